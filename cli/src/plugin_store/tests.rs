use super::etf::{self, Reference, Term};
use super::*;
use proptest::prelude::*;

const NODE: &[u8] = b"rabbit@h";

fn props(headers: Option<FieldTable>, id: Option<&str>) -> Vec<u8> {
    let mut p = BasicProperties::default().with_content_type("text/plain".into());
    if let Some(h) = headers {
        p = p.with_headers(h);
    }
    if let Some(id) = id {
        p = p.with_message_id(id.into());
    }
    amqp_delay::ops::batch::encode_properties(&p)
}

fn cc(keys: &[&str]) -> FieldTable {
    let mut h = FieldTable::default();
    let a: Vec<AMQPValue> = keys
        .iter()
        .map(|k| AMQPValue::LongString((*k).into()))
        .collect();
    h.insert("CC".into(), AMQPValue::FieldArray(a.into()));
    h.insert("x-delay".into(), AMQPValue::LongInt(5000));
    h
}

/// One entry term as batch.erl writes it.
fn entry_term<'a>(
    due: i128,
    rks: &[&'a str],
    props: &'a [u8],
    body: &[&'a [u8]],
    bcc: Term<'a>,
) -> Term<'a> {
    Term::Tuple(vec![
        Term::Int(due),
        Term::Binary(b"/"),
        Term::Binary(b"app.x"),
        Term::Binary(b"topic"),
        Term::List(rks.iter().map(|k| Term::Binary(k.as_bytes())).collect()),
        Term::Binary(props),
        Term::List(body.iter().map(|b| Term::Binary(b)).collect()),
        bcc,
        Term::Ref(Reference {
            node: NODE,
            creation: 7,
            words: vec![1, 2, 3],
        }),
    ])
}

fn output(deleted: Vec<Term<'_>>, entries: Vec<Term<'_>>, next: Term<'_>) -> Vec<u8> {
    let t = Term::Tuple(vec![
        Term::Atom(b"import_batch"),
        Term::Int(1),
        Term::Atom(NODE),
        Term::List(deleted),
        Term::List(entries),
        next,
        Term::Int(12),
        Term::Int(345),
    ]);
    let mut bytes = vec![131];
    etf::encode(&t, &mut bytes);
    let mut out = b"some banner\n".to_vec();
    out.extend(ANSWER_PREFIX.as_bytes());
    out.extend(B64.encode(bytes).as_bytes());
    out.extend(b"\nok\n");
    out
}

#[test]
fn an_answer_gives_entries_with_their_cc_bcc_and_body() {
    let p = props(Some(cc(&["k2", "k3"])), Some("m-1"));
    let e = entry_term(
        1_796_534_026_261,
        &["k1", "k2", "k3", "k4"],
        &p,
        &[b"dy", b"bo"],
        Term::Atom(b"undefined"),
    );
    let out = output(
        vec![Term::Atom(b"deleted"), Term::Atom(b"not_found")],
        vec![e],
        Term::Tuple(vec![Term::Atom(b"more"), Term::Binary(b"g2gD+/=")]),
    );
    let a = parse_output(&out).unwrap();
    assert_eq!(a.node, "rabbit@h");
    assert_eq!(a.deleted, vec![true, false]);
    assert_eq!((a.size, a.node_us), (12, 345));
    assert_eq!(a.next, Next::More(Cursor("g2gD+/=".into())));
    let e = a.entries[0].as_ref().unwrap();
    assert_eq!(
        (
            e.vhost.as_str(),
            e.exchange.as_str(),
            e.delayed_type.as_str()
        ),
        ("/", "app.x", "topic")
    );
    assert_eq!(e.routing_key, "k1");
    assert_eq!(e.bcc, vec!["k4".to_string()]);
    assert_eq!(e.body, b"body");
    assert_eq!(e.id.due_ms, 1_796_534_026_261);
    let copy = e.copy_properties();
    assert_eq!(copy.message_id().as_ref().unwrap().as_str(), "m-1");
    let h = copy.headers().as_ref().unwrap();
    assert!(h.inner().contains_key("CC"));
    assert_eq!(
        h.inner().get("BCC"),
        Some(&AMQPValue::FieldArray(
            vec![AMQPValue::LongString("k4".into())].into()
        ))
    );
    // 4.0's bcc annotation is used when present; eof ends the walk
    let p = props(None, None);
    let e = entry_term(
        5,
        &["k1", "k9"],
        &p,
        &[b"x"],
        Term::List(vec![Term::Binary(b"k9")]),
    );
    let a = parse_output(&output(vec![], vec![e], Term::Atom(b"eof"))).unwrap();
    assert_eq!(a.next, Next::End);
    let e = a.entries[0].as_ref().unwrap();
    assert_eq!(e.bcc, vec!["k9".to_string()]);
    // no message id: a deterministic one, the same at every read
    let copy = e.copy_properties();
    assert_eq!(
        copy.message_id().as_ref().unwrap().as_str(),
        "plugin-5-7-1.2.3"
    );
    assert!(copy.headers().as_ref().unwrap().inner().contains_key("BCC"));
}

#[test]
fn a_bad_entry_is_a_reason_and_the_others_still_read() {
    let p = props(None, None);
    let good = entry_term(5, &["k"], &p, &[b"x"], Term::Atom(b"undefined"));
    let no_keys = entry_term(6, &[], &p, &[b"x"], Term::Atom(b"undefined"));
    let bad_props = entry_term(7, &["k"], b"\xff\xff", &[b"x"], Term::Atom(b"undefined"));
    let mut foreign = entry_term(8, &["k"], &p, &[b"x"], Term::Atom(b"undefined"));
    if let Term::Tuple(f) = &mut foreign {
        f[8] = Term::Ref(Reference {
            node: b"other@h",
            creation: 1,
            words: vec![1],
        });
    }
    let a = parse_output(&output(
        vec![],
        vec![good, no_keys, bad_props, foreign, Term::Int(3)],
        Term::Atom(b"eof"),
    ))
    .unwrap();
    assert!(a.entries[0].is_ok());
    let reasons: Vec<String> = a.entries[1..]
        .iter()
        .map(|e| e.as_ref().unwrap_err().reason.clone())
        .collect();
    assert!(reasons[0].contains("no routing key"), "{reasons:?}");
    assert!(reasons[1].contains("properties"), "{reasons:?}");
    assert!(reasons[2].contains("other@h"), "{reasons:?}");
    assert!(reasons[3].contains("shape"), "{reasons:?}");
    assert_eq!(a.entries[2].as_ref().unwrap_err().due_ms, Some(7));
    assert_eq!(
        a.entries[2].as_ref().unwrap_err().exchange.as_deref(),
        Some("app.x")
    );
}

#[test]
fn output_without_an_answer_or_with_a_broken_one_is_an_error() {
    for out in [
        &b"Error: unable to perform an operation on node\n"[..],
        b"AMQPDELAY-IMPORT-1 ***\n",
        b"AMQPDELAY-IMPORT-1 g2o=\n",
    ] {
        assert!(
            parse_output(out).is_err(),
            "{}",
            String::from_utf8_lossy(out)
        );
    }
    // a cursor that is not base64 text never goes back into an expression
    let bad = output(
        vec![],
        vec![],
        Term::Tuple(vec![Term::Atom(b"more"), Term::Binary(b"a\">>, halt().")]),
    );
    assert!(parse_output(&bad).unwrap_err().contains("cursor"));
}

#[test]
fn the_expression_takes_only_its_parameters() {
    let ids = vec![
        EntryId {
            due_ms: 1_796_534_026_261,
            creation: 7,
            words: vec![1, 2, 3],
        },
        EntryId {
            due_ms: 5,
            creation: 8,
            words: vec![4, 5, 6],
        },
        EntryId {
            due_ms: 6,
            creation: 7,
            words: vec![9, 9, 9],
        },
    ];
    let e = expression(&ids, &Cursor("g2gD".into()), 4000, 16 << 20);
    assert!(!e.contains('@') || !e.contains("@DELS@"));
    for p in ["@DELS@", "@CURSOR@", "@MAX@", "@MAXBYTES@"] {
        assert!(!e.contains(p), "{p}");
    }
    assert!(e.contains("Cursor = <<\"g2gD\">>, Max = 4000, MaxBytes = 16777216"));
    // two segments: creation 7 with two items, creation 8 with one
    let dels = e
        .split("Dels = <<\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    let raw = B64.decode(dels).unwrap();
    assert_eq!(&raw[..9], &[0, 0, 0, 7, 3, 0, 0, 0, 2]);
    assert_eq!(&raw[9..15], &1_796_534_026_261u64.to_be_bytes()[2..]);
    assert_eq!(raw.len(), 2 * 9 + 3 * 18);
    assert_eq!(
        expression(&[], &Cursor::start(), 1, 0)
            .matches("<<\"\">>")
            .count(),
        2
    );
}

#[test]
fn thousands_of_deletes_fit_one_call() {
    let ids: Vec<EntryId> = (0..10_000)
        .map(|i| EntryId {
            due_ms: 1_796_534_026_261 + i,
            creation: 7,
            words: vec![1, 2, i as u32],
        })
        .collect();
    let n = deletes_that_fit(&ids);
    assert!(n >= 4_000, "{n}");
    let e = expression(&ids[..n], &Cursor("x".repeat(8192)), 4000, 1);
    assert!(e.len() <= MAX_EXPRESSION_BYTES, "{}", e.len());
    assert!(n * DELETE_CHARS <= MAX_EXPRESSION_BYTES);
}

/// What a POSIX shell changes inside double quotes (`$`, backquote, backslash), what a `<<-`
/// here-document strips (leading tabs) and a command substitution drops (trailing newlines):
/// none of it in any expression, so Debian's `rabbitmqctl` wrapper passes it intact.
#[test]
fn the_expression_has_nothing_a_shell_would_change() {
    let ids: Vec<EntryId> = (0..500)
        .map(|i| EntryId {
            due_ms: 1_796_534_026_261 + i,
            creation: 7,
            words: vec![i as u32, u32::MAX, 3],
        })
        .collect();
    let cursor = Cursor::from_node(b"g2gDaAJkAAlkZWxheV9rZXk+/==").unwrap();
    for e in [
        expression(&[], &Cursor::start(), 1, 0),
        expression(&ids, &cursor, 4000, 16 << 20),
    ] {
        for (n, line) in e.lines().enumerate() {
            let bad = line
                .chars()
                .find(|c| matches!(c, '$' | '`' | '\\') || !(c.is_ascii_graphic() || *c == ' '));
            assert_eq!(bad, None, "line {}: {line}", n + 1);
        }
        assert!(!e.ends_with('\n'));
    }
}

#[test]
fn periods_from_now() {
    let now = 1_000_000_000;
    let h = 3_600_000;
    assert_eq!(Period::of(now - 5, now), Period::Hour);
    assert_eq!(Period::of(now + h - 1, now), Period::Hour);
    assert_eq!(Period::of(now + h, now), Period::Day);
    assert_eq!(Period::of(now + 24 * h, now), Period::Week);
    assert_eq!(Period::of(now + 7 * 24 * h, now), Period::Later);
}

fn keys() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        prop::sample::select(vec!["a", "b", "c", "d"]).prop_map(String::from),
        0..4,
    )
}

proptest! {
    /// Whatever CC and BCC a publish had, the stored keys give BCC back exactly.
    #[test]
    fn bcc_is_what_cc_does_not_name(cc_keys in keys(), bcc in keys()) {
        let refs: Vec<&str> = cc_keys.iter().map(String::as_str).collect();
        let h = (!cc_keys.is_empty()).then(|| cc(&refs));
        let stored: Vec<String> = cc_keys.iter().chain(&bcc).cloned().collect();
        prop_assert_eq!(bcc_keys(&stored, h.as_ref()), bcc);
    }

    #[test]
    fn any_output_parses_or_fails_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let mut out = ANSWER_PREFIX.as_bytes().to_vec();
        out.extend(B64.encode(&bytes).as_bytes());
        let _ = parse_output(&out);
        let mut framed = vec![131];
        framed.extend(&bytes);
        let mut out = ANSWER_PREFIX.as_bytes().to_vec();
        out.extend(B64.encode(&framed).as_bytes());
        let _ = parse_output(&out);
        let _ = parse_output(&bytes);
    }

    /// Entries of any shape in a well-formed answer: each reads or is a reason.
    #[test]
    fn any_entry_reads_or_is_a_reason(
        due in any::<i64>(),
        rks in prop::collection::vec(prop::sample::select(vec![&b"k1"[..], b"\xff", b""]), 0..3),
        props in prop::collection::vec(any::<u8>(), 0..40),
        bcc_is_list in any::<bool>(),
    ) {
        let bcc = if bcc_is_list { Term::List(vec![Term::Binary(b"z")]) } else { Term::Atom(b"undefined") };
        let e = Term::Tuple(vec![
            Term::Int(i128::from(due)),
            Term::Binary(b"/"),
            Term::Binary(b"x"),
            Term::Binary(b""),
            Term::List(rks.iter().map(|k| Term::Binary(k)).collect()),
            Term::Binary(&props),
            Term::Binary(b"b"),
            bcc,
            Term::Ref(Reference { node: NODE, creation: 1, words: vec![1, 2, 3] }),
        ]);
        let a = parse_output(&output(vec![], vec![e], Term::Atom(b"eof"))).unwrap();
        prop_assert_eq!(a.entries.len(), 1);
    }
}
