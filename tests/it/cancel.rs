//! Cancelling against a real RabbitMQ: tombstones in the control stream, honoured by every
//! worker, across restarts and retries, with memory that follows the live cancellations only.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use amqp_delay::ops::cancel::{
    CHECKPOINT_EVERY, Cancellations, EXPIRED_KEPT, FollowOptions, Verdict,
};
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Counters, Message, Outcome, Precision, Settings, Topology, Worker};
use rand::seq::SliceRandom;
use tokio::sync::oneshot;

use crate::harness::*;
use crate::worker::{Scripted, retry, spawn_worker};

fn executed_ids(log: &std::sync::Mutex<Vec<(String, u32, u64)>>) -> Vec<String> {
    log.lock().unwrap().iter().map(|r| r.0.clone()).collect()
}

/// Half of a thousand messages cancelled in random order: exactly the other half runs, once each.
/// The messages are due 3.0–3.3 s out, two seconds past `cancel.notice` (1 s). They were due
/// 1.2 s out, leaving 0.2 s to schedule them and cancel half, and a CI run with the benchmark
/// beside it failed here; scheduling and cancelling took 470 ms with two CPU hogs and the
/// benchmark beside them. A cancel confirmed late all the same is reported `TooLate`, and its
/// message may run: it is left out of "exactly" and the count is printed. The product's rule
/// (no `Honoured` cancel's message runs) is asserted whatever the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_half_of_a_thousand_runs_exactly_the_other_half() {
    let mut env = steering_env(4_000).await;
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
        .map(|i| Message::new(q.clone(), 3_000 + (i % 300) as u64, "x").with_id(format!("c{i}")))
        .collect();
    let started = Instant::now();
    let scheduled: Vec<_> = p
        .schedule_batch(msgs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rand::rng());
    let items = order[..n / 2].iter().map(|&i| {
        (
            i,
            scheduled[i].message_id.clone(),
            Some(scheduled[i].due_at_ms),
        )
    });
    let mut honoured = HashSet::new();
    let mut too_late = HashSet::new();
    {
        let mut results = std::pin::pin!(p.cancel_all(futures::stream::iter(items)));
        while let Some((i, r)) = futures::StreamExt::next(&mut results).await {
            let id = scheduled[i].message_id.clone();
            match r.unwrap().verdict {
                Verdict::Honoured => honoured.insert(id),
                Verdict::TooLate => too_late.insert(id),
                Verdict::Unknown => {
                    panic!("{id}: cancelled with its due time, yet the verdict is Unknown")
                }
            };
        }
    }
    eprintln!(
        "scheduled {n} and cancelled {} in {:?}",
        n / 2,
        started.elapsed()
    );
    assert!(!honoured.is_empty(), "no cancel was in time");
    if !too_late.is_empty() {
        eprintln!(
            "{} of {} cancels were confirmed too late (a loaded machine)",
            too_late.len(),
            n / 2
        );
    }
    let want: HashSet<String> = scheduled
        .iter()
        .map(|s| s.message_id.clone())
        .filter(|id| !honoured.contains(id) && !too_late.contains(id))
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || {
            let ran: HashSet<String> = executed_ids(&log).into_iter().collect();
            ran.is_superset(&want)
        })
        .await,
        "not every kept message ran"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ran: Vec<String> = executed_ids(&log);
    let ran_set: HashSet<String> = ran.iter().cloned().collect();
    assert_eq!(ran.len(), ran_set.len(), "nothing ran twice");
    let wrongly: Vec<&String> = ran_set.intersection(&honoured).collect();
    assert!(wrongly.is_empty(), "honoured cancels ran: {wrongly:?}");
    let extra: Vec<&String> = ran_set
        .difference(&want)
        .filter(|id| !too_late.contains(*id))
        .collect();
    assert!(extra.is_empty(), "ran though never scheduled: {extra:?}");
    assert!(ran_set.is_superset(&want), "exactly the kept half runs");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_survives_a_worker_restart_and_stops_retries() {
    let mut env = steering_env(4_000).await;
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
    // the first attempt failed and was retried: the cancel came in time for the next one,
    // not "after the message ran"
    assert_eq!(too_late_metric(&q), 0, "a retried message counted as run");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_workers_never_run_a_cancelled_message() {
    let mut env = steering_env(4_000).await;
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
    // the hundred cancels go out together: one after another, a hundred confirm waits could eat
    // the 1.5 s between the schedule and `cancel.notice` before the due time on a loaded machine
    let items = scheduled.iter().step_by(2).map(|s| {
        (
            s.message_id.clone(),
            s.message_id.clone(),
            Some(s.due_at_ms),
        )
    });
    {
        let mut results = std::pin::pin!(p.cancel_all(futures::stream::iter(items)));
        while let Some((id, r)) = futures::StreamExt::next(&mut results).await {
            assert_eq!(r.unwrap().verdict, Verdict::Honoured, "{id}");
        }
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
    let mut env = steering_env(4_000).await;
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
    // and the worker that ran it says so
    assert!(
        wait_until(Duration::from_secs(5), || too_late_metric(&q) == 1).await,
        "no too-late count for a message that ran"
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
        while !follower.is_cancelled(&id, Some("guest")) {
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
    let mut env = steering_env(4_000).await;
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
    // expired tombstones are kept for a while, never more than EXPIRED_KEPT
    let (a, b) = (follower.stats(), fresh.stats());
    eprintln!("expired tombstones kept: {} and {}", a.expired, b.expired);
    assert!(a.expired <= EXPIRED_KEPT && b.expired <= EXPIRED_KEPT);
    p.close().await;
    env.cleanup().await;
}

/// Runs a library worker on `queue` until `stop` fires, with its counters.
fn spawn_counted(
    settings: Settings,
    queue: &str,
    handler: Scripted,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<amqp_delay::Result<()>>,
    Arc<Counters>,
) {
    let (tx, rx) = oneshot::channel::<()>();
    let w = Worker::new(settings).subscribe(queue.to_string(), handler);
    let counters = w.counters();
    let h = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    (tx, h, counters)
}

/// Appends raw JSON records to the control stream, confirmed, many in flight at once.
async fn append_raw(env: &Env, bodies: impl Iterator<Item = String>) {
    let stream = env.layout().control_stream();
    let ch = env.conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut pending = Vec::new();
    for body in bodies {
        pending.push(
            ch.basic_publish(
                "".into(),
                stream.as_str().into(),
                Default::default(),
                body.as_bytes(),
                lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_user_id("guest".into()),
            )
            .await
            .unwrap(),
        );
        if pending.len() >= 2_000 {
            for c in pending.drain(..) {
                assert!(c.await.unwrap().is_ack());
            }
        }
    }
    for c in pending.drain(..) {
        assert!(c.await.unwrap().is_ack());
    }
    let _ = ch.close(200, "ok".into()).await;
}

fn cancelled_count(c: &Counters) -> u64 {
    c.cancelled.load(Ordering::Relaxed)
}

/// The metric `amqp_delay_cancel_too_late_total` of `queue` (0 when never counted).
fn too_late_metric(queue: &str) -> u64 {
    let text = amqp_delay::metrics::global().encode();
    let key = format!("amqp_delay_cancel_too_late_total{{queue=\"{queue}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Start-up is bounded by checkpoints: with 100 000 old records (barriers, as busy workers
/// leave them) in the stream, the first follower reads them all and writes a checkpoint; the
/// next one reads back from the end only as far as that checkpoint, and still holds the
/// tombstones recorded before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_reads_from_the_latest_checkpoint_not_the_whole_stream() {
    let env = steering_env(4_000).await;
    let now = now_ms();
    let n = 100_000;
    let t = Instant::now();
    let early = [
        format!(
            r#"{{"type":"cancel","id":"early-live","until_ms":{}}}"#,
            now + 3_600_000
        ),
        // past its until already: kept as an expired tombstone
        format!(
            r#"{{"type":"cancel","id":"early-expired","until_ms":{}}}"#,
            now - 1_000
        ),
    ];
    let junk = (0..n).map(|i| format!(r#"{{"type":"barrier","nonce":"old-{i:08}"}}"#));
    append_raw(&env, early.into_iter().chain(junk)).await;
    eprintln!("{n} old records appended in {:?}", t.elapsed());
    let opts = FollowOptions::new(Duration::from_millis(1_000), 60_000);

    let t = Instant::now();
    let first = Cancellations::follow_with(&env.conn, &env.layout(), opts.clone())
        .await
        .unwrap();
    let first_took = t.elapsed();
    let s = first.stats();
    assert!(s.start_records > n, "{s:?}");
    assert!(
        first.is_cancelled("early-live", Some("guest"))
            && first.is_cancelled("early-expired", Some("guest"))
    );
    // it read far more than a checkpoint's worth: it writes one
    assert!(
        wait_until(Duration::from_secs(10), || {
            let s = first.stats();
            s.checkpoints_written >= 1 && s.checkpoints_read >= 1
        })
        .await,
        "no checkpoint: {:?}",
        first.stats()
    );
    // more records after the checkpoint
    append_raw(
        &env,
        (0..5_000).map(|i| format!(r#"{{"type":"barrier","nonce":"new-{i:08}"}}"#)),
    )
    .await;

    let t = Instant::now();
    let second = Cancellations::follow_with(&env.conn, &env.layout(), opts)
        .await
        .unwrap();
    let second_took = t.elapsed();
    let s2 = second.stats();
    eprintln!(
        "start-up with {} records in the stream: without a checkpoint {first_took:?} ({} records read), from the checkpoint {second_took:?} ({} records read)",
        n + 5_000,
        s.start_records,
        s2.start_records
    );
    assert!(
        s2.start_records <= 2 * CHECKPOINT_EVERY + 100,
        "read more than the way back to the checkpoint: {s2:?}"
    );
    assert!(s2.checkpoints_read >= 1, "{s2:?}");
    assert!(
        second.is_cancelled("early-live", Some("guest")),
        "lost a tombstone"
    );
    assert!(
        second.is_cancelled("early-expired", Some("guest")),
        "lost an expired one"
    );
    assert!(!second.is_cancelled("never", Some("guest")));
    // how long that takes is printed above, not asserted: the suite does not control the
    // machine's load (5.7 s once on a loaded 2-core machine, 4.0.5); the records read are the
    // property
    // and it works as a follower: a cancel now reaches it
    let p = env.publisher().await;
    p.cancel("later", None).await.unwrap();
    second.sync().await.unwrap();
    assert!(second.is_cancelled("later", Some("guest")));
    p.close().await;
    drop((first, second));
    env.cleanup().await;
}

/// A handler that keeps saying "not now" is not called again once its message is cancelled:
/// the message is acked as cancelled, not held for `requeue_hold`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_held_by_not_now_stops_when_cancelled() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("held").await;
    env.parked_queue(&q);
    let mut s = env.settings.clone();
    s.consumer.requeue_hold = DurationMs(30_000);
    s.consumer.retry = retry(20, 2.0, 3);
    let h = Scripted::new(|_| Outcome::Requeue("not now".into()));
    let log = h.log.clone();
    let (stop, run, counters) = spawn_counted(s, &q, h);
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 50, "h").with_id("held"))
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 2).await);
    p.cancel("held", None).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || cancelled_count(&counters) == 1).await,
        "still held after the cancel: {} calls",
        log.lock().unwrap().len()
    );
    let calls = log.lock().unwrap().len();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        log.lock().unwrap().len(),
        calls,
        "called again after the cancel"
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(counters.parked.load(Ordering::Relaxed), 0);
    env.assert_empty(&q).await;
    p.close().await;
    env.cleanup().await;
}

/// `delay-publisher cancel --id` and `cancel --jsonl`: what they print, their exit codes, and
/// that a running worker honours what they cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_cancel_by_id_and_by_jsonl() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("cli").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let mut s = env.settings.clone();
    s.consumer.retry = retry(20, 2.0, 3);
    let (stop, run, counters) = spawn_counted(s, &q, h);
    let p = env.publisher().await;
    let mut due = std::collections::HashMap::new();
    for id in ["a", "b", "c", "kept"] {
        let m = p
            .schedule(Message::new(q.clone(), 3_000, "x").with_id(id))
            .await
            .unwrap();
        due.insert(id, m.due_at_ms);
    }
    let cfg = env.write_config("");
    let verdicts = |stdout: &str| -> Vec<(String, String)> {
        stdout
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert!(v["until"].as_u64().is_some(), "{l}");
                (
                    v["id"].as_str().unwrap().to_string(),
                    v["verdict"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };

    let due_a = due["a"].to_string();
    let (code, out, err) = publisher_cli(&cfg, &["cancel", "--id", "a", "--due-at", &due_a]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(verdicts(&out), [("a".to_string(), "honoured".to_string())]);
    // an id nobody scheduled: harmless, and without a due time the verdict is unknown
    let (code, out, err) = publisher_cli(&cfg, &["cancel", "--id", "nobody"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        verdicts(&out),
        [("nobody".to_string(), "unknown".to_string())]
    );

    let file = temp_path(&env.settings.prefix, "cancel.jsonl");
    std::fs::write(
        &file,
        format!(
            "{{\"id\":\"b\",\"due_at\":{}}}\n\nnot json\n{{\"id\":\"c\"}}\n{{\"id\":\"gone-by\",\"due_at\":{}}}\n",
            due["b"],
            now_ms() - 60_000
        ),
    )
    .unwrap();
    let (code, out, err) =
        publisher_cli(&cfg, &["cancel", "--jsonl", file.to_str().unwrap()]).await;
    assert_eq!(code, Some(1), "a bad line fails the run: {err}");
    let mut got = verdicts(&out);
    got.sort();
    assert_eq!(
        got,
        [
            ("b".to_string(), "honoured".to_string()),
            ("c".to_string(), "unknown".to_string()),
            ("gone-by".to_string(), "too_late".to_string()),
        ]
    );
    assert!(err.contains("line 3: not a cancel request"), "{err}");
    assert!(err.contains("3 cancelled, 1 failed"), "{err}");

    assert!(wait_until(Duration::from_secs(10), || !log.lock().unwrap().is_empty()).await);
    assert!(wait_until(Duration::from_secs(5), || cancelled_count(&counters) == 3).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(executed_ids(&log), ["kept"]);
    assert_eq!(cancelled_count(&counters), 3);
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// Cancelled while a worker runs, which then restarts before the due time: the new session
/// reads the tombstone back and honours it. A loaded machine may take longer to stop the worker
/// than the delay, which proves nothing: the test then repeats with a longer delay, and fails
/// only when even the longest was not enough (it never passes unproven).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_read_by_a_running_worker_holds_after_its_restart() {
    let mut env = steering_env(12_000).await;
    for delay in [2_500, 5_000, 10_000] {
        if cancel_holds_after_restart(&mut env, delay).await {
            env.cleanup().await;
            return;
        }
        eprintln!("the worker restarted after the due time of a {delay} ms delay: again, longer");
    }
    panic!("the worker never restarted before the due time, even for a 10 s delay");
}

/// One try of [`a_cancel_read_by_a_running_worker_holds_after_its_restart`] on a queue of its
/// own: false when the restart came too late to prove anything.
async fn cancel_holds_after_restart(env: &mut Env, delay: u64) -> bool {
    let q = env.queue(&format!("rerun{delay}")).await;
    env.parked_queue(&q);
    let mut s = env.settings.clone();
    s.consumer.retry = retry(20, 2.0, 3);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run, _) = spawn_counted(s.clone(), &q, h.clone());
    let p = env.publisher().await;
    let gone = p
        .schedule(Message::new(q.clone(), delay, "gone").with_id("gone"))
        .await
        .unwrap();
    p.schedule(Message::new(q.clone(), delay, "kept").with_id("kept"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        p.cancel_scheduled(&gone).await.unwrap().verdict,
        Verdict::Honoured
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    if now_ms() >= gone.due_at_ms {
        p.close().await;
        return false;
    }
    let (stop, run, counters) = spawn_counted(s, &q, h);
    assert!(wait_until(Duration::from_secs(15), || !log.lock().unwrap().is_empty()).await);
    assert!(wait_until(Duration::from_secs(5), || cancelled_count(&counters) == 1).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(executed_ids(&log), ["kept"]);
    p.close().await;
    true
}

/// The guarantee's boundary where it is easiest to get wrong: a busy worker (a message falling
/// due every 40 ms) has always just synced, so it checks most messages against a recent sync
/// without a barrier of its own. A cancel confirmed exactly `cancel.notice` before the due time
/// must still win, every time; one sent later is answered `too_late`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_honours_every_cancel_confirmed_exactly_the_notice_before_due() {
    let mut t = small_topology();
    t.max_delay = DurationMs(10_000);
    let mut env = Env::new(t).await;
    env.settings.precision = Precision {
        lateness: DurationMs(20),
        lateness_ratio: 0.0,
    };
    let q = env.queue("busy").await;
    env.parked_queue(&q);
    let mut s = env.settings.clone();
    s.consumer.retry = retry(20, 2.0, 3);
    let notice = s.cancel.notice.as_millis();
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run, counters) = spawn_counted(s, &q, h);
    let p = env.publisher().await;
    // fillers fall due every 40 ms for 6.5 s
    let fillers: Vec<Message> = (0..160)
        .map(|i| Message::new(q.clone(), 200 + i * 40, "f").with_id(format!("f{i}")))
        .collect();
    for r in p.schedule_batch(fillers).await {
        r.unwrap();
    }
    // 20 at the boundary and 5 too late, due 1.6 s to 5.3 s from now, 150 ms apart
    let mut targets = Vec::new();
    for i in 0..25u64 {
        let id = if i % 5 == 4 {
            format!("late{i}")
        } else {
            format!("edge{i}")
        };
        let m = p
            .schedule(Message::new(q.clone(), 1_600 + i * 150, "t").with_id(id))
            .await
            .unwrap();
        targets.push(m);
    }
    let syncs_before = counters.cancel_syncs.load(Ordering::Relaxed);
    let mut edge = Vec::new();
    let mut overshot = Vec::new();
    let mut on_time = 0;
    for m in &targets {
        let late = m.message_id.starts_with("late");
        // the cancel's confirm lands at the notice (a few ms early: a confirm takes 5–15 ms
        // here, the publisher's 3 ms settle included), or 100 ms after it
        let at = if late {
            m.due_at_ms - notice + 100
        } else {
            m.due_at_ms - notice - 15
        };
        tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms()))).await;
        let c = p.cancel_scheduled(m).await.unwrap();
        let confirmed = now_ms();
        if late {
            assert_eq!(c.verdict, Verdict::TooLate, "{}", m.message_id);
        } else if c.verdict == Verdict::TooLate && confirmed > m.due_at_ms - notice {
            // on a loaded machine the sleep overshot the notice (the verdict is taken when
            // the cancel is sent): this one did not test the boundary; it may run
            overshot.push((m.message_id.clone(), m.due_at_ms - confirmed));
        } else {
            assert_eq!(c.verdict, Verdict::Honoured, "{}", m.message_id);
            // at the notice, or within 100 ms after it (a loaded machine's confirm)
            if confirmed <= m.due_at_ms - notice + 100 {
                on_time += 1;
            }
            edge.push((m.message_id.clone(), m.due_at_ms - confirmed));
        }
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            executed_ids(&log)
                .iter()
                .filter(|id| id.starts_with('f'))
                .count()
                == 160
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ran: HashSet<String> = executed_ids(&log).into_iter().collect();
    for (id, ahead) in &edge {
        assert!(
            !ran.contains(id),
            "{id} ran although its cancel was confirmed {ahead} ms before its due time"
        );
    }
    assert_eq!(edge.len() + overshot.len(), 20);
    // the boundary must really have been tested: most confirms landed at or near the notice
    // (under the whole suite's load a confirm now and then takes 16–30 ms: one CI run had 17
    // of 20 before the notice; at load average 13 on 4.0.5 only 8 of 20 were, the others up
    // to 76 ms after it, all honoured)
    // The product's rule (no cancel confirmed the notice before due ran) is asserted above for
    // every one. How many confirms land right at the notice depends on the machine's load,
    // which this test does not control: it needs the boundary tested at least once.
    assert!(
        on_time >= 1,
        "no confirm landed at the notice: {edge:?}; sent too late: {overshot:?}"
    );
    eprintln!("busy worker: {on_time} of 20 confirms landed at the notice (within 100 ms)");
    let syncs = counters.cancel_syncs.load(Ordering::Relaxed) - syncs_before;
    let checked = log.lock().unwrap().len() as u64 + cancelled_count(&counters);
    eprintln!(
        "busy worker: {checked} messages checked with {syncs} barriers; cancels confirmed ahead of due (ms): {:?}",
        edge.iter().map(|e| e.1).collect::<Vec<_>>()
    );
    assert!(
        syncs * 3 < checked,
        "most checks should use a recent sync: {syncs} barriers for {checked} messages"
    );
    p.close().await;
    env.cleanup().await;
}

/// A worker that was down until long after `cancel.horizon` past the due time still honours the
/// cancel: an expired tombstone is kept (bounded in number) while the stream holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_down_past_the_horizon_still_honours_a_cancel() {
    let mut env = steering_env(4_000).await;
    env.settings.consumer.retry.max_attempts = 1;
    env.settings.consumer.handler_timeout = DurationMs(500);
    env.settings.cancel.horizon = DurationMs(1_000);
    let q = env.queue("down").await;
    env.parked_queue(&q);
    let p = env.publisher().await;
    let gone = p
        .schedule(Message::new(q.clone(), 300, "gone").with_id("gone"))
        .await
        .unwrap();
    p.schedule(Message::new(q.clone(), 300, "kept").with_id("kept"))
        .await
        .unwrap();
    let c = p.cancel_scheduled(&gone).await.unwrap();
    assert_eq!(c.until_ms, gone.due_at_ms + 1_000);
    // no worker until 2 s after the tombstone's until
    tokio::time::sleep(Duration::from_millis(c.until_ms + 2_000 - now_ms())).await;
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run, counters) = spawn_counted(env.settings.clone(), &q, h);
    assert!(wait_until(Duration::from_secs(10), || !log.lock().unwrap().is_empty()).await);
    assert!(wait_until(Duration::from_secs(5), || cancelled_count(&counters) == 1).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(executed_ids(&log), ["kept"]);
    p.close().await;
    env.cleanup().await;
}

/// A follower whose control stream consumer ends (here: the stream was deleted) can no longer
/// check cancellations; the worker notices, starts a new session, follows the stream again once
/// it is back, and honours cancels as before instead of returning every message to the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_follows_the_control_stream_anew_when_its_follower_stops() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("refollow").await;
    env.parked_queue(&q);
    let mut s = env.settings.clone();
    s.consumer.retry = retry(20, 2.0, 3);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run, counters) = spawn_counted(s, &q, h);
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 50, "a").with_id("before"))
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || !log.lock().unwrap().is_empty()).await);
    let ch = env.conn.create_channel().await.unwrap();
    ch.queue_delete(
        env.layout().control_stream().as_str().into(),
        Default::default(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    env.declare().await.unwrap();
    let gone = p
        .schedule(Message::new(q.clone(), 2_000, "g").with_id("gone"))
        .await
        .unwrap();
    p.schedule(Message::new(q.clone(), 2_000, "k").with_id("kept"))
        .await
        .unwrap();
    assert_eq!(
        p.cancel_scheduled(&gone).await.unwrap().verdict,
        Verdict::Honoured
    );
    assert!(
        wait_until(Duration::from_secs(15), || executed_ids(&log)
            .contains(&"kept".to_string()))
        .await,
        "the worker did not come back"
    );
    assert!(wait_until(Duration::from_secs(5), || cancelled_count(&counters) == 1).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(executed_ids(&log), ["before", "kept"]);
    let _ = ch.close(200, "ok".into()).await;
    p.close().await;
    env.cleanup().await;
}

/// Readers of a stream stop the way `broker::end_consumer` does (cancel, then close), which
/// never costs the connection. lapin 4.12 cancels a dropped active consumer in the background
/// and fails the whole connection when its channel is closing by then: dropping the consumer
/// and then closing, 200 times on one connection, lost the connection after 44 (once in CI,
/// the cancel follower's step back lost it the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_readers_ended_in_turn_never_cost_the_connection() {
    use futures::StreamExt;
    let conn = connect().await;
    let q = format!("{}-readers", random_prefix());
    let ch = amqp_delay::ops::broker::open(&conn).await.unwrap();
    let mut stream = lapin::types::FieldTable::default();
    stream.insert(
        "x-queue-type".into(),
        amqp_delay::ops::broker::long_string("stream"),
    );
    amqp_delay::ops::broker::declare_queue(&ch, &q, stream)
        .await
        .unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for i in 0..500 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            format!("{i}").as_bytes(),
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    for round in 0..200 {
        let reader = amqp_delay::ops::broker::open(&conn)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        reader.basic_qos(100, Default::default()).await.unwrap();
        let mut args = lapin::types::FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            amqp_delay::ops::broker::long_string("first"),
        );
        let mut consumer = reader
            .basic_consume(q.as_str().into(), "".into(), Default::default(), args)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(
            consumer.next().await.is_some(),
            "round {round}: nothing read"
        );
        amqp_delay::ops::broker::end_consumer(&reader, &consumer, "read").await;
        drop(consumer);
    }
    assert!(conn.status().connected(), "the connection was lost");
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
}
