//! `pending` against a real RabbitMQ: the follower's index lists what a publisher scheduled,
//! shows it, and drops it from pending when it is cancelled, run or purged; a reschedule
//! moves it; a user sees only its own and an admin everything; the HTTP API wants a login.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::ops::control::PurgeScope;
use amqp_delay::ops::control::Reschedule;
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Outcome};
use amqp_delay_cli::pending::auth::throttle;
use amqp_delay_cli::pending::follow::{self, FollowOptions, Status};
use amqp_delay_cli::pending::http::{Api, listen, router};
use amqp_delay_cli::pending::service::{Query, Service};
use amqp_delay_cli::pending::wire::RowOut;
use amqp_delay_cli::pending_index::{Options, PendingIndex, Viewer};
use tokio::sync::oneshot;

use crate::harness::*;
use crate::worker::{Scripted, retry, spawn_worker};

mod attacks;

/// A follower over an index file of its own, and the service on it.
struct Indexed {
    service: Service,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<amqp_delay::Result<()>>,
    path: PathBuf,
}

impl Indexed {
    async fn start(settings: &Settings) -> Indexed {
        let path = temp_path(&settings.prefix, "pending.db");
        let ix = PendingIndex::open(&path, Options::default()).unwrap();
        let index = Arc::new(Mutex::new(ix));
        let status = Status::new();
        let (tx, rx) = oneshot::channel::<()>();
        let options = FollowOptions {
            poll_end_every: Duration::from_millis(200),
            ..FollowOptions::default()
        };
        let task = tokio::spawn(follow::run(
            settings.clone(),
            index.clone(),
            status.clone(),
            options,
            async move {
                let _ = rx.await;
            },
        ));
        Indexed {
            service: Service::new(settings.clone(), index, status),
            stop: Some(tx),
            task,
            path,
        }
    }

    /// The rows of `q` `viewer` sees now (none while the index is still being rebuilt).
    async fn rows(&self, viewer: Viewer, q: Option<&str>) -> Vec<RowOut> {
        let query = Query {
            queue: q.map(str::to_string),
            limit: Some(1_000),
            ..Query::default()
        };
        self.service
            .list(viewer, &query)
            .await
            .map(|p| p.rows)
            .unwrap_or_default()
    }

    async fn ids(&self, viewer: Viewer, q: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .rows(viewer, Some(q))
            .await
            .into_iter()
            .map(|r| r.id)
            .collect();
        v.sort();
        v
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let r = self.task.await.unwrap();
        assert!(r.is_ok(), "the follower ended with {r:?}");
        for ext in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{ext}", self.path.display()));
        }
    }
}

/// Polls until `ids` are exactly what `q` lists for `viewer`; how long it took.
async fn until_listed(ix: &Indexed, viewer: Viewer, q: &str, ids: &[&str]) -> Duration {
    let started = Instant::now();
    let mut want: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    want.sort();
    let ok = wait_until_async(Duration::from_secs(15), || {
        let (v, want) = (viewer.clone(), want.clone());
        async move { ix.ids(v, q).await == want }
    })
    .await;
    assert!(
        ok,
        "listed {:?}, expected {want:?}",
        ix.ids(viewer.clone(), q).await
    );
    started.elapsed()
}

/// Scheduled messages are listed (the time from confirm to listed printed), shown with their
/// fields and history; a cancelled one and one that ran leave pending, each with its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_messages_are_listed_and_leave_pending_when_cancelled_or_run() {
    let mut env = steering_env(6_000).await;
    let q = env.queue("pending").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let ix = Indexed::start(&env.settings).await;
    let me = Viewer::User("guest".into());
    let p = env.publisher().await;
    let soon = p
        .schedule(Message::new(q.clone(), 3_000, "soon").with_id("soon"))
        .await
        .unwrap();
    let late = p
        .schedule(
            Message::new(q.clone(), 5_500, "late")
                .with_id("late")
                .with_content_type("text/plain")
                .with_headers(tenant("acme")),
        )
        .await
        .unwrap();
    let confirmed = Instant::now();
    let waited = until_listed(&ix, me.clone(), &q, &["late", "soon"]).await;
    println!("confirm to listed (the last of two): {waited:?}");
    let all_confirmed = wait_until_async(Duration::from_secs(10), || async {
        ix.rows(me.clone(), Some(&q))
            .await
            .iter()
            .all(|r| r.state == "pending")
    })
    .await;
    println!("confirm to listed as confirmed: {:?}", confirmed.elapsed());
    assert!(all_confirmed, "{:?}", ix.rows(me.clone(), Some(&q)).await);
    let shown = ix.service.show(me.clone(), "late", None).await.unwrap();
    let m = &shown.messages[0];
    assert_eq!(m.row.owner, "guest");
    assert_eq!(m.row.destination.queue.as_deref(), Some(q.as_str()));
    assert_eq!(m.row.due_at_ms, late.due_at_ms);
    assert_eq!(m.row.content_type.as_deref(), Some("text/plain"));
    assert_eq!(m.row.headers, vec![("tenant".into(), "acme".into())]);
    assert!(!m.row.body_kept && m.body.is_none());
    assert_eq!(m.history[0].event, "scheduled");
    // cancelled: gone from pending, shown as cancelled
    let cancelled = Instant::now();
    ix.service
        .cancel(&env.settings, "late", None)
        .await
        .unwrap();
    until_listed(&ix, me.clone(), &q, &["soon"]).await;
    println!("cancel to gone from pending: {:?}", cancelled.elapsed());
    let shown = ix.service.show(me.clone(), "late", None).await.unwrap();
    assert_eq!(shown.messages[0].row.state, "cancelled");
    // run: gone from pending, its outcome in the history
    let log2 = log.clone();
    assert!(wait_until(Duration::from_secs(10), || !log2.lock().unwrap().is_empty()).await);
    let ran = Instant::now();
    until_listed(&ix, me.clone(), &q, &[]).await;
    println!(
        "ran to gone from pending: {:?} (due {} ms before)",
        ran.elapsed(),
        now_ms().saturating_sub(soon.due_at_ms)
    );
    let shown = ix.service.show(me.clone(), "soon", None).await.unwrap();
    let m = &shown.messages[0];
    assert_eq!(m.row.state, "done");
    assert_eq!(m.history.last().unwrap().event, "done");
    assert!(ix.service.status().lag().describe().is_none(), "caught up");
    p.close().await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    ix.stop().await;
    env.cleanup().await;
}

/// A reschedule of the caller's own message `id` to `due_at_ms`.
fn moving(id: &str, due_at_ms: u64) -> Reschedule {
    Reschedule {
        id: id.into(),
        owner: None,
        due_at_ms,
    }
}

/// A purge covers exactly the matching messages: none of them runs, the others do; a
/// reschedule later runs at the new time and not before; earlier without a kept body is a
/// clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_reschedule_steer_what_runs() {
    let mut env = steering_env(6_000).await;
    let q = env.queue("steer").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let ix = Indexed::start(&env.settings).await;
    let me = Viewer::User("guest".into());
    let p = env.publisher().await;
    let msgs: Vec<Message> = (0..10)
        .map(|i| {
            let t = if i % 2 == 0 { "a" } else { "b" };
            Message::new(q.clone(), 4_000 + i * 10, "x")
                .with_id(format!("{t}-{i}"))
                .with_headers(tenant(t))
        })
        .collect();
    for r in p.schedule_batch(msgs).await {
        r.unwrap();
    }
    let moved = p
        .schedule(Message::new(q.clone(), 3_000, "m").with_id("moved"))
        .await
        .unwrap();
    let all: Vec<String> = (0..10)
        .map(|i| format!("{}-{i}", if i % 2 == 0 { "a" } else { "b" }))
        .chain(["moved".to_string()])
        .collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    until_listed(&ix, me.clone(), &q, &all).await;
    // later: runs at its new time, not before
    let new_due = moved.due_at_ms + 2_000;
    let r = ix
        .service
        .reschedule(&env.settings, &moving("moved", new_due))
        .await
        .unwrap();
    assert!(!r.resent);
    // earlier without the body: a clear error
    let e = ix
        .service
        .reschedule(&env.settings, &moving("a-0", now_ms() + 100))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("can only be moved later") && e.contains("journal.keep_body"),
        "{e}"
    );
    let purge = PurgeScope {
        header: Some(("tenant".into(), "a".into())),
        ..PurgeScope::queue(q.clone())
    };
    let out = ix
        .service
        .purge(&env.settings, &purge, false)
        .await
        .unwrap();
    assert_eq!(out.covered, 5);
    until_listed(
        &ix,
        me.clone(),
        &q,
        &["b-1", "b-3", "b-5", "b-7", "b-9", "moved"],
    )
    .await;
    let shown = ix.service.show(me.clone(), "moved", None).await.unwrap();
    assert_eq!(shown.messages[0].row.due_at_ms, new_due);
    assert_eq!(shown.messages[0].history[1].event, "rescheduled");
    let log2 = log.clone();
    assert!(
        wait_until(Duration::from_secs(15), || log2.lock().unwrap().len() >= 6).await,
        "the five of tenant b and the moved one run"
    );
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let runs = log.lock().unwrap().clone();
    let mut ran: Vec<&str> = runs.iter().map(|r| r.0.as_str()).collect();
    ran.sort();
    assert_eq!(ran, ["b-1", "b-3", "b-5", "b-7", "b-9", "moved"]);
    let at = runs.iter().find(|r| r.0 == "moved").unwrap().2;
    assert!(
        at >= new_due,
        "ran {} ms before its new due time",
        new_due - at
    );
    until_listed(&ix, me.clone(), &q, &[]).await;
    p.close().await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    ix.stop().await;
    env.cleanup().await;
}

/// A publisher that dies between flushes hides no confirmed message: a steady flow of
/// concurrent schedules to a worker's queue (their intents queued while they linger, written
/// a few batches to a record), then the publisher's connection is gone before it writes the
/// confirmation of its last flushes. `pending` lists every message whose schedule was
/// confirmed (those of the last flushes as unconfirmed), and each one runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_dies_between_flushes_hides_no_confirmed_message() {
    use futures::StreamExt;
    let mut env = steering_env(6_000).await;
    let q = env.queue("died").await;
    env.parked_queue(&q);
    amqp_delay::Topology::new(env.layout())
        .declare_batch_marker(&env.conn, &q)
        .await
        .unwrap();
    let ix = Indexed::start(&env.settings).await;
    let me = Viewer::User("guest".into());
    let conn = Arc::new(connect().await);
    let p = amqp_delay::Publisher::with_connection(conn.clone(), env.layout(), &env.settings)
        .await
        .unwrap();
    let n = 300u64;
    let scheduled: Vec<String> = futures::stream::iter(0..n)
        .map(|i| {
            let (p, q) = (&p, q.clone());
            async move {
                let m = Message::new(q, 4_000 + (i % 100) * 10, "x").with_id(format!("d{i}"));
                p.schedule(m).await.unwrap().message_id
            }
        })
        .buffer_unordered(50)
        .collect()
        .await;
    // the crash: nothing this publisher would write from now on reaches the broker
    let _ = conn.close(320, "died".into()).await;
    drop(p);
    let ids: Vec<&str> = scheduled.iter().map(String::as_str).collect();
    until_listed(&ix, me.clone(), &q, &ids).await;
    let unconfirmed = ix
        .rows(me.clone(), Some(&q))
        .await
        .iter()
        .filter(|r| r.state == "unconfirmed")
        .count();
    println!("{unconfirmed} of {n} listed as unconfirmed after the crash");
    assert!(
        unconfirmed > 0,
        "every flush was confirmed before the crash; the test proves nothing"
    );
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let log2 = log.clone();
    let all_ran = wait_until(Duration::from_secs(20), || {
        log2.lock().unwrap().len() >= n as usize
    })
    .await;
    assert!(all_ran, "ran {} of {n}", log.lock().unwrap().len());
    until_listed(&ix, me.clone(), &q, &[]).await;
    for id in &ids {
        let shown = ix.service.show(me.clone(), id, None).await.unwrap();
        assert_eq!(shown.messages[0].row.state, "done", "{id}");
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    ix.stop().await;
    env.cleanup().await;
}

/// Users of the main broker for one test, deleted when dropped.
struct Users(Vec<String>);

impl Users {
    fn create(prefix: &str, names: &[&str]) -> Users {
        let mut made = Vec::new();
        for n in names {
            let user = format!("{prefix}-{n}");
            let ctl = |args: &[&str]| {
                let out = rabbitmqctl().args(args).output().expect("rabbitmqctl");
                assert!(
                    out.status.success(),
                    "rabbitmqctl {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            ctl(&["add_user", &user, &format!("{user}-pw")]);
            made.push(user.clone());
            let mine = format!("^{prefix}.*");
            ctl(&["set_permissions", "-p", "/", &user, &mine, &mine, &mine]);
        }
        Users(made)
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        for u in &self.0 {
            let _ = rabbitmqctl().args(["delete_user", u]).output();
        }
    }
}

fn url_as(user: &str) -> String {
    let base = url::Url::parse(&broker_url()).unwrap();
    let mut u = base.clone();
    u.set_username(user).unwrap();
    u.set_password(Some(&format!("{user}-pw"))).unwrap();
    u.to_string()
}

/// Two users schedule: each sees only its own (through the service, the HTTP API and the CLI
/// without an index server), an admin sees both; the HTTP API answers 401 without a login or
/// with a wrong one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_sees_only_its_own_and_an_admin_everything() {
    let mut env = steering_env(6_000).await;
    let q = env.queue("who").await;
    let prefix = env.settings.prefix.clone();
    let users = Users::create(&prefix, &["alice", "root"]);
    let (alice, root) = (users.0[0].clone(), users.0[1].clone());
    env.settings.trust.admins = vec![root.clone()];
    let ix = Indexed::start(&env.settings).await;
    for (who, id) in [(&alice, "of-alice"), (&root, "of-root")] {
        let s = Settings {
            url: url_as(who),
            ..env.settings.clone()
        };
        let p = amqp_delay::Publisher::connect(&s).await.unwrap();
        p.schedule(Message::new(q.clone(), 5_000, "x").with_id(id))
            .await
            .unwrap();
        p.close().await;
    }
    let waited = until_listed(&ix, Viewer::Admin, &q, &["of-alice", "of-root"]).await;
    println!("two users' messages listed within {waited:?}");
    let as_alice = ix.service.viewer(&alice);
    assert_eq!(ix.ids(as_alice.clone(), &q).await, ["of-alice"]);
    assert_eq!(ix.service.viewer(&root), Viewer::Admin);
    assert!(ix.service.show(as_alice, "of-root", None).await.is_err());

    // the HTTP API, with alice's login, the admin's, none and a wrong one
    let api = Arc::new(Api::new(ix.service.clone(), env.settings.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(listen::serve(listener, router(api), std::future::pending()));
    let get = |auth: Option<(String, String)>| {
        let url = format!("http://{addr}/api/v1/pending?queue={q}");
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into();
            let mut req = agent.get(&url);
            if let Some((u, pw)) = auth {
                use base64::Engine as _;
                let token = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{pw}"));
                req = req.header("authorization", &format!("Basic {token}"));
            }
            let mut r = req.call().unwrap();
            let challenge = r
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().unwrap().to_string());
            (
                r.status().as_u16(),
                challenge,
                r.body_mut().read_to_string().unwrap(),
            )
        })
    };
    let (status, challenge, _) = get(None).await.unwrap();
    assert_eq!(status, 401);
    assert!(challenge.unwrap().starts_with("Basic"));
    let (status, _, _) = get(Some((alice.clone(), "wrong".into()))).await.unwrap();
    assert_eq!(status, 401);
    let (status, _, body) = get(Some((alice.clone(), format!("{alice}-pw"))))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["of-alice"]);
    let (status, _, body) = get(Some((root.clone(), format!("{root}-pw"))))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["rows"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // a reschedule through the API, as alice: one JSON body, parsed once ("delay" is from
    // now: 5.5 s, within the topology's 6); her own message moves, the admin's is not hers to find
    let post = |id: &str, body: &str| {
        let url = format!("http://{addr}/api/v1/pending/{id}/reschedule");
        let (user, body) = (alice.clone(), body.to_string());
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into();
            use base64::Engine as _;
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{user}-pw"));
            let mut r = agent
                .post(&url)
                .header("authorization", &format!("Basic {token}"))
                .header("content-type", "application/json")
                .send(body.as_bytes())
                .unwrap();
            (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
        })
    };
    let asked = now_ms();
    let (status, body) = post("of-alice", r#"{"delay": 5500}"#).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let out: serde_json::Value = serde_json::from_str(&body).unwrap();
    let due = out["due_at_ms"].as_u64().unwrap();
    assert!(
        due >= asked + 5_500 && due <= now_ms() + 5_500,
        "moved to {due}, asked at {asked}: {body}"
    );
    assert_eq!(out["action"], "rescheduled", "{body}");
    let (status, body) = post("of-root", r#"{"delay": "5s"}"#).await.unwrap();
    assert_eq!(status, 404, "{body}");
    let (status, body) = post("of-alice", r#"{"delay": "20s", "at": 5}"#)
        .await
        .unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("give one of"), "{body}");
    // wrong passwords checked by the broker: five are 401s (alice's above, and four more),
    // then this address is throttled, whoever it names
    let stranger = format!("{prefix}-nobody");
    for _ in 1..throttle::FREE_FAILURES {
        let (status, _, _) = get(Some((stranger.clone(), "guess".into()))).await.unwrap();
        assert_eq!(status, 401);
    }
    let (status, _, body) = get(Some((alice.clone(), "guess".into()))).await.unwrap();
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("Too many wrong passwords"), "{body}");
    server.abort();

    // the CLI without an index server reads the streams itself, as its user
    let cfg = env.write_config(&format!("[trust]\nadmins = [\"{root}\"]\n"));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args(["pending", "list", "--queue", &q, "--json"])
        .env("AMQP_URL", url_as(&alice))
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(page["rows"].as_array().unwrap().len(), 1, "{page}");
    assert_eq!(page["rows"][0]["id"], "of-alice");
    // bad input: exit 2 with what is wrong
    for args in [
        &["pending", "list", "--due-after", "soon"][..],
        &["pending", "show", ""],
        &["pending", "purge", "--queue", &q],
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .env("AMQP_URL", url_as(&alice))
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("RFC 3339") || err.contains("1 to 255 bytes") || err.contains("--yes"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_file(cfg);
    ix.stop().await;
    drop(users);
    env.cleanup().await;
}
