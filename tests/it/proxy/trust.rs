//! The proxy acts only for its own client, and only for what the broker let that client do
//! (two attacks once made on it, replayed). On the TLS test node's plain port, where users and
//! virtual hosts are created: each user holds exactly the set `deploy/rabbitmq/permissions.sh`
//! prints (admin, proxy, gateway, and applications A of `P-a.x`, B and B2 of `P-b.x`); A also
//! has a virtual host of its own where it may do anything. Before, A registered a pair for
//! `P.deliver` (a passive declare's declare-ok matched its refused delayed declare), ended B's
//! pair (the same with deletes), and did both from its own virtual host.
//!
//! And on the main broker: a pair a client registers names it, and a delayed publish carries
//! the client's user to the ingress, where the gateway checks it.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, channel, exchange};
use amqp_delay::gateway::Pair;
use amqp_delay::ops::broker::{exchange_exists, queue_state};
use amqp_delay::ops::control::{self, Record};
use amqp_delay::settings::{PairConfig, TrustSettings};
use amqp_delay::{Layout, Settings};
use lapin::options::{ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

use super::raw::{self, RawClient};
use super::*;
use crate::permissions::{Cleanup, cli_as};

/// The applications' users and the exchange and queue each declares.
const APPS: [(&str, &str, &str); 3] = [
    ("a", "a.x", "a.q"),
    ("b", "b.x", "b.q"),
    ("b2", "b.x", "b.q"),
];

/// One test's world on the TLS test node.
struct Node {
    p: String,
    root: lapin::Connection,
    layout: Layout,
    trust: TrustSettings,
    proxy: ProxyProc,
    _vhost: Vhost,
    _cleanup: Cleanup,
}

/// A virtual host of the TLS test node, deleted when dropped.
struct Vhost(String);

impl Drop for Vhost {
    fn drop(&mut self) {
        let node = crate::security::tls_node()["TLS_NODE"].clone();
        let _ = rabbitmqctl()
            .args(["-n", &node, "delete_vhost", &self.0])
            .output();
    }
}

impl Node {
    fn user(&self, role: &str) -> String {
        format!("{}-{role}", self.p)
    }

    /// An application's name under the prefix (`P-b.x`).
    fn name(&self, n: &str) -> String {
        format!("{}-{n}", self.p)
    }

    /// The URL through the proxy of `role`'s user, in virtual host `vhost` (escaped).
    fn via_proxy(&self, role: &str, vhost: &str) -> String {
        let u = self.user(role);
        format!("amqp://{u}:{u}-pw@127.0.0.1:{}/{vhost}", self.proxy.port)
    }

    async fn connect(&self, role: &str, vhost: &str) -> lapin::Connection {
        let url = self.via_proxy(role, vhost);
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            match amqp_delay::ops::connection::connect(&url, "proxy trust test").await {
                Ok(c) => return c,
                Err(e) => assert!(
                    Instant::now() < end,
                    "{role} cannot connect through the proxy: {e}\n{}",
                    self.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn pair(&self, x: &str) -> Pair {
        let cfg = PairConfig {
            ingress: self.layout.proxy_ingress(x),
            target: x.to_string(),
            writers: Vec::new(),
        };
        Pair::new(&self.layout, &cfg).unwrap()
    }

    async fn records(&self) -> Vec<Record> {
        records(&self.root, &self.layout, &self.trust).await
    }

    fn logs(&self) -> String {
        format!("proxy (and its gateway):\n{}", self.proxy.log())
    }

    /// Waits until the gateway consumes the pair of `x`.
    async fn served(&self, x: &str) {
        let q = self.pair(x).ingress_queue;
        let end = Instant::now() + Duration::from_secs(20);
        while !matches!(queue_state(&self.root, &q).await, Ok(Some(s)) if s.consumers > 0) {
            assert!(Instant::now() < end, "no gateway on {q}\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Every record of the control stream up to now, as written (`control::read_all` keeps only
/// each pair's latest), of the writers `trust` lets name pairs.
async fn records(conn: &lapin::Connection, layout: &Layout, trust: &TrustSettings) -> Vec<Record> {
    let nonce = format!("proxy-test-{:016x}", rand::random::<u64>());
    let end = Record::Barrier {
        nonce: nonce.clone(),
    };
    control::append(conn, layout, &end).await.unwrap();
    let (out, seen) = (
        std::sync::Mutex::new(Vec::new()),
        tokio::sync::Notify::new(),
    );
    let follow = amqp_delay::gateway::follow::follow_records(conn, layout, trust, |r| {
        if r == end {
            seen.notify_one();
        } else {
            out.lock().unwrap().push(r);
        }
    });
    tokio::select! {
        r = follow => panic!("the control stream's reader ended: {r:?}"),
        () = seen.notified() => {}
    }
    out.into_inner().unwrap()
}

/// `rabbitmqctl ARGS` on the TLS test node, tried again a few times: under load (other suites
/// use the node too) a call sometimes cannot reach the node.
fn ctl(args: &[&str]) {
    let node = crate::security::tls_node()["TLS_NODE"].clone();
    let mut last = String::new();
    for _ in 0..4 {
        let out = rabbitmqctl()
            .args(["-n", &node])
            .args(args)
            .output()
            .expect("rabbitmqctl");
        if out.status.success() {
            return;
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        std::thread::sleep(Duration::from_secs(1));
    }
    panic!("rabbitmqctl {args:?}: {last}");
}

/// Creates the users and applies to them what `permissions.sh` prints for them.
fn documented_sets(p: &str, users: &[String]) {
    let apps: Vec<String> = APPS
        .iter()
        .map(|(who, x, q)| format!("{p}-{who}:{p}-{x}:{p}-{q}"))
        .collect();
    let mut args = vec!["--prefix", p, "--user-prefix", p, "--proxy"];
    for a in &apps {
        args.extend(["--app", a.as_str()]);
    }
    let sets = crate::permissions::documented_sets(&args);
    let ours: Vec<_> = sets.into_iter().filter(|s| users.contains(&s.0)).collect();
    crate::permissions::apply_sets(&ours);
}

/// The world: users with their documented sets, A's virtual host, the topology (declared by the
/// admin), a proxy and a gateway that follows the pairs.
async fn node() -> Node {
    let tls = crate::security::tls_node();
    let port = tls["AMQP_PORT"].clone();
    let p = random_prefix();
    let users: Vec<String> = ["admin", "proxy", "gateway", "a", "b", "b2"]
        .iter()
        .map(|r| format!("{p}-{r}"))
        .collect();
    let root_url = crate::permissions::url("guest", &port).replace("guest-pw", "guest");
    let cfg = temp_path(&p, "trust.toml");
    // the guards before anything they remove exists: what follows may panic
    let cleanup = Cleanup {
        cfg: cfg.clone(),
        root: root_url.clone(),
        queues: vec![format!("{p}-a.q"), format!("{p}-b.q")],
        exchanges: ["a.x", "b.x", "c.x"].map(|x| format!("{p}-{x}")).to_vec(),
        users: users.clone(),
    };
    let vhost = Vhost(format!("{p}-v2"));
    documented_sets(&p, &users);
    ctl(&["add_vhost", &vhost.0]);
    ctl(&[
        "set_permissions",
        "-p",
        &vhost.0,
        &format!("{p}-a"),
        ".*",
        ".*",
        ".*",
    ]);
    std::fs::write(
        &cfg,
        format!(
            "prefix = \"{p}\"\n[topology]\nradix = 4\nunit = 1\nmax_delay = 1500\nfixed_levels = [150]\nmax_tier_ttl = 200\n[consumer]\nshutdown_grace = \"2s\"\n[trust]\nadmins = [\"{p}-admin\"]\n"
        ),
    )
    .unwrap();
    let as_user = |role: &str| crate::permissions::url(&format!("{p}-{role}"), &port);
    cli_as("the admin's declare", &cfg, &as_user("admin"), &["declare"]).await;
    let proxy = ProxyProc::launch(
        &p,
        &cfg,
        &as_user("proxy"),
        &["--handshake-timeout", "5s"],
        &[],
    );
    let root = amqp_delay::ops::connection::connect(&root_url, "proxy trust test")
        .await
        .expect("THE TLS TEST NODE'S PLAIN PORT DOES NOT ANSWER");
    let settings = Settings {
        prefix: p.clone(),
        topology: small_topology(),
        ..Settings::default()
    };
    Node {
        layout: settings.layout().unwrap(),
        trust: TrustSettings {
            admins: vec![format!("{p}-admin")],
            peers: vec![format!("{p}-proxy")],
            ..Default::default()
        },
        p,
        root,
        proxy,
        _vhost: vhost,
        _cleanup: cleanup,
    }
}

/// `role` declares `P-x` as a delayed direct exchange through the proxy, and its queue `P-q`
/// bound to it with key `k`.
async fn app_declares(n: &Node, role: &str, x: &str, q: &str) {
    let conn = n.connect(role, "%2f").await;
    declare_delayed(&conn, &n.name(x), "direct").await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        n.name(q).as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("its own queue");
    ch.queue_bind(
        n.name(q).as_str().into(),
        n.name(x).as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("binding its queue");
    let _ = conn.close(200, "bye".into()).await;
}

/// B publishes a message delayed by 1.4 s through the proxy; it is pending in the tiers once
/// this returns (confirmed).
async fn b_publishes(n: &Node) -> Vec<Sent> {
    let conn = n.connect("b", "%2f").await;
    let msgs = vec![(1400, b"b's pending".to_vec(), with_delay(Some(1400), "b1"))];
    let sent = publish_all(&conn, &n.name("b.x"), "k", msgs).await;
    let _ = conn.close(200, "bye".into()).await;
    sent
}

/// B's message arrived (the gateway went on serving its pair), as published.
async fn b_receives(n: &Node, sent: &[Sent]) {
    let got = collect(
        &n.root,
        &n.name("b.q"),
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(got.len(), 1, "B's pending message was lost\n{}", n.logs());
    check(sent, &got);
}

/// A pair record's writers and virtual host.
type Asked<'a> = (&'a [String], Option<&'a str>);

/// What pair records name `x`: registered (with writers and virtual host) and ended.
fn records_of<'a>(records: &'a [Record], x: &str) -> (Vec<Asked<'a>>, usize) {
    let mut registered = Vec::new();
    let mut ended = 0;
    for r in records {
        match r {
            Record::GatewayPair {
                target,
                writers,
                vhost,
                ..
            } if target == x => registered.push((writers.as_slice(), vhost.as_deref())),
            Record::GatewayPairEnded { target, .. } if target == x => ended += 1,
            _ => {}
        }
    }
    (registered, ended)
}

fn is_channel_close(m: &AMQPClass, code: u16) -> bool {
    matches!(m, AMQPClass::Channel(channel::AMQPMethod::Close(c)) if c.reply_code == code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_is_registered_or_ended_only_at_the_answer_to_its_own_request() {
    within(async { own_answer_body(&node().await).await }).await;
}

async fn own_answer_body(n: &Node) {
    let (bx, deliver) = (n.name("b.x"), format!("{}.deliver", n.p));
    // B and B2 may both configure B's exchange: each becomes a writer, once
    app_declares(n, "b", "b.x", "b.q").await;
    app_declares(n, "b2", "b.x", "b.q").await;
    app_declares(n, "b", "b.x", "b.q").await;
    n.served(&bx).await;
    let sent = b_publishes(n).await;

    // A, in one write on one channel: a passive declare it may make (of its own exchange:
    // RabbitMQ 4.3 checks a passive declare against the user's rights), then a delayed declare
    // of the delivery exchange, which the broker refuses
    app_declares(n, "a", "a.x", "a.q").await;
    let (user, password) = (n.user("a"), format!("{}-pw", n.user("a")));
    let mut a = RawClient::login(n.proxy.port, &user, &password, "/", 131_072).await;
    a.open_channel(1).await;
    let mut both = raw::declare(1, &n.name("a.x"), "direct", true, FieldTable::default());
    both.extend(raw::delayed_declare(1, &deliver, "topic"));
    a.send(&both).await.unwrap();
    a.expect_method("the passive declare's declare-ok", |m| {
        matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)))
    })
    .await;
    a.expect_method("ACCESS_REFUSED for the delivery exchange", |m| {
        is_channel_close(m, 403)
    })
    .await;
    // the same with deletes: one of an exchange A may configure, then B's
    a.open_channel(2).await;
    let mut both = raw::delete(2, &n.name("a.x"));
    both.extend(raw::delete(2, &bx));
    a.send(&both).await.unwrap();
    a.expect_method("the first delete's delete-ok", |m| {
        matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(_)))
    })
    .await;
    a.expect_method("ACCESS_REFUSED for B's exchange", |m| {
        is_channel_close(m, 403)
    })
    .await;

    let records = n.records().await;
    assert_eq!(
        records_of(&records, &deliver).0.len(),
        0,
        "{records:?}\n{}",
        n.logs()
    );
    assert_eq!(
        records_of(&records, &bx).1,
        0,
        "B's pair ended: {records:?}"
    );
    let ingress = |x: &str| n.layout.proxy_ingress(x);
    assert!(!exchange_exists(&n.root, &ingress(&deliver)).await.unwrap());
    assert!(exchange_exists(&n.root, &ingress(&bx)).await.unwrap());
    b_receives(n, &sent).await;
    // B's pair names each of its writers once, and where they asked
    let (b, b2) = ([n.user("b")], [n.user("b2")]);
    assert_eq!(
        records_of(&records, &bx).0,
        [(&b[..], Some("/")), (&b2[..], Some("/"))],
        "{records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_in_another_virtual_host_changes_nothing_in_the_proxys() {
    within(async { other_vhost_body(&node().await).await }).await;
}

async fn other_vhost_body(n: &Node) {
    let (bx, cx) = (n.name("b.x"), n.name("c.x"));
    app_declares(n, "b", "b.x", "b.q").await;
    n.served(&bx).await;
    // another application's exchange, not behind the proxy
    declare_exchange(&n.root, &cx, lapin::ExchangeKind::Direct).await;
    let sent = b_publishes(n).await;

    // A, in its own virtual host where it may do anything, deletes B's exchange's name and
    // declares C's as delayed
    let vhost = format!("{}-v2", n.p);
    let a = n.connect("a", &vhost).await;
    let ch = a.create_channel().await.unwrap();
    ch.exchange_delete(bx.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("a delete of a name its own virtual host does not have");
    let ch = a.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        lapin::types::AMQPValue::LongString("direct".into()),
    );
    let declared = ch
        .exchange_declare(
            cx.as_str().into(),
            lapin::ExchangeKind::Custom("x-delayed-message".into()),
            Default::default(),
            args,
        )
        .await;

    let records = n.records().await;
    assert_eq!(
        records_of(&records, &cx).0.len(),
        0,
        "{records:?}\n{}",
        n.logs()
    );
    assert_eq!(
        records_of(&records, &bx).1,
        0,
        "B's pair ended: {records:?}"
    );
    assert!(
        declared.is_err(),
        "the broker takes x-delayed-message in another virtual host\n{}",
        n.logs()
    );
    assert!(
        !exchange_exists(&n.root, &n.layout.proxy_ingress(&cx))
            .await
            .unwrap()
    );
    assert!(
        exchange_exists(&n.root, &n.layout.proxy_ingress(&bx))
            .await
            .unwrap()
    );
    assert!(
        n.proxy.log().contains("another virtual host"),
        "{}",
        n.logs()
    );
    b_receives(n, &sent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_publish_through_the_proxy_names_its_clients_user() {
    within(user_id_body()).await;
}

/// On the main broker, a proxy that delivers nothing (`--no-gateway`): the messages stay in
/// the pair's ingress queue, as the proxy sent them.
async fn user_id_body() {
    let env = Env::new(small_topology()).await;
    let config = crate::gateway::write_config(&env, "");
    let proxy = ProxyProc::start(&env, &config.0, &["--no-gateway"]);
    let x = format!("{}-uid", env.settings.prefix);
    let layout = env.layout();
    let pair = Pair::new(
        &layout,
        &PairConfig {
            ingress: layout.proxy_ingress(&x),
            target: x.clone(),
            writers: Vec::new(),
        },
    )
    .unwrap();
    let _objects = GatewayObjects::new(&env, &[(pair.ingress.as_str(), x.as_str())], &[&x]);
    let app = proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    let user = credentials()
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let records = records(&env.conn, &layout, &TrustSettings::default()).await;
    let (registered, _) = records_of(&records, &x);
    assert_eq!(
        registered,
        [(&[user.clone()][..], Some("/"))],
        "{records:?}"
    );

    // one without user_id, one with the client's own
    let msgs = vec![
        (700, b"none".to_vec(), with_delay(Some(700), "u1")),
        (
            700,
            b"own".to_vec(),
            with_delay(Some(700), "u2").with_user_id(user.as_str().into()),
        ),
    ];
    publish_all(&app, &x, "k", msgs).await;
    let got = collect(
        &env.conn,
        &pair.ingress_queue,
        2,
        Duration::from_secs(10),
        Duration::from_millis(200),
    )
    .await;
    assert_eq!(got.len(), 2, "{}", proxy.log());
    for r in &got {
        let uid = r.properties.user_id().as_ref().map(|u| u.to_string());
        assert_eq!(uid.as_deref(), Some(user.as_str()), "{:?}", r.body);
        let added = r.header(amqp_delay::headers::ADDED_USER_ID).is_some();
        assert_eq!(
            added,
            r.body == b"none",
            "marked only when the proxy set it"
        );
    }
    let _ = app.close(200, "bye".into()).await;
    env.cleanup().await;
}
