//! AMQP plumbing shared by the runner and the clean-up, on the library's broker primitives:
//! connecting (bounded by the library's connect timeout), declaring and deleting the plain
//! (non-delay) queues the scenarios publish to and consume from, the gateway scenario's target
//! exchange, and removing a whole topology.

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

use amqp_delay::broker::{self, ResultExt};
use amqp_delay::{Layout, QueueType, Result, connection};

pub(crate) async fn connect(url: &str, name: &str) -> Result<Connection> {
    connection::connect(url, name).await
}

pub(crate) async fn declare_plain_queue(
    conn: &Connection,
    name: &str,
    qt: QueueType,
) -> Result<()> {
    let ch = broker::open(conn).await?;
    broker::declare_queue(&ch, name, broker::queue_type_args(qt)).await?;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// Deletes `name`, returning the messages it still held.
pub(crate) async fn delete_queue(conn: &Connection, name: &str) -> Result<u32> {
    let ch = broker::open(conn).await?;
    let n = ch
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
        .context(|| format!("deleting queue '{name}'"))?;
    broker::close(&ch, "ok").await;
    Ok(n)
}

/// Declares a durable direct exchange `name`.
pub(crate) async fn declare_direct_exchange(conn: &Connection, name: &str) -> Result<()> {
    let ch = broker::open(conn).await?;
    broker::declare_exchange(&ch, name, ExchangeKind::Direct, FieldTable::default()).await?;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// Binds `queue` to `exchange` with `key`.
pub(crate) async fn bind(conn: &Connection, queue: &str, exchange: &str, key: &str) -> Result<()> {
    let ch = broker::open(conn).await?;
    broker::bind_queue(&ch, queue, exchange, key).await?;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// Deletes exchange `name` (missing is fine).
pub(crate) async fn delete_exchange(conn: &Connection, name: &str) -> Result<()> {
    let ch = broker::open(conn).await?;
    ch.exchange_delete(name.into(), ExchangeDeleteOptions::default())
        .await
        .context(|| format!("deleting exchange '{name}'"))?;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// Removes everything under `layout`'s prefix as `teardown --force` does: the tiers, and the
/// gateway pairs and batch markers recorded in its control stream.
pub(crate) async fn delete_topology(conn: &Connection, layout: &Layout) -> Result<()> {
    amqp_delay_cli::admin::teardown(conn, layout, None, true)
        .await
        .map(|_| ())
}
