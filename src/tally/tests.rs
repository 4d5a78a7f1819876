use super::*;
use proptest::prelude::*;

#[test]
fn a_due_time_counts_until_its_second_is_over() {
    let mut d = Dues::default();
    d.add(10_001, 2);
    d.add(10_999, 1);
    d.add(11_000, 4);
    assert_eq!(d.compact(10_000), vec![(11, 7)]);
    assert_eq!(d.pending(10_999).total, 7);
    assert_eq!(d.pending(11_000).total, 0);
}

#[test]
fn pending_sorts_by_when_it_falls_due() {
    let now = 1_000_000_000;
    let mut d = Dues::default();
    d.add(now - 5_000, 100); // already due
    d.add(now + 30_000, 1);
    d.add(now + 600_000, 2);
    d.add(now + 7_200_000, 4);
    d.add(now + 3 * 86_400_000, 8);
    let p = d.pending(now);
    assert_eq!(
        (p.total, p.within_1m, p.within_1h, p.within_1d),
        (15, 1, 3, 7)
    );
}

#[test]
fn records_of_another_kind_or_version_do_not_decode() {
    let decode = |b: &[u8]| serde_json::from_slice::<Entry>(b).ok();
    assert_eq!(decode(b"{\"type\":\"something_new\"}"), None);
    assert_eq!(decode(b"garbage"), None);
    let e = Entry::Scheduled { dues: vec![(5, 1)] };
    assert_eq!(decode(&serde_json::to_vec(&e).unwrap()), Some(e));
}

#[test]
fn a_snapshot_is_coarser_far_ahead_and_never_early() {
    let now_s = 1_000_000;
    let mut d = Dues::default();
    for ahead in [1, 59, 7_199, 7_201, 7_210, 200_000, 200_001, 20_000_000] {
        d.add((now_s + ahead) * 1000, 1);
    }
    d.add((now_s - 3) * 1000, 5);
    let c = d.compact(now_s * 1000);
    assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 8, "{c:?}");
    // seconds within 2 h, minutes to 180 days, hours beyond: rounded up
    assert!(c.contains(&(now_s + 1, 1)) && c.contains(&(now_s + 7_199, 1)));
    assert!(c.contains(&((now_s + 7_201).div_ceil(60) * 60, 2)), "{c:?}");
    assert!(c.contains(&(now_s + 200_000, 1)), "{c:?}");
    assert!(
        c.contains(&((now_s + 200_001).div_ceil(60) * 60, 1)),
        "{c:?}"
    );
    assert!(
        c.contains(&((now_s + 20_000_000).div_ceil(3600) * 3600, 1)),
        "{c:?}"
    );
    let mut back = Dues::default();
    back.merge(&c);
    let (a, b) = (d.pending(now_s * 1000), back.pending(now_s * 1000));
    assert_eq!(
        (a.total, a.within_1m, a.within_1h),
        (b.total, b.within_1m, b.within_1h)
    );
}

#[test]
fn a_far_message_through_a_chain_of_snapshots_is_counted_until_due_and_at_most_a_minute_more() {
    let due_s = 1_000_000 + 3 * 86_400 + 37;
    let mut d = Dues::default();
    d.add(due_s * 1000, 1);
    // a snapshot every 30 min from 3 days before its due time
    let mut now_s = 1_000_000;
    while now_s < due_s + 120 {
        let mut next = Dues::default();
        next.merge(&d.compact(now_s * 1000));
        d = next;
        let pending = d.pending(now_s * 1000).total;
        if now_s < due_s {
            assert_eq!(pending, 1, "counted as due early at {now_s}");
        }
        if now_s >= due_s + 60 {
            assert_eq!(pending, 0, "still counted at {now_s}");
        }
        now_s += if due_s - 600 < now_s { 7 } else { 1_800 };
    }
}

/// The bound `compact` promises, and that a snapshot of it is one message RabbitMQ 4.x
/// accepts (16 MiB by default, DESIGN rule 12): messages due in every second of the next
/// two hours and in every minute of the rest of a year, which fills every pair `compact`
/// can keep.
#[test]
fn a_year_of_pending_messages_fits_one_snapshot() {
    let now_s = 1_000_000_000;
    let mut d = Dues::default();
    for ahead in (1..=7_200).chain((7_260..=365 * 86_400).step_by(60)) {
        d.add((now_s + ahead) * 1000, 1);
    }
    let pairs = d.compact(now_s * 1000);
    let snapshot = Entry::Snapshot {
        covers: u64::MAX,
        at_ms: u64::MAX,
        dues: pairs.clone(),
    };
    let bytes = serde_json::to_vec(&snapshot).unwrap().len();
    eprintln!("a year: {} pairs, {bytes} bytes", pairs.len());
    assert!(
        pairs.len() <= 7_200 + 180 * 1_440 + 185 * 24,
        "{}",
        pairs.len()
    );
    assert!(bytes < 16 * 1024 * 1024, "{bytes}");
}

#[test]
fn absurd_records_do_not_overflow_the_sums() {
    let mut d = Dues::default();
    d.merge(&[
        (u64::MAX, u64::MAX),
        (u64::MAX - 1, u64::MAX),
        (5, u64::MAX),
    ]);
    d.merge(&[(5, 7)]);
    let p = d.pending(1_000);
    assert_eq!((p.total, p.within_1m), (u64::MAX, u64::MAX));
    assert!(!d.compact(1_000).is_empty());
}

#[test]
fn a_window_without_a_usable_snapshot_asks_for_the_whole_stream() {
    let mut r = Reckoning::default();
    r.read(50, Entry::Scheduled { dues: vec![(9, 1)] }).unwrap();
    // covers up to 40: records 41..49 were not read
    r.read(
        51,
        Entry::Snapshot {
            covers: 40,
            at_ms: 1,
            dues: vec![(9, 3)],
        },
    )
    .unwrap();
    assert!(!r.complete());
    assert_eq!(r.finish(false), None);
}

#[test]
fn a_snapshot_covering_its_own_offset_or_later_is_skipped() {
    let mut r = Reckoning::new(Bounds::new(1_000_000, 3_600_000));
    r.read(
        0,
        Entry::Scheduled {
            dues: vec![(1_100, 1)],
        },
    )
    .unwrap();
    let forged = Entry::Snapshot {
        covers: u64::MAX,
        at_ms: u64::MAX,
        dues: vec![],
    };
    assert_eq!(r.read(1, forged), Err("insane"));
    let own = Entry::Snapshot {
        covers: 2,
        at_ms: 1,
        dues: vec![],
    };
    assert_eq!(r.read(2, own), Err("insane"), "covers its own offset");
    r.read(
        3,
        Entry::Scheduled {
            dues: vec![(1_200, 2)],
        },
    )
    .unwrap();
    let got = r.finish_whole();
    assert_eq!(got.snapshot_at_ms, None);
    assert_eq!(
        got.dues.pending(1_000_000).total,
        3,
        "every real count counted"
    );
}

#[test]
fn far_due_times_and_future_snapshots_are_clamped_and_oversize_records_skipped() {
    let now = 1_000_000;
    let b = Bounds::new(now, 3_600_000);
    assert_eq!(b.latest_s, 4_600);
    let e = b.check(Entry::Scheduled {
        dues: vec![(u64::MAX, 7), (2_000, 1)],
    });
    assert_eq!(
        e,
        Ok(Entry::Scheduled {
            dues: vec![(4_600, 7), (2_000, 1)]
        })
    );
    let e = b.check(Entry::Snapshot {
        covers: 1,
        at_ms: u64::MAX,
        dues: vec![],
    });
    assert!(
        matches!(
            e,
            Ok(Entry::Snapshot {
                at_ms: 1_000_000,
                ..
            })
        ),
        "{e:?}"
    );
    let many = (0..=b.max_pairs as u64).map(|s| (s, 1)).collect();
    assert_eq!(
        b.check(Entry::Scheduled { dues: many }),
        Err("too_many_items")
    );
    // a forged far-off count is forgotten like a real one, once its clamped time has come
    let mut d = Dues::default();
    d.merge(&[(4_600, 7)]);
    assert_eq!(d.pending(4_600_000).total, 0);
}

#[test]
fn the_pair_bound_holds_what_compact_keeps() {
    // a year: what `a_year_of_pending_messages_fits_one_snapshot` fills
    assert!(max_pairs(365 * 86_400_000) >= 270_721);
    let now_ms = 1_000_000_000;
    for ahead_s in [1u64, 7_199, 7_201, 100_000, 15_552_001, 20_000_000] {
        let mut d = Dues::default();
        for s in 1..=ahead_s.min(200_000) {
            d.add((now_ms / 1000 + s) * 1000, 1);
        }
        d.add(now_ms + ahead_s * 1000, 1);
        assert!(
            d.compact(now_ms).len() <= max_pairs(ahead_s * 1000),
            "{ahead_s}"
        );
    }
}

proptest! {
    /// Whatever is appended, a read holds a bounded sum and tail, and a snapshot with its
    /// real offsets still sums right.
    #[test]
    fn a_read_stays_bounded_whatever_is_appended(
        records in proptest::collection::vec(
            (proptest::num::u64::ANY, proptest::collection::vec((proptest::num::u64::ANY, 1u64..5), 0..40)),
            1..80,
        ),
    ) {
        let b = Bounds { now_ms: 1_000_000, latest_s: 1_100, max_pairs: 30 };
        let mut r = Reckoning::new(b);
        for (i, (covers, dues)) in records.into_iter().enumerate() {
            let e = if covers % 3 == 0 {
                Entry::Snapshot { covers, at_ms: covers, dues }
            } else {
                Entry::Scheduled { dues }
            };
            let _ = r.read(i as u64, e);
            prop_assert!(r.all.len() <= 2 * b.max_pairs + b.max_pairs);
            prop_assert!(r.tail.len() <= TAIL_RECORDS);
            if let Some((covers, at, sum)) = &r.snapshot {
                prop_assert!(*covers < i as u64 && *at <= b.now_ms);
                prop_assert!(sum.len() <= 3 * b.max_pairs);
            }
        }
        let got = r.finish_whole();
        prop_assert!(got.dues.0.keys().all(|s| *s <= b.latest_s));
    }

    /// Starting from any snapshot gives what summing every record gives.
    #[test]
    fn a_snapshot_and_the_records_after_it_sum_to_every_record(
        dues in proptest::collection::vec((1u64..500, 1u64..5), 1..60),
        cut in 0usize..60,
        start in 0usize..60,
    ) {
        let now_ms = 100_000;
        let records: Vec<Entry> = dues
            .iter()
            .map(|&(s, n)| Entry::Scheduled { dues: vec![(s, n)] })
            .collect();
        let mut everything = Reckoning::default();
        for (i, e) in records.iter().enumerate() {
            everything.read(i as u64, e.clone()).unwrap();
        }
        let all = everything.finish_whole().dues;
        // a reader took a snapshot at its barrier after record `cut`
        let cut = cut.min(records.len() - 1);
        let mut upto = Dues::default();
        for (s, n) in dues.iter().take(cut + 1) {
            upto.merge(&[(*s, *n)]);
        }
        let snap = Entry::Snapshot { covers: cut as u64, at_ms: now_ms, dues: upto.compact(now_ms) };
        // a later reader reads from `start` (at most the record after the cover), with the
        // snapshot appended after every record
        let start = start.min(cut + 1);
        let mut r = Reckoning::default();
        for (i, e) in records.iter().enumerate().skip(start) {
            r.read(i as u64, e.clone()).unwrap();
        }
        r.read(records.len() as u64, snap).unwrap();
        let got = r.finish(false).unwrap();
        prop_assert_eq!(got.snapshot_at_ms, Some(now_ms));
        prop_assert_eq!(got.dues.pending(now_ms), all.pending(now_ms));
    }
}
