//! The actions: cancel, reschedule, purge a filtered set, retry or drop a parked message. Each
//! is a form post that must carry the user's CSRF token and come from this console's own
//! pages ([`super::csrf`]); each runs on a broker connection of the logged-in user, by the
//! same code as the CLI (the pending service's cancel, reschedule and purge; the library's
//! `parked`), so the broker's permissions and the trust model decide what it may do. What each
//! did is logged with the user (never the password) and shown.

use std::sync::Arc;

use amqp_delay::Publisher;
use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::parked;
use amqp_delay::settings::Settings;
use axum::extract::{Form, FromRequest, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::search::{self, Query as Search};
use super::{App, Login, csrf, notice};
use crate::logline::escape_controls;
use crate::pending::service::Failure;
use amqp_delay::ops::control::Reschedule;

/// A refused form post: 403 and why, as plain text.
fn forbidden(why: &str) -> Response {
    (
        StatusCode::FORBIDDEN,
        format!("Refused: {why}.\nReload the console's page and submit its form again.\n"),
    )
        .into_response()
}

/// A form that carries the user's CSRF token.
pub(super) trait Tokened {
    /// The token the page put in the form.
    fn token(&self) -> &str;
}

/// An action's form from the logged-in user, extracted only when it passed the checks every
/// action passes first ([`guard`]); else the request is refused with why (403).
pub(super) struct Checked<F> {
    login: Login,
    form: F,
}

impl<F> Checked<F> {
    /// The login and the form.
    pub(super) fn into_parts(self) -> (Login, F) {
        (self.login, self.form)
    }
}

impl<F> FromRequest<Arc<App>> for Checked<F>
where
    F: DeserializeOwned + Tokened + Send,
{
    type Rejection = Response;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, Response> {
        let login = req
            .extensions()
            .get::<Login>()
            .cloned()
            .ok_or_else(|| forbidden("not logged in"))?;
        let headers = req.headers().clone();
        let Form(form) = Form::<F>::from_request(req, app)
            .await
            .map_err(IntoResponse::into_response)?;
        if let Some(refused) = guard(app, &login, &headers, form.token()) {
            return Err(refused);
        }
        Ok(Checked { login, form })
    }
}

/// The checks every action passes first: the user's token and this console's origin.
fn guard(app: &App, login: &Login, headers: &HeaderMap, token: &str) -> Option<Response> {
    if let Err(why) = csrf::same_origin(headers, app.https) {
        return Some(forbidden(&why));
    }
    match app.csrf.check(&login.user, token) {
        Ok(()) => None,
        Err(csrf::BadToken::NotThisUsers) => Some(forbidden(
            "the form's token is missing or not this user's (a page of another login, or of \
             a console that has restarted since)",
        )),
        Err(csrf::BadToken::Expired) => Some(forbidden(
            "the form's token has expired (its page is more than an hour old)",
        )),
    }
}

/// The page after an action that failed (the request, the index or the broker said why).
fn failed(app: &App, login: &Login, what: &str, e: &Failure, back: &str) -> Response {
    let status = match e {
        Failure::Broker(b) if b.kind() == amqp_delay::ErrorKind::Refused => StatusCode::FORBIDDEN,
        Failure::Broker(b) if b.kind() != amqp_delay::ErrorKind::Usage => StatusCode::BAD_GATEWAY,
        e => StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST),
    };
    let text = format!("{what} failed: {e}");
    tracing::warn!(user = %escape_controls(&login.user), "console: {}", escape_controls(&text));
    notice(app, login, status, "Not done", &text, Some(back))
}

fn message_page(id: &str, owner: &str) -> String {
    let q = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("id", id)
        .append_pair("owner", owner)
        .finish();
    format!("/message?{q}")
}

/// The form of a message's action.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct MessageForm {
    csrf: String,
    id: String,
    owner: String,
    due_at_ms: String,
    at: String,
}

impl Tokened for MessageForm {
    fn token(&self) -> &str {
        &self.csrf
    }
}

/// `POST /message/cancel`: a tombstone of the message, as `delay-publisher cancel` writes it.
pub(super) async fn cancel(
    State(app): State<Arc<App>>,
    Checked { login, form: f }: Checked<MessageForm>,
) -> Response {
    let id = match search::message_id(&f.id) {
        Ok(id) => id.to_string(),
        Err(e) => return notice(&app, &login, StatusCode::BAD_REQUEST, "Not done", &e, None),
    };
    let owner = (!f.owner.is_empty()).then_some(f.owner.as_str());
    let back = message_page(&id, &f.owner);
    match app.service.cancel(&login.as_user, &id, owner).await {
        Ok(done) => {
            tracing::info!(user = %escape_controls(&login.user), id = %escape_controls(&id), owner = %escape_controls(&done.owner), "console: cancelled");
            let text = format!(
                "Cancelled '{id}' of {}: no worker runs it from now on (unless it was due too soon for the cancel to reach every worker in time).",
                done.owner
            );
            notice(
                &app,
                &login,
                StatusCode::OK,
                "Cancelled",
                &text,
                Some(&back),
            )
        }
        Err(e) => failed(&app, &login, "The cancel", &e, &back),
    }
}

/// `POST /message/reschedule`: moves the message (`pending reschedule`).
pub(super) async fn reschedule(
    State(app): State<Arc<App>>,
    Checked { login, form: f }: Checked<MessageForm>,
) -> Response {
    let back = message_page(&f.id, &f.owner);
    let bad = |e: &str| {
        notice(
            &app,
            &login,
            StatusCode::BAD_REQUEST,
            "Not done",
            e,
            Some(&back),
        )
    };
    let id = match search::message_id(&f.id) {
        Ok(id) => id.to_string(),
        Err(e) => return bad(&e),
    };
    let to = match search::parse_time(&f.at, amqp_delay::time::now_ms()) {
        Ok(t) => t,
        Err(e) => return bad(&e),
    };
    let r = Reschedule {
        id: id.clone(),
        owner: (!f.owner.is_empty()).then(|| f.owner.clone()),
        due_at_ms: to,
    };
    match app.service.reschedule(&login.as_user, &r).await {
        Ok(done) => {
            tracing::info!(user = %escape_controls(&login.user), id = %escape_controls(&id), due_at_ms = to, "console: rescheduled");
            let text = format!(
                "Rescheduled '{id}' from {} to {}{}.",
                super::view::time(done.from_due_at_ms),
                super::view::time(done.due_at_ms.unwrap_or(to)),
                if done.resent {
                    " (sent again now from its kept body)"
                } else {
                    ""
                }
            );
            notice(
                &app,
                &login,
                StatusCode::OK,
                "Rescheduled",
                &text,
                Some(&back),
            )
        }
        Err(e) => failed(&app, &login, "The reschedule", &e, &back),
    }
}

/// The purge form: the filters of its confirmation page and the count it showed.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct PurgeForm {
    csrf: String,
    expected: String,
    #[serde(flatten)]
    query: Search,
}

impl Tokened for PurgeForm {
    fn token(&self) -> &str {
        &self.csrf
    }
}

/// `POST /purge`: one purge record for the filtered set (`pending purge`).
pub(super) async fn purge(
    State(app): State<Arc<App>>,
    Checked { login, form: f }: Checked<PurgeForm>,
) -> Response {
    let back = format!("/messages?{}", f.query.first_page());
    let p = match f.query.purge_scope(amqp_delay::time::now_ms()) {
        Ok(p) => p,
        Err(e) => return notice(&app, &login, StatusCode::BAD_REQUEST, "Not done", &e, None),
    };
    match app.service.purge(&login.as_user, &p, false).await {
        Ok(out) => {
            tracing::info!(user = %escape_controls(&login.user), queue = %escape_controls(&p.queue), covered = out.covered, "console: purged");
            let was = f.expected.parse::<u64>().ok().filter(|n| *n != out.covered);
            let text = format!(
                "Purged {}: {} pending message{} covered{}; none of them runs.",
                p.queue,
                out.covered,
                if out.covered == 1 { "" } else { "s" },
                was.map(|n| format!(" ({n} when you confirmed)"))
                    .unwrap_or_default()
            );
            notice(&app, &login, StatusCode::OK, "Purged", &text, Some(&back))
        }
        Err(e) => failed(&app, &login, "The purge", &e, &back),
    }
}

/// The form of a parked message's action.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ParkedForm {
    csrf: String,
    id: String,
    queue: String,
    delay: String,
}

impl Tokened for ParkedForm {
    fn token(&self) -> &str {
        &self.csrf
    }
}

/// `POST /parked/retry`: sends the parked message back through the tiers (`parked retry`).
pub(super) async fn parked_retry(
    State(app): State<Arc<App>>,
    Checked { login, form: f }: Checked<ParkedForm>,
) -> Response {
    parked_action(app, login, f, true).await
}

/// `POST /parked/drop`: deletes the parked message (`parked drop`).
pub(super) async fn parked_drop(
    State(app): State<Arc<App>>,
    Checked { login, form: f }: Checked<ParkedForm>,
) -> Response {
    parked_action(app, login, f, false).await
}

async fn parked_action(app: Arc<App>, login: Login, f: ParkedForm, retry: bool) -> Response {
    let bad = |e: &str| notice(&app, &login, StatusCode::BAD_REQUEST, "Not done", e, None);
    let id = match search::message_id(&f.id) {
        Ok(id) => id.to_string(),
        Err(e) => return bad(&e),
    };
    if f.queue.is_empty() {
        return bad("a parked message's action names its queue");
    }
    let delay_ms = match f.delay.trim() {
        "" => 0,
        d => match humantime::parse_duration(d) {
            Ok(d) => d.as_millis() as u64,
            Err(e) => return bad(&format!("delay '{d}': {e}")),
        },
    };
    let back = format!(
        "/messages?{}",
        url::form_urlencoded::Serializer::new(String::new())
            .append_pair("listing", "parked")
            .append_pair("queue", &f.queue)
            .finish()
    );
    let result = parked_on_broker(&login.as_user, &f.queue, &id, retry, delay_ms).await;
    let what = if retry { "retried" } else { "dropped" };
    match result {
        Ok(c) if c.done.contains(&id) => {
            tracing::info!(user = %escape_controls(&login.user), id = %escape_controls(&id), "console: parked message {what}");
            let text = format!("'{id}' {what}.");
            notice(&app, &login, StatusCode::OK, "Done", &text, Some(&back))
        }
        Ok(c) => {
            let why =
                c.failed.first().map(|(_, w)| w.clone()).unwrap_or_else(|| {
                    format!("'{id}' is not in the parking queue of {}", f.queue)
                });
            notice(
                &app,
                &login,
                StatusCode::NOT_FOUND,
                "Not done",
                &why,
                Some(&back),
            )
        }
        Err(e) => {
            let e = Failure::Broker(e);
            failed(&app, &login, &format!("The {what} action"), &e, &back)
        }
    }
}

async fn parked_on_broker(
    settings: &Settings,
    queue: &str,
    id: &str,
    retry: bool,
    delay_ms: u64,
) -> amqp_delay::Result<parked::Changed> {
    let layout = settings.layout()?;
    let conn = Connector::new(settings)?
        .connect("amqp-delay console parked")
        .await?;
    let ids = [id.to_string()];
    let r = if retry {
        match Publisher::connect(settings).await {
            Ok(p) => {
                let r = parked::retry(&conn, &layout, &p, Some(queue), &ids, delay_ms).await;
                p.close().await;
                r
            }
            Err(e) => Err(e),
        }
    } else {
        parked::drop(&conn, &layout, Some(queue), &ids).await
    };
    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    r
}
