//! The publish step of a pass: publisher `j` of `p` takes the message indexes `j, j + p, …`
//! below N, paced at the pass's rate if it has one, and publishes each where the pass's target
//! says (through `schedule_all`, one `schedule` call each when paced, or with a confirm
//! straight into a queue or plugin-style to an exchange). A failed publish is recorded by index: that message is not expected to arrive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use amqp_delay::headers;
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Result};

use super::Bench;
use super::app::Sender;
use super::measure::Running;
use super::published::Published;
use super::stage::Target;
use super::tracker::BENCH_DUE_AT;

impl Bench<'_> {
    /// Publishes message `i` (`0..n`) with `delays[i]` where the run's target says (raw: no
    /// delays), paced at `rate`.
    pub(super) async fn publish(
        &self,
        run: &Running,
        pubs: &[Sender],
        delays: Option<&[u64]>,
        rate: Option<f64>,
    ) -> Published {
        let (t0, _) = *run.tracker.t0.get().expect("started");
        let body = vec![b'x'; self.cfg.body_bytes];
        let pass = Pass {
            run,
            t0,
            rate,
            delays,
            body: &body,
            in_flight: self.cfg.settings.publisher.max_in_flight,
            max_pending: self.cfg.settings.publisher.max_pending.max(1),
            publishers: pubs.len(),
            lag_ms: AtomicU64::new(0),
        };
        let shares = pubs.iter().enumerate().map(|(j, p)| pass.share(j, p));
        let shares = futures::future::join_all(shares).await;
        let mut out = Published::empty();
        out.publish_s = t0.elapsed().as_secs_f64();
        out.release_lag_ms = pass.lag_ms.load(Ordering::Relaxed);
        for share in shares {
            out.add(share);
        }
        out
    }
}

/// What every publisher of a pass shares.
struct Pass<'a> {
    run: &'a Running,
    /// The first publish: a paced message `i` is released at `t0 + i / rate`.
    t0: Instant,
    rate: Option<f64>,
    delays: Option<&'a [u64]>,
    body: &'a [u8],
    in_flight: usize,
    /// Paced `schedule` calls in progress at once, per publisher.
    max_pending: usize,
    publishers: usize,
    /// The longest a paced message was taken after its release time, in ms.
    lag_ms: AtomicU64,
}

impl Pass<'_> {
    fn delay(&self, i: usize) -> u64 {
        self.delays.map_or(0, |d| d[i])
    }

    /// Publisher `j`'s message indexes, each released at its time when the pass is paced.
    fn paced(&self, j: usize) -> impl Stream<Item = usize> + '_ {
        let indexes = (j..self.run.n).step_by(self.publishers);
        futures::stream::iter(indexes).then(move |i| async move {
            if let Some(r) = self.rate {
                let release = self.t0 + Duration::from_secs_f64(i as f64 / r);
                tokio::time::sleep_until(release.into()).await;
                let lag = Instant::now()
                    .saturating_duration_since(release)
                    .as_millis();
                self.lag_ms
                    .fetch_max(u64::try_from(lag).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
            i
        })
    }

    /// Publisher `j`'s share of the pass, every result counted as published.
    async fn share(&self, j: usize, sender: &Sender) -> Published {
        let mut out = Published::empty();
        let mut note = |i: usize, r: Result<usize>| {
            out.note(i, r);
            self.run.tracker.published.fetch_add(1, Ordering::Relaxed);
        };
        let message = |queue: &str, i: usize| {
            Message::new(queue, self.delay(i), self.body.to_vec()).with_id(i.to_string())
        };
        match &self.run.target {
            // paced: one `schedule` call per message, as an application at a steady rate makes
            // them (concurrent calls batch); `schedule_all` would take the next message only
            // when one of its few chunks in hand is confirmed, holding back the pace
            Target::Schedule(queue) if self.rate.is_some() => {
                let publisher = match sender.library() {
                    Ok(p) => p,
                    Err(e) => return self.all_failed(j, e),
                };
                let mut results = std::pin::pin!(
                    self.paced(j)
                        .map(|i| async move { (i, publisher.schedule(message(queue, i)).await) })
                        .buffer_unordered(self.max_pending)
                );
                while let Some((i, r)) = results.next().await {
                    note(i, r.map(|s| s.route.hops()));
                }
            }
            Target::Schedule(queue) => {
                let publisher = match sender.library() {
                    Ok(p) => p,
                    Err(e) => return self.all_failed(j, e),
                };
                let msgs = self.paced(j).map(|i| (i, message(queue, i)));
                let mut results = std::pin::pin!(publisher.schedule_all(msgs));
                while let Some((i, r)) = results.next().await {
                    note(i, r.map(|s| s.route.hops()));
                }
            }
            Target::Queue(_) | Target::Plugin { .. } => {
                let mut results = std::pin::pin!(
                    self.paced(j)
                        .map(|i| self.publish_confirmed(sender, i))
                        .buffer_unordered(self.in_flight)
                );
                while let Some((i, r)) = results.next().await {
                    note(i, r);
                }
            }
        }
        out
    }

    /// Publisher `j`'s share, every message failed with `e` (nothing published).
    fn all_failed(&self, j: usize, e: amqp_delay::Error) -> Published {
        let mut out = Published::empty();
        for i in (j..self.run.n).step_by(self.publishers) {
            out.note(i, Err(e.clone()));
            self.run.tracker.published.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    /// Message `i` published with a confirm (not scheduled): plugin-style with `x-delay` to the
    /// gateway's ingress or an application's delayed exchange, or straight into the queue.
    /// Returns its planned hops.
    async fn publish_confirmed(&self, sender: &Sender, i: usize) -> (usize, Result<usize>) {
        let mut h = FieldTable::default();
        let (exchange, key, hops) = match &self.run.target {
            Target::Plugin { exchange, key } => {
                let d = self.delay(i);
                let x_delay = i64::try_from(d).unwrap_or(i64::MAX);
                h.insert(headers::X_DELAY.into(), AMQPValue::LongLongInt(x_delay));
                h.insert(
                    BENCH_DUE_AT.into(),
                    AMQPValue::LongLongInt(now_ms() as i64 + x_delay),
                );
                // the gateway plans it: alone, this route
                let hops = sender.planned_hops(d);
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
        let r = sender
            .publish_confirmed(exchange, key, self.body, props)
            .await;
        (i, r.map(|()| hops))
    }
}
