//! Sustained-rate mode (`--sustained`): for one scenario, short steady probes at the rates
//! `search::RateSearch` picks between a floor and the scenario's saturating rate, each judged
//! by `search::Verdict` against the p99 objective; the highest rate that met it.
//!
//! A probe publishes for its scenario's longest delay (the warm-up) plus `--probe-secs`; like
//! every paced run, it is judged on the messages due after the warm-up
//! ([`super::tracker::steady_window`]). A probe of 2 s with delays of 0–5 s judged on all its
//! messages was a burst, never the steady load it claimed to measure.

use amqp_delay::Result;

use super::Bench;
use super::app::Sender;
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
        pubs: &[Sender],
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
    /// its own, judged on the messages due after the warm-up.
    async fn probe(
        &mut self,
        sc: Scenario,
        pubs: &[Sender],
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
        let out = self
            .run_once(
                &format!("{} probe @ {rate:.0}/s", sc.name()),
                &format!("{}.{}.p{k}", cfg.settings.prefix, sc.name()),
                pubs,
                delays.as_deref(),
                n,
                Some(rate),
                path,
            )
            .await?;
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

/// The top of the search: the saturating rate, or its publish rate when the delays rather
/// than the broker set that run's length (then the rate measured is only a lower bound).
fn search_ceiling(sat: &RunOutcome) -> f64 {
    if sat.delay_bound() {
        sat.msgs_per_s().max(sat.publish_msgs_per_s())
    } else {
        sat.msgs_per_s()
    }
}
