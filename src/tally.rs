//! Counting delayed messages rather than broker messages (pure; the I/O is in `ledger`).
//!
//! A batch is one broker message holding many delayed messages, so queue depths count
//! batches. The ledger stream `<prefix>.ledger` counts messages instead: every publisher
//! appends, every few seconds, how many messages it put into the tiers and when each broker
//! message leaves them ([`Entry::Scheduled`], due times to the second). A reader sums what is
//! not yet due. Records are kept for the longest delay plus a week, so summing from the start
//! of the stream is always right, but long: a reader therefore appends a [`Entry::Snapshot`] of
//! its sum (what is pending as of a barrier's offset) at most every [`SNAPSHOT_EVERY_MS`], and
//! the next reader starts from the newest snapshot, reading only the last [`READ_WINDOW_MS`].
//!
//! What it counts: messages scheduled through the tiers and not yet due. A cancelled message
//! still counts until its due time (it waits in the tiers until then), a purged tier queue is
//! not seen, and what a publisher had not yet written when it died (at most its last few
//! seconds) is missing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How often a reader leaves a snapshot for the next ones (at most).
pub const SNAPSHOT_EVERY_MS: u64 = 30 * 60_000;
/// How far back a reader looks for a snapshot before it reads the ledger from its start.
pub const READ_WINDOW_MS: u64 = 2 * SNAPSHOT_EVERY_MS;

/// Records of the ledger stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Entry {
    /// Messages a publisher put into the tiers since its last record: `[due_s, count]`, where
    /// `due_s` is the second (since the epoch) by which their broker message leaves the tiers.
    Scheduled {
        /// The counts by due second.
        dues: Vec<(u64, u64)>,
    },
    /// Everything not yet due at `at_ms` that records up to offset `covers` (a reader's barrier)
    /// scheduled, coarsened by [`Dues::compact`].
    Snapshot {
        /// The offset of the barrier it covers up to (inclusive).
        covers: u64,
        /// When it was taken, ms since the epoch.
        at_ms: u64,
        /// The counts by due second.
        dues: Vec<(u64, u64)>,
    },
    /// A reader's marker: everything before it has been read.
    Barrier {
        /// Unique per read.
        nonce: String,
    },
}

/// Message counts by the second they fall due.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dues(BTreeMap<u64, u64>);

impl Dues {
    /// Counts `n` messages leaving the tiers at `due_ms` (rounded up to the second: counted as
    /// pending until that second is over).
    pub fn add(&mut self, due_ms: u64, n: u64) {
        if n > 0 {
            self.merge(&[(due_ms.div_ceil(1000), n)]);
        }
    }

    /// Adds `[due_s, count]` pairs (a record's).
    pub fn merge(&mut self, pairs: &[(u64, u64)]) {
        for &(s, n) in pairs {
            let e = self.0.entry(s).or_default();
            *e = e.saturating_add(n);
        }
    }

    /// Whether it counts nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// What is not yet due at `now_ms`, and when it falls due.
    pub fn pending(&self, now_ms: u64) -> Pending {
        let mut p = Pending {
            as_of_ms: now_ms,
            ..Pending::default()
        };
        // saturating throughout: a record anyone could have written must not overflow a sum
        for (&s, &n) in self.0.range(now_ms / 1000 + 1..) {
            let within = s.saturating_mul(1000).saturating_sub(now_ms);
            p.total = p.total.saturating_add(n);
            if within <= 60_000 {
                p.within_1m = p.within_1m.saturating_add(n);
            }
            if within <= 3_600_000 {
                p.within_1h = p.within_1h.saturating_add(n);
            }
            if within <= 86_400_000 {
                p.within_1d = p.within_1d.saturating_add(n);
            }
        }
        p
    }

    /// The pairs of what is not yet due at `now_ms`, for a record or a snapshot: to the second
    /// within two hours (a snapshot is used for up to [`READ_WINDOW_MS`] after it is taken, and
    /// the nearest bound a reader draws is one minute), to the minute within 180 days, to the
    /// hour beyond. Rounded up, so a message is never counted as due before it is; and since a
    /// snapshot is summed into the next, a message scheduled more than two hours ahead stays
    /// counted up to a minute after it fell due (more than 180 days ahead: up to an hour). At
    /// most 7 200 + 1 440 per day up to 180 days + 24 per day beyond pairs: for a year, 270 721
    /// pairs, a snapshot of 4 065 343 bytes (`a_year_of_pending_messages_fits_one_snapshot`).
    pub fn compact(&self, now_ms: u64) -> Vec<(u64, u64)> {
        let now_s = now_ms / 1000;
        let mut out: BTreeMap<u64, u64> = BTreeMap::new();
        for (&s, &n) in self.0.range(now_s + 1..) {
            let step = match s - now_s {
                0..=7_200 => 1,
                7_201..=15_552_000 => 60,
                _ => 3_600,
            };
            let key = s.div_ceil(step).saturating_mul(step);
            let e = out.entry(key).or_default();
            *e = e.saturating_add(n);
        }
        out.into_iter().collect()
    }
}

/// Messages not yet due, and when they fall due (counts within each bound include the nearer
/// ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Pending {
    /// When it was counted, ms since the epoch.
    pub as_of_ms: u64,
    /// Every message not yet due.
    pub total: u64,
    /// Due within a minute.
    pub within_1m: u64,
    /// Due within an hour.
    pub within_1h: u64,
    /// Due within a day.
    pub within_1d: u64,
}

/// Pairs `[due_s, count]` as records carry them.
pub type Pairs = Vec<(u64, u64)>;

/// Sums a ledger read in order up to a barrier: from the newest snapshot whose records after it
/// were all read, else from every record (right only when the read started at the stream's
/// start).
#[derive(Debug, Default)]
pub struct Reckoning {
    /// The first offset read.
    first: Option<u64>,
    /// Scheduled records by offset.
    scheduled: Vec<(u64, Pairs)>,
    /// The newest snapshot: covers, taken at, pairs.
    snapshot: Option<(u64, u64, Pairs)>,
    /// Records read.
    records: u64,
}

/// What a [`Reckoning`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reckoned {
    /// The sum.
    pub dues: Dues,
    /// When the snapshot it started from was taken (`None`: it summed every record).
    pub snapshot_at_ms: Option<u64>,
    /// Records it read.
    pub records: u64,
}

impl Reckoning {
    /// Takes the record at `offset` (records arrive in offset order).
    pub fn read(&mut self, offset: u64, entry: Entry) {
        self.first.get_or_insert(offset);
        self.records += 1;
        match entry {
            Entry::Scheduled { dues } => self.scheduled.push((offset, dues)),
            Entry::Snapshot {
                covers,
                at_ms,
                dues,
            } => {
                if self.snapshot.as_ref().is_none_or(|(c, ..)| covers > *c) {
                    self.snapshot = Some((covers, at_ms, dues));
                }
            }
            Entry::Barrier { .. } => {}
        }
    }

    /// Whether the read began at offset 0, the first record a stream ever had (so it read the
    /// whole stream: nothing has been dropped by retention yet).
    pub fn began_at_zero(&self) -> bool {
        self.first == Some(0)
    }

    /// The sum, when it can be right: with a usable snapshot (one whose later records were all
    /// read), or when the read began at the stream's first record (`from_start`) or read
    /// nothing. `None` otherwise: read the whole stream and take [`Reckoning::finish_whole`].
    pub fn finish(self, from_start: bool) -> Option<Reckoned> {
        (from_start || self.first.is_none() || self.usable().is_some()).then(|| self.finish_whole())
    }

    /// Whether the read so far can be summed as it is ([`Reckoning::finish`] of a read that
    /// knows no more than where it began): it holds a usable snapshot, began at offset 0, or
    /// read nothing.
    pub fn complete(&self) -> bool {
        self.began_at_zero() || self.first.is_none() || self.usable().is_some()
    }

    /// The sum of a read that began at the stream's first record: from the newest usable
    /// snapshot, else from every record.
    pub fn finish_whole(self) -> Reckoned {
        let usable = self
            .usable()
            .map(|(covers, at, pairs)| (*covers, *at, pairs));
        let mut dues = Dues::default();
        let (after, snapshot_at_ms) = match usable {
            Some((covers, at, pairs)) => {
                dues.merge(pairs);
                (Some(covers), Some(at))
            }
            None => (None, None),
        };
        for (offset, pairs) in &self.scheduled {
            if after.is_none_or(|c| *offset > c) {
                dues.merge(pairs);
            }
        }
        Reckoned {
            dues,
            snapshot_at_ms,
            records: self.records,
        }
    }

    /// The newest snapshot whose later records were all read.
    fn usable(&self) -> Option<&(u64, u64, Pairs)> {
        let first = self.first.unwrap_or(0);
        self.snapshot
            .as_ref()
            .filter(|(covers, ..)| covers.saturating_add(1) >= first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_due_time_counts_until_its_second_is_over() {
        let mut d = Dues::default();
        d.add(10_001, 2);
        d.add(10_999, 1);
        d.add(11_000, 4);
        assert_eq!(d.compact(10_000), vec![(11, 7)]);
        assert_eq!(d.pending(10_999).total, 7);
        assert_eq!(d.pending(11_000).total, 0);
    }

    #[test]
    fn pending_sorts_by_when_it_falls_due() {
        let now = 1_000_000_000;
        let mut d = Dues::default();
        d.add(now - 5_000, 100); // already due
        d.add(now + 30_000, 1);
        d.add(now + 600_000, 2);
        d.add(now + 7_200_000, 4);
        d.add(now + 3 * 86_400_000, 8);
        let p = d.pending(now);
        assert_eq!(
            (p.total, p.within_1m, p.within_1h, p.within_1d),
            (15, 1, 3, 7)
        );
    }

    #[test]
    fn records_of_another_kind_or_version_do_not_decode() {
        let decode = |b: &[u8]| serde_json::from_slice::<Entry>(b).ok();
        assert_eq!(decode(b"{\"type\":\"something_new\"}"), None);
        assert_eq!(decode(b"garbage"), None);
        let e = Entry::Scheduled { dues: vec![(5, 1)] };
        assert_eq!(decode(&serde_json::to_vec(&e).unwrap()), Some(e));
    }

    #[test]
    fn a_snapshot_is_coarser_far_ahead_and_never_early() {
        let now_s = 1_000_000;
        let mut d = Dues::default();
        for ahead in [1, 59, 7_199, 7_201, 7_210, 200_000, 200_001, 20_000_000] {
            d.add((now_s + ahead) * 1000, 1);
        }
        d.add((now_s - 3) * 1000, 5);
        let c = d.compact(now_s * 1000);
        assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 8, "{c:?}");
        // seconds within 2 h, minutes to 180 days, hours beyond: rounded up
        assert!(c.contains(&(now_s + 1, 1)) && c.contains(&(now_s + 7_199, 1)));
        assert!(c.contains(&((now_s + 7_201).div_ceil(60) * 60, 2)), "{c:?}");
        assert!(c.contains(&(now_s + 200_000, 1)), "{c:?}");
        assert!(
            c.contains(&((now_s + 200_001).div_ceil(60) * 60, 1)),
            "{c:?}"
        );
        assert!(
            c.contains(&((now_s + 20_000_000).div_ceil(3600) * 3600, 1)),
            "{c:?}"
        );
        let mut back = Dues::default();
        back.merge(&c);
        let (a, b) = (d.pending(now_s * 1000), back.pending(now_s * 1000));
        assert_eq!(
            (a.total, a.within_1m, a.within_1h),
            (b.total, b.within_1m, b.within_1h)
        );
    }

    #[test]
    fn a_far_message_through_a_chain_of_snapshots_is_counted_until_due_and_at_most_a_minute_more() {
        let due_s = 1_000_000 + 3 * 86_400 + 37;
        let mut d = Dues::default();
        d.add(due_s * 1000, 1);
        // a snapshot every 30 min from 3 days before its due time
        let mut now_s = 1_000_000;
        while now_s < due_s + 120 {
            let mut next = Dues::default();
            next.merge(&d.compact(now_s * 1000));
            d = next;
            let pending = d.pending(now_s * 1000).total;
            if now_s < due_s {
                assert_eq!(pending, 1, "counted as due early at {now_s}");
            }
            if now_s >= due_s + 60 {
                assert_eq!(pending, 0, "still counted at {now_s}");
            }
            now_s += if due_s - 600 < now_s { 7 } else { 1_800 };
        }
    }

    /// The bound `compact` promises, and that a snapshot of it is one message RabbitMQ 4.x
    /// accepts (16 MiB by default): messages due in every second of the next two hours and in
    /// every minute of the rest of a year, which fills every pair `compact` can keep.
    #[test]
    fn a_year_of_pending_messages_fits_one_snapshot() {
        let now_s = 1_000_000_000;
        let mut d = Dues::default();
        for ahead in (1..=7_200).chain((7_260..=365 * 86_400).step_by(60)) {
            d.add((now_s + ahead) * 1000, 1);
        }
        let pairs = d.compact(now_s * 1000);
        let snapshot = Entry::Snapshot {
            covers: u64::MAX,
            at_ms: u64::MAX,
            dues: pairs.clone(),
        };
        let bytes = serde_json::to_vec(&snapshot).unwrap().len();
        eprintln!("a year: {} pairs, {bytes} bytes", pairs.len());
        assert!(
            pairs.len() <= 7_200 + 180 * 1_440 + 185 * 24,
            "{}",
            pairs.len()
        );
        assert!(bytes < 16 * 1024 * 1024, "{bytes}");
    }

    #[test]
    fn absurd_records_do_not_overflow_the_sums() {
        let mut d = Dues::default();
        d.merge(&[
            (u64::MAX, u64::MAX),
            (u64::MAX - 1, u64::MAX),
            (5, u64::MAX),
        ]);
        d.merge(&[(5, 7)]);
        let p = d.pending(1_000);
        assert_eq!((p.total, p.within_1m), (u64::MAX, u64::MAX));
        assert!(!d.compact(1_000).is_empty());
    }

    #[test]
    fn a_window_without_a_usable_snapshot_asks_for_the_whole_stream() {
        let mut r = Reckoning::default();
        r.read(50, Entry::Scheduled { dues: vec![(9, 1)] });
        // covers up to 40: records 41..49 were not read
        r.read(
            51,
            Entry::Snapshot {
                covers: 40,
                at_ms: 1,
                dues: vec![(9, 3)],
            },
        );
        assert!(!r.complete());
        assert_eq!(r.finish(false), None);
    }

    proptest! {
        /// Starting from any snapshot gives what summing every record gives.
        #[test]
        fn a_snapshot_and_the_records_after_it_sum_to_every_record(
            dues in proptest::collection::vec((1u64..500, 1u64..5), 1..60),
            cut in 0usize..60,
            start in 0usize..60,
        ) {
            let now_ms = 100_000;
            let records: Vec<Entry> = dues
                .iter()
                .map(|&(s, n)| Entry::Scheduled { dues: vec![(s, n)] })
                .collect();
            let mut everything = Reckoning::default();
            for (i, e) in records.iter().enumerate() {
                everything.read(i as u64, e.clone());
            }
            let all = everything.finish_whole().dues;
            // a reader took a snapshot at its barrier after record `cut`
            let cut = cut.min(records.len() - 1);
            let mut upto = Dues::default();
            for (s, n) in dues.iter().take(cut + 1) {
                upto.merge(&[(*s, *n)]);
            }
            let snap = Entry::Snapshot { covers: cut as u64, at_ms: now_ms, dues: upto.compact(now_ms) };
            // a later reader reads from `start` (at most the record after the cover), with the
            // snapshot appended after every record
            let start = start.min(cut + 1);
            let mut r = Reckoning::default();
            for (i, e) in records.iter().enumerate().skip(start) {
                r.read(i as u64, e.clone());
            }
            r.read(records.len() as u64, snap);
            let got = r.finish(false).unwrap();
            prop_assert_eq!(got.snapshot_at_ms, Some(now_ms));
            prop_assert_eq!(got.dues.pending(now_ms), all.pending(now_ms));
        }
    }
}
