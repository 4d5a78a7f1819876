//! Batches, pure: many delayed messages that share a destination and fall due within their
//! lateness budgets travel through the tiers as ONE broker message, so the broker's cost per hop
//! (about three raw passes, docs/DESIGN.md) is paid once per batch instead of once per message.
//!
//! # The envelope, version 1
//!
//! A batch is an ordinary persistent AMQP message with content type [`CONTENT_TYPE`] and two
//! headers, [`headers::BATCH`] (the format version, 1) and [`headers::BATCH_COUNT`] (how many
//! members it holds). Its body is:
//!
//! ```text
//! "ADB" 0x01                      magic and version
//! u32 count                       big-endian, as everything below
//! count × {
//!     u32 properties length, properties   the member's AMQP basic properties, encoded exactly as
//!                                         in an AMQP content header (property flags, then the
//!                                         present fields; headers as an AMQP field table)
//!     u32 body length, body               the member's body, byte for byte
//! }
//! ```
//!
//! Each member keeps its own properties — message id, content type, correlation id, headers
//! with every AMQP value type (including our `x-delay-due-at`, `x-delay-ms`,
//! `x-delay-attempt`) — so unpacking gives back exactly what would have travelled alone. We use
//! AMQP's own encoding (through lapin's protocol module) rather than MessagePack or CBOR because
//! it is lossless for every AMQP field type (short-short ints, decimals, timestamps, byte
//! arrays would need a tagged mapping in any other format), needs no new dependency, and is
//! the format every AMQP client already decodes.
//!
//! # Grouping
//!
//! [`group`] splits messages for one destination into batches: a batch fires at one time `T`
//! that is no earlier than its latest member's due time and no later than its earliest
//! deadline (due time + lateness budget), holds at most `max_members` members and
//! `max_bytes` bytes. Members are taken in due-time order, each joining the open batch while
//! that keeps a common firing window (interval stabbing: optimal for equal budgets).

use lapin::BasicProperties;
use lapin::protocol::basic::{gen_properties, parse_properties};
use lapin::types::{AMQPValue, FieldTable};

use crate::headers;

/// Content type of a batch message.
pub const CONTENT_TYPE: &str = "application/vnd.amqp-delay.batch";
/// The envelope version this code writes and reads.
pub(crate) const VERSION: u8 = 1;
const MAGIC: &[u8; 3] = b"ADB";
/// Bytes of a batch body before its members.
pub(crate) const HEADER_LEN: usize = 3 + 1 + 4;

/// One message inside a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// Its own properties (id, headers with our due time, content type, ...).
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
}

/// The encoded properties of `p` (AMQP content-header encoding).
pub fn encode_properties(p: &BasicProperties) -> Vec<u8> {
    cookie_factory::gen_simple(gen_properties(p), Vec::new()).expect("writing to a Vec cannot fail")
}

/// Bytes `member` adds to a batch body (for the size bound).
pub(crate) fn member_len(encoded_properties: usize, body: usize) -> usize {
    4 + encoded_properties + 4 + body
}

/// Encodes members whose properties are already encoded.
pub fn encode_parts<'a>(members: impl ExactSizeIterator<Item = (&'a [u8], &'a [u8])>) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&(members.len() as u32).to_be_bytes());
    for (props, body) in members {
        out.extend_from_slice(&(props.len() as u32).to_be_bytes());
        out.extend_from_slice(props);
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body);
    }
    out
}

/// Encodes `members` into a batch body.
#[cfg(test)]
pub(crate) fn encode(members: &[Member]) -> Vec<u8> {
    let props: Vec<Vec<u8>> = members
        .iter()
        .map(|m| encode_properties(&m.properties))
        .collect();
    encode_parts(
        props
            .iter()
            .zip(members)
            .map(|(p, m)| (p.as_slice(), m.body.as_slice())),
    )
}

/// The headers that mark a batch of `count` members (the batch also carries the schedule
/// headers of its route, set by the publisher).
pub fn batch_headers(count: usize) -> FieldTable {
    let mut h = FieldTable::default();
    h.insert(headers::BATCH.into(), AMQPValue::ShortShortUInt(VERSION));
    h.insert(
        headers::BATCH_COUNT.into(),
        AMQPValue::LongLongInt(count as i64),
    );
    h
}

/// Whether a delivery with these properties is a batch (any version).
pub fn is_batch(p: &BasicProperties) -> bool {
    p.headers()
        .as_ref()
        .is_some_and(|h| h.contains_key(headers::BATCH))
}

/// The member count a batch's headers announce (1 for a plain message).
pub fn announced_count(p: &BasicProperties) -> u64 {
    p.headers()
        .as_ref()
        .and_then(|h| headers::get_int(h, headers::BATCH_COUNT))
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(1)
}

fn take<'a>(input: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if input.len() < n {
        return Err(format!(
            "batch body ends inside {what} (needs {n} bytes, {} left)",
            input.len()
        ));
    }
    let (head, rest) = input.split_at(n);
    *input = rest;
    Ok(head)
}

fn take_u32(input: &mut &[u8], what: &str) -> Result<usize, String> {
    let b = take(input, 4, what)?;
    Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

/// Decodes a batch body. Any malformation is a reason, never a panic. A delivery from the
/// broker is read with [`decode_bounded`], which also holds the body to its header and a
/// maximum.
#[cfg(test)]
pub(crate) fn decode(body: &[u8]) -> Result<Vec<Member>, String> {
    members(body, None, usize::MAX)?.collect()
}

/// Decodes a batch body that must hold exactly `announced` members (what its headers say,
/// [`announced_count`]) and at most `max_members` (the publisher's
/// `publisher.batch_max_messages`: no batch of ours holds more). Refused, with a reason,
/// before anything is allocated per member: a count that differs from the header, a count
/// beyond the maximum, a body whose member frames do not add up to it exactly. Never panics.
pub fn decode_bounded(
    body: &[u8],
    announced: u64,
    max_members: usize,
) -> Result<Vec<Member>, String> {
    members(body, Some(announced), max_members)?.collect()
}

/// The members of a batch body, decoded one at a time as the iterator is advanced (so a caller
/// may run them as a bounded stream), after the same checks as [`decode_bounded`] (without
/// `announced`, only the maximum): the whole body is walked once before the first member is
/// decoded — its framing, and every member's properties parsed and dropped — so a batch with
/// one bad member is refused whole, before anything of it runs, and holds no more than one
/// decoded member per step of the iterator. (An `Err` item cannot follow a successful walk; it
/// is kept for the type.)
pub(crate) fn members(
    body: &[u8],
    announced: Option<u64>,
    max_members: usize,
) -> Result<impl Iterator<Item = Result<Member, String>> + '_, String> {
    let (count, frames) = frame(body)?;
    if let Some(announced) = announced
        && u64::try_from(count).ok() != Some(announced)
    {
        return Err(format!(
            "batch holds {count} members but its headers announce {announced}"
        ));
    }
    if count > max_members {
        return Err(format!(
            "batch announces {count} members, more than the {max_members} a batch may hold"
        ));
    }
    check_frames(frames, count)?;
    let mut input = frames;
    Ok((0..count).map(move |i| member_at(&mut input, i)))
}

/// The member count and the members' bytes of a batch body.
fn frame(body: &[u8]) -> Result<(usize, &[u8]), String> {
    let mut input = body;
    let magic = take(&mut input, 3, "the magic")?;
    if magic != MAGIC {
        return Err("not an amqp-delay batch (bad magic)".into());
    }
    let version = take(&mut input, 1, "the version")?[0];
    if version != VERSION {
        return Err(format!(
            "batch envelope version {version} is not supported (this build reads version {VERSION})"
        ));
    }
    let count = take_u32(&mut input, "the member count")?;
    // each member takes at least 8 bytes: a count beyond that is a lie, not an allocation
    if count > input.len() / 8 {
        return Err(format!(
            "batch announces {count} members but holds {} bytes",
            input.len()
        ));
    }
    Ok((count, input))
}

/// Walks `count` member frames (two lengths and what they say each): they must end exactly
/// where the body does. The framing is walked first, without allocating anything, so a count
/// or a length that lies costs no parsing; then each member's properties are parsed (and
/// dropped: one member's at a time).
fn check_frames(frames: &[u8], count: usize) -> Result<(), String> {
    let mut input = frames;
    for _ in 0..count {
        let plen = take_u32(&mut input, "a properties length")?;
        take(&mut input, plen, "member properties")?;
        let blen = take_u32(&mut input, "a body length")?;
        take(&mut input, blen, "a member body")?;
    }
    if !input.is_empty() {
        return Err(format!("{} bytes after the last member", input.len()));
    }
    let mut input = frames;
    for i in 0..count {
        let plen = take_u32(&mut input, "a properties length")?;
        properties_of(take(&mut input, plen, "member properties")?, i)?;
        let blen = take_u32(&mut input, "a body length")?;
        take(&mut input, blen, "a member body")?;
    }
    Ok(())
}

/// Member `i`'s properties, from their encoded bytes.
fn properties_of(raw: &[u8], i: usize) -> Result<BasicProperties, String> {
    match parse_properties(raw) {
        Ok((&[], p)) => Ok(p),
        Ok(_) => Err(format!("member {i}: properties have trailing bytes")),
        Err(e) => Err(format!("member {i}: properties do not parse: {e}")),
    }
}

/// Member `i`, decoded from the front of `input` (whose framing was checked).
fn member_at(input: &mut &[u8], i: usize) -> Result<Member, String> {
    let plen = take_u32(input, "a properties length")?;
    let properties = properties_of(take(input, plen, "member properties")?, i)?;
    let blen = take_u32(input, "a body length")?;
    let body = take(input, blen, "a member body")?.to_vec();
    Ok(Member { properties, body })
}

/// What [`group`] needs of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// When it falls due (ms since the epoch).
    pub due_at_ms: u64,
    /// The latest acceptable delivery: due time + lateness budget.
    pub deadline_ms: u64,
    /// Bytes it adds to a batch body ([`member_len`]).
    pub bytes: usize,
}

/// Limits of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// At most this many members.
    pub max_members: usize,
    /// At most this many body bytes (header included).
    pub max_bytes: usize,
}

/// A group of candidates that can fire together, with its firing window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    /// Indices into the candidates.
    pub members: Vec<usize>,
    /// Fire no earlier than this (the latest due time).
    pub earliest_ms: u64,
    /// Fire no later than this (the earliest deadline; ≥ `earliest_ms`).
    pub latest_ms: u64,
}

/// Splits candidates for ONE destination into groups that can each travel as one message.
/// Every candidate is in exactly one group; a candidate too big for a batch is alone.
pub(crate) fn group(cands: &[Candidate], limits: Limits) -> Vec<Group> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| (cands[i].due_at_ms, cands[i].deadline_ms));
    let mut out: Vec<Group> = Vec::new();
    let mut cur: Option<(Group, usize)> = None;
    for i in order {
        let c = cands[i];
        let deadline = c.deadline_ms.max(c.due_at_ms);
        if let Some((g, bytes)) = cur.as_mut() {
            let earliest = g.earliest_ms.max(c.due_at_ms);
            let latest = g.latest_ms.min(deadline);
            if earliest <= latest
                && g.members.len() < limits.max_members
                && *bytes + c.bytes <= limits.max_bytes
            {
                g.members.push(i);
                g.earliest_ms = earliest;
                g.latest_ms = latest;
                *bytes += c.bytes;
                continue;
            }
            out.push(cur.take().expect("checked").0);
        }
        cur = Some((
            Group {
                members: vec![i],
                earliest_ms: c.due_at_ms,
                latest_ms: deadline,
            },
            HEADER_LEN + c.bytes,
        ));
    }
    if let Some((g, _)) = cur {
        out.push(g);
    }
    out
}

/// How much earlier than its lead a grain group of one message may arrive: enough for a
/// coarser route than the exact one (the 16 ms level and below go unused at radix 16), little
/// enough that singles hold few prefetch slots.
pub(crate) const SINGLE_EARLY_MS: u64 = 50;

/// The last level of the timing wheel, which our consumers keep (see [`group_grains`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grain {
    /// Width of a grain window in ms (windows are aligned to the epoch): messages due in the
    /// same window travel together.
    pub width_ms: u64,
    /// How long before its first member is due a batch is planned to reach the consumer: room
    /// for the route's own latency (dead-letter hops, the delivery).
    pub lead_ms: u64,
}

/// Splits candidates for ONE destination whose consumers hold early messages until they are
/// due (the worker, the relay, the gateway's due stage) into groups by grain window: members
/// whose due times fall in the same window `[k·G, (k+1)·G)` share a group (within the limits),
/// however far apart they arrived. A group should reach its consumer no earlier than its
/// window's start − lead and no later than its earliest member's due time − lead, so it is
/// never later than any member (the consumer then runs each member at its exact due time) and
/// held at most one window plus the lead. Every candidate is in exactly one group.
pub(crate) fn group_grains(cands: &[Candidate], grain: Grain, limits: Limits) -> Vec<Group> {
    let width = grain.width_ms.max(1);
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| cands[i].due_at_ms);
    let mut out: Vec<Group> = Vec::new();
    // the open group, its window index and its bytes
    let mut cur: Option<(Group, u64, usize)> = None;
    for i in order {
        let c = cands[i];
        let window = c.due_at_ms / width;
        if let Some((g, w, bytes)) = cur.as_mut() {
            if *w == window
                && g.members.len() < limits.max_members
                && *bytes + c.bytes <= limits.max_bytes
            {
                g.members.push(i);
                *bytes += c.bytes;
                continue;
            }
            out.push(cur.take().expect("checked").0);
        }
        // members come in due order: the first one is the earliest
        let latest = c.due_at_ms.saturating_sub(grain.lead_ms);
        let earliest = (window * width).saturating_sub(grain.lead_ms).min(latest);
        let g = Group {
            members: vec![i],
            earliest_ms: earliest,
            latest_ms: latest,
        };
        cur = Some((g, window, HEADER_LEN + c.bytes));
    }
    if let Some((g, _, _)) = cur {
        out.push(g);
    }
    for g in &mut out {
        // A message alone saves no broker work by arriving early, and each one waits in a
        // prefetch slot of its consumer: it comes at most `SINGLE_EARLY_MS` before its lead.
        if g.members.len() == 1 {
            g.earliest_ms = g
                .earliest_ms
                .max(g.latest_ms.saturating_sub(SINGLE_EARLY_MS));
        }
    }
    out
}

#[cfg(test)]
mod tests {
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
}
