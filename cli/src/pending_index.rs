//! The pending index (issue 47): what is scheduled, its state and recent history, kept on disk
//! so that `pending list`, `show`, `purge` and `reschedule` answer at 10 million pending messages
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
//!   may pick the same one, and a cancel names `(writer, id)` already ([`amqp_delay::trust`]).
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
//! # What is stored
//!
//! One row per message (`records`, integer key; names, destinations and content types
//! interned; a canonical UUID id as 16 bytes), history beyond the first schedule in `history`,
//! and indexes that cover only what they serve: the listing indexes hold pending (and parked)
//! rows only, `hdr` holds one entry per user header of a pending row, keyed by a hash of `k=v`
//! ([`Options::indexed_headers`] narrows which), `by_fin` holds only finished rows, which
//! [`PendingIndex::expire`] removes once older than the history window, and `by_unconfirmed`
//! only intents not confirmed yet.

mod codec;
pub mod file;
mod purge;
mod summary;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use rusqlite::types::Value;
use rusqlite::{Connection, OptionalExtension, ToSql, Transaction, params};

pub use codec::{Cursor, MAX_ID_BYTES};
use codec::{StoredId, decode_headers, encode_headers, header_hash};
pub use purge::Purge;
pub use summary::{
    DUE_BUCKETS, DestinationSummary, LATER, MAX_DESTINATIONS, RECENT_RUNS, RECENT_WINDOW_MS,
    Summary,
};

/// Rows a page holds at most.
pub const MAX_LIMIT: usize = 10_000;
/// Names (owners, destinations, content types) kept in memory at most; past it the cache is
/// emptied and refilled from the file, so memory stays bounded whatever the journal holds.
const NAME_CACHE: usize = 100_000;
/// Rows [`PendingIndex::expire`] removes per transaction.
const EXPIRE_CHUNK: usize = 50_000;
/// The schema this code writes (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 1;

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
    fn parts(&self) -> (&str, &str) {
        match self {
            Destination::Queue(q) => ("", q),
            Destination::Exchange {
                exchange,
                routing_key,
            } => (exchange, routing_key),
        }
    }

    fn from_parts(exchange: String, routing_key: String) -> Destination {
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
    /// Parked in `<prefix>.parked.<queue>`: listed by [`Listing::Parked`], kept until it is
    /// retried or dropped (not by [`PendingIndex::expire`]).
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
    fn code(self) -> i64 {
        match self {
            State::Unconfirmed => 0,
            State::Pending => 1,
            State::Cancelled => 2,
            State::Done => 3,
            State::Parked => 4,
            State::Refused => 5,
        }
    }

    fn of(code: i64) -> State {
        match code {
            0 => State::Unconfirmed,
            1 => State::Pending,
            2 => State::Cancelled,
            3 => State::Done,
            5 => State::Refused,
            _ => State::Parked,
        }
    }

    /// The listing a row in this state belongs to (`lst`): 1 pending, 2 parked, none.
    fn listing(self) -> Option<i64> {
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

/// What a list or a count covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// Who asks.
    pub viewer: Viewer,
    /// Pending or parked.
    pub listing: Listing,
    /// Only this destination.
    pub destination: Option<Destination>,
    /// Only due strictly after (ms since the epoch).
    pub due_after: Option<u64>,
    /// Only due strictly before (ms since the epoch).
    pub due_before: Option<u64>,
    /// Only with this user header `(key, value)`.
    pub header: Option<(String, String)>,
    /// Rows a page holds (1 to [`MAX_LIMIT`]).
    pub limit: usize,
    /// Continue after this cursor (a page's `next`).
    pub after: Option<Cursor>,
}

impl Filter {
    /// Everything `viewer` sees, pending, 100 a page.
    pub fn new(viewer: Viewer) -> Filter {
        Filter {
            viewer,
            listing: Listing::Pending,
            destination: None,
            due_after: None,
            due_before: None,
            header: None,
            limit: 100,
            after: None,
        }
    }
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The rows, by due time.
    pub rows: Vec<Row>,
    /// Where the next page starts; `None` when this one is the last.
    pub next: Option<Cursor>,
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

const SCHEMA: &str = "
CREATE TABLE names (
    nid INTEGER PRIMARY KEY,
    kind INTEGER NOT NULL,
    a TEXT NOT NULL,
    b TEXT NOT NULL,
    UNIQUE (kind, a, b)
);
CREATE TABLE records (
    rk INTEGER PRIMARY KEY,
    own INTEGER NOT NULL,
    id ANY NOT NULL,
    dest INTEGER NOT NULL,
    due INTEGER NOT NULL,
    sched INTEGER NOT NULL,
    size INTEGER NOT NULL,
    ctype INTEGER,
    state INTEGER NOT NULL,
    lst INTEGER,
    fin INTEGER,
    nev INTEGER NOT NULL,
    hdrs BLOB,
    body BLOB
);
CREATE UNIQUE INDEX by_id ON records (own, id);
CREATE INDEX by_fin ON records (fin) WHERE fin IS NOT NULL;
CREATE INDEX by_unconfirmed ON records (due) WHERE state = 0;
CREATE TABLE hdr (
    h INTEGER NOT NULL,
    due INTEGER NOT NULL,
    own INTEGER NOT NULL,
    rk INTEGER NOT NULL,
    dest INTEGER NOT NULL,
    PRIMARY KEY (h, due, own, rk)
) WITHOUT ROWID;
CREATE TABLE history (
    rk INTEGER NOT NULL,
    n INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    at INTEGER NOT NULL,
    by TEXT,
    x INTEGER,
    y INTEGER,
    PRIMARY KEY (rk, n)
) WITHOUT ROWID;
CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
";

/// The indexes pages are read from: dropped for a rebuild, made again by one sort each.
const LIST_INDEXES: &str = "
CREATE INDEX by_dest ON records (lst, dest, due, own) WHERE lst IS NOT NULL;
CREATE INDEX by_owner ON records (lst, own, due) WHERE lst IS NOT NULL;
CREATE INDEX by_due ON records (lst, due, own) WHERE lst IS NOT NULL;
";

const OWNER: i64 = 0;
const CONTENT_TYPE: i64 = 1;
const DESTINATION: i64 = 2;

// history kinds
const EV_SCHEDULED: i64 = 0;
const EV_RESCHEDULED: i64 = 1;
const EV_CANCELLED: i64 = 2;
const EV_DONE: i64 = 3;
const EV_RETRIED: i64 = 4;
const EV_PARKED: i64 = 5;

/// Interned names, both ways, bounded by [`NAME_CACHE`].
#[derive(Default)]
struct Names {
    ids: HashMap<(i64, String, String), i64>,
    names: HashMap<i64, (i64, String, String)>,
}

impl Names {
    fn remember(&mut self, nid: i64, key: (i64, String, String)) {
        if self.ids.len() >= NAME_CACHE {
            self.ids.clear();
            self.names.clear();
        }
        self.ids.insert(key.clone(), nid);
        self.names.insert(nid, key);
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.names.clear();
    }

    fn lookup(&mut self, c: &Connection, kind: i64, a: &str, b: &str) -> Result<Option<i64>> {
        let key = (kind, a.to_string(), b.to_string());
        if let Some(n) = self.ids.get(&key) {
            return Ok(Some(*n));
        }
        let nid: Option<i64> = c
            .prepare_cached("SELECT nid FROM names WHERE kind = ?1 AND a = ?2 AND b = ?3")?
            .query_row(params![kind, a, b], |r| r.get(0))
            .optional()?;
        if let Some(n) = nid {
            self.remember(n, key);
        }
        Ok(nid)
    }

    fn intern(&mut self, c: &Connection, kind: i64, a: &str, b: &str) -> Result<i64> {
        if let Some(n) = self.lookup(c, kind, a, b)? {
            return Ok(n);
        }
        c.prepare_cached("INSERT INTO names (kind, a, b) VALUES (?1, ?2, ?3)")?
            .execute(params![kind, a, b])?;
        let n = c.last_insert_rowid();
        self.remember(n, (kind, a.to_string(), b.to_string()));
        Ok(n)
    }

    fn name(&mut self, c: &Connection, nid: i64) -> Result<(String, String)> {
        if let Some((_, a, b)) = self.names.get(&nid) {
            return Ok((a.clone(), b.clone()));
        }
        let (kind, a, b): (i64, String, String) = c
            .prepare_cached("SELECT kind, a, b FROM names WHERE nid = ?1")?
            .query_row([nid], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        self.remember(nid, (kind, a.clone(), b.clone()));
        Ok((a, b))
    }
}

/// The pending index: one SQLite file.
pub struct PendingIndex {
    conn: Connection,
    names: Names,
    /// Hashes of the indexed header names' pairs are computed for these names only.
    indexed_headers: Option<Vec<String>>,
    /// A rebuild is under way: no listing indexes, no header index.
    rebuilding: bool,
}

/// What a row is now, as the writers need it.
struct Current {
    rk: i64,
    own: i64,
    dest: i64,
    due: i64,
    sched: i64,
    state: State,
    headers: Vec<(String, String)>,
    nev: i64,
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

const ROW_COLUMNS: &str = "r.rk, r.own, r.id, r.dest, r.due, r.sched, r.size, r.ctype, r.hdrs, r.state, r.body IS NOT NULL";

/// A row as read, names not yet resolved.
struct RawRow {
    rk: i64,
    own: i64,
    id: StoredId,
    dest: i64,
    due: i64,
    sched: i64,
    size: i64,
    ctype: Option<i64>,
    headers: Vec<(String, String)>,
    state: State,
    body_kept: bool,
}

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    let hdrs: Option<Vec<u8>> = r.get(8)?;
    Ok(RawRow {
        rk: r.get(0)?,
        own: r.get(1)?,
        id: r.get(2)?,
        dest: r.get(3)?,
        due: r.get(4)?,
        sched: r.get(5)?,
        size: r.get(6)?,
        ctype: r.get(7)?,
        headers: hdrs.and_then(|b| decode_headers(&b)).unwrap_or_default(),
        state: State::of(r.get(9)?),
        body_kept: r.get(10)?,
    })
}

/// How a list or count finds its rows: the resolved filter.
struct Plan {
    lst: i64,
    dest: Option<i64>,
    own: Option<i64>,
    /// The header pair's hash, when the header index has it.
    hash: Option<i64>,
    header: Option<(String, String)>,
    after: Option<Cursor>,
    due_after: Option<i64>,
    due_before: Option<i64>,
}

impl Plan {
    /// `FROM ... WHERE ...` and its parameters. `hdr` drives when the header index can, then
    /// the index of the narrowest given filter; every one of them is sorted by
    /// `(due, own, rk)` within its equality prefix, so the ORDER BY is a range scan.
    fn sql_from_where(&self, join_rows: bool) -> (String, Vec<(&'static str, Value)>) {
        let mut p: Vec<(&'static str, Value)> = Vec::new();
        let (mut sql, t) = if let Some(h) = self.hash {
            p.push((":h", Value::Integer(h)));
            let s = if join_rows {
                "FROM hdr t CROSS JOIN records r ON r.rk = t.rk WHERE t.h = :h".to_string()
            } else {
                "FROM hdr t WHERE t.h = :h".to_string()
            };
            (s, "t")
        } else {
            let index = if self.dest.is_some() {
                "by_dest"
            } else if self.own.is_some() {
                "by_owner"
            } else {
                "by_due"
            };
            (
                format!(
                    "FROM records r INDEXED BY {index} WHERE r.lst = {}",
                    self.lst
                ),
                "r",
            )
        };
        if let Some(d) = self.dest {
            sql.push_str(&format!(" AND {t}.dest = :dest"));
            p.push((":dest", Value::Integer(d)));
        }
        if let Some(o) = self.own {
            sql.push_str(&format!(" AND {t}.own = :own"));
            p.push((":own", Value::Integer(o)));
        }
        // The start: the cursor, or due_after when it starts later. `due >= :cd` is the range
        // the index seeks to (a plain column bound, which every index above starts with after
        // its equalities); the row value then skips what the cursor's millisecond already gave.
        match (self.after, self.due_after) {
            (Some(c), da) if da.is_none_or(|da| c.due > da) => {
                sql.push_str(&format!(
                    " AND {t}.due >= :cd AND ({t}.due, {t}.own, {t}.rk) > (:cd, :co, :cr)"
                ));
                p.push((":cd", Value::Integer(c.due)));
                p.push((":co", Value::Integer(c.owner)));
                p.push((":cr", Value::Integer(c.row)));
            }
            (_, Some(da)) => {
                sql.push_str(&format!(" AND {t}.due > :da"));
                p.push((":da", Value::Integer(da)));
            }
            (_, None) => {}
        }
        if let Some(db) = self.due_before {
            sql.push_str(&format!(" AND {t}.due < :db"));
            p.push((":db", Value::Integer(db)));
        }
        (sql, p)
    }

    fn order(&self) -> &'static str {
        if self.hash.is_some() {
            " ORDER BY t.due, t.own, t.rk"
        } else {
            " ORDER BY r.due, r.own, r.rk"
        }
    }
}

fn bind<'a>(p: &'a [(&'static str, Value)]) -> Vec<(&'static str, &'a dyn ToSql)> {
    p.iter().map(|(n, v)| (*n, v as &dyn ToSql)).collect()
}

impl PendingIndex {
    /// Opens (creating when missing, private: [`file`]) the index at `path`.
    pub fn open(path: &Path, options: Options) -> Result<PendingIndex> {
        let conn = file::open(path)?;
        let cache_kib = (options.cache_bytes / 1024).max(64);
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = {};
             PRAGMA cache_size = -{cache_kib};
             PRAGMA mmap_size = 0;
             PRAGMA temp_store = FILE;
             PRAGMA journal_size_limit = 67108864;
             PRAGMA soft_heap_limit = {};",
            if options.durable { "NORMAL" } else { "OFF" },
            options.cache_bytes + (16 << 20),
        ))?;
        conn.set_prepared_statement_cache_capacity(64);
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        match version {
            0 => {
                conn.execute_batch(&format!(
                    "BEGIN; {SCHEMA} {LIST_INDEXES} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
                ))?;
            }
            SCHEMA_VERSION => {}
            v => {
                return Err(Error::Store(format!(
                    "{} has schema version {v}, this build writes {SCHEMA_VERSION}: delete it and \
                     let the index rebuild from the journal",
                    path.display()
                )));
            }
        }
        let rebuilding: Option<i64> = conn
            .query_row("SELECT v FROM meta WHERE k = 'rebuilding'", [], |r| {
                r.get(0)
            })
            .optional()?;
        Ok(PendingIndex {
            conn,
            names: Names::default(),
            indexed_headers: options.indexed_headers,
            rebuilding: rebuilding.is_some(),
        })
    }

    /// Starts a rebuild from the journal's start (on an empty index, or one to be refilled):
    /// drops the listing indexes and empties the header index, so that applying is appending
    /// rows. `list` and `count` refuse until [`PendingIndex::finish_rebuild`]; `show` works.
    /// The state is in the file: a follower that restarts mid-rebuild is still rebuilding.
    pub fn begin_rebuild(&mut self) -> Result<()> {
        let tx = self.conn.transaction()?;
        tx.execute_batch(
            "DROP INDEX IF EXISTS by_dest; DROP INDEX IF EXISTS by_owner;
             DROP INDEX IF EXISTS by_due; DELETE FROM hdr;
             INSERT OR REPLACE INTO meta (k, v) VALUES ('rebuilding', 1);",
        )?;
        tx.commit()?;
        self.rebuilding = true;
        Ok(())
    }

    /// Ends a rebuild, once the follower has caught up with the journal: sorts the listing
    /// indexes and the header index into place, each in one pass.
    pub fn finish_rebuild(&mut self) -> Result<()> {
        if !self.rebuilding {
            return Ok(());
        }
        // The sorts take as much memory as the page cache is allowed: halve the cache meanwhile,
        // so the two together stay within `cache_bytes`.
        let cache: i64 = self.conn.query_row("PRAGMA cache_size", [], |r| r.get(0))?;
        self.conn
            .execute_batch(&format!("PRAGMA cache_size = {};", cache / 2))?;
        let result = self.sort_indexes();
        self.conn
            .execute_batch(&format!("PRAGMA cache_size = {cache};"))?;
        result?;
        // the rebuild's last transaction went to the WAL whole: give the space back
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        self.rebuilding = false;
        Ok(())
    }

    fn sort_indexes(&mut self) -> Result<()> {
        let tx = self.conn.transaction()?;
        // a temporary table: its pages live in a temporary file, not as free pages of the index
        tx.execute_batch(
            "DROP TABLE IF EXISTS temp.hdr_stage;
             CREATE TEMP TABLE hdr_stage (h INTEGER, due INTEGER, own INTEGER, rk INTEGER, dest INTEGER);",
        )?;
        {
            let w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: false,
            };
            let mut read = tx.prepare(
                "SELECT rk, own, due, dest, hdrs FROM records WHERE lst = 1 AND hdrs IS NOT NULL",
            )?;
            let mut rows = read.query([])?;
            let mut put = tx.prepare(
                "INSERT INTO hdr_stage (h, due, own, rk, dest) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            while let Some(r) = rows.next()? {
                let (rk, own, due, dest): (i64, i64, i64, i64) =
                    (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?);
                let b: Vec<u8> = r.get(4)?;
                for h in w.hashes(&decode_headers(&b).unwrap_or_default()) {
                    put.execute(params![h, due, own, rk, dest])?;
                }
            }
        }
        tx.execute_batch(&format!(
            "DELETE FROM hdr;
             INSERT INTO hdr (h, due, own, rk, dest)
                 SELECT h, due, own, rk, dest FROM hdr_stage ORDER BY h, due, own, rk;
             DROP TABLE temp.hdr_stage;
             {LIST_INDEXES}
             DELETE FROM meta WHERE k = 'rebuilding';"
        ))?;
        tx.commit()?;
        Ok(())
    }

    /// Whether a rebuild is under way ([`PendingIndex::begin_rebuild`]).
    pub fn rebuilding(&self) -> bool {
        self.rebuilding
    }

    fn check_not_rebuilding(&self) -> Result<()> {
        if self.rebuilding {
            return Err(Error::Store(
                "the index is being rebuilt from the journal; pages and counts come back when \
                 it has caught up"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Applies `entries` in order, in one transaction.
    pub fn apply(&mut self, entries: &[Entry]) -> Result<()> {
        self.apply_marked(entries, &[])
    }

    /// Applies `entries` in order and records `position` (the journal offset after the last
    /// of them) in the same transaction: after a crash the file holds both or neither.
    pub fn apply_at(&mut self, entries: &[Entry], position: u64) -> Result<()> {
        self.apply_marked(entries, &[("position", Some(position))])
    }

    /// Applies `entries` in order and sets (`Some`) or clears (`None`) each of `marks` in the
    /// same transaction: the follower's positions in its streams ([`PendingIndex::mark`]).
    /// `"position"` is the journal offset of [`PendingIndex::apply_at`]; a name is 1 to 64 bytes
    /// of `[a-z_]`.
    pub fn apply_marked(&mut self, entries: &[Entry], marks: &[(&str, Option<u64>)]) -> Result<()> {
        for (k, _) in marks {
            check_mark(k)?;
        }
        let result = (|| -> Result<()> {
            let tx = self.conn.transaction()?;
            let mut w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: self.rebuilding,
            };
            for e in entries {
                w.apply(e)?;
            }
            for (k, v) in marks {
                match v {
                    Some(v) => {
                        tx.prepare_cached("INSERT OR REPLACE INTO meta (k, v) VALUES (?1, ?2)")?
                            .execute(params![k, ms(*v, "a stream position")?])?;
                    }
                    None => {
                        tx.prepare_cached("DELETE FROM meta WHERE k = ?1")?
                            .execute([k])?;
                    }
                }
            }
            tx.commit()?;
            Ok(())
        })();
        if result.is_err() {
            self.names.clear();
        }
        result
    }

    /// A mark [`PendingIndex::apply_marked`] set (`None`: never, or cleared).
    pub fn mark(&self, key: &str) -> Result<Option<u64>> {
        check_mark(key)?;
        let v: Option<i64> = self
            .conn
            .query_row("SELECT v FROM meta WHERE k = ?1", [key], |r| r.get(0))
            .optional()?;
        Ok(v.map(|v| v as u64))
    }

    /// The journal offset applied so far (`None`: nothing yet; rebuild from the start).
    pub fn position(&self) -> Result<Option<u64>> {
        let v: Option<i64> = self
            .conn
            .query_row("SELECT v FROM meta WHERE k = 'position'", [], |r| r.get(0))
            .optional()?;
        Ok(v.map(|v| v as u64))
    }

    /// Records the journal offset applied so far (for a stretch of the journal with nothing
    /// for the index).
    pub fn set_position(&mut self, position: u64) -> Result<()> {
        set_position(&self.conn, position)
    }

    /// Every message named `id` that `viewer` sees, with body and history: at most one for a
    /// user; for an admin, one per owner who used the id.
    pub fn show(&mut self, id: &str, viewer: &Viewer) -> Result<Vec<Record>> {
        check_id(id)?;
        let owners: Vec<i64> = match viewer {
            Viewer::User(u) => self
                .names
                .lookup(&self.conn, OWNER, u, "")?
                .into_iter()
                .collect(),
            Viewer::Admin => self
                .conn
                .prepare_cached("SELECT nid FROM names WHERE kind = ?1")?
                .query_map([OWNER], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        };
        let sid = StoredId::of(id);
        let mut out = Vec::new();
        for own in owners {
            let found = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {ROW_COLUMNS}, r.body FROM records r WHERE r.own = ?1 AND r.id = ?2"
                ))?
                .query_row(params![own, sid], |r| {
                    Ok((raw_row(r)?, r.get::<_, Option<Vec<u8>>>(11)?))
                })
                .optional()?;
            if let Some((raw, body)) = found {
                let history = self.history(&raw)?;
                out.push(Record {
                    row: self.resolve(raw)?,
                    body,
                    history,
                });
            }
        }
        out.sort_by_key(|r| r.row.cursor);
        Ok(out)
    }

    fn history(&self, raw: &RawRow) -> Result<Vec<Event>> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT kind, at, by, x, y FROM history WHERE rk = ?1 ORDER BY n")?;
        let rows = stmt.query_map([raw.rk], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, Option<String>>(2)?.unwrap_or_default(),
                r.get::<_, Option<i64>>(3)?.unwrap_or(0) as u64,
                r.get::<_, Option<i64>>(4)?.unwrap_or(0) as u64,
            ))
        })?;
        let mut events = Vec::new();
        for row in rows {
            let (kind, at_ms, by, x, y) = row?;
            events.push(match kind {
                EV_SCHEDULED => Event::Scheduled {
                    at_ms,
                    due_at_ms: x,
                },
                EV_RESCHEDULED => Event::Rescheduled {
                    at_ms,
                    by,
                    from_due_at_ms: x,
                    to_due_at_ms: y,
                },
                EV_CANCELLED => Event::Cancelled { at_ms, by },
                EV_DONE | EV_RETRIED | EV_PARKED => Event::Ran {
                    at_ms,
                    lateness_ms: x,
                    outcome: match kind {
                        EV_DONE => Outcome::Done,
                        EV_RETRIED => Outcome::Retried { next_due_at_ms: y },
                        _ => Outcome::Parked,
                    },
                },
                _ => continue,
            });
        }
        // The first schedule is the row itself until a second schedule of the id wrote both
        // into the history.
        if !events.iter().any(|e| matches!(e, Event::Scheduled { .. })) {
            events.insert(
                0,
                Event::Scheduled {
                    at_ms: raw.sched as u64,
                    due_at_ms: first_due(&self.conn, raw.rk, raw.due)? as u64,
                },
            );
        }
        // by time (stable: events of one millisecond stay in the order they were applied)
        events.sort_by_key(Event::at_ms);
        Ok(events)
    }

    fn resolve(&mut self, raw: RawRow) -> Result<Row> {
        let owner = self.names.name(&self.conn, raw.own)?.0;
        let (exchange, routing_key) = self.names.name(&self.conn, raw.dest)?;
        let content_type = match raw.ctype {
            Some(c) => Some(self.names.name(&self.conn, c)?.0),
            None => None,
        };
        Ok(Row {
            id: raw.id.text(),
            owner,
            destination: Destination::from_parts(exchange, routing_key),
            due_at_ms: raw.due as u64,
            scheduled_at_ms: raw.sched as u64,
            size: raw.size as u64,
            content_type,
            headers: raw.headers,
            state: raw.state,
            body_kept: raw.body_kept,
            cursor: Cursor {
                due: raw.due,
                owner: raw.own,
                row: raw.rk,
            },
        })
    }

    /// `filter` resolved against the file; `None` when a name in it is unknown, so nothing
    /// can match.
    fn plan(&mut self, f: &Filter) -> Result<Option<Plan>> {
        let due_after = f.due_after.map(|v| ms(v, "due_after")).transpose()?;
        let due_before = f.due_before.map(|v| ms(v, "due_before")).transpose()?;
        if let (Some(a), Some(b)) = (due_after, due_before)
            && a >= b
        {
            return Err(Error::Invalid(format!(
                "due_after ({a}) must come before due_before ({b})"
            )));
        }
        if let Some((k, _)) = &f.header
            && k.is_empty()
        {
            return Err(Error::Invalid("a header filter needs a name: K=V".into()));
        }
        let own = match &f.viewer {
            Viewer::Admin => None,
            Viewer::User(u) => {
                check_user(u, "the viewer's user name")?;
                match self.names.lookup(&self.conn, OWNER, u, "")? {
                    Some(o) => Some(o),
                    None => return Ok(None),
                }
            }
        };
        let dest = match &f.destination {
            None => None,
            Some(d) => {
                let (a, b) = d.parts();
                match self.names.lookup(&self.conn, DESTINATION, a, b)? {
                    Some(n) => Some(n),
                    None => return Ok(None),
                }
            }
        };
        let lst = match f.listing {
            Listing::Pending => 1,
            Listing::Parked => 2,
        };
        let hash = match &f.header {
            Some((k, v)) if lst == 1 && indexed(self.indexed_headers.as_deref(), k) => {
                Some(header_hash(k, v))
            }
            _ => None,
        };
        Ok(Some(Plan {
            lst,
            dest,
            own,
            hash,
            header: f.header.clone(),
            after: f.after,
            due_after,
            due_before,
        }))
    }

    /// One page of what `filter` covers, sorted by due time, after `filter.after`.
    pub fn list(&mut self, filter: &Filter) -> Result<Page> {
        self.check_not_rebuilding()?;
        if filter.limit == 0 || filter.limit > MAX_LIMIT {
            return Err(Error::Invalid(format!(
                "a page holds 1 to {MAX_LIMIT} rows, not {}",
                filter.limit
            )));
        }
        let Some(plan) = self.plan(filter)? else {
            return Ok(Page {
                rows: Vec::new(),
                next: None,
            });
        };
        let (fw, p) = plan.sql_from_where(true);
        let sql = format!("SELECT {ROW_COLUMNS} {fw}{}", plan.order());
        let mut raws = Vec::with_capacity(filter.limit + 1);
        {
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(&*bind(&p))?;
            while let Some(r) = rows.next()? {
                let raw = raw_row(r)?;
                if let Some(h) = &plan.header
                    && !raw.headers.contains(h)
                {
                    continue;
                }
                raws.push(raw);
                if raws.len() > filter.limit {
                    break;
                }
            }
        }
        let more = raws.len() > filter.limit;
        raws.truncate(filter.limit);
        let rows = raws
            .into_iter()
            .map(|r| self.resolve(r))
            .collect::<Result<Vec<_>>>()?;
        let next = if more {
            rows.last().map(|r| r.cursor)
        } else {
            None
        };
        Ok(Page { rows, next })
    }

    /// How many rows `filter` covers, whatever its cursor and limit: what a purge would cancel.
    /// An index-only range count (the header index's hash is trusted; see `header_hash`),
    /// except a header filter on parked rows or on a header not indexed, which reads each row
    /// of the other filters' range.
    pub fn count(&mut self, filter: &Filter) -> Result<u64> {
        self.check_not_rebuilding()?;
        let Some(mut plan) = self.plan(filter)? else {
            return Ok(0);
        };
        plan.after = None;
        if let (Some(h), None) = (&plan.header, plan.hash) {
            let (fw, p) = plan.sql_from_where(true);
            let sql = format!("SELECT r.hdrs {fw}");
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(&*bind(&p))?;
            let mut n = 0;
            while let Some(r) = rows.next()? {
                let b: Option<Vec<u8>> = r.get(0)?;
                if b.and_then(|b| decode_headers(&b))
                    .is_some_and(|hs| hs.contains(h))
                {
                    n += 1;
                }
            }
            return Ok(n);
        }
        let (fw, p) = plan.sql_from_where(false);
        let sql = format!("SELECT count(*) {fw}");
        let n: i64 = self
            .conn
            .prepare_cached(&sql)?
            .query_row(&*bind(&p), |r| r.get(0))?;
        Ok(n as u64)
    }

    /// Removes what finished (cancelled or done) before `now_ms - window_ms`, and intents never
    /// confirmed whose due time is that old; returns how many. Parked messages stay until they
    /// leave their parking queue. Works in transactions of [`EXPIRE_CHUNK`] rows.
    pub fn expire(&mut self, window_ms: u64, now_ms: u64) -> Result<u64> {
        let cut = ms(now_ms, "now")?.saturating_sub(ms(window_ms, "the history window")?);
        let mut removed = 0u64;
        loop {
            let tx = self.conn.transaction()?;
            let victims: Vec<(i64, i64, i64, Option<Vec<u8>>)> = {
                let mut stmt = tx.prepare_cached(
                    "SELECT rk, own, due, NULL FROM records INDEXED BY by_fin WHERE fin < ?1 \
                     LIMIT ?2",
                )?;
                let mut v: Vec<_> = stmt
                    .query_map(params![cut, EXPIRE_CHUNK as i64], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })?
                    .collect::<rusqlite::Result<_>>()?;
                let left = EXPIRE_CHUNK - v.len();
                if left > 0 {
                    let mut stmt = tx.prepare_cached(
                        "SELECT rk, own, due, hdrs FROM records INDEXED BY by_unconfirmed \
                         WHERE state = 0 AND due < ?1 LIMIT ?2",
                    )?;
                    v.extend(
                        stmt.query_map(params![cut, left as i64], |r| {
                            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                        })?
                        .collect::<rusqlite::Result<Vec<_>>>()?,
                    );
                }
                v
            };
            let w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: self.rebuilding,
            };
            for (rk, own, due, hdrs) in &victims {
                if let Some(b) = hdrs {
                    let headers = decode_headers(b).unwrap_or_default();
                    w.hdr_remove(*rk, *due, *own, &headers)?;
                }
                tx.prepare_cached("DELETE FROM history WHERE rk = ?1")?
                    .execute([rk])?;
                tx.prepare_cached("DELETE FROM records WHERE rk = ?1")?
                    .execute([rk])?;
            }
            tx.commit()?;
            removed += victims.len() as u64;
            if victims.len() < EXPIRE_CHUNK {
                return Ok(removed);
            }
        }
    }
}

fn set_position(c: &Connection, position: u64) -> Result<()> {
    c.prepare_cached("INSERT OR REPLACE INTO meta (k, v) VALUES ('position', ?1)")?
        .execute([ms(position, "the journal position")?])?;
    Ok(())
}

/// The due time `rk` was first given: before its first reschedule, or `due` when none.
fn first_due(c: &Connection, rk: i64, due: i64) -> Result<i64> {
    Ok(
        c.prepare_cached("SELECT x FROM history WHERE rk = ?1 AND kind = ?2 ORDER BY n LIMIT 1")?
            .query_row(params![rk, EV_RESCHEDULED], |r| r.get(0))
            .optional()?
            .unwrap_or(due),
    )
}

fn indexed(names: Option<&[String]>, k: &str) -> bool {
    names.is_none_or(|n| n.iter().any(|x| x == k))
}

/// Applies entries inside one transaction.
struct Writer<'a> {
    tx: &'a Transaction<'a>,
    names: &'a mut Names,
    indexed_headers: Option<&'a [String]>,
    /// Leave the header index alone: `finish_rebuild` makes it from the rows.
    rebuilding: bool,
}

impl Writer<'_> {
    fn apply(&mut self, e: &Entry) -> Result<()> {
        match e {
            Entry::Scheduled(s) => self.schedule(s),
            Entry::Purged(p) => self.purge(p).map(|_| ()),
            Entry::Refused {
                owner,
                id,
                scheduled_at_ms,
            } => {
                if let Some(cur) = self.current(owner, id)?
                    && cur.state == State::Unconfirmed
                    && cur.sched == ms(*scheduled_at_ms, "a schedule time")?
                {
                    self.move_to(&cur, State::Refused, cur.due, Some(cur.sched))?;
                }
                Ok(())
            }
            Entry::Confirmed { owner, id } => {
                if let Some(cur) = self.current(owner, id)?
                    && cur.state == State::Unconfirmed
                {
                    self.tx
                        .prepare_cached("UPDATE records SET state = 1 WHERE rk = ?1")?
                        .execute([cur.rk])?;
                }
                Ok(())
            }
            Entry::Cancelled {
                owner,
                id,
                by,
                at_ms,
            } => {
                check_id(id)?;
                let at = ms(*at_ms, "a cancel's time")?;
                let targets = self.targets(owner.as_deref(), id)?;
                for cur in targets {
                    // a cancel of what already ran or was parked is too late: nothing changes
                    if cur.state.listing() == Some(1) {
                        self.event(&cur, EV_CANCELLED, at, Some(by), None, None)?;
                        self.move_to(&cur, State::Cancelled, cur.due, Some(at))?;
                    }
                }
                Ok(())
            }
            Entry::Ran {
                owner,
                id,
                at_ms,
                lateness_ms,
                outcome,
            } => {
                let Some(cur) = self.current(owner, id)? else {
                    return Ok(());
                };
                let at = ms(*at_ms, "a run's time")?;
                let replay: Option<i64> = self
                    .tx
                    .prepare_cached(
                        "SELECT 1 FROM history WHERE rk = ?1 AND at = ?2 AND kind IN (3, 4, 5)",
                    )?
                    .query_row(params![cur.rk, at], |r| r.get(0))
                    .optional()?;
                if replay.is_some() {
                    return Ok(());
                }
                let late = ms(*lateness_ms, "a lateness")?;
                let (kind, next, state, due, fin) = match outcome {
                    Outcome::Done => (EV_DONE, None, State::Done, cur.due, Some(at)),
                    Outcome::Retried { next_due_at_ms } => {
                        let next = ms(*next_due_at_ms, "a retry's due time")?;
                        (EV_RETRIED, Some(next), State::Pending, next, None)
                    }
                    Outcome::Parked => (EV_PARKED, None, State::Parked, cur.due, None),
                };
                self.event(&cur, kind, at, None, Some(late), next)?;
                self.move_to(&cur, state, due, fin)
            }
            Entry::Rescheduled {
                owner,
                id,
                due_at_ms,
                by,
                at_ms,
            } => {
                let due = ms(*due_at_ms, "a due time")?;
                let at = ms(*at_ms, "a reschedule's time")?;
                for cur in self.targets(owner.as_deref(), id)? {
                    if cur.state.listing() == Some(1) && cur.due != due {
                        self.event(&cur, EV_RESCHEDULED, at, Some(by), Some(cur.due), Some(due))?;
                        self.move_to(&cur, cur.state, due, None)?;
                    }
                }
                Ok(())
            }
        }
    }

    fn schedule(&mut self, s: &Scheduled) -> Result<()> {
        check_id(&s.id)?;
        check_user(&s.owner, "a message's owner")?;
        let (ex, rkey) = s.destination.parts();
        if rkey.is_empty() && ex.is_empty() {
            return Err(Error::Invalid(format!(
                "message '{}' has no destination",
                s.id
            )));
        }
        let due = ms(s.due_at_ms, "a due time")?;
        let sched = ms(s.scheduled_at_ms, "a schedule time")?;
        let size = ms(s.size, "a size")?;
        let own = self.names.intern(self.tx, OWNER, &s.owner, "")?;
        let dest = self.names.intern(self.tx, DESTINATION, ex, rkey)?;
        let ctype = match &s.content_type {
            Some(c) => Some(self.names.intern(self.tx, CONTENT_TYPE, c, "")?),
            None => None,
        };
        let sid = StoredId::of(&s.id);
        let hdrs = (!s.headers.is_empty()).then(|| encode_headers(&s.headers));
        let state = if s.confirmed {
            State::Pending
        } else {
            State::Unconfirmed
        };
        match self.current_of(own, &sid)? {
            None => {
                self.tx
                    .prepare_cached(
                        "INSERT INTO records (own, id, dest, due, sched, size, ctype, state, lst, \
                         fin, nev, hdrs, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 1, NULL, 0, \
                         ?9, ?10)",
                    )?
                    .execute(params![
                        own,
                        sid,
                        dest,
                        due,
                        sched,
                        size,
                        ctype,
                        state.code(),
                        hdrs,
                        s.body
                    ])?;
                let rk = self.tx.last_insert_rowid();
                self.hdr_insert(rk, due, own, dest, &s.headers)
            }
            Some(cur) if cur.sched == sched => {
                // the same record again (a replay): only a confirm adds anything
                if s.confirmed && cur.state == State::Unconfirmed {
                    self.tx
                        .prepare_cached("UPDATE records SET state = 1 WHERE rk = ?1")?
                        .execute([cur.rk])?;
                }
                Ok(())
            }
            Some(cur) => {
                // A new schedule of the id: both schedules go into the history (the first
                // one only now, as until here the row itself told it).
                let has_first: Option<i64> = self
                    .tx
                    .prepare_cached("SELECT 1 FROM history WHERE rk = ?1 AND kind = ?2 LIMIT 1")?
                    .query_row(params![cur.rk, EV_SCHEDULED], |r| r.get(0))
                    .optional()?;
                let mut cur = cur;
                if has_first.is_none() {
                    let first = first_due(self.tx, cur.rk, cur.due)?;
                    self.event(&cur, EV_SCHEDULED, cur.sched, None, Some(first), None)?;
                    cur.nev += 1;
                }
                self.event(&cur, EV_SCHEDULED, sched, None, Some(due), None)?;
                if cur.state.listing() == Some(1) {
                    self.hdr_remove(cur.rk, cur.due, cur.own, &cur.headers)?;
                }
                self.tx
                    .prepare_cached(
                        "UPDATE records SET dest = ?2, due = ?3, sched = ?4, size = ?5, ctype = ?6, \
                         state = ?7, lst = 1, fin = NULL, hdrs = ?8, body = ?9 WHERE rk = ?1",
                    )?
                    .execute(params![
                        cur.rk,
                        dest,
                        due,
                        sched,
                        size,
                        ctype,
                        state.code(),
                        hdrs,
                        s.body
                    ])?;
                self.hdr_insert(cur.rk, due, own, dest, &s.headers)
            }
        }
    }

    /// The row of `owner`'s message `id`, or of every owner's when `owner` is `None`.
    fn targets(&mut self, owner: Option<&str>, id: &str) -> Result<Vec<Current>> {
        check_id(id)?;
        let Some(o) = owner else {
            let owners: Vec<i64> = self
                .tx
                .prepare_cached("SELECT nid FROM names WHERE kind = ?1")?
                .query_map([OWNER], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            let mut v = Vec::new();
            for own in owners {
                v.extend(self.current_of(own, &StoredId::of(id))?);
            }
            return Ok(v);
        };
        Ok(self.current(o, id)?.into_iter().collect())
    }

    fn current(&mut self, owner: &str, id: &str) -> Result<Option<Current>> {
        check_id(id)?;
        match self.names.lookup(self.tx, OWNER, owner, "")? {
            Some(own) => self.current_of(own, &StoredId::of(id)),
            None => Ok(None),
        }
    }

    fn current_of(&self, own: i64, id: &StoredId) -> Result<Option<Current>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT rk, dest, due, sched, state, hdrs, nev FROM records \
                 WHERE own = ?1 AND id = ?2",
            )?
            .query_row(params![own, id], |r| {
                let hdrs: Option<Vec<u8>> = r.get(5)?;
                Ok(Current {
                    rk: r.get(0)?,
                    own,
                    dest: r.get(1)?,
                    due: r.get(2)?,
                    sched: r.get(3)?,
                    state: State::of(r.get(4)?),
                    headers: hdrs.and_then(|b| decode_headers(&b)).unwrap_or_default(),
                    nev: r.get(6)?,
                })
            })
            .optional()?)
    }

    /// Appends one history event to `cur` (its `nev + 1`-th).
    fn event(
        &self,
        cur: &Current,
        kind: i64,
        at: i64,
        by: Option<&str>,
        x: Option<i64>,
        y: Option<i64>,
    ) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO history (rk, n, kind, at, by, x, y) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?
            .execute(params![cur.rk, cur.nev + 1, kind, at, by, x, y])?;
        self.tx
            .prepare_cached("UPDATE records SET nev = nev + 1 WHERE rk = ?1")?
            .execute([cur.rk])?;
        Ok(())
    }

    /// Moves `cur` to `state` and `due`, keeping the listing and header indexes in step.
    fn move_to(&self, cur: &Current, state: State, due: i64, fin: Option<i64>) -> Result<()> {
        let was = cur.state.listing() == Some(1);
        let is = state.listing() == Some(1);
        if was && (!is || due != cur.due) {
            self.hdr_remove(cur.rk, cur.due, cur.own, &cur.headers)?;
        }
        self.tx
            .prepare_cached(
                "UPDATE records SET state = ?2, lst = ?3, due = ?4, fin = ?5 WHERE rk = ?1",
            )?
            .execute(params![cur.rk, state.code(), state.listing(), due, fin])?;
        if is && (!was || due != cur.due) {
            self.hdr_insert(cur.rk, due, cur.own, cur.dest, &cur.headers)?;
        }
        Ok(())
    }

    fn hashes(&self, headers: &[(String, String)]) -> Vec<i64> {
        let mut h: Vec<i64> = headers
            .iter()
            .filter(|(k, _)| indexed(self.indexed_headers, k))
            .map(|(k, v)| header_hash(k, v))
            .collect();
        h.sort_unstable();
        h.dedup();
        h
    }

    fn hdr_insert(
        &self,
        rk: i64,
        due: i64,
        own: i64,
        dest: i64,
        headers: &[(String, String)],
    ) -> Result<()> {
        if self.rebuilding {
            return Ok(());
        }
        for h in self.hashes(headers) {
            self.tx
                .prepare_cached(
                    "INSERT OR IGNORE INTO hdr (h, due, own, rk, dest) VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![h, due, own, rk, dest])?;
        }
        Ok(())
    }

    fn hdr_remove(&self, rk: i64, due: i64, own: i64, headers: &[(String, String)]) -> Result<()> {
        if self.rebuilding {
            return Ok(());
        }
        for h in self.hashes(headers) {
            self.tx
                .prepare_cached(
                    "DELETE FROM hdr WHERE h = ?1 AND due = ?2 AND own = ?3 AND rk = ?4",
                )?
                .execute(params![h, due, own, rk])?;
        }
        Ok(())
    }
}
