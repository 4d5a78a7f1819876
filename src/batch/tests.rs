use super::*;
use lapin::types::{DecimalValue, LongString, ShortString};
use proptest::prelude::*;

fn member(i: u8) -> Member {
    let mut h = FieldTable::default();
    h.insert("s".into(), AMQPValue::LongString(LongString::from("x")));
    h.insert("ssu".into(), AMQPValue::ShortShortUInt(i));
    h.insert("ts".into(), AMQPValue::Timestamp(42));
    h.insert(
        "dec".into(),
        AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 7 }),
    );
    h.insert("bytes".into(), AMQPValue::ByteArray(vec![0, 255].into()));
    Member {
        properties: BasicProperties::default()
            .with_message_id(ShortString::from(format!("m{i}")))
            .with_content_type("text/plain".into())
            .with_priority(i % 10)
            .with_headers(h),
        body: vec![i; i as usize],
    }
}

#[test]
fn round_trips_every_amqp_type() {
    let members: Vec<Member> = (0..5).map(member).collect();
    let body = encode(&members);
    assert_eq!(&body[..4], b"ADB\x01");
    assert_eq!(decode(&body).unwrap(), members);
    // a bare member keeps no properties at all
    let bare = vec![Member {
        properties: BasicProperties::default(),
        body: vec![],
    }];
    assert_eq!(decode(&encode(&bare)).unwrap(), bare);
    let enc: usize = members
        .iter()
        .map(|m| member_len(encode_properties(&m.properties).len(), m.body.len()))
        .sum();
    assert_eq!(body.len(), HEADER_LEN + enc);
}

#[test]
fn malformed_bodies_are_reasons() {
    let good = encode(&[member(3), member(4)]);
    for cut in 0..good.len() {
        assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
    }
    let mut v2 = good.clone();
    v2[3] = 2;
    assert!(decode(&v2).unwrap_err().contains("version 2"));
    let mut lie = good.clone();
    lie[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(decode(&lie).unwrap_err().contains("announces"));
    let mut trailing = good;
    trailing.push(0);
    assert!(
        decode(&trailing)
            .unwrap_err()
            .contains("after the last member")
    );
    assert!(decode(b"{\"json\":1}").unwrap_err().contains("bad magic"));
}

#[test]
fn a_bounded_decode_holds_the_body_to_its_header_and_the_maximum() {
    let members: Vec<Member> = (0..3).map(member).collect();
    let body = encode(&members);
    assert_eq!(decode_bounded(&body, 3, 3).unwrap(), members);
    assert!(
        decode_bounded(&body, 2, 10)
            .unwrap_err()
            .contains("announce 2")
    );
    assert!(
        decode_bounded(&body, 4, 10)
            .unwrap_err()
            .contains("announce 4")
    );
    assert!(decode_bounded(&body, u64::MAX, 10).is_err());
    assert!(
        decode_bounded(&body, 3, 2)
            .unwrap_err()
            .contains("more than the 2")
    );
    // the frames must end with the body, checked before the first member is decoded
    let mut trailing = body.clone();
    trailing.push(0);
    assert!(super::members(&trailing, Some(3), 3).is_err());
    // a plain message's announced count is 1
    assert_eq!(announced_count(&BasicProperties::default()), 1);
}

/// A batch read as a stream is refused whole when any member's properties do not parse,
/// before the first member is given out: nothing of it runs.
#[test]
fn a_batch_with_one_unreadable_member_is_refused_before_the_first_is_given_out() {
    let good = encode_properties(&BasicProperties::default());
    let bad = [0xFFu8, 0xFF, 0x01];
    let body = encode_parts(
        [
            (good.as_slice(), b"a".as_slice()),
            (good.as_slice(), b"b".as_slice()),
            (bad.as_slice(), b"c".as_slice()),
        ]
        .into_iter(),
    );
    let e = super::members(&body, Some(3), 3).err().expect("refused");
    assert!(e.contains("member 2"), "{e}");
    assert!(decode(&body).is_err());
}

/// A hostile batch: a 3 MB body announcing 300 000 ten-byte members (its header says
/// 300 000 as well) is refused by its count alone, before anything per member.
#[test]
fn a_batch_announcing_more_members_than_a_batch_may_hold_is_refused_up_front() {
    let props = encode_properties(&BasicProperties::default());
    let one = vec![7u8; 10];
    let n = 300_000;
    let body = encode_parts((0..n).map(|_| (props.as_slice(), one.as_slice())));
    assert!(body.len() > 3_000_000, "{}", body.len());
    let e = decode_bounded(&body, n as u64, 1_000).unwrap_err();
    assert!(e.contains("more than the 1000"), "{e}");
    // and one that lies about its count to its header
    let e = decode_bounded(&body, 10, 1_000).unwrap_err();
    assert!(e.contains("announce 10"), "{e}");
}

proptest! {
    /// Whatever the body and the announced count, a bounded decode gives exactly the
    /// announced members within the maximum, or a reason.
    #[test]
    fn a_bounded_decode_gives_the_announced_members_or_a_reason(
        n in 0u8..12,
        announced in 0u64..16,
        max in 0usize..16,
        flip in proptest::option::of((0usize..2_000, any::<u8>())),
    ) {
        let mut body = encode(&(0..n).map(member).collect::<Vec<_>>());
        if let Some((at, b)) = flip {
            let at = at % body.len();
            body[at] = b;
        }
        if let Ok(mut stream) = super::members(&body, None, 16) {
            // a walk that passed leaves no member to fail
            prop_assert!(stream.all(|m| m.is_ok()));
        }
        if let Ok(m) = decode_bounded(&body, announced, max) {
            prop_assert_eq!(m.len() as u64, announced);
            prop_assert!(m.len() <= max);
            prop_assert_eq!(decode(&body).unwrap(), m);
        }
        if flip.is_none() {
            let ok = u64::from(n) == announced && usize::from(n) <= max;
            prop_assert_eq!(decode_bounded(&body, announced, max).is_ok(), ok);
        }
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
        let mut b = b"ADB\x01".to_vec();
        b.extend_from_slice(&bytes);
        let _ = decode(&b);
        let _ = decode_bounded(&b, 3, 1_000);
    }

    #[test]
    fn groups_fire_in_every_members_window(
        dues in proptest::collection::vec((0u64..2_000, 0u64..30, 1usize..400), 1..200),
        max_members in 1usize..50,
        max_bytes in 50usize..4_000,
    ) {
        let cands: Vec<Candidate> = dues
            .iter()
            .map(|&(d, b, s)| Candidate { due_at_ms: d, deadline_ms: d + b, bytes: s })
            .collect();
        let limits = Limits { max_members, max_bytes };
        let groups = group(&cands, limits);
        let mut seen = vec![0; cands.len()];
        for g in &groups {
            prop_assert!(g.earliest_ms <= g.latest_ms);
            prop_assert!(!g.members.is_empty() && g.members.len() <= max_members);
            let bytes: usize = g.members.iter().map(|&i| cands[i].bytes).sum();
            prop_assert!(g.members.len() == 1 || HEADER_LEN + bytes <= max_bytes);
            for &i in &g.members {
                seen[i] += 1;
                // never early, never past the budget
                prop_assert!(g.earliest_ms >= cands[i].due_at_ms);
                prop_assert!(g.latest_ms <= cands[i].deadline_ms);
            }
        }
        prop_assert!(seen.iter().all(|&n| n == 1));
    }
}

proptest! {
    #[test]
    fn grain_groups_arrive_before_every_member_and_within_its_window(
        dues in proptest::collection::vec((0u64..20_000, 1usize..400), 1..200),
        width in 1u64..3_000,
        lead in 0u64..200,
        max_members in 1usize..50,
        max_bytes in 50usize..4_000,
    ) {
        let cands: Vec<Candidate> = dues
            .iter()
            .map(|&(d, s)| Candidate { due_at_ms: d, deadline_ms: d, bytes: s })
            .collect();
        let grain = Grain { width_ms: width, lead_ms: lead };
        let limits = Limits { max_members, max_bytes };
        let groups = group_grains(&cands, grain, limits);
        let mut seen = vec![0; cands.len()];
        for g in &groups {
            prop_assert!(g.earliest_ms <= g.latest_ms);
            prop_assert!(!g.members.is_empty() && g.members.len() <= max_members);
            let bytes: usize = g.members.iter().map(|&i| cands[i].bytes).sum();
            prop_assert!(g.members.len() == 1 || HEADER_LEN + bytes <= max_bytes);
            let window = cands[g.members[0]].due_at_ms / width;
            if let [only] = g.members[..] {
                // alone: at most SINGLE_EARLY_MS before its lead
                prop_assert!(g.earliest_ms + SINGLE_EARLY_MS + lead >= cands[only].due_at_ms);
            }
            for &i in &g.members {
                seen[i] += 1;
                let due = cands[i].due_at_ms;
                // one window per group
                prop_assert_eq!(due / width, window);
                // never later than a member's due time (less the lead) ...
                prop_assert!(g.latest_ms <= due.saturating_sub(lead));
                // ... and never earlier than the member's window (less the lead)
                prop_assert!(g.earliest_ms >= (window * width).saturating_sub(lead));
            }
        }
        prop_assert!(seen.iter().all(|&n| n == 1));
    }
}

#[test]
fn a_trickle_due_in_one_window_is_one_group() {
    // one message every 3 ms, all due within the same second
    let cands: Vec<Candidate> = (0..300)
        .map(|i| Candidate {
            due_at_ms: 10_000 + i * 3,
            deadline_ms: 10_000 + i * 3,
            bytes: 20,
        })
        .collect();
    let grain = Grain {
        width_ms: 1_000,
        lead_ms: 50,
    };
    let limits = Limits {
        max_members: 1_000,
        max_bytes: 1 << 20,
    };
    let g = group_grains(&cands, grain, limits);
    assert_eq!(g.len(), 1);
    assert_eq!((g[0].earliest_ms, g[0].latest_ms), (9_950, 9_950));
    // alone: held at most SINGLE_EARLY_MS + the lead
    let one = group_grains(&cands[100..101], grain, limits);
    assert_eq!((one[0].earliest_ms, one[0].latest_ms), (10_200, 10_250));
    // across a window boundary: two
    let shifted: Vec<Candidate> = cands
        .iter()
        .map(|c| Candidate {
            due_at_ms: c.due_at_ms + 500,
            ..*c
        })
        .collect();
    assert_eq!(group_grains(&shifted, grain, limits).len(), 2);
}

#[test]
fn equal_dues_share_one_batch_up_to_the_limits() {
    let c = Candidate {
        due_at_ms: 100,
        deadline_ms: 105,
        bytes: 10,
    };
    let limits = Limits {
        max_members: 3,
        max_bytes: 1000,
    };
    let g = group(&[c; 7], limits);
    assert_eq!(
        g.iter().map(|g| g.members.len()).collect::<Vec<_>>(),
        [3, 3, 1]
    );
    // one 6 ms apart with a 5 ms budget does not fit
    let far = Candidate {
        due_at_ms: 106,
        deadline_ms: 111,
        bytes: 10,
    };
    assert_eq!(group(&[c, far], limits).len(), 2);
}
