//! One log implementation for both streams: the control stream `<prefix>.control` (`control`,
//! `cancel`) and the ledger stream `<prefix>.ledger` (`ledger`) are RabbitMQ streams of JSON
//! records, written and read the same way through a [`StreamLog`]: declaring, appending with a
//! confirm and a timeout (a missing stream is one error, [`StreamLog::missing`], naming it),
//! reading up to a barrier, and starting from the newest compaction — a checkpoint of the
//! tombstones (`cancel`) or a snapshot of the counts (`ledger`), see [`Compaction`] — instead
//! of from the stream's first record. Records are encoded and decoded here and nowhere else.
//!
//! Reading "everything so far" uses a barrier: the reader appends a record of its own (with a
//! confirm) and reads until it sees it. Every record before the barrier was confirmed before
//! it, so nothing earlier is missed. A read gives up only when records stop arriving
//! ([`READ_STALL`]), never because the stream is long.
//!
//! Anyone allowed to write a stream can append anything, so a record is decoded only when it
//! is no larger than the stream's own records can be ([`StreamLog::max_record_bytes`]); a
//! larger one is skipped undecoded, counted (`amqp_delay_stream_records_skipped_total`) and
//! logged now and then ([`skipped`]).
//!
//! Every record appended carries the writer's user as its AMQP `user_id`, which the broker
//! checks; a reader hands each record over with that name ([`Read::by`]), and the stream's
//! followers believe a record only as far as its writer may write it ([`crate::trust`]).
//!
//! A [`Reader`] holds a lapin consumer on a channel of its own and ends the consumer before
//! closing the channel (`broker::end_consumer`), also when it is dropped.
//!
//! A record that grows past `frame_max` on delivery cannot be received at all: it ends the
//! reader's connection. After a frame error a process's readers of that stream read one
//! record at a time until they know which offset it is, then go on past it ([`poison`]).

mod poison;
mod reader;
mod tail;

pub use tail::{Entry, Start, Tail};
pub(crate) use tail::{next_entry, tail_api, tail_of};

use reader::{Credit, consume, offset_value};
pub(crate) use reader::{Reader, is_record_over_frame_max};

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::broker::{self, SharedChannel};
use crate::error::{Error, Result, ResultExt};

/// How long a read up to a barrier may go without a record arriving: a long stream takes as
/// long as it takes, a reader that gets nothing gives up.
pub(crate) const READ_STALL: Duration = Duration::from_secs(10);
/// How long an append may wait for its confirm.
pub(crate) const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the probe for the stream's end waits for its last record.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Prefetch of a reader, and how often it acks (`multiple`): acking each record made reading
/// several times slower (RabbitMQ 3.10, a scratch reader; `reader::ACK_EVERY`).
const READ_PREFETCH: u16 = 2_000;

/// The records of one stream (a serde enum, JSON on the wire), with a barrier among them.
pub(crate) trait LogRecord: Serialize + DeserializeOwned {
    /// A reader's barrier with this `nonce`.
    fn barrier(nonce: String) -> Self;
    /// The nonce, when this record is a barrier.
    fn barrier_nonce(&self) -> Option<&str>;
}

/// What a start-up read builds from the records of a stream, and whether it holds a whole
/// compaction: a record (or set of records) that stands for everything before it, so that a
/// reader needs the stream only from there ([`StreamLog::start_from_compaction`]).
pub(crate) trait Compaction {
    /// The stream's records.
    type Record: LogRecord;
    /// Takes the next record before the barrier, with its offset and writer.
    fn record(&mut self, read: Read<Self::Record>);
    /// Whether what was read since the read began holds a whole compaction.
    fn whole(&self) -> bool;
    /// The read begins again further back: forget what depends on where it began.
    fn restart(&mut self);
}

/// A new barrier's nonce.
pub(crate) fn nonce() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// Counts a record of the stream `kind` ("control stream", "ledger stream") skipped for
/// `reason` (a label of `amqp_delay_stream_records_skipped_total`), with a warning for the
/// first few of each reason and then every thousandth: a flood of forged records must not
/// flood the log as well.
pub(crate) fn skipped(kind: &str, reason: &str, detail: &dyn std::fmt::Display) {
    let stream = kind.strip_suffix(" stream").unwrap_or(kind);
    let before = crate::metrics::global().skip(stream, reason);
    if before < 10 || before.is_multiple_of(1_000) {
        tracing::warn!(
            stream,
            reason,
            skipped = before + 1,
            "skipping a record no writer of ours makes: {detail}"
        );
    }
}

/// One stream of records `R`: its name, what it is called in errors, and its prefix.
pub(crate) struct StreamLog<R> {
    /// "control stream", "ledger stream".
    kind: &'static str,
    name: String,
    prefix: String,
    /// The exchange appends go through: the topology's stream exchange.
    exchange: String,
    /// The largest record worth decoding: what the stream's largest record of ours can be.
    max_record_bytes: usize,
    /// The `user_id` on what it appends on a channel ([`StreamLog::append_on`]); an append on
    /// a connection of its own names the connection's user.
    writer: Option<String>,
    /// A reader's prefetch: records the broker sends ahead of the reader.
    prefetch: u16,
    records: PhantomData<fn() -> R>,
}

/// A record as read, with who wrote it.
#[derive(Debug)]
pub(crate) struct Read<R> {
    /// Its offset, when the broker said.
    pub(crate) offset: Option<u64>,
    /// Its `user_id` (checked by the broker when it was appended), when it has one.
    pub(crate) by: Option<String>,
    /// The record; `None` when it does not decode (garbage, a newer version's kind, longer
    /// than any of ours).
    pub(crate) record: Option<R>,
}

impl<R> Clone for StreamLog<R> {
    fn clone(&self) -> Self {
        StreamLog {
            kind: self.kind,
            name: self.name.clone(),
            prefix: self.prefix.clone(),
            exchange: self.exchange.clone(),
            max_record_bytes: self.max_record_bytes,
            writer: self.writer.clone(),
            prefetch: self.prefetch,
            records: PhantomData,
        }
    }
}

impl<R: LogRecord> StreamLog<R> {
    /// The stream `name` of `layout`'s topology, called `kind` in errors, whose records
    /// (ours) are at most `max_record_bytes` long: readers skip longer ones undecoded.
    pub(crate) fn new(
        kind: &'static str,
        name: String,
        layout: &crate::layout::Layout,
        max_record_bytes: usize,
    ) -> Self {
        StreamLog {
            kind,
            name,
            prefix: layout.prefix().to_string(),
            exchange: layout.stream_exchange(),
            max_record_bytes,
            writer: None,
            prefetch: READ_PREFETCH,
            records: PhantomData,
        }
    }

    /// The same log, read with a prefetch of `records` (a stream of large records: the journal).
    pub(crate) fn with_prefetch(mut self, records: u16) -> Self {
        self.prefetch = records.max(1);
        self
    }

    /// The same log, appending on channels as `user` (the channel's connection's user: the
    /// broker refuses any other `user_id`).
    pub(crate) fn writing_as(mut self, user: Option<String>) -> Self {
        self.writer = user;
        self
    }

    /// The largest record a reader decodes.
    #[cfg(test)]
    pub(crate) fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    /// The stream's queue name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The exchange its appends go through (with [`StreamLog::name`] as the routing key).
    pub(crate) fn exchange(&self) -> &str {
        &self.exchange
    }

    /// Checks that the stream exchange exists (a publish to a missing one would close the
    /// channel): [`StreamLog::exchange_missing`] when it does not.
    pub(crate) async fn check_exchange(&self, conn: &Connection) -> Result<()> {
        if broker::exchange_exists(conn, &self.exchange).await? {
            Ok(())
        } else {
            Err(self.exchange_missing())
        }
    }

    /// The error for the stream's missing: the topology is not (fully) declared.
    pub(crate) fn missing(&self) -> Error {
        Error::NotDeclared {
            prefix: self.prefix.clone(),
            detail: format!(": the {} '{}' is missing", self.kind, self.name),
        }
    }

    /// The error for the stream exchange's missing: the topology is not (fully) declared.
    pub(crate) fn exchange_missing(&self) -> Error {
        Error::NotDeclared {
            prefix: self.prefix.clone(),
            detail: format!(": the stream exchange '{}' is missing", self.exchange),
        }
    }

    /// `e`, or [`StreamLog::missing`] when it is a returned append (the stream exchange routes
    /// it nowhere only when the stream, and its binding with it, is gone), or
    /// [`StreamLog::exchange_missing`] when the broker closed the channel because the stream
    /// exchange does not exist.
    pub(crate) fn or_missing(&self, e: Error) -> Error {
        match e {
            Error::Returned { .. } => self.missing(),
            Error::Amqp { ref source, .. }
                if broker::reply(source).is_some_and(|(code, text)| {
                    code == broker::NOT_FOUND && text.contains(&format!("'{}'", self.exchange))
                }) =>
            {
                self.exchange_missing()
            }
            e => e,
        }
    }

    /// A record as it travels, for whoever appends it on a channel of its own (the publisher).
    pub(crate) fn encode(&self, record: &R) -> Vec<u8> {
        serde_json::to_vec(record).expect("records serialise")
    }

    /// Declares the stream (idempotent): records kept for `max_age_secs`, appended through
    /// the stream exchange (declared too) with the stream's name as the key.
    pub(crate) async fn declare(&self, conn: &Connection, max_age_secs: u64) -> Result<()> {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), broker::long_string("stream"));
        let max_age = format!("{max_age_secs}s");
        args.insert("x-max-age".into(), broker::long_string(&max_age));
        let ch = broker::open(conn).await?;
        let r = async {
            broker::declare_queue(&ch, &self.name, args).await?;
            let direct = lapin::ExchangeKind::Direct;
            broker::declare_exchange(&ch, &self.exchange, direct, FieldTable::default()).await?;
            broker::bind_queue(&ch, &self.name, &self.exchange, &self.name).await
        }
        .await;
        broker::close(&ch, "declared").await;
        r
    }

    /// Whether the stream exists (a passive declare).
    pub(crate) async fn exists(&self, conn: &Connection) -> Result<bool> {
        Ok(broker::queue_state(conn, &self.name).await?.is_some())
    }

    /// Appends `record` on a confirm channel of its own (see [`StreamLog::append_on`]).
    pub(crate) async fn append(&self, conn: &Connection, record: &R) -> Result<()> {
        let log = self.clone().writing_as(crate::connection::user_of(conn));
        let ch = SharedChannel::new(broker::open(conn).await?);
        let r = match ch
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context(|| "enabling publisher confirms".into())
        {
            Ok(()) => log.append_on(&ch, record).await,
            Err(e) => Err(e),
        };
        broker::close(&ch, "appended").await;
        r
    }

    /// Appends `records` in order on a confirm channel of its own, up to `window` awaiting
    /// their confirm at once; the first error (the records after it may be appended or not).
    pub(crate) async fn append_all(
        &self,
        conn: &Connection,
        records: &[R],
        window: usize,
    ) -> Result<()> {
        use futures::StreamExt;
        let log = self.clone().writing_as(crate::connection::user_of(conn));
        let ch = SharedChannel::new(broker::open(conn).await?);
        let r = match ch
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context(|| "enabling publisher confirms".into())
        {
            Ok(()) => {
                let mut confirms = futures::stream::iter(records)
                    .map(|r| log.append_on(&ch, r))
                    .buffered(window.max(1));
                let mut out = Ok(());
                while let Some(r) = confirms.next().await {
                    if r.is_err() {
                        out = r;
                        break;
                    }
                }
                out
            }
            Err(e) => Err(e),
        };
        broker::close(&ch, "appended").await;
        r
    }

    /// Appends `record` on `ch` (confirms on) and waits for the broker's confirm, at most
    /// [`CONFIRM_TIMEOUT`]. A missing stream or stream exchange is [`StreamLog::or_missing`]'s
    /// error.
    pub(crate) async fn append_on(&self, ch: &SharedChannel, record: &R) -> Result<()> {
        let body = self.encode(record);
        let stream = self.name.as_str();
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        if let Some(user) = &self.writer {
            props = props.with_user_id(user.as_str().into());
        }
        let appended = async {
            let confirm = ch
                .basic_publish(
                    self.exchange.as_str().into(),
                    stream.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &body,
                    props,
                )
                .await
                .context(|| format!("appending to '{stream}'"))?
                .await
                .context(|| format!("awaiting the confirm from '{stream}'"))?;
            if confirm.is_nack() {
                return Err(Error::Nacked {
                    exchange: stream.to_string(),
                });
            }
            if confirm.take_message().is_some() {
                return Err(self.missing());
            }
            Ok(())
        };
        let appended = async { appended.await.map_err(|e| self.or_missing(e)) };
        tokio::time::timeout(CONFIRM_TIMEOUT, appended)
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    context: format!("appending to the {} '{stream}'", self.kind),
                    timeout_ms: CONFIRM_TIMEOUT.as_millis() as u64,
                })
            })
    }

    /// Appends a barrier on a channel of its own; returns its nonce.
    pub(crate) async fn barrier(&self, conn: &Connection) -> Result<String> {
        let nonce = nonce();
        self.append(conn, &R::barrier(nonce.clone())).await?;
        Ok(nonce)
    }

    /// Appends a barrier on `ch`; returns its nonce.
    pub(crate) async fn barrier_on(&self, ch: &SharedChannel) -> Result<String> {
        let nonce = nonce();
        self.append_on(ch, &R::barrier(nonce.clone())).await?;
        Ok(nonce)
    }

    /// Where the stream ends now: the offset of the first record of its last chunk, read by a
    /// probe consumer. `None` when it holds nothing (or nothing came in time).
    /// After a frame error on this stream the end is the last offset this process's careful
    /// readers saw; while they saw none, the probe is made all the same (a start-up read
    /// that knows no end reads from the stream's first record, which may be the one that
    /// caused the error, unnamed: see [`poison`]), and once it met a frame error itself it is
    /// not made again (it could meet that record each time).
    pub(crate) async fn end_offset(&self, conn: &Connection) -> Result<Option<u64>> {
        let known = poison::of(&self.name);
        if known.careful && (known.seen_end.is_some() || known.end_probe_failed) {
            return Ok(known.seen_end);
        }
        let mut probe = self.open(conn, broker::long_string("last"), 1).await?;
        let end = match tokio::time::timeout(PROBE_TIMEOUT, probe.next()).await {
            Ok(Some(Ok(read))) => read.offset,
            Ok(Some(Err(e))) if is_record_over_frame_max(&e) => {
                poison::update(&self.name, |p| p.end_probe_failed = true);
                return Err(e);
            }
            _ => None,
        };
        probe.end("probed").await;
        Ok(end)
    }

    /// A reader of the stream from `from` (an `x-stream-offset` value: `"first"`, an offset, a
    /// timestamp).
    pub(crate) async fn open_reader(
        &self,
        conn: &Connection,
        from: AMQPValue,
    ) -> Result<Reader<R>> {
        self.open(conn, from, self.prefetch).await
    }

    /// A reader from `from`; one record at a time, past the offsets known to be
    /// unreceivable, when a record of this stream once ended a connection ([`poison`]).
    async fn open(&self, conn: &Connection, from: AMQPValue, prefetch: u16) -> Result<Reader<R>> {
        let known = poison::of(&self.name);
        // a careful reader knows which offset it waits for: "first" is offset 0 (the broker
        // starts at the first it holds), and so is a time (it names no offset: the record
        // the broker would start with could not be named if it were the unreceivable one;
        // reading from the start instead reads more, never less)
        let from = match from {
            AMQPValue::LongString(s) if known.careful && s.as_bytes() == b"first" => {
                AMQPValue::LongLongInt(0)
            }
            AMQPValue::Timestamp(_) if known.careful => AMQPValue::LongLongInt(0),
            other => other,
        };
        let (from, awaiting) = match from {
            AMQPValue::LongLongInt(o) if known.careful && o >= 0 => {
                let o = known.next_readable(o.unsigned_abs());
                (offset_value(o), Some((o, Instant::now())))
            }
            other => (other, None),
        };
        let prefetch = if known.careful { 1 } else { prefetch };
        let ch = broker::open(conn).await?;
        let consumer = async {
            ch.basic_qos(prefetch, BasicQosOptions::default())
                .await
                .context(|| format!("setting the prefetch of a reader of '{}'", self.name))?;
            self.consume(&ch, from).await
        }
        .await;
        match consumer {
            Ok(consumer) => Ok(Reader {
                open: Some((ch, consumer)),
                stream: self.name.clone(),
                kind: self.kind,
                max_record_bytes: self.max_record_bytes,
                credit: Credit::new(prefetch),
                careful: known.careful,
                awaiting,
                last: None,
                skip_to: None,
                records: PhantomData,
            }),
            Err(e) => {
                broker::close(&ch, "failed").await;
                Err(e)
            }
        }
    }

    /// A consumer of the stream on `ch` from `from`.
    async fn consume(&self, ch: &Channel, from: AMQPValue) -> Result<lapin::Consumer> {
        consume(ch, &self.name, from).await.map_err(|e| match e {
            Error::Amqp { source, .. } if broker::is_reply(&source, broker::NOT_FOUND) => {
                self.missing()
            }
            e => e,
        })
    }

    /// The start-up read: the stream up to the barrier `nonce` (appended by the caller) into
    /// `into`, from the nearest of `steps` (`x-stream-offset` values, each further back than the
    /// one before) whose read holds a whole compaction, else from the stream's first record.
    /// Returns the reader, positioned just after the barrier (to follow the stream from there,
    /// or to end), and the barrier's offset.
    pub(crate) async fn start_from_compaction<C: Compaction<Record = R>>(
        &self,
        conn: &Connection,
        nonce: &str,
        steps: impl IntoIterator<Item = AMQPValue>,
        into: &mut C,
    ) -> Result<(Reader<R>, Option<u64>)> {
        let mut steps = steps.into_iter();
        loop {
            let step = steps.next();
            let from_first = step.is_none();
            let from = step.unwrap_or_else(|| broker::long_string("first"));
            let mut reader = self.open_reader(conn, from).await?;
            let read = reader
                .read_to_barrier(nonce, |read| into.record(read))
                .await;
            let barrier = match read {
                Ok(b) => b,
                Err(e) => {
                    reader.end("failed").await;
                    return Err(e);
                }
            };
            if from_first || into.whole() {
                return Ok((reader, barrier));
            }
            tracing::debug!(stream = %self.name, "no whole compaction in that read: reading further back");
            // the reader ends first: nothing it reads after this counts for the next step
            reader.end("stepping back").await;
            into.restart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reader::decode;
    use super::*;

    fn layout_p() -> crate::layout::Layout {
        crate::layout::Layout::new("p", &Default::default()).unwrap()
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Test {
        Barrier { nonce: String },
        Note { text: String },
    }

    impl LogRecord for Test {
        fn barrier(nonce: String) -> Self {
            Test::Barrier { nonce }
        }
        fn barrier_nonce(&self) -> Option<&str> {
            match self {
                Test::Barrier { nonce } => Some(nonce),
                _ => None,
            }
        }
    }

    #[test]
    fn a_missing_stream_is_named_and_so_is_a_returned_append() {
        let log = StreamLog::<Test>::new("ledger stream", "p.ledger".into(), &layout_p(), 100);
        let text = log.missing().to_string();
        assert!(
            text.contains("the ledger stream 'p.ledger' is missing"),
            "{text}"
        );
        let returned = Error::Returned {
            exchange: String::new(),
            routing_key: "p.ledger".into(),
            code: 312,
            text: "NO_ROUTE".into(),
        };
        assert!(matches!(
            log.or_missing(returned),
            Error::NotDeclared { .. }
        ));
        let other = log.or_missing(Error::Nacked {
            exchange: "p.ledger".into(),
        });
        assert!(matches!(other, Error::Nacked { .. }));
    }

    #[test]
    fn records_travel_as_tagged_json_and_unknown_kinds_do_not_decode() {
        let log = StreamLog::<Test>::new("control stream", "p.control".into(), &layout_p(), 100);
        let body = log.encode(&Test::barrier("n".into()));
        assert_eq!(body, br#"{"type":"barrier","nonce":"n"}"#);
        let back: Test = serde_json::from_slice(&body).unwrap();
        assert_eq!(back.barrier_nonce(), Some("n"));
        assert!(serde_json::from_slice::<Test>(br#"{"type":"something_new"}"#).is_err());
        assert!(serde_json::from_slice::<Test>(b"garbage").is_err());
    }

    #[test]
    fn a_record_longer_than_ours_is_skipped_undecoded_and_counted() {
        let body = br#"{"type":"note","text":"0123456789"}"#;
        let counted = || {
            crate::metrics::global()
                .records_skipped
                .get_or_create(&crate::metrics::SkippedLabel {
                    stream: "test".into(),
                    reason: "oversize".into(),
                })
                .get()
        };
        let before = counted();
        assert_eq!(
            decode::<Test>(body, body.len(), "test stream"),
            Some(Test::Note {
                text: "0123456789".into()
            })
        );
        assert_eq!(counted(), before);
        assert_eq!(decode::<Test>(body, body.len() - 1, "test stream"), None);
        assert_eq!(counted(), before + 1);
    }
}
