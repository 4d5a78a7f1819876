//! One application cannot reach another through the gateway, `delay-proxy` or a worker. Every
//! user holds exactly the set `deploy/rabbitmq/permissions.sh` prints for its role (on the test
//! TLS node's plain port, where users are created): an admin, a publisher, a worker, a gateway
//! following the pairs, the proxy's own user, applications A and B behind the proxy, and
//! applications A2 and B2 of configured pairs `a-delayed → a-target`, `b-delayed → b-target`.
//! Replayed attacks:
//! * `CC` naming another application's routes, through a configured pair and through the proxy:
//!   before, the broker routed a copy per key at every tier hop (B's queue and B's worker
//!   queue got copies, A's own queue several);
//! * A delivering through B's pair: refused by the documented sets, and, where an operator
//!   granted write on every ingress, parked by the gateway;
//! * forged `x-delay-*` headers from a publisher, at a `--forward` worker.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use amqp_delay::time::now_ms;
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};

use crate::harness::*;
use crate::permissions::{Cleanup, cli_as, documented_sets, url, user};

/// Node-wide names of one test: `<prefix>-<name>`.
struct World {
    p: String,
    port: String,
    root: String,
    cfg: PathBuf,
    layout: amqp_delay::Layout,
    /// The gateway, the proxy and the workers; killed when the test ends.
    procs: Vec<(tokio::process::Child, PathBuf)>,
    proxy_port: u16,
    _cleanup: Cleanup,
}

impl World {
    fn n(&self, name: &str) -> String {
        format!("{}-{name}", self.p)
    }

    fn url(&self, who: &str) -> String {
        url(&self.n(who), &self.port)
    }

    /// An application's URL through the proxy.
    fn proxied(&self, who: &str) -> String {
        let u = self.n(who);
        format!("amqp://{u}:{u}-pw@127.0.0.1:{}/%2f", self.proxy_port)
    }

    fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|(_, log)| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n----\n")
    }

    /// Starts `bin args...` with `--config` and the URL of `who`, logging to a file.
    fn spawn(&mut self, bin: &str, who: &str, args: &[&str]) {
        let log = temp_path(&self.p, &format!("{who}-{}.log", self.procs.len()));
        let child = tokio::process::Command::new(bin)
            .arg("--config")
            .arg(&self.cfg)
            .args(["--url", &self.url(who)])
            .args(args)
            .env("RUST_LOG", "warn,amqp_delay=info,amqp_delay_cli=info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.procs.push((child, log));
    }
}

/// The users of the world, each given the set permissions.sh prints for it.
fn apply_documented_sets(p: &str) {
    let n = |s: &str| format!("{p}-{s}");
    let args = [
        "--prefix".to_string(),
        p.to_string(),
        "--queue".into(),
        n("q-b-jobs"),
        "--queue".into(),
        n("q-fwd"),
        "--gateway".into(),
        format!("{}:{}", n("a-delayed"), n("a-target")),
        "--gateway".into(),
        format!("{}:{}", n("b-delayed"), n("b-target")),
        "--proxy".into(),
        "--app".into(),
        format!("{}:{}:{}", n("app-a"), n("a-dx"), n("a-dx-out")),
        "--app".into(),
        format!("{}:{}:{}", n("app-b"), n("b-dx"), n("b-dx-out")),
        "--gateway-app".into(),
        format!("{}:{}", n("a2"), n("a-delayed")),
        "--gateway-app".into(),
        format!("{}:{}", n("b2"), n("b-delayed")),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for (who, c, w, r) in documented_sets(&args) {
        // a worker with --forward X adds write on X by hand, as documented
        let w = if who == n("worker") {
            w.replacen("^(", &format!("^({}|", n("fx")), 1)
        } else {
            w
        };
        user(&who, &c, &w, &r);
    }
}

const USERS: [&str; 10] = [
    "admin",
    "publisher",
    "worker",
    "gateway",
    "proxy",
    "keda",
    "app-a",
    "app-b",
    "a2",
    "b2",
];

async fn world() -> World {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    apply_documented_sets(&p);
    let root = url("guest", &port).replace("guest-pw", "guest");
    let n = |s: &str| format!("{p}-{s}");
    let extra = format!(
        "[consumer]\nshutdown_grace = \"1s\"\n[trust]\nadmins = [\"{}\"]\npeers = [\"{}\", \"{}\"]\n\n\
         [[gateway.pairs]]\ningress = \"{}\"\ntarget = \"{}\"\nwriters = [\"{}\"]\n\n\
         [[gateway.pairs]]\ningress = \"{}\"\ntarget = \"{}\"\nwriters = [\"{}\"]\n",
        n("admin"),
        // the proxy's gateway and the gateway following the pairs take each other's due
        // messages (as the Kubernetes ConfigMap names them)
        n("proxy"),
        n("gateway"),
        n("a-delayed"),
        n("a-target"),
        n("a2"),
        n("b-delayed"),
        n("b-target"),
        n("b2"),
    );
    let cfg = small_config(&p, "isolation.toml", &extra);
    let topology = small_topology();
    let layout = amqp_delay::Settings {
        prefix: p.clone(),
        topology,
        ..amqp_delay::Settings::default()
    }
    .layout()
    .unwrap();
    let queues = ["q-b-jobs", "q-fwd", "a-out", "a-out2", "b-out", "a-dx-out"];
    let mut queues: Vec<String> = queues.iter().map(|q| n(q)).collect();
    queues.extend(["b-dx-out", "fx-grant", "fx-out"].iter().map(|q| n(q)));
    queues.extend(
        ["q-b-jobs", "q-fwd"]
            .iter()
            .map(|q| layout.parked_queue(&n(q))),
    );
    let exchanges = ["a-target", "b-target", "a-dx", "b-dx", "fx"];
    let _cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root.clone(),
        queues,
        exchanges: exchanges.iter().map(|x| n(x)).collect(),
        users: USERS.iter().map(|u| n(u)).collect(),
    };
    let w = World {
        p,
        port,
        root,
        cfg,
        layout,
        procs: Vec::new(),
        proxy_port: free_port(),
        _cleanup,
    };
    let admin = w.url("admin");
    cli_as("the admin's declare", &w.cfg, &admin, &["declare"]).await;
    for q in ["q-b-jobs", "q-fwd"] {
        let args = ["declare", "--queue", &w.n(q), "--worker"];
        cli_as(
            "the admin's declare --queue --worker",
            &w.cfg,
            &admin,
            &args,
        )
        .await;
    }
    w
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// Declares exchange `x` (direct) with a queue per `(queue, key)` binding, as the node's
/// administrator (standing for whoever owns them).
async fn exchange_with_queues(conn: &Connection, x: &str, bound: &[(&str, &str)]) {
    let ch = conn.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    for (q, key) in bound {
        amqp_delay::ops::broker::declare_queue(&ch, q, FieldTable::default())
            .await
            .unwrap();
        ch.queue_bind(
            (*q).into(),
            x.into(),
            (*key).into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    let _ = ch.close(200, "ok".into()).await;
}

/// Starts the gateway (following the pairs) and the proxy, and waits until the gateway
/// consumes both configured pairs.
async fn start_gateway_and_proxy(w: &mut World, root: &Connection) {
    let publisher = env!("CARGO_BIN_EXE_delay-publisher");
    cli_as(
        "the admin's gateway --declare-only",
        &w.cfg,
        &w.url("admin"),
        &["gateway", "--declare-only"],
    )
    .await;
    w.spawn(publisher, "gateway", &["gateway", "--follow-pairs"]);
    let listen = format!("127.0.0.1:{}", w.proxy_port);
    w.spawn(
        env!("CARGO_BIN_EXE_delay-proxy"),
        "proxy",
        &["--listen", &listen],
    );
    for i in ["a-delayed", "b-delayed"] {
        let q = w.layout.gateway_ingress_queue(&w.n(i));
        let ok = wait_until_async(Duration::from_secs(30), || async {
            amqp_delay::ops::broker::queue_state(root, &q)
                .await
                .unwrap()
                .is_some_and(|s| s.consumers > 0)
        })
        .await;
        assert!(ok, "the gateway does not consume {q}:\n{}", w.logs());
    }
}

/// Connects as `url`, waiting up to 20 s for a proxy to listen.
async fn connect_as(url: &str) -> Connection {
    let end = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match amqp_delay::ops::connection::connect(url, "isolation app").await {
            Ok(c) => return c,
            Err(_) if std::time::Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "cannot connect as {}: {e}",
                amqp_delay::ops::connection::redact_url(url)
            ),
        }
    }
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Publishes with confirms; the broker's refusal as an error text.
async fn publish(
    conn: &Connection,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<(), String> {
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(Default::default())
        .await
        .map_err(|e| e.to_string())?;
    let sent = async {
        ch.basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await?
        .await
    }
    .await;
    let _ = ch.close(200, "ok".into()).await;
    sent.map(|_| ()).map_err(|e| e.to_string())
}

/// A delayed publish's properties: `x-delay` and the other `headers`.
fn delayed(ms: i32, id: &str, headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongInt(ms));
    for (k, v) in headers {
        h.insert((*k).into(), v.clone());
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(h)
}

/// Declares an `x-delayed-message` exchange `x` through the proxy as the application of
/// `conn`, with its queue `q` bound with `key`.
async fn declare_delayed(conn: &Connection, x: &str, q: &str, key: &str) {
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-delayed-type".into(), text("direct"));
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        durable,
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {x} through the proxy: {e}"));
    amqp_delay::ops::broker::declare_queue(&ch, q, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        q.into(),
        x.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

/// How many messages `q` holds now.
async fn depth(conn: &Connection, q: &str) -> u32 {
    amqp_delay::ops::broker::queue_state(conn, q)
        .await
        .unwrap()
        .map(|s| s.ready)
        .unwrap_or(0)
}

/// `CC` naming B's routes reaches none of them, through a configured pair or through the
/// proxy: the target gets the message once, and an honest `CC` routes once, at the target, as
/// the plugin routes it when the message is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cc_acts_once_at_the_target_and_never_in_the_tiers() {
    let mut w = world().await;
    let root = amqp_delay::ops::connection::connect(&w.root, "isolation root")
        .await
        .unwrap();
    let (a_out, a_out2, b_out) = (w.n("a-out"), w.n("a-out2"), w.n("b-out"));
    exchange_with_queues(
        &root,
        &w.n("a-target"),
        &[(&a_out, "a.k"), (&a_out2, "a.k2")],
    )
    .await;
    exchange_with_queues(&root, &w.n("b-target"), &[(&b_out, "b.k")]).await;
    start_gateway_and_proxy(&mut w, &root).await;
    // B's routes in the tiers: its pair's due queue and its worker queue, as the delivery
    // exchange routes them
    let b_due = w.layout.gateway_due_queue(&w.n("b-delayed"));
    let storm = AMQPValue::FieldArray(FieldArray::from(vec![
        text(&w.layout.routing_key(&[], &b_due)),
        text(&w.layout.routing_key(&[], &w.n("q-b-jobs"))),
        text("b.k"),
        text("a.k2"),
    ]));
    let bcc = AMQPValue::FieldArray(FieldArray::from(vec![text(
        &w.layout.routing_key(&[], &w.n("q-b-jobs")),
    )]));
    let a2 = connect_as(&w.url("a2")).await;
    // an application of a pair that names its writers publishes with its user_id
    let props = delayed(600, "a2-cc", &[("CC", storm.clone()), ("BCC", bcc.clone())])
        .with_user_id(w.n("a2").into());
    publish(&a2, &w.n("a-delayed"), "a.k", b"from a2", props)
        .await
        .expect("A2 publishes to its own ingress");
    // the same through the proxy, from A's plugin-era code
    let a = connect_as(&w.proxied("app-a")).await;
    let a_dx_out = w.n("a-dx-out");
    declare_delayed(&a, &w.n("a-dx"), &a_dx_out, "a.k").await;
    let props = delayed(600, "a-cc", &[("CC", storm), ("BCC", bcc)]);
    publish(&a, &w.n("a-dx"), "a.k", b"from a", props)
        .await
        .expect("A publishes to its delayed exchange through the proxy");

    let got = collect(
        &root,
        &a_out,
        1,
        Duration::from_secs(20),
        Duration::from_secs(2),
    )
    .await;
    let got_dx = collect(
        &root,
        &a_dx_out,
        1,
        Duration::from_secs(20),
        Duration::from_secs(1),
    )
    .await;
    let got2 = collect(
        &root,
        &a_out2,
        1,
        Duration::from_secs(5),
        Duration::from_secs(1),
    )
    .await;
    let logs = w.logs();
    assert_eq!(got.len(), 1, "A2's own queue: {:?}\n{logs}", counts(&got));
    assert_eq!(
        got_dx.len(),
        1,
        "A's own queue: {:?}\n{logs}",
        counts(&got_dx)
    );
    assert_eq!(
        got2.len(),
        1,
        "the honest CC at A2's target: {:?}",
        counts(&got2)
    );
    // what arrives is as published: CC kept, BCC removed by the broker at the target
    assert!(got[0].header("CC").is_some() && got[0].header("BCC").is_none());
    for q in [b_out, w.n("q-b-jobs"), b_due] {
        assert_eq!(depth(&root, &q).await, 0, "a copy reached B's {q}\n{logs}");
    }
    for c in [a2, a, root] {
        let _ = c.close(200, "bye".into()).await;
    }
}

/// A cannot deliver through B's pairs: the documented sets refuse A's publish to B's
/// ingresses, and where an operator granted write on every ingress the gateway parks A's
/// messages (with user_id, without, and through the proxy) while B's own still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_cannot_deliver_through_another_ones_pair() {
    let mut w = world().await;
    let root = amqp_delay::ops::connection::connect(&w.root, "isolation root")
        .await
        .unwrap();
    let b_out = w.n("b-out");
    exchange_with_queues(&root, &w.n("b-target"), &[(&b_out, "b.k")]).await;
    exchange_with_queues(&root, &w.n("a-target"), &[]).await;
    start_gateway_and_proxy(&mut w, &root).await;
    let b = connect_as(&w.proxied("app-b")).await;
    let b_dx_out = w.n("b-dx-out");
    declare_delayed(&b, &w.n("b-dx"), &b_dx_out, "b.k").await;
    let b_ingress = w.layout.proxy_ingress(&w.n("b-dx"));

    // with the documented sets the broker refuses every way in
    let a_direct = connect_as(&w.url("app-a")).await;
    let a_proxied = connect_as(&w.proxied("app-a")).await;
    let a2 = connect_as(&w.url("a2")).await;
    let refusals = [
        publish(&a_direct, &b_ingress, "b.k", b"x", delayed(300, "r1", &[])).await,
        publish(
            &a_proxied,
            &w.n("b-dx"),
            "b.k",
            b"x",
            delayed(300, "r2", &[]),
        )
        .await,
        publish(&a2, &w.n("b-delayed"), "b.k", b"x", delayed(300, "r3", &[])).await,
    ];
    for r in &refusals {
        assert!(
            r.as_ref().is_err_and(|e| e.contains("ACCESS_REFUSED")),
            "{refusals:?}"
        );
    }

    // an operator grants A and A2 write on every ingress: the gateway stops them
    let p = &w.p;
    let own = format!("{p}-a-dx|{p}-a-dx-out");
    let every_ingress = format!(r"^({own}|{p}\.gw\.x\..*)$");
    user(
        &w.n("app-a"),
        &format!("^({own})$"),
        &every_ingress,
        &format!("^({own})$"),
    );
    user(
        &w.n("a2"),
        "^$",
        &format!("^({p}-a-delayed|{p}-b-delayed)$"),
        "^$",
    );
    let a_direct = connect_as(&w.url("app-a")).await;
    let a_proxied = connect_as(&w.proxied("app-a")).await;
    let a2 = connect_as(&w.url("a2")).await;
    let as_a = delayed(300, "a-as-a", &[]).with_user_id(w.n("app-a").into());
    let as_a2 = delayed(300, "a2-as-a2", &[]).with_user_id(w.n("a2").into());
    let sent = [
        publish(&a_direct, &b_ingress, "b.k", b"a", as_a).await,
        publish(
            &a_direct,
            &b_ingress,
            "b.k",
            b"a",
            delayed(300, "a-anon", &[]),
        )
        .await,
        publish(
            &a_proxied,
            &w.n("b-dx"),
            "b.k",
            b"a",
            delayed(300, "a-proxy", &[]),
        )
        .await,
        publish(
            &a2,
            &w.n("b-delayed"),
            "b.k",
            b"a",
            delayed(300, "a2-b", &[]),
        )
        .await,
        publish(&a2, &w.n("b-delayed"), "b.k", b"a", as_a2).await,
    ];
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    // B's own message, through the proxy, still arrives
    publish(&b, &w.n("b-dx"), "b.k", b"b", delayed(300, "b-own", &[]))
        .await
        .unwrap();
    let parked_b_dx = w
        .layout
        .parked_queue(&w.layout.gateway_ingress_queue(&b_ingress));
    let parked_b = w
        .layout
        .parked_queue(&w.layout.gateway_ingress_queue(&w.n("b-delayed")));
    let parked = collect(
        &root,
        &parked_b_dx,
        3,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    let parked2 = collect(
        &root,
        &parked_b,
        2,
        Duration::from_secs(10),
        Duration::from_millis(300),
    )
    .await;
    let got = collect(
        &root,
        &b_dx_out,
        1,
        Duration::from_secs(10),
        Duration::from_secs(1),
    )
    .await;
    let logs = w.logs();
    let ids: Vec<String> = got.iter().map(Received::id).collect();
    assert_eq!(
        ids,
        ["b-own"],
        "B's queue behind its delayed exchange\n{logs}"
    );
    assert_eq!(
        depth(&root, &b_out).await,
        0,
        "A2 reached B's target\n{logs}"
    );
    assert_eq!(
        parked.len(),
        3,
        "parked at B's proxy pair: {:?}\n{logs}",
        counts(&parked)
    );
    assert_eq!(parked2.len(), 2, "parked at B's configured pair\n{logs}");
    for m in parked.iter().chain(&parked2) {
        let why = m.text_header("x-delay-parked-reason").unwrap_or_default();
        assert!(
            why.contains("may not deliver") || why.contains("no user_id"),
            "{why}"
        );
    }
    for q in [parked_b_dx, parked_b] {
        let _ = root
            .create_channel()
            .await
            .unwrap()
            .queue_delete(q.as_str().into(), Default::default())
            .await;
    }
    for c in [a_direct, a_proxied, a2, b, root] {
        let _ = c.close(200, "bye".into()).await;
    }
}

/// A publisher may write the tiers, so it can put a message into any destination with
/// `x-delay-*` headers of its choosing; a `--forward` worker believes them only from a user of
/// ours: the forged routing key and user get nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_reserved_headers_get_nowhere_at_a_forward_worker() {
    let mut w = world().await;
    let root = amqp_delay::ops::connection::connect(&w.root, "isolation root")
        .await
        .unwrap();
    let (q, grant, out) = (w.n("q-fwd"), w.n("fx-grant"), w.n("fx-out"));
    exchange_with_queues(&root, &w.n("fx"), &[(&grant, "b.admin.grant"), (&out, &q)]).await;
    let consumer = env!("CARGO_BIN_EXE_delay-consumer");
    w.spawn(
        consumer,
        "worker",
        &["--queue", &q, "--forward", &w.n("fx")],
    );
    let publisher = connect_as(&w.url("publisher")).await;
    let mut h = FieldTable::default();
    h.insert("x-delay-routing-key".into(), text("b.admin.grant"));
    h.insert("x-delay-user-id".into(), text(&w.n("app-b")));
    h.insert(
        "x-delay-due-at".into(),
        AMQPValue::LongLongInt(now_ms() as i64),
    );
    let forged = BasicProperties::default()
        .with_message_id("forged".into())
        .with_headers(h);
    let key = w.layout.routing_key(&[], &q);
    let into_tiers = w.layout.delivery_exchange();
    publish(&publisher, &into_tiers, &key, b"forged", forged)
        .await
        .expect("a publisher may write the delivery exchange");
    cli_as(
        "a publisher's send",
        &w.cfg,
        &w.url("publisher"),
        &[
            "send", "--queue", &q, "--delay", "100", "--id", "honest", "--body", "ok",
        ],
    )
    .await;
    let got = collect(
        &root,
        &out,
        2,
        Duration::from_secs(20),
        Duration::from_secs(1),
    )
    .await;
    let logs = w.logs();
    let mut ids: Vec<String> = got.iter().map(Received::id).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["forged", "honest"],
        "forwarded with the original key\n{logs}"
    );
    assert_eq!(
        depth(&root, &grant).await,
        0,
        "the forged routing key steered the forward"
    );
    for m in &got {
        assert!(
            m.header("x-delay-user-id").is_none(),
            "a forged user reached the target"
        );
    }
    assert!(logs.contains("removed x-delay-* headers"), "{logs}");
    for c in [publisher, root] {
        let _ = c.close(200, "bye".into()).await;
    }
}
