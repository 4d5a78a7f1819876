//! What the follower applies: one journal or control record as the index takes it.

use super::{Destination, Purge};

/// A message scheduled: the journal's intent record, or its confirmed copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The message id (1 to [`MAX_ID_BYTES`] bytes).
    pub id: String,
    /// Its owner: the broker-checked writer, or the owner a forwarder names (`Trust::owner`).
    pub owner: String,
    /// Where it goes when due.
    pub destination: Destination,
    /// When it is due (ms since the epoch).
    pub due_at_ms: u64,
    /// When it was scheduled (ms since the epoch); with the owner and id, what tells a replay
    /// of the same record from a new schedule of the same id.
    pub scheduled_at_ms: u64,
    /// The body's size in bytes.
    pub size: u64,
    /// Its content type, if any.
    pub content_type: Option<String>,
    /// The journal's bounded copy of its user headers.
    pub headers: Vec<(String, String)>,
    /// The body, when the journal keeps bodies (what makes "earlier" and "now" possible).
    pub body: Option<Vec<u8>>,
    /// Whether the broker confirmed it: an intent written before the publish is `false` and
    /// listed as unconfirmed until [`Entry::Confirmed`] or until it expires.
    pub confirmed: bool,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Handled; the message is finished.
    Done,
    /// Failed and sent round the tiers again, due at `next_due_at_ms`: pending again.
    Retried {
        /// When the retry falls due.
        next_due_at_ms: u64,
    },
    /// Parked in `<prefix>.parked.<queue>`: listed by [`super::Listing::Parked`], kept until it is
    /// retried or dropped (not by [`super::PendingIndex::expire`]).
    Parked,
}

/// One journal record, as the index applies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A message scheduled (or the intent to).
    Scheduled(Scheduled),
    /// The broker confirmed `(owner, id)`: unconfirmed becomes pending.
    Confirmed {
        /// The message's owner.
        owner: String,
        /// The message id.
        id: String,
    },
    /// A cancel by `by`: of `owner`'s message `id`, or of every owner's when `owner` is `None`
    /// (the journal's reader passes `None` only for an admin's cancel, `Trust::may_cancel`).
    Cancelled {
        /// Whose message (`None`: anyone's, an admin's cancel).
        owner: Option<String>,
        /// The message id.
        id: String,
        /// Who cancelled.
        by: String,
        /// When (ms since the epoch).
        at_ms: u64,
    },
    /// A worker ran it.
    Ran {
        /// The message's owner.
        owner: String,
        /// The message id.
        id: String,
        /// When it ran (ms since the epoch).
        at_ms: u64,
        /// How late, by the worker's clock.
        lateness_ms: u64,
        /// How the run ended.
        outcome: Outcome,
    },
    /// The broker refused the schedule of `(owner, id)` made at `scheduled_at_ms` (a failed
    /// flush): the intent was never scheduled and is never listed as pending.
    Refused {
        /// The message's owner.
        owner: String,
        /// The message id.
        id: String,
        /// When the refused schedule was made: a later schedule of the id is left alone.
        scheduled_at_ms: u64,
    },
    /// A purge: every matching pending message cancelled at once ([`Purge`]).
    Purged(Purge),
    /// `by` moved it to `due_at_ms`.
    Rescheduled {
        /// The message's owner (`None`: every owner's message of the id, an admin's reschedule
        /// naming none).
        owner: Option<String>,
        /// The message id.
        id: String,
        /// The new due time (ms since the epoch).
        due_at_ms: u64,
        /// Who moved it.
        by: String,
        /// When (ms since the epoch).
        at_ms: u64,
    },
}
