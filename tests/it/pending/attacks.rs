//! A tenant that writes only what the documented publisher set allows cannot slow or freeze
//! another tenant's index (on our TLS test node, every user with exactly its documented set):
//! one flush of 30 000 items split over two records with a confirm naming 60 000 failed ids,
//! and a flush dated `i64::MAX - 1` with its confirm. Before, the first left every tenant's
//! index minutes behind and the second kept every later message unconfirmed.

use std::ops::Range;
use std::time::Duration;

use amqp_delay::ops::journal::{Flush, Item, Record};
use amqp_delay::time::now_ms;
use amqp_delay::{Message, Publisher};
use amqp_delay_cli::pending_index::Viewer;

use super::{Indexed, until_listed};
use crate::harness::*;
use crate::permissions::cli_as;
use crate::trust::{World, append_to};

/// The users and topology of `crate::trust::world`, with the admin's `declare --queue Q
/// --worker`, and a follower over an index file of its own, as the node's own user.
async fn world() -> (World, Indexed) {
    let w = crate::trust::world().await;
    let declare = ["declare", "--queue", &w.q, "--worker"];
    cli_as(
        "the admin's declare --queue Q",
        &w.cfg,
        &w.url("adm"),
        &declare,
    )
    .await;
    let ix = Indexed::start(&w.settings).await;
    (w, ix)
}

/// The id of mallory's item `i`: long, all of one length, alike up to their last bytes (what
/// makes comparing them cost most).
fn id(i: usize) -> String {
    format!("{}{i:08}", "m".repeat(120))
}

/// A `Scheduled` record of flush `flush` holding ids [`id`]`(i)` for `ids`, written at `at_ms`.
fn flush_of(w: &World, flush: u64, ids: Range<usize>, at_ms: u64) -> String {
    let items = ids
        .map(|i| Item {
            id: id(i),
            owner: None,
            queue: w.q.clone(),
            exchange: None,
            routing_key: None,
            due_ms: now_ms() + 60_000,
            size: 1,
            content_type: None,
            headers: Vec::new(),
            body: None,
        })
        .collect();
    let r = Record::Scheduled {
        session: "forged".into(),
        flush,
        at_ms,
        items,
        confirmed: Vec::new(),
    };
    serde_json::to_string(&r).unwrap()
}

/// The `Confirmed` record of flush `flush`, naming `failed` ids as refused.
fn confirm_of(flush: u64, failed: Range<usize>) -> String {
    let r = Record::Confirmed {
        session: "forged".into(),
        flushes: vec![Flush {
            flush,
            failed: failed.map(id).collect(),
            unsure: Vec::new(),
        }],
    };
    serde_json::to_string(&r).unwrap()
}

/// Appends `bodies` to the journal as mallory, with mallory's own `user_id`.
async fn mallory_writes(w: &World, bodies: &[String]) {
    let journal = w.settings.layout().unwrap().journal_stream();
    let mallory = w.user("mallory");
    append_to(w, "mallory", Some(&mallory), &journal, bodies)
        .await
        .expect("the publisher set may append to the journal");
}

/// Alice schedules `ids` (each its own flush); then they are listed, and listed confirmed.
async fn alice_is_listed_and_confirmed(w: &World, ix: &Indexed, ids: &[&str]) {
    let p = Publisher::connect(&w.as_role("alice")).await.unwrap();
    for id in ids {
        p.schedule(Message::new(w.q.clone(), 1_400, "a").with_id(*id))
            .await
            .unwrap();
    }
    p.close().await;
    let alice = Viewer::User(w.user("alice"));
    let waited = until_listed(ix, alice.clone(), &w.q, ids).await;
    println!("alice's messages listed after mallory's records within {waited:?}");
    let confirmed = wait_until_async(Duration::from_secs(15), || async {
        let rows = ix.rows(alice.clone(), Some(&w.q)).await;
        rows.len() == ids.len() && rows.iter().all(|r| r.state == "pending")
    })
    .await;
    assert!(
        confirmed,
        "alice's messages stay unconfirmed: {:?}",
        ix.rows(alice.clone(), Some(&w.q)).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_flush_with_60_000_failed_ids_slows_no_other_tenant() {
    let (w, ix) = world().await;
    let now = now_ms();
    let bodies = [
        flush_of(&w, 1, 0..15_000, now),
        flush_of(&w, 1, 15_000..30_000, now),
        confirm_of(1, 0..60_000),
    ];
    mallory_writes(&w, &bodies).await;
    alice_is_listed_and_confirmed(&w, &ix, &["of-alice"]).await;
    // mallory's records were read, for mallory's own items only: refused
    let shown = ix
        .service
        .show(Viewer::User(w.user("mallory")), &id(29_999), None)
        .await
        .unwrap();
    assert_eq!(shown.messages[0].row.state, "refused");
    ix.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_dated_i64_max_freezes_no_other_tenants_confirms() {
    let (w, ix) = world().await;
    let far = i64::MAX as u64 - 1;
    mallory_writes(&w, &[flush_of(&w, 1, 0..1, far), confirm_of(1, 0..0)]).await;
    alice_is_listed_and_confirmed(&w, &ix, &["later-1", "later-2"]).await;
    // mallory's record is skipped, and counted so
    let mallory = Viewer::User(w.user("mallory"));
    assert!(ix.service.show(mallory, &id(0), None).await.is_err());
    let text = amqp_delay::metrics::global().encode();
    assert!(
        text.lines()
            .any(|l| l.contains("stream=\"journal\"") && l.contains("reason=\"time\"")),
        "skipped for its time: {text}"
    );
    ix.stop().await;
}
