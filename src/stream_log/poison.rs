//! Records no reader can receive: what a process has learnt about them, no I/O.
//!
//! A record whose header frame fits the writer's `frame_max` when appended grows on delivery
//! (the broker adds `x-stream-offset`), and the AMQP client ends the whole connection when a
//! frame is over its `frame_max` (lapin: FRAME_ERROR, "frame too large"). Anyone allowed to
//! append to a stream can write one, and a reader that starts again from before it would lose
//! its connection on it for as long as the stream keeps it. Nothing in such a record can be
//! ours (our records are far smaller), so it is skipped — once it is known for certain
//! which offset it is, because skipping a real record could skip a cancel:
//!
//! * A frame error while reading a stream makes its readers in this process **careful**:
//!   prefetch 1, each record acked as it is taken, so that at most one record, the one after
//!   the last taken, is ever on its way.
//! * A frame error while a careful reader waits for offset `o`, asked for less than a second
//!   before (a record that exists is sent at once), names `o` a **suspect**. The connection
//!   may have been ended by another consumer on it, so one error proves nothing; a suspect
//!   that is delivered after all is cleared.
//! * The second frame error on the same suspect, with no delivery of it in between, makes it
//!   **poisoned**: readers stop just before it and go on from the next offset.
//!
//! Each poisoned record costs a process three lost connections, once. What it learns is
//! bounded ([`MAX_STREAMS`], [`MAX_POISONED`]). A careful reader never opens at a time (the
//! ledger's window): the record the broker would start with has no offset it could name, so
//! it opens at the stream's start.
//!
//! **A poisoned record that is the first of a stream whose start retention removed** cannot be
//! named: a reader that opens at 0 (or anywhere before it) gets it first, and over AMQP 0-9-1
//! an offset that does not exist and an unreceivable record answer alike (a frame error),
//! so no probe tells the record's offset from the missing ones before it (with several
//! unreceivable records in a row, not even a bisection: it could skip a real record between
//! them). What does hold: the control stream's start-up read begins near the end (at
//! offsets stepped back from a probe of the end, made by careful processes too), so a
//! follower meets such a record only when no whole checkpoint was written after it; then
//! its readers keep losing their connection there until retention removes the record.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, OnceLock};

/// Frame errors on the same suspect that make it poisoned.
const CONFIRMATIONS: u8 = 2;
/// Streams a process keeps knowledge of (a process reads a handful).
pub(crate) const MAX_STREAMS: usize = 64;
/// Poisoned offsets kept per stream; past it a stream's further ones cannot be skipped (each
/// of them already cost three connections, and a reader keeps losing its connection on it).
pub(crate) const MAX_POISONED: usize = 10_000;

/// What a process knows of one stream's unreceivable records.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct StreamPoison {
    /// Readers of this stream read one record at a time.
    pub(crate) careful: bool,
    /// The offset a careful reader waited for at a frame error, with the count of such errors.
    suspect: Option<(u64, u8)>,
    /// Offsets known to be unreceivable.
    poisoned: BTreeSet<u64>,
    /// The highest offset a careful reader took, or a reader took before a frame error:
    /// where the stream ends as far as this process saw. Careful readers start from there,
    /// not from a probe of the end (the probe could meet the poisoned record itself).
    pub(crate) seen_end: Option<u64>,
    /// A probe of the end met a frame error: the end is `seen_end` only.
    pub(crate) end_probe_failed: bool,
}

/// What a frame error taught.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Learnt {
    /// The stream's readers are careful from now on.
    Careful,
    /// The offset is a suspect (this many frame errors on it).
    Suspect(u64, u8),
    /// The offset is poisoned: skipped from now on.
    Poisoned(u64),
    /// Nothing new (no offset to suspect, or no room for more).
    Nothing,
}

impl StreamPoison {
    /// A frame error while a reader waited for `awaiting` (known only to a careful reader
    /// that took a record or opened at an offset).
    pub(crate) fn frame_error(&mut self, careful: bool, awaiting: Option<u64>) -> Learnt {
        if !self.careful {
            self.careful = true;
            return Learnt::Careful;
        }
        let Some(o) = awaiting.filter(|_| careful) else {
            return Learnt::Nothing;
        };
        let n = match self.suspect {
            Some((s, n)) if s == o => n.saturating_add(1),
            _ => 1,
        };
        if n < CONFIRMATIONS {
            self.suspect = Some((o, n));
            return Learnt::Suspect(o, n);
        }
        self.suspect = None;
        if self.poisoned.len() >= MAX_POISONED {
            return Learnt::Nothing;
        }
        self.poisoned.insert(o);
        Learnt::Poisoned(o)
    }

    /// A careful reader took the record at `offset`: it is no suspect.
    pub(crate) fn delivered(&mut self, offset: u64) {
        if self.suspect.is_some_and(|(s, _)| s == offset) {
            self.suspect = None;
        }
        self.seen_end = Some(self.seen_end.map_or(offset, |e| e.max(offset)));
    }

    /// The first offset at or after `from` that is not poisoned.
    pub(crate) fn next_readable(&self, from: u64) -> u64 {
        let mut o = from;
        while self.poisoned.contains(&o) {
            o = o.saturating_add(1);
        }
        o
    }

    /// Whether `offset` is poisoned.
    pub(crate) fn is_poisoned(&self, offset: u64) -> bool {
        self.poisoned.contains(&offset)
    }
}

/// The process's knowledge, by stream name.
fn all() -> &'static Mutex<HashMap<String, StreamPoison>> {
    static ALL: OnceLock<Mutex<HashMap<String, StreamPoison>>> = OnceLock::new();
    ALL.get_or_init(Default::default)
}

/// A copy of what is known of `stream` (the default: nothing).
pub(crate) fn of(stream: &str) -> StreamPoison {
    let all = all().lock().unwrap_or_else(|e| e.into_inner());
    all.get(stream).cloned().unwrap_or_default()
}

/// Changes what is known of `stream` (forgotten, with every other stream, when the process
/// already knows [`MAX_STREAMS`] streams: the readers become fast and learn again).
pub(crate) fn update<T>(stream: &str, f: impl FnOnce(&mut StreamPoison) -> T) -> T {
    let mut all = all().lock().unwrap_or_else(|e| e.into_inner());
    if !all.contains_key(stream) && all.len() >= MAX_STREAMS {
        all.clear();
    }
    f(all.entry(stream.to_string()).or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn careful() -> StreamPoison {
        let mut p = StreamPoison::default();
        assert_eq!(p.frame_error(false, Some(7)), Learnt::Careful);
        p
    }

    #[test]
    fn the_first_frame_error_only_makes_readers_careful() {
        let mut p = StreamPoison::default();
        // even with an offset: a fast reader has many records on the way
        assert_eq!(p.frame_error(false, Some(7)), Learnt::Careful);
        assert!(p.careful);
        assert!(!p.is_poisoned(7));
    }

    #[test]
    fn an_offset_is_poisoned_by_two_frame_errors_on_it_and_no_fewer() {
        let mut p = careful();
        assert_eq!(p.frame_error(true, Some(7)), Learnt::Suspect(7, 1));
        assert!(!p.is_poisoned(7));
        assert_eq!(p.frame_error(true, Some(7)), Learnt::Poisoned(7));
        assert!(p.is_poisoned(7));
        assert_eq!(p.next_readable(7), 8);
        assert_eq!(p.next_readable(5), 5);
    }

    #[test]
    fn a_suspect_delivered_after_all_is_cleared() {
        let mut p = careful();
        p.frame_error(true, Some(7));
        // another consumer on the connection had ended it: offset 7 arrives on the next one
        p.delivered(7);
        assert_eq!(p.frame_error(true, Some(7)), Learnt::Suspect(7, 1));
        assert!(!p.is_poisoned(7));
        assert_eq!(p.seen_end, Some(7));
    }

    #[test]
    fn errors_on_different_offsets_confirm_nothing() {
        let mut p = careful();
        p.frame_error(true, Some(7));
        assert_eq!(p.frame_error(true, Some(9)), Learnt::Suspect(9, 1));
        assert_eq!(p.frame_error(true, Some(7)), Learnt::Suspect(7, 1));
        assert!(!p.is_poisoned(7) && !p.is_poisoned(9));
    }

    #[test]
    fn a_reader_that_is_not_careful_or_knows_no_offset_suspects_nothing() {
        let mut p = careful();
        assert_eq!(p.frame_error(false, Some(7)), Learnt::Nothing);
        assert_eq!(p.frame_error(true, None), Learnt::Nothing);
        assert_eq!(p.frame_error(true, None), Learnt::Nothing);
        assert!(!p.is_poisoned(7));
    }

    #[test]
    fn neighbouring_poisoned_offsets_are_skipped_together() {
        let mut p = careful();
        for o in [7, 7, 8, 8] {
            p.frame_error(true, Some(o));
        }
        assert_eq!(p.next_readable(7), 9);
        assert_eq!(p.next_readable(u64::MAX), u64::MAX);
    }

    #[test]
    fn what_a_process_keeps_is_bounded() {
        let mut p = careful();
        for o in 0..(MAX_POISONED as u64 + 5) {
            p.frame_error(true, Some(o));
            p.frame_error(true, Some(o));
        }
        assert_eq!(p.poisoned.len(), MAX_POISONED);
        for i in 0..(MAX_STREAMS + 3) {
            update(&format!("poison-test-{i}"), |p| p.careful = true);
        }
        assert!(all().lock().unwrap().len() <= MAX_STREAMS);
    }
}
