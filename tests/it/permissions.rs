//! The least-privilege permission sets of the README ("Security") hold on a real broker, each
//! user given exactly its documented set: the admin runs `declare --queue Q --worker`,
//! `gateway --declare-only` and `teardown`; a publisher sends and cancels; a worker and a
//! gateway do their job; and a publisher cannot bind a queue of its own to the delivery
//! exchange (which would let it read other destinations' messages). Runs on our own TLS test
//! node's plain port (users are created there, never on the main broker).

use std::time::Duration;

use amqp_delay::{Message, Outcome, Publisher, Settings, Worker};
use lapin::ExchangeKind;
use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;

use crate::harness::*;
use crate::worker::Scripted;

/// The TLS test node's name (`scripts/tls-node.sh`: adtls@localhost, or its 4.x twin).
pub(crate) fn tls_node_name() -> String {
    crate::security::tls_node()["TLS_NODE"].clone()
}

pub(crate) fn ctl(args: &[&str]) {
    let out = rabbitmqctl()
        .args(["-n", &tls_node_name()])
        .args(args)
        .output()
        .expect("rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Creates `user` with `configure`, `write`, `read` regexes on vhost `/`.
pub(crate) fn user(user: &str, configure: &str, write: &str, read: &str) {
    let _ = rabbitmqctl()
        .args(["-n", &tls_node_name(), "delete_user", user])
        .output();
    ctl(&["add_user", user, &format!("{user}-pw")]);
    ctl(&["set_permissions", "-p", "/", user, configure, write, read]);
}

/// A permission set: user, configure, write, read.
pub(crate) type Set = (String, String, String, String);

/// The sets `deploy/rabbitmq/permissions.sh` prints for `args` (on vhost `/`), each as it
/// would run them.
pub(crate) fn documented_sets(args: &[&str]) -> Vec<Set> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/rabbitmq/permissions.sh"
    );
    let out = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut sets = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let words = shell_words::split(line).unwrap();
        if let [_, cmd, _, vhost, who, c, w, r] = &words[..] {
            assert_eq!((cmd.as_str(), vhost.as_str()), ("set_permissions", "/"));
            sets.push((who.clone(), c.clone(), w.clone(), r.clone()));
        }
    }
    sets
}

/// The documented set of `user` among `sets`.
pub(crate) fn set_of<'a>(sets: &'a [Set], user: &str) -> &'a Set {
    sets.iter()
        .find(|s| s.0 == user)
        .unwrap_or_else(|| panic!("permissions.sh printed no set for {user}"))
}

/// Creates every user of `sets` on the test node with exactly its set.
pub(crate) fn apply_sets(sets: &[Set]) {
    for (who, c, w, r) in sets {
        user(who, c, w, r);
    }
}

pub(crate) fn url(user: &str, port: &str) -> String {
    format!("amqp://{user}:{user}-pw@127.0.0.1:{port}/%2f")
}

/// Runs `delay-publisher --config cfg --url url args...`; panics naming `what` unless it
/// succeeds. Returns its stdout.
pub(crate) async fn cli_as(what: &str, cfg: &std::path::Path, url: &str, args: &[&str]) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(cfg)
        .arg("--url")
        .arg(url)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{what} failed with its documented permission set ({args:?}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Removes what the test made on the test node, also after a panic: the topology (as
/// `teardown --force`, with what the control stream names), the queues and the exchange the
/// test declared itself, the users.
pub(crate) struct Cleanup {
    pub(crate) cfg: std::path::PathBuf,
    pub(crate) root: String,
    pub(crate) queues: Vec<String>,
    pub(crate) exchanges: Vec<String>,
    pub(crate) users: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let teardown = |extra: &[&str]| {
            let _ = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
                .arg("--config")
                .arg(&self.cfg)
                .args(["--url", &self.root, "teardown", "--force"])
                .args(extra)
                .output();
        };
        if let Some(q) = self.queues.first() {
            teardown(&["--queue", q]);
        }
        teardown(&[]);
        let (root, queues, exchanges) = (
            self.root.clone(),
            self.queues.clone(),
            self.exchanges.clone(),
        );
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(conn) = amqp_delay::ops::connection::connect(&root, "perm cleanup").await
                else {
                    return;
                };
                if let Ok(ch) = conn.create_channel().await {
                    for q in &queues {
                        let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
                    }
                    for x in &exchanges {
                        let _ = ch
                            .exchange_delete(x.as_str().into(), Default::default())
                            .await;
                    }
                }
                let _ = conn.close(200, "bye".into()).await;
            });
        })
        .join();
        for u in &self.users {
            let _ = rabbitmqctl()
                .args(["-n", &tls_node_name(), "delete_user", u])
                .output();
        }
        let _ = std::fs::remove_file(&self.cfg);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_works_with_its_permission_set_and_no_more() {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    let q = format!("{p}-orders");
    let (ingress, target) = (format!("{p}-delayed"), format!("{p}-target"));
    // the sets the README documents, exactly as permissions.sh prints them
    let sets = documented_sets(&[
        "--prefix",
        &p,
        "--queue",
        &q,
        "--gateway",
        &format!("{ingress}:{target}"),
    ]);
    apply_sets(&sets);
    // a publisher that may also have a queue of its own (configure and read on it)
    let publisher_set = set_of(&sets, &format!("{p}-publisher"));
    user(
        &format!("{p}-pubq"),
        &format!("^{p}-evil$"),
        &publisher_set.2,
        &format!("^{p}-evil$"),
    );
    // the node's own administrator stands for the application, which owns the target exchange
    let root = url("guest", &port).replace("guest-pw", "guest");
    let admin = url(&format!("{p}-admin"), &port);
    let mut settings = Settings {
        url: root.clone(),
        prefix: p.clone(),
        topology: small_topology(),
        ..Settings::default()
    };
    settings.consumer.retry.base = amqp_delay::time::DurationMs(20);
    settings.consumer.retry.jitter = 0.0;
    let cfg = small_config(&p, "perm.toml", "");
    let out = format!("{p}-out");
    let _cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root.clone(),
        queues: vec![
            q.clone(),
            out.clone(),
            format!("{p}-evil"),
            settings.layout().unwrap().parked_queue(&q),
        ],
        exchanges: vec![target.clone()],
        users: ["admin", "publisher", "pubq", "worker", "gateway", "keda"]
            .iter()
            .map(|u| format!("{p}-{u}"))
            .collect(),
    };

    // the admin declares the topology and the worker's queue with what the worker needs (its
    // parking queue, its batch marker, recorded in the control stream)
    cli_as("the admin's declare", &cfg, &admin, &["declare"]).await;
    cli_as(
        "the admin's declare --queue Q --worker",
        &cfg,
        &admin,
        &["declare", "--queue", &q, "--worker"],
    )
    .await;
    let conn = amqp_delay::ops::connection::connect(&root, "perm root")
        .await
        .unwrap();
    let topo = amqp_delay::Topology::new(settings.layout().unwrap());

    // the publisher schedules and cancels with write rights on the tiers and amq.default only
    let pub_url = url(&format!("{p}-publisher"), &port);
    let publisher = Publisher::connect(&Settings {
        url: pub_url.clone(),
        ..settings.clone()
    })
    .await
    .expect("a publisher needs no configure or read right");
    for i in 0..3 {
        publisher
            .schedule(Message::new(q.clone(), 30, format!("m{i}")).with_id(format!("m{i}")))
            .await
            .expect("send works");
    }
    let late = publisher
        .schedule(Message::new(q.clone(), 1400, "cancelled").with_id("m-cancelled"))
        .await
        .expect("send works");
    cli_as(
        "the publisher's cancel",
        &cfg,
        &pub_url,
        &[
            "cancel",
            "--id",
            "m-cancelled",
            "--due-at",
            &late.due_at_ms.to_string(),
        ],
    )
    .await;
    publisher
        .cancel("never-sent", None)
        .await
        .expect("the library's cancel works too");
    // ... and cannot bind a queue of its own to the delivery exchange, even when it may have one
    let pc = amqp_delay::ops::connection::connect(&url(&format!("{p}-pubq"), &port), "perm pub")
        .await
        .unwrap();
    let ch = pc.create_channel().await.unwrap();
    ch.queue_declare(
        format!("{p}-evil").as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .expect("its own queue");
    let bind = ch
        .queue_bind(
            format!("{p}-evil").as_str().into(),
            format!("{p}.deliver").as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await;
    let e = bind.expect_err("the publisher bound its own queue to the delivery exchange");
    assert!(e.to_string().contains("ACCESS_REFUSED"), "{e}");
    let _ = pc.close(200, "bye".into()).await;

    // the worker consumes, retries through the tiers and parks with its set
    let h = Scripted::new(|d| match (d.body.as_slice(), d.attempt) {
        (b"m1", 0) => Outcome::Retry("once".into()),
        (b"m2", _) => Outcome::Permanent("parked".into()),
        _ => Outcome::Success,
    });
    let log = h.log.clone();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::new(Settings {
        url: url(&format!("{p}-worker"), &port),
        ..settings.clone()
    })
    .subscribe(q.clone(), h);
    let counters = worker.counters();
    let run = tokio::spawn(worker.run(async {
        let _ = stop_rx.await;
    }));
    assert!(
        wait_until(Duration::from_secs(15), || log.lock().unwrap().len() >= 4
            && counters
                .cancelled
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 1)
        .await,
        "the worker did not execute (and skip the cancelled message) with its permission set: {:?}",
        log.lock().unwrap()
    );
    let _ = stop.send(());
    run.await.unwrap().expect("the worker ran without errors");
    assert!(
        !log.lock().unwrap().iter().any(|r| r.0 == "m-cancelled"),
        "the cancelled message ran"
    );
    let parked = collect(
        &conn,
        &settings.layout().unwrap().parked_queue(&q),
        1,
        Duration::from_secs(5),
        Duration::from_millis(100),
    )
    .await;
    assert_eq!(parked.len(), 1);

    // the gateway relays with its set (the target is the application's)
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        target.as_str().into(),
        ExchangeKind::Direct,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        out.as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        out.as_str().into(),
        target.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let gw_settings = Settings {
        url: url(&format!("{p}-gateway"), &port),
        gateway: amqp_delay::settings::GatewaySettings::from_flags(
            std::slice::from_ref(&ingress),
            std::slice::from_ref(&target),
        )
        .unwrap(),
        ..settings.clone()
    };
    // the admin declares the pair; the gateway binary then runs as it is deployed
    cli_as(
        "the admin's gateway --declare-only",
        &cfg,
        &admin,
        &[
            "gateway",
            "--declare-only",
            "--ingress",
            &ingress,
            "--target",
            &target,
        ],
    )
    .await;
    let mut gw = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args([
            "--url",
            &gw_settings.url,
            "gateway",
            "--ingress",
            &ingress,
            "--target",
            &target,
        ])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pair = amqp_delay::gateway::Gateway::new(gw_settings.clone())
        .unwrap()
        .pairs()[0]
        .clone();
    let end = std::time::Instant::now() + Duration::from_secs(15);
    while amqp_delay::ops::broker::queue_state(&conn, &pair.due_queue)
        .await
        .unwrap()
        .is_none_or(|s| s.consumers == 0)
    {
        if std::time::Instant::now() > end || gw.try_wait().unwrap().is_some() {
            gw.start_kill().ok();
            let out = gw.wait_with_output().await.unwrap();
            panic!(
                "the gateway did not start with its permission set:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), lapin::types::AMQPValue::LongInt(40));
    ch.basic_publish(
        ingress.as_str().into(),
        "k".into(),
        Default::default(),
        b"via gateway",
        lapin::BasicProperties::default().with_headers(h),
    )
    .await
    .unwrap();
    let got = collect(
        &conn,
        &out,
        1,
        Duration::from_secs(15),
        Duration::from_millis(100),
    )
    .await;
    gw.start_kill().unwrap();
    let gw_out = gw.wait_with_output().await.unwrap();
    assert_eq!(
        got.len(),
        1,
        "the gateway did not relay with its permission set:\n{}",
        String::from_utf8_lossy(&gw_out.stderr)
    );

    // the admin removes it all: the topology, the gateway pair and the batch marker the
    // control stream names
    let pair_exists = || async {
        amqp_delay::ops::broker::exchange_exists(&conn, &ingress)
            .await
            .unwrap()
    };
    assert!(pair_exists().await);
    // the ingress is outside the prefix: teardown deletes it only when the configuration
    // names its pair (a record in the control stream is not enough)
    let cfg_pairs = temp_path(&p, "perm-pairs.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(&format!(
        "\n[[gateway.pairs]]\ningress = \"{ingress}\"\ntarget = \"{target}\"\n"
    ));
    std::fs::write(&cfg_pairs, text).unwrap();
    let said = cli_as(
        "the admin's teardown",
        &cfg_pairs,
        &admin,
        &["teardown", "--force"],
    )
    .await;
    let _ = std::fs::remove_file(&cfg_pairs);
    assert!(
        !pair_exists().await,
        "teardown left the gateway's ingress: {said}"
    );
    let mut markers = topo.layout().markers(&q);
    markers.extend(topo.layout().markers(&pair.due_queue));
    assert_eq!(markers.len(), 4);
    for marker in markers {
        assert!(
            !amqp_delay::ops::broker::exchange_exists(&conn, &marker)
                .await
                .unwrap(),
            "teardown left the batch marker {marker}: {said}"
        );
    }
    assert!(
        amqp_delay::ops::broker::queue_state(&conn, &topo.layout().control_stream())
            .await
            .unwrap()
            .is_none(),
        "teardown left the control stream"
    );

    publisher.close().await;
    let _ = conn.close(200, "bye".into()).await;
}

/// KEDA's user, with the `monitoring` tag and no right in the vhost as permissions.sh sets it
/// up, reads a queue's depth from the management API (what KEDA's rabbitmq trigger asks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_reads_a_queue_depth_with_the_monitoring_tag_alone() {
    let node = crate::security::tls_node();
    let (port, mgmt) = (node["AMQP_PORT"].clone(), node["MGMT_PORT"].clone());
    let p = random_prefix();
    let keda = format!("{p}-keda");
    let sets = documented_sets(&["--prefix", &p]);
    let (_, c, w, r) = set_of(&sets, &keda);
    assert_eq!((c.as_str(), w.as_str(), r.as_str()), ("^$", "^$", "^$"));
    user(&keda, c, w, r);
    ctl(&["set_user_tags", &keda, "monitoring"]);
    let q = format!("{p}-depth");
    let root = url("guest", &port).replace("guest-pw", "guest");
    let _cleanup = Cleanup {
        cfg: temp_path(&p, "keda.toml"),
        root: root.clone(),
        queues: vec![q.clone()],
        exchanges: Vec::new(),
        users: vec![keda.clone()],
    };
    let conn = amqp_delay::ops::connection::connect(&root, "keda test")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    amqp_delay::ops::broker::declare_queue(&ch, &q, FieldTable::default())
        .await
        .unwrap();
    for _ in 0..3 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            b"x",
            Default::default(),
        )
        .await
        .unwrap();
    }
    let api = format!("http://127.0.0.1:{mgmt}/api/queues/%2F/{q}");
    let (user, pw) = (keda.clone(), format!("{keda}-pw"));
    let depth = move || {
        let auth = base64_basic(&user, &pw);
        let mut res = ureq::get(&api)
            .header("authorization", &auth)
            .call()
            .map_err(|e| e.to_string())?;
        let text = res.body_mut().read_to_string().map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        Ok::<_, String>(v["messages"].as_u64())
    };
    let mut last = Err("not asked".to_string());
    for _ in 0..60 {
        last = tokio::task::spawn_blocking(depth.clone()).await.unwrap();
        if last == Ok(Some(3)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(last, Ok(Some(3)), "what KEDA's user read of {q}");
    let _ = conn.close(200, "bye".into()).await;
}

/// An HTTP Basic `authorization` header.
fn base64_basic(user: &str, password: &str) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {b64}")
}

/// A relay (`delay-consumer --queue S --relay R`) with exactly its documented set moves what
/// falls due in S into R, a plain queue whose consumer is not ours; a publisher's message
/// arrives there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_works_with_its_permission_set() {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    let (s, r) = (format!("{p}-staging"), format!("{p}-plain"));
    let sets = documented_sets(&["--prefix", &p, "--relay", &format!("{s}:{r}")]);
    for role in ["admin", "publisher", "relay"] {
        let (who, c, w, rd) = set_of(&sets, &format!("{p}-{role}"));
        user(who, c, w, rd);
    }
    let root = url("guest", &port).replace("guest-pw", "guest");
    let cfg = small_config(&p, "relay.toml", "");
    let parked = Settings {
        prefix: p.clone(),
        topology: small_topology(),
        ..Settings::default()
    }
    .layout()
    .unwrap()
    .parked_queue(&s);
    let _cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root.clone(),
        queues: vec![s.clone(), r.clone(), parked],
        exchanges: Vec::new(),
        users: ["admin", "publisher", "relay"]
            .iter()
            .map(|u| format!("{p}-{u}"))
            .collect(),
    };
    let admin = url(&format!("{p}-admin"), &port);
    cli_as("the admin's declare", &cfg, &admin, &["declare"]).await;
    let args = ["declare", "--queue", &s, "--worker"];
    cli_as(
        "the admin's declare --queue S --worker",
        &cfg,
        &admin,
        &args,
    )
    .await;
    let conn = amqp_delay::ops::connection::connect(&root, "relay test")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    amqp_delay::ops::broker::declare_queue(&ch, &r, FieldTable::default())
        .await
        .unwrap();
    let relay = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(&cfg)
        .args(["--url", &url(&format!("{p}-relay"), &port)])
        .args(["--queue", &s, "--relay", &r])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let publisher = url(&format!("{p}-publisher"), &port);
    let send = [
        "send", "--queue", &s, "--delay", "200", "--id", "relayed", "--body", "r",
    ];
    cli_as("the publisher's send", &cfg, &publisher, &send).await;
    let got = collect(
        &conn,
        &r,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    let out = {
        let mut relay = relay;
        relay.start_kill().ok();
        relay.wait_with_output().await.unwrap()
    };
    let ids: Vec<String> = got.iter().map(Received::id).collect();
    assert_eq!(
        ids,
        ["relayed"],
        "the relay did not relay with its permission set:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = conn.close(200, "bye".into()).await;
}

/// `pending serve` as `<prefix>-pending`, with exactly its documented set, follows the journal
/// and the control stream into its index; a publisher logged in over HTTP sees what it
/// scheduled; the pending user may not take messages from a destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_serve_works_with_its_permission_set_and_no_more() {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    let q = format!("{p}-orders");
    let sets = documented_sets(&["--prefix", &p, "--queue", &q]);
    for role in ["admin", "publisher", "pending"] {
        let (who, c, w, r) = set_of(&sets, &format!("{p}-{role}"));
        user(who, c, w, r);
    }
    let root = url("guest", &port).replace("guest-pw", "guest");
    let cfg = small_config(&p, "pending.toml", "");
    let index = temp_path(&p, "pending.db");
    let _cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root.clone(),
        queues: vec![q.clone()],
        exchanges: Vec::new(),
        users: ["admin", "publisher", "pending"]
            .iter()
            .map(|u| format!("{p}-{u}"))
            .collect(),
    };
    let admin = url(&format!("{p}-admin"), &port);
    cli_as("the admin's declare", &cfg, &admin, &["declare"]).await;
    let declare_q = ["declare", "--queue", &q, "--worker"];
    cli_as("the admin's declare --queue Q", &cfg, &admin, &declare_q).await;
    let publisher = url(&format!("{p}-publisher"), &port);
    let send = [
        "send", "--queue", &q, "--delay", "1400", "--id", "seen", "--body", "s",
    ];
    cli_as("the publisher's send", &cfg, &publisher, &send).await;
    let listen = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args(["--url", &url(&format!("{p}-pending"), &port)])
        .args(["pending", "serve", "--listen", &listen, "--index"])
        .arg(&index)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let api = format!("http://{listen}/api/v1/pending?queue={q}");
    let (who, pw) = (format!("{p}-publisher"), format!("{p}-publisher-pw"));
    let ask = move || {
        let auth = base64_basic(&who, &pw);
        let mut res = ureq::get(&api)
            .header("authorization", &auth)
            .call()
            .map_err(|e| e.to_string())?;
        res.body_mut().read_to_string().map_err(|e| e.to_string())
    };
    let mut last = Err("not asked".to_string());
    for _ in 0..60 {
        last = tokio::task::spawn_blocking(ask.clone()).await.unwrap();
        if last.as_ref().is_ok_and(|t| t.contains("\"seen\"")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let out = {
        let mut serve = serve;
        serve.start_kill().ok();
        serve.wait_with_output().await.unwrap()
    };
    assert!(
        last.as_ref().is_ok_and(|t| t.contains("\"seen\"")),
        "the publisher's view through pending serve: {last:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // and no more: the pending user takes nothing from a destination
    let conn =
        amqp_delay::ops::connection::connect(&url(&format!("{p}-pending"), &port), "pending")
            .await
            .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let taken = ch
        .basic_get(q.as_str().into(), Default::default())
        .await
        .map(|_| ());
    assert!(
        taken
            .as_ref()
            .is_err_and(|e| e.to_string().contains("ACCESS_REFUSED")),
        "{taken:?}"
    );
    let _ = conn.close(200, "bye".into()).await;
    let _ = std::fs::remove_file(&index);
}
