//! The delay planner: requested delay + precision policy → route through the tiers. Pure.
//!
//! A route is an optional "pre-tier" (one fixed level, or `q` overflow tiers) followed by the
//! cascade digits of the remainder. The planner is never early (the route's total TTL is at
//! least the requested delay) and, within the lateness budget, picks the route with the fewest
//! hops (dead-letter hops are what the broker pays for), then the least lateness.
//!
//! The minimum-hop value in an interval `[lo, hi]` of cascade units is found in closed form: an
//! optimal value is either `lo` itself or `lo` rounded up at some digit position
//! (`(lo / r^i + 1) · r^i`). The property tests check this against brute force.

use serde::{Deserialize, Serialize};

use crate::layout::{Layout, TierKind};
use crate::time::DurationMs;

/// How late a message may be delivered so that its route needs fewer hops and it can share a
/// batch with others. The budget for a delay `D` is `max(lateness, floor(lateness_ratio · D))`,
/// never less than one unit − 1 ms (a delay is rounded up to whole units). The default, 5 ms or
/// 0.1%, is below what one dead-letter hop adds anyway (p50 4–5 ms, docs/PERFORMANCE.md).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Precision {
    /// Absolute lateness budget.
    pub lateness: DurationMs,
    /// Relative lateness budget, a fraction of the delay (0.001 = 0.1%).
    pub lateness_ratio: f64,
}

impl Default for Precision {
    fn default() -> Self {
        Precision {
            lateness: DurationMs(5),
            lateness_ratio: 0.001,
        }
    }
}

impl Precision {
    /// Exact: no lateness beyond unit rounding.
    pub const EXACT: Precision = Precision {
        lateness: DurationMs(0),
        lateness_ratio: 0.0,
    };

    /// Checks the ratio is within 0..=1.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.lateness_ratio.is_finite() && (0.0..=1.0).contains(&self.lateness_ratio)) {
            return Err(format!(
                "precision.lateness_ratio must be between 0 and 1, got {}",
                self.lateness_ratio
            ));
        }
        Ok(())
    }

    /// The lateness budget for `delay_ms` (before unit rounding).
    pub fn budget_ms(&self, delay_ms: u64) -> u64 {
        let rel = (self.lateness_ratio * delay_ms as f64).floor();
        self.lateness.as_millis().max(rel as u64)
    }
}

/// Where a route first enters the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// No tier at all: straight to the delivery exchange.
    Deliver,
    /// A cascade level's topic exchange.
    Level(u32),
    /// A fixed level of this TTL.
    Fixed(u64),
    /// The overflow chain, walking the last `hops` of its queues.
    Overflow {
        /// Overflow tiers to walk.
        hops: u32,
    },
}

/// The planned path of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Requested delay.
    pub delay_ms: u64,
    /// Sum of the TTLs of the tiers visited: when the broker will deliver it (plus latency).
    pub total_ms: u64,
    /// Where the route enters the topology.
    pub entry: Entry,
    /// Cascade digit per level (index = level).
    pub digits: Vec<u32>,
    /// Tiers in visiting order.
    pub tiers: Vec<TierKind>,
}

impl Route {
    /// Dead-letter hops (tier queues visited).
    pub fn hops(&self) -> usize {
        self.tiers.len()
    }
    /// Planned lateness: `total_ms − delay_ms`.
    pub fn lateness_ms(&self) -> u64 {
        self.total_ms - self.delay_ms
    }
    /// Exchange to publish to (shard 0 of a fixed level).
    pub fn exchange(&self, layout: &Layout) -> String {
        self.exchange_for(layout, 0)
    }
    /// Exchange to publish to, taking shard `turn % fixed_shards` of a fixed level.
    pub fn exchange_for(&self, layout: &Layout, turn: u64) -> String {
        match self.entry {
            Entry::Fixed(ms) => {
                let shard = (turn % u64::from(layout.fixed_shards().max(1))) as u32;
                layout.fixed_shard_exchange(ms, shard)
            }
            Entry::Deliver => layout.delivery_exchange(),
            Entry::Level(k) => layout.level_exchange(k),
            Entry::Overflow { hops } => {
                layout.overflow_exchange(layout.overflow_count() - hops + 1)
            }
        }
    }
    /// Human-readable path, e.g. `fixed 30m → level1 d3 → level0 d2` (or `direct`).
    pub fn describe(&self) -> String {
        if self.tiers.is_empty() {
            return "direct".into();
        }
        self.tiers
            .iter()
            .map(|t| match *t {
                TierKind::Cascade { level, digit } => format!("level{level} d{digit}"),
                TierKind::Fixed { ttl_ms } => {
                    format!("fixed {}", crate::time::compact_duration(ttl_ms))
                }
                TierKind::Overflow { index } => format!("overflow{index}"),
            })
            .collect::<Vec<_>>()
            .join(" → ")
    }
    /// Routing key for `destination`.
    pub fn routing_key(&self, layout: &Layout, destination: &str) -> String {
        layout.routing_key(&self.digits, destination)
    }
}

/// A delay the topology cannot serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("delay {delay_ms} ms is longer than the configured maximum of {max_ms} ms")]
    /// Longer than the topology accepts.
    TooLong {
        /// The requested delay.
        delay_ms: u64,
        /// `topology.max_delay`.
        max_ms: u64,
    },
}

/// Plans `delay_ms` through `layout` under `precision`.
pub fn plan(layout: &Layout, precision: &Precision, delay_ms: u64) -> Result<Route, PlanError> {
    let budget = precision.budget_ms(delay_ms);
    plan_window(layout, delay_ms, delay_ms.saturating_add(budget))
}

/// The route with the fewest hops (then the least lateness) whose total TTL lies in
/// `[delay_ms, latest_ms]` (widened to one unit when the unit is coarser than the window):
/// never early, never later than `latest_ms`. A batch is planned this way, with the window
/// every member accepts.
pub(crate) fn plan_window(
    layout: &Layout,
    delay_ms: u64,
    latest_ms: u64,
) -> Result<Route, PlanError> {
    if delay_ms > layout.max_delay_ms() {
        return Err(PlanError::TooLong {
            delay_ms,
            max_ms: layout.max_delay_ms(),
        });
    }
    let unit = layout.unit_ms();
    let hi = latest_ms.max(delay_ms.saturating_add(unit - 1));
    let pres = pre_tiers(layout);
    let (pre, n) = fewest_hops(layout, &pres, delay_ms, hi);
    let total_ms = pre.ms + n * unit;
    let digits = cascade_digits(n, layout.radix(), layout.levels());
    let tiers = tiers_visited(layout, pre.entry, &digits);
    let entry = match pre.entry {
        Some(e) => e,
        None => cascade_entry(&digits),
    };
    Ok(Route {
        delay_ms,
        total_ms,
        entry,
        digits,
        tiers,
    })
}

/// What a route may visit before the cascade: nothing, one fixed level, or the last `q`
/// queues of the overflow chain.
#[derive(Clone, Copy)]
struct PreTier {
    hops: u32,
    ms: u64,
    entry: Option<Entry>,
}

/// Every pre-tier of `layout`: none first, then the fixed levels, then the overflow walks.
fn pre_tiers(layout: &Layout) -> Vec<PreTier> {
    let mut pres = vec![PreTier {
        hops: 0,
        ms: 0,
        entry: None,
    }];
    for &f in layout.fixed_ms() {
        pres.push(PreTier {
            hops: 1,
            ms: f,
            entry: Some(Entry::Fixed(f)),
        });
    }
    for q in 1..=layout.overflow_count() {
        pres.push(PreTier {
            hops: q,
            ms: u64::from(q) * layout.overflow_ttl_ms(),
            entry: Some(Entry::Overflow { hops: q }),
        });
    }
    pres
}

/// Of the routes "pre-tier, then the cascade value with the fewest non-zero digits that puts
/// the total in `[delay_ms, hi]`", the one with the fewest hops, then the least total (the
/// earlier pre-tier on a tie): its pre-tier and its cascade value in units.
fn fewest_hops(layout: &Layout, pres: &[PreTier], delay_ms: u64, hi: u64) -> (PreTier, u64) {
    let unit = layout.unit_ms();
    let cascade_units = layout.cascade_max_ms() / unit;
    // best: (hops, total_ms, pre index, cascade units)
    let mut best: Option<(u32, u64, usize, u64)> = None;
    for (i, pre) in pres.iter().enumerate() {
        if pre.ms > hi {
            continue;
        }
        let lo_u = delay_ms.saturating_sub(pre.ms).div_ceil(unit);
        let hi_u = ((hi - pre.ms) / unit).min(cascade_units);
        if lo_u > hi_u {
            continue;
        }
        let n = fewest_digits_in(lo_u, hi_u, layout.radix());
        let hops = pre.hops + nonzero_digits(n, layout.radix());
        let total = pre.ms + n * unit;
        let cand = (hops, total, i, n);
        if best.is_none_or(|b| (cand.0, cand.1) < (b.0, b.1)) {
            best = Some(cand);
        }
    }
    let (_, _, pre_i, n) = best.expect("the layout covers every delay up to max_delay");
    (pres[pre_i], n)
}

/// `n` in base `radix`, one digit per cascade level (index = level).
fn cascade_digits(n: u64, radix: u32, levels: u32) -> Vec<u32> {
    let r = u64::from(radix);
    let mut digits = Vec::with_capacity(levels as usize);
    let mut rest = n;
    for _ in 0..levels {
        digits.push((rest % r) as u32);
        rest /= r;
    }
    digits
}

/// The tiers in visiting order: the pre-tier's, then one per non-zero digit, highest level
/// first.
fn tiers_visited(layout: &Layout, pre_entry: Option<Entry>, digits: &[u32]) -> Vec<TierKind> {
    let mut tiers = Vec::new();
    match pre_entry {
        Some(Entry::Fixed(ms)) => tiers.push(TierKind::Fixed { ttl_ms: ms }),
        Some(Entry::Overflow { hops }) => {
            let m = layout.overflow_count();
            for index in (m - hops + 1)..=m {
                tiers.push(TierKind::Overflow { index });
            }
        }
        _ => {}
    }
    for k in (0..digits.len()).rev() {
        let d = digits[k];
        if d != 0 {
            tiers.push(TierKind::Cascade {
                level: k as u32,
                digit: d,
            });
        }
    }
    tiers
}

/// Where a route without a pre-tier enters: the level of its highest non-zero digit, or
/// straight to delivery when it has none.
fn cascade_entry(digits: &[u32]) -> Entry {
    match (0..digits.len()).rev().find(|&k| digits[k] != 0) {
        Some(k) => Entry::Level(k as u32),
        None => Entry::Deliver,
    }
}

/// Number of non-zero base-`radix` digits of `n` (= cascade hops).
pub(crate) fn nonzero_digits(mut n: u64, radix: u32) -> u32 {
    let r = u64::from(radix);
    let mut c = 0;
    while n > 0 {
        if !n.is_multiple_of(r) {
            c += 1;
        }
        n /= r;
    }
    c
}

/// The value in `[lo, hi]` with the fewest non-zero base-`radix` digits, the smallest such.
/// Requires `lo <= hi`.
pub(crate) fn fewest_digits_in(lo: u64, hi: u64, radix: u32) -> u64 {
    debug_assert!(lo <= hi);
    let r = u64::from(radix);
    let mut best = lo;
    let mut best_nz = nonzero_digits(lo, radix);
    let mut p: u64 = 1; // r^i
    // lo rounded up at position i: (lo / r^i + 1) * r^i
    while let Some(c) = (lo / p).checked_add(1).and_then(|x| x.checked_mul(p)) {
        if c > hi {
            if lo / p == 0 {
                break; // higher positions only give larger values
            }
        } else {
            let nz = nonzero_digits(c, radix);
            if nz < best_nz {
                best = c;
                best_nz = nz;
            }
        }
        match p.checked_mul(r) {
            Some(np) if lo / p > 0 || np <= hi => p = np,
            _ => break,
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TopologySettings;
    use proptest::prelude::*;

    fn layout(radix: u32, unit: u64, max: u64, max_ttl: u64, fixed: &[u64]) -> Layout {
        let t = TopologySettings {
            radix,
            unit: DurationMs(unit),
            max_delay: DurationMs(max),
            fixed_levels: fixed.iter().map(|&f| DurationMs(f)).collect(),
            max_tier_ttl: DurationMs(max_ttl),
            ..TopologySettings::default()
        };
        Layout::new("t", &t).unwrap()
    }

    fn route_ttl_sum(l: &Layout, r: &Route) -> u64 {
        r.tiers
            .iter()
            .map(|t| match *t {
                TierKind::Cascade { level, digit } => u64::from(digit) * l.level_weight_ms(level),
                TierKind::Fixed { ttl_ms } => ttl_ms,
                TierKind::Overflow { .. } => l.overflow_ttl_ms(),
            })
            .sum()
    }

    /// Brute force: minimal hops over every pre-tier and every cascade value.
    fn brute_min_hops(l: &Layout, delay: u64, hi: u64) -> u32 {
        let unit = l.unit_ms();
        let mut pres = vec![(0u32, 0u64)];
        pres.extend(l.fixed_ms().iter().map(|&f| (1, f)));
        for q in 1..=l.overflow_count() {
            pres.push((q, u64::from(q) * l.overflow_ttl_ms()));
        }
        let mut best = u32::MAX;
        for (h, ms) in pres {
            for n in 0..=l.cascade_max_ms() / unit {
                let total = ms + n * unit;
                if total >= delay && total <= hi {
                    best = best.min(h + nonzero_digits(n, l.radix()));
                }
            }
        }
        best
    }

    #[test]
    fn default_layout_covers_a_year_within_the_ttl_limit() {
        let l = Layout::new("amqp-delay", &TopologySettings::default()).unwrap();
        assert!(l.max_delay_ms() >= 365 * 24 * 3_600_000);
        for t in l.tiers() {
            assert!(t.ttl_ms <= u64::from(u32::MAX), "{t:?}");
            assert!(t.ttl_ms > 0);
        }
        let year = plan(&l, &Precision::EXACT, 365 * 24 * 3_600_000).unwrap();
        assert_eq!(year.total_ms, 365 * 24 * 3_600_000);
    }

    #[test]
    fn zero_goes_straight_to_delivery() {
        let l = layout(16, 1, 100_000, u64::from(u32::MAX), &[]);
        let r = plan(&l, &Precision::EXACT, 0).unwrap();
        assert_eq!(r.entry, Entry::Deliver);
        assert_eq!(r.hops(), 0);
        assert_eq!(r.routing_key(&l, "q"), "0.0.0.0.0.q");
    }

    #[test]
    fn fixed_level_is_one_hop_and_remainder_follows() {
        let l = layout(16, 1, 4_000_000, u64::from(u32::MAX), &[1_800_000]);
        let r = plan(&l, &Precision::EXACT, 1_800_000).unwrap();
        assert_eq!(r.tiers, vec![TierKind::Fixed { ttl_ms: 1_800_000 }]);
        let r = plan(&l, &Precision::EXACT, 1_800_250).unwrap();
        assert_eq!(r.tiers[0], TierKind::Fixed { ttl_ms: 1_800_000 });
        assert_eq!(r.total_ms, 1_800_250);
        assert_eq!(r.hops(), 1 + nonzero_digits(250, 16) as usize);
    }

    #[test]
    fn too_long_is_an_error_naming_both_numbers() {
        let l = layout(4, 1, 1000, u64::from(u32::MAX), &[]);
        let e = plan(&l, &Precision::EXACT, 1001).unwrap_err();
        assert_eq!(
            e.to_string(),
            "delay 1001 ms is longer than the configured maximum of 1000 ms"
        );
    }

    #[test]
    fn budget_reduces_hops() {
        let l = layout(16, 1, 100_000, u64::from(u32::MAX), &[]);
        // 4095 = 0xfff: 3 hops exact; 4096 = 0x1000 is one hop and 1 ms late.
        let exact = plan(&l, &Precision::EXACT, 4095).unwrap();
        assert_eq!(exact.hops(), 3);
        let p = Precision {
            lateness: DurationMs(1),
            lateness_ratio: 0.0,
        };
        let r = plan(&l, &p, 4095).unwrap();
        assert_eq!((r.hops(), r.total_ms), (1, 4096));
    }

    #[test]
    fn coarse_unit_rounds_up_never_early() {
        let l = layout(4, 1000, 60_000, u64::from(u32::MAX), &[]);
        let r = plan(&l, &Precision::EXACT, 1).unwrap();
        assert_eq!(r.total_ms, 1000);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn fewest_digits_matches_brute_force(lo in 0u64..3000, span in 0u64..3000, radix in 2u32..12) {
            let hi = lo + span;
            let got = fewest_digits_in(lo, hi, radix);
            let want = (lo..=hi).min_by_key(|&n| (nonzero_digits(n, radix), n)).unwrap();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn routes_are_never_early_within_budget_and_hop_minimal(
            radix in 2u32..9,
            unit in 1u64..4,
            max_ttl in 20u64..400,
            max in 0u64..3000,
            fixed in proptest::collection::vec(1u64..400, 0..3),
            delay_frac in 0.0f64..=1.0,
            lateness_ms in 0u64..20,
            ratio in 0.0f64..0.05,
        ) {
            let max_ttl = max_ttl.max(unit * u64::from(radix - 1));
            let fixed: Vec<u64> = fixed.into_iter().filter(|&f| f <= max_ttl && f <= max).collect();
            let t = TopologySettings {
                radix, unit: DurationMs(unit), max_delay: DurationMs(max),
                fixed_levels: fixed.iter().map(|&f| DurationMs(f)).collect(),
                max_tier_ttl: DurationMs(max_ttl), ..TopologySettings::default()
            };
            let Ok(l) = Layout::new("t", &t) else { return Ok(()); };
            let delay = (max as f64 * delay_frac) as u64;
            let p = Precision { lateness: DurationMs(lateness_ms), lateness_ratio: ratio };
            let r = plan(&l, &p, delay).unwrap();
            // never early, and the tiers really add up to the total
            prop_assert!(r.total_ms >= delay);
            prop_assert_eq!(route_ttl_sum(&l, &r), r.total_ms);
            // within budget (never tighter than one unit)
            let budget = p.budget_ms(delay).max(unit - 1);
            prop_assert!(r.total_ms - delay <= budget, "late by {} > {}", r.total_ms - delay, budget);
            // each tier at most once
            let mut seen = r.tiers.clone();
            seen.sort();
            seen.dedup();
            prop_assert_eq!(seen.len(), r.tiers.len());
            // minimal hops
            prop_assert_eq!(r.hops() as u32, brute_min_hops(&l, delay, delay + budget));
            // every TTL fits
            for tier in l.tiers() { prop_assert!(tier.ttl_ms <= max_ttl); }
        }

        #[test]
        fn routing_key_fits_for_every_accepted_destination(
            radix in 2u32..37,
            levels_hint in 0u32..40,
            dest in "[a-z]{1,8}(\\.[a-z0-9_-]{1,8}){0,40}",
        ) {
            let max = (u64::from(radix)).saturating_pow(levels_hint.min(12)).min(u64::from(u32::MAX));
            let l = layout(radix, 1, max, u64::from(u32::MAX), &[]);
            if l.validate_destination(&dest).is_ok() {
                let key = l.routing_key(&vec![radix - 1; l.levels() as usize], &dest);
                prop_assert!(key.len() <= 255);
                prop_assert_eq!(key.split('.').count(), l.levels() as usize + dest.split('.').count());
            } else {
                prop_assert!(dest.len() > l.max_destination_len());
            }
        }
    }
}
