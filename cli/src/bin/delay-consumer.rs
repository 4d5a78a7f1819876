//! `delay-consumer`: a worker that runs an action (exec, http, forward, log) on every due
//! message of one or more destination queues. Thin: the work is in `worker` and `actions`.

use std::time::Duration;

use amqp_delay::Worker;
use amqp_delay::settings::RouteConfig;
use amqp_delay::time::DurationMs;
use amqp_delay_cli::actions::Action;
use amqp_delay_cli::cli::{self, EXIT_FAILURES, EXIT_USAGE, GlobalArgs};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "delay-consumer",
    version,
    about = "Run an action on every due delayed message: exec a command, POST to a URL, forward to an exchange, or log JSON",
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
    let c = &mut s.consumer;
    if let Some(v) = a.prefetch {
        c.prefetch = v;
    }
    if let Some(v) = a.concurrency {
        c.concurrency = v;
    }
    if let Some(v) = a.handler_timeout {
        c.handler_timeout = v;
    }
    if let Some(v) = a.max_attempts {
        c.retry.max_attempts = v;
    }
    if let Some(v) = a.retry_base {
        c.retry.base = v;
    }
    if let Some(v) = a.retry_factor {
        c.retry.factor = v;
    }
    if let Some(v) = a.retry_cap {
        c.retry.cap = v;
    }
    if let Some(v) = a.retry_jitter {
        c.retry.jitter = v;
    }
    if let Some(v) = a.permanent_exit_code {
        c.permanent_exit_code = v;
    }
    if let Some(v) = a.shutdown_grace {
        c.shutdown_grace = v;
    }
    if let Some(queue) = a.queue {
        c.routes = vec![RouteConfig {
            queue,
            exec: a.action.exec,
            http: a.action.http,
            forward: a.action.forward,
            relay: a.action.relay,
            log: a.action.log,
        }];
    }
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
    let timeout = Duration::from_millis(s.consumer.handler_timeout.as_millis());
    let mut worker = Worker::new(s.clone());
    let mut actions = Vec::new();
    for r in &s.consumer.routes {
        match Action::from_route(r, s.consumer.permanent_exit_code, timeout, levels) {
            Ok(action) => actions.push((r.queue.clone(), action)),
            Err(e) => {
                cli::print_error(&e.to_string());
                std::process::exit(EXIT_USAGE);
            }
        }
    }
    // what the actions need on the broker (a forward's exchange) is checked before consuming
    tokio::select! {
        () = prepare(&actions, &s) => {},
        () = cli::shutdown_signal() => return,
    }
    for (queue, action) in actions {
        worker = worker.subscribe(queue, action);
    }
    if let Err(e) = cli::start_metrics(&s).await {
        cli::fail(&e, EXIT_USAGE);
    }
    if let Err(e) = worker.run(cli::shutdown_signal()).await {
        cli::fail(&e, EXIT_FAILURES);
    }
}

/// [`Action::prepare`] of every action: a missing forward exchange ends the process with
/// [`EXIT_USAGE`]; while the broker cannot be reached it is tried again, as the worker would.
async fn prepare(actions: &[(String, Action)], s: &amqp_delay::Settings) {
    let mut backoff = amqp_delay::connection::Backoff::default();
    for (_, action) in actions {
        loop {
            match action.prepare(s).await {
                Ok(()) => break,
                Err(e @ (amqp_delay::Error::Invalid(_) | amqp_delay::Error::Settings(_))) => {
                    cli::fail(&e, EXIT_USAGE)
                }
                Err(e) => {
                    let pause = backoff.next_pause();
                    tracing::warn!(
                        "checking the action's target: {}; trying again in {pause:?}",
                        cli::chain(&e)
                    );
                    amqp_delay::connection::Backoff::wait(pause, &s.url).await;
                }
            }
        }
    }
}
