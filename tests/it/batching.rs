//! Batches against a real RabbitMQ: messages in hand together travel as one broker message to a
//! destination whose consumer is our worker; every member still arrives, never early and within
//! its lateness budget, and is retried, parked and acked on its own.

use std::collections::HashMap;
use std::time::Duration;

use amqp_delay::settings::PublisherSettings;
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Message, Outcome, Precision, Publisher, Topology};
use rand::Rng;

use crate::harness::*;
use crate::worker::{Scripted, retry, spawn_worker};

/// 20 ms of lateness budget: enough for messages scheduled together to share batches.
fn batching_env_precision(env: &mut Env) {
    env.settings.precision = Precision {
        lateness: DurationMs(20),
        lateness_ratio: 0.0,
    };
}

/// Declares `q`'s batch marker (as a worker does when it starts) and waits until publishers
/// would see it.
async fn mark_batched(env: &Env, q: &str) {
    Topology::new(env.layout())
        .declare_batch_marker(&env.conn, q)
        .await
        .expect("batch marker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_members_arrive_once_never_early_within_budget() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    let q = env.queue("batched").await;
    env.parked_queue(&q);
    mark_batched(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let n = 600;
    let mut rng = rand::rng();
    let msgs: Vec<Message> = (0..n)
        .map(|i| {
            // a few distinct delays, so many messages share a due window
            let d = [0u64, 40, 150, 400, 1_200][rng.random_range(0..5)] + rng.random_range(0..10);
            Message::new(q.clone(), d, format!("b{i}")).with_id(format!("b{i}"))
        })
        .collect();
    let results = p.schedule_batch(msgs).await;
    let mut batched = 0;
    for r in &results {
        let s = r.as_ref().expect("scheduled");
        if s.batched_with > 1 {
            batched += 1;
        }
    }
    assert!(
        batched > n / 2,
        "only {batched} of {n} messages travelled in a batch"
    );
    assert!(wait_until(Duration::from_secs(20), || log.lock().unwrap().len() >= n).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    let dues = dues.lock().unwrap().clone();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut worst = 0i64;
    for ((id, _, fired), due) in runs.iter().zip(&dues) {
        *seen.entry(id.clone()).or_default() += 1;
        let due = due.expect("every member has its due time") as i64;
        let lateness = *fired as i64 - due;
        assert!(lateness >= 0, "{id} ran {} ms early", -lateness);
        worst = worst.max(lateness);
    }
    assert_eq!(seen.len(), n, "missing members");
    assert!(
        seen.values().all(|&c| c == 1),
        "a member ran twice without a crash"
    );
    eprintln!("{n} messages, {batched} in batches, worst lateness {worst} ms");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

/// A message that must leave soon does not take the others with it: a group that falls due
/// later keeps waiting (up to `batch_linger`) for members to join it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_due_later_keeps_collecting_after_an_earlier_one_left() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    // generous: on a loaded 2-core machine "later2" may join well after its 80 ms
    env.settings.publisher.batch_linger = DurationMs(1_000);
    let q = env.queue("linger").await;
    env.parked_queue(&q);
    mark_batched(&env, &q).await;
    let p = env.publisher().await;
    let t0 = now_ms();
    let msg = |id: &str, due: u64| {
        let delay = (t0 + due).saturating_sub(now_ms());
        Message::new(q.clone(), delay, id.to_string()).with_id(id.to_string())
    };
    let (soon, later1, later2) = tokio::join!(
        p.schedule(msg("soon", 0)),
        p.schedule(msg("later1", 1_500)),
        async {
            // joins after "soon" had to leave (its deadline is 20 ms away)
            tokio::time::sleep(Duration::from_millis(80)).await;
            p.schedule(msg("later2", 1_505)).await
        }
    );
    let (soon, later1, later2) = (soon.unwrap(), later1.unwrap(), later2.unwrap());
    assert_eq!(
        soon.batched_with, 1,
        "the early message waited for the others"
    );
    assert_eq!(
        (later1.batched_with, later2.batched_with),
        (2, 2),
        "the later messages did not share a batch"
    );
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_member_is_retried_alone() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    let q = env.queue("member-retry").await;
    let parked = env.parked_queue(&q);
    mark_batched(&env, &q).await;
    let h = Scripted::new(|d| match (d.body.as_slice(), d.attempt) {
        (b"flaky", 0) => Outcome::Retry("flaky once".into()),
        (b"bad", _) => Outcome::Permanent("bad member".into()),
        _ => Outcome::Success,
    });
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(50, 2.0, 3));
    let p = env.publisher().await;
    let mut msgs: Vec<Message> = (0..20)
        .map(|i| Message::new(q.clone(), 100, "ok").with_id(format!("ok{i}")))
        .collect();
    msgs.push(Message::new(q.clone(), 100, "flaky").with_id("flaky"));
    msgs.push(Message::new(q.clone(), 100, "bad").with_id("bad"));
    let results = p.schedule_batch(msgs).await;
    assert!(
        results
            .iter()
            .any(|r| r.as_ref().is_ok_and(|s| s.batched_with >= 10)),
        "the messages did not share a batch"
    );
    let got = env.expect(&parked, 1).await;
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 23).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    let count = |id: &str| runs.iter().filter(|r| r.0 == id).count();
    for i in 0..20 {
        assert_eq!(count(&format!("ok{i}")), 1, "{runs:?}");
    }
    let flaky: Vec<u32> = runs
        .iter()
        .filter(|r| r.0 == "flaky")
        .map(|r| r.1)
        .collect();
    assert_eq!(flaky, [0, 1], "only the failing member is retried");
    assert_eq!(count("bad"), 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id(), "bad");
    assert_eq!(
        got[0].text_header("x-delay-parked-reason").as_deref(),
        Some("bad member")
    );
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_the_size_limit_is_split_never_refused() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    env.settings.publisher.batch_max_bytes = 4096;
    let q = env.queue("split").await;
    env.parked_queue(&q);
    mark_batched(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let body = vec![b'x'; 1000];
    let mut msgs: Vec<Message> = (0..40)
        .map(|i| Message::new(q.clone(), 50, body.clone()).with_id(format!("s{i}")))
        .collect();
    // one message alone is bigger than a batch may be: it travels alone
    msgs.push(Message::new(q.clone(), 50, vec![b'y'; 10_000]).with_id("big"));
    let results = p.schedule_batch(msgs).await;
    let sizes: Vec<usize> = results
        .iter()
        .map(|r| r.as_ref().expect("never refused").batched_with)
        .collect();
    assert!(sizes.iter().all(|&s| s <= 4), "{sizes:?}");
    assert!(sizes.iter().any(|&s| s > 1), "{sizes:?}");
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 41).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ids: std::collections::HashSet<String> =
        log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert_eq!(ids.len(), 41);
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_and_unbatched_publishers_share_a_topology() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    let q = env.queue("mixed").await;
    env.parked_queue(&q);
    mark_batched(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let batching = env.publisher().await;
    let plain = Publisher::connect(&amqp_delay::Settings {
        publisher: PublisherSettings {
            batch_max_messages: 1,
            ..PublisherSettings::default()
        },
        ..env.settings.clone()
    })
    .await
    .unwrap();
    let msgs = |tag: &str| -> Vec<Message> {
        (0..50)
            .map(|i| Message::new(q.clone(), 120, "m").with_id(format!("{tag}{i}")))
            .collect()
    };
    let (a, b) = tokio::join!(
        batching.schedule_batch(msgs("a")),
        plain.schedule_batch(msgs("p"))
    );
    assert!(a.iter().any(|r| r.as_ref().unwrap().batched_with > 1));
    assert!(b.iter().all(|r| r.as_ref().unwrap().batched_with == 1));
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 100).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ids: std::collections::HashSet<String> =
        log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert_eq!(ids.len(), 100);
    batching.close().await;
    plain.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_unpacks_batches_into_a_plain_queue() {
    let mut env = Env::new(small_topology()).await;
    batching_env_precision(&mut env);
    let staging = env.queue("to-relay").await;
    env.parked_queue(&staging);
    let plain = env.queue("plain").await;
    mark_batched(&env, &staging).await;
    let cfg = env.write_config("");
    let mut relay = crate::worker::consumer(&env, &cfg, &["--queue", &staging, "--relay", &plain]);
    let p = env.publisher().await;
    let before = now_ms();
    let msgs: Vec<Message> = (0..30)
        .map(|i| {
            Message::new(staging.clone(), 80, format!("r{i}"))
                .with_id(format!("r{i}"))
                .with_content_type("text/plain")
        })
        .collect();
    let results = p.schedule_batch(msgs).await;
    assert!(results.iter().any(|r| r.as_ref().unwrap().batched_with > 1));
    let got = env.expect(&plain, 30).await;
    relay.start_kill().unwrap();
    relay.wait().await.unwrap();
    let c = counts(&got);
    assert_eq!(c.len(), 30, "{c:?}");
    for r in &got {
        assert!(
            r.header("x-delay-batch").is_none(),
            "a batch reached the plain queue"
        );
        assert_eq!(
            r.properties.content_type().as_ref().unwrap().as_str(),
            "text/plain"
        );
        assert_eq!(r.body, r.id().into_bytes());
        assert!(r.arrived_ms >= before + 80);
    }
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// `stats` counts messages, not broker messages: publishers write how many messages each
/// broker message holds to the ledger stream, and a count starts from the last snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_messages_not_broker_messages() {
    let mut t = small_topology();
    t.max_delay = DurationMs(60_000);
    t.max_tier_ttl = DurationMs(20_000);
    let mut env = Env::new(t).await;
    batching_env_precision(&mut env);
    let q = env.queue("counted").await;
    mark_batched(&env, &q).await;
    let layout = env.layout();

    // 300 messages due within 5 ms of each other, 40 s from now: a few broker messages
    let p = env.publisher().await;
    let msgs: Vec<Message> = (0..300)
        .map(|i| Message::new(q.clone(), 40_000 + i % 5, format!("m{i}")))
        .collect();
    for r in p.schedule_batch(msgs).await {
        r.expect("scheduled");
    }
    p.close().await;
    let in_tiers: u64 = Topology::new(layout.clone())
        .stats(&env.conn)
        .await
        .unwrap()
        .iter()
        .map(|s| s.messages)
        .sum();
    assert!(
        (1..30).contains(&in_tiers),
        "300 messages took {in_tiers} broker messages"
    );
    let c = amqp_delay::ops::ledger::count(&env.conn, &layout, &Default::default())
        .await
        .unwrap()
        .expect("the topology has a ledger");
    assert_eq!((c.pending.total, c.pending.within_1m), (300, 300), "{c:?}");
    assert_eq!(c.snapshot_at_ms, None, "the first count reads every record");
    assert!(c.wrote_snapshot, "{c:?}");

    // 7 more, each alone, from a publisher dropped without `close` (it still writes its
    // counts): the next count starts from the snapshot and adds them
    let p = env.publisher().await;
    for i in 0..7 {
        p.schedule(Message::new(q.clone(), 30_000, format!("a{i}")))
            .await
            .expect("scheduled");
    }
    drop(p);
    let mut c = None;
    for _ in 0..50 {
        let now = amqp_delay::ops::ledger::count(&env.conn, &layout, &Default::default())
            .await
            .unwrap()
            .unwrap();
        c = Some(now);
        if now.pending.total == 307 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let c = c.unwrap();
    assert_eq!(c.pending.total, 307, "{c:?}");
    assert!(c.snapshot_at_ms.is_some() && !c.wrote_snapshot, "{c:?}");

    // what the command line shows
    let cfg = env.write_config("");
    let stats = |summary: bool| {
        let cfg = cfg.clone();
        async move {
            let mut args = vec!["--config", cfg.to_str().unwrap(), "stats"];
            if summary {
                args.extend(["--summary", "--json"]);
            }
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
                .args(args)
                .env("AMQP_URL", broker_url())
                .output()
                .await
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let summary: serde_json::Value = serde_json::from_str(&stats(true).await).unwrap();
    assert_eq!(summary["messages"]["total"], 307, "{summary}");
    assert_eq!(
        summary["broker_messages"]["in_tiers"],
        in_tiers + 7,
        "{summary}"
    );
    let text = stats(false).await;
    assert!(
        text.contains("messages not yet due: 307 (due within 1 minute: 307,"),
        "{text}"
    );

    // the ledger stream deleted (by an operator): a publisher refuses to start, naming it and
    // what adds it back; stats says what it cannot count
    let ch = amqp_delay::ops::broker::open(&env.conn).await.unwrap();
    ch.queue_delete(
        layout.ledger_stream().as_str().into(),
        lapin::options::QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    amqp_delay::ops::broker::close(&ch, "ok").await;
    let refused = |what: String| {
        let settings = env.settings.clone();
        async move {
            let e = match Publisher::connect(&settings).await {
                Ok(_) => panic!("a publisher started without {what}"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains(&format!("{what} is missing"))
                    && e.contains("run `delay-publisher declare`"),
                "{e}"
            );
        }
    };
    refused(format!("the ledger stream '{}'", layout.ledger_stream())).await;
    assert_eq!(
        amqp_delay::ops::ledger::count(&env.conn, &layout, &Default::default())
            .await
            .unwrap(),
        None
    );
    let text = stats(false).await;
    assert!(
        text.contains("messages not yet due: unknown (the topology has no ledger stream"),
        "{text}"
    );
    // so does the stream exchange, which the ledger and control records go through
    Topology::new(layout.clone())
        .declare(&env.conn)
        .await
        .unwrap();
    let ch = amqp_delay::ops::broker::open(&env.conn).await.unwrap();
    ch.exchange_delete(
        layout.stream_exchange().as_str().into(),
        lapin::options::ExchangeDeleteOptions::default(),
    )
    .await
    .unwrap();
    amqp_delay::ops::broker::close(&ch, "ok").await;
    refused(format!(
        "the stream exchange '{}'",
        layout.stream_exchange()
    ))
    .await;
    // an append on a channel of its own says the same (the broker closed the channel)
    let record = amqp_delay::ops::control::Record::Barrier { nonce: "n".into() };
    let e = amqp_delay::ops::control::append(&env.conn, &layout, &record)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "the stream exchange '{}' is missing",
            layout.stream_exchange()
        )),
        "{e}"
    );
    // (teardown reads the control stream up to a barrier of its own: it needs it too)
    Topology::new(layout.clone())
        .declare(&env.conn)
        .await
        .unwrap();
    env.cleanup().await;
}
