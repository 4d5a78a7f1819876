//! Plugin applications in other languages through the proxy: pika (`tests/py/plugin_app.py`)
//! and amqplib (`tests/js/plugin_app.js`), unchanged but for their URL.

use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pika_app_of_the_plugin_works_through_the_proxy() {
    within(pika_body()).await;
}

async fn pika_body() {
    require_pika();
    let w = World::new(&["direct", "topic"]).await;
    let (d_x, t_x) = (w.exchange("direct"), w.exchange("topic"));
    let p = w.env.settings.prefix.clone();
    // the proxy listens before the app connects (pika tries once: it failed once in CI)
    let _ = w.proxy.connect().await.close(200, "bye".into()).await;
    // the app declares both exchanges itself; the gateway starts serving each pair once the
    // proxy registered it (what arrives before waits in the ingress queue)
    let app = start_app_at(
        "routing",
        serde_json::json!({
            "prefix": p,
            "declare": true,
            "direct": {"ingress": d_x, "target": d_x},
            "topic": {"ingress": t_x, "target": t_x},
            "timeout": 30,
        }),
        &w.proxy.url(),
    );
    let report = finish(app, &[&w.proxy]).await;
    assert_eq!(report["published"], 9, "{report}\n{}", w.logs());
    assert_eq!(report["received"], 10, "{report}\n{}", w.logs());
    let edges = start_app_at(
        "edges",
        serde_json::json!({"prefix": p, "declare": true, "ingress": d_x, "target": d_x}),
        &w.proxy.url(),
    );
    let report = finish(edges, &[&w.proxy]).await;
    assert_eq!(report["published"], 8, "{report}\n{}", w.logs());
    w.env.cleanup().await;
}

/// amqplib in a directory of its own (installed with npm the first time): never skipped.
fn amqplib() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join("amqp-delay-tests-amqplib");
    let modules = dir.join("node_modules");
    if !modules.join("amqplib").exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let ok = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .arg("amqplib")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "NODE WITH AMQPLIB IS REQUIRED: `npm install amqplib` into {} failed",
            dir.display()
        );
    }
    modules
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amqplib_app_of_the_plugin_works_through_the_proxy() {
    within(amqplib_body()).await;
}

async fn amqplib_body() {
    let modules = amqplib();
    let w = World::new(&["node"]).await;
    let x = w.exchange("node");
    let _ = w.proxy.connect().await.close(200, "bye".into()).await;
    let app = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/js/plugin_app.js");
    let cfg =
        serde_json::json!({"exchange": x, "queue": format!("{}-node-app", w.env.settings.prefix)});
    let run = tokio::process::Command::new("node")
        .arg(app)
        .arg(cfg.to_string())
        .env("AMQP_URL", w.proxy.url())
        .env("NODE_PATH", &modules)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the Node app did not finish within 60 s")
        .expect("starting node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the Node app failed: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        w.logs()
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        report["errors"],
        serde_json::json!([]),
        "{report}\n{}",
        w.logs()
    );
    assert_eq!(
        (report["published"].as_u64(), report["received"].as_u64()),
        (Some(6), Some(6))
    );
    w.env.cleanup().await;
}
