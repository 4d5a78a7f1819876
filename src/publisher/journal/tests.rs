//! The journal writer's queue and flush accounting.

use super::*;

fn item(id: &str) -> Item {
    Item {
        id: id.into(),
        owner: None,
        queue: "q".into(),
        exchange: None,
        routing_key: None,
        due_ms: 1,
        size: 0,
        content_type: None,
        headers: vec![],
        body: None,
    }
}

fn writer() -> JournalWriter {
    JournalWriter {
        shared: Arc::new(Mutex::new(Shared::default())),
        wake: Arc::new(Notify::new()),
    }
}

#[test]
fn the_queue_is_written_when_its_first_intent_is_due_or_a_batch_hurries_it_or_it_is_full() {
    let now = Instant::now();
    let mut s = Shared::default();
    assert!(!s.due(now), "nothing queued");
    let (_, wake) = s.push(vec![item("a")], now + Duration::from_millis(100));
    assert!(wake, "the first intent sets the instant");
    let (_, wake) = s.push(vec![item("b")], now + Duration::from_millis(300));
    assert!(!wake, "a later one changes nothing");
    let (_, wake) = s.push(vec![item("c")], now + Duration::from_millis(50));
    assert!(wake, "an earlier one does");
    assert!(!s.due(now));
    assert!(s.due(now + Duration::from_millis(50)));
    s.hurry = true;
    assert!(s.due(now));
    let round = s.take();
    assert_eq!(round.len(), 3, "a record takes every intent queued");
    assert_eq!((s.taken, s.queued_items, s.earliest), (3, 0, None));
    assert!(!s.hurry && !s.due(now + Duration::from_secs(1)));
    let far = now + Duration::from_secs(60);
    let (_, wake) = s.push(
        (0..ROUND_ITEMS).map(|i| item(&i.to_string())).collect(),
        far,
    );
    assert!(
        wake && s.due(now),
        "four full records wait: written at once"
    );
}

#[test]
fn a_flush_ends_once_each_of_its_members_ended_naming_the_failed_and_unsure() {
    let w = writer();
    lock(&w.shared).open.insert(
        7,
        Open {
            left: 4,
            ..Open::default()
        },
    );
    let id = |i: usize| format!("m{i}");
    // one batch holds two members of flush 7 and one not journaled
    w.ended(&[Some(7), None, Some(7)], id, Ended::Confirmed);
    assert!(
        lock(&w.shared).ended.is_empty(),
        "two members still under way"
    );
    w.ended(&[Some(7)], id, Ended::Unsure);
    w.ended(&[Some(8), Some(7)], id, Ended::Failed);
    let s = lock(&w.shared);
    assert!(s.open.is_empty());
    assert_eq!(
        s.ended,
        [Flush {
            flush: 7,
            failed: vec!["m1".into()],
            unsure: vec!["m0".into()],
        }]
    );
}

#[tokio::test]
async fn a_leaving_batch_hurries_only_intents_still_queued() {
    let w = Arc::new(writer());
    let later = || Instant::now() + Duration::from_secs(9);
    fn answer(w: &JournalWriter, flush: u64) {
        for i in lock(&w.shared).take() {
            let _ = i.reply.send(Ok(flush));
        }
    }
    let Pending::Queued(first) = w.queue(item("a"), later()) else {
        panic!("queued");
    };
    answer(&w, 3);
    assert!(matches!(w.journaled(vec![first]).await[..], [Ok(3)]));
    assert!(!lock(&w.shared).hurry, "its record was written already");
    let Pending::Queued(second) = w.queue(item("b"), later()) else {
        panic!("queued");
    };
    let w2 = w.clone();
    let waiting = tokio::spawn(async move { w2.journaled(vec![second]).await });
    while !lock(&w.shared).hurry {
        tokio::task::yield_now().await;
    }
    assert!(lock(&w.shared).due(Instant::now()), "written at once");
    answer(&w, 4);
    assert!(matches!(waiting.await.unwrap()[..], [Ok(4)]));
}

#[test]
fn a_stopped_or_failing_journal_gives_the_item_back() {
    let w = writer();
    lock(&w.shared).down_until = Some(Instant::now() + OUTAGE_PAUSE);
    assert!(matches!(
        w.queue(item("a"), Instant::now()),
        Pending::Item(_)
    ));
    assert!(w.queue_now(vec![item("b")]).is_err());
    lock(&w.shared).down_until = None;
    w.stop();
    assert!(matches!(
        w.queue(item("c"), Instant::now()),
        Pending::Item(_)
    ));
}
