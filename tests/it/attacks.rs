//! Attacks once made on the trust rules, replayed against the fixed code: records anyone allowed to write a
//! stream may append (2: a never-expiring tombstone; 3: a snapshot that covers everything) and
//! a batch announcing more members than a batch may hold (7). Each test fails on the code
//! before the fix.

use std::time::Duration;

use amqp_delay::Message;
use amqp_delay::ops::batch;
use amqp_delay::ops::broker;
use amqp_delay::ops::cancel::Cancellations;
use amqp_delay::settings::PublisherSettings;
use amqp_delay::time::{DurationMs, now_ms};
use lapin::BasicProperties;
use lapin::options::BasicGetOptions;
use lapin::types::FieldTable;

use crate::harness::*;

/// Publishes raw `bodies` to the stream `stream` through the default exchange (what the
/// documented publisher role may write), confirmed.
async fn append_raw(env: &Env, stream: &str, bodies: &[Vec<u8>]) {
    append_with(env, stream, bodies, FieldTable::default()).await;
}

/// [`append_raw`] with these headers on every record.
async fn append_with(env: &Env, stream: &str, bodies: &[Vec<u8>], headers: FieldTable) {
    let ch = env.conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for body in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                stream.into(),
                Default::default(),
                body,
                // an authenticated writer (the broker checks it): what the documented
                // publisher role can append
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_user_id("guest".into())
                    .with_headers(headers.clone()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }
    let _ = ch.close(200, "ok".into()).await;
}

/// Attack 2: a forged tombstone that never expires (`until_ms` 2^64−1) lives only as long as a
/// message can need it; a record of more tombstones than any of ours, or longer, is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_expiring_forged_tombstone_is_clamped_and_floods_are_skipped() {
    let env = Env::new(small_topology()).await;
    let layout = env.layout();
    let forever = br#"{"type":"cancel","id":"victim","until_ms":18446744073709551615}"#.to_vec();
    let items: Vec<String> = (0..1_001)
        .map(|i| format!(r#"["flood-{i}",18446744073709551615]"#))
        .collect();
    let flood = format!(r#"{{"type":"cancels","items":[{}]}}"#, items.join(",")).into_bytes();
    let huge = format!(
        r#"{{"type":"cancel","id":"huge","until_ms":{},"pad":"{}"}}"#,
        u64::MAX,
        "x".repeat(3 << 20)
    )
    .into_bytes();
    append_raw(&env, &layout.control_stream(), &[forever, flood, huge]).await;

    let horizon_ms = 60_000;
    let before = now_ms();
    let follower =
        Cancellations::follow(&env.conn, &layout, Duration::from_millis(1_000), horizon_ms)
            .await
            .unwrap();
    let until = follower
        .live_until("victim", "guest")
        .expect("the tombstone is held");
    let latest = now_ms() + layout.max_delay_ms() + horizon_ms;
    assert!(
        until <= latest && until >= before + layout.max_delay_ms(),
        "until {until}, latest {latest}"
    );
    assert!(
        !follower.is_cancelled("flood-0", Some("guest")),
        "a record of 1 001 tombstones was taken"
    );
    assert!(
        !follower.is_cancelled("huge", Some("guest")),
        "a 3 MB record was taken"
    );
    assert_eq!(follower.stats().live, 1);
    drop(follower);
    env.cleanup().await;
}

/// Attack 3: a forged ledger snapshot covering offset 2^64−1 no longer hides what publishers
/// count, then or later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_snapshot_covering_everything_hides_nothing() {
    let mut t = small_topology();
    t.max_delay = DurationMs(60_000);
    t.max_tier_ttl = DurationMs(20_000);
    let mut env = Env::new(t).await;
    let q = env.queue("counted").await;
    let layout = env.layout();
    let forged = format!(
        r#"{{"type":"snapshot","covers":{},"at_ms":{},"dues":[]}}"#,
        u64::MAX,
        u64::MAX
    );
    append_raw(&env, &layout.ledger_stream(), &[forged.into_bytes()]).await;
    let p = env.publisher().await;
    for i in 0..8 {
        p.schedule(Message::new(q.clone(), 40_000, format!("m{i}")))
            .await
            .expect("scheduled");
    }
    p.close().await;
    // the first count reads everything (and leaves a snapshot of its own), the second starts
    // from that one: both see the 8
    for read in ["first", "second"] {
        let c = amqp_delay::ops::ledger::count(&env.conn, &layout, &Default::default())
            .await
            .unwrap()
            .expect("the topology has a ledger");
        assert_eq!(c.pending.total, 8, "{read} count: {c:?}");
    }
    env.cleanup().await;
}

/// Attack 7: a 3 MB batch announcing 300 000 ten-byte members (its header too) is refused by
/// the bounded decode with the publisher's `batch_max_messages`, and so is one whose header
/// announces fewer members than its body holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_announcing_more_members_than_a_batch_holds_is_refused() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("batch-attack").await;
    let props = batch::encode_properties(&BasicProperties::default());
    let member = vec![7u8; 10];
    let body = batch::encode_parts((0..300_000).map(|_| (props.as_slice(), member.as_slice())));
    let ch = broker::open(&env.conn).await.unwrap();
    for announced in [300_000, 3] {
        let p = BasicProperties::default()
            .with_content_type(batch::CONTENT_TYPE.into())
            .with_headers(batch::batch_headers(announced));
        ch.basic_publish("".into(), q.as_str().into(), Default::default(), &body, p)
            .await
            .unwrap();
    }
    let max = PublisherSettings::default().batch_max_messages;
    for expected in ["more than the", "announce 3"] {
        let mut got = None;
        for _ in 0..100 {
            got = ch
                .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            if got.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let d = got.expect("the batch arrived");
        assert!(batch::is_batch(&d.properties));
        let announced = batch::announced_count(&d.properties);
        let e = batch::decode_bounded(&d.data, announced, max).unwrap_err();
        assert!(e.contains(expected), "{e}");
    }
    broker::close(&ch, "ok").await;
    env.cleanup().await;
}

/// A record appended to `stream` whose header frame just fits `frame_max` (131 072) when
/// appended and is over it on delivery, when the broker adds `x-stream-offset`.
async fn append_over_frame_max(env: &Env, stream: &str) {
    // 620 headers of 200 B and a pad: a 131 065-byte header frame as appended, 131 092 bytes
    // as delivered (measured on RabbitMQ 3.10.8)
    let body = br#"{"type":"cancel","id":"poison","until_ms":1}"#.to_vec();
    append_with(env, stream, &[body], filler_headers(620, 825)).await;
}

/// `read` on a new connection each time, as a process that reconnects does, until it succeeds
/// (at most six times): its result, and the errors that ended the connections before.
async fn read_on_fresh_connections<T>(
    env: &Env,
    read: impl AsyncFn(&lapin::Connection) -> amqp_delay::Result<T>,
) -> (Option<T>, Vec<String>) {
    let connector = amqp_delay::ops::connection::Connector::new(&env.settings).unwrap();
    let mut lost = Vec::new();
    for _ in 0..6 {
        let conn = connector.connect("poison reader").await.unwrap();
        match read(&conn).await {
            Ok(r) => {
                broker::close_connection(&conn, "bye").await;
                return (Some(r), lost);
            }
            Err(e) => lost.push(amqp_delay::error_chain(&e)),
        }
    }
    (None, lost)
}

/// A record over `frame_max` that is the first of the ledger's read window (read from a time,
/// which names no offset) used to end every count's connection for as long as the window held
/// it: now the third connection reads on past it, to the count written after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_count_reads_past_a_record_over_frame_max_opening_its_window() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("window").await;
    let layout = env.layout();
    append_over_frame_max(&env, &layout.ledger_stream()).await;
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 1_000, "x"))
        .await
        .unwrap();
    p.close().await;
    let (counted, lost) = read_on_fresh_connections(&env, async |conn| {
        amqp_delay::ops::ledger::count(conn, &layout, &Default::default()).await
    })
    .await;
    let counted = counted.flatten();
    let counted = counted.unwrap_or_else(|| panic!("no count got past the record: {lost:#?}"));
    assert!(counted.records >= 1, "{counted:?}");
    assert_eq!(lost.len(), 3, "connections lost on the record: {lost:#?}");
    env.cleanup().await;
}

/// One-shot commands meet records over `frame_max` in the ledger and the control stream:
/// `stats` and `teardown` each read on past them, on new connections, within one run (each
/// run of a one-shot command failed on them before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_teardown_read_past_records_over_frame_max() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("oneshot").await;
    let layout = env.layout();
    let cfg = env.write_config("");
    let (code, _, err) = publisher_cli(
        &cfg,
        &["send", "--queue", &q, "--delay", "1s", "--body", "x"],
    )
    .await;
    assert_eq!(code, Some(0), "send: {err}");
    append_over_frame_max(&env, &layout.ledger_stream()).await;
    append_over_frame_max(&env, &layout.control_stream()).await;
    let (code, out, err) = publisher_cli(&cfg, &["stats", "--summary", "--json"]).await;
    assert_eq!(code, Some(0), "stats: {out}\n{err}");
    assert!(err.contains("reading again on a new connection"), "{err}");
    let summary: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert!(summary["messages_error"].is_null(), "{summary}");
    assert!(!summary["messages"].is_null(), "{summary}");
    let (code, out, err) = publisher_cli(&cfg, &["teardown", "--force"]).await;
    assert_eq!(code, Some(0), "teardown: {out}\n{err}");
    assert!(err.contains("reading again on a new connection"), "{err}");
    assert!(
        broker::queue_state(&env.conn, &layout.control_stream())
            .await
            .unwrap()
            .is_none(),
        "the control stream is left"
    );
    env.cleanup().await;
}

/// A record over `frame_max` on delivery ends the connection of whoever reads it (lapin:
/// FRAME_ERROR). Appended to the control stream by anyone allowed to cancel, it kept every
/// worker from starting for as long as the stream kept it: each session's start-up read met
/// it again. Now the worker finds its offset, reads on past it, and honours the cancels
/// written before and after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_record_over_frame_max_stops_no_worker_and_hides_no_cancel() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("stream-poison").await;
    // the worker declares the parking queue: delete it with the rest
    env.parked_queue(&q);
    let layout = env.layout();
    let p = env.publisher().await;
    p.cancel("before", None).await.unwrap();
    append_over_frame_max(&env, &layout.control_stream()).await;
    p.cancel("after", None).await.unwrap();
    for id in ["before", "after", "keep"] {
        p.schedule(Message::new(q.clone(), 1_000, id).with_id(id))
            .await
            .unwrap();
    }
    let h = crate::worker::Scripted::new(|_| amqp_delay::Outcome::Success);
    let log = h.log.clone();
    let (stop, run) = crate::worker::spawn_worker(&env, &q, h, crate::worker::retry(100, 2.0, 3));
    let ran = wait_until(Duration::from_secs(60), || !log.lock().unwrap().is_empty()).await;
    // the cancelled ones are due with "keep": a little longer for them to show up if they ran
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    let ids: Vec<String> = log.lock().unwrap().iter().map(|r| r.0.clone()).collect();
    assert!(
        ran,
        "the worker ran nothing in 60 s behind the record over frame_max"
    );
    assert_eq!(ids, ["keep"], "only the message not cancelled runs");
    p.close().await;
    env.cleanup().await;
}

/// The same record met by one-shot reads of the whole control stream (`teardown`, the
/// proxy's registry, a gateway's pairs), each on a connection of its own as a process that
/// reconnects makes them: the first three lose their connection on it, then the reads go on
/// past it, to the pair registered after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_the_control_stream_go_on_past_a_record_over_frame_max() {
    use amqp_delay::ops::control::{self, Record};
    let env = Env::new(small_topology()).await;
    let layout = env.layout();
    append_over_frame_max(&env, &layout.control_stream()).await;
    let pair = Record::GatewayPair {
        ingress: format!("{}.after-poison", env.settings.prefix),
        target: "amq.direct".into(),
        writers: vec![],
        vhost: None,
    };
    control::append(&env.conn, &layout, &pair).await.unwrap();
    let (read, lost) = read_on_fresh_connections(&env, async |conn| {
        control::read_all(conn, &layout, &Default::default()).await
    })
    .await;
    let records = read.unwrap_or_else(|| panic!("no read got past the record: {lost:#?}"));
    assert!(records.contains(&pair), "{records:?}");
    assert_eq!(lost.len(), 3, "connections lost on the record: {lost:#?}");
    assert!(
        lost.iter().all(|e| e.contains("frame too large")),
        "{lost:#?}"
    );
    env.cleanup().await;
}

/// A process whose readers of the control stream became careful before they saw any record
/// (the stream's first record is over `frame_max`: after retention removed the stream's
/// start, no reader can tell its offset from the missing ones before it) still starts a
/// follower from near the end: it probes the end once (the probe lands on its own barrier)
/// and steps back from there to the newest checkpoint, never reaching the record. Before,
/// such a process knew no end and read from the stream's first record, losing a connection
/// on it each time (here, with the record at offset 0, two before it could name it; after
/// retention, for as long as the stream kept it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_careful_follower_that_saw_no_record_starts_from_near_the_end() {
    use amqp_delay::ops::cancel::FollowOptions;
    use amqp_delay::ops::control;
    let env = Env::new(small_topology()).await;
    let layout = env.layout();
    let stream = layout.control_stream();
    append_over_frame_max(&env, &stream).await;
    let until = now_ms() + 3_600_000;
    // records after it, then a checkpoint (by guest, the follower's own user) and a cancel
    let mut records: Vec<Vec<u8>> = (0..12)
        .map(|i| format!(r#"{{"type":"barrier","nonce":"filler-{i}"}}"#).into_bytes())
        .collect();
    records.push(br#"{"type":"checkpoint_begin","nonce":"cp-1"}"#.to_vec());
    records.push(
        format!(
            r#"{{"type":"checkpoint","nonce":"cp-1","part":0,"parts":1,"items":[["in-checkpoint",{until}]],"by":"guest"}}"#
        )
        .into_bytes(),
    );
    records.push(format!(r#"{{"type":"cancel","id":"after","until_ms":{until}}}"#).into_bytes());
    append_raw(&env, &stream, &records).await;
    // a whole-stream read meets the record before any other: this process's readers of the
    // stream are careful from now on, and have seen no offset
    let conn = connect().await;
    let whole = control::read_all(&conn, &layout, &Default::default()).await;
    let e = whole.expect_err("the first record is over frame_max");
    assert!(control::is_record_over_frame_max(&e), "{e}");
    let mut opts = FollowOptions::new(Duration::from_millis(1_000), 60_000);
    opts.checkpoint_every = 4;
    let (follower, lost) = read_on_fresh_connections(&env, async |conn| {
        Cancellations::follow_with(conn, &layout, opts.clone()).await
    })
    .await;
    let follower = follower.unwrap_or_else(|| panic!("no follower started: {lost:#?}"));
    assert!(lost.is_empty(), "connections lost on the record: {lost:#?}");
    assert!(follower.is_cancelled("in-checkpoint", Some("guest")));
    assert!(follower.is_cancelled("after", Some("guest")));
    drop(follower);
    // a whole-stream read (the clean-up's teardown makes one) still meets it: at offset 0 it
    // is named after two more lost connections, then skipped
    let (read, lost) = read_on_fresh_connections(&env, async |conn| {
        control::read_all(conn, &layout, &Default::default()).await
    })
    .await;
    assert!(
        read.is_some(),
        "no whole-stream read got past the record: {lost:#?}"
    );
    assert_eq!(lost.len(), 2, "{lost:#?}");
    env.cleanup().await;
}
