//! `delay-console` in a real browser: headless Chromium through chromedriver, a real
//! broker, the real binaries; the console follows the journal into its own index. 300 messages
//! wait for A and 200 for B; a person logs in with the broker's guest credentials, sees A with
//! 300 and B with 200, searches `b-7`, sees its destination and due time, cancels it from its
//! page, and a worker never runs it (while b-8, due at the same time, runs); b-9 is moved
//! earlier from its page and runs then; A is purged after a confirmation that counts 300.
//! Without credentials the console answers 401, with TLS it serves HTTPS only, and the
//! browser's console logs no error. A screenshot of each page goes to
//! `target/console-screenshots/`.
//!
//! The test FAILS (never skips) when the broker, chromedriver or Chromium is missing.

mod browser;
// the integration suite's harness (a real broker, a random prefix, clean-up); the console's
// test uses a few of its pieces
#[allow(dead_code)]
#[path = "../it/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Message, QueueType, TopologySettings};
use browser::{Browser, free_port};
use fantoccini::Locator;
use harness::{Env, broker_url};
use tokio::io::AsyncBufReadExt;

/// Delays up to 15 minutes in 100 ms units, radix 4: seven levels of three quorum queues.
fn console_topology() -> TopologySettings {
    TopologySettings {
        radix: 4,
        unit: DurationMs(100),
        max_delay: DurationMs(15 * 60_000),
        fixed_levels: vec![],
        fixed_shards: 1,
        queue_type: QueueType::Quorum,
        max_tier_length: None,
        max_tier_ttl: DurationMs(3_600_000),
    }
}

/// Where the screenshots go: `target/console-screenshots/`.
fn screenshots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots")
}

/// A running `delay-console`, killed on drop.
struct ConsoleProc {
    child: tokio::process::Child,
    port: u16,
    log: PathBuf,
}

impl ConsoleProc {
    async fn start(env: &Env, cfg: &Path, index: &Path, extra: &[&str]) -> ConsoleProc {
        let port = free_port();
        let log = harness::temp_path(&env.settings.prefix, &format!("console-{port}.log"));
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-console"))
            .arg("--config")
            .arg(cfg)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--index")
            .arg(index)
            .args(extra)
            .env("AMQP_URL", broker_url())
            .env("RUST_LOG", "warn,amqp_delay=info,amqp_delay_cli=info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("starting delay-console");
        ConsoleProc { child, port, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the console answers /healthz on `scheme` (curl, which the TLS check needs
    /// anyway), or fails with its log.
    async fn wait_ready(&mut self, scheme: &str, ca: Option<&Path>) {
        let started = Instant::now();
        loop {
            let mut c = std::process::Command::new("curl");
            c.args(["-s", "-o", "/dev/null", "-w", "%{http_code}"]);
            if let Some(ca) = ca {
                c.arg("--cacert").arg(ca);
            }
            c.arg(format!("{scheme}://localhost:{}/healthz", self.port));
            let code = c
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string());
            if code.is_ok_and(|c| c == "200") {
                eprintln!("console ready in {:?}", started.elapsed());
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("delay-console exited ({status}):\n{}", self.log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "delay-console did not answer within 30 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `curl` of `url` with `args`: (HTTP status, body).
fn curl(url: &str, args: &[&str]) -> (String, String) {
    let out = std::process::Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}"])
        .args(args)
        .arg(url)
        .output()
        .expect("curl (apt-get install -y curl)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.to_string(), body.to_string())
}

/// Starts `delay-consumer --log` on `queue`: the ids it runs arrive on the returned lines.
fn worker(cfg: &Path, queue: &str) -> (tokio::process::Child, tokio::sync::mpsc::Receiver<String>) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(cfg)
        .args(["--queue", queue, "--log"])
        .env("AMQP_URL", broker_url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starting delay-consumer");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(out).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let id = serde_json::from_str::<serde_json::Value>(&l)
                .ok()
                .and_then(|v| v["id"].as_str().map(str::to_string))
                .unwrap_or_default();
            if tx.send(id).await.is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// The number in the pending column of `dest`'s row of the first page.
fn pending_of(html: &str, dest: &str) -> Option<u64> {
    let at = html.find(&format!(">{dest}</a>"))?;
    let rest = &html[at..];
    let cell = rest.find("class=\"num pending\">")? + "class=\"num pending\">".len();
    let text: String = rest[cell..]
        .split('<')
        .next()?
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    text.parse().ok()
}

/// The first element `locator` finds, waiting up to 10 s for the page to show it.
async fn wait_for(c: &fantoccini::Client, locator: Locator<'_>) -> fantoccini::elements::Element {
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(locator)
        .await
        .unwrap_or_else(|e| panic!("{locator:?} did not show within 10 s: {e}"))
}

/// The text of the first element `css` finds (waiting for it).
async fn text_of(c: &fantoccini::Client, css: &str) -> String {
    wait_for(c, Locator::Css(css)).await.text().await.unwrap()
}

/// Clicks the first element `locator` finds.
async fn click(c: &fantoccini::Client, locator: Locator<'_>) {
    wait_for(c, locator).await.click().await.unwrap();
}

/// Declares `b` for a worker (its parking queue too).
async fn declare_for_worker(env: &mut Env, cfg: &Path, b: &str) {
    let declared = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(cfg)
        .args(["declare", "--queue", b, "--worker"])
        .env("AMQP_URL", broker_url())
        .output()
        .await
        .unwrap();
    assert!(
        declared.status.success(),
        "{}",
        String::from_utf8_lossy(&declared.stderr)
    );
    env.parked_queue(b);
}

/// Schedules 300 messages `a-N` for `a` and 200 `b-N` for `b`, due in 10 minutes, but b-7
/// and b-8 in 40 seconds: `(queue, id, due)` of each.
async fn schedule_500(env: &Env, a: &str, b: &str) -> Vec<(String, String, u64)> {
    let p = env.publisher().await;
    let mut sent = Vec::new();
    for (q, prefix, n) in [(a, "a", 300), (b, "b", 200)] {
        let msgs: Vec<Message> = (0..n)
            .map(|i| {
                let soon = prefix == "b" && (i == 7 || i == 8);
                let delay = if soon { 40_000 } else { 600_000 };
                Message::new(q, delay, format!("{prefix}-{i}")).with_id(format!("{prefix}-{i}"))
            })
            .collect();
        for r in p.schedule_batch(msgs).await {
            let s = r.expect("scheduled");
            sent.push((q.to_string(), s.message_id, s.due_at_ms));
        }
    }
    p.close().await;
    sent
}

/// Opens the first page as guest until it shows A with 300 and B with 200 (within 30 s).
async fn first_page_shows_300_and_200(browser: &Browser, login: &str, a: &str, b: &str) {
    let started = Instant::now();
    let mut html = String::new();
    while started.elapsed() < Duration::from_secs(30) {
        browser.client.goto(login).await.unwrap();
        html = browser.source().await;
        if pending_of(&html, a) == Some(300) && pending_of(&html, b) == Some(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("A and B listed after {:?}", started.elapsed());
    assert_eq!(pending_of(&html, a), Some(300), "{html}");
    assert_eq!(pending_of(&html, b), Some(200), "{html}");
}

/// Lists `b`, searches b-7, checks its destination and due time, cancels it from its page.
async fn search_and_cancel_b7(browser: &Browser, base: &str, b: &str, b7_due: u64) {
    let c = &browser.client;
    click(c, Locator::LinkText(b)).await;
    let list = browser.source().await;
    assert!(
        list.contains(">b-7</a>") && list.contains(">b-8</a>"),
        "{list}"
    );
    browser.screenshot("2-pending-of-b").await;
    let field = c
        .find(Locator::Css("form.search input[name=id]"))
        .await
        .unwrap();
    field.send_keys("b-7").await.unwrap();
    click(c, Locator::Css("form.search button[type=submit]")).await;
    assert_eq!(text_of(c, "td.id").await, "b-7");
    assert_eq!(text_of(c, "td.destination").await, b);
    let due = text_of(c, "td.due").await;
    let expected = amqp_delay_cli::console::view::time(b7_due);
    assert!(
        due.starts_with(&expected),
        "due '{due}', expected {expected}"
    );
    browser.screenshot("3-message-b-7").await;
    click(c, Locator::Id("cancel")).await;
    let done = text_of(c, "main p.notice").await;
    assert!(done.starts_with("Cancelled 'b-7'"), "{done}");
    browser.screenshot("4-cancelled").await;
    // the index learns it from the control stream
    let started = Instant::now();
    let mut state = String::new();
    while started.elapsed() < Duration::from_secs(20) {
        c.goto(&format!("{base}/message?id=b-7")).await.unwrap();
        state = text_of(c, "article.message td.state").await;
        if state == "cancelled" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eprintln!("b-7 shown cancelled after {:?}", started.elapsed());
    assert_eq!(state, "cancelled");
    browser.screenshot("5-b-7-cancelled").await;
}

/// Moves b-9 (due in 10 minutes, its body kept) to 10 s from now, from its page.
async fn reschedule_b9_earlier(browser: &Browser, base: &str) {
    let c = &browser.client;
    c.goto(&format!("{base}/message?id=b-9")).await.unwrap();
    let at = wait_for(
        c,
        Locator::Css("form[action='/message/reschedule'] input[name=at]"),
    )
    .await;
    at.send_keys("+10s").await.unwrap();
    click(c, Locator::Css("form[action='/message/reschedule'] button")).await;
    let done = text_of(c, "main p.notice").await;
    assert!(done.starts_with("Rescheduled 'b-9'"), "{done}");
    browser.screenshot("6-b-9-rescheduled").await;
}

/// Purges A from its confirmation page (which counts 300); the first page then shows none.
async fn purge_a(browser: &Browser, base: &str, a: &str) {
    let c = &browser.client;
    c.goto(&format!("{base}/purge?queue={a}")).await.unwrap();
    assert_eq!(text_of(c, "#purge-count").await, "300");
    browser.screenshot("7-purge-confirmation").await;
    click(c, Locator::Css("form[action='/purge'] button")).await;
    let done = text_of(c, "main p.notice").await;
    assert!(done.contains("300 pending messages covered"), "{done}");
    let started = Instant::now();
    loop {
        c.goto(&format!("{base}/")).await.unwrap();
        let html = browser.source().await;
        if pending_of(&html, a).is_none_or(|n| n == 0) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "A still pending: {html}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "A gone from the first page {:?} after the purge",
        started.elapsed()
    );
    browser.screenshot("8-after-purge").await;
}

/// Waits until b-8 ran (and 5 s more): b-7 must not have, b-9 (moved earlier) must have.
async fn b8_runs_and_b7_never(ran: &mut tokio::sync::mpsc::Receiver<String>, b7_due: u64) {
    let wait = Duration::from_millis(b7_due.saturating_sub(now_ms()) + 30_000);
    let deadline = Instant::now() + wait;
    let mut seen: Vec<String> = Vec::new();
    let mut linger = None;
    while Instant::now() < linger.unwrap_or(deadline) {
        if let Ok(Some(id)) = tokio::time::timeout(Duration::from_millis(500), ran.recv()).await {
            seen.push(id);
        }
        if linger.is_none() && seen.iter().any(|id| id == "b-8") {
            // a few seconds more for a b-7 that would run late
            linger = Some(Instant::now() + Duration::from_secs(5));
        }
    }
    assert!(seen.iter().any(|id| id == "b-8"), "b-8 never ran: {seen:?}");
    assert!(
        seen.iter().any(|id| id == "b-9"),
        "the rescheduled b-9 never ran: {seen:?}"
    );
    assert!(
        !seen.iter().any(|id| id == "b-7"),
        "the cancelled b-7 ran: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_sees_searches_and_cancels_in_chromium() {
    let mut env = Env::new(console_topology()).await;
    let a = env.queue("a").await;
    let b = env.queue("b").await;
    let cfg = env.write_config("");
    declare_for_worker(&mut env, &cfg, &b).await;
    // the journal keeps bodies, so that b-9 can be moved earlier
    env.settings.journal.keep_body = true;
    let sent = schedule_500(&env, &a, &b).await;
    let b7_due = sent.iter().find(|(_, id, _)| id == "b-7").unwrap().2;
    let index = harness::temp_path(&env.settings.prefix, "index.db");
    let mut console = ConsoleProc::start(&env, &cfg, &index, &[]).await;
    console.wait_ready("http", None).await;
    let base = format!("http://127.0.0.1:{}", console.port);
    // without credentials, or with a wrong password: 401
    assert_eq!(curl(&format!("{base}/"), &[]).0, "401");
    assert_eq!(curl(&format!("{base}/"), &["-u", "guest:wrong"]).0, "401");

    let (worker_proc, mut ran) = worker(&cfg, &b);
    let browser = Browser::start(&screenshots()).await;
    let login = format!("http://guest:guest@127.0.0.1:{}/", console.port);
    first_page_shows_300_and_200(&browser, &login, &a, &b).await;
    let first = browser.screenshot("1-destinations").await;
    search_and_cancel_b7(&browser, &base, &b, b7_due).await;
    reschedule_b9_earlier(&browser, &base).await;
    purge_a(&browser, &base, &a).await;
    // the parked list (empty here)
    browser
        .client
        .goto(&format!("{base}/messages?listing=parked"))
        .await
        .unwrap();
    assert_eq!(text_of(&browser.client, "main h1").await, "Parked messages");
    browser.screenshot("9-parked").await;
    // no JavaScript error, no failed load, in the browser's console
    let logged = browser.console_log().await;
    let errors: Vec<_> = logged
        .iter()
        .filter(|(level, _)| level == "SEVERE")
        .collect();
    assert!(errors.is_empty(), "the browser logged errors: {errors:?}");
    browser.close().await;

    b8_runs_and_b7_never(&mut ran, b7_due).await;
    drop(worker_proc);
    eprintln!(
        "screenshots in {} (first: {})",
        screenshots().display(),
        first.display()
    );
    drop(console);
    let _ = std::fs::remove_file(&index);
    env.cleanup().await;
}

/// A throwaway CA and a server certificate for localhost signed by it, with openssl.
fn make_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let p = |n: &str| dir.join(n);
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(p("ext.cnf"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=amqp-delay console test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "server.pem",
    ]);
    (p("ca.pem"), p("server.pem"), p("server.key"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_certificate_the_console_serves_https_only() {
    let env = Env::new(console_topology()).await;
    let cfg = env.write_config("");
    let dir = harness::temp_path(&env.settings.prefix, "tls");
    let (ca, cert, key) = make_certs(&dir);
    let index = dir.join("index.db");
    let mut console = ConsoleProc::start(
        &env,
        &cfg,
        &index,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    )
    .await;
    console.wait_ready("https", Some(&ca)).await;
    let https = format!("https://localhost:{}/", console.port);
    let ca_arg = ca.to_str().unwrap();
    let (code, body) = curl(&https, &["--cacert", ca_arg, "-u", "guest:guest"]);
    assert_eq!(code, "200", "{body}\n{}", console.log());
    assert!(body.contains("Destinations"), "{body}");
    let (code, _) = curl(&https, &["--cacert", ca_arg]);
    assert_eq!(code, "401");
    // plain HTTP gets no page
    let (code, body) = curl(
        &format!("http://localhost:{}/healthz", console.port),
        &["-m", "5"],
    );
    assert_ne!(code, "200", "{body}");
    // the password is never logged
    let log = console.log();
    assert!(!log.contains("guest:guest"), "{log}");
    drop(console);
    let _ = std::fs::remove_dir_all(&dir);
    env.cleanup().await;
}
