//! The Schedules page: the recurring schedules the logged-in user sees (its own; an admin's:
//! everyone's), a page of at most [`MAX_PAGE`] in owner and name order (`?after=OWNER/NAME`,
//! the cursor its "Next" link carries; `limit`), each with its next ticks, its last runs as the
//! index knows them, and a pause or resume button. Read from the console's live book ([`crate::schedules::Live`]) and
//! steered through [`crate::schedules`], the code the CLI's `recurring` commands and `pending
//! serve`'s API run, on a connection of the logged-in user.

use std::sync::Arc;

use amqp_delay::recurring::Action;
use amqp_delay::time::now_ms;
use axum::extract::{Extension, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use minijinja::context;
use serde::{Deserialize, Serialize};

use super::search::Query as Search;
use super::steer::{Checked, Tokened};
use super::{App, Login, MAX_PAGE, base, notice, view};
use crate::logline::escape_controls;
use crate::pending::wire::state_name;
use crate::pending_index::Viewer;
use crate::schedules;

/// Ticks a row shows ahead and behind.
const TICKS: usize = 3;

/// One tick as a row shows it.
#[derive(Debug, Serialize)]
struct Tick {
    at: String,
    id: String,
    /// Its message page.
    href: String,
    /// What the index says of its occurrence (`None`: not in the index).
    state: Option<&'static str>,
}

/// One schedule as a row shows it.
#[derive(Debug, Serialize)]
struct Row {
    owner: String,
    name: String,
    cron: String,
    tz: String,
    queue: String,
    paused: bool,
    next: Vec<String>,
    last: Vec<Tick>,
    list_query: String,
}

/// The Schedules page's query: where the page starts and how many it shows.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct PageQuery {
    after: Option<String>,
    limit: Option<usize>,
}

/// `GET /schedules`.
pub(super) async fn page(
    State(app): State<Arc<App>>,
    Extension(login): Extension<Login>,
    Query(q): Query<PageQuery>,
) -> Response {
    let shown = match schedules::Page::parse(q.after.as_deref(), Some(q.limit.unwrap_or(MAX_PAGE)))
    {
        Ok(p) if p.limit <= MAX_PAGE => p,
        Ok(p) => {
            return bad_page(
                &app,
                &login,
                &format!("a page shows 1 to {MAX_PAGE}, not {}", p.limit),
            );
        }
        Err(e) => return bad_page(&app, &login, &amqp_delay::error_chain(&e)),
    };
    let v = match app.schedules.view(&login.user).await {
        Ok(v) => v,
        Err(e) => {
            let text = format!(
                "The schedules cannot be read: {}",
                amqp_delay::error_chain(&e)
            );
            return notice(
                &app,
                &login,
                StatusCode::BAD_GATEWAY,
                "Not read",
                &text,
                None,
            );
        }
    };
    let (now, mut crons) = (now_ms(), schedules::Crons::default());
    let total = v.visible().count();
    let mut rows: Vec<Row> = Vec::new();
    let mut ids: Vec<(String, String)> = Vec::new();
    let after = (shown.after.as_ref()).map(|(o, n)| (o.as_str(), n.as_str()));
    let (entries, more) = v.book.page(&v.user, &v.trust, after, shown.limit);
    let next = (more.then(|| entries.last()).flatten()).map(|e| {
        url::form_urlencoded::Serializer::new(String::new())
            .append_pair("after", &schedules::Page::cursor(e))
            .append_pair("limit", &shown.limit.to_string())
            .finish()
    });
    for e in entries {
        let last: Vec<Tick> = schedules::last_ticks(e, now, TICKS)
            .into_iter()
            .map(|t| {
                let id = amqp_delay::recurring::occurrence_id(&e.def.name, t);
                let q = url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("id", &id)
                    .append_pair("owner", &e.owner)
                    .finish();
                Tick {
                    at: view::time(t),
                    href: format!("/message?{q}"),
                    id,
                    state: None,
                }
            })
            .collect();
        ids.extend(last.iter().map(|t| (e.owner.clone(), t.id.clone())));
        let list_query = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("queue", &e.def.queue)
            .append_pair(
                "header",
                &format!("{}={}", amqp_delay::headers::RECURRING, e.def.name),
            )
            .finish();
        rows.push(Row {
            owner: e.owner.clone(),
            name: e.def.name.clone(),
            cron: e.def.cron.clone(),
            tz: e.def.tz.clone(),
            queue: e.def.queue.clone(),
            paused: e.paused,
            next: schedules::next_ticks_with(e, now, TICKS, &mut crons)
                .into_iter()
                .map(view::time)
                .collect(),
            last,
            list_query,
        });
    }
    drop(v);
    // the last runs' states, each as its owner's message, in one read of the index
    let states = app
        .store
        .read(move |ix| {
            let mut out = Vec::with_capacity(ids.len());
            for (owner, id) in ids {
                let found = ix.show(&id, &Viewer::User(owner))?;
                out.push(found.first().map(|r| state_name(r.row.state)));
            }
            Ok(out)
        })
        .await
        .unwrap_or_default();
    let mut states = states.into_iter();
    for t in rows.iter_mut().flat_map(|r| r.last.iter_mut()) {
        t.state = states.next().flatten();
    }
    let ctx = context! {
        rows => rows,
        total => total,
        next => next,
        ..base(&app, &login, &Search::default(), "schedules", "Schedules")
    };
    app.views.page(StatusCode::OK, "schedules.html", ctx)
}

/// A 400 for a page the query cannot name.
fn bad_page(app: &App, login: &Login, why: &str) -> Response {
    let text = format!("No such page of schedules: {why}");
    notice(app, login, StatusCode::BAD_REQUEST, "Bad page", &text, None)
}

/// The form of a schedule's pause or resume.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ScheduleForm {
    csrf: String,
    name: String,
    owner: String,
}

impl Tokened for ScheduleForm {
    fn token(&self) -> &str {
        &self.csrf
    }
}

/// `POST /schedules/pause`.
pub(super) async fn pause(State(app): State<Arc<App>>, checked: Checked<ScheduleForm>) -> Response {
    set(&app, checked, Action::Pause).await
}

/// `POST /schedules/resume`.
pub(super) async fn resume(
    State(app): State<Arc<App>>,
    checked: Checked<ScheduleForm>,
) -> Response {
    set(&app, checked, Action::Resume).await
}

async fn set(app: &App, checked: Checked<ScheduleForm>, action: Action) -> Response {
    let (login, f) = checked.into_parts();
    let owner = (!f.owner.is_empty()).then_some(f.owner.as_str());
    let done = if action == Action::Pause {
        "Paused"
    } else {
        "Resumed"
    };
    let books = schedules::Books::Live(&app.schedules, &login.user);
    match schedules::set(&login.as_user, books, &f.name, owner, action).await {
        Ok(e) => {
            tracing::info!(user = %escape_controls(&login.user), schedule = %escape_controls(&e.def.name), owner = %escape_controls(&e.owner), "console: {}", done.to_lowercase());
            let text = match action {
                Action::Pause => format!(
                    "Paused '{}' of {}: no more occurrences until resumed (those already scheduled stay).",
                    e.def.name, e.owner
                ),
                _ => format!(
                    "Resumed '{}' of {}: occurrences again from the next tick on.",
                    e.def.name, e.owner
                ),
            };
            notice(app, &login, StatusCode::OK, done, &text, Some("/schedules"))
        }
        Err(e) => {
            let status = match e.kind() {
                amqp_delay::ErrorKind::Usage => StatusCode::BAD_REQUEST,
                amqp_delay::ErrorKind::Refused => StatusCode::FORBIDDEN,
                _ => StatusCode::BAD_GATEWAY,
            };
            let text = format!(
                "The {} failed: {}",
                done.to_lowercase(),
                amqp_delay::error_chain(&e)
            );
            tracing::warn!(user = %escape_controls(&login.user), "console: {}", escape_controls(&text));
            notice(app, &login, status, "Not done", &text, Some("/schedules"))
        }
    }
}
