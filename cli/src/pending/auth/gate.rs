//! The login every request of `pending serve`'s API and of `delay-console`'s pages passes
//! ([`require_login`], an axum middleware): a checked login put on the request as [`Login`],
//! or a refusal answered in the server's own [`Style`]: 401 with a Basic challenge (no or a
//! wrong login, or a name that cannot be one), 429 with `Retry-After` (too many wrong
//! passwords for the user or from the address: [`super::throttle`]), 503 (the broker cannot
//! say). Refusals are logged with the user (escaped), never the password.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::settings::Settings;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::throttle::Throttle;
use super::{Authenticate, Credentials, Refusal};
use crate::logline::escape_controls;
use crate::pending::service::viewer_of;
use crate::pending_index::Viewer;

/// A logged-in user, as [`require_login`] puts it on each request.
#[derive(Clone)]
pub struct Login {
    /// The user name.
    pub user: String,
    /// The deployment's settings acting as this user (its URLs carry the password).
    pub as_user: Arc<Settings>,
    /// What it sees.
    pub viewer: Viewer,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("user", &self.user)
            .field("viewer", &self.viewer)
            .finish_non_exhaustive()
    }
}

impl Login {
    /// Whether the user is an admin (sees and steers everything).
    pub fn is_admin(&self) -> bool {
        self.viewer == Viewer::Admin
    }
}

/// How a server answers a refused login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// `pending serve`'s API: JSON `{"error": ...}`.
    Api,
    /// `delay-console`'s pages: plain text.
    Console,
}

impl Style {
    fn realm(self) -> &'static str {
        match self {
            Style::Api => "amqp-delay pending",
            Style::Console => "amqp-delay console",
        }
    }
}

/// Why a request was not let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// No `Authorization` header (401).
    NoCredentials,
    /// No usable Basic login: why (401).
    Unusable(String),
    /// The broker refused the user or password (401).
    Refused(String),
    /// Too many wrong passwords for the user or from the address: try again after this (429).
    Throttled(Duration),
    /// The broker could not be asked: why (503).
    Unavailable(String),
}

/// Who may log in, and how often they may fail.
pub struct Gate {
    logins: Arc<dyn Authenticate>,
    throttle: Mutex<Throttle>,
    settings: Settings,
    style: Style,
}

impl Gate {
    /// Logins checked by `logins`, admins those of `settings`, refusals answered in `style`.
    pub fn new(logins: Arc<dyn Authenticate>, settings: Settings, style: Style) -> Gate {
        Gate {
            logins,
            throttle: Mutex::new(Throttle::default()),
            settings,
            style,
        }
    }

    fn throttle(&self) -> std::sync::MutexGuard<'_, Throttle> {
        self.throttle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The login of a request with `headers` from `peer`, checked.
    pub async fn admit(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Login, Denied> {
        let login = Credentials::from_headers(headers)
            .map_err(Denied::Unusable)?
            .ok_or(Denied::NoCredentials)?;
        if !self.logins.knows(&login)
            && let Some(wait) = self.throttle().blocked(&login.user, peer, Instant::now())
        {
            return Err(Denied::Throttled(wait));
        }
        match self.logins.check(&login).await {
            Ok(as_user) => {
                self.throttle().succeeded(&login.user);
                Ok(Login {
                    viewer: viewer_of(&self.settings, &login.user),
                    user: login.user,
                    as_user: Arc::new(as_user),
                })
            }
            Err(Refusal::Refused) => {
                self.throttle().failed(&login.user, peer, Instant::now());
                Err(Denied::Refused(login.user))
            }
            Err(Refusal::Unavailable(why)) => Err(Denied::Unavailable(why)),
        }
    }

    /// The answer to a refused request, logged.
    pub fn deny(&self, d: &Denied, peer: Option<IpAddr>) -> Response {
        let peer = peer.map(|p| p.to_string()).unwrap_or_default();
        let (status, why) = match d {
            Denied::NoCredentials => (401, "No credentials.".to_string()),
            Denied::Unusable(why) => (401, format!("{}.", escape_controls(why))),
            Denied::Refused(user) => {
                let user = escape_controls(user);
                tracing::info!(%user, %peer, "login refused");
                (401, format!("The broker refused the login of '{user}'."))
            }
            Denied::Throttled(wait) => {
                tracing::info!(%peer, "login throttled");
                let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                let why = format!(
                    "Too many wrong passwords for this user or from this address: try again \
                     in {secs} s."
                );
                let mut r = self.answer(429, &why);
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
                return r;
            }
            Denied::Unavailable(why) => {
                let why = escape_controls(why);
                tracing::warn!("a login could not be checked: {why}");
                let why =
                    format!("The broker could not check the login: {why}. Try again shortly.");
                return self.answer(503, &why);
            }
        };
        let mut r = self.answer(status, &why);
        let challenge = format!("Basic realm=\"{}\", charset=\"UTF-8\"", self.style.realm());
        if let Ok(v) = HeaderValue::from_str(&challenge) {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, v);
        }
        r
    }

    fn answer(&self, status: u16, why: &str) -> Response {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::UNAUTHORIZED);
        match self.style {
            Style::Api => (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::json!({ "error": why }).to_string(),
            )
                .into_response(),
            Style::Console => {
                let hint = if status == StatusCode::UNAUTHORIZED {
                    "\nLog in with a user of the broker (HTTP Basic).\n"
                } else {
                    "\n"
                };
                (
                    status,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    format!("{why}{hint}"),
                )
                    .into_response()
            }
        }
    }
}

/// The middleware of every page and API call: a checked login on the request, or the refusal.
pub async fn require_login(
    State(gate): State<Arc<Gate>>,
    mut req: Request,
    next: Next,
) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    match gate.admit(req.headers(), peer).await {
        Ok(login) => {
            req.extensions_mut().insert(login);
            next.run(req).await
        }
        Err(d) => gate.deny(&d, peer),
    }
}
