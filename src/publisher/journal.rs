//! The publisher's side of the journal ([`crate::journal`]): one task appends what concurrent
//! publishes are about to put into the tiers as one `Scheduled` record (a group commit: every
//! publish that waits while one append is in flight goes into the next), names the flushes
//! whose publish ended in the next record or in a `Confirmed` record of their own, and writes
//! the workers' `Ran` records in batches. Nothing here waits for a reader of the journal.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use lapin::BasicProperties;
use tokio::sync::{mpsc, oneshot};

use super::Inner;
use crate::error::{Error, Result};
use crate::journal::{self, Flush, Item, Record, Run};
use crate::time::now_ms;

/// How long ended flushes and runs wait for a record to ride along before one of their own.
const LINGER: Duration = Duration::from_millis(250);
/// After an intent could not be written (the journal stream lost, deleted, or its leader
/// gone), how long publishes go on unjournaled before the journal is tried again: scheduling
/// must not stop, nor wait for the append timeout each time, while the journal is down.
const OUTAGE_PAUSE: Duration = Duration::from_secs(5);
/// Runs kept waiting for their record, at most: past it the oldest are dropped (counted as
/// skipped): the journal must never hold up or grow a worker.
const MAX_RUNS_WAITING: usize = 100_000;

/// A publish waiting for its intent record.
struct Intent {
    items: Vec<Item>,
    reply: oneshot::Sender<Result<u64>>,
}

/// What the task shares with the publishes: flushes whose publishes are under way, flushes
/// ended, runs to write.
#[derive(Default)]
struct Shared {
    /// Flush → (publishes still under way, ids they failed, ids they are unsure of).
    open: HashMap<u64, (usize, Vec<String>, Vec<String>)>,
    ended: Vec<Flush>,
    runs: VecDeque<Run>,
    /// Until when intents are not tried (the journal could not be written).
    down_until: Option<std::time::Instant>,
}

/// The journal writer of one publisher.
pub(super) struct JournalWriter {
    /// `None` once stopped.
    tx: Mutex<Option<mpsc::UnboundedSender<Intent>>>,
    shared: Arc<Mutex<Shared>>,
}

/// A publish's place in a flush: say how it ended with [`JournalWriter::ended`].
pub(super) struct Ticket(u64);

impl JournalWriter {
    /// The writer and its task (which ends, writing what is left, when the writer is dropped).
    pub(super) fn start(inner: Weak<Inner>) -> (JournalWriter, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let task = tokio::spawn(run(inner, rx, shared.clone()));
        let tx = Mutex::new(Some(tx));
        (JournalWriter { tx, shared }, task)
    }

    /// Stops taking intents: the task writes what is left and ends.
    pub(super) fn stop(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Journals `items` before their publish: returns once the record holding them is
    /// confirmed. An error means the journal could not be written (nor is tried for
    /// [`OUTAGE_PAUSE`] after a failure): the caller publishes unjournaled.
    pub(super) async fn intent(&self, items: Vec<Item>) -> Result<Ticket> {
        if let Some(until) = lock(&self.shared).down_until
            && std::time::Instant::now() < until
        {
            return Err(Error::Stopped(
                "the journal could not be written a moment ago".into(),
            ));
        }
        let (reply, rx) = oneshot::channel();
        let sent = match &*self.tx.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(tx) => tx.send(Intent { items, reply }).is_ok(),
            None => false,
        };
        if !sent {
            return Err(closing());
        }
        rx.await.unwrap_or_else(|_| Err(closing())).map(Ticket)
    }

    /// The publish of `ticket` ended: `failed` are the ids it surely did not schedule,
    /// `unsure` those whose confirm was lost.
    pub(super) fn ended(&self, ticket: Ticket, failed: Vec<String>, unsure: Vec<String>) {
        let mut s = lock(&self.shared);
        let done = match s.open.get_mut(&ticket.0) {
            Some((left, f, u)) => {
                *left -= 1;
                f.extend(failed);
                u.extend(unsure);
                *left == 0
            }
            None => false,
        };
        if done && let Some((_, failed, unsure)) = s.open.remove(&ticket.0) {
            s.ended.push(Flush {
                flush: ticket.0,
                failed,
                unsure,
            });
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

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn closing() -> Error {
    Error::Stopped("the publisher is closing; the message was not scheduled".into())
}

/// The task: one intent record per round of waiting publishes, ended flushes and runs every
/// [`LINGER`] when no intent carried them; what is left when the writer is dropped.
async fn run(
    inner: Weak<Inner>,
    mut rx: mpsc::UnboundedReceiver<Intent>,
    shared: Arc<Mutex<Shared>>,
) {
    let session = uuid::Uuid::now_v7().to_string();
    let mut next_flush = 0u64;
    let mut tick = tokio::time::interval(LINGER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let first = tokio::select! {
            i = rx.recv() => match i {
                Some(i) => i,
                None => break,
            },
            _ = tick.tick() => {
                write_rest(&inner, &session, &shared).await;
                continue;
            }
        };
        let mut round = vec![first];
        let mut n = round[0].items.len();
        while n < journal::MAX_ITEMS * 4 {
            match rx.try_recv() {
                Ok(i) => {
                    n += i.items.len();
                    round.push(i);
                }
                Err(_) => break,
            }
        }
        let flush = next_flush;
        next_flush += 1;
        write_intents(&inner, &session, flush, round, &shared).await;
    }
    write_rest(&inner, &session, &shared).await;
}

/// Appends the intents of `round` as flush `flush` (with the flushes ended so far) and
/// answers each publish.
async fn write_intents(
    inner: &Weak<Inner>,
    session: &str,
    flush: u64,
    round: Vec<Intent>,
    shared: &Mutex<Shared>,
) {
    let confirmed = {
        let mut s = lock(shared);
        s.open.insert(flush, (round.len(), Vec::new(), Vec::new()));
        std::mem::take(&mut s.ended)
    };
    let mut replies = Vec::with_capacity(round.len());
    let mut items = Vec::new();
    for i in round {
        items.extend(i.items);
        replies.push(i.reply);
    }
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
        s.down_until = Some(std::time::Instant::now() + OUTAGE_PAUSE);
    }
    for r in replies {
        let _ = r.send(result.clone().map(|()| flush));
    }
}

/// Appends the flushes ended and the runs waiting, if any.
async fn write_rest(inner: &Weak<Inner>, session: &str, shared: &Mutex<Shared>) {
    let (ended, runs) = {
        let mut s = lock(shared);
        (std::mem::take(&mut s.ended), std::mem::take(&mut s.runs))
    };
    if !ended.is_empty() {
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
    let runs = Vec::from(runs);
    for chunk in runs.chunks(journal::MAX_ITEMS) {
        let record = Record::Ran {
            items: chunk.to_vec(),
        };
        if let Err(e) = append(inner, &record).await {
            // runs are what `pending` shows as history: dropping some is better than a
            // worker that grows
            tracing::warn!(
                runs = chunk.len(),
                "could not write runs to the journal: {}",
                crate::error::chain(&e)
            );
        }
    }
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
    inner
        .publish_confirmed(log.exchange(), log.name(), &log.encode(record), props)
        .await
        .map_err(|e| log.or_missing(e))?;
    crate::metrics::global().journal_records.inc();
    Ok(())
}
