//! Pure hop statistics, no I/O: the delays of each scenario (`delays_for`), the planned hops
//! of the uniform range and of the realistic mix, and the planner-only `--hop-table`.

use std::fmt::Write as _;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use amqp_delay::TopologySettings;
use amqp_delay::settings::Settings;
use amqp_delay::time::{DurationMs, compact_duration};
use amqp_delay::{Layout, Precision, plan};

use crate::config::{
    BenchConfig, GATEWAY_DELAYS_MS, GATEWAY_LONG_DELAYS_MS, MIX_FIXED_SHARE, MIX_REAL_MAX_MS,
    Scenario,
};
use crate::report::round3;

/// `n` delays of scenario `sc` (deterministic for a seed).
pub(crate) fn delays_for(sc: Scenario, cfg: &BenchConfig, n: usize, seed: u64) -> Vec<u64> {
    // the plugin and the proxy publish gateway_long's very delays
    let sc = if sc.long_x_delay() {
        Scenario::GatewayLong
    } else {
        sc
    };
    let mut rng = StdRng::seed_from_u64(seed ^ (sc as u64) << 32);
    let max = cfg.max_delay_ms;
    let fixed = cfg.fixed_levels();
    let shards = u64::from(cfg.fixed_shards.max(1));
    (0..n)
        .map(|i| match sc {
            Scenario::Raw => 0,
            Scenario::Fixed | Scenario::FixedBatched => fixed[0] + i as u64 % shards,
            Scenario::Uniform | Scenario::Binary | Scenario::UniformBatched | Scenario::Relay => {
                rng.random_range(0..=max)
            }
            Scenario::Gateway => rng.random_range(GATEWAY_DELAYS_MS),
            Scenario::GatewayLong | Scenario::Plugin | Scenario::Proxy => {
                rng.random_range(GATEWAY_LONG_DELAYS_MS)
            }
            Scenario::Mix => mix_delay(&mut rng, &fixed, max),
        })
        .collect()
}

/// The longest delay [`delays_for`] gives scenario `sc`: how long a steady run must publish
/// before every stage of its path (the tiers, the consumer's hold, a gateway's target publish)
/// carries the rate it publishes at.
pub(crate) fn longest_delay(sc: Scenario, cfg: &BenchConfig) -> u64 {
    let fixed = cfg.fixed_levels();
    let shards = u64::from(cfg.fixed_shards.max(1));
    match sc {
        Scenario::Raw => 0,
        Scenario::Fixed | Scenario::FixedBatched => fixed.first().map_or(0, |f| f + shards - 1),
        Scenario::Uniform | Scenario::Binary | Scenario::UniformBatched | Scenario::Relay => {
            cfg.max_delay_ms
        }
        Scenario::Gateway => *GATEWAY_DELAYS_MS.end(),
        Scenario::GatewayLong | Scenario::Plugin | Scenario::Proxy => *GATEWAY_LONG_DELAYS_MS.end(),
        Scenario::Mix => fixed.iter().copied().fold(cfg.max_delay_ms, u64::max),
    }
}

fn mix_delay(rng: &mut StdRng, fixed: &[u64], max: u64) -> u64 {
    if !fixed.is_empty() && rng.random_bool(MIX_FIXED_SHARE) {
        fixed[rng.random_range(0..fixed.len())]
    } else {
        rng.random_range(0..=max)
    }
}

/// The production layout of `settings` (with its own max delay and fixed levels).
pub(crate) fn real_layout(settings: &Settings) -> Option<Layout> {
    settings.layout().ok()
}

/// Average planned hops of the realistic mix at real scale: 60% on `layout`'s fixed levels,
/// 40% uniform up to `real_max_ms` (capped by the layout's max delay); `samples` draws.
pub(crate) fn mix_avg_hops(
    layout: &Layout,
    precision: &Precision,
    real_max_ms: u64,
    samples: usize,
    seed: u64,
) -> f64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let max = real_max_ms.min(layout.max_delay_ms());
    let fixed = layout.fixed_ms().to_vec();
    let total: usize = (0..samples)
        .map(|_| {
            let d = mix_delay(&mut rng, &fixed, max);
            plan(layout, precision, d).map_or(0, |r| r.hops())
        })
        .sum();
    total as f64 / samples.max(1) as f64
}

/// Exact average planned hops over every delay `0..=max_ms`.
pub(crate) fn uniform_avg_hops(layout: &Layout, precision: &Precision, max_ms: u64) -> f64 {
    let total: usize = (0..=max_ms)
        .map(|d| plan(layout, precision, d).map_or(0, |r| r.hops()))
        .sum();
    total as f64 / (max_ms + 1) as f64
}

/// One row of the planner-only hop table.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct HopRow {
    pub(crate) radix: u32,
    pub(crate) budget: String,
    /// Exact mean over every delay 0..=max at the configured unit.
    pub(crate) uniform_avg_hops: f64,
    /// 60% fixed levels (the configured ones), 40% uniform 0–24 h.
    pub(crate) real_mix_avg_hops: f64,
    /// Largest planned lateness over the uniform range, in ms.
    pub(crate) uniform_max_lateness_ms: u64,
    /// Tier queues of the production layout (configured max delay, fixed levels) at this radix.
    pub(crate) tier_queues: usize,
}

/// Planner-only comparison of radixes and lateness budgets (no broker needed).
pub(crate) fn hop_table(settings: &Settings, max_delay_ms: u64) -> Vec<HopRow> {
    let budgets = [
        ("exact", Precision::EXACT),
        (
            "1ms",
            Precision {
                lateness: DurationMs(1),
                lateness_ratio: 0.0,
            },
        ),
        (
            "0.1%",
            Precision {
                lateness: DurationMs(0),
                lateness_ratio: 0.001,
            },
        ),
        (
            "max(2ms,0.1%)",
            Precision {
                lateness: DurationMs(2),
                lateness_ratio: 0.001,
            },
        ),
        (
            "max(5ms,0.1%)",
            Precision {
                lateness: DurationMs(5),
                lateness_ratio: 0.001,
            },
        ),
        (
            "1%",
            Precision {
                lateness: DurationMs(0),
                lateness_ratio: 0.01,
            },
        ),
    ];
    let mut rows = Vec::new();
    for radix in [2u32, 4, 8, 16, 32, 36] {
        let bench_t = TopologySettings {
            radix,
            max_delay: DurationMs(max_delay_ms),
            fixed_levels: Vec::new(),
            ..settings.topology.clone()
        };
        let real_t = TopologySettings {
            radix,
            ..settings.topology.clone()
        };
        let (Ok(bench), Ok(real)) = (Layout::new("hops", &bench_t), Layout::new("hops", &real_t))
        else {
            continue;
        };
        for (name, p) in &budgets {
            let max_late = (0..=max_delay_ms)
                .map(|d| plan(&bench, p, d).map_or(0, |r| r.lateness_ms()))
                .max()
                .unwrap_or(0);
            rows.push(HopRow {
                radix,
                budget: (*name).to_string(),
                uniform_avg_hops: round3(uniform_avg_hops(&bench, p, max_delay_ms)),
                real_mix_avg_hops: round3(mix_avg_hops(&real, p, MIX_REAL_MAX_MS, 20_000, 7)),
                uniform_max_lateness_ms: max_late,
                tier_queues: real.tiers().len(),
            });
        }
    }
    rows
}

/// The hop table as text.
pub(crate) fn hop_table_text(rows: &[HopRow], max_delay_ms: u64) -> String {
    let mut s = format!(
        "{:>5}  {:<13} {:>15} {:>13} {:>17} {:>11}\n",
        "radix",
        "budget",
        format!("hops 0–{}", compact_duration(max_delay_ms)),
        "hops real mix",
        "max planned late",
        "tier queues"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>5}  {:<13} {:>15.2} {:>13.2} {:>14} ms {:>11}",
            r.radix,
            r.budget,
            r.uniform_avg_hops,
            r.real_mix_avg_hops,
            r.uniform_max_lateness_ms,
            r.tier_queues
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BenchConfig {
        BenchConfig::new(Settings {
            prefix: "bench-test".into(),
            ..Settings::default()
        })
    }

    #[test]
    fn no_delay_is_longer_than_the_longest() {
        let c = BenchConfig {
            fixed_shards: 3,
            ..cfg()
        };
        for sc in Scenario::ALL {
            let longest = longest_delay(sc, &c);
            let seen = delays_for(sc, &c, 5_000, 3).into_iter().max().unwrap();
            assert!(seen <= longest, "{sc:?}: {seen} > {longest}");
            // and it is the longest, not a bound far above: the warm-up of a probe
            assert!(seen * 100 >= longest * 99, "{sc:?}: {seen} ≪ {longest}");
        }
    }

    #[test]
    fn distributions_stay_in_range_and_are_reproducible() {
        let c = cfg();
        for sc in Scenario::ALL {
            let a = delays_for(sc, &c, 2000, 9);
            assert_eq!(a, delays_for(sc, &c, 2000, 9));
            assert!(a.iter().all(|&d| d <= c.max_delay_ms));
        }
        let mix = delays_for(Scenario::Mix, &c, 10_000, 1);
        let fixed = c.fixed_levels();
        let on_fixed = mix.iter().filter(|d| fixed.contains(d)).count() as f64 / 10_000.0;
        assert!((0.55..0.7).contains(&on_fixed), "{on_fixed}");
        assert!(
            delays_for(Scenario::Fixed, &c, 10, 1)
                .iter()
                .all(|&d| d == 250)
        );
    }

    #[test]
    fn gateway_long_delays_are_mostly_longer_than_the_hold() {
        let c = cfg();
        let hold = Settings::default().gateway.hold.as_millis();
        let long = delays_for(Scenario::GatewayLong, &c, 10_000, 1);
        assert!(long.iter().all(|d| GATEWAY_LONG_DELAYS_MS.contains(d)));
        let crossing = long.iter().filter(|&&d| d > hold).count() as f64 / 10_000.0;
        assert!(crossing > 0.95, "{crossing}");
        // the short scenario's are all held
        let short = delays_for(Scenario::Gateway, &c, 1_000, 1);
        assert!(short.iter().all(|&d| d <= hold), "hold {hold} ms");
        // its topology carries them whatever --max-delay
        let mut small = cfg();
        small.max_delay_ms = 500;
        let s = small.gateway_long_settings();
        let layout = s.layout().unwrap();
        assert!(layout.max_delay_ms() >= *GATEWAY_LONG_DELAYS_MS.end());
        assert!(s.prefix.ends_with("-gwl"));
    }

    #[test]
    fn uniform_hops_match_the_design_table() {
        let c = cfg();
        let l16 = c.main_layout(false).unwrap();
        let l2 = c.binary_layout().unwrap();
        let h16 = uniform_avg_hops(&l16, &Precision::EXACT, 5000);
        let h2 = uniform_avg_hops(&l2, &Precision::EXACT, 5000);
        assert!((2.5..3.2).contains(&h16), "{h16}");
        assert!((5.5..7.0).contains(&h2), "{h2}");
        // the budget never adds hops
        assert!(uniform_avg_hops(&l16, &Precision::default(), 5000) <= h16);
    }
}
