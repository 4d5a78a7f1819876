//! The publisher's broker side: its connection and confirm channel (re-opened after a loss),
//! destination bindings, and publishing a group of messages as one broker message (the
//! batcher task that forms the groups is in `batcher`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::confirms::{self, Confirms, Outcome};
use super::refusal::{Flight, InFlight};
use super::{Binding, CONNECTION_NAME, Inner, Prepared, Reads};
use crate::batch;
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
        // journaled before it is published: a message the broker confirmed is in the journal
        // (one that cannot be planned is journaled only when its intent was queued already:
        // then it is named failed)
        let flushes = match &self.journal {
            Some(j) => j.intents(&mut members, planned.is_ok()).await,
            None => Vec::new(),
        };
        let result = match planned {
            Err(e) => Err(Error::from(e)),
            Ok(route) => self.publish_members(&mut members, route, earliest).await,
        };
        if let Some(j) = &self.journal {
            j.settled(&flushes, &members, &result);
        }
        self.settle(now, members, result)
    }

    /// Counts what `result` put into the tiers (in the ledger, by due time, while it is
    /// recorded, and in the metrics) and answers every member's caller; returns the answers.
    fn settle(
        &self,
        now: u64,
        members: Vec<Prepared>,
        result: Result<Route>,
    ) -> Vec<Result<Scheduled>> {
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
                Err(e) => Err(e.clone()),
            };
            let _ = m.reply.send(r.clone());
            out.push(r);
        }
        out
    }

    /// Publishes `members` (one destination) as one broker message travelling `route`: alone
    /// when there is one, else as a batch due from `earliest`; with a confirm, within the
    /// in-flight limit.
    async fn publish_members(
        &self,
        members: &mut [Prepared],
        route: Route,
        earliest: u64,
    ) -> Result<Route> {
        let destination = members[0].destination.clone();
        let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let exchange = route.exchange_for(&self.layout, turn);
        let key = route.routing_key(&self.layout, &destination);
        let (body, props) = if members.len() == 1 {
            let m = &mut members[0];
            (std::mem::take(&mut m.body), m.properties.clone())
        } else {
            self.batch_message(members, &route, earliest)
        };
        let props = self.signed(props);
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
        let log = crate::ledger::log(&self.layout);
        let stream = log.name();
        let props = self.signed(
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into()),
        );
        match self.append_log(&log, &entry, props).await {
            Ok(()) => {}
            Err(e @ Error::NotDeclared { .. }) => {
                self.ledger_on.store(false, Ordering::Relaxed);
                tracing::warn!(%stream, "no longer writing the ledger, `stats` counts broker messages only: {}", crate::error::chain(&e));
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

    /// `props` with this publisher's user as `user_id` (whatever the caller set: the broker
    /// refuses any other, DESIGN rule 15), so that readers know who wrote it ([`crate::trust`]).
    pub(super) fn signed(&self, props: BasicProperties) -> BasicProperties {
        match &self.user {
            Some(u) => props.with_user_id(u.clone()),
            None => props,
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
                        Instant::now() + self.settings.reconnect_timeout.as_duration()
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

    /// Appends `record` to the stream `log` on the confirm channel and waits for its confirm,
    /// at most [`crate::stream_log::CONFIRM_TIMEOUT`]: a stream whose leader's node was lost
    /// may answer neither confirm nor nack (RabbitMQ 3.10.8, kill -9 of the node leading the
    /// ledger stream: nothing for the 150 s we waited), and a log write must not hold up a
    /// publish, a cancel or a close for ever. A missing stream is [`StreamLog::or_missing`]'s
    /// error.
    pub(super) async fn append_log<R: crate::stream_log::LogRecord>(
        &self,
        log: &crate::stream_log::StreamLog<R>,
        record: &R,
        props: BasicProperties,
    ) -> Result<()> {
        let limit = crate::stream_log::CONFIRM_TIMEOUT;
        let body = log.encode(record);
        let appended = self.publish_confirmed(log.exchange(), log.name(), &body, props);
        match tokio::time::timeout(limit, appended).await {
            Ok(r) => r.map_err(|e| log.or_missing(e)),
            Err(_) => Err(Error::Timeout {
                context: format!("awaiting the confirm of an append to '{}'", log.name()),
                timeout_ms: limit.as_millis() as u64,
            }),
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
        // in the channel's flight until it is decided, for a refusal to be pinned on it
        let in_flight = InFlight::new(&channel.flight);
        let confirm = channel
            .basic_publish_noting(
                exchange.into(),
                key,
                // DESIGN rule 6: the broker confirms an unroutable publish too; only
                // `mandatory` makes it return it
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
                |n| in_flight.queued(n, exchange, routing_key),
            )
            .await
            .context(|| format!("publishing to '{exchange}'"))?;
        let outcome = channel
            .confirms
            .outcome(identity, confirm)
            .await
            .map_err(|source| in_flight.unconfirmed(exchange, source))?;
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
            return Err(Error::Stopped(
                "the connection this publisher was given is closed (its owner reconnects)".into(),
            ));
        };
        let mut c = self.conn.write().await;
        if c.status().connected() {
            return Ok(c.clone());
        }
        let give_up = Instant::now() + self.settings.reconnect_timeout.as_duration();
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
    /// learns from its markers what its consumers read. Returns that.
    pub(super) async fn ensure_bound(&self, destination: &str) -> Result<Reads> {
        let ttl = self.settings.binding_cache.as_duration();
        let fresh = |map: &HashMap<String, Binding>| {
            map.get(destination)
                .filter(|b| b.at.elapsed() < ttl)
                .map(|b| b.reads)
        };
        if let Some(r) = fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(r);
        }
        let mut admin = self.admin.lock().await;
        if let Some(r) = fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(r);
        }
        self.bind_destination(&mut admin, destination).await?;
        let reads = self.markers_of(destination).await?;
        self.bound.lock().expect("binding cache").insert(
            destination.to_string(),
            Binding {
                at: Instant::now(),
                reads,
            },
        );
        Ok(reads)
    }

    /// What `destination`'s markers say its consumers read: with grains, the hold marker says
    /// they hold grain batches; without, the batch marker says they read exact batches (a
    /// worker declares both).
    async fn markers_of(&self, destination: &str) -> Result<Reads> {
        if !self.settings.batching() {
            return Ok(Reads::Plain);
        }
        let conn = self.connection().await?;
        let exists = |marker: Option<String>| {
            let conn = conn.clone();
            async move {
                match marker {
                    Some(m) => broker::exchange_exists(&conn, &m).await,
                    None => Ok(false),
                }
            }
        };
        Ok(match self.settings.grain() {
            Some(_) if exists(self.layout.hold_marker(destination)).await? => Reads::Holds,
            None if exists(self.layout.batch_marker(destination)).await? => Reads::Batches,
            _ => Reads::Plain,
        })
    }

    /// Binds `destination` on the delivery exchange, on the binding channel `admin` (opened
    /// when there is none; dropped when the broker closes it). A publisher not allowed to bind
    /// relies on the admin's `declare --queue`: the destination must exist then.
    async fn bind_destination(&self, admin: &mut Option<Channel>, destination: &str) -> Result<()> {
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
            // `declare --queue` bound the destination. It must exist, though, when the broker
            // lets us look: RabbitMQ 4.3 checks a passive declare against the user's rights on
            // the queue, which a publisher to any destination has not. Then a missing one is
            // parked as unroutable at the delivery exchange, never lost.
            Err(e) if broker::is_reply(&e, ACCESS_REFUSED) => {
                *admin = None;
                let conn = self.connection().await?;
                match broker::queue_state(&conn, destination).await {
                    Ok(Some(_)) => {}
                    Ok(None) => return Err(Error::UnknownDestination(destination.into())),
                    Err(Error::Amqp { source, .. })
                        if broker::is_reply(&source, ACCESS_REFUSED) =>
                    {
                        tracing::debug!(%destination, "not allowed to check the destination either");
                    }
                    Err(e) => return Err(e),
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
        Ok(())
    }
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
            flight: Default::default(),
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

/// A confirm channel with the task that awaits its confirms (see [`confirms`]) and the
/// publishes awaiting one (see [`super::refusal`]). Many tasks publish on it at once: publishes go
/// through [`SharedChannel::basic_publish_noting`].
#[derive(Clone)]
pub(super) struct PublishChannel {
    channel: SharedChannel,
    confirms: Arc<Confirms>,
    flight: Arc<std::sync::Mutex<Flight>>,
}

impl std::ops::Deref for PublishChannel {
    type Target = SharedChannel;

    fn deref(&self) -> &SharedChannel {
        &self.channel
    }
}

/// How long opening the publish channel may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
