//! `stats`: the depth of every tier queue and of the parking queues, from a passive declare of
//! each queue (whether it exists, its ready messages, now), and from the management API when
//! there is one (unacknowledged, dead-lettered, leader; every destination's parking queue too).
//! Never a consumer or a `basic.get` on a tier: delivery beats expiry (DESIGN rule 8).

#[cfg(feature = "management")]
use std::collections::HashMap;

use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use super::Topology;
use crate::broker::{self, NOT_FOUND, open};
use crate::error::{Result, ResultExt};
use crate::layout::{Layout, TierKind};
#[cfg(feature = "management")]
use crate::management::{Management, QueueInfo};

/// Depth of one queue, for `stats`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct QueueStat {
    /// Queue name.
    pub queue: String,
    /// `cascade`, `fixed`, `overflow` or `parked`.
    pub kind: &'static str,
    /// Queue TTL (none for the parking queue).
    pub ttl_ms: Option<u64>,
    /// Broker messages it holds: ready + unacknowledged + dead-lettered and not yet moved on
    /// when the management API answered (at least the ready ones seen now: its figures lag),
    /// ready only otherwise (a batch counts once).
    pub messages: u64,
    /// Ready messages.
    pub ready: u64,
    /// Delivered and not settled (held by the broker's dead-letter worker, or a consumer);
    /// `None` when not visible (AMQP only).
    pub unacked: Option<u64>,
    /// Dead-lettered by this quorum queue (its TTL expired) and waiting in its dead-letter
    /// buffer for the broker's dead-letter worker to move them on: part of `messages`, neither
    /// ready nor unacknowledged. Normal for a moment after a restart or failover; a number that
    /// does not shrink means the worker does not run (docs/OPERATIONS.md). `None` when not
    /// visible (AMQP only).
    pub dead_lettered: Option<u64>,
    /// The node leading the queue (management API only).
    pub leader: Option<String>,
    /// The queue does not exist (`delay-publisher declare` re-creates it).
    pub missing: bool,
    /// Every message in this tier falls due within this many ms (none for parking queues).
    pub due_within_ms: Option<u64>,
}

impl QueueStat {
    /// Queue `queue`, nothing read yet.
    fn unread(
        queue: String,
        kind: &'static str,
        ttl_ms: Option<u64>,
        due_within_ms: Option<u64>,
    ) -> Self {
        QueueStat {
            queue,
            kind,
            ttl_ms,
            due_within_ms,
            messages: 0,
            ready: 0,
            unacked: None,
            dead_lettered: None,
            leader: None,
            missing: false,
        }
    }

    /// A queue that holds `messages` ready broker messages and nothing else visible (tests).
    #[doc(hidden)]
    pub fn ready_only(
        queue: String,
        kind: &'static str,
        ttl_ms: Option<u64>,
        messages: u64,
    ) -> Self {
        QueueStat {
            queue,
            kind,
            ttl_ms,
            messages,
            ready: messages,
            unacked: None,
            dead_lettered: None,
            leader: None,
            missing: false,
            due_within_ms: ttl_ms,
        }
    }
}

impl Topology {
    /// Depth of every tier queue and of the unroutable queue. Over AMQP only ready messages
    /// are visible (`unacked` is `None`); with `management`, ready and unacknowledged (held by
    /// the broker's dead-letter worker, e.g. after a restart) and the leader node. A missing
    /// queue is reported as such (`delay-publisher declare` re-creates it).
    #[cfg(feature = "management")]
    pub async fn stats_with(
        &self,
        conn: &Connection,
        management: Option<&Management>,
    ) -> Result<Vec<QueueStat>> {
        let l = &self.layout;
        let mut stats = tier_stats(l);
        match management {
            Some(m) => {
                let infos = m.queues(&l.namespace()).await?;
                stats.extend(parking_stats(l, &infos));
                // what exists and is ready, now, over AMQP: the management API's figures are
                // up to its statistics interval old (5 s by default)
                read_depths(conn, &mut stats).await?;
                for stat in &mut stats {
                    read_info(stat, &infos);
                }
            }
            None => read_depths(conn, &mut stats).await?,
        }
        Ok(stats)
    }

    /// Depth of every tier queue and of the unroutable queue over AMQP: ready messages only
    /// (`unacked` is `None`); `stats_with` (feature `management`) sees held messages too.
    pub async fn stats(&self, conn: &Connection) -> Result<Vec<QueueStat>> {
        let mut stats = tier_stats(&self.layout);
        read_depths(conn, &mut stats).await?;
        Ok(stats)
    }
}

/// Every tier queue, then the unroutable queue, nothing read yet.
fn tier_stats(l: &Layout) -> Vec<QueueStat> {
    let mut out: Vec<QueueStat> = l
        .tiers()
        .into_iter()
        .map(|t| {
            let kind = match t.kind {
                TierKind::Cascade { .. } => "cascade",
                TierKind::Fixed { .. } => "fixed",
                TierKind::Overflow { .. } => "overflow",
            };
            let within = l.due_within_ms(t.kind);
            QueueStat::unread(t.queue, kind, Some(t.ttl_ms), Some(within))
        })
        .collect();
    out.push(QueueStat::unread(
        l.unroutable_queue(),
        "parked",
        None,
        None,
    ));
    out
}

/// The parking queue of every destination the management API lists, by name.
#[cfg(feature = "management")]
fn parking_stats(l: &Layout, infos: &HashMap<String, QueueInfo>) -> Vec<QueueStat> {
    let parked_prefix = l.parked_prefix();
    let mut extra: Vec<&String> = infos
        .keys()
        .filter(|n| n.starts_with(&parked_prefix))
        .collect();
    extra.sort();
    extra
        .into_iter()
        .map(|n| QueueStat::unread(n.clone(), "parked", None, None))
        .collect()
}

/// Adds to `stat`, read over AMQP, what the management API alone sees of its queue: messages
/// unacknowledged and held by the dead-letter worker, the leader. Its figures may be seconds
/// old, so whether the queue exists and how many are ready stay as AMQP said, and `messages`
/// is the larger of the two counts (a queue the API does not list yet gets nothing from it).
#[cfg(feature = "management")]
fn read_info(stat: &mut QueueStat, infos: &HashMap<String, QueueInfo>) {
    if stat.missing {
        return;
    }
    if let Some(q) = infos.get(&stat.queue) {
        stat.messages = q.messages.max(stat.ready);
        stat.unacked = Some(q.messages_unacknowledged);
        stat.dead_lettered = Some(q.dead_lettered());
        stat.leader = q.leader_node().map(str::to_string);
    }
}

/// Over AMQP: the ready messages of each queue, from a passive declare. One channel for all of
/// them, reopened after a queue that is missing (the broker closes the channel then).
async fn read_depths(conn: &Connection, stats: &mut [QueueStat]) -> Result<()> {
    let mut ch: Option<lapin::Channel> = None;
    for stat in stats.iter_mut() {
        if ch.as_ref().is_none_or(|c| !c.status().connected()) {
            ch = Some(open(conn).await?);
        }
        let c = ch.as_ref().expect("opened");
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match c
            .queue_declare(stat.queue.as_str().into(), passive, FieldTable::default())
            .await
        {
            Ok(q) => {
                stat.ready = u64::from(q.message_count());
                stat.messages = stat.ready;
            }
            // the broker closed the channel: the next queue opens another
            Err(e) if broker::is_reply(&e, NOT_FOUND) => stat.missing = true,
            Err(e) => {
                return Err(e).context(|| format!("reading depth of '{}'", stat.queue));
            }
        }
    }
    if let Some(c) = ch {
        broker::close(&c, "stats").await;
    }
    Ok(())
}
