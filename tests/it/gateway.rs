//! The `x-delay` gateway against a real RabbitMQ, driven by a real non-Rust client: the Python
//! app in `tests/py/plugin_app.py` (pika) is written for the delayed-message-exchange plugin. It
//! publishes with `x-delay` to the ingress exchange and consumes from its own queues bound to
//! the target exchange. The gateway runs as the real `delay-publisher gateway` binary.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use amqp_delay::Settings;
use amqp_delay::gateway::{Gateway, Pair};
use amqp_delay::ops::broker;
use amqp_delay::settings::GatewaySettings;
use amqp_delay::time::DurationMs;

use crate::harness::*;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ExchangeDeleteOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ExchangeKind};

const APP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/py/plugin_app.py");

/// The tests need Python 3 with pika (installed by ./scripts/test.sh): fail, never skip.
pub(crate) fn require_pika() {
    let ok = Command::new("python3")
        .args(["-c", "import pika"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "PYTHON 3 WITH PIKA IS REQUIRED: `python3 -c 'import pika'` failed. \
         Run ./scripts/test.sh (it installs pika), or `python3 -m pip install pika`."
    );
}

/// A temporary `--config` file, removed when dropped.
pub(crate) struct ConfigFile(pub PathBuf);

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The test's settings (the harness's small topology), a short shutdown grace and `extra` TOML,
/// as a `--config` file.
pub(crate) fn write_config(env: &Env, extra: &str) -> ConfigFile {
    ConfigFile(env.write_config(&format!("[consumer]\nshutdown_grace = \"2s\"\n\n{extra}")))
}

/// A `delay-publisher gateway` process; killed when dropped.
pub(crate) struct GatewayProc {
    child: Child,
    log: PathBuf,
}

/// A process of ours whose log a failing test prints.
pub(crate) trait Logged {
    fn log(&self) -> String;
}

impl Logged for GatewayProc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl GatewayProc {
    pub(crate) fn start(
        env: &Env,
        config: &Path,
        pairs: &[(&str, &str)],
        name: &str,
    ) -> GatewayProc {
        let log = std::env::temp_dir().join(format!("{}-{name}.log", env.settings.prefix));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_delay-publisher"));
        cmd.arg("--config")
            .arg(config)
            .args(["--url", &env.settings.url])
            .args(["--prefix", &env.settings.prefix])
            .arg("gateway");
        for (i, t) in pairs {
            cmd.args(["--ingress", i, "--target", t]);
        }
        let child = cmd
            .env("RUST_LOG", "warn,amqp_delay=info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting delay-publisher gateway");
        GatewayProc { child, log }
    }

    /// SIGKILL: no chance to finish anything.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for a clean exit.
    async fn stop(&mut self) {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(
                    st.success(),
                    "gateway exited with {st} after SIGTERM:\n{}",
                    self.log()
                );
                return;
            }
            assert!(
                Instant::now() < end,
                "gateway did not stop after SIGTERM:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn settings_with(env: &Env, pairs: &[(&str, &str)]) -> Settings {
    let ingress: Vec<String> = pairs.iter().map(|p| p.0.to_string()).collect();
    let target: Vec<String> = pairs.iter().map(|p| p.1.to_string()).collect();
    Settings {
        gateway: GatewaySettings::from_flags(&ingress, &target).unwrap(),
        ..env.settings.clone()
    }
}

pub(crate) fn pairs_of(env: &Env, pairs: &[(&str, &str)]) -> Vec<Pair> {
    Gateway::new(settings_with(env, pairs))
        .unwrap()
        .pairs()
        .to_vec()
}

/// Declares exchange `name` (durable), unwrapping.
pub(crate) async fn declare_exchange(conn: &Connection, name: &str, kind: ExchangeKind) {
    let ch = broker::open(conn).await.unwrap();
    broker::declare_exchange(&ch, name, kind, FieldTable::default())
        .await
        .unwrap();
    broker::close(&ch, "ok").await;
}

/// Binds `queue` to `exchange` with `key`, unwrapping.
pub(crate) async fn bind(conn: &Connection, queue: &str, exchange: &str, key: &str) {
    let ch = broker::open(conn).await.unwrap();
    broker::bind_queue(&ch, queue, exchange, key).await.unwrap();
    broker::close(&ch, "ok").await;
}

/// Waits until every gateway queue has `n` consumers (the gateways are ready).
pub(crate) async fn wait_for_consumers(
    conn: &Connection,
    pairs: &[Pair],
    n: u32,
    gws: &[&dyn Logged],
) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let mut ready = true;
        for q in pairs.iter().flat_map(|p| [&p.ingress_queue, &p.due_queue]) {
            // a missing queue: not declared yet
            match broker::queue_state(conn, q).await {
                Ok(Some(state)) => ready &= state.consumers >= n,
                Ok(None) | Err(_) => {
                    ready = false;
                    break;
                }
            }
        }
        if ready {
            return;
        }
        let logs: Vec<String> = gws.iter().map(|g| g.log()).collect();
        assert!(
            Instant::now() < end,
            "the gateway did not start consuming within 20 s:\n{}",
            logs.join("\n---\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts the Python app; `finish` waits for its JSON report.
fn start_app(mode: &str, cfg: serde_json::Value) -> tokio::process::Child {
    start_app_at(mode, cfg, &broker_url())
}

/// Starts the Python app connected to `url`.
pub(crate) fn start_app_at(mode: &str, cfg: serde_json::Value, url: &str) -> tokio::process::Child {
    tokio::process::Command::new("python3")
        .arg(APP)
        .arg(mode)
        .arg(cfg.to_string())
        .env("AMQP_URL", url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting python3")
}

pub(crate) async fn finish(app: tokio::process::Child, gws: &[&dyn Logged]) -> serde_json::Value {
    let out = tokio::time::timeout(Duration::from_secs(75), app.wait_with_output())
        .await
        .expect("the Python app did not finish within 75 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let logs: Vec<String> = gws.iter().map(|g| g.log()).collect();
    assert!(
        out.status.success(),
        "the Python app failed ({}):\n{}\n{stdout}\ngateway logs:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        logs.join("\n---\n")
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the Python app printed no JSON report ({e}):\n{stdout}"));
    let errors = report["errors"].as_array().expect("errors");
    assert!(
        errors.is_empty(),
        "the app saw differences from what it published:\n{}\ngateway logs:\n{}",
        errors
            .iter()
            .map(|e| e.as_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n"),
        logs.join("\n---\n")
    );
    report
}

/// Deletes the gateway's objects (ingress exchanges, gateway and parking queues) and the
/// targets when the test ends, passed or not, on a fresh connection in a thread (the test's
/// runtime may be gone after a panic). The topology is the harness's `Env` to delete.
pub(crate) struct GatewayObjects {
    settings: Settings,
    targets: Vec<String>,
}

impl GatewayObjects {
    pub(crate) fn new(env: &Env, pairs: &[(&str, &str)], targets: &[&str]) -> GatewayObjects {
        GatewayObjects {
            settings: settings_with(env, pairs),
            targets: targets.iter().map(|t| t.to_string()).collect(),
        }
    }
}

impl Drop for GatewayObjects {
    fn drop(&mut self) {
        let settings = self.settings.clone();
        let targets = std::mem::take(&mut self.targets);
        with_fresh_connection(move |conn| async move {
            if let Err(e) = Gateway::new(settings).unwrap().delete(&conn).await {
                eprintln!("deleting the gateway objects: {e}");
            }
            if let Ok(ch) = conn.create_channel().await {
                for x in &targets {
                    let _ = ch
                        .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                        .await;
                }
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    }
}

/// The test's one pair, `<prefix>-delayed` → `<prefix>-target` (a direct exchange declared
/// here): its names, and a guard that deletes the pair's objects and the target when dropped.
pub(crate) async fn one_pair(env: &Env) -> (String, String, GatewayObjects) {
    let p = &env.settings.prefix;
    let (x_in, x_t) = (format!("{p}-delayed"), format!("{p}-target"));
    declare_exchange(&env.conn, &x_t, ExchangeKind::Direct).await;
    let objects = GatewayObjects::new(env, &[(x_in.as_str(), x_t.as_str())], &[&x_t]);
    (x_in, x_t, objects)
}

/// A hung broker operation fails the test instead of hanging it.
pub(crate) async fn within(test: impl std::future::Future<Output = ()>) {
    tokio::time::timeout(Duration::from_secs(90), test)
        .await
        .expect("the test did not finish within 90 s (broker unresponsive?)");
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The plugin's delivered form of an ingress message: `x-delay` → minus the delay when
/// positive; `user_id` moved into `x-delay-user-id` (documented limit).
pub(crate) fn expected_headers(original: &Received) -> Option<FieldTable> {
    let mut h = original.properties.headers().clone();
    if let Some(n) = original
        .int_header("x-delay")
        .or_else(|| match original.header("x-delay") {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).parse().ok(),
            _ => None,
        })
        .filter(|n| *n > 0)
    {
        h.get_or_insert_with(FieldTable::default)
            .insert("x-delay".into(), AMQPValue::LongInt(-(n as i32)));
    }
    if let Some(u) = original.properties.user_id() {
        h.get_or_insert_with(FieldTable::default)
            .insert("x-delay-user-id".into(), text(u.as_str()));
    }
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_and_topic_targets_get_the_message_as_published() {
    within(direct_and_topic_targets_get_the_message_as_published_body()).await;
}

async fn direct_and_topic_targets_get_the_message_as_published_body() {
    require_pika();
    let mut env = Env::new(small_topology()).await;
    let p = env.settings.prefix.clone();
    let (d_in, d_x) = (format!("{p}-delayed-direct"), format!("{p}-direct"));
    let (t_in, t_x) = (format!("{p}-delayed-topic"), format!("{p}-topic"));
    declare_exchange(&env.conn, &d_x, ExchangeKind::Direct).await;
    declare_exchange(&env.conn, &t_x, ExchangeKind::Topic).await;
    let pairs = [(d_in.as_str(), d_x.as_str()), (t_in.as_str(), t_x.as_str())];
    let _objects = GatewayObjects::new(&env, &pairs, &[&d_x, &t_x]);
    let config = write_config(&env, "");
    let mut gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
    wait_for_consumers(&env.conn, &pairs_of(&env, &pairs), 1, &[&gw]).await;

    // Taps: a copy of every message as the app published it (the ingress is a fanout) and as
    // it reached the targets, to compare the raw AMQP values, types included.
    let tap_in = env.queue("tap-in").await;
    bind(&env.conn, &tap_in, &d_in, "").await;
    bind(&env.conn, &tap_in, &t_in, "").await;
    let tap_out = env.queue("tap-out").await;
    bind(&env.conn, &tap_out, &d_x, "alpha").await;
    bind(&env.conn, &tap_out, &d_x, "beta").await;
    bind(&env.conn, &tap_out, &t_x, "#").await;

    let app = start_app(
        "routing",
        serde_json::json!({
            "prefix": p,
            "direct": {"ingress": d_in, "target": d_x},
            "topic": {"ingress": t_in, "target": t_x},
        }),
    );
    let report = finish(app, &[&gw]).await;
    assert_eq!(report["published"], 9);
    assert_eq!(report["received"], 10, "{report}"); // eu.payments matches two bindings

    let ins = env.expect(&tap_in, 9).await;
    let outs = env.expect(&tap_out, 9).await;
    assert_eq!((ins.len(), outs.len()), (9, 9));
    for i in &ins {
        let o = outs
            .iter()
            .find(|o| o.body == i.body)
            .unwrap_or_else(|| panic!("{:?} never reached the target", i.id()));
        let (a, b) = (&i.properties, &o.properties);
        assert_eq!(o.routing_key, i.routing_key);
        assert_eq!(b.content_type(), a.content_type());
        assert_eq!(b.content_encoding(), a.content_encoding());
        assert_eq!(b.delivery_mode(), a.delivery_mode(), "{:?}", i.id());
        assert_eq!(b.priority(), a.priority());
        assert_eq!(b.correlation_id(), a.correlation_id());
        assert_eq!(b.reply_to(), a.reply_to());
        assert_eq!(b.expiration(), a.expiration());
        assert_eq!(b.message_id(), a.message_id());
        assert_eq!(b.timestamp(), a.timestamp());
        assert_eq!(b.kind(), a.kind());
        assert_eq!(b.app_id(), a.app_id());
        assert_eq!(b.cluster_id(), a.cluster_id());
        assert_eq!(b.user_id(), &None);
        assert_eq!(b.headers(), &expected_headers(i), "{:?}", i.id());
    }
    // a message published with no properties at all arrives with none
    let bare = outs
        .iter()
        .find(|o| o.body.starts_with(b"bare"))
        .expect("bare");
    assert_eq!(bare.properties, lapin::BasicProperties::default());

    gw.stop().await;
    let parked = pairs_of(&env, &pairs)
        .iter()
        .map(|pr| pr.parked_queue.clone())
        .collect::<Vec<_>>();
    for q in &parked {
        env.assert_empty(q).await;
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_delay_edge_values_and_unroutable_messages() {
    within(x_delay_edge_values_and_unroutable_messages_body()).await;
}

async fn x_delay_edge_values_and_unroutable_messages_body() {
    require_pika();
    let env = Env::new(small_topology()).await;
    let p = env.settings.prefix.clone();
    let (x_in, x_t, _objects) = one_pair(&env).await;
    let pairs = [(x_in.as_str(), x_t.as_str())];
    // this one takes its pair from the config file
    let config = write_config(
        &env,
        &format!("[[gateway.pairs]]\ningress = \"{x_in}\"\ntarget = \"{x_t}\"\n"),
    );
    let gw = GatewayProc::start(&env, &config.0, &[], "gw");
    let pair = pairs_of(&env, &pairs).remove(0);
    wait_for_consumers(&env.conn, std::slice::from_ref(&pair), 1, &[&gw]).await;

    let app = start_app(
        "edges",
        serde_json::json!({"prefix": p, "ingress": x_in, "target": x_t}),
    );
    let report = finish(app, &[&gw]).await;
    assert_eq!(report["received"], 5, "{report}");

    let parked = env.expect(&pair.parked_queue, 3).await;
    let reason = |body: &str| -> (String, String) {
        let m = parked
            .iter()
            .find(|m| m.body == body.as_bytes())
            .unwrap_or_else(|| panic!("'{body}' was not parked; parked: {parked:?}"));
        let get = |h: &str| {
            m.text_header(h)
                .unwrap_or_else(|| panic!("'{body}': header {h} is {:?}", m.header(h)))
        };
        (get("x-delay-parked-reason"), get("x-delay-routing-key"))
    };
    assert_eq!(parked.len(), 3, "{parked:?}");
    let (r, key) = reason("edge abc");
    assert!(
        r.contains("x-delay 'abc' is not an integer number of milliseconds"),
        "{r}"
    );
    assert_eq!(key, "edge");
    let (r, _) = reason("edge over-range");
    assert!(
        r.contains("x-delay 999999 ms is longer") && r.contains("1500 ms"),
        "{r}"
    );
    let (r, key) = reason("edge unroutable");
    assert_eq!(
        r,
        format!(
            "unroutable at exchange '{x_t}' with routing key 'nobody-binds-this': no binding matches"
        )
    );
    assert_eq!(key, "nobody-binds-this");
    drop(gw);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_killed_mid_stream_lose_nothing() {
    within(gateways_killed_mid_stream_lose_nothing_body()).await;
}

async fn gateways_killed_mid_stream_lose_nothing_body() {
    killed_mid_stream("").await;
}

/// With `gateway.hold` at 1 s every message (delays 0–1000 ms) is held by a gateway until due,
/// unacked in the ingress queue: killing the gateways must lose none and deliver none early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_killed_while_holding_messages_lose_nothing() {
    within(killed_mid_stream("[gateway]\nhold = \"1s\"\n")).await;
}

/// 300 messages with delays 0–1000 ms over 3 s through two competing gateways (`extra`
/// configuration), both killed with SIGKILL mid-stream, then one started again.
async fn killed_mid_stream(extra: &str) {
    require_pika();
    let env = Env::new(small_topology()).await;
    let p = env.settings.prefix.clone();
    let (x_in, x_t, _objects) = one_pair(&env).await;
    let pairs = [(x_in.as_str(), x_t.as_str())];
    let config = write_config(&env, extra);
    // two competing gateways
    let mut a = GatewayProc::start(&env, &config.0, &pairs, "a");
    let mut b = GatewayProc::start(&env, &config.0, &pairs, "b");
    let pair = pairs_of(&env, &pairs);
    wait_for_consumers(&env.conn, &pair, 2, &[&a, &b]).await;

    let n = 300;
    let app = start_app(
        "stream",
        serde_json::json!({"prefix": p, "ingress": x_in, "target": x_t, "n": n, "publish_seconds": 3.0}),
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    a.kill9();
    tokio::time::sleep(Duration::from_millis(600)).await;
    b.kill9(); // no gateway at all for a while: the ingress fills up
    tokio::time::sleep(Duration::from_millis(800)).await;
    let a2 = GatewayProc::start(&env, &config.0, &pairs, "a2");
    let report = finish(app, &[&a2]).await;
    eprintln!(
        "kill -9 x2 mid-stream ({}): {} published, {} received, {} duplicates",
        extra.trim(),
        report["published"],
        report["received"],
        report["duplicates"]
    );
    assert_eq!(report["published"], n);
    assert_eq!(report["missing"], serde_json::json!([]), "{report}");
    env.assert_empty(&pair[0].parked_queue).await;
    drop((a, b, a2));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_tier_keeps_messages_in_the_ingress_unchanged() {
    within(a_full_tier_keeps_messages_in_the_ingress_unchanged_body()).await;
}

/// Tiers of one message each (`max_tier_length = 1`, reject-publish): most tier publishes are
/// nacked. The ingress message must then stay in the ingress queue as published (requeued,
/// not re-scheduled as a copy that would lose its routing key) until there is room.
async fn a_full_tier_keeps_messages_in_the_ingress_unchanged_body() {
    // every message takes the one-hop 150 ms fixed tier (longer than `gateway.hold`)
    let log = through_full_tiers(150).await;
    assert!(
        log.contains("nack"),
        "no tier publish was refused: the test did not fill a tier\n{log}"
    );
}

/// A delay within `gateway.hold` (100 ms by default) does not cross the tiers or the due
/// queue: the gateway holds the message and publishes it to the target when due. The pair's
/// due queue is declared beforehand as a single-active-consumer queue whose active consumer is
/// the test's, which takes and keeps whatever reaches it: nothing may, and all 24 messages of
/// 60 ms arrive, none early. (With `AMQP_DELAY_GATEWAY__HOLD=0` this test fails.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_delays_are_held_by_the_gateway_not_sent_through_the_tiers() {
    within(async {
        use futures::StreamExt;
        require_pika();
        let env = Env::new(small_topology()).await;
        let p = env.settings.prefix.clone();
        let (x_in, x_t, _objects) = one_pair(&env).await;
        let pairs = [(x_in.as_str(), x_t.as_str())];
        let pair = pairs_of(&env, &pairs);
        let (watch, mut on_due) = watch_due_queue(&env, &pair[0]).await;
        let config = write_config(&env, "");
        let gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
        wait_for_consumers(&env.conn, &pair, 1, &[&gw]).await;

        let app = start_app(
            "stream",
            serde_json::json!({"prefix": p, "ingress": x_in, "target": x_t, "n": 24,
                               "publish_seconds": 0.2, "delay": 60, "timeout": 10}),
        );
        let report = finish(app, &[&gw]).await;
        assert_eq!(report["missing"], serde_json::json!([]), "{report}");
        let mut reached_due = 0;
        while let Ok(Some(_)) =
            tokio::time::timeout(Duration::from_millis(200), on_due.next()).await
        {
            reached_due += 1;
        }
        assert_eq!(reached_due, 0, "held messages went through the due queue");
        let _ = watch.close(200, "bye".into()).await;
        env.assert_empty(&pair[0].parked_queue).await;
        drop(gw);
        env.cleanup().await;
    })
    .await;
}

/// Declares `pair`'s due queue (before the gateway does) as a single-active-consumer queue and
/// consumes it: the test's consumer is the active one, and takes what reaches the due queue
/// until its channel closes (unacked deliveries then go to the gateway's consumer).
async fn watch_due_queue(env: &Env, pair: &Pair) -> (lapin::Channel, lapin::Consumer) {
    let due = pair.due_queue.as_str();
    let mut args = amqp_delay::Topology::new(env.layout()).consumed_queue_args();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let watch = env.conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    watch
        .queue_declare(due.into(), durable, args)
        .await
        .unwrap();
    watch
        .basic_qos(1000, BasicQosOptions::default())
        .await
        .unwrap();
    let on_due = watch
        .basic_consume(
            due.into(),
            "watcher".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (watch, on_due)
}

/// The ingress waits for its batch without a handler permit: with `consumer.io_concurrency = 1`
/// and a `publisher.grain` of 10 s (the gateway lingers a tenth of it, at most 1 s; the lead,
/// 2 s, leaves the messages room to wait), 24 messages of 4 s (tiers up to 60 s) published
/// within 0.2 s are in the batcher together and reach the due queue in a few batches (with a
/// permit each, one at a time, they left one by one: 24 batches). The test's single active
/// consumer of the due queue counts the batches, then lets them go to the gateway: all 24
/// arrive, none early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_messages_gather_into_batches_without_a_handler_permit_each() {
    within(async {
        use futures::StreamExt;
        require_pika();
        let mut topology = small_topology();
        topology.max_delay = DurationMs(60_000);
        topology.max_tier_ttl = DurationMs(20_000);
        let env = Env::new(topology).await;
        let p = env.settings.prefix.clone();
        let (x_in, x_t, _objects) = one_pair(&env).await;
        let pairs = [(x_in.as_str(), x_t.as_str())];
        let pair = pairs_of(&env, &pairs);
        let (watch, mut on_due) = watch_due_queue(&env, &pair[0]).await;
        let config = write_config(
            &env,
            "io_concurrency = 1\nmax_hold = \"20s\"\n\n[publisher]\ngrain = \"10s\"\n",
        );
        let gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
        wait_for_consumers(&env.conn, &pair, 1, &[&gw]).await;

        let app = start_app(
            "stream",
            serde_json::json!({"prefix": p, "ingress": x_in, "target": x_t, "n": 24,
                               "publish_seconds": 0.2, "delay": 4000, "timeout": 30}),
        );
        let (mut batches, mut members) = (0, 0);
        while members < 24 {
            let d = tokio::time::timeout(Duration::from_secs(15), on_due.next())
                .await
                .unwrap_or_else(|_| panic!("{members} of 24 reached the due queue:\n{}", gw.log()))
                .unwrap()
                .unwrap();
            // a message alone in its window travels alone, not as a batch
            batches += 1;
            members += if amqp_delay::ops::batch::is_batch(&d.properties) {
                amqp_delay::ops::batch::announced_count(&d.properties)
            } else {
                1
            };
        }
        assert_eq!(members, 24);
        assert!(
            batches <= 4,
            "24 messages gathered within 0.2 s reached the due queue in {batches} broker messages"
        );
        // unacked: back to the queue, whose active consumer is now the gateway's
        let _ = watch.close(200, "bye".into()).await;
        let report = finish(app, &[&gw]).await;
        assert_eq!(report["missing"], serde_json::json!([]), "{report}");
        env.assert_empty(&pair[0].parked_queue).await;
        drop(gw);
        env.cleanup().await;
    })
    .await;
}

/// 24 messages with `x-delay` `delay` ms over 0.2 s through one gateway, on tiers of one
/// message each (`max_tier_length = 1`, reject-publish): each arrives, not early, none is
/// parked. Returns the gateway's log.
async fn through_full_tiers(delay: u64) -> String {
    require_pika();
    let mut topology = small_topology();
    topology.max_tier_length = Some(1);
    let env = Env::new(topology).await;
    let p = env.settings.prefix.clone();
    let (x_in, x_t, _objects) = one_pair(&env).await;
    let pairs = [(x_in.as_str(), x_t.as_str())];
    // exact routes: with grains a 150 ms delay would go straight to the due queue, held
    // there, and never meet a full tier
    let config = write_config(&env, "[publisher]\ngrain = \"0s\"\n");
    let gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
    let pair = pairs_of(&env, &pairs);
    wait_for_consumers(&env.conn, &pair, 1, &[&gw]).await;

    // one message at a time fits a tier, each waits for room with a growing pause (up to 2 s
    // between tries): 24 messages took 4.6 s on an idle machine and over 60 s twice beside the
    // other suites' tests; 12 still fill the one-message tier eleven times over
    let n = 12;
    let app = start_app(
        "stream",
        serde_json::json!({"prefix": p, "ingress": x_in, "target": x_t, "n": n,
                           "publish_seconds": 0.2, "delay": delay, "timeout": 60}),
    );
    let report = finish(app, &[&gw]).await;
    assert_eq!(
        report["missing"],
        serde_json::json!([]),
        "{report}\ngateway log:\n{}",
        gw.log()
    );
    env.assert_empty(&pair[0].parked_queue).await;
    let log = gw.log();
    drop(gw);
    env.cleanup().await;
    log
}

/// An ingress message whose tier publish keeps failing (its due queue deleted behind the
/// gateway) goes back to the ingress queue, and each return counts toward the quorum queue's
/// delivery limit (20, which the gateway sets on 3.x too): the broker then parks it in
/// `<prefix>.parked` with the reason `delivery_limit`, never drops it (4.x would, at its
/// default limit, in a queue that does not dead-letter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_message_the_tiers_keep_refusing_is_parked_by_the_delivery_limit() {
    within(async {
        let env = Env::new(small_topology()).await;
        let (x_in, x_t, _objects) = one_pair(&env).await;
        let pairs = [(x_in.as_str(), x_t.as_str())];
        let mut settings = settings_with(&env, &pairs);
        // "not now" is not held in the gateway: every refusal is a return
        settings.consumer.requeue_hold = amqp_delay::time::DurationMs(20);
        let gw = Gateway::new(settings).unwrap();
        let pair = gw.pairs()[0].clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let test = async {
            wait_for_consumers(&env.conn, std::slice::from_ref(&pair), 1, &[]).await;
            let ch = env.conn.create_channel().await.unwrap();
            ch.queue_delete(pair.due_queue.as_str().into(), Default::default())
                .await
                .unwrap();
            let mut h = FieldTable::default();
            h.insert("x-delay".into(), AMQPValue::LongInt(5_000));
            ch.basic_publish(
                x_in.as_str().into(),
                "k".into(),
                Default::default(),
                b"refused",
                lapin::BasicProperties::default().with_headers(h),
            )
            .await
            .unwrap();
            let limit = Duration::from_secs(60);
            let layout = env.layout();
            let parked =
                parked_by_delivery_limit(&env.conn, &layout, &pair.ingress_queue, limit).await;
            let _ = stop.send(());
            parked
        };
        // the gateway runs beside the test, on this task (its future is not Send)
        let (run, parked) = tokio::join!(
            gw.run(async {
                let _ = stopped.await;
            }),
            test
        );
        run.unwrap();
        assert_eq!(parked.len(), 1, "not parked");
        assert_eq!(parked[0].body, b"refused");
        env.assert_empty(&pair.ingress_queue).await;
        env.cleanup().await;
    })
    .await;
}

/// `teardown` finds the gateway pairs declared under the prefix (the control stream remembers
/// them), refuses while their queues hold messages, and removes their queues with the
/// topology (an ingress exchange outside the prefix only when the configuration names it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_removes_the_gateway_queues_without_a_config() {
    within(async {
        let env = Env::new(small_topology()).await;
        let (x_in, x_t, _objects) = one_pair(&env).await;
        let pairs = [(x_in.as_str(), x_t.as_str())];
        let gw = Gateway::new(settings_with(&env, &pairs)).unwrap();
        gw.declare(&env.conn).await.unwrap();
        gw.declare(&env.conn).await.unwrap(); // twice: recorded twice, removed once
        let pair = gw.pairs()[0].clone();
        // one message waits in the ingress queue (no gateway runs)
        let ch = env.conn.create_channel().await.unwrap();
        ch.basic_publish(
            x_in.as_str().into(),
            "k".into(),
            Default::default(),
            b"waiting",
            Default::default(),
        )
        .await
        .unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while amqp_delay::ops::broker::queue_state(&env.conn, &pair.ingress_queue)
            .await
            .unwrap()
            .is_none_or(|s| s.ready == 0)
        {
            assert!(
                Instant::now() < end,
                "the message never reached the ingress queue"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let config = write_config(&env, ""); // names no gateway pair
        let teardown = |force: bool| {
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"));
            cmd.arg("--config").arg(&config.0).arg("teardown");
            if force {
                cmd.arg("--force");
            }
            cmd.env("AMQP_URL", broker_url()).output()
        };
        let out = teardown(false).await.unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("1 messages are still"), "{err}");
        let out = teardown(true).await.unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("1 gateway pair(s) '{x_in}'")),
            "{text}"
        );
        for q in pair.queues() {
            let state = amqp_delay::ops::broker::queue_state(&env.conn, q)
                .await
                .unwrap();
            assert!(state.is_none(), "{q} is still there");
        }
        // its ingress exchange is outside the prefix and no configuration names it: not
        // teardown's to delete (the record could be anyone's), and said so
        assert!(
            amqp_delay::ops::broker::exchange_exists(&env.conn, &x_in)
                .await
                .unwrap()
        );
        assert!(text.contains(&format!("left exchange '{x_in}'")), "{text}");
        let marker = env.layout().layout_marker();
        assert!(
            !amqp_delay::ops::broker::exchange_exists(&env.conn, &marker)
                .await
                .unwrap()
        );
        env.cleanup().await;
    })
    .await;
}

/// Teardown deletes only what it owns: gateway-pair records that anyone
/// allowed to write the control stream may append, naming another application's exchange and a
/// broker's own, leave both (listed with the reason) and the rest is deleted all the same; a
/// pair the configuration names is deleted whatever its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_leaves_the_exchanges_a_forged_record_names_and_deletes_the_rest() {
    within(async {
        let env = Env::new(small_topology()).await;
        let p = env.settings.prefix.clone();
        let (other, configured) = (format!("{p}-other-app"), format!("{p}-configured"));
        let _objects = GatewayObjects::new(&env, &[(configured.as_str(), "x")], &[&other]);
        declare_exchange(&env.conn, &other, ExchangeKind::Fanout).await;
        declare_exchange(&env.conn, &configured, ExchangeKind::Fanout).await;
        let layout = env.layout();
        for ingress in [other.as_str(), "amq.direct", configured.as_str()] {
            let forged = amqp_delay::ops::control::Record::GatewayPair {
                ingress: ingress.into(),
                target: "x".into(),
                writers: vec![],
                vhost: None,
            };
            amqp_delay::ops::control::append(&env.conn, &layout, &forged)
                .await
                .unwrap();
        }
        let pairs = format!("[[gateway.pairs]]\ningress = \"{configured}\"\ntarget = \"x\"\n");
        let config = write_config(&env, &pairs);
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(&config.0)
            .args(["teardown", "--force"])
            .env("AMQP_URL", broker_url())
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}\n{err}");
        let exists = async |x: &str| broker::exchange_exists(&env.conn, x).await.unwrap();
        for theirs in [other.as_str(), "amq.direct"] {
            assert!(exists(theirs).await, "{theirs} was deleted");
            assert!(
                text.contains(&format!("left exchange '{theirs}'")),
                "{text}"
            );
        }
        assert!(
            !exists(&configured).await,
            "the configured pair's ingress is still there"
        );
        assert!(
            !exists(&layout.layout_marker()).await,
            "the topology is still there"
        );
        for q in [layout.control_stream(), layout.tiers()[0].queue.clone()] {
            let state = broker::queue_state(&env.conn, &q).await.unwrap();
            assert!(state.is_none(), "{q} is still there");
        }
        env.cleanup().await;
    })
    .await;
}

/// A message the gateway holds (`gateway.hold` 1 s) and that is cancelled while it waits,
/// more than `cancel.notice` before its due time, is not delivered; its neighbour is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_message_cancelled_while_it_waits_is_not_delivered() {
    within(async {
        let mut env = Env::new(small_topology()).await;
        let (x_in, x_t, _objects) = one_pair(&env).await;
        let out = env.queue("held-out").await;
        bind(&env.conn, &out, &x_t, "k").await;
        let pairs = [(x_in.as_str(), x_t.as_str())];
        let config = write_config(&env, "[gateway]\nhold = \"1s\"\n\n[cancel]\nnotice = \"200ms\"\n");
        let gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
        let pair = pairs_of(&env, &pairs);
        wait_for_consumers(&env.conn, &pair, 1, &[&gw]).await;

        let ch = env.conn.create_channel().await.unwrap();
        let due_at_ms = amqp_delay::time::now_ms() + 900;
        for id in ["keep", "drop"] {
            let mut h = FieldTable::default();
            h.insert("x-delay".into(), AMQPValue::LongInt(900));
            ch.basic_publish(
                x_in.as_str().into(),
                "k".into(),
                lapin::options::BasicPublishOptions::default(),
                id.as_bytes(),
                lapin::BasicProperties::default()
                    .with_message_id(id.into())
                    .with_headers(h),
            )
            .await
            .unwrap();
        }
        let publisher = env.publisher().await;
        publisher.cancel("drop", Some(due_at_ms)).await.unwrap();
        assert!(
            amqp_delay::time::now_ms() + 200 < due_at_ms,
            "the cancel was not confirmed a cancel.notice before the due time: the test proves nothing"
        );
        let got = env.expect(&out, 1).await;
        let ids: Vec<String> = got.iter().map(|r| r.id()).collect();
        assert_eq!(ids, ["keep"], "{}", gw.log());
        let log = gw.log();
        assert!(
            log.contains("found it cancelled"),
            "the cancel was not seen by the held message:\n{log}"
        );
        env.assert_empty(&pair[0].parked_queue).await;
        publisher.close().await;
        let _ = ch.close(200, "bye".into()).await;
        drop(gw);
        env.cleanup().await;
    })
    .await;
}
