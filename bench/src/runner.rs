//! The bench runner: `run` declares one topology at a time, runs the raw and the delayed
//! scenarios (each a saturating run, then a rate-limited lateness run) and the optional
//! capacity mode (`capacity`), and assembles the `Report`. `Bench` holds a run's connections,
//! progress display and the problems found; one publish-and-consume pass is in `measure`.

mod app;
mod app_passes;
mod capacity;
mod measure;
mod publish;
mod published;
mod scenario;
mod stage;
mod sustained;
mod tracker;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;

use amqp_delay::QueueType;
use amqp_delay::ops::connection::redact_url;
use amqp_delay::{Layout, Precision, Publisher, Result, Settings, Topology};

use crate::amqp::{connect, delete_topology};
use crate::cleanup::Cleanup;
use crate::config::{BenchConfig, Scenario};
use crate::environment::{HANDLES_PER_QUORUM_QUEUE, broker_info, file_handles, machine};
use crate::progress::Progress;
use app::Sender;
use stage::Path;

use crate::report::{Environment, Report, RunConfig, describe_precision, round1};

/// The scenarios that run on the main topology (one declaration for all of them).
const ON_MAIN_TOPOLOGY: [Scenario; 7] = [
    Scenario::Raw,
    Scenario::Fixed,
    Scenario::Uniform,
    Scenario::Mix,
    Scenario::FixedBatched,
    Scenario::UniformBatched,
    Scenario::Relay,
];

/// Runs everything `cfg` asks for. Whatever it declares is registered in `cleanup` first; the
/// caller deletes it (also after an error or an interruption) with [`Cleanup::run`].
///
/// One topology at a time, deleted before the next is declared: a quorum queue holds file
/// handles in the broker, and a shared broker should not have to hold both. Raw runs first:
/// the delayed scenarios report their rate as a ratio of its.
pub(crate) async fn run(cfg: &BenchConfig, cleanup: &Cleanup) -> Result<Report> {
    let started = Instant::now();
    let progress = Progress::new(cfg.progress);
    let (mut b, environment) = Bench::open(cfg, cleanup, progress.clone()).await?;
    let wants = |s: Scenario| cfg.scenarios.contains(&s);
    // every layout before anything is declared: a configuration error stops the run first
    let main = cfg.main_layout(true)?;
    let main_nofixed = cfg.main_layout(false)?;
    let binary = cfg.binary_layout()?;
    let proxy_bin = if wants(Scenario::Proxy) && cfg.proxy_url.is_none() {
        Some(crate::proxy_process::binary()?)
    } else {
        None
    };

    let mut raw = None;
    let mut scenarios = BTreeMap::new();
    if ON_MAIN_TOPOLOGY.into_iter().any(wants) {
        raw = b
            .on_main_topology(&main, &main_nofixed, &mut scenarios)
            .await?;
    }
    let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
    if wants(Scenario::Binary) {
        let r = b
            .on_own_topology(
                Scenario::Binary,
                &binary,
                Precision::EXACT,
                raw_rate,
                &Path::Tiers,
            )
            .await?;
        scenarios.insert(Scenario::Binary.name().to_string(), r);
    }
    for sc in [Scenario::Gateway, Scenario::GatewayLong] {
        if wants(sc) {
            let r = b.gateway(sc, raw_rate).await?;
            scenarios.insert(sc.name().to_string(), r);
        }
    }
    for sc in [Scenario::Plugin, Scenario::Proxy] {
        if wants(sc) {
            let r = b.app(sc, raw_rate, proxy_bin.as_deref()).await?;
            scenarios.insert(sc.name().to_string(), r);
        }
    }
    let capacity = match cfg.capacity {
        Some(m) => {
            let hint = raw.as_ref().map_or(2_000.0, |r| r.publish_msgs_per_s);
            Some(b.capacity(m, hint).await?)
        }
        None => None,
    };
    progress.finish();
    let problems = b.close().await;
    Ok(Report {
        tool: "delay-bench",
        version: env!("CARGO_PKG_VERSION"),
        environment,
        config: run_config(cfg),
        raw_msgs_per_s: raw.as_ref().map(|r| r.msgs_per_s),
        raw,
        scenarios,
        capacity,
        ok: problems.is_empty(),
        problems,
        elapsed_s: round1(started.elapsed().as_secs_f64()),
    })
}

/// The broker and the machine, and whether `rabbitmqctl` here talks to that broker.
async fn environment(url: &str) -> (Environment, bool) {
    let (cpu, cores) = machine();
    let (broker_version, dlx_prefetch, local_node) = broker_info(url).await;
    let environment = Environment {
        broker_url: redact_url(url),
        broker_version,
        dead_letter_worker_prefetch: dlx_prefetch,
        cpu,
        cores,
    };
    (environment, local_node)
}

/// The settings the run used, as the report shows them.
fn run_config(cfg: &BenchConfig) -> RunConfig {
    RunConfig {
        prefix: cfg.settings.prefix.clone(),
        messages: cfg.messages,
        batched_messages: cfg.batched_messages,
        quick: cfg.quick,
        radix: cfg.settings.topology.radix,
        unit_ms: cfg.settings.topology.unit.as_millis(),
        queue_type: cfg.settings.topology.queue_type.to_string(),
        lateness_budget: describe_precision(&cfg.settings.precision),
        max_in_flight: cfg.settings.publisher.max_in_flight,
        prefetch: cfg.prefetch,
        publishers: cfg.publishers,
        consumers: cfg.consumers,
        body_bytes: cfg.body_bytes,
        max_delay_ms: cfg.max_delay_ms,
        fixed_levels_ms: cfg.fixed_levels(),
        lateness_secs: cfg.lateness_secs,
        rate: cfg.rate,
        seed: cfg.seed,
        fixed_shards: cfg.fixed_shards,
        sustained: cfg.sustained,
        objective_ms: cfg.objective_ms,
        probe_secs: cfg.probe_secs,
        probes: cfg.probes,
    }
}

/// Publishers, each on its own connection.
struct Publishers {
    pubs: Vec<Sender>,
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

impl<'a> Bench<'a> {
    /// Connects the admin and the consumers' connection, reads the environment.
    async fn open(
        cfg: &'a BenchConfig,
        cleanup: &'a Cleanup,
        progress: Progress,
    ) -> Result<(Bench<'a>, Environment)> {
        let url = &cfg.settings.url;
        let admin = connect(url, "delay-bench admin").await?;
        let consumer_conn = connect(url, "delay-bench consumer").await?;
        let (environment, local_node) = environment(url).await;
        let stall_ms = (2 * cfg.max_delay_ms + 20_000).max(30_000);
        let bench = Bench {
            cfg,
            cleanup,
            progress,
            admin,
            consumer_conn,
            problems: Vec::new(),
            stall: Duration::from_millis(stall_ms),
            local_node,
        };
        Ok((bench, environment))
    }

    /// `cfg.publishers` publishers of `layout`, each on a connection of its own to `url` (the
    /// broker's, or an in-process proxy's).
    async fn publishers(
        &self,
        layout: &Layout,
        precision: Precision,
        url: &str,
    ) -> Result<Publishers> {
        let settings = Settings {
            precision,
            ..self.cfg.settings.clone()
        };
        let mut out = Publishers {
            pubs: Vec::new(),
            conns: Vec::new(),
        };
        for _ in 0..self.cfg.publishers {
            let conn = Arc::new(connect(url, "delay-bench publisher").await?);
            out.conns.push(conn.clone());
            let p = Publisher::with_connection(conn, layout.clone(), &settings).await;
            match p {
                Ok(p) => out.pubs.push(Sender::Library(p)),
                Err(e) => {
                    out.close().await;
                    return Err(e);
                }
            }
        }
        Ok(out)
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
        delete_topology(&self.admin, layout, &self.cleanup.declared_exchanges()).await?;
        self.cleanup.forget_layout(layout);
        Ok(())
    }

    /// On a local RabbitMQ 3.x, every quorum queue takes [`HANDLES_PER_QUORUM_QUEUE`] of the
    /// broker's file handles (`file_handle_cache`, sized from its open-file limit). When they
    /// run out the broker stops accepting connections without an error (DESIGN rule 11), so
    /// refuse to declare a topology that does not fit.
    async fn ensure_file_handles(&mut self, queues: usize) -> Result<()> {
        if !self.local_node || self.cfg.settings.topology.queue_type != QueueType::Quorum {
            return Ok(());
        }
        let Some((used, limit)) = file_handles().await else {
            return Ok(());
        };
        let need = queues as u64 * HANDLES_PER_QUORUM_QUEUE;
        if used + need > limit {
            // the broker's configuration cannot hold this run
            return Err(amqp_delay::settings::SettingsError::Invalid(format!(
                "the broker has {} of its {limit} file handles left and this run needs about \
                 {need} ({queues} quorum queues × {HANDLES_PER_QUORUM_QUEUE}); when they run out \
                 it stops accepting connections. Delete leftover queues or raise the broker's \
                 open-file limit (ulimit -n / LimitNOFILE)",
                limit.saturating_sub(used)
            ))
            .into());
        }
        Ok(())
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

    /// Closes the run's connections; the problems found.
    async fn close(self) -> Vec<String> {
        let _ = self.admin.close(200, "bye".into()).await;
        let _ = self.consumer_conn.close(200, "bye".into()).await;
        self.problems
    }
}
