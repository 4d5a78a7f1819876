//! `delay-bench --quick` with a tiny N against the real broker, every scenario but the plugin's
//! (the batched ones through the library's worker, relay and gateway in process, the proxy's
//! through the `delay-proxy` binary beside `delay-bench`): the JSON has the promised shape,
//! nothing was lost, duplicated beyond the report or early, every unbatched message took exactly
//! its planned hops, the batched scenarios packed messages into fewer broker messages, and the
//! run deleted what it declared. No timing assertions. Fails (never skips) when no broker answers
//! at `AMQP_URL` (the library's default URL when unset, as in the product's suites; `./scripts/test.sh`
//! starts one).

use std::time::Duration;

use serde_json::Value;

use amqp_delay::layout::{Layout, TopologySettings};

/// The broker under test: `AMQP_URL`, else the library's default, as the suites in `tests/` pick it.
fn broker_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| amqp_delay::settings::DEFAULT_URL.into())
}

fn number(v: &Value, path: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number: {v}"))
}

/// Runs `delay-bench --json` with `args` against the test broker: the report it printed.
async fn bench(args: &[&str]) -> Value {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-bench"))
        .arg("--json")
        .args(args)
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
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Every scenario, then a sustained run. Each test of this file is its own benchmark run
/// under a prefix of its own, and none asserts a time, so they may run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_run_reports_every_scenario_and_loses_nothing() {
    let report = bench(&[
        "--quick",
        "-n",
        "300",
        "--lateness-secs",
        "0.5",
        "--max-delay",
        "500ms",
        // every scenario: the default run leaves out uniform_batched, relay and gateway_long
        "--scenarios",
        "raw,fixed,uniform,mix,binary,fixed_batched,uniform_batched,relay,gateway,gateway_long",
    ])
    .await;
    check_every_scenario(&report).await;
    let sustained = bench(&[
        "--quick",
        "-n",
        "300",
        "--lateness-secs",
        "0.5",
        "--max-delay",
        "500ms",
        "--scenarios",
        "raw,fixed_batched",
        "--sustained",
        "--probes",
        "2",
        "--probe-secs",
        "0.3",
    ])
    .await;
    check_sustained(&sustained);
}

/// A plugin-era application through delay-proxy: the binary beside delay-bench, which cargo
/// builds with the cli package's suites (the plugin scenario needs a node with the plugin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_scenario_delivers_everything_and_cleans_up() {
    let proxy = bench(&[
        "--quick",
        "-n",
        "200",
        "--lateness-secs",
        "0.5",
        "--scenarios",
        "raw,proxy",
    ])
    .await;
    check_proxy(&proxy).await;
}

/// Recurring schedules through a `recurring serve` child (the delay-publisher beside the
/// bench): one minute of 120 schedules' ticks, each delivered once, none early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recurring_benchmark_sees_every_tick_once() {
    check_recurring(&recurring_bench().await);
}

/// `delay-bench-recurring --json` of 120 schedules, one measured minute after 5 s.
async fn recurring_bench() -> Value {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-bench-recurring"))
        .args(["--json", "-n", "120", "--minutes", "1", "--warmup", "5"])
        .args(["--ahead", "5"])
        .env("AMQP_URL", broker_url())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(Duration::from_secs(240), child).await {
        Ok(r) => r.expect("delay-bench-recurring runs"),
        Err(_) => panic!("delay-bench-recurring did not finish within 240 s"),
    };
    assert!(
        out.status.success(),
        "delay-bench-recurring failed ({}); it needs a real broker and the delay-publisher \
         beside it:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Every tick of the measured minute arrived once, none early; serve's RSS and `list` are read.
fn check_recurring(r: &Value) {
    assert_eq!(r["expected"], 120, "{r}");
    for k in ["lost", "duplicated", "early"] {
        assert_eq!(r[k], 0, "recurring {k}: {r}");
    }
    assert_eq!(r["ticks_seen"], 60, "{r}");
    assert!(number(&r["serve_rss_mb"]["peak"], "rss") > 0.0, "{r}");
    assert_eq!(r["list"]["lines"], 120, "{r}");
}

/// The proxy scenario: every message arrived, none early, each counted from the first one;
/// the proxy's topology, the application's exchanges and the pairs they made are gone.
async fn check_proxy(report: &Value) {
    assert_eq!(report["ok"], Value::Bool(true), "{}", report["problems"]);
    let s = &report["scenarios"]["proxy"];
    assert!(number(&s["msgs_per_s"], "msgs_per_s") > 0.0, "{s}");
    for k in ["lost", "early", "publish_errors"] {
        assert_eq!(s[k], 0, "proxy {k}: {s}");
    }
    // the paced run is judged whole from its first message
    assert_eq!(
        s["lateness_from_first_ms"]["samples"], s["lateness_messages"],
        "{s}"
    );
    assert!(number(&s["lateness_from_first_ms"]["min"], "min") >= 0.0);
    // its tiers are in the proxy's process: not counted here
    assert_eq!(s["broker_msgs_per_msg"], Value::Null, "{s}");
    assert!(number(&s["avg_hops"], "avg_hops") > 0.0, "{s}");

    let prefix = report["config"]["prefix"].as_str().expect("prefix");
    let px = Layout::new(&format!("{prefix}-px"), &TopologySettings::default()).expect("layout");
    let conn = amqp_delay::ops::connection::connect(&broker_url(), "bench smoke test")
        .await
        .expect("connect");
    let exchange = format!("{prefix}.proxy.sat.x");
    for x in [
        px.layout_marker(),
        exchange.clone(),
        px.proxy_ingress(&exchange),
    ] {
        let exists = amqp_delay::ops::broker::exchange_exists(&conn, &x)
            .await
            .expect("passive declare");
        assert!(!exists, "exchange '{x}' still exists after the run");
    }
    for q in [
        px.control_stream(),
        format!("{prefix}.proxy.sat"),
        format!("{prefix}.proxy.lat"),
    ] {
        let state = amqp_delay::ops::broker::queue_state(&conn, &q)
            .await
            .expect("passive declare");
        assert!(state.is_none(), "queue '{q}' still exists after the run");
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// The sustained-rate search: its shape in the JSON, every probe a steady run below the
/// ceiling, the rate found (if any) among the probes and its ratio to raw. No timing
/// assertions: which probes pass depends on the machine.
fn check_sustained(report: &Value) {
    assert_eq!(report["ok"], Value::Bool(true), "{}", report["problems"]);
    assert_eq!(report["config"]["sustained"], Value::Bool(true));
    for (name, s) in [
        ("raw", &report["raw"]),
        ("fixed_batched", &report["scenarios"]["fixed_batched"]),
    ] {
        let st = &s["sustained"];
        assert_eq!(st["objective_p99_ms"], 25, "{name}: {st}");
        let ceiling = number(&st["ceiling_msgs_per_s"], "ceiling_msgs_per_s");
        let probes = st["probes"].as_array().expect("probes");
        assert!(!probes.is_empty() && probes.len() <= 2, "{name}: {st}");
        for p in probes {
            let rate = number(&p["rate_msgs_per_s"], "rate_msgs_per_s");
            assert!(rate > 0.0 && rate < ceiling, "{name}: {p}");
            assert!(
                number(&p["lateness_ms"]["samples"], "samples") > 0.0,
                "{name}"
            );
            number(&p["release_lag_ms"], "release_lag_ms");
            let verdict = p["verdict"].as_str().expect("verdict");
            assert!(["ok", "late", "behind"].contains(&verdict), "{name}: {p}");
        }
        let passed: Vec<f64> = probes
            .iter()
            .filter(|p| p["verdict"] == "ok")
            .map(|p| number(&p["rate_msgs_per_s"], "rate"))
            .collect();
        match st["msgs_per_s"].as_f64() {
            Some(r) => {
                assert!(passed.contains(&r), "{name}: {st}");
                assert!(number(&st["ratio_to_raw"], "ratio_to_raw") > 0.0, "{name}");
            }
            None => assert!(passed.is_empty(), "{name}: {st}"),
        }
    }
}

/// The every-scenario run: shapes, counts, hops, batching, and that it deleted what it declared.
async fn check_every_scenario(report: &Value) {
    assert_eq!(report["ok"], Value::Bool(true), "{}", report["problems"]);
    assert_eq!(report["problems"], serde_json::json!([]));
    assert!(number(&report["raw_msgs_per_s"], "raw_msgs_per_s") > 0.0);
    assert_eq!(report["raw"]["lost"], 0);

    let unbatched = ["fixed", "uniform", "mix", "binary"];
    let batched = [
        "fixed_batched",
        "uniform_batched",
        "relay",
        "gateway",
        "gateway_long",
    ];
    for name in unbatched.into_iter().chain(batched) {
        let s = &report["scenarios"][name];
        assert!(s.is_object(), "scenario {name} missing: {report}");
        assert!(number(&s["msgs_per_s"], "msgs_per_s") > 0.0, "{name}");
        number(&s["ratio_to_raw"], "ratio_to_raw");
        let hops = number(&s["avg_hops"], "avg_hops");
        let per_msg = number(&s["broker_msgs_per_msg"], "broker_msgs_per_msg");
        if batched.contains(&name) {
            // members carry no `x-death` of their own
            assert_eq!(s["observed_avg_hops"], Value::Null, "{name}");
            // the gateway holds short delays: they take no broker message at all
            let least = if name == "gateway" {
                0.0
            } else {
                f64::MIN_POSITIVE
            };
            assert!(per_msg >= least && per_msg <= 1.0, "{name}: {per_msg}");
        } else {
            // the broker routed every message through exactly the tiers the planner chose
            let observed = number(&s["observed_avg_hops"], "observed_avg_hops");
            assert!(
                (hops - observed).abs() < 0.01,
                "{name}: planned {hops} hops, took {observed}"
            );
            // one broker message each into the tiers, plus the journal's records, which are
            // group commits shared by the publishes in flight together
            assert!(
                (1.0..2.0).contains(&per_msg),
                "{name}: unbatched, one broker message each and a share of a journal record: {per_msg}"
            );
        }
        number(
            &s["lateness_broker_msgs_per_msg"],
            "lateness_broker_msgs_per_msg",
        );
        assert!(number(&s["lateness_messages"], "lateness_messages") > 0.0);
        let l = &s["lateness_ms"];
        for k in ["min", "p50", "p99", "p999", "max"] {
            number(&l[k], k);
        }
        assert!(
            number(&l["min"], "min") >= 0.0,
            "{name}: a message arrived early: {l}"
        );
        assert!(number(&l["samples"], "samples") > 0.0, "{name}");
        // from the first message: every message of the paced run
        assert_eq!(
            s["lateness_from_first_ms"]["samples"], s["lateness_messages"],
            "{name}"
        );
        assert_eq!(s["lost"], 0, "{name} lost messages");
        assert_eq!(s["early"], 0, "{name} delivered early");
        assert_eq!(s["publish_errors"], 0, "{name}");
    }
    assert_eq!(report["scenarios"]["fixed"]["avg_hops"], 1.0);
    // 300 messages scheduled at once to one fixed level travel in a few batches
    assert!(
        number(
            &report["scenarios"]["fixed_batched"]["broker_msgs_per_msg"],
            "fixed_batched broker_msgs_per_msg"
        ) < 0.5,
        "{}",
        report["scenarios"]["fixed_batched"]
    );
    assert_eq!(report["scenarios"]["binary"]["radix"], 2);
    // the gateway holds its 1–100 ms delays; gateway_long's 1–5,000 ms cross the tiers
    for key in ["tiers_share", "lateness_tiers_share"] {
        let share = |name: &str| number(&report["scenarios"][name][key], key);
        assert_eq!(share("gateway"), 0.0, "gateway {key}");
        assert!(share("gateway_long") > 0.9, "gateway_long {key}");
    }
    assert_eq!(report["scenarios"]["fixed"]["tiers_share"], 1.0);
    assert_eq!(report["raw"]["tiers_share"], Value::Null);

    // everything the run declared is gone
    let prefix = report["config"]["prefix"].as_str().expect("prefix");
    assert!(prefix.starts_with("bench-"), "{prefix}");
    let conn = amqp_delay::ops::connection::connect(&broker_url(), "bench smoke test")
        .await
        .expect("connect");
    // the names the library gives: the run's four layouts (main, radix 2, the two gateways)
    let layout = |prefix: &str| Layout::new(prefix, &TopologySettings::default()).expect("layout");
    let (main, r2, gw, gwl) = (
        layout(prefix),
        layout(&format!("{prefix}-r2")),
        layout(&format!("{prefix}-gw")),
        layout(&format!("{prefix}-gwl")),
    );
    // the bench's own destinations and ingress, one of each kind a run declares
    let batched_dest = format!("{prefix}.fixed_batched.sat");
    let ingress = format!("{prefix}.gateway.sat.in");
    let ingress_long = format!("{prefix}.gateway_long.sat.in");
    // the layout markers are exchanges
    let exchanges = [
        main.layout_marker(),
        r2.layout_marker(),
        gw.layout_marker(),
        gwl.layout_marker(),
        main.batch_marker(&batched_dest).expect("marker name fits"),
        format!("{prefix}.gateway.sat.target"),
        ingress.clone(),
        ingress_long.clone(),
    ];
    for x in &exchanges {
        let exists = amqp_delay::ops::broker::exchange_exists(&conn, x)
            .await
            .expect("passive declare");
        assert!(!exists, "exchange '{x}' still exists after the run");
    }
    let queues = [
        main.control_stream(),
        batched_dest.clone(),
        main.parked_queue(&batched_dest),
        format!("{prefix}.relay.sat"),
        format!("{prefix}.relay.sat.src"),
        format!("{prefix}.gateway.sat"),
        gw.gateway_due_queue(&ingress),
        gw.control_stream(),
        gwl.gateway_due_queue(&ingress_long),
        gwl.control_stream(),
    ];
    for q in &queues {
        let state = amqp_delay::ops::broker::queue_state(&conn, q)
            .await
            .expect("passive declare");
        assert!(state.is_none(), "queue '{q}' still exists after the run");
    }
    let _ = conn.close(200, "bye".into()).await;
}
