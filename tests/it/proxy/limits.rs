//! What the proxy guarantees at its edges: a kill loses nothing confirmed, a refused declare
//! registers nothing, timeouts and the frame bound end a connection, pairs are shared between
//! proxies and declared again when gone, dead broker nodes are skipped.

use std::time::{Duration, Instant};

use lapin::ExchangeKind;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_after_the_confirms_loses_nothing() {
    within(killed_body()).await;
}

async fn killed_body() {
    let mut w = World::new(&["jobs"]).await;
    let x = w.exchange("jobs");
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "j").await;
    let msgs = (0..40)
        .map(|i| {
            let d = 400 + 25 * i;
            (
                d,
                format!("job {i}").into_bytes(),
                with_delay(Some(d), &format!("j{i}")),
            )
        })
        .collect();
    let sent = publish_all(&app, &x, "j", msgs).await;
    // SIGKILL right after the last confirm: everything confirmed is the broker's
    let _ = w.proxy.child.kill();
    let _ = w.proxy.child.wait();
    // started again, its gateway delivers them
    w.restart_proxy();
    w.served(&x).await;
    let got = collect(
        &w.env.conn,
        &q,
        sent.len(),
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    // the kill may leave what the proxy's gateway had published but not acked: delivered
    // again (at least once), each copy as published and never early
    let (mut got, mut twice) = first_copies(got);
    if got.len() < sent.len() {
        // duplicates filled the count: the rest are still to come
        let more = collect(
            &w.env.conn,
            &q,
            sent.len() - got.len(),
            Duration::from_secs(20),
            Duration::from_millis(500),
        )
        .await;
        got.extend(more);
        (got, twice) = {
            let (g, t) = first_copies(got);
            (g, twice + t)
        };
    }
    eprintln!("{twice} message(s) arrived twice after the kill");
    let logs = w.logs();
    assert_eq!(got.len(), sent.len(), "{logs}");
    check(&sent, &got);
    w.env.cleanup().await;
}

/// The first copy of each body, and how many more copies there were.
fn first_copies(got: Vec<Received>) -> (Vec<Received>, usize) {
    let mut seen = std::collections::HashSet::new();
    let (mut first, mut again) = (Vec::new(), 0);
    for r in got {
        if seen.insert(r.body.clone()) {
            first.push(r);
        } else {
            again += 1;
        }
    }
    (first, again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_the_broker_refuses_registers_no_pair() {
    within(refused_body()).await;
}

async fn refused_body() {
    let w = World::new(&["taken", "typo"]).await;
    let (taken, typo) = (w.exchange("taken"), w.exchange("typo"));
    // an exchange of another type under that name: the broker refuses the delayed declare
    declare_exchange(&w.env.conn, &taken, ExchangeKind::Fanout).await;
    let app = w.proxy.connect().await;
    let ch = app.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from("direct")),
    );
    let options = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let kind = ExchangeKind::Custom("x-delayed-message".into());
    let e = ch
        .exchange_declare(taken.as_str().into(), kind.clone(), options, args.clone())
        .await
        .expect_err("an inequivalent declare must be refused");
    assert!(e.to_string().contains("PRECONDITION_FAILED"), "{e}");
    // a real type the broker does not know: refused too (the connection ends)
    let ch = app.create_channel().await.unwrap();
    let mut bad = FieldTable::default();
    bad.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from("no-such-type")),
    );
    let e = ch
        .exchange_declare(typo.as_str().into(), kind, options, bad)
        .await
        .expect_err("an unknown type must be refused");
    assert!(
        e.to_string().contains("COMMAND_INVALID") || e.to_string().contains("no-such-type"),
        "{e}"
    );
    let layout = w.env.layout();
    for x in [&taken, &typo] {
        let ingress = layout.proxy_ingress(x);
        assert!(
            !amqp_delay::ops::broker::exchange_exists(&w.env.conn, &ingress)
                .await
                .unwrap(),
            "a pair was registered for refused '{x}'"
        );
    }
    let records = amqp_delay::ops::control::read_all(&w.env.conn, &layout, &Default::default())
        .await
        .unwrap();
    assert!(
        !records
            .iter()
            .any(|r| matches!(r, amqp_delay::ops::control::Record::GatewayPair { .. })),
        "{records:?}"
    );
    // the proxy is still serving: a new connection declares fine
    let again = w.proxy.connect().await;
    declare_delayed(&again, &typo, "direct").await;
    let _ = again.close(200, "bye".into()).await;
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_the_handshake_is_disconnected() {
    within(handshake_body()).await;
}

async fn handshake_body() {
    use tokio::io::AsyncReadExt;
    let w = World::new(&[]).await;
    // wait until it listens
    let ready = w.proxy.connect().await;
    let _ = ready.close(200, "bye".into()).await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", w.proxy.port))
        .await
        .unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 64];
    // silent: the proxy ends it after --handshake-timeout (2 s)
    let r = tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf)).await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "still open after 15 s: {r:?}"
    );
    assert!(start.elapsed() >= Duration::from_secs(1), "closed too soon");
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_proxy_learns_the_pairs_another_registered() {
    within(two_proxies_body()).await;
}

async fn two_proxies_body() {
    let mut w = World::new(&["shared"]).await;
    let x = w.exchange("shared");
    // the same configuration file (rewriting it would race the gateway's start)
    let b = ProxyProc::start(&w.env, &w.config.0, &[]);
    let on_b = b.connect().await;
    // registered through the first proxy only
    let on_a = w.proxy.connect().await;
    declare_delayed(&on_a, &x, "direct").await;
    let _ = on_a.close(200, "bye".into()).await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    let known = wait_until(Duration::from_secs(10), || {
        b.metric("amqp_delay_proxy_pairs_known") >= 1.0
    })
    .await;
    assert!(known, "the second proxy never read the pair:\n{}", b.log());
    // the second proxy's client publishes without declaring: still delayed
    let msgs = vec![
        (700, b"via b".to_vec(), with_delay(Some(700), "b1")),
        (0, b"via b now".to_vec(), with_delay(None, "b2")),
    ];
    let sent = publish_all(&on_b, &x, "k", msgs).await;
    let got = collect(
        &w.env.conn,
        &q,
        sent.len(),
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    let logs = w.logs();
    assert_eq!(got.len(), sent.len(), "{logs}");
    check(&sent, &got);
    assert_eq!(b.metric("amqp_delay_proxy_delayed_publishes_total"), 1.0);
    let _ = on_b.close(200, "bye".into()).await;
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_longer_than_frame_max_ends_the_connection() {
    within(oversize_body()).await;
}

async fn oversize_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = World::new(&[]).await;
    let ready = w.proxy.connect().await;
    let _ = ready.close(200, "bye".into()).await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", w.proxy.port))
        .await
        .unwrap();
    s.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
    // a method frame claiming 64 MiB, then a steady stream of bytes: the proxy stops reading
    // at one frame_max and ends the connection instead of buffering it
    s.write_all(&[1, 0, 0, 0x04, 0, 0, 0]).await.unwrap();
    let chunk = vec![0u8; 64 * 1024];
    let mut written = 0usize;
    let mut ended = false;
    for _ in 0..1024 {
        match tokio::time::timeout(Duration::from_secs(5), s.write_all(&chunk)).await {
            Ok(Ok(())) => written += chunk.len(),
            Ok(Err(_)) => {
                ended = true;
                break;
            }
            Err(_) => panic!("the proxy neither read nor closed (after {written} bytes)"),
        }
    }
    if !ended {
        // everything was written into socket buffers: the proxy must have closed by now
        let mut buf = vec![0u8; 4096];
        let r = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(_) => {}
                }
            }
        })
        .await;
        ended = r.unwrap_or(false);
    }
    assert!(
        ended,
        "the connection was still open after {written} bytes of one frame"
    );
    assert!(
        written < 16 * 1024 * 1024,
        "{written} bytes were taken for one frame"
    );
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_removed_behind_the_proxy_is_declared_again_and_dead_nodes_are_skipped() {
    within(redeclare_body()).await;
}

async fn redeclare_body() {
    let mut w = World::new(&["again"]).await;
    let x = w.exchange("again");
    // the first node of the list answers nothing: clients go to the next
    let url = format!(
        "{},{}",
        proxied_url("amqp", "127.0.0.1", 1),
        w.env.settings.url
    );
    let proxy = ProxyProc::start_at(&w.env, &w.config.0, &url, &[], &[]);
    let app = proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    // someone removes the ingress (a teardown, an admin): the next declare makes it again
    let ingress = w.env.layout().proxy_ingress(&x);
    let ch = w.env.conn.create_channel().await.unwrap();
    ch.exchange_delete(ingress.as_str().into(), Default::default())
        .await
        .unwrap();
    declare_delayed(&app, &x, "direct").await;
    assert!(
        amqp_delay::ops::broker::exchange_exists(&w.env.conn, &ingress)
            .await
            .unwrap(),
        "{}",
        proxy.log()
    );
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    let sent = publish_all(
        &app,
        &x,
        "k",
        vec![(400, b"again".to_vec(), with_delay(Some(400), "a"))],
    )
    .await;
    let got = collect(
        &w.env.conn,
        &q,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    check(&sent, &got);
    let _ = app.close(200, "bye".into()).await;
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_cut_off_and_a_version_mismatch_gets_the_brokers_answer() {
    within(garbage_body()).await;
}

async fn garbage_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = World::new(&[]).await;
    let ready = w.proxy.connect().await;
    let _ = ready.close(200, "bye".into()).await;
    let read_all = |mut s: tokio::net::TcpStream| async move {
        let mut got = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
        assert!(r.is_ok(), "the connection stayed open");
        got
    };
    // not AMQP at all: closed, nothing sent to the client
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", w.proxy.port))
        .await
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_all(s).await, b"");
    // a protocol version the broker does not speak: its own header comes back, as sent
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", w.proxy.port))
        .await
        .unwrap();
    s.write_all(b"AMQP\x00\x00\x09\x02").await.unwrap();
    assert_eq!(read_all(s).await, b"AMQP\x00\x00\x09\x01");
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_and_heartbeats_keep_one_open() {
    within(idle_body()).await;
}

async fn idle_body() {
    let w = World::new(&[]).await;
    let proxy = ProxyProc::start(&w.env, &w.config.0, &["--idle-timeout", "3s"]);
    let base = proxy.url();
    let silent = connect_until(&format!("{base}?heartbeat=0"), &proxy).await;
    let beating = connect_until(&format!("{base}?heartbeat=1"), &proxy).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(
        !silent.status().connected(),
        "a silent connection outlived --idle-timeout"
    );
    assert!(
        beating.status().connected(),
        "heartbeats did not keep a connection open:\n{}",
        proxy.log()
    );
    let _ = beating.close(200, "bye".into()).await;
    w.env.cleanup().await;
}

async fn connect_until(url: &str, proxy: &ProxyProc) -> lapin::Connection {
    for _ in 0..100 {
        if let Ok(c) = amqp_delay::ops::connection::connect(url, "idle test").await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no connection through the proxy:\n{}", proxy.log())
}
