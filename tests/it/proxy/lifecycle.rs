//! A delayed exchange's end and a proxy's: a client's `exchange.delete` ends the pair (the
//! gateway stops serving it, a new declare registers it again), and a proxy told to stop asks
//! its clients to close, as a broker that shuts down does, losing nothing confirmed.

use std::time::{Duration, Instant};

use lapin::ExchangeKind;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;

use amqp_delay::ops::broker::{exchange_exists, queue_state};
use amqp_delay::ops::control::{self, Record};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_delayed_exchange_ends_its_pair_and_a_new_declare_registers_it_again() {
    within(delete_body()).await;
}

/// Waits until `text` is in the proxy's log (its gateway's included).
async fn logged(w: &World, text: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    while !w.proxy.log().contains(text) {
        assert!(
            Instant::now() < end,
            "no '{text}' within 20 s\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn delete_body() {
    let mut w = World::new(&["gone"]).await;
    let x = w.exchange("gone");
    let layout = w.env.layout();
    let ingress = layout.proxy_ingress(&x);
    let pair = pairs_of(&w.env, &[(ingress.as_str(), x.as_str())]).remove(0);
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    w.served(&x).await;

    // an end nobody trusted wrote (no user_id) changes nothing: neither the gateway nor the
    // proxy forget the pair
    let forged = format!(r#"{{"type":"gateway_pair_ended","ingress":"{ingress}","target":"{x}"}}"#);
    let ch = w.env.conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let confirm = ch
        .basic_publish(
            layout.stream_exchange().as_str().into(),
            layout.control_stream().as_str().into(),
            Default::default(),
            forged.as_bytes(),
            lapin::BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !w.proxy.log().contains("no longer serving it"),
        "{}",
        w.logs()
    );
    w.served(&x).await;

    // the application deletes its delayed exchange, as it would with the plugin
    let ch = app.create_channel().await.unwrap();
    ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("deleting the delayed exchange through the proxy");
    let q = w.env.queue("app").await;
    let conn = &w.env.conn;
    assert!(!exchange_exists(conn, &x).await.unwrap(), "the exchange");
    assert!(
        !exchange_exists(conn, &ingress).await.unwrap(),
        "its ingress"
    );
    for q in [&pair.ingress_queue, &pair.due_queue, &pair.parked_queue] {
        assert!(queue_state(conn, q).await.unwrap().is_none(), "queue {q}");
    }
    assert_eq!(w.proxy.metric("amqp_delay_proxy_pairs_ended_total"), 1.0);
    let records = control::read_all(conn, &layout, &Default::default())
        .await
        .unwrap();
    // naming who deleted it, and where
    let user = credentials()
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let ended = Record::GatewayPairEnded {
        ingress: ingress.clone(),
        target: x.clone(),
        by: Some(user),
        vhost: Some("/".into()),
    };
    assert!(records.contains(&ended), "{records:?}");
    logged(&w, "no longer serving it").await;

    // declared again (a redeploy): registered and served again, and delayed messages work
    declare_delayed(&app, &x, "direct").await;
    bind(conn, &q, &x, "k").await;
    w.served(&x).await;
    let msgs = vec![(300, b"again".to_vec(), with_delay(Some(300), "again"))];
    let sent = publish_all(&app, &x, "k", msgs).await;
    let got = collect(
        conn,
        &q,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    check(&sent, &got);
    assert_eq!(
        w.proxy.metric("amqp_delay_proxy_pairs_registered_total"),
        2.0
    );

    // a delete without an answer (nowait): the client gets none, and its channel goes on
    let ch = app.create_channel().await.unwrap();
    let nowait = ExchangeDeleteOptions {
        nowait: true,
        ..Default::default()
    };
    ch.exchange_delete(x.as_str().into(), nowait).await.unwrap();
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let e = ch
        .exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await
        .expect_err("the exchange is gone");
    assert!(e.to_string().contains("NOT_FOUND"), "{e}\n{}", w.logs());
    assert!(app.status().connected(), "the connection goes on");
    assert!(!exchange_exists(conn, &ingress).await.unwrap());
    assert_eq!(w.proxy.metric("amqp_delay_proxy_pairs_ended_total"), 2.0);
    let _ = app.close(200, "bye".into()).await;
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_told_to_stop_asks_its_clients_to_close_and_loses_nothing_confirmed() {
    within(drain_body()).await;
}

async fn drain_body() {
    let mut w = World::new(&["drain"]).await;
    let x = w.exchange("drain");
    let app = w.proxy.connect().await;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut events = app.events_listener();
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(e) = events.next().await {
            if let lapin::Event::Error(e) = e {
                let _ = tx.send(e.to_string());
            }
        }
    });
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    w.served(&x).await;
    let msgs = (0..20)
        .map(|i| {
            let d = 500 + 50 * i;
            let id = format!("m{i}");
            (d, id.clone().into_bytes(), with_delay(Some(d), &id))
        })
        .collect();
    let sent = publish_all(&app, &x, "k", msgs).await;

    let pid = w.proxy.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let end = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = w.proxy.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "delay-proxy still runs 15 s after SIGTERM\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}\n{}", w.logs());
    let log = w.proxy.log();
    assert!(log.contains("every client closed"), "{log}");
    assert!(!app.status().connected(), "the client was asked to close");
    let why = rx.try_recv().unwrap_or_default();
    assert!(
        why.contains("CONNECTION_FORCED") || why.contains("320"),
        "'{why}'\n{log}"
    );

    // the proxy started again (its gateway) delivers what the stopped one had confirmed
    w.restart_proxy();
    let got = collect(
        &w.env.conn,
        &q,
        sent.len(),
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    check(&sent, &got);
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_no_gateway_serves_is_named_and_its_messages_wait_counted_from_their_publish() {
    within(unserved_body()).await;
}

/// A proxy that delivers nothing (`--no-gateway`) and no gateway: the confirmed messages wait,
/// the proxy's log, its metric and `stats` name the pair within seconds; a proxy that delivers,
/// started later, delivers them all, none early, their delay counted from the publish.
async fn unserved_body() {
    let mut w = World::with_proxy(&["unserved"], &["--no-gateway"]).await;
    let x = w.exchange("unserved");
    let ingress = w.env.layout().proxy_ingress(&x);
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    let msgs = (0..5)
        .map(|i| {
            let id = format!("u{i}");
            (1000, id.clone().into_bytes(), with_delay(Some(1000), &id))
        })
        .collect();
    let sent = publish_all(&app, &x, "k", msgs).await;
    let named = "no gateway serves this delayed exchange";
    let end = Instant::now() + Duration::from_secs(30);
    while !w.proxy.log().contains(named) {
        assert!(Instant::now() < end, "not named within 30 s\n{}", w.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(w.proxy.metric("amqp_delay_proxy_pairs_unserved"), 1.0);
    let (code, out, err) = publisher_cli(&w.config.0, &["stats"]).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("gateway pairs no gateway serves") && out.contains(&ingress),
        "{out}"
    );

    // a proxy that delivers: everything arrives, none early
    let started = amqp_delay::time::now_ms();
    w.restart_proxy();
    let got = collect(
        &w.env.conn,
        &q,
        sent.len(),
        Duration::from_secs(30),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(got.len(), sent.len(), "{}", w.logs());
    check(&sent, &got);
    let first = sent.iter().map(|s| s.at_ms).min().unwrap_or(0);
    let last = got.iter().map(|r| r.arrived_ms).max().unwrap_or(0);
    eprintln!(
        "x-delay 1000 ms, unserved for {} ms: the last arrived {} ms after the delivering proxy started",
        started.saturating_sub(first),
        last.saturating_sub(started)
    );
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_publish_nothing_can_hold_is_returned_not_dropped_and_the_ingress_comes_back() {
    within(returned_body()).await;
}

/// The pair's ingress queue deleted behind the proxy (by hand, as an operator might): a delayed
/// publish without `mandatory` is returned to its client (312 NO_ROUTE, naming the client's
/// exchange), never only confirmed; the proxy's log and metric name it, the proxy declares the
/// queue again within seconds, and what is published then arrives, not early.
async fn returned_body() {
    let mut w = World::new(&["ret"]).await;
    let x = w.exchange("ret");
    let ingress = w.env.layout().proxy_ingress(&x);
    let pair = pairs_of(&w.env, &[(ingress.as_str(), x.as_str())]).remove(0);
    let app = w.proxy.connect().await;
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    w.served(&x).await;
    let admin = w.env.conn.create_channel().await.unwrap();
    admin
        .queue_delete(pair.ingress_queue.as_str().into(), Default::default())
        .await
        .expect("deleting the ingress queue");

    let ch = app.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let not_mandatory = BasicPublishOptions::default();
    let confirm = ch
        .basic_publish(
            x.as_str().into(),
            "k".into(),
            not_mandatory,
            b"lost?",
            with_delay(Some(500), "lost?"),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let Confirmation::Ack(Some(returned)) = confirm else {
        panic!("not returned: {confirm:?}\n{}", w.logs());
    };
    assert_eq!(returned.reply_code, 312, "{returned:?}");
    assert_eq!(returned.exchange.as_str(), x, "names the client's exchange");
    assert_eq!(
        w.proxy.metric("amqp_delay_proxy_delayed_returned_total"),
        1.0
    );
    logged(&w, "a delayed publish was returned to its client").await;

    // declared again by the proxy's check, and served: delayed publishes work again
    logged(&w, "ingress queue declared again").await;
    assert_eq!(
        w.proxy.metric("amqp_delay_proxy_ingresses_restored_total"),
        1.0
    );
    w.served(&x).await;
    let msgs = vec![(300, b"after".to_vec(), with_delay(Some(300), "after"))];
    let sent = publish_all(&app, &x, "k", msgs).await;
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
