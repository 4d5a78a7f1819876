//! Broker I/O for the topology: declaring it (idempotently, refusing a different existing shape
//! with a clear message), reading queue depths for `stats`, and deleting it.

use futures::{StreamExt, TryStreamExt};
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

use crate::broker::{
    self, PRECONDITION_FAILED, bind_queue, declare_exchange, open, parse_inequivalent,
};
use crate::control;
use crate::error::{Error, Result, ResultExt};
use crate::layout::{Layout, QueueType, Tier, TierKind};
use crate::time::compact_duration;

mod stats;
pub use stats::QueueStat;

/// The delay topology on one broker.
#[derive(Debug, Clone)]
pub struct Topology {
    layout: Layout,
}

impl Topology {
    /// The topology of `layout` (no I/O until a method is called).
    pub fn new(layout: Layout) -> Topology {
        Topology { layout }
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Declares every exchange, queue and binding. Idempotent. Fails with
    /// [`Error::Conflict`] when objects under this prefix exist with other settings.
    pub async fn declare(&self, conn: &Connection) -> Result<()> {
        let l = &self.layout;
        let ch = open(conn).await?;
        self.declare_marker(&ch).await?;
        declare_exchange(
            &ch,
            &l.signature_exchange(),
            ExchangeKind::Fanout,
            FieldTable::default(),
        )
        .await?;
        control::declare(conn, l).await?;
        crate::ledger::declare(conn, l).await?;
        crate::journal::declare(conn, l).await?;

        // Parking first: the delivery exchange's alternate exchange must exist before anything
        // can be delivered (DESIGN rule 5: a dead-lettered message that routes nowhere is
        // dropped or stuck in its tier).
        self.declare_parking_exchanges(conn, &ch).await?;

        let mut ae = FieldTable::default();
        ae.insert(
            "alternate-exchange".into(),
            broker::long_string(&l.parking_exchange()),
        );
        declare_exchange(&ch, &l.delivery_exchange(), ExchangeKind::Topic, ae).await?;
        for k in 0..l.levels() {
            declare_exchange(
                &ch,
                &l.level_exchange(k),
                ExchangeKind::Topic,
                FieldTable::default(),
            )
            .await?;
        }

        // Tier queues, spread over the cluster's nodes (4 at a time: quorum queue creation is
        // slow), so that no single node does all the dead-letter work.
        let tiers = l.tiers();
        futures::stream::iter(tiers.iter())
            .map(|t| broker::declare_queue_spread(conn, &t.queue, self.tier_args(t)))
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await?;

        // Cascade bindings: digit d → its queue, digit 0 → next level down.
        for k in 0..l.levels() {
            let x = l.level_exchange(k);
            for d in 1..l.radix() {
                bind_queue(&ch, &l.cascade_queue(k, d), &x, &l.level_binding(k, d)).await?;
            }
            let below = if k == 0 {
                l.delivery_exchange()
            } else {
                l.level_exchange(k - 1)
            };
            broker::bind_exchange(&ch, &below, &x, &l.level_binding(k, 0)).await?;
        }
        // Fixed levels and overflow chain: a fanout exchange in front of each queue.
        for t in &tiers {
            if matches!(t.kind, TierKind::Cascade { .. }) {
                continue;
            }
            declare_exchange(&ch, &t.queue, ExchangeKind::Fanout, FieldTable::default()).await?;
            bind_queue(&ch, &t.queue, &t.queue, "").await?;
        }
        broker::close(&ch, "declared").await;
        Ok(())
    }

    /// The parking exchange (the delivery exchange's alternate) with the unroutable queue, and
    /// the park exchange the destinations' parking queues are bound to as they are declared.
    async fn declare_parking_exchanges(&self, conn: &Connection, ch: &Channel) -> Result<()> {
        let l = &self.layout;
        let fanout = FieldTable::default();
        declare_exchange(ch, &l.parking_exchange(), ExchangeKind::Fanout, fanout).await?;
        let parked = l.unroutable_queue();
        broker::declare_queue_spread(conn, &parked, self.parked_args()).await?;
        bind_queue(ch, &parked, &l.parking_exchange(), "").await?;
        let direct = FieldTable::default();
        declare_exchange(ch, &l.park_exchange(), ExchangeKind::Direct, direct).await
    }

    /// Makes sure destination queue `queue` exists (creating it durable, of the tiers' queue type,
    /// when it does not; an existing queue is left as it is) and is bound on the delivery
    /// exchange. Returns whether it was created.
    pub async fn declare_destination(&self, conn: &Connection, queue: &str) -> Result<bool> {
        let l = &self.layout;
        l.validate_destination(queue).map_err(Error::Invalid)?;
        let created = match broker::queue_state(conn, queue).await? {
            Some(_) => false,
            None => {
                broker::declare_queue_spread(conn, queue, self.consumed_queue_args()).await?;
                true
            }
        };
        let ch = open(conn).await?;
        bind_queue(
            &ch,
            queue,
            &l.delivery_exchange(),
            &l.destination_binding(queue),
        )
        .await?;
        broker::close(&ch, "declared").await;
        Ok(created)
    }

    /// Makes sure the parking queue of destination `queue` exists (a passive check first, so a
    /// worker whose admin declared it needs no right to configure it).
    pub async fn declare_parking(&self, conn: &Connection, queue: &str) -> Result<()> {
        let name = self.layout.parked_queue(queue);
        if name.len() > 255 {
            return Err(Error::Invalid(format!(
                "parking queue name for '{queue}' would be longer than 255 bytes"
            )));
        }
        if broker::queue_state(conn, &name).await?.is_none() {
            broker::declare_queue_spread(conn, &name, self.parked_args()).await?;
        }
        // a worker parks through the park exchange (declared by `declare`), with the
        // destination's name as the key. A worker or gateway with least privilege may not
        // bind: an admin's `declare --queue Q --worker` or `gateway --declare-only` did
        let park = self.layout.park_exchange();
        if !broker::exchange_exists(conn, &park).await? {
            return Err(not_declared(
                &self.layout,
                &format!(": the park exchange '{park}' is missing"),
            ));
        }
        let ch = open(conn).await?;
        let bound = bind_queue(&ch, &name, &park, queue).await;
        broker::close(&ch, "declared").await;
        match bound {
            Err(Error::Amqp { source, .. })
                if broker::is_reply(&source, broker::ACCESS_REFUSED) =>
            {
                tracing::debug!(queue = %name, "not allowed to bind the parking queue; relying on an admin's declare");
                Ok(())
            }
            other => other,
        }
    }

    /// Declares the batch and hold markers of destination `queue`: publishers then send it
    /// batches — grain batches that arrive early, which the consumer holds until each member
    /// is due — that only our worker reads (the worker declares them when it starts
    /// consuming). Recorded in the control stream so that `teardown` removes them. Idempotent.
    pub async fn declare_batch_marker(&self, conn: &Connection, queue: &str) -> Result<()> {
        let (Some(marker), Some(holds)) = (
            self.layout.batch_marker(queue),
            self.layout.hold_marker(queue),
        ) else {
            return Err(Error::Invalid(format!(
                "the batch marker name for '{queue}' would be longer than 255 bytes; it gets plain messages"
            )));
        };
        if broker::exchange_exists(conn, &holds).await? {
            return Ok(());
        }
        let ch = open(conn).await?;
        // the batch marker first: a publisher that sees the hold marker finds both
        declare_exchange(&ch, &marker, ExchangeKind::Fanout, FieldTable::default()).await?;
        declare_exchange(&ch, &holds, ExchangeKind::Fanout, FieldTable::default()).await?;
        broker::close(&ch, "declared").await;
        let record = control::Record::BatchMarker {
            queue: queue.into(),
        };
        control::append(conn, &self.layout, &record).await
    }

    /// Checks that the topology exists and was declared with these settings, without creating
    /// anything else. Used by publishers before their first message.
    pub async fn verify(&self, conn: &Connection) -> Result<()> {
        let l = &self.layout;
        // passive checks only: a publisher needs no right to configure anything
        if !broker::exchange_exists(conn, &l.signature_exchange()).await? {
            if !broker::exchange_exists(conn, &l.layout_marker()).await? {
                return Err(not_declared(l, ""));
            }
            // declared with other settings: re-declaring the marker names the difference
            // (when the user may; a refusal still says what is wrong)
            let ch = open(conn).await?;
            let r = self.declare_marker(&ch).await;
            broker::close(&ch, "verified").await;
            return Err(match r {
                Err(e @ Error::Conflict(_)) => e,
                _ => Error::Conflict(format!(
                    "the topology under prefix '{}' was declared with other settings than these [{}]; use the original settings, or another --prefix",
                    l.prefix(),
                    l.signature()
                )),
            });
        }
        if broker::queue_state(conn, &l.control_stream())
            .await?
            .is_none()
        {
            return Err(not_declared(l, ": the control stream is missing"));
        }
        // Fixed levels can be added to a topology later, so they are not in the signature:
        // check that every one this configuration may use exists.
        for &ms in l.fixed_ms() {
            let last = l.fixed_shard_exchange(ms, l.fixed_shards() - 1);
            if !broker::exchange_exists(conn, &last).await? {
                return Err(not_declared(
                    l,
                    &format!(
                        ": fixed level {} (with {} shard(s)) is configured but not declared",
                        compact_duration(ms),
                        l.fixed_shards()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every queue and every exchange of this layout, by name (what [`Topology::delete`]
    /// deletes): all of them under the prefix.
    pub fn objects(&self) -> (Vec<String>, Vec<String>) {
        let l = &self.layout;
        let mut queues: Vec<String> = l.tiers().into_iter().map(|t| t.queue).collect();
        queues.push(l.unroutable_queue());
        queues.push(l.control_stream());
        queues.push(l.ledger_stream());
        queues.push(l.journal_stream());
        let mut exchanges: Vec<String> = (0..l.levels()).map(|k| l.level_exchange(k)).collect();
        exchanges.extend(l.tiers().into_iter().filter_map(|t| match t.kind {
            TierKind::Cascade { .. } => None,
            _ => Some(t.queue),
        }));
        exchanges.push(l.delivery_exchange());
        exchanges.push(l.parking_exchange());
        exchanges.push(l.stream_exchange());
        exchanges.push(l.park_exchange());
        exchanges.push(l.layout_marker());
        exchanges.push(l.signature_exchange());
        (queues, exchanges)
    }

    /// Deletes every exchange and queue of this layout (messages in them are lost). Missing
    /// objects are ignored, so it is safe to run twice.
    pub async fn delete(&self, conn: &Connection) -> Result<()> {
        let (queues, exchanges) = self.objects();
        let ch = open(conn).await?;
        for q in &queues {
            ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .context(|| format!("deleting queue '{q}'"))?;
        }
        for x in &exchanges {
            ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .context(|| format!("deleting exchange '{x}'"))?;
        }
        broker::close(&ch, "deleted").await;
        Ok(())
    }

    async fn declare_marker(&self, ch: &Channel) -> Result<()> {
        let l = &self.layout;
        let marker = l.layout_marker();
        let mut args = FieldTable::default();
        args.insert(
            "alternate-exchange".into(),
            broker::long_string(&l.signature_exchange()),
        );
        let opts = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        match ch
            .exchange_declare(marker.as_str().into(), ExchangeKind::Fanout, opts, args)
            .await
        {
            Ok(()) => Ok(()),
            Err(e) => match broker::reply(&e) {
                Some((PRECONDITION_FAILED, text)) => {
                    let existing = parse_inequivalent(&text)
                        .map(|i| signature_of(&i.current))
                        .unwrap_or_else(|| "(unknown)".into());
                    Err(Error::Conflict(format!(
                        "the topology under prefix '{}' was declared with other settings: {}. \
                         The broker has [{existing}], this configuration wants [{}]. \
                         Use the original settings, or another --prefix, or drain the old \
                         topology and remove it with `delay-publisher teardown`.",
                        l.prefix(),
                        describe_differences(&signature_of(&existing), &l.signature()),
                        l.signature()
                    )))
                }
                _ => Err(e).context(|| format!("declaring '{marker}'")),
            },
        }
    }

    fn base_queue_args(&self) -> FieldTable {
        broker::queue_type_args(self.layout.queue_type())
    }

    /// Arguments of a queue our workers consume (a destination `declare --queue` creates, the
    /// gateway's queues; DESIGN rules 4 and 12: at-least-once dead-lettering, a delivery
    /// limit): a message that reaches the delivery limit is dead-lettered into the
    /// parking exchange, so it lands in `<prefix>.parked` with the reason (`delivery_limit`) in
    /// `x-death`, never lost. Quorum queues get the limit (`DELIVERY_LIMIT`, 20) explicitly (4.x's
    /// default; 3.x has none): a message that can never be received (a header frame over
    /// `frame_max`) is then parked after that many deliveries instead of blocking the queue
    /// forever, while the worker takes one message at a time. Classic queues have no delivery
    /// limit.
    pub fn consumed_queue_args(&self) -> FieldTable {
        let mut a = self.base_queue_args();
        a.insert(
            "x-dead-letter-exchange".into(),
            broker::long_string(&self.layout.parking_exchange()),
        );
        if self.layout.queue_type() == QueueType::Quorum {
            a.insert(
                "x-dead-letter-strategy".into(),
                broker::long_string("at-least-once"),
            );
            a.insert("x-overflow".into(), broker::long_string("reject-publish"));
            a.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(DELIVERY_LIMIT),
            );
        }
        a
    }

    /// Arguments of a parking queue (`<prefix>.parked`, `<prefix>.parked.<queue>`): quorum ones
    /// get a delivery limit no browse reaches ([`PARKED_DELIVERY_LIMIT`]).
    fn parked_args(&self) -> FieldTable {
        let mut a = self.base_queue_args();
        if self.layout.queue_type() == QueueType::Quorum {
            a.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(PARKED_DELIVERY_LIMIT),
            );
        }
        a
    }

    /// Arguments of a tier queue (DESIGN rules 1, 4 and 7: one queue-level TTL, at-least-once
    /// dead-lettering with reject-publish on quorum queues, never `x-expires`).
    pub fn tier_args(&self, t: &Tier) -> FieldTable {
        let mut a = self.base_queue_args();
        a.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(t.ttl_ms as i64),
        );
        // DESIGN rule 2: no `x-dead-letter-routing-key`, so the message keeps its routing key,
        // which carries the rest of its route.
        a.insert(
            "x-dead-letter-exchange".into(),
            broker::long_string(&t.dead_letter_exchange),
        );
        a.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        if self.layout.queue_type() == QueueType::Quorum {
            a.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
        }
        if let Some(n) = self.layout.max_tier_length() {
            a.insert("x-max-length".into(), AMQPValue::LongLongInt(n as i64));
        }
        a
    }
}

/// The delivery limit of the quorum queues our workers consume (RabbitMQ 4.x's default for
/// every quorum queue, DESIGN rule 12): a message delivered this many times without an ack is
/// parked.
pub(crate) const DELIVERY_LIMIT: i64 = 20;

/// The delivery limit of the parking queues: none that looking at a parked message reaches.
/// RabbitMQ 4.x gives a quorum queue declared without one a limit of 20 and, with no
/// dead-letter exchange (a parking queue has none), drops a message returned more often: 21
/// looks (the management UI's "Get messages", a `basic.get` given back) deleted it on 4.0.5,
/// and on 4.3.6 through a reject or a closed channel. `-1` (unlimited on 4.x) makes 3.10 drop a
/// message at its first return. Measured: docs/reports/2026-12-06-parked-browse.md.
pub(crate) const PARKED_DELIVERY_LIMIT: i64 = 1_000_000_000;

fn not_declared(l: &Layout, detail: &str) -> Error {
    Error::NotDeclared {
        prefix: l.prefix().to_string(),
        detail: detail.to_string(),
    }
}

/// The signature a signature exchange's name carries (`p.layout.r16.u1` → `r=16 u=1`), or the
/// name as it is when it carries a hash.
fn signature_of(name: &str) -> String {
    let Some(slug) = name.rsplit_once(".layout.").map(|(_, s)| s) else {
        return name.to_string();
    };
    if slug.starts_with('h') && !slug.contains('.') {
        return name.to_string();
    }
    slug.split('.')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let (k, v) = w.split_at(1);
            format!("{k}={v}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `r=16 u=1` vs `r=8 u=1` → `radix: 16 → 8`.
fn describe_differences(existing: &str, wanted: &str) -> String {
    let parse = |s: &str| -> Vec<(String, String)> {
        s.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let old = parse(existing);
    let diffs: Vec<String> = parse(wanted)
        .into_iter()
        .filter_map(|(k, v)| {
            let before = old
                .iter()
                .find(|(ok, _)| *ok == k)
                .map(|(_, ov)| ov.as_str());
            match before {
                Some(b) if b == v => None,
                Some(b) => Some(format!("{}: {b} → {v}", Layout::signature_key_name(&k))),
                None => Some(format!("{}: ? → {v}", Layout::signature_key_name(&k))),
            }
        })
        .collect();
    if diffs.is_empty() {
        "settings differ".into()
    } else {
        diffs.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_exchanges_carry_the_signature() {
        assert_eq!(
            signature_of("p.x.layout.r16.u1.L8.o1x4294967296.tquorum.m-"),
            "r=16 u=1 L=8 o=1x4294967296 t=quorum m=-"
        );
        let l = Layout::new("p.x", &crate::layout::TopologySettings::default()).unwrap();
        assert_eq!(signature_of(&l.signature_exchange()), l.signature());
        let long = Layout::new(
            &"p".repeat(200),
            &crate::layout::TopologySettings::default(),
        )
        .unwrap();
        assert!(long.signature_exchange().len() <= 255);
    }

    #[test]
    fn consumed_quorum_queues_park_after_the_delivery_limit() {
        let get = |t: &Topology, k: &str| t.consumed_queue_args().inner().get(k).cloned();
        let quorum =
            Topology::new(Layout::new("p", &crate::layout::TopologySettings::default()).unwrap());
        assert_eq!(
            get(&quorum, "x-delivery-limit"),
            Some(AMQPValue::LongLongInt(20))
        );
        // ... where a message that reaches it goes: the parking exchange (→ p.parked), kept
        // at least once
        assert_eq!(
            get(&quorum, "x-dead-letter-exchange"),
            Some(broker::long_string("p.parking"))
        );
        assert_eq!(quorum.layout().parking_exchange(), "p.parking");
        assert_eq!(
            get(&quorum, "x-dead-letter-strategy"),
            Some(broker::long_string("at-least-once"))
        );
        let classic = Topology::new(
            Layout::new(
                "p",
                &crate::layout::TopologySettings {
                    queue_type: QueueType::Classic,
                    ..crate::layout::TopologySettings::default()
                },
            )
            .unwrap(),
        );
        assert_eq!(get(&classic, "x-delivery-limit"), None);
    }

    #[test]
    fn differences_are_named() {
        assert_eq!(
            describe_differences("r=16 u=1 t=quorum", "r=8 u=1 t=quorum"),
            "radix: 16 → 8"
        );
    }
}
