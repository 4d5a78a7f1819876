//! Waiting for a delivery's due time: the worker's last timing-wheel grain, never returning
//! before it, giving a stopping worker's early ones back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::time::now_ms;

/// How waiting for a due time ended.
pub(super) enum Hold {
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
pub(super) async fn hold_until(
    until: u64,
    due: u64,
    max_hold_ms: u64,
    stopping: &AtomicBool,
    may_skip: bool,
) -> Hold {
    let now = now_ms();
    let left = due.saturating_sub(now);
    if left > max_hold_ms {
        return Hold::TooEarly(left);
    }
    let target = until.min(due);
    let Some(mut step) = hold_sleep(now, target, may_skip) else {
        return Hold::Due;
    };
    let held = &crate::metrics::global().held;
    held.inc();
    let end = loop {
        if may_skip && stopping.load(Ordering::Relaxed) {
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
