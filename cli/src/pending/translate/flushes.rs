//! The flushes waiting for their confirm, per writer, pure. Every record costs time linear in
//! its size: a flush's members are a set (a flush spread over several records, or replayed, is
//! merged by lookups, not by scanning what it holds), and no writer's records can push another
//! writer's flushes out:
//!
//! * **Age** is counted by the journal's own times (so that a rebuild from an old journal
//!   works), but the newest time seen never runs ahead of the reader's clock: a record dated in
//!   the future cannot age everyone's flushes at once.
//! * **Room**: past [`MAX_FLUSH_MEMBERS`] in all, the oldest flush of the writer holding the
//!   most members is forgotten first.

use std::collections::{HashMap, VecDeque};

use indexmap::IndexSet;

/// Items of unconfirmed flushes kept at most: far more than the publishers of a deployment
/// have in flight (a flush is confirmed within about a second).
pub const MAX_FLUSH_MEMBERS: usize = 200_000;
/// How long (by the journal's own times) a flush waits for its confirm before it is forgotten.
pub const FLUSH_WINDOW_MS: u64 = 5 * 60_000;

/// An item of a flush: its owner and id.
pub(super) type Member = (String, String);

/// A flush waiting for its confirm.
#[derive(Debug)]
pub(super) struct Waiting {
    /// The journal offset of its first `Scheduled` record: a follower restarted after a crash
    /// reads again from the oldest of these, so that their confirms still find them.
    pub offset: u64,
    pub at_ms: u64,
    pub members: IndexSet<Member>,
}

/// A flush of one writer: its session and number.
type Key = (String, u64);

/// One writer's unconfirmed flushes, oldest first.
#[derive(Debug, Default)]
struct Writer {
    map: HashMap<Key, Waiting>,
    /// Keys in the order met; some may have been taken already.
    order: VecDeque<Key>,
    members: usize,
}

impl Writer {
    /// Drops taken keys from the front, and flushes older than the window before `newest_ms`;
    /// the members forgotten.
    fn trim(&mut self, newest_ms: u64) -> usize {
        if self.order.len() > 2 * self.map.len() + 1_024 {
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
        let mut forgotten = 0;
        while let Some(front) = self.order.front() {
            match self.map.get(front) {
                None => {}
                Some(w) if w.at_ms.saturating_add(FLUSH_WINDOW_MS) < newest_ms => {}
                Some(_) => break,
            }
            forgotten += self.pop_front();
        }
        forgotten
    }

    /// Forgets the oldest key; the members it held.
    fn pop_front(&mut self) -> usize {
        let Some(key) = self.order.pop_front() else {
            return 0;
        };
        let n = self.map.remove(&key).map_or(0, |w| w.members.len());
        self.members -= n;
        n
    }

    fn oldest_offset(&self) -> Option<u64> {
        self.order
            .front()
            .and_then(|k| self.map.get(k))
            .map(|w| w.offset)
    }
}

/// The unconfirmed flushes by writer, bounded in members ([`MAX_FLUSH_MEMBERS`]) and age
/// ([`FLUSH_WINDOW_MS`]).
#[derive(Debug, Default)]
pub struct Flushes {
    writers: HashMap<String, Writer>,
    members: usize,
    newest_ms: u64,
}

impl Flushes {
    /// Adds `w`'s members to `by`'s flush `(session, flush)`, read when the reader's clock said
    /// `now_ms` (a flush larger than one record spans several records of the same number; a
    /// replayed record adds nothing twice).
    pub(super) fn insert(&mut self, by: &str, key: Key, w: Waiting, now_ms: u64) {
        self.newest_ms = self.newest_ms.max(w.at_ms.min(now_ms));
        let writer = self.writers.entry(by.to_string()).or_default();
        match writer.map.get_mut(&key) {
            Some(have) => {
                for m in w.members {
                    if have.members.insert(m) {
                        writer.members += 1;
                        self.members += 1;
                    }
                }
            }
            None => {
                writer.members += w.members.len();
                self.members += w.members.len();
                writer.map.insert(key.clone(), w);
                writer.order.push_back(key);
            }
        }
        self.trim();
    }

    /// Takes `by`'s flush `key` once its confirm arrives.
    pub(super) fn take(&mut self, by: &str, key: &Key) -> Option<Waiting> {
        let writer = self.writers.get_mut(by)?;
        let w = writer.map.remove(key)?;
        writer.members -= w.members.len();
        self.members -= w.members.len();
        self.members -= writer.trim(self.newest_ms);
        if writer.map.is_empty() {
            self.writers.remove(by);
        }
        Some(w)
    }

    /// Forgets what is too old, then, while over the bound, the oldest flush of the writer
    /// holding the most.
    fn trim(&mut self) {
        let newest = self.newest_ms;
        for writer in self.writers.values_mut() {
            self.members -= writer.trim(newest);
        }
        while self.members > MAX_FLUSH_MEMBERS {
            let Some(writer) = self.writers.values_mut().max_by_key(|w| w.members) else {
                break;
            };
            let popped = writer.pop_front();
            self.members -= popped + writer.trim(newest);
            if popped == 0 {
                break;
            }
        }
        self.writers.retain(|_, w| !w.map.is_empty());
    }

    /// The offset of the oldest flush still waiting: where a restarted follower reads from.
    pub fn replay_from(&self) -> Option<u64> {
        // each writer's front is live (`trim`), and its flushes are met in offset order
        self.writers
            .values()
            .filter_map(Writer::oldest_offset)
            .min()
    }

    /// Items waiting for a confirm.
    pub fn members(&self) -> usize {
        self.members
    }

    /// Items of `by` waiting for a confirm.
    pub fn members_of(&self, by: &str) -> usize {
        self.writers.get(by).map_or(0, |w| w.members)
    }
}
