//! What a worker did: one place counts it, both in the worker's own [`Counters`] (readable
//! while it runs, per worker) and in the process's Prometheus metrics (`crate::metrics`).

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::{Metrics, global};

/// One queue's metrics a message touches on its way, looked up once per delivery rather than
/// once per batch member (each lookup builds a label and takes the family's lock).
pub(crate) struct QueueMetrics {
    pub(crate) delivered: Counter,
    pub(crate) executed: Counter,
    pub(crate) lateness: Histogram,
    pub(crate) handler_duration: Histogram,
}

impl QueueMetrics {
    pub(crate) fn of(queue: &str) -> QueueMetrics {
        let m = global();
        let label = Metrics::queue(queue);
        QueueMetrics {
            delivered: m.delivered.get_or_create(&label).clone(),
            executed: m.executed.get_or_create(&label).clone(),
            lateness: m.lateness.get_or_create(&label).clone(),
            handler_duration: m.handler_duration.get_or_create(&label).clone(),
        }
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
    /// ([`crate::Error::ConsumerStalled`]).
    pub stalled: AtomicU64,
}

/// Something a worker did to a message of a queue, counted by [`Counters::count`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Event<'a> {
    /// A delivery the broker marked redelivered.
    Redelivered,
    /// A batch arrived (its members count on their own).
    Batch,
    /// A message (or member) reached its handler's turn.
    Delivered,
    /// A barrier was appended before running a message.
    CancelSync,
    /// The handler succeeded.
    Succeeded,
    /// A retry was scheduled.
    Retried,
    /// Parked, for this kind of reason.
    Parked(&'a str),
    /// Acked without running: cancelled.
    Cancelled,
    /// A subscription was renewed because it stalled.
    Stalled,
}

impl Counters {
    /// Counts `event` of `queue` here and in the process's metrics.
    pub(crate) fn count(&self, event: Event<'_>, queue: &str) {
        let m = global();
        let label = || Metrics::queue(queue);
        let mine = match event {
            Event::Redelivered => &self.redelivered,
            Event::Batch => &self.batches,
            Event::Delivered => {
                m.delivered.get_or_create(&label()).inc();
                return;
            }
            // the metric counts every barrier where it is appended (`cancel`)
            Event::CancelSync => &self.cancel_syncs,
            Event::Succeeded => {
                m.executed.get_or_create(&label()).inc();
                &self.succeeded
            }
            Event::Retried => {
                m.retried.get_or_create(&label()).inc();
                &self.retried
            }
            Event::Parked(kind) => {
                m.park(queue, kind);
                &self.parked
            }
            Event::Cancelled => {
                m.cancelled.get_or_create(&label()).inc();
                &self.cancelled
            }
            Event::Stalled => &self.stalled,
        };
        mine.fetch_add(1, Ordering::Relaxed);
    }

    /// [`Counters::count`], with the queue's metrics looked up already.
    pub(crate) fn count_in(&self, event: Event<'_>, queue: &str, qm: &QueueMetrics) {
        match event {
            Event::Delivered => {
                qm.delivered.inc();
            }
            Event::Succeeded => {
                qm.executed.inc();
                self.succeeded.fetch_add(1, Ordering::Relaxed);
            }
            other => self.count(other, queue),
        }
    }

    /// `(succeeded, retried, parked, cancelled)` so far, for a log line.
    pub(crate) fn summary(&self) -> (u64, u64, u64, u64) {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        (
            l(&self.succeeded),
            l(&self.retried),
            l(&self.parked),
            l(&self.cancelled),
        )
    }
}
