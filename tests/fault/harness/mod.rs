//! The fault suite's harness: a 3-node cluster from `scripts/cluster.sh` (brought up once per
//! binary; a test FAILS with the script's output when it cannot come up), one test at a time,
//! a random prefix `fault-<random>` per test, the binaries run as child processes with every
//! node's URL, and the tally each scenario prints.
//!
//! `cluster`: the nodes and what rabbitmqctl says of them; `worker`: a running
//! `delay-consumer --log`; `bulk`: `send --jsonl` and its outcome; `tally`: what a scenario saw.

mod bulk;
mod cluster;
mod tally;
mod worker;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub(crate) use bulk::*;
pub(crate) use cluster::*;
pub(crate) use tally::*;
pub(crate) use worker::*;

/// Tests in this binary: the last one to finish tears the cluster down (`scripts/test.sh`
/// stops the cluster anyway).
pub(crate) const TESTS: usize = 9;
/// Nodes of the cluster.
pub(crate) const NODES: usize = 3;
/// The broker's dead-letter confirm timeout the cluster runs with (OPERATIONS.md's setting).
pub(crate) const DLX_CONFIRM_TIMEOUT_MS: u64 = 5000;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
static FINISHED: AtomicUsize = AtomicUsize::new(0);

/// One scenario's world. Holding it serialises the tests; dropping it kills the processes it
/// started, deletes what the test declared and, after the last test, stops the cluster.
pub(crate) struct Fault {
    pub name: &'static str,
    pub prefix: String,
    pub config: PathBuf,
    pub started: Instant,
    destinations: Vec<String>,
    files: Vec<PathBuf>,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// The topology the scenarios use: 1 ms units, radix 4, no fixed levels, delays up to `max_ms`.
pub(crate) fn topology_toml(prefix: &str, max_ms: u64) -> String {
    format!(
        "prefix = \"{prefix}\"\n[topology]\nradix = 4\nunit = 1\nmax_delay = {max_ms}\nfixed_levels = []\n[precision]\nlateness = 0\nlateness_ratio = 0.0\n"
    )
}

impl Fault {
    /// Waits for the other tests, makes sure all nodes are up, picks a prefix and writes a
    /// config with delays up to `max_ms`.
    pub(crate) async fn begin(name: &'static str, max_ms: u64) -> Fault {
        let serial = SERIAL.lock().await;
        let started = Instant::now();
        if let Err(e) = tokio::task::spawn_blocking(cluster_up).await.unwrap() {
            FINISHED.fetch_add(1, Ordering::SeqCst);
            panic!(
                "THE FAULT-TEST CLUSTER DID NOT COME UP (scripts/cluster.sh, run as root):\n{e}"
            );
        }
        // an earlier scenario's faults may have cost a node its dead-letter supervisor: then
        // quorum queues led from it neither forward nor start
        unstick_dead_letters(name, None).await;
        let n: u64 = rand::rng().random();
        let prefix = format!("fault-{:010x}", n & 0xff_ffff_ffff);
        if let Err(e) = quorum_ready(&prefix).await {
            FINISHED.fetch_add(1, Ordering::SeqCst);
            panic!("THE FAULT-TEST CLUSTER CANNOT DECLARE QUORUM QUEUES: {e}");
        }
        let config = std::env::temp_dir().join(format!("{prefix}.toml"));
        std::fs::write(&config, topology_toml(&prefix, max_ms)).unwrap();
        eprintln!(
            "[{name}] prefix {prefix}; cluster ready after {:?}",
            started.elapsed()
        );
        Fault {
            name,
            prefix,
            config,
            started,
            destinations: Vec::new(),
            files: vec![],
            _serial: serial,
        }
    }

    /// Exact routes for this scenario's publishers (`publisher.grain = 0`): every message its
    /// own broker message, through every level its delay needs.
    pub(crate) fn exact_routes(&self) {
        let mut text = std::fs::read_to_string(&self.config).unwrap();
        text.push_str("[publisher]\ngrain = \"0s\"\n");
        std::fs::write(&self.config, text).unwrap();
    }

    /// A temp file of this test (deleted at the end).
    pub(crate) fn file(&mut self, name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("{}-{name}", self.prefix));
        self.files.push(p.clone());
        p
    }

    /// A destination name `<prefix>-<name>`, removed at the end (with its parking queue).
    pub(crate) fn destination(&mut self, name: &str) -> String {
        let q = format!("{}-{name}", self.prefix);
        self.destinations.push(q.clone());
        q
    }

    /// `bin --config CFG --url URLS ARGS...`, output piped.
    pub(crate) fn command(&self, bin: &str, args: &[&str]) -> Command {
        self.command_to(&urls(), bin, args)
    }

    /// [`Fault::command`] with the broker URLs `urls`.
    fn command_to(&self, urls: &str, bin: &str, args: &[&str]) -> Command {
        let mut c = Command::new(bin);
        c.arg("--config")
            .arg(&self.config)
            .arg("--url")
            .arg(urls)
            .args(args)
            .env_remove("AMQP_DELAY_PREFIX")
            .env("AMQP_DELAY_MANAGEMENT_URL", management_url())
            // FAULT_RUST_LOG=warn,amqp_delay=debug traces which batch carries which message
            // (publisher) and when each batch arrives and is acked (worker)
            .env(
                "RUST_LOG",
                std::env::var("FAULT_RUST_LOG")
                    .unwrap_or_else(|_| "warn,lapin::channel=off,amqp_delay=info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        c
    }

    /// `delay-publisher send --jsonl -` (lines come on its stdin) writing its re-send files to
    /// `unsent` and `maybe`, once it has connected to a node: the child and its pid. The files
    /// of an earlier attempt that sent nothing are removed first (a send never writes through a
    /// file it did not create).
    pub(crate) async fn bulk_send(&self, unsent: &Path, maybe: &Path) -> (Child, u32) {
        for f in [unsent, maybe] {
            let _ = std::fs::remove_file(f);
        }
        let child = self
            .command(
                env!("CARGO_BIN_EXE_delay-publisher"),
                &[
                    "send",
                    "--jsonl",
                    "-",
                    "--unsent",
                    unsent.to_str().unwrap(),
                    "--maybe-sent",
                    maybe.to_str().unwrap(),
                ],
            )
            .stdin(Stdio::piped())
            // to a file, not a pipe nobody reads until the end: with FAULT_RUST_LOG at debug or
            // trace the log outgrows a pipe's buffer and the send would block on it
            .stderr(Stdio::from(
                std::fs::File::create(stderr_file(unsent)).expect("bulk send stderr file"),
            ))
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        assert!(
            wait_until(Duration::from_secs(20), || !nodes_of(pid).is_empty()).await,
            "the bulk send never connected"
        );
        (child, pid)
    }

    /// Writes `lines` (JSONL, one per message) to the file `name` and sends it with
    /// `delay-publisher send --jsonl`, asserting that all `n` were confirmed.
    pub(crate) async fn send_confirmed(&mut self, name: &str, lines: String, n: usize) {
        let file = self.file(name);
        std::fs::write(&file, lines).unwrap();
        let out = self
            .publisher_ok(&["send", "--jsonl", file.to_str().unwrap()])
            .await;
        if std::env::var_os("FAULT_RUST_LOG").is_some() {
            eprintln!("[{}] send --jsonl {name}:\n{}", self.name, out.stderr);
        }
        assert!(
            out.stdout.contains(&format!("{n} confirmed, 0 failed")),
            "{}",
            out.stdout
        );
    }

    /// Runs `delay-publisher ARGS` to the end (at most 90 s).
    pub(crate) async fn publisher(&self, args: &[&str]) -> Output {
        self.publisher_to(&urls(), args).await
    }

    /// [`Fault::publisher`] connected to `urls`.
    async fn publisher_to(&self, urls: &str, args: &[&str]) -> Output {
        let t = Instant::now();
        let mut child = self
            .command_to(urls, env!("CARGO_BIN_EXE_delay-publisher"), args)
            .spawn()
            .unwrap();
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        let status = tokio::time::timeout(Duration::from_secs(90), child.wait()).await;
        if status.is_err() {
            let _ = child.kill().await;
        }
        let (stdout, stderr) = (stdout.await.unwrap(), stderr.await.unwrap());
        let Ok(status) = status else {
            panic!(
                "delay-publisher {args:?} did not finish in 90 s; it printed:\n{stdout}\n{stderr}"
            )
        };
        Output {
            code: status.unwrap().code(),
            stdout,
            stderr,
            took: t.elapsed(),
        }
    }

    /// Like [`Fault::publisher`], and asserts that it exited 0.
    pub(crate) async fn publisher_ok(&self, args: &[&str]) -> Output {
        self.publisher_ok_to(&urls(), args).await
    }

    /// [`Fault::publisher_ok`] connected to `urls`.
    async fn publisher_ok_to(&self, urls: &str, args: &[&str]) -> Output {
        let out = self.publisher_to(urls, args).await;
        assert_eq!(
            out.code,
            Some(0),
            "delay-publisher {args:?} failed:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        out
    }

    /// `declare --queue Q --worker` for each destination.
    pub(crate) async fn declare(&self, queues: &[&str]) -> Output {
        self.declare_to(&urls(), queues).await
    }

    /// [`Fault::declare`] through node `i` alone: the streams (control, journal, ledger) are
    /// then led from node `i`, their leader locator being `client-local`; for a scenario
    /// that loses node `i` with them.
    pub(crate) async fn declare_via(&self, i: usize, queues: &[&str]) -> Output {
        self.declare_to(&url(i), queues).await
    }

    async fn declare_to(&self, urls: &str, queues: &[&str]) -> Output {
        let mut args = vec!["declare"];
        for q in queues {
            args.extend(["--queue", q]);
        }
        if !queues.is_empty() {
            args.push("--worker");
        }
        self.publisher_ok_to(urls, &args).await
    }

    /// Starts `delay-consumer --queue Q --log` and waits until it consumes.
    pub(crate) async fn worker(&self, queue: &str) -> Worker {
        let mut child = self
            .command(
                env!("CARGO_BIN_EXE_delay-consumer"),
                &["--queue", queue, "--log", "--prefetch", "200"],
            )
            .spawn()
            .unwrap();
        let w = Worker {
            deliveries: Arc::new(Mutex::new(Vec::new())),
            log: Arc::new(Mutex::new(String::new())),
            pid: child.id().unwrap(),
            child: None,
        };
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let d = w.deliveries.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let v: serde_json::Value = match serde_json::from_str(&l) {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                d.lock().unwrap().push(Delivered {
                    id: v["id"].as_str().unwrap_or_default().to_string(),
                    due_at: v["due_at"].as_u64().unwrap_or(0),
                    fired_at: v["fired_at"].as_u64().unwrap_or(0),
                });
            }
        });
        let log = w.log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let mut g = log.lock().unwrap();
                g.push_str(&l);
                g.push('\n');
            }
        });
        let w = Worker {
            child: Some(child),
            ..w
        };
        let ready = wait_until(Duration::from_secs(30), || {
            w.log.lock().unwrap().contains("worker consuming")
        })
        .await;
        assert!(ready, "the worker did not start:\n{}", w.log());
        w
    }
}

impl Drop for Fault {
    fn drop(&mut self) {
        // a failed test may have left a node down: deleting quorum queues with a member down
        // takes a timeout per queue, so start it first
        if std::thread::panicking()
            && let Err(e) = cluster_up()
        {
            eprintln!("[{}] {e}", self.name);
        }
        let teardown = |args: &[&str]| {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
                .arg("--config")
                .arg(&self.config)
                .arg("--url")
                .arg(urls())
                .args(args)
                .env("AMQP_DELAY_MANAGEMENT_URL", management_url())
                .stdin(Stdio::null())
                .output();
            match out {
                Ok(o) if o.status.success() => {}
                Ok(o) => eprintln!(
                    "[{}] clean-up `{}` failed: {}",
                    self.name,
                    args.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
                Err(e) => eprintln!("[{}] clean-up: {e}", self.name),
            }
        };
        if std::thread::panicking() && std::env::var_os("FAULT_KEEP_FAILED").is_some() {
            // post-mortem: the failed scenario's queues stay for `cluster.sh ctl`
            eprintln!(
                "[{}] FAULT_KEEP_FAILED: prefix {} left on the cluster",
                self.name, self.prefix
            );
            return;
        }
        if !self.destinations.is_empty() {
            let mut args = vec!["teardown", "--force"];
            for q in &self.destinations {
                args.extend(["--queue", q.as_str()]);
            }
            teardown(&args);
        }
        teardown(&["teardown", "--force"]);
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        let _ = std::fs::remove_file(&self.config);
        eprintln!("[{}] took {:?}", self.name, self.started.elapsed());
        if FINISHED.fetch_add(1, Ordering::SeqCst) + 1 == TESTS
            && std::env::var_os("FAULT_KEEP_CLUSTER").is_none()
        {
            match cluster_sh(&["down"]) {
                Ok(_) => eprintln!("[fault] last test done: cluster stopped"),
                Err(e) => eprintln!("[fault] stopping the cluster failed: {e}"),
            }
        }
    }
}

/// A finished CLI run.
#[derive(Debug)]
pub(crate) struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub(crate) async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Reads a child's pipe to its end in a task of its own, so what it printed can be shown even
/// when the child is killed for taking too long.
fn drain<R>(pipe: Option<R>) -> tokio::task::JoinHandle<String>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut p, &mut buf).await;
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}
