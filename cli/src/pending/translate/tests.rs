use super::*;

use amqp_delay::settings::TrustSettings;

/// The reader's clock in these tests, and the topology's longest delay.
const NOW: u64 = 10_000_000;
const MAX_DELAY: u64 = 3_600_000;

fn trust() -> Trust {
    Trust::new(
        Some("indexer".into()),
        &TrustSettings {
            admins: vec!["root".into()],
            peers: vec!["gw".into()],
            ..Default::default()
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
    let mut t = Translator::new(trust(), MAX_DELAY);
    let r = scheduled(1, vec![item("a", None), item("b", Some("bob"))], vec![]);
    // a stranger naming another owner owns its message itself
    assert_eq!(
        owners_ids(&t.journal(0, Some("mallory"), &r, NOW)),
        [
            ("mallory".into(), "a".into()),
            ("mallory".into(), "b".into())
        ]
    );
    // a peer (a gateway) and our own user forward: the owner they name counts
    for fwd in ["gw", "indexer"] {
        assert_eq!(
            owners_ids(&t.journal(0, Some(fwd), &r, NOW)),
            [(fwd.into(), "a".into()), ("bob".into(), "b".into())]
        );
    }
    // no writer: nothing
    assert!(t.journal(0, None, &r, NOW).is_empty());
    assert!(t.journal(0, Some(""), &r, NOW).is_empty());
    assert_eq!(t.skipped(), 2);
}

#[test]
fn intents_are_unconfirmed_until_their_flush_is_confirmed_by_the_same_writer_and_session() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    let e = t.journal(
        10,
        Some("alice"),
        &scheduled(1, vec![item("a", None), item("b", None)], vec![]),
        NOW,
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
    assert!(t.journal(11, Some("alice"), &other_session, NOW).is_empty());
    assert!(t.journal(11, Some("mallory"), &confirm, NOW).is_empty());
    assert_eq!(
        t.journal(12, Some("alice"), &confirm, NOW),
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
        NOW,
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
        NOW,
    );
    assert_eq!(
        e,
        [Entry::Confirmed {
            owner: "alice".into(),
            id: "d".into()
        }]
    );
    // a confirm seen twice confirms once
    assert!(t.journal(13, Some("alice"), &confirm, NOW).is_empty());
}

#[test]
fn a_scheduled_record_confirms_earlier_flushes_it_carries() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    t.journal(
        1,
        Some("alice"),
        &scheduled(1, vec![item("a", None)], vec![]),
        NOW,
    );
    let e = t.journal(
        2,
        Some("alice"),
        &scheduled(2, vec![item("b", None)], vec![flush(1, &[])]),
        NOW,
    );
    assert_eq!(owners_ids(&e), [("alice".into(), "b".into())]);
    assert!(e.contains(&Entry::Confirmed {
        owner: "alice".into(),
        id: "a".into()
    }));
    assert_eq!(t.flushes().replay_from(), Some(2));
}

/// What a publisher writes now: a flush's messages leave in several batches at their own
/// times, so flushes end out of order and each is confirmed in whichever later record follows
/// (flush 2 before flush 1, flush 1 three records on, with a failed member).
#[test]
fn flushes_confirmed_out_of_order_and_several_records_later_are_read_right() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    let confirmed = |e: &[Entry]| {
        let mut v: Vec<&str> = e
            .iter()
            .filter_map(|e| match e {
                Entry::Confirmed { id, .. } => Some(id.as_str()),
                _ => None,
            })
            .collect();
        v.sort();
        v.join(",")
    };
    let r1 = scheduled(1, vec![item("a", None), item("b", None)], vec![]);
    t.journal(1, Some("alice"), &r1, NOW);
    t.journal(
        2,
        Some("alice"),
        &scheduled(2, vec![item("c", None)], vec![]),
        NOW,
    );
    let e = t.journal(
        3,
        Some("alice"),
        &scheduled(3, vec![item("d", None)], vec![flush(2, &[])]),
        NOW,
    );
    assert_eq!(confirmed(&e), "c");
    assert_eq!(t.flushes().replay_from(), Some(1), "flush 1 still open");
    let e = t.journal(4, Some("alice"), &scheduled(4, vec![], vec![]), NOW);
    assert!(e.is_empty());
    let e = t.journal(
        5,
        Some("alice"),
        &scheduled(
            5,
            vec![item("e", None)],
            vec![flush(1, &["b"]), flush(3, &[])],
        ),
        NOW,
    );
    assert_eq!(confirmed(&e), "a,d");
    assert!(e.contains(&Entry::Refused {
        owner: "alice".into(),
        id: "b".into(),
        scheduled_at_ms: 1_000,
    }));
    assert_eq!(t.flushes().replay_from(), Some(5), "only flush 5 open");
}

#[test]
fn the_flush_map_stays_bounded_in_members_and_age() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    let items: Vec<Item> = (0..1_000).map(|i| item(&format!("m{i}"), None)).collect();
    for f in 0..(MAX_FLUSH_MEMBERS as u64 / 1_000 + 50) {
        t.journal(f, Some("alice"), &scheduled(f, items.clone(), vec![]), NOW);
        assert!(t.flushes().members() <= MAX_FLUSH_MEMBERS);
    }
    assert_eq!(t.flushes().replay_from(), Some(50));
    // a flush older than the window is forgotten once newer ones arrive
    let mut late = scheduled(9_999, vec![item("x", None)], vec![]);
    if let Record::Scheduled { at_ms, .. } = &mut late {
        *at_ms = 1_000 + FLUSH_WINDOW_MS + 1;
    }
    t.journal(100_000, Some("alice"), &late, NOW);
    assert_eq!(t.flushes().replay_from(), Some(100_000));
    assert_eq!(t.flushes().members(), 1);
}

#[test]
fn runs_count_only_from_ourselves_admins_and_peers() {
    let mut t = Translator::new(trust(), MAX_DELAY);
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
    assert!(t.journal(0, Some("alice"), &r, NOW).is_empty());
    assert!(t.journal(0, Some("mallory"), &r, NOW).is_empty());
    let e = t.journal(0, Some("gw"), &r, NOW);
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
    assert_eq!(t.journal(0, Some("root"), &r, NOW).len(), 5);
    assert_eq!(t.journal(0, Some("indexer"), &r, NOW).len(), 5);
}

#[test]
fn steering_records_cover_the_writers_own_unless_an_admin_wrote_them() {
    let mut t = Translator::new(trust(), MAX_DELAY);
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
    let purge = ControlRecord::Purge(amqp_delay::ops::control::Purge {
        nonce: "n".into(),
        scope: amqp_delay::ops::control::PurgeScope {
            owner: Some("bob".into()),
            due_after_ms: Some(1),
            header: Some(("k".into(), "v".into())),
            ..amqp_delay::ops::control::PurgeScope::queue("orders")
        },
        scheduled_before_ms: 500,
        until_ms: 9,
    });
    let owner_of = |e: &[Entry]| match &e[0] {
        Entry::Purged(p) => p.scope.owner.clone(),
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
    assert_eq!(p.scope.queue, "orders");
    assert_eq!(p.scheduled_before_ms, 500);
    assert_eq!(p.scope.header, Some(("k".into(), "v".into())));
    let resched = |owner: Option<&str>| ControlRecord::Reschedule {
        to: amqp_delay::ops::control::Reschedule {
            id: "a".into(),
            owner: owner.map(Into::into),
            due_at_ms: 9_000,
        },
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
    let mut t = Translator::new(trust(), MAX_DELAY);
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
        NOW,
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

fn items(prefix: &str, n: usize) -> Vec<Item> {
    (0..n)
        .map(|i| item(&format!("{prefix}{i}"), None))
        .collect()
}

fn confirm_failing(n: u64, failed: Vec<String>) -> Record {
    Record::Confirmed {
        session: "s1".into(),
        flushes: vec![Flush {
            flush: n,
            failed,
            unsure: Vec::new(),
        }],
    }
}

/// The attack's shape: one flush split over two records, then a confirm naming 30 000 and
/// 60 000 failed ids. Every item is accounted for once, and the refused are exactly the failed
/// ones of the flush.
#[test]
fn a_split_flush_and_a_confirm_naming_tens_of_thousands_of_failed_ids_are_read_right() {
    let max = amqp_delay::ops::journal::MAX_ITEMS;
    for (flush_no, failed_ids) in [(1, 30_000), (2, 60_000)] {
        let mut t = Translator::new(trust(), MAX_DELAY);
        let all = items("m", 2 * max);
        let (first, second) = all.split_at(max);
        for (off, part) in [(0, first), (1, second)] {
            let e = t.journal(
                off,
                Some("mallory"),
                &scheduled(flush_no, part.to_vec(), vec![]),
                NOW,
            );
            assert_eq!(e.len(), max);
        }
        // the first record replayed adds nothing
        t.journal(
            0,
            Some("mallory"),
            &scheduled(flush_no, first.to_vec(), vec![]),
            NOW,
        );
        assert_eq!(t.flushes().members(), 2 * max);
        let failed: Vec<String> = (0..failed_ids).map(|i| format!("m{i}")).collect();
        let e = t.journal(2, Some("mallory"), &confirm_failing(flush_no, failed), NOW);
        assert_eq!(e.len(), 2 * max);
        assert!(e.iter().all(|e| matches!(e, Entry::Refused { .. })));
        assert_eq!(t.flushes().members(), 0);
    }
}

/// A regression guard for linear cost: a flush spread over 50 records (100 000 items) and a
/// confirm naming 100 000 failed ids. Matching by scanning (each item against what the flush
/// holds, each member against the failed list) takes about 10^10 comparisons here, minutes
/// at least; by lookups it is a few hundred thousand, well under a second. It cannot fail
/// spuriously: a regression makes it hang, not flake.
#[test]
fn a_flush_of_100_000_items_and_100_000_failed_ids_costs_lookups_not_scans() {
    let max = amqp_delay::ops::journal::MAX_ITEMS;
    let mut t = Translator::new(trust(), MAX_DELAY);
    for r in 0..50 {
        let part = items(&format!("r{r}-"), max);
        t.journal(r, Some("mallory"), &scheduled(9, part, vec![]), NOW);
    }
    assert_eq!(t.flushes().members(), 50 * max);
    let failed: Vec<String> = (0..50)
        .flat_map(|r| (0..max).map(move |i| format!("r{r}-{i}")))
        .collect();
    let e = t.journal(50, Some("mallory"), &confirm_failing(9, failed), NOW);
    assert_eq!(e.len(), 50 * max);
}

/// One writer's unconfirmed flushes never push another's out: past the bound, the writer
/// holding the most loses its oldest.
#[test]
fn a_writer_flooding_the_flush_map_forgets_its_own_flushes_not_others() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    t.journal(0, Some("alice"), &scheduled(1, items("a", 3), vec![]), NOW);
    let max = amqp_delay::ops::journal::MAX_ITEMS;
    let floods = MAX_FLUSH_MEMBERS / max + 10;
    for f in 0..floods {
        let part = items(&format!("f{f}-"), max);
        t.journal(
            1 + f as u64,
            Some("mallory"),
            &scheduled(f as u64, part, vec![]),
            NOW,
        );
        assert!(t.flushes().members() <= MAX_FLUSH_MEMBERS);
    }
    assert_eq!(t.flushes().members_of("alice"), 3);
    assert_eq!(
        t.flushes().replay_from(),
        Some(0),
        "alice's flush is the oldest waiting"
    );
    let e = t.journal(99_999, Some("alice"), &confirm_failing(1, vec![]), NOW);
    assert_eq!(e.len(), 3);
    assert!(e.iter().all(|e| matches!(e, Entry::Confirmed { .. })));
}

fn dated(flush: u64, id: &str, at_ms: u64) -> Record {
    let mut r = scheduled(flush, vec![item(id, None)], vec![]);
    if let Record::Scheduled {
        at_ms: at, items, ..
    } = &mut r
    {
        *at = at_ms;
        items[0].due_ms = at_ms + 1_000;
    }
    r
}

/// A flush dated where no clock could have put it is skipped and counted, and never stalls
/// another writer's confirms; nor does one dated within the skew ahead.
#[test]
fn a_forged_time_is_skipped_and_never_ages_another_writers_flushes() {
    let mut t = Translator::new(trust(), MAX_DELAY);
    let skipped = t.skipped();
    // far ahead, with its confirm: nothing of it counts
    let forged = dated(1, "x", i64::MAX as u64 - 1);
    assert!(t.journal(0, Some("mallory"), &forged, NOW).is_empty());
    assert!(
        t.journal(1, Some("mallory"), &confirm_failing(1, vec![]), NOW)
            .is_empty()
    );
    assert_eq!(t.skipped(), skipped + 1);
    // ahead, but within the skew: read, and no one else's flush ages by it
    let ahead = dated(2, "y", NOW + CLOCK_SKEW_MS - 1);
    assert_eq!(t.journal(2, Some("mallory"), &ahead, NOW).len(), 1);
    // alice, a minute behind the reader's clock, is confirmed when her confirm comes
    let e = t.journal(3, Some("alice"), &dated(1, "a", NOW - 60_000), NOW);
    assert_eq!(e.len(), 1);
    let e = t.journal(4, Some("alice"), &confirm_failing(1, vec![]), NOW + 1_000);
    assert_eq!(
        e,
        [Entry::Confirmed {
            owner: "alice".into(),
            id: "a".into()
        }]
    );
    // an item due later than the topology allows after its flush; a run from the future
    let mut far = dated(3, "far", NOW);
    if let Record::Scheduled { items, .. } = &mut far {
        items[0].due_ms = NOW + MAX_DELAY + CLOCK_SKEW_MS + 1;
        items.push(item("near", None));
    }
    let e = t.journal(5, Some("alice"), &far, NOW);
    assert_eq!(owners_ids(&e), [("alice".into(), "near".into())]);
    let run = Record::Ran {
        items: vec![Run {
            id: "a".into(),
            owner: Some("alice".into()),
            queue: "orders".into(),
            due_ms: NOW,
            at_ms: NOW + CLOCK_SKEW_MS + 1,
            outcome: RunOutcome::Done,
        }],
    };
    assert!(t.journal(6, Some("gw"), &run, NOW).is_empty());
    assert_eq!(t.skipped(), skipped + 3);
    let text = amqp_delay::metrics::global().encode();
    assert!(
        text.contains("stream=\"journal\"") && text.contains("reason=\"time\""),
        "counted as skipped for its time"
    );
}
