//! The follower's broker side, on [`crate::stream_log`]: the start-up read into the state,
//! the reader that keeps it current (and writes a checkpoint when the state says so), and
//! waiting while the reader makes progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::types::AMQPValue;
use tokio::sync::oneshot;

use super::CHECKPOINT_PART;
use super::state::{Held, State, checkpoint_parts, lock};
use crate::broker::SharedChannel;
use crate::control::Record;
use crate::error::{Error, Result};
use crate::stream_log::{Compaction, READ_STALL, Read, Reader, StreamLog};
use crate::time::now_ms;

/// Where a start-up read may begin before the stream's first record, nearest first: from
/// `2 × every` records before the stream's `end`, then 4 times as far back each step.
pub(super) fn steps_back(end: Option<u64>, every: u64) -> Vec<AMQPValue> {
    let mut steps = Vec::new();
    let Some(end) = end else { return steps };
    let mut back = every.saturating_mul(2);
    while back < end {
        steps.push(AMQPValue::LongLongInt(
            i64::try_from(end - back).unwrap_or(i64::MAX),
        ));
        back = back.saturating_mul(4);
    }
    steps
}

/// The start-up read: records into the state, each one progress for whoever waits for the
/// follower to start; whole once it read a whole checkpoint.
pub(super) struct Starting<'a> {
    pub(super) state: &'a Mutex<State>,
    pub(super) progress: Option<&'a AtomicU64>,
}

impl Compaction for Starting<'_> {
    type Record = Record;

    fn record(&mut self, read: Read<Record>) {
        lock(self.state).read_one(read.record, read.by.as_deref(), now_ms());
        if let Some(p) = self.progress {
            p.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn whole(&self) -> bool {
        lock(self.state).complete_at.is_some()
    }

    fn restart(&mut self) {
        // the tombstones read so far are real (reading them again changes nothing); only the
        // positions start again
        lock(self.state).restart_positions();
    }
}

/// Reads `reader` into `state` until the broker ends it. Writes a checkpoint (on `channel`)
/// when `state` says so.
pub(super) async fn pump(
    reader: &mut Reader<Record>,
    state: Arc<Mutex<State>>,
    channel: SharedChannel,
    log: StreamLog<Record>,
    every: u64,
) {
    loop {
        let read = match reader.next().await {
            Some(Ok(read)) => read,
            Some(Err(e)) => {
                let mut s = lock(&state);
                s.broken = Some(e.to_string());
                s.waiting.clear();
                return;
            }
            None => break,
        };
        let checkpoint = {
            let mut s = lock(&state);
            s.read_one(read.record, read.by.as_deref(), now_ms());
            s.begin_checkpoint(every)
        };
        if let Some((nonce, rx)) = checkpoint {
            let (channel, log, state) = (channel.clone(), log.clone(), state.clone());
            tokio::spawn(write_checkpoint(channel, log, state, nonce, rx));
        }
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
    log: StreamLog<Record>,
    state: Arc<Mutex<State>>,
    nonce: String,
    rx: oneshot::Receiver<Held>,
) {
    let r = async {
        let begin = Record::CheckpointBegin {
            nonce: nonce.clone(),
        };
        log.append_on(&channel, &begin).await?;
        let held = wait_progress(&state, rx, "reading a checkpoint's begin record back").await?;
        let chunks = checkpoint_parts(held, CHECKPOINT_PART);
        let held = chunks
            .iter()
            .map(|c| c.1.len() + c.2.len() + c.3.len())
            .sum::<usize>();
        let parts = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
        for (part, (by, items, purges, moves)) in chunks.into_iter().enumerate() {
            let part = Record::Checkpoint {
                nonce: nonce.clone(),
                part: u32::try_from(part).unwrap_or(u32::MAX),
                parts,
                items,
                by,
                purges,
                moves,
            };
            log.append_on(&channel, &part).await?;
        }
        Ok::<usize, Error>(held)
    }
    .await;
    let mut s = lock(&state);
    if s.own.as_ref().is_some_and(|(n, _)| *n == nonce) {
        s.own = None;
    }
    match r {
        Ok(n) => {
            s.checkpoints_written += 1;
            tracing::debug!(stream = %log.name(), tombstones = n, "checkpoint written");
        }
        Err(e) => {
            // try again only after as many records again
            s.begun_at = Some(s.read);
            tracing::info!(stream = %log.name(), "could not write a checkpoint: {}", crate::error::chain(&e));
        }
    }
}

/// How the control stream is named in a follower's errors (its full name depends on the prefix,
/// which the follower's log lines carry).
pub(super) const CONTROL: &str = "control";

/// Waits for `rx` while the follower keeps reading: gives up when no record arrived for
/// [`READ_STALL`] or the follower stopped. A long stream takes as long as it takes.
pub(super) async fn wait_progress<T>(
    state: &Mutex<State>,
    rx: oneshot::Receiver<T>,
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
                    Error::stream(CONTROL, format!("the follower stopped while {what} ({why})"))
                });
            }
            _ = tick.tick() => {
                let s = lock(state);
                if let Some(why) = &s.broken {
                    return Err(Error::stream(
                        CONTROL,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_up_steps_back_four_times_as_far_each_time_within_the_stream() {
        let offsets = |end, every| -> Vec<i64> {
            steps_back(end, every)
                .into_iter()
                .map(|v| match v {
                    AMQPValue::LongLongInt(o) => o,
                    v => panic!("{v:?}"),
                })
                .collect()
        };
        assert_eq!(offsets(None, 10), Vec::<i64>::new(), "an empty stream");
        assert_eq!(offsets(Some(20), 10), Vec::<i64>::new(), "a short one");
        assert_eq!(offsets(Some(1_000), 10), vec![980, 920, 680]);
    }
}
