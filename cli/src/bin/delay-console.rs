//! `delay-console`: a web page to see and steer what is waiting. Thin: the work is
//! in `amqp_delay_cli::console`.

use amqp_delay_cli::cli::{self, EXIT_USAGE, GlobalArgs};
use amqp_delay_cli::console::{self, Config};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "delay-console",
    version,
    about = "A web console to see and steer delayed messages: what waits per destination, search, cancel, reschedule, purge, parked messages",
    after_help = "Log in with a user of the broker (HTTP Basic): each login is checked by opening an AMQP connection as that user, and every action runs as that user. Admins (trust.admins) see everything, other users what they scheduled. The pages read the pending index (--index)."
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    /// Address the console listens on
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8088")]
    listen: String,
    /// The console's pending index file (SQLite; made when missing), kept up to date from the journal
    #[arg(long, value_name = "PATH")]
    index: Option<std::path::PathBuf>,
    /// SQLite's page caches in all, in MiB (most of the console's memory)
    #[arg(long, value_name = "MIB", default_value_t = 96, value_parser = clap::value_parser!(u64).range(4..=4096))]
    cache_mb: u64,
    /// PEM certificate chain: the console then serves HTTPS only
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() {
    let args = Cli::parse();
    cli::init_logging_as(args.global.log_format);
    let settings = match args.global.settings() {
        Ok(s) => s,
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match amqp_delay_cli::tls::acceptor(cert, key) {
            Ok(a) => Some(a),
            Err(e) => cli::fail(&e, EXIT_USAGE),
        },
        _ => None,
    };
    let Some(index) = args.index else {
        let e = amqp_delay::Error::Invalid(
            "give the console's index file with --index PATH (made when missing)".into(),
        );
        cli::fail(&e, EXIT_USAGE);
    };
    let config = Config {
        listen: args.listen,
        index,
        cache_bytes: args.cache_mb << 20,
        tls,
    };
    if let Err(e) = cli::start_metrics(&settings).await {
        cli::fail_with(&e);
    }
    let served = console::run(settings, config, cli::shutdown_signal()).await;
    if let Err(e) = served {
        cli::fail_with(&e);
    }
}
