//! `delay-publisher recurring serve`: publishes the occurrences of its own user's recurring
//! schedules ahead, each an ordinary delayed message published by that user (journaled,
//! listed by `pending`, cancellable), so no schedule reaches further than its owner's rights.
//!
//! It keeps nothing a restart loses: the schedules, and how far each is published (its mark),
//! are control-stream records. Of any number of replicas of one user, the one that holds the
//! user's lock queue (exclusive: the broker deletes it the moment its connection dies) is
//! active; the others try to declare it every [`STANDBY_POLL`]. The active one reads the
//! schedules, follows the stream, and every second publishes what [`recurring::plan`] says
//! of every due schedule at once, then appends the round's marks (after the confirms), a few
//! thousand schedules to a record. After a takeover, the next replica starts from the marks,
//! less what the pending index or the journal shows the one before published past them
//! ([`takeover`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::control::{self, Record, Start};
use amqp_delay::ops::trust::Trust;
use amqp_delay::recurring::{self, Book, Entry, Marks, Ticks, Window};
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Message, Publisher, Result};
use futures::StreamExt;
use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

pub use crate::schedules::occurrence;

mod takeover;

/// How often a replica that is not active tries to take the lock.
pub const STANDBY_POLL: Duration = Duration::from_secs(2);
/// How long a schedule whose publish failed waits before it is tried again.
const RETRY_AFTER_MS: u64 = 30_000;
/// Occurrences one schedule publishes in one round, at most.
const MAX_PER_ROUND: usize = 100;
/// Keep records appended at once.
const KEEP_CHUNK: usize = 1_000;
/// Cron expressions (with their zone) whose ticks a scheduler keeps parsed, at most: some
/// 32 MB.
const MAX_TICKS_CACHED: usize = 4_096;
/// Occurrences one round publishes, at most (the rest wait a round): bounds a round's
/// memory and how long it holds the stream's records back.
const MAX_ROUND_OCCURRENCES: usize = 20_000;
/// Schedules whose occurrences are published at once (one delay reckoning, one wait for
/// the confirms): each delay is reckoned before its chunk's publish, so the last occurrence of
/// a chunk arrives as much after its tick as the chunk takes to publish.
const PUBLISH_CHUNK: usize = 100;
/// Chunks of a round published at once.
const CHUNKS_AT_ONCE: usize = 16;
/// The bytes of revisions one [`Marks`] record names, at most (a revision of `recurring
/// add` takes 39: some 25,000 schedules), well within a control record.
const MARKS_RECORD_BYTES: usize = 1024 * 1024;
/// How often the active replica restates its schedules ([`Keep`]), so that they outlive the
/// records that made them (the stream keeps a record for a week past the longest delay).
const KEEP_EVERY: Duration = Duration::from_secs(24 * 3600);

/// How far ahead `serve` publishes.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Occurrences are published at least this far ahead (or up to the next tick).
    pub ahead_ms: u64,
    /// A tick later than this when found unpublished is missed (`--misfire`).
    pub grace_ms: u64,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            ahead_ms: 60_000,
            grace_ms: 5_000,
        }
    }
}

/// Runs until `shutdown`: waits for the lock, then publishes; a lost connection starts over.
pub async fn serve(
    settings: &Settings,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let connector = Connector::new(settings)?;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let round = async {
            let conn = connector.connect("amqp-delay recurring serve").await?;
            let r = run(settings, opts, &conn).await;
            amqp_delay::ops::broker::close_connection(&conn, "bye").await;
            r
        };
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = round => {
                let e = r.err().unwrap_or_else(|| Error::Stopped("the scheduler stopped".into()));
                if e.kind() == amqp_delay::ErrorKind::Usage {
                    return Err(e);
                }
                tracing::error!("recurring serve: {}; starting over", amqp_delay::error_chain(&e));
                tokio::time::sleep(STANDBY_POLL).await;
            }
        }
    }
}

/// One connection's life: the lock, then the schedules.
async fn run(settings: &Settings, opts: ServeOptions, conn: &Connection) -> Result<()> {
    let layout = settings.layout()?;
    // connected: ready, standing by or active
    let _live = amqp_delay::metrics::Live::open();
    let user = conn.status().username();
    let lock = layout.recurring_lock(&user);
    let _lock = take_lock(conn, &lock).await?;
    tracing::info!(%user, "active: publishing this user's recurring schedules");
    // this user's schedules alone: another's records take none of its memory or rounds
    let (book, at) = control::read_schedules(conn, &layout, &settings.trust, Some(&user)).await?;
    let from = at.map_or(Start::Next, |o| Start::Offset(o + 1));
    let mut tail = control::tail(conn, &layout, from).await?;
    let publisher = Publisher::connect(settings).await?;
    let already =
        takeover::already_published(conn, settings, &user, &book, now_ms(), opts.ahead_ms).await;
    let mut s = Scheduler {
        already,
        trust: Trust::new(Some(user.clone()), &settings.trust),
        user,
        book,
        ticks: HashMap::new(),
        wake: HashMap::new(),
        opts,
        max_delay_ms: layout.max_delay_ms(),
    };
    let mut round = tokio::time::interval(Duration::from_secs(1));
    let mut kept = Instant::now();
    s.keep(conn, &layout).await?;
    let r = loop {
        tokio::select! {
            e = tail.next() => match e {
                Some(Ok(e)) => s.apply(e.record.as_ref(), e.by.as_deref()),
                Some(Err(e)) => break Err(e),
                None => break Err(Error::Stopped("the control stream's reader ended".into())),
            },
            _ = round.tick() => {
                s.round(&publisher, conn, &layout).await?;
                if kept.elapsed() >= KEEP_EVERY {
                    s.keep(conn, &layout).await?;
                    kept = Instant::now();
                }
            }
        }
    };
    publisher.close().await;
    r
}

/// Declares `lock` exclusive, as soon as no other connection holds it; the channel holds it.
async fn take_lock(conn: &Connection, lock: &str) -> Result<lapin::Channel> {
    let opts = QueueDeclareOptions {
        exclusive: true,
        ..QueueDeclareOptions::default()
    };
    let mut waited = false;
    loop {
        let ch = amqp_delay::ops::broker::open(conn).await?;
        match ch
            .queue_declare(lock.into(), opts, FieldTable::default())
            .await
        {
            Ok(_) => return Ok(ch),
            // RESOURCE_LOCKED: another replica is active
            Err(e) if is_reply(&e, 405) => {
                if !waited {
                    tracing::info!(%lock, "standing by: another replica is active");
                    waited = true;
                }
                tokio::time::sleep(STANDBY_POLL).await;
            }
            Err(e) => {
                return Err(Error::Invalid(format!(
                    "cannot declare the lock queue '{lock}' (this user needs configure on \
                     it): {e}"
                )));
            }
        }
    }
}

fn is_reply(e: &lapin::Error, code: u16) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(r) if r.get_id() == code)
}

/// The active replica's state: the book, the ticks of the cron expressions in use, and when
/// each schedule is next worth planning.
struct Scheduler {
    /// Occurrence ids the replica before published past the marks: not published again.
    already: std::collections::HashSet<String>,
    user: String,
    trust: Trust,
    book: Book,
    /// By cron expression and zone, at most [`MAX_TICKS_CACHED`]: a parsed expression takes
    /// some 8 KB (`croner` keeps a byte per year it may match), so 100,000 schedules' own would
    /// take 800 MB; most share a few expressions, and one not cached is parsed again.
    ticks: HashMap<(String, String), Arc<Ticks>>,
    /// By revision: not before this (ms since the epoch).
    wake: HashMap<String, u64>,
    opts: ServeOptions,
    /// The topology's longest delay.
    max_delay_ms: u64,
}

impl Scheduler {
    /// A record read from the stream. A new revision (an add, or a keep that brings one
    /// back) has no wake time yet, so the next round plans it; a pause, resume or remove
    /// wakes every schedule. Marks and keeps of revisions held change no plan: were they to
    /// wake every schedule, each round would plan the same first [`MAX_ROUND_OCCURRENCES`]
    /// schedules again while a serve reads back its own keeps (one per schedule at its
    /// start), and the others would wait.
    fn apply(&mut self, record: Option<&Record>, by: Option<&str>) {
        if let Some(r) = record
            && r.apply_to(&mut self.book, by, &self.trust)
            && matches!(r, Record::RecurringSet(_))
        {
            self.wake.clear();
        }
    }

    /// Publishes what each of this user's live schedules needs now, at most
    /// [`MAX_ROUND_OCCURRENCES`] (the rest in the next round), in chunks of
    /// [`PUBLISH_CHUNK`] schedules each published at once, [`CHUNKS_AT_ONCE`] chunks at a
    /// time; then the marks of those published (after their confirms), [`MARKS_RECORD_BYTES`]
    /// of revisions to a [`Marks`] record.
    async fn round(
        &mut self,
        publisher: &Publisher,
        conn: &Connection,
        layout: &amqp_delay::Layout,
    ) -> Result<()> {
        let now = now_ms();
        let due: Vec<Entry> = self
            .book
            .iter()
            .filter(|e| e.owner == self.user && !e.paused)
            .filter(|e| self.wake.get(&e.rev).is_none_or(|&w| w <= now))
            // each has an occurrence or more: no more copies than a round publishes
            .take(MAX_ROUND_OCCURRENCES)
            .cloned()
            .collect();
        let w = Window {
            now_ms: now,
            ahead_ms: self.opts.ahead_ms,
            grace_ms: self.opts.grace_ms,
            max: MAX_PER_ROUND,
            max_delay_ms: self.max_delay_ms,
        };
        let mut planned: Vec<(Entry, recurring::Plan, u64)> = Vec::new();
        let mut occurrences = 0;
        for e in due {
            if occurrences >= MAX_ROUND_OCCURRENCES {
                break;
            }
            let Some(ticks) = self.ticks_of(&e) else {
                continue;
            };
            let plan = recurring::plan(&e.def, &ticks, e.done_ms(), w);
            let wake = plan
                .next_tick_ms
                .map_or(u64::MAX, |t| t.saturating_sub(self.opts.ahead_ms));
            if plan.occurrences.is_empty() {
                self.wake.insert(e.rev.clone(), wake);
                continue;
            }
            let mut plan = plan;
            if !self.already.is_empty() {
                let before = plan.occurrences.len();
                plan.occurrences.retain(|o| {
                    let id = recurring::occurrence_id(&e.def.name, o.tick_ms);
                    !self.already.remove(&id)
                });
                amqp_delay::metrics::global()
                    .recurring_already_published
                    .inc_by((before - plan.occurrences.len()) as u64);
            }
            occurrences += plan.occurrences.len();
            planned.push((e, plan, wake));
        }
        let mut marks: Vec<(String, u64)> = Vec::new();
        // a chunk's wait in the batcher (up to `publisher.grain_linger`) and for its confirms
        // does not hold the next chunk back: a round's chunks go out together
        let mut published = futures::stream::iter(planned.chunks(PUBLISH_CHUNK))
            .map(|chunk| async move { (chunk, publish(publisher, chunk).await) })
            .buffer_unordered(CHUNKS_AT_ONCE);
        while let Some((chunk, results)) = published.next().await {
            for ((e, plan, wake), r) in chunk.iter().zip(results) {
                if let Err(err) = r {
                    tracing::error!(
                        schedule = %e.def.name,
                        "publishing recurring occurrences failed (tried again in 30 s): {}",
                        amqp_delay::error_chain(&err)
                    );
                    self.wake.insert(e.rev.clone(), now + RETRY_AFTER_MS);
                    continue;
                }
                marks.push((e.rev.clone(), plan.through_ms));
                self.wake.insert(e.rev.clone(), *wake);
            }
        }
        if marks.is_empty() {
            return Ok(());
        }
        let records = Marks::of(&self.user, &marks, MARKS_RECORD_BYTES);
        let records: Vec<Record> = records.into_iter().map(Record::RecurringMarks).collect();
        control::append_all(conn, layout, &records).await?;
        for r in &records {
            r.apply_to(&mut self.book, Some(&self.user), &self.trust);
        }
        Ok(())
    }

    /// The ticks of `e`'s expression in its zone (parsed once while cached).
    fn ticks_of(&mut self, e: &Entry) -> Option<Arc<Ticks>> {
        let key = (e.def.cron.clone(), e.def.tz.clone());
        if let Some(t) = self.ticks.get(&key) {
            return Some(t.clone());
        }
        let t = Arc::new(e.def.check().ok()?);
        if self.ticks.len() >= MAX_TICKS_CACHED {
            self.ticks.clear();
        }
        self.ticks.insert(key, t.clone());
        Some(t)
    }

    /// Restates this user's schedules, so that they outlive their adds.
    async fn keep(&self, conn: &Connection, layout: &amqp_delay::Layout) -> Result<()> {
        let mut mine = self.book.iter().filter(|e| e.owner == self.user).peekable();
        // a chunk at a time: 100,000 keeps at once would hold a copy of every definition
        while mine.peek().is_some() {
            let chunk: Vec<Record> = (mine.by_ref())
                .take(KEEP_CHUNK)
                .map(|e| Record::RecurringKeep(e.keep()))
                .collect();
            control::append_all(conn, layout, &chunk).await?;
        }
        Ok(())
    }
}

/// Publishes the planned occurrences of each schedule of `chunk` at once and waits for every
/// confirm: whether each schedule's were all published. Each delay is reckoned from just
/// before the publish.
async fn publish(
    publisher: &Publisher,
    chunk: &[(Entry, recurring::Plan, u64)],
) -> Vec<Result<()>> {
    let now = now_ms();
    let msgs: Vec<Message> = (chunk.iter())
        .flat_map(|(e, plan, _)| {
            (plan.occurrences.iter())
                .map(move |o| occurrence(&e.def, o.tick_ms, o.due_ms.saturating_sub(now)))
        })
        .collect();
    let mut results = publisher.schedule_batch(msgs).await.into_iter();
    (chunk.iter())
        .map(|(_, plan, _)| {
            let mut out = Ok(());
            for r in results.by_ref().take(plan.occurrences.len()) {
                if let (Ok(()), Err(e)) = (&out, r) {
                    out = Err(e);
                }
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use amqp_delay::recurring::{Action, Add, Definition, Keep, Mark, Set};
    use amqp_delay::settings::TrustSettings;

    fn scheduler() -> Scheduler {
        Scheduler {
            already: Default::default(),
            user: "alice".into(),
            trust: Trust::new(Some("alice".into()), &TrustSettings::default()),
            book: Book::default(),
            ticks: HashMap::new(),
            wake: HashMap::new(),
            opts: ServeOptions::default(),
            max_delay_ms: 3_600_000,
        }
    }

    fn add(name: &str, rev: &str) -> Record {
        Record::RecurringAdd(Add {
            rev: rev.into(),
            at_ms: 1,
            schedule: Definition::new(name, "* * * * *", "q", "b"),
        })
    }

    #[test]
    fn only_a_pause_resume_or_remove_wakes_every_schedule() {
        let mut s = scheduler();
        let me = Some("alice");
        s.apply(Some(&add("a", "r1")), me);
        s.wake.insert("r1".into(), u64::MAX);
        // a keep and a mark of the revision held, and another schedule's add, change no plan
        let keep = Record::RecurringKeep(Keep {
            owner: "alice".into(),
            rev: "r1".into(),
            since_ms: 1,
            paused: false,
            through_ms: Some(60_000),
            schedule: Definition::new("a", "* * * * *", "q", "b"),
        });
        let mark = Record::RecurringMark(Mark {
            owner: "alice".into(),
            name: "a".into(),
            rev: "r1".into(),
            through_ms: 120_000,
        });
        for r in [keep, mark, add("b", "r2")] {
            s.apply(Some(&r), me);
            assert_eq!(s.wake.get("r1"), Some(&u64::MAX), "{r:?}");
        }
        assert_eq!(s.book.len(), 2);
        // the new revision has no wake time: the next round plans it
        assert!(!s.wake.contains_key("r2"));
        let pause = Record::RecurringSet(Set {
            name: "a".into(),
            owner: None,
            action: Action::Pause,
            at_ms: 2,
        });
        s.apply(Some(&pause), me);
        assert!(s.wake.is_empty());
    }
}
