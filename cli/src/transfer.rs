//! `delay-publisher transfer`: moves every message that has not run yet from this cluster (the
//! old one) to another (the new one, `--to`), each due at its original due time, nothing lost.
//!
//! * **Reads** the old cluster's tiers in the order messages flow through them (the overflow
//!   chain, the fixed levels, the cascade from its top level down;
//!   [`amqp_delay::ops::transfer::tier_queues`]), then the gateways' due queues, with a
//!   consumer per queue (a bounded prefetch), under a lock (`<prefix>.transfer-lock`, an
//!   exclusive queue) so that two transfers never run at once. Passes repeat while a pass
//!   moves something (the old workers may keep running and retry into the tiers).
//! * **Copies** each message, or each member of a batch
//!   ([`amqp_delay::ops::transfer::copies`]), and schedules it through the new cluster's
//!   publisher for its original due time (at once when that has passed), naming its owner on
//!   the old cluster. A message the old cluster's cancels, purges or reschedules stop is not
//!   copied (counted); one a reschedule moved is copied due at its new time.
//! * **Acks** the old message only once every copy it needed is confirmed. A crash anywhere
//!   loses nothing: a re-run copies again what was copied but not acked (the same ids; the
//!   broker marks them redelivered, and they are counted as possible duplicates).
//! * **Parked messages** ([`parked`]) move with `--parked`, after the tiers in every pass, into
//!   the new cluster's parking queue of the same destination; without it they are counted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use amqp_delay::ops::broker;
use amqp_delay::ops::cancel::{Cancellations, FollowOptions, Steer};
use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::control::{self, Record};
use amqp_delay::ops::transfer::{self, Copy, Reading};
use amqp_delay::ops::trust::Trust;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Layout, Publisher, Result, Settings, error_chain as chain};

use crate::plugin_store::Period;

mod parked;

/// How long a queue may give nothing before the transfer looks at what it still holds.
const IDLE: Duration = Duration::from_millis(500);
/// Passes over every queue, at most (a pass that finds nothing ends the run earlier).
const MAX_PASSES: u32 = 3;

/// What to transfer and how.
pub struct Options {
    /// The new cluster's URL (`--to`).
    pub to: String,
    /// The new cluster's prefix (default: this one's).
    pub to_prefix: Option<String>,
    /// Only the messages to these destinations (empty: all).
    pub queues: Vec<String>,
    /// Count only: nothing is copied or acked.
    pub dry_run: bool,
    /// Move the parking queues' messages too (`--parked`).
    pub parked: bool,
    /// Broker messages (plain or batches) in hand per queue, at most.
    pub prefetch: u16,
}

/// What happened so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Broker messages read (a batch is one).
    pub read: u64,
    /// Messages read (each member of a batch is one).
    pub messages: u64,
    /// Copies confirmed on the new cluster whose old message was acked.
    pub moved: u64,
    /// Stopped on the old cluster (cancelled, purged, superseded by a reschedule): not copied.
    pub cancelled: u64,
    /// Read again after an earlier run or consumer had them: their copies may arrive twice.
    pub maybe_duplicates: u64,
    /// Of destinations `--queue` did not name (left on the old cluster).
    pub not_selected: u64,
    /// `x-delay-*` headers left out of copies because their writer is not believed in them.
    pub headers_removed: u64,
    /// Left on the old cluster, by reason.
    pub left: BTreeMap<String, u64>,
    /// What would move (`--dry-run`) or was read to move, by destination on the new cluster
    /// and due period.
    pub by_destination: BTreeMap<String, [u64; 4]>,
    /// Parked messages moved (`--dry-run`: that would move) with `--parked`.
    pub parked: u64,
    /// Parked messages left on the old cluster because `--parked` was not given.
    pub parked_left: u64,
}

impl Counts {
    /// Messages left on the old cluster for a reason.
    pub fn left_total(&self) -> u64 {
        self.left.values().sum()
    }

    fn leave(&mut self, reason: String, n: u64) {
        *self.left.entry(reason).or_default() += n;
    }
}

/// The run's state.
struct Run {
    from: Layout,
    to: Layout,
    old: Arc<Connection>,
    new: Arc<Connection>,
    trust: Trust,
    cancels: Cancellations,
    /// Gateway due queues (old names) and their targets.
    targets: HashMap<String, String>,
    max_members: usize,
    queues: Vec<String>,
    prefetch: u16,
    counts: Counts,
    /// The old cluster's parking queues known to exist or to be worth a look.
    parking: BTreeSet<String>,
    /// The new cluster's parking queues declared by this run.
    declared: BTreeSet<String>,
}

/// Transfers (or with `dry_run` counts) what waits on the cluster of `settings` to `opts.to`;
/// `progress` is called after every chunk with the counts so far.
pub async fn run(
    settings: &Settings,
    opts: Options,
    mut progress: impl FnMut(&Counts),
) -> Result<Counts> {
    let from = settings
        .layout()
        .map_err(amqp_delay::settings::SettingsError::from)?;
    let mut new_settings = settings.clone();
    new_settings.url = opts.to.clone();
    new_settings.management_url = None;
    if let Some(p) = &opts.to_prefix {
        new_settings.prefix = p.clone();
    }
    let to = new_settings
        .layout()
        .map_err(amqp_delay::settings::SettingsError::from)?;
    let old = Arc::new(
        Connector::new(settings)?
            .connect("amqp-delay transfer (from)")
            .await?,
    );
    let new = match Connector::new(&new_settings) {
        Ok(c) => c.connect("amqp-delay transfer (to)").await,
        Err(e) => Err(e),
    };
    let new = match new {
        Ok(n) => Arc::new(n),
        Err(e) => {
            broker::close_connection(&old, "bye").await;
            return Err(e);
        }
    };
    let result = async {
        let writer = new.status().username();
        let carries = may_carry(settings, &writer)?;
        let lock = take_lock(&old, &from).await?;
        let r = async {
            let old_user = old.status().username();
            let mut follow = FollowOptions::new(
                settings.cancel.notice.as_duration(),
                settings.cancel.horizon.as_millis(),
            );
            follow.trust = settings.trust.clone();
            let cancels = Cancellations::follow_with(&old, &from, follow).await?;
            let mut targets = HashMap::new();
            let mut pairs = settings.gateway.pairs.clone();
            let mut marked = Vec::new();
            for r in control::read_all(&old, &from, &settings.trust).await? {
                match r {
                    Record::GatewayPair {
                        ingress, target, ..
                    } => pairs.push(amqp_delay::settings::PairConfig {
                        ingress,
                        target,
                        writers: Vec::new(),
                    }),
                    Record::BatchMarker { queue } => marked.push(queue),
                    _ => {}
                }
            }
            for p in pairs {
                marked.push(from.gateway_ingress_queue(&p.ingress));
                marked.push(from.gateway_due_queue(&p.ingress));
                targets.insert(from.gateway_due_queue(&p.ingress), p.target);
            }
            let mut run = Run {
                from: from.clone(),
                to: to.clone(),
                old: old.clone(),
                new: new.clone(),
                trust: Trust::new(Some(old_user), &settings.trust),
                cancels,
                targets,
                max_members: settings.publisher.batch_max_messages.max(
                    amqp_delay::settings::PublisherSettings::default().batch_max_messages,
                ),
                queues: opts.queues.clone(),
                prefetch: opts.prefetch.max(1),
                counts: Counts::default(),
                parking: BTreeSet::new(),
                declared: BTreeSet::new(),
            };
            run.note_parking(&marked);
            let mut sources = transfer::tier_queues(&from);
            let mut due: Vec<String> = run.targets.keys().cloned().collect();
            due.sort();
            if carries == Carry::OwnersOnly && !opts.dry_run {
                for q in &due {
                    if broker::queue_state(&old, q).await?.is_some_and(|s| s.ready > 0) {
                        return Err(Error::Invalid(format!(
                            "gateway due queue '{q}' holds messages, and the new cluster's gateway \
                             publishes to its target only what one of its peers wrote: add '{writer}' \
                             to [trust] peers of the new cluster (and this command's \
                             configuration), or run as a peer; nothing was moved"
                        )));
                    }
                }
            }
            sources.extend(due);
            if opts.dry_run {
                for q in &sources {
                    run.drain(q, None, &mut progress).await?;
                }
                run.count_parked(opts.parked).await?;
                return Ok(run.counts.clone());
            }
            let publisher = Publisher::with_connection(new.clone(), to.clone(), &new_settings).await?;
            let r = async {
                for pass in 1..=MAX_PASSES {
                    let done = |c: &Counts| c.moved + c.cancelled + c.parked;
                    let before = done(&run.counts);
                    // what is left is read again: the last pass says what stays
                    run.counts.left.clear();
                    run.counts.not_selected = 0;
                    for q in &sources {
                        run.drain(q, Some(&publisher), &mut progress).await?;
                    }
                    // after the tiers: what the old workers parked meanwhile moves too
                    if opts.parked {
                        for q in run.parking.clone() {
                            run.drain(&q, Some(&publisher), &mut progress).await?;
                        }
                    }
                    let moved = done(&run.counts) - before;
                    tracing::info!(pass, moved, "transfer pass done");
                    if moved == 0 {
                        break;
                    }
                }
                if !opts.parked {
                    run.count_parked(false).await?;
                }
                Ok(run.counts.clone())
            }
            .await;
            publisher.close().await;
            r
        }
        .await;
        let _ = lock
            .queue_delete(
                from.transfer_lock().as_str().into(),
                Default::default(),
            )
            .await;
        broker::close(&lock, "transfer done").await;
        r
    }
    .await;
    broker::close_connection(&new, "bye").await;
    broker::close_connection(&old, "bye").await;
    result
}

/// What the writer of the copies may carry across.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carry {
    /// A peer: owners, and gateways' messages (the due stage takes a peer's).
    Everything,
    /// An admin that is no peer: owners, not gateways' messages.
    OwnersOnly,
}

/// Whether `writer` (the new cluster's user) may carry owners across: an admin or a peer of
/// `[trust]`, which must be the new cluster's; refused before anything moves otherwise.
fn may_carry(settings: &Settings, writer: &str) -> Result<Carry> {
    let t = &settings.trust;
    if t.peers.iter().any(|p| p == writer) {
        return Ok(Carry::Everything);
    }
    if t.admins.iter().any(|a| a == writer) {
        return Ok(Carry::OwnersOnly);
    }
    Err(Error::Invalid(format!(
        "'{writer}' (the user of --to) is neither an admin nor a peer in [trust]: the new \
         cluster would take its copies as its own messages and their owners could no longer \
         cancel them; run as an admin or a peer of the new cluster (the same [trust] as its \
         workers); nothing was moved"
    )))
}

/// Takes the transfer's lock on the old cluster: an exclusive queue, held by this connection.
async fn take_lock(conn: &Connection, layout: &Layout) -> Result<Channel> {
    let name = layout.transfer_lock();
    let ch = broker::open(conn).await?;
    let opts = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    match ch
        .queue_declare(name.as_str().into(), opts, FieldTable::default())
        .await
    {
        Ok(_) => Ok(ch),
        Err(e) if e.to_string().contains("RESOURCE_LOCKED") => Err(Error::Stopped(format!(
            "another transfer is running from this cluster (it holds the lock queue '{name}'); \
             wait for it to end"
        ))),
        Err(e) => Err(Error::Stopped(format!(
            "taking the lock '{name}': {}",
            chain(&e)
        ))),
    }
}

/// Where one delivery stands.
enum Fate {
    /// Ack once every copy is confirmed (none: nothing to copy).
    Ack,
    /// Left on the old cluster (given back when the channel closes).
    Hold,
}

impl Run {
    /// Reads `queue` until it is empty (or, in a dry run, until everything it held was seen),
    /// copying through `publisher` (none: a dry run).
    async fn drain(
        &mut self,
        queue: &str,
        publisher: Option<&Publisher>,
        progress: &mut impl FnMut(&Counts),
    ) -> Result<()> {
        let Some(state) = broker::queue_state(&self.old, queue).await? else {
            return Ok(());
        };
        if state.ready == 0 {
            return Ok(());
        }
        // a dry run holds everything it reads; so does a run that skips other destinations
        // (a parking queue was chosen whole)
        let selective = !self.queues.is_empty() && !self.parking.contains(queue);
        let prefetch = match publisher.is_none() || selective {
            true => 0,
            false => self.prefetch,
        };
        let ch = broker::open(&self.old).await?;
        let r = self
            .consume(&ch, queue, state.ready, prefetch, publisher, progress)
            .await;
        broker::close(&ch, "transfer: queue read").await;
        r
    }

    async fn consume(
        &mut self,
        ch: &Channel,
        queue: &str,
        ready: u32,
        prefetch: u16,
        publisher: Option<&Publisher>,
        progress: &mut impl FnMut(&Counts),
    ) -> Result<()> {
        let fail = |what: &str, e: lapin::Error| {
            Error::Stopped(format!("{what} '{queue}': {}", chain(&e)))
        };
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| fail("setting the prefetch on", e))?;
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "amqp-delay transfer".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| fail("consuming", e))?;
        let chunk_max = usize::from(if prefetch == 0 { 1000 } else { prefetch });
        let (mut got, mut held) = (0u64, 0u64);
        let r = loop {
            let first = match tokio::time::timeout(IDLE, consumer.next()).await {
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(e))) => break Err(fail("reading", e)),
                Ok(None) => break Ok(()),
                Err(_) => {
                    if publisher.is_none() && got >= u64::from(ready) {
                        break Ok(());
                    }
                    let left = broker::queue_state(&self.old, queue).await?;
                    let stuck = prefetch != 0 && held >= u64::from(prefetch);
                    if left.is_none_or(|s| s.ready == 0) || stuck || publisher.is_none() {
                        break Ok(());
                    }
                    continue;
                }
            };
            let mut chunk = vec![first];
            while chunk.len() < chunk_max {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => chunk.push(d),
                    _ => break,
                }
            }
            got += chunk.len() as u64;
            let r = match publisher {
                Some(p) if self.parking.contains(queue) => {
                    self.parked_chunk(ch, queue, chunk, p).await
                }
                _ => self.chunk(ch, queue, chunk, publisher).await,
            };
            match r {
                Ok(h) => held += h,
                Err(e) => break Err(e),
            }
            progress(&self.counts);
            if publisher.is_none() && got >= u64::from(ready) {
                break Ok(());
            }
        };
        broker::end_consumer(ch, &consumer, "transfer: queue read").await;
        r
    }

    /// Copies a chunk of deliveries and acks those whose copies were all confirmed; how many
    /// it holds (left on the old cluster until the channel closes).
    async fn chunk(
        &mut self,
        ch: &Channel,
        queue: &str,
        chunk: Vec<lapin::message::Delivery>,
        publisher: Option<&Publisher>,
    ) -> Result<u64> {
        let now = now_ms();
        let reading = Reading {
            from: &self.from,
            to: &self.to,
            trust: &self.trust,
            max_members: self.max_members,
        };
        let mut fates = Vec::with_capacity(chunk.len());
        let mut items: Vec<(usize, Copy)> = Vec::new();
        let mut seen = Vec::new();
        for (i, d) in chunk.iter().enumerate() {
            self.counts.read += 1;
            let copies = match transfer::copies(
                &reading,
                queue,
                d.routing_key.as_str(),
                &d.properties,
                &d.data,
            ) {
                Ok(c) => c,
                Err(reason) => {
                    self.counts.leave(format!("unreadable: {reason}"), 1);
                    fates.push(Fate::Hold);
                    continue;
                }
            };
            let n = copies.len() as u64;
            self.counts.messages += n;
            if let Some(c) = copies.first() {
                seen.push(c.destination.clone());
            }
            let selected = self.queues.is_empty()
                || copies
                    .first()
                    .is_some_and(|c| self.queues.contains(&c.destination));
            if !selected {
                self.counts.not_selected += n;
                fates.push(Fate::Hold);
                continue;
            }
            if d.redelivered {
                self.counts.maybe_duplicates += n;
            }
            for mut c in copies {
                self.counts.headers_removed += c.headers_removed as u64;
                match self.cancels.steer(&c.subject()) {
                    Steer::Run => {}
                    Steer::MoveTo(t) => c.move_to(t),
                    Steer::Cancelled | Steer::Purged | Steer::Superseded => {
                        self.counts.cancelled += 1;
                        continue;
                    }
                }
                let row = self
                    .counts
                    .by_destination
                    .entry(c.new_destination().to_string())
                    .or_default();
                row[Period::of(c.due_ms, now) as usize] += 1;
                c.set_target(self.targets.get(&c.destination).cloned());
                items.push((i, c));
            }
            fates.push(Fate::Ack);
        }
        seen.dedup();
        self.note_parking(&seen);
        let Some(publisher) = publisher else {
            return Ok(chunk.len() as u64);
        };
        let mut failed: HashMap<usize, (String, u64)> = HashMap::new();
        let mut confirmed: HashMap<usize, u64> = HashMap::new();
        let stream = futures::stream::iter(items).map(|(i, c)| (i, c.message_now(now_ms())));
        let mut results = std::pin::pin!(publisher.schedule_all(stream));
        while let Some((i, r)) = results.next().await {
            match r {
                Ok(_) => *confirmed.entry(i).or_default() += 1,
                Err(e) => {
                    let why = if e.maybe_sent() {
                        format!(
                            "copy's confirm lost (left; a re-run copies it again): {}",
                            chain(&e)
                        )
                    } else {
                        format!("copy not scheduled: {}", chain(&e))
                    };
                    let f = failed.entry(i).or_insert((why, 0));
                    f.1 += 1;
                }
            }
        }
        let mut held = 0;
        for (i, (d, fate)) in chunk.iter().zip(fates).enumerate() {
            let done = confirmed.get(&i).copied().unwrap_or(0);
            match (fate, failed.remove(&i)) {
                (Fate::Hold, _) => held += 1,
                (Fate::Ack, Some((why, n))) => {
                    self.counts.leave(why, n);
                    // its other copies are confirmed: a re-run copies them again
                    self.counts.maybe_duplicates += done;
                    held += 1;
                }
                (Fate::Ack, None) => {
                    ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await
                        .map_err(|e| {
                            Error::Stopped(format!(
                                "acking a moved message on '{queue}' (its copies are confirmed; \
                                 a re-run copies them again): {}",
                                chain(&e)
                            ))
                        })?;
                    self.counts.moved += done;
                }
            }
        }
        Ok(held)
    }
}
