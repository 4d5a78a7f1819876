//! Hostile and careless input against every binary: nothing panics, every refusal
//! names what is wrong, nothing valid is lost because of a bad neighbour, no reserved header
//! gets through, nothing hangs on a silent server, and a timed-out handler leaves no process.

use std::process::Stdio;
use std::time::{Duration, Instant};

use amqp_delay::Message;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::gateway::{GatewayProc, Logged, pairs_of, wait_for_consumers, write_config};
use crate::harness::*;

fn no_panic(stderr: &str) {
    assert!(!stderr.contains("panicked"), "a panic: {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_strings_and_bad_flags_are_refused_without_a_panic() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("strings").await;
    let cfg = env.write_config("");
    let cfg = cfg.as_path();
    let long = "x".repeat(300);
    for (args, want) in [
        (
            vec![
                "send",
                "--queue",
                &q,
                "--delay",
                "10",
                "--body",
                "b",
                "--content-type",
                &long,
            ],
            "content type is 300 bytes",
        ),
        (
            vec![
                "send", "--queue", &q, "--delay", "10", "--body", "b", "--id", &long,
            ],
            "message id is 300 bytes",
        ),
        (
            vec![
                "send", "--queue", &q, "--delay", "10", "--body", "b", "--id", "",
            ],
            "message id must not be empty",
        ),
        (
            vec![
                "send", "--queue", &q, "--delay", "10", "--body", "b", "--header", "=v",
            ],
            "non-empty NAME",
        ),
        (
            vec![
                "send",
                "--queue",
                &q,
                "--delay",
                "10",
                "--body",
                "b",
                "--header",
                "x-delay-routing-key=evil",
            ],
            "reserved",
        ),
        (
            vec![
                "send",
                "--queue",
                &q,
                "--delay",
                "10",
                "--body",
                "b",
                "--header",
                "x-delay-user-id=admin",
            ],
            "reserved",
        ),
    ] {
        let (code, _, err) = publisher_cli(cfg, &args).await;
        no_panic(&err);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // the consumer checks its flags before it connects
    let consumer = |args: Vec<String>| {
        let cfg = cfg.to_path_buf();
        async move {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
                .arg("--config")
                .arg(&cfg)
                .args(&args)
                .env("AMQP_URL", broker_url())
                .output()
                .await
                .unwrap()
        }
    };
    for (args, want) in [
        (
            vec!["--queue", &q, "--forward", &format!("{long}:k")],
            "at most 255 bytes",
        ),
        (
            vec!["--queue", &q, "--exec", "/nonexistent/handler"],
            "not an executable",
        ),
        (
            vec![
                "--queue",
                &q,
                "--exec",
                "true",
                "--permanent-exit-code",
                "300",
            ],
            "from 1 to 255",
        ),
    ] {
        let out = consumer(args.iter().map(|s| s.to_string()).collect()).await;
        let err = String::from_utf8_lossy(&out.stderr);
        no_panic(&err);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // a closed pipe ends a command quietly
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' --config '{}' stats | head -1",
            env!("CARGO_BIN_EXE_delay-publisher"),
            cfg.display()
        ))
        .env("AMQP_URL", broker_url())
        .output()
        .await
        .unwrap();
    no_panic(&String::from_utf8_lossy(&out.stderr));
    // a body from a file, byte for byte
    let body_file = temp_path(&env.settings.prefix, "body.bin");
    std::fs::write(&body_file, [0u8, 1, 2, 255]).unwrap();
    let (code, _, err) = publisher_cli(
        cfg,
        &[
            "send",
            "--queue",
            &q,
            "--delay",
            "5",
            "--id",
            "bf",
            "--body-file",
            body_file.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    let got = env.expect(&q, 1).await;
    assert_eq!(got[0].body, [0u8, 1, 2, 255]);
    let _ = std::fs::remove_file(&body_file);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_jsonl_line_is_reported_alone_and_its_neighbours_are_delivered() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("bulk-bad").await;
    let cfg = env.write_config("[publisher]\nmax_message_bytes = 2000\n");
    let file = temp_path(&env.settings.prefix, "bad.jsonl");
    let long = "c".repeat(300);
    let big_headers: serde_json::Map<String, serde_json::Value> = (0..200)
        .map(|i| (format!("h{i}"), serde_json::Value::String("v".repeat(200))))
        .collect();
    let mut lines: Vec<String> = (0..10)
        .map(|i| format!(r#"{{"queue":"{q}","delay_ms":5,"body":"ok{i}","id":"ok{i}"}}"#))
        .collect();
    lines[2] = format!(r#"{{"queue":"{q}","delay_ms":5,"body":"x","content_type":"{long}"}}"#);
    lines[4] = format!(
        r#"{{"queue":"{q}","delay_ms":5,"body":"{}"}}"#,
        "b".repeat(3000)
    );
    lines[6] = serde_json::json!({"queue": q, "delay_ms": 5, "body": "h", "headers": big_headers})
        .to_string();
    lines[8] = format!(
        r#"{{"queue":"{q}","delay_ms":5,"body":"x","headers":{{"x-delay-routing-key":"evil"}}}}"#
    );
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let (code, out, err) = publisher_cli(&cfg, &["send", "--jsonl", file.to_str().unwrap()]).await;
    no_panic(&err);
    assert_eq!(code, Some(1), "{err}");
    assert!(out.contains("6 confirmed, 4 failed"), "{out}\n{err}");
    assert!(
        err.contains("line 3: the content type is 300 bytes"),
        "{err}"
    );
    assert!(
        err.contains("line 5:") && err.contains("the body is 3000 bytes"),
        "{err}"
    );
    assert!(
        err.contains("line 7:") && err.contains("the headers take"),
        "{err}"
    );
    assert!(err.contains("line 9:") && err.contains("reserved"), "{err}");
    let got = env.expect(&q, 6).await;
    let ids = counts(&got);
    for i in [0, 1, 3, 5, 7, 9] {
        assert!(ids.contains_key(&format!("ok{i}")), "ok{i} lost: {ids:?}");
    }
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_refuses_reserved_headers_and_oversize_headers() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("lib").await;
    let p = env.publisher().await;
    let mut h = FieldTable::default();
    h.insert(
        "x-delay-user-id".into(),
        AMQPValue::LongString(LongString::from("admin")),
    );
    let e = p
        .schedule(Message::new(q.clone(), 5, "x").with_headers(h))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("reserved"), "{e}");
    let h = filler_headers(620, 0);
    let e = p
        .schedule(Message::new(q.clone(), 5, "x").with_headers(h))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("the headers take"), "{e}");
    let e = p
        .schedule(Message::new(q.clone(), 5, "x").with_id("i".repeat(256)))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("message id is 256 bytes"), "{e}");
    p.close().await;
    env.cleanup().await;
}

/// At the gateway ingress, every `x-delay-*` header an application sends is stripped (even
/// wrongly typed ones) and the message is delivered as usual; headers too large to survive the
/// tiers park the message with the reason instead of looping; the messages behind it flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_ingress_strips_forged_headers_and_parks_oversize_ones() {
    let env = Env::new(small_topology()).await;
    let (x_in, x_t, _objects) = crate::gateway::one_pair(&env).await;
    let mut env = env;
    let out = env.queue("gw-out").await;
    crate::gateway::bind(&env.conn, &out, &x_t, "k").await;
    let pairs = [(x_in.as_str(), x_t.as_str())];
    let config = write_config(&env, "");
    let gw = GatewayProc::start(&env, &config.0, &pairs, "gw");
    let pair = pairs_of(&env, &pairs);
    wait_for_consumers(&env.conn, &pair, 1, &[&gw]).await;
    let ch = env.conn.create_channel().await.unwrap();
    let publish = |id: &'static str, h: FieldTable| {
        let ch = ch.clone();
        let x_in = x_in.clone();
        async move {
            ch.basic_publish(
                x_in.as_str().into(),
                "k".into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                lapin::BasicProperties::default()
                    .with_message_id(id.into())
                    .with_headers(h),
            )
            .await
            .unwrap();
        }
    };
    let mut forged = FieldTable::default();
    forged.insert("x-delay".into(), AMQPValue::LongInt(50));
    forged.insert(
        "x-delay-attempt".into(),
        AMQPValue::LongString(LongString::from("two")),
    );
    forged.insert(
        "x-delay-user-id".into(),
        AMQPValue::LongString(LongString::from("admin")),
    );
    forged.insert(
        "x-delay-routing-key".into(),
        AMQPValue::LongString(LongString::from("evil")),
    );
    publish("forged", forged).await;
    let mut big = filler_headers(300, 0);
    big.insert("x-delay".into(), AMQPValue::LongInt(50));
    publish("big", big).await;
    let mut fine = FieldTable::default();
    fine.insert("x-delay".into(), AMQPValue::LongInt(50));
    publish("after", fine).await;
    let got = env.expect(&out, 2).await;
    let ids: Vec<String> = got.iter().map(|r| r.id()).collect();
    assert!(ids.contains(&"forged".to_string()), "{ids:?}\n{}", gw.log());
    assert!(ids.contains(&"after".to_string()), "{ids:?}\n{}", gw.log());
    let forged = got.iter().find(|r| r.id() == "forged").unwrap();
    assert_eq!(forged.routing_key, "k", "the forged routing key was used");
    assert!(
        forged.header("x-delay-user-id").is_none(),
        "forged user id delivered"
    );
    assert!(forged.header("x-delay-attempt").is_none());
    let parked = env.expect(&pair[0].ingress_parked_queue, 1).await;
    assert_eq!(parked.len(), 1, "{}", gw.log());
    assert_eq!(parked[0].id(), "big");
    let reason = parked[0].text_header("x-delay-parked-reason").unwrap();
    assert!(reason.contains("the headers take"), "{reason}");
    assert!(
        !gw.log().contains("reconnecting"),
        "the gateway lost its connection:\n{}",
        gw.log()
    );
    let _ = ch.close(200, "bye".into()).await;
    drop(gw);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_is_given_up_on_not_waited_for_forever() {
    // accepts TCP connections and never says a word
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    for args in [
        vec!["send", "--queue", "q", "--delay", "1", "--body", "x"],
        vec!["stats"],
    ] {
        let start = Instant::now();
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--url")
            .arg(&url)
            .args(&args)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(40), out)
            .await
            .expect("the command hung on a silent server")
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("no answer from the broker"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(30));
    }
    // a worker says so and keeps trying
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .args(["--url", &url, "--queue", "q", "--log"])
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut text = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(25), async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = tokio::io::AsyncReadExt::read(&mut stderr, &mut buf).await {
            if n == 0 {
                break;
            }
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            if text.contains("reconnecting") {
                break;
            }
        }
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the worker exited: {text}"
    );
    assert!(
        text.contains("no answer from the broker") && text.contains("reconnecting"),
        "{text}"
    );
    assert!(
        !text.contains("\x1b["),
        "colour codes in a log that is not a terminal"
    );
    child.start_kill().unwrap();
    hold.abort();
}

/// `frame_max=999999999` in the URL made lapin set aside ~64 GB and abort the process: a
/// frame_max outside 96 KiB ..= 1 MiB is refused before connecting, by the binaries (exit 2)
/// and the library alike, and a URL without one asks for the broker's 128 KiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_max_out_of_bounds_is_refused_before_connecting() {
    let with = |fm: &str| {
        let url = broker_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}frame_max={fm}")
    };
    for (fm, want) in [
        ("999999999", "above 1048576 bytes"),
        ("0", "below AMQP's minimum frame size of 4096"),
        ("8192", "too small for amqp-delay"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .args(["--prefix", &random_prefix(), "--url", &with(fm), "stats"])
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        no_panic(&err);
        assert_eq!(out.status.code(), Some(2), "frame_max={fm}: {err}");
        assert!(err.contains(want), "frame_max={fm}: {err}");
        match amqp_delay::ops::connection::connect(&with(fm), "frame_max test").await {
            // the URL is configuration
            Err(e @ amqp_delay::Error::Settings(_)) => {
                assert!(e.to_string().contains(want), "{e}")
            }
            Err(e) => panic!("frame_max={fm}: {e}"),
            Ok(_) => panic!("frame_max={fm} was accepted"),
        }
    }
    let conn = amqp_delay::ops::connection::connect(&with("1048576"), "frame_max test")
        .await
        .expect("1 MiB is allowed");
    assert!(conn.configuration().frame_max() <= 1 << 20);
    let _ = conn.close(200, "bye".into()).await;
    let conn = connect().await;
    assert_eq!(conn.configuration().frame_max(), 131_072);
    let _ = conn.close(200, "bye".into()).await;

    // a broker that offers a smaller frame_max wins the negotiation: refused after the handshake
    let port = tune_rewriting_proxy(8192).await;
    let mut url = url::Url::parse(&broker_url()).unwrap();
    url.set_port(Some(port)).unwrap();
    match amqp_delay::ops::connection::connect(url.as_str(), "frame_max test").await {
        // the broker's configuration, not the request
        Err(e @ amqp_delay::Error::Settings(_)) => {
            assert!(
                e.to_string().contains("allows frames of 8192 bytes only"),
                "{e}"
            )
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a negotiated frame_max of 8192 was accepted"),
    }
}

/// An application's own connection with a `frame_max` below amqp-delay's floor is refused by
/// `Publisher::with_connection`, saying what to change (our own connections are checked when
/// they connect, above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_connection_with_a_small_frame_max_is_refused_by_the_publisher() {
    let env = Env::new(small_topology()).await;
    let url = broker_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let conn = lapin::Connection::connect(
        &format!("{url}{sep}frame_max=8192"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    assert_eq!(conn.configuration().frame_max(), 8192);
    let conn = std::sync::Arc::new(conn);
    let r = amqp_delay::Publisher::with_connection(conn.clone(), env.layout(), &env.settings).await;
    match r {
        Err(amqp_delay::Error::Invalid(e)) => assert!(
            e.contains("allows frames of 8192 bytes only") && e.contains("larger frame_max"),
            "{e}"
        ),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a connection with frame_max 8192 was accepted"),
    }
    assert!(
        conn.status().connected(),
        "the caller's connection was closed"
    );
    let _ = conn.close(200, "bye".into()).await;
    env.cleanup().await;
}

/// A TCP proxy to the broker that rewrites the `frame_max` of the broker's Connection.Tune to
/// `frame_max`, as a broker configured so would offer it. Returns its port.
async fn tune_rewriting_proxy(frame_max: u32) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let broker = url::Url::parse(&broker_url()).unwrap();
    let upstream = format!(
        "{}:{}",
        broker.host_str().unwrap(),
        broker.port().unwrap_or(5672)
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            tokio::spawn(async move {
                // frame by frame: type (1), channel (2), size (4), payload, frame-end (1)
                loop {
                    let mut head = [0u8; 7];
                    if sr.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                    let mut rest = vec![0u8; size + 1];
                    if sr.read_exact(&mut rest).await.is_err() {
                        return;
                    }
                    // a method frame of class 10 (connection), method 30 (tune): channel_max
                    // (2 bytes), then frame_max (4 bytes)
                    if head[0] == 1 && size >= 10 && rest[..4] == [0, 10, 0, 30] {
                        rest[6..10].copy_from_slice(&frame_max.to_be_bytes());
                    }
                    if cw.write_all(&head).await.is_err() || cw.write_all(&rest).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// lapin's trace level prints the login's SASL response, `\0user\0password` as a byte list:
/// no `RUST_LOG` spelling may bring it back (the audit found `5`, `lapin=5`,
/// `lapin::io_loop=trace` and `info,lapin::io_loop=trace` did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_rust_log_prints_the_password() {
    let url = broker_url();
    let password = url::Url::parse(&url)
        .ok()
        .and_then(|u| u.password().map(str::to_string))
        .unwrap_or_else(|| "guest".into());
    // how lapin's Debug prints the password's bytes, e.g. "103, 117, 101, 115, 116"
    let bytes = password
        .bytes()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    for spec in [
        "trace",
        "5",
        "lapin=5",
        "lapin::io_loop=trace",
        "info,lapin::io_loop=trace",
        "amq_protocol=trace,lapin=trace",
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .args(["--prefix", &random_prefix(), "stats"])
            .env("AMQP_URL", &url)
            .env("RUST_LOG", spec)
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains(&bytes) && !err.contains("LongString([0,"),
            "RUST_LOG={spec} printed the SASL response: {err}"
        );
        if !spec.contains("io_loop") {
            // the filter is on: lapin's debug events still show
            assert!(
                err.contains("lapin"),
                "RUST_LOG={spec}: no lapin event at all: {err}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_handler_leaves_no_process_behind() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("group").await;
    env.parked_queue(&q);
    let cfg = env.write_config("[consumer.retry]\nmax_attempts = 1\n");
    // a marker only this test's processes carry
    let marker = format!("{}", 1000 + rand::random::<u32>() % 8000);
    let cmd = format!("sh -c 'sleep {marker}; true'");
    let mut child = crate::worker::consumer(
        &env,
        &cfg,
        &["--queue", &q, "--exec", &cmd, "--handler-timeout", "1s"],
    );
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 0, "x").with_id("slow"))
        .await
        .unwrap();
    let sleeping = || {
        std::process::Command::new("pgrep")
            .args(["-f", &format!("^sleep {marker}$")])
            .output()
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false)
    };
    assert!(
        wait_until(Duration::from_secs(10), sleeping).await,
        "the handler never started"
    );
    // the 1 s timeout fires; the whole group dies with the handler
    assert!(
        wait_until(Duration::from_secs(10), || !sleeping()).await,
        "the handler's child outlived the timeout"
    );
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    p.close().await;
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}

/// Messages `q` holds (passive declare), or `None` when it does not exist.
async fn depth(env: &Env, q: &str) -> Option<u32> {
    amqp_delay::ops::broker::queue_state(&env.conn, q)
        .await
        .unwrap()
        .map(|s| s.ready)
}

/// A message whose header frame outgrew the broker's `frame_max` on a dead-letter hop (as one
/// published before header sizes were bounded, or by a foreign client into a tier) sits at the
/// head of a destination: the worker must not loop reconnecting with every message behind it
/// redelivered. It takes one message at a time until the poison is gone, and the valid messages
/// behind it run. The destination is the one `declare --queue` creates: its delivery limit (20,
/// 4.x's default, set explicitly so that 3.x has one too) parks the poison in `<prefix>.parked`.
/// Without it, on 3.10, the queue stayed blocked forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_frame_max_is_parked_and_the_queue_behind_it_runs() {
    use amqp_delay::Topology;
    use lapin::options::QueueDeclareOptions;

    let mut env = Env::new(small_topology()).await;
    let prefix = env.settings.prefix.clone();
    let q = format!("{prefix}-poisoned");
    let stage = format!("{prefix}-stage");
    env.parked_queue(&q);
    // a delivery limit dead-letters into the parking exchange, whose queue is `<prefix>.parked`
    let parked = env.layout().unroutable_queue();
    env.track_queue(&q);
    env.track_queue(&stage);
    let ch = env.conn.create_channel().await.unwrap();
    assert!(
        Topology::new(env.layout())
            .declare_destination(&env.conn, &q)
            .await
            .unwrap(),
        "{q} is created by declare"
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut stage_args = FieldTable::default();
    stage_args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(1));
    stage_args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    stage_args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(q.as_str())),
    );
    ch.queue_declare(stage.as_str().into(), durable, stage_args)
        .await
        .unwrap();

    // 620 headers of 200 B and a pad: a 130 994-byte table, a 131 021-byte header frame, just
    // within frame_max (131 072); the hop's x-death pushes it over.
    let headers = filler_headers(620, 781);
    ch.basic_publish(
        "".into(),
        stage.as_str().into(),
        BasicPublishOptions::default(),
        b"poison",
        lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id("poison".into())
            .with_headers(headers),
    )
    .await
    .unwrap();
    assert!(
        wait_until_async(Duration::from_secs(10), || async {
            depth(&env, &q).await == Some(1)
        })
        .await,
        "the poison message did not reach {q}"
    );
    let p = env.publisher().await;
    for i in 0..5 {
        p.schedule(Message::new(q.clone(), 1, "valid").with_id(format!("valid-{i}")))
            .await
            .unwrap();
    }
    assert!(
        wait_until_async(Duration::from_secs(10), || async {
            depth(&env, &q).await == Some(6)
        })
        .await,
        "the valid messages did not reach {q}"
    );

    let h = crate::worker::Scripted::new(|_| amqp_delay::Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = crate::worker::spawn_worker(&env, &q, h, crate::worker::retry(100, 2.0, 3));
    // 20 deliveries of the poison, each costing the worker a connection, then the rest
    let ran = wait_until(Duration::from_secs(90), || log.lock().unwrap().len() >= 5).await;
    let parked_n = if wait_until_async(Duration::from_secs(10), || async {
        depth(&env, &parked).await == Some(1)
    })
    .await
    {
        Some(1)
    } else {
        depth(&env, &parked).await
    };
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ids: Vec<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert!(
        ran,
        "the messages behind the poison did not run in 90 s: {ids:?}"
    );
    assert!(!ids.contains(&"poison".to_string()));
    assert_eq!(parked_n, Some(1), "the poison message is parked");
    assert_eq!(depth(&env, &q).await, Some(0));
    drop(p);
    env.cleanup().await;
}

/// A TCP proxy to the broker whose first connection goes silent right after the AMQP handshake
/// (the broker's Start, Tune and Open-Ok are passed, nothing after), as a connection to a node
/// that is stopping was seen to: open, but no broker call on it ever returns. Later connections
/// pass through. Returns the port and the number of connections accepted.
async fn silent_after_handshake_proxy() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let broker = url::Url::parse(&broker_url()).unwrap();
    let upstream = format!(
        "{}:{}",
        broker.host_str().unwrap(),
        broker.port().unwrap_or(5672)
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let k = count.fetch_add(1, Ordering::SeqCst);
            let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            tokio::spawn(async move {
                if k > 0 {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    return;
                }
                // frame by frame: type (1), channel (2), size (4), payload, frame-end (1)
                let mut methods = 0;
                loop {
                    let mut head = [0u8; 7];
                    if sr.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                    let mut rest = vec![0u8; size + 1];
                    if sr.read_exact(&mut rest).await.is_err() {
                        return;
                    }
                    if methods < 3 {
                        methods += u32::from(head[0] == 1);
                        let _ = cw.write_all(&head).await;
                        let _ = cw.write_all(&rest).await;
                    }
                    // after Open-Ok: swallowed, the connection stays open and silent
                }
            });
        }
    });
    (port, accepted)
}

/// A worker whose connection opens and then never answers (seen during a cluster restart)
/// gives it up after its setup timeout and reconnects, instead of waiting forever while its
/// queue fills up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_after_the_handshake_is_replaced() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("silent").await;
    env.parked_queue(&q);
    let (port, accepted) = silent_after_handshake_proxy().await;
    let mut s = env.settings.clone();
    s.url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let h = crate::worker::Scripted::new(|_| amqp_delay::Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = crate::worker::spawn_worker_with(s, &q, h);
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 1, "x").with_id("after-silence"))
        .await
        .unwrap();
    let started = Instant::now();
    let ran = wait_until(Duration::from_secs(60), || !log.lock().unwrap().is_empty()).await;
    let took = started.elapsed();
    let connections = accepted.load(std::sync::atomic::Ordering::SeqCst);
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), run).await;
    assert!(
        ran,
        "the worker never gave up the silent connection ({connections} connections in 60 s)"
    );
    assert!(connections >= 2, "{connections} connections");
    eprintln!("the message ran {took:?} after it was sent, over connection {connections}");
    p.close().await;
    env.cleanup().await;
}
