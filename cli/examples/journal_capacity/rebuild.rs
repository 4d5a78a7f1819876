//! The rebuild of the pending index from the journal, as `pending serve` does it, timed; then
//! `show` and list pages on the result.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::Settings;
use amqp_delay_cli::pending::follow::{self, FollowOptions, Status};
use amqp_delay_cli::pending_index::{Destination, Filter, Options, PendingIndex, Viewer};

/// Rebuilds `file` (removed first) from `settings`' journal and reports time, peak memory,
/// the file's size and query times (`queue` is the destination the pages list).
pub(crate) async fn run(settings: &Settings, file: &Path, queue: &str) {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
    }
    let ix = PendingIndex::open(file, Options::default()).expect("the index file");
    let index = Arc::new(Mutex::new(ix));
    let status = Status::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let follower = tokio::spawn(follow::run(
        settings.clone(),
        index.clone(),
        status.clone(),
        FollowOptions::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let started = Instant::now();
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let lag = status.lag();
        if !lag.is_behind() && lag.journal_end.is_some() {
            break;
        }
        if last.elapsed() > Duration::from_secs(15) {
            last = Instant::now();
            println!("  {:?}: {lag:?}", started.elapsed());
        }
    }
    let took = started.elapsed();
    let _ = stop.send(());
    let _ = follower.await;
    println!(
        "rebuilt from the journal in {took:?}; peak RSS {}",
        peak_rss()
    );
    let bytes: u64 = ["", "-wal"]
        .iter()
        .filter_map(|s| std::fs::metadata(format!("{}{s}", file.display())).ok())
        .map(|m| m.len())
        .sum();
    println!("index file: {:.1} MB", bytes as f64 / 1e6);
    queries(&index, queue);
}

/// `show` of ids from the first page and list pages of `queue`, timed.
fn queries(index: &Arc<Mutex<PendingIndex>>, queue: &str) {
    let mut ix = index.lock().unwrap();
    let mut filter = Filter::new(Viewer::Admin);
    filter.destination = Some(Destination::Queue(queue.to_string()));
    let mut pages = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let page = ix.list(&filter).expect("a page");
        pages.push(t.elapsed());
        ids.extend(page.rows.iter().map(|r| r.id.clone()));
        match page.next {
            Some(c) => filter.after = Some(c),
            None => break,
        }
    }
    let mut shows = Vec::new();
    for id in ids.iter().step_by(50) {
        let t = Instant::now();
        let found = ix.show(id, &Viewer::Admin).expect("show");
        shows.push(t.elapsed());
        assert!(!found.is_empty(), "{id} shown");
    }
    pages.sort();
    shows.sort();
    println!(
        "list --queue {queue} --limit 100: {} pages, max {:?}; show: {} ids, max {:?}",
        pages.len(),
        pages.last().copied().unwrap_or_default(),
        shows.len(),
        shows.last().copied().unwrap_or_default()
    );
}

/// The process's peak resident memory, from /proc.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM"))
                .map(str::to_string)
        })
        .unwrap_or_else(|| "unknown".into())
}
