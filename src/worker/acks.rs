//! Coalesced acks: one `basic.ack` with `multiple` for a run of settled deliveries of a
//! consumer channel, instead of one per delivery.
//!
//! A quorum queue turns every `basic.ack` frame into a log entry (and releases one prefetch
//! credit at a time): consuming 50 000 persistent messages at prefetch 256 cost RabbitMQ 3.10
//! 84 µs of CPU per message acked one by one, 31 µs acked in fours, 20 µs in sixteens and
//! 14 µs in sixty-fours (`docs/PERFORMANCE.md`, "Acks"). The gateway's ingress, the relay and
//! busy workers settle hundreds of deliveries a second, roughly in order.
//!
//! Rules, per channel (delivery tags grow in the order deliveries arrive):
//! * a delivery whose handling is done is *done*; the broker learns it later, at the latest
//!   [`FLUSH_AFTER`] later: when the run of done deliveries from the oldest one in hand reaches
//!   a quarter of the prefetch, when no delivery of the channel is still running, or when the
//!   timer fires — one ack with `multiple` for the run, then one ack each for done deliveries
//!   behind a running one (a slow handler never holds the others' acks for long);
//! * a delivery given back (`basic.nack`, requeue) is sent at once, and counts as settled;
//! * frames of one channel are sent one at a time under a lock, so an ack with `multiple` never
//!   reaches the broker before a nack of a tag it covers (that tag would be acked instead), nor
//!   after a later one that already covered it (the broker closes the channel on an unknown
//!   tag).
//!
//! What a worker dies with (at most [`FLUSH_AFTER`] of done deliveries) is delivered again:
//! at-least-once, as a worker dying between a handler and its ack always was. A stopping
//! worker flushes before it closes its channels.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};

/// Longest time a done delivery waits for its ack to be sent.
pub(super) const FLUSH_AFTER: Duration = Duration::from_millis(10);

enum Slot {
    /// Handed to its task, not settled yet.
    Running,
    /// Done; its ack not sent yet.
    Done(Acker),
    /// Given back to the broker (nack sent): nothing more to send for it.
    Settled,
}

#[derive(Default)]
struct State {
    slots: BTreeMap<u64, Slot>,
    /// A timer flush is on its way.
    timer: bool,
}

/// The acks of one consumer channel.
pub(super) struct Acks {
    state: Mutex<State>,
    /// Held while a frame is sent (see the module's rules).
    send: tokio::sync::Mutex<()>,
    /// Done deliveries in a run that are acked without waiting for the timer.
    run: usize,
    queue: String,
}

/// What one delivery's task settles it with.
pub(super) struct Settle {
    acks: Arc<Acks>,
    tag: u64,
    acker: Acker,
}

/// What a flush sends, taken out of the state under the send lock.
struct Flush {
    /// The newest done delivery of the run from the oldest one in hand (`multiple`).
    run: Option<(Acker, usize)>,
    /// Done deliveries behind a running one.
    single: Vec<Acker>,
}

impl Acks {
    /// The acks of a channel consuming `queue` with `prefetch`.
    pub(super) fn new(queue: &str, prefetch: u16) -> Arc<Acks> {
        Arc::new(Acks {
            state: Mutex::new(State::default()),
            send: tokio::sync::Mutex::new(()),
            run: usize::from(prefetch / 4).max(1),
            queue: queue.to_string(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes delivery `tag` in hand (called in the order deliveries arrive): its task settles
    /// it through the returned value.
    pub(super) fn received(self: &Arc<Self>, tag: u64, acker: Acker) -> Settle {
        self.state().slots.insert(tag, Slot::Running);
        Settle {
            acks: self.clone(),
            tag,
            acker,
        }
    }

    /// Deliveries done or running (for tests and logs).
    #[cfg(test)]
    fn in_hand(&self) -> usize {
        self.state().slots.len()
    }

    /// Marks `tag` done; sends what is due now, or makes sure the timer will.
    async fn done(self: &Arc<Self>, tag: u64, acker: Acker) {
        let now = {
            let mut st = self.state();
            st.slots.insert(tag, Slot::Done(acker));
            let (run, all) = run_from_oldest(&st.slots);
            let now = run >= self.run || all;
            if !now && !st.timer {
                st.timer = true;
                let me = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(FLUSH_AFTER).await;
                    me.flush(true).await;
                });
            }
            now
        };
        if now {
            self.flush(false).await;
        }
    }

    /// Gives `tag` back to the broker (requeue), at once.
    async fn give_back(&self, tag: u64, acker: &Acker) -> lapin::Result<bool> {
        let _turn = self.send.lock().await;
        let r = acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await;
        let mut st = self.state();
        st.slots.insert(tag, Slot::Settled);
        drop_settled_front(&mut st.slots);
        r
    }

    /// Sends the acks that are due: the run from the oldest delivery in hand, and with
    /// `all` (the timer, a stopping worker) the done deliveries behind a running one too.
    pub(super) async fn flush(&self, all: bool) {
        let _turn = self.send.lock().await;
        let f = {
            let mut st = self.state();
            if all {
                st.timer = false;
            }
            take(&mut st.slots, all)
        };
        if let Some((acker, n)) = f.run {
            match acker.ack(BasicAckOptions { multiple: n > 1 }).await {
                Ok(true) => tracing::trace!(queue = %self.queue, n, "acked"),
                Ok(false) => tracing::warn!(
                    queue = %self.queue,
                    n,
                    "not acked (the channel closed); the broker will redeliver them"
                ),
                Err(e) => tracing::warn!(
                    queue = %self.queue,
                    n,
                    "ack failed ({e}); the broker will redeliver them"
                ),
            }
        }
        for acker in f.single {
            match acker.ack(BasicAckOptions::default()).await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    queue = %self.queue,
                    "not acked (the channel closed); the broker will redeliver it"
                ),
                Err(e) => {
                    tracing::warn!(queue = %self.queue, "ack failed ({e}); the broker will redeliver it")
                }
            }
        }
    }
}

impl Settle {
    /// The delivery's tag on its channel.
    #[cfg(test)]
    fn tag(&self) -> u64 {
        self.tag
    }

    /// Done: acked with the run it belongs to, within [`FLUSH_AFTER`].
    pub(super) async fn ack(self) {
        self.acks.done(self.tag, self.acker).await;
    }

    /// Back to the queue (`basic.nack`, requeue), sent at once.
    pub(super) async fn give_back(self) -> lapin::Result<bool> {
        self.acks.give_back(self.tag, &self.acker).await
    }
}

/// Done deliveries in the run from the oldest delivery in hand (settled ones do not end it),
/// and whether that run covers every delivery in hand.
fn run_from_oldest(slots: &BTreeMap<u64, Slot>) -> (usize, bool) {
    let mut done = 0;
    for slot in slots.values() {
        match slot {
            Slot::Running => return (done, false),
            Slot::Done(_) => done += 1,
            Slot::Settled => {}
        }
    }
    (done, true)
}

/// Takes out of `slots` what a flush sends: the run from the oldest delivery (its newest done
/// acker, acked with `multiple`, covers the rest), and with `all` every other done delivery.
fn take(slots: &mut BTreeMap<u64, Slot>, all: bool) -> Flush {
    let mut run: Option<(Acker, usize)> = None;
    let mut end = None;
    for (&tag, slot) in slots.iter() {
        match slot {
            Slot::Running => break,
            Slot::Done(a) => {
                let n = run.as_ref().map_or(0, |(_, n)| *n) + 1;
                run = Some((a.clone(), n));
                end = Some(tag);
            }
            Slot::Settled => end = Some(tag),
        }
    }
    if let Some(end) = end {
        slots.retain(|&t, _| t > end);
    }
    let mut single = Vec::new();
    if all {
        slots.retain(|_, slot| match slot {
            Slot::Done(a) => {
                single.push(a.clone());
                false
            }
            _ => true,
        });
        drop_settled_front(slots);
    }
    Flush { run, single }
}

/// Drops settled slots at the front: nothing is sent for them, and they end no run.
fn drop_settled_front(slots: &mut BTreeMap<u64, Slot>) {
    while let Some(e) = slots.first_entry() {
        if !matches!(e.get(), Slot::Settled) {
            break;
        }
        e.remove();
    }
}

#[cfg(test)]
mod tests {
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
                    'd' => Slot::Done(acker(t)),
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
        let f = take(&mut s, false);
        assert_eq!(f.run.map(|(_, n)| n), Some(2));
        assert!(f.single.is_empty());
        assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![4, 5]);
        // the timer also acks what is done behind the running one
        let f = take(&mut s, true);
        assert!(f.run.is_none());
        assert_eq!(f.single.len(), 1);
        assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![4]);
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
        let f = take(&mut s, false);
        assert!(f.run.is_none() && f.single.is_empty() && s.is_empty());
        let mut s = slots(&[(1, 'r'), (2, 's'), (3, 'r')]);
        let f = take(&mut s, true);
        assert!(f.run.is_none() && f.single.is_empty());
        assert_eq!(s.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
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
        d.ack().await; // behind 3: the timer acks it
        tokio::time::sleep(FLUSH_AFTER * 5).await;
        assert_eq!(acks.in_hand(), 1);
        c.give_back().await.unwrap();
        assert_eq!(acks.in_hand(), 0);
    }
}
