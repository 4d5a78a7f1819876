//! `delay-publisher parked list|show|retry|drop` against a real RabbitMQ: listing keeps every
//! parked message and its order, drop and retry change only the chosen ones, an unknown id is
//! exit 1, and a second command while one runs is refused.

use std::time::Duration;

use amqp_delay::headers;
use amqp_delay::time::now_ms;
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::harness::*;

/// Parks `ids` in `q`'s parking queue as a worker does: through the park exchange, with the
/// parking headers, a schedule header and a user header.
async fn park(env: &Env, q: &str, ids: &[&str]) {
    let ch = env.conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for (i, id) in ids.iter().enumerate() {
        let mut h = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(LongString::from(v));
        h.insert(
            headers::PARKED_REASON.into(),
            s(&format!("handler said no to {id}")),
        );
        h.insert(
            headers::PARKED_AT.into(),
            AMQPValue::LongLongInt(now_ms() as i64),
        );
        h.insert(
            headers::PARKED_ATTEMPTS.into(),
            AMQPValue::LongLongInt(i as i64 + 1),
        );
        h.insert(headers::PARKED_FROM.into(), s(q));
        h.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(i as i64));
        h.insert("tenant".into(), s("t1"));
        ch.basic_publish(
            env.layout().park_exchange().as_str().into(),
            q.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            format!("body of {id}").as_bytes(),
            lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id((*id).into())
                .with_headers(h),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let _ = ch.close(200, "ok".into()).await;
}

/// The ids `parked list --json` prints, in order, with their reasons.
async fn listed(cfg: &std::path::Path, q: &str) -> Vec<(String, String)> {
    let (code, out, err) = publisher_cli(cfg, &["parked", "list", "--queue", q, "--json"]).await;
    assert_eq!(code, Some(0), "list: {out}\n{err}");
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            (
                v["id"].as_str().unwrap().to_string(),
                v["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn ids(l: &[(String, String)]) -> Vec<&str> {
    l.iter().map(|(id, _)| id.as_str()).collect()
}

async fn ready(env: &Env, queue: &str) -> u32 {
    amqp_delay::ops::broker::queue_state(&env.conn, queue)
        .await
        .unwrap()
        .unwrap()
        .ready
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_messages_are_listed_in_order_and_only_the_chosen_ones_change() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("parkedcli").await;
    let parked = env.parked_queue(&q);
    amqp_delay::Topology::new(env.layout())
        .declare_parking(&env.conn, &q)
        .await
        .unwrap();
    let cfg = env.write_config("");
    park(&env, &q, &["m0", "m1", "m2", "m3", "m4"]).await;

    // listed in order, with reasons, twice the same; the queue keeps all five
    let first = listed(&cfg, &q).await;
    assert_eq!(ids(&first), ["m0", "m1", "m2", "m3", "m4"]);
    assert_eq!(first[2].1, "handler said no to m2");
    let (code, out, err) = publisher_cli(&cfg, &["parked", "list", "--queue", &q]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 5, "{out}");
    assert!(out.lines().next().unwrap().starts_with("1 m0 "), "{out}");
    assert_eq!(listed(&cfg, &q).await, first);
    assert_eq!(ready(&env, &parked).await, 5);

    // show: every header and the whole body
    let (code, out, err) =
        publisher_cli(&cfg, &["parked", "show", "m1", "--queue", &q, "--json"]).await;
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["body"], "body of m1");
    assert_eq!(v["headers"]["tenant"], "t1");

    // drop one: the rest keep their order
    let (code, out, err) =
        publisher_cli(&cfg, &["parked", "drop", "m2", "--queue", &q, "--yes"]).await;
    assert_eq!(code, Some(0), "drop: {out}\n{err}");
    assert_eq!(ids(&listed(&cfg, &q).await), ["m0", "m1", "m3", "m4"]);

    // retry one: it arrives at the destination as a fresh attempt, without the parking headers
    let (code, out, err) = publisher_cli(&cfg, &["parked", "retry", "m3", "--queue", &q]).await;
    assert_eq!(code, Some(0), "retry: {out}\n{err}");
    let got = env.expect(&q, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id(), "m3");
    assert_eq!(got[0].body, b"body of m3");
    assert_eq!(got[0].int_header(headers::ATTEMPT), Some(0));
    assert_eq!(got[0].text_header("tenant").as_deref(), Some("t1"));
    let names: Vec<String> = got[0]
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .keys()
        .map(|k| k.to_string())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with(headers::PARKED_PREFIX)),
        "{names:?}"
    );
    assert_eq!(ids(&listed(&cfg, &q).await), ["m0", "m1", "m4"]);

    // an unknown id: exit 1, named; the known one is still dropped
    let (code, _, err) = publisher_cli(
        &cfg,
        &["parked", "drop", "nope", "m4", "--queue", &q, "--yes"],
    )
    .await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not found") && err.contains("nope"), "{err}");
    assert_eq!(ids(&listed(&cfg, &q).await), ["m0", "m1"]);

    // drop without --yes and no terminal: refused
    let (code, _, err) = publisher_cli(&cfg, &["parked", "drop", "m0", "--queue", &q]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--yes"), "{err}");

    // a second command while one holds the lock is refused, and changes nothing
    let lock = env.layout().parked_lock_queue(Some(&q));
    let ch = env.conn.create_channel().await.unwrap();
    ch.queue_declare(
        lock.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let (code, _, err) = publisher_cli(&cfg, &["parked", "list", "--queue", &q]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("another parked command is running"), "{err}");
    let _ = ch
        .queue_delete(lock.as_str().into(), Default::default())
        .await;
    let _ = ch.close(200, "ok".into()).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(ids(&listed(&cfg, &q).await), ["m0", "m1"]);

    // the library on a connection that stays open lets go of the lock when done
    let all = amqp_delay::ops::parked::list(&env.conn, &env.layout(), Some(&q), 10, 4)
        .await
        .unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!((all[0].body.as_slice(), all[0].size), (&b"body"[..], 10));
    assert_eq!(all[0].reason.as_deref(), Some("handler said no to m0"));
    assert_eq!(ids(&listed(&cfg, &q).await), ["m0", "m1"]);

    // neither --queue nor --unroutable: a usage error
    let (code, _, _) = publisher_cli(&cfg, &["parked", "list"]).await;
    assert_eq!(code, Some(2));
    env.cleanup().await;
}
