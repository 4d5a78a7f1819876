//! Each owner's share of the purges and reschedules a follower holds, pure. Every user who is
//! no admin has a quota of its own ([`Caps::per_owner`]), so that one owner's rules never
//! crowd out another's; the users' rules together stay under [`Caps::users`] (when that is
//! full, only the owners holding the most give way); the admins' share is apart
//! ([`Caps::admins`]): their rules are never refused by a tool, and a flood of theirs fills
//! only their own share. So whatever the stream holds, a follower's memory stays bounded.

use std::collections::HashMap;
use std::hash::Hash;

use crate::trust::Trust;

/// How many rules of one kind a follower holds, at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// What they are called in a refusal ("purges").
    pub(crate) noun: &'static str,
    /// Live rules of one owner who is no admin: its quota.
    pub(crate) per_owner: usize,
    /// Live rules of every owner who is no admin, together.
    pub(crate) users: usize,
    /// Live rules of the admins, together.
    pub(crate) admins: usize,
}

/// Purges: each is one command and covers any number of messages, so an owner needs few; one
/// lives as long as a message it covers can fall due (its `due_before`, or the longest delay,
/// plus `cancel.horizon`).
pub(crate) const PURGES: Caps = Caps {
    noun: "purges",
    per_owner: 100,
    users: 10_000,
    admins: 1_000,
};
/// Reschedules: one a message, live until the later of its old and new due time plus
/// `cancel.horizon`.
pub(crate) const MOVES: Caps = Caps {
    noun: "reschedules",
    per_owner: 10_000,
    users: 100_000,
    admins: 10_000,
};

/// Whose share a rule counts against: the admins' together, or its writer's.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Share {
    Admins,
    User(String),
}

impl Share {
    /// The share of a rule written by `by`.
    pub(super) fn of(by: &str, trust: &Trust) -> Share {
        if trust.is_admin(by) {
            Share::Admins
        } else {
            Share::User(by.to_string())
        }
    }
}

/// A rule as its pool keeps it.
pub(super) trait Rule {
    /// What a later rule replaces it by.
    type Key: Clone + Eq + Hash + Ord;
    fn key(&self) -> Self::Key;
    fn by(&self) -> &str;
    /// When it is forgotten (ms since the epoch).
    fn until_ms(&self) -> u64;
}

/// What a pool does with a new rule.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    Yes,
    /// Yes, once one rule of this owner (one of those holding the most) gave way.
    Evict(Share),
    No(String),
}

/// The rules of one kind, with how many each share holds.
#[derive(Debug)]
pub(super) struct Pool<R: Rule> {
    caps: Caps,
    rules: HashMap<R::Key, (Share, R)>,
    counts: HashMap<Share, usize>,
    users: usize,
    /// When what was over was last forgotten.
    pruned_at: u64,
}

impl<R: Rule> Pool<R> {
    pub(super) fn new(caps: Caps) -> Pool<R> {
        Pool {
            caps,
            rules: HashMap::new(),
            counts: HashMap::new(),
            users: 0,
            pruned_at: 0,
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether it holds no rule.
    pub(super) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub(super) fn get(&self, key: &R::Key) -> Option<&R> {
        self.rules.get(key).map(|(_, r)| r)
    }

    pub(super) fn contains(&self, key: &R::Key) -> bool {
        self.rules.contains_key(key)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &R> {
        self.rules.values().map(|(_, r)| r)
    }

    /// Live rules of `share`.
    pub(super) fn count(&self, share: &Share) -> usize {
        self.counts.get(share).copied().unwrap_or(0)
    }

    /// Holds `r`, replacing the rule of its key (`replace`) or, when one of its key is held,
    /// keeping that one. `Ok`: the rules that left (replaced, given way, or over at `now`);
    /// `Err`: why `r` was not held.
    pub(super) fn hold(
        &mut self,
        r: R,
        trust: &Trust,
        replace: bool,
        now: u64,
    ) -> Result<Vec<R>, String> {
        let key = r.key();
        let share = Share::of(r.by(), trust);
        let mut gone = Vec::new();
        match self.rules.get(&key) {
            Some(_) if !replace => return Ok(gone),
            // the same share's: its count stays
            Some((s, _)) if *s == share => {
                gone.extend(self.rules.insert(key, (share, r)).map(|(_, old)| old));
                return Ok(gone);
            }
            _ => {}
        }
        let mut admit = self.admit(&share);
        // what is over makes room: looked for at most once a second (a flood is refused fast)
        if admit != Admit::Yes && now.saturating_sub(self.pruned_at) >= 1_000 {
            gone.extend(self.prune(now));
            admit = self.admit(&share);
        }
        match admit {
            Admit::No(why) => return Err(why),
            Admit::Evict(victim) => gone.extend(self.evict(&victim)),
            Admit::Yes => {}
        }
        gone.extend(self.remove(&key));
        self.add(share.clone());
        self.rules.insert(key, (share, r));
        Ok(gone)
    }

    fn admit(&self, share: &Share) -> Admit {
        let (n, noun) = (self.count(share), self.caps.noun);
        match share {
            Share::Admins if n >= self.caps.admins => Admit::No(format!(
                "the admins already hold {n} live {noun}, the most a follower holds for them"
            )),
            Share::Admins => Admit::Yes,
            Share::User(u) if n >= self.caps.per_owner => Admit::No(format!(
                "'{u}' already holds {n} live {noun}, its quota (the most a follower holds for \
                 one owner)"
            )),
            Share::User(_) if self.users < self.caps.users => Admit::Yes,
            Share::User(u) => match self.most() {
                Some((top, most)) if most > n + 1 => Admit::Evict(top),
                _ => Admit::No(format!(
                    "the owners together hold {} live {noun}, the most a follower holds, and \
                     '{u}' holds as many as any ({n})",
                    self.users
                )),
            },
        }
    }

    /// The owner who is no admin holding the most rules (the first by name among equals), and
    /// how many.
    fn most(&self) -> Option<(Share, usize)> {
        self.counts
            .iter()
            .filter(|(s, _)| matches!(s, Share::User(_)))
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(s, n)| (s.clone(), *n))
    }

    /// Drops the rule of `share` that is over soonest (the first by key among equals).
    fn evict(&mut self, share: &Share) -> Option<R> {
        let key = self
            .rules
            .iter()
            .filter(|(_, (s, _))| s == share)
            .min_by(|a, b| (a.1.1.until_ms(), a.0).cmp(&(b.1.1.until_ms(), b.0)))
            .map(|(k, _)| k.clone())?;
        let r = self.remove(&key);
        if let Some(r) = &r {
            crate::stream_log::skipped(
                super::KIND,
                "rules_full",
                &format!(
                    "one of the {} of '{}', held until now: the owners together hold {}, the \
                     most a follower holds, and '{}' holds the most, so it gives way to another \
                     owner's",
                    self.caps.noun,
                    r.by(),
                    self.caps.users,
                    r.by()
                ),
            );
        }
        r
    }

    fn add(&mut self, share: Share) {
        if matches!(share, Share::User(_)) {
            self.users += 1;
        }
        *self.counts.entry(share).or_insert(0) += 1;
    }

    /// Forgets the rule of `key`, if held.
    pub(super) fn remove(&mut self, key: &R::Key) -> Option<R> {
        let (share, r) = self.rules.remove(key)?;
        if matches!(share, Share::User(_)) {
            self.users -= 1;
        }
        if let Some(n) = self.counts.get_mut(&share) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&share);
            }
        }
        Some(r)
    }

    /// Forgets what is over at `now`; what left.
    pub(super) fn prune(&mut self, now: u64) -> Vec<R> {
        self.pruned_at = now;
        let over: Vec<R::Key> = self
            .rules
            .iter()
            .filter(|(_, (_, r))| r.until_ms() <= now)
            .map(|(k, _)| k.clone())
            .collect();
        over.iter().filter_map(|k| self.remove(k)).collect()
    }

    /// Whether `by` may write one more rule now, as a tool asks before writing: `Err` says
    /// the quota, how many of `by`'s are live and when they are over. An admin's never
    /// exceeds one; nor does a rule replacing one of `by`'s held (`replacing`).
    pub(super) fn may_add(
        &self,
        by: &str,
        trust: &Trust,
        replacing: Option<&R::Key>,
    ) -> Result<(), String> {
        let share = Share::of(by, trust);
        let n = self.count(&share);
        let replaces = replacing
            .and_then(|k| self.rules.get(k))
            .is_some_and(|(s, _)| *s == share);
        if share == Share::Admins || n < self.caps.per_owner || replaces {
            return Ok(());
        }
        let untils = self
            .rules
            .values()
            .filter(|(s, _)| *s == share)
            .map(|(_, r)| r.until_ms());
        let (first, last) = untils.fold((u64::MAX, 0), |(f, l), u| (f.min(u), l.max(u)));
        Err(format!(
            "'{by}' already has {n} live {noun}, its quota of {quota}: a {one} lives until no \
             message it covers can fall due; the first of these is over at {first}, the last \
             at {last}",
            noun = self.caps.noun,
            quota = self.caps.per_owner,
            one = self.caps.noun.trim_end_matches('s'),
            first = rfc3339(first),
            last = rfc3339(last),
        ))
    }
}

fn rfc3339(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.min(i64::MAX as u64));
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::settings::TrustSettings;

    #[derive(Debug, Clone, PartialEq)]
    struct R(&'static str, u32, u64);

    impl Rule for R {
        type Key = u32;
        fn key(&self) -> u32 {
            self.1
        }
        fn by(&self) -> &str {
            self.0
        }
        fn until_ms(&self) -> u64 {
            self.2
        }
    }

    const CAPS: Caps = Caps {
        noun: "purges",
        per_owner: 3,
        users: 6,
        admins: 2,
    };

    /// A worker's trust, with one admin, `admin`.
    pub(in crate::ops::cancel) fn trust() -> Trust {
        Trust::new(
            Some("worker".into()),
            &TrustSettings {
                admins: vec!["admin".into()],
                peers: vec![],
                ..Default::default()
            },
        )
    }

    fn user(u: &str) -> Share {
        Share::User(u.into())
    }

    #[test]
    fn an_owner_at_its_quota_crowds_out_no_one_else() {
        let (t, mut p) = (trust(), Pool::new(CAPS));
        for k in 0..10 {
            let _ = p.hold(R("b", k, 100), &t, false, 0);
        }
        assert_eq!(p.count(&user("b")), 3);
        let why = p.hold(R("b", 99, 100), &t, false, 0).unwrap_err();
        assert!(
            why.contains("'b' already holds 3 live purges, its quota"),
            "{why}"
        );
        assert_eq!(p.hold(R("a", 100, 100), &t, false, 0), Ok(vec![]));
        // the tool asks before writing: b is refused with when its purges are over, a is not
        let why = p.may_add("b", &t, None).unwrap_err();
        assert!(
            why.contains("already has 3 live purges, its quota of 3")
                && why.contains("over at 1970-01-01T00:00:00Z"),
            "{why}"
        );
        assert_eq!(p.may_add("a", &t, None), Ok(()));
        assert_eq!(p.may_add("b", &t, Some(&1)), Ok(()), "replaces its own");
        // what is over makes room again
        p.prune(100);
        assert_eq!((p.len(), p.count(&user("b"))), (0, 0));
        assert_eq!(p.may_add("b", &t, None), Ok(()));
    }

    #[test]
    fn at_the_total_only_the_owners_holding_the_most_give_way() {
        let (t, mut p) = (trust(), Pool::new(CAPS));
        for (by, k) in [("b", 0), ("b", 1), ("b", 2), ("c", 3), ("c", 4), ("c", 5)] {
            p.hold(R(by, k, 100 + u64::from(k)), &t, false, 0).unwrap();
        }
        // full: a newcomer takes the place of the soonest over of the first of those holding most
        let gone = p.hold(R("a", 6, 500), &t, false, 0).unwrap();
        assert_eq!(gone, vec![R("b", 0, 100)]);
        let gone = p.hold(R("a", 7, 500), &t, false, 0).unwrap();
        assert_eq!(gone, vec![R("c", 3, 103)]);
        assert_eq!(p.len(), CAPS.users);
        // now each holds 2: as many as any, so a is refused, not b or c
        let why = p.hold(R("a", 8, 500), &t, false, 0).unwrap_err();
        assert!(why.contains("holds as many as any (2)"), "{why}");
        assert_eq!((p.count(&user("b")), p.count(&user("c"))), (2, 2));
    }

    #[test]
    fn admins_are_never_refused_by_a_tool_and_fill_only_their_own_share() {
        let (t, mut p) = (trust(), Pool::new(CAPS));
        for k in 0..5 {
            let _ = p.hold(R("admin", k, 100), &t, false, 0);
            assert_eq!(p.may_add("admin", &t, None), Ok(()));
        }
        assert_eq!(p.count(&Share::Admins), CAPS.admins);
        for k in 10..13 {
            p.hold(R("a", k, 100), &t, false, 0).unwrap();
        }
        assert_eq!(p.len(), CAPS.admins + 3);
    }

    #[test]
    fn a_replacement_moves_the_rule_between_shares() {
        let (t, mut p) = (trust(), Pool::new(CAPS));
        p.hold(R("a", 1, 100), &t, true, 0).unwrap();
        assert_eq!(
            p.hold(R("a", 1, 200), &t, true, 0),
            Ok(vec![R("a", 1, 100)])
        );
        assert_eq!(p.hold(R("a", 1, 300), &t, false, 0), Ok(vec![]), "kept");
        assert_eq!(p.get(&1), Some(&R("a", 1, 200)));
        p.hold(R("admin", 1, 400), &t, true, 0).unwrap();
        assert_eq!((p.count(&user("a")), p.count(&Share::Admins)), (0, 1));
        assert_eq!(p.remove(&1), Some(R("admin", 1, 400)));
        assert!(p.counts.is_empty() && p.users == 0);
    }
}
