//! Cancelling scheduled messages on a stock broker. A message cannot be taken out of the middle
//! of a queue, so a cancel is a *tombstone*: a record in the control stream (a replicated,
//! append-only RabbitMQ stream) naming the message id. Every worker, gateway and relay follows
//! the stream ([`Cancellations`]) — read from the start of its retention when it starts, then
//! continuously — and acks a cancelled message instead of running it.
//!
//! **The guarantee.** Before it runs a message, a follower makes sure it has read every record
//! confirmed up to `cancel.notice` ago: when its last sync is older than that, it appends a
//! barrier record of its own and waits until it reads it back (everything confirmed before the
//! barrier lies before it in the stream). So a cancel confirmed at least `cancel.notice` before
//! the message falls due is always honoured — by every consumer, after restarts, during
//! retries. A later cancel is honoured if it arrives in time, and reported as too late to the
//! canceller when it knows the due time.
//!
//! **Memory** is bounded by the live tombstones: each is forgotten at its `until` time (the
//! message's due time plus `cancel.horizon`, or, without a due time, the longest delay plus the
//! horizon), and as soon as a follower sees the cancelled message itself fall due it shortens
//! its own copy to that due time plus the horizon.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::oneshot;

use crate::broker::{self, ResultExt};
use crate::control::Record;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::time::now_ms;

/// How long a sync (barrier appended and read back) may take before the message waits.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// Executed ids remembered, to report a cancel that arrived too late.
const RECENTLY_EXECUTED: usize = 10_000;

/// What a canceller learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Confirmed at least `cancel.notice` before the due time: it will not run.
    Honoured,
    /// Confirmed too close to (or after) the due time: it may already have run, or run anyway.
    TooLate,
    /// No due time given: honoured if the message has not run yet.
    Unknown,
}

/// The answer to a cancel, once it is durably recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Cancelled {
    /// The message id.
    pub id: String,
    /// The tombstone is forgotten after this (ms since the epoch).
    pub until_ms: u64,
    /// Whether the cancel is certain to win.
    pub verdict: Verdict,
}

/// The tombstone for cancelling `id` now, pure: its `until` and the verdict.
pub fn tombstone(
    id: &str,
    due_at_ms: Option<u64>,
    now: u64,
    max_delay_ms: u64,
    notice_ms: u64,
    horizon_ms: u64,
) -> (Record, Verdict) {
    let latest_due = due_at_ms.unwrap_or_else(|| now.saturating_add(max_delay_ms));
    let until_ms = latest_due.saturating_add(horizon_ms);
    let verdict = match due_at_ms {
        None => Verdict::Unknown,
        Some(due) if due >= now.saturating_add(notice_ms) => Verdict::Honoured,
        Some(_) => Verdict::TooLate,
    };
    (
        Record::Cancel {
            id: id.to_string(),
            until_ms,
            due_at_ms,
        },
        verdict,
    )
}

#[derive(Default)]
struct State {
    /// id → forget after (ms since the epoch).
    tombstones: HashMap<String, u64>,
    /// Barriers appended by this follower and not read back yet.
    waiting: HashMap<String, oneshot::Sender<()>>,
    /// Why the follower stopped, if it did.
    broken: Option<String>,
    last_prune: u64,
    /// Recently executed ids, oldest first, to say when a cancel came too late.
    executed: VecDeque<String>,
    executed_set: HashSet<String>,
}

impl State {
    fn apply(&mut self, r: Record, now: u64) {
        match r {
            Record::Cancel { id, until_ms, .. } if until_ms > now => {
                if self.executed_set.contains(&id) {
                    tracing::warn!(%id, "a cancel arrived after the message ran: too late");
                }
                let e = self.tombstones.entry(id).or_insert(until_ms);
                *e = (*e).max(until_ms);
            }
            Record::Cancels { items } => {
                for (id, until_ms) in items {
                    self.apply(
                        Record::Cancel {
                            id,
                            until_ms,
                            due_at_ms: None,
                        },
                        now,
                    );
                }
            }
            Record::Barrier { nonce } => {
                if let Some(w) = self.waiting.remove(&nonce) {
                    let _ = w.send(());
                }
            }
            _ => {}
        }
        if now.saturating_sub(self.last_prune) >= 1_000 {
            self.tombstones.retain(|_, until| *until > now);
            self.last_prune = now;
        }
    }
}

/// A follower of the control stream's cancellations, shared by a worker's handlers. Cheap to
/// share; [`Cancellations::is_cancelled`] is a map lookup.
pub struct Cancellations {
    state: Arc<Mutex<State>>,
    channel: Channel,
    stream: String,
    notice: Duration,
    horizon_ms: u64,
    /// When the last sync started (a barrier appended then was read back).
    synced: tokio::sync::Mutex<Option<Instant>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Cancellations {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Cancellations {
    /// Starts following `layout`'s control stream on `conn` from the start of its retention,
    /// and returns once everything recorded so far has been read.
    pub async fn follow(
        conn: &Connection,
        layout: &Layout,
        notice: Duration,
        horizon_ms: u64,
    ) -> Result<Cancellations> {
        let stream = layout.control_stream();
        let reader = broker::open(conn).await?;
        reader
            .basic_qos(1_000, BasicQosOptions::default())
            .await
            .context(|| "setting the control stream's prefetch".into())?;
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), broker::long_string("first"));
        let mut consumer = reader
            .basic_consume(
                stream.as_str().into(),
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
            })?;
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let task = tokio::spawn(async move {
            let _reader = reader; // lives as long as the follower
            while let Some(d) = consumer.next().await {
                match d {
                    Ok(d) => {
                        if let Some(r) = Record::decode(&d.data) {
                            st.lock().expect("cancellations").apply(r, now_ms());
                        }
                        // a stream needs acks as credit; never nack (it closes the connection)
                        let _ = d.ack(BasicAckOptions::default()).await;
                    }
                    Err(e) => {
                        st.lock().expect("cancellations").broken = Some(e.to_string());
                        return;
                    }
                }
            }
            st.lock().expect("cancellations").broken =
                Some("the broker ended the control stream consumer".into());
        });
        let channel = broker::open(conn).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context(|| "enabling publisher confirms".into())?;
        let c = Cancellations {
            state,
            channel,
            stream,
            notice,
            horizon_ms,
            synced: tokio::sync::Mutex::new(None),
            task,
        };
        c.sync().await?;
        Ok(c)
    }

    /// Whether `id` is cancelled (a tombstone is live).
    pub fn is_cancelled(&self, id: &str) -> bool {
        !id.is_empty()
            && self
                .state
                .lock()
                .expect("cancellations")
                .tombstones
                .get(id)
                .is_some_and(|until| *until > now_ms())
    }

    /// Live tombstones (what the follower holds in memory).
    pub fn len(&self) -> usize {
        let mut s = self.state.lock().expect("cancellations");
        let now = now_ms();
        s.tombstones.retain(|_, until| *until > now);
        s.tombstones.len()
    }

    /// Whether no tombstone is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cancelled message fell due at `due_at_ms`: its tombstone is needed only for the
    /// horizon after that (retries, redeliveries), not until the canceller's worst case.
    pub fn fell_due(&self, id: &str, due_at_ms: Option<u64>) {
        if let Some(due) = due_at_ms {
            let mut s = self.state.lock().expect("cancellations");
            if let Some(until) = s.tombstones.get_mut(id) {
                *until = (*until).min(due.saturating_add(self.horizon_ms));
            }
        }
    }

    /// Remembers that `id` ran (for a too-late cancel to say so).
    pub fn executed(&self, id: &str) {
        if id.is_empty() {
            return;
        }
        let mut s = self.state.lock().expect("cancellations");
        if s.executed_set.insert(id.to_string()) {
            s.executed.push_back(id.to_string());
            if s.executed.len() > RECENTLY_EXECUTED
                && let Some(old) = s.executed.pop_front()
            {
                s.executed_set.remove(&old);
            }
        }
    }

    /// Makes sure every record confirmed `cancel.notice` ago or earlier has been read: syncs
    /// (see [`Cancellations::sync`]) when the last sync is older than that.
    pub async fn sync_if_stale(&self) -> Result<()> {
        {
            let last = self.synced.lock().await;
            if last.is_some_and(|t| t.elapsed() < self.notice / 2) {
                return Ok(());
            }
        }
        self.sync().await
    }

    /// Appends a barrier and waits until the follower reads it back: every record confirmed
    /// before now has then been read. One sync at a time; concurrent callers share it.
    pub async fn sync(&self) -> Result<()> {
        let mut last = self.synced.lock().await;
        let started = Instant::now();
        if last.is_some_and(|t| t.elapsed() < self.notice / 2) {
            return Ok(());
        }
        let nonce = uuid::Uuid::now_v7().to_string();
        let (tx, rx) = oneshot::channel();
        {
            let mut s = self.state.lock().expect("cancellations");
            if let Some(why) = &s.broken {
                return Err(Error::Invalid(format!(
                    "cannot check cancellations: the control stream follower stopped ({why})"
                )));
            }
            s.waiting.insert(nonce.clone(), tx);
        }
        let body = Record::Barrier {
            nonce: nonce.clone(),
        }
        .encode();
        let appended = async {
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    self.stream.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .context(|| format!("appending a barrier to '{}'", self.stream))?
                .await
                .context(|| format!("awaiting the barrier's confirm from '{}'", self.stream))?;
            if confirm.is_nack() || confirm.take_message().is_some() {
                return Err(Error::Invalid(format!(
                    "the control stream '{}' refused a barrier",
                    self.stream
                )));
            }
            rx.await.map_err(|_| {
                Error::Invalid("the control stream follower stopped before the barrier".into())
            })
        };
        match tokio::time::timeout(SYNC_TIMEOUT, appended).await {
            Ok(Ok(())) => {
                *last = Some(started);
                Ok(())
            }
            Ok(Err(e)) => {
                self.state
                    .lock()
                    .expect("cancellations")
                    .waiting
                    .remove(&nonce);
                Err(e)
            }
            Err(_) => {
                self.state
                    .lock()
                    .expect("cancellations")
                    .waiting
                    .remove(&nonce);
                Err(Error::Timeout {
                    context: format!("syncing with the control stream '{}'", self.stream),
                    timeout_ms: SYNC_TIMEOUT.as_millis() as u64,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_last_until_the_message_can_no_longer_fall_due() {
        let (r, v) = tombstone("a", Some(10_000), 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::Honoured);
        assert!(matches!(
            r,
            Record::Cancel {
                until_ms: 10_500,
                ..
            }
        ));
        let (_, v) = tombstone("a", Some(1_500), 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::TooLate);
        let (r, v) = tombstone("a", None, 1_000, 1_000_000, 1_000, 500);
        assert_eq!(v, Verdict::Unknown);
        assert!(matches!(
            r,
            Record::Cancel {
                until_ms: 1_001_500,
                ..
            }
        ));
    }

    #[test]
    fn state_keeps_live_tombstones_only() {
        let mut s = State::default();
        let cancel = |id: &str, until_ms| Record::Cancel {
            id: id.into(),
            until_ms,
            due_at_ms: None,
        };
        s.apply(cancel("old", 5), 10);
        s.apply(cancel("live", 5_000), 10);
        assert_eq!(s.tombstones.len(), 1);
        s.apply(cancel("later", 9_000), 6_000);
        assert!(!s.tombstones.contains_key("live"), "pruned after its until");
        assert!(s.tombstones.contains_key("later"));
    }
}
