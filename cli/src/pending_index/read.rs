//! Reading one message: a row as stored, its names resolved, its history, and the follower's
//! marks.

use rusqlite::{Connection, OptionalExtension, params};

use super::codec::{StoredId, decode_headers};
use super::schema::{
    EV_CANCELLED, EV_DONE, EV_PARKED, EV_RESCHEDULED, EV_RETRIED, EV_SCHEDULED, OWNER,
};
use super::{
    Cursor, Destination, Event, Outcome, PendingIndex, Record, Result, Row, State, Viewer,
    check_id, check_mark,
};

/// The columns [`raw_row`] reads, from `messages r`.
pub(super) const ROW_COLUMNS: &str = "r.row_id, r.owner_id, r.message_id, r.destination_id, \
     r.due_ms, r.scheduled_ms, r.body_bytes, r.content_type_id, r.headers, r.state, \
     r.body IS NOT NULL";

/// A row as read, names not yet resolved.
pub(super) struct RawRow {
    pub(super) row_id: i64,
    pub(super) owner_id: i64,
    id: StoredId,
    destination_id: i64,
    pub(super) due_ms: i64,
    scheduled_ms: i64,
    body_bytes: i64,
    content_type_id: Option<i64>,
    pub(super) headers: Vec<(String, String)>,
    state: State,
    body_kept: bool,
}

/// The row of `r`, read as [`ROW_COLUMNS`] lists it.
pub(super) fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    let headers: Option<Vec<u8>> = r.get(8)?;
    Ok(RawRow {
        row_id: r.get(0)?,
        owner_id: r.get(1)?,
        id: r.get(2)?,
        destination_id: r.get(3)?,
        due_ms: r.get(4)?,
        scheduled_ms: r.get(5)?,
        body_bytes: r.get(6)?,
        content_type_id: r.get(7)?,
        headers: headers.and_then(|b| decode_headers(&b)).unwrap_or_default(),
        state: State::of(r.get(9)?),
        body_kept: r.get(10)?,
    })
}

/// One history row: kind, when, by whom, lateness, from and to due times.
type HistoryRow = (i64, u64, String, u64, u64, u64);

/// The event a history row tells (`None`: a kind this build does not know).
fn event(h: HistoryRow) -> Option<Event> {
    let (kind, at_ms, by, lateness_ms, from_due_ms, to_due_ms) = h;
    Some(match kind {
        EV_SCHEDULED => Event::Scheduled {
            at_ms,
            due_at_ms: to_due_ms,
        },
        EV_RESCHEDULED => Event::Rescheduled {
            at_ms,
            by,
            from_due_at_ms: from_due_ms,
            to_due_at_ms: to_due_ms,
        },
        EV_CANCELLED => Event::Cancelled { at_ms, by },
        EV_DONE | EV_RETRIED | EV_PARKED => Event::Ran {
            at_ms,
            lateness_ms,
            outcome: match kind {
                EV_DONE => Outcome::Done,
                EV_RETRIED => Outcome::Retried {
                    next_due_at_ms: to_due_ms,
                },
                _ => Outcome::Parked,
            },
        },
        _ => return None,
    })
}

impl PendingIndex {
    /// Every message named `id` that `viewer` sees, with body and history: at most one for a
    /// user; for an admin, one per owner who used the id.
    pub fn show(&mut self, id: &str, viewer: &Viewer) -> Result<Vec<Record>> {
        check_id(id)?;
        let owners: Vec<i64> = match viewer {
            Viewer::User(u) => self
                .names
                .lookup(&self.conn, OWNER, u, "")?
                .into_iter()
                .collect(),
            Viewer::Admin => self
                .conn
                .prepare_cached("SELECT name_id FROM names WHERE kind = ?1")?
                .query_map([OWNER], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        };
        let sid = StoredId::of(id);
        let mut out = Vec::new();
        for owner_id in owners {
            let found = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {ROW_COLUMNS}, r.body FROM messages r \
                     WHERE r.owner_id = ?1 AND r.message_id = ?2"
                ))?
                .query_row(params![owner_id, sid], |r| {
                    Ok((raw_row(r)?, r.get::<_, Option<Vec<u8>>>(11)?))
                })
                .optional()?;
            if let Some((raw, body)) = found {
                let history = self.history(&raw)?;
                out.push(Record {
                    row: self.resolve(raw)?,
                    body,
                    history,
                });
            }
        }
        out.sort_by_key(|r| r.row.cursor);
        Ok(out)
    }

    fn history(&self, raw: &RawRow) -> Result<Vec<Event>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT kind, at_ms, by_user, lateness_ms, from_due_ms, to_due_ms FROM history \
             WHERE row_id = ?1 ORDER BY seq",
        )?;
        let rows = stmt.query_map([raw.row_id], |r| {
            let n = |i: usize| r.get::<_, Option<i64>>(i).map(|v| v.unwrap_or(0) as u64);
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, Option<String>>(2)?.unwrap_or_default(),
                n(3)?,
                n(4)?,
                n(5)?,
            ))
        })?;
        let mut events = Vec::new();
        for row in rows {
            events.extend(event(row?));
        }
        // The first schedule is the row itself until a second schedule of the id wrote both
        // into the history.
        if !events.iter().any(|e| matches!(e, Event::Scheduled { .. })) {
            events.insert(
                0,
                Event::Scheduled {
                    at_ms: raw.scheduled_ms as u64,
                    due_at_ms: first_due(&self.conn, raw.row_id, raw.due_ms)? as u64,
                },
            );
        }
        // by time (stable: events of one millisecond stay in the order they were applied)
        events.sort_by_key(Event::at_ms);
        Ok(events)
    }

    /// `raw` with its names read.
    pub(super) fn resolve(&mut self, raw: RawRow) -> Result<Row> {
        let owner = self.names.name(&self.conn, raw.owner_id)?.0;
        let (exchange, routing_key) = self.names.name(&self.conn, raw.destination_id)?;
        let content_type = match raw.content_type_id {
            Some(c) => Some(self.names.name(&self.conn, c)?.0),
            None => None,
        };
        Ok(Row {
            id: raw.id.text(),
            owner,
            destination: Destination::from_parts(exchange, routing_key),
            due_at_ms: raw.due_ms as u64,
            scheduled_at_ms: raw.scheduled_ms as u64,
            size: raw.body_bytes as u64,
            content_type,
            headers: raw.headers,
            state: raw.state,
            body_kept: raw.body_kept,
            cursor: Cursor {
                due: raw.due_ms,
                owner: raw.owner_id,
                row: raw.row_id,
            },
        })
    }

    /// A mark [`PendingIndex::apply_marked`] set (`None`: never, or cleared).
    pub fn mark(&self, key: &str) -> Result<Option<u64>> {
        check_mark(key)?;
        let v: Option<i64> = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()?;
        Ok(v.map(|v| v as u64))
    }

    /// The journal offset applied so far (`None`: nothing yet; rebuild from the start).
    pub fn position(&self) -> Result<Option<u64>> {
        let v: Option<i64> = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'position'", [], |r| {
                r.get(0)
            })
            .optional()?;
        Ok(v.map(|v| v as u64))
    }
}

/// The due time row `row_id` was first given: before its first reschedule, or `due_ms` when
/// none.
pub(super) fn first_due(c: &Connection, row_id: i64, due_ms: i64) -> Result<i64> {
    Ok(c.prepare_cached(
        "SELECT from_due_ms FROM history WHERE row_id = ?1 AND kind = ?2 ORDER BY seq LIMIT 1",
    )?
    .query_row(params![row_id, EV_RESCHEDULED], |r| r.get(0))
    .optional()?
    .unwrap_or(due_ms))
}
