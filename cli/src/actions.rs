//! The actions `delay-consumer` runs without any Rust from the user: `exec` a command, POST to
//! an `http` URL, `forward` to an exchange, or `log` a JSON line. Each maps its result onto
//! success / retryable / permanent as documented in the README.

use std::io::Write;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use amqp_delay::Delivery;
use amqp_delay::Error;
use amqp_delay::Publisher;
use amqp_delay::headers;
use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::{RouteConfig, Settings};
use amqp_delay::time::now_ms;
use amqp_delay::{Context, Handler, Outcome};

/// A configured action.
#[derive(Debug, Clone)]
pub enum Action {
    /// Run a command with the body on stdin.
    Exec {
        /// The command and its arguments (no shell).
        argv: Vec<String>,
        /// Exit code meaning "permanent failure: park".
        permanent_exit_code: i32,
    },
    /// POST the body to a URL.
    Http {
        /// Where to POST.
        url: String,
        /// The HTTP client (with the handler timeout).
        agent: ureq::Agent,
    },
    /// Re-publish to an exchange with confirms.
    Forward {
        /// Exchange to publish to.
        exchange: String,
        /// Routing key; `None` keeps the message's original key.
        routing_key: Option<String>,
        /// Digit words in our routing keys (to recover the original key).
        levels: u32,
        /// Its own connection, once [`Action::prepare`] made it; without one it publishes
        /// through the worker's publisher.
        out: Arc<tokio::sync::OnceCell<ForwardOut>>,
    },
    /// Re-publish every message plainly into a queue (batches unpacked): for a queue whose
    /// consumer is not ours.
    Relay {
        /// The queue (through the default exchange).
        queue: String,
    },
    /// Print one JSON line per message to stdout (the lock keeps lines whole).
    Log(Arc<std::sync::Mutex<()>>),
}

impl Action {
    /// Builds the action of a route. `timeout` bounds HTTP requests; `levels` is the number of
    /// digit words in our routing keys.
    pub fn from_route(
        r: &RouteConfig,
        permanent_exit_code: i32,
        timeout: Duration,
        levels: u32,
    ) -> Result<Action, String> {
        r.validate()?;
        if let Some(cmd) = &r.exec {
            let argv = shell_words::split(cmd)
                .map_err(|e| format!("exec command '{cmd}' cannot be split into words: {e}"))?;
            if argv.is_empty() {
                return Err("exec command is empty".into());
            }
            if find_program(&argv[0]).is_none() {
                return Err(format!(
                    "exec command '{}' is not an executable file or on PATH",
                    argv[0]
                ));
            }
            return Ok(Action::Exec {
                argv,
                permanent_exit_code,
            });
        }
        if let Some(url) = &r.http {
            let parsed = url::Url::parse(url).map_err(|e| format!("http URL '{url}': {e}"))?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(format!(
                    "http URL '{url}' must start with http:// or https://"
                ));
            }
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_global(Some(timeout))
                .http_status_as_error(false)
                .build()
                .into();
            return Ok(Action::Http {
                url: url.clone(),
                agent,
            });
        }
        if let Some(f) = &r.forward {
            let (exchange, key) = match f.split_once(':') {
                Some((x, k)) => (x.to_string(), Some(k.to_string())),
                None => (f.clone(), None),
            };
            if exchange.len() > 255 || key.as_ref().is_some_and(|k| k.len() > 255) {
                return Err(format!(
                    "forward '{f:.60}…': exchange and routing key are at most 255 bytes each"
                ));
            }
            return Ok(Action::Forward {
                exchange,
                routing_key: key,
                levels,
                out: Arc::new(tokio::sync::OnceCell::new()),
            });
        }
        if let Some(q) = &r.relay {
            if q.is_empty() || q.len() > 255 {
                return Err(format!(
                    "relay target queue name must be 1 to 255 bytes, got {}",
                    q.len()
                ));
            }
            return Ok(Action::Relay { queue: q.clone() });
        }
        Ok(Action::Log(Arc::new(std::sync::Mutex::new(()))))
    }

    /// Checks what the action needs on the broker before the worker starts, and connects what
    /// it publishes with. For `forward`: the exchange must exist ([`Error::Missing`] naming it
    /// otherwise; a passive declare, which needs no permission), and forwards get a connection
    /// of their own, so that a publish the broker refuses (an exchange deleted later, no write
    /// right on it) closes a channel there, never the channel the worker retries and parks on
    /// or the connection it consumes on. Other actions need nothing. Connection errors are
    /// returned as they are (the caller may retry).
    pub async fn prepare(&self, settings: &Settings) -> Result<(), Error> {
        let Action::Forward { exchange, out, .. } = self else {
            return Ok(());
        };
        let connector = Connector::new(settings)?;
        let check = connector.connect("amqp-delay forward check").await?;
        let exists = exchange_exists(&check, exchange).await;
        amqp_delay::ops::broker::close_connection(&check, "checked").await;
        if !exists? {
            return Err(Error::Missing {
                object: format!("forward exchange '{exchange}'"),
                hint: "declare it (with the bindings its consumers need) before starting the \
                       consumer"
                    .into(),
            });
        }
        if out.get().is_none() {
            let publisher = Publisher::connect(settings).await?;
            let _ = out.set(ForwardOut {
                publisher,
                connector,
                checked: tokio::sync::Mutex::new(None),
                suspect: std::sync::atomic::AtomicBool::new(false),
            });
        }
        Ok(())
    }
}

/// What a prepared `forward` publishes with: a publisher on a connection of its own (it re-opens
/// its channel and re-makes its connection after a loss), and, after a publish failed, a check
/// that the exchange exists before the next one, so that a missing exchange is not published to
/// again and again while it is missing.
pub struct ForwardOut {
    publisher: Publisher,
    connector: Connector,
    /// The last check after a failure: when, and whether the exchange existed.
    checked: tokio::sync::Mutex<Option<(std::time::Instant, bool)>>,
    /// A publish failed since the exchange was last found.
    suspect: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ForwardOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardOut")
            .field("connector", &self.connector)
            .field("suspect", &self.suspect)
            .finish_non_exhaustive()
    }
}

/// How long the answer of a check after a failed forward is trusted: messages forwarded
/// meanwhile are retried without a publish or a new check.
const FORWARD_CHECK_EVERY: Duration = Duration::from_secs(1);

impl ForwardOut {
    /// `Some(reason)` when a publish failed since the exchange was last found and it is still
    /// missing (or cannot be checked); `None` when forwarding may go ahead.
    async fn hold(&self, exchange: &str) -> Option<String> {
        use std::sync::atomic::Ordering;
        if !self.suspect.load(Ordering::Relaxed) {
            return None;
        }
        let mut checked = self.checked.lock().await;
        let fresh = checked.filter(|(at, _)| at.elapsed() < FORWARD_CHECK_EVERY);
        let exists = match fresh {
            Some((_, exists)) => exists,
            None => {
                let found = match self.connector.connect("amqp-delay forward check").await {
                    Ok(conn) => {
                        let r = exchange_exists(&conn, exchange).await;
                        amqp_delay::ops::broker::close_connection(&conn, "checked").await;
                        r
                    }
                    Err(e) => Err(e),
                };
                match found {
                    Ok(exists) => {
                        *checked = Some((std::time::Instant::now(), exists));
                        exists
                    }
                    Err(e) => {
                        // remembered as "not there" for as long as an answer is trusted, so
                        // that handlers waiting behind this one do not each spend a connect
                        // timeout on a broker that does not answer
                        *checked = Some((std::time::Instant::now(), false));
                        return Some(format!(
                            "forward to '{exchange}': checking the exchange after a failed \
                             publish: {}",
                            amqp_delay::error_chain(&e)
                        ));
                    }
                }
            }
        };
        if exists {
            self.suspect.store(false, Ordering::Relaxed);
            None
        } else {
            Some(format!(
                "forward exchange '{exchange}' does not exist (deleted while the consumer runs?)"
            ))
        }
    }

    fn failed(&self) {
        self.suspect
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether exchange `name` exists (the default exchange `""` always does).
async fn exchange_exists(conn: &lapin::Connection, name: &str) -> Result<bool, Error> {
    if name.is_empty() {
        return Ok(true);
    }
    amqp_delay::ops::broker::exchange_exists(conn, name).await
}

impl Handler for Action {
    async fn handle(&self, d: &Delivery, ctx: &Context) -> Outcome {
        match self {
            Action::Exec {
                argv,
                permanent_exit_code,
            } => exec(argv, *permanent_exit_code, d).await,
            Action::Http { url, agent } => http(url, agent, d).await,
            Action::Forward {
                exchange,
                routing_key,
                levels,
                out,
            } => {
                let key = routing_key
                    .clone()
                    .unwrap_or_else(|| d.original_routing_key(*levels));
                forward(ctx, out.get(), exchange, &key, d).await
            }
            Action::Relay { queue } => relay(ctx, queue, d).await,
            Action::Log(lock) => {
                log_line(lock, d);
                Outcome::Success
            }
        }
    }

    /// Forwarding and relaying only move messages: they run `consumer.io_concurrency` at once.
    fn io_bound(&self) -> bool {
        matches!(self, Action::Forward { .. } | Action::Relay { .. })
    }
}

/// The JSON line of the `log` action.
pub fn log_json(d: &Delivery, fired_at: u64) -> serde_json::Value {
    serde_json::json!({
        "id": d.message_id,
        "queue": d.queue,
        "attempt": d.attempt,
        "due_at": d.due_at_ms,
        "fired_at": fired_at,
        "lateness_ms": d.due_at_ms.map(|due| fired_at as i64 - due as i64),
        "redelivered": d.redelivered,
        "body": String::from_utf8_lossy(&d.body),
    })
}

fn log_line(lock: &std::sync::Mutex<()>, d: &Delivery) {
    let line = log_json(d, now_ms()).to_string();
    let _guard = lock.lock();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn exec(argv: &[String], permanent: i32, d: &Delivery) -> Outcome {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::piped())
        // its own process group, so that a timeout kills what it started too (`sh -c '...'`)
        .process_group(0)
        .kill_on_drop(true)
        .env("DELAY_MESSAGE_ID", &d.message_id)
        .env("DELAY_ATTEMPT", d.attempt.to_string())
        .env("DELAY_QUEUE", &d.queue)
        .env(
            "DELAY_DUE_AT",
            d.due_at_ms.map(|v| v.to_string()).unwrap_or_default(),
        );
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Outcome::Retry(format!("cannot start '{}': {e}", argv[0])),
    };
    // the worker's handler timeout drops this future: the group dies with it
    let _group = child.id().map(ProcessGroup);
    if let Some(mut stdin) = child.stdin.take() {
        // a command that does not read its input is fine
        let _ = stdin.write_all(&d.body).await;
        drop(stdin);
    }
    match child.wait().await {
        Ok(st) if st.success() => Outcome::Success,
        Ok(st) => match st.code() {
            Some(c) if c == permanent => {
                Outcome::Permanent(format!("'{}' exited with {c} (permanent failure)", argv[0]))
            }
            Some(c) => Outcome::Retry(format!("'{}' exited with {c}", argv[0])),
            None => Outcome::Retry(format!("'{}' was killed by a signal", argv[0])),
        },
        Err(e) => Outcome::Retry(format!("waiting for '{}': {e}", argv[0])),
    }
}

/// Kills a process group when dropped (the handler finished or timed out): nothing an `exec`
/// handler started outlives it.
struct ProcessGroup(u32);

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0) {
            // ESRCH (already gone) is the usual case after a normal exit
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Where `program` is found: a path as given, or the first executable of that name on `PATH`.
pub fn find_program(program: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = std::path::PathBuf::from(program);
        return executable(&p).then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| executable(p))
    })
}

/// Maps an HTTP status onto an outcome: 2xx success; 408, 429, 5xx retryable; other 4xx
/// permanent; anything else retryable.
pub fn http_outcome(status: u16, url: &str) -> Outcome {
    match status {
        200..=299 => Outcome::Success,
        408 | 429 | 500..=599 => Outcome::Retry(format!("POST {url} answered {status}")),
        400..=499 => Outcome::Permanent(format!("POST {url} answered {status}")),
        _ => Outcome::Retry(format!("POST {url} answered {status}")),
    }
}

async fn http(url: &str, agent: &ureq::Agent, d: &Delivery) -> Outcome {
    let agent = agent.clone();
    let url = url.to_string();
    let body = d.body.clone();
    let ct = d
        .properties
        .content_type()
        .as_ref()
        .map(|c| c.to_string())
        .unwrap_or_else(|| "application/octet-stream".into());
    let id = d.message_id.clone();
    let attempt = d.attempt.to_string();
    let res = tokio::task::spawn_blocking(move || {
        agent
            .post(&url)
            .header("content-type", &ct)
            .header(headers::HTTP_MESSAGE_ID, &id)
            .header(headers::HTTP_ATTEMPT, &attempt)
            .send(&body[..])
            .map(|r| r.status().as_u16())
            .map_err(|e| e.to_string())
            .map(|s| (s, url.clone()))
            .map_err(|e| (e, url))
    })
    .await;
    match res {
        Ok(Ok((status, url))) => http_outcome(status, &url),
        Ok(Err((e, url))) => Outcome::Retry(format!("POST {url} failed: {e}")),
        Err(e) => Outcome::Retry(format!("HTTP task failed: {e}")),
    }
}

async fn forward(
    ctx: &Context,
    out: Option<&ForwardOut>,
    exchange: &str,
    key: &str,
    d: &Delivery,
) -> Outcome {
    if let Some(reason) = match out {
        Some(o) => o.hold(exchange).await,
        None => None,
    } {
        return Outcome::Retry(reason);
    }
    let empty = lapin::types::FieldTable::default();
    // DESIGN rules 3 and 14: the copy carries no `x-death`, `CC` or `BCC`
    let h = headers::filter(d.headers().unwrap_or(&empty), |k| {
        !headers::is_broker_header(k) && k != headers::ROUTING_KEY
    });
    let props = d.republished_properties(h);
    let publisher = out.map_or(ctx.publisher(), |o| &o.publisher);
    match publisher
        .publish_confirmed(exchange, key, &d.body, props)
        .await
    {
        Ok(()) => Outcome::Success,
        Err(Error::Returned { .. }) => Outcome::Permanent(format!(
            "unroutable: exchange '{exchange}' has no binding for routing key '{key}'"
        )),
        Err(e) => {
            if let Some(o) = out {
                o.failed();
            }
            Outcome::Retry(format!(
                "forward to '{exchange}': {}",
                amqp_delay::error_chain(&e)
            ))
        }
    }
}

async fn relay(ctx: &Context, queue: &str, d: &Delivery) -> Outcome {
    let empty = lapin::types::FieldTable::default();
    // DESIGN rules 3 and 14: the copy carries no `x-death`, `CC` or `BCC`
    let h = headers::filter(d.headers().unwrap_or(&empty), |k| {
        !headers::is_broker_header(k)
    });
    let props = d.republished_properties(h);
    match ctx
        .publisher()
        .publish_confirmed("", queue, &d.body, props)
        .await
    {
        Ok(()) => Outcome::Success,
        Err(Error::Returned { .. }) => {
            Outcome::Permanent(format!("relay target queue '{queue}' does not exist"))
        }
        Err(e) => Outcome::Retry(format!(
            "relay to '{queue}': {}",
            amqp_delay::error_chain(&e)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_statuses_map_to_outcomes() {
        assert_eq!(http_outcome(204, "u"), Outcome::Success);
        for s in [408, 429, 500, 503] {
            assert!(matches!(http_outcome(s, "u"), Outcome::Retry(_)), "{s}");
        }
        for s in [400, 404, 422] {
            assert!(matches!(http_outcome(s, "u"), Outcome::Permanent(_)), "{s}");
        }
    }

    #[test]
    fn routes_need_exactly_one_action() {
        let r = RouteConfig {
            queue: "q".into(),
            log: true,
            exec: Some("x".into()),
            ..RouteConfig::default()
        };
        let e = Action::from_route(&r, 65, Duration::from_secs(1), 3).unwrap_err();
        assert!(e.contains("exactly one action"), "{e}");
        let r = RouteConfig {
            queue: "q".into(),
            exec: Some("'unterminated".into()),
            ..RouteConfig::default()
        };
        assert!(Action::from_route(&r, 65, Duration::from_secs(1), 3).is_err());
        let r = RouteConfig {
            queue: "q".into(),
            forward: Some("x:a.b".into()),
            ..RouteConfig::default()
        };
        assert!(
            matches!(Action::from_route(&r, 65, Duration::from_secs(1), 3).unwrap(), Action::Forward { routing_key: Some(k), .. } if k == "a.b")
        );
    }
}
