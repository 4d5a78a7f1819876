//! What a run found: `Report` and its parts (serialized as the `--json` object, so the field
//! names are its keys), number formatting; the human-readable table is in `table`.

mod table;

use std::collections::BTreeMap;

use serde::Serialize;

use amqp_delay::Precision;

use crate::search::Verdict;

/// Lateness (or latency) percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub(crate) struct Percentiles {
    pub(crate) min: i64,
    pub(crate) p50: i64,
    pub(crate) p99: i64,
    pub(crate) p999: i64,
    pub(crate) max: i64,
    /// Messages measured.
    pub(crate) samples: u64,
}

/// One scenario's numbers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScenarioResult {
    pub(crate) description: String,
    /// The tiers' radix and unit (null for the plugin, which has no tiers).
    pub(crate) radix: Option<u32>,
    pub(crate) unit_ms: Option<u64>,
    /// Lateness budget the planner used.
    pub(crate) precision: String,
    pub(crate) messages: usize,
    /// End to end, first publish to last distinct consume.
    pub(crate) msgs_per_s: f64,
    /// `msgs_per_s / raw_msgs_per_s` (null when raw was not measured).
    pub(crate) ratio_to_raw: Option<f64>,
    /// Planned dead-letter hops per message (batched: the routes the batches took).
    pub(crate) avg_hops: f64,
    /// The same in the rate-limited lateness run (batches formed at a steady rate may take
    /// other routes than those of a burst).
    pub(crate) lateness_avg_hops: f64,
    /// Hops the messages actually took (sum of their `x-death` counts); null for the batched
    /// scenarios, whose messages carry no `x-death` of their own.
    pub(crate) observed_avg_hops: Option<f64>,
    /// Broker messages published into the tiers per message scheduled, in the saturating run
    /// (1 unbatched; below 1 when batches carried several; null for raw). The gateway's is per
    /// message delivered: the messages it holds take no broker message (0 when it held all).
    pub(crate) broker_msgs_per_msg: Option<f64>,
    /// The same in the rate-limited lateness run.
    pub(crate) lateness_broker_msgs_per_msg: Option<f64>,
    /// Messages scheduled into the tiers per message delivered, in the saturating run: about 1
    /// for the delayed paths; for a gateway the share that crossed the tiers (the rest it held
    /// in memory, `gateway.hold`). Null for raw.
    pub(crate) tiers_share: Option<f64>,
    /// The same in the rate-limited lateness run.
    pub(crate) lateness_tiers_share: Option<f64>,
    /// Hops the same mix would take at real scale (24 h, the configured fixed levels).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) real_scale_avg_hops: Option<f64>,
    pub(crate) e2e_s: f64,
    pub(crate) publish_s: f64,
    pub(crate) publish_msgs_per_s: f64,
    /// Median lateness of the saturating run: large means the broker was behind (saturated),
    /// small means the run was limited by the publisher or by its delays.
    pub(crate) backlog_p50_ms: i64,
    /// The saturating run ended about when its last message became due: its duration was set
    /// by the delays, not by the broker, so `msgs_per_s` is a lower bound (use more messages).
    pub(crate) delay_bound: bool,
    /// Lateness of the rate-limited run (for raw: plain publish-to-consume latency), of the
    /// messages due once its longest delay has passed (all when the run is hardly longer).
    pub(crate) lateness_ms: Percentiles,
    /// Lateness of every message of the rate-limited run, from the first one: what an
    /// application that publishes as soon as it has declared sees.
    pub(crate) lateness_from_first_ms: Percentiles,
    /// Rate of the lateness run.
    pub(crate) lateness_rate_msgs_per_s: f64,
    /// Messages published in the lateness run.
    pub(crate) lateness_messages: usize,
    /// The longest a message of the lateness run waited past its release time for its
    /// publisher (ms): large means the run did not keep its rate.
    pub(crate) lateness_release_lag_ms: u64,
    /// Confirmed but never delivered (both runs).
    pub(crate) lost: usize,
    /// Deliveries beyond the first (both runs).
    pub(crate) duplicates: usize,
    /// Publishes the broker nacked or returned, or that failed (both runs).
    pub(crate) publish_errors: usize,
    /// Messages delivered before their due time (both runs): must be 0.
    pub(crate) early: u64,
    /// The sustained-rate search (`--sustained`; null without it).
    pub(crate) sustained: Option<SustainedResult>,
}

/// The highest steady rate found whose p99 lateness stayed within the objective.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SustainedResult {
    pub(crate) objective_p99_ms: u64,
    /// The highest rate probed that met the objective (null when none did).
    pub(crate) msgs_per_s: Option<f64>,
    /// `msgs_per_s` over the raw baseline of the same run (null without raw or a rate).
    pub(crate) ratio_to_raw: Option<f64>,
    /// The lowest rate probed that missed it (null when none did): the sustained rate lies
    /// below.
    pub(crate) missed_msgs_per_s: Option<f64>,
    /// The top of the search: the saturating rate (its publish rate when that run was bound
    /// by its delays). Never probed itself.
    pub(crate) ceiling_msgs_per_s: f64,
    /// Seconds of publishing per probe after the warm-up: the steady window its p99 is of.
    pub(crate) probe_secs: f64,
    /// Seconds of publishing per probe before the steady window (the scenario's longest
    /// delay): messages due then are checked for loss and earliness only.
    pub(crate) warmup_secs: f64,
    /// In the order they ran.
    pub(crate) probes: Vec<ProbeResult>,
}

/// One steady run of the search.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ProbeResult {
    pub(crate) rate_msgs_per_s: f64,
    pub(crate) messages: usize,
    pub(crate) lateness_ms: Percentiles,
    /// Broker messages through the tiers per message (as `lateness_broker_msgs_per_msg`).
    pub(crate) broker_msgs_per_msg: Option<f64>,
    /// The longest a message waited past its release time for its publisher (ms).
    pub(crate) release_lag_ms: u64,
    /// `ok`, `late` (p99 above the objective), `behind` (p99 within it, but the publisher fell
    /// behind the rate by more than the objective), `failed` (lost, early or unpublished
    /// messages).
    pub(crate) verdict: Verdict,
}

/// Capacity mode's numbers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CapacityResult {
    /// The messages travelled in batches (`--capacity-batched`): `pending_at_peak` counts
    /// broker messages, each holding many.
    pub(crate) batched: bool,
    pub(crate) messages: u64,
    pub(crate) hold_ms: u64,
    pub(crate) publish_msgs_per_s: f64,
    /// Broker messages in the tiers right after the last publish.
    pub(crate) pending_at_peak: u64,
    pub(crate) memory: MemoryResult,
    /// From the moment the first message became due to the last distinct consume.
    pub(crate) drain_s: f64,
    pub(crate) drain_msgs_per_s: f64,
    pub(crate) lost: usize,
    pub(crate) duplicates: usize,
    pub(crate) publish_errors: usize,
    pub(crate) early: u64,
    pub(crate) lateness_ms: Percentiles,
}

/// Broker memory in bytes, or null where it could not be read.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MemoryResult {
    /// How it was read (`rabbitmqctl status`, `rabbitmq-diagnostics memory_breakdown`, or `n/a`).
    pub(crate) source: String,
    pub(crate) before_bytes: Option<u64>,
    pub(crate) peak_bytes: Option<u64>,
    pub(crate) growth_bytes: Option<i64>,
    pub(crate) bytes_per_message: Option<f64>,
    pub(crate) after_drain_bytes: Option<u64>,
    /// The categories of the broker's memory breakdown that grew or shrank most, in bytes.
    pub(crate) growth_by_category: BTreeMap<String, i64>,
}

/// One reading of the broker's memory.
#[derive(Debug, Clone)]
pub(crate) struct MemorySample {
    /// How it was read.
    pub(crate) source: String,
    pub(crate) total: u64,
    /// The breakdown (`quorum_ets`, `binary`, `quorum_queue_procs`, ...).
    pub(crate) categories: BTreeMap<String, u64>,
}

/// The broker and the machine.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Environment {
    pub(crate) broker_url: String,
    pub(crate) broker_version: Option<String>,
    /// `rabbit.dead_letter_worker_consumer_prefetch` (quorum at-least-once dead-lettering).
    pub(crate) dead_letter_worker_prefetch: Option<u64>,
    pub(crate) cpu: String,
    pub(crate) cores: usize,
}

/// The settings the run used.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunConfig {
    pub(crate) prefix: String,
    pub(crate) messages: usize,
    pub(crate) batched_messages: usize,
    pub(crate) quick: bool,
    pub(crate) radix: u32,
    pub(crate) unit_ms: u64,
    pub(crate) queue_type: String,
    pub(crate) lateness_budget: String,
    pub(crate) max_in_flight: usize,
    pub(crate) prefetch: u16,
    pub(crate) publishers: usize,
    pub(crate) consumers: usize,
    pub(crate) body_bytes: usize,
    pub(crate) max_delay_ms: u64,
    pub(crate) fixed_levels_ms: Vec<u64>,
    pub(crate) lateness_secs: f64,
    pub(crate) rate: Option<f64>,
    pub(crate) seed: u64,
    pub(crate) fixed_shards: u32,
    pub(crate) sustained: bool,
    pub(crate) objective_ms: u64,
    pub(crate) probe_secs: f64,
    pub(crate) probes: usize,
}

/// Everything one run found; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) tool: &'static str,
    pub(crate) version: &'static str,
    pub(crate) environment: Environment,
    pub(crate) config: RunConfig,
    pub(crate) raw_msgs_per_s: Option<f64>,
    pub(crate) raw: Option<ScenarioResult>,
    pub(crate) scenarios: BTreeMap<String, ScenarioResult>,
    pub(crate) capacity: Option<CapacityResult>,
    /// Anything that went wrong (lost or early messages, publish errors, leftovers in tiers).
    pub(crate) problems: Vec<String>,
    pub(crate) ok: bool,
    pub(crate) elapsed_s: f64,
}

/// The lateness budget in words: `exact`, `2 ms`, `0.1%`, `max(2 ms, 0.1%)`.
pub(crate) fn describe_precision(p: &Precision) -> String {
    let pct = format!("{}%", round3(p.lateness_ratio * 100.0));
    match (p.lateness.as_millis(), p.lateness_ratio == 0.0) {
        (0, true) => "exact".into(),
        (ms, true) => format!("{ms} ms"),
        (0, false) => pct,
        (ms, false) => format!("max({ms} ms, {pct})"),
    }
}

pub(crate) fn fmt_bytes(b: Option<u64>) -> String {
    b.map_or_else(
        || "n/a".into(),
        |b| format!("{:.1} MB", b as f64 / 1_000_000.0),
    )
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn probe(rate: f64, p99: i64, verdict: Verdict) -> ProbeResult {
        ProbeResult {
            rate_msgs_per_s: rate,
            messages: 100,
            lateness_ms: Percentiles {
                p99,
                ..Percentiles::default()
            },
            broker_msgs_per_msg: Some(1.0),
            release_lag_ms: 0,
            verdict,
        }
    }

    pub(crate) fn sustained(msgs_per_s: Option<f64>, missed: Option<f64>) -> SustainedResult {
        SustainedResult {
            objective_p99_ms: 25,
            msgs_per_s,
            ratio_to_raw: msgs_per_s.map(|r| r / 2_000.0),
            missed_msgs_per_s: missed,
            ceiling_msgs_per_s: 4_000.0,
            probe_secs: 2.0,
            warmup_secs: 5.0,
            probes: vec![
                probe(1_000.0, 12, Verdict::Ok),
                probe(2_000.0, 80, Verdict::Late),
            ],
        }
    }

    #[test]
    fn json_names_are_stable() {
        let v = serde_json::to_value(sustained(Some(1_000.0), None)).unwrap();
        for k in [
            "objective_p99_ms",
            "msgs_per_s",
            "ratio_to_raw",
            "missed_msgs_per_s",
            "ceiling_msgs_per_s",
            "probe_secs",
            "warmup_secs",
            "probes",
        ] {
            assert!(v.get(k).is_some(), "{k} missing: {v}");
        }
        let p = &v["probes"][1];
        assert_eq!(p["verdict"], "late");
        assert_eq!(p["lateness_ms"]["p99"], 80);
    }
}
