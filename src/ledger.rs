//! The ledger stream's broker side: declaring it, and reading it into a count of the messages
//! (not broker messages) waiting in the tiers. What it holds and how it is summed is in
//! `tally`; publishers write it (`publisher`); it is written and read through
//! [`crate::stream_log`], a snapshot being its compaction.

use std::sync::Arc;

use lapin::Connection;
use lapin::types::AMQPValue;

use crate::error::Result;
use crate::layout::Layout;
use crate::settings::TrustSettings;
use crate::stream_log::{Compaction, LogRecord, Read, Reader, StreamLog, skipped};
use crate::tally::{
    Bounds, DUE_SLACK_MS, Dues, Entry, Pending, READ_WINDOW_MS, Reckoned, Reckoning,
    SNAPSHOT_EVERY_MS,
};
use crate::time::now_ms;
use crate::trust::Trust;

impl LogRecord for Entry {
    fn barrier(nonce: String) -> Self {
        Entry::Barrier { nonce }
    }

    fn barrier_nonce(&self) -> Option<&str> {
        match self {
            Entry::Barrier { nonce } => Some(nonce),
            _ => None,
        }
    }
}

/// A read of the ledger: the [`Reckoning`] of the records whose writers may write them. It is
/// whole from the newest snapshot whose later records it read all, or from the stream's first
/// record.
struct Reading {
    reckoning: Reckoning,
    trust: Trust,
}

impl Compaction for Reading {
    type Record = Entry;

    fn record(&mut self, read: Read<Entry>) {
        // a record of a newer version, or garbage someone published, is skipped
        let (Some(offset), Some(entry)) = (read.offset, read.record) else {
            return;
        };
        if let Some(why) = untrusted(&entry, read.by.as_deref(), &self.trust) {
            skipped(KIND, "untrusted", &format!("{why}, at offset {offset}"));
        } else if let Err(why) = self.reckoning.read(offset, entry) {
            skipped(KIND, why, &format!("the record at offset {offset}"));
        }
    }

    fn whole(&self) -> bool {
        self.reckoning.complete()
    }

    fn restart(&mut self) {
        self.reckoning = Reckoning::new(self.reckoning.bounds());
    }
}

/// Why `by` may not write `entry`, if it may not: a count needs a writer (a publisher's
/// `user_id`), a snapshot, which stands for everything before it, one the reader trusts
/// ([`Trust::may_compact`]).
fn untrusted(entry: &Entry, by: Option<&str>, trust: &Trust) -> Option<String> {
    match entry {
        Entry::Scheduled { .. } if by.is_none_or(str::is_empty) => {
            Some("a count without user_id".into())
        }
        Entry::Snapshot { .. } if !trust.may_compact(by) => Some(format!(
            "a snapshot by '{}', no admin or peer",
            by.unwrap_or("no user_id")
        )),
        _ => None,
    }
}

/// What the ledger stream is called in errors and metrics.
const KIND: &str = "ledger stream";

/// How far ahead a count of `layout`'s can fall due: its longest delay plus [`DUE_SLACK_MS`].
fn ahead_ms(layout: &Layout) -> u64 {
    layout.max_delay_ms().saturating_add(DUE_SLACK_MS)
}

/// `layout`'s ledger stream: its records at most [`crate::tally::max_record_bytes`] long.
pub(crate) fn log(layout: &Layout) -> StreamLog<Entry> {
    let max_bytes = crate::tally::max_record_bytes(ahead_ms(layout));
    StreamLog::new(KIND, layout.ledger_stream(), layout, max_bytes)
}

/// Declares the ledger stream (idempotent), kept as long as the control stream: the longest
/// delay plus a week, so summing it from its start is always right.
pub(crate) async fn declare(conn: &Connection, layout: &Layout) -> Result<()> {
    log(layout)
        .declare(conn, layout.control_max_age_secs())
        .await
}

/// What [`count`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Counted {
    /// Messages not yet due.
    #[serde(flatten)]
    pub pending: Pending,
    /// When the snapshot it started from was taken (`None`: it read the whole ledger).
    pub snapshot_at_ms: Option<u64>,
    /// Records it read.
    pub records: u64,
    /// Whether it left a snapshot for the next reader.
    pub wrote_snapshot: bool,
}

/// Counts the messages publishers put into the tiers that are not yet due. `None` when the
/// topology has no ledger stream (deleted since `declare`, which adds it back).
///
/// Reads the last [`READ_WINDOW_MS`] from the newest snapshot in it that `trust` (with the
/// connection's own user) lets count, or the whole stream when there is none; leaves a
/// snapshot when the newest is older than [`SNAPSHOT_EVERY_MS`].
pub async fn count(
    conn: &Connection,
    layout: &Layout,
    trust: &TrustSettings,
) -> Result<Option<Counted>> {
    let log = log(layout);
    let trust = Trust::new(crate::connection::user_of(conn), trust);
    let Some((reckoned, barrier, reader)) = reckon(conn, &log, ahead_ms(layout), trust).await?
    else {
        return Ok(None);
    };
    reader.end("counted").await;
    Ok(Some(conclude(conn, &log, &reckoned, barrier).await))
}

/// Reads the ledger up to a barrier of its own, from the newest snapshot in the last
/// [`READ_WINDOW_MS`] (or from its start): the sum, the barrier's offset, and the reader
/// (positioned after the barrier). `None` without a ledger stream.
async fn reckon(
    conn: &Connection,
    log: &StreamLog<Entry>,
    ahead_ms: u64,
    trust: Trust,
) -> Result<Option<(Reckoned, Option<u64>, Reader<Entry>)>> {
    if !log.exists(conn).await? {
        return Ok(None);
    }
    let nonce = log.barrier(conn).await?;
    let started = std::time::Instant::now();
    let since_s = now_ms().saturating_sub(READ_WINDOW_MS) / 1000;
    let mut reading = Reading {
        reckoning: Reckoning::new(Bounds::new(now_ms(), ahead_ms)),
        trust,
    };
    let window = [AMQPValue::Timestamp(since_s)];
    let (reader, barrier) = log
        .start_from_compaction(conn, &nonce, window, &mut reading)
        .await?;
    let reckoned = reading.reckoning.finish_whole();
    tracing::debug!(stream = %log.name(), records = reckoned.records, elapsed = ?started.elapsed(), "ledger read");
    Ok(Some((reckoned, barrier, reader)))
}

/// What a read found, leaving a snapshot (covering up to its `barrier`) when the newest is
/// older than [`SNAPSHOT_EVERY_MS`].
async fn conclude(
    conn: &Connection,
    log: &StreamLog<Entry>,
    reckoned: &Reckoned,
    barrier: Option<u64>,
) -> Counted {
    let now = now_ms();
    let stale = reckoned
        .snapshot_at_ms
        .is_none_or(|at| now.saturating_sub(at) >= SNAPSHOT_EVERY_MS);
    let mut wrote_snapshot = false;
    if let (true, Some(covers)) = (stale, barrier) {
        let snapshot = Entry::Snapshot {
            covers,
            at_ms: now,
            dues: reckoned.dues.compact(now),
        };
        match log.append(conn, &snapshot).await {
            Ok(()) => wrote_snapshot = true,
            // the count stands; the next reader reads further back
            Err(e) => {
                tracing::warn!(stream = %log.name(), "could not leave a snapshot: {}", crate::error::chain(&e))
            }
        }
    }
    Counted {
        pending: reckoned.dues.pending(now),
        snapshot_at_ms: reckoned.snapshot_at_ms,
        records: reckoned.records,
        wrote_snapshot,
    }
}

/// A count kept current: [`count`] once, then every record appended after it, read as it
/// comes (for the `amqp_delay_messages_pending` gauge).
pub struct Following {
    dues: Arc<std::sync::Mutex<Dues>>,
    task: tokio::task::JoinHandle<()>,
    /// Dropped with it: the task then ends its consumer and channel (`broker::end_consumer`).
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Following {
    /// Messages not yet due at `now_ms` (what is due is dropped from the sum).
    pub fn pending(&self, now_ms: u64) -> Pending {
        let mut d = self.dues.lock().unwrap_or_else(|p| p.into_inner());
        let mut kept = Dues::default();
        kept.merge(&d.compact(now_ms));
        *d = kept;
        d.pending(now_ms)
    }

    /// Whether it still reads the stream (a lost connection or a deleted stream ends it).
    pub fn is_following(&self) -> bool {
        !self.task.is_finished()
    }
}

/// Counts the ledger (as [`count`]) and keeps following it on a channel of `conn`. `None`
/// when the topology has no ledger stream.
pub async fn follow(
    conn: Arc<Connection>,
    layout: &Layout,
    trust: &TrustSettings,
) -> Result<Option<Following>> {
    let log = log(layout);
    let ahead = ahead_ms(layout);
    let trust = Trust::new(crate::connection::user_of(&conn), trust);
    let Some((reckoned, barrier, mut reader)) = reckon(&conn, &log, ahead, trust).await? else {
        return Ok(None);
    };
    // the reader goes on after the barrier, its snapshot included (which it skips)
    conclude(&conn, &log, &reckoned, barrier).await;
    let dues = Arc::new(std::sync::Mutex::new(reckoned.dues));
    let sum = dues.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let follow = async {
            while let Some(Ok(read)) = reader.next().await {
                // a record of a newer version, or garbage someone published, is skipped; a
                // snapshot sums what was already counted; a count needs its writer
                if let Some(record) = read.record
                    && read.by.as_deref().is_some_and(|by| !by.is_empty())
                {
                    follow_one(&sum, record, Bounds::new(now_ms(), ahead));
                }
            }
        };
        tokio::select! {
            _ = follow => {}
            _ = stopped => {}
        }
        reader.end("followed").await;
    });
    Ok(Some(Following {
        dues,
        task,
        _stop: stop,
    }))
}

/// A record read by a follower into its sum, within `bounds` (the sum compacted when it grows
/// past them: bounded whatever is appended).
fn follow_one(sum: &std::sync::Mutex<Dues>, record: Entry, bounds: Bounds) {
    match bounds.check(record) {
        Ok(Entry::Scheduled { dues: pairs }) => {
            let mut sum = sum.lock().unwrap_or_else(|p| p.into_inner());
            sum.merge(&pairs);
            sum.bound(&bounds);
        }
        Ok(_) => {}
        Err(why) => skipped(KIND, why, &"a record followed"),
    }
}

/// What a publisher has put into the tiers since it last wrote to the ledger.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    dues: std::sync::Mutex<Dues>,
}

impl Recorder {
    /// Counts `n` messages in one broker message leaving the tiers at `due_ms`.
    pub(crate) fn add(&self, due_ms: u64, n: u64) {
        self.lock().add(due_ms, n);
    }

    /// What to write (compacted as a snapshot is, from now), emptying it; `None` when empty.
    pub(crate) fn take(&self) -> Option<Entry> {
        let mut d = self.lock();
        if d.is_empty() {
            return None;
        }
        let dues = d.compact(now_ms());
        *d = Dues::default();
        (!dues.is_empty()).then_some(Entry::Scheduled { dues })
    }

    /// Puts back what could not be written.
    pub(crate) fn put_back(&self, entry: Entry) {
        if let Entry::Scheduled { dues } = entry {
            self.lock().merge(&dues);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dues> {
        self.dues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_follower_clamps_far_counts_and_stays_bounded_whatever_is_appended() {
        let now = 1_000_000_000_000;
        let bounds = Bounds::new(now, 3_600_000);
        let sum = std::sync::Mutex::new(Dues::default());
        // a count due in 2^63 s is due within the bounds instead
        follow_one(
            &sum,
            Entry::Scheduled {
                dues: vec![(u64::MAX / 2, 5)],
            },
            bounds,
        );
        assert_eq!(sum.lock().unwrap().pending(now).total, 5);
        assert_eq!(sum.lock().unwrap().pending(now + 3_601_000).total, 0);
        // a record with more pairs than ours is skipped
        let many = (0..bounds.max_pairs as u64 + 1).map(|i| (i, 1)).collect();
        follow_one(&sum, Entry::Scheduled { dues: many }, bounds);
        assert_eq!(sum.lock().unwrap().pending(now).total, 5);
        // records of due seconds anywhere: the sum never holds much more than a record may
        for k in 0..50u64 {
            let dues = (0..bounds.max_pairs as u64)
                .map(|i| (k * 10_000 + i, 1))
                .collect();
            follow_one(&sum, Entry::Scheduled { dues }, bounds);
            assert!(sum.lock().unwrap().len() <= 3 * bounds.max_pairs);
        }
    }

    #[test]
    fn the_largest_record_of_ours_fits_the_bound() {
        let layout = Layout::new("p", &Default::default()).unwrap();
        let ahead = ahead_ms(&layout);
        let pairs = vec![(u64::MAX, u64::MAX); crate::tally::max_pairs(ahead)];
        let snapshot = Entry::Snapshot {
            covers: u64::MAX,
            at_ms: u64::MAX,
            dues: pairs,
        };
        let body = log(&layout).encode(&snapshot);
        assert!(
            body.len() <= log(&layout).max_record_bytes(),
            "{}",
            body.len()
        );
    }
}
