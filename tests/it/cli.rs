//! The command-line publisher against a real RabbitMQ: bulk JSONL sends, `send`, `stats`,
//! `teardown`, `declare --queue`, and its error texts and exit codes.

use amqp_delay::time::DurationMs;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_jsonl_confirms_good_lines_and_reports_bad_ones_by_line_number() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("bulk").await;
    let cfg = env.write_config("");
    let file = temp_path(&env.settings.prefix, "bulk.jsonl");
    let mut lines = Vec::new();
    for i in 0..40 {
        lines.push(format!(
            r#"{{"queue":"{q}","delay_ms":{},"body":"b{i}","id":"j{i}"}}"#,
            i * 7
        ));
    }
    lines[3] = "this is not json".into();
    lines[10] = format!(r#"{{"queue":"{q}","delay":"soon","body":"x"}}"#);
    lines[20] = r#"{"queue":"no.such.*","delay_ms":5,"body":"x"}"#.into();
    lines[30] = format!(r#"{{"queue":"{q}","delay_ms":99999,"body":"x"}}"#);
    lines.push(String::new()); // a blank line is skipped, not an error
    lines.push(format!(r#"{{"queue":"{q}","delay":"1s","body":{{"order":42}},"id":"j-json","headers":{{"k":"v"}}}}"#));
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "send",
            "--jsonl",
            file.to_str().unwrap(),
        ])
        .env("AMQP_URL", broker_url())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(
        stdout.contains("37 confirmed, 4 failed"),
        "summary: {stdout}"
    );
    assert!(stderr.contains("line 4: not a valid request"), "{stderr}");
    assert!(
        stderr.contains("line 11: 'delay': invalid duration 'soon'"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 21: invalid request:") && stderr.contains("wildcard"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 31: delay 99999 ms is longer than the configured maximum"),
        "{stderr}"
    );
    let got = env.expect(&q, 37).await;
    let c = counts(&got);
    assert_eq!(c.len(), 37, "{c:?}");
    for bad in ["j3", "j10", "j20", "j30"] {
        assert!(!c.contains_key(bad));
    }
    let json = got.iter().find(|r| r.id() == "j-json").unwrap();
    assert_eq!(json.body, br#"{"order":42}"#);
    assert_eq!(
        json.properties.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_send_stats_and_clear_errors() {
    let mut t = small_topology();
    t.max_delay = DurationMs(60_000);
    t.max_tier_ttl = DurationMs(20_000);
    let mut env = Env::new(t).await;
    let q = env.queue("cli").await;
    let cfg = env.write_config("");
    let run = |args: Vec<String>| {
        let cfg = cfg.clone();
        async move {
            let mut full = vec!["--config".to_string(), cfg.to_str().unwrap().to_string()];
            full.extend(args);
            tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
                .args(full)
                .env("AMQP_URL", broker_url())
                .output()
                .await
                .unwrap()
        }
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let out = run(s(&[
        "send",
        "--queue",
        &q,
        "--delay",
        "50s",
        "--body",
        "{\"order\":42}",
        "--id",
        "cli-1",
    ]))
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["id"], "cli-1");
    assert!(line["due_at"].as_u64().unwrap() > line["delay_ms"].as_u64().unwrap());
    let out = run(s(&["stats", "--json", "--non-empty"])).await;
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let held: u64 = stats
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["messages"].as_u64().unwrap())
        .sum();
    assert_eq!(held, 1, "{stats}");
    // stats say when work is coming (bounded by the tier's longest wait: 65.5 s here)
    let out = run(s(&["stats"])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("due within 1 minute: 0, within 1 hour: 1,"),
        "{text}"
    );
    // the message itself falls due in 50 s (the ledger knows when, not just the tier)
    assert!(
        text.contains("messages not yet due: 1 (due within 1 minute: 1,"),
        "{text}"
    );
    // teardown refuses while messages wait (they would be lost)
    let out = run(s(&["teardown"])).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 messages are still in the tiers"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // clear errors, non-zero exit, nothing scheduled
    let out = run(s(&["send", "--queue", &q, "--delay", "-5s", "--body", "x"])).await; // hyphen value reaches our parser
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("negative duration"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(s(&[
        "send", "--queue", "a.*", "--delay", "1s", "--body", "x",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("wildcard"));
    // the password never appears in what the tool prints
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "--url",
            "amqp://guest:s3cr3t-pw@127.0.0.1:1/%2f",
            "declare",
        ])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    // Normally "cannot connect ... Connection refused" at once. lapin 4.12 can miss a refused
    // TCP connect that fails while it is still setting up the handshake (the io thread poisons
    // the connection before the protocol-header reply is registered), and then our connect
    // timeout answers instead: one CI run saw that. Both are clear errors.
    assert!(
        (err.contains("cannot connect") || err.contains("no answer from the broker"))
            && err.contains("guest:***@"),
        "{err}"
    );
    assert!(!err.contains("s3cr3t-pw"), "password leaked: {err}");
    // declare --queue creates a missing destination queue and leaves an existing one alone
    let fresh = format!("{}-fresh", env.settings.prefix);
    env.track_queue(&fresh);
    let out = run(s(&["declare", "--queue", &fresh, "--queue", &q])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("'{fresh}' created")) && text.contains(&format!("'{q}' exists")),
        "{text}"
    );
    // teardown --queue removes one destination with its parking queue and batch marker,
    // refusing while it holds messages
    let out = run(s(&["declare", "--queue", &fresh, "--worker"])).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let layout = env.layout();
    let marker = layout.batch_marker(&fresh).unwrap();
    assert!(
        amqp_delay::ops::broker::exchange_exists(&env.conn, &marker)
            .await
            .unwrap()
    );
    let out = run(s(&[
        "send", "--queue", &fresh, "--delay", "0", "--body", "x",
    ]))
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(s(&["teardown", "--queue", &fresh])).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("'{fresh}' holds 1 messages; they would be lost")),
        "{err}"
    );
    env.expect(&fresh, 1).await;
    let out = run(s(&["teardown", "--queue", &fresh])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("its batch marker"), "{text}");
    for gone in [fresh.clone(), layout.parked_queue(&fresh)] {
        assert!(
            amqp_delay::ops::broker::queue_state(&env.conn, &gone)
                .await
                .unwrap()
                .is_none(),
            "{gone} is still there"
        );
    }
    assert!(
        !amqp_delay::ops::broker::exchange_exists(&env.conn, &marker)
            .await
            .unwrap()
    );
    // the topology's own queues are not destinations
    let out = run(s(&["teardown", "--queue", &layout.unroutable_queue()])).await;
    assert_eq!(out.status.code(), Some(2));
    // the tiers are untouched: the message still waits, so the full teardown still refuses
    let out = run(s(&["teardown"])).await;
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}

/// A stand-in for the management API: answers every request with `body` (JSON), counting them.
async fn fake_management(body: String) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let body = body.clone();
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let _ = sock.read(&mut buf).await;
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(reply.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (port, hits)
}

/// Messages held by the broker's dead-letter worker (unacknowledged, invisible over AMQP) are
/// counted from the management API: `stats` shows them with the tier's leader, and `teardown`
/// refuses to call the topology empty (it once removed a topology with 7 389 held
/// messages). The management API is a stand-in answering what RabbitMQ's answers after a
/// restart: a tier with 0 ready and 7 unacknowledged messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_messages_are_counted_from_the_management_api_and_block_teardown() {
    let env = Env::new(small_topology()).await;
    let layout = env.layout();
    let tier = layout.tiers()[0].queue.clone();
    let body = serde_json::json!([{
        "name": tier,
        // 7 held by the dead-letter worker, 5 dead-lettered and waiting for it (RabbitMQ counts
        // those in "messages" only)
        "messages": 12,
        "messages_ready": 0,
        "messages_unacknowledged": 7,
        "leader": "rabbit@node-b",
        "members": ["rabbit@node-a", "rabbit@node-b", "rabbit@node-c"],
    }])
    .to_string();
    let (port, hits) = fake_management(body).await;
    let cfg = env.write_config("");
    let run = |args: &'static [&'static str]| {
        let cfg = cfg.clone();
        async move {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
                .arg("--config")
                .arg(&cfg)
                .args(args)
                .env("AMQP_URL", broker_url())
                .env(
                    "AMQP_DELAY_MANAGEMENT_URL",
                    format!("http://guest:guest@127.0.0.1:{port}/"),
                )
                .output()
                .await
                .unwrap()
        }
    };
    let out = run(&["stats", "--json", "--non-empty"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = stats
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["queue"] == tier.as_str())
        .unwrap_or_else(|| panic!("{tier} not in {stats}"));
    assert_eq!(row["messages"], 12, "{row}");
    assert_eq!(row["ready"], 0, "{row}");
    assert_eq!(row["unacked"], 7, "{row}");
    assert_eq!(row["dead_lettered"], 5, "{row}");
    assert_eq!(row["leader"], "rabbit@node-b", "{row}");
    let out = run(&["stats"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rabbit@node-b"), "{text}");
    assert!(!text.contains("ready messages only"), "{text}");
    assert!(
        text.contains(&format!(
            "dead-lettered, waiting for the broker's dead-letter worker: {tier} (5, led by rabbit@node-b)"
        )),
        "{text}"
    );
    let out = run(&["teardown"]).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("12 messages are still in the tiers"), "{err}");
    assert!(hits.load(std::sync::atomic::Ordering::Relaxed) >= 3);
    // the topology is still there
    env.assert_tiers_empty().await;
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}
