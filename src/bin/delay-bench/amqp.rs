//! AMQP plumbing shared by the runner and the clean-up, on the library's broker primitives:
//! connecting (bounded by the library's connect timeout), declaring and deleting the plain
//! (non-delay) queues the scenarios publish to and consume from.

use lapin::Connection;
use lapin::options::QueueDeleteOptions;

use amqp_delay::broker::{self, ResultExt};
use amqp_delay::{QueueType, Result, connection};

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
