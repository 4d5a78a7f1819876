//! Headless Chromium driven over WebDriver: Debian's `chromium` and `chromium-driver`
//! (`/usr/bin/chromedriver`), through the `fantoccini` client. Missing either FAILS the test
//! loudly with what to install (`scripts/test.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use axum::http::Method;
use fantoccini::wd::{Capabilities, WebDriverCompatibleCommand};
use fantoccini::{Client, ClientBuilder};
use serde_json::{Value, json};

pub(crate) const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
pub(crate) const CHROMIUM: &str = "/usr/bin/chromium";

/// A running chromedriver and one browser session on it.
pub(crate) struct Browser {
    pub client: Client,
    driver: tokio::process::Child,
    shots: PathBuf,
}

/// A free TCP port on 127.0.0.1 (bound, then released for the process that takes it).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The browser's console messages (chromedriver's log of type "browser").
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/se/log",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (Method, Option<String>) {
        (Method::POST, Some(r#"{"type":"browser"}"#.into()))
    }
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session; screenshots go to
    /// `shots`.
    pub(crate) async fn start(shots: &Path) -> Browser {
        for (what, path, package) in [
            ("chromedriver", CHROMEDRIVER, "chromium-driver"),
            ("Chromium", CHROMIUM, "chromium"),
        ] {
            assert!(
                Path::new(path).exists(),
                "NO {what} AT {path}: this test drives a real browser; install it with \
                 `apt-get install -y chromium chromium-driver` (scripts/test.sh does)"
            );
            let _ = package;
        }
        std::fs::create_dir_all(shots).unwrap();
        let port = free_port();
        let driver = tokio::process::Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("starting chromedriver");
        let mut caps = Capabilities::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                         "--disable-gpu", "--window-size=1280,1000", "--lang=en-US"]
            }),
        );
        caps.insert("goog:loggingPrefs".into(), json!({ "browser": "ALL" }));
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                Err(e) if started.elapsed() < Duration::from_secs(30) => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("no WebDriver session from {CHROMEDRIVER} on {url}: {e}"),
            }
        };
        Browser {
            client,
            driver,
            shots: shots.to_path_buf(),
        }
    }

    /// Saves a screenshot of the page as `<name>.png`; returns its path.
    pub(crate) async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }

    /// The page's HTML.
    pub(crate) async fn source(&self) -> String {
        self.client.source().await.expect("the page source")
    }

    /// The browser console's messages since the last call: `(level, message)`.
    pub(crate) async fn console_log(&self) -> Vec<(String, String)> {
        let v = self
            .client
            .issue_cmd(BrowserLog)
            .await
            .expect("chromedriver's browser log");
        match v {
            Value::Array(entries) => entries
                .iter()
                .map(|e| {
                    (
                        e["level"].as_str().unwrap_or_default().to_string(),
                        e["message"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect(),
            other => panic!("the browser log is not a list: {other}"),
        }
    }

    /// Ends the session and chromedriver.
    pub(crate) async fn close(mut self) {
        let _ = self.client.close().await;
        let _ = self.driver.start_kill();
        let _ = self.driver.wait().await;
    }
}
