//! Plugin applications in other languages through the proxy: pika (`tests/py/plugin_app.py`),
//! amqplib (`tests/js/plugin_app.js`) and the Java client (`tests/java/PluginApp.java`, run
//! against the plugin itself too), unchanged but for their URL.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

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
    let mut node = tokio::process::Command::new("node");
    node.arg(app)
        .arg(cfg.to_string())
        .env("NODE_PATH", &modules);
    let report = app_report(node, &w.proxy.url(), || w.logs()).await;
    assert_eq!(
        (report["published"].as_u64(), report["received"].as_u64()),
        (Some(6), Some(6))
    );
    w.env.cleanup().await;
}

/// Debian's RabbitMQ Java client (librabbitmq-client-java, installed by scripts/test.sh) and the
/// slf4j it logs through.
const JAVA_JARS: [&str; 3] = [
    "/usr/share/java/amqp-client.jar",
    "/usr/share/java/slf4j-api.jar",
    "/usr/share/java/slf4j-nop.jar",
];

/// `tests/java/PluginApp.java` compiled into `target/java-plugin-app` (once a run): the
/// classpath to run it with. Never skipped.
fn java_app() -> &'static str {
    static CLASSPATH: OnceLock<String> = OnceLock::new();
    CLASSPATH.get_or_init(|| {
        for jar in JAVA_JARS {
            assert!(
                std::path::Path::new(jar).exists(),
                "THE RABBITMQ JAVA CLIENT IS REQUIRED: {jar} is missing. Run ./scripts/test.sh \
                 (it installs it) or `apt-get install librabbitmq-client-java`"
            );
        }
        let jars = JAVA_JARS.join(":");
        // target/debug/deps/it-… → target/java-plugin-app
        let exe = std::env::current_exe().unwrap();
        let classes = exe.ancestors().nth(3).unwrap().join("java-plugin-app");
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/java/PluginApp.java");
        let out = Command::new("javac")
            .args(["-encoding", "UTF-8", "-cp", &jars, "-d"])
            .arg(&classes)
            .arg(src)
            .output()
            .expect("running javac (a JDK 17 is required)");
        assert!(
            out.status.success(),
            "javac {src} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        format!("{}:{jars}", classes.display())
    })
}

/// Runs an app's command with `AMQP_URL=url`: its JSON report, in which it saw nothing wrong.
async fn app_report(
    mut cmd: tokio::process::Command,
    url: &str,
    logs: impl Fn() -> String,
) -> Value {
    let run = cmd.env("AMQP_URL", url).kill_on_drop(true).output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the app did not finish within 60 s")
        .expect("starting the app");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the app failed against {url}: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs()
    );
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the app printed no JSON report ({e}):\n{stdout}"));
    assert_eq!(report["errors"], serde_json::json!([]), "{url}\n{}", logs());
    report
}

/// The Java app against `url`, on exchange and queues named `x`.
async fn run_java(url: &str, x: &str, extra: &[&str], logs: impl Fn() -> String) -> Value {
    let mut cmd = tokio::process::Command::new("java");
    cmd.args(["-cp", java_app(), "PluginApp"])
        .args([format!("exchange={x}"), format!("queue={x}"), "n=40".into()])
        .args(extra);
    let report = app_report(cmd, url, logs).await;
    assert_eq!(report["nacked"], 0, "{report}");
    report
}

/// The pika app's `x_delay` mode against `url`, on exchange `x`, deleted at the end with
/// `delete_exchange`.
async fn run_pika(
    url: &str,
    (x, prefix): (&str, &str),
    delete_exchange: bool,
    logs: impl Fn() -> String,
) -> Value {
    let cfg =
        serde_json::json!({"exchange": x, "prefix": prefix, "delete_exchange": delete_exchange});
    let mut cmd = tokio::process::Command::new("python3");
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/py/plugin_app.py"
    ))
    .arg("x_delay")
    .arg(cfg.to_string());
    app_report(cmd, url, logs).await
}

/// The cases of a report by id.
fn report_cases(report: &Value) -> BTreeMap<String, &Value> {
    report["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| (c["id"].as_str().unwrap().to_string(), c))
        .collect()
}

/// `type:value` of an x-delay in a report (`absent` for none).
fn typed(v: &Value) -> String {
    match v {
        Value::Null => "absent".into(),
        v => format!(
            "{}:{}",
            v["type"].as_str().unwrap(),
            v["value"].as_str().unwrap()
        ),
    }
}

/// What arrived of a case: `queue → x-delay`, e.g. `quorum → I:-300`.
fn x_delays(case: &Value) -> BTreeMap<String, String> {
    case["copies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["queue"].as_str().unwrap().into(), typed(&c["x_delay"])))
        .collect()
}

/// The delay an x-delay the app sent asks for, (truncated, rounded up): the plugin truncates a
/// fraction, the gateway rounds it up.
fn sent_ms(sent: &Value) -> (i64, i64) {
    if sent.is_null() {
        return (0, 0);
    }
    let v: f64 = sent["value"].as_str().unwrap().parse().unwrap();
    (v.trunc() as i64, v.ceil() as i64)
}

/// Lateness (ms after the due time) of every delayed copy in a report, sorted.
fn lateness(report: &Value) -> Vec<i64> {
    let mut l: Vec<i64> = report_cases(report)
        .values()
        .filter(|c| c["delay"].as_i64().unwrap() > 0)
        .flat_map(|c| c["copies"].as_array().unwrap().iter())
        .map(|c| c["lateness_ms"].as_i64().unwrap())
        .collect();
    l.sort_unstable();
    l
}

fn print_lateness(app: &str, plugin: &Value, proxy: &Value) {
    let (pl, xl) = (lateness(plugin), lateness(proxy));
    let stats = |l: &[i64]| {
        let max = l.last().copied().unwrap_or_default();
        format!(
            "n={} p50={} p99={} max={max}",
            l.len(),
            percentile(l, 0.5),
            percentile(l, 0.99)
        )
    };
    println!(
        "{app}: lateness of the delayed copies (ms): plugin 3.10.2 {}; delay-proxy {}",
        stats(&pl),
        stats(&xl)
    );
}

/// `x-delay` as a consumer reads it, per case and queue type, measured: from the 3.10 plugin a
/// classic queue gets it as sent, a quorum queue minus the delay (truncated) as a signed 32-bit
/// integer, but as sent for a message with an `expiration`; through the proxy both get minus the
/// delay (rounded up) as a signed 32-bit integer. Without a delay it stays as sent. A case the
/// plugin closed the connection on (`closed` in its report) arrives through the proxy only.
fn compare_x_delays(plugin: &Value, proxy: &Value, logs: &str) {
    let (pc, xc) = (report_cases(plugin), report_cases(proxy));
    assert_eq!(pc.keys().collect::<Vec<_>>(), xc.keys().collect::<Vec<_>>());
    let closed: BTreeSet<&str> = plugin["closed"]
        .as_array()
        .map(|c| c.iter().map(|c| c["id"].as_str().unwrap()).collect())
        .unwrap_or_default();
    let both = |v: &str| -> BTreeMap<String, String> {
        [("classic".into(), v.into()), ("quorum".into(), v.into())].into()
    };
    for (id, p) in &pc {
        let (got_p, got_x) = (x_delays(p), x_delays(xc[id]));
        if p["routable"] == false {
            assert!(
                got_p.is_empty() && got_x.is_empty(),
                "{id}: {got_p:?} {got_x:?}"
            );
            continue;
        }
        let (trunc, ceil) = sent_ms(&p["sent"]);
        let sent = typed(&p["sent"]);
        let via_proxy = if ceil > 0 {
            format!("I:-{ceil}")
        } else {
            sent.clone()
        };
        assert_eq!(got_x, both(&via_proxy), "{id} through the proxy\n{logs}");
        if closed.contains(id.as_str()) {
            assert!(got_p.is_empty(), "{id}: {got_p:?}");
            continue;
        }
        let negated = trunc > 0 && p["expiration"] == false;
        let quorum = if negated {
            format!("I:-{trunc}")
        } else {
            sent.clone()
        };
        let want: BTreeMap<String, String> =
            [("classic".into(), sent), ("quorum".into(), quorum)].into();
        assert_eq!(got_p, want, "{id} from the plugin");
    }
}

/// The ids of the returns in a report, each `312 NO_ROUTE` naming `exchange`.
fn returned_ids(report: &Value, exchange: &str) -> BTreeSet<String> {
    let returned = report["returned"].as_array().unwrap();
    for r in returned {
        assert_eq!(
            (
                r["code"].as_u64(),
                r["text"].as_str(),
                r["exchange"].as_str()
            ),
            (Some(312), Some("NO_ROUTE"), Some(exchange)),
            "{r}"
        );
    }
    // the app's message ids are `m-<case>`
    returned
        .iter()
        .map(|r| {
            r["id"]
                .as_str()
                .unwrap()
                .trim_start_matches("m-")
                .to_string()
        })
        .collect()
}

/// A World for delayed exchange `name`, which the application declares itself and publishes to
/// at once: its pair is served before the declare-ok, and the delay counts from the publish.
async fn world_serving(name: &str) -> (World, String) {
    let w = World::new(&[name]).await;
    let x = w.exchange(name);
    (w, x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_java_app_reads_through_the_proxy_what_it_read_from_the_plugin_on_3_10() {
    java_app();
    let plugin_url = crate::import::node("3.10")["AMQP_URL"].clone();
    within(java_body(plugin_url)).await;
}

/// The same Java app, the same messages, against the 3.10 plugin itself and through delay-proxy
/// on the main broker.
async fn java_body(plugin_url: String) {
    let x = format!("{}-java", crate::harness::random_prefix());
    let plugin = run_java(&plugin_url, &x, &["delete-exchange=true"], String::new).await;
    let (w, px) = world_serving("java").await;
    let proxy = run_java(&w.proxy.url(), &px, &[], || w.logs()).await;
    let logs = w.logs();

    let n = report_cases(&plugin).len();
    assert_eq!(
        (plugin["published"].as_u64(), proxy["published"].as_u64()),
        (Some(n as u64), Some(n as u64))
    );
    // the 3.10 plugin closes the connection (541) on a decimal x-delay: never confirmed
    assert_eq!(plugin["confirmed"], n - 1);
    let closed = plugin["closed"].as_array().unwrap();
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(closed[0]["id"], "decimal");
    assert!(
        closed[0]["reason"]
            .as_str()
            .unwrap()
            .contains("reply-code=541")
    );
    assert_eq!(proxy["confirmed"], n, "{logs}");
    assert_eq!(proxy["closed"], serde_json::json!([]), "{logs}");
    compare_x_delays(&plugin, &proxy, &logs);

    // returns: the plugin answers every mandatory delayed publish at once (and still delivers a
    // routable one); the proxy answers only a publish that routes nowhere now
    let mandatory: BTreeSet<String> = report_cases(&plugin)
        .into_iter()
        .filter(|(_, c)| c["mandatory"] == true)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(returned_ids(&plugin, &x), mandatory);
    let now: BTreeSet<String> = ["unroutable-now".to_string()].into();
    assert_eq!(returned_ids(&proxy, &px), now, "{logs}");
    // the unroutable delayed message: dropped by the plugin when due, parked by the gateway
    let ingress = w.env.layout().proxy_ingress(&px);
    let pair = pairs_of(&w.env, &[(ingress.as_str(), px.as_str())]).remove(0);
    let parked = w.env.expect(&pair.parked_queue, 1).await;
    assert_eq!(parked.len(), 1, "{logs}");
    assert_eq!(parked[0].id(), "m-unroutable-delayed");
    assert!(parked[0].header("x-delay-parked-reason").is_some());

    print_lateness("Java app", &plugin, &proxy);
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pika_app_reads_through_the_proxy_the_x_delay_it_read_from_the_plugin_on_3_10() {
    require_pika();
    let plugin_url = crate::import::node("3.10")["AMQP_URL"].clone();
    within(pika_x_delay_body(plugin_url)).await;
}

async fn pika_x_delay_body(plugin_url: String) {
    let p = crate::harness::random_prefix();
    let plugin = run_pika(&plugin_url, (&format!("{p}-pika"), &p), true, String::new).await;
    let (w, px) = world_serving("pika").await;
    let proxy = run_pika(&w.proxy.url(), (&px, &w.env.settings.prefix), false, || {
        w.logs()
    })
    .await;
    assert_eq!(
        (plugin["received"].as_u64(), proxy["received"].as_u64()),
        (Some(14), Some(14))
    );
    compare_x_delays(&plugin, &proxy, &w.logs());
    print_lateness("pika app", &plugin, &proxy);
    w.env.cleanup().await;
}
