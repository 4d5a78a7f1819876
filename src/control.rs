//! The control stream `<prefix>.control`: an append-only, replicated log (a RabbitMQ stream) of
//! what the topology needs to remember besides messages — today the gateway pairs declared under
//! the prefix (so `teardown` finds their queues without a configuration). Records are JSON
//! bodies; reading never removes them (streams are read by offset), and the broker drops them
//! after `x-max-age`.
//!
//! Reading "everything so far" uses a barrier: the reader appends a record of its own (with a
//! confirm) and reads from the start until it sees it. Every record before the barrier was
//! confirmed before it, so nothing earlier is missed.

use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use serde::{Deserialize, Serialize};

use crate::broker;
use crate::error::{Error, Result, ResultExt};
use crate::layout::Layout;

/// Records in the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// A gateway pair was declared under this prefix.
    GatewayPair {
        /// Ingress exchange.
        ingress: String,
        /// Target exchange.
        target: String,
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
    /// One part of a checkpoint: tombstones `[id, until_ms]` as of its begin record.
    Checkpoint {
        /// The nonce of its begin record.
        nonce: String,
        /// This part's number, from 0.
        part: u32,
        /// How many parts the checkpoint has (at least 1).
        parts: u32,
        /// The tombstones.
        items: Vec<(String, u64)>,
    },
}

impl Record {
    /// The record as it travels (JSON).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("records serialise")
    }

    /// A record read back; `None` for anything else (garbage, or a newer version's kind).
    pub fn decode(body: &[u8]) -> Option<Record> {
        serde_json::from_slice(body).ok()
    }
}

/// How long reading up to a barrier may go without a record arriving: a long stream takes as
/// long as it takes, a reader that gets nothing gives up.
pub(crate) const READ_STALL: Duration = Duration::from_secs(10);
/// Prefetch of a reader of the control stream, and how often it acks (`multiple`): acking each
/// record made reading several times slower (RabbitMQ 3.10, a scratch reader).
pub(crate) const READ_PREFETCH: u16 = 2_000;
pub(crate) const ACK_EVERY: u64 = 500;
/// Longer than any barrier record (JSON with a UUID nonce).
pub(crate) const BARRIER_MAX: usize = 256;

/// Arguments of the control stream: a stream queue, records kept for `max_age_secs`.
pub fn stream_args(max_age_secs: u64) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-queue-type".into(), broker::long_string("stream"));
    a.insert(
        "x-max-age".into(),
        broker::long_string(&format!("{max_age_secs}s")),
    );
    a
}

/// Declares the control stream (idempotent).
pub async fn declare(conn: &Connection, layout: &Layout) -> Result<()> {
    let ch = broker::open(conn).await?;
    let args = stream_args(layout.control_max_age_secs());
    broker::declare_queue(&ch, &layout.control_stream(), args).await?;
    broker::close(&ch, "declared").await;
    Ok(())
}

/// Appends `record` and waits for the broker's confirm.
pub async fn append(conn: &Connection, layout: &Layout, record: &Record) -> Result<()> {
    append_to(conn, layout, &layout.control_stream(), &record.encode()).await
}

/// Appends a JSON `body` to `stream` (of `layout`) on a channel of its own and waits for the
/// broker's confirm; returns the stream's missing as [`Error::NotDeclared`].
pub(crate) async fn append_to(
    conn: &Connection,
    layout: &Layout,
    stream: &str,
    body: &[u8],
) -> Result<()> {
    let ch = broker::open(conn).await?;
    ch.confirm_select(Default::default())
        .await
        .context(|| "enabling publisher confirms".into())?;
    let confirm = ch
        .basic_publish(
            "".into(),
            stream.into(),
            lapin::options::BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into()),
        )
        .await
        .context(|| format!("appending to '{stream}'"))?
        .await
        .context(|| format!("awaiting the confirm from '{stream}'"))?;
    broker::close(&ch, "appended").await;
    if confirm.is_nack() {
        return Err(Error::Nacked {
            exchange: stream.to_string(),
        });
    }
    if confirm.take_message().is_some() {
        return Err(Error::NotDeclared {
            prefix: layout.prefix().to_string(),
            detail: format!(": the stream '{stream}' is missing"),
        });
    }
    Ok(())
}

/// Every record in the stream, oldest first (barriers and checkpoints left out). `Ok(vec![])`
/// when the stream does not exist. Gives up only when no record arrives for [`READ_STALL`].
pub async fn read_all(conn: &Connection, layout: &Layout) -> Result<Vec<Record>> {
    let stream = layout.control_stream();
    if broker::queue_state(conn, &stream).await?.is_none() {
        return Ok(Vec::new());
    }
    let nonce = uuid::Uuid::now_v7().to_string();
    append(
        conn,
        layout,
        &Record::Barrier {
            nonce: nonce.clone(),
        },
    )
    .await?;
    let mut out = Vec::new();
    // a barrier is a few dozen bytes: larger records are not parsed twice
    let is_barrier = |body: &[u8]| {
        body.len() < BARRIER_MAX
            && matches!(Record::decode(body), Some(Record::Barrier { nonce: n }) if n == nonce)
    };
    read_to_barrier(
        conn,
        &stream,
        broker::long_string("first"),
        is_barrier,
        |_, body| match serde_json::from_slice::<Record>(body) {
            Ok(
                Record::Barrier { .. } | Record::CheckpointBegin { .. } | Record::Checkpoint { .. },
            ) => {}
            Ok(r) => out.push(r),
            // a record of a newer version, or garbage someone published: skip it
            Err(e) => tracing::debug!(%stream, "skipping an unreadable record: {e}"),
        },
    )
    .await?;
    Ok(out)
}

/// Acks a stream consumer's records as credit, for a reader that follows a stream: one
/// `multiple` ack every [`ACK_EVERY`] records, and one as soon as nothing more is coming (never
/// a nack: that closes the connection).
#[derive(Default)]
pub(crate) struct Credit {
    unacked: Option<(lapin::Acker, u64)>,
}

impl Credit {
    /// The consumer's next delivery; acks what it holds while none comes for 50 ms.
    pub(crate) async fn next(
        &mut self,
        consumer: &mut lapin::Consumer,
    ) -> Option<lapin::Result<lapin::message::Delivery>> {
        loop {
            if self.unacked.is_none() {
                return consumer.next().await;
            }
            match tokio::time::timeout(Duration::from_millis(50), consumer.next()).await {
                Ok(next) => return next,
                Err(_) => {
                    if let Some((acker, _)) = self.unacked.take() {
                        let _ = acker.ack(BasicAckOptions { multiple: true }).await;
                    }
                }
            }
        }
    }

    /// Counts a delivery read (its `acker`), acking every [`ACK_EVERY`].
    pub(crate) async fn read(&mut self, acker: lapin::Acker) {
        let n = self.unacked.take().map_or(0, |(_, n)| n) + 1;
        if n >= ACK_EVERY {
            let _ = acker.ack(BasicAckOptions { multiple: true }).await;
        } else {
            self.unacked = Some((acker, n));
        }
    }
}

/// Opens a channel and consumes `stream` from `offset` (an `x-stream-offset` value) with the
/// readers' prefetch.
pub(crate) async fn open_reader(
    conn: &Connection,
    stream: &str,
    offset: AMQPValue,
) -> Result<(lapin::Channel, lapin::Consumer)> {
    let ch = broker::open(conn).await?;
    ch.basic_qos(READ_PREFETCH, BasicQosOptions::default())
        .await
        .context(|| "setting prefetch".into())?;
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), offset);
    let consumer = ch
        .basic_consume(
            stream.into(),
            "".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .context(|| format!("reading '{stream}'"))?;
    Ok((ch, consumer))
}

/// Reads `stream` from `offset` (an `x-stream-offset` value) until a record `is_barrier` says
/// is the reader's own barrier, giving every record before it to `each` with its offset (when
/// the broker said it). Returns the barrier's offset. Gives up only when no record arrives for
/// [`READ_STALL`].
pub(crate) async fn read_to_barrier(
    conn: &Connection,
    stream: &str,
    offset: AMQPValue,
    is_barrier: impl Fn(&[u8]) -> bool,
    mut each: impl FnMut(Option<u64>, &[u8]),
) -> Result<Option<u64>> {
    let (ch, mut consumer) = open_reader(conn, stream, offset).await?;
    let mut unacked = 0u64;
    let read = async {
        loop {
            let next = match tokio::time::timeout(READ_STALL, consumer.next()).await {
                Ok(next) => next,
                Err(_) => {
                    return Err(Error::Timeout {
                        context: format!(
                            "reading '{stream}' up to a barrier (no record for {READ_STALL:?})"
                        ),
                        timeout_ms: READ_STALL.as_millis() as u64,
                    });
                }
            };
            let Some(d) = next else { break };
            let d = d.context(|| format!("reading '{stream}'"))?;
            // a stream needs acks as credit; one `multiple` ack every few hundred records
            unacked += 1;
            if unacked >= ACK_EVERY {
                let _ = d.ack(BasicAckOptions { multiple: true }).await;
                unacked = 0;
            }
            let offset = broker::stream_offset(&d);
            if is_barrier(&d.data) {
                return Ok(offset);
            }
            each(offset, &d.data);
        }
        Err(Error::stream(
            stream,
            "the broker ended the read before the barrier",
        ))
    };
    let r = read.await;
    // the channel closes before the consumer is dropped (see `broker::end_consumer`)
    broker::close(&ch, "read").await;
    drop(consumer);
    r
}
