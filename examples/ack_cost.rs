//! What acking costs the broker: publishes N persistent 100-byte messages to a quorum queue,
//! then consumes them at prefetch 256, acking every delivery alone (`EVERY=1`) or every
//! EVERY-th with `multiple`, and prints the broker's CPU time per message (read from
//! /proc/BPID/stat, so the broker must run on this machine). The numbers behind
//! `src/worker/acks.rs` and docs/PERFORMANCE.md ("Acks"):
//!
//! ```sh
//! BPID=$(pgrep -f beam.smp | head -1) EVERY=1 cargo run --release --example ack_cost
//! BPID=$(pgrep -f beam.smp | head -1) EVERY=64 cargo run --release --example ack_cost
//! ```
use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::time::Instant;

fn broker_ticks(pid: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[tokio::main]
async fn main() {
    let pid =
        std::env::var("BPID").expect("set BPID to the broker's process id (pgrep -f beam.smp)");
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50_000);
    let every: u64 = std::env::var("EVERY")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let conn = Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = "amqp-delay-example.ack-cost";
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let body = vec![b'x'; 100];
    let mut pending = futures::stream::FuturesUnordered::new();
    for _ in 0..n {
        let c = ch
            .basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        pending.push(c);
        while pending.len() > 1000 {
            pending.next().await;
        }
    }
    while pending.next().await.is_some() {}
    let c2 = conn.create_channel().await.unwrap();
    c2.basic_qos(256, BasicQosOptions::default()).await.unwrap();
    let mut consumer = c2
        .basic_consume(
            q.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let t0 = Instant::now();
    let b0 = broker_ticks(&pid);
    let mut got = 0usize;
    let mut last = None;
    while got < n {
        let d = consumer.next().await.unwrap().unwrap();
        got += 1;
        if every == 1 {
            d.ack(BasicAckOptions::default()).await.unwrap();
        } else if d.delivery_tag % every == 0 || got == n {
            d.ack(BasicAckOptions { multiple: true }).await.unwrap();
            last = None;
        } else {
            last = Some(d);
        }
    }
    drop(last);
    let el = t0.elapsed().as_secs_f64();
    let b1 = broker_ticks(&pid);
    println!(
        "every {every}: {n} consumed in {el:.2}s = {:.0} msg/s, broker {:.2} cpu-s, {:.1} us/msg",
        n as f64 / el,
        (b1 - b0) as f64 / 100.0,
        (b1 - b0) as f64 / 100.0 * 1e6 / n as f64
    );
    ch.queue_delete(q.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}
