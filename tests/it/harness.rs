//! Test harness: a real broker (tests FAIL loudly when none answers), a random name prefix per
//! test, a small fast topology (1 ms units), clean-up of everything a test declared, and the
//! set-ups the tests repeat (collect N messages, assert the tiers are empty, read a header).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use amqp_delay::ops::broker;
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Layout, Precision, Publisher, QueueType, Settings, Topology, TopologySettings};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use rand::Rng;

pub(crate) fn broker_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| amqp_delay::settings::DEFAULT_URL.into())
}

/// `rabbitmqctl` for the broker under test: `TEST_RABBITMQCTL` (a command line split
/// on spaces, e.g. `bash scripts/rabbitmq4.sh rabbitmqctl` for the 4.x nodes, whose tools and
/// cookie are their own), else the host's `rabbitmqctl`.
pub(crate) fn rabbitmqctl() -> std::process::Command {
    let cmd = std::env::var("TEST_RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = cmd.split_whitespace();
    let mut c = std::process::Command::new(words.next().unwrap_or("rabbitmqctl"));
    c.args(words);
    c
}

/// Connects or panics with a message saying how to get a broker.
pub(crate) async fn connect() -> Connection {
    match amqp_delay::ops::connection::connect(&broker_url(), "amqp-delay tests").await {
        Ok(c) => c,
        Err(e) => panic!(
            "NO RABBITMQ BROKER: {e}\nThese tests need a real broker; run ./scripts/test.sh, which starts one."
        ),
    }
}

/// The small topology with delays up to `max_delay_ms` and a 20 ms lateness budget: room for a
/// cancel, purge or reschedule to be in time (the cancel, journal and pending tests).
pub(crate) async fn steering_env(max_delay_ms: u64) -> Env {
    let mut t = small_topology();
    t.max_delay = DurationMs(max_delay_ms);
    let mut env = Env::new(t).await;
    env.settings.precision = Precision {
        lateness: DurationMs(20),
        lateness_ratio: 0.0,
    };
    env
}

/// Headers with `tenant` set to `t`.
pub(crate) fn tenant(t: &str) -> FieldTable {
    let mut h = FieldTable::default();
    h.insert("tenant".into(), AMQPValue::LongString(t.into()));
    h
}

pub(crate) fn random_prefix() -> String {
    let n: u64 = rand::rng().random();
    format!("t{:012x}", n & 0xffff_ffff_ffff)
}

/// The small topology most tests use: radix 4, 1 ms units, delays up to 1.5 s, tiers capped at
/// 200 ms so the overflow chain is exercised, one 150 ms fixed level.
pub(crate) fn small_topology() -> TopologySettings {
    TopologySettings {
        radix: 4,
        unit: DurationMs(1),
        max_delay: DurationMs(1500),
        fixed_levels: vec![DurationMs(150)],
        fixed_shards: 1,
        queue_type: QueueType::Quorum,
        max_tier_length: None,
        max_tier_ttl: DurationMs(200),
    }
}

/// One test's world: its prefix, settings, declared topology and destination queues.
pub(crate) struct Env {
    pub settings: Settings,
    pub conn: Connection,
    queues: Vec<String>,
    declared: Vec<Layout>,
    cleaned: bool,
}

impl Drop for Env {
    /// A test that panicked did not reach `cleanup`: delete its objects anyway, on a fresh
    /// connection in a thread (the test's runtime may be gone).
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let queues = std::mem::take(&mut self.queues);
        let declared = std::mem::take(&mut self.declared);
        with_fresh_connection(move |conn| async move {
            for q in &queues {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            for l in declared {
                delete_batch_markers(&conn, &l, &queues).await;
                // as cleanup does; the bare topology when the control stream cannot be read
                if amqp_delay_cli::admin::teardown(&conn, &l, None, true)
                    .await
                    .is_err()
                {
                    let _ = Topology::new(l).delete(&conn).await;
                }
            }
        });
    }
}

/// Deletes the batch and hold marker exchanges of each of `queues` under `layout` (absent ones are fine).
async fn delete_batch_markers(conn: &Connection, layout: &Layout, queues: &[String]) {
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    for q in queues {
        for x in layout.markers(q) {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = ch.close(200, "bye".into()).await;
}

/// Runs `f` with a new connection on a new runtime in its own thread, and waits for it: for
/// clean-up in `Drop`, where the test's runtime may be gone. Does nothing without a broker.
pub(crate) fn with_fresh_connection<F, Fut>(f: F)
where
    F: FnOnce(Connection) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            if let Ok(conn) =
                amqp_delay::ops::connection::connect(&broker_url(), "test cleanup").await
            {
                f(conn).await;
            }
        });
    })
    .join();
}

impl Env {
    pub(crate) async fn new(topology: TopologySettings) -> Env {
        let settings = Settings {
            url: broker_url(),
            prefix: random_prefix(),
            topology,
            precision: Precision::EXACT,
            ..Settings::default()
        };
        let conn = connect().await;
        let mut env = Env {
            settings,
            conn,
            queues: Vec::new(),
            declared: Vec::new(),
            cleaned: false,
        };
        env.declare().await.expect("declare");
        env
    }

    pub(crate) fn layout(&self) -> Layout {
        self.settings.layout().unwrap()
    }

    pub(crate) async fn declare(&mut self) -> amqp_delay::Result<()> {
        let layout = self.layout();
        self.declared.push(layout.clone());
        Topology::new(layout).declare(&self.conn).await
    }

    pub(crate) async fn publisher(&self) -> Publisher {
        Publisher::connect(&self.settings).await.expect("publisher")
    }

    /// A destination queue named `<prefix>-<name>` (classic, durable), deleted on clean-up.
    pub(crate) async fn queue(&mut self, name: &str) -> String {
        let q = format!("{}-{name}", self.settings.prefix);
        self.declare_queue(&q).await;
        q
    }

    /// Declares exactly `q` (deleted on clean-up).
    pub(crate) async fn declare_queue(&mut self, q: &str) {
        let ch = broker::open(&self.conn).await.unwrap();
        broker::declare_queue(&ch, q, FieldTable::default())
            .await
            .unwrap();
        broker::close(&ch, "ok").await;
        self.queues.push(q.to_string());
    }

    pub(crate) async fn delete_queue(&self, q: &str) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.queue_delete(q.into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = ch.close(200, "ok".into()).await;
    }

    /// Consumes `n` messages from `q` (up to 15 s), then 300 ms more for duplicates.
    pub(crate) async fn expect(&self, q: &str, n: usize) -> Vec<Received> {
        collect(
            &self.conn,
            q,
            n,
            Duration::from_secs(15),
            Duration::from_millis(300),
        )
        .await
    }

    /// Asserts that `q` holds nothing (consumes for 300 ms).
    pub(crate) async fn assert_empty(&self, q: &str) {
        let got = collect(&self.conn, q, 0, Duration::from_millis(300), Duration::ZERO).await;
        assert!(got.is_empty(), "{q} holds {} messages", got.len());
    }

    /// Asserts that every tier and the unroutable queue are empty.
    pub(crate) async fn assert_tiers_empty(&self) {
        let stats = Topology::new(self.layout())
            .stats(&self.conn)
            .await
            .unwrap();
        assert!(
            stats.iter().all(|s| s.messages == 0),
            "left in tiers: {stats:?}"
        );
    }

    /// The worker's parking queue of `q`, deleted on clean-up.
    pub(crate) fn parked_queue(&mut self, q: &str) -> String {
        let parked = self.layout().parked_queue(q);
        self.track_queue(&parked);
        parked
    }

    /// Deletes everything this test declared.
    pub(crate) async fn cleanup(mut self) {
        for q in &self.queues {
            self.delete_queue(q).await;
        }
        for l in &self.declared {
            // the batch markers of this test's queues even if the control stream lost them (a
            // test that deleted it)
            delete_batch_markers(&self.conn, l, &self.queues).await;
            // as `delay-publisher teardown --force`: the topology and what the control stream
            // names (batch markers workers declared, gateway pairs)
            amqp_delay_cli::admin::teardown(&self.conn, l, None, true)
                .await
                .expect("teardown");
        }
        let _ = self.conn.close(200, "bye".into()).await;
        self.cleaned = true;
    }
}

/// A message as a consumer saw it.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    pub routing_key: String,
    pub arrived_ms: u64,
}

impl Received {
    pub(crate) fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.properties.headers().as_ref()?.inner().get(name)
    }
    /// The `reason` of each of its `x-death` entries (none without the header).
    pub(crate) fn death_reasons(&self) -> Vec<String> {
        let Some(AMQPValue::FieldArray(deaths)) = self.header("x-death") else {
            return Vec::new();
        };
        deaths
            .as_slice()
            .iter()
            .filter_map(|d| match d {
                AMQPValue::FieldTable(t) => match t.inner().get("reason") {
                    Some(AMQPValue::LongString(r)) => {
                        Some(String::from_utf8_lossy(r.as_bytes()).into_owned())
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }
    /// A string header's text (`None` if absent or not a string).
    pub(crate) fn text_header(&self, name: &str) -> Option<String> {
        match self.header(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
            _ => None,
        }
    }
    pub(crate) fn int_header(&self, name: &str) -> Option<i64> {
        amqp_delay::headers::get_int(self.properties.headers().as_ref()?, name)
    }
    pub(crate) fn id(&self) -> String {
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default()
    }
    /// Queues named in `x-death`, in the broker's order (most recent first).
    pub(crate) fn death_queues(&self) -> Vec<(String, i64)> {
        let Some(AMQPValue::FieldArray(a)) = self.header("x-death") else {
            return vec![];
        };
        a.as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::FieldTable(t) => {
                    let q = match t.inner().get("queue") {
                        Some(AMQPValue::LongString(s)) => {
                            String::from_utf8_lossy(s.as_bytes()).to_string()
                        }
                        _ => return None,
                    };
                    let n = t
                        .inner()
                        .get("count")
                        .and_then(amqp_delay::headers::as_int)
                        .unwrap_or(0);
                    Some((q, n))
                }
                _ => None,
            })
            .collect()
    }
}

/// Consumes from `queue` until `n` messages arrived or `timeout` passed, then waits `linger`
/// more for duplicates. Acks everything.
pub(crate) async fn collect(
    conn: &Connection,
    queue: &str,
    n: usize,
    timeout: Duration,
    linger: Duration,
) -> Vec<Received> {
    wait_for_queue(conn, queue, timeout).await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(500, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    let start = Instant::now();
    let mut deadline = start + timeout;
    let mut lingering = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                out.push(Received {
                    body: d.data.clone(),
                    properties: d.properties.clone(),
                    routing_key: d.routing_key.to_string(),
                    arrived_ms: now_ms(),
                });
                d.ack(BasicAckOptions::default()).await.unwrap();
                if out.len() >= n && !lingering {
                    lingering = true;
                    deadline = Instant::now() + linger;
                }
            }
            Ok(Some(Err(e))) => panic!("consumer error: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    let _ = ch.close(200, "ok".into()).await;
    out
}

/// Waits until `queue` exists and answers (it may be declared by the process under test).
pub(crate) async fn wait_for_queue(conn: &Connection, queue: &str, timeout: Duration) {
    let start = Instant::now();
    let mut absent = false;
    loop {
        match amqp_delay::ops::broker::queue_state(conn, queue).await {
            Ok(Some(_)) => {
                // a quorum queue declared a moment ago (by the process under test) exists
                // before its Raft member runs: RabbitMQ 3.10 answered a consume then with
                // INTERNAL_ERROR (`noproc` in rabbit_quorum_queue:consume), closing the
                // connection (300 ms were too few on a loaded 2-core machine)
                if absent {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                return;
            }
            Ok(None) if start.elapsed() < timeout => {
                absent = true;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("queue {queue} did not appear: {other:?}"),
        }
    }
}

/// Counts per message id.
pub(crate) fn counts(msgs: &[Received]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in msgs {
        *m.entry(r.id()).or_insert(0) += 1;
    }
    m
}

pub(crate) fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

impl Env {
    /// Also delete `q` on clean-up (queues the code under test declared, e.g. parking queues).
    pub(crate) fn track_queue(&mut self, q: &str) {
        self.queues.push(q.to_string());
    }

    /// Writes this test's settings, then `extra` TOML (sections of its own), as a config file
    /// for the binaries; returns its path.
    pub(crate) fn write_config(&self, extra: &str) -> std::path::PathBuf {
        let t = &self.settings.topology;
        let fixed: Vec<String> = t
            .fixed_levels
            .iter()
            .map(|f| f.as_millis().to_string())
            .collect();
        let text = format!(
            "prefix = \"{}\"\n[topology]\nradix = {}\nunit = {}\nmax_delay = {}\nfixed_levels = [{}]\nfixed_shards = {}\nmax_tier_ttl = {}\nqueue_type = \"{}\"\n{}\n[precision]\nlateness = {}\nlateness_ratio = {}\n\n{extra}\n",
            self.settings.prefix,
            t.radix,
            t.unit.as_millis(),
            t.max_delay.as_millis(),
            fixed.join(", "),
            t.fixed_shards,
            t.max_tier_ttl.as_millis(),
            t.queue_type,
            t.max_tier_length
                .map(|n| format!("max_tier_length = {n}"))
                .unwrap_or_default(),
            self.settings.precision.lateness.as_millis(),
            self.settings.precision.lateness_ratio,
        );
        let path = std::env::temp_dir().join(format!("{}.toml", self.settings.prefix));
        std::fs::write(&path, text).unwrap();
        path
    }
}

/// A temporary file path unique to this test.
pub(crate) fn temp_path(prefix: &str, name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{prefix}-{name}"))
}

/// Lines of a file (empty if it does not exist).
pub(crate) fn read_lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|s| s.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub(crate) async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Polls the async `cond` every 50 ms until it holds or `timeout` passes.
pub(crate) async fn wait_until_async<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond().await
}

/// Runs `delay-publisher` with this test's config; returns (exit code, stdout, stderr).
pub(crate) async fn publisher_cli(
    cfg: &std::path::Path,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(cfg)
        .args(args)
        .env("AMQP_URL", broker_url())
        .output()
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A header table whose encoded size a test sets to the byte: `n` headers `h000`, `h001`, ...
/// of 200 bytes each (209 bytes encoded), then, when `pad` > 0, a header `pad` of `pad` bytes.
pub(crate) fn filler_headers(n: usize, pad: usize) -> FieldTable {
    let mut h = FieldTable::default();
    for i in 0..n {
        h.insert(
            format!("h{i:03}").into(),
            AMQPValue::LongString("x".repeat(200).into()),
        );
    }
    if pad > 0 {
        h.insert("pad".into(), AMQPValue::LongString("x".repeat(pad).into()));
    }
    h
}

/// What was parked for reaching `queue`'s delivery limit, waiting up to `timeout`: dead-lettered
/// by the broker into `<prefix>.parked` (RabbitMQ 3.x–4.2; `delivery_limit` in `x-death`), or
/// parked by the worker in the queue's parking queue (4.3 no longer counts a consumer's requeue
/// toward the limit; the worker parks what comes back over it, with the reason). Every message
/// returned has one of those reasons.
pub(crate) async fn parked_by_delivery_limit(
    conn: &Connection,
    layout: &Layout,
    queue: &str,
    timeout: Duration,
) -> Vec<Received> {
    let places = [layout.unroutable_queue(), layout.parked_queue(queue)];
    let end = Instant::now() + timeout;
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < end {
        for q in &places {
            let ready = broker::queue_state(conn, q)
                .await
                .unwrap()
                .map_or(0, |s| s.ready);
            if ready > 0 {
                let short = Duration::from_secs(2);
                got.extend(
                    collect(conn, q, ready as usize, short, Duration::from_millis(200)).await,
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for m in &got {
        let by_broker = m.death_reasons().iter().any(|r| r == "delivery_limit");
        let reason = m.text_header("x-delay-parked-reason").unwrap_or_default();
        assert!(
            by_broker || reason.contains("delivery limit"),
            "parked for another reason: {:?} / {reason}",
            m.death_reasons()
        );
    }
    got
}

/// A `--config` file for prefix `p` with the small topology and `extra` TOML after it, at
/// `temp_path(p, name)`.
pub(crate) fn small_config(p: &str, name: &str, extra: &str) -> std::path::PathBuf {
    config_of(p, name, &small_topology(), extra)
}

/// A `--config` file for prefix `p` with topology `t` and `extra` TOML after it, at
/// `temp_path(p, name)`.
pub(crate) fn config_of(
    p: &str,
    name: &str,
    t: &TopologySettings,
    extra: &str,
) -> std::path::PathBuf {
    let fixed: Vec<String> = t
        .fixed_levels
        .iter()
        .map(|f| f.as_millis().to_string())
        .collect();
    let path = temp_path(p, name);
    let text = format!(
        "prefix = \"{p}\"\n[topology]\nradix = {}\nunit = {}\nmax_delay = {}\nfixed_levels = [{}]\nmax_tier_ttl = {}\n{extra}",
        t.radix,
        t.unit.as_millis(),
        t.max_delay.as_millis(),
        fixed.join(", "),
        t.max_tier_ttl.as_millis(),
    );
    std::fs::write(&path, text).unwrap();
    path
}
