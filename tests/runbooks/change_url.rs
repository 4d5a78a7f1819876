//! MIGRATING's "Change only the URL", run as written against the broker on 127.0.0.1:5672 (the
//! tools' default URL, user and prefix, as the block gives none): the admin's `declare`, then
//! `delay-proxy --listen 0.0.0.0:5673` in the foreground; a plugin-era application
//! (`tests/py/runbook_app.py`) changes only its URL to the proxy's port, declares its
//! `x-delayed-message` exchange and publishes at once. Every message arrives, none early,
//! none altered, none twice.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use tokio::runtime::Runtime;

use crate::app::{self, Collector};
use crate::markdown;
use crate::shell::{Session, tail};

/// The broker the block's tools reach without a `--url`, as the administrator sees it.
const BROKER: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The application's URL: its old one with the proxy's host and port (the block's comment).
const THROUGH_THE_PROXY: &str = "amqp://guest:guest@127.0.0.1:5673/%2f";

/// Deletes what the application declared and what the block's tools made, however the test
/// ends: the application's exchange and queue, then the pairs and tiers (`teardown`).
struct Cleanup {
    dir: std::path::PathBuf,
    env: Vec<(String, String)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let rt = Runtime::new().unwrap();
        rt.block_on(async {
            let Ok(conn) = lapin::Connection::connect(BROKER, Default::default()).await else {
                return;
            };
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .exchange_delete("orders.delayed".into(), ExchangeDeleteOptions::default())
                    .await;
                let _ = ch
                    .queue_delete(app::QUEUE.into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = conn.close(200, "bye".into()).await;
        });
        let out = std::process::Command::new(self.dir.join("bin").join("delay-publisher"))
            .args(["teardown", "--force"])
            .current_dir(&self.dir)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output();
        if let Ok(o) = out
            && !o.status.success()
        {
            eprintln!(
                "[runbooks] teardown: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

/// Waits until something listens on the proxy's port, or the block ended, or 60 s passed.
fn wait_for_the_proxy(running: &mut crate::shell::Running) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if TcpStream::connect("127.0.0.1:5673").is_ok() {
            return Ok(());
        }
        if let Some(status) = running.child.try_wait().unwrap() {
            return Err(format!(
                "the block ended ({status}) before the proxy listened"
            ));
        }
        if Instant::now() > deadline {
            return Err("the proxy did not listen on 5673 within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn migratings_change_only_the_url_runs_as_written_and_a_plugin_app_gets_every_message() {
    crate::machine_lock();
    let t0 = Instant::now();
    let doc = crate::read_doc("docs/MIGRATING.md");
    let blocks = markdown::sh_blocks(&doc, "Change only the URL").unwrap();
    assert_eq!(blocks.len(), 1, "the section has one sh block");
    let code = &blocks[0].code;
    assert!(
        code.contains("proxy-host:5673"),
        "the block no longer tells the application to use port 5673: {code}"
    );
    let dir = crate::workdir("change-url");
    let env = crate::base_env(&dir);
    let cleanup = Cleanup {
        dir: dir.clone(),
        env: env.clone(),
    };
    let mut session = Session::new(&dir, env);
    let mut running = session.start("MIGRATING's \"Change only the URL\"", code);
    let said = |running: &crate::shell::Running| {
        let read = |p: &std::path::Path| tail(&std::fs::read_to_string(p).unwrap_or_default(), 30);
        format!(
            "--- stdout ---\n{}\n--- stderr ---\n{}",
            read(&running.stdout),
            read(&running.stderr)
        )
    };
    if let Err(e) = wait_for_the_proxy(&mut running) {
        panic!("{e}\n{}", said(&running));
    }

    let rt = Runtime::new().unwrap();
    let mut collector = Collector::new();
    collector.watch(&rt, BROKER.into(), 5672);
    let sent = app::publish(THROUGH_THE_PROXY, "url", 40, (500, 3000), true);
    let got = collector.wait_for(&sent, Duration::from_secs(30), Duration::from_secs(2));
    let (problems, summary) = app::verdict(&sent, &got, 0);
    let stubborn = session.stop_all(Duration::from_secs(90));
    let _ = running.child.wait();
    assert!(
        problems.is_empty(),
        "{problems:?}\n{summary}\n{}",
        said(&running)
    );
    assert!(stubborn.is_empty(), "the proxy ignored SIGTERM for 90 s");
    eprintln!(
        "[runbooks] change only the URL: {summary}; took {:.0}s",
        t0.elapsed().as_secs_f64()
    );
    drop(collector);
    drop(session);
    drop(cleanup);
    let _ = std::fs::remove_dir_all(&dir);
}
