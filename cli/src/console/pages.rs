//! The pages people read: the destinations with their summary, lists (paged by the index's
//! keyset cursor), one message with every field, its history and body, and the purge
//! confirmation that counts what it would cancel. Reading only: the actions are in
//! [`super::steer`].

use std::sync::Arc;

use axum::extract::{Extension, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use minijinja::{Value, context};
use serde::{Deserialize, Serialize};

use super::search::{self, Query as Search};
use super::{App, Login, MAX_PAGE, base, notice, view};
use crate::pending::service::purge_filter;
use crate::pending_index::{
    Destination, DestinationSummary, Event, Outcome, Record, Row, State as RowState,
};

/// Body bytes a message page shows at most.
pub(super) const BODY_MAX: usize = 64 * 1024;

fn bad_request(app: &App, login: &Login, why: &str) -> Response {
    notice(
        app,
        login,
        StatusCode::BAD_REQUEST,
        "Not understood",
        why,
        None,
    )
}

fn store_failed(app: &App, login: &Login, e: &super::store::StoreError) -> Response {
    match e {
        super::store::StoreError::Invalid(m) => bad_request(app, login, m),
        super::store::StoreError::Failed(m) => notice(
            app,
            login,
            StatusCode::SERVICE_UNAVAILABLE,
            "The index cannot answer",
            m,
            None,
        ),
        super::store::StoreError::Rebuilding => notice(
            app,
            login,
            StatusCode::SERVICE_UNAVAILABLE,
            "The index is being rebuilt",
            &e.to_string(),
            None,
        ),
    }
}

/// A destination as people read it.
pub(super) fn destination_name(d: &Destination) -> String {
    match d {
        Destination::Queue(q) => q.clone(),
        Destination::Exchange {
            exchange,
            routing_key,
        } => format!("exchange {exchange} → {routing_key}"),
    }
}

/// The search that lists `d`.
fn query_of(d: &Destination, parked: bool) -> Search {
    let mut q = Search::default();
    match d {
        Destination::Queue(name) => q.queue = name.clone(),
        Destination::Exchange {
            exchange,
            routing_key,
        } => {
            q.exchange = exchange.clone();
            q.routing_key = routing_key.clone();
        }
    }
    if parked {
        q.listing = "parked".into();
    }
    q
}

/// `GET /healthz`: the process answers (no login).
pub(super) async fn healthz() -> &'static str {
    "ok\n"
}

/// Anything else.
pub(super) async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "no such page\n")
}

/// Where the destinations page starts: after the destination of this name.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct IndexQuery {
    from: String,
}

#[derive(Serialize)]
struct SummaryRow {
    name: String,
    list_query: String,
    parked_query: String,
    pending: String,
    next_due: Option<String>,
    next_due_rel: String,
    chart: String,
    lateness: Option<String>,
    runs: u64,
    parked: String,
    any_pending: bool,
    any_parked: bool,
}

fn summary_row(d: &DestinationSummary, now: u64) -> SummaryRow {
    SummaryRow {
        name: destination_name(&d.destination),
        list_query: query_of(&d.destination, false).to_query_string(),
        parked_query: query_of(&d.destination, true).to_query_string(),
        pending: view::count(d.pending),
        any_pending: d.pending > 0,
        any_parked: d.parked > 0,
        next_due: d.next_due_ms.map(view::time),
        next_due_rel: d
            .next_due_ms
            .map(|t| view::relative(t, now))
            .unwrap_or_default(),
        chart: view::due_chart(&d.due),
        lateness: d.lateness_p99_ms.map(view::duration),
        runs: d.runs,
        parked: view::count(d.parked),
    }
}

/// `GET /`: every destination the user sees, [`MAX_PAGE`] a page, with its summary.
pub(super) async fn index(
    State(app): State<Arc<App>>,
    Extension(login): Extension<Login>,
    Query(iq): Query<IndexQuery>,
) -> Response {
    let q = Search::default();
    let (shown, note) = match app.summaries.get(&login.viewer).await {
        Ok(s) => (s, "Counting what is pending…"),
        // the follower's rebuild at start: the page waits for it
        Err(super::store::StoreError::Rebuilding) => {
            (None, "The index is being rebuilt from the journal…")
        }
        Err(e) => return store_failed(&app, &login, &e),
    };
    let Some(shown) = shown else {
        let ctx = context! {
            counting => note, rows => Vec::<()>::new(), truncated => false, age => Value::from(()),
            more => Value::from(()), refresh => 2,
            ..base(&app, &login, &q, "index", "Destinations")
        };
        return app.views.page(StatusCode::OK, "index.html", ctx);
    };
    let s = &shown.summary;
    let start = if iq.from.is_empty() {
        0
    } else {
        s.destinations
            .iter()
            .position(|d| destination_name(&d.destination) > iq.from)
            .unwrap_or(s.destinations.len())
    };
    let page: Vec<SummaryRow> = s.destinations[start..]
        .iter()
        .take(MAX_PAGE)
        .map(|d| summary_row(d, s.now_ms))
        .collect();
    let more = (s.destinations.len() > start + MAX_PAGE)
        .then(|| page.last().map(|r| r.name.clone()))
        .flatten();
    let age = (shown.age.as_millis() >= 1000).then(|| view::duration(shown.age.as_millis() as u64));
    let ctx = context! {
        counting => false,
        rows => page,
        truncated => s.truncated,
        more => more.map(|m| url::form_urlencoded::Serializer::new(String::new()).append_pair("from", &m).finish()),
        age => age,
        ..base(&app, &login, &q, "index", "Destinations")
    };
    app.views.page(StatusCode::OK, "index.html", ctx)
}

/// A state as pages name it (and style it): its name in lower case, `pending`, `cancelled`...
fn state_name(s: RowState) -> String {
    format!("{s:?}").to_lowercase()
}

#[derive(Serialize)]
struct ListRow {
    id: String,
    link: String,
    owner: String,
    destination: String,
    due: String,
    due_rel: String,
    state: String,
    size: u64,
    headers: String,
}

fn message_link(id: &str, owner: &str) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("id", id)
        .append_pair("owner", owner)
        .finish()
}

fn list_row(r: &Row, now: u64) -> ListRow {
    let mut headers: Vec<String> = r
        .headers
        .iter()
        .take(3)
        .map(|(k, v)| format!("{k}={}", v.chars().take(40).collect::<String>()))
        .collect();
    if r.headers.len() > 3 {
        headers.push(format!("+{}", r.headers.len() - 3));
    }
    ListRow {
        id: r.id.clone(),
        link: message_link(&r.id, &r.owner),
        owner: r.owner.clone(),
        destination: destination_name(&r.destination),
        due: view::time(r.due_at_ms),
        due_rel: view::relative(r.due_at_ms, now),
        state: state_name(r.state),
        size: r.size,
        headers: headers.join(" "),
    }
}

/// The filters of `q`, as chips.
fn chips(q: &Search) -> Vec<String> {
    let mut v = Vec::new();
    for (name, val) in [
        ("queue", &q.queue),
        ("exchange", &q.exchange),
        ("routing key", &q.routing_key),
        ("header", &q.header),
        ("due after", &q.due_after),
        ("due before", &q.due_before),
    ] {
        if !val.is_empty() {
            v.push(format!("{name}: {val}"));
        }
    }
    v
}

/// `GET /messages`: a search by id, or one page of a filtered list.
pub(super) async fn messages(
    State(app): State<Arc<App>>,
    Extension(login): Extension<Login>,
    Query(q): Query<Search>,
) -> Response {
    if !q.id.trim().is_empty() {
        return by_id(&app, &login, &q, None).await;
    }
    list(&app, &login, q).await
}

/// `GET /message?id=..&owner=..`: one message (of that owner when given).
pub(super) async fn message(
    State(app): State<Arc<App>>,
    Extension(login): Extension<Login>,
    Query(q): Query<MessageQuery>,
) -> Response {
    let search = Search {
        id: q.id.clone(),
        ..Search::default()
    };
    let owner = (!q.owner.is_empty()).then_some(q.owner.as_str());
    by_id(&app, &login, &search, owner).await
}

/// Which message a message page shows.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct MessageQuery {
    id: String,
    owner: String,
}

async fn list(app: &App, login: &Login, q: Search) -> Response {
    let now = amqp_delay::time::now_ms();
    let filter = match q.filter(login.viewer.clone(), now) {
        Ok(f) => f,
        Err(e) => return bad_request(app, login, &e),
    };
    let limit = filter.limit;
    let page = match app.store.read(move |ix| ix.list(&filter)).await {
        Ok(p) => p,
        Err(e) => return store_failed(app, login, &e),
    };
    let parked = q.parked().unwrap_or(false);
    let rows: Vec<ListRow> = page.rows.iter().map(|r| list_row(r, now)).collect();
    let heading = if parked {
        "Parked messages"
    } else {
        "Pending messages"
    };
    let ctx = context! {
        heading => heading,
        rows => rows,
        filters => chips(&q),
        parked => parked,
        can_purge => q.destination().ok().flatten().is_some(),
        after => !q.after.is_empty(),
        limit => limit,
        first_query => q.first_page(),
        next_query => page.next.map(|c| q.next_page(&c)),
        ..base(app, login, &q, if parked { "parked" } else { "pending" }, heading)
    };
    app.views.page(StatusCode::OK, "messages.html", ctx)
}

#[derive(Serialize)]
struct Shown {
    id: String,
    owner: String,
    destination: String,
    queue: Option<String>,
    due: String,
    due_ms: u64,
    due_rel: String,
    scheduled: String,
    state: String,
    pending: bool,
    parked: bool,
    size: u64,
    content_type: String,
    headers: Vec<(String, String)>,
    history: Vec<HistoryLine>,
    body: Option<String>,
    body_text: bool,
    body_cut: bool,
}

#[derive(Serialize)]
struct HistoryLine {
    at: String,
    what: String,
}

fn history_line(e: &Event) -> HistoryLine {
    let what = match e {
        Event::Scheduled { due_at_ms, .. } => format!("scheduled, due {}", view::time(*due_at_ms)),
        Event::Rescheduled {
            by,
            from_due_at_ms,
            to_due_at_ms,
            ..
        } => format!(
            "rescheduled by {by} from {} to {}",
            view::time(*from_due_at_ms),
            view::time(*to_due_at_ms)
        ),
        Event::Cancelled { by, .. } => format!("cancelled by {by}"),
        Event::Ran {
            lateness_ms,
            outcome,
            ..
        } => {
            let how = match outcome {
                Outcome::Done => "done".to_string(),
                Outcome::Retried { next_due_at_ms } => {
                    format!("failed, retried: due again {}", view::time(*next_due_at_ms))
                }
                Outcome::Parked => "failed, parked".to_string(),
            };
            format!("ran {} late: {how}", view::duration(*lateness_ms))
        }
    };
    HistoryLine {
        at: view::time(e.at_ms()),
        what,
    }
}

fn shown(r: &Record, now: u64) -> Shown {
    let row = &r.row;
    let (body, body_text, body_cut) = match &r.body {
        Some(b) => {
            let (t, text, cut) = view::body_text(b, BODY_MAX);
            (Some(t), text, cut)
        }
        None => (None, true, false),
    };
    Shown {
        id: row.id.clone(),
        owner: row.owner.clone(),
        destination: destination_name(&row.destination),
        queue: match &row.destination {
            Destination::Queue(q) => Some(q.clone()),
            Destination::Exchange { .. } => None,
        },
        due: view::time(row.due_at_ms),
        due_ms: row.due_at_ms,
        due_rel: view::relative(row.due_at_ms, now),
        scheduled: view::time(row.scheduled_at_ms),
        state: state_name(row.state),
        pending: matches!(row.state, RowState::Pending | RowState::Unconfirmed),
        parked: row.state == RowState::Parked && matches!(row.destination, Destination::Queue(_)),
        size: row.size,
        content_type: row.content_type.clone().unwrap_or_else(|| "—".into()),
        headers: row.headers.clone(),
        history: r.history.iter().map(history_line).collect(),
        body,
        body_text,
        body_cut,
    }
}

/// The page of message `q.id` (of `owner` when given): every record the user sees by that id.
async fn by_id(app: &App, login: &Login, q: &Search, owner: Option<&str>) -> Response {
    let id = match search::message_id(&q.id) {
        Ok(id) => id.to_string(),
        Err(e) => return bad_request(app, login, &e),
    };
    let viewer = login.viewer.clone();
    let lookup = id.clone();
    let found = match app.store.read(move |ix| ix.show(&lookup, &viewer)).await {
        Ok(f) => f,
        Err(e) => return store_failed(app, login, &e),
    };
    let now = amqp_delay::time::now_ms();
    let records: Vec<Shown> = found
        .iter()
        .filter(|r| owner.is_none_or(|o| r.row.owner == o))
        .map(|r| shown(r, now))
        .collect();
    if records.is_empty() {
        let text = format!(
            "No message with id '{id}'{}.",
            if login.is_admin() { "" } else { " among yours" }
        );
        return notice(app, login, StatusCode::NOT_FOUND, "Not found", &text, None);
    }
    let ctx = context! {
        records => records,
        body_max => BODY_MAX,
        ..base(app, login, q, "message", &format!("Message {id}"))
    };
    app.views.page(StatusCode::OK, "message.html", ctx)
}

/// `GET /purge?filters`: how many pending messages the filters cover, and the button that
/// purges them. A purge names a destination, as `pending purge --queue` does.
pub(super) async fn purge_confirm(
    State(app): State<Arc<App>>,
    Extension(login): Extension<Login>,
    Query(q): Query<Search>,
) -> Response {
    let scope = match q.purge_scope(amqp_delay::time::now_ms()) {
        Ok(s) => s,
        Err(e) => return bad_request(&app, &login, &e),
    };
    // the times as absolute ones: the post purges what this page counted
    let hidden = purge_fields(&q, scope.due_after_ms, scope.due_before_ms);
    let filter = purge_filter(login.viewer.clone(), &scope);
    let count = match app.store.read(move |ix| ix.count(&filter)).await {
        Ok(n) => n,
        Err(e) => return store_failed(&app, &login, &e),
    };
    let ctx = context! {
        count => view::count(count),
        raw_count => count,
        none => count == 0,
        plural => count != 1,
        filters => chips(&q),
        hidden => hidden,
        back => q.first_page(),
        ..base(&app, &login, &q, "purge", "Purge")
    };
    app.views.page(StatusCode::OK, "confirm.html", ctx)
}

/// The fields a purge form posts back, its times absolute.
fn purge_fields(q: &Search, after: Option<u64>, before: Option<u64>) -> Vec<(String, String)> {
    let iso = |ms: u64| {
        humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
        )
        .to_string()
    };
    let mut v = Vec::new();
    for (k, val) in [
        ("queue", q.queue.clone()),
        ("exchange", q.exchange.clone()),
        ("routing_key", q.routing_key.clone()),
        ("header", q.header.clone()),
        ("due_after", after.map(iso).unwrap_or_default()),
        ("due_before", before.map(iso).unwrap_or_default()),
    ] {
        if !val.is_empty() {
            v.push((k.to_string(), val));
        }
    }
    v
}
