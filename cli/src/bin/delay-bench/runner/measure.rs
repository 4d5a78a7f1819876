//! One measured pass of the runner: declare a destination queue, start the consumers (and the
//! library stage of a batched scenario, `stage`), publish N messages (saturating or paced), wait
//! for every confirmed one, then count the lost, duplicated and early ones and record lateness
//! (an HDR histogram) on first deliveries.

use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use tokio::sync::watch;

use amqp_delay::broker::ResultExt;
use amqp_delay::headers;
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Publisher, Result};
use amqp_delay_cli::cli::chain;

use super::Bench;
use super::stage::{Path, Stage, Target};
use crate::amqp::{declare_plain_queue, delete_queue};
use crate::report::Percentiles;

/// Lateness of first deliveries in ms: an HDR histogram (negative values recorded as 0) with
/// the exact minimum, maximum and the number of early messages beside it.
pub(super) struct Lateness {
    hist: Histogram<u64>,
    min: i64,
    max: i64,
    pub(super) early: u64,
}

impl Lateness {
    pub(super) fn new() -> Self {
        Lateness {
            hist: Histogram::new(3).expect("3 significant figures is valid"),
            min: i64::MAX,
            max: i64::MIN,
            early: 0,
        }
    }
    fn record(&mut self, ms: i64) {
        self.min = self.min.min(ms);
        self.max = self.max.max(ms);
        if ms < 0 {
            self.early += 1;
        }
        // auto-resizing: recording cannot fail for a non-negative value
        let _ = self.hist.record(ms.max(0) as u64);
    }
    fn merge(&mut self, o: &Lateness) {
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.early += o.early;
        let _ = self.hist.add(&o.hist);
    }
    pub(super) fn summary(&self) -> Percentiles {
        if self.hist.is_empty() {
            return Percentiles::default();
        }
        let q = |p: f64| self.hist.value_at_quantile(p) as i64;
        Percentiles {
            min: self.min,
            p50: q(0.5).clamp(self.min, self.max),
            p99: q(0.99).clamp(self.min, self.max),
            p999: q(0.999).clamp(self.min, self.max),
            max: self.max,
            samples: self.hist.len(),
        }
    }
}

/// Header of the gateway scenario's publishes: when the message falls due (ms since the
/// epoch), for lateness at the target, where the gateway has removed amqp-delay's headers.
pub(super) const BENCH_DUE_AT: &str = "bench-due-at";

/// Shared between the consumers, the publishers and the progress display.
pub(super) struct Tracker {
    counts: Vec<AtomicU8>,
    unique: AtomicUsize,
    duplicates: AtomicUsize,
    foreign: AtomicUsize,
    published: AtomicUsize,
    /// Nanoseconds from the first publish to the last distinct consume.
    last_unique_ns: AtomicU64,
    observed_hops: AtomicU64,
    /// The first publish, as an instant and in ms since the epoch.
    t0: OnceLock<(Instant, u64)>,
    /// Latest `x-delay-due-at` seen, in ms after the first publish.
    max_due_ms: AtomicU64,
}

impl Tracker {
    fn new(n: usize) -> Self {
        Tracker {
            counts: (0..n).map(|_| AtomicU8::new(0)).collect(),
            unique: AtomicUsize::new(0),
            duplicates: AtomicUsize::new(0),
            foreign: AtomicUsize::new(0),
            published: AtomicUsize::new(0),
            last_unique_ns: AtomicU64::new(0),
            observed_hops: AtomicU64::new(0),
            t0: OnceLock::new(),
            max_due_ms: AtomicU64::new(0),
        }
    }

    /// Counts one delivery of message `id` that arrived at `arrived` (ms since the epoch):
    /// the first one records its lateness and hops, later ones are duplicates.
    pub(super) fn record(
        &self,
        id: Option<&str>,
        h: Option<&FieldTable>,
        arrived: i64,
        lateness: &mut Lateness,
    ) {
        let idx = id
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&i| i < self.counts.len());
        let (Some(i), Some(&(t0, epoch0))) = (idx, self.t0.get()) else {
            self.foreign.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let prev = self.counts[i]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_add(1))
            })
            .unwrap_or(u8::MAX);
        if prev != 0 {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.unique.fetch_add(1, Ordering::Relaxed);
        let ns = t0.elapsed().as_nanos() as u64;
        self.last_unique_ns.fetch_max(ns, Ordering::Relaxed);
        if let Some(h) = h {
            let due =
                headers::get_int(h, headers::DUE_AT).or_else(|| headers::get_int(h, BENCH_DUE_AT));
            if let Some(due) = due {
                lateness.record(arrived - due);
                let rel = (due - epoch0 as i64).max(0) as u64;
                self.max_due_ms.fetch_max(rel, Ordering::Relaxed);
            }
            self.observed_hops
                .fetch_add(death_count(h), Ordering::Relaxed);
        }
    }
}

/// The tiers' broker messages and the messages scheduled so far in this process (the library's
/// metrics: a batch is one broker message).
fn tier_counts() -> (u64, u64) {
    let m = amqp_delay::metrics::global();
    (m.broker_messages.get(), m.scheduled.get())
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
    target: Target,
    stage: Option<Stage>,
    n: usize,
    tracker: Arc<Tracker>,
    stop: watch::Sender<bool>,
    consumers: Vec<tokio::task::JoinHandle<Result<Lateness>>>,
    monitor: tokio::task::JoinHandle<()>,
    /// [`tier_counts`] at the start.
    tier_counts: (u64, u64),
}

/// What the publishers did in one pass: the indexes that failed and how long publishing took.
pub(super) struct Published {
    pub(super) failed: Vec<usize>,
    first_error: Option<String>,
    hops_sum: u64,
    pub(super) publish_s: f64,
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
        if raw_consumers {
            self.cleanup.add_queue(queue);
            declare_plain_queue(&self.admin, queue, self.cfg.settings.topology.queue_type).await?;
        }
        let (target, stage) = self.start_stage(path, queue, &tracker).await?;
        let (stop, stop_rx) = watch::channel(false);
        let mut consumers = Vec::new();
        for _ in 0..if raw_consumers { self.cfg.consumers } else { 0 } {
            let ch = self
                .consumer_conn
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
                stop_rx.clone(),
            )));
        }
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
        let tier_counts = tier_counts();
        let _ = tracker.t0.set((Instant::now(), now_ms()));
        Ok(Running {
            queue: queue.to_string(),
            raw_consumers,
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

    /// Publishes message `i` (`0..n`) with `delays[i]` where the run's target says (raw: no
    /// delays), paced at `rate`.
    pub(super) async fn publish(
        &self,
        run: &Running,
        pubs: &[Publisher],
        delays: Option<&[u64]>,
        rate: Option<f64>,
    ) -> Published {
        let (t0, _) = *run.tracker.t0.get().expect("started");
        let body = vec![b'x'; self.cfg.body_bytes];
        let (n, p, target) = (run.n, pubs.len(), &run.target);
        let in_flight = self.cfg.settings.publisher.max_in_flight;
        let tracker = &run.tracker;
        let per_publisher = pubs.iter().enumerate().map(|(j, publisher)| {
            let body = &body;
            let paced = futures::stream::iter((j..n).step_by(p)).then(move |i| async move {
                if let Some(r) = rate {
                    tokio::time::sleep_until((t0 + Duration::from_secs_f64(i as f64 / r)).into())
                        .await;
                }
                i
            });
            async move {
                let mut failed = Vec::new();
                let mut first_error = None;
                let mut hops = 0u64;
                let mut note = |i: usize, r: Result<usize>| {
                    match r {
                        Ok(h) => hops += h as u64,
                        Err(e) => {
                            failed.push(i);
                            first_error.get_or_insert_with(|| chain(&e));
                        }
                    }
                    tracker.published.fetch_add(1, Ordering::Relaxed);
                };
                let delay = |i: usize| delays.map_or(0, |d| d[i]);
                match target {
                    Target::Schedule(queue) => {
                        let msgs = paced.map(|i| {
                            let m = Message::new(queue.as_str(), delay(i), body.clone())
                                .with_id(i.to_string());
                            (i, m)
                        });
                        let mut results = std::pin::pin!(publisher.schedule_all(msgs));
                        while let Some((i, r)) = results.next().await {
                            note(i, r.map(|s| s.route.hops()));
                        }
                    }
                    Target::Queue(_) | Target::Plugin { .. } => {
                        let mut results = std::pin::pin!(
                            paced
                                .map(|i| async move {
                                    let mut h = FieldTable::default();
                                    let (exchange, key, hops) = match target {
                                        Target::Plugin { exchange, key } => {
                                            let d = delay(i);
                                            let x_delay = i64::try_from(d).unwrap_or(i64::MAX);
                                            h.insert(
                                                headers::X_DELAY.into(),
                                                AMQPValue::LongLongInt(x_delay),
                                            );
                                            h.insert(
                                                BENCH_DUE_AT.into(),
                                                AMQPValue::LongLongInt(now_ms() as i64 + x_delay),
                                            );
                                            // the gateway plans it: alone, this route
                                            let hops = publisher.plan(d).map_or(0, |r| r.hops());
                                            (exchange.as_str(), key.as_str(), hops)
                                        }
                                        Target::Queue(q) | Target::Schedule(q) => {
                                            headers::set_schedule_headers(&mut h, 0, now_ms(), 0);
                                            ("", q.as_str(), 0)
                                        }
                                    };
                                    let props = BasicProperties::default()
                                        .with_message_id(i.to_string().as_str().into())
                                        .with_delivery_mode(2)
                                        .with_headers(h);
                                    let r = publisher
                                        .publish_confirmed(exchange, key, body, props)
                                        .await;
                                    (i, r.map(|()| hops))
                                })
                                .buffer_unordered(in_flight)
                        );
                        while let Some((i, r)) = results.next().await {
                            note(i, r);
                        }
                    }
                }
                (failed, first_error, hops)
            }
        });
        let parts = futures::future::join_all(per_publisher).await;
        let publish_s = t0.elapsed().as_secs_f64();
        let mut out = Published {
            failed: Vec::new(),
            first_error: None,
            hops_sum: 0,
            publish_s,
        };
        for (f, e, h) in parts {
            out.failed.extend(f);
            if out.first_error.is_none() {
                out.first_error = e;
            }
            out.hops_sum += h;
        }
        out
    }

    /// Waits until every confirmed message arrived (or nothing arrives for the stall timeout),
    /// lingers for duplicates, stops the consumers and deletes the queue.
    pub(super) async fn finish(
        &mut self,
        run: Running,
        published: Published,
        stall: Duration,
    ) -> Result<RunOutcome> {
        let t = &run.tracker;
        let expected = run.n - published.failed.len();
        let mut seen = t.unique.load(Ordering::Relaxed);
        let mut last_change = Instant::now();
        let mut stalled = false;
        loop {
            let u = t.unique.load(Ordering::Relaxed);
            if u >= expected {
                break;
            }
            if u != seen {
                seen = u;
                last_change = Instant::now();
            } else if last_change.elapsed() > stall {
                stalled = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(self.cfg.linger_ms)).await;
        let tier_messages = {
            let (b, s) = tier_counts();
            (b - run.tier_counts.0, s - run.tier_counts.1)
        };
        let _ = run.stop.send(true);
        let mut lateness = Lateness::new();
        let mut consumer_error = None;
        for c in run.consumers {
            match c.await {
                Ok(Ok(l)) => lateness.merge(&l),
                Ok(Err(e)) => consumer_error = Some(e),
                Err(e) => self.problems.push(format!("a consumer task failed: {e}")),
            }
        }
        run.monitor.abort();
        // what the stage left in its queues (the worker path's: the measured queue) counts
        // as duplicates: every distinct message arrived already
        let mut leftover = 0;
        if let Some(stage) = run.stage {
            if let Some(l) = &stage.counted {
                lateness.merge(&l.lock().expect("lateness"));
            }
            let (left, problem) = self.stop_stage(stage).await;
            leftover += left;
            if let Some(p) = problem {
                self.problems.push(format!("'{}': {p}", run.queue));
            }
        }
        if run.raw_consumers {
            leftover += match delete_queue(&self.admin, &run.queue).await {
                Ok(n) => {
                    self.cleanup.forget_queue(&run.queue);
                    n
                }
                Err(_) => 0, // Cleanup tries again at the end
            };
        }
        if let Some(e) = consumer_error {
            return Err(e);
        }
        let failed: std::collections::HashSet<usize> = published.failed.iter().copied().collect();
        let lost = (0..run.n)
            .filter(|i| !failed.contains(i) && t.counts[*i].load(Ordering::Relaxed) == 0)
            .count();
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
            hops_sum: published.hops_sum,
            observed_hops: t.observed_hops.load(Ordering::Relaxed),
            lateness,
            tier_messages,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_once(
        &mut self,
        label: &str,
        queue: &str,
        pubs: &[Publisher],
        delays: Option<&[u64]>,
        n: usize,
        rate: Option<f64>,
        path: &Path,
    ) -> Result<RunOutcome> {
        let run = self.start(label, queue, n, path).await?;
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

/// Sum of the `count` fields of `x-death`: the dead-letter hops a message took.
fn death_count(h: &FieldTable) -> u64 {
    let Some(AMQPValue::FieldArray(a)) = h.inner().get("x-death") else {
        return 0;
    };
    a.as_slice()
        .iter()
        .filter_map(|v| match v {
            AMQPValue::FieldTable(t) => headers::get_int(t, "count"),
            _ => None,
        })
        .map(|c| c.max(0) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lateness_summary_keeps_negative_minimum() {
        let mut l = Lateness::new();
        for v in [-2, 0, 5, 7, 100] {
            l.record(v);
        }
        let s = l.summary();
        assert_eq!((s.min, s.max, s.samples, l.early), (-2, 100, 5, 1));
        assert!(s.p50 >= 0 && s.p50 <= s.p99 && s.p99 <= s.max);
    }

    #[test]
    fn death_counts_add_up() {
        let mut t = FieldTable::default();
        let entry = |n: i64| {
            let mut e = FieldTable::default();
            e.insert("count".into(), AMQPValue::LongLongInt(n));
            AMQPValue::FieldTable(e)
        };
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![entry(1), entry(2)].into()),
        );
        assert_eq!(death_count(&t), 3);
        assert_eq!(death_count(&FieldTable::default()), 0);
    }
}
