//! A running `delay-consumer --log` and the deliveries it logged.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::Child;

use super::wait_until;

/// What the worker's stall watchdog may add to lateness (it renews a subscription that brought
/// nothing for 10 s while its queue had ready messages, checking every 5 s; see the worker's
/// `STALL_AFTER`): allowed past a bound when the worker's log says it renewed one.
pub(crate) const STALL_ALLOWANCE_MS: u64 = 15_000;

/// One line of the worker's `--log`.
#[derive(Debug, Clone)]
pub(crate) struct Delivered {
    pub id: String,
    pub due_at: u64,
    pub fired_at: u64,
}

/// A running `delay-consumer --log`.
pub(crate) struct Worker {
    pub deliveries: Arc<Mutex<Vec<Delivered>>>,
    pub(super) log: Arc<Mutex<String>>,
    pub pid: u32,
    pub(super) child: Option<Child>,
}

impl Worker {
    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Whether it renewed a subscription that had stalled (see [`STALL_ALLOWANCE_MS`]).
    pub(crate) fn renewed_a_stalled_subscription(&self) -> bool {
        self.log().contains("none has reached this idle worker")
    }

    pub(crate) fn delivered(&self) -> Vec<Delivered> {
        self.deliveries.lock().unwrap().clone()
    }

    /// Still running?
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Waits until every id of `ids` was delivered (or `timeout`), then `linger` more for
    /// duplicates; returns whether all came.
    pub(crate) async fn wait_for(
        &self,
        ids: &HashSet<String>,
        timeout: Duration,
        linger: Duration,
    ) -> bool {
        let all = wait_until(timeout, || {
            let seen: HashSet<String> = self
                .deliveries
                .lock()
                .unwrap()
                .iter()
                .map(|d| d.id.clone())
                .collect();
            ids.iter().all(|i| seen.contains(i))
        })
        .await;
        tokio::time::sleep(linger).await;
        all
    }

    /// SIGTERM, then waits for it to exit (it acks what it ran).
    pub(crate) async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            if tokio::time::timeout(Duration::from_secs(20), c.wait())
                .await
                .is_err()
            {
                let _ = c.kill().await;
            }
        }
    }
}
