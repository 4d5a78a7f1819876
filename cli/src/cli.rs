//! Command-line pieces shared by the binaries: the global flags (`--url`, `--prefix`,
//! `--config`), turning them into [`Settings`], logging set-up, and exit codes.

use std::path::PathBuf;

use amqp_delay::settings::{Settings, SettingsError};
use amqp_delay::{Error, ErrorKind};

/// Exit code for a command that ran but had failures (some bulk lines failed, the broker
/// refused or could not be reached, a stream read failed, a confirm was lost).
pub const EXIT_FAILURES: i32 = 1;
/// Exit code for bad usage or configuration, or a topology that must be declared (or fixed)
/// first: running the same command again fails the same way.
pub const EXIT_USAGE: i32 = 2;

/// The exit code of a command that ended with `e`, from its kind: [`EXIT_USAGE`] for the
/// request, the configuration or the topology ([`ErrorKind::Usage`], [`ErrorKind::Topology`]),
/// [`EXIT_FAILURES`] for everything else (refused, unavailable, a stream, a lost confirm).
pub fn exit_code(e: &Error) -> i32 {
    match e.kind() {
        ErrorKind::Usage | ErrorKind::Topology => EXIT_USAGE,
        _ => EXIT_FAILURES,
    }
}

/// Prints `e` with its cause chain (see [`fail`]) and exits with its [`exit_code`].
pub fn fail_with(e: &Error) -> ! {
    fail(e, exit_code(e))
}

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
    /// Serve /metrics, /healthz and /readyz on HOST:PORT (worker, gateway, relay) [config: metrics_addr]
    #[arg(
        long,
        global = true,
        value_name = "HOST:PORT",
        env = "AMQP_DELAY_METRICS_ADDR"
    )]
    pub metrics_addr: Option<String>,
    /// Log lines as readable text or as JSON objects (for log collectors)
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t = LogFormat::Human,
        env = "AMQP_DELAY_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
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
        if let Some(m) = &self.metrics_addr {
            s.metrics_addr = Some(m.clone());
        }
        s.validate()?;
        Ok(s)
    }
}

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One readable line per event (colour only on a terminal).
    #[default]
    Human,
    /// One JSON object per event, for log collectors.
    Json,
}

/// The logging filter of `RUST_LOG`, or the default (`info` for our crate) when it is unset,
/// empty or invalid. [`init_logging_as`] puts [`login_cap`] after it.
pub fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    const DEFAULT: &str = "warn,lapin::channel=off,amqp_delay=info";
    let spec = rust_log.filter(|s| !s.trim().is_empty()).unwrap_or(DEFAULT);
    tracing_subscriber::EnvFilter::try_new(spec).unwrap_or_else(|e| {
        eprintln!("warning: RUST_LOG is not a valid filter ({e}); using the default");
        tracing_subscriber::EnvFilter::new(DEFAULT)
    })
}

/// Whether `target` is the AMQP client's (lapin, amq-protocol and its sub-crates).
fn is_amqp_client(target: &str) -> bool {
    target.starts_with("lapin") || target.starts_with("amq_protocol")
}

/// Drops every event and span of lapin and amq-protocol more verbose than `debug`. Their trace
/// level prints the frames of the login, whose SASL response (`response: LongString([0, 103,
/// 117, ...])`) is the PLAIN password. Applied after [`log_filter`], so no `RUST_LOG` spelling
/// (`trace`, `5`, `lapin=5`, `lapin::io_loop=trace`, ...) can turn it back on.
pub fn login_cap<S>() -> impl tracing_subscriber::layer::Filter<S> + use<S> {
    tracing_subscriber::filter::filter_fn(|meta| {
        !(is_amqp_client(meta.target()) && *meta.level() > tracing::Level::DEBUG)
    })
}

/// The whole filter of the log output: `RUST_LOG` (see [`log_filter`]), then [`login_cap`].
pub fn log_layer_filter<S>(
    rust_log: Option<&str>,
) -> impl tracing_subscriber::layer::Filter<S> + use<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::filter::FilterExt as _;
    log_filter(rust_log).and(login_cap())
}

/// The log format chosen by [`init_logging_as`]: fatal errors are printed in it too.
static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// Logs to stderr in `format`, filtered by [`log_layer_filter`] of `RUST_LOG`; colour only on a
/// terminal.
pub fn init_logging_as(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let _ = LOG_FORMAT.set(format);
    let rust_log = std::env::var("RUST_LOG").ok();
    let rust_log = rust_log.as_deref();
    let registry = tracing_subscriber::registry();
    let _ = match format {
        LogFormat::Human => registry
            .with(
                human_layer(std::io::stderr, std::io::stderr().is_terminal())
                    .with_filter(log_layer_filter(rust_log)),
            )
            .try_init(),
        // serde escapes every control character of a JSON string
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .json()
                    .with_ansi(false)
                    .with_filter(log_layer_filter(rust_log)),
            )
            .try_init(),
    };
}

/// Human log lines on stderr (see [`init_logging_as`]).
pub fn init_logging() {
    init_logging_as(LogFormat::Human);
}

/// Writes one line to stdout. When the reader went away (`delay-publisher stats | head -1`) the
/// program ends quietly with 0 instead of panicking on the broken pipe.
pub fn print_line(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(EXIT_FAILURES);
    }
}

/// Writes many lines to stdout at once (buffered, one flush), as [`print_line`] does one.
pub fn print_lines(lines: impl IntoIterator<Item = String>) {
    use std::io::Write as _;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let r = lines
        .into_iter()
        .try_for_each(|l| writeln!(out, "{l}"))
        .and_then(|()| out.flush());
    if let Err(e) = r {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(EXIT_FAILURES);
    }
}

/// `println!` for the binaries, through [`print_line`].
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::print_line(&format!($($arg)*))
    };
}

/// A fatal error as one line on stderr: `error: ...`, or with `--log-format json` one JSON
/// object shaped like the log events (`timestamp`, `level`, `fields.message`, `target`), so a
/// log collector sees why a process exited.
pub fn error_line(format: LogFormat, message: &str) -> String {
    match format {
        LogFormat::Human => format!("error: {}", escape_controls(message)),
        LogFormat::Json => serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "ERROR",
            "fields": { "message": message },
            "target": "amqp_delay_cli::cli",
        })
        .to_string(),
    }
}

/// Prints `message` as a fatal error in the chosen log format (see [`error_line`]).
pub fn print_error(message: &str) {
    let format = LOG_FORMAT.get().copied().unwrap_or_default();
    eprintln!("{}", error_line(format, message));
}

/// Prints the error with its whole cause chain (see [`print_error`]) and exits with `code`.
pub fn fail(e: &dyn std::error::Error, code: i32) -> ! {
    print_error(&chain(e));
    std::process::exit(code)
}

pub use crate::logline::{EscapedFields, escape_controls, human_layer};
pub use amqp_delay::error_chain as chain;

/// Starts the metrics endpoint when `settings.metrics_addr` asks for one (failing to bind is a
/// usage error).
pub async fn start_metrics(settings: &Settings) -> amqp_delay::Result<()> {
    if let Some(addr) = settings.metrics_addr.as_deref().filter(|a| !a.is_empty()) {
        crate::observe::serve(addr, settings, settings.metrics_sample.as_duration()).await?;
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Exit 2 when the command, its settings or the topology must change before it can work;
    /// 1 when it failed on the way (the broker, a stream, a lost confirm): a stream that stops
    /// mid-read used to be an "invalid request", exit 2.
    #[test]
    fn the_exit_code_follows_the_kind_of_error() {
        let lost = || lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let usage = [
            Error::Invalid("--queue and --delay are required without --jsonl".into()),
            SettingsError::Invalid("tls.ca_file x is not PEM text".into()).into(),
            Error::Missing {
                object: "forward exchange 'x'".into(),
                hint: "declare it".into(),
            },
            Error::NotDeclared {
                prefix: "p".into(),
                detail: String::new(),
            },
            Error::UnknownDestination("q".into()),
            Error::Conflict("radix: 4 → 8".into()),
        ];
        for e in usage {
            assert_eq!(exit_code(&e), EXIT_USAGE, "{e}");
        }
        let failures = [
            Error::Stream {
                stream: "p.control".into(),
                what: "the broker ended the read before the barrier".into(),
            },
            Error::Stream {
                stream: "p.control".into(),
                what: "the follower stopped (it stopped)".into(),
            },
            Error::MaybeSent {
                context: "publishing".into(),
                source: lost(),
            },
            Error::Connect {
                url: "amqp://h".into(),
                source: lost(),
            },
            Error::Amqp {
                context: "declaring".into(),
                source: lost(),
            },
            Error::Timeout {
                context: "declaring".into(),
                timeout_ms: 5,
            },
            Error::Nacked {
                exchange: "x".into(),
            },
            Error::Stopped("the publisher is closing".into()),
            Error::Management {
                url: "http://h/api".into(),
                reason: "answered HTTP 500".into(),
            },
        ];
        for e in failures {
            assert_eq!(exit_code(&e), EXIT_FAILURES, "{e}");
        }
    }

    /// What reaches the log output with `RUST_LOG=rust_log`, of: lapin's and amq-protocol's
    /// trace events (the login's SASL response), a lapin debug event, our own trace event.
    fn logged_with(rust_log: &str) -> String {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .with_filter(log_layer_filter(Some(rust_log)));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            tracing::trace!(target: "lapin::io_loop", "response: LongString([0, 103, 117]) LAPIN-TRACE");
            tracing::trace!(target: "lapin", "LAPIN-ROOT-TRACE");
            tracing::trace!(target: "amq_protocol::frame", "AMQ-TRACE");
            tracing::trace!(target: "amq_protocol_tcp", "AMQ-TCP-TRACE");
            tracing::debug!(target: "lapin::channel", "LAPIN-DEBUG");
            tracing::trace!(target: "amqp_delay::worker", "OURS-TRACE");
        });
        String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned()
    }

    #[test]
    fn no_rust_log_reaches_the_login_frames() {
        for spec in [
            "trace",
            "TRACE",
            "5",
            "lapin=5",
            "lapin=trace",
            "lapin::io_loop=trace",
            "info,lapin::io_loop=trace",
            "amq_protocol=trace,amq_protocol_tcp=5",
            "warn,lapin[{channel=1}]=trace",
        ] {
            let out = logged_with(spec);
            for secret in [
                "LAPIN-TRACE",
                "LAPIN-ROOT-TRACE",
                "AMQ-TRACE",
                "AMQ-TCP-TRACE",
            ] {
                assert!(
                    !out.contains(secret),
                    "RUST_LOG={spec} let {secret} through: {out}"
                );
            }
        }
        // the cap is on lapin's trace only: its debug and our own trace level still work
        let out = logged_with("trace");
        assert!(
            out.contains("LAPIN-DEBUG") && out.contains("OURS-TRACE"),
            "{out}"
        );
        let out = logged_with("lapin=5");
        assert!(
            out.contains("LAPIN-DEBUG") && !out.contains("OURS-TRACE"),
            "{out}"
        );
        let out = logged_with("amqp_delay=trace");
        assert!(
            out.contains("OURS-TRACE") && !out.contains("LAPIN"),
            "{out}"
        );
    }

    #[test]
    fn the_default_filter_is_info_for_our_crate() {
        assert!(log_filter(None).to_string().contains("amqp_delay=info"));
        assert!(
            log_filter(Some(" "))
                .to_string()
                .contains("amqp_delay=info")
        );
        assert!(
            log_filter(Some("lapin=["))
                .to_string()
                .contains("amqp_delay=info"),
            "an invalid RUST_LOG falls back to the default"
        );
    }

    #[test]
    fn a_fatal_error_is_one_json_event_in_json_mode() {
        assert_eq!(error_line(LogFormat::Human, "no \"x\""), "error: no \"x\"");
        assert_eq!(
            error_line(LogFormat::Human, "queue 'q\nerror: forged' does not exist"),
            r"error: queue 'q\nerror: forged' does not exist"
        );
        let line = error_line(LogFormat::Json, "queue 'q' does not exist\nsecond line");
        assert!(!line.contains('\n'), "{line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["level"], "ERROR");
        assert_eq!(
            v["fields"]["message"],
            "queue 'q' does not exist\nsecond line"
        );
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    }
}
