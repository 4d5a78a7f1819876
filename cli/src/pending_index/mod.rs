//! The pending index: what is scheduled, its state and recent history, kept on disk so that
//! `pending list`, `show`, `purge` and `reschedule` answer at 10 million pending messages
//! without the broker. It is rebuilt from the journal stream: the follower applies the
//! journal's records in stream order ([`PendingIndex::apply_at`]) and the offset it reached
//! commits with them, so a restarted follower resumes where the file says.
//!
//! The store is SQLite (through `rusqlite`, bundled): a well-kept embedded store with B-tree
//! indexes, partial indexes and row-value comparisons, which is all keyset pagination needs.
//! The API is synchronous; an async caller wraps it in `spawn_blocking` behind a mutex.
//!
//! # Keys, order and who sees what
//!
//! * A message is named by its **owner and id**: ids are user-given (1 to 255 bytes), two users
//!   may pick the same one, and a cancel names `(writer, id)` already ([`amqp_delay::ops::trust`]).
//!   The owner is the journal record's broker-checked `user_id`, or the `x-delay-owner` a
//!   forwarder (gateway, worker) names, exactly as `Trust::owner` decides. A second schedule of
//!   the same `(owner, id)` replaces the first's fields and keeps one history.
//! * A **user** sees only what it owns; an **admin** sees everything ([`Viewer`]). The reader of
//!   the journal decides who is an admin (`trust.admins`); the index only filters.
//! * Pages are sorted by **due time**, then owner, then row: a total order, paged by keyset
//!   ([`Cursor`]), never by OFFSET: the page after a cursor is an index range scan whatever its
//!   depth, and rows inserted or removed meanwhile never make a page skip or repeat a row that
//!   stayed.
//!
//! # Rooms
//!
//! | file | what |
//! |---|---|
//! | `migrations/*.sql`, `schema.rs` | the schema, versioned, run at open; a file of an older layout is rebuilt |
//! | [`file`] | the files, private (0600, never through a symbolic link) |
//! | `model.rs`, `entry.rs` | what a reader gets (rows, records, history) and what the follower applies |
//! | `names.rs`, `codec.rs` | names stored once; ids, headers and cursors as bytes |
//! | `write.rs`, `purge.rs` | the writer: entries applied in one transaction; a purge as set statements |
//! | `read.rs`, `paging.rs` | one message with its history; pages and counts by keyset |
//! | `summary.rs` | the console's per-destination summary |
//! | `upkeep.rs` | rebuilds and expiry |
//!
//! # What is stored
//!
//! One row per message (`messages`, integer key; names, destinations and content types
//! interned; a canonical UUID id as 16 bytes), history beyond the first schedule in `history`,
//! and indexes that cover only what they serve: the listing indexes hold pending (and parked)
//! rows only, `header_index` holds one entry per user header of a pending row, keyed by a hash
//! of `k=v` ([`Options::indexed_headers`] narrows which), `by_fin` holds only finished rows,
//! which [`PendingIndex::expire`] removes once older than the history window, and
//! `by_unconfirmed` only intents not confirmed yet.

mod codec;
mod entry;
pub mod file;
mod model;
mod names;
mod paging;
mod purge;
mod read;
mod schema;
mod summary;
#[cfg(test)]
mod tests;
mod upkeep;
mod write;

use std::fmt;

use rusqlite::Connection;

pub use codec::{Cursor, MAX_ID_BYTES};
pub use entry::{Entry, Outcome, Scheduled};
pub use model::{Destination, Event, Listing, Record, Row, State, Viewer};
use names::Names;
pub use paging::{Filter, Page};
pub use purge::Purge;
pub use summary::{
    DUE_BUCKETS, DestinationSummary, LATER, MAX_DESTINATIONS, RECENT_RUNS, RECENT_WINDOW_MS,
    Summary,
};

/// Rows a page holds at most.
pub const MAX_LIMIT: usize = 10_000;

/// How the index opens its file.
#[derive(Debug, Clone)]
pub struct Options {
    /// SQLite's page cache, in bytes: most of the index's memory. The rest is SQLite's
    /// bookkeeping and the caller's pages.
    pub cache_bytes: u64,
    /// Whether a committed batch survives a power loss (`synchronous = NORMAL` in WAL mode).
    /// A rebuild may turn it off: the journal has everything, and a torn file is rebuilt.
    pub durable: bool,
    /// Header names whose `k=v` pairs are indexed for [`Filter::header`]; `None` indexes every
    /// header. A filter on another header still works, by scanning the other filters' range.
    pub indexed_headers: Option<Vec<String>>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            cache_bytes: 64 << 20,
            durable: true,
            indexed_headers: None,
        }
    }
}

/// What the index could not do.
#[derive(Debug)]
pub enum Error {
    /// The input is invalid (an id, a filter, a time): the message says which and why.
    Invalid(String),
    /// The file could not be read or written, or it is not an index of this version.
    Store(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid(m) => write!(f, "{m}"),
            Error::Store(m) => write!(f, "pending index: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Error {
        Error::Store(e.to_string())
    }
}

/// Results of the index.
pub type Result<T> = std::result::Result<T, Error>;

/// The pending index: one SQLite file.
pub struct PendingIndex {
    conn: Connection,
    names: Names,
    /// Hashes of the indexed header names' pairs are computed for these names only.
    indexed_headers: Option<Vec<String>>,
    /// A rebuild is under way: no listing indexes, no header index.
    rebuilding: bool,
}

impl PendingIndex {
    /// Opens (creating when missing, private: [`file`]) the index at `path`, its schema
    /// brought to this build's (versioned migrations; a file of the older, unversioned layout
    /// is emptied for a rebuild, with a warning).
    pub fn open(path: &std::path::Path, options: Options) -> Result<PendingIndex> {
        let conn = schema::open(path, &options)?;
        let rebuilding = upkeep::rebuilding_in(&conn)?;
        Ok(PendingIndex {
            conn,
            names: Names::default(),
            indexed_headers: options.indexed_headers,
            rebuilding,
        })
    }
}

fn ms(v: u64, what: &str) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::Invalid(format!("{what} {v} is past any real time")))
}

fn check_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(Error::Invalid(format!(
            "a message id has 1 to {MAX_ID_BYTES} bytes, not {}",
            id.len()
        )));
    }
    Ok(())
}

/// A meta key the follower may set: not one of the index's own (`rebuilding`).
fn check_mark(k: &str) -> Result<()> {
    if k.is_empty()
        || k.len() > 64
        || !k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        || k == "rebuilding"
    {
        return Err(Error::Invalid(format!("'{k}' is not a mark name")));
    }
    Ok(())
}

fn check_user(user: &str, what: &str) -> Result<()> {
    if user.is_empty() {
        return Err(Error::Invalid(format!("{what} is empty")));
    }
    Ok(())
}

/// Whether header `k` is one the header index holds.
fn indexed(names: Option<&[String]>, k: &str) -> bool {
    names.is_none_or(|n| n.iter().any(|x| x == k))
}
