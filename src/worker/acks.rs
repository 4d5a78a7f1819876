//! Coalesced acks: one `basic.ack` with `multiple` for a run of settled deliveries of a
//! consumer channel, instead of one per delivery (DESIGN rule 13).
//!
//! A quorum queue turns every `basic.ack` frame into a log entry (and releases one prefetch
//! credit at a time): consuming 50 000 persistent messages at prefetch 256 cost RabbitMQ 3.10
//! 84 µs of CPU per message acked one by one, 31 µs acked in fours, 20 µs in sixteens and
//! 14 µs in sixty-fours (`docs/PERFORMANCE.md`, "Acks"). The gateway's ingress, the relay and
//! busy workers settle hundreds of deliveries a second, roughly in order.
//!
//! Rules, per channel (delivery tags grow in the order deliveries arrive):
//! * a delivery whose handling is done is *done*; the broker learns it later: when the run of
//!   done deliveries from the oldest one in hand reaches a quarter of the prefetch, when no
//!   delivery of the channel is still running, or when the timer fires, at the latest
//!   [`FLUSH_AFTER`] later — one ack with `multiple` for the run. A done delivery behind a
//!   running one waits for the run to reach it up to [`BEHIND_AFTER`], then is acked alone (a
//!   slow handler never holds the others' acks for long). The gateway's ingress finishes its
//!   deliveries batch by batch, scattered over the tags: acked alone at once, nearly every
//!   one of them cost an ack frame and a Raft command;
//! * a delivery given back (`basic.nack`, requeue) is sent at once, and counts as settled;
//! * once the worker stops ([`Acks::stop`]) a delivery given back is *left*: nothing is sent
//!   for it, the channel's close returns it to the queue; it ends every run (an ack with
//!   `multiple` past it would ack it), so what is done behind it is acked one by one;
//! * frames of one channel are sent one at a time under a lock, so an ack with `multiple` never
//!   reaches the broker before a nack of a tag it covers (that tag would be acked instead), nor
//!   after a later one that already covered it (the broker closes the channel on an unknown
//!   tag); a flush under way finishes even when the task that started it is aborted (the
//!   shutdown grace ran out), so the acks it took out of the books are never dropped.
//!
//! Why a stop leaves what it gives back to the close instead of nacking it: the channel of a
//! quorum queue consumer keeps at most 32 Raft commands (one per `basic.ack` or `basic.nack`
//! frame) unapplied; past that it *stashes* further settlements and sends them once enough are
//! applied — and a channel closed meanwhile drops its stash, so the broker returns those
//! deliveries to the queue although their acks reached it (RabbitMQ 3.10.8 and 4.0.5,
//! `rabbit_fifo_client`'s `unsent_commands`). A stop that nacked the hundreds of deliveries a
//! worker holds (`consumer.hold_prefetch`) one by one sent hundreds of frames within a few
//! milliseconds and then its last acks, which the close dropped: finished messages ran again.
//! Left to the close, they cost no frame at all.
//!
//! What a worker dies with (at most [`FLUSH_AFTER`] of done deliveries) is delivered again:
//! at-least-once, as a worker dying between a handler and its ack always was. A stopping
//! worker flushes before it closes its channels, and a channel that sent many frames lately
//! (acks one by one behind slow or held deliveries, and so maybe stashed) waits
//! [`CLOSE_LINGER`] before its close.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};

/// Longest time a done delivery in the run from the oldest one waits for its ack to be sent.
pub(super) const FLUSH_AFTER: Duration = Duration::from_millis(10);

/// Longest time a done delivery behind a running one waits for the run to reach it, before it
/// is acked alone: longer than a gateway ingress message waits for its batch and confirm
/// (its linger, a tenth of `publisher.grain`: 100 ms by default, and a few ms), so that those
/// acks go in runs.
pub(super) const BEHIND_AFTER: Duration = Duration::from_millis(200);

/// Frames (acks and nacks) one channel sent within the last [`RECENT`] or so, past which its
/// close waits [`CLOSE_LINGER`]: half the 32 unapplied commands past which the broker stashes
/// settlements (the module's documentation). Counted before and after the stop alike: the
/// consumer's cancel is no barrier (the broker answers it before its Raft command; 4.0 sends
/// the stash then, 3.10 does not), and a worker acking hundreds of deliveries one by one just
/// before the stop lost a final `multiple` ack of 263 to the close on 3.10.8.
pub(super) const LINGER_FRAMES: usize = 16;

/// The window of [`LINGER_FRAMES`].
const RECENT: Duration = Duration::from_millis(100);

/// How long a channel that sent [`LINGER_FRAMES`] frames or more recently stays open before
/// its close: a broker applies a Raft command in milliseconds, and then sends what it stashed.
/// Narrows, does not close, the window in which a broker whose log lags drops the last acks
/// (those deliveries come back: at-least-once).
pub(super) const CLOSE_LINGER: Duration = Duration::from_millis(250);

enum Slot {
    /// Handed to its task, not settled yet.
    Running,
    /// Done (since the instant); its ack not sent yet.
    Done(Acker, Instant),
    /// Given back to the broker (nack sent): nothing more to send for it.
    Settled,
    /// Given back while stopping: nothing sent, the channel's close returns it. Unsettled at
    /// the broker, so no ack with `multiple` may cover it.
    Left,
}

#[derive(Default)]
struct State {
    slots: BTreeMap<u64, Slot>,
    /// A timer flush is on its way.
    timer: bool,
    /// The worker stops: deliveries given back are left to the channel's close.
    stopping: bool,
    /// Deliveries left so (for the stop's log).
    left: usize,
    /// Ack frames sent since the stop.
    stop_frames: usize,
    /// Frames sent in the current [`RECENT`] window (since `recent.0`) and the one before.
    recent: (Option<std::time::Instant>, usize, usize),
}

impl State {
    /// Marks `tag` done: whether a flush is due now (the run from the oldest delivery reaches
    /// `run`, or covers everything in hand).
    fn done(&mut self, tag: u64, acker: Acker, run: usize) -> bool {
        self.slots.insert(tag, Slot::Done(acker, Instant::now()));
        let (done, all) = run_from_oldest(&self.slots);
        done >= run || all
    }

    /// `tag` is given back: whether a nack is to be sent (then [`State::nacked`]); while
    /// stopping it is left to the channel's close instead.
    fn give_back(&mut self, tag: u64) -> bool {
        if self.stopping {
            self.slots.insert(tag, Slot::Left);
            self.left += 1;
        }
        !self.stopping
    }

    /// The nack of `tag` is sent.
    fn nacked(&mut self, tag: u64) {
        self.slots.insert(tag, Slot::Settled);
        drop_settled_front(&mut self.slots);
        self.sent(1);
    }

    /// `frames` are (being) sent now.
    fn sent(&mut self, frames: usize) {
        if frames == 0 {
            return;
        }
        self.roll();
        self.recent.1 += frames;
        if self.stopping {
            self.stop_frames += frames;
        }
    }

    /// Frames sent in the last [`RECENT`] to 2 × [`RECENT`].
    fn recent_frames(&mut self) -> usize {
        self.roll();
        self.recent.1 + self.recent.2
    }

    fn roll(&mut self) {
        let now = std::time::Instant::now();
        match self.recent.0 {
            Some(start) if now.duration_since(start) < RECENT => {}
            Some(start) if now.duration_since(start) < RECENT * 2 => {
                self.recent = (Some(now), 0, self.recent.1);
            }
            _ => self.recent = (Some(now), 0, 0),
        }
    }
}

/// The acks of one consumer channel.
pub(super) struct Acks {
    state: Mutex<State>,
    /// Held while a frame is sent (see the module's rules), by the flush's own task.
    send: Arc<tokio::sync::Mutex<()>>,
    /// Done deliveries in a run that are acked without waiting for the timer.
    run: usize,
    queue: String,
}

/// What one delivery's task settles it with.
pub(super) struct Settle {
    acks: Arc<Acks>,
    tag: u64,
    acker: Acker,
}

/// What a flush sends, taken out of the state under the send lock.
struct Flush {
    /// The newest done delivery of the run from the oldest one in hand (`multiple`), its tag
    /// and the run's length.
    run: Option<(u64, Acker, usize)>,
    /// Done deliveries behind a running (or left) one, with their tags.
    single: Vec<(u64, Acker)>,
}

impl Acks {
    /// The acks of a channel consuming `queue` with `prefetch`.
    pub(super) fn new(queue: &str, prefetch: u16) -> Arc<Acks> {
        Arc::new(Acks {
            state: Mutex::new(State::default()),
            send: Arc::new(tokio::sync::Mutex::new(())),
            run: usize::from(prefetch / 4).max(1),
            queue: queue.to_string(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes delivery `tag` in hand (called in the order deliveries arrive): its task settles
    /// it through the returned value.
    pub(super) fn received(self: &Arc<Self>, tag: u64, acker: Acker) -> Settle {
        self.state().slots.insert(tag, Slot::Running);
        Settle {
            acks: self.clone(),
            tag,
            acker,
        }
    }

    /// Deliveries done or running (for tests and logs).
    #[cfg(test)]
    fn in_hand(&self) -> usize {
        self.state().slots.len()
    }

    /// The worker stops: from now on a delivery given back is left to the channel's close
    /// (see the module's documentation). Call before the tasks learn of the stop.
    pub(super) fn stop(&self) {
        self.state().stopping = true;
    }

    /// Deliveries left to the channel's close since [`Acks::stop`], and ack frames sent.
    pub(super) fn since_stop(&self) -> (usize, usize) {
        let st = self.state();
        (st.left, st.stop_frames)
    }

    /// Whether the channel sent so many frames lately that the broker may still hold some of
    /// its acks unsent: its close should wait [`CLOSE_LINGER`].
    pub(super) fn busy(&self) -> bool {
        self.state().recent_frames() >= LINGER_FRAMES
    }

    /// Marks `tag` done; sends what is due now, or makes sure the timer will.
    async fn done(self: &Arc<Self>, tag: u64, acker: Acker) {
        let now = {
            let mut st = self.state();
            let now = st.done(tag, acker, self.run);
            if !now && !st.timer {
                st.timer = true;
                let me = self.clone();
                // every FLUSH_AFTER while done deliveries wait (behind a running one, for
                // up to BEHIND_AFTER)
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(FLUSH_AFTER).await;
                        if !me.flush_some(Some(BEHIND_AFTER)).await {
                            break;
                        }
                    }
                });
            }
            now
        };
        if now {
            self.flush(false).await;
        }
    }

    /// Gives `tag` back to the broker (requeue), at once; while stopping, leaves it to the
    /// channel's close.
    async fn give_back(&self, tag: u64, acker: &Acker) -> lapin::Result<bool> {
        if !self.state().give_back(tag) {
            return Ok(true);
        }
        let _turn = self.send.lock().await;
        let r = acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await;
        self.state().nacked(tag);
        r
    }

    /// Sends the acks that are due: the run from the oldest delivery in hand, and with
    /// `all` (a stopping worker) every done delivery behind a running one too.
    pub(super) async fn flush(&self, all: bool) {
        self.flush_some(all.then_some(Duration::ZERO)).await;
    }

    /// Sends the run from the oldest delivery in hand, and the done deliveries behind a
    /// running one that have been done for `behind` or longer (none without it). What it takes out of the
    /// books is sent by a task of its own, which holds the send lock until it is done:
    /// aborting the caller (a handler's task when the shutdown grace ends) cannot drop those
    /// acks, and the stop's last flush waits for them. With `behind` (the timer, the stop):
    /// whether done deliveries are still waiting, for which the timer goes on.
    async fn flush_some(&self, behind: Option<Duration>) -> bool {
        let turn = self.send.clone().lock_owned().await;
        let (f, waiting) = {
            let mut st = self.state();
            let f = take(&mut st.slots, behind);
            st.sent(usize::from(f.run.is_some()) + f.single.len());
            let waiting = st.slots.values().any(|s| matches!(s, Slot::Done(..)));
            if behind.is_some() && !waiting {
                st.timer = false;
            }
            (f, waiting)
        };
        if f.run.is_none() && f.single.is_empty() {
            return waiting;
        }
        let queue = self.queue.clone();
        let sending = tokio::spawn(async move {
            send(&queue, f).await;
            drop(turn);
        });
        let _ = sending.await;
        waiting
    }
}

/// Sends a flush's acks: the run, then the ones behind a running or left delivery.
async fn send(queue: &str, f: Flush) {
    if let Some((_, acker, n)) = f.run {
        match acker.ack(BasicAckOptions { multiple: n > 1 }).await {
            Ok(true) => tracing::trace!(queue, n, "acked"),
            Ok(false) => tracing::warn!(
                queue,
                n,
                "not acked (the channel closed); the broker will redeliver them"
            ),
            Err(e) => tracing::warn!(queue, n, "ack failed ({e}); the broker will redeliver them"),
        }
    }
    for (_, acker) in f.single {
        match acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                queue,
                "not acked (the channel closed); the broker will redeliver it"
            ),
            Err(e) => tracing::warn!(queue, "ack failed ({e}); the broker will redeliver it"),
        }
    }
}

impl Settle {
    /// The delivery's tag on its channel.
    #[cfg(test)]
    fn tag(&self) -> u64 {
        self.tag
    }

    /// Done: acked with the run it belongs to, within [`FLUSH_AFTER`] once the run reaches it,
    /// else alone after [`BEHIND_AFTER`].
    pub(super) async fn ack(self) {
        self.acks.done(self.tag, self.acker).await;
    }

    /// Back to the queue (`basic.nack`, requeue), sent at once.
    pub(super) async fn give_back(self) -> lapin::Result<bool> {
        self.acks.give_back(self.tag, &self.acker).await
    }
}

/// Done deliveries in the run from the oldest delivery in hand (settled ones do not end it; a
/// running or left one does), and whether that run covers every delivery in hand.
fn run_from_oldest(slots: &BTreeMap<u64, Slot>) -> (usize, bool) {
    let mut done = 0;
    for slot in slots.values() {
        match slot {
            Slot::Running | Slot::Left => return (done, false),
            Slot::Done(..) => done += 1,
            Slot::Settled => {}
        }
    }
    (done, true)
}

/// Takes out of `slots` what a flush sends: the run from the oldest delivery (its newest done
/// acker, acked with `multiple`, covers the rest), and with `behind` every other delivery done
/// for at least that long. Running and left deliveries stay (the broker still holds them unsettled): the run
/// ends at the first one, so `multiple` covers done and settled deliveries only.
fn take(slots: &mut BTreeMap<u64, Slot>, behind: Option<Duration>) -> Flush {
    let mut run: Option<(u64, Acker, usize)> = None;
    let mut end = None;
    for (&tag, slot) in slots.iter() {
        match slot {
            Slot::Running | Slot::Left => break,
            Slot::Done(a, _) => {
                let n = run.as_ref().map_or(0, |(_, _, n)| *n) + 1;
                run = Some((tag, a.clone(), n));
                end = Some(tag);
            }
            Slot::Settled => end = Some(tag),
        }
    }
    if let Some(end) = end {
        slots.retain(|&t, _| t > end);
    }
    let mut single = Vec::new();
    if let Some(age) = behind {
        let now = Instant::now();
        slots.retain(|&tag, slot| match slot {
            Slot::Done(a, at) if now.saturating_duration_since(*at) >= age => {
                single.push((tag, a.clone()));
                false
            }
            _ => true,
        });
        drop_settled_front(slots);
    }
    Flush { run, single }
}

/// Drops settled slots at the front: nothing is sent for them, and they end no run.
fn drop_settled_front(slots: &mut BTreeMap<u64, Slot>) {
    while let Some(e) = slots.first_entry() {
        if !matches!(e.get(), Slot::Settled) {
            break;
        }
        e.remove();
    }
}

#[cfg(test)]
mod tests;
