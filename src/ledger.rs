//! The ledger stream's broker side: declaring it, and reading it into a count of the messages
//! (not broker messages) waiting in the tiers. What it holds and how it is summed is in
//! `tally`; publishers write it (`publisher`).

use std::sync::Arc;

use lapin::Connection;
use lapin::types::AMQPValue;

use crate::broker;
use crate::control::{self, BARRIER_MAX};
use crate::error::Result;
use crate::layout::Layout;
use crate::tally::{Dues, Entry, Pending, READ_WINDOW_MS, Reckoning, SNAPSHOT_EVERY_MS};
use crate::time::now_ms;

/// Declares the ledger stream (idempotent), kept as long as the control stream: the longest
/// delay plus a week, so summing it from its start is always right.
pub async fn declare(conn: &Connection, layout: &Layout) -> Result<()> {
    let ch = broker::open(conn).await?;
    let args = control::stream_args(layout.control_max_age_secs());
    broker::declare_queue(&ch, &layout.ledger_stream(), args).await?;
    broker::close(&ch, "declared").await;
    Ok(())
}

/// Appends `entry` with a confirm.
pub async fn append(conn: &Connection, layout: &Layout, entry: &Entry) -> Result<()> {
    control::append_to(conn, layout, &layout.ledger_stream(), &entry.encode()).await
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
/// topology has no ledger stream (declared by a version before it: `declare` adds it).
///
/// Reads the last [`READ_WINDOW_MS`] from the newest snapshot in it, or the whole stream when
/// there is none; leaves a snapshot when the newest is older than [`SNAPSHOT_EVERY_MS`].
pub async fn count(conn: &Connection, layout: &Layout) -> Result<Option<Counted>> {
    Ok(reckon(conn, layout).await?.map(|(c, ..)| c))
}

/// [`count`], with the sum itself and the offset of the barrier it read up to.
async fn reckon(
    conn: &Connection,
    layout: &Layout,
) -> Result<Option<(Counted, Dues, Option<u64>)>> {
    let stream = layout.ledger_stream();
    if broker::queue_state(conn, &stream).await?.is_none() {
        return Ok(None);
    }
    let nonce = uuid::Uuid::now_v7().to_string();
    append(
        conn,
        layout,
        &Entry::Barrier {
            nonce: nonce.clone(),
        },
    )
    .await?;
    let started = std::time::Instant::now();
    let since_s = now_ms().saturating_sub(READ_WINDOW_MS) / 1000;
    let (reckoning, barrier) = read(conn, &stream, AMQPValue::Timestamp(since_s), &nonce).await?;
    let whole = reckoning.began_at_zero();
    let (reckoned, barrier) = match reckoning.finish(whole) {
        Some(r) => (r, barrier),
        None => {
            tracing::debug!(%stream, "no snapshot in the last hour: reading the whole ledger");
            let (all, barrier) = read(conn, &stream, broker::long_string("first"), &nonce).await?;
            (all.finish_whole(), barrier)
        }
    };
    tracing::debug!(%stream, records = reckoned.records, elapsed = ?started.elapsed(), "ledger read");
    let now = now_ms();
    let pending = reckoned.dues.pending(now);
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
        match append(conn, layout, &snapshot).await {
            Ok(()) => wrote_snapshot = true,
            // the count stands; the next reader reads further back
            Err(e) => {
                tracing::warn!(%stream, "could not leave a snapshot: {}", crate::error::chain(&e))
            }
        }
    }
    let counted = Counted {
        pending,
        snapshot_at_ms: reckoned.snapshot_at_ms,
        records: reckoned.records,
        wrote_snapshot,
    };
    Ok(Some((counted, reckoned.dues, barrier)))
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
pub async fn follow(conn: Arc<Connection>, layout: &Layout) -> Result<Option<Following>> {
    let Some((_, dues, barrier)) = reckon(&conn, layout).await? else {
        return Ok(None);
    };
    let stream = layout.ledger_stream();
    let from = match barrier {
        Some(b) => AMQPValue::LongLongInt(i64::try_from(b.saturating_add(1)).unwrap_or(i64::MAX)),
        None => broker::long_string("next"),
    };
    let (ch, mut consumer) = control::open_reader(&conn, &stream, from).await?;
    let dues = Arc::new(std::sync::Mutex::new(dues));
    let sum = dues.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let follow = async {
            let mut credit = control::Credit::default();
            while let Some(Ok(d)) = credit.next(&mut consumer).await {
                // a record of a newer version, or garbage someone published, is skipped; a
                // snapshot sums what was already counted
                if let Some(Entry::Scheduled { dues: pairs }) = Entry::decode(&d.data) {
                    sum.lock().unwrap_or_else(|p| p.into_inner()).merge(&pairs);
                }
                credit.read(d.acker).await;
            }
        };
        tokio::select! {
            _ = follow => {}
            _ = stopped => {}
        }
        broker::end_consumer(&ch, &consumer, "followed").await;
    });
    Ok(Some(Following {
        dues,
        task,
        _stop: stop,
    }))
}

/// Reads `stream` from `offset` up to the barrier `nonce`.
async fn read(
    conn: &Connection,
    stream: &str,
    offset: AMQPValue,
    nonce: &str,
) -> Result<(Reckoning, Option<u64>)> {
    let mut reckoning = Reckoning::default();
    // a barrier is a few dozen bytes: larger records are not parsed twice
    let is_barrier = |body: &[u8]| {
        body.len() < BARRIER_MAX
            && matches!(Entry::decode(body), Some(Entry::Barrier { nonce: n }) if n == nonce)
    };
    let barrier = control::read_to_barrier(conn, stream, offset, is_barrier, |offset, body| {
        // a record of a newer version, or garbage someone published, is skipped
        if let (Some(offset), Some(entry)) = (offset, Entry::decode(body)) {
            reckoning.read(offset, entry);
        }
    })
    .await?;
    Ok((reckoning, barrier))
}

/// What a publisher has put into the tiers since it last wrote to the ledger.
#[derive(Debug, Default)]
pub struct Recorder {
    dues: std::sync::Mutex<Dues>,
}

impl Recorder {
    /// Counts `n` messages in one broker message leaving the tiers at `due_ms`.
    pub fn add(&self, due_ms: u64, n: u64) {
        self.lock().add(due_ms, n);
    }

    /// What to write (compacted as a snapshot is, from now), emptying it; `None` when empty.
    pub fn take(&self) -> Option<Entry> {
        let mut d = self.lock();
        if d.is_empty() {
            return None;
        }
        let dues = d.compact(now_ms());
        *d = Dues::default();
        (!dues.is_empty()).then_some(Entry::Scheduled { dues })
    }

    /// Puts back what could not be written.
    pub fn put_back(&self, entry: Entry) {
        if let Entry::Scheduled { dues } = entry {
            self.lock().merge(&dues);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dues> {
        self.dues.lock().unwrap_or_else(|p| p.into_inner())
    }
}
