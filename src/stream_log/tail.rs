//! Following a stream from an offset, for tools: [`Tail`], its [`Entry`]s and where it
//! [`Start`]s.

use lapin::types::AMQPValue;

use super::{LogRecord, Reader};
use crate::broker;
use crate::error::Result;

/// Where a [`tail`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// At the first record the stream holds.
    First,
    /// At this offset (the one after the last a reader applied).
    Offset(u64),
    /// With what is appended from now on.
    Next,
    /// At the first chunk appended at or after this time (ms since the epoch; the broker
    /// counts in seconds, and starts at a chunk's first record).
    Since(u64),
}

impl Start {
    pub(crate) fn value(self) -> AMQPValue {
        match self {
            Start::First => broker::long_string("first"),
            Start::Offset(o) => AMQPValue::LongLongInt(i64::try_from(o).unwrap_or(i64::MAX)),
            Start::Next => broker::long_string("next"),
            Start::Since(ms) => AMQPValue::Timestamp(ms / 1000),
        }
    }
}

/// A record as read, with its offset and writer.
#[derive(Debug, Clone)]
pub struct Entry<R> {
    /// Its offset in the stream.
    pub offset: u64,
    /// Its `user_id`, checked by the broker when it was appended.
    pub by: Option<String>,
    /// The record; `None` when it does not decode (garbage, a newer version's kind, longer
    /// than any of ours): skip it.
    pub record: Option<R>,
}

/// A follower of one stream (the journal's [`crate::journal::tail`], the control stream's
/// [`crate::control::tail`]):
/// a consumer on a channel of its own.
pub struct Tail<R> {
    pub(crate) reader: Reader<R>,
}

/// A [`Tail`] over `reader`.
pub(crate) fn tail_of<R>(reader: Reader<R>) -> Tail<R> {
    Tail { reader }
}

/// The next entry of `reader`; a record without an offset (no stream delivers one) is skipped.
pub(crate) async fn next_entry<R: LogRecord>(reader: &mut Reader<R>) -> Option<Result<Entry<R>>> {
    loop {
        match reader.next().await? {
            Err(e) => return Some(Err(e)),
            Ok(read) => {
                if let Some(offset) = read.offset {
                    return Some(Ok(Entry {
                        offset,
                        by: read.by,
                        record: read.record,
                    }));
                }
            }
        }
    }
}

/// The public reading API of a [`Tail`] of one stream's records (the journal's, the control
/// stream's), invoked where the record type lives.
macro_rules! tail_api {
    ($record:ty) => {
        impl $crate::stream_log::Tail<$record> {
            /// The next record, waiting for one to be appended; `None` when the reader ended
            /// (its connection or channel closed).
            pub async fn next(
                &mut self,
            ) -> Option<$crate::error::Result<$crate::stream_log::Entry<$record>>> {
                $crate::stream_log::next_entry(&mut self.reader).await
            }

            /// Ends the consumer and closes its channel.
            pub async fn end(self) {
                self.reader.end("tail ended").await;
            }
        }
    };
}

pub(crate) use tail_api;
