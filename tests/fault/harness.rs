//! The fault suite's harness: a 3-node cluster from `scripts/cluster.sh` (brought up once per
//! binary; a test FAILS with the script's output when it cannot come up), one test at a time,
//! a random prefix `fault-<random>` per test, the binaries run as child processes with every
//! node's URL, and the tally each scenario prints.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Tests in this binary that run by default: the last one to finish tears the cluster down
/// (`kill_node` is `#[ignore]`d; `scripts/test.sh` stops the cluster anyway).
pub const TESTS: usize = 5;
/// Nodes of the cluster.
pub const NODES: usize = 3;
/// The broker's dead-letter confirm timeout the cluster runs with (OPERATIONS.md's setting).
pub const DLX_CONFIRM_TIMEOUT_MS: u64 = 5000;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
static FINISHED: AtomicUsize = AtomicUsize::new(0);
/// Why the cluster did not come up: later tests fail at once with it.
static UP_FAILED: OnceLock<String> = OnceLock::new();

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `scripts/cluster.sh ARGS` (blocking); Ok(stdout) or Err(the whole output).
pub fn cluster_sh(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/cluster.sh"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run scripts/cluster.sh: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "scripts/cluster.sh {} exited with {}\n--- stdout\n{stdout}\n--- stderr\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `cluster.sh ARGS` on a blocking thread; panics with its output when it fails.
pub async fn cluster(args: &[&str]) -> String {
    let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        cluster_sh(&refs)
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The queues under `prefix` that hold anything, as node `via` lists them (name, type, leader,
/// online members, ready, unacknowledged, consumers): where missing messages wait.
pub async fn queue_dump(prefix: &str, via: usize) -> String {
    let via = via.to_string();
    let out = tokio::task::spawn_blocking(move || {
        cluster_sh(&[
            "ctl",
            &via,
            "list_queues",
            "name",
            "type",
            "leader",
            "online",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
            // ready + unacknowledged + dead-lettered by a quorum queue and waiting for its
            // dead-letter worker (3.10's rabbitmqctl cannot show that part alone)
            "messages",
        ])
        .unwrap_or_else(|e| e)
    })
    .await
    .unwrap();
    out.lines()
        .filter(|l| l.contains(prefix))
        .filter(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            f.len() < 8 || f[4] != "0" || f[5] != "0" || f[7] != "0"
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the worker's stall watchdog may add to lateness (it renews a subscription that brought
/// nothing for 10 s while its queue had ready messages, checking every 5 s; see the worker's
/// `STALL_AFTER`): allowed past a bound when the worker's log says it renewed one.
pub const STALL_ALLOWANCE_MS: u64 = 15_000;

/// Every thread's backtrace of process `pid` (gdb), to see where a stalled worker waits.
pub async fn stacks(pid: u32) -> String {
    let out = tokio::process::Command::new("timeout")
        .args([
            "30",
            "gdb",
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt",
        ])
        .output()
        .await;
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(no backtraces: {e})"),
    }
}

/// Nodes on which RabbitMQ's supervisor of quorum queues' dead-letter workers
/// (`rabbit_fifo_dlx_sup`) is gone. RabbitMQ 3.10 gives it up after two worker crashes within
/// 5 s, which leader elections after a restart or a node loss cause (a worker whose queue's
/// leader moved while it registered exits with `ra_command_failed`); it is not restarted.
/// From then on a queue led from that node keeps what it dead-letters (TTL expiry) in its
/// dead-letter buffer: nothing moves on to the next tier, and a new queue whose leader lands
/// there fails to start (`INTERNAL_ERROR` on declare). docs/OPERATIONS.md has the remedy.
pub async fn nodes_without_dlx_supervisor() -> Vec<usize> {
    tokio::task::spawn_blocking(|| {
        (1..=NODES)
            .filter(|i| {
                cluster_sh(&[
                    "ctl",
                    &i.to_string(),
                    "eval",
                    "whereis(rabbit_fifo_dlx_sup).",
                ])
                .is_ok_and(|out| out.trim() == "undefined")
            })
            .collect()
    })
    .await
    .unwrap()
}

/// Nodes leading a queue under `prefix` that holds dead-lettered messages not yet moved on
/// (`messages` above ready + unacknowledged), asked of any node that answers. Called once they
/// should have moved (two dead-letter confirm timeouts after the fault), these are tiers whose
/// dead-letter worker does not run or waits for confirms that never come.
pub async fn leaders_of_waiting_dead_letters(prefix: &str) -> Vec<usize> {
    let prefix = format!("{prefix}.");
    tokio::task::spawn_blocking(move || {
        for via in 1..=NODES {
            let Ok(out) = cluster_sh(&[
                "ctl",
                &via.to_string(),
                "list_queues",
                "name",
                "leader",
                "messages_ready",
                "messages_unacknowledged",
                "messages",
            ]) else {
                continue;
            };
            let mut nodes: Vec<usize> = out
                .lines()
                .filter_map(|l| {
                    let c: Vec<&str> = l.split('\t').collect();
                    if c.len() < 5 || !c[0].starts_with(&prefix) {
                        return None;
                    }
                    let n = |i: usize| c[i].trim().parse::<u64>().unwrap_or(0);
                    let node = (1..=NODES).find(|i| c[1].starts_with(&format!("adfault{i}@")))?;
                    (n(4) > n(2) + n(3)).then_some(node)
                })
                .collect();
            nodes.sort_unstable();
            nodes.dedup();
            return nodes;
        }
        Vec::new()
    })
    .await
    .unwrap()
}

/// The remedy docs/OPERATIONS.md gives for dead-lettered messages that do not move: restart
/// the RabbitMQ application (`stop_app`, `start_app`), one node at a time, of each node that
/// lost its dead-letter supervisor ([`nodes_without_dlx_supervisor`]) or leads a tier whose
/// dead-lettered messages wait ([`leaders_of_waiting_dead_letters`], with `prefix`). The
/// queues' leaders move to other nodes, whose dead-letter workers start afresh and forward
/// what waited, and the node comes back with a new supervisor. Up to 3 rounds, two
/// confirm timeouts apart, while the restarts' own elections leave something behind.
/// Returns the nodes restarted.
pub async fn unstick_dead_letters(who: &str, prefix: Option<&str>) -> Vec<usize> {
    let mut restarted = Vec::new();
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(2 * DLX_CONFIRM_TIMEOUT_MS + 2000)).await;
        }
        let mut nodes = nodes_without_dlx_supervisor().await;
        let no_sup = nodes.clone();
        if let Some(p) = prefix {
            nodes.extend(leaders_of_waiting_dead_letters(p).await);
        }
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.is_empty() {
            break;
        }
        for i in nodes {
            let why = if no_sup.contains(&i) {
                "its dead-letter worker supervisor is gone (3.10: two worker crashes in 5 s)"
            } else {
                "it leads a tier whose dead-lettered messages do not move"
            };
            eprintln!("[{who}] node {i}: {why}; restarting its app (OPERATIONS.md)");
            cluster(&["stop-app", &i.to_string()]).await;
            cluster(&["start-app", &i.to_string()]).await;
            restarted.push(i);
        }
    }
    restarted
}

/// Waits (up to 90 s) until every node can declare a quorum queue: right after a full restart
/// the nodes answer AMQP but refuse declares for a while (`INTERNAL_ERROR`), and a test that
/// starts then fails in its set-up, not in what it tests.
async fn quorum_ready(prefix: &str) -> Result<(), String> {
    use amqp_delay::{QueueType, broker};
    use lapin::options::QueueDeleteOptions;
    let end = Instant::now() + Duration::from_secs(90);
    for i in 1..=NODES {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", port(i));
        loop {
            let attempt = async {
                let conn = amqp_delay::connection::connect(&url, "fault probe")
                    .await
                    .map_err(|e| e.to_string())?;
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                let q = format!("{prefix}.probe{i}");
                let args = broker::queue_type_args(QueueType::Quorum);
                let r = broker::declare_queue(&ch, &q, args).await;
                if r.is_ok() {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                broker::close_connection(&conn, "probed").await;
                r.map_err(|e| amqp_delay::error_chain(&e))
            };
            let last = match tokio::time::timeout(Duration::from_secs(15), attempt).await {
                Ok(Ok(())) => break,
                Ok(Err(e)) => e,
                Err(_) => "no answer in 15 s".to_string(),
            };
            if Instant::now() > end {
                return Err(format!("node {i}: {last}"));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    Ok(())
}

/// Brings the cluster up (idempotent: a healthy one is reused, a dead node is started again).
fn cluster_up() -> Result<(), String> {
    if let Some(e) = UP_FAILED.get() {
        return Err(format!("(it failed before, in an earlier test)\n{e}"));
    }
    let timeout = DLX_CONFIRM_TIMEOUT_MS.to_string();
    cluster_sh(&["--dlx-confirm-timeout", &timeout, "up", &NODES.to_string()])
        .map(|_| ())
        .inspect_err(|e| {
            let _ = UP_FAILED.set(e.clone());
        })
}

pub fn port(i: usize) -> u16 {
    5700 + i as u16
}

/// Every node's URL, comma-separated.
pub fn urls() -> String {
    (1..=NODES)
        .map(|i| format!("amqp://guest:guest@127.0.0.1:{}/%2f", port(i)))
        .collect::<Vec<_>>()
        .join(",")
}

/// Node index of an AMQP port of the cluster.
pub fn node_of_port(p: u16) -> Option<usize> {
    (1..=NODES).find(|&i| port(i) == p)
}

/// One scenario's world. Holding it serialises the tests; dropping it kills the processes it
/// started, deletes what the test declared and, after the last test, stops the cluster.
pub struct Fault {
    pub name: &'static str,
    pub prefix: String,
    pub config: PathBuf,
    pub started: Instant,
    destinations: Vec<String>,
    files: Vec<PathBuf>,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// The topology the scenarios use: 1 ms units, radix 4, no fixed levels, delays up to `max_ms`.
pub fn topology_toml(prefix: &str, max_ms: u64) -> String {
    format!(
        "prefix = \"{prefix}\"\n[topology]\nradix = 4\nunit_ms = 1\nmax_delay = {max_ms}\nfixed_levels = []\n[precision]\nlateness_ms = 0\nlateness_ratio = 0.0\n"
    )
}

impl Fault {
    /// Waits for the other tests, makes sure all nodes are up, picks a prefix and writes a
    /// config with delays up to `max_ms`.
    pub async fn begin(name: &'static str, max_ms: u64) -> Fault {
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

    /// A temp file of this test (deleted at the end).
    pub fn file(&mut self, name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("{}-{name}", self.prefix));
        self.files.push(p.clone());
        p
    }

    /// A destination name `<prefix>-<name>`, removed at the end (with its parking queue).
    pub fn destination(&mut self, name: &str) -> String {
        let q = format!("{}-{name}", self.prefix);
        self.destinations.push(q.clone());
        q
    }

    /// `bin --config CFG --url URLS ARGS...`, output piped.
    pub fn command(&self, bin: &str, args: &[&str]) -> Command {
        let mut c = Command::new(bin);
        c.arg("--config")
            .arg(&self.config)
            .arg("--url")
            .arg(urls())
            .args(args)
            .env_remove("AMQP_DELAY_PREFIX")
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
    /// `unsent` and `maybe`, once it has connected to a node: the child and its pid.
    pub async fn bulk_send(&self, unsent: &Path, maybe: &Path) -> (Child, u32) {
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
    pub async fn send_confirmed(&mut self, name: &str, lines: String, n: usize) {
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
    pub async fn publisher(&self, args: &[&str]) -> Output {
        let t = Instant::now();
        let child = self
            .command(env!("CARGO_BIN_EXE_delay-publisher"), args)
            .spawn()
            .unwrap();
        let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("delay-publisher {args:?} did not finish in 90 s"))
            .unwrap();
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            took: t.elapsed(),
        }
    }

    /// Like [`Fault::publisher`], and asserts that it exited 0.
    pub async fn publisher_ok(&self, args: &[&str]) -> Output {
        let out = self.publisher(args).await;
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
    pub async fn declare(&self, queues: &[&str]) -> Output {
        let mut args = vec!["declare"];
        for q in queues {
            args.extend(["--queue", q]);
        }
        if !queues.is_empty() {
            args.push("--worker");
        }
        self.publisher_ok(&args).await
    }

    /// Starts `delay-consumer --queue Q --log` and waits until it consumes.
    pub async fn worker(&self, queue: &str) -> Worker {
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
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// One line of the worker's `--log`.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub id: String,
    pub due_at: u64,
    pub fired_at: u64,
}

/// A running `delay-consumer --log`.
pub struct Worker {
    pub deliveries: Arc<Mutex<Vec<Delivered>>>,
    log: Arc<Mutex<String>>,
    pub pid: u32,
    child: Option<Child>,
}

impl Worker {
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Whether it renewed a subscription that had stalled (see [`STALL_ALLOWANCE_MS`]).
    pub fn renewed_a_stalled_subscription(&self) -> bool {
        self.log().contains("none has reached this idle worker")
    }

    pub fn delivered(&self) -> Vec<Delivered> {
        self.deliveries.lock().unwrap().clone()
    }

    /// Still running?
    pub fn running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Waits until every id of `ids` was delivered (or `timeout`), then `linger` more for
    /// duplicates; returns whether all came.
    pub async fn wait_for(
        &self,
        ids: &HashSet<String>,
        timeout: Duration,
        linger: Duration,
    ) -> bool {
        let all = wait_until(timeout, || {
            let seen: HashSet<String> = self
                .deliveries
                .lock()
                .unwrap()
                .iter()
                .map(|d| d.id.clone())
                .collect();
            ids.iter().all(|i| seen.contains(i))
        })
        .await;
        tokio::time::sleep(linger).await;
        all
    }

    /// SIGTERM, then waits for it to exit (it acks what it ran).
    pub async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            if tokio::time::timeout(Duration::from_secs(20), c.wait())
                .await
                .is_err()
            {
                let _ = c.kill().await;
            }
        }
    }
}

/// Nodes (1-based) the process `pid` has AMQP connections to, from `ss`.
pub fn nodes_of(pid: u32) -> Vec<usize> {
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .expect("ss (iproute2) is needed by the fault suite");
    let needle = format!("pid={pid},");
    let mut nodes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains(&needle) {
            continue;
        }
        // Recv-Q Send-Q Local:Port Peer:Port Process
        let cols: Vec<&str> = line.split_whitespace().collect();
        if let Some(peer) = cols.get(3)
            && let Some(p) = peer.rsplit(':').next().and_then(|p| p.parse::<u16>().ok())
            && let Some(i) = node_of_port(p)
            && !nodes.contains(&i)
        {
            nodes.push(i);
        }
    }
    nodes
}

/// Local ports of `pid`'s connections to node `node`.
pub fn local_ports(pid: u32, node: usize) -> Vec<u16> {
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .expect("ss");
    let needle = format!("pid={pid},");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let peer: u16 = cols.get(3)?.rsplit(':').next()?.parse().ok()?;
            let local: u16 = cols.get(2)?.rsplit(':').next()?.parse().ok()?;
            (node_of_port(peer) == Some(node)).then_some(local)
        })
        .collect()
}

/// Leaders of the queues under `prefix`, per node (1-based), from `rabbitmqctl list_queues`
/// asked of `via`.
pub async fn leaders(prefix: &str, via: usize) -> HashMap<usize, usize> {
    let out = cluster(&["ctl", &via.to_string(), "list_queues", "name", "leader"]).await;
    let mut m = HashMap::new();
    for line in out.lines() {
        let mut cols = line.split_whitespace();
        let (Some(name), Some(leader)) = (cols.next(), cols.next()) else {
            continue;
        };
        if !name.starts_with(&format!("{prefix}.")) {
            continue;
        }
        if let Some(i) = (1..=NODES).find(|i| leader == format!("adfault{i}@localhost")) {
            *m.entry(i).or_insert(0) += 1;
        }
    }
    m
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// A JSONL request line.
pub fn line(queue: &str, id: &str, delay_ms: u64) -> String {
    format!(r#"{{"queue":"{queue}","delay_ms":{delay_ms},"body":"{id}","id":"{id}"}}"#)
}

/// Ids in a JSONL file (empty when it does not exist).
pub fn ids_in(path: &Path) -> HashSet<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["id"].as_str().map(str::to_string))
        .collect()
}

/// The counts of a bulk send's summary line: (confirmed, invalid, not sent, maybe sent).
/// What a bulk send (`Fault::bulk_send`) ended with.
pub struct BulkOutcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub confirmed: u64,
    pub invalid: u64,
    pub not_sent: u64,
    pub maybe_sent: u64,
    /// Ids in its "not sent" and "maybe sent" files.
    pub unsent_ids: HashSet<String>,
    pub maybe_ids: HashSet<String>,
}

/// Waits (up to 120 s) for a bulk send whose stdin was closed, and reads its summary line and
/// re-send files.
/// Where [`Fault::bulk_send`] writes the send's stderr (beside its `unsent` file).
fn stderr_file(unsent: &Path) -> PathBuf {
    unsent.with_extension("stderr")
}

pub async fn finish_bulk_send(send: Child, unsent: &Path, maybe: &Path) -> BulkOutcome {
    let out = tokio::time::timeout(Duration::from_secs(120), send.wait_with_output())
        .await
        .expect("the bulk send did not finish in 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (confirmed, invalid, not_sent, maybe_sent) = summary(&stdout);
    let stderr = std::fs::read_to_string(stderr_file(unsent)).unwrap_or_default();
    let _ = std::fs::remove_file(stderr_file(unsent));
    BulkOutcome {
        code: out.status.code(),
        stderr,
        stdout,
        confirmed,
        invalid,
        not_sent,
        maybe_sent,
        unsent_ids: ids_in(unsent),
        maybe_ids: ids_in(maybe),
    }
}

pub fn summary(stdout: &str) -> (u64, u64, u64, u64) {
    let l = stdout
        .lines()
        .find(|l| l.contains(" confirmed, "))
        .unwrap_or_else(|| panic!("no summary line in: {stdout}"));
    let nums: Vec<u64> = l
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    // "{c} confirmed, {f} failed ({i} invalid, {n} not sent, {m} maybe sent)"
    assert_eq!(nums.len(), 5, "summary line: {l}");
    (nums[0], nums[2], nums[3], nums[4])
}

/// What a scenario saw: of `scheduled` (confirmed) ids, which were delivered, how often, how late.
#[derive(Debug, Default)]
pub struct Tally {
    pub scheduled: usize,
    pub delivered: usize,
    pub lost: Vec<String>,
    pub duplicates: usize,
    pub early: Vec<(String, i64)>,
    pub worst_lateness_ms: i64,
}

impl Tally {
    /// `deliveries` measured against `scheduled`; deliveries of other ids are ignored.
    pub fn of(scheduled: &HashSet<String>, deliveries: &[Delivered]) -> Tally {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut t = Tally {
            scheduled: scheduled.len(),
            ..Tally::default()
        };
        for d in deliveries {
            if !scheduled.contains(&d.id) {
                continue;
            }
            *seen.entry(d.id.as_str()).or_insert(0) += 1;
            let late = d.fired_at as i64 - d.due_at as i64;
            if late < 0 {
                t.early.push((d.id.clone(), late));
            }
            t.worst_lateness_ms = t.worst_lateness_ms.max(late);
        }
        t.delivered = seen.len();
        t.duplicates = seen.values().map(|n| n - 1).sum();
        let mut lost: Vec<String> = scheduled
            .iter()
            .filter(|i| !seen.contains_key(i.as_str()))
            .cloned()
            .collect();
        lost.sort();
        t.lost = lost;
        t
    }

    /// The scenario's one line, on stderr past the test harness's capture (so it is shown for
    /// passing tests too).
    pub fn print(&self, scenario: &str) {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "FAULT {scenario}: {} scheduled / {} delivered / {} lost / {} duplicates / {} early / worst lateness {} ms",
            self.scheduled,
            self.delivered,
            self.lost.len(),
            self.duplicates,
            self.early.len(),
            self.worst_lateness_ms
        );
    }

    /// Nothing lost, nothing early.
    pub fn assert_sound(&self, scenario: &str) {
        assert!(
            self.lost.is_empty(),
            "{scenario}: {} of {} confirmed messages never arrived, e.g. {:?}",
            self.lost.len(),
            self.scheduled,
            &self.lost[..self.lost.len().min(10)]
        );
        assert!(
            self.early.is_empty(),
            "{scenario}: {} messages early, e.g. {:?}",
            self.early.len(),
            &self.early[..self.early.len().min(10)]
        );
    }
}

/// The reasons a bulk send gave for its failed lines ("line N: " and the prefix taken out),
/// with how often each was given, most frequent first.
pub fn reasons(stderr: &str) -> Vec<(usize, String)> {
    let mut m: HashMap<String, usize> = HashMap::new();
    for l in stderr.lines().filter(|l| l.starts_with("line ")) {
        let reason = l.split_once(": ").map_or(l, |(_, r)| r);
        let reason: String = reason
            .split('\'')
            .map(|w| if w.starts_with("fault-") { "<tier>" } else { w })
            .collect::<Vec<_>>()
            .join("'");
        *m.entry(reason).or_default() += 1;
    }
    let mut v: Vec<(usize, String)> = m.into_iter().map(|(r, n)| (n, r)).collect();
    v.sort_by(|a, b| b.cmp(a));
    v
}
