//! Pure parts of the sustained-rate mode, no I/O: the search for the highest steady rate that
//! keeps p99 lateness within the objective (`RateSearch`, a bisection in log space between a
//! floor and the scenario's ceiling), and the verdict on one probe (`Verdict::of`).

use serde::Serialize;

/// The search starts at `ceiling / FLOOR_DIVISOR`: a bracket of 16× that 5 probes narrow to
/// about 9%.
pub(crate) const FLOOR_DIVISOR: f64 = 16.0;
/// The search stops when the bracket is this narrow (`hi / lo`): probing closer measures noise.
pub(crate) const CLOSE_ENOUGH: f64 = 1.1;
/// The lowest rate a probe runs at (msg/s).
pub(crate) const MIN_RATE: f64 = 1.0;

/// Bisection, in log space, for the highest rate that passes, assuming a rate passes when every
/// lower one does. `lo` is the floor or the highest rate that passed; `hi` the ceiling (never
/// probed: a steady rate at the saturating rate has no head-room) or the lowest that failed.
#[derive(Debug, Clone)]
pub(crate) struct RateSearch {
    lo: f64,
    hi: f64,
    best: Option<f64>,
    lowest_miss: Option<f64>,
    left: usize,
}

impl RateSearch {
    /// A search below `ceiling` (msg/s) of at most `probes` probes.
    pub(crate) fn new(ceiling: f64, probes: usize) -> Self {
        let hi = if ceiling.is_finite() {
            ceiling.max(MIN_RATE)
        } else {
            MIN_RATE
        };
        RateSearch {
            lo: (hi / FLOOR_DIVISOR).max(MIN_RATE),
            hi,
            best: None,
            lowest_miss: None,
            left: probes,
        }
    }

    /// The rate of the next probe, or `None` when the probes are used up or the bracket is
    /// narrow enough.
    pub(crate) fn next(&self) -> Option<f64> {
        if self.left == 0 || self.hi <= self.lo * CLOSE_ENOUGH {
            return None;
        }
        Some((self.lo * self.hi).sqrt())
    }

    /// What the probe at `rate` found.
    pub(crate) fn record(&mut self, rate: f64, passed: bool) {
        self.left = self.left.saturating_sub(1);
        if passed {
            self.lo = self.lo.max(rate);
            self.best = Some(self.best.map_or(rate, |b| b.max(rate)));
        } else {
            self.hi = self.hi.min(rate);
            self.lowest_miss = Some(self.lowest_miss.map_or(rate, |m| m.min(rate)));
        }
    }

    /// The highest rate that passed.
    pub(crate) fn best(&self) -> Option<f64> {
        self.best
    }

    /// The lowest rate that failed: the sustained rate lies below it.
    pub(crate) fn lowest_miss(&self) -> Option<f64> {
        self.lowest_miss
    }
}

/// What one probe measured, as the verdict needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeStats {
    /// The longest a message waited past its release time for the publisher to take it (the
    /// publisher's own backlog, which lateness from the due time it was given does not see).
    pub(crate) release_lag_ms: u64,
    pub(crate) p99_ms: i64,
    /// Messages whose lateness was measured.
    pub(crate) samples: u64,
    pub(crate) lost: usize,
    pub(crate) early: u64,
    pub(crate) publish_errors: usize,
}

/// Why a probe passed or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Verdict {
    /// p99 lateness within the objective, at the rate asked.
    Ok,
    /// p99 lateness above the objective.
    Late,
    /// p99 lateness within the objective, but the publisher fell behind the rate by more than
    /// the objective (its backlog, which lateness from the due time it gave does not count).
    Behind,
    /// Messages lost, early, not published or not measured: not a steady run.
    Failed,
}

impl Verdict {
    /// The verdict on `s` for a p99 objective of `objective_ms`.
    pub(crate) fn of(s: &ProbeStats, objective_ms: u64) -> Verdict {
        if s.lost > 0 || s.early > 0 || s.publish_errors > 0 || s.samples == 0 {
            return Verdict::Failed;
        }
        if s.p99_ms > i64::try_from(objective_ms).unwrap_or(i64::MAX) {
            return Verdict::Late;
        }
        if s.release_lag_ms > objective_ms {
            return Verdict::Behind;
        }
        Verdict::Ok
    }

    pub(crate) fn passed(self) -> bool {
        self == Verdict::Ok
    }
}

/// Messages of a probe at `rate` for `secs`: at least `min` (so p99 has samples to stand on).
pub(crate) fn probe_messages(rate: f64, secs: f64, min: usize) -> usize {
    let n = (rate * secs).ceil();
    if n.is_finite() && n > 0.0 {
        (n as usize).max(min)
    } else {
        min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a search against a scenario whose p99 stays within the objective up to `limit`.
    fn search(ceiling: f64, probes: usize, limit: f64) -> (RateSearch, Vec<f64>) {
        let mut s = RateSearch::new(ceiling, probes);
        let mut rates = Vec::new();
        while let Some(r) = s.next() {
            rates.push(r);
            s.record(r, r <= limit);
        }
        (s, rates)
    }

    #[test]
    fn converges_below_the_limit_within_the_probes() {
        let (s, rates) = search(10_000.0, 5, 4_000.0);
        assert_eq!(rates.len(), 5);
        let best = s.best().unwrap();
        assert!(
            best <= 4_000.0 && best > 4_000.0 / 1.2,
            "{best} after {rates:?}"
        );
        assert!(s.lowest_miss().unwrap() > 4_000.0);
        assert!(
            rates
                .iter()
                .all(|&r| (10_000.0 / 16.0..10_000.0).contains(&r))
        );
    }

    #[test]
    fn never_probes_the_ceiling_and_stops_when_close() {
        let (s, rates) = search(1_000.0, 50, f64::INFINITY);
        assert!(rates.iter().all(|&r| r < 1_000.0));
        assert!(rates.len() < 10, "{rates:?}");
        assert!(s.best().unwrap() > 1_000.0 / CLOSE_ENOUGH);
        assert_eq!(s.lowest_miss(), None);
    }

    #[test]
    fn nothing_passes_when_even_the_floor_is_late() {
        let (s, rates) = search(1_000.0, 4, 0.0);
        assert_eq!(rates.len(), 4);
        assert_eq!(s.best(), None);
        // it walked down towards the floor
        assert!(s.lowest_miss().unwrap() < 1_000.0 / 8.0);
        assert!(rates.windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn odd_ceilings_and_no_probes() {
        assert_eq!(RateSearch::new(1_000.0, 0).next(), None);
        // a ceiling at or below the floor leaves nothing to search
        assert_eq!(RateSearch::new(0.5, 5).next(), None);
        assert_eq!(RateSearch::new(f64::NAN, 5).next(), None);
        assert!(RateSearch::new(20.0, 5).next().unwrap() >= MIN_RATE);
    }

    fn stats() -> ProbeStats {
        ProbeStats {
            release_lag_ms: 3,
            p99_ms: 20,
            samples: 201,
            lost: 0,
            early: 0,
            publish_errors: 0,
        }
    }

    #[test]
    fn verdicts() {
        assert_eq!(Verdict::of(&stats(), 25), Verdict::Ok);
        assert!(Verdict::of(&stats(), 25).passed());
        // the objective is inclusive
        assert_eq!(Verdict::of(&stats(), 20), Verdict::Ok);
        assert_eq!(Verdict::of(&stats(), 19), Verdict::Late);
        let slow = ProbeStats {
            release_lag_ms: 26,
            ..stats()
        };
        assert_eq!(Verdict::of(&slow, 25), Verdict::Behind);
        // late is late, whether the publisher kept the pace or not
        assert_eq!(
            Verdict::of(&ProbeStats { p99_ms: 99, ..slow }, 25),
            Verdict::Late
        );
        for bad in [
            ProbeStats { lost: 1, ..stats() },
            ProbeStats {
                early: 1,
                ..stats()
            },
            ProbeStats {
                publish_errors: 1,
                ..stats()
            },
            ProbeStats {
                samples: 0,
                ..stats()
            },
        ] {
            assert_eq!(Verdict::of(&bad, 25), Verdict::Failed);
        }
    }

    #[test]
    fn probe_sizes() {
        assert_eq!(probe_messages(1_000.0, 2.0, 50), 2_000);
        assert_eq!(probe_messages(10.0, 2.0, 50), 50);
        assert_eq!(probe_messages(f64::NAN, 2.0, 50), 50);
        assert_eq!(probe_messages(333.3, 1.5, 1), 500);
    }
}
