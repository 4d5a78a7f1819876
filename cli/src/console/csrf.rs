//! Cross-site request forgery: every form post carries a token tied to the user and to when it
//! was issued (HMAC-SHA256 of both under a key drawn when the process starts; good for
//! [`TOKEN_LIFETIME`]), and must come from a page of this console: its `Origin` (or, when a
//! browser sends none, its `Referer`) must name the host the request was sent to. Either check
//! failing is a 403 that says which.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, header};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How long a form's token is taken after its page was made.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(3_600);
/// How far ahead of this process's clock a token may say it was issued (never, unless the
/// clock was set back).
const AHEAD: u64 = 60;

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadToken {
    /// Missing, garbled, of another user or of another process.
    NotThisUsers,
    /// Right, but issued longer than [`TOKEN_LIFETIME`] ago.
    Expired,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The key of this process's tokens.
pub struct Csrf {
    key: [u8; 32],
}

impl Csrf {
    /// A fresh random key: tokens of an earlier process are refused (the page is reloaded).
    pub fn random() -> Csrf {
        Csrf {
            key: rand::random(),
        }
    }

    fn mac(&self, user: &str, issued: u64) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(b"amqp-delay console csrf\0");
        mac.update(&issued.to_be_bytes());
        mac.update(user.as_bytes());
        mac
    }

    /// The token of `user`'s forms, issued now.
    pub fn token(&self, user: &str) -> String {
        self.token_at(user, now_secs())
    }

    /// The token of `user`'s forms issued at `issued` (seconds since the epoch): the time,
    /// then the MAC.
    pub fn token_at(&self, user: &str, issued: u64) -> String {
        let mut raw = issued.to_be_bytes().to_vec();
        raw.extend_from_slice(&self.mac(user, issued).finalize().into_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    }

    /// Whether `token` is `user`'s and still good (compared in constant time).
    pub fn check(&self, user: &str, token: &str) -> Result<(), BadToken> {
        self.check_at(user, token, now_secs())
    }

    /// [`Csrf::check`] at `now` (seconds since the epoch).
    pub fn check_at(&self, user: &str, token: &str, now: u64) -> Result<(), BadToken> {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token.trim())
            .map_err(|_| BadToken::NotThisUsers)?;
        let (Some(issued), Some(mac)) = (raw.get(..8), raw.get(8..)) else {
            return Err(BadToken::NotThisUsers);
        };
        let issued = u64::from_be_bytes(issued.try_into().map_err(|_| BadToken::NotThisUsers)?);
        self.mac(user, issued)
            .verify_slice(mac)
            .map_err(|_| BadToken::NotThisUsers)?;
        if issued > now.saturating_add(AHEAD)
            || now.saturating_sub(issued) > TOKEN_LIFETIME.as_secs()
        {
            return Err(BadToken::Expired);
        }
        Ok(())
    }
}

/// `scheme://host[:port]` of a URL, lowercased: its origin.
fn origin_of(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let host = u.host_str()?;
    Some(match u.port() {
        Some(p) => format!("{}://{}:{p}", u.scheme(), host).to_ascii_lowercase(),
        None => format!("{}://{host}", u.scheme()).to_ascii_lowercase(),
    })
}

/// Checks that a form post comes from this console's pages: its Origin, or else its Referer,
/// names the Host it was sent to, with the console's scheme. `Err` says what is wrong.
pub fn same_origin(headers: &HeaderMap, https: bool) -> Result<(), String> {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .ok_or("the request names no Host")?;
    let scheme = if https { "https" } else { "http" };
    // the default port is left out of an origin, and may or may not be in Host
    let expected = origin_of(&format!("{scheme}://{host}/"))
        .ok_or_else(|| format!("the Host header '{host}' is not a host name"))?;
    let sent = headers
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .filter(|o| *o != "null");
    let (what, from) = match sent {
        Some(o) => ("Origin", origin_of(o)),
        None => match headers.get(header::REFERER).and_then(|r| r.to_str().ok()) {
            Some(r) => ("Referer", origin_of(r)),
            None => {
                return Err(
                    "the form post names no Origin or Referer: post it from the \
                            console's own page (and let the browser send its Origin)"
                        .into(),
                );
            }
        },
    };
    match from {
        Some(o) if o == expected => Ok(()),
        Some(o) => Err(format!(
            "the form post comes from {o} ({what}), not from this console ({expected})"
        )),
        None => Err(format!("the {what} header is not a URL")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_token_belongs_to_its_user_and_its_process_and_expires_after_an_hour() {
        let c = Csrf::random();
        let t = c.token("alice");
        assert_eq!(c.check("alice", &t), Ok(()));
        let not = Err(BadToken::NotThisUsers);
        assert_eq!(c.check("bob", &t), not, "another user's token");
        assert_eq!(Csrf::random().check("alice", &t), not, "another process's");
        assert_eq!(c.check("alice", ""), not);
        assert_eq!(c.check("alice", "not base64 !"), not);
        assert_eq!(c.check("alice", &t[..t.len() - 2]), not);
        // its time is under the MAC: a token re-dated by hand is not this user's
        let issued = 1_800_000_000;
        let old = c.token_at("alice", issued);
        let mut raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&old)
            .unwrap();
        raw[7] ^= 1;
        let redated = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        assert_eq!(c.check_at("alice", &redated, issued), not);
        let hour = TOKEN_LIFETIME.as_secs();
        assert_eq!(c.check_at("alice", &old, issued + hour), Ok(()));
        assert_eq!(
            c.check_at("alice", &old, issued + hour + 1),
            Err(BadToken::Expired)
        );
        assert_eq!(
            c.check_at("alice", &old, issued - 3_600),
            Err(BadToken::Expired),
            "issued in the future"
        );
    }

    #[test]
    fn a_post_must_come_from_the_consoles_own_origin() {
        let ok = headers(&[
            (header::HOST, "127.0.0.1:8080"),
            (header::ORIGIN, "http://127.0.0.1:8080"),
        ]);
        assert_eq!(same_origin(&ok, false), Ok(()));
        let e = same_origin(&ok, true).unwrap_err();
        assert!(e.contains("https://127.0.0.1:8080"), "{e}");
        let by_referer = headers(&[
            (header::HOST, "Console.Example:443"),
            (header::REFERER, "https://console.example/message?id=1"),
        ]);
        assert_eq!(same_origin(&by_referer, true), Ok(()));
        let evil = headers(&[
            (header::HOST, "console.example"),
            (header::ORIGIN, "https://evil.example"),
            (header::REFERER, "https://console.example/"),
        ]);
        let e = same_origin(&evil, true).unwrap_err();
        assert!(e.contains("evil.example") && e.contains("Origin"), "{e}");
        let none = headers(&[(header::HOST, "console.example")]);
        assert!(same_origin(&none, true).unwrap_err().contains("no Origin"));
        let null = headers(&[(header::HOST, "h"), (header::ORIGIN, "null")]);
        assert!(same_origin(&null, false).is_err());
        assert!(
            same_origin(&HeaderMap::new(), false)
                .unwrap_err()
                .contains("Host")
        );
    }
}
