//! What the consumers of a pass count: every delivery by message index (first ones and
//! duplicates, messages the pass did not publish), the lateness of first deliveries (an HDR
//! histogram; a paced run counts only those due in its steady window), the
//! dead-letter hops they took and the latest due time seen.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;
use lapin::types::{AMQPValue, FieldTable};

use amqp_delay::headers;

use crate::report::Percentiles;

/// Lateness of first deliveries in ms: HDR histograms (negative values recorded as 0) with the
/// exact minimum, maximum and the number of early messages beside them, twice: of the
/// deliveries in a paced run's steady window ([`Tracker::steady`]; every delivery when there
/// is none) and of every first delivery from the first message (`from_first`). Outside the
/// window, an early delivery still counts as early and in the steady minimum.
pub(super) struct Lateness {
    hist: Histogram<u64>,
    pub(super) min: i64,
    max: i64,
    pub(super) early: u64,
    /// Every first delivery, from the first message on.
    all: Histogram<u64>,
    all_min: i64,
    all_max: i64,
}

impl Lateness {
    pub(super) fn new() -> Self {
        let hist = || Histogram::new(3).expect("3 significant figures is valid");
        Lateness {
            hist: hist(),
            min: i64::MAX,
            max: i64::MIN,
            early: 0,
            all: hist(),
            all_min: i64::MAX,
            all_max: i64::MIN,
        }
    }
    pub(super) fn record(&mut self, ms: i64) {
        self.min = self.min.min(ms);
        self.max = self.max.max(ms);
        // auto-resizing: recording cannot fail for a non-negative value
        let _ = self.hist.record(ms.max(0) as u64);
        self.record_outside(ms);
    }
    /// A delivery outside the steady window: in the steady figures only whether it was early
    /// counts; it counts in `from_first`.
    pub(super) fn record_outside(&mut self, ms: i64) {
        if ms < 0 {
            self.min = self.min.min(ms);
            self.early += 1;
        }
        self.all_min = self.all_min.min(ms);
        self.all_max = self.all_max.max(ms);
        let _ = self.all.record(ms.max(0) as u64);
    }
    pub(super) fn merge(&mut self, o: &Lateness) {
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.early += o.early;
        let _ = self.hist.add(&o.hist);
        self.all_min = self.all_min.min(o.all_min);
        self.all_max = self.all_max.max(o.all_max);
        let _ = self.all.add(&o.all);
    }
    /// Of the steady window.
    pub(super) fn summary(&self) -> Percentiles {
        percentiles(&self.hist, self.min, self.max)
    }
    /// Of every first delivery, from the first message.
    pub(super) fn summary_from_first(&self) -> Percentiles {
        percentiles(&self.all, self.all_min, self.all_max)
    }
}

fn percentiles(hist: &Histogram<u64>, min: i64, max: i64) -> Percentiles {
    if hist.is_empty() {
        return Percentiles::default();
    }
    let q = |p: f64| hist.value_at_quantile(p) as i64;
    Percentiles {
        min,
        p50: q(0.5).clamp(min, max),
        p99: q(0.99).clamp(min, max),
        p999: q(0.999).clamp(min, max),
        max,
        samples: hist.len(),
    }
}

/// Header of the gateway scenario's publishes: when the message falls due (ms since the
/// epoch), for lateness at the target, where the gateway has removed amqp-delay's headers.
pub(super) const BENCH_DUE_AT: &str = "bench-due-at";

/// Shared between the consumers, the publishers and the progress display.
pub(super) struct Tracker {
    pub(super) counts: Vec<AtomicU8>,
    pub(super) unique: AtomicUsize,
    pub(super) duplicates: AtomicUsize,
    pub(super) foreign: AtomicUsize,
    pub(super) published: AtomicUsize,
    /// Nanoseconds from the first publish to the last distinct consume.
    pub(super) last_unique_ns: AtomicU64,
    pub(super) observed_hops: AtomicU64,
    /// The first publish, as an instant and in ms since the epoch.
    pub(super) t0: OnceLock<(Instant, u64)>,
    /// Latest `x-delay-due-at` seen, in ms after the first publish.
    pub(super) max_due_ms: AtomicU64,
    /// Due times, in ms after the first publish, whose lateness the percentiles count (all
    /// when unset): a paced run's steady window ([`steady_window`]).
    pub(super) steady: OnceLock<std::ops::Range<u64>>,
}

impl Tracker {
    pub(super) fn new(n: usize) -> Self {
        Tracker {
            counts: (0..n).map(|_| AtomicU8::new(0)).collect(),
            unique: AtomicUsize::new(0),
            duplicates: AtomicUsize::new(0),
            foreign: AtomicUsize::new(0),
            published: AtomicUsize::new(0),
            last_unique_ns: AtomicU64::new(0),
            observed_hops: AtomicU64::new(0),
            t0: OnceLock::new(),
            max_due_ms: AtomicU64::new(0),
            steady: OnceLock::new(),
        }
    }

    /// Counts one delivery of message `id` that arrived at `arrived` (ms since the epoch):
    /// the first one records its lateness and hops, later ones are duplicates.
    pub(super) fn record(
        &self,
        id: Option<&str>,
        h: Option<&FieldTable>,
        arrived: i64,
        lateness: &mut Lateness,
    ) {
        let idx = id
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&i| i < self.counts.len());
        let (Some(i), Some(&(t0, epoch0))) = (idx, self.t0.get()) else {
            self.foreign.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let prev = self.counts[i]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_add(1))
            })
            .unwrap_or(u8::MAX);
        if prev != 0 {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.unique.fetch_add(1, Ordering::Relaxed);
        let ns = t0.elapsed().as_nanos() as u64;
        self.last_unique_ns.fetch_max(ns, Ordering::Relaxed);
        if let Some(h) = h {
            let due =
                headers::get_int(h, headers::DUE_AT).or_else(|| headers::get_int(h, BENCH_DUE_AT));
            if let Some(due) = due {
                let rel = (due - epoch0 as i64).max(0) as u64;
                if self.steady.get().is_none_or(|w| w.contains(&rel)) {
                    lateness.record(arrived - due);
                } else {
                    lateness.record_outside(arrived - due);
                }
                self.max_due_ms.fetch_max(rel, Ordering::Relaxed);
            }
            self.observed_hops
                .fetch_add(death_count(h), Ordering::Relaxed);
        }
    }
}

/// The due times (ms after the first publish) a paced run of `n` messages at `rate` whose
/// longest delay is `longest_ms` is judged on: from then, when every stage of the path (the
/// tiers, a consumer's hold, a gateway's publish at the due time) carries `rate`, to the last
/// release; before it, what falls due was published over a shorter span. `None` (judge all)
/// without delays, or when that window is shorter than half a second and than half the run (a
/// run that ends within its longest delay, or hardly past it, might have no message due in
/// it at all).
pub(super) fn steady_window(longest_ms: u64, n: usize, rate: f64) -> Option<std::ops::Range<u64>> {
    let last_release_ms = (n.saturating_sub(1) as f64 / rate * 1e3).floor();
    let steady_ms = last_release_ms - longest_ms as f64;
    if longest_ms == 0 || !steady_ms.is_finite() || steady_ms < (last_release_ms / 2.0).min(500.0) {
        return None;
    }
    Some(longest_ms..last_release_ms as u64 + 1)
}

/// Sum of the `count` fields of `x-death`: the dead-letter hops a message took.
fn death_count(h: &FieldTable) -> u64 {
    let Some(AMQPValue::FieldArray(a)) = h.inner().get("x-death") else {
        return 0;
    };
    a.as_slice()
        .iter()
        .filter_map(|v| match v {
            AMQPValue::FieldTable(t) => headers::get_int(t, "count"),
            _ => None,
        })
        .map(|c| c.max(0) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lateness_summary_keeps_negative_minimum() {
        let mut l = Lateness::new();
        for v in [-2, 0, 5, 7, 100] {
            l.record(v);
        }
        let s = l.summary();
        assert_eq!((s.min, s.max, s.samples, l.early), (-2, 100, 5, 1));
        assert!(s.p50 >= 0 && s.p50 <= s.p99 && s.p99 <= s.max);
    }

    #[test]
    fn outside_the_steady_window_only_earliness_counts() {
        let t = Tracker::new(4);
        let _ = t.t0.set((Instant::now(), 1_000_000));
        let _ = t.steady.set(5_000..7_000);
        let mut l = Lateness::new();
        let due = |rel: i64| {
            let mut h = FieldTable::default();
            h.insert(BENCH_DUE_AT.into(), AMQPValue::LongLongInt(1_000_000 + rel));
            h
        };
        // in the window, 3 ms late; before it, 500 ms late; after it, 2 ms early
        t.record(Some("0"), Some(&due(6_000)), 1_006_003, &mut l);
        t.record(Some("1"), Some(&due(1_000)), 1_001_500, &mut l);
        t.record(Some("2"), Some(&due(8_000)), 1_007_998, &mut l);
        let s = l.summary();
        assert_eq!((s.samples, s.p99, s.max), (1, 3, 3));
        assert_eq!((l.early, s.min), (1, -2));
        // from the first message: all three
        let all = l.summary_from_first();
        assert_eq!((all.samples, all.min, all.max), (3, -2, 500));
        assert_eq!(t.unique.load(Ordering::Relaxed), 3);
        assert_eq!(t.max_due_ms.load(Ordering::Relaxed), 8_000);
    }

    #[test]
    fn the_steady_window_follows_the_longest_delay_to_the_last_release() {
        // 5 s of delays and 7 s of publishing at 1 000 msg/s: the last release at 6.999 s
        assert_eq!(steady_window(5_000, 7_000, 1_000.0), Some(5_000..7_000));
        // no delays: every message counts
        assert_eq!(steady_window(0, 2_000, 1_000.0), None);
        // --quick's probe: 1 s after the warm-up
        assert_eq!(steady_window(5_000, 6_000, 1_000.0), Some(5_000..6_000));
        // a short run after a short delay: the window need not be half a second
        assert_eq!(steady_window(25, 326, 1_000.0), Some(25..326));
        // a run that ends within its longest delay, or hardly past it, is judged whole
        assert_eq!(steady_window(5_000, 30, 10.0), None);
        assert_eq!(steady_window(5_000, 30, 0.0), None);
        assert_eq!(steady_window(498, 500, 1_000.0), None);
        assert_eq!(steady_window(5_000, 5_400, 1_000.0), None);
    }

    #[test]
    fn death_counts_add_up() {
        let mut t = FieldTable::default();
        let entry = |n: i64| {
            let mut e = FieldTable::default();
            e.insert("count".into(), AMQPValue::LongLongInt(n));
            AMQPValue::FieldTable(e)
        };
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![entry(1), entry(2)].into()),
        );
        assert_eq!(death_count(&t), 3);
        assert_eq!(death_count(&FieldTable::default()), 0);
    }
}
