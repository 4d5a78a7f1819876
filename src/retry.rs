//! Retry policy, pure: how long to wait before attempt `n + 1`, and when to give up.
//! Exponential backoff with jitter: `min(cap, base · factor^attempt)`, then reduced by a random
//! fraction of at most `jitter` (0 = exact, 0.5 = "equal jitter", 1 = "full jitter").

use serde::{Deserialize, Serialize};

use crate::time::DurationMs;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
/// When and how a failed message is retried, and when it is parked.
pub struct RetryPolicy {
    /// Delay before the first retry.
    pub base: DurationMs,
    /// Growth per attempt.
    pub factor: f64,
    /// Longest delay between attempts.
    pub cap: DurationMs,
    /// Executions in all (first try included) before the message is parked.
    pub max_attempts: u32,
    /// Fraction of the delay that may be taken off at random (0..=1).
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: DurationMs(1000),
            factor: 2.0,
            cap: DurationMs(3_600_000),
            max_attempts: 5,
            jitter: 0.5,
        }
    }
}

impl RetryPolicy {
    /// Checks factor, jitter, attempts and cap.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_attempts == 0 {
            return Err("retry.max_attempts must be at least 1".into());
        }
        if !(self.factor.is_finite() && self.factor >= 1.0) {
            return Err(format!(
                "retry.factor must be at least 1, got {}",
                self.factor
            ));
        }
        if !(self.jitter.is_finite() && (0.0..=1.0).contains(&self.jitter)) {
            return Err(format!(
                "retry.jitter must be between 0 and 1, got {}",
                self.jitter
            ));
        }
        if self.cap < self.base {
            return Err(format!(
                "retry.cap ({}) must not be shorter than retry.base ({})",
                self.cap, self.base
            ));
        }
        Ok(())
    }

    /// Whether execution number `attempt` (0-based) failing leaves another try.
    pub fn may_retry(&self, attempt: u32) -> bool {
        attempt.saturating_add(1) < self.max_attempts
    }

    /// Longest backoff after execution `attempt` (0-based) failed, before jitter.
    pub fn ceiling_ms(&self, attempt: u32) -> u64 {
        let raw = self.base.as_millis() as f64 * self.factor.powi(attempt.min(1000) as i32);
        let cap = self.cap.as_millis();
        if raw.is_finite() && raw < cap as f64 {
            raw as u64
        } else {
            cap
        }
    }

    /// Backoff after execution `attempt` failed, with `random` in `[0, 1)` choosing the jitter.
    pub fn backoff_ms(&self, attempt: u32, random: f64) -> u64 {
        let c = self.ceiling_ms(attempt);
        let off = (c as f64 * self.jitter * random.clamp(0.0, 1.0)) as u64;
        c - off.min(c)
    }

    /// How long after its first due time a message can still run: every attempt's handler
    /// timeout and every backoff in between, at their longest.
    pub fn horizon_ms(&self, handler_timeout_ms: u64) -> u64 {
        let attempts = self.max_attempts.max(1);
        let backoffs: u64 = (0..attempts - 1)
            .map(|a| self.ceiling_ms(a))
            .fold(0u64, u64::saturating_add);
        backoffs.saturating_add(handler_timeout_ms.saturating_mul(u64::from(attempts)))
    }

    /// Shortest possible backoff after execution `attempt` failed.
    pub fn floor_ms(&self, attempt: u32) -> u64 {
        self.backoff_ms(attempt, 1.0)
    }
}

/// How long the worker holds a message it could not settle (its retry or parked copy was
/// not confirmed) before returning it to its queue, from the first pause
/// (`consumer.requeue_pause`, 1 s by default) and the broker's count of its earlier returns:
/// doubling, at most [`REQUEUE_PAUSE_CAP`] times the first. Every return counts toward the
/// quorum queues' delivery limit (20, then the message is parked: DESIGN rule 12), so the
/// pause grows: the limit is reached after 481 first pauses of failures (about 8 minutes at
/// 1 s), not 20.
pub(crate) fn requeue_pause_ms(first_ms: u64, returned_before: u64) -> u64 {
    // 2^5 is past the cap already
    first_ms
        .saturating_mul(1u64 << returned_before.min(5))
        .min(first_ms.saturating_mul(REQUEUE_PAUSE_CAP))
}

/// The longest pause of [`requeue_pause_ms`], in first pauses.
pub(crate) const REQUEUE_PAUSE_CAP: u64 = 30;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exponential_and_capped() {
        let p = RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        let seq: Vec<u64> = (0..14).map(|a| p.backoff_ms(a, 0.7)).collect();
        assert_eq!(&seq[..4], &[1000, 2000, 4000, 8000]);
        assert_eq!(seq[13], 3_600_000);
        assert!(p.may_retry(3) && !p.may_retry(4));
    }

    #[test]
    fn the_horizon_covers_every_attempt() {
        let p = RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        // 1 + 2 + 4 + 8 s of backoff, 5 × 5 min of handler time
        assert_eq!(p.horizon_ms(300_000), 15_000 + 1_500_000);
    }

    #[test]
    fn bad_policies_are_named() {
        let p = RetryPolicy {
            jitter: 2.0,
            ..RetryPolicy::default()
        };
        assert!(p.validate().unwrap_err().contains("retry.jitter"));
        let p = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert!(p.validate().unwrap_err().contains("max_attempts"));
    }

    proptest! {
        #[test]
        fn jitter_stays_within_bounds(attempt in 0u32..40, r in 0.0f64..1.0, j in 0.0f64..=1.0) {
            let p = RetryPolicy { jitter: j, ..RetryPolicy::default() };
            let b = p.backoff_ms(attempt, r);
            prop_assert!(b <= p.ceiling_ms(attempt));
            prop_assert!(b >= p.floor_ms(attempt));
        }
    }

    #[test]
    fn the_requeue_pause_doubles_to_its_cap_and_twenty_returns_take_minutes() {
        assert_eq!(requeue_pause_ms(1000, 0), 1000);
        assert_eq!(requeue_pause_ms(1000, 1), 2000);
        assert_eq!(requeue_pause_ms(1000, 4), 16_000);
        assert_eq!(requeue_pause_ms(1000, 5), 30_000);
        assert_eq!(requeue_pause_ms(1000, u64::MAX), 30_000);
        assert_eq!(requeue_pause_ms(u64::MAX, 3), u64::MAX);
        let to_limit: u64 = (0..20).map(|n| requeue_pause_ms(1000, n)).sum();
        assert_eq!(to_limit, 481_000);
        let short: u64 = (0..20).map(|n| requeue_pause_ms(20, n)).sum();
        assert_eq!(short, 481 * 20);
    }
}
