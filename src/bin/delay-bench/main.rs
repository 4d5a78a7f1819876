//! `delay-bench`: throughput, lateness and capacity of the delay topology against the raw broker,
//! in one run, under its own random prefix. Thin: the work is in the `bench` module.

use std::io::IsTerminal;

use amqp_delay::cli::{self, EXIT_FAILURES, EXIT_USAGE, GlobalArgs};
use amqp_delay::settings::{DurationMs, QueueType};
use bench::{BenchConfig, Cleanup, Scenario};
use clap::Parser;

mod bench;

const ABOUT: &str = "Measure amqp-delay against the raw broker: throughput, lateness, capacity";

const LONG_ABOUT: &str = "\
Measure amqp-delay against the raw broker: throughput, lateness and capacity, in one run.

Scenarios (all by default, choose with --scenarios):
  raw      N persistent messages, confirms pipelined, straight into one plain queue of the
           tiers' queue type, consumed with manual acks: the ceiling on this machine
  fixed    every message on one fixed level (one hop)
  uniform  delays uniform 0–5 s through the cascade at the configured radix, unit and budget
  mix      60% on fixed levels, 40% uniform 0–5 s (24 h scaled down)
  binary   uniform 0–5 s through a radix-2 cascade, exact: the NServiceBus-style reference

Each scenario is run twice: saturating (msg/s end to end, from the first publish to the last
consume, its ratio to raw, average hops per message), then rate-limited at half that rate (or
--rate) for lateness = consume time − x-delay-due-at (min, p50, p99, p99.9, max). Every message
is counted: lost, duplicated or early messages are reported and make the exit code 1.
--capacity M additionally holds M messages in one tier and reads the broker's memory before and
after (rabbitmqctl, local broker only), then drains them.

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
    /// Scenarios to run, comma-separated (ratios need raw)
    #[arg(long, value_delimiter = ',', value_enum, default_values_t = Scenario::ALL.to_vec())]
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
    /// Largest delay of the distributions; the bench's fixed levels are 1/20, 1/5, 1/2 and 1/1 of it
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    max_delay: DurationMs,
    /// Cascade radix (default: topology.radix of the configuration)
    #[arg(long)]
    radix: Option<u32>,
    /// Cascade unit in ms (default: topology.unit_ms)
    #[arg(long)]
    unit_ms: Option<u64>,
    /// Queue type of the tiers and of the raw and destination queues (default: topology.queue_type)
    #[arg(long, value_enum)]
    queue_type: Option<QueueType>,
    /// Absolute lateness budget in ms (default: precision.lateness_ms)
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
        s.topology.unit_ms = u;
    }
    if let Some(q) = args.queue_type {
        s.topology.queue_type = q;
    }
    if let Some(l) = args.lateness_ms {
        s.precision.lateness_ms = l;
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
    c.lateness_secs = args
        .lateness_secs
        .unwrap_or(if args.quick { 3.0 } else { 20.0 });
    c.scenarios = args.scenarios.clone();
    c.scenarios.sort();
    c.scenarios.dedup();
    c.rate = args.rate;
    c.capacity = args.capacity;
    c.capacity_hold_ms = args.capacity_hold.map(DurationMs::as_millis);
    c.max_delay_ms = args.max_delay.as_millis();
    c.prefetch = args.prefetch;
    c.publishers = args.publishers;
    c.consumers = args.consumers;
    c.body_bytes = args.body_bytes;
    c.seed = args.seed;
    c.fixed_shards = args.fixed_shards;
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
    cli::init_logging();
    let args = Args::parse();
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(EXIT_USAGE);
        }
    };
    if args.hop_table {
        let rows = bench::hop_table(&cfg.settings, cfg.max_delay_ms);
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&rows).expect("serializable")
            );
        } else {
            print!("{}", bench::hop_table_text(&rows, cfg.max_delay_ms));
        }
        return;
    }
    eprintln!(
        "delay-bench: {} under prefix '{}'",
        amqp_delay::connection::redact_url(&cfg.settings.url),
        cfg.settings.prefix
    );
    let cleanup = Cleanup::default();
    let outcome = tokio::select! {
        r = bench::run(&cfg, &cleanup) => Some(r),
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
        Some(Err(e)) => cli::fail(&e, EXIT_FAILURES),
        Some(Ok(report)) => {
            if args.json {
                println!(
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
