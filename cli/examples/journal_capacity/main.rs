//! Measures the journal at capacity (issue 47): schedules N messages (10 000 000 by default) an
//! hour out, in batches to destinations whose worker reads batches, through one publisher;
//! then reports what the journal holds (records, bytes as they travel, the stream's files on
//! the broker's disk when they are readable), how long reading it back takes (what a rebuild of
//! the pending index reads), and how long a purge of one destination takes to record. Deletes
//! everything it declared at the end (unless `--keep`).
//!
//! ```sh
//! cargo run --release -p amqp-delay-cli --example journal_capacity -- --messages 10000000
//! ```
//!
//! Then, in a process of its own (so that its peak memory is the follower's), the rebuild of
//! the pending index from that journal, as `pending serve` does it when its file is missing,
//! and the queries on the result; and the teardown:
//!
//! ```sh
//! cargo run --release -p amqp-delay-cli --example journal_capacity -- --messages 10000000 --keep
//! cargo run --release -p amqp-delay-cli --example journal_capacity -- --prefix jc… --rebuild /tmp/ix.db
//! cargo run --release -p amqp-delay-cli --example journal_capacity -- --prefix jc… --teardown
//! ```
//!
//! Flags: `--messages N`, `--destinations D` (10), `--prefix P` (a random `jc…`), `--keep`,
//! `--rebuild FILE`, `--teardown`.
//! The broker is `AMQP_URL` (default the local guest one). Bodies are 16 bytes; each message
//! has a UUIDv7 id and one header (`tenant`, 1 000 values).

use std::time::{Duration, Instant};

use amqp_delay::ops::control::PurgeScope;
use amqp_delay::ops::journal::{self, Record, Start};
use amqp_delay::{Message, Publisher, Settings, Topology};
use futures::StreamExt;
use lapin::types::{AMQPValue, FieldTable};

struct Args {
    messages: u64,
    destinations: u64,
    prefix: String,
    keep: bool,
    rebuild: Option<std::path::PathBuf>,
    teardown: bool,
}

fn args() -> Args {
    let mut a = Args {
        messages: 10_000_000,
        destinations: 10,
        prefix: format!("jc{:08x}", rand::random::<u32>()),
        keep: false,
        rebuild: None,
        teardown: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--messages" => a.messages = value().parse().expect("--messages N"),
            "--destinations" => a.destinations = value().parse().expect("--destinations D"),
            "--prefix" => a.prefix = value(),
            "--keep" => a.keep = true,
            "--rebuild" => a.rebuild = Some(value().into()),
            "--teardown" => a.teardown = true,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

#[tokio::main]
async fn main() {
    let a = args();
    let mut s = Settings::default();
    if let Ok(url) = std::env::var("AMQP_URL") {
        s.url = url;
    }
    s.prefix = a.prefix.clone();
    let layout = s.layout().expect("layout");
    let conn = amqp_delay::ops::connection::connect(&s.url, "journal capacity")
        .await
        .expect("a broker");
    let topology = Topology::new(layout.clone());
    let queues: Vec<String> = (0..a.destinations)
        .map(|d| format!("{}.dest{d}", a.prefix))
        .collect();
    let ch = conn.create_channel().await.unwrap();
    if let Some(file) = &a.rebuild {
        // dest0 was purged by the scheduling run: list another
        rebuild::run(&s, file, &queues[1 % queues.len()]).await;
        return;
    }
    if a.teardown {
        for q in &queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        topology.delete(&conn).await.expect("teardown");
        println!("deleted everything under {}", a.prefix);
        return;
    }
    topology.declare(&conn).await.expect("declare");
    for q in &queues {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(q.as_str().into(), durable(), args)
            .await
            .unwrap();
        topology.declare_batch_marker(&conn, q).await.unwrap();
    }
    println!(
        "prefix {} · {} messages to {} destinations",
        a.prefix, a.messages, a.destinations
    );
    let p = Publisher::connect(&s).await.expect("publisher");
    schedule(&p, &queues, a.messages).await;
    measure_journal(&conn, &layout).await;
    let recorded = Instant::now();
    p.purge(PurgeScope::queue(queues[0].clone()))
        .await
        .expect("purge");
    println!(
        "purge of {} (1/{} of them) recorded in {:?}",
        queues[0],
        a.destinations,
        recorded.elapsed()
    );
    p.close().await;
    if !a.keep {
        for q in &queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        topology.delete(&conn).await.expect("teardown");
        println!("deleted everything under {}", a.prefix);
    }
}

mod rebuild;

fn durable() -> lapin::options::QueueDeclareOptions {
    lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// Schedules `n` messages an hour out (spread over a minute), round robin over `queues`.
async fn schedule(p: &Publisher, queues: &[String], n: u64) {
    let started = Instant::now();
    let msgs = futures::stream::iter(0..n).map(|i| {
        let mut h = FieldTable::default();
        h.insert(
            "tenant".into(),
            AMQPValue::LongString(format!("t{}", i % 1000).into()),
        );
        let q = &queues[(i % queues.len() as u64) as usize];
        let m = Message::new(q.clone(), 3_600_000 + i % 60_000, vec![b'x'; 16]).with_headers(h);
        (i, m)
    });
    let mut results = std::pin::pin!(p.schedule_all(msgs));
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut last = Instant::now();
    while let Some((_, r)) = results.next().await {
        match r {
            Ok(_) => ok += 1,
            Err(_) => failed += 1,
        }
        if last.elapsed() > Duration::from_secs(10) {
            last = Instant::now();
            println!("  {ok} scheduled after {:?}", started.elapsed());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "scheduled {ok} ({failed} failed) in {secs:.1} s = {:.0} msg/s",
        ok as f64 / secs
    );
}

/// Reads the journal up to a barrier: records, items, bytes, the time it takes; and the
/// stream's files on disk when this process can read the broker's data directory.
async fn measure_journal(conn: &lapin::Connection, layout: &amqp_delay::Layout) {
    let nonce = journal::barrier(conn, layout).await.expect("barrier");
    let started = Instant::now();
    let mut tail = journal::tail(conn, layout, Start::First)
        .await
        .expect("tail");
    let (mut records, mut items, mut bytes, mut confirmed) = (0u64, 0u64, 0u64, 0u64);
    while let Some(e) = tail.next().await {
        let e = e.expect("a record");
        let Some(r) = e.record else { continue };
        records += 1;
        bytes += serde_json::to_vec(&r).map_or(0, |v| v.len() as u64);
        match r {
            Record::Barrier { nonce: n } if n == nonce => break,
            Record::Scheduled { items: i, .. } => items += i.len() as u64,
            Record::Confirmed { flushes, .. } => confirmed += flushes.len() as u64,
            _ => {}
        }
    }
    tail.end().await;
    println!(
        "journal: {records} records, {items} items, {confirmed} confirmations apart, {:.1} MB as records ({:.0} bytes a message); read back in {:?}",
        bytes as f64 / 1e6,
        bytes as f64 / items.max(1) as f64,
        started.elapsed()
    );
    // RabbitMQ names a stream's directory `__<name, dots as underscores>_<timestamp>`
    let glob = format!("__{}_", layout.journal_stream().replace('.', "_"));
    let du = std::process::Command::new("sh")
        .args([
            "-c",
            &format!("du -sb /var/lib/rabbitmq/mnesia/*/stream/{glob}* 2>/dev/null | cut -f1"),
        ])
        .output();
    match du
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    {
        Some(b) if !b.is_empty() => println!("journal stream on disk: {b} bytes"),
        _ => println!("journal stream on disk: not readable from here"),
    }
}
