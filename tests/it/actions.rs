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
