//! `delay-publisher transfer` between two prefixes on the main broker (the old cluster's and
//! the new one's topologies, each its own): every waiting message arrives once, at its original
//! due time and never early, with its owner; what was cancelled on the old side never; the
//! owner cancels a moved message on the new side; a user that is neither admin nor peer is
//! refused before anything moves; a dry run moves nothing; a transfer killed with SIGKILL and
//! run again loses nothing and counts what may arrive twice; parked messages stay (counted)
//! without `--parked` and move with it into the new parking queue, where `parked` sees them.

use std::collections::HashMap;
use std::time::Duration;

use amqp_delay::settings::TrustSettings;
use amqp_delay::time::DurationMs;
use amqp_delay::{Message, Outcome, Precision, QueueType, Settings, Topology, TopologySettings};
use amqp_delay_cli::transfer::{self, Counts, Options};

use crate::harness::*;
use crate::worker::{Scripted, spawn_worker_with};

/// Delays up to a minute on few queues: radix 4, 100 ms units, one 5 s fixed level.
fn topology() -> TopologySettings {
    TopologySettings {
        radix: 4,
        unit: DurationMs(100),
        max_delay: DurationMs(60_000),
        fixed_levels: vec![DurationMs(5_000)],
        fixed_shards: 1,
        queue_type: QueueType::Quorum,
        max_tier_length: None,
        ..TopologySettings::default()
    }
}

/// The old cluster's and the new one's topologies (two prefixes), a 100 ms lateness budget.
async fn clusters() -> (Env, Env) {
    let mut old = Env::new(topology()).await;
    let mut new = Env::new(topology()).await;
    for e in [&mut old, &mut new] {
        e.settings.precision = Precision {
            lateness: DurationMs(100),
            lateness_ratio: 0.0,
        };
        e.settings.trust = TrustSettings {
            admins: vec!["guest".into()],
            peers: vec![],
            ..TrustSettings::default()
        };
    }
    (old, new)
}

fn options(new: &Env) -> Options {
    Options {
        to: broker_url(),
        to_prefix: Some(new.settings.prefix.clone()),
        queues: vec![],
        dry_run: false,
        parked: false,
        prefetch: 50,
    }
}

async fn transfer(settings: &Settings, opts: Options) -> amqp_delay::Result<Counts> {
    transfer::run(settings, opts, |_| {}).await
}

/// Messages in the tiers of `env`'s topology.
async fn in_tiers(env: &Env) -> u64 {
    Topology::new(env.layout())
        .stats(&env.conn)
        .await
        .unwrap()
        .iter()
        .map(|s| s.messages)
        .sum()
}

/// What arrived: id, the due time it carries, when it arrived.
type Arrival = (String, Option<u64>, u64);

/// Messages a plain consumer received, as arrivals; each names its owner, guest.
fn arrivals(got: &[Received]) -> Vec<Arrival> {
    got.iter()
        .map(|r| {
            let owner = r.text_header("x-delay-owner");
            assert_eq!(owner.as_deref(), Some("guest"), "{}: owner", r.id());
            let due = r.int_header("x-delay-due-at").map(|d| d as u64);
            (r.id(), due, r.arrived_ms)
        })
        .collect()
}

/// Checks what arrived against what was scheduled (id → due): each once at most (`twice`
/// lets that many arrive twice), never before its original due time, which it still carries.
fn check_arrivals(got: &[Arrival], due: &HashMap<String, u64>, twice: u64) {
    let mut seen: HashMap<String, u64> = HashMap::new();
    for (id, carried, arrived) in got {
        let d = *due
            .get(id)
            .unwrap_or_else(|| panic!("{id} arrived, never scheduled or cancelled"));
        assert_eq!(*carried, Some(d), "{id}: due time moved");
        assert!(*arrived >= d, "{id} arrived {} ms early", d - arrived);
        *seen.entry(id.clone()).or_default() += 1;
    }
    let missing: Vec<_> = due.keys().filter(|k| !seen.contains_key(*k)).collect();
    assert!(missing.is_empty(), "never arrived: {missing:?}");
    let doubled = seen.values().filter(|n| **n > 1).count() as u64;
    assert!(doubled <= twice, "{doubled} arrived twice, {twice} counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiting_message_moves_once_at_its_due_time_and_cancelled_ones_never() {
    let (mut old, mut new) = clusters().await;
    let plain = old.queue("plain").await;
    let batched = old.queue("batched").await;
    Topology::new(old.layout())
        .declare_batch_marker(&old.conn, &batched)
        .await
        .unwrap();
    let p = old.publisher().await;
    let mut msgs = Vec::new();
    for i in 0..40u64 {
        msgs.push(Message::new(plain.clone(), 9_000 + 150 * i, "p").with_id(format!("p{i}")));
    }
    // batched: few distinct due times, so members share batches
    for i in 0..60u64 {
        let d = [9_000, 10_000, 12_000][(i % 3) as usize];
        msgs.push(Message::new(batched.clone(), d, "b").with_id(format!("b{i}")));
    }
    let mut due = HashMap::new();
    let mut batches = 0;
    for r in p.schedule_batch(msgs).await {
        let s = r.expect("scheduled");
        batches += usize::from(s.batched_with > 1);
        due.insert(s.message_id, s.due_at_ms);
    }
    assert!(batches > 0, "nothing travelled in a batch");
    p.cancel("p0", Some(due["p0"])).await.unwrap();
    p.cancel("b0", Some(due["b0"])).await.unwrap();
    p.close().await;
    let waiting = in_tiers(&old).await;

    // a user the new cluster neither trusts as admin nor as peer is refused, nothing moves
    let mut stranger = old.settings.clone();
    stranger.trust = TrustSettings::default();
    let e = transfer(&stranger, options(&new)).await.unwrap_err();
    assert!(e.to_string().contains("neither an admin nor a peer"), "{e}");
    assert_eq!(in_tiers(&old).await, waiting);

    // the dry run counts, moves nothing
    let mut dry = options(&new);
    dry.dry_run = true;
    let c = transfer(&old.settings, dry).await.unwrap();
    assert_eq!(c.cancelled, 2, "{c:?}");
    assert_eq!(
        c.by_destination.values().flatten().sum::<u64>(),
        98,
        "{c:?}"
    );
    assert_eq!((c.moved, c.left_total()), (0, 0), "{c:?}");
    assert_eq!(in_tiers(&new).await, 0);

    let c = transfer(&old.settings, options(&new)).await.unwrap();
    assert_eq!((c.moved, c.cancelled, c.left_total()), (98, 2, 0), "{c:?}");
    old.assert_tiers_empty().await;
    assert!(in_tiers(&new).await > 0);

    // the owner cancels a moved message on the new cluster
    let np = new.publisher().await;
    np.cancel("p1", Some(due["p1"])).await.unwrap();
    np.close().await;
    for id in ["p0", "p1", "b0"] {
        due.remove(id);
    }
    let want = |prefix: char| -> HashMap<String, u64> {
        due.iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    // a worker of the new cluster honours the new cluster's cancel
    new.parked_queue(&plain);
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker_with(new.settings.clone(), &plain, h);
    let ran = wait_until(Duration::from_secs(40), || log.lock().unwrap().len() >= 38).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop.send(());
    run.await.unwrap().expect("the new cluster's worker ran");
    let got: Vec<Arrival> = log
        .lock()
        .unwrap()
        .iter()
        .zip(dues.lock().unwrap().iter())
        .map(|((id, _, at), due)| (id.clone(), *due, *at))
        .collect();
    assert!(ran, "the worker ran {} of 38", got.len());
    check_arrivals(&got, &want('p'), 0);
    let got = collect(
        &old.conn,
        &batched,
        59,
        Duration::from_secs(40),
        Duration::from_secs(1),
    )
    .await;
    check_arrivals(&arrivals(&got), &want('b'), 0);
    new.cleanup().await;
    old.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_killed_midway_and_run_again_loses_nothing() {
    let (mut old, new) = clusters().await;
    let q = old.queue("orders").await;
    let p = old.publisher().await;
    let n = 300u64;
    let msgs: Vec<Message> = (0..n)
        .map(|i| Message::new(q.clone(), 15_000 + 20 * i, "k").with_id(format!("k{i}")))
        .collect();
    let mut due = HashMap::new();
    for r in p.schedule_batch(msgs).await {
        let s = r.expect("scheduled");
        due.insert(s.message_id, s.due_at_ms);
    }
    p.close().await;
    let cfg = old.write_config("[trust]\nadmins = [\"guest\"]\n");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args([
            "transfer",
            "--to",
            &broker_url(),
            "--to-prefix",
            &new.settings.prefix,
        ])
        .args(["--prefetch", "5"])
        .env("AMQP_URL", broker_url())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // kill -9 once part of it moved (or when it is done, if it was faster than the look)
    let start = in_tiers(&old).await;
    loop {
        if child.try_wait().unwrap().is_some() || in_tiers(&old).await < start {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
    // the killed run's channels are gone: what it held is back (or moved)
    let c = transfer(&old.settings, options(&new)).await.unwrap();
    eprintln!("after the kill, the second run: {c:?}");
    assert_eq!(c.left_total(), 0, "{c:?}");
    old.assert_tiers_empty().await;
    let got = collect(
        &old.conn,
        &q,
        n as usize,
        Duration::from_secs(60),
        Duration::from_secs(1),
    )
    .await;
    check_arrivals(&arrivals(&got), &due, c.maybe_duplicates);
    let _ = std::fs::remove_file(cfg);
    new.cleanup().await;
    old.cleanup().await;
}

/// `parked list --json` on `cfg`'s prefix: (id, reason, attempts, parked_from, owner) each, by id.
async fn parked_listed(cfg: &std::path::Path, q: &str) -> Vec<[String; 5]> {
    let (code, out, err) = publisher_cli(cfg, &["parked", "list", "--queue", q, "--json"]).await;
    assert_eq!(code, Some(0), "parked list: {out}\n{err}");
    let s = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    let mut rows: Vec<[String; 5]> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            [
                s(&v["id"]),
                s(&v["reason"]),
                s(&v["attempts"]),
                s(&v["parked_from"]),
                s(&v["owner"]),
            ]
        })
        .collect();
    // by id: the transfer moves parked messages several at a time, so their order in the new
    // parking queue is not the old one's
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_messages_stay_counted_without_parked_and_move_with_it() {
    let (mut old, mut new) = clusters().await;
    let q = old.queue("parked").await;
    let old_parked = old.parked_queue(&q);
    let new_parked = new.parked_queue(&q);
    // the old cluster's worker parks three; one more waits in the tiers
    let p = old.publisher().await;
    for i in 0..3 {
        p.schedule(Message::new(q.clone(), 200, "x").with_id(format!("x{i}")))
            .await
            .unwrap();
    }
    p.schedule(Message::new(q.clone(), 50_000, "w").with_id("w0"))
        .await
        .unwrap();
    p.close().await;
    let (stop, run) = spawn_worker_with(
        old.settings.clone(),
        &q,
        Scripted::new(|_| Outcome::Permanent("no such order".into())),
    );
    let parked3 = wait_until_async(Duration::from_secs(20), || async {
        amqp_delay::ops::broker::queue_state(&old.conn, &old_parked)
            .await
            .unwrap()
            .is_some_and(|s| s.ready == 3)
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().expect("the old cluster's worker ran");
    assert!(parked3, "the old worker did not park three");
    let ready = async |env: &Env, name: &str| {
        amqp_delay::ops::broker::queue_state(&env.conn, name)
            .await
            .unwrap()
            .map_or(0, |s| s.ready)
    };

    // without --parked: the waiting one moves, the parked stay, and the command says so
    let cfg = old.write_config("[trust]\nadmins = [\"guest\"]\n");
    let to_prefix = new.settings.prefix.clone();
    let args = ["transfer", "--to", &broker_url(), "--to-prefix", &to_prefix];
    let (code, out, err) = publisher_cli(&cfg, &args).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("moved 1,") && out.contains("parked left on the old cluster 3 (--parked"),
        "{out}"
    );
    assert_eq!(ready(&old, &old_parked).await, 3);

    // the dry run counts them, moves nothing
    let mut dry = options(&new);
    (dry.dry_run, dry.parked) = (true, true);
    let c = transfer(&old.settings, dry).await.unwrap();
    assert_eq!((c.parked, c.parked_left, c.moved), (3, 0, 0), "{c:?}");
    assert_eq!(ready(&old, &old_parked).await, 3);

    // --parked: into the new cluster's parking queue of the same destination
    let mut opts = options(&new);
    opts.parked = true;
    let c = transfer(&old.settings, opts).await.unwrap();
    assert_eq!(
        (c.parked, c.parked_left, c.left_total()),
        (3, 0, 0),
        "{c:?}"
    );
    assert_eq!(ready(&old, &old_parked).await, 0);
    assert_eq!(ready(&new, &new_parked).await, 3);

    // `parked list` on the new cluster shows them with their parking headers and owner, and
    // `parked drop` acts on them
    let new_cfg = new.write_config("");
    let listed = parked_listed(&new_cfg, &q).await;
    let ids: Vec<&str> = listed.iter().map(|l| l[0].as_str()).collect();
    assert_eq!(ids, ["x0", "x1", "x2"], "{listed:?}");
    for l in &listed {
        assert_eq!(l[1..], ["no such order", "1", q.as_str(), "guest"], "{l:?}");
    }
    let (code, out, err) =
        publisher_cli(&new_cfg, &["parked", "drop", "x1", "--queue", &q, "--yes"]).await;
    assert_eq!(code, Some(0), "drop: {out}\n{err}");
    assert_eq!(parked_listed(&new_cfg, &q).await.len(), 2);
    for f in [cfg, new_cfg] {
        let _ = std::fs::remove_file(f);
    }
    new.cleanup().await;
    old.cleanup().await;
}
