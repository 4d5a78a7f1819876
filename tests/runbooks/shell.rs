//! Runs a document's blocks as a user's terminal session would: each with
//! `bash -euo pipefail -c`, in one working directory, with only the environment given, and the
//! shell variables an earlier block set (`PROXY_PID=$!`) still set in the later ones. Every
//! block runs in a process group of its own, so that what it left running in the background
//! (`... &`) is found and stopped (SIGTERM, by process group) at the end.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// What a block did.
pub(crate) struct Ran {
    pub what: String,
    pub code: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    /// Panics, with the block and what it printed, unless it exited 0.
    pub(crate) fn ok(self) -> Ran {
        assert!(self.status.success(), "{}", self.report());
        self
    }

    /// The block, its exit status and its output, for a failure message.
    pub(crate) fn report(&self) -> String {
        format!(
            "the block of {} exited with {}:\n{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.status,
            self.code.trim_end(),
            tail(&self.stdout, 40),
            tail(&self.stderr, 40)
        )
    }
}

/// The last `n` lines of `text`.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A terminal session: a working directory, an environment, the variables the blocks set.
pub(crate) struct Session {
    dir: PathBuf,
    env: Vec<(String, String)>,
    /// `declare -p` lines of the variables the blocks set, as the last block left them.
    carried: String,
    /// Names the blocks assign (`NAME=`), carried to the next block.
    names: BTreeSet<String>,
    /// The process group of each block (its shell's pid).
    groups: Vec<i32>,
    runs: usize,
}

impl Session {
    /// A session in `dir` whose blocks see only `env` (PATH included).
    pub(crate) fn new(dir: &Path, env: Vec<(String, String)>) -> Session {
        std::fs::create_dir_all(dir).unwrap();
        Session {
            dir: dir.to_path_buf(),
            env,
            carried: String::new(),
            names: BTreeSet::new(),
            groups: Vec::new(),
            runs: 0,
        }
    }

    /// The working directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `code` and waits for its shell (not for what it left in the background).
    pub(crate) fn run(&mut self, what: &str, code: &str) -> Ran {
        let mut r = self.start(what, code);
        let status = r.child.wait().unwrap();
        self.carried = std::fs::read_to_string(&r.vars).unwrap_or_default();
        Ran {
            what: what.to_string(),
            code: code.to_string(),
            status,
            stdout: std::fs::read_to_string(&r.stdout).unwrap_or_default(),
            stderr: std::fs::read_to_string(&r.stderr).unwrap_or_default(),
        }
    }

    /// Starts `code` without waiting (a block whose last command runs until stopped).
    pub(crate) fn start(&mut self, what: &str, code: &str) -> Running {
        self.names.extend(assigned(code));
        self.runs += 1;
        let base = self.dir.join(format!(".block-{:02}", self.runs));
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let vars = base.with_extension("vars");
        // the variables outlive the block however it ends, as in a terminal (a bare
        // `declare -p` would print every variable, read-only ones too: none to carry, none)
        let carry = match names.is_empty() {
            true => String::new(),
            false => format!(
                "trap 'declare -p {} >{} 2>/dev/null || true' EXIT",
                names.join(" "),
                quote(&vars.to_string_lossy())
            ),
        };
        let script = format!("{}\n{carry}\n{code}", self.carried);
        let (stdout, stderr) = (base.with_extension("out"), base.with_extension("err"));
        let child = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(&self.dir)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(File::create(&stdout).unwrap())
            .stderr(File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting bash for {what}: {e}"));
        self.groups.push(child.id() as i32);
        Running {
            child,
            stdout,
            stderr,
            vars,
        }
    }

    /// The last lines of every block's output (background jobs' included), for a failure.
    pub(crate) fn logs(&self) -> String {
        let mut out = String::new();
        for i in 1..=self.runs {
            for ext in ["out", "err"] {
                let f = self.dir.join(format!(".block-{i:02}.{ext}"));
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                if !text.trim().is_empty() {
                    out.push_str(&format!("--- block {i} {ext} ---\n{}\n", tail(&text, 15)));
                }
            }
        }
        out
    }

    /// Stops whatever the blocks left running: SIGTERM to each block's process group, then,
    /// after `grace`, SIGKILL to what is left. Returns the groups that needed SIGKILL.
    pub(crate) fn stop_all(&mut self, grace: Duration) -> Vec<i32> {
        let live: Vec<i32> = self.groups.iter().copied().filter(|g| alive(*g)).collect();
        for g in &live {
            let _ = killpg(Pid::from_raw(*g), Signal::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while live.iter().any(|g| alive(*g)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let stubborn: Vec<i32> = live.into_iter().filter(|g| alive(*g)).collect();
        for g in &stubborn {
            let _ = killpg(Pid::from_raw(*g), Signal::SIGKILL);
        }
        self.groups.clear();
        stubborn
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_all(Duration::from_secs(15));
    }
}

/// A block started and not waited for.
pub(crate) struct Running {
    pub child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    vars: PathBuf,
}

/// Whether a process of group `pgid` runs (zombies, already dead, do not count).
fn alive(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        f.len() > 2 && f[0] != "Z" && f[2] == pgid.to_string()
    })
}

/// The names `code` assigns shell variables to: an upper-case word followed by `=` at the start
/// of a command (`PID=$!`, `X=${X:-d}`, `export Y=1`), not a flag's `--url=`.
fn assigned(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for word in code.split(|c: char| c.is_whitespace() || c == ';' || c == '&' || c == '(') {
        if let Some((name, _)) = word.split_once('=') {
            let mut chars = name.chars();
            let first = chars
                .next()
                .is_some_and(|c| c.is_ascii_uppercase() || c == '_');
            if first && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// `s` in single quotes for bash.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments_are_found_and_flags_are_not() {
        let got = assigned(
            "NODE=${NODE:-rabbit@mq1}  # x\nrun --url=\"$U\" &\nPID=$!; export A_1=2\nkey=v\n",
        );
        assert_eq!(
            got.into_iter().collect::<Vec<_>>(),
            vec!["A_1", "NODE", "PID"]
        );
    }

    #[test]
    fn variables_carry_over_and_background_jobs_are_stopped() {
        let dir = std::env::temp_dir().join(format!("rb-shell-{}", std::process::id()));
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let mut s = Session::new(&dir, env);
        s.run("one", "X=\"a 'b'\"\nsleep 600 &\nPID=$!\n").ok();
        let r = s
            .run("two", "echo \"$X\" \"$PID\" \"${HOME:-no home}\"\n")
            .ok();
        let pid: i32 = r.stdout.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(r.stdout.starts_with("a 'b' ") && r.stdout.trim_end().ends_with("no home"));
        assert!(s.run("three", "false\necho never\n").stdout.is_empty());
        let group = s.groups[0];
        assert!(pid > 0 && alive(group));
        assert!(s.stop_all(Duration::from_secs(10)).is_empty());
        assert!(!alive(group));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
