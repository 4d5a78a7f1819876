//! The confirmed publisher: validates a message, makes sure its destination is bound on the
//! delivery exchange (cached per process), plans its route and publishes it persistent,
//! `mandatory` and with publisher confirms. A nack or a return is an error for that message,
//! never silent.
//!
//! **Batching.** Messages to a destination whose consumers read batches (a worker declared its
//! batch marker, see [`Layout::batch_marker`]) go through the batcher: messages in hand at the
//! same time — the chunk `schedule_all` reads, or concurrent `schedule` calls within
//! `publisher.batch_linger` — are grouped per destination into batches whose members all fall
//! due within their lateness budgets ([`crate::batch::group`]); each batch is one broker message
//! planned with [`planner::plan_window`], so it fires no earlier than its latest member's due
//! time and no later than its earliest member's deadline. Confirms are per broker message; every
//! caller learns its own result. A destination without the marker gets plain messages, as
//! before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::{Stream, StreamExt};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::cancel::{Cancelled, tombstone};
use crate::control::Record;
use crate::error::{Error, Result};
use crate::headers;
use crate::layout::Layout;
use crate::message::{Message, Scheduled};
use crate::planner::{self, Precision, Route};
use crate::settings::{CancelSettings, PublisherSettings, Settings};
use crate::time::now_ms;
use crate::topology::Topology;

mod batcher;
mod confirms;
mod inner;
mod journal;
mod refusal;
mod steer;
use batcher::run_batcher;
use inner::{PublishChannel, open_confirm_channel};

/// Schedules messages. Cheap to share (`&Publisher` from many tasks); publishes are pipelined.
pub struct Publisher {
    inner: Arc<Inner>,
    /// What a cancel promises and how long its tombstone lives.
    cancel: CancelSettings,
    /// Feeds the batcher task (`None` when batching is off).
    batcher: Option<mpsc::UnboundedSender<Vec<Prepared>>>,
    batcher_task: Option<tokio::task::JoinHandle<()>>,
    /// Writes the ledger every [`LEDGER_EVERY`], and once more when told to stop (or when the
    /// publisher is dropped, which drops the sender).
    ledger_task: Option<tokio::task::JoinHandle<()>>,
    ledger_stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The journal writer's task: writes what is left once the writer stops.
    journal_task: Option<tokio::task::JoinHandle<()>>,
}

struct Inner {
    conn: tokio::sync::RwLock<Arc<Connection>>,
    /// Where to reconnect to; `Some` when the publisher opened its connection itself (with
    /// [`Publisher::connect`]), so it also reconnects it after a loss.
    url: Option<crate::connection::Connector>,
    /// The confirm channel; replaced when the broker closed it (e.g. after a publish to a
    /// missing exchange), so one bad publish does not stop all later ones.
    channel: tokio::sync::RwLock<PublishChannel>,
    admin: tokio::sync::Mutex<Option<Channel>>,
    layout: Layout,
    precision: Precision,
    settings: PublisherSettings,
    bound: Mutex<HashMap<String, Binding>>,
    /// Broker messages awaiting their confirm.
    in_flight: Semaphore,
    /// Publishes so far, to take turns over the shards of a fixed level.
    turn: std::sync::atomic::AtomicU64,
    /// What it put into the tiers since it last wrote the ledger.
    ledger: crate::ledger::Recorder,
    /// Whether it writes the ledger: the stream exists (checked when it starts; an operator
    /// may delete it while it runs).
    ledger_on: std::sync::atomic::AtomicBool,
    /// The connection's user: the `user_id` on everything it writes into the topology (tier
    /// messages, batches, stream records), which the broker checks (see [`crate::trust`]).
    user: Option<lapin::types::ShortString>,
    /// `[trust]`: whose ledger snapshots its counts start from.
    trust: crate::settings::TrustSettings,
    /// The journal writer (`None`: `journal.enabled` is off).
    journal: Option<journal::JournalWriter>,
    /// `[journal]`.
    journal_settings: crate::settings::JournalSettings,
}

/// What the publisher knows of a destination, refreshed every `publisher.binding_cache`.
#[derive(Debug, Clone, Copy)]
struct Binding {
    at: Instant,
    reads: Reads,
}

/// What a destination's consumers can take, from its markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reads {
    /// Plain messages only, each planned alone.
    Plain,
    /// Batches whose members are all due when it arrives (exact routes).
    Batches,
    /// Grain batches, held until each member is due (coarse routes).
    Holds,
}

/// A validated message with its final properties, waiting to be published.
struct Prepared {
    destination: String,
    delay_ms: u64,
    due_at_ms: u64,
    /// Due time + lateness budget.
    deadline_ms: u64,
    /// The latest it may leave the batcher: its deadline, or, to a destination that holds
    /// early messages, its due time − the grain's lead.
    leave_by_ms: u64,
    message_id: String,
    properties: BasicProperties,
    body: Vec<u8>,
    /// A worker's retry (re-published by the library with an attempt count): counted as
    /// retried, not as scheduled again. A gateway's hop is scheduled once, as it should.
    retry: bool,
    /// What the journal records of it (`None`: not journaled, or already written).
    journal: Option<journal::Pending>,
    /// Its destination holds early messages until due (it travels in grain batches).
    holds: bool,
    reply: oneshot::Sender<Result<Scheduled>>,
}

impl Publisher {
    /// Connects with `settings` and checks that the topology is declared with the same shape.
    pub async fn connect(settings: &Settings) -> Result<Publisher> {
        let layout = settings.layout()?;
        let connector = crate::connection::Connector::new(settings)?;
        let conn = Arc::new(connector.connect(CONNECTION_NAME).await?);
        let built = Publisher::build(conn.clone(), Some(connector), layout, settings).await;
        match built {
            Ok(p) => Ok(p),
            Err(e) => {
                crate::broker::close_connection(&conn, "bye").await;
                Err(e)
            }
        }
    }

    /// Journals what a worker did with a message (batched; never waits).
    pub(crate) fn journal_run(&self, run: crate::journal::Run) {
        if let Some(j) = &self.inner.journal {
            j.ran(run);
        }
    }

    /// A worker releases held messages due at `due_ms`: the journal writes no runs around then.
    pub(crate) fn journal_busy_at(&self, due_ms: u64) {
        if let Some(j) = &self.inner.journal {
            j.busy_at(due_ms);
        }
    }

    /// Appends `record` to the control stream on this publisher's confirm channel (re-opened
    /// after a loss, unlike a stream log's own); a missing stream is the stream log's error.
    pub(crate) async fn append_control(&self, record: &Record) -> Result<()> {
        let log = crate::control::log(&self.inner.layout);
        let props = self
            .inner
            .signed(BasicProperties::default().with_delivery_mode(2));
        self.inner.append_log(&log, record, props).await
    }

    /// Uses an existing connection (not closed by [`Publisher::close`]).
    pub async fn with_connection(
        conn: Arc<Connection>,
        layout: Layout,
        settings: &Settings,
    ) -> Result<Publisher> {
        // our own connections check this when they connect; the caller's is checked here
        let frame_max = conn.configuration().frame_max();
        if frame_max < crate::endpoints::MIN_FRAME_MAX {
            return Err(Error::Invalid(format!(
                "the connection allows frames of {frame_max} bytes only; amqp-delay needs at least {} \
                 (a message's headers, up to {} bytes plus what the tier hops add, must fit one \
                 frame): connect with a larger frame_max (the broker's default is 131072)",
                crate::endpoints::MIN_FRAME_MAX,
                crate::message::MAX_HEADER_BYTES
            )));
        }
        Publisher::build(conn, None, layout, settings).await
    }

    async fn build(
        conn: Arc<Connection>,
        url: Option<crate::connection::Connector>,
        layout: Layout,
        all: &Settings,
    ) -> Result<Publisher> {
        let (precision, settings) = (all.precision, all.publisher.clone());
        settings.validate().map_err(Error::config)?;
        Topology::new(layout.clone()).verify(&conn).await?;
        // what it appends to: the ledger stream and the stream exchange in front of it
        let ledger = crate::ledger::log(&layout);
        if !ledger.exists(&conn).await? {
            return Err(ledger.missing());
        }
        ledger.check_exchange(&conn).await?;
        let journal_on = all.journal.enabled;
        if journal_on {
            let log = crate::journal::log(&layout);
            if !log.exists(&conn).await? {
                return Err(log.missing());
            }
        }
        let channel = open_confirm_channel(&conn).await?;
        let user = crate::connection::user_of(&conn).map(|u| u.as_str().into());
        let mut journal_task = None;
        let inner = Arc::new_cyclic(|me| Inner {
            journal: journal_on.then(|| {
                let (writer, task) = journal::JournalWriter::start(me.clone());
                journal_task = Some(task);
                writer
            }),
            journal_settings: all.journal.clone(),
            user,
            trust: all.trust.clone(),
            conn: tokio::sync::RwLock::new(conn),
            url,
            channel: tokio::sync::RwLock::new(channel),
            admin: tokio::sync::Mutex::new(None),
            layout,
            precision,
            in_flight: Semaphore::new(settings.max_in_flight),
            settings,
            bound: Mutex::new(HashMap::new()),
            turn: std::sync::atomic::AtomicU64::new(0),
            ledger: crate::ledger::Recorder::default(),
            ledger_on: std::sync::atomic::AtomicBool::new(true),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let ledger_task = Some(tokio::spawn(run_ledger(inner.clone(), stopped)));
        let (batcher, batcher_task) = if inner.settings.batching() {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(run_batcher(inner.clone(), rx));
            (Some(tx), Some(task))
        } else {
            (None, None)
        };
        Ok(Publisher {
            inner,
            cancel: all.cancel.clone(),
            batcher,
            batcher_task,
            ledger_task,
            ledger_stop: Some(stop),
            journal_task,
        })
    }

    /// The topology layout it publishes into.
    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// The lateness budget it plans with.
    pub fn precision(&self) -> &Precision {
        &self.inner.precision
    }

    /// The route a delay would take alone (no I/O).
    pub fn plan(&self, delay_ms: u64) -> Result<Route> {
        Ok(planner::plan(
            &self.inner.layout,
            &self.inner.precision,
            delay_ms,
        )?)
    }

    /// What [`Publisher::schedule`] would refuse `msg` for before publishing anything: its
    /// destination's name, [`Message::check`], a delay the topology cannot serve. No I/O.
    pub fn check(&self, msg: &Message) -> Result<()> {
        let inner = &self.inner;
        inner
            .layout
            .validate_destination(&msg.destination)
            .map_err(Error::Invalid)?;
        msg.check(inner.settings.max_message_bytes)
            .map_err(Error::Invalid)?;
        self.plan(msg.delay_ms)?;
        Ok(())
    }

    /// Schedules one message; returns once the broker has confirmed it (alone, or in a batch
    /// with concurrent calls to the same destination).
    pub async fn schedule(&self, msg: Message) -> Result<Scheduled> {
        let (tx, rx) = oneshot::channel();
        let (p, reads) = self.prepare(msg, tx).await?;
        match &self.batcher {
            Some(b) if reads != Reads::Plain => {
                if let Err(mpsc::error::SendError(mut v)) = b.send(vec![p]) {
                    let p = v.pop().expect("one message");
                    return self.inner.publish_alone(p).await;
                }
                rx.await.unwrap_or_else(|_| Err(batcher_gone()))
            }
            _ => self.inner.publish_alone(p).await,
        }
    }

    /// Schedules a stream of tagged messages, up to `publisher.max_pending` in hand and
    /// `publisher.max_in_flight` broker messages awaiting their confirm at once; messages in
    /// hand together are batched per destination. Results come back as they complete (not in
    /// input order), with their tag.
    pub fn schedule_all<'a, T: Send + 'a>(
        &'a self,
        items: impl Stream<Item = (T, Message)> + 'a,
    ) -> impl Stream<Item = (T, Result<Scheduled>)> + 'a {
        let chunk = self.inner.settings.max_pending.clamp(1, 4096);
        let chunks_in_hand = self.inner.settings.max_pending.div_ceil(chunk).max(1);
        items
            .ready_chunks(chunk)
            .map(move |chunk| self.schedule_chunk(chunk))
            .buffer_unordered(chunks_in_hand)
            .flat_map(futures::stream::iter)
    }

    /// Schedules `chunk` together: what can be batched is handed to the batcher as one unit.
    async fn schedule_chunk<T>(&self, chunk: Vec<(T, Message)>) -> Vec<(T, Result<Scheduled>)> {
        let mut out = Vec::with_capacity(chunk.len());
        let mut waiting = Vec::new();
        let mut prepared = Vec::new();
        for (tag, msg) in chunk {
            let (tx, rx) = oneshot::channel();
            match self.prepare(msg, tx).await {
                Err(e) => out.push((tag, Err(e))),
                Ok((p, _)) => {
                    prepared.push(p);
                    waiting.push((tag, rx));
                }
            }
        }
        // With a batcher everything goes through it as one unit (a destination that does not
        // read batches gets its messages alone there); without, each is published alone. Either
        // way every message's answer comes through its reply channel.
        match &self.batcher {
            Some(b) => {
                if let Err(mpsc::error::SendError(v)) = b.send(prepared) {
                    for p in v {
                        let _ = p.reply.send(Err(batcher_gone()));
                    }
                }
            }
            None => {
                let inner = &self.inner;
                futures::stream::iter(prepared)
                    .for_each_concurrent(inner.settings.max_in_flight, |p| async move {
                        let _ = inner.publish_alone(p).await;
                    })
                    .await;
            }
        }
        for (tag, rx) in waiting {
            out.push((tag, rx.await.unwrap_or_else(|_| Err(batcher_gone()))));
        }
        out
    }

    /// Schedules many messages; results in input order.
    pub async fn schedule_batch(&self, msgs: Vec<Message>) -> Vec<Result<Scheduled>> {
        let n = msgs.len();
        let mut out: Vec<Option<Result<Scheduled>>> = (0..n).map(|_| None).collect();
        let mut s =
            std::pin::pin!(self.schedule_all(futures::stream::iter(msgs.into_iter().enumerate())));
        while let Some((i, r)) = s.next().await {
            out[i] = Some(r);
        }
        out.into_iter()
            .map(|r| r.expect("every message answered"))
            .collect()
    }

    /// Validates `msg`, binds its destination and gives it its final properties. The second
    /// value says what the destination's consumers read.
    async fn prepare(
        &self,
        msg: Message,
        reply: oneshot::Sender<Result<Scheduled>>,
    ) -> Result<(Prepared, Reads)> {
        let inner = &self.inner;
        self.check(&msg)?;
        let caller_headers = msg.properties.headers().clone().unwrap_or_default();
        // the broker's history never travels again; a retry's previous schedule headers are
        // replaced by the ones set below
        let mut hdrs = headers::filter(&caller_headers, |k| {
            !headers::is_broker_header(k) && !headers::RESERVED.contains(&k)
        });
        let reads = inner.ensure_bound(&msg.destination).await?;

        let due_at_ms = msg.due_at.unwrap_or_else(|| now_ms() + msg.delay_ms);
        headers::set_schedule_headers(&mut hdrs, msg.delay_ms, due_at_ms, msg.attempt);
        if let Some((name, tick_ms)) = &msg.occurrence {
            headers::set_occurrence_headers(&mut hdrs, name, *tick_ms);
        }
        if let Some(owner) = &msg.for_owner {
            hdrs.insert(
                headers::OWNER.into(),
                AMQPValue::LongString(owner.as_str().into()),
            );
        }
        let message_id = match (msg.properties.message_id(), &msg.occurrence) {
            (Some(id), _) => id.to_string(),
            (None, Some((name, tick))) => crate::recurring::occurrence_id(name, *tick),
            (None, None) => uuid::Uuid::now_v7().to_string(),
        };
        let journal = self.journal_item(&msg, &message_id, due_at_ms);
        let properties = msg
            .properties
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(hdrs);
        let budget = inner.precision.budget_ms(msg.delay_ms);
        let deadline_ms = due_at_ms.saturating_add(budget);
        let (leave_by_ms, holds) = match (reads, inner.settings.grain()) {
            (Reads::Holds, Some(g)) => (due_at_ms.saturating_sub(g.lead_ms), true),
            _ => (deadline_ms, false),
        };
        Ok((
            Prepared {
                destination: msg.destination,
                delay_ms: msg.delay_ms,
                due_at_ms,
                deadline_ms,
                leave_by_ms,
                message_id,
                properties,
                body: msg.body,
                retry: msg.internal && msg.attempt > 0 && !msg.transferred,
                journal: journal.map(journal::Pending::Item),
                holds,
                reply,
            },
            reads,
        ))
    }

    /// What the journal records of `msg` (`None` when it journals nothing, or not this one).
    fn journal_item(&self, msg: &Message, id: &str, due_ms: u64) -> Option<crate::journal::Item> {
        let inner = &self.inner;
        if inner.journal.is_none()
            || !msg.journaled
            || (msg.internal && msg.attempt > 0 && !msg.transferred)
        {
            return None;
        }
        let h = msg.properties.headers().as_ref();
        let text = |name: &str| {
            h.and_then(|h| h.inner().get(name))
                .and_then(crate::journal::header_text)
        };
        // a gateway's copy names its owner and the routing key at the target
        let (owner, routing_key) = match msg.internal {
            true => (text(headers::OWNER), text(headers::ROUTING_KEY)),
            false => (msg.for_owner.clone(), None),
        };
        let js = &inner.journal_settings;
        let keep = js.keep_body && msg.body.len() <= js.max_body;
        Some(crate::journal::Item {
            id: id.to_string(),
            owner,
            queue: msg.destination.clone(),
            exchange: msg.target.clone(),
            routing_key,
            due_ms,
            size: msg.body.len() as u64,
            content_type: msg
                .properties
                .content_type()
                .as_ref()
                .map(|c| c.to_string()),
            headers: crate::journal::kept_headers(h),
            body: keep.then(|| msg.body.clone()),
        })
    }

    /// Publishes with `mandatory` and waits for the confirm; nack and return are errors.
    /// Used for everything we (re-)publish, so callers strip `x-death` first.
    pub async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<()> {
        self.inner
            .publish_confirmed(exchange, routing_key, body, props)
            .await
    }

    /// Waits for everything handed to the batcher, then closes the channels (and the connection
    /// when we opened it).
    pub async fn close(mut self) {
        drop(self.batcher.take());
        if let Some(t) = self.batcher_task.take() {
            let _ = t.await;
        }
        // the ledger task writes what is left, then ends; so does the journal's
        drop(self.ledger_stop.take());
        if let Some(t) = self.ledger_task.take() {
            let _ = t.await;
        }
        if let Some(j) = &self.inner.journal {
            j.stop();
        }
        if let Some(t) = self.journal_task.take() {
            let _ = t.await;
        }
        let inner = &self.inner;
        crate::broker::close(&*inner.channel.read().await, "bye").await;
        if let Some(c) = inner.admin.lock().await.take() {
            crate::broker::close(&c, "bye").await;
        }
        if inner.url.is_some() {
            crate::broker::close_connection(&*inner.conn.read().await, "bye").await;
        }
    }
}

/// How often a publisher writes what it put into the tiers to the ledger (and how far behind
/// `stats` may count).
const LEDGER_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Writes the ledger every [`LEDGER_EVERY`] while the publisher lives, and once more when
/// `stop` fires (closed, or the publisher dropped: a dropped publisher's counts are written
/// too, as long as the runtime runs). About every [`crate::tally::SNAPSHOT_EVERY_MS`] it counts
/// the ledger, which leaves a snapshot when none is recent: so a topology whose publishers run
/// keeps its ledger quick to read even when nobody runs `stats`. A write is never cut short; a
/// count is, by `stop`.
async fn run_ledger(inner: Arc<Inner>, mut stop: tokio::sync::oneshot::Receiver<()>) {
    let snapshot_every = std::time::Duration::from_millis(crate::tally::SNAPSHOT_EVERY_MS);
    // publishers started together do not all count at once
    let jitter =
        std::time::Duration::from_millis(u64::from(uuid::Uuid::now_v7().as_u128() as u16) * 10);
    let mut next_count = tokio::time::Instant::now() + snapshot_every + jitter;
    let mut tick = tokio::time::interval(LEDGER_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut stop => break,
        }
        inner.write_ledger(false).await;
        if tokio::time::Instant::now() >= next_count {
            next_count = tokio::time::Instant::now() + snapshot_every;
            let count = async {
                let conn = inner.connection().await?;
                crate::ledger::count(&conn, &inner.layout, &inner.trust).await
            };
            tokio::select! {
                r = count => match r {
                    Ok(_) => {}
                    // the least-privilege publisher set has no read right: the snapshots are
                    // then left by the workers, gateways and `stats`, which may read
                    Err(Error::Amqp { ref source, .. })
                        if crate::broker::is_reply(source, crate::broker::ACCESS_REFUSED) =>
                    {
                        tracing::info!(
                            "this publisher may not read the ledger stream, so it leaves its \
                             snapshots to the workers, gateways and `stats`"
                        );
                        next_count = tokio::time::Instant::now() + NEVER;
                    }
                    Err(e) => tracing::warn!("counting the ledger: {}", crate::error::chain(&e)),
                },
                _ = &mut stop => break,
            }
        }
    }
    inner.write_ledger(true).await;
}

/// Far enough ahead to mean "not again in this process".
const NEVER: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

/// Name of the connection a publisher opens itself.
const CONNECTION_NAME: &str = "amqp-delay publisher";

fn batcher_gone() -> Error {
    Error::Stopped("the publisher is closing; the message was not scheduled".into())
}
