//! The follower's broker side: appending records with a confirm, probing the stream's end,
//! reading records into the state (and writing a checkpoint when the state says so), and
//! waiting while the reader makes progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::oneshot;

use super::state::{Items, State, lock};
use super::{CHECKPOINT_PART, CONFIRM_TIMEOUT, PROBE_TIMEOUT};
use crate::broker::{self, ResultExt, SharedChannel};
use crate::control::{Credit, READ_STALL, Record};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::time::now_ms;

/// The stream offset a delivery carries.
pub(super) fn offset_of(d: &lapin::message::Delivery) -> Option<u64> {
    broker::stream_offset(d)
}

/// Consumes `stream` from `offset`; a missing stream is [`Error::NotDeclared`].
pub(super) async fn consume(
    ch: &Channel,
    layout: &Layout,
    stream: &str,
    offset: AMQPValue,
    prefetch: u16,
) -> Result<lapin::Consumer> {
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .context(|| "setting the control stream's prefetch".into())?;
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), offset);
    ch.basic_consume(
        stream.into(),
        "".into(),
        BasicConsumeOptions::default(),
        args,
    )
    .await
    .map_err(|e| {
        if broker::is_reply(&e, broker::NOT_FOUND) {
            Error::NotDeclared {
                prefix: layout.prefix().to_string(),
                detail: format!(": the control stream '{stream}' is missing"),
            }
        } else {
            Error::Amqp {
                context: format!("following '{stream}'"),
                source: e,
            }
        }
    })
}

/// Appends `record` on `channel` (confirms on) and waits for the broker's confirm.
pub(super) async fn append(channel: &SharedChannel, stream: &str, record: &Record) -> Result<()> {
    let body = record.encode();
    let appended = async {
        let confirm = channel
            .basic_publish(
                "".into(),
                stream.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &body,
                BasicProperties::default().with_delivery_mode(2),
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
        if let Some(m) = confirm.take_message() {
            return Err(Error::Returned {
                exchange: String::new(),
                routing_key: stream.to_string(),
                code: m.reply_code,
                text: m.reply_text.to_string(),
            });
        }
        Ok(())
    };
    match tokio::time::timeout(CONFIRM_TIMEOUT, appended).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            context: format!("appending to the control stream '{stream}'"),
            timeout_ms: CONFIRM_TIMEOUT.as_millis() as u64,
        }),
    }
}

/// Where `stream` ends now: the offset of the first record of its last chunk, read by a probe
/// consumer. `None` when it holds nothing (or nothing came in time).
pub(super) async fn end_offset(
    conn: &Connection,
    layout: &Layout,
    stream: &str,
) -> Result<Option<u64>> {
    let ch = broker::open(conn).await?;
    let mut probe = match consume(&ch, layout, stream, broker::long_string("last"), 1).await {
        Ok(p) => p,
        Err(e) => {
            broker::close(&ch, "probe failed").await;
            return Err(e);
        }
    };
    let end = match tokio::time::timeout(PROBE_TIMEOUT, probe.next()).await {
        Ok(Some(Ok(d))) => offset_of(&d),
        _ => None,
    };
    broker::end_consumer(&ch, &probe, "probed").await;
    Ok(end)
}

/// Reads `consumer` into `state` until the broker ends it. Writes a checkpoint (on `channel`)
/// when `state` says so.
pub(super) async fn pump(
    consumer: &mut lapin::Consumer,
    state: Arc<Mutex<State>>,
    channel: SharedChannel,
    stream: String,
    every: u64,
    progress: Option<Arc<AtomicU64>>,
) {
    // a stream needs acks as credit
    let mut credit = Credit::default();
    loop {
        let d = match credit.next(consumer).await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                let mut s = lock(&state);
                s.broken = Some(e.to_string());
                s.waiting.clear();
                return;
            }
            None => break,
        };
        let record = Record::decode(&d.data);
        let (checkpoint, starting) = {
            let mut s = lock(&state);
            match record {
                Some(r) => s.apply(r, now_ms()),
                // garbage or a newer version's kind: a position all the same
                None => {
                    s.read += 1;
                    s.records += 1;
                }
            }
            (s.begin_checkpoint(every), !s.ready)
        };
        // progress feeds the worker's start-up watchdog: only the start-up read counts, or a
        // busy stream would keep a session that hangs later from ever timing out
        if let Some(p) = &progress
            && starting
        {
            p.fetch_add(1, Ordering::Relaxed);
        }
        if let Some((nonce, rx)) = checkpoint {
            tokio::spawn(write_checkpoint(
                channel.clone(),
                stream.clone(),
                state.clone(),
                nonce,
                rx,
            ));
        }
        credit.read(d.acker).await;
    }
    let mut s = lock(&state);
    s.broken = Some("the broker ended the control stream consumer".into());
    s.waiting.clear();
}

/// Appends a checkpoint: its begin record, then, once the reader has read that back and handed
/// over every tombstone it held at that point, the parts. A checkpoint left unfinished (an
/// error, the follower stopped) is ignored by its readers.
pub(super) async fn write_checkpoint(
    channel: SharedChannel,
    stream: String,
    state: Arc<Mutex<State>>,
    nonce: String,
    rx: oneshot::Receiver<Items>,
) {
    let r = async {
        append(
            &channel,
            &stream,
            &Record::CheckpointBegin {
                nonce: nonce.clone(),
            },
        )
        .await?;
        let items = wait_progress(&state, rx, &stream, "reading a checkpoint's begin record back").await?;
        let chunks: Vec<&[(String, u64)]> = if items.is_empty() {
            vec![&[]]
        } else {
            items.chunks(CHECKPOINT_PART).collect()
        };
        let parts = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
        for (part, chunk) in chunks.into_iter().enumerate() {
            append(
                &channel,
                &stream,
                &Record::Checkpoint {
                    nonce: nonce.clone(),
                    part: u32::try_from(part).unwrap_or(u32::MAX),
                    parts,
                    items: chunk.to_vec(),
                },
            )
            .await?;
        }
        Ok::<usize, Error>(items.len())
    }
    .await;
    let mut s = lock(&state);
    if s.own.as_ref().is_some_and(|(n, _)| *n == nonce) {
        s.own = None;
    }
    match r {
        Ok(n) => {
            s.checkpoints_written += 1;
            tracing::debug!(%stream, tombstones = n, "checkpoint written");
        }
        Err(e) => {
            // try again only after as many records again
            s.begun_at = Some(s.read);
            tracing::info!(%stream, "could not write a checkpoint: {}", crate::error::chain(&e));
        }
    }
}

/// Waits for `rx` while the follower keeps reading: gives up when no record arrived for
/// [`READ_STALL`] or the follower stopped. A long stream takes as long as it takes.
pub(super) async fn wait_progress<T>(
    state: &Mutex<State>,
    rx: oneshot::Receiver<T>,
    stream: &str,
    what: &str,
) -> Result<T> {
    let mut rx = std::pin::pin!(rx);
    let mut seen = lock(state).records;
    let mut moved = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            r = &mut rx => {
                return r.map_err(|_| {
                    let why = lock(state).broken.clone().unwrap_or_else(|| "it stopped".into());
                    Error::stream(stream, format!("the follower stopped while {what} ({why})"))
                });
            }
            _ = tick.tick() => {
                let s = lock(state);
                if let Some(why) = &s.broken {
                    return Err(Error::stream(
                        stream,
                        format!("the follower stopped while {what} ({why})"),
                    ));
                }
                if s.records != seen {
                    seen = s.records;
                    moved = Instant::now();
                } else if moved.elapsed() >= READ_STALL {
                    return Err(Error::Timeout {
                        context: format!("{what}: no record from the control stream for {READ_STALL:?}"),
                        timeout_ms: READ_STALL.as_millis() as u64,
                    });
                }
            }
        }
    }
}
