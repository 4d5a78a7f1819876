//! `pending serve`: the follower and a JSON HTTP API over its index, under `/api/v1/`.
//!
//! | method and path | what |
//! |---|---|
//! | `GET /api/v1/pending?queue=&due_after=&due_before=&header=K=V&limit=&after=` | one page |
//! | `GET /api/v1/pending/{id}?owner=` | one message (per owner, for an admin) with its history |
//! | `POST /api/v1/pending/purge` | `{"queue", "owner"?, "due_after"?, "due_before"?, "header"?, "dry_run"?}`: how many it covers |
//! | `POST /api/v1/pending/{id}/reschedule` | `{"delay": "10m"}` or `{"at": "2026-12-24T18:00:00Z"}`, `"owner"?` |
//! | `POST /api/v1/pending/{id}/cancel` | `{"owner"?}` (or no body) |
//! | `GET /api/v1/status` | how far behind the index is |
//! | `/api/v1/schedules...` | recurring schedules: list, show, add, pause, resume, remove, run-now, purge ([`schedules`]), from one live book |
//! | `GET /healthz`, `GET /readyz` | alive; following the streams (no login) |
//!
//! Every `/api/v1/` request logs in with HTTP Basic as a broker user ([`super::auth`], as the
//! console's pages do); it sees what that user sees and steers with that user's own broker
//! rights. No or a wrong login: 401 with `WWW-Authenticate`; too many wrong ones: 429 with
//! `Retry-After`. Bodies are bounded ([`MAX_BODY`]), pages too ([`super::service::MAX_PAGE`]),
//! and so is the time a client takes to send its headers ([`listen`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use amqp_delay::settings::Settings;
use amqp_delay::time::{now_ms, parse_duration_ms};
use amqp_delay::{Error, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path as UrlPath, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use super::auth::{Authenticate, Gate, Login, Logins, Style, require_login};
use super::follow::{self, FollowOptions, Status};
use super::service::{Failure, Query, Service};
use super::when::parse_time;
use super::wire::{ErrorOut, StatusOut};
use crate::pending_index::{Options, PendingIndex};
use crate::schedules::Live;
use amqp_delay::ops::control::{PurgeScope, Reschedule};

pub mod listen;
mod schedules;

/// The largest request body taken.
pub const MAX_BODY: usize = 64 << 10;

/// The API's state: the service, the live schedules and the logins.
pub struct Api {
    service: Service,
    schedules: Live,
    gate: Arc<Gate>,
}

impl Api {
    /// An API over `service`, checking logins against `settings`' broker.
    pub fn new(service: Service, settings: Settings) -> Api {
        Api::with_logins(service, settings.clone(), Arc::new(Logins::new(settings)))
    }

    /// An API over `service` whose logins `logins` checks.
    pub fn with_logins(service: Service, settings: Settings, logins: Arc<dyn Authenticate>) -> Api {
        Api {
            service,
            schedules: Live::new(settings.clone()),
            gate: Arc::new(Gate::new(logins, settings, Style::Api)),
        }
    }

    /// The schedules it answers from, followed from the first question on (or from
    /// [`serve`]'s start).
    pub fn schedules(&self) -> &Live {
        &self.schedules
    }
}

/// The routes.
pub fn router(api: Arc<Api>) -> Router {
    schedules::routes(Router::new())
        .route("/api/v1/pending", get(list))
        .route("/api/v1/pending/purge", post(purge))
        .route("/api/v1/pending/{id}", get(show))
        .route("/api/v1/pending/{id}/reschedule", post(reschedule))
        .route("/api/v1/pending/{id}/cancel", post(cancel))
        .route("/api/v1/status", get(status))
        .route_layer(axum::middleware::from_fn_with_state(
            api.gate.clone(),
            require_login,
        ))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(api)
}

/// Runs the follower over the index file at `index_path` and serves the API on `listen` until
/// `shutdown`.
pub async fn serve(
    settings: Settings,
    listen: &str,
    index_path: &Path,
    options: FollowOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let addr: SocketAddr = listen
        .parse()
        .map_err(|e| Error::Invalid(format!("--listen '{listen}': {e} (use HOST:PORT)")))?;
    let ix = PendingIndex::open(index_path, Options::default()).map_err(follow::index_error)?;
    let index = Arc::new(Mutex::new(ix));
    let status = Status::new();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Invalid(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::Invalid(format!("listener: {e}")))?;
    let service = Service::new(settings.clone(), index.clone(), status.clone());
    let api = Arc::new(Api::new(service, settings.clone()));
    api.schedules.start();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop_follow = stop_rx.clone();
    let follower = tokio::spawn(follow::run(settings, index, status, options, async move {
        let _ = stop_follow.wait_for(|s| *s).await;
    }));
    tracing::info!(%bound, index = %index_path.display(), "serving the pending API");
    let mut stop_http = stop_rx;
    let server = listen::serve(listener, router(api), async move {
        let _ = stop_http.wait_for(|s| *s).await;
    });
    let server = tokio::spawn(server);
    tokio::pin!(follower);
    let followed = tokio::select! {
        () = shutdown => None,
        r = &mut follower => Some(r),
    };
    let _ = stop_tx.send(true);
    let _ = server.await;
    let r = match followed {
        Some(r) => r,
        None => follower.await,
    };
    r.map_err(|e| Error::Stopped(format!("the follower failed: {e}")))?
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(body) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn error(status: u16, why: impl Into<String>) -> Response {
    let s = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(s, &ErrorOut { error: why.into() })
}

fn failed(f: &Failure) -> Response {
    error(f.http_status(), f.to_string())
}

/// The pairs of a query string, each name at most once, names from `known` only.
fn params(raw: Option<&str>, known: &[&str]) -> std::result::Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        if !known.contains(&k.as_ref()) {
            return Err(format!(
                "unknown parameter '{k}': known are {}",
                known.join(", ")
            ));
        }
        if out.iter().any(|(n, _)| *n == k) {
            return Err(format!("parameter '{k}' is given twice"));
        }
        out.push((k.into_owned(), v.into_owned()));
    }
    Ok(out)
}

/// `K=V` as a header filter.
pub fn header_filter(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("header filter '{s}' is not NAME=VALUE")),
    }
}

fn query_of(pairs: Vec<(String, String)>) -> std::result::Result<Query, String> {
    let now = now_ms();
    let mut q = Query::default();
    for (k, v) in pairs {
        match k.as_str() {
            "queue" => q.queue = Some(v),
            "due_after" => q.due_after_ms = Some(parse_time(&v, now)?),
            "due_before" => q.due_before_ms = Some(parse_time(&v, now)?),
            "header" => q.header = Some(header_filter(&v)?),
            "limit" => {
                q.limit = Some(
                    v.parse()
                        .map_err(|_| format!("limit '{v}' is not a number"))?,
                )
            }
            "after" => q.after = Some(v),
            _ => {}
        }
    }
    Ok(q)
}

async fn list(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    RawQuery(raw): RawQuery,
) -> Response {
    let known = [
        "queue",
        "due_after",
        "due_before",
        "header",
        "limit",
        "after",
    ];
    let q = match params(raw.as_deref(), &known).and_then(query_of) {
        Ok(q) => q,
        Err(why) => return error(400, why),
    };
    match api.service.list(login.viewer, &q).await {
        Ok(page) => json(StatusCode::OK, &page),
        Err(f) => failed(&f),
    }
}

async fn show(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    UrlPath(id): UrlPath<String>,
    RawQuery(raw): RawQuery,
) -> Response {
    let owner = match params(raw.as_deref(), &["owner"]) {
        Ok(p) => p.into_iter().next().map(|(_, v)| v),
        Err(why) => return error(400, why),
    };
    match api.service.show(login.viewer, &id, owner.as_deref()).await {
        Ok(s) => json(StatusCode::OK, &s),
        Err(f) => failed(&f),
    }
}

/// A time in a JSON body: ms since the epoch, or text as [`parse_time`] reads it.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TimeArg {
    Ms(u64),
    Text(String),
}

impl TimeArg {
    fn ms(&self, now: u64) -> std::result::Result<u64, String> {
        match self {
            TimeArg::Ms(v) => Ok(*v),
            TimeArg::Text(t) => parse_time(t, now),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgeBody {
    queue: String,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    due_after: Option<TimeArg>,
    #[serde(default)]
    due_before: Option<TimeArg>,
    #[serde(default)]
    header: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RescheduleBody {
    #[serde(default)]
    delay: Option<TimeArg>,
    #[serde(default)]
    at: Option<TimeArg>,
    #[serde(default)]
    owner: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    #[serde(default)]
    owner: Option<String>,
}

fn body_of<T: serde::de::DeserializeOwned + Default>(b: &[u8]) -> std::result::Result<T, String> {
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(b).map_err(|e| format!("the JSON body: {e}"))
}

/// The purge a JSON body asks, parsed once.
fn purge_scope(b: PurgeBody) -> std::result::Result<PurgeScope, String> {
    let now = now_ms();
    if b.queue.is_empty() {
        return Err("a purge names its destination queue: \"queue\"".into());
    }
    let scope = PurgeScope {
        queue: b.queue,
        owner: b.owner,
        due_after_ms: b.due_after.map(|t| t.ms(now)).transpose()?,
        due_before_ms: b.due_before.map(|t| t.ms(now)).transpose()?,
        header: b.header.as_deref().map(header_filter).transpose()?,
    };
    scope.check()?;
    Ok(scope)
}

async fn purge(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    body: Bytes,
) -> Response {
    let b: PurgeBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(400, format!("the JSON body: {e}")),
    };
    let dry_run = b.dry_run;
    let scope = match purge_scope(b) {
        Ok(s) => s,
        Err(why) => return error(400, why),
    };
    match api.service.purge(&login.as_user, &scope, dry_run).await {
        Ok(out) => json(StatusCode::OK, &out),
        Err(f) => failed(&f),
    }
}

/// The reschedule a JSON body asks for message `id`, parsed once: a `delay` is from now.
fn reschedule_of(id: String, b: RescheduleBody) -> std::result::Result<Reschedule, String> {
    let now = now_ms();
    let due_at_ms = match (&b.delay, &b.at) {
        (Some(TimeArg::Ms(d)), None) => now.saturating_add(*d),
        (Some(TimeArg::Text(d)), None) => {
            now.saturating_add(parse_duration_ms(d).map_err(|e| format!("delay: {e}"))?)
        }
        (None, Some(at)) => at.ms(now)?,
        _ => return Err("give one of \"delay\" (10m, 1500) and \"at\" (a time)".into()),
    };
    let r = Reschedule {
        id,
        owner: b.owner,
        due_at_ms,
    };
    r.check()?;
    Ok(r)
}

async fn reschedule(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> Response {
    let b: RescheduleBody = match body_of(&body) {
        Ok(b) => b,
        Err(why) => return error(400, why),
    };
    let r = match reschedule_of(id, b) {
        Ok(r) => r,
        Err(why) => return error(400, why),
    };
    match api.service.reschedule(&login.as_user, &r).await {
        Ok(out) => json(StatusCode::OK, &out),
        Err(f) => failed(&f),
    }
}

async fn cancel(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> Response {
    let b: CancelBody = match body_of(&body) {
        Ok(b) => b,
        Err(why) => return error(400, why),
    };
    match api
        .service
        .cancel(&login.as_user, &id, b.owner.as_deref())
        .await
    {
        Ok(out) => json(StatusCode::OK, &out),
        Err(f) => failed(&f),
    }
}

async fn status(State(api): State<Arc<Api>>) -> Response {
    json(
        StatusCode::OK,
        &StatusOut {
            lag: api.service.status().lag(),
        },
    )
}

async fn readyz(State(api): State<Arc<Api>>) -> Response {
    match api.service.status().lag().error {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not following the journal\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests;
