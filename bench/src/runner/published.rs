//! What the publishers of one pass did, which the measurement reads.

use amqp_delay::Result;

use amqp_delay_cli::cli::chain;

/// What the publishers did in one pass: the indexes that failed and how long publishing took.
pub(super) struct Published {
    pub(super) failed: Vec<usize>,
    pub(super) first_error: Option<String>,
    pub(super) hops_sum: u64,
    pub(super) publish_s: f64,
    /// Paced passes: the longest a message waited past its release time for its publisher to
    /// take it (0 when the publishers kept up).
    pub(super) release_lag_ms: u64,
}

impl Published {
    pub(super) fn empty() -> Self {
        Published {
            failed: Vec::new(),
            first_error: None,
            hops_sum: 0,
            publish_s: 0.0,
            release_lag_ms: 0,
        }
    }

    /// One publish's result: its planned hops, or its index as failed (the first error kept).
    pub(super) fn note(&mut self, i: usize, r: Result<usize>) {
        match r {
            Ok(h) => self.hops_sum += h as u64,
            Err(e) => {
                self.failed.push(i);
                self.first_error.get_or_insert_with(|| chain(&e));
            }
        }
    }

    /// Adds one publisher's share (the first error of the earliest publisher kept).
    pub(super) fn add(&mut self, share: Published) {
        self.failed.extend(share.failed);
        if self.first_error.is_none() {
            self.first_error = share.first_error;
        }
        self.hops_sum += share.hops_sum;
    }
}
