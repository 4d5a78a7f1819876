//! Operations on everything under a prefix, across the layers below: `teardown`, of the whole
//! topology or of one destination.

use lapin::Connection;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};

use amqp_delay::Topology;
use amqp_delay::gateway;
use amqp_delay::layout::Layout;
use amqp_delay::ops::broker::{self, ResultExt};
use amqp_delay::ops::control::{self, Record};
use amqp_delay::ops::management::Management;
use amqp_delay::settings::Settings;
use amqp_delay::{Error, Result};

/// The management API of `settings`, if it answers (one request, a few seconds at most).
pub async fn management(settings: &Settings) -> Option<Management> {
    let m = match Management::new(&settings.url, settings.management_url.as_deref())?
        .with_tls(&settings.tls)
    {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("management API not used: {e}");
            return None;
        }
    };
    match m.queues(&Layout::namespace_of(&settings.prefix)).await {
        Ok(_) => Some(m),
        Err(e) => {
            tracing::debug!("management API not used: {e}");
            None
        }
    }
}

/// What [`teardown`] removed, and what it left.
#[derive(Debug, Clone, Default)]
pub struct Teardown {
    /// Ingress exchanges of the gateway pairs removed (their queues; the exchange too unless
    /// it is in `left`).
    pub pairs: Vec<String>,
    /// Batch markers removed.
    pub markers: usize,
    /// What it left, and why: objects that are not ours, and those whose deletion failed.
    pub left: Vec<Left>,
}

impl Teardown {
    /// Whether a deletion failed (not counting what was left as not ours).
    pub fn failed(&self) -> bool {
        self.left.iter().any(|l| l.failed)
    }
}

/// An object [`teardown`] left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Left {
    /// `exchange 'x'`, `queue 'q'`.
    pub object: String,
    /// Why: not ours (and whose it is), or the broker's error.
    pub reason: String,
    /// Whether its deletion was tried and failed.
    pub failed: bool,
}

/// Whether teardown may delete the exchange or queue `name`, found in the control stream (which
/// anyone allowed to write it may have forged): only a name under the prefix (`<prefix>.`), or
/// an ingress exchange the configuration's gateway pairs name (`configured`); never the default
/// exchange, never the broker's own `amq.*`. `Err` says why not.
pub fn owned(
    layout: &Layout,
    configured: &[String],
    name: &str,
) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("the default exchange is the broker's".into());
    }
    if name.starts_with("amq.") {
        return Err("an `amq.*` name is the broker's own".into());
    }
    if name.starts_with(&layout.namespace()) || configured.iter().any(|c| c == name) {
        return Ok(());
    }
    Err(format!(
        "not under the prefix '{}' and no gateway pair of the configuration: not ours to delete",
        layout.namespace()
    ))
}

/// Removes the topology under `layout`'s prefix and what its control stream names under it,
/// as [`teardown_with`] with no gateway pair configured.
pub async fn teardown(
    conn: &Connection,
    layout: &Layout,
    management: Option<&Management>,
    force: bool,
) -> Result<Teardown> {
    let trust = amqp_delay::settings::TrustSettings::default();
    teardown_with(conn, layout, management, force, &[], &trust).await
}

/// Removes the topology under `layout`'s prefix, the gateway pairs and batch markers declared
/// under it (found in the control stream, so no configuration has to name them) — of those,
/// only what is ours ([`owned`]: a pair's ingress exchange outside the prefix only when
/// `configured` names it). Unless `force`, refuses while the tiers, the unroutable queue or a
/// gateway queue hold messages — ready or held by the broker's dead-letter worker — since they
/// would be lost; and, without the management API (which alone sees held messages), refuses to
/// call them empty. An object whose deletion fails is listed in [`Teardown::left`] and the
/// rest are deleted all the same. Pairs and markers count only from writers `trust` (with
/// the connection's own user) lets name them: an admin's, a peer's.
pub async fn teardown_with(
    conn: &Connection,
    layout: &Layout,
    management: Option<&Management>,
    force: bool,
    configured: &[String],
    trust: &amqp_delay::settings::TrustSettings,
) -> Result<Teardown> {
    let records = control::read_all(conn, layout, trust).await?;
    let pairs = gateway::registered_pairs(layout, &records);
    let topology = Topology::new(layout.clone());
    if !force {
        refuse_while_held(conn, layout, management, &topology, &pairs).await?;
    }
    let mut markers: Vec<String> = records
        .iter()
        .flat_map(|r| match r {
            Record::BatchMarker { queue } => layout.markers(queue),
            _ => Vec::new(),
        })
        .collect();
    markers.sort();
    markers.dedup();
    let mut d = Deleter::new(conn, layout, configured);
    let mut done = Teardown::default();
    for p in &pairs {
        for q in p.queues() {
            d.delete(Kind::Queue, q).await;
        }
        d.delete(Kind::Exchange, &p.ingress).await;
        done.pairs.push(p.ingress.clone());
    }
    for m in &markers {
        if d.delete(Kind::Exchange, m).await {
            done.markers += 1;
        }
    }
    let (queues, exchanges) = topology.objects();
    for q in &queues {
        d.delete(Kind::Queue, q).await;
    }
    for x in &exchanges {
        d.delete(Kind::Exchange, x).await;
    }
    done.left = d.finish().await;
    Ok(done)
}

/// [`teardown_with`]'s refusal while messages would be lost.
async fn refuse_while_held(
    conn: &Connection,
    layout: &Layout,
    management: Option<&Management>,
    topology: &Topology,
    pairs: &[gateway::Pair],
) -> Result<()> {
    let stats = topology.stats_with(conn, management).await?;
    // tiers and the unroutable queue go with the topology; destinations' parking queues stay
    let unroutable = layout.unroutable_queue();
    let mut held: u64 = stats
        .iter()
        .filter(|s| s.kind != "parked" || s.queue == unroutable)
        .map(|s| s.messages)
        .sum();
    let infos = match management {
        Some(m) => Some(m.queues(&layout.namespace()).await?),
        None => None,
    };
    for q in pairs.iter().flat_map(|p| p.queues()) {
        held += match infos.as_ref() {
            Some(i) => i.get(q).map_or(0, |q| q.messages),
            None => broker::queue_state(conn, q)
                .await?
                .map_or(0, |s| u64::from(s.ready)),
        };
    }
    if held > 0 {
        return Err(Error::Invalid(format!(
            "{held} messages are still in the tiers, the gateway queues or parked; they would be lost. Wait for them to drain, or pass --force"
        )));
    }
    if management.is_none() {
        return Err(Error::Invalid(
            "no message is ready in the tiers, but without the broker's management API messages held by its dead-letter worker (after a restart or failover) cannot be seen, so the topology cannot be called empty. Enable the management plugin (or set management_url), or pass --force if you are sure".into(),
        ));
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Kind {
    Queue,
    Exchange,
}

/// Deletes objects one by one, each only when it is ours ([`owned`]), going on after an error
/// (on a new channel: the broker closes the channel of a refused delete), and remembers what it
/// left.
struct Deleter<'a> {
    conn: &'a Connection,
    layout: &'a Layout,
    configured: &'a [String],
    ch: Option<lapin::Channel>,
    left: Vec<Left>,
}

impl<'a> Deleter<'a> {
    fn new(conn: &'a Connection, layout: &'a Layout, configured: &'a [String]) -> Self {
        Deleter {
            conn,
            layout,
            configured,
            ch: None,
            left: Vec::new(),
        }
    }

    /// Deletes `name` (missing is fine); `false` when it was left.
    async fn delete(&mut self, kind: Kind, name: &str) -> bool {
        let object = match kind {
            Kind::Queue => format!("queue '{name}'"),
            Kind::Exchange => format!("exchange '{name}'"),
        };
        if let Err(reason) = owned(self.layout, self.configured, name) {
            tracing::warn!("teardown leaves {object}: {reason}");
            self.left.push(Left {
                object,
                reason,
                failed: false,
            });
            return false;
        }
        let r = match self.channel().await {
            Ok(ch) => match kind {
                Kind::Queue => ch
                    .queue_delete(name.into(), QueueDeleteOptions::default())
                    .await
                    .map(|_| ()),
                Kind::Exchange => {
                    ch.exchange_delete(name.into(), ExchangeDeleteOptions::default())
                        .await
                }
            }
            .context(|| format!("deleting {object}")),
            Err(e) => Err(e),
        };
        let Err(e) = r else { return true };
        // the broker closed the channel: the next object gets a new one
        self.ch = None;
        let reason = amqp_delay::error_chain(&e);
        tracing::warn!("teardown could not delete {object}: {reason}");
        self.left.push(Left {
            object,
            reason,
            failed: true,
        });
        false
    }

    async fn channel(&mut self) -> Result<lapin::Channel> {
        match &self.ch {
            Some(ch) if ch.status().connected() => Ok(ch.clone()),
            _ => {
                let ch = broker::open(self.conn).await?;
                self.ch = Some(ch.clone());
                Ok(ch)
            }
        }
    }

    async fn finish(self) -> Vec<Left> {
        if let Some(ch) = &self.ch {
            broker::close(ch, "deleted").await;
        }
        self.left
    }
}

/// What [`teardown_destination`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationTeardown {
    /// Queues deleted (the destination, its parking queue), those that existed.
    pub queues: Vec<String>,
    /// Whether its batch marker existed and was deleted.
    pub marker: bool,
}

/// Removes destination queue `queue`, its parking queue and its batch marker (the tiers stay).
/// Unless `force`, refuses while either queue holds messages — counted with the management API
/// when it answers (ready and unacknowledged) and with a passive declare (ready, current).
/// Messages still on their way through the tiers to
/// `queue` are parked in the unroutable queue when they fall due, not lost.
pub async fn teardown_destination(
    conn: &Connection,
    layout: &Layout,
    management: Option<&Management>,
    queue: &str,
    force: bool,
) -> Result<DestinationTeardown> {
    layout.validate_destination(queue).map_err(Error::Invalid)?;
    if queue.starts_with(&layout.namespace()) {
        return Err(Error::Invalid(format!(
            "'{queue}' belongs to the topology under prefix '{}' (a gateway or tier queue); `teardown` without --queue removes those",
            layout.prefix()
        )));
    }
    let parked = layout.parked_queue(queue);
    let queues = [queue.to_string(), parked];
    if !force {
        let infos = match management {
            Some(m) => Some(m.queues("").await?),
            None => None,
        };
        for q in &queues {
            // the management API also sees unacked messages, but its counts lag by up to its
            // stats interval; the passive declare sees ready ones at once: the larger of both
            let ready = broker::queue_state(conn, q)
                .await?
                .map_or(0, |s| u64::from(s.ready));
            let all = infos
                .as_ref()
                .and_then(|i| i.get(q.as_str()))
                .map_or(0, |info| info.messages);
            let held = ready.max(all);
            if held > 0 {
                return Err(Error::Invalid(format!(
                    "'{q}' holds {held} messages; they would be lost. Consume them, or pass --force"
                )));
            }
        }
    }
    let mut done = DestinationTeardown::default();
    for q in &queues {
        if broker::queue_state(conn, q).await?.is_none() {
            continue;
        }
        // (no if-empty: quorum queues refuse it with a connection error)
        let ch = broker::open(conn).await?;
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .context(|| format!("deleting queue '{q}'"))?;
        done.queues.push(q.clone());
        broker::close(&ch, "deleted").await;
    }
    for marker in layout.markers(queue) {
        if !broker::exchange_exists(conn, &marker).await? {
            continue;
        }
        let ch = broker::open(conn).await?;
        ch.exchange_delete(marker.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .context(|| format!("deleting exchange '{marker}'"))?;
        broker::close(&ch, "deleted").await;
        done.marker = true;
    }
    Ok(done)
}

/// Adds to `stats` the parking queues that every destination (its batch marker) and gateway
/// pair named in the control stream has and `stats` does not list yet (without the management
/// API it lists only the unroutable queue), with their ready messages; and returns the pairs
/// whose ingress queue holds messages that no gateway consumes (`ingress (N waiting)`). Every
/// writer's records count: this only looks, and what a record names lies under the prefix.
pub async fn pairs_and_parking(
    conn: &Connection,
    layout: &Layout,
    stats: &mut Vec<amqp_delay::QueueStat>,
) -> Result<Vec<String>> {
    let records = control::read_all_unchecked(conn, layout).await?;
    let mut parking = std::collections::BTreeSet::new();
    let mut unserved = Vec::new();
    for r in &records {
        if let Record::BatchMarker { queue } = r {
            parking.insert(layout.parked_queue(queue));
        }
    }
    for p in gateway::registered_pairs(layout, &records) {
        parking.insert(p.parked_queue.clone());
        parking.insert(p.ingress_parked_queue.clone());
        if let Some(q) = broker::queue_state(conn, &p.ingress_queue).await?
            && q.ready > 0
            && q.consumers == 0
        {
            unserved.push(format!("{} ({} waiting)", p.ingress, q.ready));
        }
    }
    for name in parking {
        if stats.iter().any(|s| s.queue == name) {
            continue;
        }
        if let Some(q) = broker::queue_state(conn, &name).await? {
            let stat = amqp_delay::QueueStat::ready_only(name, "parked", None, q.ready.into());
            stats.push(stat);
        }
    }
    Ok(unserved)
}

/// The totals `stats` prints under its table (and alone with `--summary`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StatsSummary {
    /// Messages not yet due, counted from the ledger; `None` when the topology has none or it
    /// could not be read (`messages_error` says why).
    pub messages: Option<amqp_delay::ops::ledger::Counted>,
    /// Why the messages could not be counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages_error: Option<String>,
    /// Broker messages (a batch counts once).
    pub broker_messages: BrokerTotals,
    /// Queues of the topology that do not exist.
    pub missing_queues: usize,
    /// Tiers whose dead-lettered messages wait for the broker's dead-letter worker, with how
    /// many and (with the management API) their leader.
    pub dead_lettered_waiting: Vec<String>,
    /// Gateway pairs whose ingress queue holds messages that no gateway consumes, with how
    /// many ([`pairs_and_parking`]).
    pub unserved_pairs: Vec<String>,
}

/// Broker messages in the tiers, by when their tier lets them out at the latest, and parked.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct BrokerTotals {
    /// In every tier queue.
    pub in_tiers: u64,
    /// In tiers whose longest wait is a minute or less.
    pub within_1m: u64,
    /// ... an hour or less.
    pub within_1h: u64,
    /// ... a day or less.
    pub within_1d: u64,
    /// In tiers that may hold them longer.
    pub later: u64,
    /// In the parking queues.
    pub parked: u64,
}

impl StatsSummary {
    /// The totals of `stats` and what counting the ledger gave.
    pub fn of(
        stats: &[amqp_delay::QueueStat],
        counted: Result<Option<amqp_delay::ops::ledger::Counted>>,
    ) -> StatsSummary {
        // saturating: the depths are the broker's (or its management API's) numbers
        let mut b = BrokerTotals::default();
        let add = |to: &mut u64, n: u64| *to = to.saturating_add(n);
        for s in stats.iter().filter(|s| !s.missing) {
            if s.kind == "parked" {
                add(&mut b.parked, s.messages);
                continue;
            }
            add(&mut b.in_tiers, s.messages);
            match s.due_within_ms {
                Some(w) if w <= 60_000 => add(&mut b.within_1m, s.messages),
                Some(w) if w <= 3_600_000 => add(&mut b.within_1h, s.messages),
                Some(w) if w <= 86_400_000 => add(&mut b.within_1d, s.messages),
                _ => add(&mut b.later, s.messages),
            }
        }
        // cumulative, as the messages' counts are
        add(&mut b.within_1h, b.within_1m);
        add(&mut b.within_1d, b.within_1h);
        let dead_lettered_waiting = stats
            .iter()
            .filter(|s| s.dead_lettered.unwrap_or(0) > 0)
            .map(|s| {
                let n = s.dead_lettered.unwrap_or(0);
                match &s.leader {
                    Some(l) => format!("{} ({n}, led by {l})", s.queue),
                    None => format!("{} ({n})", s.queue),
                }
            })
            .collect();
        let (messages, messages_error) = match counted {
            Ok(c) => (c, None),
            Err(e) => (None, Some(amqp_delay::error_chain(&e))),
        };
        StatsSummary {
            messages,
            messages_error,
            broker_messages: b,
            missing_queues: stats.iter().filter(|s| s.missing).count(),
            dead_lettered_waiting,
            unserved_pairs: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amqp_delay::QueueStat;

    fn stat(kind: &'static str, within: Option<u64>, messages: u64) -> QueueStat {
        QueueStat::ready_only(format!("p.{kind}"), kind, within, messages)
    }

    #[test]
    fn the_totals_sort_broker_messages_by_their_tiers_longest_wait() {
        let stats = [
            stat("cascade", Some(30_000), 1),
            stat("cascade", Some(600_000), 2),
            stat("fixed", Some(7_200_000), 4),
            stat("overflow", Some(90_000_000), 8),
            stat("parked", None, 16),
        ];
        let t = StatsSummary::of(&stats, Ok(None));
        let b = t.broker_messages;
        assert_eq!(
            (
                b.in_tiers,
                b.within_1m,
                b.within_1h,
                b.within_1d,
                b.later,
                b.parked
            ),
            (15, 1, 3, 7, 8, 16)
        );
        assert!(t.messages.is_none() && t.messages_error.is_none());
        let e = StatsSummary::of(&stats, Err(Error::Invalid("no read right".into())));
        assert!(e.messages_error.unwrap().contains("no read right"));
    }

    #[test]
    fn absurd_depths_do_not_overflow_the_totals() {
        let stats = [
            stat("cascade", Some(30_000), u64::MAX),
            stat("cascade", Some(30_000), u64::MAX),
        ];
        let b = StatsSummary::of(&stats, Ok(None)).broker_messages;
        assert_eq!((b.in_tiers, b.within_1d), (u64::MAX, u64::MAX));
    }

    #[test]
    fn teardown_owns_what_is_under_the_prefix_or_configured_and_never_the_brokers() {
        let layout = Layout::new("p", &Default::default()).unwrap();
        let configured = ["orders.delayed".to_string(), "amq.direct".to_string()];
        assert!(owned(&layout, &configured, "p.level0").is_ok());
        assert!(owned(&layout, &configured, "orders.delayed").is_ok());
        for theirs in ["p-other-app", "pp.level0", "p", "other"] {
            let e = owned(&layout, &configured, theirs).unwrap_err();
            assert!(e.contains("not ours"), "{theirs}: {e}");
        }
        // never the broker's, even when configured
        assert!(
            owned(&layout, &configured, "amq.direct")
                .unwrap_err()
                .contains("amq.")
        );
        assert!(owned(&layout, &configured, "").is_err());
    }
}
