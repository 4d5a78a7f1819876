//! A gateway that serves the pairs registered at run time (`gateway.follow`): it follows the
//! control stream's `GatewayPair` records (those `delay-proxy` appends when a client declares
//! an `x-delayed-message` exchange, and those of every `gateway --declare-only`) and starts
//! consuming each new pair's ingress and due queues without a restart, and stops serving a pair
//! whose `GatewayPairEnded` record follows (`delay-proxy` appends it when a client deletes the
//! exchange). Each pair found this way gets a worker (a connection) of its own; the configured
//! pairs share one, as without following. Nothing is kept but the names of the pairs served: a
//! gateway started later reads the same records.

use std::collections::{HashMap, HashSet};
use std::future::Future;

use lapin::Connection;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::{Gateway, Pair};
use crate::broker;
use crate::connection::{Backoff, Connector};
use crate::control;
use crate::error::Result;
use crate::layout::Layout;
use crate::settings::{PairConfig, TrustSettings};
use crate::trust::Trust;

/// How long a follow of the control stream must have lasted for the next one to start without
/// backing off: one that ends at once (a topology not declared yet) would otherwise be retried
/// and logged several times a second.
pub const FOLLOWED_LONG: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the control stream of `layout` from its first record and gives every record to
/// `each`, following what is appended, until the stream or the connection ends (an error). A
/// gateway pair, its end or a batch marker counts only from a writer `trust` (with the
/// connection's own user) lets name one ([`crate::trust::Trust::may_compact`]: own user, admins, peers); others'
/// are skipped and counted.
pub async fn follow_records(
    conn: &Connection,
    layout: &Layout,
    trust: &TrustSettings,
    mut each: impl FnMut(control::Record),
) -> Result<()> {
    let trust = Trust::new(crate::connection::user_of(conn), trust);
    let log = control::log(layout);
    let mut reader = log.open_reader(conn, broker::long_string("first")).await?;
    let ended = loop {
        match reader.next().await {
            Some(Ok(read)) => match read.record {
                // a pair, its end or a marker: only from a trusted writer (an untrusted end
                // would stop the gateways serving a pair)
                Some(r) if r.is_named() && !trust.may_compact(read.by.as_deref()) => {
                    let by = read.by.as_deref().unwrap_or("no user_id");
                    let why = format!("{r:?} by '{by}', no admin or peer");
                    crate::stream_log::skipped(control::KIND, "untrusted", &why);
                }
                Some(record) => each(record),
                // garbage, or a record of a newer version: skipped (and counted) by the reader
                None => {}
            },
            Some(Err(e)) => break Err(e),
            None => break Err(log.missing()),
        }
    };
    reader.end("stopped following").await;
    ended
}

/// What a record says of a pair the gateway serves (its writer was checked by
/// [`follow_records`]).
#[derive(Debug)]
enum PairEvent {
    /// Registered: serve it.
    Found(Pair),
    /// Ended: stop serving the pair of this ingress.
    Ended(String),
}

fn pair_event(layout: &Layout, record: control::Record) -> Option<PairEvent> {
    let (ingress, target, ended) = match record {
        control::Record::GatewayPair {
            ingress, target, ..
        } => (ingress, target, false),
        control::Record::GatewayPairEnded {
            ingress, target, ..
        } => (ingress, target, true),
        _ => return None,
    };
    let cfg = PairConfig {
        ingress,
        target,
        writers: Vec::new(),
    };
    match Pair::new(layout, &cfg) {
        Ok(p) if ended => Some(PairEvent::Ended(p.ingress)),
        Ok(p) => Some(PairEvent::Found(p)),
        Err(e) => {
            tracing::warn!("ignoring a gateway pair record: {e}");
            None
        }
    }
}

/// Sends what every pair record of the control stream says to `found`, in the stream's order,
/// reconnecting with backoff, until `found` is closed.
async fn find_pairs(gateway: Gateway, found: mpsc::UnboundedSender<PairEvent>) {
    let mut backoff = Backoff::default();
    while !found.is_closed() {
        let r = match Connector::new(&gateway.settings) {
            Ok(c) => match c.connect("amqp-delay gateway follower").await {
                Ok(conn) => {
                    let followed = std::time::Instant::now();
                    // ready (`/readyz`) while it follows, before it serves any pair
                    let live = crate::metrics::Live::open();
                    let layout = &gateway.layout;
                    let trust = &gateway.settings.trust;
                    let writers = &gateway.writers;
                    let r = follow_records(&conn, layout, trust, |r| {
                        // at once, not when the pairs settle: a handler may wait for it
                        writers.note(&r);
                        if let Some(e) = pair_event(layout, r) {
                            let _ = found.send(e);
                        }
                    })
                    .await;
                    drop(live);
                    broker::close_connection(&conn, "bye").await;
                    // a follow that fails at once (the topology not declared yet) backs off
                    if followed.elapsed() >= FOLLOWED_LONG {
                        backoff.reset();
                    }
                    r
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            tracing::warn!(
                "following the control stream for new gateway pairs: {}",
                crate::error::chain(&e)
            );
        }
        tokio::time::sleep(backoff.next_pause()).await;
    }
}

/// How long the pair records must have been quiet before the pairs they name are started or
/// stopped: a gateway reading the stream from its start sees a pair registered and ended in
/// the same burst of records, and starts nothing for it.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

/// The pairs found at run time: those the records want served, and the workers serving them.
#[derive(Default)]
struct Followed {
    /// By ingress: the pairs whose latest record registers them.
    wanted: HashMap<String, Pair>,
    /// By ingress: the running workers, each with its number and stop signal.
    running: HashMap<String, (u64, watch::Sender<bool>)>,
    started: u64,
}

impl Followed {
    fn note(&mut self, event: PairEvent, configured: &HashSet<String>) {
        match event {
            PairEvent::Found(p) if !configured.contains(&p.ingress) => {
                self.wanted.insert(p.ingress.clone(), p);
            }
            PairEvent::Ended(i) if configured.contains(&i) => {
                tracing::warn!(ingress = %i, "a configured gateway pair was ended in the control stream; still serving it (remove it from the settings)");
            }
            PairEvent::Ended(i) => {
                self.wanted.remove(&i);
            }
            PairEvent::Found(_) => {}
        }
    }

    /// A pair this process registered itself: wanted, and returned with its worker's number
    /// and stop signal when no worker serves it yet (now counted running).
    fn announce(
        &mut self,
        pair: Pair,
        configured: &HashSet<String>,
    ) -> Option<(Pair, u64, watch::Receiver<bool>)> {
        if configured.contains(&pair.ingress) {
            return None;
        }
        let ingress = pair.ingress.clone();
        self.wanted.insert(ingress.clone(), pair.clone());
        if self.running.contains_key(&ingress) {
            return None;
        }
        self.started += 1;
        let (stop, stopped) = watch::channel(false);
        self.running.insert(ingress, (self.started, stop));
        Some((pair, self.started, stopped))
    }

    /// Stops the running workers whose pair is no longer wanted, and returns the wanted pairs
    /// that have none, each with its worker's number and stop signal (now counted running).
    fn reconcile(&mut self) -> Vec<(Pair, u64, watch::Receiver<bool>)> {
        self.running.retain(|ingress, (_, stop)| {
            let keep = self.wanted.contains_key(ingress);
            if !keep {
                tracing::info!(%ingress, "gateway pair ended in the control stream: no longer serving it");
                let _ = stop.send(true);
            }
            keep
        });
        let mut start = Vec::new();
        for (ingress, pair) in &self.wanted {
            if !self.running.contains_key(ingress) {
                self.started += 1;
                let (stop, stopped) = watch::channel(false);
                self.running.insert(ingress.clone(), (self.started, stop));
                start.push((pair.clone(), self.started, stopped));
            }
        }
        start
    }

    /// Worker `n` of `ingress` stopped: when it stopped on its own (an error, its queues
    /// gone), its pair is served again only when a record names it again (re-registered after
    /// a teardown, or read again after the follower reconnects).
    fn stopped(&mut self, ingress: &str, n: u64) -> bool {
        if self.running.get(ingress).is_some_and(|(m, _)| *m == n) {
            self.running.remove(ingress);
            self.wanted.remove(ingress);
            return false;
        }
        // stopped because its pair ended (or a newer worker serves it)
        true
    }
}

/// A finished worker: its number (0 for the configured pairs'), its pairs' ingresses, how it
/// ended.
type Done = (u64, Vec<String>, Result<()>);

/// Serves `gateway`'s configured pairs and every pair registered under its prefix (until its
/// end is recorded), until `shutdown` completes; then stops every worker (each drains as a
/// gateway does). A pair sent on `announced` (by the process that registered it) is served at
/// once, without waiting for its record to be read back and to settle. With `proxy_pairs_only`,
/// only the pairs of `delay-proxy`'s shape (ingress `<prefix>.gw.x.<target>`) are followed: the
/// configured pairs of other gateways are theirs.
pub(super) async fn serve(
    gateway: Gateway,
    mut announced: mpsc::UnboundedReceiver<Pair>,
    proxy_pairs_only: bool,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (stop_all, stopped_all) = watch::channel(false);
    let mut workers: JoinSet<Done> = JoinSet::new();
    let configured: HashSet<String> = gateway.pairs.iter().map(|p| p.ingress.clone()).collect();
    let start =
        |workers: &mut JoinSet<Done>, g: Gateway, n: u64, own: Option<watch::Receiver<bool>>| {
            let mut all = stopped_all.clone();
            let ingresses: Vec<String> = g.pairs.iter().map(|p| p.ingress.clone()).collect();
            workers.spawn(async move {
                let stop = async move {
                    let own = async move {
                        match own {
                            Some(mut s) => drop(s.wait_for(|s| *s).await),
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = all.wait_for(|s| *s) => {}
                        () = own => {}
                    }
                };
                (n, ingresses, g.worker().run(stop).await)
            });
        };
    if !gateway.pairs.is_empty() {
        start(
            &mut workers,
            gateway.with_pairs(gateway.pairs.clone()),
            0,
            None,
        );
    }
    let (found, mut events) = mpsc::unbounded_channel();
    let finder = tokio::spawn(find_pairs(gateway.with_pairs(Vec::new()), found));
    let mut followed = Followed::default();
    let settle = tokio::time::sleep(SETTLE);
    tokio::pin!(shutdown, settle);
    let mut unsettled = false;
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(pair) = announced.recv() => {
                if let Some((pair, n, stopped)) = followed.announce(pair, &configured) {
                    tracing::info!(ingress = %pair.ingress, target = %pair.target, "gateway pair registered here: serving it");
                    start(&mut workers, gateway.with_pairs(vec![pair]), n, Some(stopped));
                }
            }
            Some(event) = events.recv() => {
                if proxy_pairs_only
                    && let PairEvent::Found(p) = &event
                    && p.ingress != gateway.layout.proxy_ingress(&p.target)
                {
                    continue;
                }
                followed.note(event, &configured);
                unsettled = true;
                settle.as_mut().reset(tokio::time::Instant::now() + SETTLE);
            }
            () = &mut settle, if unsettled => {
                unsettled = false;
                for (pair, n, stopped) in followed.reconcile() {
                    tracing::info!(ingress = %pair.ingress, target = %pair.target, "gateway pair found in the control stream: serving it");
                    start(&mut workers, gateway.with_pairs(vec![pair]), n, Some(stopped));
                }
            }
            Some(done) = workers.join_next() => match done {
                Ok((n, ingresses, r)) => {
                    let pairs = ingresses.join(", ");
                    let ended = n > 0 && ingresses.iter().all(|i| followed.stopped(i, n));
                    match r {
                        Err(e) => tracing::error!(%pairs, "a gateway worker stopped: {}", crate::error::chain(&e)),
                        Ok(()) if ended => tracing::debug!(%pairs, "a gateway worker stopped: its pair ended"),
                        Ok(()) => tracing::warn!(%pairs, "a gateway worker stopped"),
                    }
                }
                Err(e) => tracing::error!("a gateway worker failed: {e}"),
            },
        }
    }
    finder.abort();
    let _ = stop_all.send(true);
    while workers.join_next().await.is_some() {}
    Ok(())
}

impl Gateway {
    /// The same gateway for `pairs`.
    fn with_pairs(&self, pairs: Vec<Pair>) -> Gateway {
        Gateway {
            settings: self.settings.clone(),
            layout: self.layout.clone(),
            pairs,
            writers: self.writers.clone(),
            asked_in: self.asked_in.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(i: &str) -> control::Record {
        control::Record::GatewayPair {
            ingress: i.into(),
            target: "t".into(),
            writers: vec![],
            vhost: None,
        }
    }

    fn ended(i: &str) -> control::Record {
        control::Record::GatewayPairEnded {
            ingress: i.into(),
            target: "t".into(),
            by: None,
            vhost: None,
        }
    }

    #[test]
    fn only_pair_records_with_valid_names_are_served() {
        let layout = crate::settings::Settings::default().layout().unwrap();
        let found = pair_event(&layout, pair("i"));
        assert!(matches!(found, Some(PairEvent::Found(p)) if p.target == "t"));
        let gone = pair_event(&layout, ended("i"));
        assert!(matches!(gone, Some(PairEvent::Ended(i)) if i == "i"));
        assert!(pair_event(&layout, pair("a..b")).is_none());
        let marker = control::Record::BatchMarker { queue: "q".into() };
        assert!(pair_event(&layout, marker).is_none());
    }

    #[test]
    fn a_pair_is_served_while_its_latest_record_registers_it() {
        let layout = crate::settings::Settings::default().layout().unwrap();
        let configured: HashSet<String> = ["c".to_string()].into();
        let mut f = Followed::default();
        let note = |f: &mut Followed, r| f.note(pair_event(&layout, r).unwrap(), &configured);
        // registered and ended in one burst: nothing starts
        note(&mut f, pair("a"));
        note(&mut f, ended("a"));
        note(&mut f, pair("c"));
        assert!(f.reconcile().is_empty(), "ended, or configured");
        note(&mut f, pair("b"));
        let started = f.reconcile();
        assert_eq!(started.len(), 1);
        let (_, n, stopped) = &started[0];
        assert!(f.reconcile().is_empty(), "already running");
        note(&mut f, ended("b"));
        assert!(f.reconcile().is_empty());
        assert!(*stopped.borrow(), "told to stop");
        assert!(f.stopped("b", *n), "it stopped because its pair ended");
        // registered again while its old worker stops: a new one starts
        note(&mut f, pair("b"));
        let again = f.reconcile();
        assert_eq!(again.len(), 1);
        // a worker that fails on its own is started again only by a new record
        assert!(!f.stopped("b", again[0].1));
        assert!(f.reconcile().is_empty());
        note(&mut f, pair("b"));
        assert_eq!(f.reconcile().len(), 1);
    }

    #[test]
    fn an_announced_pair_is_served_at_once_and_only_once() {
        let layout = crate::settings::Settings::default().layout().unwrap();
        let configured: HashSet<String> = ["c".to_string()].into();
        let of = |i: &str| match pair_event(&layout, pair(i)) {
            Some(PairEvent::Found(p)) => p,
            _ => unreachable!(),
        };
        let mut f = Followed::default();
        assert!(f.announce(of("c"), &configured).is_none(), "configured");
        let (_, n, _) = f.announce(of("a"), &configured).expect("started at once");
        assert!(
            f.announce(of("a"), &configured).is_none(),
            "already running"
        );
        // its record read back later starts nothing more
        f.note(pair_event(&layout, pair("a")).unwrap(), &configured);
        assert!(f.reconcile().is_empty());
        // its end, read back, stops it
        f.note(pair_event(&layout, ended("a")).unwrap(), &configured);
        assert!(f.reconcile().is_empty());
        assert!(f.stopped("a", n));
    }
}
