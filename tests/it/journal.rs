//! The journal and steering against a real RabbitMQ: what a publisher schedules is journaled
//! before it is published and named confirmed after, what a worker does with it is journaled
//! too, and purges and reschedules in the control stream are honoured by the worker.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use amqp_delay::ops::control::{PurgeScope, Reschedule};
use amqp_delay::ops::journal::{self, Record, RunOutcome, Start};
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Outcome};

use crate::harness::*;
use crate::worker::{Scripted, retry, spawn_worker};

/// An id's writer, due time and kept headers.
type Journaled = (Option<String>, u64, Vec<(String, String)>);

/// What the journal says so far: ids scheduled (with their writer), flushes confirmed, runs.
#[derive(Default, Debug)]
struct Seen {
    scheduled: HashMap<String, Journaled>,
    flush_of: HashMap<String, u64>,
    confirmed: HashSet<u64>,
    ran: HashMap<String, RunOutcome>,
}

/// Reads the journal from its start until `done` holds of what was read (or `timeout`).
async fn read_journal(env: &Env, timeout: Duration, done: impl Fn(&Seen) -> bool) -> Seen {
    let mut tail = journal::tail(&env.conn, &env.layout(), Start::First)
        .await
        .expect("the journal stream exists");
    let mut seen = Seen::default();
    let deadline = Instant::now() + timeout;
    while !done(&seen) && Instant::now() < deadline {
        let next = tokio::time::timeout(Duration::from_millis(500), tail.next()).await;
        let Ok(Some(entry)) = next else { continue };
        let entry = entry.expect("a record");
        match entry.record {
            Some(Record::Scheduled {
                flush,
                items,
                confirmed,
                ..
            }) => {
                for i in items {
                    seen.flush_of.insert(i.id.clone(), flush);
                    seen.scheduled
                        .insert(i.id, (entry.by.clone(), i.due_ms, i.headers));
                }
                seen.confirmed.extend(confirmed.iter().map(|f| f.flush));
            }
            Some(Record::Confirmed { flushes, .. }) => {
                seen.confirmed.extend(flushes.iter().map(|f| f.flush))
            }
            Some(Record::Ran { items }) => {
                for r in items {
                    seen.ran.insert(r.id, r.outcome);
                }
            }
            _ => {}
        }
    }
    tail.end().await;
    seen
}

/// Twenty messages scheduled and run: each is journaled once by its writer with its due time
/// and headers, its flush is confirmed, and its run is journaled as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_scheduled_and_run_is_journaled_by_its_writer() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("journal").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let msgs: Vec<Message> = (0..20)
        .map(|i| {
            Message::new(q.clone(), 300 + i * 10, "x")
                .with_id(format!("j{i}"))
                .with_headers(tenant("acme"))
        })
        .collect();
    let started = Instant::now();
    let scheduled: Vec<_> = p
        .schedule_batch(msgs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let ids: Vec<String> = scheduled.iter().map(|s| s.message_id.clone()).collect();
    let seen = read_journal(&env, Duration::from_secs(20), |s| {
        ids.iter().all(|id| {
            s.flush_of.get(id).is_some_and(|f| s.confirmed.contains(f)) && s.ran.contains_key(id)
        })
    })
    .await;
    println!(
        "journaled, confirmed and ran: {:?} after scheduling",
        started.elapsed()
    );
    for s in &scheduled {
        let (by, due, headers) = seen.scheduled.get(&s.message_id).expect("journaled");
        assert_eq!(by.as_deref(), Some("guest"));
        assert_eq!(*due, s.due_at_ms);
        assert_eq!(headers, &vec![("tenant".to_string(), "acme".to_string())]);
        let flush = seen.flush_of[&s.message_id];
        assert!(
            seen.confirmed.contains(&flush),
            "{} confirmed",
            s.message_id
        );
        assert_eq!(seen.ran.get(&s.message_id), Some(&RunOutcome::Done));
    }
    assert_eq!(log.lock().unwrap().len(), 20);
    p.close().await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    env.cleanup().await;
}

/// A purge of one tenant's messages: none of them runs, the other tenant's all do, and the
/// worker journals the purged ones as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_stops_exactly_the_messages_it_covers() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("purge").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let msgs: Vec<Message> = (0..40)
        .map(|i| {
            let t = if i % 2 == 0 { "a" } else { "b" };
            Message::new(q.clone(), 2_500 + i * 5, "x")
                .with_id(format!("{t}-{i}"))
                .with_headers(tenant(t))
        })
        .collect();
    for r in p.schedule_batch(msgs).await {
        r.unwrap();
    }
    let recorded = Instant::now();
    p.purge(PurgeScope {
        header: Some(("tenant".into(), "a".into())),
        ..PurgeScope::queue(q.clone())
    })
    .await
    .unwrap();
    println!("purge recorded in {:?}", recorded.elapsed());
    // a message scheduled after the purge is not covered by it
    p.schedule(
        Message::new(q.clone(), 100, "x")
            .with_id("a-late")
            .with_headers(tenant("a")),
    )
    .await
    .unwrap();
    let log2 = log.clone();
    assert!(
        wait_until(Duration::from_secs(20), || log2.lock().unwrap().len() >= 21).await,
        "the 20 messages of tenant b and the later one of tenant a run"
    );
    // the purged ones were due by now; give a straggler time to show itself
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let ran: HashSet<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    let expected: HashSet<String> = (0..40)
        .filter(|i| i % 2 == 1)
        .map(|i| format!("b-{i}"))
        .chain(["a-late".to_string()])
        .collect();
    assert_eq!(ran, expected);
    let seen = read_journal(&env, Duration::from_secs(10), |s| {
        (0..40)
            .filter(|i| i % 2 == 0)
            .all(|i| s.ran.contains_key(&format!("a-{i}")))
    })
    .await;
    assert_eq!(seen.ran.get("a-0"), Some(&RunOutcome::Cancelled));
    p.close().await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    env.cleanup().await;
}

/// Rescheduled later, a message runs once, at its new time and not before; rescheduled
/// earlier from a copy (a kept body), it runs once at the earlier time and its old copy is
/// acked without running. Earlier without a copy is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reschedule_moves_a_message_and_it_runs_once() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("move").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    let later = p
        .schedule(Message::new(q.clone(), 1_500, "l").with_id("later"))
        .await
        .unwrap();
    let earlier = p
        .schedule(Message::new(q.clone(), 3_500, "e").with_id("earlier"))
        .await
        .unwrap();
    let new_later = later.due_at_ms + 1_500;
    p.reschedule(&to("later", new_later), later.due_at_ms, None)
        .await
        .unwrap();
    let e = p
        .reschedule(&to("earlier", now_ms() + 500), earlier.due_at_ms, None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("can only be moved later") && e.contains("journal.keep_body"),
        "{e}"
    );
    let new_earlier = now_ms() + 1_000;
    let copy = Message::new(q.clone(), 0, "e");
    p.reschedule(&to("earlier", new_earlier), earlier.due_at_ms, Some(copy))
        .await
        .unwrap();
    let log2 = log.clone();
    assert!(wait_until(Duration::from_secs(20), || log2.lock().unwrap().len() >= 2).await);
    // past both old due times: nothing else runs
    let wait = earlier.due_at_ms.saturating_sub(now_ms()) + 1_000;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let runs = log.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "{runs:?}");
    let at = |id: &str| runs.iter().find(|r| r.0 == id).map(|r| r.2).unwrap();
    assert!(at("later") >= new_later, "not before its new due time");
    assert!(at("earlier") >= new_earlier && at("earlier") < earlier.due_at_ms);
    let seen = read_journal(&env, Duration::from_secs(10), |s| s.ran.len() >= 3).await;
    assert_eq!(
        seen.ran.get("later"),
        Some(&RunOutcome::Done),
        "the moved copy ran (its move was journaled before)"
    );
    p.close().await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    env.cleanup().await;
}

/// Journaled before published: a publish the broker refuses after its intent was journaled is
/// named failed (or unsure) in the journal, so nothing that was never scheduled is listed as
/// pending. With the journal stream gone, scheduling goes on: unjournaled, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_is_named_failed_and_a_journal_outage_stops_no_schedule() {
    let mut env = steering_env(4_000).await;
    let q = env.queue("before").await;
    let l = env.layout();
    let p = env.publisher().await;
    let ch = env.conn.create_channel().await.unwrap();
    // the level exchanges gone: the tiers refuse the publish after its intent is journaled
    for k in 0..l.levels() {
        ch.exchange_delete(l.level_exchange(k).as_str().into(), Default::default())
            .await
            .unwrap();
    }
    for &ms in l.fixed_ms() {
        for s in 0..l.fixed_shards() {
            let x = l.fixed_shard_exchange(ms, s);
            ch.exchange_delete(x.as_str().into(), Default::default())
                .await
                .unwrap();
        }
    }
    let e = p
        .schedule(Message::new(q.clone(), 300, "x").with_id("refused"))
        .await
        .unwrap_err();
    println!("refused by the tiers: {e}");
    let seen = read_journal(&env, Duration::from_secs(10), |s| {
        s.flush_of
            .get("refused")
            .is_some_and(|f| s.confirmed.contains(f))
    })
    .await;
    assert!(seen.scheduled.contains_key("refused"), "journaled before");
    let failed = failed_ids(&env).await;
    assert!(
        failed.contains("refused"),
        "named not surely scheduled: {failed:?}"
    );
    // the journal gone: scheduling goes on, unjournaled and counted (availability over the
    // journal, which only `pending` reads)
    ch.queue_delete(l.journal_stream().as_str().into(), Default::default())
        .await
        .unwrap();
    let skipped = || {
        let text = amqp_delay::metrics::global().encode();
        text.lines()
            .find(|l| l.contains("stream=\"journal\"") && l.contains("unjournaled"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = skipped();
    p.schedule(Message::new(q.clone(), 0, "x").with_id("unjournaled"))
        .await
        .expect("scheduled without the journal");
    let got = env.expect(&q, 1).await;
    assert_eq!(got[0].id(), "unjournaled");
    assert!(skipped() > before, "counted as unjournaled");
    p.close().await;
    env.cleanup().await;
}

/// The ids the journal's confirmations name as failed or unsure (not surely scheduled).
async fn failed_ids(env: &Env) -> HashSet<String> {
    let mut tail = journal::tail(&env.conn, &env.layout(), Start::First)
        .await
        .unwrap();
    let mut failed = HashSet::new();
    while let Ok(Some(Ok(e))) = tokio::time::timeout(Duration::from_millis(500), tail.next()).await
    {
        let flushes = match e.record {
            Some(Record::Confirmed { flushes, .. }) => flushes,
            Some(Record::Scheduled { confirmed, .. }) => confirmed,
            _ => continue,
        };
        failed.extend(
            flushes
                .into_iter()
                .flat_map(|f| f.failed.into_iter().chain(f.unsure)),
        );
    }
    tail.end().await;
    failed
}

/// A reschedule of the caller's own message `id` to `due_at_ms`.
fn to(id: &str, due_at_ms: u64) -> Reschedule {
    Reschedule {
        id: id.into(),
        owner: None,
        due_at_ms,
    }
}
