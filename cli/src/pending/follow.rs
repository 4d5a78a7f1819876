//! The follower: reads the journal and the control stream and applies them to a
//! [`PendingIndex`], the stream positions committing with each batch, so that a restarted
//! follower goes on where the file says.
//!
//! * **Order across the two streams.** A cancel, purge or reschedule names messages whose
//!   journal records were confirmed before it was written. So a control batch is applied only
//!   once the journal is applied up to the journal's end as it was *after* the batch was read:
//!   every record it can name is then in the index.
//! * **Confirms after a restart.** A `Confirmed` record finds its items through the
//!   translator's map of unconfirmed flushes, which a restart empties; the offset of the oldest
//!   flush still waiting commits as the mark `replay_from`, and a restarted follower reads the
//!   journal again from there (applying is idempotent: a replayed record changes nothing).
//! * **A new index** is filled as a rebuild ([`PendingIndex::begin_rebuild`]): rows are
//!   appended without the listing indexes, which are sorted into place once the follower has
//!   caught up with the journal's end.
//! * **How far behind** ([`Lag`]): the journal's end offset, polled every second, against the
//!   position applied, and for how long the follower has not been caught up.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqp_delay::ops::connection::{Backoff, Connector};
use amqp_delay::ops::trust::Trust;
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Layout, Result};
use tokio::sync::{mpsc, watch};

use super::translate::Translator;
use crate::pending_index::{self, Entry, PendingIndex};
use amqp_delay::ops::journal::{Start, Tail};
use amqp_delay::ops::{control, journal};

/// The index, shared by the follower and the queries (SQLite's connection is used by one
/// thread at a time).
pub type SharedIndex = Arc<Mutex<PendingIndex>>;

/// Mark of the control stream's position (the journal's is the index's `position`).
pub const CONTROL_POSITION: &str = "control_position";
/// Mark of the journal offset a restarted follower reads again from (unconfirmed flushes).
pub const REPLAY_FROM: &str = "replay_from";
/// Control records read ahead of the index: what the follower holds in memory besides the
/// translator's map.
const READ_AHEAD: usize = 256;
/// Control records applied in one transaction at most.
const BATCH: usize = 1_000;
/// Journal records read ahead, and applied in one transaction, at most: a journal record holds
/// up to 2 000 messages (a group commit), so 8 are up to 16 000 entries. More held the
/// decoded records of a whole batch at once: 1.5 GB at the peak of a 10M rebuild.
const JOURNAL_BATCH: usize = 8;

/// What the follower is told.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// How long finished messages stay in the index (`journal.history`).
    pub history: Duration,
    /// How often finished messages older than the history window are removed.
    pub expire_every: Duration,
    /// How often the journal's end is polled for the lag.
    pub poll_end_every: Duration,
}

impl Default for FollowOptions {
    fn default() -> FollowOptions {
        FollowOptions {
            history: Duration::from_secs(7 * 24 * 3600),
            expire_every: Duration::from_secs(60),
            poll_end_every: Duration::from_secs(1),
        }
    }
}

/// How far behind the index is.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lag {
    /// The journal offset applied so far (the next one to read).
    pub journal_position: Option<u64>,
    /// The journal's next offset, as last polled.
    pub journal_end: Option<u64>,
    /// When that poll was (ms since the epoch): once `journal_position` reaches its
    /// `journal_end`, the index holds everything journaled before then.
    #[serde(default)]
    pub end_polled_ms: Option<u64>,
    /// Journal records not applied yet (`None`: not known yet).
    pub behind_records: Option<u64>,
    /// For how long the follower has not been caught up (0 when it is).
    pub behind_ms: u64,
    /// When the follower last applied a journal record (ms since the epoch).
    pub last_applied_ms: Option<u64>,
    /// The control stream's position applied so far.
    pub control_position: Option<u64>,
    /// A rebuild from the journal is under way: lists and counts wait for it.
    pub rebuilding: bool,
    /// Why the follower is not reading now (it retries), if it is not.
    pub error: Option<String>,
}

impl Lag {
    /// Whether the index is known to be behind the journal.
    pub fn is_behind(&self) -> bool {
        self.rebuilding || self.error.is_some() || self.behind_records != Some(0)
    }

    /// One line for people: how far behind, or `None` when caught up.
    pub fn describe(&self) -> Option<String> {
        if !self.is_behind() {
            return None;
        }
        let mut s = match self.behind_records {
            Some(n) => format!(
                "the index is {n} journal record(s) behind ({:.1} s)",
                self.behind_ms as f64 / 1000.0
            ),
            None => "the index does not know the journal's end yet".to_string(),
        };
        if self.rebuilding {
            s.push_str("; it is being rebuilt from the journal");
        }
        if let Some(e) = &self.error {
            s.push_str(&format!("; the follower is not reading: {e}"));
        }
        Some(s)
    }
}

/// The follower's progress, shared with the queries.
#[derive(Debug, Clone, Default)]
pub struct Status {
    inner: Arc<Mutex<StatusInner>>,
    /// The journal position applied, for the control stream's reader to wait on.
    applied: Arc<watch::Sender<u64>>,
}

#[derive(Debug, Default)]
struct StatusInner {
    lag: Lag,
    /// When the follower was last seen caught up (ms since the epoch).
    caught_up_ms: Option<u64>,
    started_ms: u64,
}

impl Status {
    /// A status starting now.
    pub fn new() -> Status {
        let s = Status::default();
        s.update(|i| i.started_ms = now_ms());
        s
    }

    /// The status of an index read up to the journal's `end` and complete there (a one-off
    /// read: nothing behind).
    pub fn settled(end: u64) -> Status {
        let s = Status::new();
        s.update(|i| {
            i.lag.journal_position = Some(end);
            i.lag.journal_end = Some(end);
            i.lag.last_applied_ms = Some(now_ms());
        });
        s
    }

    fn update(&self, f: impl FnOnce(&mut StatusInner)) {
        let mut i = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut i);
        let now = now_ms();
        let l = &mut i.lag;
        l.behind_records = match (l.journal_end, l.journal_position) {
            (Some(end), pos) => Some(end.saturating_sub(pos.unwrap_or(0))),
            (None, _) => None,
        };
        if l.behind_records == Some(0) && !l.rebuilding {
            i.caught_up_ms = Some(now);
        }
    }

    /// How far behind the index is now.
    pub fn lag(&self) -> Lag {
        let i = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut l = i.lag.clone();
        l.behind_ms = if l.is_behind() {
            now_ms().saturating_sub(i.caught_up_ms.unwrap_or(i.started_ms))
        } else {
            0
        };
        l
    }

    fn applied_journal(&self, position: u64) {
        self.update(|i| {
            i.lag.journal_position = Some(position);
            i.lag.last_applied_ms = Some(now_ms());
        });
        self.applied.send_replace(position);
    }
}

/// Runs `f` on the index in a blocking thread.
pub async fn with_index<T: Send + 'static>(
    index: &SharedIndex,
    f: impl FnOnce(&mut PendingIndex) -> pending_index::Result<T> + Send + 'static,
) -> Result<T> {
    let index = index.clone();
    tokio::task::spawn_blocking(move || {
        let mut ix = index.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut ix)
    })
    .await
    .map_err(|e| Error::Stopped(format!("the index task failed: {e}")))?
    .map_err(index_error)
}

/// An index error as the library's: bad input is a usage error, the store's a stream failure.
pub fn index_error(e: pending_index::Error) -> Error {
    match e {
        pending_index::Error::Invalid(m) => Error::Invalid(m),
        pending_index::Error::Store(m) => Error::Stopped(format!("pending index: {m}")),
    }
}

/// Applies `entries` and `marks` in one transaction; when an entry is refused as invalid
/// (a record no writer of ours makes), applies them one by one, leaving out the refused ones,
/// so that one bad record never stops the follower.
pub async fn apply(
    index: &SharedIndex,
    entries: Vec<Entry>,
    marks: Vec<(&'static str, Option<u64>)>,
) -> Result<()> {
    with_index(index, move |ix| match ix.apply_marked(&entries, &marks) {
        Err(pending_index::Error::Invalid(_)) => {
            for e in &entries {
                if let Err(pending_index::Error::Invalid(why)) = ix.apply(std::slice::from_ref(e)) {
                    tracing::warn!("skipping a journal entry the index refuses: {why}");
                }
            }
            ix.apply_marked(&[], &marks)
        }
        r => r,
    })
    .await
}

/// The user the settings' URL logs in as (what the broker puts in its `user_id`s).
pub fn url_user(settings: &Settings) -> Option<String> {
    let first = amqp_delay::ops::connection::split_urls(&settings.url)
        .into_iter()
        .next()?;
    let u = url::Url::parse(&first).ok()?;
    let user = percent_decode(u.username());
    (!user.is_empty()).then_some(user)
}

/// `%XX` escapes decoded (user names and passwords in URLs), invalid UTF-8 replaced.
pub fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The trust of a process connected with `settings`.
pub fn trust_of(settings: &Settings) -> Trust {
    Trust::new(url_user(settings), &settings.trust)
}

/// A stream's follower, whatever its records (the library gives each stream's `Tail` its own
/// methods).
trait Follow: Send + 'static {
    type R: Send + 'static;
    fn next(&mut self) -> impl Future<Output = Option<Result<journal::Entry<Self::R>>>> + Send;
    fn end(self) -> impl Future<Output = ()> + Send;
}

impl Follow for Tail<journal::Record> {
    type R = journal::Record;
    fn next(&mut self) -> impl Future<Output = Option<Result<journal::Entry<Self::R>>>> + Send {
        Tail::<journal::Record>::next(self)
    }
    fn end(self) -> impl Future<Output = ()> + Send {
        Tail::<journal::Record>::end(self)
    }
}

impl Follow for Tail<control::Record> {
    type R = control::Record;
    fn next(&mut self) -> impl Future<Output = Option<Result<journal::Entry<Self::R>>>> + Send {
        Tail::<control::Record>::next(self)
    }
    fn end(self) -> impl Future<Output = ()> + Send {
        Tail::<control::Record>::end(self)
    }
}

/// Pumps a tail into a bounded channel (the reader's own task, so that the applier can take
/// what is there without cancelling a read half-way).
fn pump<T: Follow>(mut tail: T, ahead: usize) -> mpsc::Receiver<Result<journal::Entry<T::R>>> {
    let (tx, rx) = mpsc::channel(ahead);
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                n = tail.next() => n,
                () = tx.closed() => None,
            };
            let Some(r) = next else { break };
            if tx.send(r).await.is_err() {
                break;
            }
        }
        tail.end().await;
    });
    rx
}

/// The next record, then whatever else is already there, up to `max`; `Err` when the reader
/// failed or ended.
async fn batch<R>(
    rx: &mut mpsc::Receiver<Result<journal::Entry<R>>>,
    max: usize,
) -> Result<Vec<journal::Entry<R>>> {
    let ended = || Error::Stopped("the stream's reader ended (connection lost)".into());
    let first = rx.recv().await.ok_or_else(ended)??;
    let mut out = vec![first];
    while out.len() < max {
        match rx.try_recv() {
            Ok(r) => out.push(r?),
            Err(_) => break,
        }
    }
    Ok(out)
}

mod run;
pub use run::{build_once, run};
