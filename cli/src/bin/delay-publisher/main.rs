//! `delay-publisher`: declare the topology, schedule messages (one, or a JSONL bulk file), show
//! tier depths, plan a delay, remove the topology, run the `x-delay` gateway. Thin: the work is
//! in the library; each subcommand is one function here or in `send` / `topology`.

mod args;
mod import;
mod parked;
mod pending;
mod recurring;
mod send;
mod topology;
mod transfer;

use amqp_delay::Error;
use amqp_delay::gateway::Gateway;
use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::control;
use amqp_delay::settings::{GatewaySettings, Settings};
use amqp_delay_cli::cli::{self, EXIT_USAGE};
use args::{Cli, Cmd, GatewayArgs};
use clap::Parser;

#[tokio::main]
async fn main() {
    let args = Cli::parse();
    cli::init_logging_as(args.global.log_format);
    let settings = match args.global.settings() {
        Ok(s) => s,
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    let code = match run(args.cmd, settings).await {
        Ok(code) => code,
        Err(e) => cli::fail_with(&e),
    };
    std::process::exit(code);
}

/// Runs one subcommand; its exit code.
async fn run(cmd: Cmd, settings: Settings) -> amqp_delay::Result<i32> {
    match cmd {
        Cmd::Plan { delay } => plan(&settings, delay.as_millis()),
        Cmd::Declare { queues, worker } => topology::declare(&settings, &queues, worker).await,
        Cmd::Stats {
            json,
            non_empty,
            summary,
        } => topology::stats(&settings, json, non_empty, summary).await,
        Cmd::Teardown { force, queue } => topology::teardown(&settings, &queue, force).await,
        Cmd::Gateway(a) => gateway(settings, a).await,
        Cmd::Cancel(a) => send::cancel(&settings, a).await,
        Cmd::Send(a) => send::send(&settings, a).await,
        Cmd::ImportPlugin(a) => import::import_plugin(&settings, a).await,
        Cmd::Parked(c) => parked::run(&settings, c).await,
        Cmd::Pending(c) => pending::run(settings, c).await,
        Cmd::Recurring(c) => recurring::run(&settings, c).await,
        Cmd::Transfer(a) => transfer::transfer(&settings, a).await,
    }
}

/// How many times [`connected`] runs its work when a stream read keeps losing the connection
/// on records over `frame_max`: each such record costs two or three connections before the
/// process reads past it, so this gets past five of them in one stream.
const STREAM_TRIES: u32 = 16;

/// Connects as `name`, runs `f` on the connection and closes it, whatever `f` returned. When
/// `f` failed reading one of our streams on a record over `frame_max` (which whoever may
/// append to the stream can write), it runs again on a new connection, up to
/// [`STREAM_TRIES`] times: the process learns the record and reads past it.
async fn connected<T>(
    settings: &Settings,
    name: &str,
    f: impl AsyncFn(&lapin::Connection) -> amqp_delay::Result<T>,
) -> amqp_delay::Result<T> {
    let connector = Connector::new(settings)?;
    let mut tries = 1;
    loop {
        let conn = connector.connect(name).await?;
        let r = f(&conn).await;
        amqp_delay::ops::broker::close_connection(&conn, "bye").await;
        match r {
            Err(e) if control::is_record_over_frame_max(&e) && tries < STREAM_TRIES => {
                tracing::warn!(
                    tries,
                    "{}; reading again on a new connection",
                    amqp_delay::error_chain(&e)
                );
                tries += 1;
            }
            r => return r,
        }
    }
}

/// `plan`: the route a delay takes, as JSON.
fn plan(settings: &Settings, delay_ms: u64) -> amqp_delay::Result<i32> {
    let layout = topology::layout(settings)?;
    let r = amqp_delay::plan(&layout, &settings.precision, delay_ms)?;
    amqp_delay_cli::outln!(
        "{}",
        serde_json::json!({
            "delay_ms": r.delay_ms,
            "total_ms": r.total_ms,
            "lateness_ms": r.lateness_ms(),
            "hops": r.hops(),
            "route": r.describe(),
            "exchange": r.exchange(&layout),
            "routing_key": r.routing_key(&layout, "<queue>"),
        })
    );
    Ok(0)
}

/// `gateway`: declares the pairs (`--declare-only`) or runs the gateway until a signal.
async fn gateway(mut settings: Settings, a: GatewayArgs) -> amqp_delay::Result<i32> {
    if !a.ingress.is_empty() || !a.target.is_empty() {
        // the flags name the pairs; `gateway.hold` and `gateway.max_held` still come from the
        // configuration
        settings.gateway.pairs = GatewaySettings::from_flags(&a.ingress, &a.target)
            .map_err(Error::Invalid)?
            .pairs;
    }
    settings.gateway.follow |= a.follow_pairs;
    let gateway = Gateway::new(settings.clone())?;
    if !a.declare_only {
        cli::start_metrics(&settings).await?;
        gateway.run(cli::shutdown_signal()).await?;
        return Ok(0);
    }
    connected(&settings, "amqp-delay gateway declare", async |conn| {
        gateway.declare(conn).await
    })
    .await?;
    for p in gateway.pairs() {
        amqp_delay_cli::outln!(
            "declared gateway pair '{}' -> '{}' under prefix '{}'",
            p.ingress,
            p.target,
            settings.prefix
        );
    }
    Ok(0)
}
