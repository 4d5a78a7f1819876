//! The core against a real RabbitMQ: scheduling through every kind of tier, delivery to queues,
//! parking, validation and conflicting re-declares. 1 ms units keep it fast.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use amqp_delay::layout::TierKind;
use amqp_delay::time::{DurationMs, now_ms};
use amqp_delay::{Error, Message, QueueType, Topology};

use crate::harness::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use rand::Rng;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_delays_across_every_level_arrive_once_and_never_early() {
    let mut env = Env::new(small_topology()).await;
    let a = env.queue("a").await;
    let b = env.queue("x.a").await; // dotted, and a word-suffix relation to `a`
    let p = env.publisher().await;
    let layout = p.layout().clone();
    assert!(
        layout.overflow_count() > 0 && layout.levels() >= 3,
        "{layout}"
    );

    let n = 300;
    let mut rng = rand::rng();
    let mut msgs = Vec::new();
    // every cascade digit, the fixed level, the overflow chain, and random delays
    let mut delays: Vec<u64> = vec![0, 1, 150, 151, 199, 200, 255, 256, 1499, 1500];
    while delays.len() < n {
        delays.push(rng.random_range(0..=1500));
    }
    for (i, d) in delays.iter().enumerate() {
        let dest = if i % 2 == 0 { &a } else { &b };
        msgs.push(Message::new(dest.clone(), *d, format!("m{i}")).with_id(format!("id-{i}")));
    }
    let mut tiers_used = HashSet::new();
    for r in p.schedule_batch(msgs).await {
        let s = r.expect("scheduled");
        tiers_used.extend(s.route.tiers.iter().copied());
    }
    assert!(
        tiers_used
            .iter()
            .any(|t| matches!(t, TierKind::Overflow { .. }))
    );
    assert!(
        tiers_used
            .iter()
            .any(|t| matches!(t, TierKind::Fixed { .. }))
    );
    for k in 0..layout.levels() {
        assert!(
            tiers_used
                .iter()
                .any(|t| matches!(t, TierKind::Cascade { level, .. } if *level == k)),
            "level {k} unused"
        );
    }

    let got_a = env.expect(&a, n / 2).await;
    let got_b = env.expect(&b, n / 2).await;
    for (q, got, parity) in [(&a, &got_a, 0), (&b, &got_b, 1)] {
        let c = counts(got);
        let want: HashSet<String> = (0..n)
            .filter(|i| i % 2 == parity)
            .map(|i| format!("id-{i}"))
            .collect();
        let missing: Vec<_> = want.iter().filter(|id| !c.contains_key(*id)).collect();
        assert!(missing.is_empty(), "{q}: missing {missing:?}");
        let foreign: Vec<_> = c.keys().filter(|id| !want.contains(*id)).collect();
        assert!(
            foreign.is_empty(),
            "{q} received other queue's messages {foreign:?}"
        );
        let dups: usize = c.values().map(|v| v - 1).sum();
        eprintln!(
            "{q}: {} messages, {dups} at-least-once duplicates",
            got.len()
        );
    }
    let mut lateness: Vec<i64> = got_a
        .iter()
        .chain(&got_b)
        .map(|r| r.arrived_ms as i64 - r.int_header("x-delay-due-at").expect("due-at header"))
        .collect();
    lateness.sort_unstable();
    eprintln!(
        "lateness ms: min {} p50 {} p99 {} max {}",
        lateness[0],
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness[lateness.len() - 1]
    );
    assert!(
        lateness[0] >= 0,
        "a message arrived {} ms early",
        -lateness[0]
    );
    assert!(
        *lateness.last().unwrap() < 5_000,
        "a message was stuck for {} ms",
        lateness.last().unwrap()
    );

    // the tiers are empty again and nothing was parked
    env.assert_tiers_empty().await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_properties_and_headers_arrive_byte_for_byte() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("props").await;
    let p = env.publisher().await;
    let body: Vec<u8> = (0..=255u8).collect();
    let mut h = FieldTable::default();
    h.insert(
        "app-id".into(),
        AMQPValue::LongString(LongString::from("shop")),
    );
    h.insert("n".into(), AMQPValue::LongInt(-7));
    h.insert(
        "x-death".into(),
        AMQPValue::LongString(LongString::from("forged")),
    );
    let props = lapin::BasicProperties::default()
        .with_content_type("application/octet-stream".into())
        .with_correlation_id("corr-1".into())
        .with_headers(h);
    let before = now_ms();
    let s = p
        .schedule(Message::new(q.clone(), 40, body.clone()).with_properties(props))
        .await
        .unwrap();
    let got = env.expect(&q, 1).await;
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.body, body);
    assert_eq!(r.id(), s.message_id);
    assert_eq!(uuid::Uuid::parse_str(&r.id()).unwrap().get_version_num(), 7);
    assert_eq!(
        r.properties.content_type().as_ref().unwrap().as_str(),
        "application/octet-stream"
    );
    assert_eq!(
        r.properties.correlation_id().as_ref().unwrap().as_str(),
        "corr-1"
    );
    assert_eq!(*r.properties.delivery_mode(), Some(2));
    assert_eq!(
        r.header("app-id"),
        Some(&AMQPValue::LongString(LongString::from("shop")))
    );
    assert_eq!(r.header("n"), Some(&AMQPValue::LongInt(-7)));
    assert_eq!(r.int_header("x-delay-ms"), Some(40));
    assert_eq!(r.int_header("x-delay-attempt"), Some(0));
    let due = r.int_header("x-delay-due-at").unwrap() as u64;
    assert!(due >= before + 40 && due == s.due_at_ms);
    // the forged x-death was stripped; what is there now is the broker's own history
    assert!(
        r.death_queues()
            .iter()
            .all(|(q, _)| q.starts_with(env.settings.prefix.as_str()))
    );
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_zero_is_delivered_directly() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("zero").await;
    let p = env.publisher().await;
    let s = p.schedule(Message::new(q.clone(), 0, "now")).await.unwrap();
    assert_eq!(s.route.hops(), 0);
    let got = env.expect(&q, 1).await;
    assert_eq!(got.len(), 1);
    assert!(got[0].header("x-death").is_none(), "went through a tier");
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_level_is_exactly_one_hop() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("fixed").await;
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 150, "f")).await.unwrap();
    let got = env.expect(&q, 1).await;
    assert_eq!(got.len(), 1);
    let fixed = p.layout().fixed_queue(150);
    assert_eq!(got[0].death_queues(), vec![(fixed, 1)]);
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dotted_names_do_not_receive_each_others_messages() {
    let mut env = Env::new(small_topology()).await;
    let p = env.settings.prefix.clone();
    // `cancel-<p>` and `orders.cancel-<p>`: the second ends with the first's only word
    let short = format!("cancel-{p}");
    let long = format!("orders.cancel-{p}");
    env.declare_queue(&short).await;
    env.declare_queue(&long).await;
    let publ = env.publisher().await;
    for (i, q) in [&short, &long, &short, &long].iter().enumerate() {
        publ.schedule(
            Message::new(q.to_string(), 20 * i as u64, q.to_string()).with_id(format!("{i}")),
        )
        .await
        .unwrap();
    }
    for q in [&short, &long] {
        let got = env.expect(q, 2).await;
        assert_eq!(got.len(), 2, "{q}");
        assert!(
            got.iter().all(|r| r.body == q.as_bytes()),
            "{q} got another queue's message"
        );
    }
    publ.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_deleted_in_flight_is_parked_and_others_keep_flowing() {
    let mut env = Env::new(small_topology()).await;
    let gone = env.queue("gone").await;
    let live = env.queue("live").await;
    let p = env.publisher().await;
    p.schedule(Message::new(gone.clone(), 300, "lost?").with_id("parked-1"))
        .await
        .unwrap();
    env.delete_queue(&gone).await;
    for i in 0..5 {
        p.schedule(Message::new(live.clone(), 50 + i * 60, "ok"))
            .await
            .unwrap();
    }
    let got = env.expect(&live, 5).await;
    assert_eq!(got.len(), 5);
    let parked = env.expect(&p.layout().unroutable_queue(), 1).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id(), "parked-1");
    assert!(
        parked[0].routing_key.ends_with(&gone),
        "{}",
        parked[0].routing_key
    );
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_destinations_and_delays_are_refused_with_clear_errors() {
    let env = Env::new(small_topology()).await;
    let p = env.publisher().await;
    let cases: Vec<(Message, &str)> = vec![
        (Message::new("orders.*", 10, "x"), "wildcard word '*'"),
        (Message::new("orders.#.x", 10, "x"), "wildcard word '#'"),
        (Message::new("", 10, "x"), "empty"),
        (Message::new("a..b", 10, "x"), "empty dot-separated word"),
        (
            Message::new("x".repeat(250), 10, "x"),
            "fit in the routing key",
        ),
        (
            Message::new(format!("{}-never-declared", env.settings.prefix), 10, "x"),
            "does not exist",
        ),
        (
            Message::new("q", 1501, "x"),
            "longer than the configured maximum of 1500 ms",
        ),
    ];
    for (m, want) in cases {
        let e = p.schedule(m).await.unwrap_err();
        assert!(e.to_string().contains(want), "{e} should mention {want}");
    }
    // a publish the broker answers by closing the channel is an error for that message only
    let e = p
        .publish_confirmed("no-such-exchange-here", "k", b"x", Default::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no-such-exchange-here"), "{e}");
    // the publisher still works after the broker closed its binding and publish channels
    let mut env = env;
    let q = env.queue("after").await;
    p.schedule(Message::new(q.clone(), 5, "x")).await.unwrap();
    assert_eq!(env.expect(&q, 1).await.len(), 1);
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_redeclare_names_the_difference() {
    let mut env = Env::new(small_topology()).await;
    env.settings.topology.radix = 8;
    let e = env.declare().await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Conflict(_)), "{e}");
    assert!(text.contains("radix: 4 → 8"), "{text}");
    assert!(text.contains(&env.settings.prefix), "{text}");
    // a publisher configured differently from the declared topology is refused too
    let e = amqp_delay::Publisher::connect(&env.settings)
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("radix: 4 → 8"), "{e}");

    // a fixed level added to the configuration but not declared yet is named
    env.settings.topology.radix = 4;
    env.settings.topology.fixed_levels.push(DurationMs(170));
    let e = amqp_delay::Publisher::connect(&env.settings)
        .await
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .contains("fixed level 170ms (with 1 shard(s)) is configured but not declared"),
        "{e}"
    );
    env.settings.topology.fixed_levels.pop();

    // and an existing queue with other arguments is named with its argument
    let mut t = small_topology();
    t.queue_type = QueueType::Classic;
    let mut other = Env::new(t).await;
    let ch = other.conn.create_channel().await.unwrap();
    ch.exchange_delete(
        other.layout().layout_marker().as_str().into(),
        Default::default(),
    )
    .await
    .unwrap();
    other.settings.topology.queue_type = QueueType::Quorum;
    let e = other.declare().await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains(&format!("queue '{}.", other.settings.prefix)),
        "{text}"
    );
    assert!(
        text.contains("x-queue-type = classic but these settings need quorum"),
        "{text}"
    );
    other.settings.topology.queue_type = QueueType::Classic;
    env.settings.topology.radix = 4;
    other.cleanup().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_tier_is_an_error_not_a_silent_loss() {
    let mut t = small_topology();
    t.max_tier_length = Some(1);
    let mut env = Env::new(t).await;
    let q = env.queue("full").await;
    let p = env.publisher().await;
    // Quorum queues apply the limit asynchronously: a publish or two may be accepted past it,
    // after which the tier refuses publishes. Every accepted one must arrive.
    let mut accepted = Vec::new();
    let mut nacked = 0;
    for i in 0..6 {
        match p
            .schedule(Message::new(q.clone(), 150, format!("{i}")))
            .await
        {
            Ok(_) => accepted.push(format!("{i}").into_bytes()),
            Err(e) => {
                assert!(matches!(e, Error::Nacked { .. }), "{e}");
                assert!(e.to_string().contains("full"), "{e}");
                nacked += 1;
            }
        }
    }
    assert!(nacked > 0, "a full tier accepted everything");
    let got = env.expect(&q, accepted.len()).await;
    let mut bodies: Vec<Vec<u8>> = got.into_iter().map(|r| r.body).collect();
    bodies.sort();
    assert_eq!(bodies, accepted);
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_is_idempotent_and_stats_count_waiting_messages() {
    let mut env = Env::new(small_topology()).await;
    env.declare().await.expect("second declare is a no-op");
    let q = env.queue("stats").await;
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 150, "w")).await.unwrap();
    let stats = Topology::new(env.layout()).stats(&env.conn).await.unwrap();
    let fixed = stats.iter().find(|s| s.kind == "fixed").unwrap();
    assert_eq!(fixed.messages, 1);
    assert!(stats.iter().any(|s| s.kind == "parked"));
    assert_eq!(
        stats.iter().filter(|s| s.kind == "overflow").count() as u32,
        env.layout().overflow_count()
    );
    env.expect(&q, 1).await;
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_tiers_work_too() {
    let mut t = small_topology();
    t.queue_type = QueueType::Classic;
    t.fixed_levels = vec![DurationMs(100)];
    let mut env = Env::new(t).await;
    let q = env.queue("classic").await;
    let p = env.publisher().await;
    for d in [0u64, 7, 100, 333, 1200] {
        p.schedule(Message::new(q.clone(), d, d.to_string()))
            .await
            .unwrap();
    }
    let got = env.expect(&q, 5).await;
    assert_eq!(got.len(), 5);
    for r in &got {
        assert!(r.arrived_ms as i64 >= r.int_header("x-delay-due-at").unwrap());
    }
    p.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_fixed_level_spreads_over_its_queues() {
    let mut t = small_topology();
    t.fixed_shards = 3;
    let mut env = Env::new(t).await;
    let q = env.queue("shards").await;
    let p = env.publisher().await;
    for i in 0..9 {
        p.schedule(Message::new(q.clone(), 150, format!("{i}")))
            .await
            .unwrap();
    }
    let got = env.expect(&q, 9).await;
    assert_eq!(got.len(), 9);
    let mut used: HashSet<String> = HashSet::new();
    for r in &got {
        let hops = r.death_queues();
        assert_eq!(hops.len(), 1, "one hop through a fixed shard: {hops:?}");
        used.insert(hops[0].0.clone());
    }
    let l = env.layout();
    let want: HashSet<String> = (0..3).map(|s| l.fixed_shard_exchange(150, s)).collect();
    assert_eq!(used, want, "every shard carried messages");
    p.close().await;
    env.cleanup().await;
}

/// RabbitMQ 4.x drops a quorum message returned to its queue 20 times; a destination we
/// create dead-letters such a message (here: one a consumer rejects) into the parking queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_our_destination_gives_up_on_is_parked_not_dropped() {
    let mut env = Env::new(small_topology()).await;
    let q = format!("{}-created", env.settings.prefix);
    env.track_queue(&q);
    let created = Topology::new(env.layout())
        .declare_destination(&env.conn, &q)
        .await
        .unwrap();
    assert!(created);
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 0, "give up").with_id("g1"))
        .await
        .unwrap();
    let ch = env.conn.create_channel().await.unwrap();
    ch.basic_qos(1, Default::default()).await.unwrap();
    let mut c = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut c))
        .await
        .expect("delivered")
        .unwrap()
        .unwrap();
    d.reject(lapin::options::BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let parked = env.expect(&env.layout().unroutable_queue(), 1).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id(), "g1");
    let _ = ch.close(200, "ok".into()).await;
    p.close().await;
    env.cleanup().await;
}

/// lapin hands a returned (unroutable) message to whichever confirm completes next, so with
/// many publishes awaiting one `multiple` ack a return could reach the wrong caller: an
/// unroutable message then looked confirmed (lost) and a routed one looked refused. With a
/// tier deleted under 2,000 pipelined publishes, exactly the messages that enter through it are
/// refused, and every other one arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_tier_missing_exactly_the_messages_entering_it_are_refused() {
    let mut env = Env::new(small_topology()).await;
    let a = env.queue("a").await;
    let p = env.publisher().await;
    let layout = p.layout().clone();
    let (gone, delays) = busiest_cascade_tier(&layout, 2000);
    let TierKind::Cascade { level, digit } = gone else {
        unreachable!()
    };
    env.delete_queue(&layout.cascade_queue(level, digit)).await;
    let entry = |d: u64| amqp_delay::plan(&layout, &amqp_delay::Precision::EXACT, d).unwrap();
    let msgs: Vec<Message> = delays
        .iter()
        .enumerate()
        .map(|(i, d)| Message::new(a.clone(), *d, format!("m{i}")).with_id(format!("id-{i}")))
        .collect();
    let mut refused_wrongly = Vec::new();
    let mut accepted_wrongly = Vec::new();
    let mut sent = HashSet::new();
    for (i, r) in p.schedule_batch(msgs).await.into_iter().enumerate() {
        let enters_gone = entry(delays[i]).tiers[0] == gone;
        match (r, enters_gone) {
            (Ok(_), false) => {
                sent.insert(format!("id-{i}"));
            }
            (Ok(_), true) => accepted_wrongly.push(i),
            (Err(e), false) => refused_wrongly.push((i, e.to_string())),
            (Err(e), true) => assert!(
                e.to_string().contains("not declared") || e.to_string().contains("unroutable"),
                "{e}"
            ),
        }
    }
    assert!(
        accepted_wrongly.is_empty(),
        "{} messages entering the deleted tier were reported scheduled: {accepted_wrongly:?}",
        accepted_wrongly.len()
    );
    assert!(
        refused_wrongly.is_empty(),
        "{} routable messages were refused: {:?}",
        refused_wrongly.len(),
        &refused_wrongly[..refused_wrongly.len().min(3)]
    );
    let got = counts(&env.expect(&a, sent.len()).await);
    let missing: Vec<_> = sent.iter().filter(|id| !got.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "scheduled but not delivered: {missing:?}"
    );
    assert!(
        got.keys().all(|id| sent.contains(id)),
        "refused messages arrived"
    );
    p.close().await;
    env.cleanup().await;
}

/// The cascade tier most delays of 1–1500 ms enter through (small topology, exact), and `n`
/// random delays that either enter through it or never pass it (a message dead-lettered into
/// it from another tier would wait there, neither refused nor delivered).
fn busiest_cascade_tier(layout: &amqp_delay::Layout, n: usize) -> (TierKind, Vec<u64>) {
    let entry = |d: u64| amqp_delay::plan(layout, &amqp_delay::Precision::EXACT, d).unwrap();
    let mut entries: HashMap<TierKind, usize> = HashMap::new();
    for d in 1..=1500 {
        *entries.entry(entry(d).tiers[0]).or_default() += 1;
    }
    let (busiest, _) = entries
        .into_iter()
        .filter(|(t, _)| matches!(t, TierKind::Cascade { .. }))
        .max_by_key(|(_, n)| *n)
        .unwrap();
    let mut rng = rand::rng();
    let mut delays = Vec::new();
    while delays.len() < n {
        let d = rng.random_range(1..=1500);
        let r = entry(d);
        if r.tiers[0] == busiest || !r.tiers.contains(&busiest) {
            delays.push(d);
        }
    }
    (busiest, delays)
}

/// Arguments of a queue that refuses (nacks) every message: full at 0, `reject-publish`.
fn refusing_args() -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    a.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    a
}

/// lapin numbers a publish (the delivery tag its ack or nack comes back with) and queues its
/// frames in two steps; publishes from several threads on one channel could be numbered in one
/// order and sent in the other, and then swapped outcomes: a refused message looked confirmed.
/// `broker::SharedChannel` takes both steps at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishes_on_one_channel_each_get_their_own_ack_or_nack() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let conn = connect().await;
    let prefix = random_prefix();
    let (refusing, taking) = (format!("{prefix}-refusing"), format!("{prefix}-taking"));
    let ch = amqp_delay::ops::broker::open(&conn).await.unwrap();
    amqp_delay::ops::broker::declare_queue(&ch, &refusing, refusing_args())
        .await
        .unwrap();
    amqp_delay::ops::broker::declare_queue(&ch, &taking, FieldTable::default())
        .await
        .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let shared = amqp_delay::ops::broker::SharedChannel::new(ch.clone());
    let tasks: Vec<_> = (0..4000u32)
        .map(|i| {
            let shared = shared.clone();
            let q = if i % 3 == 0 { &refusing } else { &taking }.clone();
            tokio::spawn(async move {
                let confirm = shared
                    .basic_publish(
                        "".into(),
                        q.as_str().into(),
                        BasicPublishOptions::default(),
                        b"x",
                        lapin::BasicProperties::default(),
                    )
                    .await
                    .unwrap();
                (i % 3 == 0, confirm.await.unwrap().is_ack())
            })
        })
        .collect();
    let mut swapped = 0;
    for t in tasks {
        let (refused, acked) = t.await.unwrap();
        if refused == acked {
            swapped += 1;
        }
    }
    let admin = amqp_delay::ops::broker::open(&conn).await.unwrap();
    for q in [&refusing, &taking] {
        admin
            .queue_delete(q.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(
        swapped, 0,
        "{swapped} of 4000 publishes got another's outcome"
    );
}

/// The same through the publisher: with a tier that refuses everything (full, reject-publish)
/// and many `schedule` calls at once, every message reported scheduled arrives and none reported
/// refused does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_concurrent_schedules_a_refusing_tier_refuses_exactly_its_own_messages() {
    let mut topology = small_topology();
    topology.max_tier_length = Some(100_000);
    let mut env = Env::new(topology).await;
    let a = env.queue("a").await;
    let layout = env.layout();
    let (gone, delays) = busiest_cascade_tier(&layout, 3000);
    let TierKind::Cascade { level, digit } = gone else {
        unreachable!()
    };
    // the tier, replaced by a queue that refuses every message (nack)
    let tier = layout.cascade_queue(level, digit);
    env.delete_queue(&tier).await;
    let ch = amqp_delay::ops::broker::open(&env.conn).await.unwrap();
    amqp_delay::ops::broker::declare_queue(&ch, &tier, refusing_args())
        .await
        .unwrap();
    amqp_delay::ops::broker::bind_queue(
        &ch,
        &tier,
        &layout.level_exchange(level),
        &layout.level_binding(level, digit),
    )
    .await
    .unwrap();
    amqp_delay::ops::broker::close(&ch, "ok").await;

    // every call its own publish, from many tasks at once
    let mut s = env.settings.clone();
    s.publisher.batch_max_messages = 1;
    s.publisher.batch_linger = DurationMs(0);
    let p = std::sync::Arc::new(amqp_delay::Publisher::connect(&s).await.unwrap());
    let calls: Vec<_> = delays
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let (p, a) = (p.clone(), a.clone());
            tokio::spawn(async move {
                let r = p
                    .schedule(Message::new(a, d, format!("m{i}")).with_id(format!("id-{i}")))
                    .await;
                (format!("id-{i}"), r)
            })
        })
        .collect();
    let mut sent = HashSet::new();
    let mut refused = 0;
    for c in calls {
        match c.await.unwrap() {
            (id, Ok(_)) => {
                sent.insert(id);
            }
            (_, Err(Error::Nacked { .. })) => refused += 1,
            (id, Err(e)) => panic!("{id}: {e}"),
        }
    }
    assert!(
        refused > 100 && sent.len() > 1000,
        "{refused} refused, {} scheduled",
        sent.len()
    );
    let got = counts(&env.expect(&a, sent.len()).await);
    let missing: Vec<_> = sent.iter().filter(|id| !got.contains_key(*id)).collect();
    let extra: Vec<_> = got.keys().filter(|id| !sent.contains(*id)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} scheduled but not delivered: {:?}; {} refused but delivered: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)],
        extra.len(),
        &extra[..extra.len().min(5)]
    );
    if let Ok(p) = std::sync::Arc::try_unwrap(p) {
        p.close().await;
    }
    env.cleanup().await;
}
