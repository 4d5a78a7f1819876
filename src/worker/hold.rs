//! Holding a delivery until it is due: the worker's last timing-wheel grain, with the cancel
//! sync done on the way and a stopping worker's early ones given back.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Event;
use super::process::{Done, TaskCtx, reschedule};
use crate::envelope::Delivery;
use crate::error::Result;
use crate::time::now_ms;

/// Holds `d` until `due` (its cancel sync done on the way, half a notice before), never
/// returning before it. `Some` when it is not to run now: the worker is stopping
/// ([`Done::NotStarted`]), or it came more than `consumer.max_hold` early and was sent through
/// the tiers again for the rest ([`Done::Retried`]).
pub(super) async fn hold_until_due(
    d: &Delivery,
    due: u64,
    ctx: &TaskCtx,
    may_skip: bool,
) -> Result<Option<Done>> {
    // the cancel sync it needs may start half a notice before its due time: done while it is
    // held, it adds nothing to its lateness
    let sync_at = due.saturating_sub(ctx.cancels.notice_ms() / 2);
    let held = match hold_until(sync_at, due, ctx, may_skip).await {
        Hold::Due if sync_at < due && now_ms() < due => {
            if ctx.cancels.sync_for(Some(due)).await? {
                ctx.counters.count(Event::CancelSync, &d.queue);
            }
            hold_until(due, due, ctx, may_skip).await
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

/// How waiting for a due time ended.
enum Hold {
    /// It is due now.
    Due,
    /// The worker began stopping while it waited (only when it may be skipped).
    Stopping,
    /// It is due in this many ms, more than `consumer.max_hold`: not held.
    TooEarly(u64),
}

/// Waits until `until` (ms since the epoch, by this machine's clock; at most the message's
/// `due` time), never returning before it; a message due further off than
/// `consumer.max_hold` is not waited for. Counted in the `held` gauge while it waits.
async fn hold_until(until: u64, due: u64, ctx: &TaskCtx, may_skip: bool) -> Hold {
    let now = now_ms();
    let left = due.saturating_sub(now);
    if left > ctx.settings.max_hold.as_millis() {
        return Hold::TooEarly(left);
    }
    let target = until.min(due);
    let Some(mut step) = hold_sleep(now, target, may_skip) else {
        return Hold::Due;
    };
    let held = &crate::metrics::global().held;
    held.inc();
    let end = loop {
        if may_skip && ctx.stopping.load(Ordering::Relaxed) {
            break Hold::Stopping;
        }
        tokio::time::sleep(Duration::from_millis(step)).await;
        match hold_sleep(now_ms(), target, may_skip) {
            None => break Hold::Due,
            Some(s) => step = s,
        }
    };
    held.dec();
    end
}

/// How long the hold sleeps at `now` before it looks at the clock again, waiting for `target`
/// (both ms since the epoch, the wall clock); `None` once `target` has come. The timer runs on
/// the monotonic clock, the due time on the wall clock, so the hold looks again after every
/// wake-up and never takes a wake-up for the due time itself. A message that may be skipped is
/// looked at at least every 100 ms, so a stopping worker gives it back (a batch's members run
/// to the end anyway).
pub(super) fn hold_sleep(now: u64, target: u64, may_skip: bool) -> Option<u64> {
    let left = target.saturating_sub(now);
    if left == 0 {
        return None;
    }
    Some(if may_skip { left.min(100) } else { left })
}
