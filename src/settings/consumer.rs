//! The `[consumer]` section: the worker's settings, its routes and their checks.

use super::*;

/// Worker (`delay-consumer`) settings.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ConsumerSettings {
    /// Unacknowledged deliveries the broker sends ahead, per queue.
    pub prefetch: u16,
    /// Handlers running at once, over all queues (business handlers: exec, http, your own).
    pub concurrency: usize,
    /// Messages an I/O stage (the gateway, `forward`, `relay`) moves at once, each awaiting
    /// its publish confirm; also their prefetch. Independent of `concurrency`.
    pub io_concurrency: usize,
    /// Deliveries a queue's consumer may hold unacked, on top of its prefetch, while they
    /// wait for their due time (grain batches reach the worker up to `publisher.grain` and a
    /// fifth of it early).
    pub hold_prefetch: u16,
    /// Messages (batch members count one each) a worker keeps in hand at once, over all its
    /// queues, running or waiting for their due time: past it, it takes no more deliveries
    /// until some are done (a batch is taken when nothing else is in hand, whatever its size).
    pub max_in_hand: usize,
    /// Bytes of message bodies a worker keeps in hand at once (as `max_in_hand`).
    pub max_in_hand_bytes: usize,
    /// Longest a message is held for its due time. One that arrives earlier than that (a
    /// clock far behind the publisher's, a forged due time) is not held: it goes back
    /// through the tiers for the time that is left, so it still never runs early.
    pub max_hold: DurationMs,
    /// How long a message whose handler said "not now" (`Outcome::Requeue`) is held and
    /// retried in the worker before it goes back to its queue (each return to a RabbitMQ 4.x
    /// quorum queue can count towards its delivery limit); below the broker's
    /// `consumer_timeout`.
    pub requeue_hold: DurationMs,
    /// How long the worker waits before it returns a message it could not settle (its retry or
    /// parked copy was not confirmed: broker trouble) to its queue the first time; the pause
    /// doubles with each return, up to 30 times this. Each return counts toward the quorum
    /// delivery limit (20, then the message is parked): at 1 s that takes about 8 minutes of
    /// failures (481 first pauses).
    pub requeue_pause: DurationMs,
    /// A handler running longer counts as a retryable failure.
    pub handler_timeout: DurationMs,
    /// The broker's `consumer_timeout` (DESIGN rule 10) as the worker assumes it: RabbitMQ's
    /// default, 30 min.
    /// `handler_timeout` and `requeue_hold` are checked to stay below it, or the broker closes
    /// the channel under a slow handler. It describes the broker, it tunes nothing: set it only
    /// where the broker's `consumer_timeout` was changed (a worker cannot read the broker's
    /// value), so it is in no example configuration.
    pub consumer_timeout: DurationMs,
    /// On SIGTERM/SIGINT, how long in-flight handlers may finish before the worker exits
    /// (what did not finish is returned to the queue by the broker).
    pub shutdown_grace: DurationMs,
    /// Backoff of retries.
    pub retry: RetryPolicy,
    /// Exit code of an `exec` action that means "permanent failure: park, don't retry".
    pub permanent_exit_code: i32,
    /// Queue → action mappings for `delay-consumer` (instead of `--queue` + action flag).
    pub routes: Vec<RouteConfig>,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        ConsumerSettings {
            prefetch: 32,
            concurrency: 8,
            io_concurrency: 512,
            hold_prefetch: 512,
            max_in_hand: 200_000,
            max_in_hand_bytes: 256 << 20,
            max_hold: DurationMs(10_000),
            requeue_hold: DurationMs(5 * 60_000),
            requeue_pause: DurationMs(1000),
            handler_timeout: DurationMs(5 * 60_000),
            consumer_timeout: DurationMs(30 * 60_000),
            shutdown_grace: DurationMs(30_000),
            retry: RetryPolicy::default(),
            permanent_exit_code: 65,
            routes: Vec::new(),
        }
    }
}

/// One queue and the action `delay-consumer` runs for its messages (exactly one of
/// `exec`, `http`, `forward`, `relay`, `log`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RouteConfig {
    /// Destination queue to consume.
    pub queue: String,
    /// Command line; the body on stdin, DELAY_MESSAGE_ID / DELAY_ATTEMPT / DELAY_DUE_AT set.
    pub exec: Option<String>,
    /// URL to POST the body to.
    pub http: Option<String>,
    /// `EXCHANGE[:ROUTING_KEY]` to re-publish to.
    pub forward: Option<String>,
    /// Print one JSON line per message to stdout.
    pub log: bool,
    /// Queue to re-publish every message into, plainly (unpacking batches): for a queue whose
    /// consumer is not ours.
    pub relay: Option<String>,
}

impl RouteConfig {
    /// Checks the route names a queue and exactly one action.
    pub fn validate(&self) -> Result<(), String> {
        if self.queue.is_empty() {
            return Err("consumer.routes: every route needs a 'queue'".into());
        }
        let n = [
            self.exec.is_some(),
            self.http.is_some(),
            self.forward.is_some(),
            self.relay.is_some(),
            self.log,
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            return Err(format!(
                "consumer.routes: queue '{}' needs exactly one action of exec, http, forward, relay, log (has {n})",
                self.queue
            ));
        }
        Ok(())
    }
}

impl ConsumerSettings {
    /// Checks prefetch, concurrency, timeouts and the retry policy.
    pub fn validate(&self) -> Result<(), String> {
        if self.prefetch == 0 {
            return Err("consumer.prefetch must be at least 1".into());
        }
        if self.concurrency == 0 {
            return Err("consumer.concurrency must be at least 1".into());
        }
        if !(1..=u16::MAX as usize).contains(&self.io_concurrency) {
            return Err("consumer.io_concurrency must be between 1 and 65535".into());
        }
        if self.max_in_hand == 0 || self.max_in_hand_bytes == 0 {
            return Err(
                "consumer.max_in_hand and consumer.max_in_hand_bytes must be at least 1".into(),
            );
        }
        if self.max_hold >= self.consumer_timeout {
            return Err(format!(
                "consumer.max_hold ({}) must be shorter than the broker's consumer_timeout ({})",
                self.max_hold, self.consumer_timeout
            ));
        }
        if self.requeue_hold >= self.consumer_timeout {
            return Err(format!(
                "consumer.requeue_hold ({}) must be shorter than the broker's consumer_timeout ({})",
                self.requeue_hold, self.consumer_timeout
            ));
        }
        let longest_pause = self
            .requeue_pause
            .as_millis()
            .saturating_mul(crate::retry::REQUEUE_PAUSE_CAP);
        if self.requeue_pause.as_millis() == 0 || longest_pause >= self.consumer_timeout.as_millis()
        {
            return Err(format!(
                "consumer.requeue_pause ({}) must be positive and 30 times it shorter than the broker's consumer_timeout ({})",
                self.requeue_pause, self.consumer_timeout
            ));
        }
        if self.handler_timeout.as_millis() == 0 {
            return Err("consumer.handler_timeout must be positive".into());
        }
        if self.handler_timeout >= self.consumer_timeout {
            return Err(format!(
                "consumer.handler_timeout ({}) must be shorter than the broker's consumer_timeout ({}), or the broker closes the channel under a slow handler and the message is redelivered",
                self.handler_timeout, self.consumer_timeout
            ));
        }
        if !(1..=255).contains(&self.permanent_exit_code) {
            return Err(format!(
                "consumer.permanent_exit_code must be an exit code from 1 to 255, got {}",
                self.permanent_exit_code
            ));
        }
        self.retry.validate()?;
        for r in &self.routes {
            r.validate()?;
        }
        Ok(())
    }
}
