//! `/metrics`, `/healthz` and `/readyz` of a running `delay-consumer`: scraped during a run, the
//! counters add up and the lateness histogram fills; readiness follows the broker connection.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use amqp_delay::time::DurationMs;

use crate::harness::*;

pub(crate) fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .http_status_as_error(false)
        .build()
        .into();
    match agent.get(url).call() {
        Ok(mut r) => (
            r.status().as_u16(),
            r.body_mut().read_to_string().unwrap_or_default(),
        ),
        Err(e) => (0, e.to_string()),
    }
}

/// The value of the sample `name{labels}` (labels as written, in order), 0 when absent.
pub(crate) fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let key = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Starts `delay-consumer --queue q --exec script` with a metrics endpoint on a free port (and
/// `envs`); returns it and the endpoint's base URL.
fn consumer_with_metrics(
    cfg: &std::path::Path,
    q: &str,
    script: &str,
    envs: &[(&str, &str)],
) -> (std::process::Child, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(cfg)
        .args([
            "--queue",
            q,
            "--exec",
            script,
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("AMQP_URL", broker_url())
        .env("RUST_LOG", "warn,amqp_delay=info")
        .envs(envs.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut base = None;
    let end = std::time::Instant::now() + Duration::from_secs(20);
    while base.is_none() && std::time::Instant::now() < end {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200))
            && let Some(i) = line.find("bound=")
        {
            let addr: String = line[i + 6..]
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '\u{1b}')
                .collect();
            base = Some(format!("http://{addr}"));
        }
    }
    let base = base.expect("the consumer never said where it serves metrics");
    (child, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_add_up_and_readiness_follows_the_connection() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("observed").await;
    env.parked_queue(&q);
    let cfg = env.write_config(
        "[consumer.retry]\nbase = 50\nmax_attempts = 3\njitter = 0.0\n[cancel]\nhorizon = \"1h\"\n",
    );
    // ok → success, perm → parked, flaky → fails once (a retry), then succeeds
    let out = temp_path(&env.settings.prefix, "observed.runs");
    let script = format!(
        "sh -c 'b=$(cat); echo \"$DELAY_MESSAGE_ID\" >> {}; case \"$b\" in perm) exit 65;; flaky) [ \"$DELAY_ATTEMPT\" = 0 ] && exit 1; exit 0;; *) exit 0;; esac'",
        out.display()
    );
    let (mut child, base) = consumer_with_metrics(&cfg, &q, &script, &[]);
    assert_eq!(get(&format!("{base}/healthz")).0, 200);
    let ready = || get(&format!("{base}/readyz")).0;
    assert!(
        wait_until(Duration::from_secs(15), || ready() == 200).await,
        "never ready"
    );

    // 30 messages: 20 ok, 5 permanent failures, 5 flaky; then 10 more, 5 of them cancelled
    let p = env.publisher().await;
    let mut scheduled = 0;
    for (i, body) in std::iter::repeat_n("ok", 20)
        .chain(std::iter::repeat_n("perm", 5))
        .chain(std::iter::repeat_n("flaky", 5))
        .enumerate()
    {
        p.schedule(amqp_delay::Message::new(q.clone(), 20, body).with_id(format!("m{i}")))
            .await
            .unwrap();
        scheduled += 1;
    }
    for i in 0..10 {
        let s = p
            .schedule(amqp_delay::Message::new(q.clone(), 1_400, "ok").with_id(format!("c{i}")))
            .await
            .unwrap();
        scheduled += 1;
        if i % 2 == 0 {
            p.cancel_scheduled(&s).await.unwrap();
        }
    }
    let label = format!("queue=\"{q}\"");
    let settled = |text: &str| {
        sample(text, "amqp_delay_executed_total", &label)
            + sample(
                text,
                "amqp_delay_parked_total",
                &format!("{label},reason=\"permanent\""),
            )
            + sample(text, "amqp_delay_cancelled_total", &label)
    };
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            text = get(&format!("{base}/metrics")).1;
            settled(&text) >= f64::from(scheduled)
        })
        .await,
        "did not settle:\n{text}"
    );
    // scheduled = executed + parked + cancelled (+ retries still pending: none by now)
    assert_eq!(settled(&text), f64::from(scheduled), "{text}");
    assert_eq!(sample(&text, "amqp_delay_executed_total", &label), 30.0);
    assert_eq!(sample(&text, "amqp_delay_cancelled_total", &label), 5.0);
    assert_eq!(sample(&text, "amqp_delay_retried_total", &label), 5.0);
    // a worker's retries count as retried, not as scheduled again: this worker scheduled
    // nothing itself, so `scheduled` stays the count of messages, once each
    assert!(
        text.lines().any(|l| l == "amqp_delay_scheduled_total 0"),
        "the worker counted its retries as scheduled:\n{text}"
    );
    // delivered = executed + parked + cancelled + retried
    assert_eq!(sample(&text, "amqp_delay_delivered_total", &label), 45.0);
    assert!(
        sample(&text, "amqp_delay_lateness_seconds_count", &label) >= 35.0,
        "the lateness histogram is empty:\n{text}"
    );
    assert!(
        text.contains("amqp_delay_lateness_seconds_bucket{le=\"0.001\""),
        "{text}"
    );

    // readiness drops while the connection is gone, and comes back
    let closed = close_worker_connection(&env.settings.prefix);
    assert_eq!(closed, 1, "the consumer's connection was not found");
    assert!(
        wait_until(Duration::from_secs(5), || ready() == 503).await,
        "still ready without a connection"
    );
    assert!(
        wait_until(Duration::from_secs(20), || ready() == 200).await,
        "not ready again after reconnecting"
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

/// Closes, from the broker's side, the worker connection of `prefix`.
fn close_worker_connection(prefix: &str) -> usize {
    let out = rabbitmqctl()
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl (the broker must be local for this test)");
    let text = String::from_utf8_lossy(&out.stdout);
    let needle = format!("amqp-delay worker {prefix}");
    let mut n = 0;
    for line in text.lines().filter(|l| l.contains(&needle)) {
        let pid = line.split_whitespace().next().unwrap();
        let st = rabbitmqctl()
            .args(["-q", "close_connection", pid, "test: readiness"])
            .status()
            .unwrap();
        assert!(st.success());
        n += 1;
    }
    n
}

/// `amqp_delay_messages_pending` counts messages, not broker messages (a batch counts its
/// members), from the ledger, and follows what publishers write after it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pending_gauge_counts_messages_and_follows_the_ledger() {
    let mut t = small_topology();
    t.max_delay = DurationMs(60_000);
    t.max_tier_ttl = DurationMs(20_000);
    let mut env = Env::new(t).await;
    env.settings.precision = amqp_delay::Precision {
        lateness: DurationMs(20),
        lateness_ratio: 0.0,
    };
    let q = env.queue("gauged").await;
    env.parked_queue(&q);
    let cfg = env.write_config("");
    let (mut child, base) =
        consumer_with_metrics(&cfg, &q, "true", &[("AMQP_DELAY_METRICS_SAMPLE", "300")]);
    let ready = || get(&format!("{base}/readyz")).0;
    assert!(
        wait_until(Duration::from_secs(15), || ready() == 200).await,
        "never ready"
    );
    let pending = |bound: &str| {
        let text = get(&format!("{base}/metrics")).1;
        sample(
            &text,
            "amqp_delay_messages_pending",
            &format!("due_within=\"{bound}\""),
        )
    };
    // the worker declared the batch marker: 200 messages due 40 s from now share broker messages
    let p = env.publisher().await;
    let msgs: Vec<amqp_delay::Message> = (0..200)
        .map(|i| amqp_delay::Message::new(q.clone(), 40_000 + i % 3, format!("g{i}")))
        .collect();
    let mut batched = 0;
    for r in p.schedule_batch(msgs).await {
        batched += usize::from(r.expect("scheduled").batched_with > 1);
    }
    p.close().await;
    assert!(batched > 100, "only {batched} of 200 travelled in a batch");
    assert!(
        wait_until(Duration::from_secs(15), || pending("all") == 200.0).await,
        "the gauge says {} of 200",
        pending("all")
    );
    // written after the gauge's count: followed, not counted again
    let p = env.publisher().await;
    for i in 0..5 {
        p.schedule(amqp_delay::Message::new(q.clone(), 30_000, format!("h{i}")))
            .await
            .expect("scheduled");
    }
    p.close().await;
    assert!(
        wait_until(Duration::from_secs(15), || pending("all") == 205.0).await,
        "the gauge says {} of 205",
        pending("all")
    );
    assert_eq!(pending("1m"), 205.0);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}
