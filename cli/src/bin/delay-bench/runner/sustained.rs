//! Sustained-rate mode (`--sustained`): for one scenario, short steady probes at the rates
//! `search::RateSearch` picks between a floor and the scenario's saturating rate, each judged
//! by `search::Verdict` against the p99 objective; the highest rate that met it.
//!
//! A probe publishes for its scenario's longest delay (the warm-up) plus `--probe-secs`, and
//! judges only the messages due in the steady window after the warm-up: before it, the stages
//! after the tiers (a consumer's hold, a gateway's target publish) carry only part of the rate
//! (the messages due then were published over a shorter span), so a probe of 2 s with delays
//! of 0–5 s was a burst, never the steady load it claimed to measure.

use amqp_delay::{Publisher, Result};

use super::Bench;
use super::measure::RunOutcome;
use super::stage::Path;
use crate::config::Scenario;
use crate::hops::{delays_for, longest_delay};
use crate::report::{ProbeResult, SustainedResult, round1, round3};
use crate::search::{ProbeStats, RateSearch, Verdict, probe_messages};

/// Fewest messages in a probe, so that its p99 stands on some samples.
const MIN_PROBE_MESSAGES: usize = 30;

impl Bench<'_> {
    /// Searches `sc`'s highest steady rate whose p99 lateness stays within the objective, below
    /// the rate of its saturating run `sat`. `ratio_to_raw` is left for the caller.
    pub(super) async fn sustained(
        &mut self,
        sc: Scenario,
        pubs: &[Publisher],
        path: &Path,
        sat: &RunOutcome,
    ) -> Result<SustainedResult> {
        let cfg = self.cfg;
        let ceiling = search_ceiling(sat);
        let mut search = RateSearch::new(ceiling, cfg.probes);
        let mut probes = Vec::new();
        while let Some(rate) = search.next() {
            let p = self.probe(sc, pubs, path, rate, probes.len()).await?;
            search.record(rate, p.verdict.passed());
            probes.push(p);
        }
        let result = SustainedResult {
            objective_p99_ms: cfg.objective_ms,
            msgs_per_s: search.best().map(round1),
            ratio_to_raw: None,
            missed_msgs_per_s: search.lowest_miss().map(round1),
            ceiling_msgs_per_s: round1(ceiling),
            probe_secs: cfg.probe_secs,
            warmup_secs: longest_delay(sc, cfg) as f64 / 1e3,
            probes,
        };
        self.progress.note(&format!(
            "{:<15} sustained (p99 ≤ {} ms): {}",
            sc.name(),
            cfg.objective_ms,
            match (result.msgs_per_s, result.missed_msgs_per_s) {
                (Some(r), _) => format!("{r:.0} msg/s"),
                (None, Some(m)) => format!("below {m:.0} msg/s"),
                (None, None) => "no probe".into(),
            }
        ));
        Ok(result)
    }

    /// Probe number `k`: the warm-up and `--probe-secs` of publishing at `rate`, on a queue of
    /// its own, judged on the messages due in the steady window.
    async fn probe(
        &mut self,
        sc: Scenario,
        pubs: &[Publisher],
        path: &Path,
        rate: f64,
        k: usize,
    ) -> Result<ProbeResult> {
        let cfg = self.cfg;
        let warmup_ms = longest_delay(sc, cfg);
        let secs = cfg.probe_secs + warmup_ms as f64 / 1e3;
        let n = probe_messages(rate, secs, MIN_PROBE_MESSAGES);
        // other delays than the saturating and lateness runs', the same for a seed
        let seed = cfg.seed + 2 + k as u64;
        let delays = (sc != Scenario::Raw).then(|| delays_for(sc, cfg, n, seed));
        let label = format!("{} probe @ {rate:.0}/s", sc.name());
        let queue = format!("{}.{}.p{k}", cfg.settings.prefix, sc.name());
        let run = self.start(&label, &queue, n, path).await?;
        if let Some(w) = steady_window(warmup_ms, n, rate) {
            let _ = run.tracker.steady.set(w);
        }
        let published = self
            .publish(&run, pubs, delays.as_deref(), Some(rate))
            .await;
        let stall = self.stall;
        let out = self.finish(run, published, stall).await?;
        self.check(&label, &out);
        let lateness = out.lateness.summary();
        let stats = ProbeStats {
            release_lag_ms: out.release_lag_ms,
            p99_ms: lateness.p99,
            samples: lateness.samples,
            lost: out.lost,
            early: out.lateness.early,
            publish_errors: out.publish_errors,
        };
        let verdict = Verdict::of(&stats, cfg.objective_ms);
        self.progress.note(&format!(
            "{:<15} probe @{rate:.0}/s: {verdict:?}, p99 {} ms, publisher lag {} ms",
            sc.name(),
            lateness.p99,
            out.release_lag_ms
        ));
        Ok(ProbeResult {
            rate_msgs_per_s: round1(rate),
            messages: n,
            broker_msgs_per_msg: out.broker_msgs_per_msg_of(sc).map(round3),
            lateness_ms: lateness,
            release_lag_ms: out.release_lag_ms,
            verdict,
        })
    }
}

/// The due times (ms after the first publish) a probe of `n` messages at `rate` is judged on:
/// from the end of the warm-up to the last release, when every stage carries `rate`; `None`
/// (judge all) without a warm-up or when the probe ends within it.
fn steady_window(warmup_ms: u64, n: usize, rate: f64) -> Option<std::ops::Range<u64>> {
    let last_release_ms = (n.saturating_sub(1) as f64 / rate * 1e3).floor();
    if warmup_ms == 0 || !last_release_ms.is_finite() || last_release_ms <= warmup_ms as f64 {
        return None;
    }
    Some(warmup_ms..last_release_ms as u64 + 1)
}

/// The top of the search: the saturating rate, or its publish rate when the delays rather
/// than the broker set that run's length (then the rate measured is only a lower bound).
fn search_ceiling(sat: &RunOutcome) -> f64 {
    if sat.delay_bound() {
        sat.msgs_per_s().max(sat.publish_msgs_per_s())
    } else {
        sat.msgs_per_s()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steady_window_follows_the_warm_up_to_the_last_release() {
        // 5 s of warm-up and 2 s of probe at 1 000 msg/s: 7 000 messages, the last released
        // at 6.999 s
        assert_eq!(steady_window(5_000, 7_000, 1_000.0), Some(5_000..7_000));
        // no delays: every message counts
        assert_eq!(steady_window(0, 2_000, 1_000.0), None);
        // a probe that ends within its warm-up has no steady part
        assert_eq!(steady_window(5_000, 30, 10.0), None);
        assert_eq!(steady_window(5_000, 30, 0.0), None);
    }
}
