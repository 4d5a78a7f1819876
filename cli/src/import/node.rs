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

    /// The arguments after the command's first word that run `expr` (one argument: a wrapper
    /// that re-quotes it, like Debian's `rabbitmqctl` as root, gets it back intact).
    fn args<'a>(&'a self, expr: &'a str) -> Vec<&'a str> {
        let mut args: Vec<&str> = self.command[1..].iter().map(String::as_str).collect();
        if let Some(n) = &self.name {
            args.extend(["-n", n]);
        }
        args.extend(["-q", "eval", expr]);
        args
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
        cmd.args(self.args(&expr))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// How Debian's and Ubuntu's `/usr/sbin/rabbitmqctl` (rabbitmq-server's
    /// debian/rabbitmq-script-wrapper) passes its arguments when run as root: each one through
    /// a `<<-` here-document and sed (which escapes only `"`), wrapped in double quotes, the
    /// whole line run by `su rabbitmq -s /bin/sh -c`. Its loop verbatim, tabs and all; `sh -c`
    /// in place of su, and printf, NUL-terminated, in place of the real rabbitmqctl.
    const DEBIAN_WRAPPER: &str = concat!(
        "for arg in \"$@\" ; do\n",
        "\targ=$(sed -e 's/\"/\\\\\"/g' <<-END\n",
        "\t\t$arg\n",
        "\t\tEND\n",
        "\t)\n",
        "\tCMDLINE=\"${CMDLINE} \\\"${arg}\\\"\"\n",
        "done\n",
        "exec /bin/sh -c \"printf '%s\\0' ${CMDLINE}\"\n",
    );

    /// The arguments the real rabbitmqctl gets when the wrapper is given `args`.
    fn through_debian_wrapper(args: &[&str]) -> Vec<String> {
        let out = std::process::Command::new("/bin/sh")
            .args(["-c", DEBIAN_WRAPPER, "rabbitmqctl"])
            .args(args)
            .output()
            .expect("running /bin/sh");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut got: Vec<String> = text.split('\0').map(str::to_string).collect();
        assert_eq!(got.pop().as_deref(), Some(""), "NUL-terminated");
        got
    }

    #[test]
    fn the_wrapper_emulation_changes_what_a_shell_would() {
        let got = through_debian_wrapper(&["A = '$end_of_table', A.", "x \"q\" y"]);
        assert_eq!(got, ["A = '', A.", "x \"q\" y"]);
    }

    #[test]
    fn every_call_reaches_rabbitmqctl_intact_through_debians_wrapper() {
        let node = Node::new(
            "/usr/sbin/rabbitmqctl",
            Some("adplug310@localhost".into()),
            Duration::from_secs(1),
        )
        .unwrap();
        // the longest call: as many deletes as fit, with the longest cursor
        let ids: Vec<EntryId> = (0..10_000)
            .map(|i| EntryId {
                due_ms: 1_796_534_026_261 + i,
                creation: 7 + (i % 2) as u32,
                words: vec![1, u32::MAX - i as u32, i as u32],
            })
            .collect();
        let most = plugin_store::deletes_that_fit(&ids);
        let long = Cursor::from_node("g2gD+/=".repeat(1170).as_bytes()).unwrap();
        let short = Cursor::from_node(b"g2gDZAAJZGVsYXlfa2V5bgYA+/==").unwrap();
        for (dels, cursor) in [(0, Cursor::start()), (5, short), (most, long)] {
            let expr = plugin_store::expression(&ids[..dels], &cursor, 4000, 16 << 20);
            let args = node.args(&expr);
            let got = through_debian_wrapper(&args);
            let first_change =
                |a: &str, b: &str| a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
            for (g, a) in got.iter().zip(&args) {
                assert!(
                    g == a,
                    "{dels} deletes: changed at byte {}",
                    first_change(g, a)
                );
            }
            assert_eq!(got.len(), args.len());
        }
    }
}
