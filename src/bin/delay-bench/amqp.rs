//! AMQP plumbing shared by the runner and the clean-up: connecting with a timeout, declaring
//! and deleting the plain (non-delay) queues the scenarios publish to and consume from.

use std::time::Duration;

use lapin::Connection;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};

use amqp_delay::connection;
use amqp_delay::error::Context;
use amqp_delay::settings::QueueType;
use amqp_delay::{Error, Result};

/// How long a connection attempt may take: a broker can accept the TCP connection and never
/// answer (e.g. stuck while booting), and a benchmark should say so instead of hanging.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) async fn connect(url: &str, name: &str) -> Result<Connection> {
    match tokio::time::timeout(CONNECT_TIMEOUT, connection::connect(url, name)).await {
        Ok(r) => r,
        Err(_) => Err(Error::Connect {
            url: connection::redact_url(url),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the broker accepted the TCP connection but did not answer within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ),
            )
            .into(),
        }),
    }
}

pub(crate) async fn declare_plain_queue(
    conn: &Connection,
    name: &str,
    qt: QueueType,
) -> Result<()> {
    let ch = conn
        .create_channel()
        .await
        .context(|| "opening a channel".into())?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(qt.to_string())),
    );
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .context(|| format!("declaring queue '{name}'"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Deletes `name`, returning the messages it still held.
pub(crate) async fn delete_queue(conn: &Connection, name: &str) -> Result<u32> {
    let ch = conn
        .create_channel()
        .await
        .context(|| "opening a channel".into())?;
    let n = ch
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
        .context(|| format!("deleting queue '{name}'"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(n)
}
