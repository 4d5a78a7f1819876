//! `delay-bench --quick` with a tiny N against the real broker: the JSON has the promised shape,
//! nothing was lost, duplicated beyond the report or early, every message took exactly its
//! planned hops, and the run deleted what it declared. No timing assertions. Fails (never skips)
//! when no broker answers.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::Value;

use crate::harness::broker_url;

fn number(v: &Value, path: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_run_reports_every_scenario_and_loses_nothing() {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-bench"))
        .args([
            "--quick",
            "--json",
            "-n",
            "300",
            "--lateness-secs",
            "1",
            "--max-delay",
            "1s",
        ])
        .env("AMQP_URL", broker_url())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(Duration::from_secs(120), child).await {
        Ok(r) => r.expect("delay-bench runs"),
        Err(_) => panic!("delay-bench did not finish within 120 s: is the broker answering?"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "delay-bench failed ({}); this test needs a real broker (./scripts/test.sh starts one):\n{stderr}",
        out.status
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });

    assert_eq!(report["ok"], Value::Bool(true), "{}", report["problems"]);
    assert_eq!(report["problems"], serde_json::json!([]));
    assert!(number(&report["raw_msgs_per_s"], "raw_msgs_per_s") > 0.0);
    assert_eq!(report["raw"]["lost"], 0);

    for name in ["fixed", "uniform", "mix", "binary"] {
        let s = &report["scenarios"][name];
        assert!(s.is_object(), "scenario {name} missing: {report}");
        assert!(number(&s["msgs_per_s"], "msgs_per_s") > 0.0, "{name}");
        number(&s["ratio_to_raw"], "ratio_to_raw");
        let hops = number(&s["avg_hops"], "avg_hops");
        // the broker routed every message through exactly the tiers the planner chose
        let observed = number(&s["observed_avg_hops"], "observed_avg_hops");
        assert!(
            (hops - observed).abs() < 0.01,
            "{name}: planned {hops} hops, took {observed}"
        );
        let l = &s["lateness_ms"];
        for k in ["min", "p50", "p99", "p999", "max"] {
            number(&l[k], k);
        }
        assert!(
            number(&l["min"], "min") >= 0.0,
            "{name}: a message arrived early: {l}"
        );
        assert!(number(&l["samples"], "samples") > 0.0, "{name}");
        assert_eq!(s["lost"], 0, "{name} lost messages");
        assert_eq!(s["early"], 0, "{name} delivered early");
        assert_eq!(s["publish_errors"], 0, "{name}");
    }
    assert_eq!(report["scenarios"]["fixed"]["avg_hops"], 1.0);
    assert_eq!(report["scenarios"]["binary"]["radix"], 2);

    // everything the run declared is gone
    let prefix = report["config"]["prefix"].as_str().expect("prefix");
    assert!(prefix.starts_with("bench-"), "{prefix}");
    let conn = amqp_delay::connection::connect(&broker_url(), "bench smoke test")
        .await
        .expect("connect");
    for marker in [format!("{prefix}.layout"), format!("{prefix}-r2.layout")] {
        let ch = conn.create_channel().await.expect("channel");
        let r = ch
            .queue_declare(
                marker.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        assert!(r.is_err(), "'{marker}' still exists after the run");
    }
    let _ = conn.close(200, "bye".into()).await;
}
