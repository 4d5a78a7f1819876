//! The broker's management HTTP API, read-only and optional: what AMQP cannot tell. A passive
//! `queue.declare` counts only *ready* messages, so messages the broker's dead-letter worker
//! holds while it cannot forward them (after a restart or failover) are invisible over AMQP;
//! the management API counts ready + unacknowledged and names each queue's leader node.
//!
//! The address comes from `management_url` in the settings, or is derived from the AMQP URL
//! (`http://<host>:15672`, `https://<host>:15671` for `amqps`) with the same credentials. When
//! nothing answers, callers fall back to AMQP and say that unacknowledged messages are not
//! counted.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;

use crate::endpoints::redact_url;
use crate::error::{Error, Result};
use crate::settings::TlsSettings;

/// How long one management request may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A management API endpoint.
#[derive(Clone)]
pub struct Management {
    base: url::Url,
    user: String,
    password: String,
    vhost: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("base", &redact_url(self.base.as_str()))
            .field("vhost", &self.vhost)
            .finish()
    }
}

/// What the management API knows of one queue.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QueueInfo {
    /// Queue name.
    pub name: String,
    /// Everything it holds: ready + unacknowledged + (a quorum queue) dead-lettered and
    /// waiting for the broker's dead-letter worker.
    #[serde(default)]
    pub messages: u64,
    /// Ready for delivery.
    #[serde(default)]
    pub messages_ready: u64,
    /// Delivered (to a consumer, or to the broker's dead-letter worker) and not yet settled.
    #[serde(default)]
    pub messages_unacknowledged: u64,
    /// Node of the quorum queue's leader.
    #[serde(default)]
    pub leader: Option<String>,
    /// A classic queue's home node (and, on some versions, a quorum queue's leader).
    #[serde(default)]
    pub node: Option<String>,
    /// Nodes holding a replica.
    #[serde(default)]
    pub members: Option<Vec<String>>,
}

impl QueueInfo {
    /// Messages a quorum queue dead-lettered that its dead-letter worker has not yet moved on:
    /// counted in `messages` but neither ready nor unacknowledged (RabbitMQ's `messages_dlx`).
    pub fn dead_lettered(&self) -> u64 {
        self.messages
            .saturating_sub(self.messages_ready)
            .saturating_sub(self.messages_unacknowledged)
    }

    /// Where the queue is led from.
    pub fn leader_node(&self) -> Option<&str> {
        self.leader.as_deref().or(self.node.as_deref())
    }
}

impl Management {
    /// The endpoint for `amqp_url` (its host and credentials), or `explicit` when given.
    /// `None` when no address can be derived.
    pub fn new(amqp_url: &str, explicit: Option<&str>) -> Option<Management> {
        let amqp = url::Url::parse(amqp_url.split(',').next()?.trim()).ok()?;
        let base = match explicit {
            Some(u) => url::Url::parse(u).ok()?,
            None => {
                let (scheme, port) = if amqp.scheme() == "amqps" {
                    ("https", 15671)
                } else {
                    ("http", 15672)
                };
                url::Url::parse(&format!("{scheme}://{}:{port}/", amqp.host_str()?)).ok()?
            }
        };
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("x={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        let user = if base.username().is_empty() {
            decode(amqp.username())
        } else {
            decode(base.username())
        };
        let password = base
            .password()
            .or(amqp.password())
            .map(decode)
            .unwrap_or_default();
        let vhost = match amqp.path().trim_start_matches('/') {
            "" => "/".to_string(),
            v => decode(v),
        };
        let agent = agent(ureq::tls::TlsConfig::default());
        let (user, password) = if user.is_empty() {
            ("guest".to_string(), "guest".to_string())
        } else {
            (user, password)
        };
        Some(Management {
            base,
            user,
            password,
            vhost,
            agent,
        })
    }

    /// Uses `tls` for an `https` endpoint: `ca_file` becomes the root the server's certificate
    /// is verified against (instead of the public web roots), `client_cert` + `client_key`
    /// authenticate. Verification is never turned off. Plain `http` endpoints are unchanged.
    pub fn with_tls(mut self, tls: &TlsSettings) -> Result<Management> {
        if self.base.scheme() != "https" || (tls.ca_file.is_none() && tls.client_cert.is_none()) {
            return Ok(self);
        }
        let mut config = ureq::tls::TlsConfig::builder();
        if let Some(path) = &tls.ca_file {
            let roots = pem_certificates("tls.ca_file", path)?;
            config = config.root_certs(ureq::tls::RootCerts::new_with_certs(&roots));
        }
        if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
            let chain = pem_certificates("tls.client_cert", cert)?;
            let key = pem_items("tls.client_key", key)?
                .into_iter()
                .find_map(|item| match item {
                    ureq::tls::PemItem::PrivateKey(k) => Some(k),
                    _ => None,
                })
                .ok_or_else(|| {
                    Error::config(format!(
                        "tls.client_key {} holds no private key",
                        key.display()
                    ))
                })?;
            config = config.client_cert(Some(ureq::tls::ClientCert::new_with_certs(&chain, key)));
        }
        self.agent = agent(config.build());
        Ok(self)
    }

    /// Every queue of the vhost whose name starts with `prefix`.
    pub async fn queues(&self, prefix: &str) -> Result<HashMap<String, QueueInfo>> {
        let mut url = self.base.clone();
        url.set_username("").ok();
        url.set_password(None).ok();
        let vhost: String = url::form_urlencoded::byte_serialize(self.vhost.as_bytes()).collect();
        let url = format!(
            "{}api/queues/{}?columns=name,messages,messages_ready,messages_unacknowledged,leader,node,members",
            ensure_slash(url.as_str()),
            vhost.replace('+', "%20")
        );
        let this = self.clone();
        // credentials were taken out of `url` above (they go in a header); the query's commas
        // must not be read as a list of URLs, so no redact_url here
        let shown = url.clone();
        let body = tokio::task::spawn_blocking(move || {
            let auth = basic_auth(&this.user, &this.password);
            let mut resp = this
                .agent
                .get(&url)
                .header("authorization", &auth)
                .call()
                .map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            if status != 200 {
                return Err(format!("answered HTTP {status}"));
            }
            resp.body_mut()
                .with_config()
                .limit(256 << 20)
                .read_to_string()
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| management(&shown, format!("the request failed: {e}")))?
        .map_err(|e| management(&shown, e))?;
        let all: Vec<QueueInfo> = serde_json::from_str(&body)
            .map_err(|e| management(&shown, format!("unexpected answer: {e}")))?;
        Ok(all
            .into_iter()
            .filter(|q| q.name.starts_with(prefix))
            .map(|q| (q.name.clone(), q))
            .collect())
    }
}

fn ensure_slash(s: &str) -> String {
    if s.ends_with('/') {
        s.to_string()
    } else {
        format!("{s}/")
    }
}

fn basic_auth(user: &str, password: &str) -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

/// The HTTP client: bounded requests, status codes handled by the caller.
fn agent(tls: ureq::tls::TlsConfig) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        .http_status_as_error(false)
        .tls_config(tls)
        .build()
        .into()
}

/// The certificates of the PEM file `path` (setting `what`); at least one.
fn pem_certificates(
    what: &str,
    path: &std::path::Path,
) -> Result<Vec<ureq::tls::Certificate<'static>>> {
    let certs: Vec<_> = pem_items(what, path)?
        .into_iter()
        .filter_map(|item| match item {
            ureq::tls::PemItem::Certificate(c) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(Error::config(format!(
            "{what} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// The PEM items of the file `path` (setting `what`).
fn pem_items(what: &str, path: &std::path::Path) -> Result<Vec<ureq::tls::PemItem<'static>>> {
    let bytes = std::fs::read(path)
        .map_err(|e| Error::config(format!("reading {what} {}: {e}", path.display())))?;
    ureq::tls::parse_pem(&bytes)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::config(format!("{what} {} is not valid PEM: {e}", path.display())))
}

/// A failed request to the management API at `url`.
fn management(url: &str, reason: impl Into<String>) -> Error {
    Error::Management {
        url: url.to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_comes_from_the_amqp_url() {
        let m = Management::new("amqp://alice:s%40cret@broker.example:5672/prod", None).unwrap();
        assert_eq!(m.base.as_str(), "http://broker.example:15672/");
        assert_eq!(
            (m.user.as_str(), m.password.as_str(), m.vhost.as_str()),
            ("alice", "s@cret", "prod")
        );
        let m = Management::new("amqps://h/%2f", None).unwrap();
        assert_eq!(m.base.as_str(), "https://h:15671/");
        assert_eq!(m.vhost, "/");
        let m = Management::new(
            "amqp://u:p@a:5701,amqp://u:p@b:5702",
            Some("http://b:15702"),
        )
        .unwrap();
        assert_eq!(m.base.as_str(), "http://b:15702/");
        assert!(!format!("{m:?}").contains(":p@"));
    }

    #[test]
    fn queue_info_reads_both_leader_fields() {
        let q: Vec<QueueInfo> = serde_json::from_str(
            r#"[{"name":"a","messages":3,"messages_ready":1,"messages_unacknowledged":2,"leader":"n1@h","members":["n1@h","n2@h"]},
                {"name":"b","node":"n3@h"}]"#,
        )
        .unwrap();
        assert_eq!(q[0].messages_unacknowledged, 2);
        assert_eq!(q[1].leader_node(), Some("n3@h"));
    }
}
