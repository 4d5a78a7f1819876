//! HTTP Basic login with the broker's own users: a login counts when an AMQP connection as
//! that user opens (then it is closed at once). A successful check is remembered for
//! [`CACHE_TTL`] as a keyed hash of the password (never the password), at most [`MAX_CACHED`]
//! users; at most [`CONCURRENT_CHECKS`] checks run at once, so a flood of wrong passwords
//! costs the broker a few connections at a time. No credentials or a wrong password: 401 with
//! a `WWW-Authenticate` challenge; the broker unreachable: 503. The password is never logged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::connection::{Connector, split_urls};
use amqp_delay::settings::Settings;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures::future::BoxFuture;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{App, Login};
use crate::logline::escape_controls;
use crate::pending_index::Viewer;

/// How long a checked login is believed without asking the broker again.
pub const CACHE_TTL: Duration = Duration::from_secs(60);
/// Users whose login is remembered at most (past it the cache is emptied).
pub const MAX_CACHED: usize = 10_000;
/// Logins checked on the broker at once.
pub const CONCURRENT_CHECKS: usize = 4;
/// The realm of the challenge.
const REALM: &str = "amqp-delay console";

/// A password held for the request: its `Debug` shows nothing.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// Wraps a password.
    pub fn new(s: String) -> Secret {
        Secret(s)
    }

    /// The password itself, for the broker connection of that user.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why a login was refused.
#[derive(Debug)]
pub enum Denied {
    /// The user or password is wrong (or the user may not use the virtual host): 401.
    Wrong(String),
    /// The broker could not say (unreachable, timed out): 503.
    Unavailable(String),
}

/// Checks a user's password.
pub trait Authenticate: Send + Sync {
    /// `Ok` when `user` logs in with `password`.
    fn check<'a>(&'a self, user: &'a str, password: &'a str) -> BoxFuture<'a, Result<(), Denied>>;
}

/// `user:password` of an `Authorization: Basic` header; `None` when absent or malformed.
pub fn basic_credentials(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, b64) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (user, password) = text.split_once(':')?;
    if user.is_empty() {
        return None;
    }
    Some((user.to_string(), password.to_string()))
}

/// `urls` (comma-separated) with every URL's credentials replaced by `user` and `password`.
pub fn urls_as(urls: &str, user: &str, password: &str) -> Result<String, String> {
    let mut out = Vec::new();
    for u in split_urls(urls) {
        let mut parsed = url::Url::parse(&u).map_err(|e| format!("the broker URL: {e}"))?;
        parsed
            .set_username(user)
            .and_then(|()| parsed.set_password(Some(password)))
            .map_err(|()| "the broker URL cannot carry credentials".to_string())?;
        out.push(parsed.to_string());
    }
    Ok(out.join(","))
}

/// `settings` acting as `login`: its URLs carry the login's credentials.
pub fn settings_as(settings: &Settings, login: &Login) -> Result<Settings, String> {
    let mut s = settings.clone();
    s.url = urls_as(&settings.url, &login.user, login.password.expose())?;
    Ok(s)
}

/// Logins checked on the broker of the settings.
pub struct BrokerLogins {
    settings: Settings,
    key: [u8; 32],
    cache: Mutex<HashMap<String, ([u8; 32], Instant)>>,
    gate: tokio::sync::Semaphore,
}

impl BrokerLogins {
    /// Logins on the broker of `settings` (its URLs and TLS files; its own credentials unused).
    pub fn new(settings: &Settings) -> amqp_delay::Result<BrokerLogins> {
        Connector::new(settings)?;
        Ok(BrokerLogins {
            settings: settings.clone(),
            key: rand::random(),
            cache: Mutex::new(HashMap::new()),
            gate: tokio::sync::Semaphore::new(CONCURRENT_CHECKS),
        })
    }

    fn digest(&self, user: &str, password: &str) -> [u8; 32] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(user.as_bytes());
        mac.update(&[0]);
        mac.update(password.as_bytes());
        mac.finalize().into_bytes().into()
    }

    fn cached(&self, user: &str, digest: &[u8; 32]) -> bool {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .get(user)
            .is_some_and(|(d, at)| d == digest && at.elapsed() < CACHE_TTL)
    }

    fn remember(&self, user: &str, digest: [u8; 32]) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(user.to_string(), (digest, Instant::now()));
    }

    async fn ask_broker(&self, user: &str, password: &str) -> Result<(), Denied> {
        let urls = urls_as(&self.settings.url, user, password).map_err(Denied::Unavailable)?;
        let connector = Connector::with_tls(&urls, &self.settings.tls)
            .map_err(|e| Denied::Unavailable(amqp_delay::error_chain(&e)))?;
        match connector.connect("amqp-delay console login").await {
            Ok(conn) => {
                amqp_delay::broker::close_connection(&conn, "login checked").await;
                Ok(())
            }
            Err(e) => {
                let why = amqp_delay::error_chain(&e);
                if refused(&why) {
                    Err(Denied::Wrong(format!(
                        "the broker refused the login of '{user}'"
                    )))
                } else {
                    Err(Denied::Unavailable(why))
                }
            }
        }
    }
}

/// Whether a connection error is the broker refusing the login (rather than not answering).
fn refused(why: &str) -> bool {
    [
        "ACCESS_REFUSED",
        "NOT_ALLOWED",
        "access to vhost",
        "authentication",
        "Login was refused",
    ]
    .iter()
    .any(|w| why.contains(w))
}

impl Authenticate for BrokerLogins {
    fn check<'a>(&'a self, user: &'a str, password: &'a str) -> BoxFuture<'a, Result<(), Denied>> {
        Box::pin(async move {
            let digest = self.digest(user, password);
            if self.cached(user, &digest) {
                return Ok(());
            }
            let _permit = self
                .gate
                .acquire()
                .await
                .map_err(|_| Denied::Unavailable("the console is stopping".into()))?;
            if self.cached(user, &digest) {
                return Ok(());
            }
            self.ask_broker(user, password).await?;
            self.remember(user, digest);
            Ok(())
        })
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
    let Some((user, password)) = basic_credentials(req.headers()) else {
        return unauthorized("No credentials.");
    };
    match app.logins.check(&user, &password).await {
        Ok(()) => {
            let viewer = if app.settings.trust.admins.iter().any(|a| a == &user) {
                Viewer::Admin
            } else {
                Viewer::User(user.clone())
            };
            req.extensions_mut().insert(Login {
                user,
                password: Secret::new(password),
                viewer,
            });
            next.run(req).await
        }
        Err(Denied::Wrong(why)) => {
            tracing::info!(user = %escape_controls(&user), "console login refused");
            unauthorized(&format!("{why}."))
        }
        Err(Denied::Unavailable(why)) => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn basic_credentials_are_read_and_malformed_ones_refused() {
        // guest:gu:est — a colon in the password belongs to it
        let ok = with_auth("Basic Z3Vlc3Q6Z3U6ZXN0");
        assert_eq!(
            basic_credentials(&ok),
            Some(("guest".into(), "gu:est".into()))
        );
        assert_eq!(
            basic_credentials(&with_auth("basic  Z3Vlc3Q6Z3Vlc3Q=")),
            Some(("guest".into(), "guest".into()))
        );
        for bad in [
            "Bearer abc",
            "Basic !!!",
            "Basic Z3Vlc3Q=", // no colon
            "Basic Omd1ZXN0", // empty user
            "Basic",
            "Basic //79", // not UTF-8
        ] {
            assert_eq!(basic_credentials(&with_auth(bad)), None, "{bad}");
        }
        assert_eq!(basic_credentials(&HeaderMap::new()), None);
    }

    #[test]
    fn urls_carry_the_logins_credentials_escaped() {
        let u = urls_as(
            "amqp://guest:guest@a:5672/%2f,amqps://b/%2f",
            "ann@x",
            "p:w/d",
        )
        .unwrap();
        assert_eq!(
            u,
            "amqp://ann%40x:p%3Aw%2Fd@a:5672/%2f,amqps://ann%40x:p%3Aw%2Fd@b/%2f"
        );
    }

    #[test]
    fn a_secret_never_prints() {
        let s = Secret::new("hunter2".into());
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn a_refused_login_is_told_from_a_broker_that_does_not_answer() {
        assert!(refused(
            "connecting to amqp://a@h: ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN"
        ));
        assert!(!refused(
            "connecting to amqp://h: Connection refused (os error 111)"
        ));
    }
}
