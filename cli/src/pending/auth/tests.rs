use super::*;

use axum::http::HeaderValue;
use base64::Engine as _;

fn basic(user_pass: &str) -> HeaderMap {
    let v = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(user_pass)
    );
    headers_of(&[v.as_bytes()])
}

fn headers_of(values: &[&[u8]]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(header::AUTHORIZATION, HeaderValue::from_bytes(v).unwrap());
    }
    h
}

#[test]
fn a_basic_header_gives_its_login_and_anything_else_a_reason() {
    let l = Credentials::from_headers(&basic("alice:s3cr:et"))
        .unwrap()
        .unwrap();
    assert_eq!(l, Credentials::new("alice", "s3cr:et"));
    assert!(!format!("{l:?}").contains("s3cr"));
    assert_eq!(
        Credentials::from_headers(&headers_of(&[b"basic YWxpY2U6cHc="])),
        Ok(Some(Credentials::new("alice", "pw")))
    );
    assert_eq!(Credentials::from_headers(&HeaderMap::new()), Ok(None));
    let long_user = format!("{}:pw", "u".repeat(256));
    let long_pw = format!("u:{}", "p".repeat(1_025));
    for bad in [
        headers_of(&[b"Bearer abc"]),
        headers_of(&[b"Basic"]),
        headers_of(&[b"Basic !!!"]),
        headers_of(&[b"\xff\xfe"]),
        basic("no-colon"),
        basic(":pw"),
        basic(&long_user),
        basic(&long_pw),
        headers_of(&[b"Basic YWxpY2U6cHc=", b"Basic Ym9iOnB3"]),
    ] {
        assert!(Credentials::from_headers(&bad).is_err(), "{bad:?}");
    }
}

/// A name is taken as sent, once: one that a URL would read as another name, or that holds
/// control characters, is refused with why.
#[test]
fn a_user_name_is_one_name_or_refused() {
    for ok in ["alice", "al ice", "ålice", "50%off", "a+b@example.com"] {
        assert_eq!(check_user(ok), Ok(()), "{ok}");
    }
    let e = Credentials::from_headers(&basic("al%69ce:pw")).unwrap_err();
    assert!(e.contains("%XX escape") && e.contains("al%69ce"), "{e}");
    for bad in ["", "al\nice", "al\u{7f}ice", "a\u{0}b", "%61"] {
        assert!(check_user(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn every_url_logs_in_as_the_user_with_every_character_as_sent() {
    let s = Settings {
        url: "amqp://guest:guest@a:5672/%2f,amqps://b/vh".into(),
        ..Settings::default()
    };
    for (user, pw) in [
        ("al ice", "p@ss/w:rd"),
        ("50%off", "p%41ss"),
        ("ålice", "ü"),
    ] {
        let as_user = settings_as(&s, &Credentials::new(user, pw)).unwrap();
        let urls = amqp_delay::ops::connection::split_urls(&as_user.url);
        assert_eq!(urls.len(), 2);
        for u in &urls {
            // what the AMQP client logs in with: decoded once
            let uri: lapin::uri::AMQPUri = u.parse().unwrap();
            assert_eq!(uri.authority.userinfo.username, user, "{u}");
            assert_eq!(uri.authority.userinfo.password, pw, "{u}");
            // what the tools read back as the acting user
            let parsed = url::Url::parse(u).unwrap();
            assert_eq!(
                super::super::follow::percent_decode(parsed.username()),
                user
            );
        }
        assert!(urls[1].starts_with("amqps://") && urls[1].ends_with("/vh"));
    }
}

#[test]
fn the_cache_is_bounded_and_keyed_by_user_and_password() {
    let logins = Logins::new(Settings::default());
    let a = Credentials::new("alice", "pw");
    logins.remember(logins.key(&a), "alice");
    assert!(logins.remembered(&logins.key(&a), "alice"));
    assert!(Authenticate::knows(&logins, &a));
    assert!(!Authenticate::knows(
        &logins,
        &Credentials::new("alice", "other")
    ));
    for i in 0..(MAX_REMEMBERED + 10) {
        let l = Credentials::new(format!("u{i}"), "pw");
        logins.remember(logins.key(&l), &l.user);
    }
    assert!(logins.remembered.lock().unwrap().len() <= MAX_REMEMBERED);
}
