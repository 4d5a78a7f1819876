//! The publisher's broker side: its connection and confirm channel (re-opened after a loss),
//! destination bindings, and the batcher task that turns messages in hand into broker messages.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Connection};
use tokio::sync::mpsc;

use super::confirms::{self, Confirms, Outcome};
use super::{Binding, CONNECTION_NAME, Inner, Prepared};
use crate::batch::{self, Candidate, Limits};
use crate::broker::{self, ACCESS_REFUSED, NOT_FOUND, SharedChannel};
use crate::error::{Error, Result, ResultExt};
use crate::headers;
use crate::message::Scheduled;
use crate::planner::{self, Route};
use crate::time::now_ms;

impl Inner {
    /// Publishes one message on its own, planned from now, and answers its caller too.
    pub(super) async fn publish_alone(&self, p: Prepared) -> Result<Scheduled> {
        let now = now_ms();
        let r = self.publish_group(now, vec![p], None).await;
        r.into_iter().next().expect("one result")
    }

    /// Publishes `members` (one destination) as one broker message — alone when there is one,
    /// as a batch otherwise — planned in `window` (`None`: one message, planned from its own
    /// request), and answers every member's caller. Returns the results too.
    pub(super) async fn publish_group(
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
                let batch_id = (members.len() > 1)
                    .then(|| props.message_id().as_ref().map(|s| s.to_string()))
                    .flatten();
                let _permit = self.in_flight.acquire().await.expect("never closed");
                let r = self
                    .publish_confirmed(&exchange, &key, &body, props)
                    .await
                    .map(|()| route);
                match (&r, batch_id) {
                    // which messages travel in which batch: the trail an operator follows
                    // when one is missing (the worker logs the batch id when it arrives)
                    (Ok(_), Some(batch)) => {
                        tracing::debug!(%batch, %exchange, %key, members = ?members.iter().map(|m| m.message_id.as_str()).collect::<Vec<_>>(), "batch confirmed")
                    }
                    (Ok(_), None) => {
                        tracing::trace!(id = %members[0].message_id, %exchange, %key, "confirmed")
                    }
                    _ => {}
                }
                r
            }
        };
        let count = members.len();
        let mut out = Vec::with_capacity(count);
        if let Ok(route) = &result {
            if route.delay_ms > 0 && self.ledger_on.load(std::sync::atomic::Ordering::Relaxed) {
                self.ledger.add(now + route.delay_ms, count as u64);
            }
            let m = crate::metrics::global();
            m.broker_messages.inc();
            // a worker's retry is counted by the worker as retried: `scheduled` counts each
            // message once, so the counters add up (see `metrics`)
            m.scheduled
                .inc_by(members.iter().filter(|m| !m.retry).count() as u64);
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

    /// Writes what it put into the tiers since the last time to the ledger stream; keeps it for
    /// the next time when the write fails (unless it is the `last`), and stops recording when
    /// the stream is missing. A write whose confirm was lost is written again: counted twice
    /// rather than never.
    pub(super) async fn write_ledger(&self, last: bool) {
        use std::sync::atomic::Ordering;
        if !self.ledger_on.load(Ordering::Relaxed) {
            return;
        }
        let Some(entry) = self.ledger.take() else {
            return;
        };
        let stream = self.layout.ledger_stream();
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        match self
            .publish_confirmed("", &stream, &entry.encode(), props)
            .await
        {
            Ok(()) => {}
            Err(Error::Returned { .. }) => {
                self.ledger_on.store(false, Ordering::Relaxed);
                tracing::warn!(%stream, "the ledger stream is gone: `stats` counts broker messages only until `delay-publisher declare` adds it back");
            }
            Err(e) if last => {
                tracing::warn!(%stream, "could not write the ledger before closing: `stats` counts the messages of its last seconds only as broker messages: {}", crate::error::chain(&e));
            }
            Err(e) => {
                tracing::warn!(%stream, "could not write the ledger (kept for the next try): {}", crate::error::chain(&e));
                self.ledger.put_back(entry);
            }
        }
    }

    /// The body and properties of a batch of `members` travelling `route`.
    pub(super) fn batch_message(
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
    pub(super) async fn publish_confirmed(
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
                            + self.settings.reconnect_timeout.as_duration()
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
    async fn renew_channel(&self, stale: &PublishChannel, exchange: &str) {
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
                    crate::broker::close(&old, "replaced").await;
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
        channel: &PublishChannel,
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
        let identity = confirms::key(
            exchange,
            routing_key,
            props.message_id().as_ref().map(|s| s.as_str()),
            body,
        );
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
            .context(|| format!("publishing to '{exchange}'"))?;
        let outcome = channel
            .confirms
            .outcome(identity, confirm)
            .await
            .map_err(|source| Error::MaybeSent {
                context: format!("awaiting the confirm from '{exchange}'"),
                source,
            })?;
        match outcome {
            Outcome::Ack => Ok(()),
            Outcome::Nack => {
                crate::metrics::global().nacks.inc();
                Err(Error::Nacked {
                    exchange: exchange.into(),
                })
            }
            Outcome::Returned(ret) => {
                crate::metrics::global().returns.inc();
                Err(Error::Returned {
                    exchange: exchange.into(),
                    routing_key: routing_key.into(),
                    code: ret.reply_code,
                    text: ret.reply_text.to_string(),
                })
            }
        }
    }

    /// The confirm channel, reopened if the broker closed it (on a new connection if the
    /// connection was lost and the publisher owns it).
    pub(super) async fn publish_channel(&self) -> Result<PublishChannel> {
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
            *ch = match open_confirm_channel(&conn).await {
                Ok(new) => new,
                Err(e @ Error::Timeout { .. }) => {
                    // the connection looks open but does not answer: drop it, so the next
                    // publish reconnects
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(5),
                            conn.close(320, "not answering".into()),
                        )
                        .await;
                    });
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
        }
        Ok(ch.clone())
    }

    /// The connection, re-established with backoff (for up to `publisher.reconnect_timeout`)
    /// when it was lost and the publisher owns it.
    pub(super) async fn connection(&self) -> Result<Arc<Connection>> {
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
            Instant::now() + self.settings.reconnect_timeout.as_duration();
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
    pub(super) async fn ensure_bound(&self, destination: &str) -> Result<bool> {
        let ttl = self.settings.binding_cache.as_duration();
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

/// The batcher: holds prepared messages — a whole chunk from `schedule_all` leaves at once,
/// a single `schedule` call may wait up to `batch_linger` (never past its deadline) — and
/// publishes them grouped per destination and firing window, one broker message per group,
/// concurrently. Each group leaves when one of its members must: a group of messages that
/// fall due later keeps collecting members while an earlier one leaves (flushing everything
/// at the first deadline kept the gateway's batches at ~6 members).
pub(super) async fn run_batcher(inner: Arc<Inner>, mut rx: mpsc::UnboundedReceiver<Vec<Prepared>>) {
    let mut tasks = tokio::task::JoinSet::new();
    let linger = inner.settings.batch_linger.as_duration();
    let limit = inner.settings.max_pending.max(1);
    // every message in hand, with the instant it must leave by
    let mut held: Vec<Held> = Vec::new();
    let mut open = true;
    while open || !held.is_empty() {
        let next = held.iter().map(|h| h.leave_by).min();
        let more = match next {
            None => rx.recv().await,
            Some(at) => tokio::select! {
                m = rx.recv() => m,
                _ = tokio::time::sleep_until(at.into()) => Some(Vec::new()),
            },
        };
        match more {
            Some(first) => {
                hold(&mut held, first, linger);
                while held.len() < limit {
                    match rx.try_recv() {
                        Ok(more) => hold(&mut held, more, linger),
                        Err(_) => break,
                    }
                }
            }
            None => open = false,
        }
        let now = Instant::now();
        // everything leaves when the publisher closes or too much is in hand
        let all = !open || held.len() >= limit;
        if !all && !held.iter().any(|h| h.leave_by <= now) {
            continue;
        }
        let mut leaving: Vec<Group> = Vec::new();
        for (members, window) in plan_groups(&inner, std::mem::take(&mut held)) {
            if all || members.iter().any(|h| h.leave_by <= now) {
                leaving.push((members.into_iter().map(|h| h.prepared).collect(), window));
            } else {
                held.extend(members);
            }
        }
        while tasks.try_join_next().is_some() {}
        tasks.spawn(publish_groups(inner.clone(), leaving));
    }
    while tasks.join_next().await.is_some() {}
}

/// A message in the batcher's hands.
struct Held {
    leave_by: Instant,
    /// Its size as a batch member (computed once: it is grouped again every round).
    bytes: usize,
    prepared: Prepared,
}

/// Takes `batch` into `held`: a chunk of several leaves at once, a single message after up to
/// `linger`, never past its deadline.
fn hold(held: &mut Vec<Held>, batch: Vec<Prepared>, linger: Duration) {
    let now = Instant::now();
    let bulk = batch.len() > 1;
    let now_ms = now_ms();
    held.extend(batch.into_iter().map(|p| {
        let wait = if bulk {
            Duration::ZERO
        } else {
            linger.min(Duration::from_millis(p.deadline_ms.saturating_sub(now_ms)))
        };
        Held {
            leave_by: now + wait,
            bytes: batch::member_len(batch::encode_properties(&p.properties).len(), p.body.len()),
            prepared: p,
        }
    }));
}

/// Messages that travel as one broker message, with their firing window (`None`: alone, in
/// its own budget).
type Group<T = Prepared> = (Vec<T>, Option<(u64, u64)>);

/// Groups `held` per destination: a destination that reads batches into groups whose members
/// all fall due within a common window (`batch::group`), any other message alone.
fn plan_groups(inner: &Inner, held: Vec<Held>) -> Vec<Group<Held>> {
    let mut by_dest: HashMap<String, Vec<Held>> = HashMap::new();
    for h in held {
        by_dest
            .entry(h.prepared.destination.clone())
            .or_default()
            .push(h);
    }
    let limits = Limits {
        max_members: inner.settings.batch_max_messages,
        max_bytes: inner.settings.batch_max_bytes,
    };
    let mut groups = Vec::new();
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
            .map(|h| Candidate {
                due_at_ms: h.prepared.due_at_ms,
                deadline_ms: h.prepared.deadline_ms,
                bytes: h.bytes,
            })
            .collect();
        let plan = batch::group(&cands, limits);
        let mut slots: Vec<Option<Held>> = members.into_iter().map(Some).collect();
        for g in plan {
            let ms: Vec<Held> = g
                .members
                .iter()
                .map(|&i| slots[i].take().expect("each member in one group"))
                .collect();
            groups.push((ms, Some((g.earliest_ms, g.latest_ms))));
        }
    }
    groups
}

/// Publishes every group concurrently.
async fn publish_groups(inner: Arc<Inner>, groups: Vec<Group>) {
    let now = now_ms();
    futures::stream::iter(groups)
        .for_each_concurrent(None, |(members, window)| {
            let inner = &inner;
            async move {
                let _ = inner.publish_group(now, members, window).await;
            }
        })
        .await;
}

/// Opens a channel with publisher confirms, within [`OPEN_TIMEOUT`]: on a connection that broke
/// while a node stopped, lapin was seen never to answer.
pub(super) async fn open_confirm_channel(conn: &Connection) -> Result<PublishChannel> {
    let open = async {
        let channel = conn
            .create_channel()
            .await
            .context(|| "opening the publish channel".into())?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context(|| "enabling publisher confirms".into())?;
        let confirms = Arc::new(Confirms::start(channel.id()));
        Ok(PublishChannel {
            channel: SharedChannel::new(channel),
            confirms,
        })
    };
    tokio::time::timeout(OPEN_TIMEOUT, open)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Timeout {
                context: "opening the publish channel".into(),
                timeout_ms: OPEN_TIMEOUT.as_millis() as u64,
            })
        })
}

/// A confirm channel with the task that awaits its confirms (see [`confirms`]). Many tasks
/// publish on it at once: publishes go through [`SharedChannel::basic_publish`].
#[derive(Clone)]
pub(super) struct PublishChannel {
    channel: SharedChannel,
    confirms: Arc<Confirms>,
}

impl std::ops::Deref for PublishChannel {
    type Target = SharedChannel;

    fn deref(&self) -> &SharedChannel {
        &self.channel
    }
}

/// How long opening the publish channel may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
