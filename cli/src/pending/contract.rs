//! TEMPORARY: the journal contract (`amqp_delay::journal`, the control stream's `Purge` and
//! `Reschedule`, `Publisher::purge`/`reschedule`) as the library will offer it, so that the
//! `pending` application compiles and its pure parts are tested before the library's journal
//! lands. Reading fails with a clear error. Replaced by the library's own items on rebase.

#![allow(missing_docs, dead_code)]

use amqp_delay::{Error, Layout, Message, Publisher, Result};

/// `amqp_delay::journal`.
pub mod journal {
    use serde::{Deserialize, Serialize};

    pub use super::{Entry, end_offset_of as end_offset, tail};

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    pub enum Record {
        Scheduled {
            session: String,
            flush: u64,
            at_ms: u64,
            items: Vec<Item>,
            confirmed: Vec<Flush>,
        },
        Confirmed {
            session: String,
            flushes: Vec<Flush>,
        },
        Ran {
            items: Vec<Run>,
        },
        Barrier {
            nonce: String,
        },
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Flush {
        pub flush: u64,
        pub failed: Vec<String>,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Item {
        pub id: String,
        pub owner: Option<String>,
        pub queue: String,
        pub exchange: Option<String>,
        pub routing_key: Option<String>,
        pub due_ms: u64,
        pub size: u64,
        pub content_type: Option<String>,
        pub headers: Vec<(String, String)>,
        pub body: Option<Vec<u8>>,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Run {
        pub id: String,
        pub owner: Option<String>,
        pub queue: String,
        pub due_ms: u64,
        pub at_ms: u64,
        pub outcome: RunOutcome,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub enum RunOutcome {
        Done,
        Retried { next_due_ms: u64 },
        Parked,
        Cancelled,
        Rescheduled { due_ms: u64 },
        Superseded,
    }
}

/// `amqp_delay::control` with the contract's new records.
pub mod control {
    pub use super::tail_control as tail;

    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Record {
        Barrier {
            nonce: String,
        },
        Cancel {
            id: String,
            until_ms: u64,
            due_at_ms: Option<u64>,
        },
        Cancels {
            items: Vec<(String, u64)>,
        },
        Purge {
            nonce: String,
            queue: String,
            owner: Option<String>,
            due_after_ms: Option<u64>,
            due_before_ms: Option<u64>,
            header: Option<(String, String)>,
            scheduled_before_ms: u64,
            until_ms: u64,
        },
        Reschedule {
            id: String,
            owner: Option<String>,
            due_at_ms: u64,
            until_ms: u64,
        },
        Other,
    }

    /// The contract's `Purge` argument of `Publisher::purge`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Purge {
        pub queue: String,
        pub owner: Option<String>,
        pub due_after_ms: Option<u64>,
        pub due_before_ms: Option<u64>,
        pub header: Option<(String, String)>,
    }

    pub async fn append(
        _conn: &lapin::Connection,
        _layout: &amqp_delay::Layout,
        _r: &Record,
    ) -> amqp_delay::Result<()> {
        Err(super::missing())
    }
}

/// Where a tail starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    First,
    Offset(u64),
    Next,
}

/// A record read, with its offset and broker-checked writer.
#[derive(Debug, Clone)]
pub struct Entry<R> {
    pub offset: u64,
    pub by: Option<String>,
    pub record: Option<R>,
}

/// A reader of one stream.
pub struct Tail<R> {
    _r: std::marker::PhantomData<R>,
}

impl<R> Tail<R> {
    pub async fn next(&mut self) -> Option<Result<Entry<R>>> {
        Some(Err(missing()))
    }

    pub async fn end(self) {}
}

fn missing() -> Error {
    Error::Invalid("this build has no journal yet (amqp_delay::journal)".into())
}

pub async fn tail(
    _conn: &lapin::Connection,
    _layout: &Layout,
    _from: Start,
) -> Result<Tail<journal::Record>> {
    Err(missing())
}

pub async fn tail_control(
    _conn: &lapin::Connection,
    _layout: &Layout,
    _from: Start,
) -> Result<Tail<control::Record>> {
    Err(missing())
}

pub async fn end_offset_of(_conn: &lapin::Connection, _layout: &Layout) -> Result<Option<u64>> {
    Err(missing())
}

/// What `Publisher::reschedule` answers.
#[derive(Debug, Clone)]
pub struct Rescheduled {
    pub id: String,
    pub due_at_ms: u64,
}

pub async fn purge(_p: &Publisher, _purge: control::Purge) -> Result<()> {
    Err(missing())
}

pub async fn reschedule(
    _p: &Publisher,
    _id: &str,
    _owner: Option<&str>,
    _from_due_ms: u64,
    _due_at_ms: u64,
    _copy: Option<Message>,
) -> Result<Rescheduled> {
    Err(missing())
}
