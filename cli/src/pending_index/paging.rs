//! Pages and counts: a filter resolved into a plan that reads one index by keyset (never by
//! OFFSET), so any page after a cursor costs the same whatever its depth.

use rusqlite::ToSql;
use rusqlite::types::Value;

use super::codec::decode_headers;
use super::read::{ROW_COLUMNS, raw_row};
use super::schema::{DESTINATION, OWNER};
use super::{
    Cursor, Destination, Error, Listing, MAX_LIMIT, PendingIndex, Result, Row, Viewer, check_user,
    codec::header_hash, indexed, ms,
};

/// What a list or a count covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// Who asks.
    pub viewer: Viewer,
    /// Pending or parked.
    pub listing: Listing,
    /// Only this destination.
    pub destination: Option<Destination>,
    /// Only due strictly after (ms since the epoch).
    pub due_after: Option<u64>,
    /// Only due strictly before (ms since the epoch).
    pub due_before: Option<u64>,
    /// Only with this user header `(key, value)`.
    pub header: Option<(String, String)>,
    /// Rows a page holds (1 to [`MAX_LIMIT`]).
    pub limit: usize,
    /// Continue after this cursor (a page's `next`).
    pub after: Option<Cursor>,
}

impl Filter {
    /// Everything `viewer` sees, pending, 100 a page.
    pub fn new(viewer: Viewer) -> Filter {
        Filter {
            viewer,
            listing: Listing::Pending,
            destination: None,
            due_after: None,
            due_before: None,
            header: None,
            limit: 100,
            after: None,
        }
    }
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The rows, by due time.
    pub rows: Vec<Row>,
    /// Where the next page starts; `None` when this one is the last.
    pub next: Option<Cursor>,
}

/// How a list or count finds its rows: the resolved filter.
pub(super) struct Plan {
    listing: i64,
    destination_id: Option<i64>,
    owner_id: Option<i64>,
    /// The header pair's hash, when the header index has it.
    hash: Option<i64>,
    header: Option<(String, String)>,
    after: Option<Cursor>,
    due_after: Option<i64>,
    due_before: Option<i64>,
}

impl Plan {
    /// `FROM ... WHERE ...` and its parameters. `header_index` drives when it can, then the
    /// index of the narrowest given filter; every one of them is sorted by
    /// `(due_ms, owner_id, row_id)` within its equality prefix, so the ORDER BY is a range scan.
    pub(super) fn sql_from_where(&self, join_rows: bool) -> (String, Vec<(&'static str, Value)>) {
        let mut p: Vec<(&'static str, Value)> = Vec::new();
        let (mut sql, t) = if let Some(h) = self.hash {
            p.push((":h", Value::Integer(h)));
            let s = if join_rows {
                "FROM header_index t CROSS JOIN messages r ON r.row_id = t.row_id \
                 WHERE t.header_hash = :h"
                    .to_string()
            } else {
                "FROM header_index t WHERE t.header_hash = :h".to_string()
            };
            (s, "t")
        } else {
            let index = if self.destination_id.is_some() {
                "by_dest"
            } else if self.owner_id.is_some() {
                "by_owner"
            } else {
                "by_due"
            };
            (
                format!(
                    "FROM messages r INDEXED BY {index} WHERE r.listing = {}",
                    self.listing
                ),
                "r",
            )
        };
        if let Some(d) = self.destination_id {
            sql.push_str(&format!(" AND {t}.destination_id = :dest"));
            p.push((":dest", Value::Integer(d)));
        }
        if let Some(o) = self.owner_id {
            sql.push_str(&format!(" AND {t}.owner_id = :own"));
            p.push((":own", Value::Integer(o)));
        }
        // The start: the cursor, or due_after when it starts later. `due_ms >= :cd` is the range
        // the index seeks to (a plain column bound, which every index above starts with after
        // its equalities); the row value then skips what the cursor's millisecond already gave.
        match (self.after, self.due_after) {
            (Some(c), da) if da.is_none_or(|da| c.due > da) => {
                sql.push_str(&format!(
                    " AND {t}.due_ms >= :cd \
                     AND ({t}.due_ms, {t}.owner_id, {t}.row_id) > (:cd, :co, :cr)"
                ));
                p.push((":cd", Value::Integer(c.due)));
                p.push((":co", Value::Integer(c.owner)));
                p.push((":cr", Value::Integer(c.row)));
            }
            (_, Some(da)) => {
                sql.push_str(&format!(" AND {t}.due_ms > :da"));
                p.push((":da", Value::Integer(da)));
            }
            (_, None) => {}
        }
        if let Some(db) = self.due_before {
            sql.push_str(&format!(" AND {t}.due_ms < :db"));
            p.push((":db", Value::Integer(db)));
        }
        (sql, p)
    }

    pub(super) fn order(&self) -> &'static str {
        if self.hash.is_some() {
            " ORDER BY t.due_ms, t.owner_id, t.row_id"
        } else {
            " ORDER BY r.due_ms, r.owner_id, r.row_id"
        }
    }
}

/// Named parameters as rusqlite binds them.
pub(super) fn bind<'a>(p: &'a [(&'static str, Value)]) -> Vec<(&'static str, &'a dyn ToSql)> {
    p.iter().map(|(n, v)| (*n, v as &dyn ToSql)).collect()
}

impl PendingIndex {
    /// `filter` resolved against the file; `None` when a name in it is unknown, so nothing
    /// can match.
    pub(super) fn plan(&mut self, f: &Filter) -> Result<Option<Plan>> {
        let due_after = f.due_after.map(|v| ms(v, "due_after")).transpose()?;
        let due_before = f.due_before.map(|v| ms(v, "due_before")).transpose()?;
        if let (Some(a), Some(b)) = (due_after, due_before)
            && a >= b
        {
            return Err(Error::Invalid(format!(
                "due_after ({a}) must come before due_before ({b})"
            )));
        }
        if let Some((k, _)) = &f.header
            && k.is_empty()
        {
            return Err(Error::Invalid("a header filter needs a name: K=V".into()));
        }
        let owner_id = match &f.viewer {
            Viewer::Admin => None,
            Viewer::User(u) => {
                check_user(u, "the viewer's user name")?;
                match self.names.lookup(&self.conn, OWNER, u, "")? {
                    Some(o) => Some(o),
                    None => return Ok(None),
                }
            }
        };
        let destination_id = match &f.destination {
            None => None,
            Some(d) => {
                let (a, b) = d.parts();
                match self.names.lookup(&self.conn, DESTINATION, a, b)? {
                    Some(n) => Some(n),
                    None => return Ok(None),
                }
            }
        };
        let listing = match f.listing {
            Listing::Pending => 1,
            Listing::Parked => 2,
        };
        let hash = match &f.header {
            Some((k, v)) if listing == 1 && indexed(self.indexed_headers.as_deref(), k) => {
                Some(header_hash(k, v))
            }
            _ => None,
        };
        Ok(Some(Plan {
            listing,
            destination_id,
            owner_id,
            hash,
            header: f.header.clone(),
            after: f.after,
            due_after,
            due_before,
        }))
    }

    /// One page of what `filter` covers, sorted by due time, after `filter.after`.
    pub fn list(&mut self, filter: &Filter) -> Result<Page> {
        self.check_not_rebuilding()?;
        if filter.limit == 0 || filter.limit > MAX_LIMIT {
            return Err(Error::Invalid(format!(
                "a page holds 1 to {MAX_LIMIT} rows, not {}",
                filter.limit
            )));
        }
        let Some(plan) = self.plan(filter)? else {
            return Ok(Page {
                rows: Vec::new(),
                next: None,
            });
        };
        let (fw, p) = plan.sql_from_where(true);
        let sql = format!("SELECT {ROW_COLUMNS} {fw}{}", plan.order());
        let mut raws = Vec::with_capacity(filter.limit + 1);
        {
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(&*bind(&p))?;
            while let Some(r) = rows.next()? {
                let raw = raw_row(r)?;
                if let Some(h) = &plan.header
                    && !raw.headers.contains(h)
                {
                    continue;
                }
                raws.push(raw);
                if raws.len() > filter.limit {
                    break;
                }
            }
        }
        let more = raws.len() > filter.limit;
        raws.truncate(filter.limit);
        let rows = raws
            .into_iter()
            .map(|r| self.resolve(r))
            .collect::<Result<Vec<_>>>()?;
        let next = if more {
            rows.last().map(|r| r.cursor)
        } else {
            None
        };
        Ok(Page { rows, next })
    }

    /// How many rows `filter` covers, whatever its cursor and limit: what a purge would cancel.
    /// An index-only range count (the header index's hash is trusted; see `header_hash`),
    /// except a header filter on parked rows or on a header not indexed, which reads each row
    /// of the other filters' range.
    pub fn count(&mut self, filter: &Filter) -> Result<u64> {
        self.check_not_rebuilding()?;
        let Some(mut plan) = self.plan(filter)? else {
            return Ok(0);
        };
        plan.after = None;
        if let (Some(h), None) = (&plan.header, plan.hash) {
            let (fw, p) = plan.sql_from_where(true);
            let sql = format!("SELECT r.headers {fw}");
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(&*bind(&p))?;
            let mut n = 0;
            while let Some(r) = rows.next()? {
                let b: Option<Vec<u8>> = r.get(0)?;
                if b.and_then(|b| decode_headers(&b))
                    .is_some_and(|hs| hs.contains(h))
                {
                    n += 1;
                }
            }
            return Ok(n);
        }
        let (fw, p) = plan.sql_from_where(false);
        let sql = format!("SELECT count(*) {fw}");
        let n: i64 = self
            .conn
            .prepare_cached(&sql)?
            .query_row(&*bind(&p), |r| r.get(0))?;
        Ok(n as u64)
    }
}
