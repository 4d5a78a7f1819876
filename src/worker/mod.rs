//! The worker: consumes destination queues with bounded prefetch and concurrency, runs a
//! [`Handler`] on each due message, acks after success, re-schedules retryable failures through
//! the tiers with backoff (acking the original only after the broker confirmed the copy), parks
//! permanent failures and exhausted retries in `<prefix>.parked.<queue>` with the reason, shuts
//! down gracefully and reconnects after a connection loss.
//!
//! It reads batches natively (`process`): every member of a batch runs the handler and is
//! retried, parked or put back on its own; the batch is acked once every member is done,
//! re-scheduled or parked, each durably confirmed. On start it declares, per queue, the batch
//! marker that tells publishers its consumers read batches.
//!
//! A consumer the broker cancels (its queue was deleted) is logged and, once the queue exists
//! again, subscribed anew; the other queues keep flowing meanwhile.

mod acks;
mod process;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use crate::broker;
use crate::cancel::{Cancellations, FollowOptions};
use crate::envelope::Delivery;
use crate::error::{Error, Result, ResultExt};
use crate::layout::Layout;
use crate::publisher::Publisher;
use crate::settings::Settings;
use crate::topology::Topology;

/// What a handler decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done: the message is acked.
    Success,
    /// Failed, try again later (re-scheduled with backoff until `max_attempts`).
    Retry(String),
    /// Failed for good: parked with the reason.
    Permanent(String),
    /// Not processed now, and a re-scheduled, modified copy would be wrong (the gateway's
    /// ingress when the tiers refuse): the worker holds the message and runs the handler again
    /// with a growing pause, for up to `consumer.requeue_hold`; then the message goes back to
    /// its queue unchanged (a member of a batch: re-scheduled alone, attempt unchanged). No
    /// attempt is counted.
    Requeue(String),
    /// The message was cancelled while the handler had it ([`Context::is_cancelled`]): acked
    /// and counted as cancelled, like a message cancelled before its handler started.
    Cancelled,
}

/// Business logic run on every due message. Must be idempotent: delivery is at-least-once.
pub trait Handler: Send + Sync + 'static {
    /// Processes one due message and says what to do with it.
    fn handle(&self, delivery: &Delivery, ctx: &Context) -> impl Future<Output = Outcome> + Send;

    /// Whether this handler only moves messages (publishes and awaits a confirm), like the
    /// gateway or a relay: it then runs up to `consumer.io_concurrency` at once with that
    /// prefetch, instead of sharing the business handlers' `consumer.concurrency`.
    fn io_bound(&self) -> bool {
        false
    }

    /// Whether the messages it consumes carry amqp-delay's own headers (attempt, due time) to
    /// be read and checked. `false` for a queue applications publish to directly (the gateway's
    /// ingress): their `x-delay-*` headers are forged, removed before the handler sees them.
    fn reads_our_headers(&self) -> bool {
        true
    }
}

/// What a handler may use besides the message: the worker's confirmed publisher (to forward
/// or schedule follow-up messages on the worker's connection) and its view of the cancels.
pub struct Context {
    publisher: Arc<Publisher>,
    cancels: Arc<Cancellations>,
}

impl Context {
    /// The worker's confirmed publisher.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Whether `message_id`, due at `due_at_ms`, has been cancelled, after reading every cancel
    /// that matters for it (those confirmed `cancel.notice` before the due time), as the worker
    /// does before it runs a handler. For a handler that itself waits until a message is due
    /// (the gateway holding a short delay); it then returns [`Outcome::Cancelled`]. An error
    /// when the control stream cannot be read.
    pub async fn is_cancelled(&self, message_id: &str, due_at_ms: u64) -> Result<bool> {
        self.cancels.sync_for(Some(due_at_ms)).await?;
        Ok(self.cancels.is_cancelled(message_id))
    }
}

/// Counters of what a worker did, readable while it runs. Batches count once per member.
#[derive(Debug, Default)]
pub struct Counters {
    /// Handlers that succeeded.
    pub succeeded: AtomicU64,
    /// Retries scheduled.
    pub retried: AtomicU64,
    /// Messages parked.
    pub parked: AtomicU64,
    /// Deliveries the broker marked as redelivered.
    pub redelivered: AtomicU64,
    /// Batches received (their members are counted in the other counters).
    pub batches: AtomicU64,
    /// Messages acked without running because they were cancelled.
    pub cancelled: AtomicU64,
    /// Barriers appended to the control stream before running a message (the last sync was
    /// too old for its due time); the other checks used a recent sync.
    pub cancel_syncs: AtomicU64,
    /// Subscriptions renewed because nothing arrived while their queue had ready messages
    /// ([`Error::ConsumerStalled`]).
    pub stalled: AtomicU64,
}

/// Runs handlers over destination queues.
pub struct Worker<H: Handler> {
    settings: Settings,
    subscriptions: Vec<(String, Arc<H>)>,
    counters: Arc<Counters>,
}

/// How a session runs.
#[derive(Clone, Copy)]
struct Mode {
    /// The worker's first session (a missing queue is fatal then).
    first: bool,
    /// One message at a time (after a frame too large).
    careful: bool,
    /// See [`STALL_AFTER`].
    stall_after: Duration,
}

enum SessionEnd {
    Stopped,
    Lost(Error),
    /// A one-at-a-time session is over: reconnect at the configured prefetch.
    Careful,
}

/// How long a worker consumes one message at a time after a message too large to receive.
const CAREFUL_FOR: Duration = Duration::from_secs(30);

/// How long a session may go without progress while it starts consuming (channels, the control
/// stream, consumers) before the worker gives up on the connection and makes a new one. A
/// broker call whose connection broke during a cluster restart was seen never to return.
/// Reading the control stream is progress: a long read is not a broken connection.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// An idle worker (no message in hand) that has received nothing from a queue for this long
/// while the queue has ready messages treats the subscription as stalled and reconnects
/// ([`Error::ConsumerStalled`]). Checked every [`STALL_CHECK`]. Doubled after each stall in a
/// row, up to [`STALL_AFTER_MAX`]: an inactive consumer of a single-active-consumer queue looks
/// the same and should not reconnect every few seconds. Each check also ends the consumer of
/// a queue that no longer exists, in case the broker's cancel never came.
const STALL_AFTER: Duration = Duration::from_secs(10);
const STALL_AFTER_MAX: Duration = Duration::from_secs(300);
const STALL_CHECK: Duration = Duration::from_secs(5);

/// How long one stall check (passive declares of the idle queues, perhaps a cancel) may take
/// before the session gives up on the connection.
const STALL_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// How long ending a consumer whose queue vanished may take before its channel is closed.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a session checks that its control stream follower still reads.
const FOLLOWER_CHECK: Duration = Duration::from_secs(1);

/// Whether `e` says a frame exceeded `frame_max`: a message (its header frame) that grew past
/// the limit on its hops, which no consumer on this connection can receive.
fn is_frame_error(e: &Error) -> bool {
    matches!(e, Error::Amqp { source, .. } if broker::is_reply(source, broker::FRAME_ERROR))
}

/// A delivery stream tagged with its subscription; `None` once the broker cancelled it.
/// A delivery of subscription `i` with the acks of its channel; `None` when its consumer ended.
type Tagged = (
    usize,
    Option<(Arc<acks::Acks>, lapin::Result<lapin::message::Delivery>)>,
);

impl<H: Handler> Worker<H> {
    /// A worker with `settings` and no queue yet (add them with [`Worker::subscribe`]).
    pub fn new(settings: Settings) -> Self {
        Worker {
            settings,
            subscriptions: Vec::new(),
            counters: Arc::new(Counters::default()),
        }
    }

    /// Adds a queue and its handler.
    pub fn subscribe(mut self, queue: impl Into<String>, handler: H) -> Self {
        self.subscriptions.push((queue.into(), Arc::new(handler)));
        self
    }

    /// The worker's counters, readable while it runs.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Runs until `shutdown` completes, reconnecting with backoff when the connection is lost.
    /// Returns an error only for problems a reconnect cannot fix (missing topology or queue at
    /// start, invalid settings).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        if self.subscriptions.is_empty() {
            return Err(Error::Invalid("the worker has no queue to consume".into()));
        }
        self.settings.consumer.validate().map_err(Error::Invalid)?;
        let layout = self.settings.layout()?;
        for (q, _) in &self.subscriptions {
            layout.validate_destination(q).map_err(Error::Invalid)?;
        }
        let connector = crate::connection::Connector::new(&self.settings)?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = crate::connection::Backoff::default();
        let conn_name = format!("amqp-delay worker {}", self.settings.prefix);
        let mut first = true;
        // after a frame too large: one message at a time, so that only that message is
        // redelivered (and counted against the queue's delivery limit, which parks it)
        let mut careful = false;
        let mut stall_after = STALL_AFTER;
        loop {
            let conn = tokio::select! {
                c = connector.connect(&conn_name) => c,
                _ = &mut shutdown => return Ok(()),
            };
            let outcome = match conn {
                Ok(conn) => {
                    let conn = Arc::new(conn);
                    backoff.reset();
                    let (ready_tx, ready_rx) = oneshot::channel::<()>();
                    let progress = Arc::new(AtomicU64::new(0));
                    let mode = Mode {
                        first,
                        careful,
                        stall_after,
                    };
                    let session = self.session(
                        &conn,
                        &layout,
                        mode,
                        &mut shutdown,
                        (ready_tx, progress.clone()),
                    );
                    tokio::pin!(session);
                    let end = tokio::select! {
                        biased;
                        end = &mut session => end,
                        started = setup_watchdog(ready_rx, &progress) => if started {
                            session.await
                        } else {
                            Ok(SessionEnd::Lost(Error::Timeout {
                                context: "starting to consume (a broker call did not return)".into(),
                                timeout_ms: SETUP_TIMEOUT.as_millis() as u64,
                            }))
                        },
                    };
                    broker::close_connection(&conn, "bye").await;
                    if let Ok(SessionEnd::Lost(_)) = end {
                        first = false;
                    }
                    end
                }
                Err(e) => Ok(SessionEnd::Lost(e)),
            };
            careful = matches!(&outcome, Ok(SessionEnd::Lost(e)) if is_frame_error(e));
            stall_after = match &outcome {
                Ok(SessionEnd::Lost(Error::ConsumerStalled { .. })) => {
                    (stall_after * 2).min(STALL_AFTER_MAX)
                }
                _ => STALL_AFTER,
            };
            if careful {
                tracing::error!(
                    "a message in one of the queues is larger than the connection's frame_max \
                     (its headers grew on the way) and cannot be received; consuming one message \
                     at a time for {CAREFUL_FOR:?} so that only it is redelivered. A quorum queue's \
                     delivery limit then parks it (20 by default on RabbitMQ 4.x; on 3.x set a \
                     `delivery-limit` policy on the queue), or remove it by hand"
                );
            }
            let pause = backoff.next_pause();
            match outcome {
                Ok(SessionEnd::Stopped) => return Ok(()),
                Ok(SessionEnd::Careful) => {
                    tracing::info!("back to the configured prefetch");
                    continue;
                }
                Ok(SessionEnd::Lost(e)) => {
                    tracing::warn!(
                        "connection lost or refused: {}; reconnecting in {:?} (sooner if a node answers)",
                        crate::error::chain(&e),
                        pause
                    );
                }
                // Once it has run, a worker outlives what a reconnect may fix: a topology or
                // queue that is missing while nodes come back, say.
                Err(e) if !first => {
                    tracing::error!("{}; trying again in {:?}", crate::error::chain(&e), pause);
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                _ = crate::connection::Backoff::wait(pause, connector.urls()) => {},
                _ = &mut shutdown => return Ok(()),
            }
        }
    }

    /// One connection's worth of work. `Err` = fatal, `Lost` = reconnect.
    async fn session(
        &self,
        conn: &Arc<Connection>,
        layout: &Layout,
        mode: Mode,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        (ready, progress): (oneshot::Sender<()>, Arc<AtomicU64>),
    ) -> Result<SessionEnd> {
        let Mode {
            first,
            careful,
            stall_after,
        } = mode;
        let s = &self.settings;
        let cs = &s.consumer;
        let publisher = match Publisher::with_connection(
            conn.clone(),
            layout.clone(),
            s.precision,
            s.publisher.clone(),
        )
        .await
        {
            Ok(p) => Arc::new(p.with_cancel_settings(s.cancel.clone())),
            Err(e @ (Error::Amqp { .. } | Error::Connect { .. } | Error::Timeout { .. })) => {
                return Ok(SessionEnd::Lost(e));
            }
            Err(e) => return Err(e),
        };
        for (q, _) in &self.subscriptions {
            if broker::queue_state(conn, q).await?.is_none() {
                if first {
                    return Err(Error::Invalid(format!(
                        "queue '{q}' does not exist; declare it (and schedule messages to it) first"
                    )));
                }
                tracing::warn!(queue = %q, "the queue is gone; consuming the others and waiting for it");
            }
        }
        // cancellations first: nothing runs before every tombstone so far has been read
        let mut follow = FollowOptions::new(
            Duration::from_millis(s.cancel.notice.as_millis()),
            s.cancel.horizon.as_millis(),
        );
        follow.progress = Some(progress);
        let cancels = match Cancellations::follow_with(conn, layout, follow).await {
            Ok(c) => Arc::new(c),
            Err(e @ (Error::Amqp { .. } | Error::Timeout { .. } | Error::Invalid(_))) => {
                return Ok(SessionEnd::Lost(e));
            }
            Err(e) => return Err(e),
        };
        let ctx = Arc::new(process::TaskCtx {
            cancels,
            publisher: publisher.clone(),
            settings: cs.clone(),
            layout: layout.clone(),
            counters: self.counters.clone(),
            business: Arc::new(Semaphore::new(cs.concurrency)),
            io: Arc::new(Semaphore::new(cs.io_concurrency)),
            stopping: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        });
        let (resub_tx, mut resub_rx) = mpsc::unbounded_channel::<usize>();
        let mut deliveries: SelectAll<BoxStream<'static, Tagged>> = SelectAll::new();
        let mut channels: Vec<Option<(Channel, lapin::types::ShortString)>> =
            vec![None; self.subscriptions.len()];
        // every channel's acks, to flush before a stopping worker closes them
        let mut all_acks: Vec<Arc<acks::Acks>> = Vec::new();
        for (i, slot) in channels.iter_mut().enumerate() {
            match self.subscribe_one(conn, layout, i, careful).await? {
                Some((ch, tag, a, stream)) => {
                    *slot = Some((ch, tag));
                    all_acks.push(a);
                    deliveries.push(stream);
                }
                None => spawn_wait_for_queue(conn, &self.subscriptions[i].0, i, &resub_tx),
            }
        }
        tracing::info!(
            queues = ?self.subscriptions.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>(),
            prefetch = cs.prefetch,
            concurrency = cs.concurrency,
            "worker consuming"
        );
        crate::metrics::global().connected.set(1);
        let _ = ready.send(());
        let mut tasks = JoinSet::new();
        let careful_over = tokio::time::sleep(if careful {
            CAREFUL_FOR
        } else {
            Duration::MAX / 4
        });
        tokio::pin!(careful_over);
        // when each subscription last brought a message (or was made)
        let mut last_delivery = vec![Instant::now(); self.subscriptions.len()];
        let mut stall_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + STALL_CHECK, STALL_CHECK);
        // a follower whose control stream consumer ended cannot check cancellations: every
        // message would go back to the queue; a new session follows the stream anew
        let mut follower_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + FOLLOWER_CHECK, FOLLOWER_CHECK);
        let end = loop {
            while tasks.try_join_next().is_some() {}
            tokio::select! {
                _ = shutdown.as_mut() => break SessionEnd::Stopped,
                _ = &mut careful_over, if careful => break SessionEnd::Careful,
                _ = follower_tick.tick() => {
                    if let Some(why) = ctx.cancels.broken() {
                        break SessionEnd::Lost(Error::Invalid(format!(
                            "the control stream follower stopped ({why})"
                        )));
                    }
                }
                _ = stall_tick.tick() => {
                    let idle = tasks.is_empty();
                    // the loop waits for this check: a broker that stops answering it ends
                    // the session rather than freezing it
                    let check = self.stalled(conn, &channels, &mut last_delivery, stall_after, idle);
                    let checked = tokio::time::timeout(STALL_CHECK_TIMEOUT, check)
                        .await
                        .unwrap_or_else(|_| Err(Error::Timeout {
                            context: "checking the consumed queues".into(),
                            timeout_ms: STALL_CHECK_TIMEOUT.as_millis() as u64,
                        }));
                    match checked {
                        Ok(None) => {}
                        Ok(Some(e)) => {
                            self.counters.stalled.fetch_add(1, Ordering::Relaxed);
                            break SessionEnd::Lost(e);
                        }
                        Err(e) => break SessionEnd::Lost(e),
                    }
                }
                Some(i) = resub_rx.recv() => {
                    match self.subscribe_one(conn, layout, i, careful).await {
                        Ok(Some((ch, tag, a, stream))) => {
                            tracing::info!(queue = %self.subscriptions[i].0, "the queue is back; consuming it again");
                            channels[i] = Some((ch, tag));
                            all_acks.push(a);
                            last_delivery[i] = Instant::now();
                            deliveries.push(stream);
                        }
                        Ok(None) => spawn_wait_for_queue(conn, &self.subscriptions[i].0, i, &resub_tx),
                        Err(e) => break SessionEnd::Lost(e),
                    }
                }
                next = deliveries.next(), if !deliveries.is_empty() => match next {
                    Some((i, Some((acks, Ok(d))))) => {
                        last_delivery[i] = Instant::now();
                        let (queue, handler) = self.subscriptions[i].clone();
                        tracing::trace!(%queue, tag = d.delivery_tag, redelivered = d.redelivered, in_flight = tasks.len(), "delivery");
                        let settle = acks.received(d.delivery_tag, d.acker.clone());
                        let ctx = ctx.clone();
                        tasks.spawn(async move {
                            process::delivery(d, settle, &queue, &*handler, &ctx).await;
                        });
                    }
                    Some((i, Some((_, Err(e))))) => {
                        break SessionEnd::Lost(Error::Amqp {
                            context: format!("consuming '{}'", self.subscriptions[i].0),
                            source: e,
                        });
                    }
                    Some((i, None)) => {
                        let queue = &self.subscriptions[i].0;
                        if !conn.status().connected() {
                            break SessionEnd::Lost(Error::ConsumerCancelled { queue: queue.clone() });
                        }
                        tracing::warn!(
                            queue = %queue,
                            "the consumer was cancelled (queue deleted?); waiting for the queue to come back"
                        );
                        if let Some((ch, _)) = channels[i].take() {
                            broker::close(&ch, "consumer cancelled").await;
                        }
                        spawn_wait_for_queue(conn, queue, i, &resub_tx);
                    }
                    None => {}
                },
            }
        };
        crate::metrics::global().connected.set(0);
        if let SessionEnd::Stopped | SessionEnd::Careful = end {
            ctx.stopping.store(true, Ordering::Relaxed);
            for (ch, tag) in channels.iter().flatten() {
                let _ = ch
                    .basic_cancel(tag.clone(), BasicCancelOptions::default())
                    .await;
            }
            let grace = Duration::from_millis(cs.shutdown_grace.as_millis());
            while tasks.try_join_next().is_some() {}
            if let SessionEnd::Stopped = end {
                tracing::info!(
                    in_flight = tasks.len(),
                    ?grace,
                    "stopping: waiting for in-flight handlers"
                );
            }
            let drained =
                tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} })
                    .await;
            if drained.is_err() {
                tracing::warn!(
                    unfinished = tasks.len(),
                    "shutdown grace over: unfinished messages go back to the queue"
                );
                tasks.abort_all();
            }
            for a in &all_acks {
                a.flush(true).await;
            }
            let c = &self.counters;
            if let SessionEnd::Stopped = end {
                tracing::info!(
                    succeeded = c.succeeded.load(Ordering::Relaxed),
                    retried = c.retried.load(Ordering::Relaxed),
                    parked = c.parked.load(Ordering::Relaxed),
                    cancelled = c.cancelled.load(Ordering::Relaxed),
                    "worker stopped"
                );
            }
        } else {
            tasks.abort_all();
        }
        for (ch, _) in channels.iter().flatten() {
            broker::close(ch, "bye").await;
        }
        drop(ctx);
        if let Ok(p) = Arc::try_unwrap(publisher) {
            p.close().await;
        }
        Ok(end)
    }

    /// With no message in hand: the first subscription that brought nothing for `after`
    /// ([`STALL_AFTER`] and up) while its queue has ready messages, as
    /// [`Error::ConsumerStalled`]. A queue found without ready messages counts as active
    /// again, so an idle worker asks about each queue once per `after`, not every check.
    async fn stalled(
        &self,
        conn: &Connection,
        channels: &[Option<(Channel, lapin::types::ShortString)>],
        last_delivery: &mut [Instant],
        after: Duration,
        idle_worker: bool,
    ) -> Result<Option<Error>> {
        for (i, slot) in channels.iter().enumerate() {
            let idle = last_delivery[i].elapsed();
            let Some((ch, tag)) = slot else { continue };
            if idle < STALL_CHECK {
                continue;
            }
            let queue = &self.subscriptions[i].0;
            match broker::queue_state(conn, queue).await? {
                None => {
                    // The broker's cancel for a deleted queue did not reach us (seen with a
                    // quorum queue deleted from another cluster node): end the consumer
                    // ourselves, which ends its stream and starts waiting for the queue.
                    tracing::warn!(
                        queue = %queue,
                        "the queue no longer exists but its consumer was not cancelled; cancelling it"
                    );
                    let cancel = ch.basic_cancel(tag.clone(), BasicCancelOptions::default());
                    if !matches!(
                        tokio::time::timeout(CANCEL_TIMEOUT, cancel).await,
                        Ok(Ok(()))
                    ) {
                        broker::close(ch, "queue deleted").await;
                    }
                }
                Some(state) if idle_worker && idle >= after && state.ready > 0 => {
                    return Ok(Some(Error::ConsumerStalled {
                        queue: queue.clone(),
                        ready: state.ready,
                        idle_ms: idle.as_millis() as u64,
                    }));
                }
                Some(_) if idle >= after => last_delivery[i] = Instant::now(),
                Some(_) => {}
            }
        }
        Ok(None)
    }

    /// Declares what consuming queue `i` needs (its parking queue, its batch marker) and starts
    /// consuming it on a channel of its own. `None` when the queue does not exist.
    async fn subscribe_one(
        &self,
        conn: &Connection,
        layout: &Layout,
        i: usize,
        careful: bool,
    ) -> Result<
        Option<(
            Channel,
            lapin::types::ShortString,
            Arc<acks::Acks>,
            BoxStream<'static, Tagged>,
        )>,
    > {
        let (q, handler) = &self.subscriptions[i];
        if broker::queue_state(conn, q).await?.is_none() {
            return Ok(None);
        }
        let ch = broker::open(conn).await?;
        declare_parking(conn, layout, q).await?;
        if let Err(e) = Topology::new(layout.clone())
            .declare_batch_marker(conn, q)
            .await
        {
            // publishers then send plain messages, which work too
            tracing::info!(queue = %q, "publishers will send plain messages: {}", crate::error::chain(&e));
        }
        let cs = &self.settings.consumer;
        let prefetch = if careful {
            1
        } else if handler.io_bound() {
            u16::try_from(cs.io_concurrency).unwrap_or(u16::MAX)
        } else {
            cs.prefetch
        };
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .context(|| "setting prefetch".into())?;
        let consumer = match ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(c) => c,
            // deleted between the check and the consume
            Err(e) if broker::is_reply(&e, broker::NOT_FOUND) => return Ok(None),
            Err(e) => return Err(e).context(|| format!("consuming '{q}'")),
        };
        let tag = consumer.tag();
        let acks = acks::Acks::new(q, prefetch);
        // A consumer's stream ends when the broker cancels it: say which one ended.
        let ended = futures::stream::once(async move { (i, None) });
        let each = acks.clone();
        let stream = consumer
            .map(move |d| (i, Some((each.clone(), d))))
            .chain(ended)
            .boxed();
        Ok(Some((ch, tag, acks, stream)))
    }
}

/// Waits until the session says it consumes (`true`; also when it ended before) or until it
/// made no progress for [`SETUP_TIMEOUT`] (`false`).
async fn setup_watchdog(ready: oneshot::Receiver<()>, progress: &AtomicU64) -> bool {
    let mut ready = std::pin::pin!(ready);
    let mut seen = progress.load(Ordering::Relaxed);
    let mut moved = Instant::now();
    loop {
        tokio::select! {
            _ = &mut ready => return true,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                let now = progress.load(Ordering::Relaxed);
                if now != seen {
                    seen = now;
                    moved = Instant::now();
                } else if moved.elapsed() >= SETUP_TIMEOUT {
                    return false;
                }
            }
        }
    }
}

/// Polls until `queue` exists again, then asks the session to subscribe `i` anew.
fn spawn_wait_for_queue(
    conn: &Arc<Connection>,
    queue: &str,
    i: usize,
    resub: &mpsc::UnboundedSender<usize>,
) {
    let conn = conn.clone();
    let queue = queue.to_string();
    let resub = resub.clone();
    tokio::spawn(async move {
        let mut pause = Duration::from_millis(250);
        while conn.status().connected() && !resub.is_closed() {
            tokio::time::sleep(pause).await;
            match broker::queue_state(&conn, &queue).await {
                Ok(Some(_)) => {
                    let _ = resub.send(i);
                    return;
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(%queue, "checking the queue: {e}"),
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
}

async fn declare_parking(conn: &Connection, layout: &Layout, q: &str) -> Result<()> {
    Topology::new(layout.clone()).declare_parking(conn, q).await
}
