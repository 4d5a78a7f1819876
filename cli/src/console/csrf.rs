//! Cross-site request forgery: every form post carries a token tied to the user (HMAC-SHA256
//! of the user name under a key drawn when the process starts), and must come from a page of
//! this console: its `Origin` (or, when a browser sends none, its `Referer`) must name the
//! host the request was sent to. Either check failing is a 403 that says which.

use axum::http::{HeaderMap, header};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

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

    fn mac(&self, user: &str) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(b"amqp-delay console csrf\0");
        mac.update(user.as_bytes());
        mac
    }

    /// The token of `user`'s forms.
    pub fn token(&self, user: &str) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(self.mac(user).finalize().into_bytes())
    }

    /// Whether `token` is `user`'s (compared in constant time).
    pub fn valid(&self, user: &str, token: &str) -> bool {
        match base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token.trim()) {
            Ok(raw) => self.mac(user).verify_slice(&raw).is_ok(),
            Err(_) => false,
        }
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
    fn a_token_belongs_to_its_user_and_its_process() {
        let c = Csrf::random();
        let t = c.token("alice");
        assert!(c.valid("alice", &t));
        assert!(!c.valid("bob", &t), "another user's token");
        assert!(
            !Csrf::random().valid("alice", &t),
            "another process's token"
        );
        assert!(!c.valid("alice", ""));
        assert!(!c.valid("alice", "not base64 !"));
        assert!(!c.valid("alice", &t[..t.len() - 2]));
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
