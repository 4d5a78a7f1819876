//! `delay-proxy` against a real RabbitMQ: applications written for the delayed-message-exchange
//! plugin, unchanged but for their URL — lapin here, pika (`tests/py/plugin_app.py`) — declare
//! `x-delayed-message` exchanges through the proxy and publish with `x-delay`; the proxy's own
//! gateway delivers, with nothing else running. The proxy runs as the real binary on a free
//! port.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::future::join_all;
use lapin::Confirmation;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};

use crate::gateway::*;
use crate::harness::*;

mod apps;
mod bounds;
mod lifecycle;
mod limits;
mod raw;
mod tls;
mod trust;

/// The broker's URL (its user and vhost) with `scheme`, `host` and `port` instead: what an
/// application behind a proxy uses.
fn proxied_url(scheme: &str, host: &str, port: u16) -> String {
    let first = amqp_delay::ops::connection::split_urls(&broker_url())
        .into_iter()
        .next()
        .expect("a broker URL");
    let u = url::Url::parse(&first).expect("the broker URL parses");
    let vhost = match u.path() {
        "" | "/" => "/%2f".to_string(),
        p => p.to_string(),
    };
    format!("{scheme}://{}@{host}:{port}{vhost}", credentials())
}

/// `user:password` of the broker's URL.
fn credentials() -> String {
    let first = amqp_delay::ops::connection::split_urls(&broker_url())
        .into_iter()
        .next()
        .expect("a broker URL");
    let u = url::Url::parse(&first).expect("the broker URL parses");
    format!("{}:{}", u.username(), u.password().unwrap_or_default())
}

/// A `delay-proxy` process on a free port; killed when dropped.
struct ProxyProc {
    child: Child,
    log: std::path::PathBuf,
    port: u16,
    metrics: u16,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl ProxyProc {
    fn start(env: &Env, config: &Path, extra: &[&str]) -> ProxyProc {
        ProxyProc::start_at(env, config, &env.settings.url, extra, &[])
    }

    /// A proxy whose `--url` is `url`, with `envs` set.
    fn start_at(
        env: &Env,
        config: &Path,
        url: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> ProxyProc {
        ProxyProc::launch(&env.settings.prefix, config, url, extra, envs)
    }

    /// A proxy of prefix `prefix` whose `--url` is `url`, with `envs` set.
    fn launch(
        prefix: &str,
        config: &Path,
        url: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> ProxyProc {
        let (port, metrics) = (free_port(), free_port());
        let n: u32 = rand::random();
        let log = std::env::temp_dir().join(format!("{prefix}-proxy-{n:08x}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_delay-proxy"))
            .arg("--config")
            .arg(config)
            .args(["--url", url])
            .args(["--prefix", prefix])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .args(extra)
            .env("RUST_LOG", "warn,amqp_delay=info,amqp_delay_cli=debug")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting delay-proxy");
        ProxyProc {
            child,
            log,
            port,
            metrics,
        }
    }

    /// A sample of its `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let (status, text) =
            crate::observe::get(&format!("http://127.0.0.1:{}/metrics", self.metrics));
        assert_eq!(status, 200, "{text}");
        crate::observe::sample(&text, name, "")
    }

    /// The URL an application uses: the broker's, with the proxy's port.
    fn url(&self) -> String {
        proxied_url("amqp", "127.0.0.1", self.port)
    }

    /// Connects through the proxy, waiting for it to listen.
    async fn connect(&self) -> Connection {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            match amqp_delay::ops::connection::connect(&self.url(), "proxy test app").await {
                Ok(c) => return c,
                Err(e) => assert!(
                    Instant::now() < end,
                    "no AMQP connection through delay-proxy within 20 s: {e}\n{}",
                    self.log()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Logged for ProxyProc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ProxyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The topology and a proxy (its own gateway delivers), with the guards that delete the pairs
/// of `exchanges` (and the exchanges) at the end.
struct World {
    env: Env,
    proxy: ProxyProc,
    _objects: GatewayObjects,
    config: ConfigFile,
}

impl World {
    async fn new(names: &[&str]) -> World {
        World::with_proxy(names, &[]).await
    }

    /// The world whose proxy gets `extra` flags too.
    async fn with_proxy(names: &[&str], extra: &[&str]) -> World {
        let env = Env::new(small_topology()).await;
        let p = env.settings.prefix.clone();
        let layout = env.layout();
        let exchanges: Vec<String> = names.iter().map(|n| format!("{p}-{n}")).collect();
        let ingresses: Vec<String> = exchanges.iter().map(|x| layout.proxy_ingress(x)).collect();
        let pairs: Vec<(&str, &str)> = ingresses
            .iter()
            .zip(&exchanges)
            .map(|(i, x)| (i.as_str(), x.as_str()))
            .collect();
        let targets: Vec<&str> = exchanges.iter().map(String::as_str).collect();
        let objects = GatewayObjects::new(&env, &pairs, &targets);
        let config = write_config(&env, "");
        let args = [&["--handshake-timeout", "2s"][..], extra].concat();
        let proxy = ProxyProc::start(&env, &config.0, &args);
        World {
            env,
            proxy,
            _objects: objects,
            config,
        }
    }

    /// A new proxy in place of the old one (stopped or killed), as a supervisor would start
    /// it again: its gateway serves the pairs the control stream names.
    fn restart_proxy(&mut self) {
        let old = self.proxy.log();
        self.proxy = ProxyProc::start(&self.env, &self.config.0, &["--handshake-timeout", "2s"]);
        eprintln!("the proxy before its restart:\n{old}");
    }

    fn exchange(&self, name: &str) -> String {
        format!("{}-{name}", self.env.settings.prefix)
    }

    /// Waits until the gateway consumes the pair of delayed exchange `x`.
    async fn served(&self, x: &str) {
        let ingress = self.env.layout().proxy_ingress(x);
        let pairs = pairs_of(&self.env, &[(ingress.as_str(), x)]);
        wait_for_consumers(&self.env.conn, &pairs, 1, &[&self.proxy]).await;
    }

    fn logs(&self) -> String {
        format!("proxy (and its gateway):\n{}", self.proxy.log())
    }
}

/// Declares `x` as the plugin's README does, through `conn`.
async fn declare_delayed(conn: &Connection, x: &str, kind: &str) {
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from(kind)),
    );
    let options = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        options,
        args,
    )
    .await
    .expect("declaring an x-delayed-message exchange through the proxy");
    let _ = ch.close(200, "ok".into()).await;
}

fn with_delay(delay: Option<i64>, id: &str) -> BasicProperties {
    let mut h = FieldTable::default();
    if let Some(d) = delay {
        h.insert("x-delay".into(), AMQPValue::LongLongInt(d));
    }
    h.insert("case".into(), AMQPValue::LongString(LongString::from(id)));
    BasicProperties::default()
        .with_headers(h)
        .with_message_id(id.into())
        .with_correlation_id("corr".into())
        .with_content_type("application/octet-stream".into())
        .with_priority(3)
        .with_delivery_mode(2)
}

struct Sent {
    delay: i64,
    at_ms: u64,
    props: BasicProperties,
    body: Vec<u8>,
}

/// Publishes on a confirm channel of `conn`, mandatory; every publish must be acked without a
/// return.
async fn publish_all(
    conn: &Connection,
    x: &str,
    key: &str,
    msgs: Vec<(i64, Vec<u8>, BasicProperties)>,
) -> Vec<Sent> {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut out = Vec::new();
    for (delay, body, props) in msgs {
        let at_ms = amqp_delay::time::now_ms();
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let confirm = ch
            .basic_publish(x.into(), key.into(), options, &body, props.clone())
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            matches!(confirm, Confirmation::Ack(None)),
            "publish {delay} not acked cleanly: {confirm:?}"
        );
        out.push(Sent {
            delay,
            at_ms,
            props,
            body,
        });
    }
    let _ = ch.close(200, "ok".into()).await;
    out
}

/// Every message arrived once, never early, with its body and properties as published
/// (`x-delay` negated when it delayed, as the plugin does).
fn check(sent: &[Sent], got: &[Received]) {
    assert_eq!(got.len(), sent.len(), "lost or duplicated messages");
    for s in sent {
        let r = got
            .iter()
            .find(|r| r.body == s.body)
            .unwrap_or_else(|| panic!("a message of delay {} never arrived", s.delay));
        let waited = r.arrived_ms.saturating_sub(s.at_ms);
        assert!(
            waited as i64 >= s.delay,
            "early: {waited} ms for a delay of {} ms",
            s.delay
        );
        let mut want = s.props.clone();
        if s.delay > 0 {
            let mut h = s.props.headers().clone().unwrap_or_default();
            h.insert("x-delay".into(), AMQPValue::LongInt(-(s.delay as i32)));
            want = want.with_headers(h);
        }
        assert_eq!(r.properties, want, "delay {}", s.delay);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapin_uses_a_delayed_exchange_through_the_proxy() {
    within(lapin_body()).await;
}

async fn lapin_body() {
    let mut w = World::new(&["orders"]).await;
    let x = w.exchange("orders");
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    let ch = app.create_channel().await.unwrap();
    ch.queue_bind(
        q.as_str().into(),
        x.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    w.served(&x).await;

    // positive delays through the tiers and held, zero, negative and no x-delay straight,
    // a body of several frames (frame_max is 131072)
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let cases: Vec<(Option<i64>, Vec<u8>)> = vec![
        (Some(300), b"d300".to_vec()),
        (Some(1200), b"d1200".to_vec()),
        (Some(60), b"d60 held".to_vec()),
        (Some(0), b"zero".to_vec()),
        (Some(-400), b"negative".to_vec()),
        (None, b"absent".to_vec()),
        (Some(500), big),
    ];
    let msgs = cases
        .into_iter()
        .enumerate()
        .map(|(i, (d, body))| (d.unwrap_or(0).max(0), body, with_delay(d, &format!("m{i}"))))
        .collect();
    let sent = publish_all(&app, &x, "k", msgs).await;
    let got = collect(
        &app,
        &q,
        sent.len(),
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    let logs = w.logs();
    assert_eq!(got.len(), sent.len(), "{logs}");
    check(&sent, &got);
    for r in &got {
        assert_eq!(r.routing_key, "k");
    }

    // 300, 1200, 60 and 500 ms went to the ingress; the rest straight
    assert_eq!(
        w.proxy.metric("amqp_delay_proxy_delayed_publishes_total"),
        4.0
    );
    assert_eq!(
        w.proxy.metric("amqp_delay_proxy_pairs_registered_total"),
        1.0
    );
    assert_eq!(w.proxy.metric("amqp_delay_proxy_connections"), 1.0);
    let ready = format!("http://127.0.0.1:{}/readyz", w.proxy.metrics);
    assert_eq!(
        crate::observe::get(&ready).0,
        200,
        "following the control stream"
    );

    // a mandatory publish nobody's binding matches comes back naming the app's exchange
    let ch = app.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let options = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let confirm = ch
        .basic_publish(
            x.as_str().into(),
            "nobody".into(),
            options,
            b"unroutable",
            with_delay(Some(0), "u"),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let returned = confirm
        .take_message()
        .expect("a basic.return for the unroutable publish");
    assert_eq!(returned.delivery.exchange.as_str(), x);
    assert_eq!(returned.delivery.data, b"unroutable");
    let _ = ch.close(200, "ok".into()).await;

    let _ = app.close(200, "bye".into()).await;
    assert!(
        !w.proxy.log().contains(&credentials()),
        "the proxy logged credentials"
    );
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_channels_and_a_second_connection_share_a_delayed_exchange() {
    within(many_channels_body()).await;
}

async fn many_channels_body() {
    let mut w = World::new(&["events"]).await;
    let x = w.exchange("events");
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "topic").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "ev.#").await;
    w.served(&x).await;

    // a second connection only declares passively, then publishes on 16 channels at once
    let other = w.proxy.connect().await;
    let ch = other.create_channel().await.unwrap();
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        passive,
        FieldTable::default(),
    )
    .await
    .expect("a passive declare through the proxy");
    let publishes = (0..16).map(|c| {
        let msgs = (0..5)
            .map(|i| {
                let d = 200 + 50 * i;
                (
                    d,
                    format!("c{c}-m{i}").into_bytes(),
                    with_delay(Some(d), &format!("c{c}-m{i}")),
                )
            })
            .collect();
        publish_all(&other, &x, "ev.x", msgs)
    });
    let sent: Vec<Sent> = join_all(publishes).await.into_iter().flatten().collect();
    let got = collect(
        &w.env.conn,
        &q,
        sent.len(),
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    let mut counts: HashMap<&[u8], usize> = HashMap::new();
    for r in &got {
        *counts.entry(r.body.as_slice()).or_default() += 1;
    }
    assert!(counts.values().all(|n| *n == 1), "duplicates: {counts:?}");
    let logs = w.logs();
    assert_eq!(got.len(), sent.len(), "{logs}");
    check(&sent, &got);
    let _ = other.close(200, "bye".into()).await;
    let _ = app.close(200, "bye".into()).await;
    w.env.cleanup().await;
}
