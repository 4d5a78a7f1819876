//! The publisher's side of the journal ([`crate::journal`]): one task appends what the
//! publisher is about to put into the tiers as `Scheduled` records (a group commit), names the
//! flushes whose publish ended in the next record or in a `Confirmed` record of their own, and
//! writes the workers' `Ran` records in batches. Nothing here waits for a reader of the journal.
//!
//! **When an intent is written.** An intent comes with the instant its message must be
//! published by: at once for a message that leaves as it comes (a chunk of `schedule_all`, a
//! plain message), or the end of its wait in the batcher for a message that lingers there
//! for others of its grain window. The task writes one record when the first of the waiting
//! intents is due (or a departing batch asks for one it holds, or enough wait to fill
//! records), and that record takes every intent waiting: messages that linger share records
//! with one another and with those that cannot wait, so the records follow the departures'
//! pace, not each batch's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use tokio::sync::{Notify, oneshot};

use super::{Inner, Prepared};
use crate::error::{Error, Result};
use crate::journal::{self, Flush, Item, Record, Run};
use crate::time::now_ms;

/// How often the task looks for ended flushes and runs to write on their own.
const TICK: Duration = Duration::from_millis(250);
/// Ended flushes ride on the next intent record; a `Confirmed` record of their own is written
/// only once no intent record came for this long.
const CONFIRM_IDLE: Duration = Duration::from_millis(250);
/// Runs wait for a full record ([`journal::MAX_ITEMS`]) at most this long.
const RUN_PERIOD: Duration = Duration::from_secs(1);
/// After an intent could not be written (the journal stream lost, deleted, or its leader
/// gone), how long publishes go on unjournaled before the journal is tried again: scheduling
/// must not stop, nor wait for the append timeout each time, while the journal is down.
const OUTAGE_PAUSE: Duration = Duration::from_secs(5);
/// Runs kept waiting for their record, at most: past it the oldest are dropped (counted as
/// skipped): the journal must never hold up or grow a worker.
const MAX_RUNS_WAITING: usize = 100_000;
/// How long before held messages are due a worker's runs are not written ([`JournalWriter::busy_at`]).
const BUSY_BEFORE_MS: u64 = 30;
/// How long after held messages are due a worker's runs are not written.
const BUSY_AFTER_MS: u64 = 50;
/// Windows of [`JournalWriter::busy_at`] kept, at most (one for each due time to come).
const MAX_BUSY: usize = 64;
/// Items waiting that are written at once, whatever their instants: four full records.
const ROUND_ITEMS: usize = journal::MAX_ITEMS * 4;

/// Messages waiting for their intent record.
struct Intent {
    items: Vec<Item>,
    reply: oneshot::Sender<Result<u64>>,
}

/// What a message carries for the journal until its publish: its item, or the intent it was
/// queued as while it waited in the batcher.
pub(super) enum Pending {
    /// Not journaled yet: written when its batch leaves.
    Item(Item),
    /// Queued: [`JournalWriter::journaled`] answers with its flush.
    Queued(Queued),
}

/// An intent in the queue.
pub(super) struct Queued {
    /// Its place in the queue: intents below [`Shared::taken`] were taken into a record.
    seq: u64,
    rx: oneshot::Receiver<Result<u64>>,
}

/// How a publish ended, for the flushes its members were journaled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Confirmed.
    Confirmed,
    /// Sent, but its confirm never came: it may be in the tiers.
    Unsure,
    /// Surely not scheduled.
    Failed,
}

/// A flush whose publishes are under way: its items not yet ended, the ids failed and unsure.
#[derive(Default)]
struct Open {
    left: usize,
    failed: Vec<String>,
    unsure: Vec<String>,
}

/// What the task shares with the publishes: intents waiting, flushes whose publishes are under
/// way, flushes ended, runs to write.
#[derive(Default)]
struct Shared {
    queue: Vec<Intent>,
    queued_items: usize,
    /// The earliest instant an intent in the queue must be written by.
    earliest: Option<Instant>,
    /// A departing batch waits for an intent still in the queue.
    hurry: bool,
    next_seq: u64,
    /// Intents with a smaller `seq` were taken into a record.
    taken: u64,
    closed: bool,
    open: HashMap<u64, Open>,
    ended: Vec<Flush>,
    runs: VecDeque<Run>,
    /// Until when intents are not tried (the journal could not be written).
    down_until: Option<Instant>,
    /// A worker releases held messages in this window (ms since the epoch, the wall clock):
    /// runs are not written then, so that their record does not take the CPU from the
    /// messages due.
    busy: Vec<(u64, u64)>,
}

impl Shared {
    /// Why an intent cannot be queued now, if it cannot.
    fn refusal(&self) -> Option<Error> {
        if self.closed {
            return Some(closing());
        }
        match self.down_until {
            Some(until) if Instant::now() < until => Some(Error::Stopped(
                "the journal could not be written a moment ago".into(),
            )),
            _ => None,
        }
    }

    /// Queues `items`, to be written by `by`; whether the task must look again (it is due
    /// earlier than anything queued, or the queue is full).
    fn push(&mut self, items: Vec<Item>, by: Instant) -> (Queued, bool) {
        let (reply, rx) = oneshot::channel();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queued_items += items.len();
        self.queue.push(Intent { items, reply });
        let sooner = self.earliest.is_none_or(|e| by < e);
        if sooner {
            self.earliest = Some(by);
        }
        (
            Queued { seq, rx },
            sooner || self.queued_items >= ROUND_ITEMS,
        )
    }

    /// Whether the queue is to be written now.
    fn due(&self, now: Instant) -> bool {
        !self.queue.is_empty()
            && (self.hurry
                || self.closed
                || self.queued_items >= ROUND_ITEMS
                || self.earliest.is_some_and(|e| e <= now))
    }

    /// Takes the queue.
    fn take(&mut self) -> Vec<Intent> {
        self.queued_items = 0;
        self.earliest = None;
        self.hurry = false;
        self.taken = self.next_seq;
        std::mem::take(&mut self.queue)
    }
}

/// The journal writer of one publisher.
pub(super) struct JournalWriter {
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Notify>,
}

impl JournalWriter {
    /// The writer and its task (which ends, writing what is left, when the writer stops).
    pub(super) fn start(inner: Weak<Inner>) -> (JournalWriter, tokio::task::JoinHandle<()>) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let wake = Arc::new(Notify::new());
        let task = tokio::spawn(run(inner, shared.clone(), wake.clone()));
        (JournalWriter { shared, wake }, task)
    }

    /// Stops taking intents: the task writes what is left and ends.
    pub(super) fn stop(&self) {
        lock(&self.shared).closed = true;
        self.wake.notify_one();
    }

    /// Queues `items` of messages about to leave, to be written at once. An error means the
    /// journal could not be written (nor is tried for [`OUTAGE_PAUSE`] after a failure): the
    /// caller publishes unjournaled.
    pub(super) fn queue_now(&self, items: Vec<Item>) -> Result<Queued> {
        let queued = {
            let mut s = lock(&self.shared);
            if let Some(e) = s.refusal() {
                return Err(e);
            }
            s.push(items, Instant::now()).0
        };
        self.wake.notify_one();
        Ok(queued)
    }

    /// Queues `item` of a message that leaves by `by`: written with the first record due by
    /// then. Gives the item back when the journal cannot take it now.
    pub(super) fn queue(&self, item: Item, by: Instant) -> Pending {
        let (queued, wake) = {
            let mut s = lock(&self.shared);
            if s.refusal().is_some() {
                return Pending::Item(item);
            }
            s.push(vec![item], by)
        };
        if wake {
            self.wake.notify_one();
        }
        Pending::Queued(queued)
    }

    /// The flush of each queued intent of `qs`, once the record holding it is confirmed (those
    /// still in the queue are written now: their batch is leaving). An error means it could
    /// not be written.
    pub(super) async fn journaled(&self, qs: Vec<Queued>) -> Vec<Result<u64>> {
        let hurry = {
            let mut s = lock(&self.shared);
            let waiting = qs.iter().any(|q| q.seq >= s.taken);
            s.hurry |= waiting;
            waiting
        };
        if hurry {
            self.wake.notify_one();
        }
        let mut out = Vec::with_capacity(qs.len());
        for q in qs {
            out.push(q.rx.await.unwrap_or_else(|_| Err(closing())));
        }
        out
    }

    /// Journals what `members` carry for the journal (once: it is taken) before their publish:
    /// with `fresh`, queues what was not queued while they waited in the batcher; waits for
    /// the records. The flush of each member (`None`: not journaled).
    pub(super) async fn intents(&self, members: &mut [Prepared], fresh: bool) -> Vec<Option<u64>> {
        let mut flushes = vec![None; members.len()];
        // which members each queued intent holds
        let (mut holds, mut queued) = (Vec::new(), Vec::new());
        let (mut items, mut unqueued) = (Vec::new(), Vec::new());
        for (i, m) in members.iter_mut().enumerate() {
            match m.journal.take() {
                Some(Pending::Queued(q)) => {
                    holds.push(vec![i]);
                    queued.push(q);
                }
                Some(Pending::Item(item)) if fresh => {
                    items.push(item);
                    unqueued.push(i);
                }
                _ => {}
            }
        }
        if !items.is_empty() {
            match self.queue_now(items) {
                Ok(q) => {
                    holds.push(unqueued);
                    queued.push(q);
                }
                Err(e) => unjournaled(&e, unqueued.len()),
            }
        }
        let mut failed = None;
        for (r, members) in self.journaled(queued).await.into_iter().zip(holds) {
            match r {
                Ok(flush) => members.into_iter().for_each(|i| flushes[i] = Some(flush)),
                Err(e) => failed = Some((e, failed.map_or(0, |(_, n)| n) + members.len())),
            }
        }
        if let Some((e, n)) = failed {
            unjournaled(&e, n);
        }
        flushes
    }

    /// The publish of `members` (their `flushes`) ended with `result`.
    pub(super) fn settled<T>(
        &self,
        flushes: &[Option<u64>],
        members: &[Prepared],
        result: &Result<T>,
    ) {
        let how = match result {
            Ok(_) => Ended::Confirmed,
            // sent, but the confirm never came: it may be in the tiers
            Err(Error::MaybeSent { .. } | Error::Timeout { .. }) => Ended::Unsure,
            Err(_) => Ended::Failed,
        };
        self.ended(flushes, |i| members[i].message_id.clone(), how);
    }

    /// A publish ended `how`: `flushes` holds the flush of each of its members (`None`: not
    /// journaled), `id` a member's id.
    fn ended(&self, flushes: &[Option<u64>], id: impl Fn(usize) -> String, how: Ended) {
        let mut s = lock(&self.shared);
        for (i, f) in flushes.iter().enumerate() {
            let Some(f) = *f else { continue };
            let done = match s.open.get_mut(&f) {
                Some(open) => {
                    open.left = open.left.saturating_sub(1);
                    match how {
                        Ended::Confirmed => {}
                        Ended::Unsure => open.unsure.push(id(i)),
                        Ended::Failed => open.failed.push(id(i)),
                    }
                    open.left == 0
                }
                None => false,
            };
            if done && let Some(open) = s.open.remove(&f) {
                s.ended.push(Flush {
                    flush: f,
                    failed: open.failed,
                    unsure: open.unsure,
                });
            }
        }
    }

    /// A worker releases held messages due at `due_ms`: no runs are written from a little
    /// before it to a little after.
    pub(super) fn busy_at(&self, due_ms: u64) {
        let (from, until) = (
            due_ms.saturating_sub(BUSY_BEFORE_MS),
            due_ms + BUSY_AFTER_MS,
        );
        let now = now_ms();
        let mut s = lock(&self.shared);
        s.busy.retain(|&(_, u)| u >= now);
        let room = s.busy.len() < MAX_BUSY;
        match s.busy.iter_mut().find(|(f, u)| from <= *u && *f <= until) {
            Some(w) => *w = (w.0.min(from), w.1.max(until)),
            None if room => s.busy.push((from, until)),
            None => {}
        }
    }

    /// A worker's run, written with the next batch.
    pub(super) fn ran(&self, run: Run) {
        let mut s = lock(&self.shared);
        if s.runs.len() >= MAX_RUNS_WAITING {
            s.runs.pop_front();
            crate::stream_log::skipped(
                journal::KIND,
                "runs_full",
                &"a run the journal could not write in time",
            );
        }
        s.runs.push_back(run);
    }
}

impl Drop for JournalWriter {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `n` messages go without an intent: availability over the journal, a journal that cannot be
/// written (its stream lost or deleted) must not stop scheduling; what is published meanwhile
/// is counted, and `pending` does not list it.
fn unjournaled(e: &Error, n: usize) {
    // counted as skipped journal records; logged now and then, not per publish
    let before = crate::metrics::global().skip("journal", "unjournaled");
    if before < 10 || before.is_multiple_of(1_000) {
        tracing::warn!(
            messages = n,
            unjournaled = before + 1,
            "publishing without the journal, which `pending` lists from: {}",
            crate::error::chain(e)
        );
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn closing() -> Error {
    Error::Stopped("the publisher is closing; the message was not scheduled".into())
}

/// What the task does next.
enum Step {
    Write(Vec<Intent>),
    Wait(Option<Instant>),
    End,
}

/// The task: one intent record whenever the queue is due; ended flushes and runs every
/// [`TICK`] when no intent carried them; what is left once stopped.
async fn run(inner: Weak<Inner>, shared: Arc<Mutex<Shared>>, wake: Arc<Notify>) {
    let session = uuid::Uuid::now_v7().to_string();
    let mut next_flush = 0u64;
    let mut last_intent = Instant::now();
    let mut last_runs = Instant::now();
    let mut next_tick = Instant::now() + TICK;
    loop {
        let now = Instant::now();
        if now >= next_tick {
            next_tick = now + TICK;
            if last_intent.elapsed() >= CONFIRM_IDLE {
                write_confirmed(&inner, &session, &shared).await;
            }
            // not while a worker releases held messages (unless runs pile up): the next tick
            let busy = {
                let s = lock(&shared);
                let now = now_ms();
                s.busy
                    .iter()
                    .any(|&(from, until)| (from..=until).contains(&now))
                    && s.runs.len() < MAX_RUNS_WAITING / 2
            };
            if !busy && write_runs(&inner, &shared, last_runs.elapsed() >= RUN_PERIOD).await {
                last_runs = Instant::now();
            }
        }
        let step = {
            let mut s = lock(&shared);
            if s.due(Instant::now()) {
                Step::Write(s.take())
            } else if s.closed {
                Step::End
            } else {
                Step::Wait(s.earliest)
            }
        };
        let until = match step {
            Step::Write(round) => {
                write_intents(&inner, &session, next_flush, round, &shared).await;
                next_flush += 1;
                last_intent = Instant::now();
                continue;
            }
            Step::End => break,
            Step::Wait(until) => until.map_or(next_tick, |u| u.min(next_tick)),
        };
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(until.into()) => {}
        }
    }
    write_confirmed(&inner, &session, &shared).await;
    write_runs(&inner, &shared, true).await;
}

/// Appends the intents of `round` as flush `flush` (with the flushes ended so far) and
/// answers each.
async fn write_intents(
    inner: &Weak<Inner>,
    session: &str,
    flush: u64,
    round: Vec<Intent>,
    shared: &Mutex<Shared>,
) {
    let mut replies = Vec::with_capacity(round.len());
    let mut items = Vec::new();
    for i in round {
        items.extend(i.items);
        replies.push(i.reply);
    }
    let confirmed = {
        let mut s = lock(shared);
        let open = Open {
            left: items.len(),
            ..Open::default()
        };
        s.open.insert(flush, open);
        std::mem::take(&mut s.ended)
    };
    let at_ms = now_ms();
    let mut result = Ok(());
    let mut confirmed = Some(confirmed);
    for chunk in journal::chunks(items) {
        let record = Record::Scheduled {
            session: session.to_string(),
            flush,
            at_ms,
            items: chunk,
            confirmed: confirmed.take().unwrap_or_default(),
        };
        if let Err(e) = append(inner, &record).await {
            if let Record::Scheduled { confirmed, .. } = record {
                lock(shared).ended.extend(confirmed);
            }
            result = Err(e);
            break;
        }
    }
    if result.is_err() {
        let mut s = lock(shared);
        s.open.remove(&flush);
        s.down_until = Some(Instant::now() + OUTAGE_PAUSE);
    }
    for r in replies {
        let _ = r.send(result.clone().map(|()| flush));
    }
}

/// Appends the flushes ended, if any, as a `Confirmed` record of their own.
async fn write_confirmed(inner: &Weak<Inner>, session: &str, shared: &Mutex<Shared>) {
    let ended = std::mem::take(&mut lock(shared).ended);
    if ended.is_empty() {
        return;
    }
    let record = Record::Confirmed {
        session: session.to_string(),
        flushes: ended,
    };
    if let Err(e) = append(inner, &record).await {
        tracing::warn!(
            "could not write confirmations to the journal (kept for the next try): {}",
            crate::error::chain(&e)
        );
        if let Record::Confirmed { flushes, .. } = record {
            lock(shared).ended.extend(flushes);
        }
    }
}

/// Appends the runs waiting in full records, and with `all` the rest too; whether it wrote
/// them all.
async fn write_runs(inner: &Weak<Inner>, shared: &Mutex<Shared>, all: bool) -> bool {
    let runs: Vec<Run> = {
        let mut s = lock(shared);
        let n = match all {
            true => s.runs.len(),
            false => s.runs.len() - s.runs.len() % journal::MAX_ITEMS,
        };
        s.runs.drain(..n).collect()
    };
    let mut runs = runs;
    while !runs.is_empty() {
        let rest = runs.split_off(runs.len().min(journal::MAX_ITEMS));
        let n = runs.len();
        let record = Record::Ran {
            items: std::mem::replace(&mut runs, rest),
        };
        if let Err(e) = append(inner, &record).await {
            // runs are what `pending` shows as history: dropping some is better than a
            // worker that grows
            tracing::warn!(
                runs = n,
                "could not write runs to the journal: {}",
                crate::error::chain(&e)
            );
        }
    }
    all
}

/// Appends `record` to the journal on the publisher's confirm channel.
async fn append(inner: &Weak<Inner>, record: &Record) -> Result<()> {
    let Some(inner) = inner.upgrade() else {
        return Err(closing());
    };
    let log = journal::log(&inner.layout);
    let props = inner.signed(
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into()),
    );
    inner.append_log(&log, record, props).await?;
    crate::metrics::global().journal_records.inc();
    Ok(())
}

#[cfg(test)]
mod tests;
