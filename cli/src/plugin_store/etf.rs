//! The part of Erlang's External Term Format that the node's answer uses (pure): integers,
//! atoms, binaries, lists, tuples and references, read from a byte slice without copying.
//! Every length is checked against what is left of the input before anything is allocated,
//! nesting is bounded, and any other tag is an error: the input comes from outside (a node,
//! through a command), so no input makes this panic or allocate more than its own size.
//!
//! (The `eetf` crate was the first choice; it panics on two tags, `unimplemented!()`, and
//! allocates whatever a length field says before reading, so a few bytes could abort the tool.)

/// A decoded term, borrowing from the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Term<'a> {
    /// Any integer up to 128 bits.
    Int(i128),
    /// An atom's name (Latin-1 atoms with bytes over 127 are kept as their bytes).
    Atom(&'a [u8]),
    /// A binary.
    Binary(&'a [u8]),
    /// A proper list (a `STRING_EXT` is a list of small integers).
    List(Vec<Term<'a>>),
    /// A tuple.
    Tuple(Vec<Term<'a>>),
    /// A reference.
    Ref(Reference<'a>),
}

/// An Erlang reference: what makes a plugin entry unique.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference<'a> {
    /// The node that made it.
    pub node: &'a [u8],
    /// The node's incarnation.
    pub creation: u32,
    /// Its words (3 for `make_ref()`, up to 5).
    pub words: Vec<u32>,
}

const VERSION: u8 = 131;
const NEW_REFERENCE: u8 = 114;
const NEWER_REFERENCE: u8 = 90;
const SMALL_INTEGER: u8 = 97;
const INTEGER: u8 = 98;
const ATOM: u8 = 100;
const SMALL_ATOM: u8 = 115;
const ATOM_UTF8: u8 = 118;
const SMALL_ATOM_UTF8: u8 = 119;
const SMALL_TUPLE: u8 = 104;
const LARGE_TUPLE: u8 = 105;
const NIL: u8 = 106;
const STRING: u8 = 107;
const LIST: u8 = 108;
const BINARY: u8 = 109;
const SMALL_BIG: u8 = 110;
const LARGE_BIG: u8 = 111;

/// Deepest nesting accepted (the answer nests 5 deep).
const MAX_DEPTH: usize = 32;

/// Decodes one whole term (`131` first, nothing after it).
pub fn decode(input: &[u8]) -> Result<Term<'_>, String> {
    let mut r = Reader { input, at: 0 };
    if r.u8()? != VERSION {
        return Err("not External Term Format (no version byte 131)".into());
    }
    let t = r.term(0)?;
    if r.at != input.len() {
        return Err(format!("{} bytes after the term", input.len() - r.at));
    }
    Ok(t)
}

struct Reader<'a> {
    input: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.input.len())
            .ok_or_else(|| format!("the term ends early (at byte {}, {n} wanted)", self.at))?;
        let s = &self.input[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<usize, String> {
        let b = self.take(2)?;
        Ok(usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn len32(&mut self) -> Result<usize, String> {
        usize::try_from(self.u32()?).map_err(|_| "a length over the address space".to_string())
    }

    /// `n` elements, each at least one byte: never more than what is left.
    fn elements(&mut self, n: usize, depth: usize) -> Result<Vec<Term<'a>>, String> {
        if n > self.input.len() - self.at {
            return Err(format!("{n} elements announced, fewer bytes left"));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.term(depth + 1)?);
        }
        Ok(v)
    }

    fn term(&mut self, depth: usize) -> Result<Term<'a>, String> {
        if depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH}"));
        }
        let tag = self.u8()?;
        Ok(match tag {
            SMALL_INTEGER => Term::Int(i128::from(self.u8()?)),
            INTEGER => Term::Int(i128::from(self.u32()? as i32)),
            SMALL_BIG => {
                let n = usize::from(self.u8()?);
                self.big(n)?
            }
            LARGE_BIG => {
                let n = self.len32()?;
                self.big(n)?
            }
            ATOM | ATOM_UTF8 => {
                let n = self.u16()?;
                Term::Atom(self.take(n)?)
            }
            SMALL_ATOM | SMALL_ATOM_UTF8 => {
                let n = usize::from(self.u8()?);
                Term::Atom(self.take(n)?)
            }
            BINARY => {
                let n = self.len32()?;
                Term::Binary(self.take(n)?)
            }
            NIL => Term::List(Vec::new()),
            STRING => {
                let n = self.u16()?;
                let bytes = self.take(n)?;
                Term::List(bytes.iter().map(|&b| Term::Int(i128::from(b))).collect())
            }
            LIST => {
                let n = self.len32()?;
                let v = self.elements(n, depth)?;
                if self.u8()? != NIL {
                    return Err("an improper list".into());
                }
                Term::List(v)
            }
            SMALL_TUPLE => {
                let n = usize::from(self.u8()?);
                Term::Tuple(self.elements(n, depth)?)
            }
            LARGE_TUPLE => {
                let n = self.len32()?;
                Term::Tuple(self.elements(n, depth)?)
            }
            NEW_REFERENCE | NEWER_REFERENCE => self.reference(tag == NEWER_REFERENCE)?,
            other => {
                return Err(format!(
                    "a term of tag {other}, which the answer never holds"
                ));
            }
        })
    }

    /// A bignum of `n` little-endian digits: up to 16 bytes (the answer holds none longer).
    fn big(&mut self, n: usize) -> Result<Term<'a>, String> {
        let sign = self.u8()?;
        let digits = self.take(n)?;
        if n > 16 || (n == 16 && digits[15] & 0x80 != 0) {
            return Err(format!(
                "an integer of {n} bytes, more than this reader takes"
            ));
        }
        let magnitude = digits
            .iter()
            .rev()
            .fold(0i128, |acc, &d| (acc << 8) | i128::from(d));
        Ok(Term::Int(if sign == 0 { magnitude } else { -magnitude }))
    }

    fn reference(&mut self, newer: bool) -> Result<Term<'a>, String> {
        let n = self.u16()?;
        if n == 0 || n > 5 {
            return Err(format!("a reference of {n} words"));
        }
        let node = match self.term(MAX_DEPTH)? {
            Term::Atom(a) => a,
            _ => return Err("a reference whose node is not an atom".into()),
        };
        let creation = if newer {
            self.u32()?
        } else {
            u32::from(self.u8()?)
        };
        let words = (0..n).map(|_| self.u32()).collect::<Result<Vec<_>, _>>()?;
        Ok(Term::Ref(Reference {
            node,
            creation,
            words,
        }))
    }
}

impl<'a> Term<'a> {
    /// The integer, if it is one.
    pub fn int(&self) -> Option<i128> {
        match self {
            Term::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// The binary, if it is one.
    pub fn binary(&self) -> Option<&'a [u8]> {
        match self {
            Term::Binary(b) => Some(b),
            _ => None,
        }
    }

    /// Whether it is the atom `name`.
    pub fn is_atom(&self, name: &str) -> bool {
        matches!(self, Term::Atom(a) if *a == name.as_bytes())
    }

    /// The elements of a list.
    pub fn list(&self) -> Option<&[Term<'a>]> {
        match self {
            Term::List(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of a tuple of `n`.
    pub fn tuple(&self, n: usize) -> Option<&[Term<'a>]> {
        match self {
            Term::Tuple(v) if v.len() == n => Some(v),
            _ => None,
        }
    }
}

/// Encodes terms for tests (and nothing else needs it: what the tool sends the node is not ETF).
#[cfg(test)]
pub(crate) fn encode(t: &Term<'_>, out: &mut Vec<u8>) {
    match t {
        Term::Int(n) if (0..=255).contains(n) => out.extend([SMALL_INTEGER, *n as u8]),
        Term::Int(n) if i32::try_from(*n).is_ok() => {
            out.push(INTEGER);
            out.extend((*n as i32).to_be_bytes());
        }
        Term::Int(n) => {
            let mut digits = n.unsigned_abs().to_le_bytes().to_vec();
            while digits.last() == Some(&0) {
                digits.pop();
            }
            out.extend([SMALL_BIG, digits.len() as u8, u8::from(*n < 0)]);
            out.extend(digits);
        }
        Term::Atom(a) => {
            out.extend([SMALL_ATOM_UTF8, a.len() as u8]);
            out.extend(*a);
        }
        Term::Binary(b) => {
            out.push(BINARY);
            out.extend((b.len() as u32).to_be_bytes());
            out.extend(*b);
        }
        Term::List(v) if v.is_empty() => out.push(NIL),
        Term::List(v) => {
            out.push(LIST);
            out.extend((v.len() as u32).to_be_bytes());
            v.iter().for_each(|t| encode(t, out));
            out.push(NIL);
        }
        Term::Tuple(v) => {
            out.extend([SMALL_TUPLE, v.len() as u8]);
            v.iter().for_each(|t| encode(t, out));
        }
        Term::Ref(r) => {
            out.push(NEWER_REFERENCE);
            out.extend((r.words.len() as u16).to_be_bytes());
            encode(&Term::Atom(r.node), out);
            out.extend(r.creation.to_be_bytes());
            r.words.iter().for_each(|w| out.extend(w.to_be_bytes()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn whole(t: &Term<'_>) -> Vec<u8> {
        let mut out = vec![VERSION];
        encode(t, &mut out);
        out
    }

    #[test]
    fn what_erlang_writes_decodes() {
        // term_to_binary({ok, [<<"k1">>], 1796534026261, -1}) from erl
        let bytes = [
            131, 104, 4, 100, 0, 2, 111, 107, 108, 0, 0, 0, 1, 109, 0, 0, 0, 2, 107, 49, 106, 110,
            6, 0, 21, 192, 197, 73, 162, 1, 98, 255, 255, 255, 255,
        ];
        let t = decode(&bytes).unwrap();
        let v = t.tuple(4).unwrap();
        assert!(v[0].is_atom("ok"));
        assert_eq!(v[1].list().unwrap()[0].binary(), Some(&b"k1"[..]));
        assert_eq!(v[2].int(), Some(1_796_534_026_261));
        assert_eq!(v[3].int(), Some(-1));
        // "abc" as a list of bytes, an old 1-byte-creation reference
        let s = decode(&[131, 107, 0, 2, 97, 98]).unwrap();
        assert_eq!(s, Term::List(vec![Term::Int(97), Term::Int(98)]));
        let r = decode(&[131, 114, 0, 1, 100, 0, 1, 110, 3, 0, 0, 0, 7]).unwrap();
        let Term::Ref(r) = r else { panic!() };
        assert_eq!((r.node, r.creation, r.words), (&b"n"[..], 3, vec![7]));
    }

    #[test]
    fn lengths_past_the_end_and_odd_terms_are_errors() {
        for bad in [
            &[][..],
            &[130, 97, 1],
            &[131],
            &[131, 109, 255, 255, 255, 255, 0],
            &[131, 108, 255, 255, 255, 255, 106],
            &[131, 105, 255, 255, 255, 255],
            &[131, 108, 0, 0, 0, 1, 97, 1, 97, 2],
            &[131, 97, 1, 97],
            &[131, 70, 0, 0, 0, 0, 0, 0, 0, 0],
            &[131, 82, 0],
            &[131, 68, 0],
            &[
                131, 110, 17, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
            ],
            &[131, 90, 0, 0, 119, 1, 110, 0, 0, 0, 1],
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        let mut deep = vec![131];
        deep.extend(std::iter::repeat_n([104u8, 1], 100).flatten());
        deep.push(106);
        assert!(decode(&deep).unwrap_err().contains("deeper"));
    }

    fn term() -> impl Strategy<Value = Term<'static>> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(|n| Term::Int(i128::from(n))),
            prop::sample::select(vec![&b"ok"[..], b"undefined", b"eof"]).prop_map(Term::Atom),
            prop::sample::select(vec![&b""[..], b"k1", b"\xff\x00body"]).prop_map(Term::Binary),
            (any::<u32>(), prop::collection::vec(any::<u32>(), 1..=5)).prop_map(|(c, w)| {
                Term::Ref(Reference {
                    node: b"rabbit@h",
                    creation: c,
                    words: w,
                })
            }),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Term::List),
                prop::collection::vec(inner, 0..6).prop_map(Term::Tuple),
            ]
        })
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut with_version = vec![131];
            with_version.extend(&bytes);
            let _ = decode(&bytes);
            let _ = decode(&with_version);
        }

        #[test]
        fn terms_round_trip(t in term()) {
            let bytes = whole(&t);
            prop_assert_eq!(decode(&bytes).unwrap(), t);
            // every strict prefix fails, without panic
            for cut in 0..bytes.len() {
                prop_assert!(decode(&bytes[..cut]).is_err());
            }
        }
    }
}
