//! The bench runner: `run` declares one topology at a time, runs the raw and the delayed
//! scenarios (each a saturating run, then a rate-limited lateness run) and the optional
//! capacity mode, and assembles the `Report`. `Bench` holds a run's connections, progress
//! display and the problems found; one publish-and-consume pass is in `measure`.

mod measure;
mod stage;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;

use amqp_delay::QueueType;
use amqp_delay::connection::redact_url;
use amqp_delay::time::compact_duration;
use amqp_delay::{Error, Layout, Precision, Publisher, Result, Topology};

use crate::amqp::{connect, delete_topology};
use crate::cleanup::Cleanup;
use crate::config::{BenchConfig, GATEWAY_DELAYS_MS, MIX_FIXED_SHARE, MIX_REAL_MAX_MS, Scenario};
use crate::environment::{
    HANDLES_PER_QUORUM_QUEUE, broker_info, broker_memory, file_handles, machine,
};
use crate::hops::{delays_for, mix_avg_hops, real_layout};
use crate::progress::Progress;
use stage::Path;

use crate::report::{
    CapacityResult, Environment, MemoryResult, Report, RunConfig, ScenarioResult,
    describe_precision, fmt_bytes, round1, round3,
};

/// Runs everything `cfg` asks for. Whatever it declares is registered in `cleanup` first; the
/// caller deletes it (also after an error or an interruption) with [`Cleanup::run`].
pub(crate) async fn run(cfg: &BenchConfig, cleanup: &Cleanup) -> Result<Report> {
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
    let max_s = compact_duration(cfg.max_delay_ms);
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
        Scenario::FixedBatched,
        Scenario::UniformBatched,
        Scenario::Relay,
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
                    &Path::Raw,
                )
                .await;
            pubs.close().await;
            let mut r = r?;
            r.ratio_to_raw = Some(1.0);
            r.precision = "n/a".into();
            raw = Some(r);
        }
        let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
        let fixed_name = compact_duration(fixed[0]);
        let worker = Path::Worker(Box::new(cfg.settings_for(main.prefix(), true)));
        let relay = Path::Relay(Box::new(cfg.settings_for(main.prefix(), true)));
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
                &Path::Tiers,
            ),
            (
                Scenario::Uniform,
                format!("uniform 0–{max_s}"),
                &main_nofixed,
                &Path::Tiers,
            ),
            (
                Scenario::Mix,
                format!(
                    "mix: {:.0}% fixed [{}], {:.0}% uniform 0–{max_s}",
                    MIX_FIXED_SHARE * 100.0,
                    fixed
                        .iter()
                        .map(|&f| compact_duration(f))
                        .collect::<Vec<_>>()
                        .join(", "),
                    (1.0 - MIX_FIXED_SHARE) * 100.0
                ),
                &main,
                &Path::Tiers,
            ),
            (
                Scenario::FixedBatched,
                format!("batched: one fixed level ({fixed_name}) → worker"),
                &main,
                &worker,
            ),
            (
                Scenario::UniformBatched,
                format!("batched: uniform 0–{max_s} → worker"),
                &main_nofixed,
                &worker,
            ),
            (
                Scenario::Relay,
                format!("batched: uniform 0–{max_s} → relay → {qt} queue"),
                &main_nofixed,
                &relay,
            ),
        ];
        for (sc, description, layout, path) in delayed {
            if wants(sc) {
                let r = b
                    .delayed(sc, description, layout, precision, raw_rate, path)
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
                &Path::Tiers,
            )
            .await?;
        scenarios.insert(Scenario::Binary.name().to_string(), r);
        b.check_empty(&binary).await;
        b.delete(&binary).await?;
    }
    if wants(Scenario::Gateway) {
        let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
        // the gateway's own topology (as `delay-publisher gateway` declares it), its settings
        // the configuration's: the defaults unless configured
        let settings = cfg.gateway_settings();
        let layout = settings.layout()?;
        b.declare(&layout).await?;
        let r = b
            .delayed(
                Scenario::Gateway,
                format!(
                    "gateway: x-delay {}–{} ms → ingress → target → {qt} queue",
                    GATEWAY_DELAYS_MS.start(),
                    GATEWAY_DELAYS_MS.end()
                ),
                &layout,
                settings.precision,
                raw_rate,
                &Path::Gateway(Box::new(settings.clone())),
            )
            .await?;
        scenarios.insert(Scenario::Gateway.name().to_string(), r);
        b.check_empty(&layout).await;
        b.delete(&layout).await?;
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
            broker_url: redact_url(url),
            broker_version,
            dead_letter_worker_prefetch: dlx_prefetch,
            cpu,
            cores,
        },
        config: RunConfig {
            prefix: cfg.settings.prefix.clone(),
            messages: cfg.messages,
            batched_messages: cfg.batched_messages,
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
        path: &Path,
    ) -> Result<ScenarioResult> {
        let cfg = self.cfg;
        let prefix = &cfg.settings.prefix;
        let raw = sc == Scenario::Raw;
        let n = if sc.batched() {
            cfg.batched_messages
        } else {
            cfg.messages
        };
        let delays = (!raw).then(|| delays_for(sc, cfg, n, cfg.seed));
        let sat = self
            .run_once(
                &format!("{} saturating", sc.name()),
                &format!("{prefix}.{}.sat", sc.name()),
                pubs,
                delays.as_deref(),
                n,
                None,
                path,
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
                path,
            )
            .await?;
        let ok_n = (n - sat.publish_errors).max(1) as f64;
        let ok_lat = (n_lat - lat.publish_errors).max(1) as f64;
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
        let per_msg = |r: &measure::RunOutcome| match sc {
            Scenario::Gateway => r.broker_msgs_per_delivered(),
            _ => r.broker_msgs_per_msg(),
        };
        let result = ScenarioResult {
            description,
            radix: layout.radix(),
            unit_ms: layout.unit_ms(),
            precision: describe_precision(&precision),
            messages: n,
            msgs_per_s: round1(measured),
            ratio_to_raw: raw_rate.map(|r| round3(measured / r)),
            avg_hops: round3(sat.hops_sum as f64 / ok_n),
            lateness_avg_hops: round3(lat.hops_sum as f64 / ok_lat),
            // a batch member, a relayed or a gateway's message carries no `x-death` of its own
            observed_avg_hops: (!sc.batched())
                .then(|| round3(sat.observed_hops as f64 / sat.unique.max(1) as f64)),
            broker_msgs_per_msg: per_msg(&sat).map(round3),
            lateness_broker_msgs_per_msg: per_msg(&lat).map(round3),
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
            "{:<15} {:>8.0} msg/s{}  hops {:.2}{}  lateness @{:.0}/s p50 {} p99 {} max {} ms",
            sc.name(),
            result.msgs_per_s,
            result
                .ratio_to_raw
                .map(|r| format!(" ({r:.2} of raw)"))
                .unwrap_or_default(),
            result.avg_hops,
            result
                .broker_msgs_per_msg
                .filter(|_| sc.batched())
                .map(|b| format!("  {b:.3} broker msgs/msg"))
                .unwrap_or_default(),
            rate,
            l.p50,
            l.p99,
            l.max
        ));
        Ok(result)
    }

    /// A delayed scenario with its own publishers.
    #[allow(clippy::too_many_arguments)]
    async fn delayed(
        &mut self,
        sc: Scenario,
        description: String,
        layout: &Layout,
        precision: Precision,
        raw_rate: Option<f64>,
        path: &Path,
    ) -> Result<ScenarioResult> {
        let pubs = self.publishers(layout, precision).await?;
        let r = self
            .scenario(
                sc,
                description,
                &pubs.pubs,
                layout,
                precision,
                raw_rate,
                path,
            )
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
        delete_topology(&self.admin, layout).await?;
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
            return Err(Error::Invalid(format!(
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
            compact_duration(hold_ms)
        ));
        self.declare(&layout).await?;
        let pubs = self
            .publishers(&layout, self.cfg.settings.precision)
            .await?;
        let before = broker_memory(&cfg.settings.url).await;
        let n = usize::try_from(m).expect("capacity fits memory");
        let delays = vec![hold_ms; n];
        let queue = format!("{}.capacity", cfg.settings.prefix);
        let path = if cfg.capacity_batched {
            Path::Worker(Box::new(cfg.capacity_settings(hold_ms)))
        } else {
            Path::Tiers
        };
        let run = self.start("capacity publish", &queue, n, &path).await?;
        let published = self.publish(&run, &pubs.pubs, Some(&delays), None).await;
        let pending: u64 = Topology::new(layout.clone())
            .stats(&self.admin)
            .await?
            .iter()
            .map(|s| s.messages)
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
            batched: cfg.capacity_batched,
            messages: m,
            hold_ms,
            publish_msgs_per_s: round1(publish_rate),
            pending_at_peak: pending,
            memory: MemoryResult {
                source,
                before_bytes: b,
                peak_bytes: p,
                growth_bytes: growth,
                // per message scheduled (a batch holds many of them)
                bytes_per_message: growth
                    .filter(|_| pending > 0 && ok > 0.0)
                    .map(|g| round1(g as f64 / ok)),
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
