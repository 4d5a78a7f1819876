//! Cancelling against a real RabbitMQ: tombstones in the control stream, honoured by every
//! worker, across restarts and retries, with memory that follows the live cancellations only.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use amqp_delay::cancel::{Cancellations, Verdict};
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Message, Outcome, Precision, Topology};
use rand::seq::SliceRandom;

use crate::harness::*;
use crate::worker::{Scripted, retry, spawn_worker};

/// A topology whose messages may wait up to 4 s, long enough for a cancel to be in time.
async fn env() -> Env {
    let mut t = small_topology();
    t.max_delay = DurationMs(4_000);
    let mut env = Env::new(t).await;
    env.settings.precision = Precision {
        lateness_ms: 20,
        lateness_ratio: 0.0,
    };
    env
}

fn executed_ids(log: &std::sync::Mutex<Vec<(String, u32, u64)>>) -> Vec<String> {
    log.lock().unwrap().iter().map(|r| r.0.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_half_of_a_thousand_runs_exactly_the_other_half() {
    let mut env = env().await;
    let q = env.queue("half").await;
    env.parked_queue(&q);
    Topology::new(env.layout())
        .declare_batch_marker(&env.conn, &q)
        .await
        .unwrap();
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let n = 1000;
    let msgs: Vec<Message> = (0..n)
        .map(|i| Message::new(q.clone(), 1200 + (i % 300) as u64, "x").with_id(format!("c{i}")))
        .collect();
    let scheduled: Vec<_> = p
        .schedule_batch(msgs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rand::rng());
    let cancelled: HashSet<String> = order[..n / 2]
        .iter()
        .map(|&i| scheduled[i].message_id.clone())
        .collect();
    let items = order[..n / 2].iter().map(|&i| {
        (
            i,
            scheduled[i].message_id.clone(),
            Some(scheduled[i].due_at_ms),
        )
    });
    {
        let mut results = std::pin::pin!(p.cancel_all(futures::stream::iter(items)));
        while let Some((_, r)) = futures::StreamExt::next(&mut results).await {
            assert_eq!(r.unwrap().verdict, Verdict::Honoured, "cancels were late");
        }
    }
    assert!(
        wait_until(Duration::from_secs(20), || log.lock().unwrap().len()
            >= n / 2)
        .await,
        "not every kept message ran"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ran: Vec<String> = executed_ids(&log);
    let ran_set: HashSet<String> = ran.iter().cloned().collect();
    let want: HashSet<String> = scheduled
        .iter()
        .map(|s| s.message_id.clone())
        .filter(|id| !cancelled.contains(id))
        .collect();
    assert_eq!(ran_set, want, "exactly the kept half runs");
    assert_eq!(ran.len(), n / 2, "nothing ran twice");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_survives_a_worker_restart_and_stops_retries() {
    let mut env = env().await;
    let q = env.queue("restart").await;
    env.parked_queue(&q);
    let p = env.publisher().await;
    // cancelled while no worker runs; the worker that starts later honours it
    let gone = p
        .schedule(Message::new(q.clone(), 3_000, "gone").with_id("gone"))
        .await
        .unwrap();
    let kept = p
        .schedule(Message::new(q.clone(), 3_000, "kept").with_id("kept"))
        .await
        .unwrap();
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let c = p.cancel_scheduled(&gone).await.unwrap();
    assert_eq!(c.verdict, Verdict::Honoured);
    let h = Scripted::new(|_| Outcome::Success);
    let log2 = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    assert!(wait_until(Duration::from_secs(10), || !log2.lock().unwrap().is_empty()).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert!(log.lock().unwrap().is_empty());
    assert_eq!(executed_ids(&log2), std::slice::from_ref(&kept.message_id));

    // cancelled during its retry backoff: no further attempt
    let h = Scripted::new(|_| Outcome::Retry("not yet".into()));
    let log3 = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(1_200, 1.0, 5));
    p.schedule(Message::new(q.clone(), 50, "r").with_id("retried"))
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || !log3.lock().unwrap().is_empty()).await);
    let c = p.cancel("retried", None).await.unwrap();
    assert_eq!(c.verdict, Verdict::Unknown);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(
        executed_ids(&log3),
        ["retried"],
        "a cancelled retry ran again"
    );
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_workers_never_run_a_cancelled_message() {
    let mut env = env().await;
    let q = env.queue("competing").await;
    env.parked_queue(&q);
    let a = Scripted::new(|_| Outcome::Success);
    let b = Scripted::new(|_| Outcome::Success);
    let (la, lb) = (a.log.clone(), b.log.clone());
    let (stop_a, run_a) = spawn_worker(&env, &q, a, retry(20, 2.0, 3));
    let (stop_b, run_b) = spawn_worker(&env, &q, b, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let msgs: Vec<Message> = (0..200)
        .map(|i| Message::new(q.clone(), 2_500, "x").with_id(format!("w{i}")))
        .collect();
    let scheduled: Vec<_> = p
        .schedule_batch(msgs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    for s in scheduled.iter().step_by(2) {
        assert_eq!(
            p.cancel_scheduled(s).await.unwrap().verdict,
            Verdict::Honoured
        );
    }
    assert!(
        wait_until(Duration::from_secs(15), || {
            la.lock().unwrap().len() + lb.lock().unwrap().len() >= 100
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_a.send(()).unwrap();
    stop_b.send(()).unwrap();
    run_a.await.unwrap().unwrap();
    run_b.await.unwrap().unwrap();
    let ran: HashSet<String> = executed_ids(&la)
        .into_iter()
        .chain(executed_ids(&lb))
        .collect();
    let want: HashSet<String> = scheduled
        .iter()
        .skip(1)
        .step_by(2)
        .map(|s| s.message_id.clone())
        .collect();
    assert_eq!(ran, want);
    p.close().await;
    env.cleanup().await;
}

/// The guarantee is `cancel.notice` (1 s): tested at that boundary, with the measured time a
/// confirmed cancel takes to reach a follower printed for the docs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_confirmed_the_notice_before_due_is_honoured_and_a_late_one_is_reported() {
    let mut env = env().await;
    let q = env.queue("boundary").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let notice = env.settings.cancel.notice.as_millis();
    let mut honoured = Vec::new();
    for i in 0..20 {
        // due 1.1 s ahead: the cancel is sent 1.0 s + a few ms before the due time
        let s = p
            .schedule(Message::new(q.clone(), 1_100, "b").with_id(format!("b{i}")))
            .await
            .unwrap();
        let wait = s.due_at_ms.saturating_sub(now_ms() + notice + 30);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let c = p.cancel_scheduled(&s).await.unwrap();
        if c.verdict == Verdict::Honoured {
            honoured.push(s.message_id);
        }
    }
    assert!(
        honoured.len() >= 15,
        "only {} cancels in time",
        honoured.len()
    );
    // too late: it already ran
    let s = p
        .schedule(Message::new(q.clone(), 0, "late").with_id("late"))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || executed_ids(&log)
            .contains(&"late".into()))
        .await
    );
    assert_eq!(
        p.cancel_scheduled(&s).await.unwrap().verdict,
        Verdict::TooLate
    );
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ran: HashSet<String> = executed_ids(&log).into_iter().collect();
    for id in &honoured {
        assert!(
            !ran.contains(id),
            "{id} ran although cancelled {notice} ms before its due time"
        );
    }

    // how long a confirmed cancel takes to reach a follower
    let follower = Cancellations::follow(
        &env.conn,
        &env.layout(),
        Duration::from_millis(notice),
        60_000,
    )
    .await
    .unwrap();
    let mut lat = Vec::new();
    for i in 0..50 {
        let id = format!("probe{i}");
        p.cancel(&id, None).await.unwrap();
        let t = Instant::now();
        while !follower.is_cancelled(&id) {
            tokio::time::sleep(Duration::from_micros(200)).await;
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the follower never saw {id}"
            );
        }
        lat.push(t.elapsed().as_micros() as i64);
    }
    lat.sort_unstable();
    eprintln!(
        "cancel propagation (confirm → follower) µs: p50 {} p99 {} max {}; guarantee: cancel.notice {notice} ms",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat[lat.len() - 1]
    );
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_follows_live_cancellations_only() {
    let mut env = env().await;
    // a short horizon (retries are off), so tombstones are forgotten within the test
    env.settings.consumer.retry.max_attempts = 1;
    env.settings.consumer.handler_timeout = DurationMs(500);
    env.settings.cancel.horizon = DurationMs(1_000);
    let p = env.publisher().await;
    let follower = Cancellations::follow(
        &env.conn,
        &env.layout(),
        Duration::from_millis(1_000),
        env.settings.cancel.horizon.as_millis(),
    )
    .await
    .unwrap();
    let n = 100_000;
    let due = now_ms() + 200;
    let items = (0..n).map(|i| (i, format!("m{i}"), Some(due)));
    let start = Instant::now();
    let mut ok = 0;
    {
        let mut results = std::pin::pin!(p.cancel_all(futures::stream::iter(items)));
        while let Some((_, r)) = futures::StreamExt::next(&mut results).await {
            r.unwrap();
            ok += 1;
        }
    }
    assert_eq!(ok, n);
    eprintln!("{n} cancels confirmed in {:?}", start.elapsed());
    follower.sync().await.unwrap();
    let peak = follower.len();
    // their messages fell due 200 ms after the cancels; a second later the horizon is over
    assert!(
        wait_until(Duration::from_secs(10), || follower.is_empty()).await,
        "{} tombstones still held (peak {peak})",
        follower.len()
    );
    eprintln!(
        "tombstones held: peak {peak}, after the horizon {}",
        follower.len()
    );
    // a fresh follower reading the whole stream holds none of them either
    let fresh = Cancellations::follow(
        &env.conn,
        &env.layout(),
        Duration::from_millis(1_000),
        1_000,
    )
    .await
    .unwrap();
    assert_eq!(fresh.len(), 0);
    p.close().await;
    env.cleanup().await;
}
