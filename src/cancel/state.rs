//! What a follower knows, changed in stream order by its reader: live tombstones, the expired
//! ones it still keeps, the barriers it waits for, and where checkpoints begin and end.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

use rand::Rng;
use tokio::sync::oneshot;

use super::quota::{MOVES, PURGES};
use super::steer::{PURGES_PER_PART, Rules};
use super::{CHECKPOINT_PART, EXPIRED_KEPT, EXPIRED_KEPT_MS, KIND, MAX_LIVE};
use crate::control::{HeldPurge, MAX_ID_BYTES, MAX_ITEMS, Move, Record};
use crate::stream_log::skipped;
use crate::trust::Trust;

/// What a follower takes of records anyone may have appended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// A tombstone is live at most this long from now: the topology's longest delay plus the
    /// follower's `cancel.horizon` (no message can fall due later); a later `until` is clamped.
    pub(super) ahead_ms: u64,
    /// Live tombstones held, at most ([`MAX_LIVE`]).
    pub(super) max_live: usize,
}

/// Parts of one checkpoint, at most: every tombstone a follower may hold, live and expired, in
/// parts of [`CHECKPOINT_PART`], each part one writer's (a part more for each of up to
/// [`MAX_WRITERS`] writers). A checkpoint announcing more is no follower's.
const MAX_PARTS: u32 = ((MAX_LIVE + EXPIRED_KEPT) / CHECKPOINT_PART
    + 1
    + MAX_WRITERS
    + (MOVES.users + MOVES.admins) / CHECKPOINT_PART
    + (PURGES.users + PURGES.admins) / PURGES_PER_PART
    + 2) as u32;
/// Users writing cancels a checkpoint allows for: far more than a deployment has (users are
/// broker accounts an administrator creates).
const MAX_WRITERS: usize = 10_000;

/// A tombstone's name: the cancelled message id and the user who wrote the cancel (it stops
/// only that user's messages, or any when the user is an admin: [`Trust::may_cancel`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Key {
    pub(super) by: String,
    pub(super) id: String,
}

impl Key {
    pub(super) fn new(by: &str, id: &str) -> Key {
        Key {
            by: by.to_string(),
            id: id.to_string(),
        }
    }
}

/// A tombstone's name borrowed (`(by, id)`), to look a message up without building a [`Key`]:
/// a worker asks for every message it runs.
trait KeyView {
    fn by(&self) -> &str;
    fn id(&self) -> &str;
}

impl KeyView for Key {
    fn by(&self) -> &str {
        &self.by
    }
    fn id(&self) -> &str {
        &self.id
    }
}

impl KeyView for (&str, &str) {
    fn by(&self) -> &str {
        self.0
    }
    fn id(&self) -> &str {
        self.1
    }
}

impl<'a> std::borrow::Borrow<dyn KeyView + 'a> for Key {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

// as `Key`'s derived `Hash` and `Eq` (its fields in order; a `str` hashes as a `String`)
impl std::hash::Hash for dyn KeyView + '_ {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.by().hash(h);
        self.id().hash(h);
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.by() == other.by() && self.id() == other.id()
    }
}

impl Eq for dyn KeyView + '_ {}

/// Tombstones as a follower hands them to its checkpoint: `(key, until_ms)`.
pub(super) type Items = Vec<(Key, u64)>;

/// Everything a checkpoint repeats: tombstones, purges, reschedules.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) items: Items,
    pub(super) purges: Vec<HeldPurge>,
    pub(super) moves: Vec<Move>,
}

/// One checkpoint part's content: a writer's tombstones, or rules.
pub(super) type Part = (String, Vec<(String, u64)>, Vec<HeldPurge>, Vec<Move>);

/// `held` as checkpoint parts: the tombstones by writer ([`parts_of`]), then the reschedules
/// in parts of `part`, then the purges in parts of [`PURGES_PER_PART`].
pub(super) fn checkpoint_parts(held: Held, part: usize) -> Vec<Part> {
    let mut out: Vec<Part> = parts_of(held.items, part)
        .into_iter()
        .map(|(by, items)| (by, items, Vec::new(), Vec::new()))
        .collect();
    for moves in held.moves.chunks(part) {
        out.push((String::new(), Vec::new(), Vec::new(), moves.to_vec()));
    }
    for purges in held.purges.chunks(PURGES_PER_PART) {
        out.push((String::new(), Vec::new(), purges.to_vec(), Vec::new()));
    }
    out
}

/// `items` as checkpoint parts carry them: by writer, at most `part` tombstones `(id, until)`
/// a part, each part one writer's; one empty part when there is nothing.
pub(super) fn parts_of(mut items: Items, part: usize) -> Vec<(String, Vec<(String, u64)>)> {
    items.sort_unstable();
    let mut parts: Vec<(String, Vec<(String, u64)>)> = Vec::new();
    for (key, until) in items {
        match parts.last_mut() {
            Some((by, part_items)) if *by == key.by && part_items.len() < part => {
                part_items.push((key.id, until))
            }
            _ => parts.push((key.by, vec![(key.id, until)])),
        }
    }
    if parts.is_empty() {
        parts.push((String::new(), Vec::new()));
    }
    parts
}

/// The records read since a checkpoint's begin record, while its parts arrive.
pub(super) struct OpenCheckpoint {
    /// `State::read` when its begin record was read.
    pub(super) begin: u64,
    pub(super) parts: u32,
    pub(super) got: HashSet<u32>,
}

/// What a follower knows; changed only by its reader task (and by the lookups that prune).
pub(super) struct State {
    pub(super) limits: Limits,
    /// Whose records count for what.
    pub(super) trust: Trust,
    /// Tombstone → live until (ms since the epoch).
    pub(super) tombstones: HashMap<Key, u64>,
    /// Purges and reschedules.
    pub(super) rules: Rules,
    /// Expired tombstones still kept: key → kept until.
    pub(super) expired: HashMap<Key, u64>,
    /// The same, oldest first (a key may appear more than once; the map says which counts).
    pub(super) expired_order: VecDeque<(Key, u64)>,
    /// Barriers appended by this follower and not read back yet.
    pub(super) waiting: HashMap<String, oneshot::Sender<()>>,
    /// Why the follower stopped, if it did.
    pub(super) broken: Option<String>,
    pub(super) last_prune: u64,
    /// Recently executed ids (→ their queue), oldest first, to say when a cancel came too late.
    pub(super) executed: VecDeque<String>,
    pub(super) executed_set: HashMap<String, String>,
    /// Cancels read after this follower's worker had run the message.
    pub(super) too_late: u64,
    /// Records read by the current consumer (positions for checkpoints).
    pub(super) read: u64,
    /// Records read in all, for progress.
    pub(super) records: u64,
    /// Checkpoints whose begin record the current consumer read and whose parts are coming.
    pub(super) open: HashMap<String, OpenCheckpoint>,
    /// `read` at the begin record of the latest whole checkpoint the current consumer read.
    pub(super) complete_at: Option<u64>,
    /// `read` at the latest checkpoint begin record read (anyone's).
    pub(super) begun_at: Option<u64>,
    /// This follower's own checkpoint: its nonce, and where to hand the tombstones when its
    /// begin record is read back.
    pub(super) own: Option<(String, Option<oneshot::Sender<Held>>)>,
    /// Whether this follower has read everything up to its start barrier: only then may it
    /// write a checkpoint.
    pub(super) ready: bool,
    /// This follower's own threshold factor (1.0 to 1.5), so that followers reading the same
    /// records do not all write a checkpoint at once.
    pub(super) jitter: f64,
    pub(super) checkpoints_written: u64,
    pub(super) checkpoints_read: u64,
}

impl State {
    pub(super) fn new(limits: Limits, trust: Trust) -> State {
        State {
            limits,
            trust,
            tombstones: HashMap::new(),
            rules: Rules::default(),
            expired: HashMap::new(),
            expired_order: VecDeque::new(),
            waiting: HashMap::new(),
            broken: None,
            last_prune: 0,
            executed: VecDeque::new(),
            executed_set: HashMap::new(),
            too_late: 0,
            read: 0,
            records: 0,
            open: HashMap::new(),
            complete_at: None,
            begun_at: None,
            own: None,
            ready: false,
            jitter: 1.0 + rand::rng().random::<f64>() / 2.0,
            checkpoints_written: 0,
            checkpoints_read: 0,
        }
    }

    /// A tombstone read (a cancel, or a checkpoint's copy): its `until` clamped to what a
    /// message can need, an id no message can have skipped, and a new live one beyond
    /// [`Limits::max_live`] too (loudly: the cap is far above what a deployment needs).
    pub(super) fn add(&mut self, key: Key, until_ms: u64, now: u64) {
        if key.id.is_empty() || key.id.len() > MAX_ID_BYTES {
            skipped(
                KIND,
                "insane",
                &format!("a tombstone of a {}-byte id", key.id.len()),
            );
            return;
        }
        let until_ms = until_ms.min(now.saturating_add(self.limits.ahead_ms));
        if until_ms > now {
            if self.tombstones.len() >= self.limits.max_live && !self.tombstones.contains_key(&key)
            {
                self.prune(now);
                if self.tombstones.len() >= self.limits.max_live {
                    let max = self.limits.max_live;
                    skipped(
                        KIND,
                        "tombstones_full",
                        &format!("already {max} live tombstones, the most a follower holds"),
                    );
                    return;
                }
            }
            // a checkpoint repeats every live tombstone: count a late cancel once, when it is new
            if !self.tombstones.contains_key(&key)
                && let Some(queue) = self.executed_set.get(&key.id)
            {
                let id = &key.id;
                tracing::warn!(%id, %queue, "a cancel arrived after the message ran: too late");
                crate::metrics::global()
                    .cancel_too_late
                    .get_or_create(&crate::metrics::Metrics::queue(queue))
                    .inc();
                self.too_late += 1;
            }
            let e = self.tombstones.entry(key).or_insert(until_ms);
            *e = (*e).max(until_ms);
        } else {
            self.keep_expired(key, until_ms.saturating_add(EXPIRED_KEPT_MS), now);
        }
    }

    pub(super) fn keep_expired(&mut self, id: Key, keep_until: u64, now: u64) {
        if keep_until <= now || self.tombstones.contains_key(&id) {
            return;
        }
        // a checkpoint repeats every expired tombstone: one entry in the order each, or trimming
        // an old duplicate would drop the id while the new one stays queued
        if self.expired.get(&id).is_some_and(|k| *k >= keep_until) {
            return;
        }
        let e = self.expired.entry(id.clone()).or_insert(keep_until);
        *e = (*e).max(keep_until);
        let keep_until = *e;
        self.expired_order.push_back((id, keep_until));
        self.trim_expired(now);
    }

    pub(super) fn trim_expired(&mut self, now: u64) {
        while let Some((_, keep)) = self.expired_order.front() {
            if self.expired_order.len() <= EXPIRED_KEPT && *keep > now {
                break;
            }
            if let Some((id, keep)) = self.expired_order.pop_front()
                && self.expired.get(&id) == Some(&keep)
            {
                self.expired.remove(&id);
            }
        }
    }

    /// Moves tombstones past their `until` to the expired ones.
    pub(super) fn prune(&mut self, now: u64) {
        let gone: Vec<(Key, u64)> = self
            .tombstones
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(id, until)| (id.clone(), *until))
            .collect();
        for (id, until) in gone {
            self.tombstones.remove(&id);
            self.keep_expired(id, until.saturating_add(EXPIRED_KEPT_MS), now);
        }
        self.rules.prune(now);
        self.trim_expired(now);
        self.last_prune = now;
    }

    /// Whether a message `id` owned by `owner` is cancelled: a tombstone of its owner's or of
    /// an admin's is held.
    pub(super) fn is_cancelled(&self, id: &str, owner: Option<&str>, now: u64) -> bool {
        owner
            .into_iter()
            .chain(self.trust.admins())
            .any(|by| self.holds(&(by, id), now))
    }

    fn holds(&self, key: &dyn KeyView, now: u64) -> bool {
        // a tombstone past its `until` counts as expired even before `prune` moves it
        self.tombstones
            .get(key)
            .is_some_and(|until| until.saturating_add(EXPIRED_KEPT_MS) > now)
            || self.expired.get(key).is_some_and(|keep| *keep > now)
    }

    /// Everything a checkpoint repeats: [`State::snapshot`], the purges and reschedules.
    pub(super) fn held(&self, now: u64) -> Held {
        let (purges, moves) = self.rules.snapshot(now);
        Held {
            items: self.snapshot(now),
            purges,
            moves,
        }
    }

    /// Every tombstone held, as checkpoint items: live ones with their `until`, expired ones
    /// with the `until` that keeps them as long again.
    pub(super) fn snapshot(&self, now: u64) -> Items {
        self.tombstones
            .iter()
            .filter(|(_, until)| until.saturating_add(EXPIRED_KEPT_MS) > now)
            .map(|(id, until)| (id.clone(), *until))
            .chain(
                self.expired
                    .iter()
                    .filter(|(_, keep)| **keep > now)
                    .map(|(id, keep)| (id.clone(), keep.saturating_sub(EXPIRED_KEPT_MS))),
            )
            .collect()
    }

    /// A new consumer starts reading: positions start again.
    pub(super) fn restart_positions(&mut self) {
        self.read = 0;
        self.open.clear();
        self.complete_at = None;
        self.begun_at = None;
    }

    /// A record read, written by `by`: applied as far as its writer may write it, or, when it
    /// did not decode (garbage or a newer version's kind) or its writer may not, a position
    /// all the same.
    pub(super) fn read_one(&mut self, r: Option<Record>, by: Option<&str>, now: u64) {
        self.read += 1;
        self.records += 1;
        let Some(r) = r else { return };
        if let Some((reason, why)) = insane(&r).or_else(|| self.untrusted(&r, by)) {
            skipped(KIND, reason, &why);
            return;
        }
        self.apply(r, by.unwrap_or_default(), now);
    }

    /// Why `by` may not write `r`, if it may not: a cancel needs a writer (it stops only its
    /// writer's messages), a checkpoint one who may stand for everyone ([`Trust::may_compact`]).
    fn untrusted(&self, r: &Record, by: Option<&str>) -> Option<(&'static str, String)> {
        let who = || by.unwrap_or("no user_id");
        match r {
            Record::Cancel { .. }
            | Record::Cancels { .. }
            | Record::Purge(_)
            | Record::Reschedule { .. }
                if by.is_none_or(str::is_empty) =>
            {
                Some((
                    "untrusted",
                    "a cancel, purge or reschedule without user_id".into(),
                ))
            }
            Record::CheckpointBegin { .. } | Record::Checkpoint { .. }
                if !self.trust.may_compact(by) =>
            {
                Some((
                    "untrusted",
                    format!("a checkpoint by '{}', no admin or peer", who()),
                ))
            }
            _ => None,
        }
    }

    fn apply(&mut self, r: Record, by: &str, now: u64) {
        match r {
            Record::Cancel { id, until_ms, .. } => self.add(Key::new(by, &id), until_ms, now),
            Record::Cancels { items } => {
                for (id, until_ms) in items {
                    self.add(Key::new(by, &id), until_ms, now);
                }
            }
            r @ (Record::Purge(_) | Record::Reschedule { .. }) => self.take_rule(r, by, now),
            Record::Barrier { nonce } => {
                if let Some(w) = self.waiting.remove(&nonce) {
                    let _ = w.send(());
                }
            }
            Record::CheckpointBegin { nonce } => self.begin_read(nonce, now),
            r @ Record::Checkpoint { .. } => self.take_part(r, now),
            Record::GatewayPair { .. }
            | Record::GatewayPairEnded { .. }
            | Record::BatchMarker { .. }
            | Record::RecurringAdd(_)
            | Record::RecurringSet(_)
            | Record::RecurringMark(_)
            | Record::RecurringMarks(_)
            | Record::RecurringKeep(_) => {}
        }
        if now.saturating_sub(self.last_prune) >= 1_000 {
            self.prune(now);
        }
    }

    /// A purge or a reschedule written by `by`, as far as `by` may steer ([`Rules`]).
    fn take_rule(&mut self, r: Record, by: &str, now: u64) {
        let (ahead, t) = (self.limits.ahead_ms, &self.trust);
        let taken = match r {
            Record::Purge(p) => self.rules.purge(p, by, t, now, ahead),
            Record::Reschedule { to, until_ms } => {
                self.rules.reschedule(by, to, until_ms, t, now, ahead)
            }
            _ => Ok(()),
        };
        if let Err(why) = taken {
            skipped(KIND, "rules_full", &why);
        }
    }

    /// A checkpoint's begin record read: its parts are awaited (and this follower's own
    /// checkpoint gets what it holds).
    fn begin_read(&mut self, nonce: String, now: u64) {
        self.begun_at = Some(self.read);
        if let Some((own, tx)) = &mut self.own
            && *own == nonce
            && let Some(tx) = tx.take()
        {
            let _ = tx.send(self.held(now));
        }
        // begins whose parts never came (a writer that failed): forget the oldest
        if self.open.len() >= 64 {
            let oldest = self
                .open
                .iter()
                .min_by_key(|(_, o)| o.begin)
                .map(|(n, _)| n.clone());
            if let Some(n) = oldest {
                self.open.remove(&n);
            }
        }
        self.open.insert(
            nonce,
            OpenCheckpoint {
                begin: self.read,
                parts: 0,
                got: HashSet::new(),
            },
        );
    }

    /// A checkpoint part read: its tombstones and rules held, and the checkpoint whole once
    /// every part came.
    fn take_part(&mut self, r: Record, now: u64) {
        let Record::Checkpoint {
            nonce,
            part,
            parts,
            items,
            by,
            purges,
            moves,
        } = r
        else {
            return;
        };
        // a part of a checkpoint written before cancels had writers names none: its
        // tombstones stop nothing (the checkpoint counts as a position all the same)
        if !by.is_empty() {
            for (id, until_ms) in items {
                self.add(Key::new(&by, &id), until_ms, now);
            }
        }
        // the rules a trusted follower held, each with its writer
        let mut refused = Vec::new();
        for p in purges {
            refused.extend(self.rules.hold_purge(p, &self.trust, now).err());
        }
        for m in moves {
            refused.extend(self.rules.hold_move(m, &self.trust, now).err());
        }
        for why in refused {
            skipped(KIND, "rules_full", &why);
        }
        // a checkpoint has at least one part, and its first part read says how many
        if parts > 0
            && let Some(open) = self.open.get_mut(&nonce)
            && (open.parts == 0 || open.parts == parts)
        {
            open.parts = parts;
            if part < parts {
                open.got.insert(part);
            }
            if open.got.len() as u64 >= u64::from(open.parts) {
                let begin = open.begin;
                self.open.remove(&nonce);
                self.complete_at = Some(begin);
                self.checkpoints_read += 1;
            }
        }
    }

    /// When this follower should write a checkpoint now: its nonce, and where the reader will
    /// hand over the tombstones when it reads the begin record back.
    pub(super) fn begin_checkpoint(
        &mut self,
        every: u64,
    ) -> Option<(String, oneshot::Receiver<Held>)> {
        if !self.wants_checkpoint(every) {
            return None;
        }
        let nonce = uuid::Uuid::now_v7().to_string();
        let (tx, rx) = oneshot::channel();
        self.own = Some((nonce.clone(), Some(tx)));
        Some((nonce, rx))
    }

    /// Whether this follower should write a checkpoint now.
    pub(super) fn wants_checkpoint(&self, every: u64) -> bool {
        if !self.ready || self.own.is_some() || self.broken.is_some() {
            return false;
        }
        let held = (self.tombstones.len() + self.expired.len()) as u64;
        let threshold = (every.max(held.saturating_mul(2)) as f64 * self.jitter) as u64;
        let since_complete = self.read - self.complete_at.unwrap_or(0);
        let since_begun = self.read - self.begun_at.unwrap_or(0);
        since_complete >= threshold && since_begun >= threshold / 2
    }
}

/// Why no writer of ours makes `r`, if none does: more tombstones than a record of ours holds
/// ([`MAX_ITEMS`]), a checkpoint of more parts than a follower can write ([`MAX_PARTS`]).
fn insane(r: &Record) -> Option<(&'static str, String)> {
    match r {
        Record::Cancels { items } | Record::Checkpoint { items, .. } if items.len() > MAX_ITEMS => {
            Some((
                "too_many_items",
                format!("{} tombstones, more than {MAX_ITEMS}", items.len()),
            ))
        }
        Record::Checkpoint { purges, moves, .. }
            if purges.len() > PURGES_PER_PART || moves.len() > MAX_ITEMS =>
        {
            Some((
                "too_many_items",
                format!(
                    "{} purges and {} reschedules in a checkpoint part, more than {PURGES_PER_PART} or {MAX_ITEMS}",
                    purges.len(),
                    moves.len()
                ),
            ))
        }
        Record::Purge(p) => p.check().err().map(|why| ("insane", why)),
        Record::Checkpoint { parts, .. } if *parts > MAX_PARTS => Some((
            "too_many_items",
            format!("a checkpoint of {parts} parts, more than {MAX_PARTS}"),
        )),
        _ => None,
    }
}

/// The state, also after a panic elsewhere held its lock.
pub(super) fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // a panic while holding the lock leaves a state that is still a valid map of tombstones
    state.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
