//! The proxy's own side of the broker: its connection (the settings' URL, user and virtual
//! host, never a client's), the gateway pairs it registers for the delayed exchanges clients
//! declare — with the gateway's own declare, as `delay-publisher gateway --declare-only` does:
//! ingress exchange, queues, binding, the control stream's `GatewayPair` record naming the
//! client's user as a writer and its virtual host — and the pairs it knows with their writers,
//! read from the control stream, so that nothing lives only in one proxy's memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_delay::gateway::{Gateway, Pair};
use amqp_delay::ops::connection::{Backoff, Connector};
use amqp_delay::ops::control;
use amqp_delay::settings::PairConfig;
use amqp_delay::{Error, Result};
use amqp_delay::{Layout, Settings};
use lapin::Connection;
use tokio::sync::Mutex;

use super::rewrite::Pairs;
use crate::logline::escape_controls;

/// A refresh from the control stream asked for by a client's passive declare runs at most this
/// often (each read appends a barrier).
const REFRESH_EVERY: Duration = Duration::from_secs(2);

/// How long a client's delayed declare waits, at most, for its new pair to be served.
const SERVE_WAIT: Duration = Duration::from_secs(3);

/// How often the proxy checks that every delayed exchange it knows is served.
const UNSERVED_CHECK: Duration = Duration::from_secs(5);

/// How often an exchange that stays unserved is named in the log again.
const UNSERVED_RELOG: Duration = Duration::from_secs(60);

/// The proxy's registrations and what it knows of every pair under its prefix.
pub struct Registry {
    settings: Settings,
    layout: Layout,
    /// The virtual host of the settings' URL: the only one the proxy acts in.
    vhost: String,
    pairs: Pairs,
    conn: Mutex<Option<Connection>>,
    refreshed: Mutex<Option<Instant>>,
    /// The proxy's own gateway, told of each pair registered here so that it serves it before
    /// the client publishes ([`Registry::serve_with`]).
    announce: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<Pair>>,
}

impl Registry {
    /// The registry of `settings`' prefix (no I/O).
    pub fn new(settings: Settings) -> Result<Registry> {
        let layout = settings
            .layout()
            .map_err(amqp_delay::settings::SettingsError::from)?;
        let vhost = vhost_of(&settings.url)?;
        Ok(Registry {
            settings,
            layout,
            vhost,
            pairs: Pairs::default(),
            conn: Mutex::new(None),
            refreshed: Mutex::new(None),
            announce: std::sync::OnceLock::new(),
        })
    }

    /// Tells `gateway` of every pair registered from now on (once; later calls are ignored).
    pub fn serve_with(&self, gateway: tokio::sync::mpsc::UnboundedSender<Pair>) {
        let _ = self.announce.set(gateway);
    }

    /// The virtual host the proxy acts in: its URL's.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// The delayed exchanges known.
    pub fn pairs(&self) -> &Pairs {
        &self.pairs
    }

    /// The longest delay the tiers take.
    pub fn max_delay_ms(&self) -> u64 {
        self.layout.max_delay_ms()
    }

    /// The pair a delayed exchange `exchange` gets, or why it cannot have one (a name too long
    /// for its queues, a character a destination may not have).
    pub fn pair_for(&self, exchange: &str) -> std::result::Result<Pair, String> {
        if exchange.is_empty() || exchange.starts_with("amq.") {
            return Err(format!(
                "exchange '{exchange}' is the broker's; it cannot be a delayed exchange"
            ));
        }
        let cfg = PairConfig {
            ingress: self.layout.proxy_ingress(exchange),
            target: exchange.to_string(),
            writers: Vec::new(),
        };
        Pair::new(&self.layout, &cfg)
    }

    /// The proxy's connection, made again when it was lost (held while the guard lives).
    async fn connected(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Connection>>> {
        let mut guard = self.conn.lock().await;
        if !guard.as_ref().is_some_and(|c| c.status().connected()) {
            let conn = Connector::new(&self.settings)?
                .connect("amqp-delay proxy")
                .await?;
            *guard = Some(conn);
        }
        Ok(guard)
    }

    /// Makes sure delayed exchange `exchange` has its pair and `user` is one of its writers:
    /// called only after the broker accepted `user`'s own declare of `exchange` in virtual host
    /// `vhost` (the proxy's). The first time, the pair is declared; for a writer not known yet,
    /// the declare runs again (it declares only what is missing) and records the writer; else
    /// only its ingress is checked, and declared again when it is gone.
    pub async fn ensure(self: &Arc<Self>, exchange: &str, user: &str, vhost: &str) -> Result<()> {
        // The gateway's declare is not `Send` for every lifetime (a closure over the tiers), so
        // it cannot run in a connection's task: it runs on a blocking thread of the runtime.
        let me = self.clone();
        let asked = [exchange, user, vhost].map(String::from);
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let [exchange, user, vhost] = &asked;
            runtime.block_on(me.register(exchange, user, vhost))
        })
        .await
        .map_err(|e| super::config(format!("registering a delayed exchange: {e}")))?
    }

    async fn register(&self, exchange: &str, user: &str, vhost: &str) -> Result<()> {
        let pair = self.pair_for(exchange).map_err(Error::Invalid)?;
        // known with this writer, and its ingress still there (a teardown may have removed it
        // since): one passive check rather than the whole declare and a record for every
        // client's declare
        let known = self.pairs.ingress_of(exchange).is_some();
        if known && self.pairs.has_writer(exchange, user) {
            let guard = self.connected().await?;
            if let Some(conn) = guard.as_ref()
                && amqp_delay::ops::broker::exchange_exists(conn, &pair.ingress).await?
                && amqp_delay::ops::broker::queue_state(conn, &pair.ingress_queue)
                    .await?
                    .is_some()
            {
                drop(guard);
                self.announce(&pair).await;
                return Ok(());
            }
        }
        let writers = vec![user.to_string()];
        let mut settings = self.settings.clone();
        settings.gateway.pairs = vec![PairConfig {
            ingress: pair.ingress.clone(),
            target: pair.target.clone(),
            writers: writers.clone(),
        }];
        let gateway = Gateway::new(settings)?.asked_in(Some(vhost.to_string()));
        let guard = self.connected().await?;
        let conn = guard
            .as_ref()
            .ok_or_else(|| super::config("no broker connection"))?;
        gateway.declare(conn).await?;
        drop(guard);
        self.announce(&pair).await;
        self.pairs.insert(&pair.target, &pair.ingress, &writers);
        let (x, user) = (escape_controls(&pair.target), escape_controls(user));
        if known {
            tracing::info!(exchange = %x, ingress = %pair.ingress, writer = %user, "delayed exchange declared by a writer not known yet: recorded");
        } else {
            amqp_delay::metrics::global().proxy_pairs_registered.inc();
            tracing::info!(exchange = %x, ingress = %pair.ingress, writer = %user, "delayed exchange registered");
        }
        Ok(())
    }

    /// Tells the proxy's own gateway to serve `pair` now (a no-op when it serves it already),
    /// and waits until a gateway consumes its ingress queue, at most [`SERVE_WAIT`]: the
    /// client's declare-ok follows, so that what it publishes next is taken at once.
    async fn announce(&self, pair: &Pair) {
        let Some(gateway) = self.announce.get() else {
            return;
        };
        let _ = gateway.send(pair.clone());
        let end = Instant::now() + SERVE_WAIT;
        while Instant::now() < end {
            let Ok(state) = self.ingress_state(pair).await else {
                return;
            };
            if state.is_some_and(|q| q.consumers > 0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::warn!(ingress = %pair.ingress, "the pair is not served yet {SERVE_WAIT:?} after its registration; what is published meanwhile waits in its ingress queue, its delay counted from the publish");
    }

    /// `pair`'s ingress queue as a passive declare on the proxy's connection sees it (`None`:
    /// missing); `Err` when the broker cannot be asked.
    async fn ingress_state(
        &self,
        pair: &Pair,
    ) -> Result<Option<amqp_delay::ops::broker::QueueState>> {
        let guard = self.connected().await?;
        let conn = guard
            .as_ref()
            .ok_or_else(|| super::config("no broker connection"))?;
        amqp_delay::ops::broker::queue_state(conn, &pair.ingress_queue).await
    }

    /// Ends delayed exchange `exchange`'s pair: called only after the broker deleted `exchange`
    /// for a client (under the client's own permissions) of user `by` (`None`: its SASL
    /// mechanism does not name one) in virtual host `vhost` (the proxy's). Deletes the ingress exchange and the
    /// ingress and due queues (the messages still waiting in them are dropped, as the plugin
    /// drops those of a deleted delayed exchange), and the parking queues when they are empty
    /// (a teardown removes the others); then records the end, so that gateways stop serving the
    /// pair and other proxies forget it.
    pub async fn end(
        self: &Arc<Self>,
        exchange: &str,
        by: Option<&str>,
        vhost: &str,
    ) -> Result<()> {
        let pair = self.pair_for(exchange).map_err(Error::Invalid)?;
        let guard = self.connected().await?;
        let conn = guard
            .as_ref()
            .ok_or_else(|| super::config("no broker connection"))?;
        amqp_delay::gateway::end_pair(conn, &pair).await?;
        let record = control::Record::GatewayPairEnded {
            ingress: pair.ingress.clone(),
            target: pair.target.clone(),
            by: by.map(String::from),
            vhost: Some(vhost.to_string()),
        };
        control::append(conn, &self.layout, &record).await?;
        drop(guard);
        self.pairs.remove(exchange);
        amqp_delay::metrics::global().proxy_pairs_ended.inc();
        let (x, by) = (
            escape_controls(&pair.target),
            escape_controls(by.unwrap_or("?")),
        );
        tracing::info!(exchange = %x, ingress = %pair.ingress, %by, "delayed exchange deleted: its pair ended");
        Ok(())
    }

    /// Reads the pairs registered under the prefix (by any proxy) from the control stream, at
    /// most every [`REFRESH_EVERY`] unless `always`.
    pub async fn refresh(&self, always: bool) -> Result<()> {
        let mut last = self.refreshed.lock().await;
        if !always && last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
            return Ok(());
        }
        let guard = self.connected().await?;
        let conn = guard
            .as_ref()
            .ok_or_else(|| super::config("no broker connection"))?;
        let records = control::read_all(conn, &self.layout, &self.settings.trust).await?;
        drop(guard);
        *last = Some(Instant::now());
        drop(last);
        for r in &records {
            self.learn(r);
        }
        Ok(())
    }

    /// Remembers a record's pair when it is a proxy's (its ingress named after its target), with
    /// its writers, and forgets one whose end is recorded: the one place a filter on the
    /// record's writer goes.
    fn learn(&self, r: &control::Record) {
        match r {
            control::Record::GatewayPair {
                ingress,
                target,
                writers,
                ..
            } if *ingress == self.layout.proxy_ingress(target)
                && self.pairs.insert(target, ingress, writers) =>
            {
                tracing::debug!(exchange = %escape_controls(target), ingress = %escape_controls(ingress), "delayed exchange known from the control stream");
            }
            control::Record::GatewayPairEnded {
                ingress, target, ..
            } if *ingress == self.layout.proxy_ingress(target) && self.pairs.remove(target) => {
                tracing::debug!(exchange = %escape_controls(target), ingress = %escape_controls(ingress), "delayed exchange ended in the control stream");
            }
            _ => {}
        }
    }

    /// Every [`UNSERVED_CHECK`], the delayed exchanges whose ingress queue holds messages that
    /// no gateway consumes: counted in `amqp_delay_proxy_pairs_unserved` and named in the log
    /// (once when found, again every [`UNSERVED_RELOG`] while it lasts), for ever.
    pub async fn watch_served(self: Arc<Self>) {
        let mut logged: std::collections::HashMap<String, Instant> = Default::default();
        loop {
            tokio::time::sleep(UNSERVED_CHECK).await;
            let mut unserved = 0;
            for (exchange, ingress) in self.pairs.all() {
                let Ok(pair) = self.pair_for(&exchange) else {
                    continue;
                };
                let q = match self.ingress_state(&pair).await {
                    Ok(Some(q)) => q,
                    Ok(None) => {
                        self.clone().restore(&exchange, &pair).await;
                        continue;
                    }
                    Err(_) => break,
                };
                if q.ready == 0 || q.consumers > 0 {
                    logged.remove(&exchange);
                    continue;
                }
                unserved += 1;
                if logged
                    .get(&exchange)
                    .is_none_or(|t| t.elapsed() >= UNSERVED_RELOG)
                {
                    logged.insert(exchange.clone(), Instant::now());
                    tracing::warn!(exchange = %escape_controls(&exchange), %ingress, waiting = q.ready, "no gateway serves this delayed exchange: its messages wait, late, in its ingress queue until one does (this proxy's own, unless --no-gateway; a `delay-publisher gateway --follow-pairs` needs this proxy's user in trust.peers)");
                }
            }
            amqp_delay::metrics::global()
                .proxy_pairs_unserved
                .set(unserved);
        }
    }

    /// Declares the ingress queue of known delayed exchange `exchange` again when it alone is
    /// gone (deleted by hand): meanwhile its delayed publishes are returned to their clients
    /// ([`super::rewrite::server_frame`]), never confirmed and dropped. When the pair's ingress
    /// exchange is gone too (a teardown), nothing is declared: a running proxy does not bring
    /// back what an operator removed, and a client's delayed publish meets the broker's
    /// `NOT_FOUND` until its next declare registers the pair again. A pair ended through the
    /// proxy is no longer known.
    async fn restore(self: Arc<Self>, exchange: &str, pair: &Pair) {
        let Some(writer) = self.pairs.a_writer(exchange) else {
            return;
        };
        let exists = match self.connected().await {
            Ok(guard) => match guard.as_ref() {
                Some(conn) => amqp_delay::ops::broker::exchange_exists(conn, &pair.ingress).await,
                None => return,
            },
            Err(_) => return,
        };
        if !matches!(exists, Ok(true)) {
            return;
        }
        let x = escape_controls(exchange).into_owned();
        tracing::error!(exchange = %x, queue = %pair.ingress_queue, "the ingress queue of a delayed exchange is gone: declaring it again (delayed publishes to it were returned to their clients meanwhile)");
        let vhost = self.vhost.clone();
        match self.ensure(exchange, &writer, &vhost).await {
            Ok(()) => {
                amqp_delay::metrics::global().proxy_ingresses_restored.inc();
                tracing::info!(exchange = %x, queue = %pair.ingress_queue, "ingress queue declared again");
            }
            Err(e) => {
                tracing::error!(exchange = %x, error = %amqp_delay::error_chain(&e), "could not declare the ingress queue again; delayed publishes to it are returned to their clients")
            }
        }
    }

    /// Keeps the pairs known current from the control stream, for ever (reconnecting with
    /// backoff): pairs other proxies register become known here too.
    pub async fn follow(self: Arc<Self>) {
        let mut backoff = Backoff::default();
        loop {
            let conn = match Connector::new(&self.settings) {
                Ok(c) => c.connect("amqp-delay proxy follower").await,
                Err(e) => Err(e),
            };
            let r = match conn {
                Ok(conn) => {
                    let followed = std::time::Instant::now();
                    // ready (`/readyz`) while the pairs other proxies register reach us
                    let live = amqp_delay::metrics::Live::open();
                    let me = self.clone();
                    let trust = &self.settings.trust;
                    let r = amqp_delay::gateway::follow::follow_records(
                        &conn,
                        &self.layout,
                        trust,
                        |r| me.learn(&r),
                    )
                    .await;
                    drop(live);
                    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
                    // a follow that fails at once (the topology not declared yet) backs off,
                    // instead of warning several times a second
                    if followed.elapsed() >= amqp_delay::gateway::follow::FOLLOWED_LONG {
                        backoff.reset();
                    }
                    r
                }
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::warn!(
                    "following the control stream: {}",
                    amqp_delay::error_chain(&e)
                );
            }
            tokio::time::sleep(backoff.next_pause()).await;
        }
    }
}

/// The virtual host of the first of `urls` (the one the proxy's own connection opens, as lapin
/// reads it); every URL of the list must name the same.
fn vhost_of(urls: &str) -> Result<String> {
    let mut found: Option<String> = None;
    for url in amqp_delay::ops::connection::split_urls(urls) {
        let redacted = amqp_delay::ops::connection::redact_url(&url);
        let uri: lapin::uri::AMQPUri = url
            .parse()
            .map_err(|e| super::config(format!("broker URL '{redacted}' is invalid: {e}")))?;
        match &found {
            Some(v) if *v != uri.vhost => {
                return Err(super::config(format!(
                    "broker URL '{redacted}' names virtual host '{}', the first names '{v}': delay-proxy acts in one virtual host, give every URL the same",
                    uri.vhost
                )));
            }
            Some(_) => {}
            None => found = Some(uri.vhost),
        }
    }
    found.ok_or_else(|| super::config("the broker URL is empty"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxys_virtual_host_is_its_urls_as_lapin_reads_it() {
        assert_eq!(vhost_of("amqp://u:p@h:5672/%2f").unwrap(), "/");
        assert_eq!(vhost_of("amqp://h").unwrap(), "/");
        assert_eq!(vhost_of("amqp://h/apps,amqps://g/apps").unwrap(), "apps");
        let e = vhost_of("amqp://h/a,amqp://u:secret@g/b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("same") && !e.contains("secret"), "{e}");
    }
}
