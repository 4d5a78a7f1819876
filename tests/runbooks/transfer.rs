//! MIGRATING's runbook C, run as written: blue-green from the main broker (RabbitMQ 3.10.8) to a
//! 4.3 node (`RABBITMQ4_SERIES=4.3 scripts/rabbitmq4.sh up`, AMQP 5841) with amqp-delay
//! messages waiting in the old cluster's tiers. Before the runbook the old cluster runs
//! amqp-delay under a prefix of this run's own (`AMQP_DELAY_PREFIX`) with a backlog for
//! `order-timeouts` (20–60 s); after step 0 the application publishes to the
//! new cluster too (step 1, which has no block). The application's consumer reads
//! `order-timeouts` on both clusters throughout. At the end every message has arrived once
//! (duplicates only as `transfer` counted them), none before its original due time, which it
//! still carries.
//!
//! `OLD_URL` and `NEW_URL` are guest's on each broker (the brokers' administrator, named in
//! `ADMIN_USER`): the one user the text needs on each side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::time::now_ms;
use amqp_delay::{Message, Publisher, Settings, Topology, TopologySettings};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

use crate::markdown;
use crate::shell::{Ran, Session};

const QUEUE: &str = "order-timeouts";
const OLD_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const BACKLOG: u64 = 120;
const NEW_ONES: u64 = 20;
const RABBITMQ4: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/rabbitmq4.sh");

/// The 4.3 node's AMQP URL (started when it is not running; never stopped here: the suites
/// share it).
fn new_cluster() -> String {
    let out = std::process::Command::new("bash")
        .args([RABBITMQ4, "up"])
        .env("RABBITMQ4_SERIES", "4.3")
        .output()
        .expect("running scripts/rabbitmq4.sh");
    assert!(
        out.status.success(),
        "THE 4.3 NODE DID NOT START (RABBITMQ4_SERIES=4.3 scripts/rabbitmq4.sh up):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("AMQP_URL="))
        .expect("rabbitmq4.sh up prints AMQP_URL=")
        .to_string()
}

/// One arrival: id, the due time it carries, when it arrived.
type Got = (String, Option<i64>, u64);

/// Consumes `order-timeouts` on `url` into `got` until the runtime ends.
async fn consume(url: String, got: Arc<Mutex<Vec<Got>>>) {
    let conn = amqp_delay::ops::connection::connect(&url, "runbook C consumer")
        .await
        .expect("the application's consumer connects");
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(200, BasicQosOptions::default()).await.unwrap();
    let mut c = ch
        .basic_consume(
            QUEUE.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consuming order-timeouts");
    while let Some(Ok(d)) = c.next().await {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let due = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| amqp_delay::headers::get_int(h, amqp_delay::headers::DUE_AT));
        got.lock().unwrap().push((id, due, now_ms()));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
}

/// The settings an application of this run uses on `url`.
fn settings(url: &str, prefix: &str) -> Settings {
    Settings {
        url: url.to_string(),
        prefix: prefix.to_string(),
        topology: TopologySettings::default(),
        ..Settings::default()
    }
}

/// Schedules `n` messages `tag-<i>` with delays spread over `from..to` ms; their due times.
async fn publish(s: &Settings, tag: &str, n: u64, (from, to): (u64, u64)) -> HashMap<String, u64> {
    let p = Publisher::connect(s)
        .await
        .expect("the application connects");
    let msgs: Vec<Message> = (0..n)
        .map(|i| {
            // a third share one due time
            let d = match i % 3 {
                0 => from,
                _ => from + (to - from) * i / n,
            };
            Message::new(QUEUE, d, format!("{tag} {i}")).with_id(format!("{}-{tag}-{i}", s.prefix))
        })
        .collect();
    let mut due = HashMap::new();
    for r in p.schedule_batch(msgs).await {
        let s = r.expect("scheduled");
        due.insert(s.message_id, s.due_at_ms);
    }
    p.close().await;
    due
}

/// Removes this run's topology and `order-timeouts` from both brokers however the test ends
/// (a default topology is 130 quorum queues: the main broker has few file handles).
struct Cleanup {
    prefix: String,
    urls: [String; 2],
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (prefix, urls) = (self.prefix.clone(), self.urls.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                for url in &urls {
                    let Ok(conn) =
                        amqp_delay::ops::connection::connect(url, "runbook C cleanup").await
                    else {
                        eprintln!("[runbooks] runbook C: cannot clean up {prefix} on {url}");
                        continue;
                    };
                    let layout = settings(url, &prefix).layout().unwrap();
                    let _ = amqp_delay_cli::admin::teardown(&conn, &layout, None, true).await;
                    if let Ok(ch) = conn.create_channel().await {
                        let _ = ch.queue_delete(QUEUE.into(), Default::default()).await;
                    }
                    let _ = conn.close(200, "bye".into()).await;
                }
            });
        })
        .join();
    }
}

/// The last line of what a block printed.
fn last_line(r: &Ran) -> String {
    r.stdout.lines().last().unwrap_or_default().to_string()
}

/// The number right after `label` in `text`.
fn number_after(text: &str, label: &str) -> Option<u64> {
    let rest = text.split_once(label)?.1;
    rest.chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

#[test]
fn runbook_c_moves_what_waits_from_3_10_to_4_3_and_every_message_arrives_once() {
    crate::machine_lock();
    let t0 = Instant::now();
    let new_url = new_cluster();
    let prefix = format!("rbt{:08x}", rand::random::<u32>());
    let doc = crate::read_doc("docs/MIGRATING.md");
    let blocks = markdown::sh_blocks(&doc, "Runbook C:").unwrap();
    let dir = crate::workdir("transfer");
    let mut env = crate::base_env(&dir);
    for (k, v) in [
        ("OLD_URL", OLD_URL.to_string()),
        ("NEW_URL", new_url.clone()),
        ("ADMIN_USER", "guest".to_string()),
        ("AMQP_DELAY_PREFIX", prefix.clone()),
    ] {
        env.push((k.into(), v));
    }
    let _cleanup = Cleanup {
        prefix: prefix.clone(),
        urls: [OLD_URL.to_string(), new_url.clone()],
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // an earlier run's order-timeouts on the new cluster (step 0 declares it)
        if let Ok(conn) = amqp_delay::ops::connection::connect(&new_url, "runbook C").await {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.queue_delete(QUEUE.into(), Default::default()).await;
            }
            let _ = conn.close(200, "bye".into()).await;
        }
    });
    let (old, new) = (settings(OLD_URL, &prefix), settings(&new_url, &prefix));
    // the old cluster as it runs today: the tiers, the destination, the backlog
    let mut due = rt.block_on(async {
        let conn = amqp_delay::ops::connection::connect(OLD_URL, "runbook C set-up")
            .await
            .expect("the main broker answers");
        let layout = old.layout().unwrap();
        Topology::new(layout).declare(&conn).await.unwrap();
        let ch = amqp_delay::ops::broker::open(&conn).await.unwrap();
        // what an earlier run that could not clean up left
        let _ = ch.queue_delete(QUEUE.into(), Default::default()).await;
        let ch = amqp_delay::ops::broker::open(&conn).await.unwrap();
        amqp_delay::ops::broker::declare_queue(&ch, QUEUE, FieldTable::default())
            .await
            .unwrap();
        let _ = conn.close(200, "bye".into()).await;
        publish(&old, "backlog", BACKLOG, (20_000, 60_000)).await
    });
    let got = Arc::new(Mutex::new(Vec::new()));
    rt.spawn(consume(OLD_URL.to_string(), got.clone()));
    let mut session = Session::new(&dir, env.clone());
    let mut moved = None;
    let mut counted = 0;
    for b in &blocks {
        let what = format!("runbook C step {:?}", b.step);
        eprintln!("[runbooks] {what}");
        let r = session.run(&what, &b.code);
        assert!(r.status.success(), "{}\n{}", r.report(), session.logs());
        let last = last_line(&r);
        match b.step {
            Some(0) => {
                // step 1: the application moves; its consumer reads both clusters
                rt.spawn(consume(new_url.clone(), got.clone()));
                due.extend(rt.block_on(publish(&new, "new", NEW_ONES, (5_000, 20_000))));
            }
            Some(2) => {
                let would = number_after(&last, "would move ")
                    .unwrap_or_else(|| panic!("{what}: '{last}'"));
                assert!(
                    would <= BACKLOG,
                    "{what}: would move {would}, more than the backlog"
                );
            }
            Some(3) => {
                moved = number_after(&last, "moved ");
                counted += number_after(&last, "possible duplicates ").unwrap_or(0);
                eprintln!("[runbooks] {what}: {last}");
            }
            Some(4) => {
                assert!(
                    last.starts_with("would move 0;"),
                    "{what}: '{last}'\n{}",
                    r.report()
                );
            }
            _ => {}
        }
        if b.step == Some(4) {
            eprintln!("[runbooks] runbook C: waiting for {} messages", due.len());
            // step 5 retires the old cluster once its order-timeouts is drained: wait for the
            // messages first
            let until = Instant::now() + Duration::from_secs(150);
            while got.lock().unwrap().len() < due.len() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(500));
            }
            std::thread::sleep(Duration::from_secs(2));
            eprintln!(
                "[runbooks] runbook C: {} arrivals after {:.0}s",
                got.lock().unwrap().len(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    assert!(moved.is_some(), "step 3 printed no 'moved N'");
    let got = got.lock().unwrap().clone();
    let mut seen: HashMap<&str, u64> = HashMap::new();
    let mut problems = Vec::new();
    for (id, carried, arrived) in &got {
        let Some(&d) = due.get(id) else {
            problems.push(format!("{id} arrived, never sent"));
            continue;
        };
        if *carried != Some(d as i64) {
            problems.push(format!("{id} carries due {carried:?}, sent due {d}"));
        }
        if *arrived < d {
            problems.push(format!("{id} arrived {} ms early", d - arrived));
        }
        *seen.entry(id).or_default() += 1;
    }
    for id in due.keys() {
        if !seen.contains_key(id.as_str()) {
            problems.push(format!("{id} never arrived"));
        }
    }
    let twice = seen.values().filter(|n| **n > 1).count() as u64;
    if twice > counted {
        problems.push(format!("{twice} arrived twice, {counted} counted"));
    }
    let stubborn = session.stop_all(Duration::from_secs(10));
    assert!(stubborn.is_empty(), "background jobs ignored SIGTERM");
    assert!(
        problems.is_empty(),
        "runbook C: {} problems:\n{}\n{}",
        problems.len(),
        problems.join("\n"),
        session.logs()
    );
    eprintln!(
        "[runbooks] runbook C: {} messages arrived ({} moved), took {:.0}s",
        got.len(),
        moved.unwrap_or(0),
        t0.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
