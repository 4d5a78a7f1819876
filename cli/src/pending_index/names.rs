//! Owners, content types and destinations, stored once in `names` and cached both ways.

use std::collections::HashMap;

use rusqlite::{Connection, OptionalExtension, params};

use super::Result;

/// Names (owners, destinations, content types) kept in memory at most; past it the cache is
/// emptied and refilled from the file, so memory stays bounded whatever the journal holds.
const NAME_CACHE: usize = 100_000;

/// Interned names, both ways, bounded by [`NAME_CACHE`].
#[derive(Default)]
pub(super) struct Names {
    ids: HashMap<(i64, String, String), i64>,
    names: HashMap<i64, (i64, String, String)>,
}

impl Names {
    fn remember(&mut self, nid: i64, key: (i64, String, String)) {
        if self.ids.len() >= NAME_CACHE {
            self.ids.clear();
            self.names.clear();
        }
        self.ids.insert(key.clone(), nid);
        self.names.insert(nid, key);
    }

    pub(super) fn clear(&mut self) {
        self.ids.clear();
        self.names.clear();
    }

    pub(super) fn lookup(
        &mut self,
        c: &Connection,
        kind: i64,
        a: &str,
        b: &str,
    ) -> Result<Option<i64>> {
        let key = (kind, a.to_string(), b.to_string());
        if let Some(n) = self.ids.get(&key) {
            return Ok(Some(*n));
        }
        let nid: Option<i64> = c
            .prepare_cached(
                "SELECT name_id FROM names WHERE kind = ?1 AND name = ?2 AND routing_key = ?3",
            )?
            .query_row(params![kind, a, b], |r| r.get(0))
            .optional()?;
        if let Some(n) = nid {
            self.remember(n, key);
        }
        Ok(nid)
    }

    pub(super) fn intern(&mut self, c: &Connection, kind: i64, a: &str, b: &str) -> Result<i64> {
        if let Some(n) = self.lookup(c, kind, a, b)? {
            return Ok(n);
        }
        c.prepare_cached("INSERT INTO names (kind, name, routing_key) VALUES (?1, ?2, ?3)")?
            .execute(params![kind, a, b])?;
        let n = c.last_insert_rowid();
        self.remember(n, (kind, a.to_string(), b.to_string()));
        Ok(n)
    }

    pub(super) fn name(&mut self, c: &Connection, nid: i64) -> Result<(String, String)> {
        if let Some((_, a, b)) = self.names.get(&nid) {
            return Ok((a.clone(), b.clone()));
        }
        let (kind, a, b): (i64, String, String) = c
            .prepare_cached("SELECT kind, name, routing_key FROM names WHERE name_id = ?1")?
            .query_row([nid], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        self.remember(nid, (kind, a.clone(), b.clone()));
        Ok((a, b))
    }
}
