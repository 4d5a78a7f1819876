//! Purges and reschedules as a follower holds them, pure: which rule a message meets when it
//! falls due ([`Rules::steer`]), bounded whatever the stream holds.

use std::collections::HashMap;

use lapin::types::FieldTable;

use crate::control::{HeldPurge, MAX_ID_BYTES, Move, Purge};
use crate::trust::Trust;

/// Purges a follower holds, at most: each is one operator's command, live until the messages
/// it covers can no longer fall due; a stream flooded with more is forged.
pub(crate) const MAX_PURGES: usize = 1_000;
/// Reschedules a follower holds, at most.
pub(crate) const MAX_MOVES: usize = 100_000;
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

/// The purges and reschedules held.
#[derive(Debug, Default)]
pub(super) struct Rules {
    /// By nonce.
    pub(super) purges: HashMap<String, HeldPurge>,
    /// By (owner, id); `None`: an admin's reschedule of anyone's message.
    pub(super) moves: HashMap<(Option<String>, String), Move>,
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
            p.owner = Some(by.to_string());
        }
        p.until_ms = p.until_ms.min(now.saturating_add(ahead_ms));
        self.hold_purge(
            HeldPurge {
                by: by.to_string(),
                purge: p,
            },
            now,
        )
    }

    /// Holds `h` (a purge read, or a checkpoint's copy) unless it is over or full.
    pub(super) fn hold_purge(&mut self, h: HeldPurge, now: u64) -> Result<(), String> {
        if h.purge.until_ms <= now || self.purges.contains_key(&h.purge.nonce) {
            return Ok(());
        }
        if self.purges.len() >= MAX_PURGES {
            self.prune(now);
            if self.purges.len() >= MAX_PURGES {
                return Err(format!(
                    "already {MAX_PURGES} live purges, the most a follower holds"
                ));
            }
        }
        self.purges.insert(h.purge.nonce.clone(), h);
        Ok(())
    }

    /// Takes a reschedule written by `by` of `owner`'s message `id`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reschedule(
        &mut self,
        by: &str,
        owner: Option<String>,
        id: String,
        due_at_ms: u64,
        until_ms: u64,
        trust: &Trust,
        now: u64,
        ahead_ms: u64,
    ) -> Result<(), String> {
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
        self.hold_move(m, now)
    }

    /// Holds `m` (a reschedule read, or a checkpoint's copy); a later one of the same message
    /// replaces it.
    pub(super) fn hold_move(&mut self, m: Move, now: u64) -> Result<(), String> {
        if m.until_ms <= now || m.id.is_empty() || m.id.len() > MAX_ID_BYTES {
            return Ok(());
        }
        let key = (m.owner.clone(), m.id.clone());
        if self.moves.len() >= MAX_MOVES && !self.moves.contains_key(&key) {
            self.prune(now);
            if self.moves.len() >= MAX_MOVES {
                return Err(format!(
                    "already {MAX_MOVES} live reschedules, the most a follower holds"
                ));
            }
        }
        self.moves.insert(key, m);
        Ok(())
    }

    /// Forgets what is over.
    pub(super) fn prune(&mut self, now: u64) {
        self.purges.retain(|_, p| p.purge.until_ms > now);
        self.moves.retain(|_, m| m.until_ms > now);
    }

    /// What `s` is to do, by the purges and reschedules held (cancels are checked before).
    pub(super) fn steer(&self, s: &Subject<'_>) -> Steer {
        if self.purges.values().any(|p| covers(&p.purge, s)) {
            return Steer::Purged;
        }
        // a retry has its own due time: a reschedule moves only the first run
        let (0, Some(due)) = (s.attempt, s.due_at_ms) else {
            return Steer::Run;
        };
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
fn covers(p: &Purge, s: &Subject<'_>) -> bool {
    if p.queue != s.queue {
        return false;
    }
    if p.owner.as_deref().is_some_and(|o| Some(o) != s.owner) {
        return false;
    }
    let Some(scheduled) = s.scheduled_at_ms() else {
        return false;
    };
    if scheduled >= p.scheduled_before_ms {
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
    use crate::settings::TrustSettings;
    use lapin::types::AMQPValue;

    fn trust() -> Trust {
        Trust::new(
            Some("worker".into()),
            &TrustSettings {
                admins: vec!["admin".into()],
                peers: vec![],
            },
        )
    }

    fn purge(queue: &str) -> Purge {
        Purge {
            nonce: "n1".into(),
            queue: queue.into(),
            owner: None,
            due_after_ms: None,
            due_before_ms: None,
            header: None,
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
        p.owner = Some("bob".into()); // not believed from alice
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
        p.due_after_ms = Some(1_500);
        p.due_before_ms = Some(2_500);
        p.header = Some(("tenant".into(), "x".into()));
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
        r.reschedule("alice", None, "m".into(), 5_000, 9_000, &t, 0, 100_000)
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
        r.reschedule("admin", None, "m".into(), 6_000, 9_000, &t, 0, 100_000)
            .unwrap();
        assert_eq!(
            r.steer(&subject("bob", 2_000, 100, None)),
            Steer::MoveTo(6_000)
        );
        r.prune(9_000);
        assert_eq!(r.steer(&subject("alice", 2_000, 100, None)), Steer::Run);
    }

    #[test]
    fn rules_stay_bounded_whatever_arrives() {
        let mut r = Rules::default();
        let t = trust();
        let mut refused = 0;
        for i in 0..MAX_PURGES + 10 {
            let mut p = purge("q");
            p.nonce = i.to_string();
            if r.purge(p, "alice", &t, 0, 1_000_000).is_err() {
                refused += 1;
            }
        }
        assert_eq!((r.purges.len(), refused), (MAX_PURGES, 10));
        for i in 0..MAX_MOVES + 5 {
            let _ = r.reschedule("alice", None, i.to_string(), 5, 9, &t, 0, 100);
        }
        assert_eq!(r.moves.len(), MAX_MOVES);
    }
}
