//! `delay-bench-recurring`: recurring schedules at scale. It adds N schedules (default
//! 100,000) ticking every minute, their seconds spread evenly (N/60 ticks a second), all to one
//! queue under a fresh prefix; runs `delay-publisher recurring serve` (the binary beside this
//! one) as a child process; consumes the occurrences; and reports, for the ticks of the
//! measured minutes (after a warm-up: the first round publishes a whole minute at once):
//!
//! * lateness after the tick (consume time − `x-delay-recurring-tick`), p50/p99/p99.9/max,
//!   overall and per minute;
//! * occurrences a second; lost (a tick of the window never delivered), duplicated (an id
//!   delivered twice) and early (before its tick);
//! * the serve process's RSS (peak and last, from /proc) and the CPU of serve, of this process
//!   (adder and consumer) and of the broker (`--broker-pid`, or the only `beam.smp`);
//! * the control stream's records and bytes written per minute by the marks;
//! * `delay-publisher recurring list` of all N: its wall time, run as a child, three times.
//!
//! Everything it declares is deleted at the end (`teardown --force` of the prefix, the queue).
//! Only one benchmark at a time on a machine: the numbers are of a shared machine otherwise.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::ops::broker;
use amqp_delay::ops::control::{self, Record};
use amqp_delay::recurring::{Add, Definition};
use amqp_delay::time::now_ms;
use amqp_delay::{Layout, Result, Settings, Topology};
use amqp_delay_cli::cli::GlobalArgs;
use clap::Parser;
use futures::StreamExt;
use hdrhistogram::Histogram;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;

/// Recurring schedules at scale: N minutely schedules through `recurring serve`.
#[derive(Parser)]
#[command(name = "delay-bench-recurring", version)]
struct Args {
    #[command(flatten)]
    global: GlobalArgs,
    /// Schedules, each ticking once a minute (their seconds spread evenly)
    #[arg(short = 'n', long, default_value_t = 100_000)]
    schedules: usize,
    /// Minutes of ticks measured, after the warm-up
    #[arg(long, default_value_t = 3)]
    minutes: u64,
    /// Seconds from serve's start to the first tick measured
    #[arg(long, default_value_t = 120)]
    warmup: u64,
    /// serve's --ahead, in seconds
    #[arg(long, default_value_t = 60)]
    ahead: u64,
    /// The broker's process, whose CPU is read [default: the only beam.smp, if one]
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Consume with the library's worker (in process) instead of a plain consumer: the
    /// destination gets its batch marker, so serve's publisher batches the occurrences and
    /// the worker holds each until its tick
    #[arg(long)]
    worker: bool,
    /// Only time `recurring list` of the N schedules through a `pending serve` (the binary
    /// beside this one) at `pending.index_url`, and its parts; no serve, no ticks
    #[arg(long)]
    list_only: bool,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

/// Where deliveries are counted.
type Sink = Arc<Mutex<Vec<Got>>>;

/// The worker path's handler: each member counted as it runs.
struct Counting(Sink);

impl amqp_delay::Handler for Counting {
    async fn handle(
        &self,
        d: &amqp_delay::Delivery,
        _ctx: &amqp_delay::Context,
    ) -> amqp_delay::Outcome {
        record(&self.0, d.headers(), d.message_id.clone());
        amqp_delay::Outcome::Success
    }
}

/// Counts a delivery with these headers and id, arrived now.
fn record(sink: &Sink, headers: Option<&FieldTable>, id: String) {
    let at_ms = now_ms();
    let ms = |name: &str| {
        headers
            .and_then(|h| match h.inner().get(name) {
                Some(AMQPValue::LongLongInt(t)) => u64::try_from(*t).ok(),
                _ => None,
            })
            .unwrap_or(0)
    };
    let tick_ms = ms(amqp_delay::headers::RECURRING_TICK);
    let due_ms = ms(amqp_delay::headers::DUE_AT);
    sink.lock().expect("sink").push(Got {
        at_ms,
        tick_ms,
        due_ms,
        id,
    });
}

mod recurring_list;
mod tool;

use tool::{hist, invalid, lat, note};

fn main() -> std::process::ExitCode {
    tool::main("delay-bench-recurring", run(Args::parse()))
}

/// What a `delay-publisher` child of the bench runs with: the bench's broker, prefix, cap
/// and `--config`.
fn child_env(c: &mut tokio::process::Command, settings: &Settings, args: &Args) {
    c.env("AMQP_URL", &settings.url)
        .env("AMQP_DELAY_PREFIX", &settings.prefix)
        .env(
            "AMQP_DELAY_TRUST__MAX_SCHEDULES_PER_USER",
            settings.trust.max_schedules_per_user.to_string(),
        );
    if let Some(config) = &args.global.config {
        c.arg("--config").arg(config);
    }
}

/// `delay-publisher` beside this binary.
fn publisher_bin() -> Result<PathBuf> {
    tool::beside("delay-publisher")
}

async fn run(args: Args) -> Result<bool> {
    let mut settings = args.global.settings().map_err(|e| invalid(e.to_string()))?;
    let tag: u32 = rand::random();
    settings.prefix = format!("{}-rb{tag:08x}", settings.prefix);
    // one user owns every schedule: its cap must hold them (a setting every reader shares)
    settings.trust.max_schedules_per_user = args
        .schedules
        .clamp(1, amqp_delay::recurring::MAX_SCHEDULES);
    let layout = settings.layout()?;
    let conn = amqp_delay::ops::connection::connect(&settings.url, "delay-bench-recurring").await?;
    let queue = format!("{}.rbench.dest", settings.prefix);
    note(&format!("declaring {} and {queue}", settings.prefix));
    let r = if args.list_only {
        recurring_list::measure(&args, &settings, &layout, &conn, &queue).await
    } else {
        measure(&args, &settings, &layout, &conn, &queue).await
    };
    let parked = layout.parked_queue(&queue);
    tool::tear_down(&conn, &settings, &layout, &[&queue, &parked]).await;
    let report = r?;
    let ok =
        args.list_only || report["lost"] == 0 && report["duplicated"] == 0 && report["early"] == 0;
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    }
    Ok(ok)
}

/// One delivery: when it arrived, its tick, its due time (as the publisher reckoned it), its
/// id.
struct Got {
    at_ms: u64,
    tick_ms: u64,
    due_ms: u64,
    id: String,
}

async fn measure(
    args: &Args,
    settings: &Settings,
    layout: &Layout,
    conn: &lapin::Connection,
    queue: &str,
) -> Result<serde_json::Value> {
    Topology::new(layout.clone()).declare(conn).await?;
    let ch = broker::open(conn).await?;
    broker::declare_queue(&ch, queue, broker::queue_type_args(layout.queue_type())).await?;
    broker::close(&ch, "ok").await;

    let n = args.schedules;
    let add_secs = add_schedules(conn, layout, queue, n).await?;

    // the consumer: a plain one, or the library's worker
    let got: Sink = Arc::default();
    let (stop_worker, worker_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut plain = None;
    let consuming = if args.worker {
        Topology::new(layout.clone())
            .declare_destination(conn, queue)
            .await?;
        let worker =
            amqp_delay::Worker::new(settings.clone()).subscribe(queue, Counting(got.clone()));
        tokio::spawn(async move {
            let _ = worker
                .run(async move {
                    let _ = worker_stopped.await;
                })
                .await;
        })
    } else {
        let (cch, mut consumer) = tool::consume_no_ack(conn, queue, "rbench").await?;
        plain = Some(cch);
        let sink = got.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let id = (d.properties.message_id().as_ref())
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                record(&sink, d.properties.headers().as_ref(), id);
            }
        })
    };

    // serve, as a child
    let bin = publisher_bin()?;
    let env = |c: &mut tokio::process::Command| child_env(c, settings, args);
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(["recurring", "serve", "--ahead", &format!("{}s", args.ahead)]);
    env(&mut cmd);
    cmd.kill_on_drop(true).stdout(std::process::Stdio::null());
    let serve_start = now_ms();
    let mut serve = cmd
        .spawn()
        .map_err(|e| invalid(format!("{}: {e}", bin.display())))?;
    let serve_pid = serve.id().unwrap_or(0);
    let broker_pid = args.broker_pid.or_else(only_beam);
    note(&format!(
        "serve runs as pid {serve_pid}; broker pid {broker_pid:?}"
    ));

    // the window: whole minutes of ticks after the warm-up
    let from_ms = (serve_start + args.warmup * 1000).div_ceil(60_000) * 60_000;
    let until_ms = from_ms + args.minutes * 60_000;
    let mut rss_peak = 0u64;
    let mut rss_samples = Vec::new();
    let mut cpu_at_from = None;
    let stream = layout.control_stream();
    let mut stream_at_from = None;
    loop {
        let now = now_ms();
        if let Ok(Some(status)) = serve.try_wait() {
            return Err(invalid(format!("recurring serve exited early: {status}")));
        }
        let rss = rss_kb(serve_pid);
        rss_peak = rss_peak.max(rss);
        rss_samples.push((now.saturating_sub(serve_start) / 1000, rss));
        if cpu_at_from.is_none() && now >= from_ms {
            cpu_at_from = Some(cpu(serve_pid, broker_pid));
            stream_at_from = stream_size(conn, &stream).await;
            note("measuring");
        }
        if now >= until_ms + 10_000 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cpu_end = cpu(serve_pid, broker_pid);
    let stream_end = stream_size(conn, &stream).await;
    let rss_last = rss_kb(serve_pid);
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(serve_pid as i32).expect("a pid"),
        rustix::process::Signal::TERM,
    );
    let _ = tokio::time::timeout(Duration::from_secs(10), serve.wait()).await;
    if let Some(cch) = plain {
        broker::close(&cch, "ok").await;
        consuming.abort();
    } else {
        let _ = stop_worker.send(());
        let _ = tokio::time::timeout(Duration::from_secs(30), consuming).await;
    }

    // `recurring list` of all of them, three times
    let mut list_ms = Vec::new();
    let mut listed = 0;
    for _ in 0..3 {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.args(["recurring", "list"]);
        env(&mut cmd);
        let t = Instant::now();
        let out = cmd
            .output()
            .await
            .map_err(|e| invalid(format!("{}: {e}", bin.display())))?;
        list_ms.push(t.elapsed().as_millis() as u64);
        if !out.status.success() {
            return Err(invalid(format!(
                "recurring list failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        listed = out.stdout.iter().filter(|&&b| b == b'\n').count();
    }
    note(&format!("recurring list: {listed} lines in {list_ms:?} ms"));

    // the replay alone, in this process: what `list` spends reading the stream
    let t = Instant::now();
    let (book, _) = control::read_schedules(conn, layout, &settings.trust, None).await?;
    let replay_ms = t.elapsed().as_millis() as u64;
    let booked = book.len();
    drop(book);
    let records_in_stream = stream_size(conn, &stream).await;

    let got = std::mem::take(&mut *got.lock().expect("sink"));
    let mut all = hist();
    // the split: due − tick (the delay reckoned before the publish), arrival − due (the tiers)
    let (mut reckoning, mut tiers) = (hist(), hist());
    let mut minutes: Vec<Histogram<u64>> = (0..args.minutes).map(|_| hist()).collect();
    let mut seen = HashSet::new();
    let (mut dup, mut early, mut in_window) = (0u64, 0u64, 0u64);
    let mut per_tick: HashMap<u64, u64> = HashMap::new();
    for g in &got {
        if !seen.insert(g.id.clone()) {
            dup += 1;
            continue;
        }
        if g.at_ms < g.tick_ms {
            early += 1;
        }
        if (from_ms..until_ms).contains(&g.tick_ms) {
            in_window += 1;
            *per_tick.entry(g.tick_ms).or_default() += 1;
            let late = g.at_ms.saturating_sub(g.tick_ms);
            let _ = all.record(late);
            let _ = reckoning.record(g.due_ms.saturating_sub(g.tick_ms));
            let _ = tiers.record(g.at_ms.saturating_sub(g.due_ms));
            let _ = minutes[((g.tick_ms - from_ms) / 60_000) as usize].record(late);
        }
    }
    let expected = n as u64 * args.minutes;
    let lost = expected.saturating_sub(in_window);
    // the ticks short of their schedules (the first 20): where lost occurrences were
    let mut short: Vec<serde_json::Value> = Vec::new();
    for tick in (from_ms..until_ms).step_by(1000) {
        let s = (tick / 1000 % 60) as usize;
        let want = (n / 60 + usize::from(s < n % 60)) as u64;
        let got = per_tick.get(&tick).copied().unwrap_or(0);
        if got < want && short.len() < 20 {
            short.push(json!([amqp_delay::recurring::rfc3339(tick), got, want]));
        }
    }
    let secs = (until_ms - from_ms) as f64 / 1000.0;
    let cpu_of = |i: usize| {
        cpu_at_from
            .map(|a: [f64; 3]| (cpu_end[i] - a[i]) / secs)
            .unwrap_or(f64::NAN)
    };
    let stream_growth = match (stream_at_from, stream_end) {
        (Some(a), Some(b)) => json!({
            "records_per_min": b.saturating_sub(a) as f64 / (secs / 60.0),
        }),
        _ => json!(null),
    };
    Ok(json!({
        "schedules": n,
        "consumer": if args.worker { "worker" } else { "plain" },
        "prefix": settings.prefix,
        "add_secs": add_secs,
        "window": [amqp_delay::recurring::rfc3339(from_ms), amqp_delay::recurring::rfc3339(until_ms)],
        "expected": expected,
        "delivered_in_window": in_window,
        "lost": lost,
        "duplicated": dup,
        "early": early,
        "occurrences_per_sec": in_window as f64 / secs,
        "ticks_seen": per_tick.len(),
        "ticks_short": short,
        "lateness_ms": lat(&all),
        "lateness_ms_per_minute": minutes.iter().map(lat).collect::<Vec<_>>(),
        "due_after_tick_ms": lat(&reckoning),
        "arrival_after_due_ms": lat(&tiers),
        "serve_rss_mb": { "peak": rss_peak as f64 / 1024.0, "last": rss_last as f64 / 1024.0 },
        "serve_rss_mb_by_sec": rss_samples.iter().step_by(15).map(|(s, k)| json!([s, *k as f64 / 1024.0])).collect::<Vec<_>>(),
        "cpu_cores": { "serve": cpu_of(0), "bench": cpu_of(1), "broker": cpu_of(2) },
        "control_stream": stream_growth,
        "marks_bytes_per_min": marks_bytes_per_min("guest", n),
        "list": { "lines": listed, "ms": list_ms, "replay_ms": replay_ms, "replayed": booked,
                  "records_in_stream": records_in_stream },
    }))
}

/// Adds `n` schedules `S * * * * *` (S = i mod 60) of `queue`, 10,000 records at a time; the
/// seconds it took.
pub(crate) async fn add_schedules(
    conn: &lapin::Connection,
    layout: &Layout,
    queue: &str,
    n: usize,
) -> Result<f64> {
    let t0 = Instant::now();
    let at_ms = now_ms();
    let records: Vec<Record> = (0..n)
        .map(|i| {
            Record::RecurringAdd(Add {
                rev: format!("{:08x}-0000-7000-8000-{i:012x}", rand::random::<u32>()),
                at_ms,
                schedule: Definition::new(
                    &format!("s{i}"),
                    &format!("{} * * * * *", i % 60),
                    queue,
                    "{}",
                ),
            })
        })
        .collect();
    for chunk in records.chunks(10_000) {
        control::append_all(conn, layout, chunk).await?;
    }
    let add_secs = t0.elapsed().as_secs_f64();
    note(&format!("added {n} schedules in {add_secs:.1} s"));
    Ok(add_secs)
}

/// Resident memory of `pid`, kB (0 when gone).
fn rss_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// CPU seconds so far of serve, of this process and of the broker.
fn cpu(serve: u32, broker: Option<u32>) -> [f64; 3] {
    let of = |pid: String| {
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime: fields 14 and 15, 12 and 13 after the command
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / 100.0
    };
    [
        of(serve.to_string()),
        of("self".into()),
        broker.map_or(f64::NAN, |p| of(p.to_string())),
    ]
}

/// The broker's process, when exactly one `beam.smp` runs.
fn only_beam() -> Option<u32> {
    let beams: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "beam.smp")
        })
        .collect();
    (beams.len() == 1).then(|| beams[0])
}

/// The control stream's last offset (records so far, barriers included), when it tells.
async fn stream_size(conn: &lapin::Connection, stream: &str) -> Option<u64> {
    let s = broker::queue_state(conn, stream).await.ok()??;
    Some(u64::from(s.ready))
}

/// Bytes of the marks of `n` schedules of `owner` a minute: each round's marks name the
/// schedules of one tick second (revisions as this bench writes them, 36 bytes like a UUID).
fn marks_bytes_per_min(owner: &str, n: usize) -> usize {
    let per_second = n.div_ceil(60);
    let revs: Vec<(String, u64)> = (0..per_second)
        .map(|i| (format!("00000000-0000-7000-8000-{i:012x}"), 1))
        .collect();
    let round: usize = amqp_delay::recurring::Marks::of(owner, &revs, 1 << 20)
        .iter()
        .map(|m| serde_json::to_vec(&Record::RecurringMarks(m.clone())).map_or(0, |v| v.len()))
        .sum();
    round * 60
}
