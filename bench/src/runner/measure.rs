//! One measured pass of the runner: declare a destination queue, start the consumers (and the
//! library stage of a batched scenario, `stage`), publish N messages (saturating or paced,
//! `publish`), wait for every confirmed one, then count the lost, duplicated and early ones
//! (what the consumers counted is in `tracker`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use amqp_delay::ops::broker::ResultExt;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Result};

use super::Bench;
use super::app::{AppEnd, Sender};
use super::published::Published;
use super::stage::{Path, Stage, Target};
use super::tracker::{Lateness, Tracker, steady_window};
use crate::amqp::{declare_plain_queue, delete_queue};
use crate::config::Scenario;

/// The broker messages (the tiers' and the journal's records) and the messages scheduled so
/// far in this process (the library's metrics: a batch is one broker message).
fn tier_counts() -> (u64, u64) {
    let m = amqp_delay::metrics::global();
    (
        m.broker_messages.get() + m.journal_records.get(),
        m.scheduled.get(),
    )
}

/// What one publish-and-consume run measured.
pub(super) struct RunOutcome {
    n: usize,
    pub(super) unique: usize,
    pub(super) lost: usize,
    pub(super) duplicates: usize,
    pub(super) publish_errors: usize,
    first_error: Option<String>,
    pub(super) e2e_s: f64,
    /// When the last message became due, in s after the first publish.
    max_due_s: f64,
    pub(super) publish_s: f64,
    /// Paced passes: the longest a message waited past its release time for its publisher.
    pub(super) release_lag_ms: u64,
    pub(super) hops_sum: u64,
    pub(super) observed_hops: u64,
    pub(super) lateness: Lateness,
    /// Broker messages published into the tiers and messages they carried during the pass.
    pub(super) tier_messages: (u64, u64),
}

impl RunOutcome {
    pub(super) fn msgs_per_s(&self) -> f64 {
        if self.e2e_s > 0.0 {
            self.unique as f64 / self.e2e_s
        } else {
            0.0
        }
    }
    /// The last message arrived about when it became due (the broker was not behind at the
    /// end) and a good part of the run was spent waiting for delays after publishing ended: the
    /// delays, not the broker, set the duration, so msg/s is only a lower bound. (A publisher
    /// slowed down by the broker's flow control also ends close to the last due time, but then
    /// publishing takes most of the run and the number is the broker's.)
    pub(super) fn delay_bound(&self) -> bool {
        self.max_due_s > 0.0
            && self.e2e_s <= self.max_due_s * 1.05 + 0.25
            && self.max_due_s - self.publish_s > 0.2 * self.e2e_s
    }

    /// Broker messages through the tiers per message scheduled (1 unbatched; `None` when
    /// nothing went through the tiers).
    pub(super) fn broker_msgs_per_msg(&self) -> Option<f64> {
        let (broker, scheduled) = self.tier_messages;
        (scheduled > 0).then(|| broker as f64 / scheduled as f64)
    }

    /// Broker messages through the tiers per message delivered: the gateway's measure, since
    /// the messages it holds are never scheduled into the tiers (0 when it held them all).
    pub(super) fn broker_msgs_per_delivered(&self) -> Option<f64> {
        (self.unique > 0).then(|| self.tier_messages.0 as f64 / self.unique as f64)
    }

    /// Broker messages through the tiers per message as scenario `sc` counts them: per
    /// message delivered for a gateway, else per message scheduled.
    pub(super) fn broker_msgs_per_msg_of(&self, sc: Scenario) -> Option<f64> {
        if sc.gateway() {
            self.broker_msgs_per_delivered()
        } else {
            self.broker_msgs_per_msg()
        }
    }

    /// Messages scheduled into the tiers per message delivered: below 1 for a gateway that
    /// held some in memory (0 when it held all), about 1 for the other delayed paths.
    pub(super) fn tiers_share(&self) -> Option<f64> {
        (self.unique > 0).then(|| self.tier_messages.1 as f64 / self.unique as f64)
    }

    pub(super) fn publish_msgs_per_s(&self) -> f64 {
        if self.publish_s > 0.0 {
            (self.n - self.publish_errors) as f64 / self.publish_s
        } else {
            0.0
        }
    }
}

/// Consumers running on a destination queue (and the library stage in front of it), ready for
/// a publish.
pub(super) struct Running {
    /// The measured queue, read by the bench's consumers (or by the stage's worker).
    queue: String,
    /// The bench's consumers read `queue` (else the stage's worker does, and deletes it).
    raw_consumers: bool,
    /// The application whose connections declared `queue` and consume it (else the bench's).
    app: Option<Arc<AppEnd>>,
    pub(super) target: Target,
    stage: Option<Stage>,
    pub(super) n: usize,
    pub(super) tracker: Arc<Tracker>,
    stop: watch::Sender<bool>,
    consumers: Vec<JoinHandle<Result<Lateness>>>,
    monitor: JoinHandle<()>,
    /// [`tier_counts`] at the start.
    tier_counts: (u64, u64),
}

impl Bench<'_> {
    /// Declares `queue` (the tiers' queue type) and starts the consumers on it, or the
    /// library stage `path` asks for.
    pub(super) async fn start(
        &self,
        label: &str,
        queue: &str,
        n: usize,
        path: &Path,
    ) -> Result<Running> {
        let tracker = Arc::new(Tracker::new(n));
        // the worker path's queue is a destination the stage declares and its worker reads
        let raw_consumers = !matches!(path, Path::Worker(_));
        let app = match path {
            Path::App(app) => Some(app.clone()),
            _ => None,
        };
        // an application's queue is on its broker, declared and read through its connections
        let (admin, consumer_conn, cleanup) = match &app {
            Some(a) => (&a.admin, &a.consumer, &a.cleanup),
            None => (&self.admin, &self.consumer_conn, self.cleanup),
        };
        if raw_consumers {
            cleanup.add_queue(queue);
            declare_plain_queue(admin, queue, self.cfg.settings.topology.queue_type).await?;
        }
        let (target, stage) = self.start_stage(path, queue, &tracker).await?;
        let (stop, stop_rx) = watch::channel(false);
        let n_consumers = if raw_consumers { self.cfg.consumers } else { 0 };
        let consumers = self
            .consumers(consumer_conn, queue, n_consumers, &tracker, &stop_rx)
            .await?;
        self.progress.phase(label, n as u64);
        let monitor = {
            let (t, bar) = (tracker.clone(), self.progress.bar().clone());
            tokio::spawn(async move {
                loop {
                    bar.set_position(t.unique.load(Ordering::Relaxed) as u64);
                    bar.set_message(format!("published {}", t.published.load(Ordering::Relaxed)));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        // an application declares its exchange and publishes at once (the releases of a paced
        // pass count from the first publish, after the declare)
        if let Some(app) = &app {
            app.declare(queue).await?;
        }
        let tier_counts = tier_counts();
        let _ = tracker.t0.set((Instant::now(), now_ms()));
        Ok(Running {
            queue: queue.to_string(),
            raw_consumers,
            app,
            target,
            stage,
            tier_counts,
            n,
            tracker,
            stop,
            consumers,
            monitor,
        })
    }

    /// `n` consumers of `queue` on `conn`, each on a channel of its own, counting into
    /// `tracker` until told to stop.
    async fn consumers(
        &self,
        conn: &lapin::Connection,
        queue: &str,
        n: usize,
        tracker: &Arc<Tracker>,
        stop: &watch::Receiver<bool>,
    ) -> Result<Vec<JoinHandle<Result<Lateness>>>> {
        let mut consumers = Vec::new();
        for _ in 0..n {
            let ch = conn
                .create_channel()
                .await
                .context(|| "opening a consumer channel".into())?;
            ch.basic_qos(self.cfg.prefetch, BasicQosOptions::default())
                .await
                .context(|| "setting the prefetch".into())?;
            let consumer = ch
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .context(|| format!("consuming from '{queue}'"))?;
            consumers.push(tokio::spawn(consume(
                ch,
                consumer,
                tracker.clone(),
                stop.clone(),
            )));
        }
        Ok(consumers)
    }

    /// Waits until every confirmed message arrived (or nothing arrives for the stall timeout),
    /// lingers for duplicates, stops the consumers and deletes the queue. A message is lost
    /// when it was confirmed (its publish did not fail) and never arrived.
    pub(super) async fn finish(
        &mut self,
        run: Running,
        published: Published,
        stall: Duration,
    ) -> Result<RunOutcome> {
        let expected = run.n - published.failed.len();
        let stalled = !all_arrived(&run.tracker, expected, stall).await;
        tokio::time::sleep(Duration::from_millis(self.cfg.linger_ms)).await;
        let tier_messages = {
            let (b, s) = tier_counts();
            (b - run.tier_counts.0, s - run.tier_counts.1)
        };
        let _ = run.stop.send(true);
        let (mut lateness, consumer_error) = self.join_consumers(run.consumers).await;
        run.monitor.abort();
        let leftover = match &run.app {
            Some(app) => app.delete(&run.queue).await,
            None => {
                self.take_down(&run.queue, run.raw_consumers, run.stage, &mut lateness)
                    .await
            }
        };
        if let Some(e) = consumer_error {
            return Err(e);
        }
        let t = &run.tracker;
        let lost = never_arrived(t, run.n, &published.failed);
        if stalled {
            self.problems.push(format!(
                "'{}': nothing arrived for {} s with {lost} messages missing",
                run.queue,
                stall.as_secs()
            ));
        }
        let foreign = t.foreign.load(Ordering::Relaxed);
        if foreign > 0 {
            self.problems.push(format!(
                "'{}': {foreign} messages that this run did not publish",
                run.queue
            ));
        }
        Ok(RunOutcome {
            n: run.n,
            unique: t.unique.load(Ordering::Relaxed),
            lost,
            duplicates: t.duplicates.load(Ordering::Relaxed) + leftover as usize,
            publish_errors: published.failed.len(),
            first_error: published.first_error,
            e2e_s: t.last_unique_ns.load(Ordering::Relaxed) as f64 / 1e9,
            max_due_s: t.max_due_ms.load(Ordering::Relaxed) as f64 / 1e3,
            publish_s: published.publish_s,
            release_lag_ms: published.release_lag_ms,
            hops_sum: published.hops_sum,
            observed_hops: t.observed_hops.load(Ordering::Relaxed),
            lateness,
            tier_messages,
        })
    }

    /// Waits for the (told to stop) consumers: the lateness they recorded and the last error
    /// one returned; a consumer task that failed is a problem of the run.
    async fn join_consumers(
        &mut self,
        consumers: Vec<JoinHandle<Result<Lateness>>>,
    ) -> (Lateness, Option<Error>) {
        let mut lateness = Lateness::new();
        let mut consumer_error = None;
        for c in consumers {
            match c.await {
                Ok(Ok(l)) => lateness.merge(&l),
                Ok(Err(e)) => consumer_error = Some(e),
                Err(e) => self.problems.push(format!("a consumer task failed: {e}")),
            }
        }
        (lateness, consumer_error)
    }

    /// Stops the stage (adding its handler's lateness to `lateness`) and deletes the measured
    /// queue if the bench's consumers read it. Returns what the stage's queues and the measured
    /// queue still held: duplicates, since every distinct message arrived already.
    async fn take_down(
        &mut self,
        queue: &str,
        raw_consumers: bool,
        stage: Option<Stage>,
        lateness: &mut Lateness,
    ) -> u32 {
        let mut leftover = 0;
        // the worker path's stage holds the measured queue
        if let Some(stage) = stage {
            if let Some(l) = &stage.counted {
                lateness.merge(&l.lock().expect("lateness"));
            }
            let (left, problem) = self.stop_stage(stage).await;
            leftover += left;
            if let Some(p) = problem {
                self.problems.push(format!("'{queue}': {p}"));
            }
        }
        if raw_consumers {
            leftover += match delete_queue(&self.admin, queue).await {
                Ok(n) => {
                    self.cleanup.forget_queue(queue);
                    n
                }
                Err(_) => 0, // Cleanup tries again at the end
            };
        }
        leftover
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_once(
        &mut self,
        label: &str,
        queue: &str,
        pubs: &[Sender],
        delays: Option<&[u64]>,
        n: usize,
        rate: Option<f64>,
        path: &Path,
    ) -> Result<RunOutcome> {
        let run = self.start(label, queue, n, path).await?;
        let longest = delays.and_then(|d| d.iter().copied().max()).unwrap_or(0);
        if let Some(w) = rate.and_then(|r| steady_window(longest, n, r)) {
            let _ = run.tracker.steady.set(w);
        }
        let published = self.publish(&run, pubs, delays, rate).await;
        let stall = self.stall;
        let out = self.finish(run, published, stall).await?;
        self.check(label, &out);
        Ok(out)
    }

    pub(super) fn check(&mut self, label: &str, o: &RunOutcome) {
        if o.lost > 0 {
            self.problems
                .push(format!("{label}: {} confirmed messages were lost", o.lost));
        }
        if o.lateness.early > 0 {
            self.problems.push(format!(
                "{label}: {} messages arrived early (min lateness {} ms)",
                o.lateness.early, o.lateness.min
            ));
        }
        if o.publish_errors > 0 {
            self.problems.push(format!(
                "{label}: {} publishes failed, first: {}",
                o.publish_errors,
                o.first_error.as_deref().unwrap_or("?")
            ));
        }
    }
}

/// Waits until `expected` distinct messages arrived: true, or false when none arrived for
/// `stall`.
async fn all_arrived(t: &Tracker, expected: usize, stall: Duration) -> bool {
    let mut seen = t.unique.load(Ordering::Relaxed);
    let mut last_change = Instant::now();
    loop {
        let u = t.unique.load(Ordering::Relaxed);
        if u >= expected {
            return true;
        }
        if u != seen {
            seen = u;
            last_change = Instant::now();
        } else if last_change.elapsed() > stall {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Messages `0..n` that were confirmed (not in `failed`) and never delivered.
fn never_arrived(t: &Tracker, n: usize, failed: &[usize]) -> usize {
    let failed: std::collections::HashSet<usize> = failed.iter().copied().collect();
    (0..n)
        .filter(|i| !failed.contains(i) && t.counts[*i].load(Ordering::Relaxed) == 0)
        .count()
}

/// Consumes until told to stop: counts every message index, records lateness of first
/// deliveries, acks each delivery.
async fn consume(
    ch: Channel,
    mut consumer: lapin::Consumer,
    t: Arc<Tracker>,
    mut stop: watch::Receiver<bool>,
) -> Result<Lateness> {
    let mut lateness = Lateness::new();
    loop {
        let d = tokio::select! {
            biased;
            _ = stop.changed() => break,
            d = consumer.next() => d,
        };
        let d = match d {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e).context(|| "consuming".into()),
            None => break,
        };
        let arrived = now_ms() as i64;
        t.record(
            d.properties.message_id().as_ref().map(|s| s.as_str()),
            d.properties.headers().as_ref(),
            arrived,
            &mut lateness,
        );
        d.ack(BasicAckOptions::default())
            .await
            .context(|| "acking".into())?;
    }
    let _ = ch.close(200, "done".into()).await;
    Ok(lateness)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass that delivered `unique` messages, `scheduled` of them through `broker` broker
    /// messages in the tiers.
    fn outcome(unique: usize, broker: u64, scheduled: u64) -> RunOutcome {
        RunOutcome {
            n: unique,
            unique,
            lost: 0,
            duplicates: 0,
            publish_errors: 0,
            first_error: None,
            e2e_s: 1.0,
            max_due_s: 0.0,
            publish_s: 1.0,
            release_lag_ms: 0,
            hops_sum: 0,
            observed_hops: 0,
            lateness: Lateness::new(),
            tier_messages: (broker, scheduled),
        }
    }

    #[test]
    fn broker_messages_per_message_by_path() {
        // batched: 1000 messages in 50 batches
        let batched = outcome(1_000, 50, 1_000);
        assert_eq!(
            batched.broker_msgs_per_msg_of(Scenario::UniformBatched),
            Some(0.05)
        );
        assert_eq!(batched.tiers_share(), Some(1.0));
        // a gateway that held 100 of 1000 and sent the rest in 300 batches: per delivered
        let gateway = outcome(1_000, 300, 900);
        assert_eq!(
            gateway.broker_msgs_per_msg_of(Scenario::GatewayLong),
            Some(0.3)
        );
        assert_eq!(
            gateway.broker_msgs_per_msg_of(Scenario::Uniform),
            Some(300.0 / 900.0)
        );
        assert_eq!(gateway.tiers_share(), Some(0.9));
        // held them all / nothing through the tiers
        let held = outcome(1_000, 0, 0);
        assert_eq!(held.broker_msgs_per_msg_of(Scenario::Gateway), Some(0.0));
        assert_eq!(held.broker_msgs_per_msg_of(Scenario::Raw), None);
        assert_eq!(outcome(0, 0, 0).tiers_share(), None);
    }
}
