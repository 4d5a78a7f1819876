//! The worker against a real RabbitMQ: retries through the tiers, parking, poison messages,
//! crash and graceful stop of the `delay-consumer` process, and its exec and http actions.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Context, Delivery, Handler, Message, Outcome, RetryPolicy, Worker};

use crate::harness::*;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use tokio::sync::oneshot;

/// Records every execution (id, attempt, time, due time) and answers from a script.
#[derive(Clone)]
pub(crate) struct Scripted {
    pub log: Arc<Mutex<Vec<(String, u32, u64)>>>,
    pub dues: Arc<Mutex<Vec<Option<u64>>>>,
    pub answer: fn(&Delivery) -> Outcome,
}

impl Scripted {
    pub(crate) fn new(answer: fn(&Delivery) -> Outcome) -> Scripted {
        Scripted {
            log: Arc::default(),
            dues: Arc::default(),
            answer,
        }
    }
}

impl Handler for Scripted {
    async fn handle(&self, d: &Delivery, _ctx: &Context) -> Outcome {
        let now = now_ms();
        self.log
            .lock()
            .unwrap()
            .push((d.message_id.clone(), d.attempt, now));
        self.dues.lock().unwrap().push(d.due_at_ms);
        (self.answer)(d)
    }
}

pub(crate) fn retry(base: u64, factor: f64, max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        base: DurationMs(base),
        factor,
        cap: DurationMs(10_000),
        max_attempts,
        jitter: 0.0,
    }
}

/// Runs a library worker on `queue` until `stop` fires.
pub(crate) fn spawn_worker(
    env: &Env,
    queue: &str,
    handler: Scripted,
    policy: RetryPolicy,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<amqp_delay::Result<()>>,
) {
    let mut s = env.settings.clone();
    s.consumer.retry = policy;
    spawn_worker_with(s, queue, handler)
}

/// Runs a library worker with `settings` on `queue` until `stop` fires.
pub(crate) fn spawn_worker_with(
    s: amqp_delay::Settings,
    queue: &str,
    handler: Scripted,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<amqp_delay::Result<()>>,
) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,amqp_delay=info".into()),
        ))
        .with_test_writer()
        .try_init();
    let (tx, rx) = oneshot::channel::<()>();
    let w = Worker::new(s).subscribe(queue.to_string(), handler);
    let h = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    (tx, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_twice_then_succeeds_on_attempt_2_through_the_same_tiers() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("flaky").await;
    env.parked_queue(&q);
    let h = Scripted::new(|d| {
        if d.attempt < 2 {
            Outcome::Retry(format!("flaky {}", d.attempt))
        } else {
            Outcome::Success
        }
    });
    let log = h.log.clone();
    // first trip 100 ms; the first retry waits 100 ms too, so it visits exactly the tiers the
    // first trip visited (the broker's cycle detection must not drop it); the second 200 ms.
    let (stop, run) = spawn_worker(&env, &q, h, retry(100, 2.0, 5));
    let p = env.publisher().await;
    let first = p.plan(100).unwrap();
    assert!(first.hops() > 0);
    p.schedule(Message::new(q.clone(), 100, "x").with_id("m1"))
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 3).await);
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    let attempts: Vec<u32> = runs.iter().map(|r| r.1).collect();
    assert_eq!(attempts, vec![0, 1, 2], "{runs:?}");
    assert!(runs[1].2 - runs[0].2 >= 100, "first retry early: {runs:?}");
    assert!(runs[2].2 - runs[1].2 >= 200, "second retry early: {runs:?}");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

/// A backoff longer than the topology's longest delay (the default retry.cap is 1 h) cannot
/// be scheduled as it is: the retry waits the longest delay instead of going back to the queue
/// again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backoff_longer_than_the_topology_allows_waits_the_longest_delay() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("long-backoff").await;
    env.parked_queue(&q);
    let h = Scripted::new(|d| {
        if d.attempt == 0 {
            Outcome::Retry("once".into())
        } else {
            Outcome::Success
        }
    });
    let log = h.log.clone();
    let max = env.layout().max_delay_ms();
    // 5 s backoff, on a topology whose longest delay is 1.5 s
    let (stop, run) = spawn_worker(&env, &q, h, retry(5_000, 1.0, 3));
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 10, "x").with_id("m1"))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || log.lock().unwrap().len() >= 2).await,
        "the retry never ran: {:?}",
        log.lock().unwrap()
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[1].1, 1, "{runs:?}");
    let waited = runs[1].2 - runs[0].2;
    assert!(
        waited >= max,
        "the retry came after {waited} ms, before {max} ms"
    );
    assert!(waited < 4_000, "the retry waited {waited} ms");
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_is_parked_after_max_attempts_with_the_reason() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("doomed").await;
    let parked = env.parked_queue(&q);
    let h = Scripted::new(|d| match d.body.as_slice() {
        b"perm" => Outcome::Permanent("invalid order".into()),
        _ => Outcome::Retry("boom".into()),
    });
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 10, "x").with_id("m1"))
        .await
        .unwrap();
    p.schedule(Message::new(q.clone(), 10, "perm").with_id("m2"))
        .await
        .unwrap();
    let got = env.expect(&parked, 2).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(got.len(), 2);
    let by_id: HashMap<String, &Received> = got.iter().map(|r| (r.id(), r)).collect();
    let m1 = by_id["m1"];
    assert_eq!(
        m1.text_header("x-delay-parked-reason").as_deref(),
        Some("gave up after 3 attempts; last error: boom")
    );
    assert_eq!(m1.int_header("x-delay-parked-attempts"), Some(3));
    assert!(m1.int_header("x-delay-parked-at").unwrap() > 0);
    assert!(
        m1.header("x-death").is_none(),
        "x-death must be stripped when parking"
    );
    let m2 = by_id["m2"];
    assert_eq!(m2.int_header("x-delay-parked-attempts"), Some(1));
    assert_eq!(
        m2.text_header("x-delay-parked-reason").as_deref(),
        Some("invalid order")
    );
    let executions = log.lock().unwrap().iter().filter(|r| r.0 == "m1").count();
    assert_eq!(executions, 3);
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_parked_and_the_rest_processed() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("poison").await;
    let parked = env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    // a message with a string where our attempt counter should be, straight into the queue
    let ch = env.conn.create_channel().await.unwrap();
    let mut t = FieldTable::default();
    t.insert(
        "x-delay-attempt".into(),
        AMQPValue::LongString(LongString::from("two")),
    );
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"poison",
        lapin::BasicProperties::default()
            .with_message_id("poison".into())
            .with_headers(t),
    )
    .await
    .unwrap();
    let p = env.publisher().await;
    for i in 0..3 {
        p.schedule(Message::new(q.clone(), 5, "ok").with_id(format!("ok{i}")))
            .await
            .unwrap();
    }
    let got = env.expect(&parked, 1).await;
    assert!(wait_until(Duration::from_secs(5), || log.lock().unwrap().len() >= 3).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id(), "poison");
    let reason = got[0].text_header("x-delay-parked-reason").unwrap();
    assert!(
        reason.contains("invalid envelope: header 'x-delay-attempt' must be an integer"),
        "{reason}"
    );
    let ids: Vec<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert!(
        !ids.contains(&"poison".to_string()),
        "the handler saw the poison message"
    );
    let _ = ch.close(200, "ok".into()).await;
    p.close().await;
    env.cleanup().await;
}

/// A handler that says "not now" for ever: the worker gives the message back after each
/// `consumer.requeue_hold`, every return counts toward the quorum queue's delivery limit (20,
/// which `declare --queue` sets on 3.x too), and the broker then dead-letters it into
/// `<prefix>.parked` with the reason `delivery_limit`: parked, never dropped (4.x drops a message
/// at the limit unless its queue dead-letters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_put_back_for_ever_is_parked_by_the_delivery_limit_not_dropped() {
    let mut env = Env::new(small_topology()).await;
    let q = format!("{}-notnow", env.settings.prefix);
    amqp_delay::Topology::new(env.layout())
        .declare_destination(&env.conn, &q)
        .await
        .unwrap();
    env.track_queue(&q);
    // the worker declares the destination's parking queue: deleted with the rest
    env.parked_queue(&q);
    let unroutable = env.layout().unroutable_queue();
    env.settings.consumer.requeue_hold = amqp_delay::time::DurationMs(20);
    let h = Scripted::new(|_| Outcome::Requeue("not now".into()));
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 5));
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 1, "later").with_id("later"))
        .await
        .unwrap();
    let parked =
        parked_by_delivery_limit(&env.conn, &env.layout(), &q, Duration::from_secs(60)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().len();
    assert_eq!(parked.len(), 1, "not parked after {runs} runs");
    assert_eq!(parked[0].body, b"later");
    let _ = unroutable;
    // the limit is the broker's count of returns: one run per delivery, at least 20
    assert!(runs >= 20, "{runs} runs");
    p.close().await;
    env.cleanup().await;
}

/// A topology without its park exchange (deleted since `declare`): the worker does not start,
/// and says what is missing and what declares it, rather than parking nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_the_park_exchange_says_to_declare_it() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("nopark").await;
    env.parked_queue(&q);
    let park = env.layout().park_exchange();
    let ch = env.conn.create_channel().await.unwrap();
    ch.exchange_delete(park.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = ch.close(200, "ok".into()).await;
    let (_stop, run) = spawn_worker(
        &env,
        &q,
        Scripted::new(|_| Outcome::Success),
        retry(20, 2.0, 3),
    );
    let e = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the worker gave up")
        .unwrap()
        .expect_err("a worker without the park exchange")
        .to_string();
    assert!(
        e.contains(&format!("the park exchange '{park}' is missing"))
            && e.contains("run `delay-publisher declare`"),
        "{e}"
    );
    env.cleanup().await;
}

/// A destination of `env` whose retries cannot be published: every tier deleted, exact routes
/// (a grain route for a 20 ms backoff would go straight back to the queue: it needs no tier).
/// Returns the queue and its parking queue.
async fn destination_without_tiers(env: &mut Env, name: &str) -> (String, String) {
    let q = format!("{}-{name}", env.settings.prefix);
    amqp_delay::Topology::new(env.layout())
        .declare_destination(&env.conn, &q)
        .await
        .unwrap();
    env.track_queue(&q);
    let parked = env.parked_queue(&q);
    for t in env.layout().tiers() {
        env.delete_queue(&t.queue).await;
    }
    env.settings.publisher.grain = amqp_delay::time::DurationMs(0);
    (q, parked)
}

/// Publishes `body` as message `id` straight into `queue`.
async fn publish_plain(env: &Env, queue: &str, id: &str, body: &[u8]) {
    let ch = env.conn.create_channel().await.unwrap();
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        lapin::BasicProperties::default().with_message_id(id.into()),
    )
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

/// A message whose retry cannot be published (its tiers are gone) goes back to its queue, and
/// the worker waits longer before each return (1 s, 2 s, 4 s, ... from `x-delivery-count`):
/// every return counts toward the quorum queue's delivery limit (20), so a short outage must
/// not park it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_cannot_be_published_is_returned_after_a_growing_pause() {
    let mut env = Env::new(small_topology()).await;
    let (q, parked) = destination_without_tiers(&mut env, "unsettled").await;
    let h = Scripted::new(|_| Outcome::Retry("boom".into()));
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 5));
    publish_plain(&env, &q, "m1", b"x").await;
    assert!(
        wait_until(Duration::from_secs(30), || log.lock().unwrap().len() >= 4).await,
        "ran {} times",
        log.lock().unwrap().len()
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    // the retry was never published: every run is the first attempt
    assert!(runs.iter().all(|r| r.0 == "m1" && r.1 == 0), "{runs:?}");
    let gaps: Vec<u64> = runs.windows(2).map(|w| w[1].2 - w[0].2).collect();
    for (i, (gap, pause)) in gaps.iter().zip([1000, 2000, 4000]).enumerate() {
        assert!(
            *gap >= pause,
            "return {i}: ran again after {gap} ms, not {pause}: {gaps:?}"
        );
    }
    // back in its queue, counted by the broker (4.3: as acquired), not parked
    let got = env.expect(&q, 1).await;
    assert_eq!(got.len(), 1);
    let counted = |h| got[0].int_header(h).unwrap_or(0);
    assert!(counted("x-delivery-count").max(counted("x-acquired-count")) >= 3);
    env.assert_empty(&parked).await;
    env.cleanup().await;
}

/// A retry the broker keeps refusing, to the end: each return counts toward the quorum
/// delivery limit (20, which `declare --queue` sets on 3.x too), and the broker then parks the
/// message in `<prefix>.parked` with the reason `delivery_limit` — never dropped, as 4.x would
/// at its default limit in a queue that does not dead-letter. `consumer.requeue_pause` 20 ms
/// makes the 481 pauses take 10 s instead of 8 min.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_broker_keeps_refusing_is_parked_by_the_delivery_limit_not_dropped() {
    let mut env = Env::new(small_topology()).await;
    let (q, parked) = destination_without_tiers(&mut env, "refused").await;
    env.settings.consumer.requeue_pause = amqp_delay::time::DurationMs(20);
    let h = Scripted::new(|_| Outcome::Retry("boom".into()));
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 5));
    publish_plain(&env, &q, "refused", b"refused").await;
    let limited =
        parked_by_delivery_limit(&env.conn, &env.layout(), &q, Duration::from_secs(90)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let runs = log.lock().unwrap().clone();
    assert_eq!(limited.len(), 1, "not parked after {} runs", runs.len());
    assert_eq!(limited[0].body, b"refused");
    // one run per delivery, each the first attempt (no retry was ever published)
    assert!(runs.len() >= 20, "{} runs", runs.len());
    assert!(
        runs.iter().all(|r| r.0 == "refused" && r.1 == 0),
        "{runs:?}"
    );
    env.assert_empty(&q).await;
    let _ = parked;
    env.cleanup().await;
}

/// `delay-consumer` as a child process, killed when dropped.
pub(crate) fn consumer(
    _env: &Env,
    config: &std::path::Path,
    args: &[&str],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env("AMQP_URL", broker_url())
        .env("RUST_LOG", "warn,amqp_delay=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start delay-consumer")
}

pub(crate) fn ids(lines: &[String]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for l in lines {
        let id = l.split_whitespace().next().unwrap_or("").to_string();
        *m.entry(id).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_batch_then_restart_executes_everything_at_least_once() {
    let mut env = Env::new(small_topology()).await;
    // messages due within 20 ms of each other share a batch: the kill lands inside batches
    env.settings.precision.lateness = DurationMs(20);
    let q = env.queue("crash").await;
    env.parked_queue(&q);
    amqp_delay::Topology::new(env.layout())
        .declare_batch_marker(&env.conn, &q)
        .await
        .unwrap();
    let out = temp_path(&env.settings.prefix, "crash.out");
    let cfg = env.write_config("");
    let cmd = format!(
        "sh -c 'sleep 0.05; echo \"$DELAY_MESSAGE_ID $DELAY_ATTEMPT\" >> {}'",
        out.display()
    );
    let args = [
        "--queue",
        q.as_str(),
        "--exec",
        cmd.as_str(),
        "--concurrency",
        "2",
    ];
    let p = env.publisher().await;
    let n = 60;
    let msgs = (0..n)
        .map(|i| Message::new(q.clone(), (i % 4) as u64 * 50, "x").with_id(format!("c{i}")))
        .collect();
    let mut batches = 0;
    for r in p.schedule_batch(msgs).await {
        batches += usize::from(r.unwrap().batched_with > 1);
    }
    assert!(batches > n / 2, "the messages did not travel in batches");
    let mut child = consumer(&env, &cfg, &args);
    assert!(
        wait_until(Duration::from_secs(20), || read_lines(&out).len() >= 15).await,
        "worker did not start"
    );
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    let after_kill = read_lines(&out).len();
    assert!(
        after_kill < n,
        "the worker finished before it was killed; the test proves nothing"
    );
    let mut child = consumer(&env, &cfg, &args);
    let ok = wait_until(Duration::from_secs(30), || {
        ids(&read_lines(&out)).len() >= n
    })
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let seen = ids(&read_lines(&out));
    let missing: Vec<String> = (0..n)
        .map(|i| format!("c{i}"))
        .filter(|id| !seen.contains_key(id))
        .collect();
    assert!(ok && missing.is_empty(), "lost: {missing:?}");
    let dups: usize = seen.values().map(|c| c - 1).sum();
    eprintln!(
        "kill -9 after {after_kill} executions: {n} messages, {dups} executed twice (at-least-once)"
    );
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&cfg);
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_handlers_finish_and_loses_nothing() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("term").await;
    env.parked_queue(&q);
    let out = temp_path(&env.settings.prefix, "term.out");
    let started = temp_path(&env.settings.prefix, "term.started");
    let cfg = env.write_config("");
    let cmd = format!(
        "sh -c 'echo $DELAY_MESSAGE_ID >> {}; sleep 1; echo $DELAY_MESSAGE_ID >> {}'",
        started.display(),
        out.display()
    );
    let args = [
        "--queue",
        q.as_str(),
        "--exec",
        cmd.as_str(),
        "--concurrency",
        "4",
    ];
    let p = env.publisher().await;
    let n = 12;
    for i in 0..n {
        p.schedule(Message::new(q.clone(), 0, "x").with_id(format!("t{i}")))
            .await
            .unwrap();
    }
    let mut child = consumer(&env, &cfg, &args);
    assert!(wait_until(Duration::from_secs(20), || !read_lines(&started).is_empty()).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = child.id().unwrap();
    assert!(
        std::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("stopped in time")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    let started_at_exit = ids(&read_lines(&started));
    let done_at_exit = ids(&read_lines(&out));
    // every handler that had started finished before the process exited
    for id in started_at_exit.keys() {
        assert!(done_at_exit.contains_key(id), "{id} was cut off");
    }
    assert!(
        done_at_exit.len() < n,
        "it kept taking new deliveries after SIGTERM"
    );
    // what it did not take is still there for the next worker
    let mut child = consumer(&env, &cfg, &args);
    let ok = wait_until(Duration::from_secs(30), || {
        ids(&read_lines(&out)).len() >= n
    })
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert!(ok, "lost messages: {:?}", ids(&read_lines(&out)));
    for f in [&out, &started, &cfg] {
        let _ = std::fs::remove_file(f);
    }
    p.close().await;
    env.cleanup().await;
}

/// Closes, from the broker's side, every connection whose name contains `needle`.
fn close_connections_named(needle: &str) -> usize {
    let out = rabbitmqctl()
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl (the broker must be local for this test)");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut n = 0;
    for line in text.lines().filter(|l| l.contains(needle)) {
        let pid = line.split_whitespace().next().unwrap();
        let st = rabbitmqctl()
            .args([
                "-q",
                "close_connection",
                pid,
                "test: simulated connection loss",
            ])
            .status()
            .unwrap();
        assert!(st.success());
        n += 1;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_reconnects_after_losing_its_connection() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("reconnect").await;
    env.parked_queue(&q);
    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = spawn_worker(&env, &q, h, retry(20, 2.0, 3));
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 10, "a").with_id("before"))
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.lock().unwrap().len() == 1).await);
    let closed = close_connections_named(&format!("amqp-delay worker {}", env.settings.prefix));
    assert_eq!(closed, 1, "the worker's connection was not found");
    p.schedule(Message::new(q.clone(), 10, "b").with_id("after"))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || log.lock().unwrap().len() >= 2).await,
        "no message processed after the connection was lost"
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ids: Vec<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert!(ids.contains(&"after".to_string()), "{ids:?}");
    p.close().await;
    env.cleanup().await;
}

/// A subscription that brings nothing while its queue has ready messages is renewed (after a
/// full cluster restart the broker once held a prefetch's worth of messages as delivered to a
/// worker that never received them, and 548 more waited). Stood in for here by a
/// single-active-consumer queue whose active consumer is someone else: the worker's consumer
/// gets nothing although messages are ready. The worker reconnects; once the other consumer
/// leaves, everything is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_whose_queue_has_ready_messages_renews_its_subscription() {
    use amqp_delay::QueueType;
    use amqp_delay::ops::broker;
    use futures::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    let mut env = Env::new(small_topology()).await;
    let q = format!("{}-sac", env.settings.prefix);
    let mut args = broker::queue_type_args(QueueType::Quorum);
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let ch = env.conn.create_channel().await.unwrap();
    broker::declare_queue(&ch, &q, args).await.unwrap();
    env.track_queue(&q);
    env.parked_queue(&q);
    for i in 0..4 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"x",
            lapin::BasicProperties::default()
                .with_message_id(format!("sac{i}").into())
                .with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    // the active consumer takes one message and keeps it
    let other = env.conn.create_channel().await.unwrap();
    other
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap();
    let mut held = other
        .basic_consume(
            q.as_str().into(),
            "other".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), held.next())
        .await
        .expect("the other consumer got nothing");
    assert!(first.is_some());

    let h = Scripted::new(|_| Outcome::Success);
    let log = h.log.clone();
    let w = Worker::new(env.settings.clone()).subscribe(q.clone(), h);
    let counters = w.counters();
    let (stop, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    assert!(
        wait_until(Duration::from_secs(40), || {
            counters.stalled.load(std::sync::atomic::Ordering::Relaxed) >= 1
        })
        .await,
        "the worker did not notice that nothing reached it while 3 messages were ready"
    );
    assert!(log.lock().unwrap().is_empty());
    // the other consumer leaves: its message goes back, and the worker is the active one
    let _ = other.close(200, "bye".into()).await;
    assert!(
        wait_until(Duration::from_secs(60), || log.lock().unwrap().len() >= 4).await,
        "not everything processed: {:?}",
        log.lock().unwrap()
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let _ = ch.close(200, "ok".into()).await;
    env.cleanup().await;
}

/// Counts finished runs per message id; sleeps first, as long as `ms` says for the id.
#[derive(Clone)]
struct Paced {
    runs: Arc<Mutex<HashMap<String, usize>>>,
    ms: fn(&str) -> u64,
}

impl Paced {
    fn new(ms: fn(&str) -> u64) -> Paced {
        Paced {
            runs: Arc::default(),
            ms,
        }
    }

    fn finished(&self) -> usize {
        self.runs.lock().unwrap().len()
    }

    fn twice(&self) -> Vec<String> {
        let runs = self.runs.lock().unwrap();
        runs.iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

impl Handler for Paced {
    async fn handle(&self, d: &Delivery, _ctx: &Context) -> Outcome {
        tokio::time::sleep(Duration::from_millis((self.ms)(&d.message_id))).await;
        *self
            .runs
            .lock()
            .unwrap()
            .entry(d.message_id.clone())
            .or_default() += 1;
        Outcome::Success
    }
}

/// A quorum queue `<prefix>-<name>` holding plain messages with ids `ids`, published by an
/// application (no amqp-delay headers).
async fn queue_with_plain_messages(env: &mut Env, name: &str, ids: &[String]) -> String {
    use amqp_delay::QueueType;
    use amqp_delay::ops::broker;
    let q = format!("{}-{name}", env.settings.prefix);
    let ch = env.conn.create_channel().await.unwrap();
    broker::declare_queue(&ch, &q, broker::queue_type_args(QueueType::Quorum))
        .await
        .unwrap();
    env.track_queue(&q);
    env.parked_queue(&q);
    ch.confirm_select(Default::default()).await.unwrap();
    let mut confirms = Vec::new();
    for id in ids {
        let c = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                b"x",
                lapin::BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_delivery_mode(2),
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
    let _ = ch.close(200, "ok".into()).await;
    q
}

async fn ready(env: &Env, q: &str) -> u32 {
    amqp_delay::ops::broker::queue_state(&env.conn, q)
        .await
        .unwrap()
        .expect("the queue exists")
        .ready
}

/// Acks are sent in runs (one `basic.ack` with `multiple` for many deliveries). A worker
/// stopped while it is busy gives back what it had not started and acks what it finished:
/// nothing is lost, and nothing it finished runs again.
///
/// With the default `consumer.hold_prefetch` (512 on top of the prefetch of 64) about 500
/// deliveries that have not started are in hand at the stop: a stop that nacked them one by
/// one pushed the consumer channel of the quorum queue past its 32 unapplied Raft commands,
/// the broker stashed the acks that followed and dropped them with the channel (once: 48
/// finished deliveries ready again on 4.0.5; 48, 35 and 57 on 3.10.8, in one run of two to
/// ten). 1 000 messages, so that at the stop some are finished, some in hand and some still
/// in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_mid_stream_acks_what_it_finished_and_gives_back_the_rest() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,amqp_delay=info".into()),
        ))
        .with_test_writer()
        .try_init();
    let mut env = Env::new(small_topology()).await;
    let n = 1000;
    let ids: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    let q = queue_with_plain_messages(&mut env, "runs", &ids).await;
    let mut s = env.settings.clone();
    s.consumer.prefetch = 64;
    s.consumer.concurrency = 16;
    s.consumer.hold_prefetch = amqp_delay::settings::ConsumerSettings::default().hold_prefetch;
    let h = Paced::new(|_| 2);
    let w = Worker::new(s.clone()).subscribe(q.clone(), h.clone());
    let (stop, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    assert!(wait_until(Duration::from_secs(30), || h.finished() >= 200).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let finished = h.finished();
    assert!(finished < n, "it finished everything before the stop");
    assert!(h.twice().is_empty(), "ran twice: {:?}", h.twice());
    // everything it did not finish is ready again, nothing more
    let left = (n - finished) as u32;
    assert!(
        wait_until_async(Duration::from_secs(10), || async {
            ready(&env, &q).await == left
        })
        .await,
        "{} ready after the stop, {left} expected ({finished} finished)",
        ready(&env, &q).await
    );
    // the next worker runs exactly the rest
    let w = Worker::new(s).subscribe(q.clone(), h.clone());
    let (stop, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    assert!(wait_until(Duration::from_secs(30), || h.finished() >= n).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert!(h.twice().is_empty(), "ran twice: {:?}", h.twice());
    assert_eq!(ready(&env, &q).await, 0);
    env.cleanup().await;
}

/// The same with hundreds of handlers running at once (an I/O stage's concurrency), each for
/// its own time: they finish out of order, so their acks go one by one behind the ones still
/// running — hundreds of frames just before the stop, which can leave the channel past the
/// broker's 32 unapplied commands when its last `multiple` ack comes (263 finished deliveries
/// ready again once in 20 runs on 3.10.8, before the close waited for a busy channel). Each
/// finished delivery is acked all the same, none runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_with_hundreds_of_handlers_running_acks_each_one_that_finished() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,amqp_delay=info".into()),
        ))
        .with_test_writer()
        .try_init();
    let mut env = Env::new(small_topology()).await;
    let n = 2000;
    let ids: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    let q = queue_with_plain_messages(&mut env, "many", &ids).await;
    let mut s = env.settings.clone();
    s.consumer.prefetch = 300;
    s.consumer.concurrency = 300;
    s.consumer.hold_prefetch = amqp_delay::settings::ConsumerSettings::default().hold_prefetch;
    // 0 to 60 ms, spread over the ids
    let h = Paced::new(|id| id[1..].parse::<u64>().unwrap_or(0) * 7919 % 61);
    let w = Worker::new(s.clone()).subscribe(q.clone(), h.clone());
    let (stop, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    assert!(wait_until(Duration::from_secs(30), || h.finished() >= 600).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let finished = h.finished();
    assert!(finished < n, "it finished everything before the stop");
    assert!(h.twice().is_empty(), "ran twice: {:?}", h.twice());
    let left = (n - finished) as u32;
    assert!(
        wait_until_async(Duration::from_secs(10), || async {
            ready(&env, &q).await == left
        })
        .await,
        "{} ready after the stop, {left} expected ({finished} finished)",
        ready(&env, &q).await
    );
    env.cleanup().await;
}

/// A delivery whose handler runs long does not hold back the acks of those after it: with
/// a prefetch of 4, forty quick messages behind a slow one all finish while it still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_message_does_not_hold_back_the_acks_of_those_after_it() {
    let mut env = Env::new(small_topology()).await;
    let mut ids = vec!["slow".to_string()];
    ids.extend((0..40).map(|i| format!("quick{i}")));
    let q = queue_with_plain_messages(&mut env, "slow", &ids).await;
    let mut s = env.settings.clone();
    s.consumer.prefetch = 4;
    s.consumer.concurrency = 4;
    let h = Paced::new(|id| if id == "slow" { 6_000 } else { 1 });
    let w = Worker::new(s).subscribe(q.clone(), h.clone());
    let (stop, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rx.await;
    }));
    let quick_done = wait_until(Duration::from_secs(5), || h.finished() >= 40).await;
    assert!(
        quick_done,
        "only {} of 40 quick messages finished while the slow one ran",
        h.finished()
    );
    assert!(!h.runs.lock().unwrap().contains_key("slow"));
    assert!(wait_until(Duration::from_secs(20), || h.finished() >= 41).await);
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert!(h.twice().is_empty(), "ran twice: {:?}", h.twice());
    assert_eq!(ready(&env, &q).await, 0);
    env.cleanup().await;
}

/// Looking at a parked message never uses it up: 25 looks that count as a return on every
/// broker version (`basic.get`, then `basic.reject` with requeue; the management UI's "Get
/// messages" does the same) leave it in its parking queue. On RabbitMQ 4.x a quorum queue
/// without a delivery limit of its own has one of 20 and drops what goes past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_survives_being_looked_at() {
    use lapin::options::{BasicGetOptions, BasicRejectOptions};
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("looked").await;
    let parked = env.parked_queue(&q);
    amqp_delay::Topology::new(env.layout())
        .declare_parking(&env.conn, &q)
        .await
        .unwrap();
    let ch = env.conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.basic_publish(
        env.layout().park_exchange().as_str().into(),
        q.as_str().into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"parked",
        lapin::BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    for look in 1..=26 {
        // a return is applied through the queue's log: wait for it to be back
        let mut got = None;
        for _ in 0..100 {
            got = ch
                .basic_get(parked.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap();
            if got.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let m =
            got.unwrap_or_else(|| panic!("the parked message is gone after {} looks", look - 1));
        assert_eq!(m.delivery.data, b"parked");
        if look < 26 {
            ch.basic_reject(
                m.delivery.delivery_tag,
                BasicRejectOptions { requeue: true },
            )
            .await
            .unwrap();
        } else {
            ch.basic_ack(m.delivery.delivery_tag, Default::default())
                .await
                .unwrap();
        }
    }
    let _ = ch.close(200, "ok".into()).await;
    env.cleanup().await;
}
