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
#[path = "batch/tests.rs"]
mod tests;
