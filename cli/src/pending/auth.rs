//! HTTP logins checked by the broker: an HTTP Basic user and password count when an AMQP
//! connection as that user to the configured broker opens. A successful check is remembered for
//! [`REMEMBER`], keyed by a salted SHA-256 of user and password (the password itself is never
//! kept nor logged), in a bounded cache. The pending API and the console share it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use amqp_delay::connection::Connector;
use amqp_delay::settings::Settings;
use base64::Engine as _;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

/// How long a successful check is remembered.
pub const REMEMBER: Duration = Duration::from_secs(60);
/// Logins remembered at most; past it the oldest are forgotten.
pub const MAX_REMEMBERED: usize = 1_000;
/// Checks (AMQP connections) under way at once, at most: a flood of wrong passwords opens no
/// more connections than this.
const CONCURRENT_CHECKS: usize = 4;
/// The longest user name and password taken (the broker's own limits are lower).
const MAX_CREDENTIAL_BYTES: usize = 1_024;

/// An HTTP Basic login. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    /// The user name.
    pub user: String,
    password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl Login {
    /// A login of `user` with `password`.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Login {
        Login {
            user: user.into(),
            password: password.into(),
        }
    }

    /// The login of an `Authorization` header's value (`Basic base64(user:password)`), or
    /// `None` when it is no Basic login (or one too long to be a broker's).
    pub fn from_header(value: &[u8]) -> Option<Login> {
        let v = std::str::from_utf8(value).ok()?.trim();
        let (scheme, rest) = v.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("basic") || rest.len() > 4 * MAX_CREDENTIAL_BYTES {
            return None;
        }
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (user, password) = text.split_once(':')?;
        if user.is_empty() || user.len() > 255 || password.len() > MAX_CREDENTIAL_BYTES {
            return None;
        }
        Some(Login::new(user, password))
    }
}

/// Why a login was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The broker refused the user or password (HTTP 401).
    Refused,
    /// The broker could not be asked (HTTP 503): the message says why.
    Unavailable(String),
}

/// `settings` with every broker URL logging in as `login` (for a check, or to act as the user).
pub fn settings_as(settings: &Settings, login: &Login) -> Result<Settings, String> {
    let mut urls = Vec::new();
    for u in amqp_delay::connection::split_urls(&settings.url) {
        let mut url = url::Url::parse(&u).map_err(|e| format!("the broker URL: {e}"))?;
        url.set_username(&login.user)
            .and_then(|()| url.set_password(Some(&login.password)))
            .map_err(|()| "the broker URL cannot carry a user name".to_string())?;
        urls.push(url.to_string());
    }
    let mut s = settings.clone();
    s.url = urls.join(",");
    Ok(s)
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

    fn key(&self, login: &Login) -> [u8; 32] {
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
    pub async fn check(&self, login: &Login) -> Result<Settings, Refusal> {
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
                amqp_delay::broker::close_connection(&conn, "login checked").await;
                self.remember(key, &login.user);
                Ok(as_user)
            }
            Err(e) if is_login_refused(&e) => Err(Refusal::Refused),
            Err(e) => Err(Refusal::Unavailable(amqp_delay::error_chain(&e))),
        }
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
mod tests {
    use super::*;

    fn header(user_pass: &str) -> Vec<u8> {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_pass)
        )
        .into_bytes()
    }

    #[test]
    fn a_basic_header_gives_its_login_and_anything_else_none() {
        let l = Login::from_header(&header("alice:s3cr:et")).unwrap();
        assert_eq!(l, Login::new("alice", "s3cr:et"));
        assert!(!format!("{l:?}").contains("s3cr"));
        assert_eq!(
            Login::from_header(b"basic YWxpY2U6cHc=").unwrap(),
            Login::new("alice", "pw")
        );
        for bad in [
            &b"Bearer abc"[..],
            b"Basic",
            b"Basic !!!",
            &header("no-colon"),
            &header(":pw"),
            &header(&format!("{}:pw", "u".repeat(256))),
            b"\xff\xfe",
        ] {
            assert_eq!(Login::from_header(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_url_logs_in_as_the_user_with_special_characters_escaped() {
        let s = Settings {
            url: "amqp://guest:guest@a:5672/%2f,amqps://b/vh".into(),
            ..Settings::default()
        };
        let as_user = settings_as(&s, &Login::new("al ice", "p@ss/w:rd")).unwrap();
        let urls = amqp_delay::connection::split_urls(&as_user.url);
        assert_eq!(urls.len(), 2);
        for u in &urls {
            let parsed = url::Url::parse(u).unwrap();
            assert_eq!(
                super::super::follow::percent_decode(parsed.username()),
                "al ice"
            );
            assert_eq!(
                super::super::follow::percent_decode(parsed.password().unwrap()),
                "p@ss/w:rd"
            );
        }
        assert!(urls[1].starts_with("amqps://") && urls[1].ends_with("/vh"));
    }

    #[test]
    fn the_cache_is_bounded_and_keyed_by_user_and_password() {
        let logins = Logins::new(Settings::default());
        let a = Login::new("alice", "pw");
        logins.remember(logins.key(&a), "alice");
        assert!(logins.remembered(&logins.key(&a), "alice"));
        assert!(!logins.remembered(&logins.key(&Login::new("alice", "other")), "alice"));
        for i in 0..(MAX_REMEMBERED + 10) {
            let l = Login::new(format!("u{i}"), "pw");
            logins.remember(logins.key(&l), &l.user);
        }
        assert!(logins.remembered.lock().unwrap().len() <= MAX_REMEMBERED);
    }
}
