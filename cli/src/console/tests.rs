//! The console against an index filled directly (no broker): logins, who sees what, pages,
//! paging, escaping, the CSRF checks and the body cap, over real HTTP.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use amqp_delay::settings::Settings;
use base64::Engine as _;
use futures::future::BoxFuture;

use super::*;
use crate::pending::auth::{Authenticate, Credentials, Gate, Refusal, Style, settings_as};
use crate::pending_index::{Destination, Entry, Options, PendingIndex, Scheduled};

/// Logins of a fixed table, as the broker would check them.
struct Fixed(Vec<Credentials>, Settings);

impl Authenticate for Fixed {
    fn check<'a>(&'a self, login: &'a Credentials) -> BoxFuture<'a, Result<Settings, Refusal>> {
        Box::pin(async move {
            if self.0.contains(login) {
                settings_as(&self.1, login).map_err(Refusal::Unavailable)
            } else {
                Err(Refusal::Refused)
            }
        })
    }
}

/// A console serving an index of its own on a free port, in a runtime of its own.
struct Served {
    addr: SocketAddr,
    dir: PathBuf,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sched(owner: &str, id: &str, queue: &str, due: u64) -> Entry {
    Entry::Scheduled(Scheduled {
        id: id.into(),
        owner: owner.into(),
        destination: Destination::Queue(queue.into()),
        due_at_ms: due,
        scheduled_at_ms: amqp_delay::time::now_ms(),
        size: 12,
        content_type: Some("text/plain".into()),
        headers: vec![("tenant".into(), "t<1>".into())],
        body: Some(b"hello <b>world</b>".to_vec()),
        confirmed: true,
    })
}

fn serve_with(entries: Vec<Entry>) -> Served {
    let dir = std::env::temp_dir().join(format!(
        "console-test-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("index.db");
    let mut ix = PendingIndex::open(&path, Options::default()).unwrap();
    ix.apply(&entries).unwrap();
    drop(ix);
    let mut settings = Settings::default();
    settings.trust.admins = vec!["root".into()];
    let users = [("alice", "a-pw"), ("bob", "b-pw"), ("root", "r-pw")]
        .into_iter()
        .map(|(u, p)| Credentials::new(u, p))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = store::Store::open(&path, 8 << 20).unwrap();
    let writer = PendingIndex::open(&path, Options::default()).unwrap();
    let status = crate::pending::follow::Status::new();
    let service = crate::pending::service::Service::new(
        settings.clone(),
        Arc::new(std::sync::Mutex::new(writer)),
        status.clone(),
    );
    let app = Arc::new(App {
        gate: Arc::new(Gate::new(
            Arc::new(Fixed(users, settings.clone())),
            settings.clone(),
            Style::Console,
        )),
        schedules: crate::schedules::Live::new(settings.clone()),
        settings,
        summaries: summaries::Summaries::new(store.clone()),
        store,
        service,
        status,
        csrf: csrf::Csrf::random(),
        https: false,
        views: view::Views::new(),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let config = Config {
        listen: "127.0.0.1:0".into(),
        index: path,
        cache_bytes: 8 << 20,
        tls: None,
    };
    rt.spawn(async move {
        let r = serve(
            app,
            config,
            move |a| tx.send(a).unwrap(),
            std::future::pending(),
        )
        .await;
        r.unwrap();
    });
    let addr = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    Served { addr, dir, _rt: rt }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}

fn basic(user: &str, pw: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pw}"))
    )
}

impl Served {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// GET as `user` (None: no credentials): status and body.
    fn get(&self, path: &str, user: Option<(&str, &str)>) -> (u16, String) {
        let mut req = agent().get(&self.url(path));
        if let Some((u, p)) = user {
            req = req.header("Authorization", &basic(u, p));
        }
        let mut r = req.call().unwrap();
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_string().unwrap())
    }

    fn post(
        &self,
        path: &str,
        user: (&str, &str),
        origin: Option<&str>,
        form: &[(&str, &str)],
    ) -> (u16, String) {
        let mut req = agent()
            .post(&self.url(path))
            .header("Authorization", &basic(user.0, user.1));
        if let Some(o) = origin {
            req = req.header("Origin", o);
        }
        let mut r = req.send_form(form.iter().copied()).unwrap();
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_string().unwrap())
    }
}

const ALICE: (&str, &str) = ("alice", "a-pw");
const BOB: (&str, &str) = ("bob", "b-pw");
const ROOT: (&str, &str) = ("root", "r-pw");

fn later(ms: u64) -> u64 {
    amqp_delay::time::now_ms() + ms
}

/// The number in the pending column of `dest`'s row of the first page.
fn pending_of(html: &str, dest: &str) -> Option<u64> {
    let at = html.find(&format!(">{dest}</a></td>"))?;
    let rest = &html[at..];
    let cell = rest.find("class=\"num pending\">")? + "class=\"num pending\">".len();
    let text: String = rest[cell..]
        .split('<')
        .next()?
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    text.parse().ok()
}

#[test]
fn without_a_login_or_with_a_wrong_password_every_page_is_401() {
    let s = serve_with(vec![sched("alice", "a-1", "A", later(60_000))]);
    for path in [
        "/",
        "/messages?queue=A",
        "/message?id=a-1",
        "/purge?queue=A",
    ] {
        let (status, body) = s.get(path, None);
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("No credentials"), "{body}");
        let (status, body) = s.get(path, Some(("alice", "wrong")));
        assert_eq!(status, 401, "{path}");
        assert!(body.contains("refused the login of 'alice'"), "{body}");
    }
    let r = agent().get(&s.url("/")).call().unwrap();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(challenge.starts_with("Basic realm="), "{challenge}");
    assert_eq!(s.get("/healthz", None).0, 200);
    let (status, css) = s.get("/static/console.css", None);
    assert_eq!(status, 200);
    assert!(css.contains("svg.chart"));
    assert_eq!(s.get("/nope", Some(ALICE)).0, 404);
}

#[test]
fn each_user_sees_its_own_and_an_admin_sees_everything() {
    let mut e = Vec::new();
    for i in 0..3 {
        e.push(sched("alice", &format!("a-{i}"), "A", later(30_000 + i)));
    }
    for i in 0..2 {
        e.push(sched("bob", &format!("b-{i}"), "B", later(7_200_000 + i)));
    }
    let s = serve_with(e);
    let (status, root) = s.get("/", Some(ROOT));
    assert_eq!(status, 200, "{root}");
    assert_eq!(pending_of(&root, "A"), Some(3), "{root}");
    assert_eq!(pending_of(&root, "B"), Some(2), "{root}");
    assert!(root.contains("<svg class=\"chart\""), "the due-time chart");
    assert!(root.contains("<span class=\"tag\">admin</span>"));
    let (_, alice) = s.get("/", Some(ALICE));
    assert_eq!(pending_of(&alice, "A"), Some(3));
    assert_eq!(pending_of(&alice, "B"), None, "alice sees none of bob's");
    // lists and searches
    let (status, list) = s.get("/messages?queue=B", Some(BOB));
    assert_eq!(status, 200);
    assert!(
        list.contains(">b-0</a>") && list.contains(">b-1</a>"),
        "{list}"
    );
    let (_, list) = s.get("/messages?queue=B", Some(ALICE));
    assert!(!list.contains(">b-0</a>"), "{list}");
    let (status, page) = s.get("/messages?id=b-1", Some(BOB));
    assert_eq!(status, 200);
    assert!(page.contains("<td class=\"destination\">B</td>"), "{page}");
    assert!(page.contains("<td class=\"due\">"), "{page}");
    let (status, page) = s.get("/messages?id=b-1", Some(ALICE));
    assert_eq!(status, 404, "{page}");
    assert!(
        page.contains("No message with id &#x27;b-1&#x27; among yours"),
        "{page}"
    );
    assert_eq!(s.get("/message?id=b-1&owner=bob", Some(ROOT)).0, 200);
}

#[test]
fn values_from_outside_are_escaped_and_bodies_shown_as_text() {
    let s = serve_with(vec![sched(
        "alice",
        "<script>x</script>",
        "A&B",
        later(60_000),
    )]);
    let (status, page) = s.get("/message?id=%3Cscript%3Ex%3C%2Fscript%3E", Some(ALICE));
    assert_eq!(status, 200, "{page}");
    assert!(!page.contains("<script>"), "{page}");
    assert!(
        page.contains("&lt;script&gt;x&lt;&#x2f;script&gt;"),
        "{page}"
    );
    assert!(page.contains("A&amp;B"));
    assert!(
        page.contains("hello &lt;b&gt;world&lt;&#x2f;b&gt;"),
        "the body, escaped"
    );
    assert!(page.contains("t&lt;1&gt;"), "the header, escaped");
    let (_, list) = s.get("/messages", Some(ALICE));
    assert!(!list.contains("<script>"));
}

#[test]
fn lists_are_paged_by_cursor_and_bounded() {
    let e: Vec<Entry> = (0..120)
        .map(|i| sched("alice", &format!("m-{i:03}"), "A", later(60_000 + i * 1000)))
        .collect();
    let s = serve_with(e);
    let mut path = "/messages?queue=A&limit=50".to_string();
    let mut seen = Vec::new();
    for expect in [50, 50, 20] {
        let (status, page) = s.get(&path, Some(ALICE));
        assert_eq!(status, 200, "{page}");
        let ids: Vec<&str> = page.split("\">m-").skip(1).map(|t| &t[..3]).collect();
        assert_eq!(ids.len(), expect, "{path}");
        seen.extend(ids.iter().map(|s| s.to_string()));
        match page.split("rel=\"next\" href=\"").nth(1) {
            Some(rest) => path = rest.split('"').next().unwrap().replace("&amp;", "&"),
            None => assert_eq!(expect, 20, "only the last page has no next link"),
        }
    }
    let want: Vec<String> = (0..120).map(|i| format!("{i:03}")).collect();
    assert_eq!(seen, want, "in due order, none skipped or repeated");
    let (status, page) = s.get("/messages?limit=500", Some(ALICE));
    assert_eq!(status, 400);
    assert!(page.contains("1 to 100"), "{page}");
    let (status, page) = s.get("/messages?due_after=tomorrow", Some(ALICE));
    assert_eq!(status, 400);
    assert!(
        page.contains("due after: &#x27;tomorrow&#x27; is not a time"),
        "{page}"
    );
}

/// The CSRF token in a page's forms.
fn token_of(html: &str) -> String {
    html.split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|t| t.split('"').next())
        .unwrap_or_else(|| panic!("no form with a token: {html}"))
        .to_string()
}

fn purge_world() -> Served {
    let mut e: Vec<Entry> = (0..7)
        .map(|i| sched("alice", &format!("p-{i}"), "P", later(60_000 + i)))
        .collect();
    e.push(sched("bob", "p-bob", "P", later(60_000)));
    serve_with(e)
}

#[test]
fn a_purge_is_confirmed_with_the_count_its_user_sees() {
    let s = purge_world();
    let (status, page) = s.get("/purge?queue=P", Some(ALICE));
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("<strong id=\"purge-count\">7</strong>"),
        "{page}"
    );
    assert!(page.contains("name=\"expected\" value=\"7\""), "{page}");
    let (_, page) = s.get("/purge?queue=P", Some(ROOT));
    assert!(
        page.contains("<strong id=\"purge-count\">8</strong>"),
        "{page}"
    );
    let (status, page) = s.get("/purge", Some(ROOT));
    assert_eq!(status, 400, "a purge names its queue: {page}");
    let (status, page) = s.get("/purge?exchange=x&routing_key=k", Some(ROOT));
    assert_eq!(status, 400, "{page}");
    assert!(page.contains("due queue"), "{page}");
}

#[test]
fn posts_need_the_users_token_and_this_origin() {
    let s = purge_world();
    let token = token_of(&s.get("/message?id=p-1", Some(ALICE)).1);
    let origin = format!("http://{}", s.addr);
    // no Origin, no Referer
    let (status, body) = s.post("/message/reschedule", ALICE, None, &[("csrf", &token)]);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("no Origin or Referer"), "{body}");
    // another site
    let evil = Some("http://evil.example");
    let (status, body) = s.post("/message/cancel", ALICE, evil, &[("csrf", &token)]);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("evil.example"), "{body}");
    // this origin, no token or another user's token
    let (status, body) = s.post("/message/cancel", ALICE, Some(&origin), &[("id", "p-1")]);
    assert_eq!(status, 403);
    assert!(body.contains("token"), "{body}");
    let bob_token = token_of(&s.get("/message?id=p-bob", Some(BOB)).1);
    let form = [("csrf", bob_token.as_str()), ("queue", "P")];
    assert_eq!(s.post("/purge", ALICE, Some(&origin), &form).0, 403);
    // both right: the action itself answers (here: a time it cannot read)
    let form = [("csrf", token.as_str()), ("id", "p-1"), ("at", "someday")];
    let (status, body) = s.post("/message/reschedule", ALICE, Some(&origin), &form);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("&#x27;someday&#x27; is not a time"), "{body}");
    // a body over the cap
    let big = "x".repeat(MAX_BODY + 1);
    let form = [("csrf", token.as_str()), ("id", big.as_str())];
    assert_eq!(
        s.post("/message/cancel", ALICE, Some(&origin), &form).0,
        413
    );
}

/// Wrong passwords pass as 401 five times; then the user, and the address, get 429 with
/// Retry-After, the right password too (it is not asked of the broker while blocked).
#[test]
fn too_many_wrong_passwords_are_answered_429_with_retry_after() {
    let s = serve_with(vec![sched("alice", "a-1", "A", later(60_000))]);
    for _ in 0..crate::pending::auth::throttle::FREE_FAILURES {
        assert_eq!(s.get("/", Some(("alice", "wrong"))).0, 401);
    }
    for who in [ALICE, BOB] {
        let mut r = agent()
            .get(&s.url("/"))
            .header("Authorization", &basic(who.0, who.1))
            .call()
            .unwrap();
        assert_eq!(r.status().as_u16(), 429, "{}", who.0);
        assert!(r.headers().get("retry-after").is_some());
        let body = r.body_mut().read_to_string().unwrap();
        assert!(body.contains("Too many wrong passwords"), "{body}");
    }
}
