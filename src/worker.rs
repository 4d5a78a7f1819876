//! The worker: consumes destination queues with bounded prefetch and concurrency, runs a
//! [`Handler`] on each due message, acks after success, re-schedules retryable failures through
//! the tiers with backoff (acking the original only after the broker confirmed the copy), parks
//! permanent failures and exhausted retries in `<prefix>.parked.<queue>` with the reason, shuts
//! down gracefully and reconnects after a connection loss.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection};
use rand::Rng;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::broker;
use crate::envelope::{self, Delivery};
use crate::error::{Error, Result, ResultExt};
use crate::headers;
use crate::layout::Layout;
use crate::message::Message;
use crate::publisher::Publisher;
use crate::settings::{ConsumerSettings, Settings};
use crate::time::now_ms;

/// What a handler decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done: the message is acked.
    Success,
    /// Failed, try again later (re-scheduled with backoff until `max_attempts`).
    Retry(String),
    /// Failed for good: parked with the reason.
    Permanent(String),
    /// Not processed now: the message goes back to its queue unchanged (nack with requeue after
    /// a 1 s pause) and is delivered again. For a dependency that is down when a re-scheduled,
    /// modified copy would be wrong (the gateway's ingress). No attempt is counted.
    Requeue(String),
}

/// Business logic run on every due message. Must be idempotent: delivery is at-least-once.
pub trait Handler: Send + Sync + 'static {
    /// Processes one due message and says what to do with it.
    fn handle(&self, delivery: &Delivery, ctx: &Context) -> impl Future<Output = Outcome> + Send;
}

/// What a handler may use besides the message: the worker's confirmed publisher (to forward
/// or schedule follow-up messages on the worker's connection).
pub struct Context {
    publisher: Arc<Publisher>,
}

impl Context {
    /// The worker's confirmed publisher.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }
}

/// Counters of what a worker did, readable while it runs.
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
}

/// Runs handlers over destination queues.
pub struct Worker<H: Handler> {
    settings: Settings,
    subscriptions: Vec<(String, Arc<H>)>,
    counters: Arc<Counters>,
}

enum SessionEnd {
    Stopped,
    Lost(Error),
}

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
    /// Returns an error only for problems a reconnect cannot fix (missing topology or queue,
    /// invalid settings).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        if self.subscriptions.is_empty() {
            return Err(Error::Invalid("the worker has no queue to consume".into()));
        }
        self.settings.consumer.validate().map_err(Error::Invalid)?;
        let layout = self
            .settings
            .layout()
            .map_err(crate::settings::SettingsError::from)?;
        for (q, _) in &self.subscriptions {
            layout.validate_destination(q).map_err(Error::Invalid)?;
        }
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = Duration::from_millis(500);
        let conn_name = format!("amqp-delay worker {}", self.settings.prefix);
        loop {
            let conn = tokio::select! {
                c = crate::connection::connect(&self.settings.url, &conn_name) => c,
                _ = &mut shutdown => return Ok(()),
            };
            let outcome = match conn {
                Ok(conn) => {
                    let conn = Arc::new(conn);
                    backoff = Duration::from_millis(500);
                    let end = self.session(&conn, &mut shutdown).await;
                    let _ = conn.close(200, "bye".into()).await;
                    end
                }
                Err(e) => Ok(SessionEnd::Lost(e)),
            };
            match outcome {
                Ok(SessionEnd::Stopped) => return Ok(()),
                Ok(SessionEnd::Lost(e)) => {
                    tracing::warn!(
                        "connection lost or refused: {}; reconnecting in {:?}",
                        crate::error::chain(&e),
                        backoff
                    );
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {},
                _ = &mut shutdown => return Ok(()),
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    }

    /// One connection's worth of work. `Err` = fatal, `Lost` = reconnect.
    async fn session(
        &self,
        conn: &Arc<Connection>,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<SessionEnd> {
        let s = &self.settings;
        let cs = &s.consumer;
        let layout = s.layout().map_err(crate::settings::SettingsError::from)?;
        let publisher = match Publisher::with_connection(
            conn.clone(),
            layout.clone(),
            s.precision,
            s.publisher.clone(),
        )
        .await
        {
            Ok(p) => Arc::new(p),
            Err(e @ (Error::Amqp { .. } | Error::Connect { .. })) => {
                return Ok(SessionEnd::Lost(e));
            }
            Err(e) => return Err(e),
        };
        let ch = conn
            .create_channel()
            .await
            .context(|| "opening the consume channel".into())?;
        for (q, _) in &self.subscriptions {
            check_queue_exists(conn, q).await?;
            declare_parking(&ch, &layout, q).await?;
        }
        ch.basic_qos(cs.prefetch, BasicQosOptions::default())
            .await
            .context(|| "setting prefetch".into())?;
        let mut streams = Vec::new();
        let mut tags = Vec::new();
        for (i, (q, _)) in self.subscriptions.iter().enumerate() {
            let consumer = ch
                .basic_consume(
                    q.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .context(|| format!("consuming '{q}'"))?;
            tags.push(consumer.tag().clone());
            // A consumer's stream ends when the broker cancels it: say which one ended.
            let ended = futures::stream::once(async move { (i, None) });
            streams.push(consumer.map(move |d| (i, Some(d))).chain(ended).boxed());
        }
        tracing::info!(
            queues = ?self.subscriptions.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>(),
            prefetch = cs.prefetch,
            concurrency = cs.concurrency,
            "worker consuming"
        );
        let mut deliveries = futures::stream::select_all(streams);
        let permits = Arc::new(Semaphore::new(cs.concurrency));
        let mut tasks = JoinSet::new();
        let end = loop {
            while tasks.try_join_next().is_some() {}
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => p.expect("semaphore open"),
                _ = shutdown.as_mut() => break SessionEnd::Stopped,
            };
            let next = tokio::select! {
                d = deliveries.next() => d,
                _ = shutdown.as_mut() => break SessionEnd::Stopped,
            };
            match next {
                Some((i, Some(Ok(d)))) => {
                    let (queue, handler) = self.subscriptions[i].clone();
                    let ctx = TaskCtx {
                        publisher: publisher.clone(),
                        settings: cs.clone(),
                        layout: layout.clone(),
                        counters: self.counters.clone(),
                    };
                    tasks.spawn(async move {
                        process(d, &queue, &*handler, &ctx).await;
                        drop(permit);
                    });
                }
                Some((i, Some(Err(e)))) => {
                    break SessionEnd::Lost(Error::Amqp {
                        context: format!("consuming '{}'", self.subscriptions[i].0),
                        source: e,
                    });
                }
                Some((i, None)) => {
                    break SessionEnd::Lost(Error::ConsumerCancelled {
                        queue: self.subscriptions[i].0.clone(),
                    });
                }
                None => {
                    break SessionEnd::Lost(Error::Invalid(
                        "every consumer of this worker ended".into(),
                    ));
                }
            }
        };
        if let SessionEnd::Stopped = end {
            for t in &tags {
                let _ = ch
                    .basic_cancel(t.clone(), BasicCancelOptions::default())
                    .await;
            }
            let grace = Duration::from_millis(cs.shutdown_grace.as_millis());
            while tasks.try_join_next().is_some() {}
            tracing::info!(
                in_flight = tasks.len(),
                ?grace,
                "stopping: waiting for in-flight handlers"
            );
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
            let c = &self.counters;
            tracing::info!(
                succeeded = c.succeeded.load(Ordering::Relaxed),
                retried = c.retried.load(Ordering::Relaxed),
                parked = c.parked.load(Ordering::Relaxed),
                "worker stopped"
            );
        } else {
            tasks.abort_all();
        }
        let _ = ch.close(200, "bye".into()).await;
        if let Ok(p) = Arc::try_unwrap(publisher) {
            p.close().await;
        }
        Ok(end)
    }
}

struct TaskCtx {
    publisher: Arc<Publisher>,
    settings: ConsumerSettings,
    layout: Layout,
    counters: Arc<Counters>,
}

async fn check_queue_exists(conn: &Connection, q: &str) -> Result<()> {
    match broker::queue_state(conn, q).await? {
        Some(_) => Ok(()),
        None => Err(Error::Invalid(format!(
            "queue '{q}' does not exist; declare it (and schedule messages to it) first"
        ))),
    }
}

async fn declare_parking(ch: &Channel, layout: &Layout, q: &str) -> Result<()> {
    let name = layout.parked_queue(q);
    if name.len() > 255 {
        return Err(Error::Invalid(format!(
            "parking queue name for '{q}' would be longer than 255 bytes"
        )));
    }
    broker::declare_queue(ch, &name, broker::queue_type_args(layout.queue_type())).await
}

/// Handles one delivery end to end. Never panics on bad input; on an error it cannot resolve
/// (publisher down) it returns the message to the queue.
async fn process<H: Handler>(
    raw: lapin::message::Delivery,
    queue: &str,
    handler: &H,
    ctx: &TaskCtx,
) {
    let redelivered = raw.redelivered;
    if redelivered {
        ctx.counters.redelivered.fetch_add(1, Ordering::Relaxed);
    }
    let acker = raw.acker.clone();
    let decoded = envelope::decode(
        queue,
        raw.data,
        raw.properties,
        raw.routing_key.as_str(),
        raw.exchange.as_str(),
        redelivered,
    );
    let (delivery, result) = match decoded {
        (d, Some(reason)) => {
            tracing::warn!(queue, id = %d.message_id, %reason, "parking a message with an invalid envelope");
            let r = park(&d, &reason, ctx).await;
            (d, r.map(|_| "parked"))
        }
        (d, None) => {
            let timeout = Duration::from_millis(ctx.settings.handler_timeout.as_millis());
            let hctx = Context {
                publisher: ctx.publisher.clone(),
            };
            let outcome = match tokio::time::timeout(timeout, handler.handle(&d, &hctx)).await {
                Ok(o) => o,
                Err(_) => Outcome::Retry(format!(
                    "handler timed out after {}",
                    ctx.settings.handler_timeout
                )),
            };
            let r = match &outcome {
                Outcome::Success => {
                    ctx.counters.succeeded.fetch_add(1, Ordering::Relaxed);
                    Ok("succeeded")
                }
                Outcome::Retry(reason) if ctx.settings.retry.may_retry(d.attempt) => {
                    reschedule(&d, reason, ctx).await.map(|_| "retried")
                }
                Outcome::Retry(reason) => {
                    let why = format!(
                        "gave up after {} attempts; last error: {reason}",
                        d.attempt + 1
                    );
                    park(&d, &why, ctx).await.map(|_| "parked")
                }
                Outcome::Permanent(reason) => park(&d, reason, ctx).await.map(|_| "parked"),
                Outcome::Requeue(reason) => Err(Error::Requeued {
                    reason: reason.clone(),
                }),
            };
            (d, r)
        }
    };
    match result {
        Ok(what) => {
            tracing::debug!(queue, id = %delivery.message_id, attempt = delivery.attempt, what, "done");
            if let Err(e) = acker.ack(BasicAckOptions::default()).await {
                tracing::warn!(queue, id = %delivery.message_id, "ack failed ({e}); the broker will redeliver it");
            }
        }
        Err(e) => {
            // Could not re-schedule or park: give it back so nothing is lost; a short pause
            // keeps a persistent failure from becoming a hot loop.
            tracing::error!(queue, id = %delivery.message_id, "{}; returning the message to the queue", crate::error::chain(&e));
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await;
        }
    }
}

async fn reschedule(d: &Delivery, reason: &str, ctx: &TaskCtx) -> Result<()> {
    let random: f64 = rand::rng().random();
    let delay = ctx.settings.retry.backoff_ms(d.attempt, random);
    let props = envelope::republish_properties(
        &d.properties,
        envelope::headers_for_reschedule(d.headers()),
    );
    let msg = Message::new(d.queue.clone(), delay, d.body.clone())
        .with_properties(props)
        .with_attempt(d.attempt + 1);
    ctx.publisher.schedule(msg).await?;
    ctx.counters.retried.fetch_add(1, Ordering::Relaxed);
    tracing::info!(queue = %d.queue, id = %d.message_id, attempt = d.attempt, delay_ms = delay, %reason, "retry scheduled");
    Ok(())
}

async fn park(d: &Delivery, reason: &str, ctx: &TaskCtx) -> Result<()> {
    let empty = FieldTable::default();
    let mut h = headers::strip_death(d.headers().unwrap_or(&empty));
    h.insert(
        headers::PARKED_REASON.into(),
        AMQPValue::LongString(LongString::from(reason)),
    );
    h.insert(
        headers::PARKED_AT.into(),
        AMQPValue::LongLongInt(now_ms() as i64),
    );
    h.insert(
        headers::PARKED_ATTEMPTS.into(),
        AMQPValue::LongLongInt(i64::from(d.attempt) + 1),
    );
    h.insert(
        headers::PARKED_FROM.into(),
        AMQPValue::LongString(LongString::from(d.queue.as_str())),
    );
    let props = envelope::republish_properties(&d.properties, h).with_delivery_mode(2);
    let target = ctx.layout.parked_queue(&d.queue);
    ctx.publisher
        .publish_confirmed("", &target, &d.body, props)
        .await?;
    ctx.counters.parked.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(queue = %d.queue, id = %d.message_id, parked_in = %target, %reason, "message parked");
    Ok(())
}
