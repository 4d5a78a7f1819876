//! One tenant attacking another, replayed with several users, each holding exactly its documented permission set
//! (on our own TLS test node's plain port, where users are created): what one role can do to
//! another. A publisher (mallory) cancels, forges records and writes into the gateway's due
//! queue; another publisher's (alice's) messages, an admin's cancel and the gateway's output
//! must come out as their owners meant. Before writers were authenticated, mallory's cancel
//! stopped alice's message, the forged checkpoint hid alice's cancel (as the reader that trusts
//! mallory still shows) and the due stage delivered mallory's message.

use std::time::Duration;

use amqp_delay::ops::cancel::{Cancellations, FollowOptions};
use amqp_delay::settings::TrustSettings;
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Outcome, Publisher, Settings, Worker};
use amqp_delay_cli::pending::follow::Status;
use amqp_delay_cli::pending::service::{Failure, Service};
use amqp_delay_cli::pending_index::{Options, PendingIndex};
use futures::StreamExt;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::harness::*;
use crate::permissions::{Cleanup, cli_as, documented_sets, set_of, url, user};
use crate::worker::Scripted;

/// The users of one test, with the documented sets: an admin, two publishers, a worker of
/// `q`, a gateway of `ingress` → `target`.
pub(crate) struct World {
    pub(crate) p: String,
    port: String,
    pub(crate) q: String,
    ingress: String,
    target: String,
    root: String,
    pub(crate) settings: Settings,
    pub(crate) cfg: std::path::PathBuf,
    _cleanup: Cleanup,
}

impl World {
    pub(crate) fn url(&self, role: &str) -> String {
        url(&format!("{}-{role}", self.p), &self.port)
    }

    pub(crate) fn user(&self, role: &str) -> String {
        format!("{}-{role}", self.p)
    }

    /// The settings of `role`, which trusts the admin as every deployment should.
    pub(crate) fn as_role(&self, role: &str) -> Settings {
        Settings {
            url: self.url(role),
            trust: TrustSettings {
                admins: vec![self.user("adm")],
                peers: vec![],
                ..Default::default()
            },
            ..self.settings.clone()
        }
    }
}

pub(crate) async fn world() -> World {
    world_of(small_topology()).await
}

/// [`world`] with topology `topology`.
pub(crate) async fn world_of(topology: amqp_delay::TopologySettings) -> World {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    let q = format!("{p}-orders");
    let (ingress, target) = (format!("{p}-delayed"), format!("{p}-target"));
    // exactly the sets permissions.sh prints: alice and mallory are both publishers
    let sets = documented_sets(&[
        "--prefix",
        &p,
        "--user-prefix",
        &p,
        "--queue",
        &q,
        "--gateway",
        &format!("{ingress}:{target}"),
    ]);
    let renamed = [
        ("admin", "adm"),
        ("worker", "wrk"),
        ("gateway", "gw"),
        ("pending", "pending"),
    ];
    for (role, who) in renamed {
        let (_, c, w, r) = set_of(&sets, &format!("{p}-{role}"));
        user(&format!("{p}-{who}"), c, w, r);
    }
    let (_, c, w, r) = set_of(&sets, &format!("{p}-publisher"));
    for who in ["alice", "mallory"] {
        user(&format!("{p}-{who}"), c, w, r);
    }
    let root = url("guest", &port).replace("guest-pw", "guest");
    let settings = Settings {
        url: root.clone(),
        prefix: p.clone(),
        topology: topology.clone(),
        ..Settings::default()
    };
    let pair = format!(
        "[trust]\nadmins = [\"{p}-adm\"]\n\n[[gateway.pairs]]\ningress = \"{ingress}\"\ntarget = \"{target}\"\n"
    );
    let cfg = config_of(&p, "trust.toml", &topology, &pair);
    let layout = settings.layout().unwrap();
    let _cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root.clone(),
        queues: vec![q.clone(), format!("{p}-out"), layout.parked_queue(&q)],
        exchanges: vec![target.clone()],
        users: ["adm", "alice", "mallory", "wrk", "gw", "pending"]
            .iter()
            .map(|u| format!("{p}-{u}"))
            .collect(),
    };
    let w = World {
        p,
        port,
        q,
        ingress,
        target,
        root,
        settings,
        cfg,
        _cleanup,
    };
    cli_as("the admin's declare", &w.cfg, &w.url("adm"), &["declare"]).await;
    w
}

/// [`world`] with `q` declared for a worker, by the admin.
async fn world_with_worker() -> World {
    let w = world().await;
    cli_as(
        "the admin's declare --queue Q --worker",
        &w.cfg,
        &w.url("adm"),
        &["declare", "--queue", &w.q, "--worker"],
    )
    .await;
    w
}

/// Appends `bodies` to the control stream as `who` would with its own rights (through the
/// stream exchange), each with `user_id` `as_user` (`None`: without one); returns the error
/// of the first publish the broker refused.
async fn append_as(
    w: &World,
    who: &str,
    as_user: Option<&str>,
    bodies: &[String],
) -> Result<(), String> {
    let stream = w.settings.layout().unwrap().control_stream();
    append_to(w, who, as_user, &stream, bodies).await
}

/// Appends `bodies` to `stream` (the control stream, the journal) as [`append_as`] does.
pub(crate) async fn append_to(
    w: &World,
    who: &str,
    as_user: Option<&str>,
    stream: &str,
    bodies: &[String],
) -> Result<(), String> {
    let conn = amqp_delay::ops::connection::connect(&w.url(who), "trust forger")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let exchange = w.settings.layout().unwrap().stream_exchange();
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(u) = as_user {
        props = props.with_user_id(u.into());
    }
    let mut r = Ok(());
    for body in bodies {
        let sent = async {
            ch.basic_publish(
                exchange.as_str().into(),
                stream.into(),
                Default::default(),
                body.as_bytes(),
                props.clone(),
            )
            .await?
            .await
        }
        .await;
        if let Err(e) = sent {
            r = Err(e.to_string());
            break;
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    r
}

/// Runs a worker of `q` as the worker's user (its handler always succeeds) until it has acked
/// `cancelled` messages without running them and run one; what it ran.
async fn run_worker(w: &World, q: &str, cancelled: u64) -> Vec<String> {
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let worker = Worker::new(w.as_role("wrk")).subscribe(q.to_string(), h);
    let counters = worker.counters();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async {
        let _ = stop_rx.await;
    }));
    let settled = wait_until(Duration::from_secs(30), || {
        counters
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed)
            >= cancelled
            && !log.lock().unwrap().is_empty()
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().expect("the worker ran without errors");
    let ran: Vec<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert!(settled, "not all settled: ran {ran:?}");
    ran
}

/// A cancel stops only its writer's messages (an admin's stops any); a record without a writer,
/// or a checkpoint by a publisher, changes nothing; and the broker refuses a forged writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_only_its_writers_messages_and_forged_checkpoints_hide_nothing() {
    let w = world_with_worker().await;
    let q = w.q.clone();
    let alice = Publisher::connect(&w.as_role("alice")).await.unwrap();
    let mut due = 0;
    for id in ["a-keep", "a-cancel", "a-admin"] {
        let s = alice
            .schedule(Message::new(q.clone(), 1_000, id).with_id(id))
            .await
            .unwrap();
        due = due.max(s.due_at_ms);
    }
    alice.cancel("a-cancel", Some(due)).await.unwrap();
    cli_as(
        "an admin's cancel",
        &w.cfg,
        &w.url("adm"),
        &["cancel", "--id", "a-admin"],
    )
    .await;
    // mallory, a publisher too, cancels alice's message: the command succeeds, as it must (a
    // canceller cannot know whose id it names), and stops nothing of alice's
    cli_as(
        "mallory's cancel",
        &w.cfg,
        &w.url("mallory"),
        &["cancel", "--id", "a-keep"],
    )
    .await;
    // the broker checks user_id: mallory cannot write as alice
    let forged = append_as(
        &w,
        "mallory",
        Some(&w.user("alice")),
        &[r#"{"type":"barrier","nonce":"x"}"#.into()],
    )
    .await;
    assert!(
        forged
            .as_ref()
            .is_err_and(|e| e.contains("PRECONDITION_FAILED")),
        "the broker took a user_id that is not the connection's: {forged:?}"
    );
    // a tombstone without user_id, then a complete, empty checkpoint after many records: a
    // follower that believed it would start there and forget alice's cancel
    let far = u64::MAX;
    let mut junk = vec![format!(
        r#"{{"type":"cancel","id":"a-keep","until_ms":{far}}}"#
    )];
    append_as(&w, "mallory", None, &junk).await.unwrap();
    junk = (0..30)
        .map(|i| format!(r#"{{"type":"barrier","nonce":"j{i}"}}"#))
        .collect();
    junk.push(r#"{"type":"checkpoint_begin","nonce":"forged"}"#.into());
    junk.push(format!(
        r#"{{"type":"checkpoint","nonce":"forged","part":0,"parts":1,"items":[],"by":"{}"}}"#,
        w.user("alice")
    ));
    junk.extend((0..5).map(|i| format!(r#"{{"type":"barrier","nonce":"k{i}"}}"#)));
    append_as(&w, "mallory", Some(&w.user("mallory")), &junk)
        .await
        .unwrap();

    let layout = w.settings.layout().unwrap();
    let alice_user = w.user("alice");
    let owner = Some(alice_user.as_str());
    let opts = |peers: Vec<String>| {
        let mut o = FollowOptions::new(Duration::from_millis(500), 60_000);
        o.checkpoint_every = 10;
        o.trust = TrustSettings {
            admins: vec![w.user("adm")],
            peers,
            ..Default::default()
        };
        o
    };
    // what the attack did: a reader that trusts mallory starts from her checkpoint (the
    // node's administrator reads here, so that its own checkpoint counts for no one below)
    let root = amqp_delay::ops::connection::connect(&w.root, "trust root")
        .await
        .unwrap();
    let fooled = Cancellations::follow_with(&root, &layout, opts(vec![w.user("mallory")]))
        .await
        .unwrap();
    assert!(
        !fooled.is_cancelled("a-cancel", owner),
        "the forged checkpoint was not where the read began: the scenario proves nothing"
    );
    drop(fooled);
    // the worker's user trusts only itself and the admin
    let wrk = amqp_delay::ops::connection::connect(&w.url("wrk"), "trust wrk")
        .await
        .unwrap();
    let follower = Cancellations::follow_with(&wrk, &layout, opts(vec![]))
        .await
        .unwrap();
    assert!(
        follower.is_cancelled("a-cancel", owner),
        "alice's cancel was lost"
    );
    assert!(
        follower.is_cancelled("a-admin", owner),
        "the admin's cancel was lost"
    );
    assert!(
        !follower.is_cancelled("a-keep", owner),
        "mallory cancelled alice's message"
    );
    assert!(follower.is_cancelled("a-keep", Some(&w.user("mallory"))));
    drop(follower);
    let _ = wrk.close(200, "bye".into()).await;

    // and the worker runs what alice did not cancel, nothing else
    let ran = run_worker(&w, &q, 2).await;
    assert_eq!(ran, ["a-keep"], "what ran");
    alice.close().await;
    let _ = root.close(200, "bye".into()).await;
}

/// The gateway's due stage publishes to the target only what a gateway wrote: a publisher
/// writing into the due queue (with a routing key and `x-delay-user-id` of its choosing) gets
/// its message parked, not delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_due_stage_takes_only_what_a_gateway_wrote() {
    let w = world().await;
    let root = amqp_delay::ops::connection::connect(&w.root, "trust root")
        .await
        .unwrap();
    let out = format!("{}-out", w.p);
    let ch = root.create_channel().await.unwrap();
    ch.exchange_declare(
        w.target.as_str().into(),
        lapin::ExchangeKind::Direct,
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
        w.target.as_str().into(),
        "k".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let (ingress, target) = (w.ingress.clone(), w.target.clone());
    cli_as(
        "the admin's gateway --declare-only",
        &w.cfg,
        &w.url("adm"),
        &["gateway", "--declare-only"],
    )
    .await;
    let gw_settings = w.as_role("gw");
    let mut gw = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&w.cfg)
        .args(["--url", &gw_settings.url, "gateway"])
        .args(["--ingress", &ingress, "--target", &target])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pair = amqp_delay::gateway::Gateway::new(Settings {
        gateway: amqp_delay::settings::GatewaySettings::from_flags(
            std::slice::from_ref(&ingress),
            std::slice::from_ref(&target),
        )
        .unwrap(),
        ..gw_settings.clone()
    })
    .unwrap()
    .pairs()[0]
        .clone();
    let consuming = wait_until_async(Duration::from_secs(15), || async {
        amqp_delay::ops::broker::queue_state(&root, &pair.due_queue)
            .await
            .unwrap()
            .is_some_and(|s| s.consumers > 0)
    })
    .await;
    assert!(consuming, "the gateway did not start");

    // mallory may not write straight into a queue (no role has the default exchange) ...
    let mallory = amqp_delay::ops::connection::connect(&w.url("mallory"), "trust mallory")
        .await
        .unwrap();
    let mch = mallory.create_channel().await.unwrap();
    mch.confirm_select(Default::default()).await.unwrap();
    // the refusal closes the channel, which fails the publish's confirm with the reason
    let direct = async {
        mch.basic_publish(
            "".into(),
            out.as_str().into(),
            Default::default(),
            b"straight in",
            BasicProperties::default(),
        )
        .await?
        .await
    }
    .await;
    let refused = direct.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("ACCESS_REFUSED"), "{refused:?}");
    // ... but it may write the tiers: into the due queue, as the gateway's copy would look
    let mch = mallory.create_channel().await.unwrap();
    let layout = w.settings.layout().unwrap();
    let mut h = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    h.insert("x-delay-routing-key".into(), text("k"));
    h.insert("x-delay-user-id".into(), text(&w.user("alice")));
    h.insert("x-delay-owner".into(), text(&w.user("alice")));
    h.insert(
        "x-delay-due-at".into(),
        AMQPValue::LongLongInt(now_ms() as i64),
    );
    mch.basic_publish(
        layout.delivery_exchange().as_str().into(),
        layout.routing_key(&[], &pair.due_queue).as_str().into(),
        Default::default(),
        b"forged",
        BasicProperties::default()
            .with_message_id("forged".into())
            .with_headers(h),
    )
    .await
    .unwrap();
    // and an application's own message through the ingress, which arrives
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongInt(50));
    ch.basic_publish(
        ingress.as_str().into(),
        "k".into(),
        Default::default(),
        b"via gateway",
        BasicProperties::default().with_headers(h),
    )
    .await
    .unwrap();
    let parked_q = w.settings.layout().unwrap().parked_queue(&pair.due_queue);
    let parked = collect(
        &root,
        &parked_q,
        1,
        Duration::from_secs(15),
        Duration::from_millis(200),
    )
    .await;
    let got = collect(
        &root,
        &out,
        2,
        Duration::from_secs(5),
        Duration::from_millis(500),
    )
    .await;
    gw.start_kill().ok();
    let gw_out = gw.wait_with_output().await.unwrap();
    let bodies: Vec<&[u8]> = got.iter().map(|r| r.body.as_slice()).collect();
    assert_eq!(
        bodies,
        [b"via gateway".as_slice()],
        "the target got:\n{}",
        String::from_utf8_lossy(&gw_out.stderr)
    );
    assert_eq!(parked.len(), 1, "the forged message was not parked");
    let reason = parked[0]
        .text_header("x-delay-parked-reason")
        .unwrap_or_default();
    assert!(reason.contains("not written by a gateway"), "{reason}");
    // the teardown of the cleanup needs the queues empty of nothing: delete what we added
    let _ = ch
        .queue_delete(parked_q.as_str().into(), Default::default())
        .await;
    let _ = mallory.close(200, "bye".into()).await;
    let _ = root.close(200, "bye".into()).await;
}

/// One owner's purges cannot crowd out another's. mallory, a publisher, writes 1 000 purges of
/// her own that cover nothing straight to the control stream (her rights allow it), which used
/// to fill the one cap every owner shared; her next one through `pending` is refused at once
/// with the quota, how many are live and when they are over. alice's own purge of her own message
/// is still taken and the worker does not run that message; an admin's purge is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owners_purges_cannot_crowd_out_anothers() {
    let w = world_with_worker().await;
    let q = w.q.clone();
    let alice = Publisher::connect(&w.as_role("alice")).await.unwrap();
    alice
        .schedule(Message::new(q.clone(), 200, "x").with_id("a-purged"))
        .await
        .unwrap();
    let purge = |queue: &str| amqp_delay::ops::control::PurgeScope::queue(queue);
    // the attack: 1 000 purges, as many as a follower held of everyone's together
    let mallory = Publisher::connect(&w.as_role("mallory")).await.unwrap();
    let flood = futures::stream::iter(0..1_000)
        .map(|_| mallory.purge(purge(&q)))
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    assert!(flood.iter().all(Result::is_ok), "the broker refused one");
    mallory.close().await;

    // `pending serve` (its own user reads the control stream) steering as each user
    let path = temp_path(&w.p, "quota.db");
    let ix = PendingIndex::open(&path, Options::default()).unwrap();
    let index = std::sync::Arc::new(std::sync::Mutex::new(ix));
    let service = Service::new(w.as_role("pending"), index, Status::new());
    let ask = |owner: Option<String>| amqp_delay::ops::control::PurgeScope {
        owner,
        ..amqp_delay::ops::control::PurgeScope::queue(q.clone())
    };
    let refused = service
        .purge(&w.as_role("mallory"), &ask(None), false)
        .await;
    let Err(f @ Failure::Quota(_)) = &refused else {
        panic!("mallory's purge beyond her quota: {refused:?}");
    };
    let why = f.to_string();
    println!("mallory is told: {why}");
    assert_eq!(f.http_status(), 429);
    assert!(
        why.contains(&format!(
            "'{}' already has 100 live purges",
            w.user("mallory")
        )) && why.contains("its quota of 100")
            && why.contains("the first of these is over at 20"),
        "{why}"
    );
    let taken = service.purge(&w.as_role("alice"), &ask(None), false).await;
    assert!(taken.as_ref().is_ok_and(|o| o.written), "{taken:?}");
    let admin = service
        .purge(&w.as_role("adm"), &ask(Some(w.user("mallory"))), false)
        .await;
    assert!(admin.as_ref().is_ok_and(|o| o.written), "{admin:?}");
    // a message of alice's scheduled after her purge is not covered: it runs
    alice
        .schedule(Message::new(q.clone(), 200, "x").with_id("a-after"))
        .await
        .unwrap();

    // the worker, started now, reads every purge before it runs anything
    let ran = run_worker(&w, &q, 1).await;
    assert_eq!(ran, ["a-after"], "alice's purged message ran");
    alice.close().await;
    drop(service);
    for ext in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
    }
}
