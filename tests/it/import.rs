//! `delay-publisher import-plugin` against the real delayed-message plugin, on a throwaway node
//! of each series (`scripts/plugin-node.sh`: 3.10 on 5931, 4.0 on 5941; a node that cannot
//! start fails the test). The node is also the broker the copies go to (the same-broker route),
//! with a gateway `--follow-pairs` delivering them. Each test has its own prefix and exchange,
//! and imports only that exchange (`--exchange`), so tests on the same node do not meet.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;
use std::time::Duration;

use amqp_delay::ops::broker;
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Settings, TopologySettings};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{BasicProperties, Connection, ExchangeKind};

use crate::harness::{Received, collect, random_prefix};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/plugin-node.sh");

/// The `KEY=VALUE` lines of `plugin-node.sh SERIES up` (started once per series and run).
pub(crate) fn node(series: &'static str) -> &'static HashMap<String, String> {
    static N310: OnceLock<HashMap<String, String>> = OnceLock::new();
    static N40: OnceLock<HashMap<String, String>> = OnceLock::new();
    let cell = if series == "3.10" { &N310 } else { &N40 };
    cell.get_or_init(|| {
        let out = std::process::Command::new("bash")
            .args([SCRIPT, series, "up"])
            .output()
            .expect("running scripts/plugin-node.sh");
        assert!(
            out.status.success(),
            "THE PLUGIN NODE {series} DID NOT START (scripts/plugin-node.sh {series} up, needs root, \
             the rabbitmq-server package and /work/shared/plugin):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

/// One test's world on one plugin node: its prefix and topology, the application's delayed
/// exchange (type `x-delayed-message`, as the application declared it) and its queues.
struct World {
    series: &'static str,
    url: String,
    settings: Settings,
    conn: Connection,
    exchange: String,
    queues: Vec<String>,
    config: std::path::PathBuf,
    gateway: Option<tokio::process::Child>,
}

impl World {
    async fn new(series: &'static str, extra_config: &str) -> World {
        let url = node(series)["AMQP_URL"].clone();
        let prefix = random_prefix();
        let settings = Settings {
            url: url.clone(),
            prefix: prefix.clone(),
            topology: TopologySettings {
                radix: 8,
                unit: DurationMs(100),
                max_delay: DurationMs(300_000),
                fixed_levels: vec![],
                ..TopologySettings::default()
            },
            ..Settings::default()
        };
        let conn = amqp_delay::ops::connection::connect(&url, "import test")
            .await
            .expect("the plugin node answers AMQP");
        amqp_delay::Topology::new(settings.layout().unwrap())
            .declare(&conn)
            .await
            .expect("declare");
        let config = std::env::temp_dir().join(format!("{prefix}-import.toml"));
        let text = format!(
            "prefix = \"{prefix}\"\n[topology]\nradix = 8\nunit = 100\nmax_delay = 300000\nfixed_levels = []\n{extra_config}\n"
        );
        std::fs::write(&config, text).unwrap();
        let exchange = format!("{prefix}.app");
        let mut args = FieldTable::default();
        args.insert(
            "x-delayed-type".into(),
            AMQPValue::LongString("direct".into()),
        );
        let ch = broker::open(&conn).await.unwrap();
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declaring the plugin's exchange");
        broker::close(&ch, "ok").await;
        World {
            series,
            url,
            settings,
            conn,
            exchange,
            queues: Vec::new(),
            config,
            gateway: None,
        }
    }

    /// A queue bound to the exchange with `keys`.
    async fn queue(&mut self, name: &str, keys: &[&str]) -> String {
        let q = format!("{}-{name}", self.settings.prefix);
        let ch = broker::open(&self.conn).await.unwrap();
        broker::declare_queue(&ch, &q, FieldTable::default())
            .await
            .unwrap();
        for k in keys {
            broker::bind_queue(&ch, &q, &self.exchange, k)
                .await
                .unwrap();
        }
        broker::close(&ch, "ok").await;
        self.queues.push(q.clone());
        q
    }

    /// Publishes to the plugin's exchange with confirms; returns when it was sent (ms).
    async fn publish(&self, key: &str, body: &[u8], props: BasicProperties) -> u64 {
        let ch = self.conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let sent = now_ms();
        ch.basic_publish(
            self.exchange.as_str().into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let _ = ch.close(200, "ok".into()).await;
        sent
    }

    fn ctl(&self) -> String {
        format!("bash {SCRIPT} {} ctl", self.series)
    }

    /// Entries the plugin holds for `exchange`.
    fn pending_of(&self, exchange: &str) -> u64 {
        let expr = format!(
            "T = list_to_atom(\"rabbit_delayed_message\" ++ atom_to_list(node())), \
             N = ets:foldl(fun({{delay_entry, {{delay_key, _, X}}, _, _}}, A) -> \
             case element(4, element(2, X)) of <<\"{exchange}\">> -> A + 1; _ -> A end end, 0, T), \
             io:format(\"~p~n\", [N]), ok."
        );
        let out = std::process::Command::new("bash")
            .args([SCRIPT, self.series, "eval", &expr])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("counting the plugin's entries: {text}"))
    }

    fn pending(&self) -> u64 {
        self.pending_of(&self.exchange)
    }

    /// `import-plugin` with `args`, through the series' rabbitmqctl unless `args` name another.
    fn import_command(&self, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"));
        c.arg("--config")
            .arg(&self.config)
            .args(["--url", &self.url, "import-plugin"])
            .args(args)
            .kill_on_drop(true);
        if !args.contains(&"--rabbitmqctl") {
            c.args(["--rabbitmqctl", &self.ctl()]);
        }
        c
    }

    /// Runs the import of this test's exchange with `args`: (exit code, stdout, stderr).
    async fn import(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = self
            .import_command(args)
            .args(["--exchange", &self.exchange])
            .output()
            .await
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A gateway serving every pair registered under the prefix.
    fn start_gateway(&mut self) {
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(&self.config)
            .args(["--url", &self.url, "gateway", "--follow-pairs"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.gateway = Some(child);
    }

    async fn cleanup(mut self) {
        if let Some(mut g) = self.gateway.take() {
            let _ = g.kill().await;
        }
        let ch = self.conn.create_channel().await.unwrap();
        for q in &self.queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let _ = ch
            .exchange_delete(self.exchange.as_str().into(), Default::default())
            .await;
        let _ = ch.close(200, "bye".into()).await;
        amqp_delay_cli::admin::teardown(&self.conn, &self.settings.layout().unwrap(), None, true)
            .await
            .expect("teardown");
        let _ = std::fs::remove_file(&self.config);
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

fn x_delay_props(delay: i64) -> FieldTable {
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongLongInt(delay));
    h
}

fn array(keys: &[&str]) -> AMQPValue {
    let v: Vec<AMQPValue> = keys
        .iter()
        .map(|k| AMQPValue::LongString((*k).into()))
        .collect();
    AMQPValue::FieldArray(FieldArray::from(v))
}

/// What a test published: when, how long, and as what.
struct Sent {
    at_ms: u64,
    delay_ms: u64,
    key: String,
    body: Vec<u8>,
    props: BasicProperties,
}

fn assert_as_published(got: &Received, sent: &Sent) {
    let id = got.id();
    assert_eq!(got.body, sent.body, "{id}: body");
    assert_eq!(got.routing_key, sent.key, "{id}: routing key");
    assert!(
        got.arrived_ms >= sent.at_ms + sent.delay_ms,
        "{id}: early by {} ms",
        sent.at_ms + sent.delay_ms - got.arrived_ms
    );
    let p = &got.properties;
    assert_eq!(p.content_type(), sent.props.content_type(), "{id}");
    assert_eq!(p.correlation_id(), sent.props.correlation_id(), "{id}");
    assert_eq!(p.priority(), sent.props.priority(), "{id}");
    assert_eq!(p.timestamp(), sent.props.timestamp(), "{id}");
    assert_eq!(p.kind(), sent.props.kind(), "{id}");
    assert_eq!(p.app_id(), sent.props.app_id(), "{id}");
    assert_eq!(p.delivery_mode(), sent.props.delivery_mode(), "{id}");
    // x-delay as the plugin gives it: minus the delay; every other header as published, BCC gone
    assert_eq!(
        got.int_header("x-delay"),
        Some(-(sent.delay_ms as i64)),
        "{id}"
    );
    let sent_h = sent.props.headers().clone().unwrap_or_default();
    for (k, v) in sent_h.inner() {
        match k.as_str() {
            "x-delay" => {}
            "BCC" => assert!(got.header("BCC").is_none(), "{id}: BCC delivered"),
            _ => assert_eq!(got.header(k.as_str()), Some(v), "{id}: header {k}"),
        }
    }
    let ours: Vec<_> = p
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .keys()
                .filter(|k| k.as_str().starts_with("x-delay-"))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    assert!(
        ours.iter().all(|k| k.as_str() == "x-delay-user-id"),
        "{id}: {ours:?}"
    );
}

/// Everything moves and arrives as published: body, routing key, properties, headers (x-delay
/// negated as the plugin delivers it, CC kept, BCC acted on and removed), none early; a message
/// published without an id arrives with the deterministic one; what falls due within the leave
/// window stays in the plugin, which delivers it; `--dry-run` changes nothing; the plugin holds
/// none of the exchange's messages afterwards.
async fn moves_everything_intact(series: &'static str) {
    let mut w = World::new(series, "").await;
    let main = w.queue("main", &["k1", "k.a", "k.b"]).await;
    let cc = w.queue("cc", &["k2"]).await;
    let bcc = w.queue("bcc", &["k4"]).await;
    let other = w.queue("other", &["zz"]).await;
    let mut sent: HashMap<String, Sent> = HashMap::new();
    for i in 0..200u64 {
        let delay = 60_000 + (i * 97) % 10_000;
        let mut h = x_delay_props(delay as i64);
        h.insert(
            "tenant".into(),
            AMQPValue::LongString(format!("t{}", i % 7).into()),
        );
        h.insert("n".into(), AMQPValue::LongInt(i as i32));
        let mut props = BasicProperties::default()
            .with_headers(h)
            .with_content_type("application/json".into())
            .with_delivery_mode(if i % 2 == 0 { 2 } else { 1 })
            .with_priority((i % 5) as u8)
            .with_correlation_id(format!("c{i}").into())
            .with_timestamp(1_765_000_000 + i)
            .with_type("order".into())
            .with_app_id("shop".into());
        let id = if i % 10 == 9 {
            None
        } else {
            Some(format!("m{i}"))
        };
        if let Some(id) = &id {
            props = props.with_message_id(id.as_str().into());
        }
        let key = if i % 2 == 0 { "k.a" } else { "k.b" };
        let body = format!(
            "{{\"order\":{i},\"pad\":\"{}\"}}",
            "x".repeat((i % 50) as usize)
        );
        let at_ms = w.publish(key, body.as_bytes(), props.clone()).await;
        let s = Sent {
            at_ms,
            delay_ms: delay,
            key: key.into(),
            body: body.into_bytes(),
            props,
        };
        sent.insert(id.unwrap_or_else(|| format!("noid-{i}")), s);
    }
    // CC and BCC: routed once, when due, to the queues of k1, k2 and k4
    let mut h = x_delay_props(61_000);
    h.insert("CC".into(), array(&["k2"]));
    h.insert("BCC".into(), array(&["k4"]));
    let props = BasicProperties::default()
        .with_headers(h)
        .with_message_id("cc".into());
    let at_ms = w.publish("k1", b"cc-bcc", props.clone()).await;
    let cc_sent = Sent {
        at_ms,
        delay_ms: 61_000,
        key: "k1".into(),
        body: b"cc-bcc".to_vec(),
        props,
    };
    // due within the leave window: the plugin keeps and delivers these two
    for i in 0..2 {
        let props = BasicProperties::default()
            .with_headers(x_delay_props(25_000))
            .with_message_id(format!("soon{i}").into());
        w.publish("k1", b"soon", props).await;
    }
    assert_eq!(w.pending(), 203);

    let (code, out, err) = w.import(&["--dry-run", "--leave", "40s"]).await;
    assert_eq!(
        code,
        Some(1),
        "no pair yet: everything would be left\n{out}\n{err}"
    );
    assert!(out.contains("left 201: no gateway pair"), "{out}");
    let (code, out, err) = w
        .import(&["--dry-run", "--leave", "40s", "--declare-pairs"])
        .await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("would move 201; skipped 2"), "{out}");
    let total = out
        .lines()
        .find(|l| l.starts_with("total"))
        .unwrap_or_default();
    assert!(total.split_whitespace().last() == Some("201"), "{out}");
    assert_eq!(w.pending(), 203, "--dry-run changed the plugin's store");

    w.start_gateway();
    let (code, out, err) = w
        .import(&["--leave", "40s", "--declare-pairs", "--batch", "50"])
        .await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("moved 201, duplicates 0; skipped 2"), "{out}");
    assert!(w.pending() <= 2, "left in the plugin: {}", w.pending());

    let got = collect(
        &w.conn,
        &main,
        203,
        Duration::from_secs(120),
        Duration::from_millis(500),
    )
    .await;
    let ids: Vec<String> = got.iter().map(Received::id).collect();
    assert_eq!(got.len(), 203, "main queue got {} of 203", got.len());
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        203,
        "a duplicate arrived"
    );
    for g in &got {
        match g.id().as_str() {
            "cc" => assert_as_published(g, &cc_sent),
            "soon0" | "soon1" => assert_eq!(g.body, b"soon"),
            id if id.starts_with("plugin-") => {
                let n = g.int_header("n").unwrap();
                assert_as_published(g, &sent[&format!("noid-{n}")]);
            }
            id => assert_as_published(g, &sent[id]),
        }
    }
    assert_eq!(ids.iter().filter(|i| i.starts_with("plugin-")).count(), 20);
    for q in [&cc, &bcc] {
        let got = collect(
            &w.conn,
            q,
            1,
            Duration::from_secs(10),
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(got.len(), 1, "{q}: one copy");
        assert_as_published(&got[0], &cc_sent);
    }
    let none = collect(
        &w.conn,
        &other,
        0,
        Duration::from_millis(300),
        Duration::ZERO,
    )
    .await;
    assert!(none.is_empty());
    assert_eq!(w.pending(), 0);
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_everything_intact_on_3_10() {
    moves_everything_intact("3.10").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_everything_intact_on_4_0() {
    moves_everything_intact("4.0").await;
}

/// A message whose exchange no longer exists and one over `publisher.max_message_bytes` are
/// left in the plugin and reported; the exit code is 1; the rest moves.
async fn leaves_what_cannot_move(series: &'static str) {
    let mut w = World::new(series, "[publisher]\nmax_message_bytes = 4096\n").await;
    let q = w.queue("q", &["k"]).await;
    w.start_gateway();
    let gone = format!("{}.gone", w.settings.prefix);
    {
        let mut args = FieldTable::default();
        args.insert(
            "x-delayed-type".into(),
            AMQPValue::LongString("direct".into()),
        );
        let ch = broker::open(&w.conn).await.unwrap();
        ch.exchange_declare(
            gone.as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions::default(),
            args,
        )
        .await
        .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let props = BasicProperties::default().with_headers(x_delay_props(20_000));
        ch.basic_publish(
            gone.as_str().into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"g",
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        ch.exchange_delete(gone.as_str().into(), Default::default())
            .await
            .unwrap();
        broker::close(&ch, "ok").await;
    }
    let big = BasicProperties::default()
        .with_headers(x_delay_props(20_000))
        .with_message_id("big".into());
    w.publish("k", &vec![b'x'; 10_000], big).await;
    let fine = BasicProperties::default()
        .with_headers(x_delay_props(20_000))
        .with_message_id("fine".into());
    w.publish("k", b"fine", fine).await;
    let (code, out, err) = w
        .import(&["--declare-pairs", "--leave", "5s", "--exchange", &gone])
        .await;
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains(&format!("left 1: exchange '{gone}' does not exist")),
        "{out}"
    );
    assert!(out.contains("left 1: cannot move:"), "{out}");
    assert!(out.contains("moved 1,"), "{out}");
    assert_eq!(
        (w.pending(), w.pending_of(&gone)),
        (1, 1),
        "what could not move is still there"
    );
    let got = collect(
        &w.conn,
        &q,
        2,
        Duration::from_secs(40),
        Duration::from_millis(500),
    )
    .await;
    let mut ids: Vec<String> = got.iter().map(Received::id).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["big", "fine"],
        "the big one from the plugin, the other through the gateway"
    );
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaves_what_cannot_move_on_3_10() {
    leaves_what_cannot_move("3.10").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaves_what_cannot_move_on_4_0() {
    leaves_what_cannot_move("4.0").await;
}

/// `kill -9` of the importer mid-run, then a re-run: nothing lost, nothing early, and the
/// duplicates no more than what was in flight (two batches: the one being copied and the one
/// whose delete had not been confirmed).
async fn survives_kill_9(series: &'static str) {
    const N: u64 = 600;
    const BATCH: u64 = 50;
    let mut w = World::new(series, "").await;
    let q = w.queue("q", &["k"]).await;
    w.start_gateway();
    let mut due: HashMap<String, u64> = HashMap::new();
    for i in 0..N {
        let delay = 60_000 + (i * 37) % 10_000;
        let props = BasicProperties::default()
            .with_headers(x_delay_props(delay as i64))
            .with_message_id(format!("m{i}").into());
        let at = w.publish("k", format!("b{i}").as_bytes(), props).await;
        due.insert(format!("m{i}"), at + delay);
    }
    // a first run, killed once it has moved some
    let batch = BATCH.to_string();
    let mut first = w
        .import_command(&[
            "--declare-pairs",
            "--batch",
            &batch,
            "--exchange",
            &w.exchange,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let moving =
        crate::harness::wait_until(Duration::from_secs(60), || w.pending() < N - 2 * BATCH).await;
    let _ = first.start_kill();
    let _ = first.wait().await;
    assert!(moving, "the first run moved nothing in 60 s");
    let left_by_first = w.pending();
    let (code, out, err) = w.import(&["--declare-pairs", "--batch", &batch]).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_eq!(w.pending(), 0);
    let got = collect(
        &w.conn,
        &q,
        N as usize,
        Duration::from_secs(150),
        Duration::from_secs(2),
    )
    .await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for g in &got {
        *seen.entry(g.id()).or_default() += 1;
        assert!(g.arrived_ms >= due[&g.id()], "{} early", g.id());
    }
    let lost: Vec<_> = due.keys().filter(|id| !seen.contains_key(*id)).collect();
    assert!(lost.is_empty(), "lost: {lost:?}");
    let dups: usize = seen.values().map(|n| n - 1).sum();
    assert!(
        dups as u64 <= 2 * BATCH + 10,
        "{dups} duplicates, more than the two batches in flight (the plugin held {left_by_first} after the kill)"
    );
    eprintln!(
        "{series}: killed with {left_by_first} in the plugin; {dups} duplicates; re-run: {out}"
    );
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_kill_9_on_3_10() {
    survives_kill_9("3.10").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_kill_9_on_4_0() {
    survives_kill_9("4.0").await;
}

/// A copy whose original the plugin delivered before the delete reached it: counted as a
/// duplicate, and each such message arrives twice (the plugin's delivery and the copy), the
/// others once. The deleting call is held back (a `--rabbitmqctl` wrapper that sleeps before a
/// call with deletes) until the plugin has delivered everything.
async fn counts_what_the_plugin_delivered_meanwhile(series: &'static str) {
    const N: usize = 60;
    let mut w = World::new(series, "").await;
    let q = w.queue("q", &["k"]).await;
    w.start_gateway();
    for i in 0..N {
        let props = BasicProperties::default()
            .with_headers(x_delay_props(12_000 + (i as i64 * 31) % 2_000))
            .with_message_id(format!("m{i}").into());
        w.publish("k", b"x", props).await;
    }
    let wrapper = std::env::temp_dir().join(format!("{}-slow-delete.sh", w.settings.prefix));
    std::fs::write(
        &wrapper,
        format!(
            "#!/usr/bin/env bash\ncase \"$*\" in *'Dels = <<\"'[A-Za-z0-9+/]*) sleep 20;; esac\nexec bash {SCRIPT} {series} ctl \"$@\"\n"
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&w.config)
        .args([
            "--url",
            &w.url,
            "import-plugin",
            "--declare-pairs",
            "--leave",
            "5s",
        ])
        .args(["--exchange", &w.exchange, "--rabbitmqctl"])
        .arg(format!("bash {}", wrapper.display()))
        .output()
        .await
        .unwrap();
    let _ = std::fs::remove_file(&wrapper);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("moved 0, duplicates {N};")),
        "{text}"
    );
    let got = collect(
        &w.conn,
        &q,
        2 * N,
        Duration::from_secs(60),
        Duration::from_secs(1),
    )
    .await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for g in &got {
        *seen.entry(g.id()).or_default() += 1;
    }
    assert_eq!(seen.len(), N, "lost: {}", N - seen.len());
    assert!(seen.values().all(|&n| n == 2), "{seen:?}");
    assert_eq!(w.pending(), 0);
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_what_the_plugin_delivered_meanwhile_on_3_10() {
    counts_what_the_plugin_delivered_meanwhile("3.10").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_what_the_plugin_delivered_meanwhile_on_4_0() {
    counts_what_the_plugin_delivered_meanwhile("4.0").await;
}

/// What a Debian or Ubuntu user types, as root: `import-plugin --rabbitmqctl /usr/sbin/rabbitmqctl
/// --node NODE`, the package's wrapper, which re-quotes every argument into `su rabbitmq -c`'s
/// shell line. The dry run counts every message (would move, or skipped: due within the leave
/// window, which grows on a slow machine); the import moves them in several calls with deletes;
/// each arrives once (copy or the plugin's own delivery), none early, as published (bodies and
/// headers full of what a shell would expand), and the plugin holds none afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_through_debians_packaged_rabbitmqctl_as_root_on_3_10() {
    const N: u64 = 300;
    const WRAPPER: &str = "/usr/sbin/rabbitmqctl";
    let uid = std::process::Command::new("id").arg("-u").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "THIS TEST MUST RUN AS ROOT: it runs the packaged {WRAPPER} as root, as a Debian user does \
         (CI runs as root)"
    );
    let packaged = std::fs::read_to_string(WRAPPER).unwrap_or_default();
    assert!(
        packaged.contains("su rabbitmq -s /bin/sh -c"),
        "{WRAPPER} is not the rabbitmq-server package's wrapper (install the Debian package)"
    );
    let mut w = World::new("3.10", "").await;
    let q = w.queue("q", &["k"]).await;
    w.start_gateway();
    let mut sent: HashMap<String, Sent> = HashMap::new();
    for i in 0..N {
        let delay = 90_000 + (i * 37) % 10_000;
        let mut h = x_delay_props(delay as i64);
        let shelly = format!("$end_of_table `id` \\ \"{i}\" \t'$HOME'");
        h.insert("note".into(), AMQPValue::LongString(shelly.clone().into()));
        let props = BasicProperties::default()
            .with_headers(h)
            .with_message_id(format!("m{i}").into())
            .with_correlation_id(format!("$c{i}").into());
        let mut body = shelly.into_bytes();
        body.extend([0, 255, b'\n', i as u8]);
        let at_ms = w.publish("k", &body, props.clone()).await;
        let s = Sent {
            at_ms,
            delay_ms: delay,
            key: "k".into(),
            body,
            props,
        };
        sent.insert(format!("m{i}"), s);
    }
    assert_eq!(w.pending(), N);
    let node = node("3.10")["NODE"].clone();
    let debian = ["--rabbitmqctl", WRAPPER, "--node", &node, "--declare-pairs"];
    let (code, out, err) = w.import(&[&debian[..], &["--dry-run"]].concat()).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    let (would, skipped) = (
        number_after(&out, "would move "),
        number_after(&out, "skipped "),
    );
    assert!(would > 0 && would + skipped == N, "{out}");
    eprintln!(
        "3.10 through {WRAPPER}, dry run: {}",
        out.lines().last().unwrap_or_default()
    );
    let total = out
        .lines()
        .find(|l| l.starts_with("total"))
        .unwrap_or_default();
    assert_eq!(
        total.split_whitespace().last(),
        Some(&*would.to_string()),
        "{out}"
    );
    assert_eq!(w.pending(), N, "the dry run changed nothing");
    let (code, out, err) = w.import(&[&debian[..], &["--batch", "70"]].concat()).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    let (moved, skipped) = (number_after(&out, "moved "), number_after(&out, "skipped "));
    assert!(moved > 0 && moved + skipped == N, "{out}");
    assert!(out.contains("duplicates 0;"), "{out}");
    eprintln!("3.10 through {WRAPPER}, import: {out}");
    assert!(
        w.pending() <= skipped,
        "left in the plugin: {}",
        w.pending()
    );
    let got = collect(
        &w.conn,
        &q,
        N as usize,
        Duration::from_secs(150),
        Duration::from_secs(2),
    )
    .await;
    let mut seen = HashSet::new();
    for g in &got {
        assert!(seen.insert(g.id()), "{} twice", g.id());
        assert_as_published(g, &sent[&g.id()]);
    }
    assert_eq!(seen.len() as u64, N, "{out}");
    assert_eq!(w.pending(), 0, "left in the plugin");
    w.cleanup().await;
}

/// The number after `word` in a summary line.
fn number_after(out: &str, word: &str) -> u64 {
    out.split_once(word)
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after '{word}' in: {out}"))
}

/// Blue-green (MIGRATING, runbook B): the plugin's 4.0 node is the old cluster, the suite's
/// broker the new one (3.10.8, 4.0.5 or 4.3.6, whichever this run targets), with the
/// application's exchange of its real type there and a gateway following the pairs.
/// `import-plugin --url NEW` reaches the old node through rabbitmqctl and moves everything:
/// each message arrives once at the new cluster's queue, as published and none early, and the
/// plugin is left empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blue_green_to_the_suites_broker() {
    const N: u64 = 60;
    let mut old = World::new("4.0", "").await;
    let new_url = crate::harness::broker_url();
    let new = amqp_delay::ops::connection::connect(&new_url, "blue-green new cluster")
        .await
        .expect("NO RABBITMQ BROKER for the new cluster (AMQP_URL)");
    let layout = old.settings.layout().unwrap();
    amqp_delay::Topology::new(layout.clone())
        .declare(&new)
        .await
        .expect("declare on the new cluster");
    // step 0: the application's exchange with its real type and binding, on the new cluster
    let q = format!("{}-q", old.settings.prefix);
    let ch = broker::open(&new).await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        old.exchange.as_str().into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    broker::declare_queue(&ch, &q, FieldTable::default())
        .await
        .unwrap();
    broker::bind_queue(&ch, &q, &old.exchange, "k")
        .await
        .unwrap();
    broker::close(&ch, "ok").await;
    // the old cluster's plugin holds the backlog
    let mut due = HashMap::new();
    for i in 0..N {
        let delay = 60_000 + (i * 53) % 5_000;
        let props = BasicProperties::default()
            .with_headers(x_delay_props(delay as i64))
            .with_message_id(format!("m{i}").into());
        let at = old.publish("k", format!("b{i}").as_bytes(), props).await;
        due.insert(format!("m{i}"), at + delay);
    }
    // step 1: a gateway on the new cluster; step 3: the import, --url the new cluster
    let mut gateway = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&old.config)
        .args(["--url", &new_url, "gateway", "--follow-pairs"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&old.config)
        .args([
            "--url",
            &new_url,
            "import-plugin",
            "--rabbitmqctl",
            &old.ctl(),
        ])
        .args(["--declare-pairs", "--exchange", &old.exchange])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}\n{err}");
    assert!(said.contains(&format!("moved {N}, duplicates 0")), "{said}");
    // step 4: the old node holds nothing of the exchange
    assert_eq!(old.pending(), 0, "left in the old cluster's plugin");
    let got = collect(
        &new,
        &q,
        N as usize,
        Duration::from_secs(150),
        Duration::from_secs(2),
    )
    .await;
    let _ = gateway.kill().await;
    let mut seen = HashSet::new();
    for g in &got {
        assert!(g.arrived_ms >= due[&g.id()], "{} early", g.id());
        assert!(seen.insert(g.id()), "{} twice", g.id());
    }
    assert_eq!(seen.len() as u64, N, "{said}");
    // what the test made on the new cluster, then on the old node
    let ch = broker::open(&new).await.unwrap();
    let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    let _ = ch
        .exchange_delete(old.exchange.as_str().into(), Default::default())
        .await;
    broker::close(&ch, "bye").await;
    amqp_delay_cli::admin::teardown(&new, &layout, None, true)
        .await
        .expect("teardown on the new cluster");
    let _ = new.close(200, "bye".into()).await;
    old.queues.clear();
    old.cleanup().await;
}
