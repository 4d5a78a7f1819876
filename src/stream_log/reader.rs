//! A [`Reader`]: a consumer of one stream on a channel of its own, acking its records as
//! credit, reading one record at a time while it looks for a poisoned one ([`super::poison`]).

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde::de::DeserializeOwned;

use super::{LogRecord, READ_STALL, Read, poison, skipped};
use crate::broker;
use crate::error::{Error, Result, ResultExt};

/// Prefetch acks: one `multiple` ack every this many records (acking each made reading
/// several times slower: DESIGN rule 13).
const ACK_EVERY: u64 = 500;
/// How soon after a careful reader asks for a record a frame error counts against that
/// record ([`poison`]): one that exists is sent at once (well within this on a loaded
/// 2-core machine); an error later came from something else on the connection, or from a
/// record appended meanwhile, which the next start-up read meets at once.
const SUSPECT_WITHIN: Duration = Duration::from_secs(1);

/// A consumer of a stream on a channel of its own, acking its records as credit.
pub(crate) struct Reader<R> {
    /// `None` once ended.
    pub(super) open: Option<(Channel, lapin::Consumer)>,
    pub(super) stream: String,
    pub(super) kind: &'static str,
    pub(super) max_record_bytes: usize,
    pub(super) credit: Credit,
    /// One record at a time, each acked as it is taken ([`poison`]).
    pub(super) careful: bool,
    /// The offset a careful reader waits for, when it knows it, and since when: a record
    /// that exists comes at once, so a frame error long after is not laid at its door.
    pub(super) awaiting: Option<(u64, Instant)>,
    /// The highest offset it took.
    pub(super) last: Option<u64>,
    /// A careful reader took the record before a poisoned one: it goes on from this offset
    /// on a new consumer before it reads again.
    pub(super) skip_to: Option<u64>,
    pub(super) records: PhantomData<fn() -> R>,
}

impl<R: LogRecord> Reader<R> {
    /// The next record, with its offset and writer (a record longer than any of ours is
    /// skipped undecoded, see [`skipped`]). `None` when the broker ended the consumer.
    pub(crate) async fn next(&mut self) -> Option<Result<Read<R>>> {
        if let Some(to) = self.skip_to.take()
            && let Err(e) = self.skip(to).await
        {
            return Some(Err(e));
        }
        let (_, consumer) = self.open.as_mut()?;
        let d = match self.credit.next(consumer).await? {
            Ok(d) => d,
            Err(source) => {
                if broker::is_reply(&source, broker::FRAME_ERROR) {
                    self.frame_error();
                }
                return Some(Err(Error::Amqp {
                    context: format!("{READING}{}'", self.stream),
                    source,
                }));
            }
        };
        let offset = broker::stream_offset(&d);
        let record = decode(&d.data, self.max_record_bytes, self.kind);
        let by = d.properties.user_id().as_ref().map(|u| u.to_string());
        self.last = self.last.max(offset);
        if self.careful {
            self.took(d.acker, offset).await;
        } else {
            self.credit.read(d.acker).await;
        }
        Some(Ok(Read { offset, by, record }))
    }

    /// What a frame error on this reader's connection teaches ([`poison`]).
    fn frame_error(&self) {
        let awaiting = self
            .awaiting
            .filter(|(_, since)| since.elapsed() < SUSPECT_WITHIN)
            .map(|(o, _)| o);
        let (careful, last) = (self.careful, self.last);
        let learnt = poison::update(&self.stream, |p| {
            // where the careful readers start: near the end, not at the stream's first record
            if let Some(o) = last {
                p.delivered(o);
            }
            p.frame_error(careful, awaiting)
        });
        match learnt {
            poison::Learnt::Careful => tracing::warn!(
                stream = %self.stream,
                "a frame over frame_max ended the connection while reading the stream (a record of it, or a message to another consumer of the connection); its readers now read one record at a time, to find such a record and read on past it"
            ),
            poison::Learnt::Suspect(o, n) => tracing::debug!(
                stream = %self.stream,
                offset = o,
                frame_errors = n,
                "a frame error while waiting for the record at this offset"
            ),
            poison::Learnt::Poisoned(o) => skipped(
                self.kind,
                "over_frame_max",
                &format!(
                    "the record at offset {o} is larger than frame_max on delivery; reading on from the next"
                ),
            ),
            poison::Learnt::Nothing => {}
        }
    }

    /// A careful reader took the record at `offset`: acks it (the next one is sent), unless
    /// the next one is poisoned (then nothing more is sent, and it goes on past it).
    async fn took(&mut self, acker: lapin::Acker, offset: Option<u64>) {
        let Some(o) = offset else {
            self.awaiting = None;
            let _ = acker.ack(BasicAckOptions::default()).await;
            return;
        };
        let next = o.saturating_add(1);
        let (poisoned, readable) = poison::update(&self.stream, |p| {
            p.delivered(o);
            (p.is_poisoned(next), p.next_readable(next))
        });
        self.awaiting = Some((readable, Instant::now()));
        if poisoned {
            self.skip_to = Some(readable);
        } else {
            let _ = acker.ack(BasicAckOptions::default()).await;
        }
    }

    /// Ends the consumer (the record it was not given credit for stays on the broker) and
    /// consumes again from `to` on the same channel.
    async fn skip(&mut self, to: u64) -> Result<()> {
        let Some((ch, consumer)) = self.open.as_mut() else {
            return Ok(());
        };
        let stream = self.stream.as_str();
        ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await
            .context(|| format!("reading '{stream}' past an unreceivable record"))?;
        *consumer = consume(ch, stream, offset_value(to)).await?;
        self.awaiting = Some((to, Instant::now()));
        tracing::info!(
            stream,
            offset = to,
            "reading on past a record over frame_max"
        );
        Ok(())
    }

    /// Reads until the barrier `nonce`, giving every record before it to `each`. Returns the
    /// barrier's offset. Gives up only when no record arrives for [`READ_STALL`].
    pub(crate) async fn read_to_barrier(
        &mut self,
        nonce: &str,
        mut each: impl FnMut(Read<R>),
    ) -> Result<Option<u64>> {
        loop {
            let Ok(next) = tokio::time::timeout(READ_STALL, self.next()).await else {
                return Err(Error::Timeout {
                    context: format!(
                        "reading '{}' up to a barrier (no record for {READ_STALL:?})",
                        self.stream
                    ),
                    timeout_ms: READ_STALL.as_millis() as u64,
                });
            };
            let Some(next) = next else {
                return Err(Error::stream(
                    &self.stream,
                    "the broker ended the read before the barrier",
                ));
            };
            let read = next?;
            if read.record.as_ref().and_then(R::barrier_nonce) == Some(nonce) {
                return Ok(read.offset);
            }
            each(read);
        }
    }
}

/// A consumer of the stream `stream` on `ch` from `from` (an `x-stream-offset` value).
pub(super) async fn consume(
    ch: &Channel,
    stream: &str,
    from: AMQPValue,
) -> Result<lapin::Consumer> {
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), from);
    ch.basic_consume(
        stream.into(),
        "".into(),
        BasicConsumeOptions::default(),
        args,
    )
    .await
    .context(|| format!("reading '{stream}'"))
}

/// `offset` as an `x-stream-offset` value.
pub(super) fn offset_value(offset: u64) -> AMQPValue {
    AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX))
}

/// Whether `e` is a stream reader's frame error: a record of a stream grew past `frame_max`
/// (its readers find it and read on past it, see [`poison`]), not a queue's message.
pub(crate) fn is_record_over_frame_max(e: &Error) -> bool {
    matches!(e, Error::Amqp { context, source }
        if context.starts_with(READING) && broker::is_reply(source, broker::FRAME_ERROR))
}

/// How a reader's errors begin.
const READING: &str = "reading '";

/// A record's body decoded, unless it is longer than `max_bytes` (skipped undecoded: decoding
/// it would cost a multiple of its size) or not a record of ours.
pub(super) fn decode<R: DeserializeOwned>(body: &[u8], max_bytes: usize, kind: &str) -> Option<R> {
    if body.len() > max_bytes {
        let detail = format!(
            "{} bytes, more than the {max_bytes} of any record of ours",
            body.len()
        );
        skipped(kind, "oversize", &detail);
        return None;
    }
    serde_json::from_slice(body).ok()
}

impl<R> Reader<R> {
    /// Ends the consumer, then closes its channel (`broker::end_consumer`).
    pub(crate) async fn end(mut self, why: &str) {
        if let Some((ch, consumer)) = self.open.take() {
            broker::end_consumer(&ch, &consumer, why).await;
        }
    }
}

impl<R> Drop for Reader<R> {
    fn drop(&mut self) {
        // a reader dropped before it ended (its task stopped, a timeout): end it all the same,
        // never leaving lapin an active consumer to cancel on a channel that may be closing
        if let Some((ch, consumer)) = self.open.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move { broker::end_consumer(&ch, &consumer, "dropped").await });
        }
    }
}

/// Acks a stream consumer's records as credit: one `multiple` ack every [`ACK_EVERY`] records,
/// and one as soon as nothing more is coming (never a nack: that closes the connection).
pub(super) struct Credit {
    unacked: Option<(lapin::Acker, u64)>,
    /// Records between acks: [`ACK_EVERY`], or half the prefetch when that is less (else a
    /// reader with a small prefetch would wait for the 50 ms idle ack every time).
    every: u64,
}

impl Credit {
    /// Credit for a consumer of `prefetch`.
    pub(super) fn new(prefetch: u16) -> Credit {
        Credit {
            unacked: None,
            every: ACK_EVERY.min(u64::from(prefetch / 2).max(1)),
        }
    }

    /// The consumer's next delivery; acks what it holds while none comes for 50 ms.
    async fn next(
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
    async fn read(&mut self, acker: lapin::Acker) {
        let n = self.unacked.take().map_or(0, |(_, n)| n) + 1;
        if n >= self.every {
            let _ = acker.ack(BasicAckOptions { multiple: true }).await;
        } else {
            self.unacked = Some((acker, n));
        }
    }
}
