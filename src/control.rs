//! The control stream `<prefix>.control`: an append-only, replicated log (a RabbitMQ stream,
//! written and read through [`crate::stream_log`]) of what the topology needs to remember
//! besides messages: the gateway pairs and batch markers declared under the prefix (so
//! `teardown` finds their queues without a configuration), cancellations (tombstones), and the
//! barriers and checkpoints of the followers that read them (`cancel`). Records are JSON
//! bodies; reading never removes them (streams are read by offset), and the broker drops them
//! after `x-max-age`.

use lapin::Connection;
use serde::{Deserialize, Serialize};

use crate::broker;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::recurring::{self, Book};
use crate::settings::TrustSettings;
use crate::stream_log::{LogRecord, StreamLog, skipped};
use crate::trust::Trust;

pub use crate::stream_log::{Entry, Start, Tail};
crate::stream_log::tail_api!(Record);

/// What the control stream is called in errors and metrics.
pub(crate) const KIND: &str = "control stream";

/// The longest message id: AMQP's `message-id` is a short string (what `Publisher::cancel`
/// accepts too). A tombstone naming a longer or an empty id is no canceller's, and is skipped.
pub(crate) const MAX_ID_BYTES: usize = 255;
/// Tombstones in one record, at most: what a bulk cancel (`Publisher::cancel_all`) and a
/// checkpoint part put in one. A record with more is no writer's of ours, and is skipped.
pub(crate) const MAX_ITEMS: usize = 1_000;
/// The longest record worth decoding: [`MAX_ITEMS`] tombstones of [`MAX_ID_BYTES`]-byte ids
/// each escaped to six bytes a byte (JSON's `\u00XX`, the worst case) with their `until`
/// (1 000 × 1 556 bytes ≈ 1.5 MiB), rounded up. A gateway pair or a batch marker is far less.
pub(crate) const MAX_RECORD_BYTES: usize = 2 * 1024 * 1024;
/// Names of gateway pairs and batch markers [`read_all`] keeps, at most: far more than a
/// topology has destinations and pairs; a stream flooded with distinct names is forged.
pub(crate) const MAX_NAMED: usize = 100_000;

/// Records in the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// A gateway pair was declared under this prefix.
    GatewayPair {
        /// Ingress exchange.
        ingress: String,
        /// Target exchange.
        target: String,
        /// The users whose ingress messages the pair delivers to its target (besides
        /// `trust.admins`): for a pair `delay-proxy` registers, the client's user that
        /// declared the exchange (the broker let it configure the target). Empty: every user
        /// the broker lets write the ingress (a pair an operator declared). A pair's writers
        /// are those of every record of it since its last end.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        writers: Vec<String>,
        /// The virtual host the pair was asked for in (`delay-proxy`: the client's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vhost: Option<String>,
    },
    /// A gateway pair ended: `delay-proxy` deleted its ingress exchange and queues after a
    /// client deleted its target (an `x-delayed-message` exchange). Gateways stop serving it;
    /// a later [`Record::GatewayPair`] of the same names registers it again.
    GatewayPairEnded {
        /// Ingress exchange.
        ingress: String,
        /// Target exchange.
        target: String,
        /// The client's user whose delete of the target ended it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
        /// The virtual host it was deleted in.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vhost: Option<String>,
    },
    /// A worker declared the batch marker of `queue` (so `teardown` removes it).
    BatchMarker {
        /// The destination queue.
        queue: String,
    },
    /// A reader's marker: everything before it has been read.
    Barrier {
        /// Unique per read.
        nonce: String,
    },
    /// The message `id` must not run: no worker, gateway or relay executes or forwards it.
    Cancel {
        /// The cancelled message id.
        id: String,
        /// When the tombstone is forgotten: once the message can no longer fall due (its due
        /// time, or the latest it could have, plus the retry horizon), ms since the epoch.
        until_ms: u64,
        /// Its due time, when the canceller knew it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        due_at_ms: Option<u64>,
    },
    /// Every matching message scheduled before `scheduled_before_ms` must not run: honoured
    /// like a cancel by every worker, gateway and relay (`pending purge`). A purge written by
    /// a user who is no admin covers only that user's messages (`owner` is then ignored); an
    /// admin's covers `owner`'s, or everyone's when it names none ([`crate::trust`]).
    Purge(Purge),
    /// Message `id` is to run at `due_at_ms` instead (`pending reschedule`): the copy that
    /// arrives before is sent round the tiers again, one that arrives after is acked without
    /// running (an earlier copy was published from the journal's kept body). Of the writer's
    /// own message, or, written by an admin, of `owner`'s (anyone's when `None`).
    Reschedule {
        /// The reschedule as asked (its fields sit flat beside `until_ms` on the wire).
        #[serde(flatten)]
        to: Reschedule,
        /// When the record is forgotten: the later of the old and the new due time, plus the
        /// horizon.
        until_ms: u64,
    },
    /// Many cancels in one record (a bulk cancel): each `[id, until_ms]`.
    Cancels {
        /// The tombstones.
        items: Vec<(String, u64)>,
    },
    /// A follower starts a checkpoint: the parts that follow (same nonce) hold every tombstone
    /// it had read when it read this record back, so a follower that starts later needs the
    /// stream only from here (see [`crate::cancel`]).
    CheckpointBegin {
        /// Unique per checkpoint.
        nonce: String,
    },
    /// One part of a checkpoint: tombstones `[id, until_ms]` as of its begin record, all
    /// written by the user `by` (a cancel stops only its writer's messages, see
    /// [`crate::trust`]).
    Checkpoint {
        /// The nonce of its begin record.
        nonce: String,
        /// This part's number, from 0.
        part: u32,
        /// How many parts the checkpoint has (at least 1).
        parts: u32,
        /// The tombstones.
        items: Vec<(String, u64)>,
        /// Who wrote the cancels of these tombstones (empty in a checkpoint written before
        /// cancels had owners: none of its tombstones counts).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        by: String,
        /// Purges live as of its begin record (whoever wrote them; each names its writer).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        purges: Vec<HeldPurge>,
        /// Reschedules live as of its begin record.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        moves: Vec<Move>,
    },
    /// A recurring schedule is added, or replaced: its writer's ([`crate::recurring`]).
    RecurringAdd(recurring::Add),
    /// A recurring schedule is paused, resumed or removed: its writer's, or an admin's of
    /// anyone's.
    RecurringSet(recurring::Set),
    /// A scheduler published a schedule's occurrences up to a tick.
    RecurringMark(recurring::Mark),
    /// A scheduler restated a live schedule before the stream drops its add.
    RecurringKeep(recurring::Keep),
    /// A scheduler published the occurrences of many schedules up to their ticks: one
    /// round's marks.
    RecurringMarks(recurring::Marks),
}

/// What a purge covers, as its writer asks it: messages of one destination queue, due in a
/// range, with a header, of one owner (an admin's). Parsed once where it is asked (the
/// console's form, the `pending` API's JSON, the CLI's flags) and carried unchanged into the
/// record, [`Purge`], which adds only what the publisher knows when it writes
/// ([`crate::Publisher::purge`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PurgeScope {
    /// The destination queue (a gateway's due queue for a gateway's messages).
    pub queue: String,
    /// Whose messages (an admin's purge only; `None`: everyone's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Only messages due strictly after (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_after_ms: Option<u64>,
    /// Only messages due strictly before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_before_ms: Option<u64>,
    /// Only messages with this user header (its value as text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<(String, String)>,
}

impl PurgeScope {
    /// Every message of `queue`, no filter.
    pub fn queue(queue: impl Into<String>) -> PurgeScope {
        PurgeScope {
            queue: queue.into(),
            owner: None,
            due_after_ms: None,
            due_before_ms: None,
            header: None,
        }
    }

    /// Why no writer of ours asks this, if none does: a queue of no name or over 255 bytes,
    /// an owner or header name over 255 bytes, a header value over
    /// [`MAX_PURGE_HEADER_VALUE`].
    pub fn check(&self) -> Result<(), String> {
        let long = |s: &str| s.len() > MAX_ID_BYTES;
        let (name, value) = self
            .header
            .as_ref()
            .map_or((1, 0), |(k, v)| (k.len(), v.len()));
        if self.queue.is_empty() || long(&self.queue) {
            return Err(format!(
                "a purge names its queue in 1 to 255 bytes, not {}",
                self.queue.len()
            ));
        }
        if self.owner.as_deref().is_some_and(long) {
            return Err("a purge's owner is at most 255 bytes".into());
        }
        if name == 0 || name > MAX_ID_BYTES || value > MAX_PURGE_HEADER_VALUE {
            return Err(format!(
                "a purge's header is NAME=VALUE, the name 1 to 255 bytes and the value at most \
                 {MAX_PURGE_HEADER_VALUE}, not {name} and {value}"
            ));
        }
        Ok(())
    }
}

/// A reschedule as asked: message `id` is to run at `due_at_ms`. Parsed once where it is
/// asked (the console's form, `pending serve`'s JSON, the CLI's flags; a "delay from now" is
/// resolved there), its `owner` resolved against the index by the service, and written as is in
/// [`Record::Reschedule`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Reschedule {
    /// The message id.
    pub id: String,
    /// Whose message (an admin's reschedule of another owner's; `None`: the writer's own, or,
    /// written by an admin, anyone's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Its new due time (ms since the epoch).
    pub due_at_ms: u64,
}

impl Reschedule {
    /// Why no writer of ours asks this, if none does: an id of no bytes or over 255, an owner
    /// over 255 bytes.
    pub fn check(&self) -> Result<(), String> {
        if self.id.is_empty() || self.id.len() > MAX_ID_BYTES {
            return Err(format!(
                "a message id is 1 to 255 bytes, got {}",
                self.id.len()
            ));
        }
        if self.owner.as_ref().is_some_and(|o| o.len() > MAX_ID_BYTES) {
            return Err("a reschedule's owner is at most 255 bytes".into());
        }
        Ok(())
    }
}

/// A purge record: its [`PurgeScope`] as asked, and what the publisher adds when it writes.
/// On the wire the scope's fields sit beside the others (one flat JSON object, as records
/// written before the scope had a type of its own).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Purge {
    /// Unique per purge.
    pub nonce: String,
    /// What it covers.
    #[serde(flatten)]
    pub scope: PurgeScope,
    /// Only messages scheduled before (ms since the epoch): when the purge was written.
    pub scheduled_before_ms: u64,
    /// When it is forgotten: no message it covers can fall due later.
    pub until_ms: u64,
}

/// The longest header value a purge filters on: 100 purges, a checkpoint part's, fit one
/// record ([`MAX_RECORD_BYTES`]) even with every byte escaped.
pub const MAX_PURGE_HEADER_VALUE: usize = 1_024;

impl Purge {
    /// Why no writer of ours makes this purge, if none does: a nonce over 255 bytes, or a
    /// scope no writer asks ([`PurgeScope::check`]).
    pub fn check(&self) -> Result<(), String> {
        if self.nonce.len() > MAX_ID_BYTES {
            return Err(format!("a purge of a {}-byte nonce", self.nonce.len()));
        }
        self.scope.check()
    }
}

/// A purge as a follower holds it (and a checkpoint repeats it): with its writer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeldPurge {
    /// Who wrote it.
    pub by: String,
    /// The purge, its `owner` as its writer may name it (`trust`).
    #[serde(flatten)]
    pub purge: Purge,
}

/// A reschedule as a follower holds it (and a checkpoint repeats it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Move {
    /// Who wrote it.
    pub by: String,
    /// Whose message (`None`: anyone's, an admin's reschedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The message id.
    pub id: String,
    /// Its new due time.
    pub due_at_ms: u64,
    /// When it is forgotten.
    pub until_ms: u64,
}

impl LogRecord for Record {
    fn barrier(nonce: String) -> Self {
        Record::Barrier { nonce }
    }

    fn barrier_nonce(&self) -> Option<&str> {
        match self {
            Record::Barrier { nonce } => Some(nonce),
            _ => None,
        }
    }
}

/// `layout`'s control stream.
pub(crate) fn log(layout: &Layout) -> StreamLog<Record> {
    StreamLog::new(KIND, layout.control_stream(), layout, MAX_RECORD_BYTES)
}

/// Declares the control stream (idempotent).
pub(crate) async fn declare(conn: &Connection, layout: &Layout) -> Result<()> {
    log(layout)
        .declare(conn, layout.control_max_age_secs())
        .await
}

/// Appends `record` and waits for the broker's confirm (bounded); a missing stream is
/// [`crate::Error::NotDeclared`].
pub async fn append(conn: &Connection, layout: &Layout, record: &Record) -> Result<()> {
    log(layout).append(conn, record).await
}

/// Appends `records` in order, pipelined on one confirm channel (256 awaiting their confirm),
/// and waits for every confirm (each bounded): what writes many records at once (a round of
/// marks, a bulk of schedules). The first error; records after it may be appended or not.
pub async fn append_all(conn: &Connection, layout: &Layout, records: &[Record]) -> Result<()> {
    log(layout).append_all(conn, records, 256).await
}

/// The gateway pairs and batch markers in the stream, oldest first, each once (what
/// `teardown` needs; tombstones, barriers and checkpoints left out), at most [`MAX_NAMED`]; a
/// pair as its latest record says (registered, or ended by [`Record::GatewayPairEnded`]),
/// of writers `trust` lets name them (with the connection's own user: [`Trust::may_compact`]).
/// `Ok(vec![])` when the stream does not exist. Gives up only when no record arrives for a
/// while ([`crate::stream_log::READ_STALL`]).
pub async fn read_all(
    conn: &Connection,
    layout: &Layout,
    trust: &TrustSettings,
) -> Result<Vec<Record>> {
    let trust = Trust::new(crate::connection::user_of(conn), trust);
    read_named(conn, layout, |by| trust.may_compact(by)).await
}

/// [`read_all`] of every writer's records: for what only looks (`stats` lists the parking
/// queues of every pair and destination named; a record names nothing outside the prefix), never
/// for what acts on them.
pub async fn read_all_unchecked(conn: &Connection, layout: &Layout) -> Result<Vec<Record>> {
    read_named(conn, layout, |_| true).await
}

async fn read_named(
    conn: &Connection,
    layout: &Layout,
    trusted: impl Fn(Option<&str>) -> bool,
) -> Result<Vec<Record>> {
    let log = log(layout);
    if !log.exists(conn).await? {
        return Ok(Vec::new());
    }
    let nonce = log.barrier(conn).await?;
    let mut reader = log.open_reader(conn, broker::long_string("first")).await?;
    let mut named = Named::default();
    let read = reader
        .read_to_barrier(&nonce, |read| match read.record {
            Some(r) if trusted(read.by.as_deref()) => named.take(r),
            Some(r) if r.is_named() => {
                let by = read.by.as_deref().unwrap_or("no user_id");
                skipped(KIND, "untrusted", &format!("{r:?} by '{by}', no admin"));
            }
            Some(_) => {}
            // a record of a newer version, or garbage someone published: skip it
            None => tracing::debug!(stream = %log.name(), "skipping an unreadable record"),
        })
        .await;
    reader.end("read").await;
    read.map(|_| named.out)
}

/// The recurring schedules the stream's records make ([`Record::apply_to`]), each record
/// believed as far as its writer's `user_id` allows (with the connection's own user as a
/// scheduler: [`Trust::may_compact`]), and the offset of the barrier the read ended at, to
/// follow the stream from. An empty book when the stream does not exist.
///
/// With `only`, the book keeps that owner's schedules alone: what a user's
/// own `recurring serve` or `list` needs, in memory bounded by its own cap.
pub async fn read_schedules(
    conn: &Connection,
    layout: &Layout,
    trust: &TrustSettings,
    only: Option<&str>,
) -> Result<(Book, Option<u64>)> {
    let trust = Trust::new(crate::connection::user_of(conn), trust);
    let log = log(layout);
    let mut book = only.map_or_else(Book::default, Book::of_owner);
    if !log.exists(conn).await? {
        return Ok((book, None));
    }
    let nonce = log.barrier(conn).await?;
    let mut reader = log.open_reader(conn, broker::long_string("first")).await?;
    let read = reader
        .read_to_barrier(&nonce, |read| {
            if let Some(r) = read.record {
                r.apply_to(&mut book, read.by.as_deref(), &trust);
            }
        })
        .await;
    reader.end("read").await;
    read.map(|at| (book, at))
}

/// Follows the control stream from `from` (what `pending`'s index reads besides the journal:
/// cancels, purges, reschedules).
pub async fn tail(conn: &Connection, layout: &Layout, from: Start) -> Result<Tail<Record>> {
    let reader = log(layout).open_reader(conn, from.value()).await?;
    Ok(crate::stream_log::tail_of(reader))
}

/// Whether a read of the control or the ledger stream ([`read_all`], [`crate::ledger::count`])
/// failed because the broker delivered a record longer than the connection's `frame_max`
/// (anyone who may append to the stream can write one): the connection is lost. Reading again
/// on a new connection, in the same process, gets past it — the process remembers the record's
/// offset and skips it after a few tries (two or three lost connections per such record).
pub fn is_record_over_frame_max(e: &Error) -> bool {
    crate::stream_log::is_record_over_frame_max(e)
}

impl Record {
    /// A record naming objects of the topology (a gateway pair, its end, a batch marker): only
    /// trusted writers' count ([`Trust::may_compact`]).
    pub(crate) fn is_named(&self) -> bool {
        matches!(
            self,
            Record::GatewayPair { .. }
                | Record::GatewayPairEnded { .. }
                | Record::BatchMarker { .. }
        )
    }

    /// Applies a recurring schedule's record written by `by` to `book`: whether the book took
    /// it (a record about a schedule it keeps, applied). One no writer of ours makes, or whose
    /// writer may not, is skipped, logged and counted.
    pub fn apply_to(&self, book: &mut Book, by: Option<&str>, trust: &Trust) -> bool {
        let owner = self.schedule_owner(by, trust);
        let applied = match self {
            Record::RecurringAdd(a) => book.add(by, a, trust),
            Record::RecurringSet(s) => book.set(by, s, trust),
            Record::RecurringMark(m) => book.mark(by, m, trust),
            Record::RecurringMarks(m) => book.marks(by, m, trust),
            Record::RecurringKeep(k) => book.keep(by, k, trust),
            _ => return false,
        };
        if let Err(why) = applied {
            let by = by.unwrap_or("no user_id");
            skipped(KIND, "recurring", &format!("by '{by}': {why}"));
            return false;
        }
        owner.is_some_and(|o| book.keeps(o))
    }

    /// Whose schedule a recurring record written by `by` is about, as the book believes it
    /// (`None`: no recurring record, or none with a writer).
    fn schedule_owner<'a>(&'a self, by: Option<&'a str>, trust: &Trust) -> Option<&'a str> {
        match self {
            Record::RecurringAdd(_) => by,
            Record::RecurringSet(s) => match (&s.owner, by) {
                (Some(o), Some(b)) if trust.is_admin(b) => Some(o.as_str()),
                _ => by,
            },
            Record::RecurringMark(m) => Some(&m.owner),
            Record::RecurringMarks(m) => Some(&m.owner),
            Record::RecurringKeep(k) => Some(&k.owner),
            _ => None,
        }
    }

    /// What a named record is about: a pair's ingress and target (registered or ended alike),
    /// a marker's queue.
    fn name(&self) -> Option<(&str, &str)> {
        match self {
            Record::GatewayPair {
                ingress, target, ..
            }
            | Record::GatewayPairEnded {
                ingress, target, ..
            } => Some((ingress, target)),
            Record::BatchMarker { queue } => Some(("", queue)),
            _ => None,
        }
    }
}

/// The gateway pairs and batch markers of a read, each once (a pair as its latest record
/// says), at most [`MAX_NAMED`].
#[derive(Default)]
struct Named {
    /// Where each name's record is in `out`.
    seen: std::collections::HashMap<(String, String, bool), usize>,
    out: Vec<Record>,
}

impl Named {
    fn take(&mut self, r: Record) {
        let Some((a, b)) = r.name() else { return };
        let marker = matches!(r, Record::BatchMarker { .. });
        let key = (a.to_string(), b.to_string(), marker);
        if let Some(&i) = self.seen.get(&key) {
            // registered again after it ended, or ended: the latest record counts
            self.out[i] = r;
            return;
        }
        if self.out.len() >= MAX_NAMED {
            skipped(
                KIND,
                "too_many_items",
                &format!("more than {MAX_NAMED} gateway pairs and batch markers"),
            );
            return;
        }
        self.seen.insert(key, self.out.len());
        self.out.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_their_wire_form() {
        let log = log(&Layout::new("p", &Default::default()).unwrap());
        let body = log.encode(&Record::Cancels {
            items: vec![("a".into(), 5)],
        });
        assert_eq!(body, br#"{"type":"cancels","items":[["a",5]]}"#);
        let body = log.encode(&Record::barrier("n".into()));
        assert_eq!(body, br#"{"type":"barrier","nonce":"n"}"#);
        let marks = recurring::Marks::of("u", &[("r1".into(), 60), ("r2".into(), 60)], 1 << 20);
        let body = log.encode(&Record::RecurringMarks(marks[0].clone()));
        assert_eq!(
            body,
            br#"{"type":"recurring_marks","owner":"u","groups":[{"through_ms":60,"revs":["r1","r2"]}]}"#
        );
    }

    /// A purge as records carried it before its scope had a type of its own, and as they
    /// carry it now: one flat object, read and written alike (a running worker of either
    /// version reads the other's).
    #[test]
    fn a_purge_keeps_its_flat_wire_form() {
        let wire = r#"{"type":"purge","nonce":"n","queue":"q","owner":"o","due_before_ms":9,"header":["k","v"],"scheduled_before_ms":5,"until_ms":20}"#;
        let mut scope = PurgeScope::queue("q");
        scope.owner = Some("o".into());
        scope.due_before_ms = Some(9);
        scope.header = Some(("k".into(), "v".into()));
        let purge = Purge {
            nonce: "n".into(),
            scope,
            scheduled_before_ms: 5,
            until_ms: 20,
        };
        let record = Record::Purge(purge.clone());
        assert_eq!(serde_json::to_string(&record).unwrap(), wire);
        assert_eq!(serde_json::from_str::<Record>(wire).unwrap(), record);
        // a checkpoint's copy names its writer beside the same fields
        let held = HeldPurge {
            by: "alice".into(),
            purge,
        };
        let json = serde_json::to_string(&held).unwrap();
        assert!(
            json.starts_with(r#"{"by":"alice","nonce":"n","queue":"q""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<HeldPurge>(&json).unwrap(), held);
    }

    /// A reschedule as records carried it before it had a type of its own, and as they carry
    /// it now: one flat object, with or without an owner.
    #[test]
    fn a_reschedule_keeps_its_flat_wire_form() {
        let wire = r#"{"type":"reschedule","id":"m","owner":"o","due_at_ms":9,"until_ms":20}"#;
        let mut record = Record::Reschedule {
            to: Reschedule {
                id: "m".into(),
                owner: Some("o".into()),
                due_at_ms: 9,
            },
            until_ms: 20,
        };
        assert_eq!(serde_json::to_string(&record).unwrap(), wire);
        assert_eq!(serde_json::from_str::<Record>(wire).unwrap(), record);
        let wire = r#"{"type":"reschedule","id":"m","due_at_ms":9,"until_ms":20}"#;
        if let Record::Reschedule { to, .. } = &mut record {
            to.owner = None;
        }
        assert_eq!(serde_json::to_string(&record).unwrap(), wire);
        assert_eq!(serde_json::from_str::<Record>(wire).unwrap(), record);
        let long = Reschedule {
            id: "x".repeat(MAX_ID_BYTES + 1),
            owner: None,
            due_at_ms: 1,
        };
        assert!(long.check().unwrap_err().contains("1 to 255 bytes"));
    }

    #[test]
    fn the_largest_record_of_ours_fits_the_bound() {
        let id = "\u{1}".repeat(MAX_ID_BYTES);
        let items = vec![(id, u64::MAX); MAX_ITEMS];
        let body =
            log(&Layout::new("p", &Default::default()).unwrap()).encode(&Record::Cancels { items });
        assert!(body.len() <= MAX_RECORD_BYTES, "{}", body.len());
    }

    #[test]
    fn a_read_keeps_each_name_once_and_nothing_else() {
        let mut n = Named::default();
        let marker = Record::BatchMarker { queue: "q".into() };
        n.take(marker.clone());
        n.take(Record::barrier("b".into()));
        n.take(Record::Cancels { items: vec![] });
        n.take(marker.clone());
        assert_eq!(n.out, vec![marker.clone()]);
        let pair = Record::GatewayPair {
            ingress: "i".into(),
            target: "t".into(),
            writers: vec!["a".into()],
            vhost: None,
        };
        let ended = Record::GatewayPairEnded {
            ingress: "i".into(),
            target: "t".into(),
            by: None,
            vhost: None,
        };
        n.take(pair.clone());
        n.take(ended.clone());
        assert_eq!(n.out, vec![marker.clone(), ended]);
        n.take(pair.clone());
        assert_eq!(n.out, vec![marker, pair], "registered again");
        for i in 0..MAX_NAMED + 5 {
            n.take(Record::BatchMarker {
                queue: format!("q{i}"),
            });
        }
        assert_eq!(n.out.len(), MAX_NAMED);
    }
}
