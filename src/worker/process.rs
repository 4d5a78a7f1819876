//! One delivery end to end: a plain message, or a batch whose members each run the handler.
//! Never panics on bad input; what it cannot resolve (the broker refuses the retry or the
//! parked copy) goes back to the queue, so nothing is lost.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable, LongString};
use rand::Rng;
use tokio::sync::{Notify, Semaphore};

use super::acks::Settle;
use super::counters::QueueMetrics;
use super::hold::{Hold, hold_sleep, hold_until};
use super::trusted::{believed_headers, member_properties, owner_of, strip_our_headers};
use super::{Context, Counters, Event, Handler, Outcome};
use crate::batch;
use crate::cancel::{Cancellations, Steer, Subject};
use crate::envelope::{self, Delivery};
use crate::error::{Error, Result};
use crate::headers;
use crate::journal::{Run, RunOutcome};
use crate::layout::Layout;
use crate::message::Message;
use crate::publisher::Publisher;
use crate::settings::ConsumerSettings;
use crate::time::now_ms;
use crate::trust::Trust;

/// What every delivery task shares.
pub(super) struct TaskCtx {
    /// The control stream's tombstones.
    pub cancels: Arc<Cancellations>,
    /// Whose messages are whose ([`crate::trust`]).
    pub trust: Arc<Trust>,
    /// The park exchange: each destination's parking queue is bound to it with the
    /// destination's name as the key.
    pub park_exchange: String,
    pub publisher: Arc<Publisher>,
    pub settings: ConsumerSettings,
    /// The most members a batch may announce (no publisher of ours sends more).
    pub batch_max_members: usize,
    pub layout: Layout,
    pub counters: Arc<Counters>,
    /// Permits of business handlers (`consumer.concurrency`).
    pub business: Arc<Semaphore>,
    /// Permits of I/O handlers (`consumer.io_concurrency`).
    pub io: Arc<Semaphore>,
    /// Set when the worker stops: a message whose handler has not started goes back to the
    /// queue instead.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// How a message (or a member) ended.
enum Done {
    Succeeded,
    Retried,
    Parked,
    /// The handler kept saying "not now" for `requeue_hold`.
    PutBack(String),
    /// The worker is stopping and the handler had not started.
    NotStarted,
    /// Cancelled: acked without running.
    Cancelled,
}

/// Handles one delivery from `queue`: a batch member by member, a plain message as itself;
/// acks when everything it carried is settled, else returns it to the queue.
pub(super) async fn delivery<H: Handler>(
    raw: lapin::message::Delivery,
    acker: Settle,
    queue: &str,
    handler: &H,
    ctx: &TaskCtx,
) {
    let redelivered = raw.redelivered;
    // read before our headers are cleaned off for the handler
    let returned_before = headers::delivery_count(raw.properties.headers().as_ref());
    let requeue = Requeue {
        returned_before,
        first_pause_ms: ctx.settings.requeue_pause.as_millis(),
        stopping: &ctx.stopping,
    };
    if redelivered {
        ctx.counters.count(Event::Redelivered, queue);
    }
    if returned_before > DELIVERY_LIMIT {
        park_returned(raw, acker, queue, ctx, requeue).await;
        return;
    }
    let mut raw = raw;
    if !handler.reads_our_headers() {
        strip_our_headers(&mut raw);
    } else {
        let writer = raw.properties.user_id().as_ref().map(|u| u.to_string());
        raw.properties = believed_headers(raw.properties, writer.as_deref(), &ctx.trust, queue);
    }
    if ctx.stopping.load(Ordering::Relaxed) {
        let _ = acker.give_back().await;
        return;
    }
    if batch::is_batch(&raw.properties) {
        ctx.counters.count(Event::Batch, queue);
        batch_delivery(raw, acker, queue, handler, ctx, requeue).await;
        return;
    }
    let owner = owner_of(&raw.properties, None, &ctx.trust);
    let mut decoded = envelope::decode(
        queue,
        raw.data,
        raw.properties,
        raw.routing_key.as_str(),
        raw.exchange.as_str(),
        redelivered,
    );
    decoded.0.owner = owner;
    let id = decoded.0.message_id.clone();
    let qm = QueueMetrics::of(queue);
    match one(decoded, handler, ctx, &qm, true).await {
        Ok((_, Done::NotStarted)) => {
            let _ = acker.give_back().await;
        }
        Ok((d, Done::PutBack(reason))) => {
            tracing::warn!(queue, id = %d.message_id, %reason, "the handler still cannot process it; returning it to the queue");
            let _ = acker.give_back().await;
        }
        Ok(_) => settle(acker, queue, &id, Ok(()), requeue).await,
        Err(e) => settle(acker, queue, &id, Err(e), requeue).await,
    }
}

/// The quorum queues' delivery limit the queues we declare have (`x-delivery-limit`).
const DELIVERY_LIMIT: u64 = crate::topology::DELIVERY_LIMIT.unsigned_abs();

/// A delivery returned to its queue as often as the delivery limit allows, and delivered all
/// the same: RabbitMQ 4.3 no longer counts a consumer's requeue toward the limit (up to 4.2 the
/// broker dead-letters it into `<prefix>.parked` at the limit), so the worker parks it whole,
/// without running it, as the broker did.
async fn park_returned(
    raw: lapin::message::Delivery,
    acker: Settle,
    queue: &str,
    ctx: &TaskCtx,
    requeue: Requeue<'_>,
) {
    let (key, exchange) = (raw.routing_key.to_string(), raw.exchange.to_string());
    let (d, _) = envelope::decode(queue, raw.data, raw.properties, &key, &exchange, true);
    let reason = format!(
        "returned to its queue {} times without being settled: the queue's delivery limit ({DELIVERY_LIMIT})",
        requeue.returned_before
    );
    tracing::warn!(queue, id = %d.message_id, %reason, "parking a message the broker keeps delivering");
    let r = park(&d, &reason, "delivery_limit", ctx).await;
    settle(acker, queue, &d.message_id, r, requeue).await;
}

/// A batch: every member runs (and is retried, parked or put back) on its own; the batch is
/// acked once all are settled, else returned whole. An unreadable batch is parked whole.
async fn batch_delivery<H: Handler>(
    raw: lapin::message::Delivery,
    acker: Settle,
    queue: &str,
    handler: &H,
    ctx: &TaskCtx,
    requeue: Requeue<'_>,
) {
    let redelivered = raw.redelivered;
    // the count must be the header's and within what a publisher of ours sends, checked
    // before anything is allocated per member: a forged batch cannot blow up the worker
    let announced = batch::announced_count(&raw.properties);
    let members = match batch::members(&raw.data, Some(announced), ctx.batch_max_members) {
        Ok(m) => m,
        Err(reason) => {
            // copied (the members' reader borrows the body): only an unreadable batch is
            let (d, _) = envelope::decode(
                queue,
                raw.data.clone(),
                raw.properties,
                raw.routing_key.as_str(),
                raw.exchange.as_str(),
                redelivered,
            );
            let reason = format!("invalid batch: {reason}");
            tracing::warn!(queue, id = %d.message_id, %reason, "parking an unreadable batch");
            let r = park(&d, &reason, "invalid", ctx).await;
            settle(acker, queue, &d.message_id, r, requeue).await;
            return;
        }
    };
    let batch_id = raw
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let (key, exchange) = (raw.routing_key.as_str(), raw.exchange.as_str());
    tracing::debug!(queue, batch = %batch_id, redelivered, members = announced, "batch received");
    let batch = Batch {
        queue,
        props: &raw.properties,
        key,
        exchange,
        redelivered,
        metrics: QueueMetrics::of(queue),
    };
    // as many members run at once as the handlers that may run at once, each in one of that
    // many lanes (not a task or a future per member)
    let lanes = if handler.io_bound() {
        ctx.settings.io_concurrency
    } else {
        ctx.settings.concurrency
    }
    .clamp(1, announced.max(1) as usize);
    let hand = Hand {
        ready: Mutex::new(VecDeque::new()),
        more: Notify::new(),
        finished: AtomicBool::new(false),
    };
    let driving = drive(members, &batch, &hand, lanes, handler, ctx);
    let running = futures::future::join_all((0..lanes).map(|_| lane(&hand, &batch, handler, ctx)));
    let (driven, ran) = tokio::join!(driving, running);
    // every member ran to its end, whatever another's result: the first error decides
    let first_error = driven.or(ran.into_iter().flatten().next());
    settle(
        acker,
        queue,
        &batch_id,
        first_error.map_or(Ok(()), Err),
        requeue,
    )
    .await;
}

/// How long before its due time a held batch member is decoded and its cancel sync done (one
/// sync for the members due together), at most: at its due time only the cancel check and its
/// handler are left. Never more than half a `cancel.notice` ([`prep_lead_ms`]). A batch thus holds decoded only its members due within this time; the rest stay
/// in its body.
const PREP_LEAD_MS: u64 = 100;

/// How long before its due time a batch member is prepared with a cancel notice of
/// `notice_ms`: a sync that starts then is still within the notice, so a cancel confirmed
/// `notice_ms` before the due time is read before the member runs.
fn prep_lead_ms(notice_ms: u64) -> u64 {
    PREP_LEAD_MS.min(notice_ms / 2)
}

/// What every member of a batch shares.
struct Batch<'a> {
    queue: &'a str,
    props: &'a lapin::BasicProperties,
    key: &'a str,
    exchange: &'a str,
    redelivered: bool,
    metrics: QueueMetrics,
}

impl Batch<'_> {
    /// A member as if it had been delivered alone (its owner the batch writer's, see
    /// [`member_properties`]).
    fn decode(&self, m: batch::Member, ctx: &TaskCtx) -> (Delivery, Option<String>) {
        let owner = owner_of(&m.properties, Some(self.props), &ctx.trust);
        let props = member_properties(m.properties, self.props, &ctx.trust, self.queue);
        let mut decoded = envelope::decode(
            self.queue,
            m.body,
            props,
            self.key,
            self.exchange,
            self.redelivered,
        );
        decoded.0.owner = owner;
        decoded
    }
}

/// A member's turn in a lane.
enum Turn {
    /// Decoded, its cancel sync done, due: it runs at once.
    Due(Delivery),
    /// Anything else (an invalid envelope, no due time, due too far off to hold, a sync that
    /// failed): it goes the whole way of a message alone ([`one`]).
    Whole((Delivery, Option<String>)),
}

/// The members of one batch whose turn has come, for its lanes.
struct Hand {
    ready: Mutex<VecDeque<Turn>>,
    more: Notify,
    /// Every member was handed out.
    finished: AtomicBool,
}

impl Hand {
    fn push(&self, turns: impl IntoIterator<Item = Turn>, lanes: usize) {
        let n = {
            let mut r = self.ready.lock().unwrap_or_else(|p| p.into_inner());
            let before = r.len();
            r.extend(turns);
            r.len() - before
        };
        if n >= lanes {
            self.more.notify_waiters();
        } else {
            (0..n).for_each(|_| self.more.notify_one());
        }
    }

    fn pop(&self) -> Option<Turn> {
        self.ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    /// The next member's turn; `None` once all were handed out.
    async fn next(&self) -> Option<Turn> {
        loop {
            let notified = self.more.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(t) = self.pop() {
                return Some(t);
            }
            if self.finished.load(Ordering::Acquire) {
                return self.pop();
            }
            notified.await;
        }
    }
}

/// Decodes the members of a batch as they come within [`prep_lead_ms`] of their due time
/// (they come in due-time order), syncs with the cancels for them, and hands each to the lanes
/// at its due time, never before it (the wall clock is read again after every wake-up). The
/// first error it met (a member unreadable after all).
async fn drive<H: Handler>(
    mut members: impl Iterator<Item = std::result::Result<batch::Member, String>>,
    b: &Batch<'_>,
    hand: &Hand,
    lanes: usize,
    handler: &H,
    ctx: &TaskCtx,
) -> Option<Error> {
    let held = &crate::metrics::global().held;
    let max_hold = ctx.settings.max_hold.as_millis();
    let lead = prep_lead_ms(ctx.cancels.notice_ms());
    let mut first_error = None;
    // the next member, decoded, not yet within the lead
    let mut next: Option<(Delivery, Option<String>)> = None;
    let mut exhausted = false;
    // decoded, synced, waiting for their due time (in due order)
    let mut staged: VecDeque<Delivery> = VecDeque::new();
    // the latest due time synced for, and told the journal of
    let (mut synced, mut busy): (Option<u64>, Option<u64>) = (None, None);
    loop {
        let now = now_ms();
        while !exhausted {
            let (mut d, invalid) = match next.take() {
                Some(decoded) => decoded,
                None => match members.next() {
                    None => {
                        exhausted = true;
                        break;
                    }
                    Some(Err(reason)) => {
                        // the whole batch was parsed before the first member was given out
                        first_error
                            .get_or_insert(Error::Invalid(format!("invalid batch: {reason}")));
                        continue;
                    }
                    Some(Ok(m)) => b.decode(m, ctx),
                },
            };
            if d.due_at_ms.is_none() {
                d.due_at_ms = handler.due_at(&d);
            }
            let due = match (invalid.is_none(), d.due_at_ms) {
                (true, Some(due)) if due.saturating_sub(now) <= max_hold => due,
                _ => {
                    hand.push([Turn::Whole((d, invalid))], lanes);
                    continue;
                }
            };
            if due > now + lead {
                // not yet within the lead: the next turn of the outer loop takes it up
                next = Some((d, invalid));
                break;
            }
            // every cancel confirmed `cancel.notice` before its due time is read before it
            // runs: the sync starts now, at most the lead (half a notice) before it
            if synced.is_none_or(|s| s < due) {
                // what is due already does not wait for a barrier's round trip
                release_due(&mut staged, hand, lanes, held);
                if !synced_for(due, b, ctx).await {
                    // it goes the whole way, which syncs again (or fails) on its own
                    hand.push([Turn::Whole((d, invalid))], lanes);
                    continue;
                }
                synced = Some(due);
            }
            if busy != Some(due) {
                ctx.publisher.journal_busy_at(due);
                busy = Some(due);
            }
            staged.push_back(d);
            held.inc();
        }
        release_due(&mut staged, hand, lanes, held);
        if exhausted && next.is_none() && staged.is_empty() {
            break;
        }
        // sleep until the first staged member is due, or the next one is within the lead
        let staged_due = staged.front().and_then(|d| d.due_at_ms);
        let next_prep =
            (next.as_ref().and_then(|(d, _)| d.due_at_ms)).map(|t| t.saturating_sub(lead));
        let target = staged_due.into_iter().chain(next_prep).min().unwrap_or(now);
        if let Some(step) = hold_sleep(now_ms(), target, false) {
            tokio::time::sleep(Duration::from_millis(step)).await;
        }
    }
    hand.finished.store(true, Ordering::Release);
    hand.more.notify_waiters();
    first_error
}

/// Syncs with the cancels for members due at `due` (counted when it appended a barrier):
/// whether it did.
async fn synced_for(due: u64, b: &Batch<'_>, ctx: &TaskCtx) -> bool {
    match ctx.cancels.sync_for(Some(due)).await {
        Ok(appended) => {
            if appended {
                ctx.counters.count(Event::CancelSync, b.queue);
            }
            true
        }
        Err(_) => false,
    }
}

/// Hands the lanes every staged member due by now (the wall clock read now).
fn release_due(
    staged: &mut VecDeque<Delivery>,
    hand: &Hand,
    lanes: usize,
    held: &prometheus_client::metrics::gauge::Gauge,
) {
    let now = now_ms();
    let due = staged
        .iter()
        .take_while(|d| d.due_at_ms.is_some_and(|due| due <= now))
        .count();
    if due > 0 {
        held.dec_by(due as i64);
        hand.push(staged.drain(..due).map(Turn::Due), lanes);
    }
}

/// Runs the members handed out, one at a time, until all were; the first error it met.
async fn lane<H: Handler>(hand: &Hand, b: &Batch<'_>, handler: &H, ctx: &TaskCtx) -> Option<Error> {
    let mut first_error = None;
    while let Some(turn) = hand.next().await {
        let r = match turn {
            Turn::Due(d) => run_due(d, handler, ctx, &b.metrics, false, true).await,
            // a batch that started runs to the end (within the shutdown grace): its members
            // are never skipped
            Turn::Whole(decoded) => one(decoded, handler, ctx, &b.metrics, false).await,
        };
        let r = match r {
            // a member cannot go back to the queue alone: re-schedule it, attempt kept
            Ok((d, Done::PutBack(reason))) => reschedule(&d, &reason, ctx, d.attempt, 1_000).await,
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        if let (None, Err(e)) = (&first_error, r) {
            first_error = Some(e);
        }
    }
    first_error
}

/// What `settle` needs to return a message it could not settle.
#[derive(Clone, Copy)]
struct Requeue<'a> {
    /// The broker's count of this delivery's earlier returns ([`headers::delivery_count`]).
    returned_before: u64,
    /// `consumer.requeue_pause`: the pause before the first return.
    first_pause_ms: u64,
    /// Set when the worker stops: the pause ends early.
    stopping: &'a std::sync::atomic::AtomicBool,
}

/// Acks after success; after a failure to re-schedule or park, returns the message (a
/// batch: all of it, its finished members run again — at-least-once) after a pause that grows
/// with its earlier returns (`retry::requeue_pause_ms`): each return counts toward the quorum
/// queues' delivery limit, so broker trouble of a few minutes does not park it.
async fn settle(acker: Settle, queue: &str, id: &str, r: Result<()>, requeue: Requeue<'_>) {
    match r {
        Ok(()) => {
            tracing::debug!(queue, id, "done; acked with its run");
            acker.ack().await;
        }
        Err(e) => {
            let pause = Duration::from_millis(crate::retry::requeue_pause_ms(
                requeue.first_pause_ms,
                requeue.returned_before,
            ));
            tracing::error!(
                queue,
                id,
                returned_before = requeue.returned_before,
                "{}; returning the message to the queue in {pause:?}",
                crate::error::chain(&e)
            );
            // the pause keeps a persistent failure from becoming a hot loop; a stopping
            // worker returns the message at once
            let until = Instant::now() + pause;
            while !requeue.stopping.load(Ordering::Relaxed) {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                tokio::time::sleep(left.min(Duration::from_millis(100))).await;
            }
            let _ = acker.give_back().await;
        }
    }
}

/// Runs the handler on one message (plain, or a batch member) and carries out its outcome.
/// `Err` when a re-schedule or park could not be published. With `may_skip`, a message whose
/// turn comes after the worker began stopping is not started.
async fn one<H: Handler>(
    decoded: (Delivery, Option<String>),
    handler: &H,
    ctx: &TaskCtx,
    qm: &QueueMetrics,
    may_skip: bool,
) -> Result<(Delivery, Done)> {
    let (mut d, invalid) = decoded;
    if let Some(reason) = invalid {
        tracing::warn!(queue = %d.queue, id = %d.message_id, %reason, "parking a message with an invalid envelope");
        ctx.counters.count(Event::Delivered, &d.queue);
        park(&d, &reason, "invalid", ctx).await?;
        return Ok((d, Done::Parked));
    }
    // a grain batch (or a message alone on a coarse route) arrives before it is due, and so
    // does a message whose handler names its due time (the gateway's short `x-delay`): it
    // waits here, its delivery unacked, and runs at its due time, never before
    if d.due_at_ms.is_none() {
        d.due_at_ms = handler.due_at(&d);
    }
    if let Some(due) = d.due_at_ms
        && let Some(done) = hold_until_due(&d, due, ctx, may_skip).await?
    {
        return Ok((d, done));
    }
    run_due(d, handler, ctx, qm, may_skip, false).await
}

/// Runs `d`, due now: its cancel sync unless `synced` (one started no earlier than its due
/// time less `cancel.notice`), the cancel check, the handler, its outcome.
async fn run_due<H: Handler>(
    d: Delivery,
    handler: &H,
    ctx: &TaskCtx,
    qm: &QueueMetrics,
    may_skip: bool,
    synced: bool,
) -> Result<(Delivery, Done)> {
    let permits = if handler.io_bound() {
        &ctx.io
    } else {
        &ctx.business
    };
    let _permit = if handler.takes_permit(&d) {
        Some(permits.acquire().await.expect("never closed"))
    } else {
        None
    };
    if may_skip && ctx.stopping.load(Ordering::Relaxed) {
        return Ok((d, Done::NotStarted));
    }
    // every cancel confirmed `cancel.notice` before the due time has been read before anything
    // runs; if the stream cannot be read, the message waits (it goes back to the queue)
    ctx.counters.count_in(Event::Delivered, &d.queue, qm);
    if !synced && ctx.cancels.sync_for(d.due_at_ms).await? {
        ctx.counters.count(Event::CancelSync, &d.queue);
    }
    if let Some(done) = steered(&d, ctx).await? {
        return Ok((d, done));
    }
    let Some(outcome) = run_handler(&d, handler, ctx, qm).await else {
        cancelled(&d, ctx, "acked while held by \"not now\", not run again");
        return Ok((d, Done::Cancelled));
    };
    let done = carry_out(&d, outcome, ctx, qm).await?;
    Ok((d, done))
}

/// What the control stream says of `d` as it is about to run: `None` to run it; else it was
/// cancelled, purged or moved (a reschedule) and is done.
async fn steered(d: &Delivery, ctx: &TaskCtx) -> Result<Option<Done>> {
    let (what, outcome) = match ctx.cancels.steer(&Subject::of(d)) {
        Steer::Run => return Ok(None),
        Steer::Cancelled => ("acked without running", RunOutcome::Cancelled),
        Steer::Purged => ("purged: acked without running", RunOutcome::Cancelled),
        Steer::Superseded => (
            "rescheduled earlier: its earlier copy runs, this one is acked without running",
            RunOutcome::Superseded,
        ),
        Steer::MoveTo(due) => {
            move_later(d, due, ctx).await?;
            ran(ctx, d, RunOutcome::Rescheduled { due_ms: due });
            return Ok(Some(Done::Retried));
        }
    };
    cancelled(d, ctx, what);
    ran(ctx, d, outcome);
    Ok(Some(Done::Cancelled))
}

/// Sends a copy of `d` round the tiers again, due at exactly `due` (a reschedule moved it
/// later: the copy is told from the old one by its due time).
async fn move_later(d: &Delivery, due: u64, ctx: &TaskCtx) -> Result<()> {
    let props = envelope::republish_properties(
        &d.properties,
        envelope::headers_for_reschedule(d.headers(), d.owner.as_deref()),
    );
    let mut msg = Message::new(
        d.queue.clone(),
        due.saturating_sub(now_ms()),
        d.body.clone(),
    )
    .with_properties(props)
    .with_attempt(d.attempt)
    .internal()
    .unjournaled();
    msg.due_at = Some(due);
    ctx.publisher.schedule(msg).await?;
    tracing::info!(queue = %d.queue, id = %d.message_id, due_at_ms = due, "rescheduled: sent round the tiers again");
    Ok(())
}

/// Journals what became of `d` (batched with the publisher's records; never waits).
fn ran(ctx: &TaskCtx, d: &Delivery, outcome: RunOutcome) {
    ctx.publisher.journal_run(Run {
        id: d.message_id.clone(),
        owner: d.owner.clone(),
        queue: d.queue.clone(),
        due_ms: d.due_at_ms.unwrap_or_default(),
        at_ms: now_ms(),
        outcome,
    });
}

/// Holds `d` until `due` (its cancel sync done on the way, half a notice before), never
/// returning before it. `Some` when it is not to run now: the worker is stopping
/// ([`Done::NotStarted`]), or it came more than `consumer.max_hold` early and was sent through
/// the tiers again for the rest ([`Done::Retried`]).
async fn hold_until_due(
    d: &Delivery,
    due: u64,
    ctx: &TaskCtx,
    may_skip: bool,
) -> Result<Option<Done>> {
    // the cancel sync it needs may start half a notice before its due time: done while it is
    // held, it adds nothing to its lateness
    let sync_at = due.saturating_sub(ctx.cancels.notice_ms() / 2);
    let max_hold = ctx.settings.max_hold.as_millis();
    let held = match hold_until(sync_at, due, max_hold, &ctx.stopping, may_skip).await {
        Hold::Due if sync_at < due && now_ms() < due => {
            if ctx.cancels.sync_for(Some(due)).await? {
                ctx.counters.count(Event::CancelSync, &d.queue);
            }
            hold_until(due, due, max_hold, &ctx.stopping, may_skip).await
        }
        other => other,
    };
    match held {
        Hold::Due => Ok(None),
        Hold::Stopping => Ok(Some(Done::NotStarted)),
        Hold::TooEarly(left) => {
            let reason = format!(
                "arrived {} before its due time, more than consumer.max_hold ({}): sent through the tiers again for the rest",
                crate::time::DurationMs(left),
                ctx.settings.max_hold
            );
            tracing::warn!(queue = %d.queue, id = %d.message_id, %reason);
            reschedule(
                d,
                &reason,
                ctx,
                d.attempt,
                left.min(ctx.layout.max_delay_ms()),
            )
            .await?;
            Ok(Some(Done::Retried))
        }
    }
}

/// Runs the handler (within `consumer.handler_timeout`), again with a growing pause while it
/// says "not now", for up to `consumer.requeue_hold`; `None` when the message was cancelled
/// meanwhile. Observes lateness, time in the handler and the handlers in flight.
async fn run_handler<H: Handler>(
    d: &Delivery,
    handler: &H,
    ctx: &TaskCtx,
    qm: &QueueMetrics,
) -> Option<Outcome> {
    let metrics = crate::metrics::global();
    // DESIGN rule 10: both stay below the broker's consumer_timeout (checked in settings)
    let timeout = ctx.settings.handler_timeout.as_duration();
    let hold = ctx.settings.requeue_hold.as_duration();
    let hctx = Context {
        publisher: ctx.publisher.clone(),
        cancels: ctx.cancels.clone(),
        trust: ctx.trust.clone(),
    };
    let held = Instant::now();
    let mut pause = Duration::from_millis(250);
    if let Some(due) = d.due_at_ms {
        let late = now_ms().saturating_sub(due);
        qm.lateness.observe(late as f64 / 1000.0);
    }
    metrics.in_flight.inc();
    let outcome = loop {
        let outcome = match tokio::time::timeout(timeout, handler.handle(d, &hctx)).await {
            Ok(o) => o,
            Err(_) => Outcome::Retry(format!(
                "handler timed out after {}",
                ctx.settings.handler_timeout
            )),
        };
        match outcome {
            Outcome::Requeue(reason) if held.elapsed() + pause < hold => {
                tracing::info!(queue = %d.queue, id = %d.message_id, %reason, "not processed now; trying again in {pause:?}");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                if ctx.cancels.is_cancelled(&d.message_id, d.owner.as_deref()) {
                    break None;
                }
            }
            other => break Some(other),
        }
    };
    metrics.in_flight.dec();
    qm.handler_duration.observe(held.elapsed().as_secs_f64());
    outcome
}

/// Does what the handler decided: acks (by returning), re-schedules with backoff, parks, or
/// puts back. `Err` when a re-schedule or park could not be published.
async fn carry_out(
    d: &Delivery,
    outcome: Outcome,
    ctx: &TaskCtx,
    qm: &QueueMetrics,
) -> Result<Done> {
    Ok(match outcome {
        Outcome::Success => {
            ctx.cancels.executed(&d.message_id, &d.queue);
            ctx.counters.count_in(Event::Succeeded, &d.queue, qm);
            ran(ctx, d, RunOutcome::Done);
            Done::Succeeded
        }
        Outcome::Retry(reason) if ctx.settings.retry.may_retry(d.attempt) => {
            let random: f64 = rand::rng().random();
            // a backoff longer than the topology's longest delay (retry.cap defaults to 1 h)
            // could never be scheduled: the message would go back to the queue again and again
            let delay = ctx
                .settings
                .retry
                .backoff_ms(d.attempt, random)
                .min(ctx.layout.max_delay_ms());
            reschedule(d, &reason, ctx, d.attempt + 1, delay).await?;
            let next_due_ms = now_ms().saturating_add(delay);
            ran(ctx, d, RunOutcome::Retried { next_due_ms });
            Done::Retried
        }
        Outcome::Retry(reason) => {
            let why = format!(
                "gave up after {} attempts; last error: {reason}",
                d.attempt + 1
            );
            park(d, &why, "exhausted", ctx).await?;
            ctx.cancels.executed(&d.message_id, &d.queue);
            Done::Parked
        }
        Outcome::Permanent(reason) => {
            park(d, &reason, "permanent", ctx).await?;
            ctx.cancels.executed(&d.message_id, &d.queue);
            Done::Parked
        }
        Outcome::Requeue(reason) => Done::PutBack(reason),
        Outcome::Cancelled => {
            cancelled(d, ctx, "acked by its handler, which found it cancelled");
            Done::Cancelled
        }
    })
}

/// Counts and logs a cancelled message (acked without running, or without running again).
fn cancelled(d: &Delivery, ctx: &TaskCtx, what: &str) {
    ctx.cancels
        .fell_due(&d.message_id, d.owner.as_deref(), d.due_at_ms);
    ctx.counters.count(Event::Cancelled, &d.queue);
    tracing::info!(queue = %d.queue, id = %d.message_id, attempt = d.attempt, "cancelled: {what}");
}

/// Re-schedules a copy of `d` through the tiers after `delay` ms with attempt `attempt`.
async fn reschedule(
    d: &Delivery,
    reason: &str,
    ctx: &TaskCtx,
    attempt: u32,
    delay: u64,
) -> Result<()> {
    let props = envelope::republish_properties(
        &d.properties,
        envelope::headers_for_reschedule(d.headers(), d.owner.as_deref()),
    );
    let msg = Message::new(d.queue.clone(), delay, d.body.clone())
        .with_properties(props)
        .with_attempt(attempt)
        .internal()
        .unjournaled();
    ctx.publisher.schedule(msg).await?;
    ctx.counters.count(Event::Retried, &d.queue);
    tracing::info!(queue = %d.queue, id = %d.message_id, attempt = d.attempt, delay_ms = delay, %reason, "retry scheduled");
    Ok(())
}

/// Parks a copy of `d` in its queue's parking queue with the reason, confirmed.
async fn park(d: &Delivery, reason: &str, kind: &str, ctx: &TaskCtx) -> Result<()> {
    let empty = FieldTable::default();
    // DESIGN rules 3 and 14: no dead-letter history, `CC` or `BCC` on the parked copy
    let mut h = headers::strip_death(d.headers().unwrap_or(&empty));
    h.insert(
        headers::PARKED_REASON.into(),
        AMQPValue::LongString(LongString::from(reason)),
    );
    h.insert(
        headers::PARKED_AT.into(),
        AMQPValue::LongLongInt(now_ms() as i64),
    );
    h.insert(
        headers::PARKED_ATTEMPTS.into(),
        AMQPValue::LongLongInt(i64::from(d.attempt) + 1),
    );
    h.insert(
        headers::PARKED_FROM.into(),
        AMQPValue::LongString(LongString::from(d.queue.as_str())),
    );
    // who scheduled it, for whoever looks at the parked copy
    if let Some(owner) = &d.owner {
        h.insert(
            headers::OWNER.into(),
            AMQPValue::LongString(LongString::from(owner.as_str())),
        );
    }
    let props = envelope::republish_properties(&d.properties, h).with_delivery_mode(2);
    let target = ctx.layout.parked_queue(&d.queue);
    // a parking queue missing or unbound (deleted since it was declared) returns it: the
    // delivery is not settled, it comes back to the queue
    ctx.publisher
        .publish_confirmed(&ctx.park_exchange, &d.queue, &d.body, props)
        .await?;
    ctx.counters.count(Event::Parked(kind), &d.queue);
    ran(ctx, d, RunOutcome::Parked);
    tracing::warn!(queue = %d.queue, id = %d.message_id, parked_in = %target, %reason, "message parked");
    Ok(())
}

#[cfg(test)]
mod tests;
