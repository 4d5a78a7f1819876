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
async fn add_as(w: &crate::trust::World, role: &str, name: &str) -> String {
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

#[tokio::test]
async fn an_owners_schedule_is_invisible_and_unsteerable_to_another_tenant() {
    let w = world().await;
    // alice and mallory: the recurring set of each, as permissions.sh prints it
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
        let log = std::env::temp_dir().join(format!("{}-serve-{name}.log", env.settings.prefix));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(cfg)
            .args([
                "--url",
                &env.settings.url,
                "recurring",
                "serve",
                "--ahead",
                "3s",
            ])
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
