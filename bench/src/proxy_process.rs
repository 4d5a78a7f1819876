//! The `proxy` scenario's `delay-proxy`: the binary beside `delay-bench` (as the build puts
//! them, `target/release/`), started as its own process on a free local port, with the bench's
//! settings for its prefix (a private config file, read at its start and removed once it
//! listens; the broker URL, credentials and all, only in its environment), and stopped with
//! SIGTERM as an operator stops it. Its log stays out of the bench's output, except warnings and
//! errors, and its last lines explain a proxy that did not start.

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use amqp_delay::settings::SettingsError;
use amqp_delay::{Error, Result, Settings};

/// What the proxy logs when it accepts clients.
const LISTENING: &str = "delay-proxy listening";
/// Its log filter: the tools' default, and the binary's own `info` line [`LISTENING`].
const LOG_FILTER: &str = "warn,lapin::channel=off,amqp_delay=info,delay_proxy=info";
/// How long it may take to start (it reads the control stream first).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of its log kept to explain a failure.
const KEPT_LINES: usize = 20;

fn invalid(why: String) -> Error {
    SettingsError::Invalid(why).into()
}

/// A running `delay-proxy` child.
pub(crate) struct ProxyProcess {
    child: Child,
    /// The URL its clients use: the broker URL's credentials and virtual host, its address.
    pub(crate) url: String,
    log: Arc<Mutex<VecDeque<String>>>,
}

/// The `delay-proxy` beside the running `delay-bench`.
pub(crate) fn binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| invalid(format!("where delay-bench runs from: {e}")))?;
    let bin = exe.with_file_name("delay-proxy");
    if !bin.is_file() {
        return Err(invalid(format!(
            "the proxy scenario runs {} (beside delay-bench), which does not exist: build it \
             (`cargo build --release -p amqp-delay-bench -p amqp-delay-cli`) or give --proxy-url \
             of a running delay-proxy",
            bin.display()
        )));
    }
    Ok(bin)
}

impl ProxyProcess {
    /// Starts `bin` for `settings` (the prefix and topology it serves; the broker of its
    /// `url`) and waits until it listens.
    pub(crate) async fn start(bin: &Path, settings: &Settings) -> Result<ProxyProcess> {
        let port = free_port()?;
        let url = client_url(&settings.url, port)?;
        let dir = PrivateDir::new()?;
        let config = dir.write("delay-proxy.toml", &config_text(settings)?)?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--drain-timeout", "2s", "--log-format", "human"])
            .env("AMQP_URL", &settings.url)
            .env("RUST_LOG", LOG_FILTER)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // the file is the proxy's whole configuration: none of the bench's own variables
        for (k, _) in std::env::vars_os() {
            if k.to_str().is_some_and(|k| k.starts_with("AMQP_DELAY_")) {
                cmd.env_remove(k);
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| invalid(format!("starting {}: {e}", bin.display())))?;
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (ready, listening) = oneshot::channel();
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(read_log(stderr, log.clone(), ready));
        }
        let mut p = ProxyProcess { child, url, log };
        let started = tokio::select! {
            r = listening => r.is_ok(),
            _ = p.child.wait() => false,
            _ = tokio::time::sleep(START_TIMEOUT) => false,
        };
        drop(dir);
        if !started {
            let _ = p.child.start_kill();
            return Err(invalid(format!(
                "delay-proxy did not start within {} s; its last lines:\n{}",
                START_TIMEOUT.as_secs(),
                p.last_lines()
            )));
        }
        Ok(p)
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn last_lines(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Stops it as an operator does (SIGTERM: it closes its clients and lets its gateway
    /// finish), killing it after a minute; what went wrong, if anything.
    pub(crate) async fn stop(mut self) -> Option<String> {
        let Some(pid) = self.child.id() else {
            return Some(format!("delay-proxy had ended:\n{}", self.last_lines()));
        };
        let pid = rustix::process::Pid::from_raw(pid as i32);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => None,
            Ok(Ok(status)) => Some(format!(
                "delay-proxy ended with {status}:\n{}",
                self.last_lines()
            )),
            Ok(Err(e)) => Some(format!("waiting for delay-proxy: {e}")),
            Err(_) => {
                let _ = self.child.kill().await;
                Some("delay-proxy did not stop within 60 s of SIGTERM: killed".into())
            }
        }
    }
}

/// Reads the proxy's log: keeps its last lines, says when it listens, shows its warnings and
/// errors.
async fn read_log(
    stderr: tokio::process::ChildStderr,
    log: Arc<Mutex<VecDeque<String>>>,
    ready: oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.contains(LISTENING)
            && let Some(r) = ready.take()
        {
            let _ = r.send(());
        }
        if line.contains("WARN") || line.contains("ERROR") {
            eprintln!("delay-proxy: {line}");
        }
        let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() == KEPT_LINES {
            l.pop_front();
        }
        l.push_back(line);
    }
}

/// A local port free now (the proxy binds it a moment later).
fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| invalid(format!("finding a free port for delay-proxy: {e}")))
}

/// The first of `urls` with the address of a local proxy on `port`: how its clients reach it.
pub(crate) fn client_url(urls: &str, port: u16) -> Result<String> {
    let first = amqp_delay::ops::connection::split_urls(urls)
        .first()
        .cloned()
        .unwrap_or_default();
    let mut url = url::Url::parse(&first).map_err(|e| {
        invalid(format!(
            "the broker URL '{}' does not parse: {e}",
            amqp_delay::ops::connection::redact_url(&first)
        ))
    })?;
    if url.set_host(Some("127.0.0.1")).is_err() || url.set_port(Some(port)).is_err() {
        return Err(invalid(
            "the broker URL cannot take the proxy's address".into(),
        ));
    }
    Ok(url.to_string())
}

/// `settings` as a config file, without what must not be written down or shared: the URL
/// (given in the environment), the management URL, a metrics address.
fn config_text(settings: &Settings) -> Result<String> {
    let mut s = settings.clone();
    s.url = amqp_delay::ops::connection::redact_url(&s.url);
    s.management_url = None;
    s.metrics_addr = None;
    toml::to_string(&s).map_err(|e| invalid(format!("writing delay-proxy's settings: {e}")))
}

/// A directory only we can read, removed with what is in it when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> Result<PrivateDir> {
        use std::os::unix::fs::DirBuilderExt as _;
        let path =
            std::env::temp_dir().join(format!("delay-bench-proxy-{:016x}", rand::random::<u64>()));
        // a fresh name, created here: an existing path (a planted one) is an error
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| invalid(format!("creating {}: {e}", path.display())))?;
        Ok(PrivateDir(path))
    }

    /// Writes a new file `name` (0600) in it.
    fn write(&self, name: &str, text: &str) -> Result<PathBuf> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let path = self.0.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| invalid(format!("writing {}: {e}", path.display())))?;
        Ok(path)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_file_gives_back_the_settings_without_secrets() {
        let mut s = Settings {
            url: "amqp://app:secret@broker:5672/v".into(),
            prefix: "bench-1-px".into(),
            metrics_addr: Some("127.0.0.1:9000".into()),
            ..Settings::default()
        };
        s.topology.max_delay = amqp_delay::time::DurationMs(5_000);
        s.topology.fixed_levels.clear();
        let text = config_text(&s).unwrap();
        assert!(!text.contains("secret"), "{text}");
        let dir = PrivateDir::new().unwrap();
        let file = dir.write("s.toml", &text).unwrap();
        let back = Settings::load_with_env(Some(&file), Some(Default::default())).unwrap();
        assert_eq!(back.topology, s.topology);
        assert_eq!(back.prefix, s.prefix);
        assert_eq!(back.gateway, s.gateway);
        assert_eq!(back.metrics_addr, None);
        // a name that exists already is not written through
        assert!(dir.write("s.toml", "x").is_err());
        let path = dir.0.clone();
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn clients_reach_the_proxy_with_the_brokers_credentials() {
        let url = client_url("amqp://u:p@h:5672/%2f,amqp://u:p@g:5672/%2f", 5999).unwrap();
        assert_eq!(url, "amqp://u:p@127.0.0.1:5999/%2f");
    }
}
