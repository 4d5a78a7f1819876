//! The plugin's node, reached with `rabbitmqctl eval` run as a subprocess: the operator's own
//! access (the Erlang cookie stays with rabbitmqctl; nothing here reads or logs it).

use std::process::Stdio;
use std::time::{Duration, Instant};

use amqp_delay::{Error, Result};

use crate::logline::escape_controls;
use crate::plugin_store::{self, Answer, Cursor, EntryId};

/// How to reach the node.
#[derive(Debug, Clone)]
pub struct Node {
    /// The command's words (`rabbitmqctl`, or `kubectl exec -i pod -- rabbitmqctl`, ...).
    command: Vec<String>,
    /// `-n NAME`, when given.
    name: Option<String>,
    /// Longest a call may take before it is given up (and its process killed).
    timeout: Duration,
}

impl Node {
    /// The node reached by `command` (a shell-like line: `"kubectl exec -i rabbit-0 --
    /// rabbitmqctl"`), with `-n name` when given.
    pub fn new(command: &str, name: Option<String>, timeout: Duration) -> Result<Node> {
        let command = shell_words::split(command)
            .map_err(|e| Error::Invalid(format!("--rabbitmqctl '{command}': {e}")))?;
        if command.is_empty() {
            return Err(Error::Invalid(
                "--rabbitmqctl is empty: give the command that runs rabbitmqctl".into(),
            ));
        }
        Ok(Node {
            command,
            name,
            timeout,
        })
    }

    /// How it is shown (never with the expression).
    pub fn describe(&self) -> String {
        let mut s = self.command.join(" ");
        if let Some(n) = &self.name {
            s.push_str(&format!(" -n {n}"));
        }
        escape_controls(&s).into_owned()
    }

    /// One call: deletes `deletes` (all must fit, [`plugin_store::deletes_that_fit`]), then
    /// reads up to `max_entries` entries from `cursor`. Returns the answer and the call's time.
    pub async fn call(
        &self,
        deletes: &[EntryId],
        cursor: &Cursor,
        max_entries: usize,
        max_bytes: usize,
    ) -> Result<(Answer, Duration)> {
        let expr = plugin_store::expression(deletes, cursor, max_entries, max_bytes);
        let mut cmd = tokio::process::Command::new(&self.command[0]);
        cmd.args(&self.command[1..]);
        if let Some(n) = &self.name {
            cmd.args(["-n", n]);
        }
        cmd.args(["-q", "eval", &expr])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let started = Instant::now();
        let child = cmd.spawn().map_err(|e| {
            Error::Invalid(format!(
                "cannot run '{}': {e}; give the command that runs rabbitmqctl with --rabbitmqctl",
                self.describe()
            ))
        })?;
        let out = tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| Error::Timeout {
                context: format!("rabbitmqctl eval through '{}'", self.describe()),
                timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            })?
            .map_err(|e| Error::Stopped(format!("running '{}': {e}", self.describe())))?;
        if !out.status.success() {
            return Err(Error::Stopped(format!(
                "'{} eval' failed ({}): {}",
                self.describe(),
                out.status,
                excerpt(&out.stderr, &out.stdout)
            )));
        }
        let answer = plugin_store::parse_output(&out.stdout).map_err(|e| {
            let prefix = plugin_store::ANSWER_PREFIX.trim().as_bytes();
            if out.stdout.windows(prefix.len()).any(|w| w == prefix) {
                Error::Stopped(format!("the plugin's node gave a malformed answer: {e}"))
            } else {
                Error::Stopped(format!(
                    "the plugin's node answered '{}' ({e}): is the delayed-message plugin enabled there?",
                    excerpt(&out.stderr, &out.stdout)
                ))
            }
        })?;
        if answer.deleted.len() != deletes.len() {
            return Err(Error::Stopped(format!(
                "the node answered {} deletes for {} asked",
                answer.deleted.len(),
                deletes.len()
            )));
        }
        Ok((answer, started.elapsed()))
    }
}

/// The start of what a failed call printed (stderr, else stdout), escaped for a log line.
fn excerpt(stderr: &[u8], stdout: &[u8]) -> String {
    let raw = if stderr.iter().any(|b| !b.is_ascii_whitespace()) {
        stderr
    } else {
        stdout
    };
    let text = String::from_utf8_lossy(&raw[..raw.len().min(600)]);
    escape_controls(text.trim()).into_owned()
}
