//! HTTP Basic login with the broker's own users, as the pending API checks them
//! ([`crate::pending::auth::Logins`]: an AMQP connection as that user opens, remembered 60 s by
//! a salted hash, a few checks at once). No credentials or a wrong password: 401 with a
//! `WWW-Authenticate` challenge; the broker unreachable: 503. The password is never logged: a
//! [`Login`] keeps it only inside the settings that act as that user, and its `Debug` shows
//! the user alone.

use std::sync::Arc;

use amqp_delay::settings::Settings;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;

use super::App;
use crate::logline::escape_controls;
use crate::pending::auth::{Login as Credentials, Logins, Refusal};
use crate::pending::service::viewer_of;
use crate::pending_index::Viewer;

/// The realm of the challenge.
const REALM: &str = "amqp-delay console";

/// Checks a user's password: `Ok` with the settings that act as that user.
pub trait Authenticate: Send + Sync {
    /// Whether `login` logs in.
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>>;
}

impl Authenticate for Logins {
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>> {
        Box::pin(Logins::check(self, login))
    }
}

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

/// A 401 with the Basic challenge and why.
pub fn unauthorized(why: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [
            (
                header::WWW_AUTHENTICATE,
                format!("Basic realm=\"{REALM}\", charset=\"UTF-8\""),
            ),
            (header::CONTENT_TYPE, "text/plain; charset=utf-8".into()),
        ],
        format!("{why}\nLog in with a user of the broker (HTTP Basic).\n"),
    )
        .into_response()
}

/// The middleware of every page and action: a checked login, or 401 (503 when the broker
/// cannot say).
pub async fn require_login(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let Some(login) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| Credentials::from_header(v.as_bytes()))
    else {
        return unauthorized("No credentials.");
    };
    match app.logins.check(&login).await {
        Ok(as_user) => {
            let viewer = viewer_of(&app.settings, &login.user);
            req.extensions_mut().insert(Login {
                user: login.user.clone(),
                as_user: Arc::new(as_user),
                viewer,
            });
            next.run(req).await
        }
        Err(Refusal::Refused) => {
            tracing::info!(user = %escape_controls(&login.user), "console login refused");
            unauthorized(&format!(
                "The broker refused the login of '{}'.",
                escape_controls(&login.user)
            ))
        }
        Err(Refusal::Unavailable(why)) => {
            tracing::warn!(
                "console login could not be checked: {}",
                escape_controls(&why)
            );
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("The broker could not check the login: {why}\nTry again shortly.\n"),
            )
                .into_response()
        }
    }
}
