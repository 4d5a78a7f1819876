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
mod counters;
mod hold;
mod in_hand;
mod process;
mod session;
mod trusted;

pub use counters::Counters;
pub(crate) use counters::Event;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::Connection;
use tokio::sync::oneshot;

use crate::broker;
use crate::cancel::Cancellations;
use crate::envelope::Delivery;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::publisher::Publisher;
use crate::settings::Settings;
use crate::trust::Trust;

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

    /// When a message without amqp-delay's own due time falls due, for a handler whose
    /// messages carry a delay of their own (the gateway's ingress: a short `x-delay`, see
    /// `gateway.hold`). Asked once, as the message arrives; the worker then holds it (unacked)
    /// until that time exactly as it holds an early grain batch, with the cancel check done
    /// while it waits, and the handler sees it with [`Delivery::due_at_ms`] set. `None` (the
    /// default): the message runs as it arrives.
    fn due_at(&self, delivery: &Delivery) -> Option<u64> {
        let _ = delivery;
        None
    }

    /// Whether running this message takes one of the handler permits (`consumer.concurrency`,
    /// or `consumer.io_concurrency` when [`Handler::io_bound`]). `true` (the default) for a
    /// handler that works while it runs. A handler that mostly waits for the worker's
    /// publisher to gather a batch and have it confirmed (the gateway's ingress, which moves
    /// messages into the tiers) answers `false`: a permit held through that wait would cap
    /// its throughput at the permits over the wait, whatever the machine. Its messages are
    /// then bounded by the prefetch alone (every one of them is a delivery in hand).
    fn takes_permit(&self, delivery: &Delivery) -> bool {
        let _ = delivery;
        true
    }
}

/// What a handler may use besides the message: the worker's confirmed publisher (to forward
/// or schedule follow-up messages on the worker's connection) and its view of the cancels.
pub struct Context {
    publisher: Arc<Publisher>,
    cancels: Arc<Cancellations>,
    trust: Arc<Trust>,
}

impl Context {
    /// The worker's confirmed publisher.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Whether `d`, due at `due_at_ms`, has been cancelled (by its owner or an admin), after
    /// reading every cancel that matters for it (those confirmed `cancel.notice` before the
    /// due time), as the worker does before it runs a handler. For a handler that checks again
    /// for an owner of its own (the gateway's copy of an application's message); it then
    /// returns [`Outcome::Cancelled`]. An error when the control stream cannot be read.
    pub async fn is_cancelled(&self, d: &Delivery, due_at_ms: u64) -> Result<bool> {
        self.is_cancelled_as(&d.message_id, d.owner.as_deref(), due_at_ms)
            .await
    }

    /// [`Context::is_cancelled`] for the message `id` owned by `owner`.
    pub async fn is_cancelled_as(
        &self,
        id: &str,
        owner: Option<&str>,
        due_at_ms: u64,
    ) -> Result<bool> {
        self.cancels.sync_for(Some(due_at_ms)).await?;
        Ok(self.cancels.is_cancelled(id, owner))
    }

    /// What the message `s` is to do by the cancels, purges and reschedules read so far
    /// (call [`Context::is_cancelled_as`] first for the guarantee: it syncs).
    pub fn steer(&self, s: &crate::cancel::Subject<'_>) -> crate::cancel::Steer {
        self.cancels.steer(s)
    }

    /// Whose records and messages count for what ([`crate::trust`]).
    pub fn trust(&self) -> &Trust {
        &self.trust
    }
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
/// Frame errors in a row after which the worker reconnects at once: the broker is fine, a
/// message is too large, and each return brings it nearer its queue's delivery limit (20 on
/// RabbitMQ 4.x). Past them, the usual backoff (something else is wrong).
const FAST_RECONNECTS: u32 = 25;

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

/// How long one stall check (passive declares of the idle queues, perhaps a channel closed) may
/// take before the session gives up on the connection.
const STALL_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

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
        let layout = self.checked_layout()?;
        let connector = crate::connection::Connector::new(&self.settings)?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = crate::connection::Backoff::default();
        let conn_name = format!("amqp-delay worker {}", self.settings.prefix);
        let mut first = true;
        // after a frame too large: one message at a time, so that only that message is
        // redelivered (and counted against the queue's delivery limit, which parks it)
        let mut careful = false;
        let mut stall_after = STALL_AFTER;
        let mut frame_errors = 0u32;
        loop {
            let conn = tokio::select! {
                c = connector.connect(&conn_name) => c,
                _ = &mut shutdown => return Ok(()),
            };
            let outcome = match conn {
                Ok(conn) => {
                    backoff.reset();
                    let mode = Mode {
                        first,
                        careful,
                        stall_after,
                    };
                    let end = self
                        .watched_session(conn, &layout, mode, &mut shutdown)
                        .await;
                    if let Ok(SessionEnd::Lost(_)) = end {
                        first = false;
                    }
                    end
                }
                Err(e) => Ok(SessionEnd::Lost(e)),
            };
            // a stream's record over frame_max is found and passed by its reader
            careful = matches!(&outcome, Ok(SessionEnd::Lost(e))
                if is_frame_error(e) && !crate::stream_log::is_record_over_frame_max(e));
            stall_after = match &outcome {
                Ok(SessionEnd::Lost(Error::ConsumerStalled { .. })) => {
                    (stall_after * 2).min(STALL_AFTER_MAX)
                }
                _ => STALL_AFTER,
            };
            frame_errors = if careful { frame_errors + 1 } else { 0 };
            if frame_errors == 1 {
                warn_careful();
            }
            let pause = if careful && frame_errors <= FAST_RECONNECTS {
                Duration::ZERO
            } else {
                backoff.next_pause()
            };
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

    /// The layout, once the settings and every subscribed queue are known to be usable.
    fn checked_layout(&self) -> Result<Layout> {
        if self.subscriptions.is_empty() {
            return Err(Error::Invalid("the worker has no queue to consume".into()));
        }
        self.settings.consumer.validate().map_err(Error::config)?;
        let layout = self.settings.layout()?;
        for (q, _) in &self.subscriptions {
            layout.validate_destination(q).map_err(Error::Invalid)?;
        }
        Ok(layout)
    }

    /// A session on `conn` under the start-up watchdog, then the connection closed.
    async fn watched_session(
        &self,
        conn: Connection,
        layout: &Layout,
        mode: Mode,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<SessionEnd> {
        let conn = Arc::new(conn);
        let (ready_tx, ready_rx) = oneshot::channel::<()>();
        let progress = Arc::new(AtomicU64::new(0));
        let session = self.session(&conn, layout, mode, shutdown, (ready_tx, progress.clone()));
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
        end
    }

    /// One connection's worth of work. `Err` = fatal, `Lost` = reconnect.
    async fn session(
        &self,
        conn: &Arc<Connection>,
        layout: &Layout,
        mode: Mode,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        started: (oneshot::Sender<()>, Arc<AtomicU64>),
    ) -> Result<SessionEnd> {
        session::run(self, conn, layout, mode, shutdown, started).await
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

/// After a frame too large: says why the worker now consumes one message at a time.
fn warn_careful() {
    tracing::error!(
        "a message in one of the queues is larger than the connection's frame_max (its headers \
         grew on the way) and cannot be received; consuming one message at a time for \
         {CAREFUL_FOR:?} so that only it is redelivered. A quorum queue's delivery limit then \
         parks it (20 by default on RabbitMQ 4.x; on 3.x set a `delivery-limit` policy on the \
         queue), or remove it by hand"
    );
}
