//! A node without its dead-letter supervisor, the state RabbitMQ 3.10 leaves a node in when
//! leader elections after a restart or a node loss crash two of its dead-letter workers within
//! 5 s (see `nodes_without_dlx_supervisor`). Made deterministic here by stopping the supervisor
//! on the node that leads the most tiers: what those tiers dead-letter stays in their
//! dead-letter buffers (counted in the queue's `messages`, neither ready nor unacknowledged —
//! what `stats` shows as "dead-lettered, waiting"); after the remedy docs/OPERATIONS.md gives
//! (restart that node's RabbitMQ application) every message arrives, none early.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::harness::*;

const N: usize = 300;
const MAX_MS: u64 = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_lettered_messages_wait_while_a_node_has_no_dead_letter_supervisor() {
    let mut f = Fault::begin("dlx-stuck", MAX_MS).await;
    // the premise is messages crossing the tiers the victim leads: on grain routes 300
    // messages over 2 s are a handful of batches, which can miss them all (it happened once in
    // CI: every message arrived); exact routes send them through the cascade's many tiers
    f.exact_routes();
    let q = f.destination("dest");
    f.declare(&[&q]).await;
    let worker = f.worker(&q).await;
    let leaders = leaders(&f.prefix, 1).await;
    let (&victim, &led) = leaders
        .iter()
        .max_by_key(|(node, n)| (**n, usize::MAX - **node))
        .expect("the tiers have leaders");
    assert!(led > 0, "{leaders:?}");
    cluster(&[
        "ctl",
        &victim.to_string(),
        "eval",
        "supervisor:terminate_child(rabbit_sup, rabbit_fifo_dlx_sup).",
    ])
    .await;
    assert_eq!(nodes_without_dlx_supervisor().await, vec![victim]);
    eprintln!("[dlx-stuck] node {victim} (leads {led} queues) has no dead-letter supervisor");

    let mut rng = rand::rng();
    let ids: Vec<String> = (0..N).map(|i| format!("s{i}")).collect();
    let text: String = ids
        .iter()
        .map(|id| line(&q, id, rng.random_range(0..MAX_MS)) + "\n")
        .collect();
    f.send_confirmed("bulk.jsonl", text, N).await;
    let scheduled: HashSet<String> = ids.iter().cloned().collect();

    // everything is due by now, plus two dead-letter confirm timeouts
    let all_early = worker
        .wait_for(
            &scheduled,
            Duration::from_millis(MAX_MS + 2 * DLX_CONFIRM_TIMEOUT_MS),
            Duration::ZERO,
        )
        .await;
    let stuck = N - worker
        .delivered()
        .iter()
        .map(|d| d.id.as_str())
        .collect::<HashSet<_>>()
        .len();
    let dump = queue_dump(&f.prefix, victim % NODES + 1).await;
    eprintln!(
        "[dlx-stuck] {stuck} of {N} not delivered {} s after the last due time; queues holding them:\n{dump}",
        2 * DLX_CONFIRM_TIMEOUT_MS / 1000
    );
    assert!(
        !all_early && stuck > 0,
        "every message arrived although node {victim}, leading {led} queues, had no dead-letter supervisor"
    );
    // they wait in the dead-letter buffers of tiers led by the victim: in `messages`, neither
    // ready nor unacknowledged (name, type, leader, online, ready, unacked, consumers, messages)
    let victim_node = node_name(victim);
    let waiting: u64 = dump
        .lines()
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .filter(|c| c.len() >= 8 && c[2].starts_with(&victim_node))
        .map(|c| {
            let n = |i: usize| c[i].parse::<u64>().unwrap_or(0);
            n(7).saturating_sub(n(4) + n(5))
        })
        .sum();
    assert!(
        waiting > 0,
        "no tier led by node {victim} holds dead-lettered messages:\n{dump}"
    );

    let t = Instant::now();
    let restarted = unstick_dead_letters("dlx-stuck", Some(&f.prefix)).await;
    assert_eq!(restarted.first(), Some(&victim));
    let remedied_ms = amqp_delay::time::now_ms();
    let all_came = worker
        .wait_for(&scheduled, Duration::from_secs(60), Duration::from_secs(1))
        .await;
    let delivered = worker.delivered();
    let tally = Tally::of(&scheduled, &delivered);
    tally.print("node without a dead-letter supervisor");
    let last_after = delivered
        .iter()
        .map(|d| d.fired_at as i64 - remedied_ms as i64)
        .max()
        .unwrap_or(0);
    eprintln!(
        "[dlx-stuck] remedy (restart the app of node {victim}) took {:?}; all delivered: {all_came}; the last one {last_after} ms after it",
        t.elapsed()
    );
    tally.assert_sound("dlx-stuck");
    worker.stop().await;
}
