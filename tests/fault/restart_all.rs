//! Every node stopped and started again (`cluster.sh restart-all`) with messages pending across
//! the levels (delays over the whole range, so routes use every level; at the stop they wait in
//! the upper levels: the lowest ones, TTLs of 1-48 ms, hold a message only for that long):
//! the worker reconnects by itself and everything arrives within the bound OPERATIONS.md gives
//! with the 5000 ms dead-letter confirm timeout (the downtime + up to one or two timeouts).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use amqp_delay::time::now_ms;
use rand::Rng;

use crate::harness::*;

const N: usize = 1000;
const MAX_MS: u64 = 8000;
/// Lateness allowed past the moment the cluster is back: two confirm timeouts (the broker's
/// dead-letter worker re-sends only when its timer fires, "one full period, sometimes two"),
/// plus the worker's reconnect (backoff capped at 5 s, cut short once a node answers).
const BOUND_MS: u64 = 2 * DLX_CONFIRM_TIMEOUT_MS + 3000;

// Opt-in (`cargo test --test fault -- --ignored`): in 3 of ~20 runs on 2026-11-30 confirmed
// messages were missing after the restart (250; 765 waiting in the destination with no
// consumer — a worker hung in setup, fixed; then 114 with every queue empty and the worker
// consuming). The last is not explained; see README "Open findings".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "open finding: confirmed messages missing after a full restart in some runs (README)"]
async fn full_cluster_restart_with_messages_pending_across_the_levels() {
    let mut f = Fault::begin("restart-all", MAX_MS).await;
    let q = f.destination("dest");
    f.declare(&[&q]).await;
    let worker = f.worker(&q).await;
    let mut rng = rand::rng();
    let ids: Vec<String> = (0..N).map(|i| format!("r{i}")).collect();
    let text: String = ids
        .iter()
        .map(|id| line(&q, id, rng.random_range(1..MAX_MS)) + "\n")
        .collect();
    f.send_confirmed("bulk.jsonl", text, N).await;
    let scheduled: HashSet<String> = ids.iter().cloned().collect();

    // where they wait: messages per cascade level
    let stats = f.publisher_ok(&["stats", "--json", "--non-empty"]).await;
    let stats: serde_json::Value = serde_json::from_str(&stats.stdout).unwrap();
    let mut levels: BTreeMap<String, u64> = BTreeMap::new();
    for s in stats.as_array().unwrap() {
        let name = s["queue"].as_str().unwrap();
        if let Some(level) = name.split('.').find(|p| p.starts_with("level")) {
            *levels.entry(level.to_string()).or_default() += s["messages"].as_u64().unwrap();
        }
    }
    let before = worker.delivered().len();
    eprintln!("[restart-all] before the restart: {before} delivered, in the tiers {levels:?}");
    assert!(
        levels.len() >= 3,
        "messages should be waiting in several levels: {levels:?}"
    );

    let stop_ms = now_ms();
    let t = Instant::now();
    cluster(&["restart-all"]).await;
    let up_ms = now_ms();
    let downtime = t.elapsed();
    let all_came = worker
        .wait_for(
            &scheduled,
            Duration::from_millis(BOUND_MS + 10_000),
            Duration::from_secs(1),
        )
        .await;
    // Not all in the bound: say where the rest wait, then give them a minute more, so a
    // failure tells "late" (a queue without a leader, a stalled tier) from "lost".
    let mut diagnosis = String::new();
    if !all_came {
        let missing = {
            let seen: HashSet<String> = worker.delivered().into_iter().map(|d| d.id).collect();
            scheduled.iter().filter(|i| !seen.contains(*i)).count()
        };
        let queues = queue_dump(&f.prefix, 1).await;
        let late = worker
            .wait_for(&scheduled, Duration::from_secs(60), Duration::ZERO)
            .await;
        diagnosis = format!(
            "\n{missing} had not arrived {} s after the restart; after a minute more: {}\nqueues holding messages then:\n{}",
            (BOUND_MS + 10_000) / 1000,
            if late {
                "all arrived (late, not lost)"
            } else {
                "still missing"
            },
            queues
        );
        eprintln!("[restart-all]{diagnosis}");
    }
    let delivered = worker.delivered();
    let tally = Tally::of(&scheduled, &delivered);
    tally.print("full cluster restart");
    // lateness past the later of the due time and the moment the cluster was back
    let worst_past_up = delivered
        .iter()
        .filter(|d| scheduled.contains(&d.id))
        .map(|d| d.fired_at as i64 - d.due_at.max(up_ms) as i64)
        .max()
        .unwrap_or(0);
    let due_in_downtime = delivered
        .iter()
        .filter(|d| d.due_at >= stop_ms && d.due_at <= up_ms)
        .count();
    eprintln!(
        "[restart-all] restart took {downtime:?}; {due_in_downtime} came due while it ran; all delivered: {all_came}; worst lateness past the cluster's return {worst_past_up} ms (bound {BOUND_MS} ms)\nworker log:\n{}",
        worker.log()
    );
    tally.assert_sound(&format!("restart-all{diagnosis}"));
    assert!(
        worst_past_up <= BOUND_MS as i64,
        "a message arrived {worst_past_up} ms after the later of its due time and the cluster's return (bound {BOUND_MS} ms){diagnosis}"
    );
    assert!(worker.log().contains("reconnecting"), "{}", worker.log());
    worker.stop().await;
}
