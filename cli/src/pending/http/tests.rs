use super::*;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use futures::future::BoxFuture;
use tower::ServiceExt as _;

use super::super::auth::{Credentials, Refusal, settings_as, throttle};

/// What the 401 answer asks for.
const CHALLENGE: &str = "Basic realm=\"amqp-delay pending\", charset=\"UTF-8\"";

fn api() -> Arc<Api> {
    let ix = PendingIndex::open(Path::new(":memory:"), Options::default()).unwrap();
    let settings = Settings::default();
    let service = Service::new(settings.clone(), Arc::new(Mutex::new(ix)), Status::new());
    Arc::new(Api::new(service, settings))
}

/// One user, alice, whose password is "right", as the broker would check it.
struct OnlyAlice(Settings);

impl Authenticate for OnlyAlice {
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>> {
        Box::pin(async move {
            if *login == Credentials::new("alice", "right") {
                settings_as(&self.0, login).map_err(Refusal::Unavailable)
            } else {
                Err(Refusal::Refused)
            }
        })
    }
}

fn api_of_alice() -> Arc<Api> {
    let ix = PendingIndex::open(Path::new(":memory:"), Options::default()).unwrap();
    let settings = Settings::default();
    let service = Service::new(settings.clone(), Arc::new(Mutex::new(ix)), Status::new());
    let logins = Arc::new(OnlyAlice(settings.clone()));
    Arc::new(Api::with_logins(service, settings, logins))
}

fn status_as(user: &str, pw: &str, from: &str) -> Request<Body> {
    use base64::Engine as _;
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pw}"));
    let mut req = Request::get("/api/v1/status")
        .header("authorization", format!("Basic {token}"))
        .body(Body::empty())
        .unwrap();
    let peer: std::net::SocketAddr = from.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(peer));
    req
}

/// Five wrong passwords pass as 401s; the sixth attempt for that user, even from elsewhere, or
/// from that address, even for another user, is 429 with Retry-After, unasked of the broker.
#[tokio::test]
async fn wrong_passwords_are_throttled_per_user_and_per_address() {
    let routes = router(api_of_alice());
    let call = |req| routes.clone().oneshot(req);
    assert_eq!(
        call(status_as("alice", "right", "192.0.2.1:1"))
            .await
            .unwrap()
            .status(),
        200
    );
    for _ in 0..throttle::FREE_FAILURES {
        let r = call(status_as("alice", "guess", "192.0.2.9:1"))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    for (user, from) in [("alice", "198.51.100.1:2"), ("bob", "192.0.2.9:3")] {
        let r = call(status_as(user, "guess", from)).await.unwrap();
        assert_eq!(
            r.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{user} from {from}"
        );
        assert_eq!(r.headers().get("retry-after").unwrap(), "1");
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("Too many wrong passwords"), "{text}");
    }
    // a login checked right a moment ago still passes (the broker was asked then)
    let remembered = call(status_as("carol", "x", "203.0.113.1:1"))
        .await
        .unwrap();
    assert_eq!(
        remembered.status(),
        StatusCode::UNAUTHORIZED,
        "another user elsewhere"
    );
}

/// A user name sent percent-encoded is refused, not read as another user's.
#[tokio::test]
async fn a_percent_encoded_user_name_is_refused_with_why() {
    let r = router(api_of_alice())
        .oneshot(status_as("%61lice", "right", "192.0.2.1:1"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("%XX escape"), "{text}");
}

async fn call(req: Request<Body>) -> Response {
    router(api()).oneshot(req).await.unwrap()
}

#[tokio::test]
async fn the_api_answers_401_with_a_challenge_without_a_basic_login() {
    for (method, path) in [
        ("GET", "/api/v1/pending"),
        ("GET", "/api/v1/pending/x"),
        ("POST", "/api/v1/pending/purge"),
        ("POST", "/api/v1/pending/x/reschedule"),
        ("POST", "/api/v1/pending/x/cancel"),
        ("GET", "/api/v1/status"),
    ] {
        for auth in [None, Some("Bearer abc"), Some("Basic !!!")] {
            let mut req = Request::builder().method(method).uri(path);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = call(req.body(Body::empty()).unwrap()).await;
            assert_eq!(
                r.status(),
                StatusCode::UNAUTHORIZED,
                "{method} {path} {auth:?}"
            );
            assert_eq!(
                r.headers().get("www-authenticate").unwrap(),
                CHALLENGE,
                "{method} {path}"
            );
        }
    }
    let r = call(Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::OK);
}

/// A body is read only after a login (401 without one), and one over the cap never whole.
#[tokio::test]
async fn an_oversize_body_is_refused_before_it_is_read_whole() {
    let big = || Body::from(vec![b' '; MAX_BODY + 1]);
    let r = call(Request::post("/api/v1/pending/purge").body(big()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let mut req = status_as("alice", "right", "192.0.2.1:1");
    *req.method_mut() = axum::http::Method::POST;
    *req.uri_mut() = "/api/v1/pending/purge".parse().unwrap();
    *req.body_mut() = big();
    let r = router(api_of_alice()).oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[test]
fn query_strings_read_with_clear_errors() {
    let known = ["queue", "due_after", "limit", "header"];
    let p = params(Some("queue=a%20b&limit=5&header=tenant%3Dt%3D1"), &known).unwrap();
    let q = query_of(p).unwrap();
    assert_eq!(q.queue.as_deref(), Some("a b"));
    assert_eq!(q.limit, Some(5));
    assert_eq!(q.header, Some(("tenant".into(), "t=1".into())));
    assert!(params(Some("queue=a&queue=b"), &known).is_err());
    assert!(params(Some("nope=1"), &known).is_err());
    for (bad, want) in [
        ("limit=x", "not a number"),
        ("due_after=soon", "RFC 3339"),
        ("header=novalue", "NAME=VALUE"),
        ("header==v", "NAME=VALUE"),
    ] {
        let e = query_of(params(Some(bad), &known).unwrap()).unwrap_err();
        assert!(e.contains(want), "{bad}: {e}");
    }
}

#[test]
fn bodies_read_with_clear_errors() {
    let body = |j: &str| serde_json::from_str::<RescheduleBody>(j).unwrap();
    let before = amqp_delay::time::now_ms();
    let r = reschedule_of("m".into(), body(r#"{"delay": "10m"}"#)).unwrap();
    assert!(r.due_at_ms >= before + 600_000 && r.due_at_ms <= now_ms() + 600_000);
    assert_eq!((r.id.as_str(), r.owner), ("m", None));
    let r = reschedule_of("m".into(), body(r#"{"at": 1796000000000, "owner": "bob"}"#)).unwrap();
    assert_eq!(r.due_at_ms, 1_796_000_000_000);
    assert_eq!(r.owner.as_deref(), Some("bob"));
    for bad in [r#"{}"#, r#"{"delay": 5, "at": 6}"#, r#"{"delay": "soon"}"#] {
        assert!(reschedule_of("m".into(), body(bad)).is_err(), "{bad}");
    }
    assert!(reschedule_of(String::new(), body(r#"{"delay": 5}"#)).is_err());
    assert!(serde_json::from_str::<RescheduleBody>(r#"{"later": 1}"#).is_err());
    let p: PurgeBody =
        serde_json::from_str(r#"{"queue": "q", "due_before": "+1h", "header": "k=v"}"#).unwrap();
    let q = purge_scope(p).unwrap();
    assert_eq!(q.header, Some(("k".into(), "v".into())));
    assert!(q.due_before_ms.unwrap() > now_ms());
    let p: PurgeBody = serde_json::from_str(r#"{"queue": ""}"#).unwrap();
    assert!(purge_scope(p).unwrap_err().contains("queue"));
    assert!(body_of::<CancelBody>(b" ").is_ok());
    assert!(body_of::<CancelBody>(b"{").is_err());
}
