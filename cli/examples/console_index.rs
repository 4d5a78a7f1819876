//! Fills a pending index for measuring `delay-console` at scale (issue 48): like
//! `pending_index_bench`'s synthetic journal (1 000 queues with Zipf(1) weights, 8 owners,
//! UUIDv7 ids, three headers), but with times relative to now so that every due-time bucket
//! and the lateness figures have something: due times spread over the next 10 days, 1 % of
//! the rows ran in the last half hour (done, 0-2 s late), 0.1 % parked. Filled as a rebuild.
//!
//! ```sh
//! cargo build --release -p amqp-delay-cli --example console_index --bin delay-console
//! target/release/examples/console_index --rows 10000000 --path /work/scratch/console-10m.db
//! ```
//!
//! Then serve it (`delay-console --index PATH`) and time pages with curl; the owners are
//! `app0` to `app7`, and the first queue `orders.q0000` is the largest.

use std::path::PathBuf;
use std::time::Instant;

use amqp_delay_cli::pending_index::{
    Destination, Entry, Options, Outcome, PendingIndex, Scheduled,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DESTINATIONS: usize = 1_000;
const OWNERS: usize = 8;
const SPREAD_MS: u64 = 10 * 24 * 3_600_000;

/// Cumulative Zipf(1) weights over the destinations.
fn zipf() -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=DESTINATIONS)
        .map(|k| {
            acc += 1.0 / k as f64;
            acc
        })
        .collect();
    for x in &mut cdf {
        *x /= acc;
    }
    cdf
}

/// The entries of row `i` of `rows`: its schedule and, for 1.1 % of them, its run.
fn entries(rng: &mut StdRng, cdf: &[f64], now: u64, i: u64, rows: u64, out: &mut Vec<Entry>) {
    let u: f64 = rng.random();
    let d = cdf.partition_point(|&c| c < u).min(DESTINATIONS - 1);
    let owner = format!("app{}", d % OWNERS);
    let sched = now - 3_600_000 + i * 3_600_000 / rows;
    let mut r10 = [0u8; 10];
    rng.fill(&mut r10);
    let id = uuid::Builder::from_unix_timestamp_millis(sched, &r10)
        .into_uuid()
        .hyphenated()
        .to_string();
    let fate = rng.random_range(0..1000u32);
    let due = if fate < 10 {
        now - rng.random_range(1_000..1_800_000)
    } else {
        now + rng.random_range(1_000..SPREAD_MS)
    };
    out.push(Entry::Scheduled(Scheduled {
        id: id.clone(),
        owner: owner.clone(),
        destination: Destination::Queue(format!("orders.q{d:04}")),
        due_at_ms: due,
        scheduled_at_ms: sched,
        size: rng.random_range(200..2_000),
        content_type: Some("application/json".into()),
        headers: vec![
            (
                "tenant".into(),
                format!("t{}", rng.random_range(0..1_000u32)),
            ),
            ("kind".into(), format!("k{}", rng.random_range(0..20u32))),
            (
                "x-request-id".into(),
                format!("{:016x}", rng.random::<u64>()),
            ),
        ],
        body: None,
        confirmed: true,
    }));
    if fate < 11 {
        let late = rng.random_range(0..2_000);
        out.push(Entry::Ran {
            owner,
            id,
            at_ms: due.max(sched) + late,
            lateness_ms: late,
            outcome: if fate < 10 {
                Outcome::Done
            } else {
                Outcome::Parked
            },
        });
    }
}

fn main() {
    let mut rows = 10_000_000u64;
    let mut path = PathBuf::from("/tmp/console-index.db");
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--rows" => rows = value.parse().expect("--rows N"),
            "--path" => path = PathBuf::from(value),
            other => panic!("unknown flag {other}"),
        }
    }
    let _ = std::fs::remove_file(&path);
    let mut ix = PendingIndex::open(
        &path,
        Options {
            cache_bytes: 256 << 20,
            durable: false,
            indexed_headers: None,
        },
    )
    .unwrap();
    let cdf = zipf();
    let mut rng = StdRng::seed_from_u64(48);
    let now = amqp_delay::time::now_ms();
    let started = Instant::now();
    ix.begin_rebuild().unwrap();
    let mut batch = Vec::with_capacity(10_000);
    for i in 0..rows {
        entries(&mut rng, &cdf, now, i, rows, &mut batch);
        if batch.len() >= 10_000 || i + 1 == rows {
            ix.apply_at(&batch, i + 1).unwrap();
            batch.clear();
        }
    }
    let applied = started.elapsed();
    ix.finish_rebuild().unwrap();
    println!(
        "{rows} rows in {:.1} s (applying {:.1} s, sorting the indexes {:.1} s): {}",
        started.elapsed().as_secs_f64(),
        applied.as_secs_f64(),
        (started.elapsed() - applied).as_secs_f64(),
        path.display()
    );
}
