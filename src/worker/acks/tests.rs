//! Unit tests of the parent module.

use super::*;

fn acker(tag: u64) -> Acker {
    // an acker without a channel: `ack` succeeds and sends nothing
    lapin::message::Delivery::mock(tag, "".into(), "".into(), false, Vec::new()).acker
}

fn slots(spec: &[(u64, char)]) -> BTreeMap<u64, Slot> {
    spec.iter()
        .map(|&(t, c)| {
            let s = match c {
                'r' => Slot::Running,
                'd' => Slot::Done(acker(t), Instant::now()),
                _ => Slot::Settled,
            };
            (t, s)
        })
        .collect()
}

#[test]
fn the_run_from_the_oldest_delivery_is_taken_and_stops_at_a_running_one() {
    let mut s = slots(&[(1, 'd'), (2, 's'), (3, 'd'), (4, 'r'), (5, 'd')]);
    assert_eq!(run_from_oldest(&s), (2, false));
    let f = take(&mut s, None);
    assert_eq!(f.run.map(|(t, _, n)| (t, n)), Some((3, 2)));
    assert!(f.single.is_empty());
    assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![4, 5]);
    // the timer also acks what is done behind the running one
    let f = take(&mut s, Some(Duration::ZERO));
    assert!(f.run.is_none());
    assert_eq!(f.single.len(), 1);
    assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![4]);
}

#[test]
fn a_done_delivery_behind_a_running_one_waits_for_the_run_until_it_is_old_enough() {
    let mut s = slots(&[(1, 'r'), (2, 'd')]);
    // the timer, before BEHIND_AFTER: nothing goes
    let f = take(&mut s, Some(BEHIND_AFTER));
    assert!(f.run.is_none() && f.single.is_empty());
    assert_eq!(s.len(), 2);
    // the running one finishes: one ack with multiple covers both
    s.insert(1, Slot::Done(acker(1), Instant::now()));
    let f = take(&mut s, Some(BEHIND_AFTER));
    assert_eq!(f.run.map(|(t, _, n)| (t, n)), Some((2, 2)));
    assert!(f.single.is_empty() && s.is_empty());
    // still running once it is old enough: acked alone
    let mut s = slots(&[(1, 'r'), (2, 'd')]);
    let f = take(&mut s, Some(Duration::ZERO));
    assert_eq!(
        f.single.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        vec![2]
    );
    assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![1]);
}

#[test]
fn a_run_that_covers_everything_in_hand_is_due_at_once() {
    let s = slots(&[(7, 's'), (8, 'd'), (9, 'd')]);
    assert_eq!(run_from_oldest(&s), (2, true));
    let s = slots(&[(7, 'r')]);
    assert_eq!(run_from_oldest(&s), (0, false));
    assert_eq!(run_from_oldest(&BTreeMap::new()), (0, true));
}

#[test]
fn settled_deliveries_are_dropped_and_never_acked() {
    let mut s = slots(&[(1, 's'), (2, 's')]);
    let f = take(&mut s, None);
    assert!(f.run.is_none() && f.single.is_empty() && s.is_empty());
    let mut s = slots(&[(1, 'r'), (2, 's'), (3, 'r')]);
    let f = take(&mut s, Some(Duration::ZERO));
    assert!(f.run.is_none() && f.single.is_empty());
    assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
}

/// What the broker holds of one channel's deliveries, checking every frame it gets.
#[derive(Default)]
struct Broker {
    /// Delivered, not settled yet.
    unsettled: std::collections::BTreeSet<u64>,
    acked: Vec<u64>,
    nacked: Vec<u64>,
}

impl Broker {
    fn ack(&mut self, tag: u64, multiple: bool, finished: &BTreeSet<u64>) {
        assert!(self.unsettled.contains(&tag), "ack of {tag}: not unsettled");
        let covered: Vec<u64> = if multiple {
            self.unsettled.range(..=tag).copied().collect()
        } else {
            vec![tag]
        };
        for t in covered {
            assert!(
                finished.contains(&t),
                "ack covers {t}, which is not finished"
            );
            self.unsettled.remove(&t);
            self.acked.push(t);
        }
    }

    fn nack(&mut self, tag: u64, finished: &BTreeSet<u64>) {
        assert!(self.unsettled.remove(&tag), "nack of {tag}: not unsettled");
        assert!(!finished.contains(&tag), "nack of {tag}, which is finished");
        self.nacked.push(tag);
    }

    fn flush(&mut self, st: &mut State, all: bool, finished: &BTreeSet<u64>) {
        let f = take(&mut st.slots, all.then_some(Duration::ZERO));
        if let Some((tag, _, n)) = f.run {
            self.ack(tag, n > 1, finished);
        }
        for (tag, _) in f.single {
            self.ack(tag, false, finished);
        }
    }
}

use proptest::prelude::{Just, Strategy};
use std::collections::BTreeSet;

proptest::proptest! {
    /// Any interleaving of deliveries finishing, given back (before or after the stop),
    /// held (running long) and flushes by run, by timer and at the stop: no tag is acked
    /// or nacked twice, an ack with `multiple` covers finished deliveries only, and after
    /// the stop's last flush every finished delivery is acked and every other one is
    /// either nacked or still unsettled for the channel's close to return — none is lost.
    #[test]
    fn any_interleaving_acks_each_finished_delivery_once_and_nothing_else(
        (ends, order) in (1usize..60).prop_flat_map(|n| (
            proptest::collection::vec((proptest::bool::weighted(0.7), 0u8..4), n),
            Just((1..=n as u64).collect::<Vec<_>>()).prop_shuffle(),
        )),
        stop_at in 0usize..60,
        run in 1usize..8,
        held in proptest::collection::btree_set(1u64..60, 0..6),
        ahead in 0u64..8,
    ) {
        let n = ends.len() as u64;
        let mut st = State::default();
        let mut broker = Broker::default();
        let mut finished = BTreeSet::new();
        let mut given_back = BTreeSet::new();
        // deliveries arrive in tag order, `ahead` more than needed (a delivery arrives
        // before it can end)
        let mut next = 1;
        // the order in which deliveries end (a permutation of the tags); held ones (a
        // delivery waiting for its due time, or a slow handler) end last, and are given
        // back when the stop comes first
        let mut order = order;
        order.sort_by_key(|tag| held.contains(tag));
        for (step, &tag) in order.iter().enumerate() {
            let upto = tag.max(next - 1 + ahead).min(n);
            while next <= upto {
                st.slots.insert(next, Slot::Running);
                broker.unsettled.insert(next);
                next += 1;
            }
            let (ok, flush) = ends[tag as usize - 1];
            if step == stop_at {
                st.stopping = true;
            }
            if ok && !(st.stopping && held.contains(&tag)) {
                finished.insert(tag);
                if st.done(tag, acker(tag), run) {
                    broker.flush(&mut st, false, &finished);
                }
            } else {
                given_back.insert(tag);
                if st.give_back(tag) {
                    broker.nack(tag, &finished);
                    st.nacked(tag);
                }
            }
            match flush {
                0 => broker.flush(&mut st, true, &finished), // the timer
                1 => broker.flush(&mut st, false, &finished),
                _ => {}
            }
        }
        // the stop's last flush
        broker.flush(&mut st, true, &finished);
        let mut acked = broker.acked.clone();
        acked.sort_unstable();
        proptest::prop_assert_eq!(acked, finished.iter().copied().collect::<Vec<_>>());
        let mut returned: Vec<u64> = broker.nacked.clone();
        returned.extend(broker.unsettled.iter().copied());
        returned.sort_unstable();
        proptest::prop_assert_eq!(returned, given_back.iter().copied().collect::<Vec<_>>());
        proptest::prop_assert_eq!(st.left, broker.unsettled.len());
        // nothing done is left in the books (only what the close returns, and nacked ones
        // behind it, which nothing is sent for)
        proptest::prop_assert!(
            st.slots.values().all(|s| matches!(s, Slot::Left | Slot::Settled))
        );
    }
}

#[test]
fn a_left_delivery_ends_every_run_and_stays_for_the_close() {
    let mut st = State {
        stopping: true,
        ..State::default()
    };
    for tag in 1..=4 {
        st.slots.insert(tag, Slot::Running);
    }
    assert!(st.done(1, acker(1), 1), "a run of one");
    let f = take(&mut st.slots, None);
    assert_eq!(f.run.map(|(t, _, n)| (t, n)), Some((1, 1)));
    assert!(!st.give_back(2), "a stopping worker sends no nack");
    assert!(!st.done(3, acker(3), 1), "behind a left one: not a run");
    assert!(!st.done(4, acker(4), 1));
    let f = take(&mut st.slots, None);
    assert!(f.run.is_none() && f.single.is_empty());
    let f = take(&mut st.slots, Some(Duration::ZERO));
    assert!(f.run.is_none());
    assert_eq!(
        f.single.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(st.slots.keys().copied().collect::<Vec<_>>(), vec![2]);
    assert_eq!(st.left, 1);
}

#[test]
fn frames_sent_lately_make_the_channel_busy_and_those_since_the_stop_are_counted() {
    let mut st = State::default();
    st.sent(LINGER_FRAMES - 1);
    assert!(st.recent_frames() < LINGER_FRAMES);
    st.nacked(1);
    assert_eq!(st.recent_frames(), LINGER_FRAMES, "a nack is a frame too");
    assert_eq!(st.stop_frames, 0);
    st.stopping = true;
    st.sent(2);
    assert_eq!(st.stop_frames, 2);
    // two windows later nothing is recent any more
    st.recent.0 = std::time::Instant::now().checked_sub(RECENT * 2);
    assert_eq!(st.recent_frames(), 0);
}

#[tokio::test]
async fn done_deliveries_leave_the_books_by_run_or_by_timer() {
    let acks = Acks::new("q", 8); // runs of 2
    let a = acks.received(1, acker(1));
    let b = acks.received(2, acker(2));
    let c = acks.received(3, acker(3));
    assert_eq!((a.tag(), acks.in_hand()), (1, 3));
    b.ack().await; // behind a running one: waits
    assert_eq!(acks.in_hand(), 3);
    a.ack().await; // the run 1–2 is complete
    assert_eq!(acks.in_hand(), 1);
    let d = acks.received(4, acker(4));
    d.ack().await; // behind 3: the timer acks it once it waited BEHIND_AFTER
    tokio::time::sleep(BEHIND_AFTER + FLUSH_AFTER * 5).await;
    assert_eq!(acks.in_hand(), 1);
    c.give_back().await.unwrap();
    assert_eq!(acks.in_hand(), 0);
}
