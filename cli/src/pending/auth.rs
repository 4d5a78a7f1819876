//! HTTP logins checked by the broker, the one implementation `pending serve` and
//! `delay-console` share: an HTTP Basic user and password count when an AMQP connection as
//! that user to the configured broker opens.
//!
//! * **Credentials** ([`Credentials::from_headers`]) are read by the `headers` crate and taken
//!   as sent, once: a user name that is empty, too long, holds a control character or a `%XX`
//!   escape is refused (it would name another user in a broker URL), and the name goes into
//!   the URL fully escaped ([`settings_as`]), so the broker checks, and the index lists and
//!   steers, one and the same name.
//! * **Checks** ([`Logins`]): a successful one is remembered for [`REMEMBER`], keyed by a
//!   salted SHA-256 of user and password (the password itself is never kept nor logged), in a
//!   bounded cache; a few checks run at once.
//! * **Abuse** ([`gate`]): wrong passwords are throttled per user and per client address
//!   ([`throttle`]), answered 429 with `Retry-After`.

pub mod gate;
pub mod throttle;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::Settings;
use axum::http::{HeaderMap, header};
use futures::future::BoxFuture;
use headers::Header as _;
use headers::authorization::{Authorization, Basic};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

pub use gate::{Gate, Login, Style, require_login};

/// How long a successful check is remembered.
pub const REMEMBER: Duration = Duration::from_secs(60);
/// Logins remembered at most; past it the oldest are forgotten.
pub const MAX_REMEMBERED: usize = 1_000;
/// Checks (AMQP connections) under way at once, at most: a flood of wrong passwords opens no
/// more connections than this.
const CONCURRENT_CHECKS: usize = 4;
/// The longest password taken (the broker's own limits are lower), and user name.
const MAX_PASSWORD_BYTES: usize = 1_024;
const MAX_USER_BYTES: usize = 255;

/// An HTTP Basic login. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name, as the broker knows it.
    pub user: String,
    password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl Credentials {
    /// A login of `user` with `password`.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Credentials {
        Credentials {
            user: user.into(),
            password: password.into(),
        }
    }

    /// The login a request's headers carry: `Ok(None)` without an `Authorization` header,
    /// `Err` why when it is no usable Basic login.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Credentials>, String> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err("the request has more than one Authorization header".into());
        }
        // "Basic " and the longest user and password in base64 fit in this
        let basic = (value.len() <= 2_048)
            .then(|| Authorization::<Basic>::decode(&mut std::iter::once(value)).ok())
            .flatten()
            .ok_or("the Authorization header is no HTTP Basic login")?;
        let (user, password) = (basic.username(), basic.password());
        check_user(user)?;
        if password.len() > MAX_PASSWORD_BYTES {
            return Err(format!(
                "the password is longer than {MAX_PASSWORD_BYTES} bytes"
            ));
        }
        Ok(Some(Credentials::new(user, password)))
    }
}

/// Whether `user` can be taken as the name it is: `Err` says why not.
pub fn check_user(user: &str) -> Result<(), String> {
    if user.is_empty() || user.len() > MAX_USER_BYTES {
        return Err(format!(
            "a user name is 1 to {MAX_USER_BYTES} bytes, not {}",
            user.len()
        ));
    }
    if user.chars().any(char::is_control) {
        return Err("the user name holds a control character".into());
    }
    if percent_encoding::percent_decode_str(user).ne(user.bytes()) {
        return Err(format!(
            "the user name '{user}' holds a %XX escape: send the name itself (HTTP Basic is \
             not URL-encoded)"
        ));
    }
    Ok(())
}

/// Why a login was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The broker refused the user or password (HTTP 401).
    Refused,
    /// The broker could not be asked (HTTP 503): the message says why.
    Unavailable(String),
}

/// `settings` with every broker URL logging in as `login` (for a check, or to act as the user):
/// the name and password escaped whole, so that the broker decodes them back to what was sent.
pub fn settings_as(settings: &Settings, login: &Credentials) -> Result<Settings, String> {
    let user = utf8_percent_encode(&login.user, NON_ALPHANUMERIC).to_string();
    let password = utf8_percent_encode(&login.password, NON_ALPHANUMERIC).to_string();
    let mut urls = Vec::new();
    for u in amqp_delay::ops::connection::split_urls(&settings.url) {
        let mut url = url::Url::parse(&u).map_err(|e| format!("the broker URL: {e}"))?;
        url.set_username(&user)
            .and_then(|()| url.set_password(Some(&password)))
            .map_err(|()| "the broker URL cannot carry a user name".to_string())?;
        urls.push(url.to_string());
    }
    let mut s = settings.clone();
    s.url = urls.join(",");
    Ok(s)
}

/// Checks a user's password: `Ok` with the settings that act as that user.
pub trait Authenticate: Send + Sync {
    /// Whether `login` logs in.
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>>;

    /// Whether `login` was found right so recently that it is taken without asking again
    /// (and without counting against the throttle).
    fn knows(&self, _login: &Credentials) -> bool {
        false
    }
}

/// The logins checked so far, and the broker to check them with.
pub struct Logins {
    settings: Settings,
    salt: [u8; 32],
    /// By salted hash: the user and when the check stops counting.
    remembered: Mutex<HashMap<[u8; 32], (String, Instant)>>,
    checks: Semaphore,
}

impl Logins {
    /// Checks logins against the broker of `settings`.
    pub fn new(settings: Settings) -> Logins {
        Logins {
            settings,
            salt: rand::random(),
            remembered: Mutex::new(HashMap::new()),
            checks: Semaphore::new(CONCURRENT_CHECKS),
        }
    }

    fn key(&self, login: &Credentials) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.salt);
        h.update(login.user.as_bytes());
        h.update([0]);
        h.update(login.password.as_bytes());
        h.finalize().into()
    }

    fn remembered(&self, key: &[u8; 32], user: &str) -> bool {
        let map = self.remembered.lock().unwrap_or_else(|p| p.into_inner());
        map.get(key)
            .is_some_and(|(u, until)| u == user && *until > Instant::now())
    }

    fn remember(&self, key: [u8; 32], user: &str) {
        let mut map = self.remembered.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        map.retain(|_, (_, until)| *until > now);
        while map.len() >= MAX_REMEMBERED {
            let Some(oldest) = map.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| *k) else {
                break;
            };
            map.remove(&oldest);
        }
        map.insert(key, (user.to_string(), now + REMEMBER));
    }

    /// Accepts `login` when the broker lets it open a connection (or did within
    /// [`REMEMBER`]); the settings that act as that user.
    pub async fn check(&self, login: &Credentials) -> Result<Settings, Refusal> {
        let as_user = settings_as(&self.settings, login).map_err(Refusal::Unavailable)?;
        let key = self.key(login);
        if self.remembered(&key, &login.user) {
            return Ok(as_user);
        }
        let _turn = self
            .checks
            .acquire()
            .await
            .map_err(|_| Refusal::Unavailable("shutting down".into()))?;
        // another request may have checked the same login meanwhile
        if self.remembered(&key, &login.user) {
            return Ok(as_user);
        }
        let connector = Connector::new(&as_user)
            .map_err(|e| Refusal::Unavailable(amqp_delay::error_chain(&e)))?;
        match connector.connect("amqp-delay pending login").await {
            Ok(conn) => {
                amqp_delay::ops::broker::close_connection(&conn, "login checked").await;
                self.remember(key, &login.user);
                Ok(as_user)
            }
            Err(e) if is_login_refused(&e) => Err(Refusal::Refused),
            Err(e) => Err(Refusal::Unavailable(amqp_delay::error_chain(&e))),
        }
    }
}

impl Authenticate for Logins {
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>> {
        Box::pin(Logins::check(self, login))
    }

    fn knows(&self, login: &Credentials) -> bool {
        self.remembered(&self.key(login), &login.user)
    }
}

/// Whether a connection failed because the broker refused the login (a wrong user or
/// password, or no access to the virtual host), not because it could not be reached.
pub fn is_login_refused(e: &amqp_delay::Error) -> bool {
    let amqp_delay::Error::Connect { source, .. } = e else {
        return false;
    };
    if let lapin::ErrorKind::ProtocolError(reply) = source.kind()
        && matches!(reply.get_id(), 403 | 530)
    {
        return true;
    }
    let text = source.to_string();
    text.contains("ACCESS_REFUSED") || text.contains("NOT_ALLOWED")
}

#[cfg(test)]
mod tests;
