//! The journal stream `<prefix>.journal`: what publishers scheduled and what workers did with
//! it, so that `pending` can list, show and steer what is waiting. A RabbitMQ stream of JSON
//! records, written and read through [`crate::stream_log`] like the control and ledger streams,
//! kept as long as the control stream (the longest delay plus a week).
//!
//! **What is written, and when.** A publisher appends one [`Record::Scheduled`] per flush (the
//! intents waiting when the first of them must be written: those of messages lingering in its
//! batcher, queued as they came, and of messages about to be published), and waits for its
//! confirm *before* it publishes them; once every message of a flush was published it names
//! the flush in the `confirmed` list of its next `Scheduled` record, or in a
//! [`Record::Confirmed`] of its own when none follows soon. So a message the broker confirmed
//! was journaled before, and a journaled message whose confirm never came (the publisher died
//! in between) is known as unconfirmed. Workers append [`Record::Ran`] records, batched, for
//! what they ran, retried, parked, cancelled or moved. Cancels, purges and reschedules are
//! control-stream records ([`crate::control::Record`]), which every worker follows.
//!
//! **Who wrote it.** Every record carries its writer's broker-checked `user_id`
//! ([`Entry::by`]); a reader believes a record as far as [`crate::trust`] says: a `Scheduled`
//! or `Confirmed` record is its writer's own (an item's `owner` counts only from a forwarder
//! or an admin: [`crate::trust::Trust::owner`]), a `Ran` record only from a user that may compact
//! ([`crate::trust::Trust::may_compact`]: the reader's own user, an admin, a peer).
//!
//! Writing never waits for a reader: the journal is read by `pending`'s index, which may be
//! down or behind without delaying anything.

use lapin::Connection;
use lapin::types::AMQPValue;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::layout::Layout;
use crate::stream_log::{LogRecord, StreamLog};

/// What the journal is called in errors and metrics.
pub(crate) const KIND: &str = "journal stream";
/// Items in one `Scheduled` or `Ran` record, at most (a larger flush is written as several).
pub const MAX_ITEMS: usize = 2_000;
/// The largest body a record keeps (`journal.max_body` is at most this).
pub const MAX_BODY_BYTES: usize = crate::settings::MAX_KEPT_BODY;
/// Bytes of kept bodies in one record, at most: a flush with more is split.
pub(crate) const MAX_RECORD_BODIES: usize = 2 << 20;
/// The longest record worth decoding: [`MAX_ITEMS`] items of the largest fields we write plus
/// [`MAX_RECORD_BODIES`] of bodies (base64), rounded up.
pub const MAX_RECORD_BYTES: usize = 16 << 20;
/// User headers an item keeps, at most; and their names' and values' lengths.
pub const MAX_HEADERS: usize = 16;
/// The longest header name an item keeps (longer ones are left out).
pub const MAX_HEADER_NAME: usize = 64;
/// The longest header value an item keeps (longer ones are cut at a character boundary).
pub const MAX_HEADER_VALUE: usize = 256;

/// Records in the journal stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// Messages a publisher is about to publish: appended, and confirmed, before their publish.
    Scheduled {
        /// The writing publisher's session (unique per publisher instance).
        session: String,
        /// The flush's number in its session, from 0.
        flush: u64,
        /// When it was written (ms since the epoch): when the messages were scheduled.
        at_ms: u64,
        /// The messages.
        items: Vec<Item>,
        /// Earlier flushes of the same session that the broker has confirmed since.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        confirmed: Vec<Flush>,
    },
    /// Flushes of `session` the broker confirmed (each with the ids it refused).
    Confirmed {
        /// The publisher's session.
        session: String,
        /// The flushes.
        flushes: Vec<Flush>,
    },
    /// What workers did with messages.
    Ran {
        /// The runs.
        items: Vec<Run>,
    },
    /// A reader's marker: everything before it has been read.
    Barrier {
        /// Unique per read.
        nonce: String,
    },
}

/// A flush whose publish ended: every item of it is scheduled but `failed` and `unsure`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flush {
    /// The flush's number.
    pub flush: u64,
    /// Ids of its items that were surely not scheduled (refused, never sent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<String>,
    /// Ids of its items whose confirm was lost: they may or may not be scheduled (a reader
    /// keeps them unconfirmed until their due time passes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsure: Vec<String>,
}

/// One scheduled message, as journaled (short names on the wire: there may be millions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// Its message id.
    pub id: String,
    /// Its owner, when a forwarder (a gateway) or an admin ([`crate::Message::for_owner`])
    /// scheduled it on someone's behalf; believed only from those (`Trust::owner`).
    #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The destination queue in the tiers (a gateway's due queue for a gateway's message).
    #[serde(rename = "q")]
    pub queue: String,
    /// A gateway's message: the target exchange it is published to when due.
    #[serde(rename = "x", default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<String>,
    /// A gateway's message: its routing key at the target.
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
    /// When it is due (ms since the epoch).
    #[serde(rename = "d")]
    pub due_ms: u64,
    /// Its body's size in bytes.
    #[serde(rename = "n")]
    pub size: u64,
    /// Its content type.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// A bounded copy of its user headers, as text ([`MAX_HEADERS`]).
    #[serde(rename = "h", default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
    /// Its body, when `journal.keep_body` and it is at most `journal.max_body` (base64).
    #[serde(
        rename = "b",
        default,
        skip_serializing_if = "Option::is_none",
        with = "body64"
    )]
    pub body: Option<Vec<u8>>,
}

/// What a worker did with a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// Its message id.
    pub id: String,
    /// Its owner, as the worker believed it ([`crate::trust::Trust::owner`]).
    #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The queue it was consumed from.
    #[serde(rename = "q")]
    pub queue: String,
    /// When it was due.
    #[serde(rename = "d")]
    pub due_ms: u64,
    /// When the worker finished with it.
    #[serde(rename = "t")]
    pub at_ms: u64,
    /// How it ended.
    #[serde(rename = "r")]
    pub outcome: RunOutcome,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunOutcome {
    /// Handled; finished.
    Done,
    /// Failed and sent round the tiers again, due at `next_due_ms`.
    Retried {
        /// When the retry falls due.
        next_due_ms: u64,
    },
    /// Parked in its parking queue.
    Parked,
    /// Acked without running: cancelled or purged.
    Cancelled,
    /// Moved later by a reschedule: sent round the tiers again, due at `due_ms`.
    Rescheduled {
        /// The new due time.
        due_ms: u64,
    },
    /// Acked without running: a reschedule moved it earlier, and its earlier copy runs.
    Superseded,
}

mod body64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match b {
            Some(b) => s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        s.map(|s| base64::engine::general_purpose::STANDARD.decode(s))
            .transpose()
            .map_err(serde::de::Error::custom)
    }
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

/// A reader's prefetch of journal records: each holds up to [`MAX_ITEMS`] messages (about
/// 230 KB without bodies), so the control stream's 2 000 would let the broker send hundreds
/// of megabytes ahead of a rebuild.
const READ_PREFETCH: u16 = 16;

/// `layout`'s journal stream.
pub(crate) fn log(layout: &Layout) -> StreamLog<Record> {
    StreamLog::new(KIND, layout.journal_stream(), layout, MAX_RECORD_BYTES)
        .with_prefetch(READ_PREFETCH)
}

/// Declares the journal stream (idempotent), kept as long as the control stream.
pub(crate) async fn declare(conn: &Connection, layout: &Layout) -> Result<()> {
    log(layout)
        .declare(conn, layout.control_max_age_secs())
        .await
}

pub use crate::stream_log::{Entry, Start, Tail};
crate::stream_log::tail_api!(Record);

/// Follows the journal from `from`. A missing stream is [`crate::Error::NotDeclared`] (run
/// `delay-publisher declare`).
pub async fn tail(conn: &Connection, layout: &Layout, from: Start) -> Result<Tail<Record>> {
    let log = log(layout);
    Ok(crate::stream_log::tail_of(
        log.open_reader(conn, from.value()).await?,
    ))
}

/// The offset the journal's next record will have (how far a reader is behind); `None` when
/// the stream holds no record.
pub async fn end_offset(conn: &Connection, layout: &Layout) -> Result<Option<u64>> {
    log(layout).end_offset(conn).await
}

/// Appends a barrier to the journal and returns its nonce: a reader that reads up to it has
/// read every record confirmed before (`pending` without an index reads up to one).
pub async fn barrier(conn: &Connection, layout: &Layout) -> Result<String> {
    log(layout).barrier(conn).await
}

/// The bounded copy of `headers` an item keeps: text and integer values of user headers (not
/// ours, not the broker's), at most [`MAX_HEADERS`], names of at most [`MAX_HEADER_NAME`]
/// bytes, values cut to [`MAX_HEADER_VALUE`].
pub(crate) fn kept_headers(headers: Option<&lapin::types::FieldTable>) -> Vec<(String, String)> {
    let Some(h) = headers else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (k, v) in h.inner() {
        let k = k.as_str();
        if out.len() >= MAX_HEADERS {
            break;
        }
        if k.len() > MAX_HEADER_NAME
            || crate::headers::is_ours(k)
            || crate::headers::is_broker_header(k)
            || crate::headers::is_routing_header(k)
        {
            continue;
        }
        if let Some(text) = header_text(v) {
            out.push((k.to_string(), cut(text, MAX_HEADER_VALUE)));
        }
    }
    out
}

/// A header's value as text, as the journal keeps it and a purge's header filter compares it:
/// strings, integers and booleans; `None` for other kinds.
pub(crate) fn header_text(v: &AMQPValue) -> Option<String> {
    Some(match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        other => crate::headers::as_int(other)?.to_string(),
    })
}

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// The bodies of `items` in bytes, as a record carries them.
pub(crate) fn body_bytes(item: &Item) -> usize {
    item.body.as_ref().map_or(0, |b| b.len().div_ceil(3) * 4)
}

/// `items` in chunks a record may hold: at most [`MAX_ITEMS`] and about
/// [`MAX_RECORD_BODIES`] of bodies each (a chunk holds at least one item).
pub(crate) fn chunks(items: Vec<Item>) -> Vec<Vec<Item>> {
    let mut out: Vec<Vec<Item>> = Vec::new();
    let mut bytes = 0;
    for item in items {
        let b = body_bytes(&item);
        match out.last_mut() {
            Some(last) if last.len() < MAX_ITEMS && bytes + b <= MAX_RECORD_BODIES => {
                bytes += b;
                last.push(item);
            }
            _ => {
                bytes = b;
                out.push(vec![item]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldTable, LongString};

    fn item(id: &str, body: Option<usize>) -> Item {
        Item {
            id: id.into(),
            owner: None,
            queue: "q".into(),
            exchange: None,
            routing_key: None,
            due_ms: 1,
            size: 0,
            content_type: None,
            headers: vec![],
            body: body.map(|n| vec![7; n]),
        }
    }

    #[test]
    fn a_record_round_trips_with_short_names_and_its_body_in_base64() {
        let mut i = item("a", Some(3));
        i.headers = vec![("tenant".into(), "x".into())];
        let r = Record::Scheduled {
            session: "s".into(),
            flush: 0,
            at_ms: 5,
            items: vec![i],
            confirmed: vec![],
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"type":"scheduled","session":"s","flush":0,"at_ms":5,"items":[{"id":"a","q":"q","d":1,"n":0,"h":[["tenant","x"]],"b":"BwcH"}]}"#
        );
        assert_eq!(serde_json::from_str::<Record>(&json).unwrap(), r);
        let ran = Record::Ran {
            items: vec![Run {
                id: "a".into(),
                owner: Some("alice".into()),
                queue: "q".into(),
                due_ms: 1,
                at_ms: 2,
                outcome: RunOutcome::Retried { next_due_ms: 9 },
            }],
        };
        let json = serde_json::to_string(&ran).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&json).unwrap(), ran);
    }

    #[test]
    fn chunks_bound_items_and_body_bytes_and_keep_every_item() {
        let items: Vec<Item> = (0..5_000).map(|i| item(&i.to_string(), None)).collect();
        let c = chunks(items);
        assert_eq!(
            c.iter().map(Vec::len).collect::<Vec<_>>(),
            [2000, 2000, 1000]
        );
        let big: Vec<Item> = (0..5)
            .map(|i| item(&i.to_string(), Some(MAX_BODY_BYTES)))
            .collect();
        let c = chunks(big);
        assert!(
            c.iter()
                .all(|c| c.iter().map(body_bytes).sum::<usize>() <= MAX_RECORD_BODIES)
        );
        assert_eq!(c.iter().map(Vec::len).sum::<usize>(), 5);
    }

    #[test]
    fn kept_headers_are_bounded_and_leave_out_ours_and_the_brokers() {
        let mut h = FieldTable::default();
        h.insert(
            "tenant".into(),
            AMQPValue::LongString(LongString::from("acme")),
        );
        h.insert("n".into(), AMQPValue::LongInt(42));
        h.insert("x-delay-owner".into(), AMQPValue::LongString("bob".into()));
        h.insert("x-death".into(), AMQPValue::LongString("d".into()));
        h.insert("CC".into(), AMQPValue::LongString("d".into()));
        h.insert("long".into(), AMQPValue::LongString("é".repeat(200).into()));
        let kept = kept_headers(Some(&h));
        let names: Vec<&str> = kept.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["long", "n", "tenant"]);
        assert!(kept[0].1.len() <= MAX_HEADER_VALUE);
        assert_eq!(kept[1].1, "42");
        let many: FieldTable = {
            let mut t = FieldTable::default();
            for i in 0..100 {
                t.insert(format!("h{i}").into(), AMQPValue::LongInt(i));
            }
            t
        };
        assert_eq!(kept_headers(Some(&many)).len(), MAX_HEADERS);
    }
}
