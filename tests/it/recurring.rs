//! Recurring schedules kept by the broker: each a control-stream record of its owner, seen
//! and steered by its owner and the admins only (every user with its documented permission
//! set, on our own test node, where users are created); `recurring serve` publishes each tick
//! once, as an ordinary delayed message named by its tick, across a kill -9 of the active
//! replica.

use std::time::Duration;

use crate::harness::*;
use crate::permissions::{cli_as, documented_sets, set_of, user};
use crate::trust::world;

/// `recurring list --json` as `role`: (owner, name, paused) of each line.
async fn listed(w: &crate::trust::World, role: &str) -> Vec<(String, String, bool)> {
    let out = cli_as(
        "recurring list",
        &w.cfg,
        &w.url(role),
        &["recurring", "list", "--json"],
    )
    .await;
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["owner"].as_str().unwrap().to_string(),
                v["name"].as_str().unwrap().to_string(),
                v["paused"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// Runs `delay-publisher recurring ARGS` as `role`; whether it succeeded, and its stderr.
async fn try_as(w: &crate::trust::World, role: &str, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&w.cfg)
        .args(["--url", &w.url(role), "recurring"])
        .args(args)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Adds schedule `name` (02:00 in Berlin) as `role`; its output.
pub(crate) async fn add_as(w: &crate::trust::World, role: &str, name: &str) -> String {
    let args = [
        "recurring",
        "add",
        name,
        "--cron",
        "0 2 * * *",
        "--tz",
        "Europe/Berlin",
        "--queue",
        &w.q,
        "--body",
        "hi",
    ];
    cli_as("recurring add", &w.cfg, &w.url(role), &args).await
}

/// [`world`] with alice and mallory holding the recurring set each, as permissions.sh prints
/// it, and the world's queue declared by the admin.
pub(crate) async fn tenants() -> crate::trust::World {
    tenants_of(world().await).await
}

/// [`tenants`] in `w`.
async fn tenants_of(w: crate::trust::World) -> crate::trust::World {
    let (alice, mallory) = (w.user("alice"), w.user("mallory"));
    let sets = documented_sets(&[
        "--prefix",
        &w.p,
        "--user-prefix",
        &w.p,
        "--recurring",
        &alice,
        "--recurring",
        &mallory,
    ]);
    for who in [&alice, &mallory] {
        let (_, c, wr, r) = set_of(&sets, who);
        user(who, c, wr, r);
    }
    cli_as(
        "declare --queue",
        &w.cfg,
        &w.url("adm"),
        &["declare", "--queue", &w.q],
    )
    .await;
    w
}

#[tokio::test]
async fn an_owners_schedule_is_invisible_and_unsteerable_to_another_tenant() {
    let w = tenants().await;
    let (alice, mallory) = (w.user("alice"), w.user("mallory"));
    let out = add_as(&w, "alice", "nightly").await;
    assert!(out.contains("next tick"), "{out}");
    add_as(&w, "mallory", "nightly").await;
    assert_eq!(
        listed(&w, "alice").await,
        [(alice.clone(), "nightly".into(), false)]
    );
    assert_eq!(
        listed(&w, "mallory").await,
        [(mallory.clone(), "nightly".into(), false)]
    );

    // an add past the owner's cap is refused before it is written, with the cap named (every
    // reader would skip it); the setting is the one OPERATIONS documents
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .env("AMQP_DELAY_TRUST__MAX_SCHEDULES_PER_USER", "1")
        .arg("--config")
        .arg(&w.cfg)
        .args(["--url", &w.url("mallory"), "recurring", "add", "second"])
        .args(["--cron", "@daily", "--queue", &w.q])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("trust.max_schedules_per_user"),
        "{err}"
    );
    assert_eq!(listed(&w, "mallory").await.len(), 1);

    // mallory cannot name alice's: --owner is an admin's
    let (ok, err) = try_as(&w, "mallory", &["pause", "nightly", "--owner", &alice]).await;
    assert!(!ok && err.contains("admin"), "{err}");
    // mallory's own remove takes only mallory's schedule
    cli_as(
        "remove",
        &w.cfg,
        &w.url("mallory"),
        &["recurring", "remove", "nightly"],
    )
    .await;
    assert!(listed(&w, "mallory").await.is_empty());
    assert_eq!(
        listed(&w, "alice").await,
        [(alice.clone(), "nightly".into(), false)]
    );

    // the admin sees and steers alice's
    let args = ["recurring", "pause", "nightly", "--owner", &alice];
    cli_as("admin's pause", &w.cfg, &w.url("adm"), &args).await;
    assert_eq!(
        listed(&w, "adm").await,
        [(alice.clone(), "nightly".into(), true)]
    );
    cli_as(
        "resume",
        &w.cfg,
        &w.url("alice"),
        &["recurring", "resume", "nightly"],
    )
    .await;
    assert_eq!(
        listed(&w, "alice").await,
        [(alice.clone(), "nightly".into(), false)]
    );

    // a definition no cron or zone makes is refused before anything is written
    for (bad, why) in [
        (
            [
                "--cron",
                "61 * * * *",
                "--tz",
                "UTC",
                "--queue",
                w.q.as_str(),
            ],
            "cron",
        ),
        (
            [
                "--cron",
                "@daily",
                "--tz",
                "Mars/Olympus",
                "--queue",
                w.q.as_str(),
            ],
            "time zone",
        ),
    ] {
        let mut args = vec!["add", "bad"];
        args.extend(bad);
        let (ok, err) = try_as(&w, "alice", &args).await;
        assert!(!ok && err.contains(why), "{args:?}: {err}");
    }
    assert_eq!(listed(&w, "alice").await.len(), 1);
}

/// A `delay-publisher recurring serve` process, killed when dropped.
struct Serve {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl Serve {
    fn start(env: &Env, cfg: &std::path::Path, name: &str) -> Serve {
        Serve::start_with(env, cfg, name, &["--ahead", "3s"])
    }

    fn start_with(env: &Env, cfg: &std::path::Path, name: &str, args: &[&str]) -> Serve {
        let log = std::env::temp_dir().join(format!("{}-serve-{name}.log", env.settings.prefix));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(cfg)
            .args(["--url", &env.settings.url, "recurring", "serve"])
            .args(args)
            .env("RUST_LOG", "warn,amqp_delay=info,amqp_delay_cli=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting delay-publisher recurring serve");
        Serve { child, log }
    }

    /// SIGKILL: no chance to finish anything.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_file(&self.log);
    }
}

#[tokio::test]
async fn each_tick_arrives_once_never_early_with_its_id_across_a_kill_9_of_the_active_replica() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("ticks").await;
    let cfg = env.write_config("");
    let add = [
        "recurring",
        "add",
        "every2",
        "--cron",
        "*/2 * * * * *",
        "--queue",
        &q,
        "--body",
        "tick",
        "--header",
        "kind=report",
    ];
    let (code, _, err) = publisher_cli(&cfg, &add).await;
    assert_eq!(code, Some(0), "{err}");
    let mut a = Serve::start(&env, &cfg, "a");
    let mut got = env.expect(&q, 2).await;
    assert_eq!(
        got.len(),
        2,
        "the first replica published nothing:\n{}",
        a.log()
    );
    // a second replica stands by; the active one is killed: the second takes over
    let mut b = Serve::start(&env, &cfg, "b");
    a.kill9();
    let more = env.expect(&q, 4).await;
    assert_eq!(more.len(), 4, "no takeover:\n{}", b.log());
    got.extend(more);
    b.kill9();
    // what was published ahead arrives too
    got.extend(
        collect(
            &env.conn,
            &q,
            usize::MAX,
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .await,
    );

    let mut ticks = Vec::new();
    for m in &got {
        let tick = m.int_header("x-delay-recurring-tick").expect("its tick") as u64;
        assert_eq!(m.id(), amqp_delay::recurring::occurrence_id("every2", tick));
        assert_eq!(
            m.text_header("x-delay-recurring").as_deref(),
            Some("every2")
        );
        assert_eq!(m.text_header("kind").as_deref(), Some("report"));
        assert_eq!(m.body, b"tick");
        assert!(
            m.arrived_ms >= tick,
            "{} arrived early, at {}",
            m.id(),
            m.arrived_ms
        );
        ticks.push(tick);
    }
    ticks.sort_unstable();
    let (first, last) = (ticks[0], ticks[ticks.len() - 1]);
    let every: Vec<u64> = (first..=last).step_by(2_000).collect();
    assert_eq!(ticks, every, "a tick missing or run twice");
    env.cleanup().await;
}

#[tokio::test]
async fn a_paused_schedule_runs_no_tick_until_resumed_and_its_paused_ticks_never() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("paused").await;
    let cfg = env.write_config("");
    let add = [
        "recurring",
        "add",
        "each",
        "--cron",
        "* * * * * *",
        "--queue",
        &q,
    ];
    let (code, _, err) = publisher_cli(&cfg, &add).await;
    assert_eq!(code, Some(0), "{err}");
    let serve = Serve::start(&env, &cfg, "p");
    let mut got = env.expect(&q, 2).await;
    assert_eq!(got.len(), 2, "nothing published:\n{}", serve.log());
    let (code, _, err) = publisher_cli(&cfg, &["recurring", "pause", "each"]).await;
    assert_eq!(code, Some(0), "{err}");
    let paused_at = amqp_delay::time::now_ms();
    // what was published before the pause (at most the topology's longest delay ahead, 1.5 s,
    // and one round of the scheduler) still arrives; nothing after it
    got.extend(
        collect(
            &env.conn,
            &q,
            usize::MAX,
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .await,
    );
    let resuming_at = amqp_delay::time::now_ms();
    let (code, _, err) = publisher_cli(&cfg, &["recurring", "resume", "each"]).await;
    assert_eq!(code, Some(0), "{err}");
    let after = env.expect(&q, 2).await;
    assert_eq!(after.len(), 2, "nothing after the resume:\n{}", serve.log());
    let tick = |m: &Received| m.int_header("x-delay-recurring-tick").unwrap() as u64;
    for m in &got {
        assert!(tick(m) <= paused_at + 2_500, "{} ran while paused", m.id());
    }
    for m in &after {
        assert!(
            tick(m) > resuming_at,
            "{}: a paused tick ran after the resume",
            m.id()
        );
    }
    env.cleanup().await;
}

/// `pending serve`'s API on a free port, logins checked by the world's broker, the admin its
/// `trust.admins`; its address.
async fn api_of(w: &crate::trust::World) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use amqp_delay_cli::pending::follow::Status;
    use amqp_delay_cli::pending::http::{Api, listen, router};
    use amqp_delay_cli::pending::service::Service;
    use amqp_delay_cli::pending_index::{Options, PendingIndex};
    use std::sync::{Arc, Mutex};
    let settings = w.as_role("adm");
    let ix = PendingIndex::open(std::path::Path::new(":memory:"), Options::default()).unwrap();
    let service = Service::new(settings.clone(), Arc::new(Mutex::new(ix)), Status::new());
    let api = Arc::new(Api::new(service, settings));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = listen::serve(listener, router(api), std::future::pending()).await;
    });
    (addr, server)
}

/// `METHOD path` with `body` as `user` (password `<user>-pw`); the status and the JSON.
pub(crate) async fn call(
    addr: std::net::SocketAddr,
    method: &'static str,
    path: &str,
    user: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    use base64::Engine as _;
    let url = format!("http://{addr}{path}");
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{user}-pw"));
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let auth = format!("Basic {token}");
        let mut r = match (method, body) {
            ("GET", _) => agent.get(&url).header("authorization", &auth).call(),
            (_, Some(b)) => agent
                .post(&url)
                .header("authorization", &auth)
                .header("content-type", "application/json")
                .send(b.to_string()),
            (_, None) => agent.post(&url).header("authorization", &auth).send_empty(),
        }
        .unwrap();
        let text = r.body_mut().read_to_string().unwrap();
        let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (r.status().as_u16(), v)
    })
    .await
    .unwrap()
}

/// (owner, name, paused) of each schedule of a list answer.
pub(crate) fn rows(v: &serde_json::Value) -> Vec<(String, String, bool)> {
    v["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["owner"].as_str().unwrap().to_string(),
                s["name"].as_str().unwrap().to_string(),
                s["paused"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// The API steers schedules as the login, with the CLI's code: alice adds, lists, shows,
/// pauses, resumes, runs now and removes her own; mallory sees none of hers and cannot name
/// them; the admin sees and steers everyone's; bad definitions are 400 before anything is
/// written.
#[tokio::test]
async fn the_api_steers_schedules_as_the_login_and_no_further() {
    let w = tenants().await;
    let (alice, mallory, adm) = (w.user("alice"), w.user("mallory"), w.user("adm"));
    let (addr, server) = api_of(&w).await;
    let def = serde_json::json!({
        "name": "nightly", "cron": "0 2 * * *", "tz": "Europe/Berlin", "queue": w.q,
        "body": "hi", "headers": {"kind": "report"}
    });
    let (status, out) = call(addr, "POST", "/api/v1/schedules", &alice, Some(def)).await;
    assert_eq!(status, 201, "{out}");
    assert!(
        out["next_tick"].as_str().unwrap().ends_with(":00:00Z"),
        "{out}"
    );
    let (status, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(rows(&out), [(alice.clone(), "nightly".into(), false)]);
    let (status, one) = call(addr, "GET", "/api/v1/schedules/nightly", &alice, None).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["next_ticks"].as_array().unwrap().len(), 5, "{one}");
    assert_eq!(one["headers"], serde_json::json!([["kind", "report"]]));

    // mallory: none of alice's, and naming her is refused
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &mallory, None).await;
    assert!(rows(&out).is_empty(), "{out}");
    let (status, _) = call(addr, "GET", "/api/v1/schedules/nightly", &mallory, None).await;
    assert_eq!(status, 404);
    let owner = serde_json::json!({ "owner": alice });
    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/nightly/pause",
        &mallory,
        Some(owner.clone()),
    )
    .await;
    assert_eq!(status, 400, "{out}");
    assert!(out["error"].as_str().unwrap().contains("admin"), "{out}");

    // alice pauses and resumes; the admin pauses hers, naming her
    for (who, action, body, paused) in [
        (&alice, "pause", None, true),
        (&alice, "resume", None, false),
        (&adm, "pause", Some(owner.clone()), true),
    ] {
        let path = format!("/api/v1/schedules/nightly/{action}");
        let (status, out) = call(addr, "POST", &path, who, body).await;
        assert_eq!(status, 200, "{action}: {out}");
        let (_, out) = call(addr, "GET", "/api/v1/schedules", &adm, None).await;
        assert_eq!(rows(&out), [(alice.clone(), "nightly".into(), paused)]);
    }
    // run-now: one occurrence, published as alice, named by this second
    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/nightly/run-now",
        &alice,
        None,
    )
    .await;
    assert_eq!(status, 200, "{out}");
    assert!(
        out["sent"].as_str().unwrap().starts_with("nightly@"),
        "{out}"
    );
    // the admin's run of alice's schedule is alice's message (its id a second later): the
    // journal names her as its owner, which every reader believes of an admin
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/nightly/run-now",
        &adm,
        Some(owner.clone()),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    let by_admin = out["sent"].as_str().unwrap().to_string();
    let (by, named) = journaled_owner(&w, &by_admin).await;
    assert_eq!(
        (by.as_deref(), named.as_deref()),
        (Some(adm.as_str()), Some(alice.as_str())),
        "{by_admin}: published by the admin for alice"
    );
    let trust = amqp_delay::ops::trust::Trust::new(None, &w.as_role("alice").trust);
    assert_eq!(
        trust.owner(by.as_deref(), named.as_deref()).as_deref(),
        Some(alice.as_str())
    );

    // what no schedule can be: 400, and nothing written
    for (bad, why) in [
        (
            serde_json::json!({"name": "bad", "cron": "61 * * * *", "queue": w.q}),
            "cron",
        ),
        (
            serde_json::json!({"name": "bad", "cron": "@daily", "tz": "Mars/Olympus", "queue": w.q}),
            "time zone",
        ),
        (
            serde_json::json!({"name": "bad", "cron": "@daily", "queue": w.q, "x": 1}),
            "unknown field",
        ),
        (
            serde_json::json!({"name": "bad", "cron": "@daily", "queue": w.q, "headers": {"x-delay-ms": "1"}}),
            "reserved",
        ),
    ] {
        let (status, out) = call(addr, "POST", "/api/v1/schedules", &alice, Some(bad)).await;
        assert_eq!(status, 400, "{out}");
        assert!(out["error"].as_str().unwrap().contains(why), "{why}: {out}");
    }
    // the console's Schedules page: alice's resume button, mallory's empty page
    let console = Console::start(&w).await;
    let page = console.get("/schedules", &alice).await;
    assert!(
        page.contains("nightly") && page.contains(">Resume<"),
        "{page}"
    );
    assert!(page.contains("<code>0 2 * * *</code>"), "{page}");
    assert!(
        !console
            .get("/schedules", &mallory)
            .await
            .contains("nightly")
    );
    let token = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|t| t.split('"').next())
        .unwrap()
        .to_string();
    let form = [
        ("csrf", token.as_str()),
        ("name", "nightly"),
        ("owner", alice.as_str()),
    ];
    let (status, done) = console.post("/schedules/resume", &alice, &form).await;
    assert_eq!(status, 200, "{done}");
    assert!(done.contains("Resumed"), "{done}");
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!(rows(&out), [(alice.clone(), "nightly".into(), false)]);
    assert!(console.get("/schedules", &alice).await.contains(">Pause<"));
    // a form without this user's token is refused, and changes nothing
    let forged = [
        ("csrf", "forged"),
        ("name", "nightly"),
        ("owner", alice.as_str()),
    ];
    let (status, _) = console.post("/schedules/pause", &alice, &forged).await;
    assert_eq!(status, 403);
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!(rows(&out), [(alice.clone(), "nightly".into(), false)]);
    // a page at a time: the first of one names the next, which ends the list
    let def = serde_json::json!({"name": "weekly", "cron": "0 3 * * 1", "queue": w.q});
    let (status, out) = call(addr, "POST", "/api/v1/schedules", &alice, Some(def)).await;
    assert_eq!(status, 201, "{out}");
    let first = console.get("/schedules?limit=1", &alice).await;
    assert!(
        first.contains(">nightly<") && !first.contains(">weekly<"),
        "{first}"
    );
    let next = first
        .split("href=\"/schedules?")
        .nth(1)
        .and_then(|t| t.split('"').next())
        .unwrap()
        .replace("&amp;", "&");
    let second = console.get(&format!("/schedules?{next}"), &alice).await;
    assert!(
        second.contains(">weekly<") && !second.contains(">nightly<"),
        "{second}"
    );
    assert!(!second.contains("Next page"), "{second}");
    for bad in ["limit=0", "limit=101", "after=no-cursor"] {
        let (status, page) = console
            .send(&format!("/schedules?{bad}"), &alice, None)
            .await;
        assert_eq!(status, 400, "{bad}: {page}");
    }
    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/weekly/remove",
        &alice,
        None,
    )
    .await;
    assert_eq!(status, 200, "{out}");
    console.stop().await;

    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/nightly/remove",
        &alice,
        None,
    )
    .await;
    assert_eq!(status, 200, "{out}");
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &adm, None).await;
    assert!(rows(&out).is_empty(), "{out}");
    server.abort();
}

/// `delay-console` of the world on a free port (its index in a file of its own), the admin
/// its `trust.admins`.
struct Console {
    addr: std::net::SocketAddr,
    dir: std::path::PathBuf,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<()>,
}

impl Console {
    async fn start(w: &crate::trust::World) -> Console {
        use amqp_delay_cli::console;
        let dir = std::env::temp_dir().join(format!("{}-console", w.p));
        std::fs::create_dir_all(&dir).unwrap();
        let config = console::Config {
            listen: "127.0.0.1:0".into(),
            index: dir.join("index.db"),
            cache_bytes: 4 << 20,
            tls: None,
        };
        let (app, _index) = console::app(w.as_role("adm"), &config).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let served = tokio::spawn(async move {
            let bound = move |a| {
                let _ = tx.send(a);
            };
            let shutdown = async move {
                let _ = stopped.await;
            };
            console::serve(app, config, bound, shutdown).await.unwrap();
        });
        Console {
            addr: rx.await.unwrap(),
            dir,
            stop,
            served,
        }
    }

    /// A request as `user` (password `<user>-pw`) from the console's own page: the status
    /// and the body.
    async fn send(
        &self,
        path: &str,
        user: &str,
        form: Option<Vec<(String, String)>>,
    ) -> (u16, String) {
        use base64::Engine as _;
        let url = format!("http://{}{path}", self.addr);
        let origin = format!("http://{}", self.addr);
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{user}-pw"));
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into();
            let auth = format!("Basic {token}");
            let mut r = match form {
                None => agent.get(&url).header("authorization", &auth).call(),
                Some(f) => agent
                    .post(&url)
                    .header("authorization", &auth)
                    .header("origin", &origin)
                    .send_form(f.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
            }
            .unwrap();
            (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
        })
        .await
        .unwrap()
    }

    async fn get(&self, path: &str, user: &str) -> String {
        let (status, page) = self.send(path, user, None).await;
        assert_eq!(status, 200, "{page}");
        page
    }

    async fn post(&self, path: &str, user: &str, form: &[(&str, &str)]) -> (u16, String) {
        let form = form
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.send(path, user, Some(form)).await
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.served.await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How many times the journal says each occurrence of schedule `name` was scheduled, by id:
/// the journal read from its start to a barrier of our own.
async fn journaled(env: &Env, name: &str) -> std::collections::BTreeMap<String, usize> {
    use amqp_delay::ops::journal::{self, Record, Start};
    let layout = env.settings.layout().unwrap();
    let nonce = journal::barrier(&env.conn, &layout).await.unwrap();
    let mut tail = journal::tail(&env.conn, &layout, Start::First)
        .await
        .unwrap();
    let mut out = std::collections::BTreeMap::new();
    let prefix = format!("{name}@");
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), tail.next())
            .await
            .expect("the journal's reader stalled")
            .expect("the journal's reader ended")
            .unwrap();
        match e.record {
            Some(Record::Barrier { nonce: n }) if n == nonce => break,
            Some(Record::Scheduled { items, .. }) => {
                for i in items.iter().filter(|i| i.id.starts_with(&prefix)) {
                    *out.entry(i.id.clone()).or_insert(0) += 1;
                }
            }
            _ => {}
        }
    }
    tail.end().await;
    out
}

/// Who wrote message `id` to the journal (broker-checked) and whom it names as its owner:
/// the journal read as the admin from its start to a barrier of our own.
async fn journaled_owner(w: &crate::trust::World, id: &str) -> (Option<String>, Option<String>) {
    use amqp_delay::ops::journal::{self, Record, Start};
    let s = w.as_role("adm");
    let layout = s.layout().unwrap();
    let conn = amqp_delay::ops::connection::Connector::new(&s)
        .unwrap()
        .connect("test journal")
        .await
        .unwrap();
    let nonce = journal::barrier(&conn, &layout).await.unwrap();
    let mut tail = journal::tail(&conn, &layout, Start::First).await.unwrap();
    let mut found = (None, None);
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), tail.next())
            .await
            .expect("the journal's reader stalled")
            .expect("the journal's reader ended")
            .unwrap();
        match e.record {
            Some(Record::Barrier { nonce: n }) if n == nonce => break,
            Some(Record::Scheduled { items, .. }) => {
                if let Some(i) = items.iter().find(|i| i.id == id) {
                    found = (e.by.clone(), i.owner.clone());
                }
            }
            _ => {}
        }
    }
    tail.end().await;
    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    found
}

/// Polls [`journaled`] until it names `n` occurrences of `name` (or a minute passes).
async fn until_journaled(
    env: &Env,
    name: &str,
    n: usize,
) -> std::collections::BTreeMap<String, usize> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = journaled(env, name).await;
        if got.len() >= n || std::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `recurring serve --ahead 400d` against the broker, on two schedules of Europe/Berlin
/// windowed (`--from`/`--until`) onto the real transitions of 2027: every quarter hour from
/// 01:00 to 03:45 local time, within 01:30 and 03:30 (spring) or 03:15 (fall) local. On 28 March the clocks skip 02:00-03:00: the skipped quarter
/// hours and 03:00 fall on the same instant, the change (01:00Z), which runs once. On 31
/// October they repeat 02:00-03:00: its quarter hours run once, on their first pass (00:00Z to
/// 00:45Z), and none during the second (01:00Z to 01:59Z). Each occurrence is journaled once
/// and listed by `pending` under its id; nothing waits for 2027 (they are scheduled ahead, in
/// a topology whose longest delay is 400 days).
#[tokio::test]
async fn ticks_across_the_daylight_saving_changes_of_2027_are_scheduled_once_each() {
    let topology = amqp_delay::TopologySettings {
        radix: 4,
        unit: amqp_delay::time::DurationMs(3_600_000),
        max_delay: amqp_delay::time::DurationMs(400 * 24 * 3_600_000),
        fixed_levels: vec![],
        fixed_shards: 1,
        ..amqp_delay::TopologySettings::default()
    };
    let mut env = Env::new(topology).await;
    // nothing here is to arrive on time: two hours' lateness is within budget
    env.settings.precision = amqp_delay::Precision {
        lateness: amqp_delay::time::DurationMs(7_200_000),
        lateness_ratio: 0.0,
    };
    let q = env.queue("dst").await;
    let cfg = env.write_config("");
    for (name, from, until) in [
        ("spring", "2027-03-28T00:30:00Z", "2027-03-28T01:30:00Z"),
        ("fall", "2027-10-30T23:30:00Z", "2027-10-31T02:15:00Z"),
    ] {
        let add = [
            "recurring",
            "add",
            name,
            "--cron",
            "*/15 1-3 * * *",
            "--tz",
            "Europe/Berlin",
            "--queue",
            &q,
            "--from",
            from,
            "--until",
            until,
        ];
        let (code, _, err) = publisher_cli(&cfg, &add).await;
        assert_eq!(code, Some(0), "{err}");
    }
    let serve = Serve::start_with(&env, &cfg, "dst", &["--ahead", "400days"]);
    let at = |t: &str| format!("{t}:00Z");
    let spring: Vec<String> = [
        "2027-03-28T00:30",
        "2027-03-28T00:45",
        "2027-03-28T01:00",
        "2027-03-28T01:15",
        "2027-03-28T01:30",
    ]
    .iter()
    .map(|t| format!("spring@{}", at(t)))
    .collect();
    let fall: Vec<String> = [
        "2027-10-30T23:30",
        "2027-10-30T23:45",
        "2027-10-31T00:00",
        "2027-10-31T00:15",
        "2027-10-31T00:30",
        "2027-10-31T00:45",
        "2027-10-31T02:00",
        "2027-10-31T02:15",
    ]
    .iter()
    .map(|t| format!("fall@{}", at(t)))
    .collect();
    for (name, want) in [("spring", &spring), ("fall", &fall)] {
        let got = until_journaled(&env, name, want.len()).await;
        let ids: Vec<&String> = got.keys().collect();
        let mut sorted = want.clone();
        sorted.sort();
        assert_eq!(
            ids,
            sorted.iter().collect::<Vec<_>>(),
            "{name}:\n{}",
            serve.log()
        );
        assert!(
            got.values().all(|&n| n == 1),
            "{name}: scheduled more than once: {got:?}"
        );
    }
    // `pending` lists them under their ids (the CLI reading the streams itself)
    let (code, out, err) = publisher_cli(
        &cfg,
        &["pending", "list", "--queue", &q, "--json", "--limit", "100"],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    let page: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed: std::collections::BTreeSet<String> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["id"].as_str().map(str::to_string))
        .collect();
    for id in spring.iter().chain(&fall) {
        assert!(listed.contains(id), "{id} is not listed by pending: {out}");
    }
    drop(serve);
    env.cleanup().await;
}

/// A kill -9 of the active replica between an occurrence's confirm and its mark, just before
/// its tick, replayed exactly: the dead replica's publish (the same user, journaled, confirmed)
/// and no mark. The replica that becomes active finds it in the journal and does not publish
/// it again: that tick runs once, and every later tick once, none missing.
#[tokio::test]
async fn a_tick_published_but_not_marked_before_a_kill_9_runs_once() {
    // the replayed tick is up to 3.2 s ahead
    let mut topology = small_topology();
    topology.max_delay = amqp_delay::time::DurationMs(5_000);
    let mut env = Env::new(topology).await;
    let q = env.queue("once").await;
    let cfg = env.write_config("");
    let add = [
        "recurring",
        "add",
        "every3",
        "--cron",
        "*/3 * * * * *",
        "--queue",
        &q,
    ];
    let (code, _, err) = publisher_cli(&cfg, &add).await;
    assert_eq!(code, Some(0), "{err}");
    // what the dead replica did: the next tick's occurrence published (within the topology's
    // longest delay), confirmed, and then no mark
    let def = amqp_delay::recurring::Definition::new("every3", "*/3 * * * * *", &q, "");
    let ticks = def.check().unwrap();
    let now = amqp_delay::time::now_ms();
    let tick = ticks.next_after(now + 200).unwrap();
    let p = amqp_delay::Publisher::connect(&env.settings).await.unwrap();
    let delay = tick.saturating_sub(amqp_delay::time::now_ms());
    let sent = p
        .schedule(amqp_delay_cli::recurring::occurrence(&def, tick, delay))
        .await
        .unwrap();
    p.close().await;
    let id = amqp_delay::recurring::occurrence_id("every3", tick);
    assert_eq!(sent.message_id, id);
    let serve = Serve::start(&env, &cfg, "once");
    let mut got = env.expect(&q, 3).await;
    assert_eq!(got.len(), 3, "too few ticks:\n{}", serve.log());
    drop(serve);
    got.extend(
        collect(
            &env.conn,
            &q,
            usize::MAX,
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .await,
    );
    each_tick_once_from(&got, tick, 3_000, &id, "");
    // and the journal holds each occurrence once: the dead one's was not published again
    let journaled = journaled(&env, "every3").await;
    assert_eq!(journaled.get(&id), Some(&1), "{journaled:?}");
    assert!(journaled.values().all(|&n| n == 1), "{journaled:?}");
    env.cleanup().await;
}

/// A tenant's replica takes over from one that published a tick and died before marking it.
/// The tenant holds exactly the documented `recurring` set, which cannot read the journal; with
/// `pending.index_url` (a `pending serve` as the documented pending user) the new replica asks
/// that index what its user journaled past the marks, and the tick runs once.
#[tokio::test]
async fn a_tenants_takeover_asks_the_pending_index_and_runs_a_published_tick_once() {
    use amqp_delay::time::now_ms;
    let mut topology = small_topology();
    topology.max_delay = amqp_delay::time::DurationMs(10_000);
    let w = tenants_of(crate::trust::world_of(topology).await).await;
    // pending serve, as the pending user, on a free port
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let index = std::env::temp_dir().join(format!("{}-takeover-index.db", w.p));
    let pending_log = std::env::temp_dir().join(format!("{}-takeover-pending.log", w.p));
    let mut pending = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&w.cfg)
        .args(["--url", &w.url("pending"), "pending", "serve", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--index")
        .arg(&index)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&pending_log).unwrap())
        .spawn()
        .expect("starting pending serve");
    let up = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < up,
            "pending serve did not listen:\n{}",
            std::fs::read_to_string(&pending_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // alice's configuration: the world's, and the index, as OPERATIONS tells
    let cfg = temp_path(&w.p, "takeover-alice.toml");
    let text = std::fs::read_to_string(&w.cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("{text}\n[pending]\nindex_url = \"http://127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    let (ok, err) = try_as(
        &w,
        "alice",
        &["add", "every5", "--cron", "*/5 * * * * *", "--queue", &w.q],
    )
    .await;
    assert!(ok, "{err}");
    // what the dead replica did: the next tick's occurrence (3 to 8 s ahead) published as
    // alice, journaled and confirmed, and then no mark
    let def = amqp_delay::recurring::Definition::new("every5", "*/5 * * * * *", &w.q, "");
    let tick = def.check().unwrap().next_after(now_ms() + 3_000).unwrap();
    let p = amqp_delay::Publisher::connect(&w.as_role("alice"))
        .await
        .unwrap();
    let delay = tick.saturating_sub(now_ms());
    p.schedule(amqp_delay_cli::recurring::occurrence(&def, tick, delay))
        .await
        .unwrap();
    p.close().await;
    let id = amqp_delay::recurring::occurrence_id("every5", tick);
    // the next replica, as alice
    let log = std::env::temp_dir().join(format!("{}-takeover-serve.log", w.p));
    let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args([
            "--url",
            &w.url("alice"),
            "recurring",
            "serve",
            "--ahead",
            "3s",
        ])
        .env("RUST_LOG", "warn,amqp_delay=info,amqp_delay_cli=info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("starting recurring serve");
    let conn = amqp_delay::ops::connection::Connector::new(&w.settings)
        .unwrap()
        .connect("test takeover")
        .await
        .unwrap();
    let mut got = collect(&conn, &w.q, 3, Duration::from_secs(60), Duration::ZERO).await;
    let _ = serve.kill();
    let _ = serve.wait();
    let _ = pending.kill();
    let _ = pending.wait();
    let serve_log = std::fs::read_to_string(&log).unwrap_or_default();
    got.extend(
        collect(
            &conn,
            &w.q,
            usize::MAX,
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .await,
    );
    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    for f in [&log, &pending_log, &index, &cfg] {
        let _ = std::fs::remove_file(f);
    }
    assert!(
        !serve_log.contains("cannot be read back"),
        "the takeover was not checked:\n{serve_log}"
    );
    let from_tick = each_tick_once_from(&got, tick, 5_000, &id, &serve_log);
    assert!(from_tick >= 2, "too few ticks after {id}:\n{serve_log}");
}

/// Asserts that no tick of `got` ran twice and that from `tick` (the replayed one, `id`) on
/// each tick `period_ms` apart ran, none missing; how many ran from `tick` on. On a slow
/// machine serve can start within the grace of a tick before the replayed one and send it
/// once as a catch-up, so those before `tick` are only checked for doubles. `log` is shown
/// on failure.
fn each_tick_once_from(
    got: &[Received],
    tick: u64,
    period_ms: usize,
    id: &str,
    log: &str,
) -> usize {
    let mut ran: Vec<u64> = (got.iter())
        .map(|m| m.int_header("x-delay-recurring-tick").unwrap() as u64)
        .collect();
    ran.sort_unstable();
    let mut once = ran.clone();
    once.dedup();
    assert_eq!(once, ran, "a tick ran twice:\n{log}");
    let from_tick: Vec<u64> = ran.iter().copied().filter(|&t| t >= tick).collect();
    let last = ran.last().copied().unwrap_or(tick);
    let every: Vec<u64> = (tick..=last).step_by(period_ms).collect();
    assert_eq!(
        from_tick, every,
        "the replayed tick {id} ran twice, or a tick is missing:\n{log}"
    );
    from_tick.len()
}
