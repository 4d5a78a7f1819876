//! Connecting to the broker, and URL redaction so credentials never reach a log line.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::error::{Error, Result};

/// `amqp://user:secret@host/vhost` → `amqp://user:***@host/vhost`. Unparseable input is
/// replaced entirely, since it might still contain a password.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparseable AMQP URL>".into(),
    }
}

/// How long connecting (TCP, TLS and the AMQP handshake) may take before it is given up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Opens a connection named `name` (shown in the broker's connection list), giving up after
/// [`CONNECT_TIMEOUT`].
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(url, props)).await {
        Ok(r) => r.map_err(|source| Error::Connect {
            url: redact_url(url),
            source,
        }),
        Err(_) => Err(Error::Timeout {
            context: format!("connecting to {}", redact_url(url)),
            timeout_ms: CONNECT_TIMEOUT.as_millis() as u64,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://h/v"), "amqp://h/v");
        assert_eq!(redact_url("not a url :: secret"), "<unparseable AMQP URL>");
    }
}
