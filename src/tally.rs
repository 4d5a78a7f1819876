//! Counting delayed messages rather than broker messages (pure; the I/O is in `ledger`).
//!
//! A batch is one broker message holding many delayed messages, so queue depths count
//! batches, and a tier's messages cannot be looked into without taking them out
//! (DESIGN rule 8). The ledger stream `<prefix>.ledger` counts messages instead: every publisher
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
pub(crate) const SNAPSHOT_EVERY_MS: u64 = 30 * 60_000;
/// How far back a reader looks for a snapshot before it reads the ledger from its start.
pub(crate) const READ_WINDOW_MS: u64 = 2 * SNAPSHOT_EVERY_MS;

/// Records of the ledger stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Entry {
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
pub(crate) struct Dues(BTreeMap<u64, u64>);

impl Dues {
    /// Counts `n` messages leaving the tiers at `due_ms` (rounded up to the second: counted as
    /// pending until that second is over).
    pub(crate) fn add(&mut self, due_ms: u64, n: u64) {
        if n > 0 {
            self.merge(&[(due_ms.div_ceil(1000), n)]);
        }
    }

    /// Adds `[due_s, count]` pairs (a record's).
    pub(crate) fn merge(&mut self, pairs: &[(u64, u64)]) {
        for &(s, n) in pairs {
            let e = self.0.entry(s).or_default();
            *e = e.saturating_add(n);
        }
    }

    /// Whether it counts nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// What is not yet due at `now_ms`, and when it falls due.
    pub(crate) fn pending(&self, now_ms: u64) -> Pending {
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
    pub(crate) fn compact(&self, now_ms: u64) -> Vec<(u64, u64)> {
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
pub(crate) type Pairs = Vec<(u64, u64)>;

/// The most bytes one pair takes in a record: `[u64,u64],`.
pub(crate) const MAX_PAIR_BYTES: usize = 44;

/// How far past the longest delay a due time of ours can be: a planned route never overshoots
/// its delay by more than one tier's TTL, and no TTL exceeds 2^32 − 1 ms (~49.7 days).
pub(crate) const DUE_SLACK_MS: u64 = 1 << 32;

/// The most pairs [`Dues::compact`] leaves for counts due within `ahead_ms`: every second of
/// the first two hours, every minute to 180 days, every hour beyond (one more of each for the
/// rounding up). A record of ours never holds more (publishers compact what they write).
pub(crate) fn max_pairs(ahead_ms: u64) -> usize {
    let ahead_s = ahead_ms.div_ceil(1000);
    let seconds = ahead_s.min(7_200);
    let minutes = ahead_s.min(15_552_000).saturating_sub(7_200).div_ceil(60) + 1;
    let hours = ahead_s.saturating_sub(15_552_000).div_ceil(3_600) + 1;
    usize::try_from(seconds + minutes + hours).unwrap_or(usize::MAX)
}

/// The longest ledger record of ours for counts due within `ahead_ms`: [`max_pairs`] pairs of
/// [`MAX_PAIR_BYTES`], and the rest of a snapshot. A reader skips longer ones undecoded.
pub(crate) fn max_record_bytes(ahead_ms: u64) -> usize {
    max_pairs(ahead_ms)
        .saturating_mul(MAX_PAIR_BYTES)
        .saturating_add(256)
}

/// What a reader accepts of the records anyone may have appended, as of `now_ms`: at most
/// `max_pairs` pairs a record, due times no later than `latest_s` (later ones are counted as
/// due then: a forged far-off count is forgotten like a real one), a snapshot taken no later
/// than now and covering only offsets before its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// The latest second a count may fall due.
    pub latest_s: u64,
    /// Pairs in one record, at most.
    pub max_pairs: usize,
}

impl Bounds {
    /// For a topology whose counts fall due within `ahead_ms` (its longest delay plus
    /// [`DUE_SLACK_MS`]), as of `now_ms`.
    pub(crate) fn new(now_ms: u64, ahead_ms: u64) -> Bounds {
        Bounds {
            now_ms,
            latest_s: now_ms.saturating_add(ahead_ms).div_ceil(1000),
            max_pairs: max_pairs(ahead_ms),
        }
    }

    /// No bound at all (tests of the arithmetic).
    pub(crate) fn none() -> Bounds {
        Bounds {
            now_ms: u64::MAX,
            latest_s: u64::MAX,
            max_pairs: usize::MAX,
        }
    }

    /// `entry` as a reader takes it, or why it is skipped (a label of
    /// `amqp_delay_stream_records_skipped_total`): more pairs than a record of ours holds
    /// (`too_many_items`); due times past `latest_s` clamped, a snapshot's time past now too.
    pub(crate) fn check(&self, entry: Entry) -> Result<Entry, &'static str> {
        let clamp = |mut dues: Pairs| {
            if dues.len() > self.max_pairs {
                return Err("too_many_items");
            }
            for (s, _) in &mut dues {
                *s = (*s).min(self.latest_s);
            }
            Ok(dues)
        };
        Ok(match entry {
            Entry::Scheduled { dues } => Entry::Scheduled { dues: clamp(dues)? },
            Entry::Snapshot {
                covers,
                at_ms,
                dues,
            } => Entry::Snapshot {
                covers,
                at_ms: at_ms.min(self.now_ms),
                dues: clamp(dues)?,
            },
            e @ Entry::Barrier { .. } => e,
        })
    }
}

impl Dues {
    /// Keeps the sum within `b`: once it holds more than twice the pairs a record may, it is
    /// compacted as of `b.now_ms` (what is due dropped, far-off seconds coarsened), so that its
    /// size is bounded whatever records were read.
    pub(crate) fn bound(&mut self, b: &Bounds) {
        if self.0.len() > b.max_pairs.saturating_mul(2) {
            let mut kept = Dues::default();
            kept.merge(&self.compact(b.now_ms));
            *self = kept;
        }
    }

    /// Pairs held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// Scheduled records a [`Reckoning`] keeps for a snapshot still to come, at most: a snapshot
/// follows the barrier it covers at once, so only what publishers appended meanwhile (one
/// record each per 10 s) lies between them.
pub(crate) const TAIL_RECORDS: usize = 10_000;
/// Pairs in those records, at most (16 MB).
pub(crate) const TAIL_PAIRS: usize = 1_000_000;

/// Sums a ledger read in order up to a barrier, as it goes (its memory bounded whatever was
/// appended): from the newest snapshot whose records after it were all read, else from every
/// record (right only when the read started at the stream's start).
#[derive(Debug)]
pub(crate) struct Reckoning {
    bounds: Bounds,
    /// The first offset read.
    first: Option<u64>,
    /// Every scheduled record read, summed.
    all: Dues,
    /// The latest scheduled records by offset, for a snapshot covering up to a recent barrier.
    tail: std::collections::VecDeque<(u64, Pairs)>,
    tail_pairs: usize,
    /// The newest scheduled record that left the tail.
    dropped: Option<u64>,
    /// The newest usable snapshot: covers, taken at, and its pairs plus every record after.
    snapshot: Option<(u64, u64, Dues)>,
    /// Records read.
    records: u64,
}

impl Default for Reckoning {
    fn default() -> Self {
        Reckoning::new(Bounds::none())
    }
}

/// What a [`Reckoning`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reckoned {
    /// The sum.
    pub dues: Dues,
    /// When the snapshot it started from was taken (`None`: it summed every record).
    pub snapshot_at_ms: Option<u64>,
    /// Records it read.
    pub records: u64,
}

impl Reckoning {
    /// A read that takes records within `bounds`.
    pub(crate) fn new(bounds: Bounds) -> Reckoning {
        Reckoning {
            bounds,
            first: None,
            all: Dues::default(),
            tail: Default::default(),
            tail_pairs: 0,
            dropped: None,
            snapshot: None,
            records: 0,
        }
    }

    /// Its bounds.
    pub(crate) fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Takes the record at `offset` (records arrive in offset order), or says why it skipped
    /// it (see [`Bounds::check`]; `insane`: a snapshot covering offsets at or after its own).
    pub(crate) fn read(&mut self, offset: u64, entry: Entry) -> Result<(), &'static str> {
        self.first.get_or_insert(offset);
        self.records += 1;
        match self.bounds.check(entry)? {
            Entry::Scheduled { dues } => {
                self.all.merge(&dues);
                self.all.bound(&self.bounds);
                if let Some((.., sum)) = &mut self.snapshot {
                    sum.merge(&dues);
                    sum.bound(&self.bounds);
                }
                self.keep(offset, dues);
            }
            Entry::Snapshot {
                covers,
                at_ms,
                dues,
            } => {
                // a reader's barrier lies before the snapshot it appends after reading it
                if covers >= offset {
                    return Err("insane");
                }
                self.take_snapshot(covers, at_ms, &dues);
            }
            Entry::Barrier { .. } => {}
        }
        Ok(())
    }

    /// A scheduled record into the tail, the oldest dropped beyond its bounds.
    fn keep(&mut self, offset: u64, dues: Pairs) {
        self.tail_pairs += dues.len();
        self.tail.push_back((offset, dues));
        while self.tail.len() > TAIL_RECORDS || self.tail_pairs > TAIL_PAIRS {
            let Some((o, pairs)) = self.tail.pop_front() else {
                break;
            };
            self.tail_pairs -= pairs.len();
            self.dropped = Some(o);
        }
    }

    /// A snapshot covering up to `covers`: the one to start from when it is newer than the one
    /// held, every record after it was read, and the tail still holds them.
    fn take_snapshot(&mut self, covers: u64, at_ms: u64, dues: &[(u64, u64)]) {
        let first = self.first.unwrap_or(0);
        let newer = self.snapshot.as_ref().is_none_or(|(c, ..)| covers > *c);
        let read_after = covers.saturating_add(1) >= first;
        let in_tail = self.dropped.is_none_or(|d| d <= covers);
        if newer && read_after && in_tail {
            let mut sum = Dues::default();
            sum.merge(dues);
            for (_, pairs) in self.tail.iter().filter(|(o, _)| *o > covers) {
                sum.merge(pairs);
            }
            sum.bound(&self.bounds);
            self.snapshot = Some((covers, at_ms, sum));
        }
    }

    /// Whether the read began at offset 0, the first record a stream ever had (so it read the
    /// whole stream: nothing has been dropped by retention yet).
    pub(crate) fn began_at_zero(&self) -> bool {
        self.first == Some(0)
    }

    /// The sum, when it can be right: with a usable snapshot (one whose later records were all
    /// read), or when the read began at the stream's first record (`from_start`) or read
    /// nothing. `None` otherwise: read the whole stream and take [`Reckoning::finish_whole`].
    #[cfg(test)]
    pub(crate) fn finish(self, from_start: bool) -> Option<Reckoned> {
        (from_start || self.first.is_none() || self.snapshot.is_some()).then(|| self.finish_whole())
    }

    /// Whether the read so far can be summed as it is ([`Reckoning::finish`] of a read that
    /// knows no more than where it began): it holds a usable snapshot, began at offset 0, or
    /// read nothing.
    pub(crate) fn complete(&self) -> bool {
        self.began_at_zero() || self.first.is_none() || self.snapshot.is_some()
    }

    /// The sum of a read that began at the stream's first record: from the newest usable
    /// snapshot, else from every record.
    pub(crate) fn finish_whole(self) -> Reckoned {
        let (dues, snapshot_at_ms) = match self.snapshot {
            Some((_, at, sum)) => (sum, Some(at)),
            None => (self.all, None),
        };
        Reckoned {
            dues,
            snapshot_at_ms,
            records: self.records,
        }
    }
}

#[cfg(test)]
mod tests;
