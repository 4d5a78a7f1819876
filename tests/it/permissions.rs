//! The least-privilege permission sets of the README ("Security") hold on a real broker: after
//! an admin ran `declare`, a publisher, a worker and a gateway each do their job with their
//! set, and the publisher cannot bind a queue of its own to the delivery exchange (which would
//! let it read other destinations' messages). Runs on our own TLS test node's plain port (users
//! are created there, never on the main broker).

use std::time::Duration;

use amqp_delay::{Message, Outcome, Publisher, Settings, Worker};
use lapin::ExchangeKind;
use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;

use crate::harness::*;
use crate::worker::Scripted;

fn ctl(args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-n", "adtls@localhost"])
        .args(args)
        .output()
        .expect("rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Creates `user` with `configure`, `write`, `read` regexes on vhost `/`.
fn user(user: &str, configure: &str, write: &str, read: &str) {
    let _ = std::process::Command::new("rabbitmqctl")
        .args(["-n", "adtls@localhost", "delete_user", user])
        .output();
    ctl(&["add_user", user, &format!("{user}-pw")]);
    ctl(&["set_permissions", "-p", "/", user, configure, write, read]);
}

fn url(user: &str, port: &str) -> String {
    format!("amqp://{user}:{user}-pw@127.0.0.1:{port}/%2f")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_works_with_its_permission_set_and_no_more() {
    let node = crate::security::tls_node();
    let port = node["AMQP_PORT"].clone();
    let p = random_prefix();
    let q = format!("{p}-orders");
    let tiers = format!(r"{p}\.(level\d+|fixed\..+|overflow\d+|deliver)");
    // the sets the README documents
    user(
        &format!("{p}-pub"),
        &format!("^{p}-evil$"),
        &format!("^{tiers}$"),
        &format!("^{p}-evil$"),
    );
    user(
        &format!("{p}-wrk"),
        "^$",
        &format!("^(amq\\.default|{tiers})$"),
        &format!(r"^({q}|{p}\.control)$"),
    );
    let (ingress, target) = (format!("{p}-delayed"), format!("{p}-target"));
    user(
        &format!("{p}-gw"),
        "^$",
        &format!(r"^(amq\.default|{ingress}|{target}|{p}\.(gw\..*|parking)|{tiers})$"),
        &format!(r"^({ingress}|{p}\.gw\..*|{p}\.control)$"),
    );
    let admin = url("guest", &port).replace("guest-pw", "guest");
    let mut settings = Settings {
        url: admin.clone(),
        prefix: p.clone(),
        topology: small_topology(),
        ..Settings::default()
    };
    settings.consumer.retry.base = amqp_delay::time::DurationMs(20);
    settings.consumer.retry.jitter = 0.0;

    // the admin declares the topology and the worker's queue with what the worker needs
    let conn = amqp_delay::connection::connect(&admin, "perm admin")
        .await
        .unwrap();
    let topo = amqp_delay::Topology::new(settings.layout().unwrap());
    topo.declare(&conn).await.unwrap();
    topo.declare_destination(&conn, &q).await.unwrap();
    topo.declare_parking(&conn, &q).await.unwrap();
    topo.declare_batch_marker(&conn, &q).await.unwrap();

    // the publisher schedules with write rights on the tiers only
    let publisher = Publisher::connect(&Settings {
        url: url(&format!("{p}-pub"), &port),
        ..settings.clone()
    })
    .await
    .expect("a publisher needs no configure or read right");
    for i in 0..3 {
        publisher
            .schedule(Message::new(q.clone(), 30, format!("m{i}")).with_id(format!("m{i}")))
            .await
            .expect("send works");
    }
    // ... and cannot bind a queue of its own to the delivery exchange
    let pc = amqp_delay::connection::connect(&url(&format!("{p}-pub"), &port), "perm pub")
        .await
        .unwrap();
    let ch = pc.create_channel().await.unwrap();
    ch.queue_declare(
        format!("{p}-evil").as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .expect("its own queue");
    let bind = ch
        .queue_bind(
            format!("{p}-evil").as_str().into(),
            format!("{p}.deliver").as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await;
    let e = bind.expect_err("the publisher bound its own queue to the delivery exchange");
    assert!(e.to_string().contains("ACCESS_REFUSED"), "{e}");
    let _ = pc.close(200, "bye".into()).await;

    // the worker consumes, retries through the tiers and parks with its set
    let h = Scripted::new(|d| match (d.body.as_slice(), d.attempt) {
        (b"m1", 0) => Outcome::Retry("once".into()),
        (b"m2", _) => Outcome::Permanent("parked".into()),
        _ => Outcome::Success,
    });
    let log = h.log.clone();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::new(Settings {
        url: url(&format!("{p}-wrk"), &port),
        ..settings.clone()
    })
    .subscribe(q.clone(), h);
    let run = tokio::spawn(worker.run(async {
        let _ = stop_rx.await;
    }));
    assert!(
        wait_until(Duration::from_secs(15), || log.lock().unwrap().len() >= 4).await,
        "the worker did not execute with its permission set: {:?}",
        log.lock().unwrap()
    );
    let _ = stop.send(());
    run.await.unwrap().expect("the worker ran without errors");
    let parked = collect(
        &conn,
        &settings.layout().unwrap().parked_queue(&q),
        1,
        Duration::from_secs(5),
        Duration::from_millis(100),
    )
    .await;
    assert_eq!(parked.len(), 1);

    // the gateway relays with its set (the target is the application's, declared by an admin)
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        target.as_str().into(),
        ExchangeKind::Direct,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let out = format!("{p}-out");
    ch.queue_declare(
        out.as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        out.as_str().into(),
        target.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let gw_settings = Settings {
        url: url(&format!("{p}-gw"), &port),
        gateway: amqp_delay::settings::GatewaySettings::from_flags(
            std::slice::from_ref(&ingress),
            std::slice::from_ref(&target),
        )
        .unwrap(),
        ..settings.clone()
    };
    // an admin declares the pair; the gateway binary then runs as it is deployed
    amqp_delay::gateway::Gateway::new(Settings {
        url: admin.clone(),
        ..gw_settings.clone()
    })
    .unwrap()
    .declare(&conn)
    .await
    .unwrap();
    let t = &settings.topology;
    let cfg = temp_path(&p, "gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "prefix = \"{p}\"\n[topology]\nradix = {}\nunit_ms = {}\nmax_delay = {}\nfixed_levels = [150]\nmax_tier_ttl_ms = {}\n",
            t.radix,
            t.unit_ms,
            t.max_delay.as_millis(),
            t.max_tier_ttl_ms
        ),
    )
    .unwrap();
    let mut gw = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args([
            "--url",
            &gw_settings.url,
            "gateway",
            "--ingress",
            &ingress,
            "--target",
            &target,
        ])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pair = amqp_delay::gateway::Gateway::new(gw_settings.clone())
        .unwrap()
        .pairs()[0]
        .clone();
    let end = std::time::Instant::now() + Duration::from_secs(15);
    while amqp_delay::broker::queue_state(&conn, &pair.due_queue)
        .await
        .unwrap()
        .is_none_or(|s| s.consumers == 0)
    {
        if std::time::Instant::now() > end || gw.try_wait().unwrap().is_some() {
            gw.start_kill().ok();
            let out = gw.wait_with_output().await.unwrap();
            panic!(
                "the gateway did not start with its permission set:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), lapin::types::AMQPValue::LongInt(40));
    ch.basic_publish(
        ingress.as_str().into(),
        "k".into(),
        Default::default(),
        b"via gateway",
        lapin::BasicProperties::default().with_headers(h),
    )
    .await
    .unwrap();
    let got = collect(
        &conn,
        &out,
        1,
        Duration::from_secs(15),
        Duration::from_millis(100),
    )
    .await;
    gw.start_kill().unwrap();
    let gw_out = gw.wait_with_output().await.unwrap();
    let _ = std::fs::remove_file(&cfg);
    assert_eq!(
        got.len(),
        1,
        "the gateway did not relay with its permission set:\n{}",
        String::from_utf8_lossy(&gw_out.stderr)
    );

    // clean up on the test node
    amqp_delay::gateway::Gateway::new(gw_settings)
        .unwrap()
        .delete(&conn)
        .await
        .unwrap();
    for x in [&target] {
        let _ = ch
            .exchange_delete(x.as_str().into(), Default::default())
            .await;
    }
    for q in [
        &q,
        &out,
        &format!("{p}-evil"),
        &settings.layout().unwrap().parked_queue(&q),
    ] {
        let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    }
    topo.delete(&conn).await.unwrap();
    publisher.close().await;
    for u in ["pub", "wrk", "gw"] {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["-n", "adtls@localhost", "delete_user", &format!("{p}-{u}")])
            .output();
    }
}
