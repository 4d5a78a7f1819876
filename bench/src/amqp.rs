//! AMQP plumbing shared by the runner and the clean-up, on the library's broker primitives:
//! connecting (bounded by the library's connect timeout), declaring and deleting the plain
//! (non-delay) queues the scenarios publish to and consume from, the gateway scenario's target
//! exchange, and removing a whole topology.

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

use amqp_delay::ops::broker::{self, ResultExt};
use amqp_delay::ops::connection;
use amqp_delay::{Layout, QueueType, Result};

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

/// Declares `name` as an application of the delayed-message-exchange plugin does
/// (`x-delayed-message`, `x-delayed-type: direct`), through `conn`: a connection through a
/// `delay-proxy`, which declares it as a direct exchange and registers its gateway pair.
pub(crate) async fn declare_delayed_exchange(conn: &Connection, name: &str) -> Result<()> {
    let ch = broker::open(conn).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        lapin::types::AMQPValue::LongString("direct".into()),
    );
    let kind = ExchangeKind::Custom("x-delayed-message".into());
    broker::declare_exchange(&ch, name, kind, args).await?;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// A `delay-proxy` in this process for `settings`' prefix, on a thread and a single-threaded
/// runtime of its own at the binary's default niceness (as the `delay-proxy` binary runs, so
/// that it does not share the benchmark's runtime), listening on a free local port until the sender is dropped or sent
/// to; returns the URL clients use (`settings`' first, with the proxy's address).
pub(crate) async fn start_proxy(
    settings: &amqp_delay::Settings,
) -> Result<(String, tokio::sync::oneshot::Sender<()>)> {
    use amqp_delay_cli::proxy::{Limits, Proxy, config};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| config(format!("listening for the in-process delay-proxy: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| config(format!("the in-process delay-proxy's address: {e}")))?
        .port();
    let url = crate::proxy_process::client_url(&settings.url, port)?;
    // every client is local: no cap per address
    let limits = Limits {
        drain: std::time::Duration::from_secs(1),
        max_per_address: usize::MAX,
        ..Limits::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, started) = tokio::sync::oneshot::channel::<Result<()>>();
    let settings = settings.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| config(format!("the in-process delay-proxy's runtime: {e}")))?;
    std::thread::spawn(move || {
        // as the delay-proxy binary runs by default (only this thread and those it starts)
        if let Err(e) = amqp_delay_cli::proxy::priority::lower_to(
            amqp_delay_cli::proxy::priority::DEFAULT_NICENESS,
        ) {
            tracing::warn!("the in-process delay-proxy runs at the bench's priority: {e}");
        }
        runtime.block_on(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready.send(Err(config(format!("the proxy's listener: {e}"))));
                    return;
                }
            };
            let proxy = match Proxy::start(settings, limits, None).await {
                Ok(p) => p,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            let _ = proxy
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await;
        });
    });
    started
        .await
        .map_err(|_| config("the in-process delay-proxy's thread ended"))??;
    Ok((url, stop))
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
/// gateway pairs and batch markers recorded in its control stream. `own` names the exchanges
/// this run declared itself (the gateway stages' ingresses, under the run's prefix but outside
/// a scenario's own, as `bench-x.gateway_long.sat.in` is outside `bench-x-gwl.`): teardown may
/// delete those too, instead of warning that it leaves them as not ours.
pub(crate) async fn delete_topology(
    conn: &Connection,
    layout: &Layout,
    own: &[String],
) -> Result<()> {
    let trust = amqp_delay::settings::TrustSettings::default();
    amqp_delay_cli::admin::teardown_with(conn, layout, None, true, own, &trust)
        .await
        .map(|_| ())
}
