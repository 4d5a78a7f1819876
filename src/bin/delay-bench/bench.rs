//! The measurements behind `delay-bench` (issue 5): throughput, lateness and capacity of the
//! delay topology, measured against the raw broker on the same machine in one run.
//!
//! # What one run measures
//!
//! * **raw**: N persistent messages published with confirms (pipelined, `publisher.max_in_flight`
//!   awaiting their confirm, through [`Publisher::publish_confirmed`], the very path scheduled
//!   messages take) straight into one plain queue of the tiers' queue type, consumed with manual
//!   acks. The ceiling on this machine.
//! * **fixed / uniform / mix / binary**: the same N messages through the delay topology
//!   (publish → tiers → destination → consume) for four delay distributions: (a) one fixed level;
//!   (b) uniform 0–max (5 s) at the configured unit and lateness budget; (c) a realistic mix, 60%
//!   on fixed levels, 40% arbitrary 0–max; (d) an NServiceBus-style binary cascade (radix 2, exact).
//!   Each reports msg/s end to end, its ratio to raw and the average hops per message.
//! * **lateness** of every scenario, from a second, rate-limited run at half its measured
//!   capacity (or `rate`): `consume time − x-delay-due-at`, as min/p50/p99/p99.9/max.
//! * **capacity** (optional): M messages held in one tier, the publish rate and the broker's
//!   memory before/after (read with `rabbitmqctl` when the broker is local), then drained.
//!
//! # How it counts
//!
//! Throughput is end to end: from the first publish to the consume of the last distinct message,
//! `distinct messages / that time`. Every message carries its index as `message_id`; the
//! consumers count each index, so lost messages (confirmed but never delivered) and duplicates
//! (at-least-once dead-lettering may duplicate) are reported, and the destination queue's
//! leftovers are counted when it is deleted. Lateness is measured on the first delivery of each
//! message. A saturating run whose delays are long next to its duration under-reports capacity
//! (the last message cannot arrive before its due time): `backlog_p50_ms`, the median lateness
//! of the saturating run, tells whether the broker was really behind.
//!
//! Everything lives under the run's own prefix and is registered in a [`Cleanup`] before it is
//! declared, so the caller can delete it on success, error or interruption.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::watch;

use amqp_delay::error::{Context, Result};
use amqp_delay::headers;
use amqp_delay::layout::Layout;
use amqp_delay::planner::{self, Precision};
use amqp_delay::publisher::{Message, Publisher, now_ms};
use amqp_delay::settings::{DurationMs, QueueType, Settings, SettingsError, TopologySettings};
use amqp_delay::topology::Topology;

/// One measured path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Publish → one plain queue → consume: the ceiling.
    Raw,
    /// Every message on one fixed level (one hop).
    Fixed,
    /// Uniform 0–max delays through the cascade.
    Uniform,
    /// 60% on fixed levels, 40% uniform 0–max.
    Mix,
    /// Uniform 0–max through a radix-2 cascade, exact (NServiceBus-style reference).
    Binary,
}

impl Scenario {
    pub const ALL: [Scenario; 5] = [
        Scenario::Raw,
        Scenario::Fixed,
        Scenario::Uniform,
        Scenario::Mix,
        Scenario::Binary,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Raw => "raw",
            Scenario::Fixed => "fixed",
            Scenario::Uniform => "uniform",
            Scenario::Mix => "mix",
            Scenario::Binary => "binary",
        }
    }
}

/// Share of the realistic mix that uses a fixed level exactly.
pub const MIX_FIXED_SHARE: f64 = 0.6;
/// Real-world upper bound of the mix's arbitrary delays (scaled down to `max_delay` in the run).
pub const MIX_REAL_MAX_MS: u64 = 24 * 3_600_000;

/// Everything a run needs. Build with [`BenchConfig::new`], then adjust the fields.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// URL, the run's own prefix, the topology shape (radix, unit, queue type, tier limits),
    /// the precision policy and `publisher.max_in_flight` come from here.
    pub settings: Settings,
    /// Messages per saturating run.
    pub messages: usize,
    pub scenarios: Vec<Scenario>,
    /// Rate of the lateness runs (msg/s); default half of each scenario's measured capacity.
    pub rate: Option<f64>,
    /// Duration of publishing in each lateness run.
    pub lateness_secs: f64,
    /// Largest delay of the distributions (the fixed levels are 1/20, 1/5, 1/2 and 1/1 of it).
    pub max_delay_ms: u64,
    /// Consumer prefetch (per consumer channel).
    pub prefetch: u16,
    /// Publisher instances (each its own connection and channel).
    pub publishers: usize,
    /// Consumer channels on the destination queue.
    pub consumers: usize,
    pub body_bytes: usize,
    /// Capacity mode: messages to hold in the tiers.
    pub capacity: Option<u64>,
    /// How long the capacity messages wait (default: long enough to publish them all).
    pub capacity_hold_ms: Option<u64>,
    /// Seed of the delay distributions (the same seed gives the same delays).
    pub seed: u64,
    /// How long to wait for duplicates after the last distinct message.
    pub linger_ms: u64,
    /// Investigation knob: spread the fixed scenario over this many one-hop tiers (TTLs F,
    /// F+1 ms, …) to see whether a sharded fixed level scales past one queue.
    pub fixed_shards: u32,
    /// Show a progress bar on stderr.
    pub progress: bool,
    pub quick: bool,
}

impl BenchConfig {
    /// Defaults for a full run against `settings`.
    pub fn new(settings: Settings) -> Self {
        BenchConfig {
            settings,
            messages: 50_000,
            scenarios: Scenario::ALL.to_vec(),
            rate: None,
            lateness_secs: 20.0,
            max_delay_ms: 5_000,
            prefetch: 256,
            publishers: 1,
            consumers: 1,
            body_bytes: 100,
            capacity: None,
            capacity_hold_ms: None,
            seed: 1,
            linger_ms: 300,
            fixed_shards: 1,
            progress: false,
            quick: false,
        }
    }

    /// The fixed levels of the distributions: 1/20, 1/5, 1/2 and all of `max_delay`.
    pub fn fixed_levels(&self) -> Vec<u64> {
        let m = self.max_delay_ms;
        let mut v: Vec<u64> = [m / 20, m / 5, m / 2, m]
            .into_iter()
            .filter(|&x| x > 0)
            .collect();
        v.dedup();
        v
    }

    /// The fixed levels the bench topology declares: [`BenchConfig::fixed_levels`] plus, with
    /// `fixed_shards` > 1, the extra tiers `F+1 ms, F+2 ms, …` the fixed scenario spreads over.
    fn declared_fixed_levels(&self) -> Vec<u64> {
        let mut v = self.fixed_levels();
        let f = v[0];
        v.extend((1..u64::from(self.fixed_shards)).map(|k| f + k));
        v.sort_unstable();
        v.dedup();
        v
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.messages == 0 {
            return Err("--messages must be at least 1".into());
        }
        if self.max_delay_ms < 20 {
            return Err("--max-delay must be at least 20 ms".into());
        }
        if self.publishers == 0 || self.consumers == 0 || self.prefetch == 0 {
            return Err("--publishers, --consumers and --prefetch must be at least 1".into());
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(format!("--rate must be a positive number, got {r}"));
        }
        if !(self.lateness_secs.is_finite() && self.lateness_secs > 0.0) {
            return Err("--lateness-secs must be positive".into());
        }
        if self.fixed_shards == 0 || u64::from(self.fixed_shards) >= self.max_delay_ms / 20 {
            return Err("--fixed-shards must be at least 1 and below max_delay/20 ms".into());
        }
        if self.capacity == Some(0) {
            return Err("--capacity must be at least 1".into());
        }
        self.settings.validate().map_err(|e| e.to_string())?;
        self.main_layout(true).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn topology(&self, radix: u32, fixed: Vec<u64>, max_delay_ms: u64) -> TopologySettings {
        let t = &self.settings.topology;
        TopologySettings {
            radix,
            unit_ms: t.unit_ms,
            max_delay: DurationMs(max_delay_ms),
            fixed_levels: fixed.into_iter().map(DurationMs).collect(),
            queue_type: t.queue_type,
            max_tier_length: t.max_tier_length,
            max_tier_ttl_ms: t.max_tier_ttl_ms,
        }
    }

    /// The configured radix and unit, delays up to `max_delay`, with or without the fixed levels
    /// (both have the same cascade queues and signature, so both plan onto one declared topology).
    fn main_layout(&self, with_fixed: bool) -> std::result::Result<Layout, SettingsError> {
        let fixed = if with_fixed {
            self.declared_fixed_levels()
        } else {
            Vec::new()
        };
        let t = self.topology(self.settings.topology.radix, fixed, self.max_delay_ms);
        Ok(Layout::new(&self.settings.prefix, &t)?)
    }

    fn binary_layout(&self) -> std::result::Result<Layout, SettingsError> {
        let t = self.topology(2, Vec::new(), self.max_delay_ms);
        Ok(Layout::new(&format!("{}-r2", self.settings.prefix), &t)?)
    }

    fn capacity_layout(&self, hold_ms: u64) -> std::result::Result<Layout, SettingsError> {
        let t = self.topology(self.settings.topology.radix, vec![hold_ms], hold_ms);
        Ok(Layout::new(&format!("{}-cap", self.settings.prefix), &t)?)
    }
}

// ---- results ------------------------------------------------------------------------------------

/// Lateness (or latency) percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub min: i64,
    pub p50: i64,
    pub p99: i64,
    pub p999: i64,
    pub max: i64,
    /// Messages measured.
    pub samples: u64,
}

/// One scenario's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioResult {
    pub description: String,
    pub radix: u32,
    pub unit_ms: u64,
    /// Lateness budget the planner used.
    pub precision: String,
    pub messages: usize,
    /// End to end, first publish to last distinct consume.
    pub msgs_per_s: f64,
    /// `msgs_per_s / raw_msgs_per_s` (null when raw was not measured).
    pub ratio_to_raw: Option<f64>,
    /// Planned dead-letter hops per message.
    pub avg_hops: f64,
    /// Hops the messages actually took (sum of their `x-death` counts).
    pub observed_avg_hops: f64,
    /// Hops the same mix would take at real scale (24 h, the configured fixed levels).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub real_scale_avg_hops: Option<f64>,
    pub e2e_s: f64,
    pub publish_s: f64,
    pub publish_msgs_per_s: f64,
    /// Median lateness of the saturating run: large means the broker was behind (saturated),
    /// small means the run was limited by the publisher or by its delays.
    pub backlog_p50_ms: i64,
    /// The saturating run ended about when its last message became due: its duration was set
    /// by the delays, not by the broker, so `msgs_per_s` is a lower bound (use more messages).
    pub delay_bound: bool,
    /// Lateness of the rate-limited run (for raw: plain publish-to-consume latency).
    pub lateness_ms: Percentiles,
    /// Rate of the lateness run.
    pub lateness_rate_msgs_per_s: f64,
    /// Confirmed but never delivered (both runs).
    pub lost: usize,
    /// Deliveries beyond the first (both runs).
    pub duplicates: usize,
    /// Publishes the broker nacked or returned, or that failed (both runs).
    pub publish_errors: usize,
    /// Messages delivered before their due time (both runs): must be 0.
    pub early: u64,
}

/// Capacity mode's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityResult {
    pub messages: u64,
    pub hold_ms: u64,
    pub publish_msgs_per_s: f64,
    /// Messages in the tiers right after the last publish.
    pub pending_at_peak: u64,
    pub memory: MemoryResult,
    /// From the moment the first message became due to the last distinct consume.
    pub drain_s: f64,
    pub drain_msgs_per_s: f64,
    pub lost: usize,
    pub duplicates: usize,
    pub publish_errors: usize,
    pub early: u64,
    pub lateness_ms: Percentiles,
}

/// Broker memory in bytes, or null where it could not be read.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryResult {
    /// How it was read (`rabbitmqctl status`, `rabbitmq-diagnostics memory_breakdown`, or `n/a`).
    pub source: String,
    pub before_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    pub growth_bytes: Option<i64>,
    pub bytes_per_message: Option<f64>,
    pub after_drain_bytes: Option<u64>,
    /// The categories of the broker's memory breakdown that grew or shrank most, in bytes.
    pub growth_by_category: BTreeMap<String, i64>,
}

/// One reading of the broker's memory.
#[derive(Debug, Clone)]
pub struct MemorySample {
    /// How it was read.
    pub source: String,
    pub total: u64,
    /// The breakdown (`quorum_ets`, `binary`, `quorum_queue_procs`, ...).
    pub categories: BTreeMap<String, u64>,
}

/// The broker and the machine.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub broker_url: String,
    pub broker_version: Option<String>,
    /// `rabbit.dead_letter_worker_consumer_prefetch` (quorum at-least-once dead-lettering).
    pub dead_letter_worker_prefetch: Option<u64>,
    pub cpu: String,
    pub cores: usize,
}

/// The settings the run used.
#[derive(Debug, Clone, Serialize)]
pub struct RunConfig {
    pub prefix: String,
    pub messages: usize,
    pub quick: bool,
    pub radix: u32,
    pub unit_ms: u64,
    pub queue_type: String,
    pub lateness_budget: String,
    pub max_in_flight: usize,
    pub prefetch: u16,
    pub publishers: usize,
    pub consumers: usize,
    pub body_bytes: usize,
    pub max_delay_ms: u64,
    pub fixed_levels_ms: Vec<u64>,
    pub lateness_secs: f64,
    pub rate: Option<f64>,
    pub seed: u64,
    pub fixed_shards: u32,
}

/// Everything one run found; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub version: &'static str,
    pub environment: Environment,
    pub config: RunConfig,
    pub raw_msgs_per_s: Option<f64>,
    pub raw: Option<ScenarioResult>,
    pub scenarios: BTreeMap<String, ScenarioResult>,
    pub capacity: Option<CapacityResult>,
    /// Anything that went wrong (lost or early messages, publish errors, leftovers in tiers).
    pub problems: Vec<String>,
    pub ok: bool,
    pub elapsed_s: f64,
}

// ---- clean-up -----------------------------------------------------------------------------------

/// What a run has declared, so it can be deleted on success, error or Ctrl-C. Objects are
/// registered before they are declared; deleting a missing one is harmless.
#[derive(Debug, Clone, Default)]
pub struct Cleanup {
    inner: Arc<Mutex<(Vec<Layout>, Vec<String>)>>,
}

impl Cleanup {
    fn add_layout(&self, l: &Layout) {
        self.inner.lock().expect("cleanup").0.push(l.clone());
    }
    fn add_queue(&self, q: &str) {
        self.inner.lock().expect("cleanup").1.push(q.to_string());
    }
    /// `layout` was deleted already.
    fn forget_layout(&self, l: &Layout) {
        self.inner
            .lock()
            .expect("cleanup")
            .0
            .retain(|x| x.prefix() != l.prefix());
    }
    /// `q` was deleted already.
    fn forget_queue(&self, q: &str) {
        self.inner.lock().expect("cleanup").1.retain(|x| x != q);
    }
    /// Deletes every registered queue and topology (over a fresh connection).
    pub async fn run(&self, url: &str) -> Result<()> {
        let (layouts, queues) = self.inner.lock().expect("cleanup").clone();
        if layouts.is_empty() && queues.is_empty() {
            return Ok(());
        }
        let conn = connect(url, "delay-bench cleanup").await?;
        let mut result = Ok(());
        for q in &queues {
            if let Err(e) = delete_queue(&conn, q).await {
                result = Err(e);
            }
        }
        for l in &layouts {
            if let Err(e) = Topology::new(l.clone()).delete(&conn).await {
                result = Err(e);
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        if result.is_ok() {
            let mut g = self.inner.lock().expect("cleanup");
            g.0.clear();
            g.1.clear();
        }
        result
    }
}

// ---- progress -----------------------------------------------------------------------------------

/// A progress bar on stderr (hidden unless enabled); notes go above it.
#[derive(Clone)]
struct Progress {
    bar: ProgressBar,
    enabled: bool,
}

impl Progress {
    fn new(enabled: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if enabled {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {prefix:<22} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
            )
            .expect("valid template"),
        );
        bar.set_prefix("declaring");
        if enabled {
            bar.enable_steady_tick(Duration::from_millis(200));
        }
        Progress { bar, enabled }
    }
    fn phase(&self, name: &str, total: u64) {
        self.bar.set_prefix(name.to_string());
        self.bar.set_position(0);
        self.bar.set_length(total);
        self.bar.set_message("");
        self.bar.reset_elapsed();
    }
    fn note(&self, line: &str) {
        if self.enabled {
            self.bar.println(line);
        } else {
            eprintln!("{line}");
        }
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

// ---- lateness -----------------------------------------------------------------------------------

struct Lateness {
    hist: Histogram<u64>,
    min: i64,
    max: i64,
    early: u64,
}

impl Lateness {
    fn new() -> Self {
        Lateness {
            hist: Histogram::new(3).expect("3 significant figures is valid"),
            min: i64::MAX,
            max: i64::MIN,
            early: 0,
        }
    }
    fn record(&mut self, ms: i64) {
        self.min = self.min.min(ms);
        self.max = self.max.max(ms);
        if ms < 0 {
            self.early += 1;
        }
        // auto-resizing: recording cannot fail for a non-negative value
        let _ = self.hist.record(ms.max(0) as u64);
    }
    fn merge(&mut self, o: &Lateness) {
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.early += o.early;
        let _ = self.hist.add(&o.hist);
    }
    fn summary(&self) -> Percentiles {
        if self.hist.is_empty() {
            return Percentiles::default();
        }
        let q = |p: f64| self.hist.value_at_quantile(p) as i64;
        Percentiles {
            min: self.min,
            p50: q(0.5).clamp(self.min, self.max),
            p99: q(0.99).clamp(self.min, self.max),
            p999: q(0.999).clamp(self.min, self.max),
            max: self.max,
            samples: self.hist.len(),
        }
    }
}

// ---- one run: publish N, consume N ------------------------------------------------------------

/// Shared between the consumers, the publishers and the progress display.
struct Tracker {
    counts: Vec<AtomicU8>,
    unique: AtomicUsize,
    duplicates: AtomicUsize,
    foreign: AtomicUsize,
    published: AtomicUsize,
    /// Nanoseconds from the first publish to the last distinct consume.
    last_unique_ns: AtomicU64,
    observed_hops: AtomicU64,
    /// The first publish, as an instant and in ms since the epoch.
    t0: Mutex<Option<(Instant, u64)>>,
    /// Latest `x-delay-due-at` seen, in ms after the first publish.
    max_due_ms: AtomicU64,
}

impl Tracker {
    fn new(n: usize) -> Self {
        Tracker {
            counts: (0..n).map(|_| AtomicU8::new(0)).collect(),
            unique: AtomicUsize::new(0),
            duplicates: AtomicUsize::new(0),
            foreign: AtomicUsize::new(0),
            published: AtomicUsize::new(0),
            last_unique_ns: AtomicU64::new(0),
            observed_hops: AtomicU64::new(0),
            t0: Mutex::new(None),
            max_due_ms: AtomicU64::new(0),
        }
    }
}

/// What one publish-and-consume run measured.
struct RunOutcome {
    n: usize,
    unique: usize,
    lost: usize,
    duplicates: usize,
    publish_errors: usize,
    first_error: Option<String>,
    e2e_s: f64,
    /// When the last message became due, in s after the first publish.
    max_due_s: f64,
    publish_s: f64,
    hops_sum: u64,
    observed_hops: u64,
    lateness: Lateness,
}

impl RunOutcome {
    fn msgs_per_s(&self) -> f64 {
        if self.e2e_s > 0.0 {
            self.unique as f64 / self.e2e_s
        } else {
            0.0
        }
    }
    /// The last message arrived about when it became due (the broker was not behind at the
    /// end) and a good part of the run was spent waiting for delays after publishing ended: the
    /// delays, not the broker, set the duration, so msg/s is only a lower bound. (A publisher
    /// slowed down by the broker's flow control also ends close to the last due time, but then
    /// publishing takes most of the run and the number is the broker's.)
    fn delay_bound(&self) -> bool {
        self.max_due_s > 0.0
            && self.e2e_s <= self.max_due_s * 1.05 + 0.25
            && self.max_due_s - self.publish_s > 0.2 * self.e2e_s
    }

    fn publish_msgs_per_s(&self) -> f64 {
        if self.publish_s > 0.0 {
            (self.n - self.publish_errors) as f64 / self.publish_s
        } else {
            0.0
        }
    }
}

/// Consumers running on a destination queue, ready for a publish.
struct Running {
    queue: String,
    n: usize,
    tracker: Arc<Tracker>,
    stop: watch::Sender<bool>,
    consumers: Vec<tokio::task::JoinHandle<Result<Lateness>>>,
    monitor: tokio::task::JoinHandle<()>,
}

struct Published {
    failed: Vec<usize>,
    first_error: Option<String>,
    hops_sum: u64,
    publish_s: f64,
}

/// Publishers, each on its own connection.
struct Publishers {
    pubs: Vec<Publisher>,
    conns: Vec<Arc<Connection>>,
}

impl Publishers {
    async fn close(self) {
        for p in self.pubs {
            p.close().await;
        }
        for c in self.conns {
            let _ = c.close(200, "bye".into()).await;
        }
    }
}

/// The state of a bench run.
struct Bench<'a> {
    cfg: &'a BenchConfig,
    cleanup: &'a Cleanup,
    progress: Progress,
    admin: Connection,
    consumer_conn: Connection,
    problems: Vec<String>,
    stall: Duration,
    /// `rabbitmqctl` on this machine talks to the broker being measured.
    local_node: bool,
}

impl Bench<'_> {
    async fn publishers(&self, layout: &Layout, precision: Precision) -> Result<Publishers> {
        let mut out = Publishers {
            pubs: Vec::new(),
            conns: Vec::new(),
        };
        for _ in 0..self.cfg.publishers {
            let conn = Arc::new(connect(&self.cfg.settings.url, "delay-bench publisher").await?);
            out.conns.push(conn.clone());
            let p = Publisher::with_connection(
                conn,
                layout.clone(),
                precision,
                self.cfg.settings.publisher.clone(),
            )
            .await;
            match p {
                Ok(p) => out.pubs.push(p),
                Err(e) => {
                    out.close().await;
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Declares `queue` (the tiers' queue type) and starts the consumers on it.
    async fn start(&self, label: &str, queue: &str, n: usize) -> Result<Running> {
        self.cleanup.add_queue(queue);
        declare_plain_queue(&self.admin, queue, self.cfg.settings.topology.queue_type).await?;
        let tracker = Arc::new(Tracker::new(n));
        let (stop, stop_rx) = watch::channel(false);
        let mut consumers = Vec::new();
        for _ in 0..self.cfg.consumers {
            let ch = self
                .consumer_conn
                .create_channel()
                .await
                .context(|| "opening a consumer channel".into())?;
            ch.basic_qos(self.cfg.prefetch, BasicQosOptions::default())
                .await
                .context(|| "setting the prefetch".into())?;
            let consumer = ch
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .context(|| format!("consuming from '{queue}'"))?;
            consumers.push(tokio::spawn(consume(
                ch,
                consumer,
                tracker.clone(),
                stop_rx.clone(),
            )));
        }
        self.progress.phase(label, n as u64);
        let monitor = {
            let (t, bar) = (tracker.clone(), self.progress.bar.clone());
            tokio::spawn(async move {
                loop {
                    bar.set_position(t.unique.load(Ordering::Relaxed) as u64);
                    bar.set_message(format!("published {}", t.published.load(Ordering::Relaxed)));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        *tracker.t0.lock().expect("t0") = Some((Instant::now(), now_ms()));
        Ok(Running {
            queue: queue.to_string(),
            n,
            tracker,
            stop,
            consumers,
            monitor,
        })
    }

    /// Publishes message `i` (`0..n`) with `delays[i]` (raw when `None`), paced at `rate`.
    async fn publish(
        &self,
        run: &Running,
        pubs: &[Publisher],
        delays: Option<&[u64]>,
        rate: Option<f64>,
    ) -> Published {
        let (t0, _) = run.tracker.t0.lock().expect("t0").expect("started");
        let body = vec![b'x'; self.cfg.body_bytes];
        let (n, p, queue) = (run.n, pubs.len(), run.queue.as_str());
        let in_flight = self.cfg.settings.publisher.max_in_flight;
        let tracker = &run.tracker;
        let per_publisher = pubs.iter().enumerate().map(|(j, publisher)| {
            let body = &body;
            let paced = futures::stream::iter((j..n).step_by(p)).then(move |i| async move {
                if let Some(r) = rate {
                    tokio::time::sleep_until((t0 + Duration::from_secs_f64(i as f64 / r)).into())
                        .await;
                }
                i
            });
            async move {
                let mut failed = Vec::new();
                let mut first_error = None;
                let mut hops = 0u64;
                let mut note = |i: usize, r: std::result::Result<usize, amqp_delay::Error>| {
                    match r {
                        Ok(h) => hops += h as u64,
                        Err(e) => {
                            failed.push(i);
                            first_error.get_or_insert_with(|| amqp_delay::cli::chain(&e));
                        }
                    }
                    tracker.published.fetch_add(1, Ordering::Relaxed);
                };
                match delays {
                    Some(delays) => {
                        let msgs = paced.map(|i| {
                            let m =
                                Message::new(queue, delays[i], body.clone()).with_id(i.to_string());
                            (i, m)
                        });
                        let mut results = std::pin::pin!(publisher.schedule_all(msgs));
                        while let Some((i, r)) = results.next().await {
                            note(i, r.map(|s| s.route.hops()));
                        }
                    }
                    None => {
                        let mut results = std::pin::pin!(
                            paced
                                .map(|i| async move {
                                    let mut h = FieldTable::default();
                                    headers::set_schedule_headers(&mut h, 0, now_ms(), 0);
                                    let props = BasicProperties::default()
                                        .with_message_id(i.to_string().as_str().into())
                                        .with_delivery_mode(2)
                                        .with_headers(h);
                                    let r =
                                        publisher.publish_confirmed("", queue, body, props).await;
                                    (i, r.map(|()| 0))
                                })
                                .buffer_unordered(in_flight)
                        );
                        while let Some((i, r)) = results.next().await {
                            note(i, r);
                        }
                    }
                }
                (failed, first_error, hops)
            }
        });
        let parts = futures::future::join_all(per_publisher).await;
        let publish_s = t0.elapsed().as_secs_f64();
        let mut out = Published {
            failed: Vec::new(),
            first_error: None,
            hops_sum: 0,
            publish_s,
        };
        for (f, e, h) in parts {
            out.failed.extend(f);
            if out.first_error.is_none() {
                out.first_error = e;
            }
            out.hops_sum += h;
        }
        out
    }

    /// Waits until every confirmed message arrived (or nothing arrives for the stall timeout),
    /// lingers for duplicates, stops the consumers and deletes the queue.
    async fn finish(
        &mut self,
        run: Running,
        published: Published,
        stall: Duration,
    ) -> Result<RunOutcome> {
        let t = &run.tracker;
        let expected = run.n - published.failed.len();
        let mut seen = t.unique.load(Ordering::Relaxed);
        let mut last_change = Instant::now();
        let mut stalled = false;
        loop {
            let u = t.unique.load(Ordering::Relaxed);
            if u >= expected {
                break;
            }
            if u != seen {
                seen = u;
                last_change = Instant::now();
            } else if last_change.elapsed() > stall {
                stalled = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(self.cfg.linger_ms)).await;
        let _ = run.stop.send(true);
        let mut lateness = Lateness::new();
        let mut consumer_error = None;
        for c in run.consumers {
            match c.await {
                Ok(Ok(l)) => lateness.merge(&l),
                Ok(Err(e)) => consumer_error = Some(e),
                Err(e) => self.problems.push(format!("a consumer task failed: {e}")),
            }
        }
        run.monitor.abort();
        let leftover = match delete_queue(&self.admin, &run.queue).await {
            Ok(n) => {
                self.cleanup.forget_queue(&run.queue);
                n
            }
            Err(_) => 0, // Cleanup tries again at the end
        };
        if let Some(e) = consumer_error {
            return Err(e);
        }
        let failed: std::collections::HashSet<usize> = published.failed.iter().copied().collect();
        let lost = (0..run.n)
            .filter(|i| !failed.contains(i) && t.counts[*i].load(Ordering::Relaxed) == 0)
            .count();
        if stalled {
            self.problems.push(format!(
                "'{}': nothing arrived for {} s with {lost} messages missing",
                run.queue,
                stall.as_secs()
            ));
        }
        let foreign = t.foreign.load(Ordering::Relaxed);
        if foreign > 0 {
            self.problems.push(format!(
                "'{}': {foreign} messages that this run did not publish",
                run.queue
            ));
        }
        Ok(RunOutcome {
            n: run.n,
            unique: t.unique.load(Ordering::Relaxed),
            lost,
            duplicates: t.duplicates.load(Ordering::Relaxed) + leftover as usize,
            publish_errors: published.failed.len(),
            first_error: published.first_error,
            e2e_s: t.last_unique_ns.load(Ordering::Relaxed) as f64 / 1e9,
            max_due_s: t.max_due_ms.load(Ordering::Relaxed) as f64 / 1e3,
            publish_s: published.publish_s,
            hops_sum: published.hops_sum,
            observed_hops: t.observed_hops.load(Ordering::Relaxed),
            lateness,
        })
    }

    async fn run_once(
        &mut self,
        label: &str,
        queue: &str,
        pubs: &[Publisher],
        delays: Option<&[u64]>,
        n: usize,
        rate: Option<f64>,
    ) -> Result<RunOutcome> {
        let run = self.start(label, queue, n).await?;
        let published = self.publish(&run, pubs, delays, rate).await;
        let stall = self.stall;
        let out = self.finish(run, published, stall).await?;
        self.check(label, &out);
        Ok(out)
    }

    fn check(&mut self, label: &str, o: &RunOutcome) {
        if o.lost > 0 {
            self.problems
                .push(format!("{label}: {} confirmed messages were lost", o.lost));
        }
        if o.lateness.early > 0 {
            self.problems.push(format!(
                "{label}: {} messages arrived early (min lateness {} ms)",
                o.lateness.early, o.lateness.min
            ));
        }
        if o.publish_errors > 0 {
            self.problems.push(format!(
                "{label}: {} publishes failed, first: {}",
                o.publish_errors,
                o.first_error.as_deref().unwrap_or("?")
            ));
        }
    }

    fn lateness_count(&self, rate: f64) -> usize {
        ((rate * self.cfg.lateness_secs).ceil() as usize).max(1)
    }

    /// Saturating run, then the rate-limited lateness run.
    #[allow(clippy::too_many_arguments)]
    async fn scenario(
        &mut self,
        sc: Scenario,
        description: String,
        pubs: &[Publisher],
        layout: &Layout,
        precision: Precision,
        raw_rate: Option<f64>,
    ) -> Result<ScenarioResult> {
        let cfg = self.cfg;
        let prefix = &cfg.settings.prefix;
        let raw = sc == Scenario::Raw;
        let n = cfg.messages;
        let delays = (!raw).then(|| delays_for(sc, cfg, n, cfg.seed));
        let sat = self
            .run_once(
                &format!("{} saturating", sc.name()),
                &format!("{prefix}.{}.sat", sc.name()),
                pubs,
                delays.as_deref(),
                n,
                None,
            )
            .await?;
        let measured = sat.msgs_per_s();
        let rate = cfg.rate.unwrap_or(measured / 2.0).max(1.0);
        let n_lat = self.lateness_count(rate);
        let delays_lat = (!raw).then(|| delays_for(sc, cfg, n_lat, cfg.seed + 1));
        let lat = self
            .run_once(
                &format!("{} @ {rate:.0}/s", sc.name()),
                &format!("{prefix}.{}.lat", sc.name()),
                pubs,
                delays_lat.as_deref(),
                n_lat,
                Some(rate),
            )
            .await?;
        let ok_n = (n - sat.publish_errors).max(1) as f64;
        let real_scale_avg_hops = (sc == Scenario::Mix).then(|| {
            let real = real_layout(&cfg.settings);
            real.map_or(f64::NAN, |l| {
                mix_avg_hops(
                    &l,
                    &cfg.settings.precision,
                    MIX_REAL_MAX_MS,
                    20_000,
                    cfg.seed,
                )
            })
        });
        let result = ScenarioResult {
            description,
            radix: layout.radix(),
            unit_ms: layout.unit_ms(),
            precision: describe_precision(&precision),
            messages: n,
            msgs_per_s: round1(measured),
            ratio_to_raw: raw_rate.map(|r| round3(measured / r)),
            avg_hops: round3(sat.hops_sum as f64 / ok_n),
            observed_avg_hops: round3(sat.observed_hops as f64 / sat.unique.max(1) as f64),
            real_scale_avg_hops: real_scale_avg_hops.map(round3),
            e2e_s: round3(sat.e2e_s),
            publish_s: round3(sat.publish_s),
            publish_msgs_per_s: round1(sat.publish_msgs_per_s()),
            backlog_p50_ms: sat.lateness.summary().p50,
            delay_bound: !raw && sat.delay_bound(),
            lateness_ms: lat.lateness.summary(),
            lateness_rate_msgs_per_s: round1(rate),
            lost: sat.lost + lat.lost,
            duplicates: sat.duplicates + lat.duplicates,
            publish_errors: sat.publish_errors + lat.publish_errors,
            early: sat.lateness.early + lat.lateness.early,
        };
        let l = &result.lateness_ms;
        self.progress.note(&format!(
            "{:<8} {:>8.0} msg/s{}  hops {:.2}  lateness @{:.0}/s p50 {} p99 {} max {} ms",
            sc.name(),
            result.msgs_per_s,
            result
                .ratio_to_raw
                .map(|r| format!(" ({r:.2} of raw)"))
                .unwrap_or_default(),
            result.avg_hops,
            rate,
            l.p50,
            l.p99,
            l.max
        ));
        Ok(result)
    }

    /// A delayed scenario with its own publishers.
    async fn delayed(
        &mut self,
        sc: Scenario,
        description: String,
        layout: &Layout,
        precision: Precision,
        raw_rate: Option<f64>,
    ) -> Result<ScenarioResult> {
        let pubs = self.publishers(layout, precision).await?;
        let r = self
            .scenario(sc, description, &pubs.pubs, layout, precision, raw_rate)
            .await;
        pubs.close().await;
        r
    }

    /// Registers `layout` for clean-up, checks the broker can take its queues, declares it.
    async fn declare(&mut self, layout: &Layout) -> Result<()> {
        self.cleanup.add_layout(layout);
        // the tiers, the parking queue and the two destination queues of a scenario
        self.ensure_file_handles(layout.tiers().len() + 3).await?;
        self.progress.note(&format!(
            "declaring {} ({} tier queues: {layout})",
            layout.prefix(),
            layout.tiers().len()
        ));
        Topology::new(layout.clone()).declare(&self.admin).await
    }

    async fn delete(&mut self, layout: &Layout) -> Result<()> {
        Topology::new(layout.clone()).delete(&self.admin).await?;
        self.cleanup.forget_layout(layout);
        Ok(())
    }

    /// On a local RabbitMQ 3.x, every quorum queue takes [`HANDLES_PER_QUORUM_QUEUE`] of the
    /// broker's file handles (`file_handle_cache`, sized from its open-file limit). When they
    /// run out the broker stops accepting connections without an error, so refuse to declare
    /// a topology that does not fit.
    async fn ensure_file_handles(&mut self, queues: usize) -> Result<()> {
        if !self.local_node || self.cfg.settings.topology.queue_type != QueueType::Quorum {
            return Ok(());
        }
        let Some((used, limit)) = file_handles().await else {
            return Ok(());
        };
        let need = queues as u64 * HANDLES_PER_QUORUM_QUEUE;
        if used + need > limit {
            return Err(amqp_delay::Error::Invalid(format!(
                "the broker has {} of its {limit} file handles left and this run needs about \
                 {need} ({queues} quorum queues × {HANDLES_PER_QUORUM_QUEUE}); when they run out \
                 it stops accepting connections. Delete leftover queues or raise the broker's \
                 open-file limit (ulimit -n / LimitNOFILE)",
                limit.saturating_sub(used)
            )));
        }
        Ok(())
    }

    async fn capacity(&mut self, m: u64, publish_rate_hint: f64) -> Result<CapacityResult> {
        let cfg = self.cfg;
        // Long enough that the last message is published before the first one expires.
        let hold_ms = cfg.capacity_hold_ms.unwrap_or_else(|| {
            let secs = m as f64 / publish_rate_hint.max(500.0) * 1.5 + 10.0;
            ((secs * 1000.0) as u64).clamp(20_000, 4 * 3_600_000)
        });
        let layout = self.capacity_layout(hold_ms)?;
        self.progress.note(&format!(
            "capacity: {m} messages held {}",
            amqp_delay::layout::compact_duration(hold_ms)
        ));
        self.declare(&layout).await?;
        let pubs = self
            .publishers(&layout, self.cfg.settings.precision)
            .await?;
        let before = broker_memory(&cfg.settings.url).await;
        let n = usize::try_from(m).expect("capacity fits memory");
        let delays = vec![hold_ms; n];
        let queue = format!("{}.capacity", cfg.settings.prefix);
        let run = self.start("capacity publish", &queue, n).await?;
        let published = self.publish(&run, &pubs.pubs, Some(&delays), None).await;
        let pending: u64 = Topology::new(layout.clone())
            .stats(&self.admin)
            .await?
            .iter()
            .map(|s| u64::from(s.messages))
            .sum();
        let peak = broker_memory(&cfg.settings.url).await;
        let ok = (n - published.failed.len()) as f64;
        let publish_rate = ok / published.publish_s.max(1e-9);
        self.progress.note(&format!(
            "capacity: {ok} published at {publish_rate:.0} msg/s, {pending} pending, memory {} → {}",
            fmt_bytes(before.as_ref().map(|m| m.total)),
            fmt_bytes(peak.as_ref().map(|m| m.total)),
        ));
        self.progress.phase("capacity drain", n as u64);
        let stall = Duration::from_millis(hold_ms) + self.stall;
        let out = self.finish(run, published, stall).await?;
        self.check("capacity", &out);
        let after = broker_memory(&cfg.settings.url).await;
        pubs.close().await;
        self.delete(&layout).await?;
        let drain_s = (out.e2e_s - hold_ms as f64 / 1e3).max(1e-3);
        let source = before
            .as_ref()
            .or(peak.as_ref())
            .map_or_else(|| "n/a".to_string(), |m| m.source.clone());
        let mut by_category: Vec<(String, i64)> = match (&before, &peak) {
            (Some(b), Some(p)) => p
                .categories
                .iter()
                .map(|(k, &v)| {
                    let was = b.categories.get(k).copied().unwrap_or(0);
                    (k.clone(), v as i64 - was as i64)
                })
                .collect(),
            _ => Vec::new(),
        };
        by_category.sort_by_key(|(_, g)| std::cmp::Reverse(g.abs()));
        by_category.truncate(6);
        let (b, p) = (before.map(|m| m.total), peak.map(|m| m.total));
        let growth = b.zip(p).map(|(b, p)| p as i64 - b as i64);
        Ok(CapacityResult {
            messages: m,
            hold_ms,
            publish_msgs_per_s: round1(publish_rate),
            pending_at_peak: pending,
            memory: MemoryResult {
                source,
                before_bytes: b,
                peak_bytes: p,
                growth_bytes: growth,
                bytes_per_message: growth
                    .filter(|_| pending > 0)
                    .map(|g| round1(g as f64 / pending as f64)),
                after_drain_bytes: after.map(|m| m.total),
                growth_by_category: by_category.into_iter().collect(),
            },
            drain_s: round3(drain_s),
            drain_msgs_per_s: round1(out.unique as f64 / drain_s),
            lost: out.lost,
            duplicates: out.duplicates,
            publish_errors: out.publish_errors,
            early: out.lateness.early,
            lateness_ms: out.lateness.summary(),
        })
    }

    fn capacity_layout(&self, hold_ms: u64) -> Result<Layout> {
        Ok(self.cfg.capacity_layout(hold_ms)?)
    }

    /// Tiers and parking queue of `layout` must be empty after a run.
    async fn check_empty(&mut self, layout: &Layout) {
        match Topology::new(layout.clone()).stats(&self.admin).await {
            Ok(stats) => {
                for s in stats.iter().filter(|s| s.messages > 0) {
                    self.problems.push(format!(
                        "{} queue '{}' still holds {} messages after the run",
                        s.kind, s.queue, s.messages
                    ));
                }
            }
            Err(e) => self
                .problems
                .push(format!("could not read the tier depths: {e}")),
        }
    }
}

/// Consumes until told to stop: counts every message index, records lateness of first
/// deliveries, acks each delivery.
async fn consume(
    ch: Channel,
    mut consumer: lapin::Consumer,
    t: Arc<Tracker>,
    mut stop: watch::Receiver<bool>,
) -> Result<Lateness> {
    let mut lateness = Lateness::new();
    let (t0, epoch0) = loop {
        if let Some(t0) = *t.t0.lock().expect("t0") {
            break t0;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    loop {
        let d = tokio::select! {
            biased;
            _ = stop.changed() => break,
            d = consumer.next() => d,
        };
        let d = match d {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e).context(|| "consuming".into()),
            None => break,
        };
        let arrived = now_ms() as i64;
        let idx = d
            .properties
            .message_id()
            .as_ref()
            .and_then(|s| s.as_str().parse::<usize>().ok())
            .filter(|&i| i < t.counts.len());
        match idx {
            Some(i) => {
                let prev = t.counts[i]
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                        Some(c.saturating_add(1))
                    })
                    .unwrap_or(u8::MAX);
                if prev == 0 {
                    t.unique.fetch_add(1, Ordering::Relaxed);
                    let ns = t0.elapsed().as_nanos() as u64;
                    t.last_unique_ns.fetch_max(ns, Ordering::Relaxed);
                    if let Some(h) = d.properties.headers().as_ref() {
                        if let Some(due) = headers::get_int(h, headers::DUE_AT) {
                            lateness.record(arrived - due);
                            let rel = (due - epoch0 as i64).max(0) as u64;
                            t.max_due_ms.fetch_max(rel, Ordering::Relaxed);
                        }
                        t.observed_hops.fetch_add(death_count(h), Ordering::Relaxed);
                    }
                } else {
                    t.duplicates.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                t.foreign.fetch_add(1, Ordering::Relaxed);
            }
        }
        d.ack(BasicAckOptions::default())
            .await
            .context(|| "acking".into())?;
    }
    let _ = ch.close(200, "done".into()).await;
    Ok(lateness)
}

/// Sum of the `count` fields of `x-death`: the dead-letter hops a message took.
fn death_count(h: &FieldTable) -> u64 {
    let Some(AMQPValue::FieldArray(a)) = h.inner().get("x-death") else {
        return 0;
    };
    a.as_slice()
        .iter()
        .filter_map(|v| match v {
            AMQPValue::FieldTable(t) => t.inner().get("count").and_then(headers::as_int),
            _ => None,
        })
        .map(|c| c.max(0) as u64)
        .sum()
}

/// How long a connection attempt may take: a broker can accept the TCP connection and never
/// answer (e.g. stuck while booting), and a benchmark should say so instead of hanging.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

async fn connect(url: &str, name: &str) -> Result<Connection> {
    match tokio::time::timeout(CONNECT_TIMEOUT, amqp_delay::connection::connect(url, name)).await {
        Ok(r) => r,
        Err(_) => Err(amqp_delay::Error::Connect {
            url: amqp_delay::connection::redact_url(url),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the broker accepted the TCP connection but did not answer within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ),
            )
            .into(),
        }),
    }
}

async fn declare_plain_queue(conn: &Connection, name: &str, qt: QueueType) -> Result<()> {
    let ch = conn
        .create_channel()
        .await
        .context(|| "opening a channel".into())?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(qt.to_string())),
    );
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .context(|| format!("declaring queue '{name}'"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Deletes `name`, returning the messages it still held.
async fn delete_queue(conn: &Connection, name: &str) -> Result<u32> {
    let ch = conn
        .create_channel()
        .await
        .context(|| "opening a channel".into())?;
    let n = ch
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
        .context(|| format!("deleting queue '{name}'"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(n)
}

// ---- distributions and pure hop statistics -----------------------------------------------------

/// `n` delays of scenario `sc` (deterministic for a seed).
pub fn delays_for(sc: Scenario, cfg: &BenchConfig, n: usize, seed: u64) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed ^ (sc as u64) << 32);
    let max = cfg.max_delay_ms;
    let fixed = cfg.fixed_levels();
    let shards = u64::from(cfg.fixed_shards.max(1));
    (0..n)
        .map(|i| match sc {
            Scenario::Raw => 0,
            Scenario::Fixed => fixed[0] + i as u64 % shards,
            Scenario::Uniform | Scenario::Binary => rng.random_range(0..=max),
            Scenario::Mix => mix_delay(&mut rng, &fixed, max),
        })
        .collect()
}

fn mix_delay(rng: &mut StdRng, fixed: &[u64], max: u64) -> u64 {
    if !fixed.is_empty() && rng.random_bool(MIX_FIXED_SHARE) {
        fixed[rng.random_range(0..fixed.len())]
    } else {
        rng.random_range(0..=max)
    }
}

/// The production layout of `settings` (with its own max delay and fixed levels).
fn real_layout(settings: &Settings) -> Option<Layout> {
    settings.layout().ok()
}

/// Average planned hops of the realistic mix at real scale: 60% on `layout`'s fixed levels,
/// 40% uniform up to `real_max_ms` (capped by the layout's max delay); `samples` draws.
pub fn mix_avg_hops(
    layout: &Layout,
    precision: &Precision,
    real_max_ms: u64,
    samples: usize,
    seed: u64,
) -> f64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let max = real_max_ms.min(layout.max_delay_ms());
    let fixed = layout.fixed_ms().to_vec();
    let total: usize = (0..samples)
        .map(|_| {
            let d = mix_delay(&mut rng, &fixed, max);
            planner::plan(layout, precision, d).map_or(0, |r| r.hops())
        })
        .sum();
    total as f64 / samples.max(1) as f64
}

/// Exact average planned hops over every delay `0..=max_ms`.
pub fn uniform_avg_hops(layout: &Layout, precision: &Precision, max_ms: u64) -> f64 {
    let total: usize = (0..=max_ms)
        .map(|d| planner::plan(layout, precision, d).map_or(0, |r| r.hops()))
        .sum();
    total as f64 / (max_ms + 1) as f64
}

/// One row of the planner-only hop table.
#[derive(Debug, Clone, Serialize)]
pub struct HopRow {
    pub radix: u32,
    pub budget: String,
    /// Exact mean over every delay 0..=max at the configured unit.
    pub uniform_avg_hops: f64,
    /// 60% fixed levels (the configured ones), 40% uniform 0–24 h.
    pub real_mix_avg_hops: f64,
    /// Largest planned lateness over the uniform range, in ms.
    pub uniform_max_lateness_ms: u64,
    /// Tier queues of the production layout (configured max delay, fixed levels) at this radix.
    pub tier_queues: usize,
}

/// Planner-only comparison of radixes and lateness budgets (no broker needed).
pub fn hop_table(settings: &Settings, max_delay_ms: u64) -> Vec<HopRow> {
    let budgets = [
        ("exact", Precision::EXACT),
        (
            "1ms",
            Precision {
                lateness_ms: 1,
                lateness_ratio: 0.0,
            },
        ),
        (
            "0.1%",
            Precision {
                lateness_ms: 0,
                lateness_ratio: 0.001,
            },
        ),
        (
            "max(2ms,0.1%)",
            Precision {
                lateness_ms: 2,
                lateness_ratio: 0.001,
            },
        ),
        (
            "max(5ms,0.1%)",
            Precision {
                lateness_ms: 5,
                lateness_ratio: 0.001,
            },
        ),
        (
            "1%",
            Precision {
                lateness_ms: 0,
                lateness_ratio: 0.01,
            },
        ),
    ];
    let mut rows = Vec::new();
    for radix in [2u32, 4, 8, 16, 32, 36] {
        let bench_t = TopologySettings {
            radix,
            max_delay: DurationMs(max_delay_ms),
            fixed_levels: Vec::new(),
            ..settings.topology.clone()
        };
        let real_t = TopologySettings {
            radix,
            ..settings.topology.clone()
        };
        let (Ok(bench), Ok(real)) = (Layout::new("hops", &bench_t), Layout::new("hops", &real_t))
        else {
            continue;
        };
        for (name, p) in &budgets {
            let max_late = (0..=max_delay_ms)
                .map(|d| planner::plan(&bench, p, d).map_or(0, |r| r.lateness_ms()))
                .max()
                .unwrap_or(0);
            rows.push(HopRow {
                radix,
                budget: (*name).to_string(),
                uniform_avg_hops: round3(uniform_avg_hops(&bench, p, max_delay_ms)),
                real_mix_avg_hops: round3(mix_avg_hops(&real, p, MIX_REAL_MAX_MS, 20_000, 7)),
                uniform_max_lateness_ms: max_late,
                tier_queues: real.tiers().len(),
            });
        }
    }
    rows
}

/// The hop table as text.
pub fn hop_table_text(rows: &[HopRow], max_delay_ms: u64) -> String {
    let mut s = format!(
        "{:>5}  {:<13} {:>15} {:>13} {:>17} {:>11}\n",
        "radix",
        "budget",
        format!(
            "hops 0–{}",
            amqp_delay::layout::compact_duration(max_delay_ms)
        ),
        "hops real mix",
        "max planned late",
        "tier queues"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>5}  {:<13} {:>15.2} {:>13.2} {:>14} ms {:>11}",
            r.radix,
            r.budget,
            r.uniform_avg_hops,
            r.real_mix_avg_hops,
            r.uniform_max_lateness_ms,
            r.tier_queues
        );
    }
    s
}

// ---- environment ------------------------------------------------------------------------------

/// The CPU model from /proc/cpuinfo and the number of cores.
pub fn machine() -> (String, usize) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpu, cores)
}

/// Whether the URL points at this machine (then `rabbitmqctl` can ask the broker directly).
pub fn is_local(url: &str) -> bool {
    url::Url::parse(url).ok().is_some_and(|u| {
        matches!(
            u.host_str(),
            Some("localhost" | "127.0.0.1" | "::1" | "[::1]")
        )
    })
}

async fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let fut = tokio::process::Command::new(cmd)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(20), fut).await {
        Ok(Ok(o)) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        _ => None,
    }
}

/// The AMQP port `url` points at (5672, or 5671 for amqps, unless given).
fn url_port(url: &str) -> Option<u16> {
    let u = url::Url::parse(url).ok()?;
    u.port().or(match u.scheme() {
        "amqps" => Some(5671),
        _ => Some(5672),
    })
}

/// Whether a `listeners` list (from `rabbitmqctl status` or `rabbitmq-diagnostics listeners`)
/// contains the AMQP port of `url`: then the local CLI talks to the broker we measure.
fn serves(listeners: &serde_json::Value, url: &str) -> bool {
    let Some(port) = url_port(url) else {
        return false;
    };
    listeners.as_array().is_some_and(|a| {
        a.iter().any(|l| {
            l["port"].as_u64() == Some(u64::from(port))
                && l["protocol"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("amqp"))
        })
    })
}

/// `rabbitmqctl status` of the local node (the one `RABBITMQ_NODENAME` names), if it is the
/// broker at `url`.
async fn local_status(url: &str) -> Option<serde_json::Value> {
    if !is_local(url) {
        return None;
    }
    let out = command_output("rabbitmqctl", &["status", "--formatter", "json"]).await?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    serves(&v["listeners"], url).then_some(v)
}

/// Broker memory: `rabbitmqctl status` (the total the memory alarm uses, and its breakdown),
/// else `rabbitmq-diagnostics memory_breakdown`; `None` for a remote broker, a local node that
/// is not the one at `url`, or when neither tool answers.
pub async fn broker_memory(url: &str) -> Option<MemorySample> {
    if !is_local(url) {
        return None;
    }
    let numbers = |v: &serde_json::Value, inner: Option<&str>| -> BTreeMap<String, u64> {
        v.as_object()
            .map(|o| {
                o.iter()
                    .filter_map(|(k, c)| {
                        let c = inner.map_or(c, |f| &c[f]);
                        c.as_u64().map(|n| (k.clone(), n))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    if let Some(v) = local_status(url).await {
        let mem = &v["memory"];
        let strategy = mem["strategy"].as_str().unwrap_or("rss");
        let total = &mem["total"];
        let bytes = total[strategy]
            .as_u64()
            .or_else(|| total["rss"].as_u64())
            .or_else(|| total["erlang"].as_u64());
        if let Some(total) = bytes {
            return Some(MemorySample {
                source: format!("rabbitmqctl status (memory.total.{strategy})"),
                total,
                categories: numbers(mem, None),
            });
        }
    }
    let listeners = command_output(
        "rabbitmq-diagnostics",
        &["-q", "listeners", "--formatter", "json"],
    )
    .await
    .and_then(|o| serde_json::from_str::<serde_json::Value>(&o).ok())?;
    if !serves(&listeners, url) {
        return None;
    }
    let out = command_output(
        "rabbitmq-diagnostics",
        &["-q", "memory_breakdown", "--formatter", "json"],
    )
    .await?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let categories = numbers(&v, Some("bytes"));
    Some(MemorySample {
        source: "rabbitmq-diagnostics memory_breakdown (sum)".into(),
        total: categories.values().sum(),
        categories,
    })
}

/// Version, dead-letter worker prefetch, and whether the local CLI reaches this broker.
async fn broker_info(url: &str) -> (Option<String>, Option<u64>, bool) {
    let Some(status) = local_status(url).await else {
        return (None, None, false);
    };
    let version = status["rabbitmq_version"].as_str().map(str::to_string);
    let prefetch = command_output(
        "rabbitmqctl",
        &[
            "eval",
            "application:get_env(rabbit, dead_letter_worker_consumer_prefetch).",
        ],
    )
    .await
    .and_then(|o| {
        o.trim()
            .trim_start_matches("{ok,")
            .trim_end_matches('}')
            .parse()
            .ok()
    });
    (version, prefetch, true)
}

/// File handles of RabbitMQ 3.x's `file_handle_cache` a quorum queue keeps (measured on 3.10.8:
/// declaring the 132 quorum queues of the default topology takes 396).
pub const HANDLES_PER_QUORUM_QUEUE: u64 = 3;

/// `(total_used, total_limit)` of the local node's `file_handle_cache` (RabbitMQ 3.x).
async fn file_handles() -> Option<(u64, u64)> {
    let out = command_output("rabbitmqctl", &["eval", "file_handle_cache:info()."]).await?;
    let field = |name: &str| -> Option<u64> {
        let rest = &out[out.find(&format!("{{{name},"))? + name.len() + 2..];
        rest[..rest.find('}')?].trim().parse().ok()
    };
    Some((field("total_used")?, field("total_limit")?))
}

// ---- the run ----------------------------------------------------------------------------------

/// Runs everything `cfg` asks for. Whatever it declares is registered in `cleanup` first; the
/// caller deletes it (also after an error or an interruption) with [`Cleanup::run`].
pub async fn run(cfg: &BenchConfig, cleanup: &Cleanup) -> Result<Report> {
    let started = Instant::now();
    let url = &cfg.settings.url;
    let progress = Progress::new(cfg.progress);
    let admin = connect(url, "delay-bench admin").await?;
    let consumer_conn = connect(url, "delay-bench consumer").await?;
    let (cpu, cores) = machine();
    let (broker_version, dlx_prefetch, local_node) = broker_info(url).await;
    let stall_ms = (2 * cfg.max_delay_ms + 20_000).max(30_000);
    let mut b = Bench {
        cfg,
        cleanup,
        progress: progress.clone(),
        admin,
        consumer_conn,
        problems: Vec::new(),
        stall: Duration::from_millis(stall_ms),
        local_node,
    };
    let wants = |s: Scenario| cfg.scenarios.contains(&s);
    let main = cfg.main_layout(true)?;
    let main_nofixed = cfg.main_layout(false)?;
    let binary = cfg.binary_layout()?;

    let precision = cfg.settings.precision;
    let max_s = amqp_delay::layout::compact_duration(cfg.max_delay_ms);
    let qt = cfg.settings.topology.queue_type;
    let fixed = cfg.fixed_levels();
    let mut raw = None;
    let mut scenarios = BTreeMap::new();

    // One topology at a time, deleted before the next is declared: a quorum queue holds file
    // handles in the broker, and a shared broker should not have to hold both.
    if [
        Scenario::Raw,
        Scenario::Fixed,
        Scenario::Uniform,
        Scenario::Mix,
    ]
    .into_iter()
    .any(wants)
    {
        b.declare(&main).await?;
        if wants(Scenario::Raw) {
            let pubs = b.publishers(&main, precision).await?;
            let r = b
                .scenario(
                    Scenario::Raw,
                    format!("raw: publish → one {qt} queue → consume"),
                    &pubs.pubs,
                    &main,
                    Precision::EXACT,
                    None,
                )
                .await;
            pubs.close().await;
            let mut r = r?;
            r.ratio_to_raw = Some(1.0);
            r.precision = "n/a".into();
            raw = Some(r);
        }
        let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
        let fixed_name = amqp_delay::layout::compact_duration(fixed[0]);
        let delayed = [
            (
                Scenario::Fixed,
                if cfg.fixed_shards > 1 {
                    format!(
                        "one fixed level ({fixed_name}) over {} shards",
                        cfg.fixed_shards
                    )
                } else {
                    format!("one fixed level ({fixed_name})")
                },
                &main,
            ),
            (
                Scenario::Uniform,
                format!("uniform 0–{max_s}"),
                &main_nofixed,
            ),
            (
                Scenario::Mix,
                format!(
                    "mix: {:.0}% fixed [{}], {:.0}% uniform 0–{max_s}",
                    MIX_FIXED_SHARE * 100.0,
                    fixed
                        .iter()
                        .map(|&f| amqp_delay::layout::compact_duration(f))
                        .collect::<Vec<_>>()
                        .join(", "),
                    (1.0 - MIX_FIXED_SHARE) * 100.0
                ),
                &main,
            ),
        ];
        for (sc, description, layout) in delayed {
            if wants(sc) {
                let r = b
                    .delayed(sc, description, layout, precision, raw_rate)
                    .await?;
                scenarios.insert(sc.name().to_string(), r);
            }
        }
        b.check_empty(&main).await;
        b.delete(&main).await?;
    }
    if wants(Scenario::Binary) {
        let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
        b.declare(&binary).await?;
        let r = b
            .delayed(
                Scenario::Binary,
                format!("binary cascade (radix 2, exact), uniform 0–{max_s}"),
                &binary,
                Precision::EXACT,
                raw_rate,
            )
            .await?;
        scenarios.insert(Scenario::Binary.name().to_string(), r);
        b.check_empty(&binary).await;
        b.delete(&binary).await?;
    }
    let capacity = match cfg.capacity {
        Some(m) => {
            let hint = raw.as_ref().map_or(2_000.0, |r| r.publish_msgs_per_s);
            Some(b.capacity(m, hint).await?)
        }
        None => None,
    };
    progress.finish();
    let _ = b.admin.close(200, "bye".into()).await;
    let _ = b.consumer_conn.close(200, "bye".into()).await;
    let problems = b.problems;
    Ok(Report {
        tool: "delay-bench",
        version: env!("CARGO_PKG_VERSION"),
        environment: Environment {
            broker_url: amqp_delay::connection::redact_url(url),
            broker_version,
            dead_letter_worker_prefetch: dlx_prefetch,
            cpu,
            cores,
        },
        config: RunConfig {
            prefix: cfg.settings.prefix.clone(),
            messages: cfg.messages,
            quick: cfg.quick,
            radix: cfg.settings.topology.radix,
            unit_ms: cfg.settings.topology.unit_ms,
            queue_type: qt.to_string(),
            lateness_budget: describe_precision(&precision),
            max_in_flight: cfg.settings.publisher.max_in_flight,
            prefetch: cfg.prefetch,
            publishers: cfg.publishers,
            consumers: cfg.consumers,
            body_bytes: cfg.body_bytes,
            max_delay_ms: cfg.max_delay_ms,
            fixed_levels_ms: fixed,
            lateness_secs: cfg.lateness_secs,
            rate: cfg.rate,
            seed: cfg.seed,
            fixed_shards: cfg.fixed_shards,
        },
        raw_msgs_per_s: raw.as_ref().map(|r| r.msgs_per_s),
        raw,
        scenarios,
        capacity,
        ok: problems.is_empty(),
        problems,
        elapsed_s: round1(started.elapsed().as_secs_f64()),
    })
}

// ---- output ----------------------------------------------------------------------------------

/// The lateness budget in words: `exact`, `2 ms`, `0.1%`, `max(2 ms, 0.1%)`.
pub fn describe_precision(p: &Precision) -> String {
    let pct = format!("{}%", round3(p.lateness_ratio * 100.0));
    match (p.lateness_ms, p.lateness_ratio == 0.0) {
        (0, true) => "exact".into(),
        (ms, true) => format!("{ms} ms"),
        (0, false) => pct,
        (ms, false) => format!("max({ms} ms, {pct})"),
    }
}

fn fmt_bytes(b: Option<u64>) -> String {
    b.map_or_else(
        || "n/a".into(),
        |b| format!("{:.1} MB", b as f64 / 1_000_000.0),
    )
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl Report {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let e = &self.environment;
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "delay-bench {} — {} (RabbitMQ {}), {} × {} cores",
            self.version,
            e.broker_url,
            e.broker_version.as_deref().unwrap_or("?"),
            e.cpu,
            e.cores
        );
        let _ = writeln!(
            s,
            "radix {}, unit {} ms, budget {}, {} tiers and queues, {} messages × {} B, \
             max_in_flight {}, prefetch {}, {} publisher(s), {} consumer(s), dead-letter worker prefetch {}",
            c.radix,
            c.unit_ms,
            c.lateness_budget,
            c.queue_type,
            c.messages,
            c.body_bytes,
            c.max_in_flight,
            c.prefetch,
            c.publishers,
            c.consumers,
            e.dead_letter_worker_prefetch
                .map_or_else(|| "?".into(), |p| p.to_string()),
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<62} {:>7} {:>5} {:>5} {:>8} │ {:>6} {:>5} {:>5} {:>5} {:>6} {:>6} │ {:>4} {:>4}",
            "scenario",
            "msg/s",
            "×raw",
            "hops",
            "sat p50",
            "@msg/s",
            "min",
            "p50",
            "p99",
            "p99.9",
            "max",
            "lost",
            "dup"
        );
        // raw first, then the fixed order of the scenarios
        let mut ordered: Vec<&ScenarioResult> = Vec::new();
        ordered.extend(self.raw.iter());
        for sc in Scenario::ALL.iter().skip(1) {
            if let Some(r) = self.scenarios.get(sc.name()) {
                ordered.push(r);
            }
        }
        for r in ordered {
            let l = &r.lateness_ms;
            let _ = writeln!(
                s,
                "{:<62} {:>7} {:>5} {:>5.2} {:>8} │ {:>6.0} {:>5} {:>5} {:>5} {:>6} {:>6} │ {:>4} {:>4}",
                truncate(&r.description, 62),
                format!(
                    "{}{:.0}",
                    if r.delay_bound { "≥" } else { "" },
                    r.msgs_per_s
                ),
                r.ratio_to_raw
                    .map_or_else(|| "-".into(), |x| format!("{x:.2}")),
                r.avg_hops,
                r.backlog_p50_ms,
                r.lateness_rate_msgs_per_s,
                l.min,
                l.p50,
                l.p99,
                l.p999,
                l.max,
                r.lost,
                r.duplicates
            );
        }
        let _ = writeln!(
            s,
            "\nmsg/s: end to end, first publish to last consume. sat p50: median lateness of that \
             saturating run (ms). Lateness (ms, consume − x-delay-due-at; raw: latency) from a \
             second run at half the measured rate."
        );
        if self.scenarios.values().any(|r| r.delay_bound) {
            let _ = writeln!(
                s,
                "≥: the run ended when its last message became due, so the delays, not the broker, \
                 set its length: a lower bound; more messages (-n) measure the broker."
            );
        }
        if let Some(m) = self
            .scenarios
            .get("mix")
            .and_then(|m| m.real_scale_avg_hops)
        {
            let _ = writeln!(
                s,
                "mix at real scale (configured fixed levels, 0–24 h): {m:.2} hops per message"
            );
        }
        if let Some(cap) = &self.capacity {
            let m = &cap.memory;
            let _ = writeln!(
                s,
                "\ncapacity: {} messages held {} published at {:.0} msg/s, {} pending; broker \
                 memory {} → {} (growth {}, {} B/message; after drain {}) [{}]; drained in {:.1} s \
                 ({:.0} msg/s), lost {}, duplicates {}",
                cap.messages,
                amqp_delay::layout::compact_duration(cap.hold_ms),
                cap.publish_msgs_per_s,
                cap.pending_at_peak,
                fmt_bytes(m.before_bytes),
                fmt_bytes(m.peak_bytes),
                m.growth_bytes.map_or_else(
                    || "n/a".into(),
                    |g| format!("{:.1} MB", g as f64 / 1_000_000.0)
                ),
                m.bytes_per_message
                    .map_or_else(|| "n/a".into(), |b| format!("{b:.0}")),
                fmt_bytes(m.after_drain_bytes),
                m.source,
                cap.drain_s,
                cap.drain_msgs_per_s,
                cap.lost,
                cap.duplicates
            );
        }
        if self.problems.is_empty() {
            let _ = writeln!(
                s,
                "\nno message lost, none early, nothing left in the tiers ({:.0} s)",
                self.elapsed_s
            );
        } else {
            let _ = writeln!(s, "\nPROBLEMS:");
            for p in &self.problems {
                let _ = writeln!(s, "  - {p}");
            }
        }
        s
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BenchConfig {
        BenchConfig::new(Settings {
            prefix: "bench-test".into(),
            ..Settings::default()
        })
    }

    #[test]
    fn distributions_stay_in_range_and_are_reproducible() {
        let c = cfg();
        for sc in Scenario::ALL {
            let a = delays_for(sc, &c, 2000, 9);
            assert_eq!(a, delays_for(sc, &c, 2000, 9));
            assert!(a.iter().all(|&d| d <= c.max_delay_ms));
        }
        let mix = delays_for(Scenario::Mix, &c, 10_000, 1);
        let fixed = c.fixed_levels();
        let on_fixed = mix.iter().filter(|d| fixed.contains(d)).count() as f64 / 10_000.0;
        assert!((0.55..0.7).contains(&on_fixed), "{on_fixed}");
        assert!(
            delays_for(Scenario::Fixed, &c, 10, 1)
                .iter()
                .all(|&d| d == 250)
        );
    }

    #[test]
    fn uniform_hops_match_the_design_table() {
        let c = cfg();
        let l16 = c.main_layout(false).unwrap();
        let l2 = c.binary_layout().unwrap();
        let h16 = uniform_avg_hops(&l16, &Precision::EXACT, 5000);
        let h2 = uniform_avg_hops(&l2, &Precision::EXACT, 5000);
        assert!((2.5..3.2).contains(&h16), "{h16}");
        assert!((5.5..7.0).contains(&h2), "{h2}");
        // the budget never adds hops
        assert!(uniform_avg_hops(&l16, &Precision::default(), 5000) <= h16);
    }

    #[test]
    fn lateness_summary_keeps_negative_minimum() {
        let mut l = Lateness::new();
        for v in [-2, 0, 5, 7, 100] {
            l.record(v);
        }
        let s = l.summary();
        assert_eq!((s.min, s.max, s.samples, l.early), (-2, 100, 5, 1));
        assert!(s.p50 >= 0 && s.p50 <= s.p99 && s.p99 <= s.max);
    }

    #[test]
    fn layouts_share_the_prefix_rules() {
        let c = cfg();
        assert_eq!(c.fixed_levels(), vec![250, 1000, 2500, 5000]);
        assert_eq!(c.binary_layout().unwrap().prefix(), "bench-test-r2");
        assert!(c.validate().is_ok());
    }

    #[test]
    fn the_local_node_must_serve_the_url_port() {
        let l = serde_json::json!([
            {"port": 25672, "protocol": "clustering"},
            {"port": 5673, "protocol": "amqp"}
        ]);
        assert!(serves(&l, "amqp://guest:guest@127.0.0.1:5673/%2f"));
        assert!(!serves(&l, "amqp://guest:guest@127.0.0.1/%2f"));
        assert!(is_local("amqp://localhost"));
        assert!(!is_local("amqp://rabbit.example.com"));
    }

    #[test]
    fn death_counts_add_up() {
        let mut t = FieldTable::default();
        let entry = |n: i64| {
            let mut e = FieldTable::default();
            e.insert("count".into(), AMQPValue::LongLongInt(n));
            AMQPValue::FieldTable(e)
        };
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![entry(1), entry(2)].into()),
        );
        assert_eq!(death_count(&t), 3);
        assert_eq!(death_count(&FieldTable::default()), 0);
    }
}
