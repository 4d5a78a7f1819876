//! `delay-bench`: throughput, lateness and capacity of the delay topology, measured
//! against the raw broker on the same machine in one run, under its own random prefix. This file
//! is the command line only; the modules below do the work.
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
//! * **fixed_batched / uniform_batched / relay / gateway**: the batched paths, with the
//!   library's stages running in process (`runner::stage`): the same fixed level and uniform
//!   delays to a destination the library's `Worker` consumes (its batch marker makes the
//!   publisher batch; members counted one by one in its handler); uniform delays through the
//!   relay of `delay-consumer --relay` into a plain queue; and plugin-style `x-delay` 1–100 ms
//!   publishes to the `x-delay` gateway's ingress, counted on a queue bound to its target;
//!   `gateway_long` the same with `x-delay` 1–5,000 ms, which cross the tiers (longer than
//!   `gateway.hold`). Besides the above they report broker messages through the tiers per
//!   message (the library's metrics: how well batches packed), the gateways also the share of
//!   their messages that crossed the tiers. `uniform_batched`, `relay` and `gateway_long` are
//!   opt-in.
//! * **plugin / proxy** (opt-in, `runner::app`): a plugin-era application on plain AMQP
//!   connections declares an `x-delayed-message` exchange, binds its queue and publishes
//!   `gateway_long`'s delays to it at once; on a broker with the delayed-message-exchange plugin
//!   (`--plugin-url`), or through a `delay-proxy` process (`proxy_process`; `--proxy-url` of a
//!   running one), which runs the gateway itself. Compared with `gateway_long` in one run.
//! * **lateness** of every scenario, from a second, rate-limited run at half its measured
//!   capacity (or `rate`): `consume time − x-delay-due-at`, as min/p50/p99/p99.9/max, with its
//!   broker messages per message; of the messages due once the longest delay has passed (the
//!   steady state), and of every message from the first (`lateness_from_first_ms`).
//! * **sustained rate** (optional, `--sustained`): the highest steady rate whose p99 lateness
//!   stays within an objective, found by short paced probes, each judged after a warm-up as
//!   long as the scenario's longest delay (`runner::sustained`, the search
//!   and the verdict pure in `search`), as msg/s and as a ratio to raw's saturating rate.
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
//! declared, so `main` can delete it on success, error or interruption.
//!
//! # Where things live
//!
//! * `config`: the scenarios and `BenchConfig` (defaults, validation, the bench layouts).
//! * `runner`: the run itself (raw and delayed scenarios, lateness runs, capacity) and, in
//!   `runner::measure`, one publish-and-consume pass with its counting.
//! * `hops`: pure hop statistics: the delay distributions and `--hop-table`.
//! * `search`: pure parts of the sustained-rate mode: the rate search and a probe's verdict.
//! * `environment`: the machine and what `rabbitmqctl` says about a local broker.
//! * `report`: the `Report` (the `--json` object) and its table.
//! * `proxy_process`: the `delay-proxy` child of the proxy scenario.
//! * `cleanup`, `progress`, `amqp`: deleting what a run declared, the progress bar, AMQP plumbing.
//!
//! The binary reaches the library only through its public API (`amqp_delay::...`).
//!
//! [`Publisher::publish_confirmed`]: amqp_delay::Publisher::publish_confirmed

/// The bench allocates with mimalloc: with glibc's malloc, about a fifth of delay-bench's CPU on
/// the gateway scenario (its publisher, gateway and consumer) went to `malloc_consolidate`,
/// `unlink_chunk` and the aligned allocations of runtime tasks (`perf record` of
/// `delay-bench --scenarios gateway_long`, docs/PERFORMANCE.md). The choice is the bench's own:
/// the tools and the library leave the allocator to the system (or the application).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod amqp;
mod cleanup;
mod config;
mod environment;
mod hops;
mod progress;
mod proxy_process;
mod report;
mod runner;
mod search;

use std::io::IsTerminal;

use amqp_delay::QueueType;
use amqp_delay::ops::connection::redact_url;
use amqp_delay::time::DurationMs;
use amqp_delay_cli::cli::{self, EXIT_FAILURES, EXIT_USAGE, GlobalArgs};
use clap::Parser;

use cleanup::Cleanup;
use config::{BenchConfig, Scenario};

const ABOUT: &str = "Measure amqp-delay against the raw broker: throughput, lateness, capacity";

const LONG_ABOUT: &str = "\
Measure amqp-delay against the raw broker: throughput, lateness and capacity, in one run.

Scenarios (choose with --scenarios; all but uniform_batched, relay and gateway_long by default):
  raw      N persistent messages, confirms pipelined, straight into one plain queue of the
           tiers' queue type, consumed with manual acks: the ceiling on this machine
  fixed    every message on one fixed level (one hop)
  uniform  delays uniform 0–5 s through the cascade at the configured radix, unit and budget
  mix      60% on fixed levels, 40% uniform 0–5 s (24 h scaled down)
  binary   uniform 0–5 s through a radix-2 cascade, exact: the NServiceBus-style reference
  fixed_batched    as fixed, to a destination the library's worker consumes (in process):
                   the publisher batches, the worker unpacks; counted per message
  uniform_batched  as uniform, batched, to the worker (opt-in: needs --batched-messages
                   100000 or so, else its 5 s delays, not the broker, set the rate)
  relay    as uniform_batched, the worker being the relay of `delay-consumer --relay`,
           unpacking into a plain queue read by a raw consumer (opt-in, as uniform_batched)
  gateway  plugin-style publishes with x-delay 1–100 ms to the ingress of the x-delay
           gateway (in process, the configuration's settings), read from a queue bound to
           its target exchange; with --rate 1000: its lateness at a steady 1,000 msg/s
  gateway_long  as gateway with x-delay 1–5,000 ms: longer than gateway.hold (100 ms by
           default), so the messages cross the tiers (opt-in, as uniform_batched)
  plugin   a plugin-era application on plain AMQP: declares an x-delayed-message exchange,
           binds its queue, publishes gateway_long's x-delays to it at once, consumes the
           queue; on the broker of --plugin-url, which runs the delayed-message-exchange
           plugin (opt-in)
  proxy    the same application through delay-proxy, which runs the gateway itself: the
           binary beside delay-bench, started on a free port for a topology of its own (or
           --proxy-url of a running one) (opt-in)

Each scenario is run twice: saturating (msg/s end to end, from the first publish to the last
consume, its ratio to raw, average hops per message), then rate-limited at half that rate (or
--rate) for lateness = consume time − x-delay-due-at (min, p50, p99, p99.9, max) of the messages
due once the longest delay has passed, and of every message from the first. Every message
is counted: lost, duplicated or early messages are reported and make the exit code 1. Both runs
report broker messages through the tiers per message (brk/m); the gateways also the share of
their messages that crossed the tiers.
--sustained additionally searches, for each scenario, the highest steady rate whose p99 lateness
stays within --objective-ms (25 ms): --probes steady runs at rates bisected between 1/16 of its
saturating rate and that rate. A probe publishes for the scenario's longest delay (a warm-up:
until then the stages after the tiers carry only part of the rate) plus --probe-secs, and its
p99 is of the messages due in those last --probe-secs (all are checked for loss and earliness).
It reports that rate and its ratio to raw's saturating rate (of the same run). A probe fails when
its p99 is above the objective, when the publisher fell behind the rate by more than the
objective, or when a message was lost or early.
--capacity M additionally holds M messages in one tier and reads the broker's memory before and
after (rabbitmqctl, local broker only), then drains them; with --capacity-batched they travel in
batches to a worker.

The topology shape (radix, unit, queue type, lateness budget, max_in_flight) comes from the
configuration (--config, AMQP_DELAY_* variables) or the flags below. Everything is declared under
a fresh prefix (bench-<random>, or <--prefix>-bench-<random>) and deleted at the end, also after
an error or Ctrl-C. Messages and numbers go to stdout (a table, or one JSON object with --json);
progress goes to stderr.";

#[derive(Parser)]
#[command(name = "delay-bench", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Args {
    #[command(flatten)]
    global: GlobalArgs,
    /// Messages per saturating run [default: 50000, with --quick 10000]
    #[arg(short = 'n', long)]
    messages: Option<usize>,
    /// A shorter run (fewer messages, shorter lateness runs) that finishes in under two minutes
    #[arg(long)]
    quick: bool,
    /// Print one JSON object instead of the table
    #[arg(long)]
    json: bool,
    /// Messages per saturating run of the batched scenarios [default: as --messages]
    #[arg(long, value_name = "N")]
    batched_messages: Option<usize>,
    /// Scenarios to run, comma-separated (ratios need raw)
    #[arg(long, value_delimiter = ',', value_enum, default_values_t = Scenario::defaults())]
    scenarios: Vec<Scenario>,
    /// Rate of the lateness runs in msg/s [default: half of each scenario's measured rate]
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of publishing in each lateness run [default: 20, with --quick 3]
    #[arg(long, value_name = "SECS")]
    lateness_secs: Option<f64>,
    /// Capacity mode: hold M messages (e.g. 1000000, 500k, 1M) in one tier, read the broker's
    /// memory, then drain them
    #[arg(long, value_name = "M", value_parser = parse_count)]
    capacity: Option<u64>,
    /// How long the capacity messages wait [default: long enough to publish them all]
    #[arg(long, value_name = "DURATION")]
    capacity_hold: Option<DurationMs>,
    /// Capacity mode through batches: the tier's destination is consumed by the library's
    /// worker, so `schedule_all` packs the messages into batches (as `fixed_batched`)
    #[arg(long, requires = "capacity")]
    capacity_batched: bool,
    /// Largest delay of the distributions; the bench's fixed levels are 1/20, 1/5, 1/2 and 1/1 of it
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    max_delay: DurationMs,
    /// Cascade radix (default: topology.radix of the configuration)
    #[arg(long)]
    radix: Option<u32>,
    /// Cascade unit in ms (default: topology.unit)
    #[arg(long)]
    unit_ms: Option<u64>,
    /// Queue type of the tiers and of the raw and destination queues: quorum or classic
    /// (default: topology.queue_type)
    #[arg(long)]
    queue_type: Option<QueueType>,
    /// Absolute lateness budget in ms (default: precision.lateness)
    #[arg(long)]
    lateness_ms: Option<u64>,
    /// Relative lateness budget, e.g. 0.001 (default: precision.lateness_ratio)
    #[arg(long)]
    lateness_ratio: Option<f64>,
    /// Publishes awaiting their confirm at once, per publisher (default: publisher.max_in_flight)
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Consumer prefetch per consumer channel
    #[arg(long, default_value_t = 256)]
    prefetch: u16,
    /// Publisher instances, each with its own connection and channel
    #[arg(long, default_value_t = 1)]
    publishers: usize,
    /// Consumer channels on each destination queue
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Body size in bytes
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Seed of the delay distributions
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Spread the fixed scenario over K one-hop tiers (TTLs F, F+1 ms, …): shows whether a
    /// sharded fixed level scales past the single-queue limit
    #[arg(long, value_name = "K", default_value_t = 1)]
    fixed_shards: u32,
    /// Sustained-rate mode: after each scenario's runs, search the highest steady rate whose
    /// p99 lateness stays within --objective-ms (short probes between 1/16 of its saturating
    /// rate and that rate), reported in msg/s and as a ratio to raw's
    #[arg(long)]
    sustained: bool,
    /// The p99 lateness objective of --sustained, in ms
    #[arg(long, value_name = "MS", default_value_t = 25)]
    objective_ms: u64,
    /// Seconds of steady publishing in each probe of --sustained, after a warm-up as long as
    /// the scenario's longest delay; its p99 is of the messages due then [default: 2, with
    /// --quick 1]
    #[arg(long, value_name = "SECS")]
    probe_secs: Option<f64>,
    /// Probes per scenario in --sustained (the search stops earlier once it brackets the rate
    /// within 10%) [default: 5, with --quick 3]
    #[arg(long, value_name = "K")]
    probes: Option<usize>,
    /// The gateway scenarios as a plugin-era application behind delay-proxy sees them: an
    /// in-process proxy, the target declared through it as an x-delayed-message exchange, the
    /// x-delay publishes sent to that exchange through it (the proxy sends them to the pair's
    /// ingress); compare with the same run without the flag
    #[arg(long)]
    via_proxy: bool,
    /// The plugin scenario's broker, one that runs rabbitmq_delayed_message_exchange (e.g.
    /// amqp://guest:guest@127.0.0.1:5931/%2f of `scripts/plugin-node.sh 3.10 up`)
    #[arg(long, value_name = "URL")]
    plugin_url: Option<String>,
    /// The proxy scenario through this running delay-proxy (its own prefix and settings)
    /// instead of one the bench starts from the delay-proxy binary beside its own
    #[arg(long, value_name = "URL")]
    proxy_url: Option<String>,
    /// No progress display (it is shown only when stderr is a terminal anyway)
    #[arg(long)]
    no_progress: bool,
    /// Print the planner's average hops per radix and lateness budget (no broker) and exit
    #[arg(long)]
    hop_table: bool,
}

fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim().replace('_', "");
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1_000),
        Some('m' | 'M') => (&t[..t.len() - 1], 1_000_000),
        _ => (t.as_str(), 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("'{s}' is not a count (e.g. 1000000, 500k, 1M)"))
}

fn config(args: &Args) -> Result<BenchConfig, String> {
    let mut s = args.global.settings().map_err(|e| cli::chain(&e))?;
    let id = format!("{:08x}", rand::random::<u32>());
    s.prefix = match &args.global.prefix {
        Some(p) => format!("{p}-bench-{id}"),
        None => format!("bench-{id}"),
    };
    if let Some(r) = args.radix {
        s.topology.radix = r;
    }
    if let Some(u) = args.unit_ms {
        s.topology.unit = DurationMs(u);
    }
    if let Some(q) = args.queue_type {
        s.topology.queue_type = q;
    }
    if let Some(l) = args.lateness_ms {
        s.precision.lateness = DurationMs(l);
    }
    if let Some(r) = args.lateness_ratio {
        s.precision.lateness_ratio = r;
    }
    if let Some(m) = args.max_in_flight {
        s.publisher.max_in_flight = m;
    }
    let mut c = BenchConfig::new(s);
    c.quick = args.quick;
    c.messages = args
        .messages
        .unwrap_or(if args.quick { 10_000 } else { 50_000 });
    c.batched_messages = args.batched_messages.unwrap_or(c.messages);
    c.lateness_secs = args
        .lateness_secs
        .unwrap_or(if args.quick { 3.0 } else { 20.0 });
    c.scenarios = args.scenarios.clone();
    c.scenarios.sort();
    c.scenarios.dedup();
    c.rate = args.rate;
    c.capacity = args.capacity;
    c.capacity_hold_ms = args.capacity_hold.map(DurationMs::as_millis);
    c.capacity_batched = args.capacity_batched;
    c.max_delay_ms = args.max_delay.as_millis();
    c.prefetch = args.prefetch;
    c.publishers = args.publishers;
    c.consumers = args.consumers;
    c.body_bytes = args.body_bytes;
    c.seed = args.seed;
    c.fixed_shards = args.fixed_shards;
    c.sustained = args.sustained;
    c.via_proxy = args.via_proxy;
    c.plugin_url = args.plugin_url.clone();
    c.proxy_url = args.proxy_url.clone();
    c.objective_ms = args.objective_ms;
    c.probe_secs = args
        .probe_secs
        .unwrap_or(if args.quick { 1.0 } else { 2.0 });
    c.probes = args.probes.unwrap_or(if args.quick { 3 } else { 5 });
    c.progress = !args.no_progress && std::io::stderr().is_terminal();
    c.validate()?;
    Ok(c)
}

/// Resolves on Ctrl-C or SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    cli::init_logging_as(args.global.log_format);
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(EXIT_USAGE);
        }
    };
    if args.hop_table {
        let rows = hops::hop_table(&cfg.settings, cfg.max_delay_ms);
        if args.json {
            amqp_delay_cli::outln!(
                "{}",
                serde_json::to_string_pretty(&rows).expect("serializable")
            );
        } else {
            print!("{}", hops::hop_table_text(&rows, cfg.max_delay_ms));
        }
        return;
    }
    eprintln!(
        "delay-bench: {} under prefix '{}'",
        redact_url(&cfg.settings.url),
        cfg.settings.prefix
    );
    let cleanup = Cleanup::default();
    let outcome = tokio::select! {
        r = runner::run(&cfg, &cleanup) => Some(r),
        _ = interrupted() => None,
    };
    if outcome.is_none() {
        eprintln!(
            "interrupted: deleting everything under '{}' (Ctrl-C again to skip)",
            cfg.settings.prefix
        );
        tokio::spawn(async {
            interrupted().await;
            std::process::exit(130);
        });
    }
    let cleaned = cleanup.run(&cfg.settings.url).await;
    if let Err(e) = &cleaned {
        eprintln!(
            "warning: clean-up of prefix '{}' failed: {} (remove it with `delay-publisher --prefix {} teardown --force`)",
            cfg.settings.prefix,
            cli::chain(e),
            cfg.settings.prefix
        );
    }
    match outcome {
        None => std::process::exit(130),
        Some(Err(e)) => cli::fail_with(&e),
        Some(Ok(report)) => {
            if args.json {
                amqp_delay_cli::outln!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("serializable")
                );
            } else {
                print!("{}", report.table());
            }
            if !report.ok || cleaned.is_err() {
                std::process::exit(EXIT_FAILURES);
            }
        }
    }
}
