//! One line per destination of what a viewer sees (the console's first page): how many are
//! pending, when the next is due, how the due times spread (next minute, hour, day, week,
//! later), the lateness p99 of recent runs and how many are parked.
//!
//! Every figure is one bounded read of an index that exists already:
//!
//! * pending, next due and the due-time buckets: one `GROUP BY destination_id` over the
//!   listing index `by_dest (listing, destination_id, due_ms, owner_id)`, index only (the owner filter of a user is read from the
//!   index too), in destination order, stopping after [`MAX_DESTINATIONS`] groups. It visits
//!   every pending entry the viewer's destinations hold: ~40 ns each, so at 10 million pending
//!   it takes a few hundred milliseconds. A page that must answer faster shows a summary made
//!   beforehand (the console keeps one per viewer and refreshes it in the background).
//! * parked: the same over the parked entries (`listing = 2`).
//! * lateness p99: the [`RECENT_RUNS`] most recently finished rows (`by_fin`, newest first,
//!   within [`RECENT_WINDOW_MS`]), the done ones among them joined with their history's run
//!   event. A sample, not every run: enough for a p99 of a busy destination, and bounded
//!   whatever the history holds.

use std::collections::HashMap;

use rusqlite::types::Value;

use super::paging::bind;
use super::schema::{EV_DONE, OWNER};
use super::{Destination, PendingIndex, Result, State, Viewer, check_user, ms};

/// Destinations a summary holds at most; past it, [`Summary::truncated`] says so.
pub const MAX_DESTINATIONS: usize = 10_000;
/// Finished rows read, newest first, for the lateness figures.
pub const RECENT_RUNS: usize = 10_000;
/// How far back a run counts as recent (ms).
pub const RECENT_WINDOW_MS: u64 = 3_600_000;

/// The upper bound of each due-time bucket but the last, relative to now (ms), and its label:
/// the next minute (what is overdue counts there too), hour, day and week. The fifth bucket is
/// everything later.
pub const DUE_BUCKETS: [(u64, &str); 4] = [
    (60_000, "next minute"),
    (3_600_000, "next hour"),
    (86_400_000, "next day"),
    (604_800_000, "next week"),
];

/// The label of the last due-time bucket.
pub const LATER: &str = "later";

/// What waits for one destination, as one viewer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationSummary {
    /// The destination.
    pub destination: Destination,
    /// Pending messages (unconfirmed ones included).
    pub pending: u64,
    /// When the next one is due (ms since the epoch); `None` when none is pending.
    pub next_due_ms: Option<u64>,
    /// Pending messages by due time: the [`DUE_BUCKETS`] then later. They add up to `pending`.
    pub due: [u64; 5],
    /// The 99th percentile of how late the sampled recent runs were (ms).
    pub lateness_p99_ms: Option<u64>,
    /// How many recent runs that percentile is of.
    pub runs: u64,
    /// Parked messages.
    pub parked: u64,
}

impl DestinationSummary {
    fn new(destination: Destination) -> DestinationSummary {
        DestinationSummary {
            destination,
            pending: 0,
            next_due_ms: None,
            due: [0; 5],
            lateness_p99_ms: None,
            runs: 0,
            parked: 0,
        }
    }
}

/// Every destination a viewer has pending, parked or recently run messages of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// By destination: queues by name first, then exchanges.
    pub destinations: Vec<DestinationSummary>,
    /// More destinations than [`MAX_DESTINATIONS`]: the list holds the first ones by the
    /// index's order.
    pub truncated: bool,
    /// The "now" the due-time buckets are relative to (ms since the epoch).
    pub now_ms: u64,
}

/// The value at quantile `q` of `v` (sorted in place), nearest rank.
fn quantile(v: &mut [u64], q: f64) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let rank = ((v.len() as f64) * q).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

impl PendingIndex {
    /// The summary of every destination `viewer` sees, the due-time buckets relative to
    /// `now_ms`. Bounded: at most [`MAX_DESTINATIONS`] destinations and [`RECENT_RUNS`] runs
    /// read; the cost is one index-only pass over the viewer's pending and parked entries.
    pub fn summary(&mut self, viewer: &Viewer, now_ms: u64) -> Result<Summary> {
        self.check_not_rebuilding()?;
        let now = ms(now_ms, "now")?;
        let own = match viewer {
            Viewer::Admin => None,
            Viewer::User(u) => {
                check_user(u, "the viewer's user name")?;
                match self.names.lookup(&self.conn, OWNER, u, "")? {
                    Some(o) => Some(o),
                    None => {
                        return Ok(Summary {
                            destinations: Vec::new(),
                            truncated: false,
                            now_ms,
                        });
                    }
                }
            }
        };
        let mut by_dest: HashMap<i64, DestinationSummary> = HashMap::new();
        let truncated = self.pending_groups(own, now, &mut by_dest)?;
        self.parked_groups(own, &mut by_dest)?;
        self.recent_lateness(own, now, &mut by_dest)?;
        let mut destinations: Vec<DestinationSummary> = by_dest.into_values().collect();
        destinations.sort_by(|a, b| order_key(&a.destination).cmp(&order_key(&b.destination)));
        Ok(Summary {
            destinations,
            truncated,
            now_ms,
        })
    }

    /// The summary line of `dest` (interned as `nid`), made on first sight.
    fn line<'a>(
        &mut self,
        by_dest: &'a mut HashMap<i64, DestinationSummary>,
        nid: i64,
    ) -> Result<&'a mut DestinationSummary> {
        Ok(match by_dest.entry(nid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let (a, b) = self.names.name(&self.conn, nid)?;
                e.insert(DestinationSummary::new(Destination::from_parts(a, b)))
            }
        })
    }

    /// Pending count, next due and due-time buckets per destination; whether it stopped at
    /// [`MAX_DESTINATIONS`].
    fn pending_groups(
        &mut self,
        own: Option<i64>,
        now: i64,
        by_dest: &mut HashMap<i64, DestinationSummary>,
    ) -> Result<bool> {
        let mut p: Vec<(&'static str, Value)> = DUE_BUCKETS
            .iter()
            .zip([":b1", ":b2", ":b3", ":b4"])
            .map(|((d, _), n)| (n, Value::Integer(now.saturating_add(*d as i64))))
            .collect();
        p.push((":lim", Value::Integer((MAX_DESTINATIONS + 1) as i64)));
        let sql = format!(
            "SELECT destination_id, count(*), min(due_ms), sum(due_ms < :b1), \
             sum(due_ms >= :b1 AND due_ms < :b2), sum(due_ms >= :b2 AND due_ms < :b3), \
             sum(due_ms >= :b3 AND due_ms < :b4) \
             FROM messages INDEXED BY by_dest WHERE listing = 1{} \
             GROUP BY destination_id LIMIT :lim",
            owner_clause(own, "", &mut p)
        );
        let groups: Vec<(i64, i64, i64, [i64; 4])> = self
            .conn
            .prepare_cached(&sql)?
            .query_map(&*bind(&p), |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    [r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?],
                ))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let truncated = groups.len() > MAX_DESTINATIONS;
        for (nid, n, next, buckets) in groups.into_iter().take(MAX_DESTINATIONS) {
            let line = self.line(by_dest, nid)?;
            line.pending = n as u64;
            line.next_due_ms = Some(next as u64);
            let mut rest = n as u64;
            for (i, c) in buckets.iter().enumerate() {
                line.due[i] = *c as u64;
                rest = rest.saturating_sub(*c as u64);
            }
            line.due[4] = rest;
        }
        Ok(truncated)
    }

    /// Parked count per destination (of the destinations already listed, or new ones while
    /// the bound allows).
    fn parked_groups(
        &mut self,
        own: Option<i64>,
        by_dest: &mut HashMap<i64, DestinationSummary>,
    ) -> Result<()> {
        let mut p = vec![(":lim", Value::Integer(MAX_DESTINATIONS as i64))];
        let sql = format!(
            "SELECT destination_id, count(*) FROM messages INDEXED BY by_dest WHERE listing = 2{} \
             GROUP BY destination_id LIMIT :lim",
            owner_clause(own, "", &mut p)
        );
        let groups: Vec<(i64, i64)> = self
            .conn
            .prepare_cached(&sql)?
            .query_map(&*bind(&p), |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        for (nid, n) in groups {
            if by_dest.len() >= MAX_DESTINATIONS && !by_dest.contains_key(&nid) {
                continue;
            }
            self.line(by_dest, nid)?.parked = n as u64;
        }
        Ok(())
    }

    /// Lateness p99 per destination over the done runs among the [`RECENT_RUNS`] most recently
    /// finished rows of the last [`RECENT_WINDOW_MS`].
    fn recent_lateness(
        &mut self,
        own: Option<i64>,
        now: i64,
        by_dest: &mut HashMap<i64, DestinationSummary>,
    ) -> Result<()> {
        let mut p = vec![
            (
                ":since",
                Value::Integer(now.saturating_sub(RECENT_WINDOW_MS as i64)),
            ),
            (":lim", Value::Integer(RECENT_RUNS as i64)),
        ];
        let sql = format!(
            "SELECT f.destination_id, h.lateness_ms FROM (SELECT row_id, destination_id, \
             owner_id, state FROM messages INDEXED BY by_fin WHERE finished_ms >= :since \
             ORDER BY finished_ms DESC LIMIT :lim) f \
             JOIN history h ON h.row_id = f.row_id AND h.kind = {EV_DONE} \
             WHERE f.state = {}{}",
            State::Done.code(),
            owner_clause(own, "f.", &mut p)
        );
        let mut late: HashMap<i64, Vec<u64>> = HashMap::new();
        {
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(&*bind(&p))?;
            while let Some(r) = rows.next()? {
                let nid: i64 = r.get(0)?;
                let x: Option<i64> = r.get(1)?;
                late.entry(nid)
                    .or_default()
                    .push(x.unwrap_or(0).max(0) as u64);
            }
        }
        for (nid, mut v) in late {
            if by_dest.len() >= MAX_DESTINATIONS && !by_dest.contains_key(&nid) {
                continue;
            }
            let line = self.line(by_dest, nid)?;
            line.runs = v.len() as u64;
            line.lateness_p99_ms = quantile(&mut v, 0.99);
        }
        Ok(())
    }
}

/// ` AND {table}owner_id = :own` for a user's summary (binding `:own`), nothing for an admin's.
fn owner_clause(own: Option<i64>, table: &str, p: &mut Vec<(&'static str, Value)>) -> String {
    match own {
        Some(o) => {
            p.push((":own", Value::Integer(o)));
            format!(" AND {table}owner_id = :own")
        }
        None => String::new(),
    }
}

/// Queues by name, then exchanges by name and routing key.
fn order_key(d: &Destination) -> (u8, &str, &str) {
    match d {
        Destination::Queue(q) => (0, q, ""),
        Destination::Exchange {
            exchange,
            routing_key,
        } => (1, exchange, routing_key),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Entry, Options, Outcome, Scheduled};
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    struct Temp(std::path::PathBuf);

    impl Temp {
        fn new() -> Temp {
            let dir = std::env::temp_dir().join(format!(
                "pending-summary-test-{}-{}",
                std::process::id(),
                uuid::Uuid::now_v7()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Temp(dir)
        }

        fn open(&self) -> PendingIndex {
            PendingIndex::open(&self.0.join("index.db"), Options::default()).unwrap()
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sched(owner: &str, id: &str, queue: &str, due: u64) -> Entry {
        Entry::Scheduled(Scheduled {
            id: id.into(),
            owner: owner.into(),
            destination: Destination::Queue(queue.into()),
            due_at_ms: due,
            scheduled_at_ms: NOW - 10_000,
            size: 1,
            content_type: None,
            headers: vec![],
            body: None,
            confirmed: true,
        })
    }

    fn find<'a>(s: &'a Summary, q: &str) -> &'a DestinationSummary {
        s.destinations
            .iter()
            .find(|d| d.destination == Destination::Queue(q.into()))
            .unwrap_or_else(|| panic!("{q} is not in {s:?}"))
    }

    #[test]
    fn counts_next_due_and_buckets_per_destination_as_each_viewer_sees_them() {
        let t = Temp::new();
        let mut ix = t.open();
        let mut e = Vec::new();
        // A: one overdue, 2 in the next minute, 3 within the hour, 1 within a day, 1 within a
        // week, 2 later; owned by alice except one of bob's
        for (i, off) in [
            -5_000i64,
            10_000,
            59_000,
            61_000,
            600_000,
            3_599_000,
            7_200_000,
            86_400_000 * 3,
            86_400_000 * 8,
            86_400_000 * 30,
        ]
        .iter()
        .enumerate()
        {
            let owner = if i == 9 { "bob" } else { "alice" };
            e.push(sched(
                owner,
                &format!("a-{i}"),
                "A",
                (NOW as i64 + off) as u64,
            ));
        }
        for i in 0..4 {
            e.push(sched("bob", &format!("b-{i}"), "B", NOW + 120_000 + i));
        }
        ix.apply(&e).unwrap();
        let s = ix.summary(&Viewer::Admin, NOW).unwrap();
        assert!(!s.truncated);
        assert_eq!(s.destinations.len(), 2);
        assert_eq!(
            s.destinations[0].destination,
            Destination::Queue("A".into())
        );
        let a = find(&s, "A");
        assert_eq!(a.pending, 10);
        assert_eq!(a.next_due_ms, Some(NOW - 5_000));
        assert_eq!(a.due, [3, 3, 1, 1, 2]);
        assert_eq!(a.due.iter().sum::<u64>(), a.pending);
        let b = find(&s, "B");
        assert_eq!((b.pending, b.next_due_ms), (4, Some(NOW + 120_000)));
        assert_eq!(b.due, [0, 4, 0, 0, 0]);

        let alice = ix.summary(&Viewer::User("alice".into()), NOW).unwrap();
        assert_eq!(alice.destinations.len(), 1, "{alice:?}");
        assert_eq!(find(&alice, "A").pending, 9);
        assert_eq!(find(&alice, "A").due, [3, 3, 1, 1, 1]);
        let bob = ix.summary(&Viewer::User("bob".into()), NOW).unwrap();
        assert_eq!((find(&bob, "A").pending, find(&bob, "B").pending), (1, 4));
        let nobody = ix.summary(&Viewer::User("carol".into()), NOW).unwrap();
        assert!(nobody.destinations.is_empty());
    }

    #[test]
    fn lateness_p99_comes_from_recent_done_runs_and_parked_are_counted() {
        let t = Temp::new();
        let mut ix = t.open();
        let mut e = Vec::new();
        for i in 0..200u64 {
            e.push(sched("alice", &format!("r-{i}"), "R", NOW - 60_000));
        }
        e.push(sched("alice", "p-1", "P", NOW - 60_000));
        e.push(sched("alice", "p-2", "P", NOW - 60_000));
        e.push(sched("alice", "old", "R", NOW - 7_200_000));
        ix.apply(&e).unwrap();
        let mut runs = Vec::new();
        for i in 0..200u64 {
            runs.push(Entry::Ran {
                owner: "alice".into(),
                id: format!("r-{i}"),
                at_ms: NOW - 1_000,
                // 1..=200 ms late: the p99 by nearest rank is 198
                lateness_ms: i + 1,
                outcome: Outcome::Done,
            });
        }
        // run two hours ago, 1 h late: outside the window, not counted
        runs.push(Entry::Ran {
            owner: "alice".into(),
            id: "old".into(),
            at_ms: NOW - 7_200_000,
            lateness_ms: 3_600_000,
            outcome: Outcome::Done,
        });
        for id in ["p-1", "p-2"] {
            runs.push(Entry::Ran {
                owner: "alice".into(),
                id: id.into(),
                at_ms: NOW - 500,
                lateness_ms: 5,
                outcome: Outcome::Parked,
            });
        }
        ix.apply(&runs).unwrap();
        let s = ix.summary(&Viewer::Admin, NOW).unwrap();
        let r = find(&s, "R");
        assert_eq!((r.pending, r.next_due_ms), (0, None));
        assert_eq!((r.runs, r.lateness_p99_ms), (200, Some(198)));
        let p = find(&s, "P");
        assert_eq!((p.pending, p.parked), (0, 2));
        let bob = ix.summary(&Viewer::User("bob".into()), NOW).unwrap();
        assert!(bob.destinations.is_empty());
    }

    #[test]
    fn a_summary_during_a_rebuild_says_so_and_quantiles_are_nearest_rank() {
        let t = Temp::new();
        let mut reader = t.open();
        let mut ix = t.open();
        ix.begin_rebuild().unwrap();
        let e = ix.summary(&Viewer::Admin, NOW).unwrap_err();
        assert!(e.to_string().contains("rebuilt"), "{e}");
        // another connection learns of the rebuild from the file
        assert!(reader.rebuilding_now().unwrap());
        assert!(reader.summary(&Viewer::Admin, NOW).is_err());
        ix.finish_rebuild().unwrap();
        assert!(!reader.rebuilding_now().unwrap());
        assert!(reader.summary(&Viewer::Admin, NOW).is_ok());
        assert_eq!(quantile(&mut [], 0.99), None);
        assert_eq!(quantile(&mut [7], 0.99), Some(7));
        assert_eq!(quantile(&mut [3, 1, 2], 0.5), Some(2));
        let mut v: Vec<u64> = (1..=1000).rev().collect();
        assert_eq!(quantile(&mut v, 0.99), Some(990));
    }

    #[test]
    fn the_summary_reads_the_listing_index_without_a_sort() {
        let t = Temp::new();
        let ix = t.open();
        let plan: Vec<String> = ix
            .conn
            .prepare(
                "EXPLAIN QUERY PLAN SELECT destination_id, count(*), min(due_ms) FROM messages \
                 INDEXED BY by_dest WHERE listing = 1 AND owner_id = 3 GROUP BY destination_id",
            )
            .unwrap()
            .query_map([], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let text = plan.join(" | ");
        assert!(text.contains("COVERING INDEX by_dest"), "{text}");
        assert!(!text.contains("TEMP B-TREE"), "{text}");
    }
}
