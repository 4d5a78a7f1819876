//! `delay-consumer`: a worker that runs an action (exec, http, forward, relay, log) on every
//! due message of one or more destination queues. Thin: the work is in `worker` and `actions`.

use amqp_delay::Worker;
use amqp_delay::settings::RouteConfig;
use amqp_delay::time::DurationMs;
use amqp_delay_cli::actions::Action;
use amqp_delay_cli::cli::{self, EXIT_USAGE, GlobalArgs};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "delay-consumer",
    version,
    about = "Run an action on every due delayed message: exec a command, POST to a URL, forward to an exchange, relay it plainly into a queue, or log JSON",
    after_help = "Without --queue, the queues and actions come from [[consumer.routes]] in the config file.\nExit codes of --exec: 0 = success, --permanent-exit-code (default 65) = permanent failure (parked), anything else = retry."
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    /// Destination queue to consume
    #[arg(long, short = 'q', requires = "action")]
    queue: Option<String>,
    #[command(flatten)]
    action: ActionArgs,
    /// Unacknowledged deliveries the broker sends ahead per queue
    #[arg(long)]
    prefetch: Option<u16>,
    /// Handlers running at once
    #[arg(long)]
    concurrency: Option<usize>,
    /// A handler running longer counts as a retryable failure (e.g. 30s, 5m)
    #[arg(long)]
    handler_timeout: Option<DurationMs>,
    /// Executions in all before a failing message is parked
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Delay before the first retry
    #[arg(long)]
    retry_base: Option<DurationMs>,
    /// Backoff growth per attempt
    #[arg(long)]
    retry_factor: Option<f64>,
    /// Longest backoff
    #[arg(long)]
    retry_cap: Option<DurationMs>,
    /// Fraction of the backoff taken off at random (0..1)
    #[arg(long)]
    retry_jitter: Option<f64>,
    /// Exit code of --exec meaning "permanent failure"
    #[arg(long)]
    permanent_exit_code: Option<i32>,
    /// How long in-flight handlers may finish after SIGTERM/SIGINT
    #[arg(long)]
    shutdown_grace: Option<DurationMs>,
}

impl Cli {
    /// The flags over the settings (flags win); `--queue` with its action replaces the routes.
    fn apply(self, s: &mut amqp_delay::Settings) {
        let c = &mut s.consumer;
        if let Some(v) = self.prefetch {
            c.prefetch = v;
        }
        if let Some(v) = self.concurrency {
            c.concurrency = v;
        }
        if let Some(v) = self.handler_timeout {
            c.handler_timeout = v;
        }
        if let Some(v) = self.max_attempts {
            c.retry.max_attempts = v;
        }
        if let Some(v) = self.retry_base {
            c.retry.base = v;
        }
        if let Some(v) = self.retry_factor {
            c.retry.factor = v;
        }
        if let Some(v) = self.retry_cap {
            c.retry.cap = v;
        }
        if let Some(v) = self.retry_jitter {
            c.retry.jitter = v;
        }
        if let Some(v) = self.permanent_exit_code {
            c.permanent_exit_code = v;
        }
        if let Some(v) = self.shutdown_grace {
            c.shutdown_grace = v;
        }
        if let Some(queue) = self.queue {
            c.routes = vec![RouteConfig {
                queue,
                exec: self.action.exec,
                http: self.action.http,
                forward: self.action.forward,
                relay: self.action.relay,
                log: self.action.log,
            }];
        }
    }
}

#[derive(clap::Args)]
#[group(id = "action", multiple = false)]
struct ActionArgs {
    /// Run CMD with the body on stdin (DELAY_MESSAGE_ID, DELAY_ATTEMPT, DELAY_DUE_AT, DELAY_QUEUE set)
    #[arg(long, value_name = "CMD")]
    exec: Option<String>,
    /// POST the body to URL (2xx success; 408, 429, 5xx, timeout retry; other 4xx permanent)
    #[arg(long, value_name = "URL")]
    http: Option<String>,
    /// Re-publish to EXCHANGE with ROUTING_KEY (default: the message's original key)
    #[arg(long, value_name = "EXCHANGE[:ROUTING_KEY]")]
    forward: Option<String>,
    /// Re-publish every message plainly into QUEUE (batches unpacked), for a queue whose
    /// consumer is not amqp-delay's
    #[arg(long, value_name = "QUEUE")]
    relay: Option<String>,
    /// Print one JSON line per message (id, queue, attempt, due_at, fired_at, lateness_ms)
    #[arg(long)]
    log: bool,
}

#[tokio::main]
async fn main() {
    let a = Cli::parse();
    cli::init_logging_as(a.global.log_format);
    let mut s = match a.global.settings() {
        Ok(s) => s,
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    a.apply(&mut s);
    if let Err(e) = s.validate() {
        cli::fail(&e, EXIT_USAGE);
    }
    if s.consumer.routes.is_empty() {
        cli::print_error(
            "nothing to consume: give --queue Q with an action, or [[consumer.routes]] in --config",
        );
        std::process::exit(EXIT_USAGE);
    }
    let levels = match s.layout() {
        Ok(l) => l.levels(),
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    let mut worker = Worker::new(s.clone());
    let actions = match actions(&s, levels) {
        Ok(a) => a,
        Err(e) => {
            cli::print_error(&e);
            std::process::exit(EXIT_USAGE);
        }
    };
    // what the actions need on the broker (a forward's exchange) is checked before consuming
    tokio::select! {
        () = prepare(&actions, &s) => {},
        () = cli::shutdown_signal() => return,
    }
    for (queue, action) in actions {
        worker = worker.subscribe(queue, action);
    }
    if let Err(e) = cli::start_metrics(&s).await {
        cli::fail_with(&e);
    }
    if let Err(e) = worker.run(cli::shutdown_signal()).await {
        cli::fail_with(&e);
    }
}

/// The action of every route, by queue.
fn actions(s: &amqp_delay::Settings, levels: u32) -> Result<Vec<(String, Action)>, String> {
    let timeout = s.consumer.handler_timeout.as_duration();
    s.consumer
        .routes
        .iter()
        .map(|r| {
            Action::from_route(r, s.consumer.permanent_exit_code, timeout, levels)
                .map(|a| (r.queue.clone(), a))
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// [`Action::prepare`] of every action: what retrying cannot fix (a missing forward exchange,
/// bad settings: [`EXIT_USAGE`] by [`cli::exit_code`]) ends the process; anything else (the
/// broker cannot be reached, or refused) is tried again, as the worker would.
async fn prepare(actions: &[(String, Action)], s: &amqp_delay::Settings) {
    let mut backoff = amqp_delay::ops::connection::Backoff::default();
    for (_, action) in actions {
        loop {
            match action.prepare(s).await {
                Ok(()) => break,
                Err(e) if cli::exit_code(&e) == EXIT_USAGE => cli::fail_with(&e),
                Err(e) => {
                    let pause = backoff.next_pause();
                    tracing::warn!(
                        "checking the action's target: {}; trying again in {pause:?}",
                        cli::chain(&e)
                    );
                    amqp_delay::ops::connection::Backoff::wait(pause, &s.url).await;
                }
            }
        }
    }
}
