//! The human-readable table of a [`Report`]: the run's setup, one row per scenario, the notes
//! that explain the columns, the sustained-rate lines, capacity mode's line and the verdict.

use std::fmt::Write as _;

use amqp_delay::time::compact_duration;

use super::{CapacityResult, Report, ScenarioResult, SustainedResult, fmt_bytes};
use crate::config::Scenario;
use crate::search::Verdict;

impl Report {
    /// The human-readable table: the run's setup, one row per scenario (raw first), the notes
    /// that explain the columns, capacity mode's line, and the verdict.
    pub(crate) fn table(&self) -> String {
        let mut s = String::new();
        self.write_setup(&mut s);
        self.write_rows(&mut s);
        self.write_notes(&mut s);
        self.write_sustained(&mut s);
        if let Some(cap) = &self.capacity {
            write_capacity(&mut s, cap);
        }
        self.write_verdict(&mut s);
        s
    }

    /// The broker, the machine and the settings of the run.
    fn write_setup(&self, s: &mut String) {
        let e = &self.environment;
        let c = &self.config;
        let _ = writeln!(
            s,
            "delay-bench {} — {} (RabbitMQ {}), {} × {} cores",
            self.version,
            e.broker_url,
            e.broker_version.as_deref().unwrap_or("?"),
            e.cpu,
            e.cores
        );
        let _ = writeln!(
            s,
            "radix {}, unit {} ms, budget {}, {} tiers and queues, {} messages × {} B, \
             max_in_flight {}, prefetch {}, {} publisher(s), {} consumer(s), dead-letter worker prefetch {}",
            c.radix,
            c.unit_ms,
            c.lateness_budget,
            c.queue_type,
            c.messages,
            c.body_bytes,
            c.max_in_flight,
            c.prefetch,
            c.publishers,
            c.consumers,
            e.dead_letter_worker_prefetch
                .map_or_else(|| "?".into(), |p| p.to_string()),
        );
    }

    /// The column heads, then raw and the scenarios in their fixed order.
    fn write_rows(&self, s: &mut String) {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<62} {:>7} {:>5} {:>5} {:>5} {:>8} │ {:>6} {:>5} {:>5} {:>5} {:>6} {:>6} {:>5} │ {:>5} {:>5} {:>6} │ {:>4} {:>4}",
            "scenario",
            "msg/s",
            "×raw",
            "hops",
            "brk/m",
            "sat p50",
            "@msg/s",
            "min",
            "p50",
            "p99",
            "p99.9",
            "max",
            "brk/m",
            "1st50",
            "p99",
            "max",
            "lost",
            "dup"
        );
        // raw first, then the fixed order of the scenarios
        let mut ordered: Vec<&ScenarioResult> = Vec::new();
        ordered.extend(self.raw.iter());
        for sc in Scenario::ALL.iter().skip(1) {
            if let Some(r) = self.scenarios.get(sc.name()) {
                ordered.push(r);
            }
        }
        for r in ordered {
            let (l, f) = (&r.lateness_ms, &r.lateness_from_first_ms);
            let _ = writeln!(
                s,
                "{:<62} {:>7} {:>5} {:>5.2} {:>5} {:>8} │ {:>6.0} {:>5} {:>5} {:>5} {:>6} {:>6} {:>5} │ {:>5} {:>5} {:>6} │ {:>4} {:>4}",
                truncate(&r.description, 62),
                format!(
                    "{}{:.0}",
                    if r.delay_bound { "≥" } else { "" },
                    r.msgs_per_s
                ),
                r.ratio_to_raw
                    .map_or_else(|| "-".into(), |x| format!("{x:.2}")),
                r.avg_hops,
                fmt_ratio(r.broker_msgs_per_msg),
                r.backlog_p50_ms,
                r.lateness_rate_msgs_per_s,
                l.min,
                l.p50,
                l.p99,
                l.p999,
                l.max,
                fmt_ratio(r.lateness_broker_msgs_per_msg),
                f.p50,
                f.p99,
                f.max,
                r.lost,
                r.duplicates
            );
        }
    }

    /// What the columns mean, and what only some runs have: the batched scenarios' lateness
    /// runs, delay-bound runs, the mix at real scale.
    fn write_notes(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\nmsg/s: end to end, first publish to last consume. sat p50: median lateness of that \
             saturating run (ms). Lateness (ms, consume − x-delay-due-at; raw: latency) from a \
             second run at a steady half the measured rate (or --rate), of the messages due once \
             the longest delay has passed (all when the run is hardly longer); 1st50, p99, max: of \
             every message of that run from the first, published as soon as the path was declared. \
             brk/m: broker messages through the tiers per message, left in the saturating run, \
             right in the steady one (1: unbatched; a batch counts once; gateway: per message \
             delivered, a held one takes none; -: not counted, as in another process)."
        );
        self.write_batched_notes(s);
        if self.scenarios.values().any(|r| r.delay_bound) {
            let _ = writeln!(
                s,
                "≥: the run ended when its last message became due, so the delays, not the broker, \
                 set its length: a lower bound; more messages (-n) measure the broker."
            );
        }
        if let Some(m) = self
            .scenarios
            .get("mix")
            .and_then(|m| m.real_scale_avg_hops)
        {
            let _ = writeln!(
                s,
                "mix at real scale (configured fixed levels, 0–24 h): {m:.2} hops per message"
            );
        }
    }

    /// The batched scenarios' hops in the lateness runs, and how many of the gateways'
    /// messages crossed the tiers (the rest the gateway held in memory).
    fn write_batched_notes(&self, s: &mut String) {
        let batched = self.named(|sc| sc.batched(), |r| format!("{:.2}", r.lateness_avg_hops));
        if !batched.is_empty() {
            let _ = writeln!(
                s,
                "Batched hops are the routes the batches took (gateway: planned per message \
                 alone); in the steady runs: {}.",
                batched.join(", ")
            );
        }
        let crossed = self.named(Scenario::gateway, |r| {
            format!(
                "{} (steady {})",
                fmt_ratio(r.tiers_share),
                fmt_ratio(r.lateness_tiers_share)
            )
        });
        if !crossed.is_empty() {
            let _ = writeln!(
                s,
                "Share of the gateway's messages that crossed the tiers: {}.",
                crossed.join(", ")
            );
        }
    }

    /// `name value` for each scenario of the run that `pick` selects, in the fixed order.
    fn named(
        &self,
        pick: impl Fn(Scenario) -> bool,
        value: impl Fn(&ScenarioResult) -> String,
    ) -> Vec<String> {
        Scenario::ALL
            .into_iter()
            .filter(|&sc| pick(sc))
            .filter_map(|sc| {
                let r = self.scenarios.get(sc.name())?;
                Some(format!("{} {}", sc.name(), value(r)))
            })
            .collect()
    }

    /// The sustained-rate search, one line per scenario (raw first) with its probes.
    fn write_sustained(&self, s: &mut String) {
        if !self.config.sustained {
            return;
        }
        let _ = writeln!(
            s,
            "\nsustained rate: the highest steady rate probed whose p99 lateness stayed within \
             {} ms (probes of {} s steady after a warm-up as long as the scenario's longest delay, \
             at most {} per scenario; ×raw: of raw's saturating rate)",
            self.config.objective_ms, self.config.probe_secs, self.config.probes
        );
        let ordered = self.raw.iter().map(|r| ("raw", r)).chain(
            Scenario::ALL
                .iter()
                .skip(1)
                .filter_map(|sc| Some((sc.name(), self.scenarios.get(sc.name())?))),
        );
        for (name, r) in ordered {
            if let Some(st) = &r.sustained {
                let _ = writeln!(s, "  {name:<15} {}", sustained_line(st));
            }
        }
    }

    /// No problem, or the list of them.
    fn write_verdict(&self, s: &mut String) {
        if self.problems.is_empty() {
            let _ = writeln!(
                s,
                "\nno message lost, none early, nothing left in the tiers ({:.0} s)",
                self.elapsed_s
            );
        } else {
            let _ = writeln!(s, "\nPROBLEMS:");
            for p in &self.problems {
                let _ = writeln!(s, "  - {p}");
            }
        }
    }
}

/// Capacity mode: how many messages the broker held, what they cost in memory, the drain.
fn write_capacity(s: &mut String, cap: &CapacityResult) {
    let m = &cap.memory;
    let _ = writeln!(
        s,
        "\ncapacity{}: {} messages held {} published at {:.0} msg/s, {} broker messages pending; broker \
         memory {} → {} (growth {}, {} B/message; after drain {}) [{}]; drained in {:.1} s \
         ({:.0} msg/s), lost {}, duplicates {}",
        if cap.batched { " (batched)" } else { "" },
        cap.messages,
        compact_duration(cap.hold_ms),
        cap.publish_msgs_per_s,
        cap.pending_at_peak,
        fmt_bytes(m.before_bytes),
        fmt_bytes(m.peak_bytes),
        m.growth_bytes.map_or_else(
            || "n/a".into(),
            |g| format!("{:.1} MB", g as f64 / 1_000_000.0)
        ),
        m.bytes_per_message
            .map_or_else(|| "n/a".into(), |b| format!("{b:.0}")),
        fmt_bytes(m.after_drain_bytes),
        m.source,
        cap.drain_s,
        cap.drain_msgs_per_s,
        cap.lost,
        cap.duplicates
    );
}

/// `1234 msg/s (0.17 × raw)` or `< 80 msg/s`, then the probes: `rate verdict p99`.
fn sustained_line(st: &SustainedResult) -> String {
    let found = match (st.msgs_per_s, st.missed_msgs_per_s) {
        (Some(r), _) => format!(
            "{r:>8.0} msg/s ({} × raw)",
            st.ratio_to_raw
                .map_or_else(|| "-".into(), |x| format!("{x:.2}"))
        ),
        (None, Some(m)) => format!("   < {m:.0} msg/s (none of the probes met it)"),
        (None, None) => "       - (no probe: the ceiling is too low)".into(),
    };
    let probes: Vec<String> = st
        .probes
        .iter()
        .map(|p| {
            format!(
                "{:.0} {} p99 {}",
                p.rate_msgs_per_s,
                verdict_word(p.verdict),
                p.lateness_ms.p99
            )
        })
        .collect();
    format!(
        "{found}; ceiling {:.0}; warm-up {} s; probes: {}",
        st.ceiling_msgs_per_s,
        st.warmup_secs,
        probes.join(", ")
    )
}

fn verdict_word(v: Verdict) -> &'static str {
    match v {
        Verdict::Ok => "ok",
        Verdict::Late => "late",
        Verdict::Behind => "behind",
        Verdict::Failed => "failed",
    }
}

/// A ratio with three decimals, `-` when there is none.
fn fmt_ratio(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.3}"))
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sustained;

    #[test]
    fn sustained_lines_say_what_was_found() {
        let found = sustained_line(&sustained(Some(1_000.0), Some(2_000.0)));
        assert!(found.contains("1000 msg/s (0.50 × raw)"), "{found}");
        assert!(
            found.contains("probes: 1000 ok p99 12, 2000 late p99 80"),
            "{found}"
        );
        assert!(found.contains("ceiling 4000; warm-up 5 s"), "{found}");
        let none = sustained_line(&sustained(None, Some(250.0)));
        assert!(none.contains("< 250 msg/s"), "{none}");
        let empty = SustainedResult {
            probes: Vec::new(),
            ..sustained(None, None)
        };
        assert!(sustained_line(&empty).contains("no probe"));
    }

    #[test]
    fn ratios_have_three_decimals() {
        assert_eq!(fmt_ratio(None), "-");
        assert_eq!(fmt_ratio(Some(0.1234)), "0.123");
    }
}
