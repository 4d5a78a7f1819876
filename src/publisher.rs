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
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::batch::{self, Candidate, Limits};
use crate::broker::{self, ACCESS_REFUSED, NOT_FOUND};
use crate::cancel::{Cancelled, tombstone};
use crate::control::Record;
use crate::error::{Error, Result, ResultExt};
use crate::headers;
use crate::layout::Layout;
use crate::message::{Message, Scheduled};
use crate::planner::{self, Precision, Route};
use crate::settings::{CancelSettings, PublisherSettings, Settings};
use crate::time::now_ms;
use crate::topology::Topology;

/// Schedules messages. Cheap to share (`&Publisher` from many tasks); publishes are pipelined.
pub struct Publisher {
    inner: Arc<Inner>,
    /// What a cancel promises and how long its tombstone lives.
    cancel: CancelSettings,
    /// Feeds the batcher task (`None` when batching is off).
    batcher: Option<mpsc::UnboundedSender<Vec<Prepared>>>,
    batcher_task: Option<tokio::task::JoinHandle<()>>,
}

struct Inner {
    conn: tokio::sync::RwLock<Arc<Connection>>,
    /// Where to reconnect to; `Some` when the publisher opened its connection itself (with
    /// [`Publisher::connect`]), so it also reconnects it after a loss.
    url: Option<crate::connection::Connector>,
    /// The confirm channel; replaced when the broker closed it (e.g. after a publish to a
    /// missing exchange), so one bad publish does not stop all later ones.
    channel: tokio::sync::RwLock<Channel>,
    admin: tokio::sync::Mutex<Option<Channel>>,
    layout: Layout,
    precision: Precision,
    settings: PublisherSettings,
    bound: Mutex<HashMap<String, Binding>>,
    /// Broker messages awaiting their confirm.
    in_flight: Semaphore,
    /// Publishes so far, to take turns over the shards of a fixed level.
    turn: std::sync::atomic::AtomicU64,
}

/// What the publisher knows of a destination, refreshed every `binding_cache_secs`.
#[derive(Debug, Clone, Copy)]
struct Binding {
    at: Instant,
    /// Its consumers read batches.
    batches: bool,
}

/// A validated message with its final properties, waiting to be published.
struct Prepared {
    destination: String,
    delay_ms: u64,
    due_at_ms: u64,
    /// Due time + lateness budget.
    deadline_ms: u64,
    message_id: String,
    properties: BasicProperties,
    body: Vec<u8>,
    reply: oneshot::Sender<Result<Scheduled>>,
}

impl Publisher {
    /// Connects with `settings` and checks that the topology is declared with the same shape.
    pub async fn connect(settings: &Settings) -> Result<Publisher> {
        let layout = settings.layout()?;
        let connector = crate::connection::Connector::new(settings)?;
        let conn = Arc::new(connector.connect(CONNECTION_NAME).await?);
        let built = Publisher::build(
            conn.clone(),
            Some(connector),
            layout,
            settings.precision,
            settings.publisher.clone(),
        )
        .await;
        match built {
            Ok(p) => Ok(p.with_cancel_settings(settings.cancel.clone())),
            Err(e) => {
                let _ = conn.close(200, "bye".into()).await;
                Err(e)
            }
        }
    }

    /// Uses these cancel settings (the default: `cancel` of [`Settings::default`]).
    pub fn with_cancel_settings(mut self, cancel: CancelSettings) -> Self {
        self.cancel = cancel;
        self
    }

    /// Cancels message `id`: records a tombstone in the control stream and returns once the
    /// broker confirmed it. From then on no worker, gateway or relay runs or forwards the
    /// message. With its due time (from [`Scheduled`]) the tombstone is forgotten sooner and the
    /// answer says whether the cancel is certain to win (see [`crate::cancel`]).
    pub async fn cancel(&self, id: &str, due_at_ms: Option<u64>) -> Result<Cancelled> {
        if id.is_empty() || id.len() > 255 {
            return Err(Error::Invalid("a message id is 1 to 255 bytes".into()));
        }
        let (record, verdict) = tombstone(
            id,
            due_at_ms,
            now_ms(),
            self.inner.layout.max_delay_ms(),
            self.cancel.notice.as_millis(),
            self.cancel.horizon.as_millis(),
        );
        let until_ms = match &record {
            Record::Cancel { until_ms, .. } => *until_ms,
            _ => 0,
        };
        let stream = self.inner.layout.control_stream();
        self.inner
            .publish_confirmed(
                "",
                &stream,
                &record.encode(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .map_err(|e| match e {
                Error::Returned { .. } => Error::NotDeclared {
                    prefix: self.inner.layout.prefix().to_string(),
                    detail: format!(": the control stream '{stream}' is missing"),
                },
                e => e,
            })?;
        Ok(Cancelled {
            id: id.to_string(),
            until_ms,
            verdict,
        })
    }

    /// [`Publisher::cancel`] of a message this publisher scheduled.
    pub async fn cancel_scheduled(&self, s: &Scheduled) -> Result<Cancelled> {
        self.cancel(&s.message_id, Some(s.due_at_ms)).await
    }

    /// Cancels many: up to 1,000 tombstones travel in one record of the control stream, a few
    /// records awaiting their confirm at once. Results as they complete, with their tag.
    pub fn cancel_all<'a, T: Send + 'a>(
        &'a self,
        items: impl Stream<Item = (T, String, Option<u64>)> + 'a,
    ) -> impl Stream<Item = (T, Result<Cancelled>)> + 'a {
        items
            .ready_chunks(1_000)
            .map(move |chunk| self.cancel_chunk(chunk))
            .buffer_unordered(8)
            .flat_map(futures::stream::iter)
    }

    async fn cancel_chunk<T>(
        &self,
        chunk: Vec<(T, String, Option<u64>)>,
    ) -> Vec<(T, Result<Cancelled>)> {
        let now = now_ms();
        let mut out = Vec::with_capacity(chunk.len());
        let mut good = Vec::new();
        for (tag, id, due) in chunk {
            if id.is_empty() || id.len() > 255 {
                out.push((
                    tag,
                    Err(Error::Invalid("a message id is 1 to 255 bytes".into())),
                ));
                continue;
            }
            let (record, verdict) = tombstone(
                &id,
                due,
                now,
                self.inner.layout.max_delay_ms(),
                self.cancel.notice.as_millis(),
                self.cancel.horizon.as_millis(),
            );
            let until_ms = match record {
                Record::Cancel { until_ms, .. } => until_ms,
                _ => 0,
            };
            good.push((
                tag,
                Cancelled {
                    id,
                    until_ms,
                    verdict,
                },
            ));
        }
        if good.is_empty() {
            return out;
        }
        let record = Record::Cancels {
            items: good
                .iter()
                .map(|(_, c)| (c.id.clone(), c.until_ms))
                .collect(),
        };
        let stream = self.inner.layout.control_stream();
        let r = self
            .inner
            .publish_confirmed(
                "",
                &stream,
                &record.encode(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await;
        for (tag, c) in good {
            out.push((
                tag,
                match &r {
                    Ok(()) => Ok(c),
                    Err(e) => Err(e.duplicate()),
                },
            ));
        }
        out
    }

    /// Uses an existing connection (not closed by [`Publisher::close`]).
    pub async fn with_connection(
        conn: Arc<Connection>,
        layout: Layout,
        precision: Precision,
        settings: PublisherSettings,
    ) -> Result<Publisher> {
        Publisher::build(conn, None, layout, precision, settings).await
    }

    async fn build(
        conn: Arc<Connection>,
        url: Option<crate::connection::Connector>,
        layout: Layout,
        precision: Precision,
        settings: PublisherSettings,
    ) -> Result<Publisher> {
        settings.validate().map_err(Error::Invalid)?;
        Topology::new(layout.clone()).verify(&conn).await?;
        let channel = open_confirm_channel(&conn).await?;
        let inner = Arc::new(Inner {
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
        });
        let (batcher, batcher_task) = if inner.settings.batching() {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(run_batcher(inner.clone(), rx));
            (Some(tx), Some(task))
        } else {
            (None, None)
        };
        Ok(Publisher {
            inner,
            cancel: CancelSettings::default(),
            batcher,
            batcher_task,
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

    /// Schedules one message; returns once the broker has confirmed it (alone, or in a batch
    /// with concurrent calls to the same destination).
    pub async fn schedule(&self, msg: Message) -> Result<Scheduled> {
        let (tx, rx) = oneshot::channel();
        let (p, batches) = self.prepare(msg, tx).await?;
        match &self.batcher {
            Some(b) if batches => {
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
    /// value says whether the destination reads batches.
    async fn prepare(
        &self,
        msg: Message,
        reply: oneshot::Sender<Result<Scheduled>>,
    ) -> Result<(Prepared, bool)> {
        let inner = &self.inner;
        inner
            .layout
            .validate_destination(&msg.destination)
            .map_err(Error::Invalid)?;
        msg.check(inner.settings.max_message_bytes)
            .map_err(Error::Invalid)?;
        // a delay the topology cannot serve is refused before anything is published
        self.plan(msg.delay_ms)?;
        let caller_headers = msg.properties.headers().clone().unwrap_or_default();
        // the broker's history never travels again; a retry's previous schedule headers are
        // replaced by the ones set below
        let mut hdrs = headers::filter(&caller_headers, |k| {
            !headers::is_broker_header(k) && !headers::RESERVED.contains(&k)
        });
        let batches = inner.ensure_bound(&msg.destination).await?;

        let due_at_ms = now_ms() + msg.delay_ms;
        headers::set_schedule_headers(&mut hdrs, msg.delay_ms, due_at_ms, msg.attempt);
        let message_id = match msg.properties.message_id() {
            Some(id) => id.to_string(),
            None => uuid::Uuid::now_v7().to_string(),
        };
        let properties = msg
            .properties
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(hdrs);
        let budget = inner.precision.budget_ms(msg.delay_ms);
        Ok((
            Prepared {
                destination: msg.destination,
                delay_ms: msg.delay_ms,
                due_at_ms,
                deadline_ms: due_at_ms.saturating_add(budget),
                message_id,
                properties,
                body: msg.body,
                reply,
            },
            batches,
        ))
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
        let inner = &self.inner;
        let _ = inner.channel.read().await.close(200, "bye".into()).await;
        if let Some(c) = inner.admin.lock().await.take() {
            let _ = c.close(200, "bye".into()).await;
        }
        if inner.url.is_some() {
            let _ = inner.conn.read().await.close(200, "bye".into()).await;
        }
    }
}

/// Name of the connection a publisher opens itself.
const CONNECTION_NAME: &str = "amqp-delay publisher";

fn batcher_gone() -> Error {
    Error::Invalid("the publisher is closing; the message was not scheduled".into())
}

impl Inner {
    /// Publishes one message on its own, planned from now, and answers its caller too.
    async fn publish_alone(&self, p: Prepared) -> Result<Scheduled> {
        let now = now_ms();
        let r = self.publish_group(now, vec![p], None).await;
        r.into_iter().next().expect("one result")
    }

    /// Publishes `members` (one destination) as one broker message — alone when there is one,
    /// as a batch otherwise — planned in `window` (`None`: one message, planned from its own
    /// request), and answers every member's caller. Returns the results too.
    async fn publish_group(
        &self,
        now: u64,
        mut members: Vec<Prepared>,
        window: Option<(u64, u64)>,
    ) -> Vec<Result<Scheduled>> {
        // A message on its own is planned from its request, as if published when it was
        // prepared (publishing a moment later only makes it that much later); a group is
        // planned from now, within the window every member accepts.
        let earliest = match window {
            Some((e, _)) => e,
            None => members.iter().map(|m| m.due_at_ms).max().unwrap_or(now),
        };
        let planned = match window {
            None => planner::plan(&self.layout, &self.precision, members[0].delay_ms),
            Some((e, l)) => {
                let lo = e.saturating_sub(now);
                planner::plan_window(&self.layout, lo, l.saturating_sub(now).max(lo))
            }
        };
        let result = match planned {
            Err(e) => Err(Error::from(e)),
            Ok(route) => {
                let destination = members[0].destination.clone();
                let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let exchange = route.exchange_for(&self.layout, turn);
                let key = route.routing_key(&self.layout, &destination);
                let (body, props) = if members.len() == 1 {
                    let m = &mut members[0];
                    (std::mem::take(&mut m.body), m.properties.clone())
                } else {
                    self.batch_message(&members, &route, earliest)
                };
                let _permit = self.in_flight.acquire().await.expect("never closed");
                self.publish_confirmed(&exchange, &key, &body, props)
                    .await
                    .map(|()| route)
            }
        };
        let count = members.len();
        let mut out = Vec::with_capacity(count);
        if result.is_ok() {
            let m = crate::metrics::global();
            m.broker_messages.inc();
            m.scheduled.inc_by(count as u64);
        }
        for m in members {
            let r = match &result {
                Ok(route) => Ok(Scheduled {
                    message_id: m.message_id,
                    delay_ms: m.delay_ms,
                    due_at_ms: m.due_at_ms,
                    route: route.clone(),
                    batched_with: count,
                }),
                Err(e) => Err(e.duplicate()),
            };
            let _ = m.reply.send(match &r {
                Ok(s) => Ok(s.clone()),
                Err(e) => Err(e.duplicate()),
            });
            out.push(r);
        }
        out
    }

    /// The body and properties of a batch of `members` travelling `route`.
    fn batch_message(
        &self,
        members: &[Prepared],
        route: &Route,
        earliest: u64,
    ) -> (Vec<u8>, BasicProperties) {
        let props: Vec<Vec<u8>> = members
            .iter()
            .map(|m| batch::encode_properties(&m.properties))
            .collect();
        let body = batch::encode_parts(
            props
                .iter()
                .zip(members)
                .map(|(p, m)| (p.as_slice(), m.body.as_slice())),
        );
        let mut h = batch::batch_headers(members.len());
        headers::set_schedule_headers(&mut h, route.delay_ms, earliest, 0);
        let props = BasicProperties::default()
            .with_content_type(batch::CONTENT_TYPE.into())
            .with_delivery_mode(2)
            .with_message_id(uuid::Uuid::now_v7().to_string().as_str().into())
            .with_headers(h);
        (body, props)
    }

    /// [`Inner::publish_once`], publishing again after a nack while the tiers have no length
    /// limit: a nack then cannot mean "full", only that the queue is unavailable (its leader
    /// moving after a node loss), and the broker took nothing, so trying again cannot duplicate
    /// it. A channel that published to the queue while its leader was being replaced keeps
    /// being refused even once a new leader serves other channels (RabbitMQ 3.10, kill -9 of a
    /// node: nacked for the whole 60 s tried, while new channels were served within 2 s), so
    /// later publishes go to a new channel. Tried with backoff for up to
    /// `publisher.reconnect_timeout`, as a lost connection is; with `max_tier_length` set, a
    /// nack is reported at once (the tier is full).
    async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<()> {
        let mut give_up = None;
        let mut pause = Duration::from_millis(50);
        loop {
            let channel = self.publish_channel().await?;
            match self
                .publish_once(&channel, exchange, routing_key, body, props.clone())
                .await
            {
                Err(Error::Nacked { .. }) if self.layout.max_tier_length().is_none() => {
                    let end = *give_up.get_or_insert_with(|| {
                        Instant::now()
                            + Duration::from_millis(self.settings.reconnect_timeout.as_millis())
                    });
                    if Instant::now() + pause > end {
                        return Err(Error::Nacked {
                            exchange: exchange.into(),
                        });
                    }
                    self.renew_channel(&channel, exchange).await;
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                r => return r,
            }
        }
    }

    /// Replaces the publish channel by a new one if it is still `stale`. The old one stays open
    /// a while, so the confirms it still awaits can arrive.
    async fn renew_channel(&self, stale: &Channel, exchange: &str) {
        let mut ch = self.channel.write().await;
        if ch.id() != stale.id() || !ch.status().connected() {
            return;
        }
        let Ok(conn) = self.connection().await else {
            return;
        };
        match open_confirm_channel(&conn).await {
            Ok(new) => {
                tracing::info!(
                    "'{exchange}' refused a message (nack): a queue is unavailable, e.g. its leader moved; publishing again on a new channel"
                );
                let old = std::mem::replace(&mut *ch, new);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let _ = old.close(200, "replaced".into()).await;
                });
            }
            Err(e) => tracing::warn!(
                "could not open a new publish channel: {}",
                crate::error::chain(&e)
            ),
        }
    }

    async fn publish_once(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<()> {
        let key = ShortString::try_new(routing_key).map_err(|_| {
            Error::Invalid(format!(
                "routing key is {} bytes, more than 255",
                routing_key.len()
            ))
        })?;
        let confirm = channel
            .basic_publish(
                exchange.into(),
                key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
            .context(|| format!("publishing to '{exchange}'"))?
            .await
            .map_err(|source| Error::MaybeSent {
                context: format!("awaiting the confirm from '{exchange}'"),
                source,
            })?;
        if confirm.is_nack() {
            crate::metrics::global().nacks.inc();
            return Err(Error::Nacked {
                exchange: exchange.into(),
            });
        }
        if let Some(ret) = confirm.take_message() {
            crate::metrics::global().returns.inc();
            return Err(Error::Returned {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                code: ret.reply_code,
                text: ret.reply_text.to_string(),
            });
        }
        Ok(())
    }

    /// The confirm channel, reopened if the broker closed it (on a new connection if the
    /// connection was lost and the publisher owns it).
    async fn publish_channel(&self) -> Result<Channel> {
        {
            let ch = self.channel.read().await;
            if ch.status().connected() {
                return Ok(ch.clone());
            }
        }
        let mut ch = self.channel.write().await;
        if !ch.status().connected() {
            let conn = self.connection().await?;
            tracing::info!("the publish channel was closed; reopening it");
            *ch = open_confirm_channel(&conn).await?;
        }
        Ok(ch.clone())
    }

    /// The connection, re-established with backoff (for up to `publisher.reconnect_timeout`)
    /// when it was lost and the publisher owns it.
    async fn connection(&self) -> Result<Arc<Connection>> {
        {
            let c = self.conn.read().await;
            if c.status().connected() {
                return Ok(c.clone());
            }
        }
        let Some(url) = &self.url else {
            return Err(Error::Invalid(
                "the connection this publisher was given is closed (its owner reconnects)".into(),
            ));
        };
        let mut c = self.conn.write().await;
        if c.status().connected() {
            return Ok(c.clone());
        }
        let give_up =
            Instant::now() + Duration::from_millis(self.settings.reconnect_timeout.as_millis());
        let mut backoff = crate::connection::Backoff::default();
        loop {
            match url.connect(CONNECTION_NAME).await {
                Ok(new) => {
                    tracing::info!("the publisher reconnected");
                    *c = Arc::new(new);
                    self.bound.lock().expect("binding cache").clear();
                    *self.admin.lock().await = None;
                    return Ok(c.clone());
                }
                Err(e) if Instant::now() < give_up => {
                    let pause = backoff.next_pause();
                    tracing::warn!(
                        "the publisher's connection is lost: {}; reconnecting in {pause:?}",
                        crate::error::chain(&e)
                    );
                    crate::connection::Backoff::wait(pause, url.urls()).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Binds `destination` on the delivery exchange unless it was bound recently by us, and
    /// learns whether its consumers read batches. Returns that.
    async fn ensure_bound(&self, destination: &str) -> Result<bool> {
        let ttl = Duration::from_secs(self.settings.binding_cache_secs);
        let fresh = |map: &HashMap<String, Binding>| {
            map.get(destination)
                .filter(|b| b.at.elapsed() < ttl)
                .map(|b| b.batches)
        };
        if let Some(b) = fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(b);
        }
        let mut admin = self.admin.lock().await;
        if let Some(b) = fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(b);
        }
        let ch = match admin.as_ref() {
            Some(c) if c.status().connected() => c.clone(),
            _ => {
                let c = self
                    .connection()
                    .await?
                    .create_channel()
                    .await
                    .context(|| "opening the binding channel".into())?;
                *admin = Some(c.clone());
                c
            }
        };
        let exchange = self.layout.delivery_exchange();
        let pattern = self.layout.destination_binding(destination);
        match ch
            .queue_bind(
                destination.into(),
                exchange.as_str().into(),
                pattern.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(()) => {}
            // A publisher with least privilege may not bind (that needs read on the delivery
            // exchange, which would let it bind a queue of its own there too): the admin's
            // `declare --queue` bound the destination. It must exist, though.
            Err(e) if broker::is_reply(&e, ACCESS_REFUSED) => {
                *admin = None;
                let conn = self.connection().await?;
                if broker::queue_state(&conn, destination).await?.is_none() {
                    return Err(Error::UnknownDestination(destination.into()));
                }
                tracing::debug!(%destination, "not allowed to bind the destination; relying on `declare --queue`");
            }
            Err(e) => {
                *admin = None; // the broker closed the channel
                return match broker::reply(&e) {
                    Some((NOT_FOUND, text)) if text.contains("no queue") => {
                        Err(Error::UnknownDestination(destination.into()))
                    }
                    Some((NOT_FOUND, _)) => Err(Error::NotDeclared {
                        prefix: self.layout.prefix().to_string(),
                        detail: format!(": the delivery exchange '{exchange}' is missing"),
                    }),
                    _ => Err(e).context(|| format!("binding destination '{destination}'")),
                };
            }
        }
        let batches = self.settings.batching()
            && match self.layout.batch_marker(destination) {
                Some(marker) => {
                    broker::exchange_exists(&*self.connection().await?, &marker).await?
                }
                None => false,
            };
        self.bound.lock().expect("binding cache").insert(
            destination.to_string(),
            Binding {
                at: Instant::now(),
                batches,
            },
        );
        Ok(batches)
    }
}

/// The batcher: collects prepared messages — a whole chunk from `schedule_all`, or single
/// `schedule` calls for up to `batch_linger` (never past a member's deadline) — groups them per
/// destination and publishes every group as one broker message, concurrently.
async fn run_batcher(inner: Arc<Inner>, mut rx: mpsc::UnboundedReceiver<Vec<Prepared>>) {
    let mut tasks = tokio::task::JoinSet::new();
    let linger = Duration::from_millis(inner.settings.batch_linger.as_millis());
    let limit = inner.settings.max_pending.max(1);
    while let Some(first) = rx.recv().await {
        let bulk = first.len() > 1;
        let mut buf = first;
        let started = Instant::now();
        let deadline_of = |buf: &[Prepared]| {
            let now = now_ms();
            let soonest = buf.iter().map(|p| p.deadline_ms).min().unwrap_or(now);
            Duration::from_millis(soonest.saturating_sub(now))
        };
        let mut flush_at = started
            + if bulk {
                Duration::ZERO
            } else {
                linger.min(deadline_of(&buf))
            };
        loop {
            while buf.len() < limit {
                match rx.try_recv() {
                    Ok(more) => buf.extend(more),
                    Err(_) => break,
                }
            }
            if buf.len() >= limit || Instant::now() >= flush_at {
                break;
            }
            tokio::select! {
                more = rx.recv() => match more {
                    Some(more) => {
                        buf.extend(more);
                        flush_at = flush_at.min(Instant::now() + deadline_of(&buf));
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(flush_at.into()) => break,
            }
        }
        while tasks.try_join_next().is_some() {}
        tasks.spawn(flush(inner.clone(), buf));
    }
    while tasks.join_next().await.is_some() {}
}

/// Messages that travel as one broker message, with their firing window (`None`: alone, in
/// its own budget).
type Group = (Vec<Prepared>, Option<(u64, u64)>);

/// Groups `buf` per destination and publishes every group concurrently.
async fn flush(inner: Arc<Inner>, buf: Vec<Prepared>) {
    let now = now_ms();
    let mut by_dest: HashMap<String, Vec<Prepared>> = HashMap::new();
    for p in buf {
        by_dest.entry(p.destination.clone()).or_default().push(p);
    }
    let limits = Limits {
        max_members: inner.settings.batch_max_messages,
        max_bytes: inner.settings.batch_max_bytes,
    };
    let mut groups: Vec<Group> = Vec::new();
    for (dest, members) in by_dest {
        let batches = inner
            .bound
            .lock()
            .expect("binding cache")
            .get(&dest)
            .is_some_and(|b| b.batches);
        if !batches {
            groups.extend(members.into_iter().map(|m| (vec![m], None)));
            continue;
        }
        let cands: Vec<Candidate> = members
            .iter()
            .map(|m| Candidate {
                due_at_ms: m.due_at_ms,
                deadline_ms: m.deadline_ms,
                bytes: batch::member_len(
                    batch::encode_properties(&m.properties).len(),
                    m.body.len(),
                ),
            })
            .collect();
        let plan = batch::group(&cands, limits);
        let mut slots: Vec<Option<Prepared>> = members.into_iter().map(Some).collect();
        for g in plan {
            let ms: Vec<Prepared> = g
                .members
                .iter()
                .map(|&i| slots[i].take().expect("each member in one group"))
                .collect();
            groups.push((ms, Some((g.earliest_ms, g.latest_ms))));
        }
    }
    futures::stream::iter(groups)
        .for_each_concurrent(None, |(members, window)| {
            let inner = &inner;
            async move {
                let _ = inner.publish_group(now, members, window).await;
            }
        })
        .await;
}

async fn open_confirm_channel(conn: &Connection) -> Result<Channel> {
    let channel = conn
        .create_channel()
        .await
        .context(|| "opening the publish channel".into())?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context(|| "enabling publisher confirms".into())?;
    Ok(channel)
}
