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
mod handler;
mod pair;
mod writers;
pub mod x_delay;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

use crate::broker;
use crate::control;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::settings::Settings;
use crate::topology::Topology;
use crate::worker::Worker;
use handler::PairCtx;
pub use handler::{GatewayHandler, Ingress, due_message};
pub(crate) use pair::delete_pairs;
pub use pair::{Pair, end_pair, registered_pairs};
use writers::Writers;

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
    use crate::settings::PairConfig;

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
