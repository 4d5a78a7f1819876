use super::*;

use amqp_delay::settings::TrustSettings;

fn trust() -> Trust {
    Trust::new(
        Some("indexer".into()),
        &TrustSettings {
            admins: vec!["root".into()],
            peers: vec!["gw".into()],
        },
    )
}

fn item(id: &str, owner: Option<&str>) -> Item {
    Item {
        id: id.into(),
        owner: owner.map(Into::into),
        queue: "orders".into(),
        exchange: None,
        routing_key: None,
        due_ms: 9_000,
        size: 3,
        content_type: None,
        headers: vec![("tenant".into(), "t1".into())],
        body: None,
    }
}

fn scheduled(flush: u64, items: Vec<Item>, confirmed: Vec<Flush>) -> Record {
    Record::Scheduled {
        session: "s1".into(),
        flush,
        at_ms: 1_000,
        items,
        confirmed,
    }
}

fn owners_ids(entries: &[Entry]) -> Vec<(String, String)> {
    entries
        .iter()
        .filter_map(|e| match e {
            Entry::Scheduled(s) => Some((s.owner.clone(), s.id.clone())),
            _ => None,
        })
        .collect()
}

fn flush(n: u64, failed: &[&str]) -> Flush {
    Flush {
        flush: n,
        failed: failed.iter().map(|s| s.to_string()).collect(),
        unsure: Vec::new(),
    }
}

#[test]
fn an_item_is_owned_by_its_writer_unless_a_forwarder_names_the_owner() {
    let mut t = Translator::new(trust());
    let r = scheduled(1, vec![item("a", None), item("b", Some("bob"))], vec![]);
    // a stranger naming another owner owns its message itself
    assert_eq!(
        owners_ids(&t.journal(0, Some("mallory"), &r)),
        [
            ("mallory".into(), "a".into()),
            ("mallory".into(), "b".into())
        ]
    );
    // a peer (a gateway) and our own user forward: the owner they name counts
    for fwd in ["gw", "indexer"] {
        assert_eq!(
            owners_ids(&t.journal(0, Some(fwd), &r)),
            [(fwd.into(), "a".into()), ("bob".into(), "b".into())]
        );
    }
    // no writer: nothing
    assert!(t.journal(0, None, &r).is_empty());
    assert!(t.journal(0, Some(""), &r).is_empty());
    assert_eq!(t.skipped(), 2);
}

#[test]
fn intents_are_unconfirmed_until_their_flush_is_confirmed_by_the_same_writer_and_session() {
    let mut t = Translator::new(trust());
    let e = t.journal(
        10,
        Some("alice"),
        &scheduled(1, vec![item("a", None), item("b", None)], vec![]),
    );
    assert!(matches!(&e[0], Entry::Scheduled(s) if !s.confirmed && s.scheduled_at_ms == 1_000));
    assert_eq!(t.flushes().replay_from(), Some(10));
    // another writer or another session confirms nothing
    let other_session = Record::Confirmed {
        session: "s2".into(),
        flushes: vec![flush(1, &[])],
    };
    let confirm = Record::Confirmed {
        session: "s1".into(),
        flushes: vec![flush(1, &["b"])],
    };
    assert!(t.journal(11, Some("alice"), &other_session).is_empty());
    assert!(t.journal(11, Some("mallory"), &confirm).is_empty());
    assert_eq!(
        t.journal(12, Some("alice"), &confirm),
        [
            Entry::Confirmed {
                owner: "alice".into(),
                id: "a".into()
            },
            Entry::Refused {
                owner: "alice".into(),
                id: "b".into(),
                scheduled_at_ms: 1_000
            }
        ]
    );
    assert_eq!(t.flushes().replay_from(), None);
    // a lost confirm leaves its ids unconfirmed
    t.journal(
        20,
        Some("alice"),
        &scheduled(2, vec![item("c", None), item("d", None)], vec![]),
    );
    let mut unsure = flush(2, &[]);
    unsure.unsure = vec!["c".into()];
    let e = t.journal(
        21,
        Some("alice"),
        &Record::Confirmed {
            session: "s1".into(),
            flushes: vec![unsure],
        },
    );
    assert_eq!(
        e,
        [Entry::Confirmed {
            owner: "alice".into(),
            id: "d".into()
        }]
    );
    // a confirm seen twice confirms once
    assert!(t.journal(13, Some("alice"), &confirm).is_empty());
}

#[test]
fn a_scheduled_record_confirms_earlier_flushes_it_carries() {
    let mut t = Translator::new(trust());
    t.journal(
        1,
        Some("alice"),
        &scheduled(1, vec![item("a", None)], vec![]),
    );
    let e = t.journal(
        2,
        Some("alice"),
        &scheduled(2, vec![item("b", None)], vec![flush(1, &[])]),
    );
    assert_eq!(owners_ids(&e), [("alice".into(), "b".into())]);
    assert!(e.contains(&Entry::Confirmed {
        owner: "alice".into(),
        id: "a".into()
    }));
    assert_eq!(t.flushes().replay_from(), Some(2));
}

#[test]
fn the_flush_map_stays_bounded_in_members_and_age() {
    let mut t = Translator::new(trust());
    let items: Vec<Item> = (0..1_000).map(|i| item(&format!("m{i}"), None)).collect();
    for f in 0..(MAX_FLUSH_MEMBERS as u64 / 1_000 + 50) {
        t.journal(f, Some("alice"), &scheduled(f, items.clone(), vec![]));
        assert!(t.flushes().members() <= MAX_FLUSH_MEMBERS);
    }
    assert_eq!(t.flushes().replay_from(), Some(50));
    // a flush older than the window is forgotten once newer ones arrive
    let mut late = scheduled(9_999, vec![item("x", None)], vec![]);
    if let Record::Scheduled { at_ms, .. } = &mut late {
        *at_ms = 1_000 + FLUSH_WINDOW_MS + 1;
    }
    t.journal(100_000, Some("alice"), &late);
    assert_eq!(t.flushes().replay_from(), Some(100_000));
    assert_eq!(t.flushes().members(), 1);
}

#[test]
fn runs_count_only_from_ourselves_admins_and_peers() {
    let mut t = Translator::new(trust());
    let run = |outcome| Run {
        id: "a".into(),
        owner: Some("alice".into()),
        queue: "orders".into(),
        due_ms: 5_000,
        at_ms: 5_040,
        outcome,
    };
    let r = Record::Ran {
        items: vec![
            run(RunOutcome::Done),
            run(RunOutcome::Retried { next_due_ms: 9_000 }),
            run(RunOutcome::Parked),
            run(RunOutcome::Cancelled),
            run(RunOutcome::Rescheduled { due_ms: 7_000 }),
            run(RunOutcome::Superseded),
        ],
    };
    assert!(t.journal(0, Some("alice"), &r).is_empty());
    assert!(t.journal(0, Some("mallory"), &r).is_empty());
    let e = t.journal(0, Some("gw"), &r);
    assert_eq!(e.len(), 5);
    assert_eq!(
        e[0],
        Entry::Ran {
            owner: "alice".into(),
            id: "a".into(),
            at_ms: 5_040,
            lateness_ms: 40,
            outcome: Outcome::Done
        }
    );
    assert!(matches!(
        e[1],
        Entry::Ran {
            outcome: Outcome::Retried {
                next_due_at_ms: 9_000
            },
            ..
        }
    ));
    assert!(
        matches!(&e[3], Entry::Cancelled { owner: Some(o), by, .. } if o == "alice" && by == "gw")
    );
    assert!(matches!(
        &e[4],
        Entry::Rescheduled {
            due_at_ms: 7_000,
            ..
        }
    ));
    assert_eq!(t.journal(0, Some("root"), &r).len(), 5);
    assert_eq!(t.journal(0, Some("indexer"), &r).len(), 5);
}

#[test]
fn steering_records_cover_the_writers_own_unless_an_admin_wrote_them() {
    let mut t = Translator::new(trust());
    let cancel = ControlRecord::Cancel {
        id: "a".into(),
        until_ms: 1,
        due_at_ms: None,
    };
    assert_eq!(
        t.control(Some("alice"), &cancel, 77),
        [Entry::Cancelled {
            owner: Some("alice".into()),
            id: "a".into(),
            by: "alice".into(),
            at_ms: 77
        }]
    );
    assert!(matches!(
        &t.control(Some("root"), &cancel, 77)[0],
        Entry::Cancelled { owner: None, .. }
    ));
    let cancels = ControlRecord::Cancels {
        items: vec![("a".into(), 1), ("".into(), 1), ("b".into(), 1)],
    };
    assert_eq!(t.control(Some("alice"), &cancels, 77).len(), 2);
    let purge = ControlRecord::Purge(amqp_delay::control::Purge {
        nonce: "n".into(),
        queue: "orders".into(),
        owner: Some("bob".into()),
        due_after_ms: Some(1),
        due_before_ms: None,
        header: Some(("k".into(), "v".into())),
        scheduled_before_ms: 500,
        until_ms: 9,
    });
    let owner_of = |e: &[Entry]| match &e[0] {
        Entry::Purged(p) => p.owner.clone(),
        Entry::Rescheduled { owner, .. } => owner.clone(),
        other => panic!("{other:?}"),
    };
    // a user's purge covers its own messages whatever owner it names; an admin's the named one
    assert_eq!(
        owner_of(&t.control(Some("alice"), &purge, 77)),
        Some("alice".into())
    );
    assert_eq!(
        owner_of(&t.control(Some("root"), &purge, 77)),
        Some("bob".into())
    );
    let Entry::Purged(p) = &t.control(Some("root"), &purge, 77)[0] else {
        panic!()
    };
    assert_eq!(p.destination, Destination::Queue("orders".into()));
    assert_eq!(p.scheduled_before_ms, 500);
    assert_eq!(p.header, Some(("k".into(), "v".into())));
    let resched = |owner: Option<&str>| ControlRecord::Reschedule {
        id: "a".into(),
        owner: owner.map(Into::into),
        due_at_ms: 9_000,
        until_ms: 1,
    };
    assert_eq!(
        owner_of(&t.control(Some("alice"), &resched(Some("bob")), 7)),
        Some("alice".into())
    );
    assert_eq!(
        owner_of(&t.control(Some("root"), &resched(Some("bob")), 7)),
        Some("bob".into())
    );
    assert_eq!(owner_of(&t.control(Some("root"), &resched(None), 7)), None);
    // without a writer nothing counts; what is not steering is nothing for the index
    assert!(t.control(None, &cancel, 7).is_empty());
    assert!(
        t.control(
            Some("alice"),
            &ControlRecord::BatchMarker { queue: "q".into() },
            7
        )
        .is_empty()
    );
    assert!(
        t.control(
            Some("alice"),
            &ControlRecord::Barrier { nonce: "n".into() },
            7
        )
        .is_empty()
    );
}

#[test]
fn what_the_index_cannot_hold_is_skipped_not_applied() {
    let mut t = Translator::new(trust());
    let mut long = item(&"x".repeat(256), None);
    long.owner = None;
    let mut far = item("far", None);
    far.due_ms = u64::MAX;
    let mut nowhere = item("nowhere", None);
    nowhere.queue = String::new();
    let mut gateway = item("gw-msg", None);
    gateway.exchange = Some("target".into());
    gateway.routing_key = Some("a.b".into());
    let mut noisy = item("noisy", None);
    noisy.headers = (0..1_000)
        .map(|i| (format!("k{i}"), "v".repeat(100)))
        .collect();
    let e = t.journal(
        0,
        Some("alice"),
        &scheduled(1, vec![long, far, nowhere, gateway, noisy], vec![]),
    );
    assert_eq!(e.len(), 2);
    let Entry::Scheduled(g) = &e[0] else { panic!() };
    assert_eq!(
        g.destination,
        Destination::Exchange {
            exchange: "target".into(),
            routing_key: "a.b".into()
        }
    );
    let Entry::Scheduled(n) = &e[1] else { panic!() };
    assert!(n.headers.len() <= MAX_HEADERS);
    assert!(
        n.headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
            <= MAX_HEADER_BYTES
    );
    assert_eq!(t.skipped(), 3);
}
