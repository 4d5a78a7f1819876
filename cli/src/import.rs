//! `delay-publisher import-plugin`: moves the delayed-message plugin's pending messages into
//! amqp-delay, nothing lost and nothing doubled beyond at-least-once.
//!
//! * **Reads** the plugin's store in the plugin's own node, through `rabbitmqctl eval`
//!   ([`node`]): bounded batches in due order from a cursor, with dirty reads that take no lock
//!   and never go through the plugin's process, which keeps delivering meanwhile.
//! * **Schedules** each message as a gateway's ingress would have ([`gateway::due_message`]):
//!   into the due queue of the gateway pair whose target is the message's exchange ([`pairs`]),
//!   with its remaining delay (its due time unchanged), its routing key, properties (`CC` kept,
//!   `BCC` given back) and body; the pair's due stage restores it at the target as published,
//!   `x-delay` negated as the plugin delivers it. The copy is written under the importing
//!   user's broker-checked `user_id` and names that user in `x-delay-owner`.
//! * **Deletes** a plugin entry only once its copy is confirmed, in the next call (batched, the
//!   plugin's process suspended for each short transaction). A crash anywhere loses nothing: a
//!   re-run copies again what was copied but not yet deleted (duplicates, with the same ids).
//! * **Leaves** to the plugin what falls due within `--leave` (at least three times the slowest
//!   call), so that the plugin seldom delivers a message whose copy is being made; when it does
//!   (the delete finds the entry gone), the duplicate is counted.
//!
//! Two calls are in flight at most: the node reads (and deletes) while the previous batch's
//! copies are published.

mod node;
mod pairs;

pub use node::Node;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use lapin::Connection;

use amqp_delay::gateway::{self, Ingress};
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Result, error_chain as chain};
use amqp_delay::{Layout, Message, Publisher, Settings};

use crate::plugin_store::{self, Cursor, Entry, EntryId, Next, Period, Unreadable};
use pairs::Pairs;

/// What to import and how.
pub struct Options {
    /// The plugin's node.
    pub node: Node,
    /// Only these exchanges (empty: all of the URL's virtual host).
    pub exchanges: Vec<String>,
    /// Count only: nothing is copied or deleted.
    pub dry_run: bool,
    /// Leave to the plugin what falls due within this many ms.
    pub leave_ms: u64,
    /// Entries read per call.
    pub batch: usize,
    /// Body bytes read per call.
    pub batch_bytes: usize,
    /// Declare a missing gateway pair (`<prefix>.gw.x.<exchange>`) with the gateway's declare.
    pub declare_pairs: bool,
}

/// What happened so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Entries read.
    pub read: u64,
    /// Copied, confirmed, and deleted from the plugin.
    pub moved: u64,
    /// Copied and confirmed, but the plugin had delivered the entry meanwhile (two deliveries).
    pub duplicates: u64,
    /// Copies confirmed whose entries are not deleted yet.
    pub copying: u64,
    /// Due within the leave window: left to the plugin, which delivers them.
    pub skipped: u64,
    /// Of exchanges `--exchange` did not name.
    pub not_selected: u64,
    /// Left in the plugin, by reason.
    pub left: BTreeMap<String, u64>,
    /// Entries the plugin held at the last call.
    pub plugin_holds: u64,
    /// The leave window in force (ms): `--leave`, or three times the slowest call.
    pub leave_ms: u64,
    /// What would move (`--dry-run`) or was read to move, by exchange and period.
    pub by_exchange: BTreeMap<String, [u64; 4]>,
}

impl Counts {
    /// Entries left in the plugin for a reason (not those due within the leave window).
    pub fn left_total(&self) -> u64 {
        self.left.values().sum()
    }

    fn leave(&mut self, reason: String) {
        *self.left.entry(reason).or_default() += 1;
    }
}

/// A copy on its way: the entry it replaces, its due time and the message.
struct Copy {
    id: EntryId,
    due_ms: u64,
    msg: Message,
}

/// What publishing a batch of copies ended with.
#[derive(Default)]
struct Published {
    confirmed: Vec<EntryId>,
    failed: Vec<String>,
}

/// The run's state between calls.
struct Run {
    settings: Settings,
    layout: Layout,
    conn: Arc<Connection>,
    pairs: Pairs,
    owner: Option<String>,
    vhost: String,
    exchanges: Vec<String>,
    dry_run: bool,
    leave_ms: u64,
    counts: Counts,
}

/// Imports (or with `dry_run` counts) the plugin's pending messages; `progress` is called after
/// every call with the counts so far.
pub async fn run(
    settings: &Settings,
    opts: Options,
    mut progress: impl FnMut(&Counts),
) -> Result<Counts> {
    let layout = settings
        .layout()
        .map_err(amqp_delay::settings::SettingsError::from)?;
    let conn = amqp_delay::ops::connection::Connector::new(settings)?
        .connect("amqp-delay import-plugin")
        .await?;
    let conn = Arc::new(conn);
    let result = async {
        let pairs = Pairs::load(&conn, settings, opts.declare_pairs, opts.dry_run).await?;
        let status = conn.status();
        let mut run = Run {
            settings: settings.clone(),
            layout: layout.clone(),
            conn: conn.clone(),
            pairs,
            owner: Some(status.username()).filter(|u| !u.is_empty()),
            vhost: status.vhost().to_string(),
            exchanges: opts.exchanges.clone(),
            dry_run: opts.dry_run,
            leave_ms: opts.leave_ms,
            counts: Counts {
                leave_ms: opts.leave_ms,
                ..Counts::default()
            },
        };
        if opts.dry_run {
            return run.count(&opts, &mut progress).await;
        }
        let publisher = Publisher::with_connection(conn.clone(), layout, settings).await?;
        let r = run.import(&opts, &publisher, &mut progress).await;
        publisher.close().await;
        r
    }
    .await;
    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    result
}

impl Run {
    /// `--dry-run`: reads every batch, counts, changes nothing.
    async fn count(
        &mut self,
        opts: &Options,
        progress: &mut impl FnMut(&Counts),
    ) -> Result<Counts> {
        let mut cursor = Cursor::start();
        loop {
            let (answer, took) = opts
                .node
                .call(&[], &cursor, opts.batch, opts.batch_bytes)
                .await?;
            self.took(took);
            self.counts.plugin_holds = answer.size;
            self.classify(answer.entries).await;
            progress(&self.counts);
            match answer.next {
                Next::End => return Ok(self.counts.clone()),
                Next::More(c) => cursor = c,
            }
        }
    }

    /// The import: each call deletes what the previous batches' confirmed copies replace and
    /// reads the next batch, while the batch read before is being published.
    async fn import(
        &mut self,
        opts: &Options,
        publisher: &Publisher,
        progress: &mut impl FnMut(&Counts),
    ) -> Result<Counts> {
        let mut cursor = Cursor::start();
        let mut reading = true;
        let mut to_delete: Vec<EntryId> = Vec::new();
        let mut pending: Option<BoxFuture<'_, Published>> = None;
        while reading || !to_delete.is_empty() || pending.is_some() {
            let dels: Vec<EntryId> = to_delete
                .drain(..plugin_store::deletes_that_fit(&to_delete))
                .collect();
            let want = if reading { opts.batch } else { 0 };
            if dels.is_empty() && want == 0 {
                if let Some(p) = pending.take() {
                    self.published(p.await, &mut to_delete);
                }
                continue;
            }
            let publishing = async {
                match pending.take() {
                    Some(p) => p.await,
                    None => Published::default(),
                }
            };
            let call = opts.node.call(&dels, &cursor, want, opts.batch_bytes);
            let (answer, published) = futures::join!(call, publishing);
            self.published(published, &mut to_delete);
            let (answer, took) = match answer {
                Ok(a) => a,
                Err(e) => return Err(self.stopped(e, dels.len() + to_delete.len())),
            };
            self.took(took);
            tracing::debug!(
                deleted = dels.len(),
                read = answer.entries.len(),
                node_ms = answer.node_us / 1000,
                call_ms = took.as_millis() as u64,
                "rabbitmqctl call"
            );
            self.deleted(&answer.deleted);
            self.counts.plugin_holds = answer.size;
            match answer.next {
                Next::End => reading = false,
                Next::More(c) => cursor = c,
            }
            let copies = self.classify(answer.entries).await;
            if !copies.is_empty() {
                pending = Some(Box::pin(publish(publisher, copies)));
            }
            progress(&self.counts);
        }
        Ok(self.counts.clone())
    }

    /// A failed call: the copies confirmed but not deleted are copied again by a re-run.
    fn stopped(&self, e: Error, undeleted: usize) -> Error {
        if undeleted > 0 {
            tracing::warn!(
                copies = undeleted,
                "these copies were confirmed but their plugin entries are not deleted: a re-run copies them again (duplicates, with the same message ids)"
            );
        }
        e
    }

    /// A call took `took`: the leave window grows to three times the slowest call.
    fn took(&mut self, took: Duration) {
        let three = u64::try_from(took.as_millis().saturating_mul(3)).unwrap_or(u64::MAX);
        self.counts.leave_ms = self.counts.leave_ms.max(self.leave_ms).max(three);
    }

    /// The results of the deletes of the copies confirmed before (one per copy, in order).
    fn deleted(&mut self, results: &[bool]) {
        for &found in results {
            self.counts.copying = self.counts.copying.saturating_sub(1);
            if found {
                self.counts.moved += 1;
            } else {
                self.counts.duplicates += 1;
            }
        }
    }

    /// A batch's copies were published: the confirmed ones' entries go to the next delete, the
    /// others stay in the plugin.
    fn published(&mut self, p: Published, to_delete: &mut Vec<EntryId>) {
        self.counts.copying += p.confirmed.len() as u64;
        to_delete.extend(p.confirmed);
        for reason in p.failed {
            self.counts.leave(reason);
        }
    }

    /// Sorts a batch's entries: the copies to make, and the counts of the others.
    async fn classify(
        &mut self,
        entries: Vec<std::result::Result<Entry, Unreadable>>,
    ) -> Vec<Copy> {
        let now = now_ms();
        let mut copies = Vec::new();
        for e in entries {
            self.counts.read += 1;
            let e = match e {
                Ok(e) => e,
                Err(u) => {
                    self.counts.leave(format!("unreadable: {}", u.reason));
                    continue;
                }
            };
            if !self.exchanges.is_empty() && !self.exchanges.contains(&e.exchange) {
                self.counts.not_selected += 1;
                continue;
            }
            if e.id.due_ms < now.saturating_add(self.counts.leave_ms) {
                self.counts.skipped += 1;
                continue;
            }
            match self.copy_of(&e, now).await {
                Ok(msg) => {
                    let row = self
                        .counts
                        .by_exchange
                        .entry(e.exchange.clone())
                        .or_default();
                    row[Period::of(e.id.due_ms, now) as usize] += 1;
                    if !self.dry_run {
                        copies.push(Copy {
                            due_ms: e.id.due_ms,
                            id: e.id,
                            msg,
                        });
                    }
                }
                Err(reason) => self.counts.leave(reason),
            }
        }
        copies
    }

    /// The copy of `e` a gateway's ingress would have written, or why there can be none.
    async fn copy_of(&mut self, e: &Entry, now: u64) -> std::result::Result<Message, String> {
        if e.vhost != self.vhost {
            return Err(format!(
                "in virtual host '{}' (the URL names '{}'): run again with a URL naming it",
                e.vhost, self.vhost
            ));
        }
        let pair = self.pairs.pair_for(&self.conn, &e.exchange).await?;
        let properties = e.copy_properties();
        let ingress = Ingress {
            properties: &properties,
            routing_key: &e.routing_key,
            invalid: None,
            owner: self.owner.as_deref(),
        };
        let delay = e.id.due_ms.saturating_sub(now);
        let msg = gateway::due_message(&pair, ingress, e.body.clone(), delay);
        check(&self.settings, &self.layout, &msg).map_err(|why| format!("cannot move: {why}"))?;
        Ok(msg)
    }
}

/// What the publisher would refuse `msg` for (its size, headers, delay), without I/O.
fn check(settings: &Settings, layout: &Layout, msg: &Message) -> std::result::Result<(), String> {
    msg.check(settings.publisher.max_message_bytes)?;
    amqp_delay::plan(layout, &settings.precision, msg.delay_ms).map_err(|e| e.to_string())?;
    Ok(())
}

/// Publishes `copies`, each with the delay left until its due time at the moment it is
/// scheduled (so the due time does not move while the batch waits its turn).
async fn publish(publisher: &Publisher, copies: Vec<Copy>) -> Published {
    let items = futures::stream::iter(copies).map(|mut c| {
        c.msg.delay_ms = c.due_ms.saturating_sub(now_ms());
        (c.id, c.msg)
    });
    let mut out = Published::default();
    let mut results = std::pin::pin!(publisher.schedule_all(items));
    while let Some((id, r)) = results.next().await {
        match r {
            Ok(_) => out.confirmed.push(id),
            Err(e) if e.maybe_sent() => out.failed.push(format!(
                "copy's confirm lost (left in the plugin; a re-run copies it again): {}",
                chain(&e)
            )),
            Err(e) => out
                .failed
                .push(format!("copy not scheduled: {}", chain(&e))),
        }
    }
    out
}
