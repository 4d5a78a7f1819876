//! Connecting to the broker: one URL or several (the nodes of a cluster, comma-separated, tried
//! in turn from a random start so clients spread over the nodes), each attempt bounded by a
//! timeout; and the reconnect backoff (capped, with jitter, cut short once a node answers).

use std::time::Duration;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Connection, ConnectionProperties};
use rand::Rng;

use crate::error::{Error, Result};
use crate::settings::{Settings, TlsSettings};

/// How long one connection attempt (TCP, TLS and the AMQP handshake) may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub use crate::endpoints::{redact_url, split_urls, validate_urls};

/// How to reach the broker: its URLs and the TLS material for `amqps://` ones, read once.
#[derive(Clone)]
pub struct Connector {
    urls: String,
    tls: OwnedTLSConfig,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("urls", &redact_url(&self.urls))
            .field("client_certificate", &self.tls.identity.is_some())
            .field("extra_ca", &self.tls.cert_chain.is_some())
            .finish()
    }
}

impl Connector {
    /// The broker of `settings`: its URLs and `tls` files (read now; a missing or unreadable
    /// file is an error naming it).
    pub fn new(settings: &Settings) -> Result<Connector> {
        Connector::with_tls(&settings.url, &settings.tls)
    }

    /// `urls` with the TLS material of `tls`.
    pub fn with_tls(urls: &str, tls: &TlsSettings) -> Result<Connector> {
        tls.validate().map_err(Error::config)?;
        let read = |what: &str, p: &std::path::Path| {
            std::fs::read(p)
                .map_err(|e| Error::config(format!("cannot read {what} {}: {e}", p.display())))
        };
        let cert_chain = match &tls.ca_file {
            Some(p) => Some(String::from_utf8(read("tls.ca_file", p)?).map_err(|_| {
                Error::config(format!("tls.ca_file {} is not PEM text", p.display()))
            })?),
            None => None,
        };
        let identity = match (&tls.client_cert, &tls.client_key) {
            (Some(c), Some(k)) => Some(OwnedIdentity::PKCS8 {
                pem: read("tls.client_cert", c)?,
                key: read("tls.client_key", k)?,
            }),
            _ => None,
        };
        Ok(Connector {
            urls: urls.to_string(),
            tls: OwnedTLSConfig {
                identity,
                cert_chain,
            },
        })
    }

    /// `urls` with the system's CA certificates only.
    pub fn plain(urls: &str) -> Connector {
        Connector {
            urls: urls.to_string(),
            tls: OwnedTLSConfig::default(),
        }
    }

    /// The URLs (with credentials: print them redacted, never as they are).
    pub fn urls(&self) -> &str {
        &self.urls
    }

    /// Opens a connection named `name` (shown in the broker's connection list) to the first
    /// node that answers, starting from a random one; each attempt gives up after
    /// 10 s. The error names the last node tried.
    pub async fn connect(&self, name: &str) -> Result<Connection> {
        let list = split_urls(&self.urls);
        if list.is_empty() {
            return Err(Error::config("the broker URL is empty"));
        }
        let start = if list.len() > 1 {
            rand::rng().random_range(0..list.len())
        } else {
            0
        };
        let mut last = None;
        for i in 0..list.len() {
            let url = &list[(start + i) % list.len()];
            match self.connect_one(url, name).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    if list.len() > 1 {
                        tracing::info!("{}; trying the next node", crate::error::chain(&e));
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one URL"))
    }

    async fn connect_one(&self, url: &str, name: &str) -> Result<Connection> {
        // before lapin sizes its buffers from it
        let target = crate::endpoints::connect_url(url).map_err(Error::config)?;
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let runtime = lapin::runtime::default_runtime().map_err(|source| Error::Connect {
            url: redact_url(url),
            source,
        })?;
        let attempt = Connection::connect_with_config(&target, props, self.tls.clone(), runtime);
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(conn)) => {
                // a broker configured with a smaller frame_max wins the negotiation
                let frame_max = conn.configuration().frame_max();
                if frame_max < crate::endpoints::MIN_FRAME_MAX {
                    crate::broker::close_connection(&conn, "frame_max too small").await;
                    return Err(Error::config(format!(
                        "{} allows frames of {frame_max} bytes only; amqp-delay needs at least {} \
                         (a message's headers, up to {} bytes plus what the tier hops add, must \
                         fit one frame): raise the broker's frame_max",
                        redact_url(url),
                        crate::endpoints::MIN_FRAME_MAX,
                        crate::message::MAX_HEADER_BYTES
                    )));
                }
                Ok(conn)
            }
            Ok(Err(source)) => Err(Error::Connect {
                url: redact_url(url),
                source,
            }),
            Err(_) => Err(Error::Timeout {
                context: format!("connecting to {}", redact_url(url)),
                timeout_ms: CONNECT_TIMEOUT.as_millis() as u64,
            }),
        }
    }
}

/// The user `conn` logged in as (from its URL; `None` when it names none): what the broker
/// accepts as the `user_id` of its publishes ([`crate::trust`]).
pub(crate) fn user_of(conn: &Connection) -> Option<String> {
    Some(conn.status().username()).filter(|u| !u.is_empty())
}

/// Connects to `urls` with the system's CA certificates (see [`Connector`] for TLS files).
pub async fn connect(urls: &str, name: &str) -> Result<Connection> {
    Connector::plain(urls).connect(name).await
}

/// Pauses between reconnect attempts: from 250 ms doubling to 5 s, each with ±50% jitter (so a
/// fleet of workers does not reconnect in lockstep).
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            next: Backoff::FIRST,
        }
    }
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(250);
    /// The longest pause.
    pub(crate) const CAP: Duration = Duration::from_secs(5);

    /// Back to the first pause (after a successful connection).
    pub fn reset(&mut self) {
        self.next = Backoff::FIRST;
    }

    /// The next pause, jittered.
    pub fn next_pause(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(Backoff::CAP);
        let f: f64 = rand::rng().random_range(0.5..1.5);
        base.mul_f64(f)
    }

    /// Waits `pause`, returning early as soon as one of the nodes of `urls` accepts a TCP
    /// connection again (polled every 250 ms), so a restarted broker is used at once.
    pub async fn wait(pause: Duration, urls: &str) {
        let addrs: Vec<(String, u16)> = split_urls(urls)
            .iter()
            .filter_map(|u| {
                let p = url::Url::parse(u).ok()?;
                let port = p
                    .port()
                    .unwrap_or(if p.scheme() == "amqps" { 5671 } else { 5672 });
                Some((p.host_str()?.to_string(), port))
            })
            .collect();
        let end = tokio::time::Instant::now() + pause;
        // the node that refused a moment ago answering now is the signal to try again
        let mut answered_before = any_answers(&addrs).await;
        while tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(250).min(pause)).await;
            let answers = any_answers(&addrs).await;
            if answers && !answered_before {
                return;
            }
            answered_before = answers;
        }
    }
}

async fn any_answers(addrs: &[(String, u16)]) -> bool {
    for (host, port) in addrs {
        let probe = tokio::net::TcpStream::connect((host.as_str(), *port));
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(200), probe).await {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let mut b = Backoff::default();
        let pauses: Vec<Duration> = (0..10).map(|_| b.next_pause()).collect();
        assert!(pauses.iter().all(|p| *p <= Backoff::CAP.mul_f64(1.5)));
        assert!(pauses[0] >= Duration::from_millis(125));
        b.reset();
        assert!(b.next_pause() <= Duration::from_millis(375));
    }
}
