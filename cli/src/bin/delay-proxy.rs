//! `delay-proxy`: an AMQP proxy in front of a stock RabbitMQ, so that applications written for
//! the delayed-message-exchange plugin switch by changing only their URL (see
//! docs/MIGRATING.md, "Change only the URL"). Thin: the work is in `amqp_delay_cli::proxy`.

use amqp_delay::time::DurationMs;
use amqp_delay_cli::cli::{self, EXIT_USAGE, GlobalArgs};
use amqp_delay_cli::proxy::{
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_FRAME, DEFAULT_MAX_PER_ADDRESS, Limits, Proxy, priority,
};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "delay-proxy",
    version,
    about = "An AMQP 0-9-1 proxy that gives x-delayed-message exchanges to applications of the delayed-message-exchange plugin on a stock broker",
    after_help = "Clients connect to --listen with their own credentials; the broker is the first node of --url that answers (amqp://, or amqps:// verified with the [tls] settings), whose user is the proxy's own: it registers the gateway pairs and, as a gateway, delivers what waits in them (unless --no-gateway)."
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    /// Address clients connect to
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:5673")]
    listen: String,
    /// A client that has not finished the AMQP handshake after this is disconnected
    #[arg(long, default_value = "10s")]
    handshake_timeout: DurationMs,
    /// A connection without a byte in either direction for this long is closed (heartbeats count)
    #[arg(long, default_value = "10m")]
    idle_timeout: DurationMs,
    /// On SIGTERM or Ctrl-C: stop listening, send every client connection.close 320 (as a broker that shuts down does; clients reconnect), and wait this long for them to close
    #[arg(long, default_value = "10s")]
    drain_timeout: DurationMs,
    /// The largest frame_max offered to clients, in bytes (the broker's when lower): each connection buffers at most about four frames
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_FRAME, value_parser = clap::value_parser!(u32).range(4096..=16_777_216))]
    max_frame: u32,
    /// Client connections open at once, in all: more are refused at once (and logged)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_connections: usize,
    /// Client connections open at once from one source address: more are refused at once (and logged)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PER_ADDRESS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_connections_per_address: usize,
    /// PEM certificate chain of the proxy: clients must then connect with TLS (amqps://)
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Deliver nothing: leave the pairs to `delay-publisher gateway --follow-pairs` processes, run as this proxy's user or with it in their trust.peers
    #[arg(long)]
    no_gateway: bool,
    /// CPU niceness to run at, 0 (unchanged) to 19: beside a broker on the same cores the proxy then yields to it and moves more frames per system call (about half its CPU); a niceness already higher is kept
    #[arg(long, env = "AMQP_DELAY_PROXY_NICENESS", default_value_t = priority::DEFAULT_NICENESS, value_parser = clap::value_parser!(i32).range(0..=priority::MAX_NICENESS as i64))]
    niceness: i32,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Cli::parse();
    cli::init_logging_as(args.global.log_format);
    // before the threads lapin starts, which inherit it
    match priority::lower_to(args.niceness) {
        Ok(n) => tracing::debug!(niceness = n, "CPU priority"),
        Err(e) => tracing::warn!("running at the inherited CPU priority: {e}"),
    }
    let settings = match args.global.settings() {
        Ok(s) => s,
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    let limits = Limits {
        handshake: args.handshake_timeout.as_duration(),
        idle: args.idle_timeout.as_duration(),
        drain: args.drain_timeout.as_duration(),
        max_frame: args.max_frame,
        max_connections: args.max_connections,
        max_per_address: args.max_connections_per_address,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match amqp_delay_cli::tls::acceptor(cert, key) {
            Ok(a) => Some(a),
            Err(e) => cli::fail(&e, EXIT_USAGE),
        },
        _ => None,
    };
    if let Err(e) = run(settings, &args.listen, limits, tls, !args.no_gateway).await {
        cli::fail_with(&e);
    }
}

async fn run(
    settings: amqp_delay::Settings,
    listen: &str,
    limits: Limits,
    tls: Option<amqp_delay_cli::tls::TlsAcceptor>,
    gateway: bool,
) -> amqp_delay::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| amqp_delay_cli::proxy::config(format!("listening on {listen}: {e}")))?;
    cli::start_metrics(&settings).await?;
    let proxy = Proxy::start(settings.clone(), limits, tls).await?;
    if gateway {
        proxy.start_gateway(&settings)?;
    }
    tracing::info!(%listen, tls = proxy.tls(), "delay-proxy listening");
    proxy.serve(listener, cli::shutdown_signal()).await
}
