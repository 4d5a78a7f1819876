//! Command-line pieces shared by the binaries: the global flags (`--url`, `--prefix`,
//! `--config`), turning them into [`Settings`], logging set-up, and exit codes.

use std::path::PathBuf;

use crate::settings::{Settings, SettingsError};

/// Exit code for a command that ran but had failures (e.g. some bulk lines failed).
pub const EXIT_FAILURES: i32 = 1;
/// Exit code for bad usage or configuration.
pub const EXIT_USAGE: i32 = 2;

/// Flags every binary takes.
#[derive(Debug, Clone, clap::Args)]
pub struct GlobalArgs {
    /// Broker URL (default `amqp://guest:guest@127.0.0.1:5672/%2f`)
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        hide_env_values = true,
        help = "Broker URL [default: amqp://guest:guest@127.0.0.1:5672/%2f]"
    )]
    pub url: Option<String>,
    /// Prefix of every exchange and queue amqp-delay creates (default `amqp-delay`)
    #[arg(
        long,
        env = "AMQP_DELAY_PREFIX",
        global = true,
        hide_env_values = true,
        help = "Prefix of every exchange and queue amqp-delay creates [default: amqp-delay]"
    )]
    pub prefix: Option<String>,
    /// TOML configuration file (see README, "Configuration"); AMQP_DELAY_* variables override it
    #[arg(long, short = 'c', global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl GlobalArgs {
    /// Defaults < config file < environment < these flags.
    pub fn settings(&self) -> Result<Settings, SettingsError> {
        let mut s = Settings::load(self.config.as_deref())?;
        if let Some(u) = &self.url {
            s.url = u.clone();
        }
        if let Some(p) = &self.prefix {
            s.prefix = p.clone();
        }
        s.validate()?;
        Ok(s)
    }
}

/// Logs to stderr; `RUST_LOG` overrides the default level (`info` for our crate).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,lapin::channel=off,amqp_delay=info")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Prints `error: ...` with the whole cause chain and exits with `code`.
pub fn fail(e: &dyn std::error::Error, code: i32) -> ! {
    eprintln!("error: {}", chain(e));
    std::process::exit(code)
}

pub use crate::error::chain;

/// Completes on SIGINT or SIGTERM (what the long-running commands stop on).
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested");
}
