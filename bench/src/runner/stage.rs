//! The library stages the batched scenarios run in process, through the library's public API
//! only: the [`Worker`] with a counting handler (`fixed_batched`, `uniform_batched`), the
//! worker with the relay action behind `delay-consumer --relay` (`relay`) and the x-delay
//! [`Gateway`] (`gateway`). A stage is started before the first publish (so the batch marker
//! its worker declares makes the publishers batch) and stopped after the last delivery; what it
//! declared is registered for clean-up first and deleted when it stops.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use amqp_delay::gateway::Gateway;
use amqp_delay::ops::broker;
use amqp_delay::settings::{PairConfig, Settings};
use amqp_delay::{Context, Delivery, Error, Handler, Outcome, Result, Topology, Worker};
use amqp_delay_cli::actions::Action;

use super::Bench;
use super::app::GATEWAY_KEY;
use super::tracker::{Lateness, Tracker};
use crate::amqp::{
    bind, connect, declare_delayed_exchange, declare_direct_exchange, delete_exchange, delete_queue,
};

/// How a scenario's messages travel and what counts them.
#[derive(Clone)]
pub(crate) enum Path {
    /// Published with a confirm straight into the measured queue (the raw baseline).
    Raw,
    /// Scheduled through the tiers to the measured queue, read by the bench's raw consumers
    /// (the unbatched scenarios: a plain queue gets plain messages).
    Tiers,
    /// Scheduled to the measured queue, which the library's [`Worker`] consumes with these
    /// settings (it declares the batch marker, so the publishers batch); its handler counts
    /// each member.
    Worker(Box<Settings>),
    /// Scheduled to `<queue>.src`, which a worker running the relay action (as
    /// `delay-consumer --relay`) unpacks into the measured queue, read by raw consumers.
    Relay(Box<Settings>),
    /// Published with `x-delay` to the ingress of an in-process [`Gateway`] with these settings;
    /// the measured queue is bound to its target exchange and read by raw consumers. With a
    /// URL (`--via-proxy`): declared as an `x-delayed-message` exchange through the in-process
    /// `delay-proxy` at that URL and published to there, as a plugin-era application does; the
    /// proxy sends the delayed publishes to the pair it registered.
    Gateway(Box<Settings>, Option<String>),
    /// A plugin-era application's `x-delayed-message` exchange, declared through these
    /// connections (the plugin's broker, or a `delay-proxy`) right before the first publish,
    /// the measured queue bound to it; published to with `x-delay` and consumed there.
    App(std::sync::Arc<super::app::AppEnd>),
}

/// Where a pass publishes.
pub(super) enum Target {
    /// Straight into this queue (default exchange), confirmed.
    Queue(String),
    /// Through the publisher's `schedule_all` to this destination.
    Schedule(String),
    /// Plugin-style: to this exchange with an `x-delay` header, confirmed.
    Plugin { exchange: String, key: String },
}

/// A library stage running for one pass.
pub(super) struct Stage {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<()>>,
    /// The counting handler's lateness (worker path).
    pub(super) counted: Option<Arc<Mutex<Lateness>>>,
    /// What the stage declared (or made its worker declare), deleted when it stops.
    queues: Vec<String>,
    exchanges: Vec<String>,
    /// The gateway, whose pair is deleted when it stops.
    gateway: Option<Gateway>,
}

/// Counts every message (batch members one by one) the worker hands it.
struct Counting {
    tracker: Arc<Tracker>,
    lateness: Arc<Mutex<Lateness>>,
}

impl Handler for Counting {
    async fn handle(&self, d: &Delivery, _ctx: &Context) -> Outcome {
        let arrived = amqp_delay::time::now_ms() as i64;
        let mut l = self.lateness.lock().expect("lateness");
        self.tracker
            .record(Some(&d.message_id), d.headers(), arrived, &mut l);
        Outcome::Success
    }
}

impl Bench<'_> {
    /// Starts what `path` needs in front of the measured `queue` (declared already when raw
    /// consumers read it); returns where to publish and the running stage.
    pub(super) async fn start_stage(
        &self,
        path: &Path,
        queue: &str,
        tracker: &Arc<Tracker>,
    ) -> Result<(Target, Option<Stage>)> {
        match path {
            Path::Raw => Ok((Target::Queue(queue.to_string()), None)),
            Path::Tiers => Ok((Target::Schedule(queue.to_string()), None)),
            Path::Worker(s) => {
                let lateness = Arc::new(Mutex::new(Lateness::new()));
                let handler = Counting {
                    tracker: tracker.clone(),
                    lateness: lateness.clone(),
                };
                let mut stage = self.worker_stage(s, queue, handler).await?;
                stage.counted = Some(lateness);
                Ok((Target::Schedule(queue.to_string()), Some(stage)))
            }
            Path::Relay(s) => {
                let source = format!("{queue}.src");
                let relay = Action::Relay {
                    queue: queue.to_string(),
                };
                let stage = self.worker_stage(s, &source, relay).await?;
                Ok((Target::Schedule(source), Some(stage)))
            }
            Path::App(_) => Ok((
                Target::Plugin {
                    exchange: super::app::AppEnd::exchange(queue),
                    key: GATEWAY_KEY.into(),
                },
                None,
            )),
            Path::Gateway(s, proxy) => {
                let stage = self.gateway_stage(s, queue, proxy.as_deref()).await?;
                let exchange = match proxy {
                    Some(_) => format!("{queue}.target"),
                    None => format!("{queue}.in"),
                };
                Ok((
                    Target::Plugin {
                        exchange,
                        key: GATEWAY_KEY.into(),
                    },
                    Some(stage),
                ))
            }
        }
    }

    /// Declares destination `queue` as `declare --queue` does and runs a worker with `handler`
    /// on it until the stage is stopped.
    async fn worker_stage<H: Handler>(
        &self,
        settings: &Settings,
        queue: &str,
        handler: H,
    ) -> Result<Stage> {
        let layout = settings.layout()?;
        let parked = layout.parked_queue(queue);
        let markers = layout.markers(queue);
        self.cleanup.add_queue(queue);
        self.cleanup.add_queue(&parked);
        for m in &markers {
            self.cleanup.add_exchange(m);
        }
        Topology::new(layout.clone())
            .declare_destination(&self.admin, queue)
            .await?;
        let worker = Worker::new(settings.clone()).subscribe(queue, handler);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(worker.run(async move {
            let _ = stopped.await;
        }));
        let mut stage = Stage {
            stop,
            task,
            counted: None,
            queues: vec![queue.to_string(), parked],
            exchanges: markers,
            gateway: None,
        };
        if let Err(e) = self.until_consumed(&mut stage, queue).await {
            let _ = self.stop_stage(stage).await;
            return Err(e);
        }
        Ok(stage)
    }

    /// Declares the target exchange `<queue>.target` (bound to the measured `queue` with
    /// [`GATEWAY_KEY`]) and a gateway pair `<queue>.in` → it, and runs the gateway (the
    /// library's, with `settings`) until the stage is stopped. Through the proxy at `proxy`, the
    /// target is declared as a delayed exchange there, and the pair is the one it registers.
    async fn gateway_stage(
        &self,
        settings: &Settings,
        queue: &str,
        proxy: Option<&str>,
    ) -> Result<Stage> {
        let target = format!("{queue}.target");
        let ingress = match proxy {
            Some(_) => settings.layout()?.proxy_ingress(&target),
            None => format!("{queue}.in"),
        };
        let mut s = settings.clone();
        s.gateway.pairs = vec![PairConfig {
            ingress: ingress.clone(),
            target: target.clone(),
            writers: Vec::new(),
        }];
        let gateway = Gateway::new(s.clone())?;
        let pair = gateway.pairs()[0].clone();
        let layout = s.layout()?;
        let mut queues: Vec<String> = pair.queues().iter().map(|q| q.to_string()).collect();
        let mut exchanges = vec![target.clone(), ingress];
        exchanges.extend(layout.markers(&pair.due_queue));
        for q in &queues {
            self.cleanup.add_queue(q);
        }
        for x in &exchanges {
            self.cleanup.add_exchange(x);
        }
        match proxy {
            Some(url) => {
                let app = connect(url, "delay-bench application").await?;
                let declared = declare_delayed_exchange(&app, &target).await;
                broker::close_connection(&app, "declared").await;
                declared?;
            }
            None => declare_direct_exchange(&self.admin, &target).await?,
        }
        bind(&self.admin, queue, &target, GATEWAY_KEY).await?;
        gateway.declare(&self.admin).await?;
        let worker = gateway.worker();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(worker.run(async move {
            let _ = stopped.await;
        }));
        // the pair's queues go with the gateway (`Gateway::delete`); the rest here
        queues.clear();
        let mut stage = Stage {
            stop,
            task,
            counted: None,
            queues,
            exchanges,
            gateway: Some(gateway),
        };
        // the worker subscribes the ingress queue, then the due queue
        if let Err(e) = self.until_consumed(&mut stage, &pair.due_queue).await {
            let _ = self.stop_stage(stage).await;
            return Err(e);
        }
        Ok(stage)
    }

    /// Waits until `queue` has a consumer (the stage's worker started; it declared its batch
    /// marker before consuming), or the stage failed.
    async fn until_consumed(&self, stage: &mut Stage, queue: &str) -> Result<()> {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            if stage.task.is_finished() {
                return match (&mut stage.task).await {
                    Ok(Err(e)) => Err(e),
                    Ok(Ok(())) => Err(Error::Stopped(format!(
                        "the worker on '{queue}' stopped before consuming"
                    ))),
                    Err(e) => Err(Error::Stopped(format!("the worker on '{queue}': {e}"))),
                };
            }
            if let Some(s) = broker::queue_state(&self.admin, queue).await?
                && s.consumers > 0
            {
                return Ok(());
            }
            if Instant::now() > give_up {
                return Err(Error::Stopped(format!(
                    "the worker did not consume '{queue}' within 30 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the stage's worker, deletes what it declared; returns what its queues still held
    /// and, if the worker failed or did not stop, what went wrong (a problem of the run: every
    /// message it had was settled by then).
    pub(super) async fn stop_stage(&self, stage: Stage) -> (u32, Option<String>) {
        let _ = stage.stop.send(());
        let mut task = stage.task;
        let stop = Duration::from_secs(60);
        let problem = match tokio::time::timeout(stop, &mut task).await {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(format!(
                "the stage's worker failed: {}",
                amqp_delay::error_chain(&e)
            )),
            Ok(Err(e)) => Some(format!("the stage's worker panicked: {e}")),
            Err(_) => {
                task.abort();
                Some(format!(
                    "the stage's worker did not stop within {} s of its shutdown signal",
                    stop.as_secs()
                ))
            }
        };
        let mut leftover = 0;
        if let Some(g) = &stage.gateway {
            for q in g.pairs().iter().flat_map(|p| p.queues()) {
                leftover += broker::queue_state(&self.admin, q)
                    .await
                    .ok()
                    .flatten()
                    .map_or(0, |s| s.ready);
            }
            if g.delete(&self.admin).await.is_ok() {
                for q in g.pairs().iter().flat_map(|p| p.queues()) {
                    self.cleanup.forget_queue(q);
                }
            }
        }
        for q in &stage.queues {
            if let Ok(n) = delete_queue(&self.admin, q).await {
                leftover += n;
                self.cleanup.forget_queue(q);
            }
        }
        for x in &stage.exchanges {
            if delete_exchange(&self.admin, x).await.is_ok() {
                self.cleanup.forget_exchange(x);
            }
        }
        (leftover, problem)
    }
}
