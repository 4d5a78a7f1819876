//! The application's side: a plugin-era publisher (`tests/py/runbook_app.py`, pika), consumers
//! of the application's queue that note when each message arrived, and the verdict on what
//! arrived: every message, none early, none altered, duplicates only as counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::time::now_ms;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::runtime::Runtime;

const APP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/py/runbook_app.py");
pub(crate) const QUEUE: &str = "order-timeouts";
pub(crate) const KEY: &str = "order.timeout";

/// A message the application published and had confirmed.
#[derive(Debug, Clone, serde::Deserialize)]
pub(crate) struct Sent {
    pub id: String,
    pub body: String,
    pub delay: u64,
    /// Just before the publish: it is due at `sent_ms + delay` at the earliest.
    pub sent_ms: f64,
}

impl Sent {
    pub(crate) fn due_ms(&self) -> u64 {
        self.sent_ms.floor() as u64 + self.delay
    }
}

/// Publishes `n` messages with ids `prefix-i` and `x-delay` in `lo..hi` ms through `url`,
/// declaring the plugin-era exchange, queue and binding first with `declare`.
pub(crate) fn publish(
    url: &str,
    prefix: &str,
    n: u32,
    delays: (u64, u64),
    declare: bool,
) -> Vec<Sent> {
    let mut c = std::process::Command::new("python3");
    c.args([APP, url, prefix, &n.to_string()])
        .args([delays.0.to_string(), delays.1.to_string()]);
    if declare {
        c.arg("declare");
    }
    let out = c.output().expect("running python3 tests/py/runbook_app.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the application ({prefix}, {n} messages) failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sent: Vec<Sent> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(sent.len(), n as usize, "{stdout}");
    sent
}

/// A message as it arrived.
#[derive(Debug, Clone)]
pub(crate) struct Got {
    pub id: String,
    pub body: Vec<u8>,
    pub routing_key: String,
    pub arrived_ms: u64,
    pub node: u16,
}

/// Consumes `QUEUE` on a node (as its administrator, an observer the runbook does not know),
/// reconnecting after an error, until dropped.
pub(crate) struct Collector {
    got: Arc<Mutex<Vec<Got>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Collector {
    pub(crate) fn new() -> Collector {
        Collector {
            got: Arc::default(),
            tasks: Vec::new(),
        }
    }

    /// Also consumes the queue of `url` (port `port`).
    pub(crate) fn watch(&mut self, rt: &Runtime, url: String, port: u16) {
        let got = self.got.clone();
        self.tasks.push(rt.spawn(async move {
            loop {
                if let Err(e) = consume(&url, port, &got).await {
                    eprintln!("[runbooks] the consumer on {port} reconnects: {e}");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }

    pub(crate) fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until every id of `sent` arrived (or the last is due plus `margin`), then `linger`
    /// for duplicates; returns what arrived.
    pub(crate) fn wait_for(&self, sent: &[Sent], margin: Duration, linger: Duration) -> Vec<Got> {
        let last_due = sent.iter().map(Sent::due_ms).max().unwrap_or(0);
        let deadline = last_due + margin.as_millis() as u64;
        let start = Instant::now();
        loop {
            let got = self.got();
            let seen: std::collections::HashSet<&str> = got.iter().map(|g| g.id.as_str()).collect();
            if sent.iter().all(|s| seen.contains(s.id.as_str())) || now_ms() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        std::thread::sleep(linger);
        eprintln!(
            "[runbooks] waited {:.1}s for {} messages",
            start.elapsed().as_secs_f64(),
            sent.len()
        );
        self.got()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

async fn consume(url: &str, port: u16, got: &Mutex<Vec<Got>>) -> Result<(), String> {
    let conn = amqp_delay::ops::connection::connect(url, "runbook observer")
        .await
        .map_err(|e| e.to_string())?;
    // the queue may be declared later by the runbook
    while amqp_delay::ops::broker::queue_state(&conn, QUEUE)
        .await
        .map_err(|e| e.to_string())?
        .is_none()
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.basic_qos(500, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut consumer = ch
        .basic_consume(
            QUEUE.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    while let Some(d) = consumer.next().await {
        let d = d.map_err(|e| e.to_string())?;
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        got.lock().unwrap().push(Got {
            id: id.unwrap_or_default(),
            body: d.data.clone(),
            routing_key: d.routing_key.to_string(),
            arrived_ms: now_ms(),
            node: port,
        });
        d.ack(BasicAckOptions::default())
            .await
            .map_err(|e| e.to_string())?;
    }
    Err("the consumer was cancelled".into())
}

/// What arrived against what was sent: problems (lost, early, altered, unexpected, duplicates
/// beyond `allowed`), and a summary with the lateness of each batch (ids `BATCH-i`).
pub(crate) fn verdict(sent: &[Sent], got: &[Got], allowed: u64) -> (Vec<String>, String) {
    let by_id: HashMap<&str, &Sent> = sent.iter().map(|s| (s.id.as_str(), s)).collect();
    let mut problems = Vec::new();
    let mut count: HashMap<&str, u64> = HashMap::new();
    let mut late: std::collections::BTreeMap<&str, Vec<u64>> = Default::default();
    for g in got {
        let Some(s) = by_id.get(g.id.as_str()) else {
            problems.push(format!("unexpected message '{}' on {}", g.id, g.node));
            continue;
        };
        *count.entry(s.id.as_str()).or_default() += 1;
        if g.arrived_ms < s.due_ms() {
            problems.push(format!(
                "{} arrived {} ms early",
                s.id,
                s.due_ms() - g.arrived_ms
            ));
        } else {
            let batch = s.id.split('-').next().unwrap_or_default();
            late.entry(batch)
                .or_default()
                .push(g.arrived_ms - s.due_ms());
        }
        if g.body != s.body.as_bytes() || g.routing_key != KEY {
            problems.push(format!(
                "{} altered: key {}, body {:?}",
                s.id,
                g.routing_key,
                String::from_utf8_lossy(&g.body)
            ));
        }
    }
    let lost: Vec<&str> = sent
        .iter()
        .map(|s| s.id.as_str())
        .filter(|id| !count.contains_key(id))
        .collect();
    if !lost.is_empty() {
        problems.push(format!("{} lost: {}", lost.len(), lost.join(" ")));
    }
    let duplicates: u64 = count.values().map(|n| n - 1).sum();
    if duplicates > allowed {
        problems.push(format!(
            "{duplicates} duplicates, {allowed} counted by import-plugin"
        ));
    }
    let mut summary = format!(
        "sent {}, arrived {} ({} distinct), lost {}, duplicates {duplicates} (counted {allowed}); lateness ms p50/p99/max:",
        sent.len(),
        got.len(),
        count.len(),
        lost.len()
    );
    for (batch, mut l) in late {
        l.sort_unstable();
        let p = |q: f64| l[((l.len() - 1) as f64 * q) as usize];
        summary.push_str(&format!(
            " {batch} {}/{}/{}",
            p(0.5),
            p(0.99),
            l[l.len() - 1]
        ));
    }
    (problems, summary)
}

/// The messages of `sent` whose id starts with `prefix` and that have not arrived yet.
pub(crate) fn outstanding(sent: &[Sent], got: &[Got], prefix: &str) -> u64 {
    let seen: std::collections::HashSet<&str> = got.iter().map(|g| g.id.as_str()).collect();
    sent.iter()
        .filter(|s| s.id.starts_with(prefix) && !seen.contains(s.id.as_str()))
        .count() as u64
}
