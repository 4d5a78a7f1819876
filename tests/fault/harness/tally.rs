//! What a scenario saw, and the one line it prints.

use std::collections::{HashMap, HashSet};

use super::Delivered;

/// What a scenario saw: of `scheduled` (confirmed) ids, which were delivered, how often, how late.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub scheduled: usize,
    pub delivered: usize,
    pub lost: Vec<String>,
    pub duplicates: usize,
    pub early: Vec<(String, i64)>,
    pub worst_lateness_ms: i64,
}

impl Tally {
    /// `deliveries` measured against `scheduled`; deliveries of other ids are ignored.
    pub(crate) fn of(scheduled: &HashSet<String>, deliveries: &[Delivered]) -> Tally {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut t = Tally {
            scheduled: scheduled.len(),
            ..Tally::default()
        };
        for d in deliveries {
            if !scheduled.contains(&d.id) {
                continue;
            }
            *seen.entry(d.id.as_str()).or_insert(0) += 1;
            let late = d.fired_at as i64 - d.due_at as i64;
            if late < 0 {
                t.early.push((d.id.clone(), late));
            }
            t.worst_lateness_ms = t.worst_lateness_ms.max(late);
        }
        t.delivered = seen.len();
        t.duplicates = seen.values().map(|n| n - 1).sum();
        let mut lost: Vec<String> = scheduled
            .iter()
            .filter(|i| !seen.contains_key(i.as_str()))
            .cloned()
            .collect();
        lost.sort();
        t.lost = lost;
        t
    }

    /// The scenario's one line, on stderr past the test harness's capture (so it is shown for
    /// passing tests too).
    pub(crate) fn print(&self, scenario: &str) {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "FAULT {scenario}: {} scheduled / {} delivered / {} lost / {} duplicates / {} early / worst lateness {} ms",
            self.scheduled,
            self.delivered,
            self.lost.len(),
            self.duplicates,
            self.early.len(),
            self.worst_lateness_ms
        );
    }

    /// Nothing lost, nothing early.
    pub(crate) fn assert_sound(&self, scenario: &str) {
        assert!(
            self.lost.is_empty(),
            "{scenario}: {} of {} confirmed messages never arrived, e.g. {:?}",
            self.lost.len(),
            self.scheduled,
            &self.lost[..self.lost.len().min(10)]
        );
        assert!(
            self.early.is_empty(),
            "{scenario}: {} messages early, e.g. {:?}",
            self.early.len(),
            &self.early[..self.early.len().min(10)]
        );
    }
}
