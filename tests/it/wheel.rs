//! The timing wheel's last grain against a real RabbitMQ: to a destination our worker reads,
//! messages due in the same grain window travel as one batch on a coarse route that arrives
//! before they are due, and the worker holds each until its exact due time. What a user sees:
//! a trickle costs a handful of broker messages, nothing runs early, nothing is lost (also
//! when the worker dies holding them, or may take only one message at a time), a held
//! message can be cancelled, and plain queues and publishers without grains are served with
//! exact routes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use amqp_delay::time::DurationMs;
use amqp_delay::{Message, Outcome, Publisher, Topology};

use crate::harness::*;
use crate::worker::{Scripted, consumer, ids, retry, spawn_worker, spawn_worker_with};

/// Declares `q`'s batch and hold markers, as a worker does when it starts.
async fn mark(env: &Env, q: &str) {
    Topology::new(env.layout())
        .declare_batch_marker(&env.conn, q)
        .await
        .expect("markers");
}

/// Runs of `log` by id, and the earliest a member ran before its due time (negative: early).
fn runs_and_worst(
    log: &[(String, u32, u64)],
    dues: &[Option<u64>],
) -> (HashMap<String, usize>, i64, Vec<i64>) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut earliest = i64::MAX;
    let mut late = Vec::new();
    for ((id, _, ran), due) in log.iter().zip(dues) {
        *seen.entry(id.clone()).or_default() += 1;
        let l = *ran as i64 - due.expect("every message has its due time") as i64;
        earliest = earliest.min(l);
        late.push(l);
    }
    late.sort_unstable();
    (seen, earliest, late)
}

/// Distinct broker messages behind `results` (members of one batch share its count).
fn broker_messages(results: &[amqp_delay::Scheduled]) -> f64 {
    results.iter().map(|s| 1.0 / s.batched_with as f64).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_travels_in_a_handful_of_broker_messages_and_nothing_runs_early() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("trickle").await;
    env.parked_queue(&q);
    mark(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = std::sync::Arc::new(env.publisher().await);
    // one message every 2 ms for ~0.8 s, each from a caller of its own, all due 1 s later
    let n = 400;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let (p, q) = (p.clone(), q.clone());
        calls.spawn(async move {
            let m = Message::new(q, 1_000, format!("t{i}")).with_id(format!("t{i}"));
            p.schedule(m).await
        });
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut results = Vec::new();
    while let Some(r) = calls.join_next().await {
        results.push(r.unwrap().expect("scheduled"));
    }
    let brokered = broker_messages(&results);
    assert!(
        wait_until(Duration::from_secs(20), || log.lock().unwrap().len() >= n).await,
        "not every message ran"
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let (seen, earliest, late) = runs_and_worst(&log.lock().unwrap(), &dues.lock().unwrap());
    assert_eq!(seen.len(), n, "missing messages");
    assert!(earliest >= 0, "a message ran {} ms early", -earliest);
    // a few dozen on an idle machine (one per grain window per linger, 100 ms), never one per
    // message: how many depends on how evenly the trickle arrives, which a loaded machine does
    // not keep (94 once in CI, with the other suites running), so the bound is half of them
    assert!(
        brokered <= n as f64 / 2.0,
        "{n} messages took {brokered:.0} broker messages"
    );
    eprintln!(
        "trickle of {n}: {brokered:.0} broker messages; lateness p50 {} ms, p99 {} ms, max {} ms",
        percentile(&late, 0.5),
        percentile(&late, 0.99),
        late.last().unwrap()
    );
    env.assert_tiers_empty().await;
    Arc::try_unwrap(p)
        .ok()
        .expect("one publisher")
        .close()
        .await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_for_a_held_member_is_honoured_and_its_batch_mates_run() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("heldcancel").await;
    env.parked_queue(&q);
    mark(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    // one bulk, due within 300 ms of each other, 1.2 s from now: one or two grain batches,
    // held by the worker for up to a grain
    let n = 20;
    let msgs: Vec<Message> = (0..n)
        .map(|i| Message::new(q.clone(), 1_200 + i * 15, "x").with_id(format!("h{i}")))
        .collect();
    let results: Vec<_> = p
        .schedule_batch(msgs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(broker_messages(&results) <= 3.0, "not batched: {results:?}");
    // cancel the last one while its batch travels or is held
    let c = p
        .cancel(
            &format!("h{}", n - 1),
            Some(results[n as usize - 1].due_at_ms),
        )
        .await
        .unwrap();
    eprintln!("cancel: {c:?}");
    assert!(
        wait_until(Duration::from_secs(20), || log.lock().unwrap().len()
            >= n as usize - 1)
        .await,
        "the batch mates did not run"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let (seen, earliest, _) = runs_and_worst(&log.lock().unwrap(), &dues.lock().unwrap());
    assert!(
        !seen.contains_key(&format!("h{}", n - 1)),
        "a cancelled held message ran"
    );
    assert_eq!(seen.len(), n as usize - 1);
    assert!(earliest >= 0, "a message ran {} ms early", -earliest);
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_in_hand_bound_takes_one_delivery_at_a_time_and_loses_nothing() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("tinyhand").await;
    env.parked_queue(&q);
    mark(&env, &q).await;
    let mut s = env.settings.clone();
    s.consumer.retry = retry(20, 2.0, 3);
    s.consumer.max_in_hand = 1;
    s.consumer.max_in_hand_bytes = 1;
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker_with(s, &q, h);
    let p = env.publisher().await;
    // three bulks a little apart: several broker messages, each held in turn
    let mut want = 0;
    for b in 0..3 {
        let msgs: Vec<Message> = (0..30)
            .map(|i| {
                Message::new(q.clone(), 300 + (i * 37) % 900, "x").with_id(format!("k{b}-{i}"))
            })
            .collect();
        want += msgs.len();
        for r in p.schedule_batch(msgs).await {
            r.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(
        wait_until(Duration::from_secs(30), || ids_of(&log).len() >= want).await,
        "with one delivery in hand at a time, not every message ran"
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let (seen, earliest, _) = runs_and_worst(&log.lock().unwrap(), &dues.lock().unwrap());
    assert_eq!(seen.len(), want);
    assert!(earliest >= 0, "a message ran {} ms early", -earliest);
    env.assert_tiers_empty().await;
    env.assert_empty(&q).await;
    p.close().await;
    env.cleanup().await;
}

fn ids_of(log: &std::sync::Mutex<Vec<(String, u32, u64)>>) -> std::collections::HashSet<String> {
    log.lock().unwrap().iter().map(|r| r.0.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_holding_is_redelivered_and_runs_each_at_least_once() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("heldkill").await;
    env.parked_queue(&q);
    mark(&env, &q).await;
    let out = temp_path(&env.settings.prefix, "heldkill.out");
    let cfg = env.write_config("");
    let cmd = format!(
        "sh -c 'echo \"$DELAY_MESSAGE_ID $DELAY_DUE_AT $(date +%s%3N)\" >> {}'",
        out.display()
    );
    let args = ["--queue", q.as_str(), "--exec", cmd.as_str()];
    let mut child = consumer(&env, &cfg, &args);
    wait_for_consumer(&env, &q).await;
    let p = env.publisher().await;
    let n = 40;
    let msgs: Vec<Message> = (0..n)
        .map(|i| Message::new(q.clone(), 1_300 + i * 5, "x").with_id(format!("w{i}")))
        .collect();
    for r in p.schedule_batch(msgs).await {
        r.unwrap();
    }
    // held: out of the tiers and out of the queue, and not run yet
    let held = wait_until_async(Duration::from_secs(10), || async {
        let ready = amqp_delay::ops::broker::queue_state(&env.conn, &q)
            .await
            .unwrap();
        let stats = Topology::new(env.layout()).stats(&env.conn).await.unwrap();
        ready.is_some_and(|s| s.ready == 0) && stats.iter().all(|s| s.messages == 0)
    })
    .await;
    let before = read_lines(&out).len();
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    eprintln!("killed holding (everything left the tiers: {held}), {before} already ran");
    let mut child = consumer(&env, &cfg, &args);
    let ok = wait_until(Duration::from_secs(30), || {
        ids(&read_lines(&out)).len() >= n as usize
    })
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let lines = read_lines(&out);
    let seen = ids(&lines);
    assert!(ok, "lost: {} of {n} ran", seen.len());
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (due, ran): (i64, i64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        assert!(ran >= due, "{} ran {} ms early", f[0], due - ran);
    }
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// Waits until `q` has a consumer.
async fn wait_for_consumer(env: &Env, q: &str) {
    let up = wait_until_async(Duration::from_secs(20), || async {
        amqp_delay::ops::broker::queue_state(&env.conn, q)
            .await
            .unwrap()
            .is_some_and(|s| s.consumers > 0)
    })
    .await;
    assert!(up, "delay-consumer did not start consuming {q}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_queue_gets_exact_messages_never_early() {
    let mut env = Env::new(small_topology()).await;
    let plain = env.queue("plainq").await;
    let p = env.publisher().await;
    let mut msgs = Vec::new();
    for (i, d) in [0u64, 40, 300, 700, 1_100].iter().enumerate() {
        msgs.push(Message::new(plain.clone(), *d, "x").with_id(format!("{plain}-{i}")));
    }
    for r in p.schedule_batch(msgs).await {
        r.unwrap();
    }
    // a raw consumer: what arrives is run as it arrives, so it must never be early
    let got = env.expect(&plain, 5).await;
    for m in &got {
        let due = m.int_header("x-delay-due-at").expect("due time");
        assert!(
            m.arrived_ms as i64 >= due,
            "{} arrived {} ms early at {plain}",
            m.id(),
            due - m.arrived_ms as i64
        );
    }
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_route_publisher_and_a_grain_publisher_share_a_destination() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("mixed").await;
    env.parked_queue(&q);
    mark(&env, &q).await;
    let h = Scripted::new(|_| Outcome::Success);
    let (log, dues) = (h.log.clone(), h.dues.clone());
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let grain = env.publisher().await;
    // a publisher without grains: exact routes, batches only within the budget
    let mut old = env.settings.clone();
    old.publisher.grain = DurationMs(0);
    let exact = Publisher::connect(&old).await.expect("exact publisher");
    let batch = |tag: &str| -> Vec<Message> {
        (0..50)
            .map(|i| {
                Message::new(q.clone(), 200 + (i * 23) % 1_100, "x").with_id(format!("{tag}{i}"))
            })
            .collect()
    };
    let (a, b) = tokio::join!(
        grain.schedule_batch(batch("g")),
        exact.schedule_batch(batch("e"))
    );
    let a: Vec<_> = a.into_iter().map(|r| r.unwrap()).collect();
    let b: Vec<_> = b.into_iter().map(|r| r.unwrap()).collect();
    // the grain routes arrive at least a lead (200 ms) before their due time; the exact ones
    // (planned a moment after the request) do not
    assert!(
        a.iter().all(|s| s.route.total_ms + 200 <= s.delay_ms),
        "a grain route was not early: {a:?}"
    );
    let exact_routes = b
        .iter()
        .filter(|s| s.route.total_ms + 200 > s.delay_ms)
        .count();
    assert!(
        exact_routes > b.len() / 2,
        "the exact publisher sent coarse routes: {b:?}"
    );
    assert!(
        wait_until(Duration::from_secs(20), || ids_of(&log).len() >= 100).await,
        "not every message ran"
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let (seen, earliest, _) = runs_and_worst(&log.lock().unwrap(), &dues.lock().unwrap());
    assert_eq!(seen.len(), 100);
    assert!(seen.values().all(|&c| c == 1));
    assert!(earliest >= 0, "a message ran {} ms early", -earliest);
    grain.close().await;
    exact.close().await;
    env.cleanup().await;
}
