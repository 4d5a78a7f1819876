//! How the index writes ids, headers and cursors, pure: the byte forms that keep 10 million
//! records inside the disk budget, and the stable hash the header index is keyed by.

use std::fmt;
use std::str::FromStr;

/// Longest id, in bytes (the publisher's own limit: `Message::id`).
pub const MAX_ID_BYTES: usize = 255;

/// An id as stored: a canonical UUID string (lowercase, hyphenated, what the publisher
/// generates) as its 16 bytes, anything else as its text. The two never collide: SQLite compares
/// a BLOB and a TEXT as different values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StoredId {
    Uuid([u8; 16]),
    Text(String),
}

impl StoredId {
    pub(super) fn of(id: &str) -> StoredId {
        if id.len() == 36
            && let Ok(u) = uuid::Uuid::try_parse(id)
            && u.hyphenated().to_string() == id
        {
            return StoredId::Uuid(*u.as_bytes());
        }
        StoredId::Text(id.to_string())
    }

    /// The id as the user gave it.
    pub(super) fn text(&self) -> String {
        match self {
            StoredId::Uuid(b) => uuid::Uuid::from_bytes(*b).hyphenated().to_string(),
            StoredId::Text(t) => t.clone(),
        }
    }
}

impl rusqlite::ToSql for StoredId {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self {
            StoredId::Uuid(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            StoredId::Text(t) => ToSqlOutput::Borrowed(ValueRef::Text(t.as_bytes())),
        })
    }
}

impl rusqlite::types::FromSql for StoredId {
    fn column_result(v: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
        use rusqlite::types::{FromSqlError, ValueRef};
        match v {
            ValueRef::Blob(b) => <[u8; 16]>::try_from(b).map(StoredId::Uuid).map_err(|_| {
                FromSqlError::InvalidBlobSize {
                    expected_size: 16,
                    blob_size: b.len(),
                }
            }),
            ValueRef::Text(t) => String::from_utf8(t.to_vec())
                .map(StoredId::Text)
                .map_err(|e| FromSqlError::Other(Box::new(e))),
            _ => Err(FromSqlError::InvalidType),
        }
    }
}

/// Headers as one BLOB: for each pair, the key's and the value's length as LEB128 then the
/// bytes. Smaller than JSON by the quotes, braces and escapes, and read back in order.
pub(super) fn encode_headers(headers: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(headers.iter().map(|(k, v)| k.len() + v.len() + 2).sum());
    for (k, v) in headers {
        for s in [k, v] {
            leb128(&mut out, s.len());
            out.extend_from_slice(s.as_bytes());
        }
    }
    out
}

fn leb128(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn read_leb128(b: &[u8], at: &mut usize) -> Option<usize> {
    let mut n: usize = 0;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        n |= usize::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(n);
        }
    }
    None
}

/// The pairs of [`encode_headers`]; `None` for bytes it did not write.
pub(super) fn decode_headers(b: &[u8]) -> Option<Vec<(String, String)>> {
    let mut at = 0;
    let mut out = Vec::new();
    let text = |at: &mut usize| -> Option<String> {
        let len = read_leb128(b, at)?;
        let end = at.checked_add(len)?;
        let s = std::str::from_utf8(b.get(*at..end)?).ok()?.to_string();
        *at = end;
        Some(s)
    };
    while at < b.len() {
        let k = text(&mut at)?;
        let v = text(&mut at)?;
        out.push((k, v));
    }
    Some(out)
}

/// The header index's key of `k=v`: FNV-1a over `k`, a 0 byte and `v`, as an `i64`. Stable
/// across builds and platforms (an index outlives the binary that wrote it). A page verifies
/// each row's headers, so a collision never shows a wrong row; a count trusts the hash (one
/// chance in 2^64 per pair of distinct values).
pub(super) fn header_hash(k: &str, v: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in k.bytes().chain([0u8]).chain(v.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h as i64
}

/// Where a page ended: the sort key `(due, owner, row)` of its last row. Pages are sorted by due
/// time, then by the owner's and the row's number, so the order is total and a page starts
/// strictly after its cursor (keyset pagination: no OFFSET, any page costs the same).
///
/// Written as `due.owner.row` (decimal), opaque to users. A cursor names row numbers of one
/// index file: after a rebuild from the journal, an old cursor still gives a valid page order but
/// may skip or repeat rows of its due millisecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor {
    pub(super) due: i64,
    pub(super) owner: i64,
    pub(super) row: i64,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.due, self.owner, self.row)
    }
}

impl FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Cursor, String> {
        let bad = || format!("'{s}' is not a cursor this index gave (want due.owner.row)");
        let mut parts = s.split('.');
        let mut next = || -> Result<i64, String> {
            let p = parts.next().ok_or_else(bad)?;
            let n: i64 = p.parse().map_err(|_| bad())?;
            if n < 0 { Err(bad()) } else { Ok(n) }
        };
        let c = Cursor {
            due: next()?,
            owner: next()?,
            row: next()?,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn canonical_uuids_are_stored_as_16_bytes_and_anything_else_as_text() {
        let u = "01890a5d-ac96-774b-bcce-b302099a8057";
        assert!(matches!(StoredId::of(u), StoredId::Uuid(_)));
        assert_eq!(StoredId::of(u).text(), u);
        for other in [
            "01890A5D-AC96-774B-BCCE-B302099A8057",
            "01890a5dac96774bbcceb302099a8057",
            "order-42",
            "",
        ] {
            assert_eq!(StoredId::of(other), StoredId::Text(other.to_string()));
            assert_eq!(StoredId::of(other).text(), other);
        }
    }

    #[test]
    fn a_cursor_reads_back_and_refuses_what_it_did_not_write() {
        let c = Cursor {
            due: 1_700_000_000_000,
            owner: 3,
            row: 99,
        };
        assert_eq!(c.to_string().parse::<Cursor>(), Ok(c));
        for bad in ["", "1.2", "1.2.3.4", "a.b.c", "-1.2.3", "1..3"] {
            assert!(bad.parse::<Cursor>().is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn headers_read_back_as_written(h in proptest::collection::vec((".{0,40}", ".{0,300}"), 0..6)) {
            prop_assert_eq!(decode_headers(&encode_headers(&h)), Some(h));
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_headers(&b);
        }
    }

    #[test]
    fn the_header_hash_is_stable_and_separates_key_from_value() {
        assert_eq!(header_hash("", ""), header_hash("", ""));
        assert_ne!(header_hash("ab", "c"), header_hash("a", "bc"));
        // FNV-1a's published value for the empty input, after our separator byte
        assert_eq!(header_hash("", "") as u64, 0xaf63_bd4c_8601_b7df);
    }
}
