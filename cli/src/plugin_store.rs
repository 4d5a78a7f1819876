//! The delayed-message plugin's store as `delay-publisher import-plugin` reads it (pure): the
//! Erlang expression one `rabbitmqctl eval` runs in the plugin's node (`plugin_store/batch.erl`:
//! delete the entries whose copies were confirmed, then read the next batch in due order from a
//! cursor), and its answer decoded into [`Entry`]s with everything a copy needs. No I/O: the
//! answer is outside input, so every field is checked and a malformed entry is a reason, never
//! a panic.
//!
//! What a stored message is (docs/reports/2026-12-06-plugin-behaviour.md): keyed by its due time
//! and exchange; routing keys `[RK | CC ++ BCC]`; properties as published but `BCC` (the channel
//! took it out); the body. So a copy's routing key is the first key, its `CC` header is kept, and
//! its `BCC` is the keys `CC` does not name (4.0 also keeps the `bcc` annotation, used when
//! present).

pub mod etf;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use lapin::BasicProperties;
use lapin::protocol::basic::parse_properties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};

use etf::Term;

/// The expression of one call (parameters `@DELS@`, `@CURSOR@`, `@MAX@`, `@MAXBYTES@`).
const BATCH_ERL: &str = include_str!("plugin_store/batch.erl");
/// What starts the answer's line in `rabbitmqctl eval`'s output.
pub const ANSWER_PREFIX: &str = "AMQPDELAY-IMPORT-1 ";
/// The longest expression a call passes: Linux takes at most 128 KiB in one argument
/// (`MAX_ARG_STRLEN`), and `rabbitmqctl eval` takes the expression as one (4.0's does not read
/// it from standard input); Debian's wrapper puts all its arguments into one `sh -c` line, which
/// the rest of the 128 KiB leaves room for.
pub const MAX_EXPRESSION_BYTES: usize = 120_000;
/// Characters one delete adds to the expression (a reference of 3 words).
pub const DELETE_CHARS: usize = 24;

/// Where a walk of the plugin's index goes on from: the start, or after a key the node named.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cursor(String);

impl Cursor {
    /// The start of the index.
    pub fn start() -> Cursor {
        Cursor::default()
    }

    /// A cursor the node gave (base64 text only: it goes back into an expression; empty: the
    /// start).
    pub(crate) fn from_node(b: &[u8]) -> Result<Cursor, String> {
        let ok = b.len() <= 8192
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'='));
        match ok {
            true => Ok(Cursor(String::from_utf8_lossy(b).into_owned())),
            false => Err("the cursor is not base64 text of at most 8 KiB".into()),
        }
    }
}

/// One plugin entry, as the node can find it again to delete it: its due time and its
/// reference (made by the node itself).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntryId {
    /// Due time, ms since the epoch (the key's).
    pub due_ms: u64,
    /// The reference's creation (the node's incarnation).
    pub creation: u32,
    /// The reference's words.
    pub words: Vec<u32>,
}

impl EntryId {
    /// The id a copy carries when the message had no `message_id`: the same for every read of
    /// the same entry, so a consumer can drop a second copy (after a crash and a re-run).
    pub fn message_id(&self) -> String {
        let words: Vec<String> = self.words.iter().map(|w| format!("{w:x}")).collect();
        format!(
            "plugin-{}-{:x}-{}",
            self.due_ms,
            self.creation,
            words.join(".")
        )
    }
}

/// The deletes of a call, encoded as `batch.erl` reads them (segments of one creation and
/// word count).
fn encode_deletes(ids: &[EntryId]) -> String {
    let mut segments: Vec<((u32, usize), Vec<&EntryId>)> = Vec::new();
    for id in ids {
        let k = (id.creation, id.words.len());
        match segments.iter_mut().find(|(s, _)| *s == k) {
            Some((_, v)) => v.push(id),
            None => segments.push((k, vec![id])),
        }
    }
    let mut out = Vec::with_capacity(ids.len() * 18 + 9);
    for ((creation, words), items) in segments {
        out.extend(creation.to_be_bytes());
        out.push(words as u8);
        out.extend((items.len() as u32).to_be_bytes());
        for id in items {
            out.extend(&id.due_ms.to_be_bytes()[2..]);
            id.words.iter().for_each(|w| out.extend(w.to_be_bytes()));
        }
    }
    B64.encode(out)
}

/// How many of `deletes` fit one call's expression (with a cursor of up to 8 KiB).
pub fn deletes_that_fit(deletes: &[EntryId]) -> usize {
    let room = MAX_EXPRESSION_BYTES.saturating_sub(BATCH_ERL.len() + 8192 + 64) / 4 * 3;
    let mut segments: Vec<(u32, usize)> = Vec::new();
    let mut raw = 0;
    for (i, d) in deletes.iter().enumerate() {
        let k = (d.creation, d.words.len());
        if !segments.contains(&k) {
            segments.push(k);
            raw += 9;
        }
        raw += 6 + 4 * d.words.len();
        if raw > room {
            return i;
        }
    }
    deletes.len()
}

/// The expression of one call: delete `deletes` (all of them must fit, see
/// [`deletes_that_fit`]), then read up to `max_entries` entries (whole keys: a few more when
/// the last key holds several) or `max_bytes` of bodies from `cursor`. Its text means the same
/// after a POSIX shell's double quotes (no `$`, backquote, backslash or tab; no trailing
/// newline for a command substitution to strip), as Debian's `rabbitmqctl` wrapper passes it.
pub fn expression(
    deletes: &[EntryId],
    cursor: &Cursor,
    max_entries: usize,
    max_bytes: usize,
) -> String {
    BATCH_ERL
        .trim_end()
        .replace("@DELS@", &encode_deletes(deletes))
        .replace("@CURSOR@", &cursor.0)
        .replace("@MAX@", &max_entries.to_string())
        .replace("@MAXBYTES@", &max_bytes.max(1).to_string())
}

/// One pending message of the plugin, with what its copy needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// How to find it again.
    pub id: EntryId,
    /// Its virtual host and exchange (the delayed exchange it was published to).
    pub vhost: String,
    /// The exchange's name.
    pub exchange: String,
    /// The exchange's `x-delayed-type`.
    pub delayed_type: String,
    /// The publish's routing key.
    pub routing_key: String,
    /// The `BCC` keys it had (the routing keys its `CC` header does not name).
    pub bcc: Vec<String>,
    /// Its properties as published (without `BCC`).
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
}

impl Entry {
    /// The properties of its copy: as published, with `BCC` back (a gateway stashes `CC` and
    /// `BCC` and gives them back at the target, where the broker routes them once, as the
    /// plugin does) and a `message_id` ([`EntryId::message_id`] when it had none).
    pub fn copy_properties(&self) -> BasicProperties {
        let mut p = self.properties.clone();
        if p.message_id().is_none() {
            p = p.with_message_id(self.id.message_id().into());
        }
        if !self.bcc.is_empty() {
            let mut h = p.headers().clone().unwrap_or_default();
            let keys: Vec<AMQPValue> = self
                .bcc
                .iter()
                .map(|k| AMQPValue::LongString(LongString::from(k.as_str())))
                .collect();
            h.insert("BCC".into(), AMQPValue::FieldArray(FieldArray::from(keys)));
            p = p.with_headers(h);
        }
        p
    }
}

/// An entry that could not be read, with what is known of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    /// Its due time, when that much was readable.
    pub due_ms: Option<u64>,
    /// Its exchange, when readable.
    pub exchange: Option<String>,
    /// Why.
    pub reason: String,
}

/// Where the walk stands after a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// More keys after this cursor.
    More(Cursor),
    /// The end of the index.
    End,
}

/// The node's answer to one call.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The node's name.
    pub node: String,
    /// For each delete asked, in order: whether it was there (else the plugin had delivered it,
    /// or someone deleted it).
    pub deleted: Vec<bool>,
    /// The entries read, in due order.
    pub entries: Vec<Result<Entry, Unreadable>>,
    /// Where to go on from.
    pub next: Next,
    /// Entries the plugin holds after the deletes.
    pub size: u64,
    /// Time the call took inside the node.
    pub node_us: u64,
}

/// The answer in `rabbitmqctl eval`'s output (the one line that starts with
/// [`ANSWER_PREFIX`]; rabbitmqctl prints the expression's value, `ok`, after it).
pub fn parse_output(stdout: &[u8]) -> Result<Answer, String> {
    let line = stdout
        .split(|&b| b == b'\n')
        .find_map(|l| l.strip_prefix(ANSWER_PREFIX.as_bytes()))
        .ok_or("no answer line in the output (is this the plugin's node?)")?;
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let bytes = B64
        .decode(line)
        .map_err(|e| format!("the answer is not base64: {e}"))?;
    let term = etf::decode(&bytes).map_err(|e| format!("the answer does not decode: {e}"))?;
    answer(&term)
}

fn text(t: &Term<'_>, what: &str) -> Result<String, String> {
    let b = t
        .binary()
        .ok_or_else(|| format!("{what} is not a binary"))?;
    String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
}

fn answer(t: &Term<'_>) -> Result<Answer, String> {
    let f = t
        .tuple(8)
        .filter(|f| f[0].is_atom("import_batch") && f[1].int() == Some(1))
        .ok_or("the answer is not an import_batch of version 1")?;
    let node = match &f[2] {
        Term::Atom(a) => String::from_utf8_lossy(a).into_owned(),
        _ => return Err("the answer's node is not an atom".into()),
    };
    let deleted = f[3]
        .list()
        .ok_or("the deletes' results are not a list")?
        .iter()
        .map(|r| match r {
            r if r.is_atom("deleted") => Ok(true),
            r if r.is_atom("not_found") => Ok(false),
            _ => Err("a delete's result is neither deleted nor not_found".to_string()),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let entries = f[4]
        .list()
        .ok_or("the entries are not a list")?
        .iter()
        .map(|e| entry(e, &node))
        .collect();
    let next = match &f[5] {
        n if n.is_atom("eof") => Next::End,
        n => match n.tuple(2) {
            Some([m, c]) if m.is_atom("more") => Next::More(Cursor::from_node(
                c.binary().ok_or("the cursor is not a binary")?,
            )?),
            _ => return Err("the answer's next is neither eof nor {more, Cursor}".into()),
        },
    };
    let count = |t: &Term<'_>, what: &str| {
        t.int()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| format!("{what} is not a count"))
    };
    Ok(Answer {
        node,
        deleted,
        entries,
        next,
        size: count(&f[6], "the table's size")?,
        node_us: count(&f[7], "the time in the node")?,
    })
}

/// One entry `{Due, VHost, XName, XType, RoutingKeys, PropsBin, BodyRev, Bcc, Ref}`.
fn entry(t: &Term<'_>, node: &str) -> Result<Entry, Unreadable> {
    let f = t.tuple(9).ok_or_else(|| Unreadable {
        due_ms: None,
        exchange: None,
        reason: "an entry of another shape".into(),
    })?;
    let due_ms = f[0].int().and_then(|n| u64::try_from(n).ok());
    let exchange = text(&f[2], "the exchange name").ok();
    let unreadable = |reason: String| Unreadable {
        due_ms,
        exchange: exchange.clone(),
        reason,
    };
    let due = due_ms.ok_or_else(|| unreadable("its due time is not a time".into()))?;
    let id = entry_id(due, &f[8], node).map_err(&unreadable)?;
    let read = || -> Result<Entry, String> {
        let keys = f[4]
            .list()
            .ok_or("its routing keys are not a list")?
            .iter()
            .map(|k| text(k, "a routing key"))
            .collect::<Result<Vec<_>, _>>()?;
        let (routing_key, others) = keys.split_first().ok_or("it has no routing key")?;
        let properties = properties(f[5].binary().ok_or("its properties are not a binary")?)?;
        let bcc = match f[7].list() {
            Some(l) => l
                .iter()
                .map(|k| text(k, "a BCC key"))
                .collect::<Result<Vec<_>, _>>()?,
            None if f[7].is_atom("undefined") => bcc_keys(others, properties.headers().as_ref()),
            None => return Err("its bcc is neither a list nor undefined".into()),
        };
        Ok(Entry {
            id: id.clone(),
            vhost: text(&f[1], "the virtual host")?,
            exchange: exchange
                .clone()
                .ok_or("its exchange name is not UTF-8 text")?,
            delayed_type: text(&f[3], "the x-delayed-type").unwrap_or_default(),
            routing_key: routing_key.clone(),
            bcc,
            properties,
            body: body(&f[6])?,
        })
    };
    read().map_err(unreadable)
}

fn entry_id(due_ms: u64, t: &Term<'_>, node: &str) -> Result<EntryId, String> {
    let Term::Ref(r) = t else {
        return Err("its reference is not one".into());
    };
    if r.node != node.as_bytes() {
        return Err(format!(
            "its reference was made by node '{}', not by this node: it could not be deleted",
            String::from_utf8_lossy(r.node)
        ));
    }
    if due_ms >= 1 << 48 {
        return Err("its due time is past the year 10000".into());
    }
    Ok(EntryId {
        due_ms,
        creation: r.creation,
        words: r.words.clone(),
    })
}

fn properties(raw: &[u8]) -> Result<BasicProperties, String> {
    match parse_properties(raw) {
        Ok((&[], p)) => Ok(p),
        Ok(_) => Err("its properties have trailing bytes".into()),
        Err(e) => Err(format!("its properties do not parse: {e}")),
    }
}

/// The body from the content's fragments (newest first), or a binary.
fn body(t: &Term<'_>) -> Result<Vec<u8>, String> {
    if let Some(b) = t.binary() {
        return Ok(b.to_vec());
    }
    let parts = t.list().ok_or("its body is neither a binary nor a list")?;
    let mut out = Vec::new();
    for p in parts.iter().rev() {
        out.extend(p.binary().ok_or("a fragment of its body is not a binary")?);
    }
    Ok(out)
}

/// The `BCC` keys of a stored message: its routing keys after the first are `CC ++ BCC`, and
/// its `CC` header is still there. The first keys that match the `CC` header's text values in
/// order are its `CC`; the rest are `BCC`. (If they do not match, the keys the header does not
/// name: a copy then routes no key twice and none less.)
pub fn bcc_keys(others: &[String], headers: Option<&FieldTable>) -> Vec<String> {
    let cc: Vec<String> = match headers.and_then(|h| h.inner().get("CC")) {
        Some(AMQPValue::FieldArray(a)) => a
            .as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    if others.len() >= cc.len() && others[..cc.len()] == cc[..] {
        return others[cc.len()..].to_vec();
    }
    others.iter().filter(|k| !cc.contains(k)).cloned().collect()
}

/// The period a due time falls in, from now (for `--dry-run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Period {
    /// Due within the hour (or overdue).
    Hour,
    /// Within the day.
    Day,
    /// Within the week.
    Week,
    /// Later.
    Later,
}

impl Period {
    /// Every period, in order.
    pub const ALL: [Period; 4] = [Period::Hour, Period::Day, Period::Week, Period::Later];

    /// The period of `due_ms` seen at `now_ms`.
    pub fn of(due_ms: u64, now_ms: u64) -> Period {
        const HOUR: u64 = 3_600_000;
        match due_ms.saturating_sub(now_ms) {
            d if d < HOUR => Period::Hour,
            d if d < 24 * HOUR => Period::Day,
            d if d < 7 * 24 * HOUR => Period::Week,
            _ => Period::Later,
        }
    }

    /// How it is printed.
    pub fn label(self) -> &'static str {
        match self {
            Period::Hour => "next hour",
            Period::Day => "next day",
            Period::Week => "next week",
            Period::Later => "later",
        }
    }
}

#[cfg(test)]
mod tests;
