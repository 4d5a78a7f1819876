//! What a reader of the index gets: destinations, who asks, a message's state, rows, history
//! and records.

use super::{Cursor, Outcome};

/// Where a message goes when due: a queue, or a gateway target exchange with a routing key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    /// A queue of ours (stored as the default exchange's routing key, which is what it is).
    Queue(String),
    /// A gateway's target exchange and the message's routing key.
    Exchange {
        /// The target exchange (not empty).
        exchange: String,
        /// The message's routing key.
        routing_key: String,
    },
}

impl Destination {
    pub(super) fn parts(&self) -> (&str, &str) {
        match self {
            Destination::Queue(q) => ("", q),
            Destination::Exchange {
                exchange,
                routing_key,
            } => (exchange, routing_key),
        }
    }

    pub(super) fn from_parts(exchange: String, routing_key: String) -> Destination {
        if exchange.is_empty() {
            Destination::Queue(routing_key)
        } else {
            Destination::Exchange {
                exchange,
                routing_key,
            }
        }
    }
}

/// Who asks: what a query may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Viewer {
    /// Sees everything.
    Admin,
    /// Sees only what this user owns.
    User(String),
}

/// Which rows a list covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Listing {
    /// Not yet run nor cancelled (unconfirmed included, marked as such).
    #[default]
    Pending,
    /// Parked, waiting in a parking queue.
    Parked,
}

/// A message's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Journaled before its publish; no confirm seen yet.
    Unconfirmed,
    /// Confirmed, waiting for its due time (or retried and waiting again).
    Pending,
    /// Cancelled before it ran.
    Cancelled,
    /// Ran and done.
    Done,
    /// Parked after a permanent failure or its last attempt.
    Parked,
    /// Journaled before its publish, which the broker then refused: never scheduled.
    Refused,
}

impl State {
    pub(super) fn code(self) -> i64 {
        match self {
            State::Unconfirmed => 0,
            State::Pending => 1,
            State::Cancelled => 2,
            State::Done => 3,
            State::Parked => 4,
            State::Refused => 5,
        }
    }

    pub(super) fn of(code: i64) -> State {
        match code {
            0 => State::Unconfirmed,
            1 => State::Pending,
            2 => State::Cancelled,
            3 => State::Done,
            5 => State::Refused,
            _ => State::Parked,
        }
    }

    /// The listing a row in this state belongs to (`messages.listing`): 1 pending, 2 parked,
    /// none.
    pub(super) fn listing(self) -> Option<i64> {
        match self {
            State::Unconfirmed | State::Pending => Some(1),
            State::Parked => Some(2),
            State::Cancelled | State::Done | State::Refused => None,
        }
    }
}

/// One row of a page: every field but the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The message id.
    pub id: String,
    /// Its owner.
    pub owner: String,
    /// Where it goes.
    pub destination: Destination,
    /// When it is due (the latest reschedule or retry).
    pub due_at_ms: u64,
    /// When it was scheduled.
    pub scheduled_at_ms: u64,
    /// The body's size.
    pub size: u64,
    /// The content type.
    pub content_type: Option<String>,
    /// The kept user headers.
    pub headers: Vec<(String, String)>,
    /// Its state.
    pub state: State,
    /// Whether the body was kept.
    pub body_kept: bool,
    /// Where it sorts: a page that ends with this row continues after it.
    pub cursor: Cursor,
}

/// What happened to a message, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Scheduled at `at_ms`, due at `due_at_ms`.
    Scheduled {
        /// When.
        at_ms: u64,
        /// The due time it was given.
        due_at_ms: u64,
    },
    /// Moved from one due time to another.
    Rescheduled {
        /// When.
        at_ms: u64,
        /// Who moved it.
        by: String,
        /// The due time before.
        from_due_at_ms: u64,
        /// The due time after.
        to_due_at_ms: u64,
    },
    /// Cancelled.
    Cancelled {
        /// When.
        at_ms: u64,
        /// Who cancelled.
        by: String,
    },
    /// Ran.
    Ran {
        /// When.
        at_ms: u64,
        /// How late.
        lateness_ms: u64,
        /// How it ended.
        outcome: Outcome,
    },
}

impl Event {
    /// When it happened.
    pub fn at_ms(&self) -> u64 {
        match self {
            Event::Scheduled { at_ms, .. }
            | Event::Rescheduled { at_ms, .. }
            | Event::Cancelled { at_ms, .. }
            | Event::Ran { at_ms, .. } => *at_ms,
        }
    }
}

/// A message with its body and history: what `pending show` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its fields.
    pub row: Row,
    /// The kept body.
    pub body: Option<Vec<u8>>,
    /// What happened to it, oldest first, from its first schedule on.
    pub history: Vec<Event>,
}
