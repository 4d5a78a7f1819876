//! The actions of `delay-consumer` against a real RabbitMQ: `--exec` (exit codes, body and
//! environment) and `--http` (statuses, retries, parking).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqp_delay::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;
use crate::worker::{consumer, ids};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_action_maps_exit_codes_and_passes_body_and_environment() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("exec").await;
    let parked = env.parked_queue(&q);
    let out = temp_path(&env.settings.prefix, "exec.out");
    let cfg = env.write_config("[consumer.retry]\nbase = 30\nmax_attempts = 2\njitter = 0.0\n");
    let script = format!(
        "sh -c 'b=$(cat); echo \"$DELAY_MESSAGE_ID $DELAY_ATTEMPT $b $DELAY_DUE_AT\" >> {}; case \"$b\" in ok) exit 0;; perm) exit 65;; *) exit 1;; esac'",
        out.display()
    );
    let p = env.publisher().await;
    for (id, body) in [("e-ok", "ok"), ("e-perm", "perm"), ("e-retry", "flaky")] {
        p.schedule(Message::new(q.clone(), 20, body).with_id(id))
            .await
            .unwrap();
    }
    let mut child = consumer(&env, &cfg, &["--queue", &q, "--exec", &script]);
    let got = env.expect(&parked, 2).await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let lines = read_lines(&out);
    let runs = ids(&lines);
    assert_eq!(runs.get("e-ok"), Some(&1), "{lines:?}");
    assert_eq!(
        runs.get("e-perm"),
        Some(&1),
        "permanent failures are not retried: {lines:?}"
    );
    assert_eq!(
        runs.get("e-retry"),
        Some(&2),
        "retried up to max_attempts: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("e-retry 1 flaky ")),
        "attempt and body passed: {lines:?}"
    );
    let due: u64 = lines[0].split_whitespace().nth(3).unwrap().parse().unwrap();
    assert!(due > 0);
    let mut parked_ids: Vec<String> = got.iter().map(|r| r.id()).collect();
    parked_ids.sort();
    assert_eq!(parked_ids, ["e-perm", "e-retry"]);
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// A tiny HTTP server answering by body: `ok` → 200, `bad` → 400, `flaky` → 503 the first
/// time then 200. Records (body, message-id header, content-type) of every request.
async fn http_server() -> (String, Arc<Mutex<Vec<(String, String, String)>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let rec = rec.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head, body) = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| {
                                l.strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        while buf.len() < i + 4 + len {
                            let n = s.read(&mut chunk).await.unwrap_or(0);
                            if n == 0 {
                                break;
                            }
                            buf.extend_from_slice(&chunk[..n]);
                        }
                        break (head, String::from_utf8_lossy(&buf[i + 4..]).to_string());
                    }
                };
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| {
                            l.strip_prefix(&format!("{name}:"))
                                .map(|v| v.trim().to_string())
                        })
                        .unwrap_or_default()
                };
                let status = {
                    let mut r = rec.lock().unwrap();
                    let earlier = r.iter().filter(|(b, _, _)| *b == body).count();
                    r.push((
                        body.clone(),
                        header("x-delay-message-id"),
                        header("content-type"),
                    ));
                    match body.as_str() {
                        "ok" => "200 OK",
                        "bad" => "400 Bad Request",
                        "flaky" if earlier == 0 => "503 Service Unavailable",
                        _ => "200 OK",
                    }
                };
                let resp =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_action_posts_and_maps_statuses() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("http").await;
    let parked = env.parked_queue(&q);
    let (url, seen) = http_server().await;
    let cfg = env.write_config("[consumer.retry]\nbase = 30\nmax_attempts = 3\njitter = 0.0\n");
    let p = env.publisher().await;
    for (id, body) in [("h-ok", "ok"), ("h-bad", "bad"), ("h-flaky", "flaky")] {
        p.schedule(
            Message::new(q.clone(), 20, body)
                .with_id(id)
                .with_content_type("text/plain"),
        )
        .await
        .unwrap();
    }
    let mut child = consumer(&env, &cfg, &["--queue", &q, "--http", &url]);
    let got = env.expect(&parked, 1).await;
    assert!(wait_until(Duration::from_secs(10), || seen.lock().unwrap().len() >= 4).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let reqs = seen.lock().unwrap().clone();
    let count = |b: &str| reqs.iter().filter(|r| r.0 == b).count();
    assert_eq!(
        (count("ok"), count("bad"), count("flaky")),
        (1, 1, 2),
        "{reqs:?}"
    );
    assert!(
        reqs.iter()
            .any(|r| r.0 == "ok" && r.1 == "h-ok" && r.2 == "text/plain"),
        "{reqs:?}"
    );
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id(), "h-bad");
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// `--forward` to an exchange that does not exist is refused at start-up (exit 2), and one
/// deleted under a running consumer makes it retry those messages, not lose its connection:
/// the broker closes a channel that publishes to a missing exchange, which used to take the
/// worker's own publishing channel (its retries) and then its connection with it, again and
/// again ("CHANNEL_ERROR - expected 'channel.open'", 11 reconnects in 15 s). Once the exchange
/// is back, every message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_to_a_missing_exchange_is_refused_at_start_and_never_costs_the_connection() {
    use amqp_delay::ops::broker;
    use lapin::ExchangeKind;
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;

    let mut env = Env::new(small_topology()).await;
    let q = env.queue("fwd").await;
    let parked = env.parked_queue(&q);
    let prefix = env.settings.prefix.clone();
    let cfg = env.write_config(
        "[consumer]\nhandler_timeout = 5000\n[consumer.retry]\nbase = 100\nfactor = 2.0\ncap = 800\nmax_attempts = 200\njitter = 0.0\n",
    );

    // at start-up: a missing exchange is a usage error, said at once
    let missing = format!("{prefix}-missing");
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
            .arg("--config")
            .arg(&cfg)
            .args(["--queue", &q, "--forward", &format!("{missing}:k")])
            .env("AMQP_URL", broker_url())
            .output(),
    )
    .await
    .expect("delay-consumer kept running with a missing forward exchange")
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("forward exchange '{missing}' does not exist")),
        "{err}"
    );

    // an exchange of the application's, deleted while the consumer runs
    let x = format!("{prefix}-fwd-x");
    let target = format!("{prefix}-fwd-out");
    env.declare_queue(&target).await;
    let ch = env.conn.create_channel().await.unwrap();
    let declare_x = || async {
        ch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            target.as_str().into(),
            x.as_str().into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    };
    declare_x().await;
    let log = temp_path(&prefix, "fwd.log");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(&cfg)
        .args(["--queue", &q, "--forward", &format!("{x}:k")])
        .env("AMQP_URL", broker_url())
        .env("RUST_LOG", "warn,amqp_delay=info")
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 10, "before").with_id("before"))
        .await
        .unwrap();
    assert_eq!(env.expect(&target, 1).await.len(), 1, "forwarding works");

    ch.exchange_delete(x.as_str().into(), Default::default())
        .await
        .unwrap();
    for i in 0..150 {
        p.schedule(Message::new(q.clone(), 10 + i % 50, "during").with_id(format!("d{i}")))
            .await
            .unwrap();
    }
    // the messages fall due and are retried while the exchange is missing
    tokio::time::sleep(Duration::from_secs(8)).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        child.try_wait().unwrap().is_none(),
        "the consumer exited: {text}"
    );
    let lost = text.matches("connection lost").count();
    assert_eq!(
        lost, 0,
        "the consumer lost its connection {lost} times over a forward to a deleted exchange:\n{text}"
    );
    assert!(text.contains("does not exist"), "{text}");
    let state = broker::queue_state(&env.conn, &q).await.unwrap().unwrap();
    assert_eq!(state.consumers, 1, "{text}");

    // back: everything arrives, nothing was parked
    declare_x().await;
    let got = env.expect(&target, 150).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(got.len(), 150, "{text}");
    assert_eq!(counts(&got).len(), 150, "each once: {text}");
    assert!(!text.contains("connection lost"), "{text}");
    env.assert_empty(&parked).await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let _ = ch
        .exchange_delete(x.as_str().into(), Default::default())
        .await;
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}
