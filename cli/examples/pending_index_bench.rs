//! Measures the pending index (issue 47) at scale: fills it with synthetic journal entries as
//! a rebuild would, then times `show`, `list` pages (first, deep, random depths, filtered),
//! `count` and `expire`, and reports disk and peak RSS.
//!
//! ```sh
//! CARGO_TARGET_DIR=/work/target-index cargo run --release -p amqp-delay-cli \
//!     --example pending_index_bench -- --rows 10000000 --dir /tmp/pending-index-bench
//! # bodies kept: --rows 1000000 --body-bytes 1024
//! ```
//!
//! Flags: `--rows N` (10 000 000), `--body-bytes B` (0: no body), `--cache-mb M` (256),
//! `--batch N` (entries a transaction, 10 000), `--indexed-headers a,b` (all), `--dir D` (a
//! directory it creates and empties), `--keep` (leave the file), `--incremental` (fill with
//! every index maintained, as a follower applies live records, instead of a rebuild).
//!
//! The synthetic journal: 1 000 destinations with Zipf(1) weights (the first holds ~13 % of
//! the rows), each owned by one of 8 users; ids are UUIDv7 strings in scheduling order; due
//! times uniform over the 7 days after scheduling; three headers (`tenant`: 1 000 values,
//! `kind`: 20 values, `x-request-id`: unique); content type `application/json`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use amqp_delay_cli::pending_index::{
    Cursor, Destination, Entry, Filter, Options, Outcome, PendingIndex, Scheduled, Viewer,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DESTINATIONS: usize = 1_000;
const OWNERS: usize = 8;
const START_MS: u64 = 1_796_000_000_000;
const WEEK_MS: u64 = 7 * 24 * 3_600_000;

struct Args {
    rows: u64,
    body_bytes: usize,
    cache_mb: u64,
    batch: usize,
    indexed_headers: Option<Vec<String>>,
    dir: PathBuf,
    keep: bool,
    incremental: bool,
}

fn args() -> Args {
    let mut a = Args {
        rows: 10_000_000,
        body_bytes: 0,
        cache_mb: 256,
        batch: 10_000,
        indexed_headers: None,
        dir: std::env::temp_dir().join("pending-index-bench"),
        keep: false,
        incremental: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--rows" => a.rows = value().parse().expect("--rows N"),
            "--body-bytes" => a.body_bytes = value().parse().expect("--body-bytes B"),
            "--cache-mb" => a.cache_mb = value().parse().expect("--cache-mb M"),
            "--batch" => a.batch = value().parse().expect("--batch N"),
            "--indexed-headers" => {
                a.indexed_headers = Some(value().split(',').map(String::from).collect())
            }
            "--dir" => a.dir = PathBuf::from(value()),
            "--keep" => a.keep = true,
            "--incremental" => a.incremental = true,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn queue(d: usize) -> String {
    format!("orders.q{d:04}")
}

fn owner_of(d: usize) -> String {
    format!("app{}", d % OWNERS)
}

/// Zipf(1) over the destinations: cumulative weights, sampled by binary search.
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(n: usize) -> Zipf {
        let mut acc = 0.0;
        let mut c: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / k as f64;
                acc
            })
            .collect();
        for x in &mut c {
            *x /= acc;
        }
        Zipf(c)
    }

    fn sample(&self, rng: &mut StdRng) -> usize {
        let u: f64 = rng.random();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

fn status(key: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .map(|l| l[key.len()..].trim().to_string())
        .unwrap_or_else(|| "?".into())
}

/// Each file of `dir` and its size, for the report.
fn files(dir: &Path) -> String {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            format!(
                "{} {}",
                e.file_name().to_string_lossy(),
                e.metadata().unwrap().len()
            )
        })
        .collect();
    v.sort();
    v.join(", ")
}

fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn pct(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let at = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1e3;
    (at(0.5), at(0.99), v.last().unwrap().as_secs_f64() * 1e3)
}

fn report(what: &str, v: Vec<Duration>, extra: &str) {
    let n = v.len();
    let (p50, p99, max) = pct(v);
    println!("{what:<58} n={n:<6} p50 {p50:>8.3} ms  p99 {p99:>8.3} ms  max {max:>8.3} ms {extra}");
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

fn main() {
    let a = args();
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir).unwrap();
    let path = a.dir.join("index.db");
    println!(
        "rows {} · body {} B · cache {} MiB · batch {} · indexed headers {:?} · file {}",
        a.rows,
        a.body_bytes,
        a.cache_mb,
        a.batch,
        a.indexed_headers,
        path.display()
    );
    let mut ix = PendingIndex::open(
        &path,
        Options {
            cache_bytes: a.cache_mb << 20,
            durable: false,
            indexed_headers: a.indexed_headers.clone(),
        },
    )
    .unwrap();

    // ---- fill (a rebuild from the journal) ----
    let zipf = Zipf::new(DESTINATIONS);
    let mut rng = StdRng::seed_from_u64(47);
    let sample_every = (a.rows / 10_000).max(1);
    let mut samples: Vec<(String, String)> = Vec::new();
    let mut per_dest = vec![0u64; DESTINATIONS];
    let body = (a.body_bytes > 0).then(|| vec![b'x'; a.body_bytes]);
    let started = Instant::now();
    if !a.incremental {
        ix.begin_rebuild().unwrap();
    }
    let mut batch = Vec::with_capacity(a.batch);
    let mut last_report = Instant::now();
    for i in 0..a.rows {
        let d = zipf.sample(&mut rng);
        per_dest[d] += 1;
        let sched_ms = START_MS + i / 100; // 100 a millisecond: the journal of ~28 h at 10M
        let mut rand10 = [0u8; 10];
        rng.fill(&mut rand10);
        let id = uuid::Builder::from_unix_timestamp_millis(sched_ms, &rand10)
            .into_uuid()
            .hyphenated()
            .to_string();
        if i % sample_every == 0 {
            samples.push((owner_of(d), id.clone()));
        }
        batch.push(Entry::Scheduled(Scheduled {
            id,
            owner: owner_of(d),
            destination: Destination::Queue(queue(d)),
            due_at_ms: sched_ms + rng.random_range(1_000..WEEK_MS),
            scheduled_at_ms: sched_ms,
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
            body: body.clone(),
            confirmed: true,
        }));
        if batch.len() == a.batch || i + 1 == a.rows {
            ix.apply_at(&batch, i + 1).unwrap();
            batch.clear();
            if last_report.elapsed() > Duration::from_secs(30) {
                last_report = Instant::now();
                let s = started.elapsed().as_secs_f64();
                eprintln!(
                    "  {} rows in {s:.0} s ({:.0}/s), disk {} MB, VmRSS {}",
                    i + 1,
                    (i + 1) as f64 / s,
                    disk_bytes(&a.dir) >> 20,
                    status("VmRSS:")
                );
            }
        }
    }
    let applied = started.elapsed();
    let (_, finish_t) = timed(|| ix.finish_rebuild().unwrap());
    let fill = started.elapsed();
    println!(
        "apply: {:.1} s; finish_rebuild (sort the listing and header indexes): {:.1} s",
        applied.as_secs_f64(),
        finish_t.as_secs_f64()
    );
    println!(
        "fill: {} rows in {:.1} s = {:.0} rows/s; disk {} bytes ({:.2} GB); VmHWM {} VmRSS {}",
        a.rows,
        fill.as_secs_f64(),
        a.rows as f64 / fill.as_secs_f64(),
        disk_bytes(&a.dir),
        disk_bytes(&a.dir) as f64 / 1e9,
        status("VmHWM:"),
        status("VmRSS:")
    );
    println!("files: {}", files(&a.dir));
    assert_eq!(ix.position().unwrap(), Some(a.rows));

    // ---- show ----
    let mut times = Vec::new();
    for _ in 0..10_000 {
        let (owner, id) = &samples[rng.random_range(0..samples.len())];
        let viewer = if rng.random_bool(0.5) {
            Viewer::Admin
        } else {
            Viewer::User(owner.clone())
        };
        let (r, t) = timed(|| ix.show(id, &viewer).unwrap());
        assert_eq!(r.len(), 1);
        times.push(t);
    }
    report("show ID (random, user or admin)", times, "");

    // ---- list: the largest queue ----
    let top = (0..DESTINATIONS).max_by_key(|d| per_dest[*d]).unwrap();
    let mut f = Filter::new(Viewer::Admin);
    f.destination = Some(Destination::Queue(queue(top)));
    f.limit = 100;
    println!("largest queue: {} with {} rows", queue(top), per_dest[top]);
    let mut times = Vec::new();
    for _ in 0..200 {
        let (p, t) = timed(|| ix.list(&f).unwrap());
        assert_eq!(p.rows.len(), 100);
        times.push(t);
    }
    report("list --queue Q --limit 100, first page (admin)", times, "");
    let mut fu = f.clone();
    fu.viewer = Viewer::User(owner_of(top));
    let mut times = Vec::new();
    for _ in 0..200 {
        times.push(timed(|| ix.list(&fu).unwrap()).1);
    }
    report("list --queue Q --limit 100, first page (owner)", times, "");

    // walk the queue 10 000 rows a page, keeping a cursor every page
    let mut walk = f.clone();
    walk.limit = 10_000;
    let mut cursors: Vec<Cursor> = Vec::new();
    let mut walked = 0u64;
    let (_, t) = timed(|| {
        loop {
            let p = ix.list(&walk).unwrap();
            walked += p.rows.len() as u64;
            match p.next {
                Some(c) => {
                    cursors.push(c);
                    walk.after = Some(c);
                }
                None => break,
            }
        }
    });
    println!(
        "walk of Q, 10 000 a page: {walked} rows in {:.2} s ({:.0} rows/s)",
        t.as_secs_f64(),
        walked as f64 / t.as_secs_f64()
    );
    assert_eq!(walked, per_dest[top]);
    if cursors.len() >= 100 {
        let mut deep = f.clone();
        deep.after = Some(cursors[99]); // after the 1 000 000-th row
        let mut times = Vec::new();
        for _ in 0..200 {
            let (p, t) = timed(|| ix.list(&deep).unwrap());
            assert_eq!(p.rows.len(), 100);
            times.push(t);
        }
        report(
            "list --queue Q --limit 100, after the 1 000 000-th row",
            times,
            "",
        );
    }
    let mut times = Vec::new();
    for _ in 0..1_000 {
        let mut any = f.clone();
        any.after = Some(cursors[rng.random_range(0..cursors.len())]);
        times.push(timed(|| ix.list(&any).unwrap()).1);
    }
    report("list --queue Q --limit 100, random depths", times, "");

    // ---- filtered pages ----
    let mut times = Vec::new();
    let mut found = 0;
    for _ in 0..200 {
        let mut fh = f.clone();
        fh.header = Some((
            "tenant".into(),
            format!("t{}", rng.random_range(0..1_000u32)),
        ));
        let (p, t) = timed(|| ix.list(&fh).unwrap());
        found += p.rows.len();
        times.push(t);
    }
    report(
        "list --queue Q --header tenant=T --limit 100, first page",
        times,
        &format!("(avg {} rows)", found / 200),
    );
    let mut times = Vec::new();
    let mut found = 0;
    for _ in 0..200 {
        let mut fh = f.clone();
        fh.header = Some((
            "tenant".into(),
            format!("t{}", rng.random_range(0..1_000u32)),
        ));
        fh.after = Some(cursors[rng.random_range(0..cursors.len())]);
        let (p, t) = timed(|| ix.list(&fh).unwrap());
        found += p.rows.len();
        times.push(t);
    }
    report(
        "list --queue Q --header tenant=T --limit 100, random depths",
        times,
        &format!("(avg {} rows)", found / 200),
    );
    let mut times = Vec::new();
    for _ in 0..200 {
        let mut fh = Filter::new(Viewer::Admin);
        fh.header = Some(("kind".into(), format!("k{}", rng.random_range(0..20u32))));
        times.push(timed(|| ix.list(&fh).unwrap()).1);
    }
    report("list --header kind=K --limit 100 (all queues)", times, "");
    let mut times = Vec::new();
    for _ in 0..200 {
        let fa = Filter::new(Viewer::Admin);
        times.push(timed(|| ix.list(&fa).unwrap()).1);
    }
    report("list --limit 100 (admin, all queues)", times, "");
    let mut times = Vec::new();
    for _ in 0..200 {
        let mut fw = f.clone();
        let from = START_MS + rng.random_range(0..WEEK_MS);
        fw.due_after = Some(from);
        fw.due_before = Some(from + 3_600_000);
        times.push(timed(|| ix.list(&fw).unwrap()).1);
    }
    report(
        "list --queue Q --due-after T --due-before T+1h --limit 100",
        times,
        "",
    );

    // ---- count ----
    for (what, filter) in [
        ("count --queue Q (admin)", f.clone()),
        ("count --queue Q (owner)", fu.clone()),
        ("count --queue Q --header tenant=t7", {
            let mut x = f.clone();
            x.header = Some(("tenant".into(), "t7".into()));
            x
        }),
        ("count (admin, everything)", Filter::new(Viewer::Admin)),
    ] {
        let mut times = Vec::new();
        let mut n = 0;
        for _ in 0..5 {
            let (c, t) = timed(|| ix.count(&filter).unwrap());
            n = c;
            times.push(t);
        }
        report(what, times, &format!("= {n}"));
    }
    println!(
        "after queries: VmHWM {} VmRSS {}",
        status("VmHWM:"),
        status("VmRSS:")
    );

    // ---- live inserts, every index maintained ----
    let live = 100_000u64;
    let (_, t) = timed(|| {
        let mut batch = Vec::with_capacity(1_000);
        for i in 0..live {
            let d = zipf.sample(&mut rng);
            batch.push(Entry::Scheduled(Scheduled {
                id: format!("live-{i}"),
                owner: owner_of(d),
                destination: Destination::Queue(queue(d)),
                due_at_ms: START_MS + rng.random_range(1_000..WEEK_MS),
                scheduled_at_ms: START_MS + a.rows / 100 + i / 10,
                size: 500,
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
                body: body.clone(),
                confirmed: true,
            }));
            if batch.len() == 1_000 {
                ix.apply(&batch).unwrap();
                batch.clear();
            }
        }
    });
    println!(
        "live inserts: {live} rows in batches of 1 000 in {:.1} s = {:.0} rows/s",
        t.as_secs_f64(),
        live as f64 / t.as_secs_f64()
    );

    // ---- finish 10 % and expire them ----
    let finish = a.rows / 10;
    let mut rng2 = StdRng::seed_from_u64(47);
    let mut done = Vec::with_capacity(a.batch);
    let (_, t) = timed(|| {
        for i in 0..a.rows {
            // replay the generator to know each row's owner and id
            let d = zipf.sample(&mut rng2);
            let sched_ms = START_MS + i / 100;
            let mut rand10 = [0u8; 10];
            rng2.fill(&mut rand10);
            let _: u64 = rng2.random_range(1_000..WEEK_MS);
            let _: u64 = rng2.random_range(200..2_000);
            let _: u32 = rng2.random_range(0..1_000u32);
            let _: u32 = rng2.random_range(0..20u32);
            let _: u64 = rng2.random();
            if i >= finish {
                break;
            }
            let id = uuid::Builder::from_unix_timestamp_millis(sched_ms, &rand10)
                .into_uuid()
                .hyphenated()
                .to_string();
            done.push(Entry::Ran {
                owner: owner_of(d),
                id,
                at_ms: sched_ms + 1,
                lateness_ms: 1,
                outcome: Outcome::Done,
            });
            if done.len() == a.batch {
                ix.apply(&done).unwrap();
                done.clear();
            }
        }
        ix.apply(&done).unwrap();
    });
    println!(
        "ran (done) {finish} rows in {:.1} s = {:.0} rows/s",
        t.as_secs_f64(),
        finish as f64 / t.as_secs_f64()
    );
    let before = ix.count(&Filter::new(Viewer::Admin)).unwrap();
    assert_eq!(before, a.rows + live - finish, "every Ran found its row");
    let (n, t) = timed(|| ix.expire(3_600_000, START_MS + WEEK_MS).unwrap());
    println!(
        "expire: {n} records in {:.1} s = {:.0} rows/s",
        t.as_secs_f64(),
        n as f64 / t.as_secs_f64()
    );
    assert_eq!(n, finish);
    println!(
        "end: disk {} bytes ({}); VmHWM {} VmRSS {}",
        disk_bytes(&a.dir),
        files(&a.dir),
        status("VmHWM:"),
        status("VmRSS:")
    );
    drop(ix);
    if !a.keep {
        let _ = std::fs::remove_dir_all(&a.dir);
    }
}
