//! Unit tests of the parent module.

use super::*;

/// The writer of the tests' cancels, and the owner of the messages they check.
const W: &str = "u";

/// A follower whose own user is `W` (its checkpoints count).
fn ours() -> Trust {
    Trust::new(Some(W.into()), &Default::default())
}

fn key(id: &str) -> Key {
    Key::new(W, id)
}

impl State {
    /// A record of `W`'s.
    fn apply_w(&mut self, r: Record, now: u64) {
        self.read_one(Some(r), Some(W), now);
    }

    /// Whether `W`'s message `id` is cancelled.
    fn cancelled_w(&self, id: &str, now: u64) -> bool {
        self.is_cancelled(id, Some(W), now)
    }
}

/// Limits that bound nothing the tests below do.
const WIDE: Limits = Limits {
    ahead_ms: u64::MAX,
    max_live: usize::MAX,
};

fn cancel(id: &str, until_ms: u64) -> Record {
    Record::Cancel {
        id: id.into(),
        until_ms,
        due_at_ms: None,
    }
}

#[test]
fn state_keeps_live_tombstones_and_a_bounded_number_of_expired_ones() {
    let mut s = State::new(WIDE, ours());
    s.apply_w(cancel("old", 5), 10);
    s.apply_w(cancel("live", 5_000), 10);
    assert_eq!(s.tombstones.len(), 1);
    assert!(s.cancelled_w("old", 10), "expired, but still kept");
    s.apply_w(cancel("later", 9_000), 6_000);
    assert!(
        !s.tombstones.contains_key(&key("live")),
        "no longer live after its until"
    );
    assert!(s.cancelled_w("live", 6_000), "kept after its until");
    assert!(s.tombstones.contains_key(&key("later")));
    // kept for EXPIRED_KEPT_MS after the until, no longer
    assert!(s.cancelled_w("live", 5_000 + EXPIRED_KEPT_MS - 1));
    assert!(!s.cancelled_w("live", 5_000 + EXPIRED_KEPT_MS));
    // and at most EXPIRED_KEPT of them, the most recently expired
    let mut s = State::new(WIDE, ours());
    for i in 0..EXPIRED_KEPT + 10 {
        s.apply_w(cancel(&format!("e{i}"), 5), 10);
    }
    assert_eq!(s.expired.len(), EXPIRED_KEPT);
    assert!(!s.cancelled_w("e0", 10));
    assert!(s.cancelled_w(&format!("e{}", EXPIRED_KEPT + 9), 10));
}

#[test]
fn reading_the_same_expired_tombstones_again_keeps_them_all() {
    // every checkpoint repeats them: re-reading must not push duplicates that trimming
    // would later take for the originals
    let mut s = State::new(WIDE, ours());
    for _ in 0..3 {
        for i in 0..EXPIRED_KEPT {
            s.apply_w(cancel(&format!("e{i}"), 5), 10);
        }
    }
    assert_eq!(s.expired.len(), EXPIRED_KEPT);
    assert_eq!(s.expired_order.len(), EXPIRED_KEPT);
    assert!(s.cancelled_w("e0", 10));
}

#[test]
fn a_tombstone_past_its_until_counts_before_it_is_pruned() {
    let mut s = State::new(WIDE, ours());
    s.apply_w(cancel("t", 100), 10);
    // no prune has run since: still cancelled, and still in a checkpoint
    assert!(s.cancelled_w("t", 200));
    assert!(s.snapshot(200).iter().any(|(k, _)| k.id == "t"));
    assert!(!s.cancelled_w("t", 100 + EXPIRED_KEPT_MS));
}

#[test]
fn a_late_cancel_read_again_from_a_checkpoint_counts_once() {
    let mut s = State::new(WIDE, ours());
    s.executed_set.insert("ran".into(), "q".into());
    s.add(key("ran"), 5_000, 10);
    s.add(key("ran"), 5_000, 20);
    assert_eq!(s.too_late, 1);
}

#[test]
fn a_checkpoint_of_no_parts_or_of_changing_parts_is_not_complete() {
    let mut s = State::new(WIDE, ours());
    s.apply_w(Record::CheckpointBegin { nonce: "k".into() }, 10);
    let part = |part: u32, parts: u32| Record::Checkpoint {
        nonce: "k".into(),
        part,
        parts,
        items: vec![],
        by: W.into(),
        purges: vec![],
        moves: vec![],
    };
    s.apply_w(part(0, 0), 10);
    assert_eq!(s.complete_at, None, "zero parts");
    s.apply_w(part(0, 2), 10);
    s.apply_w(part(1, 1), 10);
    assert_eq!(s.complete_at, None, "a part claiming fewer parts");
    s.apply_w(part(1, 2), 10);
    assert!(s.complete_at.is_some());
}

#[test]
fn a_checkpoint_counts_once_all_its_parts_follow_its_begin() {
    let mut s = State::new(WIDE, ours());
    let part = |n: u32, items: Vec<(String, u64)>| Record::Checkpoint {
        nonce: "k".into(),
        part: n,
        parts: 2,
        items,
        by: W.into(),
        purges: vec![],
        moves: vec![],
    };
    // parts without their begin: tombstones taken, no checkpoint
    s.apply_w(part(0, vec![("a".into(), 100)]), 10);
    assert!(s.cancelled_w("a", 10));
    assert_eq!(s.complete_at, None);
    s.apply_w(cancel("x", 100), 10);
    s.apply_w(Record::CheckpointBegin { nonce: "k".into() }, 10);
    s.apply_w(cancel("y", 100), 10);
    s.apply_w(part(1, vec![]), 10);
    assert_eq!(s.complete_at, None, "one part of two");
    s.apply_w(part(1, vec![]), 10);
    assert_eq!(s.complete_at, None, "the same part again");
    s.apply_w(part(0, vec![("b".into(), 100)]), 10);
    assert_eq!(
        s.complete_at,
        Some(3),
        "whole from its begin record, the 3rd read"
    );
    assert_eq!(s.checkpoints_read, 1);
}

#[test]
fn a_snapshot_read_back_restores_what_its_writer_held() {
    let mut w = State::new(WIDE, ours());
    w.apply_w(cancel("live", 50_000), 1_000);
    w.apply_w(cancel("expired", 500), 1_000);
    let parts = parts_of(w.snapshot(1_000), 10);
    assert_eq!(parts.len(), 1);
    let (by, items) = parts.into_iter().next().unwrap();
    let mut r = State::new(WIDE, ours());
    r.apply_w(
        Record::Checkpoint {
            nonce: "k".into(),
            part: 0,
            parts: 1,
            items,
            by,
            purges: vec![],
            moves: vec![],
        },
        2_000,
    );
    assert_eq!(r.tombstones.get(&key("live")), Some(&50_000));
    assert!(r.cancelled_w("expired", 2_000));
    assert_eq!(
        r.expired.get(&key("expired")),
        w.expired.get(&key("expired")),
        "kept exactly as long"
    );
}

#[test]
fn only_a_ready_follower_checkpoints_after_enough_records() {
    let mut s = State::new(WIDE, ours());
    s.jitter = 1.0;
    for i in 0..100 {
        s.apply_w(
            Record::Barrier {
                nonce: format!("{i}"),
            },
            10,
        );
    }
    assert!(
        !s.wants_checkpoint(100),
        "not ready: its state may be partial"
    );
    s.ready = true;
    assert!(s.wants_checkpoint(100));
    assert!(!s.wants_checkpoint(101));
    // someone else began one: wait for it
    s.apply_w(Record::CheckpointBegin { nonce: "k".into() }, 10);
    assert!(!s.wants_checkpoint(100));
    // many tombstones: checkpoints further apart (twice as many records as tombstones)
    let mut s = State::new(WIDE, ours());
    s.jitter = 1.0;
    s.ready = true;
    for i in 0..100 {
        s.apply_w(cancel(&format!("c{i}"), 1_000), 10);
    }
    assert!(!s.wants_checkpoint(10), "holds 100: every 200 records");
    for i in 0..100 {
        s.apply_w(
            Record::Barrier {
                nonce: format!("{i}"),
            },
            10,
        );
    }
    assert!(s.wants_checkpoint(10));
}

#[test]
fn a_never_expiring_tombstone_is_live_only_as_long_as_a_message_can_need() {
    let mut s = State::new(
        Limits {
            ahead_ms: 1_000,
            max_live: 10,
        },
        ours(),
    );
    s.apply_w(cancel("forever", u64::MAX), 5_000);
    assert_eq!(s.tombstones.get(&key("forever")), Some(&6_000));
    assert!(s.cancelled_w("forever", 5_999));
    // then an expired one like any other, kept a week and forgotten
    s.prune(6_000);
    assert!(s.tombstones.is_empty());
    assert!(!s.cancelled_w("forever", 6_000 + EXPIRED_KEPT_MS));
}

#[test]
fn tombstones_no_writer_of_ours_makes_are_skipped() {
    let mut s = State::new(WIDE, ours());
    s.apply_w(cancel("", 100), 10);
    s.apply_w(cancel(&"x".repeat(MAX_ID_BYTES + 1), 100), 10);
    let many = |n: usize| (0..n).map(|i| (format!("m{i}"), 100)).collect::<Vec<_>>();
    s.apply_w(
        Record::Cancels {
            items: many(MAX_ITEMS + 1),
        },
        10,
    );
    assert!(s.tombstones.is_empty());
    assert_eq!(s.read, 3, "each a position all the same");
    s.apply_w(
        Record::Cancels {
            items: many(MAX_ITEMS),
        },
        10,
    );
    assert_eq!(s.tombstones.len(), MAX_ITEMS);
    // a checkpoint of absurdly many parts never completes
    s.apply_w(Record::CheckpointBegin { nonce: "k".into() }, 10);
    let part = |parts| Record::Checkpoint {
        nonce: "k".into(),
        part: 0,
        parts,
        items: vec![],
        by: W.into(),
        purges: vec![],
        moves: vec![],
    };
    s.apply_w(part(MAX_PARTS + 1), 10);
    assert_eq!(s.complete_at, None);
    s.apply_w(part(1), 10);
    assert!(s.complete_at.is_some());
}

#[test]
fn live_tombstones_stop_at_the_cap_and_room_comes_back_as_they_expire() {
    let mut s = State::new(
        Limits {
            ahead_ms: u64::MAX,
            max_live: 3,
        },
        ours(),
    );
    for i in 0..5 {
        s.apply_w(cancel(&format!("t{i}"), 100 + i), 10);
    }
    assert_eq!(s.tombstones.len(), 3);
    assert!(s.cancelled_w("t2", 10) && !s.cancelled_w("t3", 10));
    // one held already is taken again (a checkpoint repeats it)
    s.add(key("t0"), 500, 10);
    assert_eq!(s.tombstones.get(&key("t0")), Some(&500));
    // expired ones make room
    s.add(key("late"), 1_000, 150);
    assert!(s.tombstones.contains_key(&key("late")));
}

proptest::proptest! {
    /// Whatever records are read, a follower holds at most its caps, and no tombstone is
    /// live past now plus its limit.
    #[test]
    fn a_follower_stays_within_its_limits_whatever_it_reads(
        records in proptest::collection::vec(
            (0u8..4, proptest::collection::vec((0u16..400, proptest::num::u64::ANY), 0..30)),
            1..40,
        ),
    ) {
        let limits = Limits { ahead_ms: 5_000, max_live: 50 };
        let mut s = State::new(limits, ours());
        let now = 1_000_000;
        for (kind, items) in records {
            let items: Vec<_> = items.into_iter().map(|(i, u)| (format!("i{i}"), u)).collect();
            let r = match kind {
                0 => Record::Cancels { items },
                1 => Record::Checkpoint { nonce: "k".into(), part: 0, parts: 1, items, by: W.into() , purges: vec![], moves: vec![]},
                2 => Record::CheckpointBegin { nonce: "k".into() },
                _ => match items.into_iter().next() {
                    Some((id, until_ms)) => Record::Cancel { id, until_ms, due_at_ms: None },
                    None => Record::Barrier { nonce: "b".into() },
                },
            };
            s.apply_w(r, now);
            proptest::prop_assert!(s.tombstones.len() <= limits.max_live);
            proptest::prop_assert!(s.expired.len() <= EXPIRED_KEPT);
            proptest::prop_assert!(s.tombstones.values().all(|u| *u <= now + limits.ahead_ms));
        }
    }
}
