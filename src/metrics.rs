//! What the process counts, in Prometheus' model (the `prometheus-client` crate): one registry per
//! process ([`global`]), shared by its publishers, workers, gateways and relays, served as text by
//! the `/metrics` endpoint. Names follow Prometheus' conventions: `amqp_delay_` prefix, `_total`
//! counters, base units (`_seconds`). No I/O here.
//!
//! For one topology the counters add up: every message a publisher scheduled (`scheduled`) ends
//! up executed, parked, cancelled or still waiting — retried ones wait again —, and every
//! message delivered to a worker (`delivered`) is executed, retried, parked or cancelled.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A destination queue.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// The queue name.
    pub queue: String,
}

/// A destination queue and why a message was parked there.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ParkedLabel {
    /// The queue name.
    pub queue: String,
    /// `permanent` (the handler said so), `exhausted` (last attempt failed), `invalid`
    /// (unreadable envelope or batch), `unroutable` (a gateway target or relay queue is missing).
    pub reason: String,
}

/// A tier (or parking) queue's depth.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// The queue name.
    pub queue: String,
    /// `cascade`, `fixed`, `overflow` or `parked`.
    pub kind: String,
}

/// A stream and why one of its records was skipped.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkippedLabel {
    /// `control` or `ledger`.
    pub stream: String,
    /// `oversize` (more bytes than any record we write), `too_many_items` (more tombstones or
    /// counts than one record of ours holds), `insane` (a snapshot covering offsets at or after
    /// its own, an id no message can have) or `tombstones_full` (a tombstone past the cap of
    /// live ones).
    pub reason: String,
}

/// How soon the messages a gauge counts fall due: `1m`, `1h`, `1d` or `all`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DueLabel {
    /// The bound.
    pub due_within: String,
}

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    /// Messages a publisher scheduled (confirmed by the broker), each once: a worker's retry
    /// counts in `retried`, not here.
    pub scheduled: Counter,
    /// Broker messages published into the tiers (a batch counts once).
    pub broker_messages: Counter,
    /// Records appended to the journal stream (scheduled, confirmed, ran).
    pub journal_records: Counter,
    /// Occurrences of recurring schedules a `recurring serve` replica taking over found in the
    /// journal, published by the replica before it but not yet marked, and did not publish
    /// again.
    pub recurring_already_published: Counter,
    /// Takeovers of `recurring serve` that could not read the journal: the occurrences past
    /// each schedule's mark were published again, so one published just before the takeover
    /// may run twice.
    pub recurring_takeover_unchecked: Counter,
    /// Publishes the broker refused (nack).
    pub nacks: Counter,
    /// Publishes the broker returned as unroutable.
    pub returns: Counter,
    /// Messages delivered to a worker (batch members counted one by one).
    pub delivered: Family<QueueLabel, Counter>,
    /// Handlers that succeeded.
    pub executed: Family<QueueLabel, Counter>,
    /// Retries scheduled through the tiers.
    pub retried: Family<QueueLabel, Counter>,
    /// Messages parked, by reason.
    pub parked: Family<ParkedLabel, Counter>,
    /// Messages acked without running because they were cancelled.
    pub cancelled: Family<QueueLabel, Counter>,
    /// Cancels a worker read after it had run the message (succeeded or parked).
    pub cancel_too_late: Family<QueueLabel, Counter>,
    /// Barriers appended to the control stream to sync before running a message.
    pub cancel_syncs: Counter,
    /// Messages whose `x-delay-*` headers (other than the schedule ones) a worker removed
    /// because their writer is none of ours (a forgery, see `amqp_delay::trust`).
    pub untrusted_headers_removed: Family<QueueLabel, Counter>,
    /// Stream records a reader skipped (or cut short) because no writer of ours makes them.
    pub records_skipped: Family<SkippedLabel, Counter>,
    /// Due time → handler start, in seconds.
    pub lateness: Family<QueueLabel, Histogram>,
    /// Handler run time, in seconds.
    pub handler_duration: Family<QueueLabel, Histogram>,
    /// Handlers running now.
    pub in_flight: Gauge,
    /// Messages a worker holds until they are due (grain batches arrive early).
    pub held: Gauge,
    /// Broker messages in each tier and parking queue (ready + held when the management API
    /// answers), sampled periodically.
    pub tier_messages: Family<TierLabel, Gauge>,
    /// Of those, dead-lettered by the tier and not yet moved on by the broker's dead-letter
    /// worker (management API only): a value that stays above 0 means the worker does not run.
    pub tier_dead_lettered: Family<TierLabel, Gauge>,
    /// Messages (not broker messages) not yet due, from the ledger, by how soon they fall due.
    pub messages_pending: Family<DueLabel, Gauge>,
    /// 1 while at least one of the process's broker connections works (a worker consuming, a
    /// follower reading: [`Live`]), 0 while none does.
    pub connected: Gauge,
    /// `delay-proxy`: client connections open now.
    pub proxy_connections: Gauge,
    /// `delay-proxy`: client connections refused over its caps (in all, per source address).
    pub proxy_connections_refused: Counter,
    /// `delay-proxy`: publishes sent to a pair's ingress (a positive or unreadable `x-delay`).
    pub proxy_delayed_publishes: Counter,
    /// `delay-proxy`: gateway pairs it registered after a client's declare.
    pub proxy_pairs_registered: Counter,
    /// `delay-proxy`: gateway pairs it ended after a client's delete of their exchange.
    pub proxy_pairs_ended: Counter,
    /// `delay-proxy`: delayed exchanges it knows (its own and those read from the control stream).
    pub proxy_pairs_known: Gauge,
    /// `delay-proxy`: delayed exchanges whose ingress queue holds messages that no gateway
    /// consumes (checked every few seconds).
    pub proxy_pairs_unserved: Gauge,
    /// `delay-proxy`: delayed publishes the broker returned to their client because the pair's
    /// ingress queue was gone (nothing held them).
    pub proxy_delayed_returned: Counter,
    /// `delay-proxy`: ingress queues of known pairs found gone and declared again.
    pub proxy_ingresses_restored: Counter,
}

/// Lateness buckets: 1 ms to 5 min.
const LATENESS_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Handler duration buckets: 1 ms to 10 min.
const DURATION_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 300.0, 600.0,
];

impl Metrics {
    /// Every metric at zero, registered in the prefixed registry.
    fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("amqp_delay"),
            scheduled: Counter::default(),
            broker_messages: Counter::default(),
            journal_records: Counter::default(),
            recurring_already_published: Counter::default(),
            recurring_takeover_unchecked: Counter::default(),
            nacks: Counter::default(),
            returns: Counter::default(),
            delivered: Family::default(),
            executed: Family::default(),
            retried: Family::default(),
            parked: Family::default(),
            cancelled: Family::default(),
            cancel_too_late: Family::default(),
            cancel_syncs: Counter::default(),
            untrusted_headers_removed: Family::default(),
            records_skipped: Family::default(),
            lateness: Family::new_with_constructor(|| Histogram::new(LATENESS_BUCKETS)),
            handler_duration: Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
            in_flight: Gauge::default(),
            held: Gauge::default(),
            tier_messages: Family::default(),
            tier_dead_lettered: Family::default(),
            messages_pending: Family::default(),
            connected: Gauge::default(),
            proxy_connections: Gauge::default(),
            proxy_connections_refused: Counter::default(),
            proxy_delayed_publishes: Counter::default(),
            proxy_pairs_registered: Counter::default(),
            proxy_pairs_unserved: Gauge::default(),
            proxy_delayed_returned: Counter::default(),
            proxy_ingresses_restored: Counter::default(),
            proxy_pairs_ended: Counter::default(),
            proxy_pairs_known: Gauge::default(),
        };
        m.register_publishing();
        m.register_worker();
        m.register_state();
        m.register_proxy();
        m
    }

    /// What `delay-proxy` counts.
    fn register_proxy(&mut self) {
        self.registry.register(
            "proxy_connections",
            "delay-proxy: client connections open now",
            self.proxy_connections.clone(),
        );
        self.registry.register(
            "proxy_connections_refused",
            "delay-proxy: client connections refused over --max-connections or --max-connections-per-address",
            self.proxy_connections_refused.clone(),
        );
        self.registry.register(
            "proxy_delayed_publishes",
            "delay-proxy: publishes sent to a gateway pair's ingress (a positive or unreadable x-delay)",
            self.proxy_delayed_publishes.clone(),
        );
        self.registry.register(
            "proxy_pairs_unserved",
            "delay-proxy: delayed exchanges whose ingress queue holds messages that no gateway consumes",
            self.proxy_pairs_unserved.clone(),
        );
        self.registry.register(
            "proxy_delayed_returned",
            "delay-proxy: delayed publishes returned to their client (312 NO_ROUTE) because the pair's ingress queue was gone",
            self.proxy_delayed_returned.clone(),
        );
        self.registry.register(
            "proxy_ingresses_restored",
            "delay-proxy: ingress queues of known delayed exchanges found gone and declared again",
            self.proxy_ingresses_restored.clone(),
        );
        self.registry.register(
            "proxy_pairs_registered",
            "delay-proxy: gateway pairs registered after a client's declare was accepted",
            self.proxy_pairs_registered.clone(),
        );
        self.registry.register(
            "proxy_pairs_ended",
            "delay-proxy: gateway pairs ended after a client's delete of their exchange was accepted",
            self.proxy_pairs_ended.clone(),
        );
        self.registry.register(
            "proxy_pairs_known",
            "delay-proxy: delayed exchanges it knows (registered by it or read from the control stream)",
            self.proxy_pairs_known.clone(),
        );
    }

    /// What publishers count: messages scheduled, broker messages, nacks and returns.
    fn register_publishing(&mut self) {
        self.registry.register(
            "scheduled",
            "Messages scheduled (confirmed by the broker)",
            self.scheduled.clone(),
        );
        self.registry.register(
            "broker_messages",
            "Broker messages published into the tiers (a batch counts once)",
            self.broker_messages.clone(),
        );
        self.registry.register(
            "journal_records",
            "Records appended to the journal stream (scheduled, confirmed, ran)",
            self.journal_records.clone(),
        );
        self.registry.register(
            "recurring_already_published",
            "Occurrences a recurring serve replica taking over found journaled past their schedule's mark, and did not publish again",
            self.recurring_already_published.clone(),
        );
        self.registry.register(
            "recurring_takeover_unchecked",
            "Takeovers of recurring serve that could not read the journal (an occurrence published just before may run twice)",
            self.recurring_takeover_unchecked.clone(),
        );
        self.registry.register(
            "broker_nacks",
            "Publishes the broker refused",
            self.nacks.clone(),
        );
        self.registry.register(
            "broker_returns",
            "Publishes the broker returned as unroutable",
            self.returns.clone(),
        );
    }

    /// What workers count: deliveries and how each ended, cancels, lateness, handler time.
    fn register_worker(&mut self) {
        self.registry.register(
            "delivered",
            "Messages delivered to a worker",
            self.delivered.clone(),
        );
        self.registry
            .register("executed", "Handlers that succeeded", self.executed.clone());
        self.registry.register(
            "retried",
            "Retries scheduled through the tiers",
            self.retried.clone(),
        );
        self.registry
            .register("parked", "Messages parked, by reason", self.parked.clone());
        self.registry.register(
            "cancelled",
            "Messages acked without running because they were cancelled",
            self.cancelled.clone(),
        );
        self.registry.register(
            "cancel_too_late",
            "Cancels a worker read after it had run the message",
            self.cancel_too_late.clone(),
        );
        self.registry.register(
            "cancel_syncs",
            "Barriers appended to the control stream to sync before running a message",
            self.cancel_syncs.clone(),
        );
        self.registry.register(
            "untrusted_headers_removed",
            "Messages whose x-delay-* headers a worker removed because their writer is none of ours (not its own user, a peer or an admin), by queue",
            self.untrusted_headers_removed.clone(),
        );
        self.registry.register(
            "stream_records_skipped",
            "Records of the control or ledger stream a reader skipped (or cut short) because no writer of ours makes them, by stream and reason",
            self.records_skipped.clone(),
        );
        self.registry.register_with_unit(
            "lateness",
            "Time from a message's due time to its handler's start",
            prometheus_client::registry::Unit::Seconds,
            self.lateness.clone(),
        );
        self.registry.register_with_unit(
            "handler_duration",
            "Time a handler ran",
            prometheus_client::registry::Unit::Seconds,
            self.handler_duration.clone(),
        );
        self.registry
            .register("in_flight", "Handlers running now", self.in_flight.clone());
        self.registry.register(
            "held",
            "Messages waiting in a worker for their due time",
            self.held.clone(),
        );
    }

    /// The sampled gauges: tier depths, messages pending, the connection.
    fn register_state(&mut self) {
        self.registry.register(
            "tier_messages",
            "Broker messages in each tier and parking queue (ready + held when the management API answers)",
            self.tier_messages.clone(),
        );
        self.registry.register(
            "tier_dead_lettered_messages",
            "Of the tier's messages, those it dead-lettered that the broker's dead-letter worker has not moved on yet (management API only); staying above 0 means the worker does not run",
            self.tier_dead_lettered.clone(),
        );
        self.registry.register(
            "messages_pending",
            "Messages not yet due, counted from the ledger stream (a batch counts its members), by how soon they fall due (1m, 1h, 1d, all)",
            self.messages_pending.clone(),
        );
        self.registry.register(
            "connected",
            "1 while connected to the broker and consuming, 0 while (re)connecting",
            self.connected.clone(),
        );
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// The label of `queue`.
    pub fn queue(queue: &str) -> QueueLabel {
        QueueLabel {
            queue: queue.to_string(),
        }
    }

    /// Counts a record of `stream` skipped for `reason`; returns how many were skipped before
    /// (so that a flood of them is logged only now and then).
    pub fn skip(&self, stream: &str, reason: &str) -> u64 {
        self.records_skipped
            .get_or_create(&SkippedLabel {
                stream: stream.to_string(),
                reason: reason.to_string(),
            })
            .inc()
    }

    /// Counts a parked message.
    pub fn park(&self, queue: &str, reason: &str) {
        self.parked
            .get_or_create(&ParkedLabel {
                queue: queue.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// A broker connection of this process that works (a worker consuming, a follower reading):
/// [`Metrics::connected`] is 1 while at least one lives. Several tasks of one process (a
/// gateway's pair workers and its follower, a proxy's) each hold their own.
#[must_use = "the connection counts as working only while this lives"]
pub struct Live(());

/// How many [`Live`] there are.
static LIVE: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

impl Live {
    /// Counts one more working connection.
    pub fn open() -> Live {
        let mut n = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        global().connected.set(1);
        Live(())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut n = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            global().connected.set(0);
        }
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let m = Metrics::new();
        m.scheduled.inc();
        m.lateness
            .get_or_create(&Metrics::queue("q"))
            .observe(0.002);
        m.park("q", "permanent");
        assert_eq!(m.skip("ledger", "oversize"), 0);
        assert_eq!(m.skip("ledger", "oversize"), 1);
        let text = m.encode();
        for name in [
            "amqp_delay_scheduled_total 1",
            "amqp_delay_lateness_seconds_bucket{le=\"0.0025\",queue=\"q\"} 1",
            "amqp_delay_parked_total{queue=\"q\",reason=\"permanent\"} 1",
            "amqp_delay_stream_records_skipped_total{stream=\"ledger\",reason=\"oversize\"} 2",
            "# TYPE amqp_delay_connected gauge",
        ] {
            assert!(text.contains(name), "{name} missing in:\n{text}");
        }
    }
}
