//! The broker closes the bulk sender's connection (three times) in the middle of a send: lines
//! reported "not sent" are never delivered, "maybe sent" ones are reported as such (stderr,
//! summary and the .maybe-sent file agree), and every confirmed one is delivered, none early.

use std::collections::HashSet;
use std::time::Duration;

use rand::Rng;
use tokio::io::AsyncWriteExt;

use crate::harness::*;

/// At most this many lines (the send stops 200 lines after the last cut).
const MAX_LINES: usize = 5000;
const MAX_MS: u64 = 2000;
const CUTS: usize = 3;

/// Has the broker close `pid`'s connection(s) (as `rabbitmqctl close_connection` does, with
/// CONNECTION_FORCED), found by their client ports, in one `rabbitmqctl eval` (each rabbitmqctl
/// call takes seconds on a busy 2-core machine); returns how many.
async fn cut(pid: u32) -> usize {
    let ports: Vec<String> = (1..=NODES)
        .flat_map(|n| local_ports(pid, n))
        .map(|p| format!("[{{peer_port,{p}}}]"))
        .collect();
    if ports.is_empty() {
        return 0;
    }
    let expr = format!(
        "length([rabbit_networking:close_connection(C, \"fault suite: connection cut\") || C <- rabbit_networking:connections(), lists:member(rabbit_networking:connection_info(C, [peer_port]), [{}])]).",
        ports.join(",")
    );
    let out = cluster(&["ctl", "1", "eval", &expr]).await;
    eprintln!(
        "[conn-cut] {} closed {} connection(s) of the bulk send",
        amqp_delay::time::now_ms(),
        out.trim()
    );
    out.trim().parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_cut_mid_bulk_send_tells_not_sent_from_maybe_sent() {
    let mut f = Fault::begin("conn-cut", MAX_MS).await;
    let q = f.destination("dest");
    f.declare(&[&q]).await;
    let worker = f.worker(&q).await;
    let unsent = f.file("unsent");
    let maybe = f.file("maybe");
    let (mut send, pid) = f.bulk_send(&unsent, &maybe).await;
    let mut rng = rand::rng();
    let mut stdin = send.stdin.take().unwrap();
    let cutter = tokio::spawn(async move {
        let mut done = 0;
        for _ in 0..CUTS {
            tokio::time::sleep(Duration::from_millis(300)).await;
            done += cut(pid).await;
        }
        done
    });
    // ~200 lines/s until the cuts (each takes a second or two of rabbitmqctl) are done, then
    // 200 more: the cuts land mid-send, with confirms outstanding
    let mut ids: Vec<String> = Vec::new();
    let mut after_cuts = 0;
    while after_cuts < 200 && ids.len() < MAX_LINES {
        let chunk: Vec<String> = (0..10)
            .map(|_| {
                let id = format!("c{}", ids.len());
                let l = line(&q, &id, rng.random_range(0..MAX_MS));
                ids.push(id);
                l
            })
            .collect();
        stdin
            .write_all((chunk.join("\n") + "\n").as_bytes())
            .await
            .unwrap();
        if cutter.is_finished() {
            after_cuts += chunk.len();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let n = ids.len();
    let cuts = cutter.await.unwrap();
    drop(stdin);
    let BulkOutcome {
        code,
        stdout,
        stderr,
        confirmed,
        invalid,
        not_sent,
        maybe_sent,
        unsent_ids,
        maybe_ids,
    } = finish_bulk_send(send, &unsent, &maybe).await;
    eprintln!(
        "[conn-cut] {cuts} cuts; bulk send of {n} lines: {confirmed} confirmed, {not_sent} not sent, {maybe_sent} maybe sent, exit {:?}",
        code
    );
    assert!(cuts >= 1, "no connection was cut");
    assert!(
        stderr.matches("the publisher reconnected").count() >= 1,
        "the publisher never reconnected:\n{stderr}"
    );
    for (n, reason) in reasons(&stderr) {
        eprintln!("[conn-cut]   {n} x {reason}");
    }
    assert_eq!(invalid, 0, "{stderr}");
    assert_eq!(confirmed + not_sent + maybe_sent, n as u64, "{stdout}");
    // every line that did not end confirmed is reported, with its kind, in stderr and its file
    assert_eq!(
        stderr.matches(": maybe sent (confirm lost").count() as u64,
        maybe_sent,
        "{stderr}"
    );
    assert_eq!(stderr.matches(": not sent: ").count() as u64, not_sent);
    assert_eq!(maybe_ids.len() as u64, maybe_sent);
    assert_eq!(unsent_ids.len() as u64, not_sent);
    assert!(unsent_ids.is_disjoint(&maybe_ids));
    if maybe_sent > 0 {
        assert!(
            stdout.contains("maybe sent: re-sending may duplicate them"),
            "{stdout}"
        );
    }
    let scheduled: HashSet<String> = ids
        .iter()
        .filter(|i| !unsent_ids.contains(*i) && !maybe_ids.contains(*i))
        .cloned()
        .collect();
    let late_failures: Vec<&String> = ids[n - 100..]
        .iter()
        .filter(|i| !scheduled.contains(*i))
        .collect();
    assert!(
        late_failures.is_empty(),
        "the publisher did not carry on after the cuts: {late_failures:?}\n{stderr}"
    );
    let everything: HashSet<String> = ids.iter().cloned().collect();
    worker
        .wait_for(
            &scheduled,
            Duration::from_secs(60),
            Duration::from_millis(MAX_MS + 1500),
        )
        .await;
    let delivered = worker.delivered();
    let t = Tally::of(&scheduled, &delivered);
    t.print("connection cut mid bulk send");
    let seen: HashSet<&str> = delivered.iter().map(|d| d.id.as_str()).collect();
    let maybe_delivered = maybe_ids
        .iter()
        .filter(|i| seen.contains(i.as_str()))
        .count();
    let not_sent_delivered: Vec<&String> = unsent_ids
        .iter()
        .filter(|i| seen.contains(i.as_str()))
        .collect();
    eprintln!(
        "[conn-cut] of {maybe_sent} maybe-sent lines {maybe_delivered} were delivered; of {not_sent} not-sent lines {} were",
        not_sent_delivered.len()
    );
    t.assert_sound("conn-cut");
    assert!(
        not_sent_delivered.is_empty(),
        "lines reported \"not sent\" were delivered: {not_sent_delivered:?}"
    );
    let strays: Vec<&str> = seen
        .iter()
        .filter(|i| !everything.contains(**i))
        .copied()
        .collect();
    assert!(strays.is_empty(), "unknown ids delivered: {strays:?}");
    worker.stop().await;
}
