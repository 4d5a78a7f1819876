//! `delay-bench-burst`: the worker's side of issue 56's recurring load, alone (no `recurring
//! serve`). Each second it schedules N messages (default 1,667, a minute of 100,000 minutely
//! schedules) due at one tick, through the library's `Publisher` to a queue read by
//! `delay-consumer --relay` (the release binary beside this one), so the worker receives grain
//! batches, holds them and relays each member into a plain queue at its due time; it consumes
//! that queue and reports, for the ticks after the warm-up:
//!
//! * lateness (arrival − due, and arrival − tick), p50/p99/p99.9/max;
//! * lost (never delivered), duplicated and early (before its due time) messages;
//! * the worker process's CPU over the window, and per message (µs), and its busiest thread's.
//!
//! Everything it declares is deleted at the end, also after an error. One benchmark at a time
//! on a machine.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqp_delay::ops::broker;
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Publisher, Result, Settings, Topology};
use amqp_delay_cli::cli::GlobalArgs;
use clap::Parser;
use futures::StreamExt;
use lapin::types::AMQPValue;
use serde_json::json;

/// The worker's side of recurring load: N messages due at one tick each second.
#[derive(Parser)]
#[command(name = "delay-bench-burst", version)]
struct Args {
    #[command(flatten)]
    global: GlobalArgs,
    /// Messages due at the same tick each second
    #[arg(short = 'n', long, default_value_t = 1_667)]
    per_second: usize,
    /// Seconds of ticks measured, after the warm-up
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds of ticks before those measured
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// How long before its tick each second's messages are scheduled, seconds
    #[arg(long, default_value_t = 5)]
    ahead: u64,
    /// The consumer binary [default: delay-consumer beside this one]
    #[arg(long)]
    consumer: Option<PathBuf>,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

/// One message consumed: arrival, due time, tick, id.
struct Got {
    at_ms: u64,
    due_ms: u64,
    tick_ms: u64,
    id: String,
}

mod tool;

use tool::{hist, invalid, lat, note};

fn main() -> std::process::ExitCode {
    tool::main("delay-bench-burst", run(Args::parse()))
}

async fn run(args: Args) -> Result<bool> {
    let mut settings = args.global.settings().map_err(|e| invalid(e.to_string()))?;
    let tag: u32 = rand::random();
    settings.prefix = format!("{}-bb{tag:08x}", settings.prefix);
    let layout = settings.layout()?;
    let conn = amqp_delay::ops::connection::connect(&settings.url, "delay-bench-burst").await?;
    let (src, out) = (
        format!("{}.burst.src", settings.prefix),
        format!("{}.burst.out", settings.prefix),
    );
    note(&format!("declaring {}, {src} and {out}", settings.prefix));
    let mut child = None;
    let r = measure(&args, &settings, &conn, &src, &out, &mut child).await;
    if let Some(mut c) = child {
        stop(&mut c).await;
    }
    let parked = layout.parked_queue(&src);
    tool::tear_down(&conn, &settings, &layout, &[&src, &out, &parked]).await;
    let report = r?;
    let ok = report["lost"] == 0 && report["duplicated"] == 0 && report["early"] == 0;
    match args.json {
        true => println!("{report}"),
        false => println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        ),
    }
    Ok(ok)
}

/// SIGTERM, then a kill after 10 s.
async fn stop(c: &mut tokio::process::Child) {
    if let Some(pid) = c
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(Duration::from_secs(10), c.wait())
        .await
        .is_err()
    {
        let _ = c.kill().await;
    }
}

fn consumer_bin(args: &Args) -> Result<PathBuf> {
    match &args.consumer {
        Some(b) => tool::existing(b.clone()),
        None => tool::beside("delay-consumer"),
    }
}

async fn measure(
    args: &Args,
    settings: &Settings,
    conn: &lapin::Connection,
    src: &str,
    out: &str,
    child: &mut Option<tokio::process::Child>,
) -> Result<serde_json::Value> {
    let layout = settings.layout()?;
    Topology::new(layout.clone()).declare(conn).await?;
    Topology::new(layout.clone())
        .declare_destination(conn, src)
        .await?;
    let ch = broker::open(conn).await?;
    broker::declare_queue(&ch, out, broker::queue_type_args(layout.queue_type())).await?;
    broker::close(&ch, "ok").await;

    // the worker, as a child; it declares its hold marker before it consumes
    let bin = consumer_bin(args)?;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(["--queue", src, "--relay", out])
        .env("AMQP_URL", &settings.url)
        .env("AMQP_DELAY_PREFIX", &settings.prefix)
        .kill_on_drop(true)
        .stdout(std::process::Stdio::null());
    if let Some(config) = &args.global.config {
        cmd.arg("--config").arg(config);
    }
    let c = cmd
        .spawn()
        .map_err(|e| invalid(format!("{}: {e}", bin.display())))?;
    let pid = c.id().unwrap_or(0);
    *child = Some(c);
    note(&format!("delay-consumer runs as pid {pid}"));
    let give_up = now_ms() + 30_000;
    loop {
        let s = broker::queue_state(conn, src).await?;
        if s.is_some_and(|s| s.consumers > 0) {
            break;
        }
        if let Some(Ok(Some(st))) = child.as_mut().map(|c| c.try_wait()) {
            return Err(invalid(format!("delay-consumer exited: {st}")));
        }
        if now_ms() > give_up {
            return Err(invalid("delay-consumer did not consume in 30 s".into()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // the plain consumer of the relayed copies
    let got: Arc<Mutex<Vec<Got>>> = Arc::default();
    let (cch, mut consumer) = tool::consume_no_ack(conn, out, "burst").await?;
    let sink = got.clone();
    let consuming = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let at_ms = now_ms();
            let h = d.properties.headers().as_ref();
            let ms = |name: &str| match h.and_then(|h| h.inner().get(name)) {
                Some(AMQPValue::LongLongInt(t)) => u64::try_from(*t).unwrap_or(0),
                _ => 0,
            };
            let id = (d.properties.message_id().as_ref()).map_or(String::new(), |s| s.to_string());
            let g = Got {
                at_ms,
                due_ms: ms(amqp_delay::headers::DUE_AT),
                tick_ms: ms(amqp_delay::headers::RECURRING_TICK),
                id,
            };
            sink.lock().expect("sink").push(g);
        }
    });

    // each second's messages, scheduled `ahead` before their tick (a random ms of the second)
    let publisher = Arc::new(Publisher::connect(settings).await?);
    let n = args.per_second;
    let total = args.warmup + args.seconds;
    let offset = rand::random::<u64>() % 1000;
    let first_tick = (now_ms() / 1000 + 2 + args.ahead) * 1000 + offset;
    let from_ms = first_tick + args.warmup * 1000;
    let until_ms = first_tick + total * 1000;
    let mut cpu_from = None;
    let mut scheduling = Vec::new();
    for s in 0..total {
        let tick = first_tick + s * 1000;
        let at = tick - args.ahead * 1000;
        tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms()))).await;
        if cpu_from.is_none() && now_ms() + 1000 >= from_ms {
            cpu_from = Some((now_ms(), cpu(pid)));
        }
        let (p, src) = (publisher.clone(), src.to_string());
        scheduling.push(tokio::spawn(async move {
            // as `recurring serve` makes occurrences: one `now` for the lot
            let delay = tick.saturating_sub(now_ms());
            let msgs = (0..n)
                .map(|i| {
                    Message::new(src.as_str(), delay, b"{}".to_vec())
                        .occurrence(&format!("s{i}"), tick)
                })
                .collect::<Vec<_>>();
            p.schedule_batch(msgs)
                .await
                .into_iter()
                .filter(|r| r.is_err())
                .count()
        }));
        if let Some(Ok(Some(st))) = child.as_mut().map(|c| c.try_wait()) {
            return Err(invalid(format!("delay-consumer exited: {st}")));
        }
    }
    // the measured ticks' deliveries, and `ahead` more for the rest of the CPU window
    tokio::time::sleep(Duration::from_millis(
        (until_ms + 3000).saturating_sub(now_ms()),
    ))
    .await;
    let cpu_end = (now_ms(), cpu(pid));
    let mut failed = 0;
    for t in scheduling {
        failed += t.await.unwrap_or(n);
    }
    broker::close(&cch, "ok").await;
    consuming.abort();
    if let Ok(p) = Arc::try_unwrap(publisher) {
        p.close().await;
    }

    let got = std::mem::take(&mut *got.lock().expect("sink"));
    let (mut due, mut tick, mut spread) = (hist(), hist(), hist());
    let mut seen = HashSet::new();
    let (mut dup, mut early, mut in_window) = (0u64, 0u64, 0u64);
    for g in &got {
        if !seen.insert(g.id.as_str()) {
            dup += 1;
            continue;
        }
        if g.at_ms < g.due_ms {
            early += 1;
        }
        if (from_ms..until_ms).contains(&g.tick_ms) {
            in_window += 1;
            let _ = due.record(g.at_ms.saturating_sub(g.due_ms));
            let _ = tick.record(g.at_ms.saturating_sub(g.tick_ms));
            let _ = spread.record(g.due_ms.saturating_sub(g.tick_ms));
        }
    }
    let expected = n as u64 * args.seconds;
    let (t0, c0) = cpu_from.unwrap_or((from_ms, (0.0, HashMap::new())));
    let (t1, c1) = cpu_end;
    let busiest = (c1.1.iter())
        .map(|(tid, c)| c - c0.1.get(tid).copied().unwrap_or(0.0))
        .fold(0.0, f64::max);
    let wall = (t1 - t0) as f64 / 1000.0;
    // the messages of the ticks in the CPU window (scheduled a second apart)
    let members = n as f64 * wall;
    Ok(json!({
        "per_second": n,
        "seconds": args.seconds,
        "prefix": settings.prefix,
        "expected": expected,
        "delivered_in_window": in_window,
        "lost": expected.saturating_sub(in_window),
        "duplicated": dup,
        "early": early,
        "schedule_failures": failed,
        "lateness_ms": lat(&due),
        "after_tick_ms": lat(&tick),
        "due_after_tick_ms": lat(&spread),
        "worker_cpu": {
            "cores": (c1.0 - c0.0) / wall,
            "busiest_thread_cores": busiest / wall,
            "us_per_message": (c1.0 - c0.0) * 1e6 / members,
        },
    }))
}

/// CPU seconds of `pid` so far: the process's, and each thread's.
fn cpu(pid: u32) -> (f64, HashMap<String, f64>) {
    let of = |path: String| {
        let s = std::fs::read_to_string(path).unwrap_or_default();
        let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime: fields 14 and 15, 12 and 13 after the command
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / 100.0
    };
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| {
                    let tid = e.file_name().to_string_lossy().into_owned();
                    (tid, of(format!("{}/stat", e.path().display())))
                })
                .collect()
        })
        .unwrap_or_default();
    (of(format!("/proc/{pid}/stat")), threads)
}
