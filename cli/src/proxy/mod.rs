//! `delay-proxy`: an AMQP 0-9-1 proxy in front of a stock broker, so that applications written
//! for the delayed-message-exchange plugin switch by changing only their URL. Each client
//! connection gets an upstream connection of its own, under the client's own credentials
//! (SASL passes through, never logged: the proxy keeps only the user of a PLAIN or AMQPLAIN
//! login); frames pass as sent except, for a client in the virtual host of the proxy's own URL:
//! * `exchange.declare` of type `x-delayed-message` goes to the broker as a declare of its
//!   `x-delayed-type` (so the broker checks it under the client's permissions); only when the
//!   broker answers that declare (not an earlier request's answer: [`replies`]) does the proxy
//!   register the exchange's gateway pair (ingress `<prefix>.gw.x.<exchange>` → the exchange)
//!   on its own connection, its record naming the client's user as a writer and the virtual
//!   host, then the client gets its declare-ok; `exchange.delete` of such an exchange ends the
//!   pair the same way, at the answer to that delete;
//! * `basic.publish` to a delayed exchange with a positive `x-delay` goes to the pair's ingress
//!   (a `delay-publisher gateway --follow-pairs` delays it and publishes it to the exchange with
//!   its routing key), carrying the client's user as `user_id` when it set none; no, zero or
//!   negative `x-delay` goes straight to the exchange;
//! * `basic.return` naming an ingress names the application's exchange again.
//!
//! In any other virtual host the frames pass as they came (the broker refuses
//! `x-delayed-message` there). Towards every client, the broker's `connection.tune` offers at
//! most `--max-frame` bytes a frame and 2047 channels, and the client's `tune-ok` is held to
//! that; before the broker's `connection.open-ok` a frame is at most the handshake's size and
//! only channel 0 is allowed; a publish is held for its content header only on a channel the
//! client opened. Connections over `--max-connections` in all or
//! `--max-connections-per-address` from one address are refused at once.
//!
//! Publishes are neither added nor dropped, so confirms stay one for one. The pairs are in the
//! control stream, which every proxy follows: nothing lives only in one proxy's memory.

pub mod conn;
pub mod frames;
pub mod login;
pub mod priority;
pub mod registry;
pub mod replies;
pub mod rewrite;

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::Settings;
use amqp_delay::{Error, Result};
use tokio::net::TcpListener;

pub use conn::Limits;
pub use conn::{DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_FRAME, DEFAULT_MAX_PER_ADDRESS};
pub use registry::Registry;

/// A settings error (`why` says what to change).
pub fn config(why: impl Into<String>) -> Error {
    Error::from(amqp_delay::settings::SettingsError::Invalid(why.into()))
}

/// A broker node clients are sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `host:port`.
    pub addr: String,
    /// The host its certificate must name, for an `amqps://` URL.
    pub tls_host: Option<String>,
}

/// The broker nodes a proxy connects its clients to, in the order of the settings' URLs (a
/// client goes to the first that answers). `amqps://` ones are reached with TLS, verified.
pub fn upstreams_of(urls: &str) -> Result<Vec<Upstream>> {
    let list = amqp_delay::ops::connection::split_urls(urls);
    if list.is_empty() {
        return Err(config("the broker URL is empty"));
    }
    list.iter().map(|u| upstream_of(u)).collect()
}

fn upstream_of(url: &str) -> Result<Upstream> {
    let redacted = amqp_delay::ops::connection::redact_url(url);
    let u = url::Url::parse(url)
        .map_err(|e| config(format!("broker URL '{redacted}' is invalid: {e}")))?;
    let (tls, port) = match u.scheme() {
        "amqp" => (false, 5672),
        "amqps" => (true, 5671),
        other => {
            return Err(config(format!(
                "broker URL '{redacted}': scheme '{other}' is neither amqp:// nor amqps://"
            )));
        }
    };
    let host = u
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| config(format!("broker URL '{redacted}' names no host")))?;
    // an IPv6 literal comes bracketed, as `connect` wants it
    Ok(Upstream {
        addr: format!("{host}:{}", u.port().unwrap_or(port)),
        tls_host: tls.then(|| host.trim_matches(['[', ']']).to_string()),
    })
}

/// A running proxy's parts: where it sends clients, what it knows of the pairs, its limits.
pub struct Proxy {
    upstreams: Arc<Vec<Upstream>>,
    tls: Option<crate::tls::TlsAcceptor>,
    upstream_tls: Option<crate::tls::TlsConnector>,
    registry: Arc<Registry>,
    limits: Limits,
    open: Arc<Mutex<Open>>,
    closing: tokio::sync::watch::Sender<bool>,
    /// The follower of the control stream (ended with the proxy).
    follower: tokio::task::JoinHandle<()>,
    /// The check that every pair is served (ended with the proxy).
    watcher: tokio::task::JoinHandle<()>,
    /// The proxy's own gateway ([`Proxy::start_gateway`]), stopped after the clients.
    gateway: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    stop_gateway: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    /// The proxy of `settings` (its URL names the broker and the proxy's own user): reads the
    /// pairs already registered under the prefix, and keeps following them.
    /// With `tls`, clients must speak TLS.
    pub async fn start(
        settings: Settings,
        limits: Limits,
        tls: Option<crate::tls::TlsAcceptor>,
    ) -> Result<Proxy> {
        let upstreams = Arc::new(upstreams_of(&settings.url)?);
        let upstream_tls = if upstreams.iter().any(|u| u.tls_host.is_some()) {
            Some(crate::tls::connector(&settings.tls)?)
        } else {
            None
        };
        let registry = Arc::new(Registry::new(settings)?);
        registry.refresh(true).await?;
        let follower = tokio::spawn(registry.clone().follow());
        let watcher = tokio::spawn(registry.clone().watch_served());
        Ok(Proxy {
            upstreams,
            tls,
            upstream_tls,
            registry,
            limits,
            open: Arc::new(Mutex::new(Open::default())),
            closing: tokio::sync::watch::Sender::new(false),
            follower,
            watcher,
            gateway: std::sync::Mutex::new(None),
            stop_gateway: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Starts the proxy's own gateway, as the proxy's user: it serves every pair registered
    /// under the prefix (those this proxy registers at once, before their declare-ok reaches
    /// the client; others' once their record is read) and delivers what waits in them, until
    /// the proxy stops. Nothing else need run for an application's delayed messages to arrive.
    pub fn start_gateway(&self, settings: &Settings) -> Result<()> {
        let mut settings = settings.clone();
        settings.gateway.follow = true;
        settings.gateway.pairs.clear();
        let gateway = amqp_delay::Gateway::new(settings)?;
        let (announce, announced) = tokio::sync::mpsc::unbounded_channel();
        self.registry.serve_with(announce);
        let mut stop = self.stop_gateway.subscribe();
        // the gateway's futures are not `Send` for every lifetime (as in the registry): it is
        // driven on a blocking thread of the runtime, its tasks on the runtime
        let runtime = tokio::runtime::Handle::current();
        let task = tokio::task::spawn_blocking(move || {
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            if let Err(e) = runtime.block_on(gateway.run_announced(announced, stopped)) {
                tracing::error!(
                    "the proxy's gateway stopped: {}; delayed messages wait in their ingress queues until a gateway serves them",
                    amqp_delay::error_chain(&e)
                );
            }
        });
        *self.gateway.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        Ok(())
    }

    /// Stops the proxy's own gateway (it finishes what it holds, as a gateway does) and waits
    /// for it.
    async fn stop_gateway(&self) {
        self.stop_gateway.send_replace(true);
        let task = self
            .gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Whether clients must speak TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Asks every open client to close and waits until none is open, at most
    /// [`Limits::drain`].
    async fn drain(&self) {
        let open = self.connections();
        tracing::info!(open, drain = ?self.limits.drain, "delay-proxy stops listening and asks its clients to close");
        self.closing.send_replace(true);
        let end = tokio::time::Instant::now() + self.limits.drain;
        while self.connections() > 0 && tokio::time::Instant::now() < end {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        match self.connections() {
            0 => tracing::info!("every client closed"),
            n => tracing::warn!(
                open = n,
                "clients still open after the drain: their connections are cut"
            ),
        }
    }

    /// Client connections open now.
    pub fn connections(&self) -> usize {
        self.open
            .lock()
            .map(|o| o.total)
            .unwrap_or_else(|e| e.into_inner().total)
    }

    /// Accepts clients on `listener` until `shutdown` completes; then drains: stops
    /// listening, asks every client to close (`connection.close` 320 CONNECTION_FORCED, as a
    /// broker that shuts down does: clients reconnect, to another proxy), and waits for them
    /// at most [`Limits::drain`]. A client's unconfirmed publishes are its to send again, and
    /// its unacked deliveries go back to their queues: nothing confirmed is lost.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        tokio::pin!(shutdown);
        let mut refusals = Refusals::default();
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => {
                    drop(listener);
                    self.drain().await;
                    self.stop_gateway().await;
                    self.follower.abort();
                    self.watcher.abort();
                    return Ok(());
                }
                a = listener.accept() => a,
            };
            let (client, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // out of file descriptors, or a client gone before accept: go on
                    tracing::warn!("accepting a client: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let slot = match admit(&self.open, peer.ip(), &self.limits) {
                Ok(slot) => slot,
                Err(why) => {
                    // closed at once, before anything is read or a broker connection made
                    drop(client);
                    refusals.note(peer.ip(), &why);
                    continue;
                }
            };
            let _ = client.set_nodelay(true);
            let upstream = conn::Upstreams {
                nodes: self.upstreams.clone(),
                tls: self.upstream_tls.clone(),
            };
            let (registry, limits, tls, closing) = (
                self.registry.clone(),
                self.limits,
                self.tls.clone(),
                self.closing.subscribe(),
            );
            tokio::spawn(async move {
                tracing::debug!(%peer, "client connected");
                match one_client(client, tls, &upstream, registry, limits, closing).await {
                    Ok(()) => tracing::debug!(%peer, "client disconnected"),
                    Err(e) => tracing::info!(%peer, "client connection ended: {e}"),
                }
                drop(slot);
            });
        }
    }
}

/// Client connections open now: in all, and by source address.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// A client connection counted open until it is dropped.
struct Slot {
    open: Arc<Mutex<Open>>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_address.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by_address.remove(&self.ip);
            }
        }
        amqp_delay::metrics::global().proxy_connections.dec();
    }
}

/// A connection from `ip`, counted open; or why it is refused: the cap of all connections or of
/// those from one address is reached.
fn admit(open: &Arc<Mutex<Open>>, ip: IpAddr, limits: &Limits) -> Result<Slot, String> {
    let mut o = open.lock().unwrap_or_else(|e| e.into_inner());
    if o.total >= limits.max_connections {
        return Err(format!(
            "{} client connections are open, the most --max-connections allows",
            o.total
        ));
    }
    let from = o.by_address.get(&ip).copied().unwrap_or(0);
    if from >= limits.max_per_address {
        return Err(format!(
            "{from} client connections are open from this address, the most --max-connections-per-address allows"
        ));
    }
    o.total += 1;
    *o.by_address.entry(ip).or_default() += 1;
    amqp_delay::metrics::global().proxy_connections.inc();
    Ok(Slot {
        open: open.clone(),
        ip,
    })
}

/// Refused connections, counted, and logged at most once a second (a flood of them must not
/// flood the log).
#[derive(Default)]
struct Refusals {
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl Refusals {
    fn note(&mut self, ip: IpAddr, why: &str) {
        amqp_delay::metrics::global()
            .proxy_connections_refused
            .inc();
        self.unlogged += 1;
        if self
            .last_logged
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        let refused = std::mem::take(&mut self.unlogged);
        self.last_logged = Some(Instant::now());
        tracing::warn!(%ip, refused, "client connection refused: {why}");
    }
}

/// One client, after its TLS handshake when the proxy has a certificate.
async fn one_client(
    client: tokio::net::TcpStream,
    tls: Option<crate::tls::TlsAcceptor>,
    upstreams: &conn::Upstreams,
    registry: Arc<Registry>,
    limits: Limits,
    closing: tokio::sync::watch::Receiver<bool>,
) -> std::result::Result<(), String> {
    let Some(acceptor) = tls else {
        return conn::serve(client, upstreams, registry, limits, closing).await;
    };
    match tokio::time::timeout(limits.handshake, crate::tls::accept(&acceptor, client)).await {
        Ok(Ok(s)) => conn::serve(s, upstreams, registry, limits, closing).await,
        Ok(Err(e)) => Err(format!("TLS handshake: {e}")),
        Err(_) => Err(format!(
            "TLS handshake: not finished within {:?}",
            limits.handshake
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstreams_are_the_urls_nodes_tls_ones_named_for_verification() {
        let up = |a: &str, t: Option<&str>| Upstream {
            addr: a.into(),
            tls_host: t.map(String::from),
        };
        assert_eq!(
            upstreams_of("amqp://u:p@h:5673/%2f").unwrap(),
            [up("h:5673", None)]
        );
        assert_eq!(
            upstreams_of("amqp://h, amqps://u:secret@g/v").unwrap(),
            [up("h:5672", None), up("g:5671", Some("g"))]
        );
        let e = upstreams_of("amqp://h,http://u:secret@h/v")
            .unwrap_err()
            .to_string();
        assert!(e.contains("neither"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        assert!(upstreams_of("").is_err());
    }
}
