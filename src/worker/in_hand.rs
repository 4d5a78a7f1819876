//! What a worker keeps in hand — deliveries running or waiting for their due time, counted in
//! messages (a batch's members one each) and body bytes — and the bound on it: past
//! `consumer.max_in_hand` or `consumer.max_in_hand_bytes` the session takes no more
//! deliveries until some are done (the broker keeps the rest), so holding early messages can
//! never exhaust memory. A delivery is always taken when nothing else is in hand, whatever its
//! size (it could not be taken later either).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

use crate::batch;

/// The messages and bytes in hand, and their bounds.
pub(super) struct InHand {
    messages: AtomicUsize,
    bytes: AtomicUsize,
    max_messages: usize,
    max_bytes: usize,
    /// Told each time something is given back.
    room: Notify,
}

/// A delivery's share of what is in hand, given back when dropped (its task ended).
pub(super) struct Taken {
    hand: Arc<InHand>,
    messages: usize,
    bytes: usize,
}

impl InHand {
    pub(super) fn new(max_messages: usize, max_bytes: usize) -> Arc<InHand> {
        Arc::new(InHand {
            messages: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_messages: max_messages.max(1),
            max_bytes: max_bytes.max(1),
            room: Notify::new(),
        })
    }

    /// Whether a bound is reached: take no delivery now.
    pub(super) fn full(&self) -> bool {
        self.messages.load(Ordering::Acquire) >= self.max_messages
            || self.bytes.load(Ordering::Acquire) >= self.max_bytes
    }

    /// Counts `delivery` as in hand until the returned value is dropped.
    pub(super) fn take(self: &Arc<Self>, delivery: &lapin::message::Delivery) -> Taken {
        let bytes = delivery.data.len();
        self.take_counts(messages_in(&delivery.properties, bytes), bytes)
    }

    fn take_counts(self: &Arc<Self>, messages: usize, bytes: usize) -> Taken {
        self.messages.fetch_add(messages, Ordering::AcqRel);
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        Taken {
            hand: self.clone(),
            messages,
            bytes,
        }
    }

    /// Completes once something was given back since the last call (at once if it was).
    pub(super) async fn room(&self) {
        self.room.notified().await
    }

    #[cfg(test)]
    fn in_hand(&self) -> (usize, usize) {
        (
            self.messages.load(Ordering::Acquire),
            self.bytes.load(Ordering::Acquire),
        )
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.hand
            .messages
            .fetch_sub(self.messages, Ordering::AcqRel);
        self.hand.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        self.hand.room.notify_one();
    }
}

/// Messages a delivery carries: a batch's announced count, but no more than its body can hold
/// (a member takes at least 8 bytes), so a lying header cannot block the worker; else one.
fn messages_in(properties: &lapin::BasicProperties, body_len: usize) -> usize {
    if !batch::is_batch(properties) {
        return 1;
    }
    let most = body_len.saturating_sub(batch::HEADER_LEN) / 8;
    let announced = usize::try_from(batch::announced_count(properties)).unwrap_or(usize::MAX);
    announced.min(most).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_at_either_bound_and_free_again_when_given_back() {
        let hand = InHand::new(3, 100);
        let a = hand.take_counts(1, 10);
        let b = hand.take_counts(1, 10);
        assert!(!hand.full());
        let c = hand.take_counts(1, 10);
        assert!(hand.full());
        assert_eq!(hand.in_hand(), (3, 30));
        drop((a, b, c));
        assert_eq!(hand.in_hand(), (0, 0));
        assert!(!hand.full());
        let big = hand.take_counts(1, 100);
        assert!(hand.full(), "the byte bound counts too");
        drop(big);
    }

    #[test]
    fn a_batch_counts_its_members_but_never_more_than_its_body_holds() {
        let props = lapin::BasicProperties::default().with_headers(batch::batch_headers(1_000_000));
        // 72 bytes of members: at most 9 of them
        assert_eq!(messages_in(&props, batch::HEADER_LEN + 72), 9);
        let props = lapin::BasicProperties::default().with_headers(batch::batch_headers(4));
        assert_eq!(messages_in(&props, 1000), 4);
        assert_eq!(messages_in(&lapin::BasicProperties::default(), 1000), 1);
    }
}
