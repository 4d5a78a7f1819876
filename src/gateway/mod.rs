//! The `x-delay` gateway: a drop-in successor to the delayed-message-exchange plugin, built on
//! the tiers. Applications keep publishing to an exchange with an `x-delay` header (milliseconds)
//! and their usual routing key; when the delay is over the message is published to a target
//! exchange with its original routing key, body and properties, so the bindings the
//! application already has on that exchange route it as before.
//!
//! One gateway *pair* (ingress exchange `I`, target exchange `T`) is made of:
//! * `I`, a durable **fanout** exchange (any routing key reaches us, so `x-delayed-type` is not
//!   needed), bound to the ingress queue `<prefix>.gw.in.<I>`;
//! * the due queue `<prefix>.gw.due.<I>`, an ordinary amqp-delay destination (queue type of
//!   the tiers).
//!
//! A [`Worker`] consumes both queues:
//! * **ingress**: reads `x-delay` ([`x_delay::parse_x_delay`]), moves what the tiers must not carry into
//!   `x-delay-*` headers ([`x_delay::stash`]: the routing key, `expiration`, `delivery_mode`, `user_id`,
//!   whether `message_id` or `headers` were absent) and schedules the message to the due queue.
//!   The ingress message is acked only after the broker confirmed that publish; if it fails the
//!   message is requeued unchanged ([`Outcome::Requeue`]), never re-scheduled as a modified copy.
//!   A non-numeric or over-range `x-delay` goes to the due queue at once, marked, and is parked
//!   there with the reason. A delay of at most `gateway.hold` (100 ms by default) does not cross
//!   the tiers: the worker holds the message until due ([`GatewayHandler`]'s
//!   [`Handler::due_at`]), unacked in the ingress queue so a gateway that dies loses nothing, in
//!   the hold early grain batches use; the handler then publishes it to `T` as the due stage
//!   would. If that publish is returned, refused or not confirmed in time, the message goes to
//!   the due queue at once, whose retries and parking apply. Held messages take prefetch slots
//!   (`consumer.hold_prefetch`, and `gateway.max_held` more), not handler permits.
//! * **due**: rebuilds the message as published ([`x_delay::restore`]: original routing key and
//!   properties, `x-delay` → minus the delay (the plugin: only in some queues, MIGRATING), ours
//!   and the broker's `x-death` history removed) and publishes it to `T`, mandatory, confirmed.
//!   Unroutable at `T` → parked in `<prefix>.parked.<prefix>.gw.due.<I>` with the reason (the
//!   plugin drops it); a nack or a broker error → retried with backoff, then parked.
//!
//! Delivery is at-least-once: a gateway that dies between a confirm and its ack leaves a message
//! that is delivered again (a duplicate). Any number of gateway processes may consume the same
//! pairs (competing consumers; they hold no state).
//!
//! `user_id` is not re-published: the broker refuses (and closes the channel of) a publish whose
//! `user_id` differs from the publishing connection's user, and the gateway's user is generally
//! not the application's. The value, validated by the broker when the application published it,
//! is delivered in the header `x-delay-user-id` instead.

pub mod follow;
mod writers;
pub mod x_delay;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ExchangeKind};

use crate::broker;
use crate::control;
use crate::envelope::Delivery;
use crate::error::{Error, Result, ResultExt};
use crate::headers::{INVALID, OWNER, PUBLISHED_AT, X_DELAY};
use crate::layout::Layout;
use crate::message::Message;
use crate::settings::{PairConfig, Settings};
use crate::topology::Topology;
use crate::worker::{Context, Handler, Outcome, Worker};
use writers::Writers;
use x_delay::{parse_x_delay, restore, stash, text_header};

/// One ingress → target pair with its queue names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// Exchange applications publish to with `x-delay`.
    pub ingress: String,
    /// Exchange the message is published to when due.
    pub target: String,
    /// Queue bound to the ingress exchange.
    pub ingress_queue: String,
    /// Destination queue of the pair's messages while they wait.
    pub due_queue: String,
    /// Where messages of this pair are parked (refused `x-delay`, unroutable at the target).
    pub parked_queue: String,
    /// Where the worker parks ingress messages it cannot read at all.
    pub ingress_parked_queue: String,
    /// The users whose ingress messages it delivers besides admins (empty: anyone the broker
    /// lets write the ingress), as configured ([`PairConfig::writers`]).
    pub writers: Vec<String>,
}

impl Pair {
    /// Computes the names and checks they are valid for `layout` (destination rules, lengths
    /// of the parking queues the worker declares).
    pub fn new(layout: &Layout, cfg: &PairConfig) -> Result<Pair, String> {
        let due_queue = layout.gateway_due_queue(&cfg.ingress);
        let pair = Pair {
            ingress: cfg.ingress.clone(),
            target: cfg.target.clone(),
            ingress_queue: layout.gateway_ingress_queue(&cfg.ingress),
            parked_queue: layout.parked_queue(&due_queue),
            ingress_parked_queue: layout.parked_queue(&layout.gateway_ingress_queue(&cfg.ingress)),
            due_queue,
            writers: cfg.writers.clone(),
        };
        for q in [&pair.ingress_queue, &pair.due_queue] {
            layout
                .validate_destination(q)
                .map_err(|e| format!("ingress '{}': {e}", cfg.ingress))?;
            let parked = layout.parked_queue(q);
            if parked.len() > 255 {
                return Err(format!(
                    "ingress '{}': its parking queue name '{parked:.60}…' would be {} bytes, more than 255; use a shorter ingress name or prefix",
                    cfg.ingress,
                    parked.len()
                ));
            }
        }
        Ok(pair)
    }
}

impl Pair {
    /// Every queue of the pair: ingress, due and the two parking queues.
    pub fn queues(&self) -> [&str; 4] {
        [
            &self.ingress_queue,
            &self.due_queue,
            &self.parked_queue,
            &self.ingress_parked_queue,
        ]
    }
}

/// The pairs declared under `layout`'s prefix by any gateway, from the control stream's
/// `records`, each once, in the order they were first declared; ended ones too (a teardown
/// deletes what is left of them, such as a parking queue that still held messages).
pub fn registered_pairs(layout: &Layout, records: &[control::Record]) -> Vec<Pair> {
    let mut out: Vec<Pair> = Vec::new();
    for r in records {
        if let control::Record::GatewayPair {
            ingress, target, ..
        }
        | control::Record::GatewayPairEnded {
            ingress, target, ..
        } = r
        {
            let (ingress, target) = (ingress.clone(), target.clone());
            if out.iter().any(|p| p.ingress == ingress) {
                continue;
            }
            let cfg = PairConfig {
                ingress,
                target,
                writers: Vec::new(),
            };
            match Pair::new(layout, &cfg) {
                Ok(p) => out.push(p),
                Err(e) => tracing::warn!("ignoring a gateway pair record: {e}"),
            }
        }
    }
    out
}

/// Ends `pair` (its target was deleted): deletes its ingress exchange first (nothing enters
/// any more), then its ingress and due queues (messages in them are lost), and its parking
/// queues only when they hold nothing (a teardown removes them later: the pair stays in the
/// control stream, ended). Missing objects are ignored.
pub async fn end_pair(conn: &Connection, pair: &Pair) -> Result<()> {
    let ch = broker::open(conn).await?;
    ch.exchange_delete(
        pair.ingress.as_str().into(),
        ExchangeDeleteOptions::default(),
    )
    .await
    .context(|| format!("deleting exchange '{}'", pair.ingress))?;
    for q in [&pair.ingress_queue, &pair.due_queue] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .context(|| format!("deleting queue '{q}'"))?;
    }
    broker::close(&ch, "deleted").await;
    for q in [&pair.parked_queue, &pair.ingress_parked_queue] {
        match broker::queue_state(conn, q).await? {
            Some(s) if s.ready > 0 => {
                tracing::warn!(queue = %q, parked = s.ready, "a deleted delayed exchange's parking queue holds messages: left for you to read (teardown removes it)");
            }
            Some(_) => {
                let ch = broker::open(conn).await?;
                ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .context(|| format!("deleting queue '{q}'"))?;
                broker::close(&ch, "deleted").await;
            }
            None => {}
        }
    }
    Ok(())
}

/// Deletes the ingress exchanges and every queue of `pairs` (messages in them are lost);
/// missing objects are ignored. Leaves the targets and the tier topology.
pub(crate) async fn delete_pairs(conn: &Connection, pairs: &[Pair]) -> Result<()> {
    let ch = broker::open(conn).await?;
    for p in pairs {
        for q in p.queues() {
            ch.queue_delete(q.into(), QueueDeleteOptions::default())
                .await
                .context(|| format!("deleting queue '{q}'"))?;
        }
        ch.exchange_delete(p.ingress.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .context(|| format!("deleting exchange '{}'", p.ingress))?;
    }
    broker::close(&ch, "deleted").await;
    Ok(())
}

// ---- the handler ---------------------------------------------------------------------------

struct PairCtx {
    pair: Pair,
    max_delay_ms: u64,
    /// Longest wait for the tier publish's confirm before the ingress message is requeued.
    confirm_timeout: Duration,
    /// `gateway.hold`: delays up to this are held by the worker instead of crossing the tiers
    /// (0: none are).
    hold_ms: u64,
    /// Who may deliver through each pair of the gateway.
    writers: Arc<Writers>,
}

/// How publishing a held message straight to its target ended.
enum Held {
    Published,
    Cancelled,
    Failed,
}

/// Who owns an application's message: the `user_id` it published with (the broker checked
/// it), else the gateway's own user, which schedules it; their cancels (and an admin's) stop it.
fn ingress_owner(d: &Delivery, ctx: &Context) -> Option<String> {
    d.owner
        .clone()
        .or_else(|| ctx.trust().own().map(str::to_string))
}

/// The gateway's [`Handler`]: one value per subscribed queue.
#[derive(Clone)]
pub struct GatewayHandler {
    ctx: Arc<PairCtx>,
    ingress: bool,
}

impl Handler for GatewayHandler {
    async fn handle(&self, d: &Delivery, ctx: &Context) -> Outcome {
        if self.ingress {
            self.handle_ingress(d, ctx).await
        } else {
            self.handle_due(d, ctx).await
        }
    }

    /// The gateway only moves messages: its due stage publishes `consumer.io_concurrency` of
    /// them at once (the ingress takes no permit, see [`GatewayHandler::takes_permit`]).
    fn io_bound(&self) -> bool {
        true
    }

    /// The ingress takes applications' messages: their `x-delay-*` headers are not ours.
    fn reads_our_headers(&self) -> bool {
        !self.ingress
    }

    /// An ingress message waits for its batch to be confirmed (or, held, for one publish):
    /// bounded by the ingress prefetch, it takes no permit. One held through that wait would
    /// cap the ingress at `consumer.io_concurrency` messages per linger (a tenth of
    /// `publisher.grain`) and confirm, whatever the machine.
    fn takes_permit(&self, _d: &Delivery) -> bool {
        !self.ingress
    }

    /// An ingress message whose `x-delay` is at most `gateway.hold` is held by the worker, as
    /// it holds an early grain batch, and published straight to the target when due.
    fn due_at(&self, d: &Delivery) -> Option<u64> {
        let c = &self.ctx;
        if !self.ingress || c.hold_ms == 0 {
            return None;
        }
        let value = d.headers().and_then(|h| h.inner().get(X_DELAY));
        let now = crate::time::now_ms();
        let delay_ms = parse_x_delay(value, c.max_delay_ms).ok()?;
        let left = delay_ms.saturating_sub(waited_ms(d, now));
        (left <= c.hold_ms).then(|| now.saturating_add(left))
    }
}

impl GatewayHandler {
    /// Whether `d`'s writer (its broker-checked `user_id`) may deliver through the pair
    /// ([`writers`]); a writer not known yet is looked for in the control stream up to a
    /// barrier first. `Err` is what to do with the message instead: park it with the reason,
    /// or give it back when the control stream cannot be read.
    async fn writer_may_deliver(&self, d: &Delivery, ctx: &Context) -> Result<(), Outcome> {
        let (c, since) = (&self.ctx, crate::time::now_ms());
        let writer = d.properties.user_id().as_ref().map(|u| u.as_str());
        let (ingress, target) = (&c.pair.ingress, &c.pair.target);
        let check = || {
            let allowed = c.writers.allowed(ingress);
            writers::check(allowed.as_ref(), writer, ctx.trust(), ingress, target)
        };
        if check().is_ok() {
            return Ok(());
        }
        let append = async |r: control::Record| ctx.publisher().append_control(&r).await;
        if let Err(e) = c.writers.sync(since, append).await {
            return Err(Outcome::Requeue(format!(
                "reading the control stream for the writers of pair '{ingress}': {}",
                crate::error::chain(&e)
            )));
        }
        check().map_err(Outcome::Permanent)
    }

    async fn handle_ingress(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        if let Err(refused) = self.writer_may_deliver(d, ctx).await {
            return refused;
        }
        let value = d.headers().and_then(|h| h.inner().get(X_DELAY));
        let (delay_ms, invalid) = match parse_x_delay(value, c.max_delay_ms) {
            // counted from the publish when `delay-proxy` said when that was
            Ok(ms) => (ms.saturating_sub(waited_ms(d, crate::time::now_ms())), None),
            Err(reason) => (0, Some(reason)),
        };
        let owner = ingress_owner(d, ctx);
        let mut msg = due_message(
            &c.pair,
            Ingress {
                properties: &d.properties,
                routing_key: &d.routing_key,
                invalid: invalid.as_deref(),
                owner: owner.as_deref(),
            },
            d.body.clone(),
            delay_ms,
        );
        // held by the worker until now, its due time ([`GatewayHandler::due_at`])
        if let Some(due_at_ms) = d.due_at_ms.filter(|_| invalid.is_none()) {
            // what could not cross the tiers is parked whatever its delay, as it would be
            if let Err(e) = ctx.publisher().check(&msg) {
                return cannot_schedule(&e);
            }
            let held = self.publish_held(d, owner.as_deref(), (due_at_ms, delay_ms), &msg, ctx);
            match held.await {
                Held::Published => return Outcome::Success,
                Held::Cancelled => return Outcome::Cancelled,
                // due now: the due queue retries it, or parks it with the reason
                Held::Failed => msg.delay_ms = 0,
            }
        }
        let sent = tokio::time::timeout(c.confirm_timeout, ctx.publisher().schedule(msg)).await;
        match sent {
            Ok(Ok(_)) => Outcome::Success,
            // The message itself cannot travel (headers or body too large); a delay out of
            // range cannot happen (checked against the same layout): park it with the reason.
            Ok(Err(e @ (Error::Plan(_) | Error::Invalid(_)))) => cannot_schedule(&e),
            // Everything else (nack, lost channel, missing delivery exchange or due queue) is
            // the infrastructure's: the message waits in the ingress queue, unchanged.
            Ok(Err(e)) => Outcome::Requeue(format!(
                "moving the message into the tiers failed: {}",
                crate::error::chain(&e)
            )),
            Err(_) => Outcome::Requeue(format!(
                "the broker did not confirm the tier publish within {:?}",
                c.confirm_timeout
            )),
        }
    }

    /// Publishes a message the worker held until it was due to its target, as the due stage
    /// would, unless its owner (or the gateway's user, for a message published without a
    /// `user_id`) cancelled it. The ingress message is still unacked, so a gateway that dies
    /// loses nothing. [`Held::Failed`] when the publish was returned, refused or not confirmed
    /// in time, or the cancels could not be read: the caller sends the message through the due
    /// queue, whose checks, retries and parking then apply.
    async fn publish_held(
        &self,
        d: &Delivery,
        owner: Option<&str>,
        (due_at_ms, delay_ms): (u64, u64),
        msg: &Message,
        ctx: &Context,
    ) -> Held {
        let c = &self.ctx;
        let props = &msg.properties;
        match ctx.is_cancelled_as(&d.message_id, owner, due_at_ms).await {
            Ok(true) => return Held::Cancelled,
            Ok(false) => {}
            Err(_) => return Held::Failed,
        }
        // a purge covers it as the due queue's message it would have been; a reschedule is
        // carried out by the due queue's worker
        let subject = crate::cancel::Subject {
            id: &d.message_id,
            owner,
            queue: &c.pair.due_queue,
            due_at_ms: Some(due_at_ms),
            delay_ms: Some(delay_ms),
            attempt: 0,
            headers: d.headers(),
        };
        match ctx.steer(&subject) {
            crate::cancel::Steer::Run => {}
            crate::cancel::Steer::Cancelled | crate::cancel::Steer::Purged => {
                return Held::Cancelled;
            }
            _ => return Held::Failed,
        }
        let Ok((key, props)) = restore(props) else {
            return Held::Failed;
        };
        let target = &c.pair.target;
        let publish = ctx
            .publisher()
            .publish_confirmed(target, &key, &d.body, props);
        match tokio::time::timeout(c.confirm_timeout, publish).await {
            Ok(Ok(())) => Held::Published,
            Ok(Err(e)) => {
                tracing::debug!(%target, %key, error = %crate::error::chain(&e), "a held message goes through the due queue");
                Held::Failed
            }
            Err(_) => Held::Failed,
        }
    }

    async fn handle_due(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        // the due stage publishes to the target what it carries, with the routing key and
        // `x-delay-user-id` it names: only a gateway may have written it, not whoever may
        // write the tiers
        let writer = d.properties.user_id().as_ref().map(|u| u.as_str());
        if !ctx.trust().is_forwarder(writer) {
            return Outcome::Permanent(format!(
                "not written by a gateway: user_id '{}' is neither this gateway's user nor one of trust.peers",
                writer.unwrap_or("(none)")
            ));
        }
        let empty = FieldTable::default();
        match text_header(d.headers().unwrap_or(&empty), INVALID) {
            Ok(Some(reason)) => return Outcome::Permanent(reason),
            Ok(None) => {}
            Err(e) => return Outcome::Permanent(e),
        }
        let (key, props) = match restore(&d.properties) {
            Ok(r) => r,
            Err(reason) => return Outcome::Permanent(reason),
        };
        let target = &c.pair.target;
        match ctx
            .publisher()
            .publish_confirmed(target, &key, &d.body, props)
            .await
        {
            Ok(()) => Outcome::Success,
            Err(Error::Returned { .. }) => Outcome::Permanent(format!(
                "unroutable at exchange '{target}' with routing key '{key}': no binding matches"
            )),
            Err(e) => Outcome::Retry(format!(
                "publishing to '{target}': {}",
                crate::error::chain(&e)
            )),
        }
    }
}

/// How long `d` has waited since `delay-proxy` took its publish ([`PUBLISHED_AT`]) at `now_ms`:
/// 0 without the header, or for a time after now.
fn waited_ms(d: &Delivery, now_ms: u64) -> u64 {
    d.headers()
        .and_then(|h| h.inner().get(PUBLISHED_AT))
        .and_then(crate::headers::as_int)
        .and_then(|t| u64::try_from(t).ok())
        .map_or(0, |t| now_ms.saturating_sub(t))
}

/// An application's message as a gateway's ingress reads it.
pub struct Ingress<'a> {
    /// Its properties as published.
    pub properties: &'a lapin::BasicProperties,
    /// The routing key it was published with.
    pub routing_key: &'a str,
    /// Why it must be parked instead of delivered (a refused `x-delay`).
    pub invalid: Option<&'a str>,
    /// Who owns it: whose cancels (and admins') stop it.
    pub owner: Option<&'a str>,
}

/// What a gateway's ingress writes into `pair`'s due queue for `ingress` with `body`, due in
/// `delay_ms`: its properties stashed ([`stash`]: what the tiers must not carry moves into
/// `x-delay-*` headers, `CC` and `BCC` too) and its owner named in `x-delay-owner`, so that the
/// due stage delivers it to the target as published and its owner's cancels stop it. Written by
/// a gateway's user or one of `trust.peers` (the due stage believes no one else).
/// `import-plugin` writes the same for each message it moves out of the plugin.
pub fn due_message(pair: &Pair, ingress: Ingress<'_>, body: Vec<u8>, delay_ms: u64) -> Message {
    let mut props = stash(ingress.properties, ingress.routing_key, ingress.invalid);
    // the gateway's copy names its owner, so that the owner's cancels stop it
    if let Some(owner) = ingress.owner {
        let mut h = props.headers().clone().unwrap_or_default();
        h.insert(OWNER.into(), AMQPValue::LongString(owner.into()));
        props = props.with_headers(h);
    }
    let mut m = Message::new(pair.due_queue.clone(), delay_ms, body)
        .with_properties(props)
        .internal();
    m.target = Some(pair.target.clone());
    m
}

/// A message that cannot travel (headers or body too large) is parked with the reason.
fn cannot_schedule(e: &Error) -> Outcome {
    Outcome::Permanent(format!("cannot schedule: {}", crate::error::chain(e)))
}

// ---- broker I/O ----------------------------------------------------------------------------

/// The gateway of [`Settings::gateway`]'s pairs.
pub struct Gateway {
    settings: Settings,
    layout: Layout,
    pairs: Vec<Pair>,
    /// Who may deliver through each pair (shared by every worker of the gateway, and kept
    /// current by its follower of the control stream).
    writers: Arc<Writers>,
    /// The virtual host its pair records say they were asked for in.
    asked_in: Option<String>,
}

impl Gateway {
    /// Checks what a gateway needs of `settings` ([`Settings::validate_gateway`]) and names the
    /// pairs' queues from the layout (no I/O).
    pub fn new(settings: Settings) -> Result<Gateway> {
        settings.validate_gateway().map_err(Error::config)?;
        let layout = settings
            .layout()
            .map_err(crate::settings::SettingsError::from)?;
        let pairs = settings
            .gateway
            .pairs
            .iter()
            .map(|p| Pair::new(&layout, p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(Error::config)?;
        let configured = pairs.iter().map(|p| (p.ingress.as_str(), &p.writers[..]));
        let writers = Arc::new(Writers::new(configured, settings.gateway.follow));
        Ok(Gateway {
            settings,
            layout,
            pairs,
            writers,
            asked_in: None,
        })
    }

    /// The same gateway, whose pair records ([`Gateway::declare`]) say they were asked for in
    /// virtual host `vhost` (`delay-proxy`: its client's).
    pub fn asked_in(mut self, vhost: Option<String>) -> Gateway {
        self.asked_in = vhost;
        self
    }

    /// The validated pairs.
    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }

    /// Declares the tier topology, then per pair the ingress exchange (durable fanout), the
    /// ingress and due queues and the binding; checks that every target exchange exists.
    /// Idempotent.
    pub async fn declare(&self, conn: &Connection) -> Result<()> {
        let topology = Topology::new(self.layout.clone());
        // an admin may have declared the topology already (the gateway then needs no right to
        // configure it): only a missing one is declared here
        match topology.verify(conn).await {
            Ok(()) => {}
            Err(Error::NotDeclared { .. }) => topology.declare(conn).await?,
            Err(e) => return Err(e),
        }
        let qargs = topology.consumed_queue_args();
        for p in &self.pairs {
            self.check_target(conn, p).await?;
            // What exists is used as it is (an admin may have declared it with `gateway
            // --declare-only`, so that the gateway itself needs no right to configure it).
            let ch = broker::open(conn).await?;
            if !broker::exchange_exists(conn, &p.ingress).await? {
                match broker::declare_exchange(
                    &ch,
                    &p.ingress,
                    ExchangeKind::Fanout,
                    FieldTable::default(),
                )
                .await
                {
                    Err(Error::Conflict(text)) => {
                        return Err(Error::Conflict(format!(
                            "{text} (the plugin's x-delayed-message exchange?) Delete it once it is drained, or choose another ingress name"
                        )));
                    }
                    other => other?,
                }
            }
            for q in [&p.ingress_queue, &p.due_queue] {
                if broker::queue_state(conn, q).await?.is_none() {
                    broker::declare_queue_spread(conn, q, qargs.clone()).await?;
                }
            }
            broker::bind_queue(&ch, &p.ingress_queue, &p.ingress, "").await?;
            broker::close(&ch, "declared").await;
            // the due queue's binding on the delivery exchange needs read on that exchange,
            // which a gateway with least privilege does not have: an admin's declare made it
            match topology.declare_destination(conn, &p.due_queue).await {
                Ok(_) => {}
                Err(Error::Amqp { source, .. })
                    if broker::is_reply(&source, broker::ACCESS_REFUSED) =>
                {
                    tracing::debug!(queue = %p.due_queue, "not allowed to bind the due queue; relying on `gateway --declare-only` by an admin");
                }
                Err(e) => return Err(e),
            }
            topology.declare_parking(conn, &p.due_queue).await?;
            topology.declare_parking(conn, &p.ingress_queue).await?;
            topology.declare_batch_marker(conn, &p.due_queue).await?;
            // so that `teardown` finds this pair's queues without a configuration
            let record = control::Record::GatewayPair {
                ingress: p.ingress.clone(),
                target: p.target.clone(),
                writers: p.writers.clone(),
                vhost: self.asked_in.clone(),
            };
            control::append(conn, &self.layout, &record).await?;
        }
        Ok(())
    }

    /// Fails when `pair`'s target exchange is missing. A user that may not check it is let
    /// through: RabbitMQ 4.3 checks a passive declare against the user's rights on the
    /// exchange, and an admin's `gateway --declare-only` or `delay-proxy` (whose client the
    /// broker has just let declare it) has none on an application's exchange; the running
    /// gateway, which writes it, checks it when it starts.
    async fn check_target(&self, conn: &Connection, pair: &Pair) -> Result<()> {
        match broker::exchange_exists(conn, &pair.target).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::Missing {
                object: format!("target exchange '{}'", pair.target),
                hint: "declare it, with the bindings your queues had on the delayed exchange, before starting the gateway".into(),
            }),
            Err(Error::Amqp { source, .. })
                if broker::is_reply(&source, broker::ACCESS_REFUSED) =>
            {
                tracing::debug!(target = %pair.target, "not allowed to check the target exchange; the gateway checks it when it starts");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes what [`Gateway::declare`] created for the pairs (ingress exchanges, ingress, due
    /// and parking queues; messages in them are lost). Leaves the targets and the tier topology.
    pub async fn delete(&self, conn: &Connection) -> Result<()> {
        delete_pairs(conn, &self.pairs).await
    }

    /// The worker consuming every pair's ingress and due queues.
    pub fn worker(&self) -> Worker<GatewayHandler> {
        // The tier publish must be given up (and the ingress message requeued) before the
        // worker's handler timeout would turn it into a retry.
        let handler_ms = self.settings.consumer.handler_timeout.as_millis();
        let confirm_timeout = Duration::from_millis((handler_ms / 2).clamp(1, 30_000));
        let mut settings = self.settings.clone();
        settings.publisher.batch_linger = settings.publisher.gateway_linger();
        // Messages held until due (`gateway.hold`) wait in the worker's hold, as early grain
        // batches do, each in a prefetch slot: `gateway.max_held` more of those, so that
        // holding never takes the slots of the messages in flight to the tiers.
        if self.settings.gateway.hold.as_millis() > 0 {
            let extra = u16::try_from(self.settings.gateway.max_held).unwrap_or(u16::MAX);
            settings.consumer.hold_prefetch = settings.consumer.hold_prefetch.saturating_add(extra);
        }
        // Ingress messages wait in the batcher for their batch's confirm, each in a prefetch
        // slot and without a handler permit ([`Handler::takes_permit`]): the batcher may hold
        // every ingress delivery in hand, so that only the linger (or a message's
        // slack) decides when a batch leaves, never a count reached first; with many pairs at
        // most `publisher.max_pending` (each round of the batcher looks at all it holds).
        let ingress_prefetch =
            settings.consumer.io_concurrency + usize::from(settings.consumer.hold_prefetch);
        settings.publisher.max_pending = ingress_prefetch
            .saturating_mul(self.pairs.len().max(1))
            .min(settings.publisher.max_pending.max(ingress_prefetch));
        let mut w = Worker::new(settings);
        for p in &self.pairs {
            let ctx = Arc::new(PairCtx {
                pair: p.clone(),
                max_delay_ms: self.layout.max_delay_ms(),
                confirm_timeout,
                hold_ms: self.settings.gateway.hold.as_millis(),
                writers: self.writers.clone(),
            });
            w = w
                .subscribe(
                    p.ingress_queue.clone(),
                    GatewayHandler {
                        ctx: ctx.clone(),
                        ingress: true,
                    },
                )
                .subscribe(
                    p.due_queue.clone(),
                    GatewayHandler {
                        ctx,
                        ingress: false,
                    },
                );
        }
        w
    }

    /// Declares everything, then relays messages until `shutdown` completes (the worker
    /// reconnects after a connection loss).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        self.declare_once().await?;
        for p in &self.pairs {
            tracing::info!(
                ingress = %p.ingress,
                target = %p.target,
                parked = %p.parked_queue,
                "gateway pair ready"
            );
        }
        if self.settings.gateway.follow {
            let (_none, announced) = tokio::sync::mpsc::unbounded_channel();
            return follow::serve(self, announced, false, shutdown).await;
        }
        self.worker().run(shutdown).await
    }

    /// Serves the configured pairs and follows the pairs of `delay-proxy`'s shape (ingress
    /// `<prefix>.gw.x.<target>`) registered at run time, as [`Gateway::run`] with
    /// `gateway.follow` does for every pair, and serves a pair sent on `announced` at once: a
    /// process that registers pairs itself (`delay-proxy`) serves each before its client
    /// publishes, rather than when the record is read back. Declares the tiers when they are
    /// missing. Runs until `shutdown` completes.
    pub async fn run_announced(
        self,
        announced: tokio::sync::mpsc::UnboundedReceiver<Pair>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        self.declare_once().await?;
        follow::serve(self, announced, true, shutdown).await
    }

    /// [`Gateway::declare`] on a connection of its own, closed after.
    async fn declare_once(&self) -> Result<()> {
        let conn = crate::connection::Connector::new(&self.settings)?
            .connect("amqp-delay gateway")
            .await?;
        let declared = self.declare(&conn).await;
        crate::broker::close_connection(&conn, "declared").await;
        declared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway handler of one pair, holding delays up to `hold_ms`.
    fn handler(ingress: bool, hold_ms: u64) -> GatewayHandler {
        let layout = Settings::default().layout().unwrap();
        let cfg = PairConfig {
            ingress: "i".into(),
            target: "t".into(),
            writers: Vec::new(),
        };
        let ctx = PairCtx {
            pair: Pair::new(&layout, &cfg).unwrap(),
            max_delay_ms: layout.max_delay_ms(),
            confirm_timeout: Duration::from_secs(1),
            hold_ms,
            writers: Arc::new(Writers::new([("i", &[][..])], false)),
        };
        GatewayHandler {
            ctx: Arc::new(ctx),
            ingress,
        }
    }

    /// An application's message with this `x-delay` header (none for `None`).
    fn with_x_delay(x_delay: Option<AMQPValue>) -> Delivery {
        let mut h = FieldTable::default();
        if let Some(v) = x_delay {
            h.insert(X_DELAY.into(), v);
        }
        let props = lapin::BasicProperties::default().with_headers(h);
        crate::envelope::decode("gw.in.i", b"x".to_vec(), props, "k", "i", false).0
    }

    #[test]
    fn the_delay_counts_from_the_proxys_publish_time_never_from_a_later_one() {
        let gw = handler(true, 100);
        let stamped = |delay: i64, at: AMQPValue| {
            let mut h = FieldTable::default();
            h.insert(X_DELAY.into(), AMQPValue::LongLongInt(delay));
            h.insert(PUBLISHED_AT.into(), at);
            let props = lapin::BasicProperties::default().with_headers(h);
            crate::envelope::decode("gw.in.i", b"x".to_vec(), props, "k", "i", false).0
        };
        let now = crate::time::now_ms();
        let at = |ms: u64| AMQPValue::LongLongInt(i64::try_from(ms).unwrap());
        // taken 1 s ago with x-delay 1.05 s: 50 ms are left, so it is held, due 1.05 s after
        // the publish and not before
        let d = stamped(1050, at(now - 1000));
        assert!((now - 1000 + 1050..=crate::time::now_ms() + 50).contains(&gw.due_at(&d).unwrap()));
        assert_eq!(waited_ms(&d, now), 1000);
        // a time after now counts as now; an unreadable one as no stamp
        assert_eq!(waited_ms(&stamped(5, at(now + 60_000)), now), 0);
        assert_eq!(
            waited_ms(&stamped(5, AMQPValue::LongString("x".into())), now),
            0
        );
        // long past: due at once (the writer's own message, as with a smaller x-delay)
        let due = gw.due_at(&stamped(1000, at(now - 3_600_000))).unwrap();
        assert!(due <= crate::time::now_ms());
    }

    #[test]
    fn only_a_valid_x_delay_up_to_the_hold_is_held_and_never_due_before_it_ends() {
        let gw = handler(true, 100);
        for ms in [0, 1, 50, 100] {
            let before = crate::time::now_ms();
            let due = gw.due_at(&with_x_delay(Some(AMQPValue::LongLongInt(ms))));
            let due = due.unwrap_or_else(|| panic!("x-delay {ms} is held"));
            assert!(
                due >= before + ms as u64,
                "x-delay {ms}: due {due}, asked at {before}"
            );
            assert!(due <= crate::time::now_ms() + ms as u64);
        }
        for v in [
            Some(AMQPValue::LongLongInt(101)),
            Some(AMQPValue::LongString("soon".into())),
        ] {
            assert_eq!(gw.due_at(&with_x_delay(v.clone())), None, "{v:?}");
        }
        // no x-delay is due now, as the plugin delivers it
        assert!(gw.due_at(&with_x_delay(None)).is_some());
        // holding off, or the due stage: nothing is held
        let x = Some(AMQPValue::LongLongInt(10));
        assert_eq!(handler(true, 0).due_at(&with_x_delay(x.clone())), None);
        assert_eq!(handler(false, 100).due_at(&with_x_delay(x)), None);
    }

    #[test]
    fn only_the_due_stage_takes_a_handler_permit() {
        let d = with_x_delay(Some(AMQPValue::LongLongInt(5_000)));
        assert!(!handler(true, 100).takes_permit(&d));
        assert!(!handler(true, 0).takes_permit(&d));
        assert!(handler(false, 100).takes_permit(&d));
    }

    #[test]
    fn pair_names_never_collide_and_are_checked() {
        let layout = Settings::default().layout().unwrap();
        let pair = |i: &str| {
            Pair::new(
                &layout,
                &PairConfig {
                    ingress: i.into(),
                    target: "t".into(),
                    writers: Vec::new(),
                },
            )
        };
        let a = pair("x").unwrap();
        let b = pair("x.due").unwrap();
        let c = pair("due.x").unwrap();
        let names = [
            &a.ingress_queue,
            &a.due_queue,
            &b.ingress_queue,
            &b.due_queue,
            &c.ingress_queue,
            &c.due_queue,
        ];
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert!(pair("a..b").is_err());
        assert!(pair("a.*").is_err());
        assert!(pair(&"x".repeat(220)).unwrap_err().contains("255"));
        assert!(pair(&"x".repeat(240)).is_err());
    }

    #[test]
    fn a_gateway_is_built_only_from_settings_a_gateway_can_run_with() {
        // the checks themselves: settings::tests
        let mut s = Settings::default();
        let e = Gateway::new(s.clone()).err().unwrap().to_string();
        assert!(e.contains("the gateway has no pair"), "{e}");
        s.gateway.pairs = vec![PairConfig {
            ingress: "i".into(),
            target: "t".into(),
            writers: Vec::new(),
        }];
        assert!(Gateway::new(s.clone()).is_ok());
        s.gateway.hold = crate::time::DurationMs(1_000);
        s.consumer.max_hold = crate::time::DurationMs(1_000);
        let e = Gateway::new(s).err().unwrap().to_string();
        assert!(
            e.contains("gateway.hold (1s) must be shorter than consumer.max_hold (1s)"),
            "{e}"
        );
    }
}
