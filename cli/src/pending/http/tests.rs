use super::*;

use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt as _;

fn api() -> Arc<Api> {
    let ix = PendingIndex::open(Path::new(":memory:"), Options::default()).unwrap();
    let settings = Settings::default();
    let service = Service::new(settings.clone(), Arc::new(Mutex::new(ix)), Status::new());
    Arc::new(Api::new(service, settings))
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

#[tokio::test]
async fn an_oversize_body_is_refused_before_it_is_read_whole() {
    let big = vec![b' '; MAX_BODY + 1];
    let r = call(
        Request::post("/api/v1/pending/purge")
            .body(Body::from(big))
            .unwrap(),
    )
    .await;
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
    let b: RescheduleBody = serde_json::from_str(r#"{"delay": "10m"}"#).unwrap();
    assert_eq!(move_to(&b), Ok(MoveTo::Delay(600_000)));
    let b: RescheduleBody = serde_json::from_str(r#"{"at": 1796000000000}"#).unwrap();
    assert_eq!(move_to(&b), Ok(MoveTo::At(1_796_000_000_000)));
    for bad in [r#"{}"#, r#"{"delay": 5, "at": 6}"#, r#"{"delay": "soon"}"#] {
        let b: RescheduleBody = serde_json::from_str(bad).unwrap();
        assert!(move_to(&b).is_err(), "{bad}");
    }
    assert!(serde_json::from_str::<RescheduleBody>(r#"{"later": 1}"#).is_err());
    let p: PurgeBody =
        serde_json::from_str(r#"{"queue": "q", "due_before": "+1h", "header": "k=v"}"#).unwrap();
    let q = purge_query(p).unwrap();
    assert_eq!(q.header, Some(("k".into(), "v".into())));
    assert!(q.due_before_ms.unwrap() > now_ms());
    let p: PurgeBody = serde_json::from_str(r#"{"queue": ""}"#).unwrap();
    assert!(purge_query(p).unwrap_err().contains("queue"));
    assert!(body_of::<CancelBody>(b" ").is_ok());
    assert!(body_of::<CancelBody>(b"{").is_err());
}
