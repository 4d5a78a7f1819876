//! Cancelling scheduled messages on a stock broker. A message cannot be taken out of the middle
//! of a queue, so a cancel is a *tombstone*: a record in the control stream (a replicated,
//! append-only RabbitMQ stream) naming the message id. Every worker, gateway and relay follows
//! the stream ([`Cancellations`]) and acks a cancelled message instead of running it.
//!
//! **The guarantee.** Before it runs a message due at `D`, a follower makes sure it has read
//! every record confirmed before `D − cancel.notice`: when its last sync started earlier than
//! that, it appends a barrier record of its own and waits until it reads it back (everything
//! confirmed before the barrier lies before it in the stream). So a cancel confirmed at least
//! `cancel.notice` before the message falls due is always honoured — by every consumer, after
//! restarts, during retries. A later cancel is honoured if it arrives in time, and reported as
//! too late to the canceller when it knows the due time. A follower that keeps running
//! messages as they fall due appends about one barrier per `cancel.notice`; one working
//! through a backlog of overdue messages, none.
//!
//! **Start-up is bounded by checkpoints, not by the stream's length.** Barriers accumulate for
//! the stream's retention (the longest delay plus a week), far too many to read at every
//! start. So a follower that has read many records since the last checkpoint appends one: a
//! begin record, then, in parts, every tombstone it held when it read its begin record back.
//! A follower that starts reads backwards in growing steps from the stream's end (offsets)
//! until its read contains a whole checkpoint; everything before that checkpoint's begin is in
//! it. Only a stream without any checkpoint (a new or upgraded deployment) is read from its
//! start, once. A read gives up only when no record arrives for a while, never because the
//! stream is long.
//!
//! **Memory** is bounded by the live tombstones: each is live until its `until` time (the
//! message's due time plus `cancel.horizon`, or, without a due time, the longest delay plus the
//! horizon), and as soon as a follower sees the cancelled message itself fall due it shortens
//! its own copy to that due time plus the horizon. After that it is kept for
//! [`EXPIRED_KEPT_MS`] more (the control stream's retention beyond the longest delay) while it
//! is among the [`EXPIRED_KEPT`] most recently expired, so a consumer that was down for longer
//! than the horizon still honours most cancels.

mod quota;
mod state;
mod steer;
mod stream;

pub use steer::{Steer, Subject};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use lapin::options::ConfirmSelectOptions;
use tokio::sync::oneshot;

use crate::broker::{self, ResultExt, SharedChannel};
use crate::control::{self, Record};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::settings::TrustSettings;
use crate::stream_log::{Reader, StreamLog};
use crate::time::now_ms;
use crate::trust::Trust;
use state::{Key, Limits, State, lock};
use stream::{Starting, pump, steps_back, wait_progress, write_checkpoint};

/// Executed ids remembered, to report a cancel that arrived too late.
const RECENTLY_EXECUTED: usize = 10_000;

/// What the follower's skips name as their source (`amqp_delay_skipped_total`'s `kind`).
const KIND: &str = "control stream";
/// Tombstones kept after their `until`, at most (the most recently expired).
pub const EXPIRED_KEPT: usize = 100_000;
/// How long after its `until` an expired tombstone is kept: the control stream keeps records
/// for the longest delay plus 7 days, which covers a tombstone's `until` plus this.
pub(crate) const EXPIRED_KEPT_MS: u64 = 7 * 24 * 3600 * 1000;
/// Records a follower reads between checkpoints, at least (more when it holds many
/// tombstones: twice their number, so that checkpoints stay a small part of the stream).
pub const CHECKPOINT_EVERY: u64 = 10_000;
/// Tombstones per checkpoint record (as many as a bulk cancel puts in one record).
const CHECKPOINT_PART: usize = control::MAX_ITEMS;
/// Live tombstones a follower holds, at most: a cancel beyond is not held (a warning and
/// `amqp_delay_stream_records_skipped_total{reason="tombstones_full"}`), so that whatever is
/// appended a follower's memory stays bounded. A tombstone of a UUID id costs about 130 bytes
/// (a million added ~130 MB, measured), so this is ~33 MB (~90 MB with 255-byte ids); it is
/// 2.5 times the expired ones kept, and more live cancels than a deployment of ours holds
/// (each lives only until its message's due time plus the horizon).
pub(crate) const MAX_LIVE: usize = 250_000;

/// What a canceller learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Confirmed at least `cancel.notice` before the due time: it will not run.
    Honoured,
    /// Confirmed too close to (or after) the due time: it may already have run, or run anyway.
    TooLate,
    /// No due time given: honoured if the message has not run yet.
    Unknown,
}

/// The answer to a cancel, once it is durably recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Cancelled {
    /// The message id.
    pub id: String,
    /// The tombstone is forgotten after this (ms since the epoch).
    pub until_ms: u64,
    /// Whether the cancel is certain to win.
    pub verdict: Verdict,
}

/// The tombstone for cancelling `id` now, pure: its `until` and the verdict.
pub(crate) fn tombstone(
    id: &str,
    due_at_ms: Option<u64>,
    now: u64,
    max_delay_ms: u64,
    notice_ms: u64,
    horizon_ms: u64,
) -> (Record, Verdict) {
    // no message can fall due later than the longest delay from now: nor can a tombstone need
    // to live longer (followers clamp it there too)
    let latest = now.saturating_add(max_delay_ms);
    let latest_due = due_at_ms.map_or(latest, |due| due.min(latest));
    let until_ms = latest_due.saturating_add(horizon_ms);
    let verdict = match due_at_ms {
        None => Verdict::Unknown,
        Some(due) if due >= now.saturating_add(notice_ms) => Verdict::Honoured,
        Some(_) => Verdict::TooLate,
    };
    (
        Record::Cancel {
            id: id.to_string(),
            until_ms,
            due_at_ms,
        },
        verdict,
    )
}

/// How a follower reads the control stream.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// `cancel.notice`: the guarantee's margin.
    pub notice: Duration,
    /// `cancel.horizon`, ms: how long after its due time a cancelled message may still arrive.
    pub horizon_ms: u64,
    /// Records read between checkpoints, at least ([`CHECKPOINT_EVERY`]).
    pub checkpoint_every: u64,
    /// Counts every record read, from the start: whoever waits for the follower to start sees
    /// that it makes progress.
    pub progress: Option<Arc<AtomicU64>>,
    /// `[trust]`: whose cancels stop any message and whose checkpoints count besides the
    /// follower's own user ([`crate::trust`]).
    pub trust: TrustSettings,
}

impl FollowOptions {
    /// The defaults with this notice and horizon.
    pub fn new(notice: Duration, horizon_ms: u64) -> FollowOptions {
        FollowOptions {
            notice,
            horizon_ms,
            checkpoint_every: CHECKPOINT_EVERY,
            progress: None,
            trust: TrustSettings::default(),
        }
    }
}

/// What a follower did so far, for tests and diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowerStats {
    /// Records read at start-up (up to its start barrier, over every step back).
    pub start_records: u64,
    /// Records read in all.
    pub records: u64,
    /// Barriers appended to sync (the start-up's not counted).
    pub syncs: u64,
    /// Live tombstones held.
    pub live: usize,
    /// Expired tombstones still kept.
    pub expired: usize,
    /// Checkpoints this follower wrote.
    pub checkpoints_written: u64,
    /// Whole checkpoints it read.
    pub checkpoints_read: u64,
    /// Cancels it read after its worker had run the message.
    pub too_late: u64,
}

/// A follower of the control stream's cancellations, shared by a worker's handlers. Cheap to
/// share; [`Cancellations::is_cancelled`] is a map lookup.
pub struct Cancellations {
    state: Arc<Mutex<State>>,
    channel: SharedChannel,
    log: StreamLog<Record>,
    notice_ms: u64,
    horizon_ms: u64,
    /// When the last sync started (ms since the epoch): every record confirmed before then has
    /// been read.
    synced: tokio::sync::Mutex<Option<u64>>,
    syncs: AtomicU64,
    start_records: u64,
    /// The reader; dropping it stops it (see [`Reading`]).
    _reading: Reading,
}

/// The reader task of the control stream: pumping records until told to stop (dropped), then
/// ending its consumer before its channel, in the order lapin needs (`broker::end_consumer`).
struct Reading {
    _stop: oneshot::Sender<()>,
}

impl Reading {
    /// Follows the stream on `reader` (positioned after the start barrier) into `state`.
    fn spawn(
        mut reader: Reader<Record>,
        state: Arc<Mutex<State>>,
        channel: SharedChannel,
        log: StreamLog<Record>,
        every: u64,
    ) -> Reading {
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                _ = pump(&mut reader, state, channel, log, every) => {}
                _ = stopped => {}
            }
            reader.end("stopped").await;
        });
        Reading { _stop: stop }
    }
}

impl Cancellations {
    /// Starts following `layout`'s control stream on `conn` and returns once every record
    /// confirmed so far has been read (from the latest checkpoint, or from the start of the
    /// stream when it has none). See [`Cancellations::follow_with`].
    pub async fn follow(
        conn: &Connection,
        layout: &Layout,
        notice: Duration,
        horizon_ms: u64,
    ) -> Result<Cancellations> {
        Cancellations::follow_with(conn, layout, FollowOptions::new(notice, horizon_ms)).await
    }

    /// [`Cancellations::follow`] with every option. Start-up: the stream's end is probed, a
    /// start barrier appended, and the stream read from `2 × checkpoint_every` records before
    /// the end up to the barrier; without a whole checkpoint in that read, from 4 times as far
    /// back, and so on, up to the stream's start. It gives up only when no record arrives for
    /// 10 s.
    pub async fn follow_with(
        conn: &Connection,
        layout: &Layout,
        opts: FollowOptions,
    ) -> Result<Cancellations> {
        let user = crate::connection::user_of(conn);
        let log = control::log(layout).writing_as(user.clone());
        log.check_exchange(conn).await?;
        let trust = Trust::new(user, &opts.trust);
        let channel = broker::open(conn).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context(|| "enabling publisher confirms".into())?;
        // barriers (syncs) and checkpoints are appended on it from different tasks
        let channel = SharedChannel::new(channel);
        let limits = Limits {
            ahead_ms: layout.max_delay_ms().saturating_add(opts.horizon_ms),
            max_live: MAX_LIVE,
        };
        let state = Arc::new(Mutex::new(State::new(limits, trust)));
        let every = opts.checkpoint_every.max(1);
        // the end: a marker first, so that an empty stream has one, then the probe; the start
        // barrier comes after the probed end, so every step back reads up to it
        log.barrier_on(&channel).await?;
        let end = log.end_offset(conn).await?;
        let started = now_ms();
        let nonce = log.barrier_on(&channel).await?;
        let mut starting = Starting {
            state: &state,
            progress: opts.progress.as_deref(),
        };
        let (reader, _) = log
            .start_from_compaction(conn, &nonce, steps_back(end, every), &mut starting)
            .await?;
        let (ch, l) = (channel.clone(), log.clone());
        let reading = Reading::spawn(reader, state.clone(), ch, l, every);
        let (start_records, checkpoint) = {
            let mut s = lock(&state);
            s.ready = true;
            // a long read with no checkpoint in it: write one now, not at the next record
            (s.records, s.begin_checkpoint(every))
        };
        if let Some((nonce, rx)) = checkpoint {
            let (ch, l, st) = (channel.clone(), log.clone(), state.clone());
            tokio::spawn(write_checkpoint(ch, l, st, nonce, rx));
        }
        tracing::debug!(stream = %log.name(), records = start_records, "following the control stream");
        Ok(Cancellations {
            state,
            channel,
            log,
            notice_ms: opts.notice.as_millis() as u64,
            horizon_ms: opts.horizon_ms,
            synced: tokio::sync::Mutex::new(Some(started)),
            syncs: AtomicU64::new(0),
            start_records,
            _reading: reading,
        })
    }

    /// Whether the message `id` owned by `owner` (see [`crate::trust::Trust::owner`]) is
    /// cancelled: a tombstone written by its owner or by an admin is held. For the guarantee,
    /// call [`Cancellations::sync_for`] first.
    pub fn is_cancelled(&self, id: &str, owner: Option<&str>) -> bool {
        !id.is_empty() && lock(&self.state).is_cancelled(id, owner, now_ms())
    }

    /// What the message `s` is to do when it falls due: run, or not (cancelled by its owner
    /// or an admin, covered by a purge, moved by a reschedule). For the guarantee, call
    /// [`Cancellations::sync_for`] first.
    pub fn steer(&self, s: &Subject<'_>) -> Steer {
        let now = now_ms();
        let state = lock(&self.state);
        if !s.id.is_empty() && state.is_cancelled(s.id, s.owner, now) {
            return Steer::Cancelled;
        }
        state.rules.steer(s)
    }

    /// Until when the tombstone `by` wrote for `id` is live (ms since the epoch), if one is.
    pub fn live_until(&self, id: &str, by: &str) -> Option<u64> {
        lock(&self.state).tombstones.get(&Key::new(by, id)).copied()
    }

    /// Whether `by` may write one more purge now, by the purges this follower holds: `Err`
    /// says its quota, how many of its purges are live and when they are over. An admin's is
    /// never refused. A tool asks after [`Cancellations::sync`], before it writes.
    pub fn may_purge(&self, by: &str) -> std::result::Result<(), String> {
        let mut s = lock(&self.state);
        s.prune(now_ms());
        s.rules.may_purge(by, &s.trust)
    }

    /// Whether `by` may write a reschedule of its message `id` now (one replacing its own
    /// live reschedule of `id` always may), like [`Cancellations::may_purge`].
    pub fn may_reschedule(&self, by: &str, id: &str) -> std::result::Result<(), String> {
        let mut s = lock(&self.state);
        s.prune(now_ms());
        s.rules.may_reschedule(by, id, &s.trust)
    }

    /// Whose records and messages count for what, as this follower reads them.
    pub(crate) fn trust(&self) -> Trust {
        lock(&self.state).trust.clone()
    }

    /// Live tombstones (what the follower holds in memory besides the expired ones it keeps).
    pub fn len(&self) -> usize {
        let mut s = lock(&self.state);
        s.prune(now_ms());
        s.tombstones.len()
    }

    /// Whether no tombstone is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Why the follower stopped reading the stream, if it did (its consumer ended or its
    /// channel closed): it then knows no new cancel, and every sync fails.
    pub(crate) fn broken(&self) -> Option<String> {
        if let Some(why) = lock(&self.state).broken.clone() {
            return Some(why);
        }
        // barriers and checkpoints are appended on their own channel: without it no sync can
        // succeed, and every message would go back to the queue
        (!self.channel.status().connected())
            .then(|| "the channel appending to the control stream was closed".to_string())
    }

    /// What the follower did so far.
    pub fn stats(&self) -> FollowerStats {
        let mut s = lock(&self.state);
        s.prune(now_ms());
        FollowerStats {
            start_records: self.start_records,
            records: s.records,
            syncs: self.syncs.load(Ordering::Relaxed),
            live: s.tombstones.len(),
            expired: s.expired.len(),
            checkpoints_written: s.checkpoints_written,
            checkpoints_read: s.checkpoints_read,
            too_late: s.too_late,
        }
    }

    /// A cancelled message fell due at `due_at_ms`: its tombstone is needed only for the
    /// horizon after that (retries, redeliveries), not until the canceller's worst case.
    pub(crate) fn fell_due(&self, id: &str, owner: Option<&str>, due_at_ms: Option<u64>) {
        if let Some(due) = due_at_ms {
            let mut s = lock(&self.state);
            let trust = s.trust.clone();
            for by in owner.into_iter().chain(trust.admins()) {
                if let Some(until) = s.tombstones.get_mut(&Key::new(by, id)) {
                    *until = (*until).min(due.saturating_add(self.horizon_ms));
                }
            }
        }
    }

    /// Remembers that `id` from `queue` ran — succeeded, or was parked — so that a cancel read
    /// later is reported as too late (a warning and `amqp_delay_cancel_too_late_total`). Not
    /// for a retry: its next attempt can still be cancelled.
    pub(crate) fn executed(&self, id: &str, queue: &str) {
        if id.is_empty() {
            return;
        }
        let mut s = lock(&self.state);
        if s.executed_set
            .insert(id.to_string(), queue.to_string())
            .is_none()
        {
            s.executed.push_back(id.to_string());
            if s.executed.len() > RECENTLY_EXECUTED
                && let Some(old) = s.executed.pop_front()
            {
                s.executed_set.remove(&old);
            }
        }
    }

    /// Makes sure every cancel that matters for a message due at `due_at_ms` has been read:
    /// every record confirmed before `due − cancel.notice` (before `now − notice / 2` without
    /// a due time). Syncs (see [`Cancellations::sync`]) only when the last sync started
    /// earlier than that. `Ok(true)` when it appended a barrier, `Ok(false)` when the last
    /// sync was recent enough. Called for a message held until its due time, up to a notice
    /// before it (the sync then adds nothing to its lateness): a sync needed then starts now.
    pub async fn sync_for(&self, due_at_ms: Option<u64>) -> Result<bool> {
        let now = now_ms();
        let need = match due_at_ms {
            Some(due) => due.saturating_sub(self.notice_ms).min(now),
            None => now.saturating_sub(self.notice_ms / 2),
        };
        self.sync_since(need).await
    }

    /// `cancel.notice` in ms.
    pub(crate) fn notice_ms(&self) -> u64 {
        self.notice_ms
    }

    /// Appends a barrier and waits until the follower reads it back: every record confirmed
    /// before now has then been read.
    pub async fn sync(&self) -> Result<()> {
        self.sync_since(now_ms()).await.map(|_| ())
    }

    /// Syncs unless the last sync started at `need` or later. One sync at a time; callers that
    /// waited for another's sync use it when it started late enough.
    async fn sync_since(&self, need: u64) -> Result<bool> {
        let mut last = self.synced.lock().await;
        if last.is_some_and(|started| started >= need) {
            return Ok(false);
        }
        let started = now_ms();
        let nonce = crate::stream_log::nonce();
        let (tx, rx) = oneshot::channel();
        {
            let mut s = lock(&self.state);
            if let Some(why) = &s.broken {
                return Err(Error::stream(
                    stream::CONTROL,
                    format!("cannot check cancellations: the follower stopped ({why})"),
                ));
            }
            s.waiting.insert(nonce.clone(), tx);
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        crate::metrics::global().cancel_syncs.inc();
        let r = async {
            let barrier = Record::Barrier {
                nonce: nonce.clone(),
            };
            self.log.append_on(&self.channel, &barrier).await?;
            wait_progress(&self.state, rx, "syncing with the control stream").await
        }
        .await;
        match r {
            Ok(()) => {
                *last = Some(started);
                Ok(true)
            }
            Err(e) => {
                lock(&self.state).waiting.remove(&nonce);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_last_until_the_message_can_no_longer_fall_due() {
        let (r, v) = tombstone("a", Some(10_000), 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::Honoured);
        assert!(matches!(
            r,
            Record::Cancel {
                until_ms: 10_500,
                ..
            }
        ));
        let (_, v) = tombstone("a", Some(1_500), 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::TooLate);
        let (r, v) = tombstone("a", None, 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::Unknown);
        assert!(matches!(
            r,
            Record::Cancel {
                until_ms: 1_001_500,
                ..
            }
        ));
        // a due time past the longest delay from now is no message's
        let (r, _) = tombstone("a", Some(u64::MAX), 1_000, 1_000_000, 1_000, 500);
        assert!(matches!(
            r,
            Record::Cancel {
                until_ms: 1_001_500,
                ..
            }
        ));
    }
}
