//! The schedules a control stream's records make, pure: the fold of [`Add`], [`Set`] (pause,
//! resume, remove), [`Mark`] and [`Keep`] records in stream order, each believed as far as its
//! writer's broker-checked `user_id` allows ([`crate::trust`]):
//!
//! * an **add** is its writer's schedule (its owner is the writer, never a field); a new add
//!   of the same name replaces it, with a new `rev`;
//! * a **pause, resume or remove** acts on its writer's schedule, or, written by an admin, on
//!   `owner`'s;
//! * a **mark** (every tick up to `through_ms` published) and a **keep** (a schedule restated
//!   before the stream's `x-max-age` drops its add) count only from the schedule's owner (whose
//!   `recurring serve` publishes its occurrences) or a scheduler of the topology: this
//!   process's user, a peer or an admin ([`Trust::may_compact`]). A keep never brings back a
//!   revision that was removed or replaced, and never overrides what the records before it
//!   said.
//!
//! Anything else is skipped with a reason. Each user who is no admin has a book of its own
//! within the book, of at most `trust.max_schedules_per_user` ([`MAX_PER_OWNER`] by default),
//! and the admins share one of [`MAX_SCHEDULES`]: what one tenant writes never takes room
//! another's adds need, so the book holds at most users × the per-user cap plus the admins'.
//! A book of one owner (what its `recurring serve` keeps) holds only that
//! owner's schedules; the rest are not its to keep.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque, btree_map};

use serde::{Deserialize, Serialize};

use super::{Definition, check_name};
use crate::trust::Trust;

/// Schedules the admins own together, at most.
pub const MAX_SCHEDULES: usize = crate::settings::MAX_SCHEDULES;
/// Schedules of one owner who is no admin, at most, by default
/// (`trust.max_schedules_per_user`, [`Trust::max_schedules_per_user`]).
pub const MAX_PER_OWNER: usize = crate::settings::DEFAULT_MAX_SCHEDULES_PER_USER;
/// The longest owner or revision in a record.
const MAX_TAG_BYTES: usize = 255;

/// A schedule is added, or replaced when its writer has one of that name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Add {
    /// Unique per add: marks and keeps name the revision they are about.
    pub rev: String,
    /// When it was written (ms since the epoch): no tick before it runs.
    pub at_ms: u64,
    /// The definition.
    pub schedule: Definition,
}

/// What a [`Set`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// No more occurrences until resumed (those published stay).
    Pause,
    /// Occurrences again, from the next tick after the resume on.
    Resume,
    /// Gone (those published stay: a purge of its queue's `x-delay-recurring` removes them).
    Remove,
}

/// A pause, resume or remove of a schedule.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Set {
    /// The schedule's name.
    pub name: String,
    /// Whose schedule (an admin's record only; others act on their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// What it does.
    pub action: Action,
    /// When it was written.
    pub at_ms: u64,
}

/// A scheduler published every occurrence of `owner`'s schedule `name` (revision `rev`) up to
/// `through_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mark {
    /// Whose schedule.
    pub owner: String,
    /// Its name.
    pub name: String,
    /// Its revision.
    pub rev: String,
    /// Every tick up to here is published (ms since the epoch).
    pub through_ms: u64,
}

/// A scheduler published every occurrence of each of `owner`'s schedules it names (by
/// revision) up to its group's `through_ms`: the marks of one round, in one record, so that
/// a thousand ticks a second make one record a second, not a thousand.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Marks {
    /// Whose schedules.
    pub owner: String,
    /// The revisions marked, by how far.
    pub groups: Vec<MarkGroup>,
}

/// Revisions marked through the same time.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MarkGroup {
    /// Every tick up to here is published (ms since the epoch).
    pub through_ms: u64,
    /// The revisions.
    pub revs: Vec<String>,
}

impl Marks {
    /// `marks` of `owner`'s schedules (revision, through) as records of at most about
    /// `max_bytes` of revisions each (a record of one revision when that one is longer),
    /// grouped by how far they are marked.
    pub fn of(owner: &str, marks: &[(String, u64)], max_bytes: usize) -> Vec<Marks> {
        let mut sorted: Vec<&(String, u64)> = marks.iter().collect();
        sorted.sort_by_key(|(_, t)| *t);
        let mut out: Vec<Marks> = Vec::new();
        let mut bytes = usize::MAX;
        for (rev, through_ms) in sorted {
            // a revision costs its bytes, quotes and a comma; a group its number and keys
            let cost = rev.len() + 3;
            if bytes.saturating_add(cost + 40) > max_bytes {
                out.push(Marks {
                    owner: owner.to_string(),
                    groups: Vec::new(),
                });
                bytes = 0;
            }
            let Some(m) = out.last_mut() else { continue };
            match m.groups.last_mut() {
                Some(g) if g.through_ms == *through_ms => {
                    g.revs.push(rev.clone());
                    bytes += cost;
                }
                _ => {
                    m.groups.push(MarkGroup {
                        through_ms: *through_ms,
                        revs: vec![rev.clone()],
                    });
                    bytes += cost + 40;
                }
            }
        }
        out
    }
}

/// A scheduler restates a live schedule as of this record, so that it outlives its add.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Keep {
    /// Whose schedule.
    pub owner: String,
    /// Its revision.
    pub rev: String,
    /// No tick before runs (its add, or its last resume).
    pub since_ms: u64,
    /// Whether it is paused.
    #[serde(default)]
    pub paused: bool,
    /// Its latest mark.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through_ms: Option<u64>,
    /// The definition.
    pub schedule: Definition,
}

/// A schedule as the book holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its owner: the user who added it.
    pub owner: String,
    /// Its revision.
    pub rev: String,
    /// The definition.
    pub def: Definition,
    /// Whether it is paused.
    pub paused: bool,
    /// No tick before runs: when it was added, or last resumed.
    pub since_ms: u64,
    /// A scheduler's latest mark.
    pub through_ms: Option<u64>,
}

impl Entry {
    /// Every tick up to here is dealt with: its mark, or when it was added or resumed.
    pub fn done_ms(&self) -> u64 {
        self.through_ms.unwrap_or(0).max(self.since_ms)
    }

    /// This entry as a [`Keep`] record.
    pub fn keep(&self) -> Keep {
        Keep {
            owner: self.owner.clone(),
            rev: self.rev.clone(),
            since_ms: self.since_ms,
            paused: self.paused,
            through_ms: self.through_ms,
            schedule: self.def.clone(),
        }
    }
}

/// The schedules of a control stream.
#[derive(Debug, Default)]
pub struct Book {
    /// By owner and name.
    entries: BTreeMap<(String, String), Entry>,
    /// Schedules of each owner.
    per_owner: HashMap<String, usize>,
    /// Schedules the admins own.
    admins_own: usize,
    /// The name of each owner's revision held ([`Marks`] name revisions).
    revs: HashMap<(String, String), String>,
    /// Each owner's revisions removed or replaced, newest last, as many as it may hold: no
    /// keep brings them back, and no other owner's churn pushes them out.
    gone: HashMap<String, Gone>,
    /// The only owner whose schedules this book keeps ([`Book::of_owner`]).
    only: Option<String>,
}

/// One owner's revisions removed or replaced.
#[derive(Debug, Default)]
struct Gone {
    set: HashSet<String>,
    order: VecDeque<String>,
}

impl Book {
    /// A book of `owner`'s schedules only: records about anyone else's are not applied (and
    /// take none of its room or time).
    pub(crate) fn of_owner(owner: &str) -> Book {
        Book {
            only: Some(owner.to_string()),
            ..Book::default()
        }
    }

    /// Whether this book keeps `owner`'s schedules (every owner's, unless it is
    /// [`Book::of_owner`] another).
    pub(crate) fn keeps(&self, owner: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == owner)
    }

    /// Applies an add written by `by`.
    pub fn add(&mut self, by: Option<&str>, a: &Add, trust: &Trust) -> Result<(), String> {
        let owner = writer(by)?;
        if !self.keeps(owner) {
            return Ok(());
        }
        a.schedule.check()?;
        tag("revision", &a.rev)?;
        self.put(owner, &a.rev, a.schedule.clone(), trust)?;
        if let Some(e) = self
            .entries
            .get_mut(&(owner.to_string(), a.schedule.name.clone()))
        {
            e.since_ms = a.at_ms;
        }
        Ok(())
    }

    /// Applies a pause, resume or remove written by `by`.
    pub fn set(&mut self, by: Option<&str>, s: &Set, trust: &Trust) -> Result<(), String> {
        let by = writer(by)?;
        check_set(s)?;
        let owner = match &s.owner {
            Some(o) if trust.is_admin(by) => o.as_str(),
            _ => by,
        };
        if !self.keeps(owner) {
            return Ok(());
        }
        let key = (owner.to_string(), s.name.clone());
        let Some(e) = self.entries.get_mut(&key) else {
            return Err(format!("{owner} has no schedule {:?}", s.name));
        };
        match s.action {
            Action::Pause => e.paused = true,
            Action::Resume if e.paused => {
                e.paused = false;
                // the ticks while paused are none to run
                e.since_ms = e.since_ms.max(s.at_ms);
            }
            Action::Resume => {}
            Action::Remove => {
                let rev = e.rev.clone();
                self.entries.remove(&key);
                self.forget(owner, &s.name, rev, trust);
            }
        }
        Ok(())
    }

    /// Applies a scheduler's mark written by `by`.
    pub fn mark(&mut self, by: Option<&str>, m: &Mark, trust: &Trust) -> Result<(), String> {
        scheduler(by, &m.owner, trust)?;
        if !self.keeps(&m.owner) {
            return Ok(());
        }
        let key = (m.owner.clone(), m.name.clone());
        match self.entries.get_mut(&key) {
            Some(e) if e.rev == m.rev => {
                e.through_ms = e.through_ms.max(Some(m.through_ms));
                Ok(())
            }
            _ => Err(format!(
                "no revision {} of {}'s {:?}",
                m.rev, m.owner, m.name
            )),
        }
    }

    /// Applies a scheduler's marks written by `by`; an error counts the revisions it does not
    /// hold (removed or replaced since: the rest are applied).
    pub fn marks(&mut self, by: Option<&str>, m: &Marks, trust: &Trust) -> Result<(), String> {
        scheduler(by, &m.owner, trust)?;
        if !self.keeps(&m.owner) {
            return Ok(());
        }
        let mut unknown = 0usize;
        for g in &m.groups {
            for rev in &g.revs {
                let key = (m.owner.clone(), rev.clone());
                let entry = self
                    .revs
                    .get(&key)
                    .and_then(|name| self.entries.get_mut(&(m.owner.clone(), name.clone())))
                    .filter(|e| e.rev == *rev);
                match entry {
                    Some(e) => e.through_ms = e.through_ms.max(Some(g.through_ms)),
                    None => unknown += 1,
                }
            }
        }
        if unknown > 0 {
            return Err(format!(
                "{unknown} revisions of {}'s marked that the book does not hold",
                m.owner
            ));
        }
        Ok(())
    }

    /// Applies a scheduler's keep written by `by`: a schedule whose add the stream no longer
    /// holds comes back as it says; one the book holds takes only its mark.
    pub fn keep(&mut self, by: Option<&str>, k: &Keep, trust: &Trust) -> Result<(), String> {
        scheduler(by, &k.owner, trust)?;
        tag("owner", &k.owner)?;
        tag("revision", &k.rev)?;
        if !self.keeps(&k.owner) {
            return Ok(());
        }
        k.schedule.check()?;
        if self
            .gone
            .get(&k.owner)
            .is_some_and(|g| g.set.contains(&k.rev))
        {
            return Err(format!("revision {} was removed or replaced", k.rev));
        }
        let key = (k.owner.clone(), k.schedule.name.clone());
        if let Some(e) = self.entries.get_mut(&key) {
            if e.rev != k.rev {
                return Err(format!("revision {} is not {}'s", k.rev, e.rev));
            }
            e.through_ms = e.through_ms.max(k.through_ms);
            return Ok(());
        }
        let e = self.put(&k.owner, &k.rev, k.schedule.clone(), trust)?;
        e.since_ms = k.since_ms;
        e.paused = k.paused;
        e.through_ms = k.through_ms;
        Ok(())
    }

    /// `owner`'s schedule `name`.
    pub fn get(&self, owner: &str, name: &str) -> Option<&Entry> {
        self.entries.get(&(owner.to_string(), name.to_string()))
    }

    /// Every schedule, by owner and name.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// The schedules `user` may see and steer: its own, or every one for an admin.
    pub fn visible_to<'a>(
        &'a self,
        user: &'a str,
        trust: &'a Trust,
    ) -> impl Iterator<Item = &'a Entry> + 'a {
        let all = trust.is_admin(user);
        self.iter().filter(move |e| all || e.owner == user)
    }

    /// A page of the schedules `user` may see ([`Book::visible_to`]) in (owner, name) order: at
    /// most `limit` after the (owner, name) `after`, and whether more follow. A user who is no
    /// admin walks only its own.
    pub fn page<'a>(
        &'a self,
        user: &'a str,
        trust: &Trust,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> (Vec<&'a Entry>, bool) {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let after = after.map(|(o, n)| (o.to_string(), n.to_string()));
        let mut walk: Box<dyn Iterator<Item = &'a Entry> + 'a> = if trust.is_admin(user) {
            let from = after.map_or(Unbounded, Excluded);
            Box::new(self.entries.range((from, Unbounded)).map(|(_, e)| e))
        } else {
            let first = (user.to_string(), String::new());
            let from = match after {
                Some(k) if k >= first => Excluded(k),
                _ => Included(first),
            };
            Box::new(
                (self.entries.range((from, Unbounded)))
                    .take_while(move |(k, _)| k.0 == user)
                    .map(|(_, e)| e),
            )
        };
        let page: Vec<&Entry> = walk.by_ref().take(limit).collect();
        let more = walk.next().is_some();
        (page, more)
    }

    /// How many schedules it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether an add of `owner`'s schedule `name` would be kept: it replaces one of that name,
    /// or the owner is under its cap (an admin: the admins under theirs). The error says which
    /// cap.
    pub fn admits(&self, owner: &str, name: &str, trust: &Trust) -> Result<(), String> {
        if self
            .entries
            .contains_key(&(owner.to_string(), name.to_string()))
        {
            return Ok(());
        }
        if trust.is_admin(owner) {
            if self.admins_own >= MAX_SCHEDULES {
                return Err(format!(
                    "the admins have {MAX_SCHEDULES} schedules, the most they may"
                ));
            }
            return Ok(());
        }
        let mine = self.per_owner.get(owner).copied().unwrap_or(0);
        let cap = trust.max_schedules_per_user();
        if mine >= cap {
            return Err(format!(
                "{owner} has {cap} schedules, the most a user may \
                 (trust.max_schedules_per_user)"
            ));
        }
        Ok(())
    }

    /// Puts revision `rev` of `owner`'s `def`, replacing one of the same name (unpaused, not
    /// marked), within the caps.
    fn put(
        &mut self,
        owner: &str,
        rev: &str,
        def: Definition,
        trust: &Trust,
    ) -> Result<&mut Entry, String> {
        self.admits(owner, &def.name, trust)?;
        let key = (owner.to_string(), def.name.clone());
        if let Some(old) = self.entries.get(&key) {
            let old = old.rev.clone();
            self.forget(owner, &def.name, old, trust);
        }
        *self.per_owner.entry(owner.to_string()).or_default() += 1;
        if trust.is_admin(owner) {
            self.admins_own += 1;
        }
        self.revs
            .insert((owner.to_string(), rev.to_string()), def.name.clone());
        let entry = Entry {
            owner: owner.to_string(),
            rev: rev.to_string(),
            def,
            paused: false,
            since_ms: 0,
            through_ms: None,
        };
        Ok(match self.entries.entry(key) {
            btree_map::Entry::Vacant(v) => v.insert(entry),
            btree_map::Entry::Occupied(mut o) => {
                o.insert(entry);
                o.into_mut()
            }
        })
    }

    /// Revision `rev` of `owner`'s schedule `name` is gone (removed, or about to be replaced).
    fn forget(&mut self, owner: &str, name: &str, rev: String, trust: &Trust) {
        let key = (owner.to_string(), rev.clone());
        if self.revs.get(&key).is_some_and(|n| n == name) {
            self.revs.remove(&key);
        }
        if let Some(n) = self.per_owner.get_mut(owner) {
            *n -= 1;
            if *n == 0 {
                self.per_owner.remove(owner);
            }
        }
        let admin = trust.is_admin(owner);
        if admin {
            self.admins_own = self.admins_own.saturating_sub(1);
        }
        let most = if admin {
            MAX_SCHEDULES
        } else {
            trust.max_schedules_per_user()
        };
        let gone = self.gone.entry(owner.to_string()).or_default();
        if gone.order.len() >= most
            && let Some(old) = gone.order.pop_front()
        {
            gone.set.remove(&old);
        }
        if gone.set.insert(rev.clone()) {
            gone.order.push_back(rev);
        }
    }
}

/// The writer of a record, which must have one.
fn writer(by: Option<&str>) -> Result<&str, String> {
    match by {
        Some(u) if !u.is_empty() && u.len() <= MAX_TAG_BYTES => Ok(u),
        _ => Err("a record without a user_id steers no schedule".into()),
    }
}

/// Whether `by` writes marks and keeps of `owner`'s schedules: `owner` itself, or a scheduler.
fn scheduler(by: Option<&str>, owner: &str, trust: &Trust) -> Result<(), String> {
    if by == Some(owner) || trust.may_compact(by) {
        Ok(())
    } else {
        let by = by.unwrap_or("no user_id");
        Err(format!(
            "a mark or keep of {owner}'s by '{by}', no scheduler of this topology"
        ))
    }
}

fn tag(what: &str, s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > MAX_TAG_BYTES {
        return Err(format!("a {what} of {} bytes", s.len()));
    }
    Ok(())
}

/// Whether a [`Set`] names a schedule as a writer of ours would.
fn check_set(s: &Set) -> Result<(), String> {
    check_name(&s.name)?;
    s.owner.as_deref().map_or(Ok(()), |o| tag("owner", o))
}

#[cfg(test)]
mod tests;
