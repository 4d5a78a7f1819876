//! A gateway that serves the pairs registered at run time (`gateway.follow`): it follows the
//! control stream's `GatewayPair` records (those `delay-proxy` appends when a client declares
//! an `x-delayed-message` exchange, and those of every `gateway --declare-only`) and starts
//! consuming each new pair's ingress and due queues without a restart. Each pair found this way
//! gets a worker (a connection) of its own; the configured pairs share one, as without
//! following. Nothing is kept but the names of the pairs served: a gateway started later reads
//! the same records.

use std::collections::HashSet;
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
/// gateway pair or batch marker counts only from a writer `trust` (with the connection's own
/// user) lets name one ([`crate::trust::Trust::may_compact`]: own user, admins, peers); others'
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
                Some(
                    r @ (control::Record::GatewayPair { .. } | control::Record::BatchMarker { .. }),
                ) if !trust.may_compact(read.by.as_deref()) => {
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

/// The pair a record registers, if the gateway serves it (its writer was checked by
/// [`follow_records`]).
fn pair_of(layout: &Layout, record: control::Record) -> Option<Pair> {
    let control::Record::GatewayPair { ingress, target } = record else {
        return None;
    };
    match Pair::new(layout, &PairConfig { ingress, target }) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!("ignoring a gateway pair record: {e}");
            None
        }
    }
}

/// Sends every pair record of the control stream to `found`, reconnecting with backoff, until
/// `found` is closed.
async fn find_pairs(gateway: Gateway, found: mpsc::UnboundedSender<Pair>) {
    let mut backoff = Backoff::default();
    while !found.is_closed() {
        let r = match Connector::new(&gateway.settings) {
            Ok(c) => match c.connect("amqp-delay gateway follower").await {
                Ok(conn) => {
                    let followed = std::time::Instant::now();
                    let layout = &gateway.layout;
                    let trust = &gateway.settings.trust;
                    let r = follow_records(&conn, layout, trust, |r| {
                        if let Some(p) = pair_of(layout, r) {
                            let _ = found.send(p);
                        }
                    })
                    .await;
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

/// Serves `gateway`'s configured pairs and every pair registered under its prefix, until
/// `shutdown` completes; then stops every worker (each drains as a gateway does).
pub(super) async fn serve(gateway: Gateway, shutdown: impl Future<Output = ()>) -> Result<()> {
    let (stop, stopped) = watch::channel(false);
    let mut workers = JoinSet::new();
    let mut served: HashSet<String> = gateway.pairs.iter().map(|p| p.ingress.clone()).collect();
    let start = |workers: &mut JoinSet<(Vec<String>, Result<()>)>, g: Gateway| {
        let mut stopped = stopped.clone();
        let ingresses: Vec<String> = g.pairs.iter().map(|p| p.ingress.clone()).collect();
        workers.spawn(async move {
            let r = g
                .worker()
                .run(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
            (ingresses, r)
        });
    };
    if !gateway.pairs.is_empty() {
        start(&mut workers, gateway.with_pairs(gateway.pairs.clone()));
    }
    let (found, mut new_pairs) = mpsc::unbounded_channel();
    let finder = tokio::spawn(find_pairs(gateway.with_pairs(Vec::new()), found));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(pair) = new_pairs.recv() => {
                if served.insert(pair.ingress.clone()) {
                    tracing::info!(ingress = %pair.ingress, target = %pair.target, "gateway pair found in the control stream: serving it");
                    start(&mut workers, gateway.with_pairs(vec![pair]));
                }
            }
            Some(done) = workers.join_next() => match done {
                // served again when a record names its pair again (re-registered after a
                // teardown, or read again after the follower reconnects)
                Ok((ingresses, r)) => {
                    let pairs = ingresses.join(", ");
                    match r {
                        Err(e) => tracing::error!(%pairs, "a gateway worker stopped: {}", crate::error::chain(&e)),
                        Ok(()) => tracing::warn!(%pairs, "a gateway worker stopped"),
                    }
                    for i in &ingresses {
                        served.remove(i);
                    }
                }
                Err(e) => tracing::error!("a gateway worker failed: {e}"),
            },
        }
    }
    finder.abort();
    let _ = stop.send(true);
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pair_records_with_valid_names_are_served() {
        let layout = crate::settings::Settings::default().layout().unwrap();
        let pair = |i: &str| control::Record::GatewayPair {
            ingress: i.into(),
            target: "t".into(),
        };
        assert_eq!(pair_of(&layout, pair("i")).unwrap().target, "t");
        assert!(pair_of(&layout, pair("a..b")).is_none());
        assert!(pair_of(&layout, control::Record::BatchMarker { queue: "q".into() }).is_none());
    }
}
