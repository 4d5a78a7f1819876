//! One connection's worth of a worker's work: [`Session::start`] (the publisher, the control
//! stream follower, a channel per queue), [`Session::serve`] (deliveries to handlers, the
//! stall, follower and resubscription checks) and [`Session::finish`] (drain on a stop, abort
//! on a loss).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use super::{
    CAREFUL_FOR, Event, FOLLOWER_CHECK, Handler, Mode, STALL_CHECK, STALL_CHECK_TIMEOUT,
    SessionEnd, Tagged, Worker, acks, in_hand, process,
};
use crate::broker;
use crate::cancel::{Cancellations, FollowOptions};
use crate::error::{Error, Result, ResultExt};
use crate::layout::Layout;
use crate::publisher::Publisher;
use crate::topology::Topology;

/// A consuming queue's channel and consumer tag.
type Subscribed = Option<(Channel, ShortString)>;

/// Runs one session on `conn`; `ready` is told once it consumes, `progress` moves while it
/// starts (the watchdog's view).
pub(super) async fn run<H: Handler>(
    worker: &Worker<H>,
    conn: &Arc<Connection>,
    layout: &Layout,
    mode: Mode,
    shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    (ready, progress): (oneshot::Sender<()>, Arc<AtomicU64>),
) -> Result<SessionEnd> {
    let mut session = match Session::start(worker, conn, layout, mode, progress).await? {
        Ok(s) => s,
        Err(end) => return Ok(end),
    };
    let _ = ready.send(());
    let end = session.serve(shutdown).await;
    session.finish(&end).await;
    Ok(end)
}

/// A running session's state.
struct Session<'w, H: Handler> {
    worker: &'w Worker<H>,
    conn: &'w Arc<Connection>,
    layout: &'w Layout,
    mode: Mode,
    publisher: Arc<Publisher>,
    ctx: Arc<process::TaskCtx>,
    deliveries: SelectAll<BoxStream<'static, Tagged>>,
    /// Per subscription: its channel while it consumes.
    channels: Vec<Subscribed>,
    /// Every channel's acks, to flush before a stopping worker closes them.
    all_acks: Vec<Arc<acks::Acks>>,
    /// When each subscription last brought a message (or was made).
    last_delivery: Vec<Instant>,
    /// Messages and bytes of the deliveries running or held, and their bound.
    in_hand: Arc<in_hand::InHand>,
    tasks: JoinSet<()>,
    resub_tx: mpsc::UnboundedSender<usize>,
    resub_rx: mpsc::UnboundedReceiver<usize>,
    /// `/readyz`: counted working from the first subscription until the session ends.
    live: Option<crate::metrics::Live>,
}

impl<'w, H: Handler> Session<'w, H> {
    /// Starts consuming: `Ok(Err(end))` when the connection failed on the way (reconnect),
    /// `Err` when it cannot work at all.
    async fn start(
        worker: &'w Worker<H>,
        conn: &'w Arc<Connection>,
        layout: &'w Layout,
        mode: Mode,
        progress: Arc<AtomicU64>,
    ) -> Result<std::result::Result<Self, SessionEnd>> {
        let s = &worker.settings;
        let cs = &s.consumer;
        let publisher = match Publisher::with_connection(conn.clone(), layout.clone(), s).await {
            Ok(p) => Arc::new(p),
            Err(e @ (Error::Amqp { .. } | Error::Connect { .. } | Error::Timeout { .. })) => {
                return Ok(Err(SessionEnd::Lost(e)));
            }
            Err(e) => return Err(e),
        };
        worker.check_queues_exist(conn, mode.first).await?;
        // cancellations first: nothing runs before every tombstone so far has been read
        let mut follow =
            FollowOptions::new(s.cancel.notice.as_duration(), s.cancel.horizon.as_millis());
        follow.progress = Some(progress);
        follow.trust = s.trust.clone();
        let cancels = match Cancellations::follow_with(conn, layout, follow).await {
            Ok(c) => Arc::new(c),
            Err(e @ (Error::Amqp { .. } | Error::Timeout { .. } | Error::Stream { .. })) => {
                return Ok(Err(SessionEnd::Lost(e)));
            }
            Err(e) => return Err(e),
        };
        let ctx = Arc::new(process::TaskCtx {
            park_exchange: layout.park_exchange(),
            trust: Arc::new(cancels.trust()),
            cancels,
            publisher: publisher.clone(),
            settings: cs.clone(),
            // a worker configured below the default still reads a default publisher's batches
            batch_max_members: s
                .publisher
                .batch_max_messages
                .max(crate::settings::PublisherSettings::default().batch_max_messages),
            layout: layout.clone(),
            counters: worker.counters.clone(),
            business: Arc::new(Semaphore::new(cs.concurrency)),
            io: Arc::new(Semaphore::new(cs.io_concurrency)),
            stopping: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        });
        let n = worker.subscriptions.len();
        let (resub_tx, resub_rx) = mpsc::unbounded_channel::<usize>();
        let mut session = Session {
            worker,
            conn,
            layout,
            mode,
            publisher,
            ctx,
            deliveries: SelectAll::new(),
            channels: vec![None; n],
            all_acks: Vec::new(),
            last_delivery: vec![Instant::now(); n],
            in_hand: in_hand::InHand::new(cs.max_in_hand, cs.max_in_hand_bytes),
            tasks: JoinSet::new(),
            resub_tx,
            resub_rx,
            live: None,
        };
        for i in 0..n {
            session.subscribe(i).await?;
        }
        tracing::info!(
            queues = ?worker.subscriptions.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>(),
            prefetch = cs.prefetch,
            hold_prefetch = cs.hold_prefetch,
            concurrency = cs.concurrency,
            "worker consuming"
        );
        session.live = Some(crate::metrics::Live::open());
        Ok(Ok(session))
    }

    /// Subscribes queue `i`, or waits in the background for it to exist (then `resub_rx`
    /// names it).
    async fn subscribe(&mut self, i: usize) -> Result<()> {
        let queue = &self.worker.subscriptions[i].0;
        match self
            .worker
            .subscribe_one(self.conn, self.layout, i, self.mode.careful)
            .await?
        {
            Some((ch, tag, a, stream)) => {
                self.channels[i] = Some((ch, tag));
                self.all_acks.push(a);
                self.last_delivery[i] = Instant::now();
                self.deliveries.push(stream);
            }
            None => spawn_wait_for_queue(self.conn, queue, i, &self.resub_tx),
        }
        Ok(())
    }

    /// Hands deliveries to handlers until the session ends, and how it ended.
    async fn serve(
        &mut self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> SessionEnd {
        let careful = self.mode.careful;
        let careful_over = tokio::time::sleep(if careful {
            CAREFUL_FOR
        } else {
            Duration::MAX / 4
        });
        tokio::pin!(careful_over);
        let mut stall_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + STALL_CHECK, STALL_CHECK);
        // a follower whose control stream consumer ended cannot check cancellations: every
        // message would go back to the queue; a new session follows the stream anew
        let mut follower_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + FOLLOWER_CHECK, FOLLOWER_CHECK);
        let hand = self.in_hand.clone();
        loop {
            while self.tasks.try_join_next().is_some() {}
            // past the in-hand bound no delivery is taken (the broker keeps them) until one
            // is done
            let full = hand.full();
            let end = tokio::select! {
                _ = shutdown.as_mut() => Some(SessionEnd::Stopped),
                _ = &mut careful_over, if careful => Some(SessionEnd::Careful),
                _ = follower_tick.tick() => self.ctx.cancels.broken().map(|why| {
                    SessionEnd::Lost(Error::stream(
                        self.layout.control_stream(),
                        format!("the follower stopped ({why})"),
                    ))
                }),
                _ = stall_tick.tick() => self.check_stalls().await,
                Some(i) = self.resub_rx.recv() => self.resubscribe(i).await,
                _ = hand.room(), if full => None,
                next = self.deliveries.next(), if !full && !self.deliveries.is_empty() => match next {
                    Some((i, event)) => self.on_delivery(i, event).await,
                    None => None,
                },
            };
            if let Some(end) = end {
                return end;
            }
        }
    }

    /// The stall check: the loop waits for it, so a broker that stops answering it ends the
    /// session rather than freezing it.
    async fn check_stalls(&mut self) -> Option<SessionEnd> {
        let idle = self.tasks.is_empty();
        let check = self.worker.stalled(
            self.conn,
            &self.channels,
            &mut self.last_delivery,
            self.mode.stall_after,
            idle,
        );
        let checked = tokio::time::timeout(STALL_CHECK_TIMEOUT, check)
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    context: "checking the consumed queues".into(),
                    timeout_ms: STALL_CHECK_TIMEOUT.as_millis() as u64,
                })
            });
        match checked {
            Ok(None) => None,
            Ok(Some(e)) => {
                let queue = match &e {
                    Error::ConsumerStalled { queue, .. } => queue.as_str(),
                    _ => "",
                };
                self.worker.counters.count(Event::Stalled, queue);
                Some(SessionEnd::Lost(e))
            }
            Err(e) => Some(SessionEnd::Lost(e)),
        }
    }

    /// Queue `i` exists again: consume it.
    async fn resubscribe(&mut self, i: usize) -> Option<SessionEnd> {
        let before = self.channels[i].is_some();
        if let Err(e) = self.subscribe(i).await {
            return Some(SessionEnd::Lost(e));
        }
        if !before && self.channels[i].is_some() {
            tracing::info!(queue = %self.worker.subscriptions[i].0, "the queue is back; consuming it again");
        }
        None
    }

    /// A delivery of subscription `i` (spawned to its handler), its consumer's error, or the
    /// end of its consumer (`None`: the broker cancelled it, or we did).
    async fn on_delivery(
        &mut self,
        i: usize,
        event: Option<(Arc<acks::Acks>, lapin::Result<lapin::message::Delivery>)>,
    ) -> Option<SessionEnd> {
        let queue = &self.worker.subscriptions[i].0;
        match event {
            Some((acks, Ok(d))) => {
                self.last_delivery[i] = Instant::now();
                let (queue, handler) = self.worker.subscriptions[i].clone();
                tracing::trace!(%queue, tag = d.delivery_tag, redelivered = d.redelivered, in_flight = self.tasks.len(), "delivery");
                let settle = acks.received(d.delivery_tag, d.acker.clone());
                let ctx = self.ctx.clone();
                let taken = self.in_hand.take(&d);
                self.tasks.spawn(async move {
                    process::delivery(d, settle, &queue, &*handler, &ctx).await;
                    drop(taken);
                });
                None
            }
            Some((_, Err(e))) => Some(SessionEnd::Lost(Error::Amqp {
                context: format!("consuming '{queue}'"),
                source: e,
            })),
            None if !self.conn.status().connected() => {
                Some(SessionEnd::Lost(Error::ConsumerCancelled {
                    queue: queue.clone(),
                }))
            }
            None => {
                tracing::warn!(
                    queue = %queue,
                    "the consumer was cancelled (queue deleted?); waiting for the queue to come back"
                );
                if let Some((ch, _)) = self.channels[i].take() {
                    broker::close(&ch, "consumer cancelled").await;
                }
                spawn_wait_for_queue(self.conn, queue, i, &self.resub_tx);
                None
            }
        }
    }

    /// Ends the session: on a stop (or the end of a careful spell), cancels the consumers,
    /// lets the handlers in flight finish within the grace and flushes their acks; on a loss,
    /// aborts them (the broker redelivers what was not acked: DESIGN rule 10). Then closes
    /// everything.
    async fn finish(mut self, end: &SessionEnd) {
        self.live = None;
        if let SessionEnd::Stopped | SessionEnd::Careful = end {
            self.drain(matches!(end, SessionEnd::Stopped)).await;
        } else {
            self.tasks.abort_all();
        }
        for (ch, _) in self.channels.iter().flatten() {
            broker::close(ch, "bye").await;
        }
        let Session { ctx, publisher, .. } = self;
        drop(ctx);
        if let Ok(p) = Arc::try_unwrap(publisher) {
            p.close().await;
        }
    }

    /// Cancels the consumers and waits up to the shutdown grace for the handlers in flight;
    /// what does not run is left unsettled for the channels' close to return to the queues
    /// (nacked one by one, hundreds of deliveries in hand made the broker drop the last acks:
    /// see `acks`), then flushes the acks of what finished.
    async fn drain(&mut self, stopping: bool) {
        // before any task can see `stopping`, so none of them nacks (DESIGN rule 13)
        for a in &self.all_acks {
            a.stop();
        }
        self.ctx.stopping.store(true, Ordering::Relaxed);
        for (ch, tag) in self.channels.iter().flatten() {
            let _ = ch
                .basic_cancel(tag.clone(), BasicCancelOptions::default())
                .await;
        }
        let grace = self.worker.settings.consumer.shutdown_grace.as_duration();
        let tasks = &mut self.tasks;
        while tasks.try_join_next().is_some() {}
        if stopping {
            tracing::info!(
                in_flight = tasks.len(),
                ?grace,
                "stopping: waiting for in-flight handlers"
            );
        }
        let drained =
            tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tracing::warn!(
                unfinished = tasks.len(),
                "shutdown grace over: unfinished messages go back to the queue"
            );
            tasks.abort_all();
            // an aborted task may be settling right now: the last flush comes after it
            while tasks.join_next().await.is_some() {}
        }
        for a in &self.all_acks {
            a.flush(true).await;
        }
        // the broker may still hold acks of a busy channel unsent, and drops them if it closes
        if self.all_acks.iter().any(|a| a.busy()) {
            tokio::time::sleep(acks::CLOSE_LINGER).await;
        }
        if stopping {
            let (succeeded, retried, parked, cancelled) = self.worker.counters.summary();
            let (given_back, ack_frames) = self
                .all_acks
                .iter()
                .map(|a| a.since_stop())
                .fold((0, 0), |(l, f), (l1, f1)| (l + l1, f + f1));
            tracing::info!(
                succeeded,
                retried,
                parked,
                cancelled,
                given_back,
                ack_frames,
                "worker stopped"
            );
        }
    }
}

impl<H: Handler> Worker<H> {
    /// Every consumed queue exists: on the first session a missing one is an error; later it is
    /// waited for while the others are consumed.
    async fn check_queues_exist(&self, conn: &Connection, first: bool) -> Result<()> {
        for (q, _) in &self.subscriptions {
            if broker::queue_state(conn, q).await?.is_none() {
                if first {
                    return Err(Error::Missing {
                        object: format!("queue '{q}'"),
                        hint: "declare it (and schedule messages to it) first".into(),
                    });
                }
                tracing::warn!(queue = %q, "the queue is gone; consuming the others and waiting for it");
            }
        }
        Ok(())
    }

    /// With no message in hand: the first subscription that brought nothing for `after`
    /// ([`STALL_AFTER`] and up) while its queue has ready messages, as
    /// [`Error::ConsumerStalled`]. A queue found without ready messages counts as active
    /// again, so an idle worker asks about each queue once per `after`, not every check.
    async fn stalled(
        &self,
        conn: &Connection,
        channels: &[Subscribed],
        last_delivery: &mut [Instant],
        after: Duration,
        idle_worker: bool,
    ) -> Result<Option<Error>> {
        for (i, slot) in channels.iter().enumerate() {
            let idle = last_delivery[i].elapsed();
            let Some((ch, _)) = slot else { continue };
            if idle < STALL_CHECK {
                continue;
            }
            let queue = &self.subscriptions[i].0;
            match broker::queue_state(conn, queue).await? {
                None => {
                    // The broker's cancel for a deleted queue did not reach us (seen with a
                    // quorum queue deleted from another cluster node): end the consumer
                    // ourselves by closing its channel, which ends its stream and starts
                    // waiting for the queue. Not `basic.cancel`: 3.10.8 once answered that
                    // with a connection error (INTERNAL_ERROR; its quorum queue asks the
                    // queue's members, which are gone), and the whole session was lost.
                    tracing::warn!(
                        queue = %queue,
                        "the queue no longer exists but its consumer was not cancelled; closing its channel"
                    );
                    broker::close(ch, "queue deleted").await;
                }
                Some(state) if idle_worker && idle >= after && state.ready > 0 => {
                    return Ok(Some(Error::ConsumerStalled {
                        queue: queue.clone(),
                        ready: state.ready,
                        idle_ms: idle.as_millis() as u64,
                    }));
                }
                Some(_) if idle >= after => last_delivery[i] = Instant::now(),
                Some(_) => {}
            }
        }
        Ok(None)
    }

    /// Declares what consuming queue `i` needs (its parking queue, its batch marker) and starts
    /// consuming it on a channel of its own. `None` when the queue does not exist.
    async fn subscribe_one(
        &self,
        conn: &Connection,
        layout: &Layout,
        i: usize,
        careful: bool,
    ) -> Result<
        Option<(
            Channel,
            ShortString,
            Arc<acks::Acks>,
            BoxStream<'static, Tagged>,
        )>,
    > {
        let (q, handler) = &self.subscriptions[i];
        if broker::queue_state(conn, q).await?.is_none() {
            return Ok(None);
        }
        let ch = broker::open(conn).await?;
        declare_parking(conn, layout, q).await?;
        if let Err(e) = Topology::new(layout.clone())
            .declare_batch_marker(conn, q)
            .await
        {
            // publishers then send plain messages, which work too
            tracing::info!(queue = %q, "publishers will send plain messages: {}", crate::error::chain(&e));
        }
        let cs = &self.settings.consumer;
        // on top of what keeps the handlers busy, slots for deliveries that wait for their
        // due time (grain batches arrive early)
        let prefetch = if careful {
            1
        } else if handler.io_bound() {
            u16::try_from(cs.io_concurrency).unwrap_or(u16::MAX)
        } else {
            cs.prefetch
        };
        let prefetch = if careful {
            prefetch
        } else {
            prefetch.saturating_add(cs.hold_prefetch)
        };
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .context(|| "setting prefetch".into())?;
        let consumer = match ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(c) => c,
            // deleted between the check and the consume
            Err(e) if broker::is_reply(&e, broker::NOT_FOUND) => return Ok(None),
            Err(e) => return Err(e).context(|| format!("consuming '{q}'")),
        };
        let tag = consumer.tag();
        let acks = acks::Acks::new(q, prefetch);
        // A consumer's stream ends when the broker cancels it: say which one ended.
        let ended = futures::stream::once(async move { (i, None) });
        let each = acks.clone();
        let stream = consumer
            .map(move |d| (i, Some((each.clone(), d))))
            .chain(ended)
            .boxed();
        Ok(Some((ch, tag, acks, stream)))
    }
}

/// Polls until `queue` exists again, then asks the session to subscribe `i` anew.
fn spawn_wait_for_queue(
    conn: &Arc<Connection>,
    queue: &str,
    i: usize,
    resub: &mpsc::UnboundedSender<usize>,
) {
    let conn = conn.clone();
    let queue = queue.to_string();
    let resub = resub.clone();
    tokio::spawn(async move {
        let mut pause = Duration::from_millis(250);
        while conn.status().connected() && !resub.is_closed() {
            tokio::time::sleep(pause).await;
            match broker::queue_state(&conn, &queue).await {
                Ok(Some(_)) => {
                    let _ = resub.send(i);
                    return;
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(%queue, "checking the queue: {e}"),
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
}

async fn declare_parking(conn: &Connection, layout: &Layout, q: &str) -> Result<()> {
    // one that exists was bound by whoever declared it (an admin's declare, a gateway pair's
    // registrar): a worker with least privilege that tried again would be refused, and the
    // broker would log an error for every queue it subscribes
    if broker::queue_state(conn, &layout.parked_queue(q))
        .await?
        .is_some()
    {
        return Ok(());
    }
    Topology::new(layout.clone()).declare_parking(conn, q).await
}
