//! `delay-console`: one small web application to see and steer what is waiting.
//!
//! * **The index** is the console's own: the pending follower ([`crate::pending::follow`])
//!   keeps it up to date from the journal and the control stream, as `pending serve` does.
//! * **Login** is HTTP Basic with the broker's own users, the pending API's own implementation
//!   ([`crate::pending::auth`]): each login is checked by opening an AMQP connection as that
//!   user (remembered briefly), wrong passwords are throttled per user and address, and every
//!   action runs on a connection of that user, so the broker's permissions and the trust model
//!   decide what it may do. A user sees what it owns; an admin (`trust.admins`) everything.
//! * **Pages** ([`pages`]) read the index through [`store::Store`]: the destinations with
//!   their summary ([`summaries`], refreshed in the background so that a page answers fast
//!   whatever the index holds), paged lists (keyset, never OFFSET, at most [`MAX_PAGE`] rows),
//!   one message with its history and body.
//! * **Actions** ([`steer`]) are the CLI's: cancel, reschedule and purge through the pending
//!   service ([`crate::pending::service::Service`], after a confirmation page that counts for a
//!   purge), retry or drop parked messages (`amqp_delay::ops::parked`), pause and resume a
//!   recurring schedule ([`schedules`], the CLI's `recurring` code).
//!   Every POST carries a token tied to the user and an hour old at most, and must come from
//!   this console's own pages (Origin or Referer naming this host) ([`csrf`]).
//! * **HTML** comes from templates embedded at compile time and escaped by the engine
//!   ([`view`]); charts are SVG drawn on the server; no script is needed, none is loaded from
//!   elsewhere.
//! * **Bounded**: request bodies are capped ([`MAX_BODY`]), pages hold at most [`MAX_PAGE`]
//!   rows, summaries are bounded by the index ([`crate::pending_index::MAX_DESTINATIONS`]),
//!   SQLite's caches by [`Config::cache_bytes`], the login cache by
//!   [`crate::pending::auth::MAX_REMEMBERED`], the time to send a request's headers by
//!   [`crate::pending::http::listen::HEADER_READ_TIMEOUT`].

pub mod csrf;
mod pages;
mod schedules;
pub mod search;
mod steer;
pub mod store;
pub mod summaries;
pub mod tls;
pub mod view;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use amqp_delay::settings::Settings;
use amqp_delay::{Error, Result};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use minijinja::{Value, context};

use crate::pending::auth::{Gate, Logins, Style};
use crate::pending::follow::{self, FollowOptions, SharedIndex, Status};
use crate::pending::http::listen;
use crate::pending::service::Service;
use crate::pending_index::{Options, PendingIndex};

pub use crate::pending::auth::Login;

/// Rows an HTML page lists at most.
pub const MAX_PAGE: usize = 100;
/// The largest request body accepted (a form post), in bytes.
pub const MAX_BODY: usize = 16 * 1024;

/// How the console runs.
pub struct Config {
    /// `HOST:PORT` to listen on.
    pub listen: String,
    /// The pending index file.
    pub index: PathBuf,
    /// SQLite's page caches in all, in bytes (split over the console's connections).
    pub cache_bytes: u64,
    /// Serve HTTPS with this certificate and key.
    pub tls: Option<crate::tls::TlsAcceptor>,
}

/// Everything a request handler needs.
pub struct App {
    /// The deployment's settings (URL without the login's credentials, prefix, trust).
    pub settings: Settings,
    /// The pending index.
    pub store: store::Store,
    /// Summaries per viewer, refreshed in the background.
    pub summaries: summaries::Summaries,
    /// Who may log in, and how often they may fail.
    pub gate: Arc<Gate>,
    /// The pending service: the CLI's cancel, reschedule and purge.
    pub service: Service,
    /// The recurring schedules, a live book (followed from `run`'s start, or the first page).
    pub schedules: crate::schedules::Live,
    /// How far behind the follower is.
    pub status: Status,
    /// The CSRF tokens' key.
    pub csrf: csrf::Csrf,
    /// Whether the console serves HTTPS (the origin a form post must come from).
    pub https: bool,
    /// The templates.
    pub views: view::Views,
}

/// A configuration error of the console (exit 2).
pub(crate) fn config(why: String) -> Error {
    amqp_delay::settings::SettingsError::Invalid(why).into()
}

/// The console's routes on `app`.
pub fn router(app: Arc<App>) -> Router {
    let authed = Router::new()
        .route("/", get(pages::index))
        .route("/messages", get(pages::messages))
        .route("/message", get(pages::message))
        .route("/purge", get(pages::purge_confirm).post(steer::purge))
        .route("/message/cancel", post(steer::cancel))
        .route("/message/reschedule", post(steer::reschedule))
        .route("/parked/retry", post(steer::parked_retry))
        .route("/parked/drop", post(steer::parked_drop))
        .route("/schedules", get(schedules::page))
        .route("/schedules/pause", post(schedules::pause))
        .route("/schedules/resume", post(schedules::resume))
        .route_layer(axum::middleware::from_fn_with_state(
            app.gate.clone(),
            crate::pending::auth::require_login,
        ));
    Router::new()
        .merge(authed)
        .route("/static/console.css", get(view::stylesheet))
        .route("/static/favicon.svg", get(view::favicon))
        .route("/favicon.ico", get(view::favicon))
        .route("/healthz", get(pages::healthz))
        .fallback(pages::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

/// Opens the index (the follower's connection and the pages' two) and builds the application
/// of `settings`, logins checked on its broker. The caches split `config.cache_bytes`: two
/// fifths for the follower, the rest for the pages ([`store::Store::open`]).
pub fn app(settings: Settings, config: &Config) -> Result<(Arc<App>, SharedIndex)> {
    let writer = PendingIndex::open(
        &config.index,
        Options {
            cache_bytes: config.cache_bytes * 2 / 5,
            ..Options::default()
        },
    )
    .map_err(|e| config_err_index(&config.index, &e))?;
    let index: SharedIndex = Arc::new(std::sync::Mutex::new(writer));
    let store = store::Store::open(&config.index, config.cache_bytes * 3 / 5)?;
    let status = Status::new();
    let app = Arc::new(App {
        summaries: summaries::Summaries::new(store.clone()),
        store,
        gate: Arc::new(Gate::new(
            Arc::new(Logins::new(settings.clone())),
            settings.clone(),
            Style::Console,
        )),
        service: Service::new(settings.clone(), index.clone(), status.clone()),
        schedules: crate::schedules::Live::new(settings.clone()),
        status,
        csrf: csrf::Csrf::random(),
        https: config.tls.is_some(),
        views: view::Views::new(),
        settings,
    });
    Ok((app, index))
}

fn config_err_index(path: &std::path::Path, e: &dyn std::fmt::Display) -> Error {
    config(format!("the pending index {}: {e}", path.display()))
}

/// Runs the console of `settings` until `shutdown`: the follower into `config.index`, and the
/// pages on `config.listen`.
pub async fn run(
    settings: Settings,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let (app, index) = app(settings.clone(), &config)?;
    app.schedules.start();
    let options = FollowOptions {
        history: settings.journal.history.as_duration(),
        ..FollowOptions::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let status = app.status.clone();
    let follow_stop = stopped(stop_rx.clone());
    let mut follower = tokio::spawn(follow::run(settings, index, status, options, follow_stop));
    let https = config.tls.is_some();
    let served = serve(
        app,
        config,
        move |addr| tracing::info!(%addr, https, "delay-console listening"),
        stopped(stop_rx),
    );
    tokio::pin!(served, shutdown);
    let joined = |r: std::result::Result<Result<()>, tokio::task::JoinError>| {
        r.map_err(|e| Error::Stopped(format!("the pending follower: {e}")))?
    };
    tokio::select! {
        r = &mut served => {
            let _ = stop_tx.send(true);
            let followed = joined(follower.await);
            r.and(followed)
        }
        () = &mut shutdown => {
            let _ = stop_tx.send(true);
            let r = served.await;
            r.and(joined(follower.await))
        }
        f = &mut follower => {
            // the follower gave up (bad settings): the pages would never change again
            let _ = stop_tx.send(true);
            let r = served.await;
            joined(f).and(r)
        }
    }
}

/// Binds `config.listen` and serves `app` until `shutdown` completes; `bound` is told the
/// address (port 0 picks a free one).
pub async fn serve(
    app: Arc<App>,
    config: Config,
    bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .map_err(|e| config_err_listen(&config.listen, e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| config_err_listen(&config.listen, e))?;
    bound(addr);
    let routes = router(app);
    let served = match config.tls {
        Some(acceptor) => {
            let tls = tls::TlsListener::new(listener, acceptor);
            listen::serve(tls, routes, shutdown).await
        }
        None => listen::serve(listener, routes, shutdown).await,
    };
    served.map_err(|e| Error::Invalid(format!("serving the console: {e}")))
}

fn config_err_listen(listen: &str, e: std::io::Error) -> Error {
    config(format!("listening on {listen}: {e}"))
}

/// What every page's layout needs (the pages' and the actions' alike).
fn base(app: &App, login: &Login, q: &search::Query, page: &str, title: &str) -> Value {
    context! {
        user => login.user,
        admin => login.is_admin(),
        q => q,
        page => page,
        title => title,
        now => view::time(amqp_delay::time::now_ms()),
        csrf => app.csrf.token(&login.user),
        refresh => Value::from(()),
        notice => Value::from(()),
        behind => app.status.lag().describe(),
    }
}

/// A page that says what went wrong (escaped like every value), with `status`.
fn notice(
    app: &App,
    login: &Login,
    status: StatusCode,
    heading: &str,
    text: &str,
    back: Option<&str>,
) -> Response {
    let kind = if status.is_success() {
        "notice"
    } else {
        "error"
    };
    let ctx = context! {
        heading => heading,
        text => text,
        kind => kind,
        back => back,
        ..base(app, login, &search::Query::default(), "", heading)
    };
    app.views.page(status, "notice.html", ctx)
}

#[cfg(test)]
mod tests;
