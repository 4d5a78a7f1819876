//! Purges and reschedules as a follower holds them, pure: which rule a message meets when it
//! falls due ([`Rules::steer`]), bounded whatever the stream holds.

use std::collections::{HashMap, HashSet};

use lapin::types::FieldTable;

use super::quota::{MOVES, PURGES, Pool, Rule};
#[cfg(test)]
use crate::control::PurgeScope;
use crate::control::{HeldPurge, MAX_ID_BYTES, Move, Purge, Reschedule};
use crate::trust::Trust;

/// Purges in one checkpoint part.
pub(crate) const PURGES_PER_PART: usize = 100;

/// What a message about to run is to do, by the rules held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steer {
    /// Run it.
    Run,
    /// Cancelled: ack it without running.
    Cancelled,
    /// A purge covers it: ack it without running.
    Purged,
    /// A reschedule moved it later: send it round the tiers again, due at this time.
    MoveTo(u64),
    /// A reschedule moved it earlier and its earlier copy ran (or runs): ack it without
    /// running.
    Superseded,
}

/// A message as the rules see it.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// Its message id.
    pub id: &'a str,
    /// Its owner ([`Trust::owner`]).
    pub owner: Option<&'a str>,
    /// The queue it was consumed from (its destination).
    pub queue: &'a str,
    /// When it is due, when it came through amqp-delay.
    pub due_at_ms: Option<u64>,
    /// The delay it was scheduled with.
    pub delay_ms: Option<u64>,
    /// 0 on its first run.
    pub attempt: u32,
    /// Its headers.
    pub headers: Option<&'a FieldTable>,
}

impl<'a> Subject<'a> {
    /// The subject of a delivery.
    pub fn of(d: &'a crate::envelope::Delivery) -> Subject<'a> {
        Subject {
            id: &d.message_id,
            owner: d.owner.as_deref(),
            queue: &d.queue,
            due_at_ms: d.due_at_ms,
            delay_ms: d.delay_ms,
            attempt: d.attempt,
            headers: d.headers(),
        }
    }

    /// When it was scheduled: its due time less its delay (a retry's: when it was retried).
    fn scheduled_at_ms(&self) -> Option<u64> {
        Some(self.due_at_ms?.saturating_sub(self.delay_ms?))
    }
}

/// The purges and reschedules held, each owner's within its share ([`super::quota`]).
#[derive(Debug)]
pub(super) struct Rules {
    /// By nonce.
    pub(super) purges: Pool<HeldPurge>,
    /// The purges' nonces by queue: a message meets only its queue's purges of everyone's
    /// messages and of its owner's, so no owner's purges slow the steering of another's.
    targets: HashMap<String, Target>,
    /// By (owner, id); `None`: an admin's reschedule of anyone's message.
    pub(super) moves: Pool<Move>,
}

/// The nonces of one queue's purges.
#[derive(Debug, Default)]
struct Target {
    everyone: HashSet<String>,
    owned: HashMap<String, HashSet<String>>,
}

impl Default for Rules {
    fn default() -> Rules {
        Rules {
            purges: Pool::new(PURGES),
            targets: HashMap::new(),
            moves: Pool::new(MOVES),
        }
    }
}

impl Rule for HeldPurge {
    type Key = String;
    fn key(&self) -> String {
        self.purge.nonce.clone()
    }
    fn by(&self) -> &str {
        &self.by
    }
    fn until_ms(&self) -> u64 {
        self.purge.until_ms
    }
}

impl Rule for Move {
    type Key = (Option<String>, String);
    fn key(&self) -> Self::Key {
        (self.owner.clone(), self.id.clone())
    }
    fn by(&self) -> &str {
        &self.by
    }
    fn until_ms(&self) -> u64 {
        self.until_ms
    }
}

impl Rules {
    /// Takes a purge written by `by`: its owner as `by` may name it. `Err` says why not.
    pub(super) fn purge(
        &mut self,
        mut p: Purge,
        by: &str,
        trust: &Trust,
        now: u64,
        ahead_ms: u64,
    ) -> Result<(), String> {
        if !trust.is_admin(by) {
            p.scope.owner = Some(by.to_string());
        }
        p.until_ms = p.until_ms.min(now.saturating_add(ahead_ms));
        let h = HeldPurge {
            by: by.to_string(),
            purge: p,
        };
        self.hold_purge(h, trust, now)
    }

    /// Holds `h` (a purge read, or a checkpoint's copy) unless it is over, held already, no
    /// writer's of ours, or beyond its writer's share.
    pub(super) fn hold_purge(
        &mut self,
        h: HeldPurge,
        trust: &Trust,
        now: u64,
    ) -> Result<(), String> {
        if h.purge.until_ms <= now || self.purges.contains(&h.purge.nonce) {
            return Ok(());
        }
        h.purge.check()?;
        let (queue, owner, nonce) = (
            h.purge.scope.queue.clone(),
            h.purge.scope.owner.clone(),
            h.key(),
        );
        let gone = self.purges.hold(h, trust, false, now)?;
        self.unindex(&gone);
        let t = self.targets.entry(queue).or_default();
        match owner {
            Some(o) => t.owned.entry(o).or_default().insert(nonce),
            None => t.everyone.insert(nonce),
        };
        Ok(())
    }

    fn unindex(&mut self, gone: &[HeldPurge]) {
        for h in gone {
            let p = &h.purge;
            let Some(t) = self.targets.get_mut(&p.scope.queue) else {
                continue;
            };
            match &p.scope.owner {
                Some(o) => {
                    if let Some(set) = t.owned.get_mut(o) {
                        set.remove(&p.nonce);
                        if set.is_empty() {
                            t.owned.remove(o);
                        }
                    }
                }
                None => {
                    t.everyone.remove(&p.nonce);
                }
            }
            if t.everyone.is_empty() && t.owned.is_empty() {
                self.targets.remove(&p.scope.queue);
            }
        }
    }

    /// Takes a reschedule written by `by` (its owner as `by` may name it), live until
    /// `until_ms`.
    pub(super) fn reschedule(
        &mut self,
        by: &str,
        to: Reschedule,
        until_ms: u64,
        trust: &Trust,
        now: u64,
        ahead_ms: u64,
    ) -> Result<(), String> {
        let Reschedule {
            id,
            owner,
            due_at_ms,
        } = to;
        let owner = if trust.is_admin(by) {
            owner
        } else {
            Some(by.to_string())
        };
        let m = Move {
            by: by.to_string(),
            owner,
            id,
            due_at_ms,
            until_ms: until_ms.min(now.saturating_add(ahead_ms)),
        };
        self.hold_move(m, trust, now)
    }

    /// Holds `m` (a reschedule read, or a checkpoint's copy); a later one of the same message
    /// replaces it.
    pub(super) fn hold_move(&mut self, m: Move, trust: &Trust, now: u64) -> Result<(), String> {
        if m.until_ms <= now || m.id.is_empty() || m.id.len() > MAX_ID_BYTES {
            return Ok(());
        }
        if m.by.len() > MAX_ID_BYTES || m.owner.as_ref().is_some_and(|o| o.len() > MAX_ID_BYTES) {
            return Err(format!("a reschedule naming a {}-byte user", m.by.len()));
        }
        self.moves.hold(m, trust, true, now).map(|_| ())
    }

    /// Whether `by` may write one more purge now (a tool asks before writing): `Err` says its
    /// quota, how many of its purges are live and when they are over.
    pub(super) fn may_purge(&self, by: &str, trust: &Trust) -> Result<(), String> {
        self.purges.may_add(by, trust, None)
    }

    /// Whether `by` may write a reschedule of its message `id` now (one replacing its own
    /// held reschedule of `id` always may).
    pub(super) fn may_reschedule(&self, by: &str, id: &str, trust: &Trust) -> Result<(), String> {
        let key = (Some(by.to_string()), id.to_string());
        self.moves.may_add(by, trust, Some(&key))
    }

    /// Forgets what is over.
    pub(super) fn prune(&mut self, now: u64) {
        let gone = self.purges.prune(now);
        self.unindex(&gone);
        self.moves.prune(now);
    }

    /// What `s` is to do, by the purges and reschedules held (cancels are checked before).
    pub(super) fn steer(&self, s: &Subject<'_>) -> Steer {
        if let Some(t) = self.targets.get(s.queue) {
            let owned = s.owner.and_then(|o| t.owned.get(o));
            let mut nonces = t.everyone.iter().chain(owned.into_iter().flatten());
            if nonces.any(|n| self.purges.get(n).is_some_and(|p| covers(&p.purge, s))) {
                return Steer::Purged;
            }
        }
        // a retry has its own due time: a reschedule moves only the first run
        let (0, Some(due)) = (s.attempt, s.due_at_ms) else {
            return Steer::Run;
        };
        // no reschedule held: nothing to look up (a worker asks for every message it runs)
        if self.moves.is_empty() {
            return Steer::Run;
        }
        let owned = s.owner.map(|o| (Some(o.to_string()), s.id.to_string()));
        let m = owned
            .and_then(|k| self.moves.get(&k))
            .or_else(|| self.moves.get(&(None, s.id.to_string())));
        match m {
            None => Steer::Run,
            Some(m) if m.due_at_ms == due => Steer::Run,
            Some(m) if m.due_at_ms > due => Steer::MoveTo(m.due_at_ms),
            Some(_) => Steer::Superseded,
        }
    }

    /// The rules as a checkpoint repeats them.
    pub(super) fn snapshot(&self, now: u64) -> (Vec<HeldPurge>, Vec<Move>) {
        (
            self.purges
                .values()
                .filter(|p| p.purge.until_ms > now)
                .cloned()
                .collect(),
            self.moves
                .values()
                .filter(|m| m.until_ms > now)
                .cloned()
                .collect(),
        )
    }
}

/// Whether purge `p` covers `s`.
fn covers(purge: &Purge, s: &Subject<'_>) -> bool {
    let p = &purge.scope;
    if p.queue != s.queue {
        return false;
    }
    if p.owner.as_deref().is_some_and(|o| Some(o) != s.owner) {
        return false;
    }
    let Some(scheduled) = s.scheduled_at_ms() else {
        return false;
    };
    if scheduled >= purge.scheduled_before_ms {
        return false;
    }
    let due = s.due_at_ms.unwrap_or_default();
    if p.due_after_ms.is_some_and(|a| due <= a) || p.due_before_ms.is_some_and(|b| due >= b) {
        return false;
    }
    match &p.header {
        None => true,
        Some((k, v)) => s
            .headers
            .and_then(|h| h.inner().get(k.as_str()))
            .and_then(crate::journal::header_text)
            .is_some_and(|t| t == *v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cancel::quota::tests::trust;
    use lapin::types::AMQPValue;

    fn mv(owner: Option<String>, id: String, due_at_ms: u64) -> Reschedule {
        Reschedule {
            id,
            owner,
            due_at_ms,
        }
    }

    fn purge(queue: &str) -> Purge {
        Purge {
            nonce: "n1".into(),
            scope: PurgeScope::queue(queue),
            scheduled_before_ms: 1_000,
            until_ms: 10_000,
        }
    }

    fn subject<'a>(owner: &'a str, due: u64, delay: u64, h: Option<&'a FieldTable>) -> Subject<'a> {
        Subject {
            id: "m",
            owner: Some(owner),
            queue: "q",
            due_at_ms: Some(due),
            delay_ms: Some(delay),
            attempt: 0,
            headers: h,
        }
    }

    #[test]
    fn a_users_purge_covers_only_its_own_messages_scheduled_before_it() {
        let mut r = Rules::default();
        let mut p = purge("q");
        p.scope.owner = Some("bob".into()); // not believed from alice
        r.purge(p, "alice", &trust(), 0, 1_000_000).unwrap();
        assert_eq!(
            r.steer(&subject("alice", 2_000, 1_500, None)),
            Steer::Purged
        );
        assert_eq!(r.steer(&subject("bob", 2_000, 1_500, None)), Steer::Run);
        // scheduled after the purge
        assert_eq!(r.steer(&subject("alice", 3_000, 1_000, None)), Steer::Run);
        let mut other = subject("alice", 2_000, 1_500, None);
        other.queue = "other";
        assert_eq!(r.steer(&other), Steer::Run);
    }

    #[test]
    fn an_admins_purge_filters_by_due_range_and_header() {
        let mut r = Rules::default();
        let mut p = purge("q");
        p.scope.due_after_ms = Some(1_500);
        p.scope.due_before_ms = Some(2_500);
        p.scope.header = Some(("tenant".into(), "x".into()));
        r.purge(p, "admin", &trust(), 0, 1_000_000).unwrap();
        let mut h = FieldTable::default();
        h.insert("tenant".into(), AMQPValue::LongString("x".into()));
        let mut y = FieldTable::default();
        y.insert("tenant".into(), AMQPValue::LongString("y".into()));
        assert_eq!(
            r.steer(&subject("bob", 2_000, 1_500, Some(&h))),
            Steer::Purged
        );
        assert_eq!(r.steer(&subject("bob", 2_000, 1_500, Some(&y))), Steer::Run);
        assert_eq!(r.steer(&subject("bob", 2_000, 1_500, None)), Steer::Run);
        assert_eq!(r.steer(&subject("bob", 2_600, 2_000, Some(&h))), Steer::Run);
        assert_eq!(r.steer(&subject("bob", 1_500, 1_000, Some(&h))), Steer::Run);
    }

    #[test]
    fn a_reschedule_moves_the_first_run_later_or_supersedes_the_old_copy() {
        let mut r = Rules::default();
        let t = trust();
        r.reschedule("alice", mv(None, "m".into(), 5_000), 9_000, &t, 0, 100_000)
            .unwrap();
        assert_eq!(
            r.steer(&subject("alice", 2_000, 100, None)),
            Steer::MoveTo(5_000)
        );
        assert_eq!(r.steer(&subject("alice", 5_000, 100, None)), Steer::Run);
        assert_eq!(
            r.steer(&subject("alice", 7_000, 100, None)),
            Steer::Superseded
        );
        // another owner's message of the same id is not alice's to move
        assert_eq!(r.steer(&subject("bob", 2_000, 100, None)), Steer::Run);
        // a retry runs when it is due
        let mut retry = subject("alice", 7_000, 100, None);
        retry.attempt = 1;
        assert_eq!(r.steer(&retry), Steer::Run);
        // an admin's reschedule of anyone's
        r.reschedule("admin", mv(None, "m".into(), 6_000), 9_000, &t, 0, 100_000)
            .unwrap();
        assert_eq!(
            r.steer(&subject("bob", 2_000, 100, None)),
            Steer::MoveTo(6_000)
        );
        r.prune(9_000);
        assert_eq!(r.steer(&subject("alice", 2_000, 100, None)), Steer::Run);
    }

    #[test]
    fn one_owners_flood_of_purges_leaves_anothers_purge_in_force() {
        let (mut r, t) = (Rules::default(), trust());
        // bob writes far more purges of his own than his quota, covering nothing of alice's
        let mut refused = 0;
        for i in 0..PURGES.per_owner + 900 {
            let mut p = purge("q");
            p.nonce = format!("b{i}");
            refused += usize::from(r.purge(p, "bob", &t, 0, 1_000_000).is_err());
        }
        assert_eq!((r.purges.len(), refused), (PURGES.per_owner, 900));
        let why = r.may_purge("bob", &t).unwrap_err();
        assert!(why.contains("its quota of 100"), "{why}");
        // alice's own purge is held, and stops her message
        assert_eq!(r.may_purge("alice", &t), Ok(()));
        let mut p = purge("q");
        p.nonce = "a".into();
        r.purge(p, "alice", &t, 0, 1_000_000).unwrap();
        assert_eq!(
            r.steer(&subject("alice", 2_000, 1_500, None)),
            Steer::Purged
        );
        // an admin's is never refused by a tool, and held beyond any user's quota
        for i in 0..PURGES.per_owner + 1 {
            assert_eq!(r.may_purge("admin", &t), Ok(()));
            let mut p = purge("other");
            p.nonce = format!("adm{i}");
            r.purge(p, "admin", &t, 0, 1_000_000).unwrap();
        }
        // all over: room again
        r.prune(10_000);
        assert_eq!((r.purges.len(), r.targets.len()), (0, 0));
    }

    #[test]
    fn reschedules_have_a_quota_per_owner_too() {
        let (mut r, t) = (Rules::default(), trust());
        for i in 0..MOVES.per_owner + 5 {
            let _ = r.reschedule("bob", mv(None, i.to_string(), 5), 9, &t, 0, 100);
        }
        assert_eq!(r.moves.len(), MOVES.per_owner);
        assert!(r.may_reschedule("bob", "new", &t).is_err());
        // moving one of his own again replaces it
        assert_eq!(r.may_reschedule("bob", "3", &t), Ok(()));
        r.reschedule("bob", mv(None, "3".into(), 7), 9, &t, 0, 100)
            .unwrap();
        r.reschedule("alice", mv(None, "m".into(), 5_000), 9_000, &t, 0, 100_000)
            .unwrap();
        assert_eq!(
            r.steer(&subject("alice", 2_000, 100, None)),
            Steer::MoveTo(5_000)
        );
    }

    #[test]
    fn a_purge_no_writer_of_ours_makes_is_not_held() {
        let (mut r, t) = (Rules::default(), trust());
        let mut p = purge("q");
        p.scope.header = Some((
            "k".into(),
            "v".repeat(crate::control::MAX_PURGE_HEADER_VALUE + 1),
        ));
        assert!(r.purge(p, "alice", &t, 0, 1_000_000).is_err());
        let mut p = purge("q");
        p.scope.owner = Some("o".repeat(256));
        assert!(r.purge(p, "admin", &t, 0, 1_000_000).is_err());
        assert_eq!(r.purges.len(), 0);
    }
}
