//! The writer: entries applied in order inside one transaction, with the follower's marks, the
//! listing and header indexes kept in step with each row.

use rusqlite::{OptionalExtension, Transaction, params};

use super::codec::{StoredId, decode_headers, encode_headers, header_hash};
use super::names::Names;
use super::read::first_due;
use super::schema::{
    CONTENT_TYPE, DESTINATION, EV_CANCELLED, EV_DONE, EV_PARKED, EV_RESCHEDULED, EV_RETRIED,
    EV_SCHEDULED, OWNER,
};
use super::{
    Entry, Error, Outcome, PendingIndex, Result, Scheduled, State, check_id, check_mark,
    check_user, indexed, ms,
};

/// What a row is now, as the writers need it.
pub(super) struct Current {
    pub(super) row_id: i64,
    pub(super) owner_id: i64,
    destination_id: i64,
    due_ms: i64,
    scheduled_ms: i64,
    state: State,
    headers: Vec<(String, String)>,
    events: i64,
}

impl PendingIndex {
    /// Applies `entries` in order, in one transaction.
    pub fn apply(&mut self, entries: &[Entry]) -> Result<()> {
        self.apply_marked(entries, &[])
    }

    /// Applies `entries` in order and records `position` (the journal offset after the last
    /// of them) in the same transaction: after a crash the file holds both or neither.
    pub fn apply_at(&mut self, entries: &[Entry], position: u64) -> Result<()> {
        self.apply_marked(entries, &[("position", Some(position))])
    }

    /// Applies `entries` in order and sets (`Some`) or clears (`None`) each of `marks` in the
    /// same transaction: the follower's positions in its streams ([`PendingIndex::mark`]).
    /// `"position"` is the journal offset of [`PendingIndex::apply_at`]; a name is 1 to 64 bytes
    /// of `[a-z_]`.
    pub fn apply_marked(&mut self, entries: &[Entry], marks: &[(&str, Option<u64>)]) -> Result<()> {
        for (k, _) in marks {
            check_mark(k)?;
        }
        let result = (|| -> Result<()> {
            let tx = self.conn.transaction()?;
            let mut w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: self.rebuilding,
            };
            for e in entries {
                w.apply(e)?;
            }
            for (k, v) in marks {
                match v {
                    Some(v) => {
                        tx.prepare_cached(
                            "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
                        )?
                        .execute(params![k, ms(*v, "a stream position")?])?;
                    }
                    None => {
                        tx.prepare_cached("DELETE FROM meta WHERE key = ?1")?
                            .execute([k])?;
                    }
                }
            }
            tx.commit()?;
            Ok(())
        })();
        if result.is_err() {
            self.names.clear();
        }
        result
    }

    /// Records the journal offset applied so far (for a stretch of the journal with nothing
    /// for the index).
    pub fn set_position(&mut self, position: u64) -> Result<()> {
        self.conn
            .prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES ('position', ?1)")?
            .execute([ms(position, "the journal position")?])?;
        Ok(())
    }
}

/// Applies entries inside one transaction.
pub(super) struct Writer<'a> {
    pub(super) tx: &'a Transaction<'a>,
    pub(super) names: &'a mut Names,
    pub(super) indexed_headers: Option<&'a [String]>,
    /// Leave the header index alone: `finish_rebuild` makes it from the rows.
    pub(super) rebuilding: bool,
}

/// One history event: its kind, when, by whom, and the lateness and due times it tells.
struct Happened<'a> {
    kind: i64,
    at_ms: i64,
    by: Option<&'a str>,
    lateness_ms: Option<i64>,
    from_due_ms: Option<i64>,
    to_due_ms: Option<i64>,
}

impl<'a> Happened<'a> {
    fn new(kind: i64, at_ms: i64) -> Happened<'a> {
        Happened {
            kind,
            at_ms,
            by: None,
            lateness_ms: None,
            from_due_ms: None,
            to_due_ms: None,
        }
    }
}

impl Writer<'_> {
    fn apply(&mut self, e: &Entry) -> Result<()> {
        match e {
            Entry::Scheduled(s) => self.schedule(s),
            Entry::Purged(p) => self.purge(p).map(|_| ()),
            Entry::Refused {
                owner,
                id,
                scheduled_at_ms,
            } => {
                if let Some(cur) = self.current(owner, id)?
                    && cur.state == State::Unconfirmed
                    && cur.scheduled_ms == ms(*scheduled_at_ms, "a schedule time")?
                {
                    self.move_to(&cur, State::Refused, cur.due_ms, Some(cur.scheduled_ms))?;
                }
                Ok(())
            }
            Entry::Confirmed { owner, id } => {
                if let Some(cur) = self.current(owner, id)? {
                    self.confirm(&cur)?;
                }
                Ok(())
            }
            Entry::Cancelled {
                owner,
                id,
                by,
                at_ms,
            } => self.cancel(owner.as_deref(), id, by, *at_ms),
            Entry::Ran {
                owner,
                id,
                at_ms,
                lateness_ms,
                outcome,
            } => self.ran(owner, id, *at_ms, *lateness_ms, *outcome),
            Entry::Rescheduled {
                owner,
                id,
                due_at_ms,
                by,
                at_ms,
            } => self.reschedule(owner.as_deref(), id, *due_at_ms, by, *at_ms),
        }
    }

    /// An unconfirmed row becomes pending.
    fn confirm(&self, cur: &Current) -> Result<()> {
        if cur.state == State::Unconfirmed {
            self.tx
                .prepare_cached("UPDATE messages SET state = ?2 WHERE row_id = ?1")?
                .execute(params![cur.row_id, State::Pending.code()])?;
        }
        Ok(())
    }

    fn cancel(&mut self, owner: Option<&str>, id: &str, by: &str, at_ms: u64) -> Result<()> {
        check_id(id)?;
        let at = ms(at_ms, "a cancel's time")?;
        for cur in self.targets(owner, id)? {
            // a cancel of what already ran or was parked is too late: nothing changes
            if cur.state.listing() == Some(1) {
                let mut h = Happened::new(EV_CANCELLED, at);
                h.by = Some(by);
                self.event(&cur, &h)?;
                self.move_to(&cur, State::Cancelled, cur.due_ms, Some(at))?;
            }
        }
        Ok(())
    }

    fn ran(
        &mut self,
        owner: &str,
        id: &str,
        at_ms: u64,
        lateness_ms: u64,
        outcome: Outcome,
    ) -> Result<()> {
        let Some(cur) = self.current(owner, id)? else {
            return Ok(());
        };
        let at = ms(at_ms, "a run's time")?;
        let replay: Option<i64> = self
            .tx
            .prepare_cached(
                "SELECT 1 FROM history WHERE row_id = ?1 AND at_ms = ?2 AND kind IN (?3, ?4, ?5)",
            )?
            .query_row(
                params![cur.row_id, at, EV_DONE, EV_RETRIED, EV_PARKED],
                |r| r.get(0),
            )
            .optional()?;
        if replay.is_some() {
            return Ok(());
        }
        let (kind, next, state, due, finished) = match outcome {
            Outcome::Done => (EV_DONE, None, State::Done, cur.due_ms, Some(at)),
            Outcome::Retried { next_due_at_ms } => {
                let next = ms(next_due_at_ms, "a retry's due time")?;
                (EV_RETRIED, Some(next), State::Pending, next, None)
            }
            Outcome::Parked => (EV_PARKED, None, State::Parked, cur.due_ms, None),
        };
        let mut h = Happened::new(kind, at);
        h.lateness_ms = Some(ms(lateness_ms, "a lateness")?);
        h.to_due_ms = next;
        self.event(&cur, &h)?;
        self.move_to(&cur, state, due, finished)
    }

    fn reschedule(
        &mut self,
        owner: Option<&str>,
        id: &str,
        due_at_ms: u64,
        by: &str,
        at_ms: u64,
    ) -> Result<()> {
        let due = ms(due_at_ms, "a due time")?;
        let at = ms(at_ms, "a reschedule's time")?;
        for cur in self.targets(owner, id)? {
            if cur.state.listing() == Some(1) && cur.due_ms != due {
                let mut h = Happened::new(EV_RESCHEDULED, at);
                h.by = Some(by);
                h.from_due_ms = Some(cur.due_ms);
                h.to_due_ms = Some(due);
                self.event(&cur, &h)?;
                self.move_to(&cur, cur.state, due, None)?;
            }
        }
        Ok(())
    }

    fn schedule(&mut self, s: &Scheduled) -> Result<()> {
        check_id(&s.id)?;
        check_user(&s.owner, "a message's owner")?;
        let (ex, rkey) = s.destination.parts();
        if rkey.is_empty() && ex.is_empty() {
            return Err(Error::Invalid(format!(
                "message '{}' has no destination",
                s.id
            )));
        }
        let row = NewRow {
            owner_id: self.names.intern(self.tx, OWNER, &s.owner, "")?,
            destination_id: self.names.intern(self.tx, DESTINATION, ex, rkey)?,
            due_ms: ms(s.due_at_ms, "a due time")?,
            scheduled_ms: ms(s.scheduled_at_ms, "a schedule time")?,
            body_bytes: ms(s.size, "a size")?,
            content_type_id: match &s.content_type {
                Some(c) => Some(self.names.intern(self.tx, CONTENT_TYPE, c, "")?),
                None => None,
            },
            state: if s.confirmed {
                State::Pending
            } else {
                State::Unconfirmed
            },
            headers: (!s.headers.is_empty()).then(|| encode_headers(&s.headers)),
        };
        let sid = StoredId::of(&s.id);
        match self.current_of(row.owner_id, &sid)? {
            None => {
                self.tx
                    .prepare_cached(
                        "INSERT INTO messages (owner_id, message_id, destination_id, due_ms, \
                         scheduled_ms, body_bytes, content_type_id, state, listing, \
                         finished_ms, events, headers, body) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 1, NULL, 0, ?9, ?10)",
                    )?
                    .execute(params![
                        row.owner_id,
                        sid,
                        row.destination_id,
                        row.due_ms,
                        row.scheduled_ms,
                        row.body_bytes,
                        row.content_type_id,
                        row.state.code(),
                        row.headers,
                        s.body
                    ])?;
                let row_id = self.tx.last_insert_rowid();
                let (due, owner, dest) = (row.due_ms, row.owner_id, row.destination_id);
                self.index_headers(row_id, due, owner, dest, &s.headers)
            }
            // the same record again (a replay): only a confirm adds anything
            Some(cur) if cur.scheduled_ms == row.scheduled_ms => {
                if s.confirmed {
                    self.confirm(&cur)?;
                }
                Ok(())
            }
            Some(cur) => self.schedule_again(cur, &row, s),
        }
    }

    /// A new schedule of an id that has a row: both schedules go into the history (the first
    /// one only now, as until here the row itself told it), and the row takes the new fields.
    fn schedule_again(&mut self, mut cur: Current, row: &NewRow, s: &Scheduled) -> Result<()> {
        let has_first: Option<i64> = self
            .tx
            .prepare_cached("SELECT 1 FROM history WHERE row_id = ?1 AND kind = ?2 LIMIT 1")?
            .query_row(params![cur.row_id, EV_SCHEDULED], |r| r.get(0))
            .optional()?;
        if has_first.is_none() {
            let mut h = Happened::new(EV_SCHEDULED, cur.scheduled_ms);
            h.to_due_ms = Some(first_due(self.tx, cur.row_id, cur.due_ms)?);
            self.event(&cur, &h)?;
            cur.events += 1;
        }
        let mut h = Happened::new(EV_SCHEDULED, row.scheduled_ms);
        h.to_due_ms = Some(row.due_ms);
        self.event(&cur, &h)?;
        if cur.state.listing() == Some(1) {
            self.unindex_headers(cur.row_id, cur.due_ms, cur.owner_id, &cur.headers)?;
        }
        self.tx
            .prepare_cached(
                "UPDATE messages SET destination_id = ?2, due_ms = ?3, scheduled_ms = ?4, \
                 body_bytes = ?5, content_type_id = ?6, state = ?7, listing = 1, \
                 finished_ms = NULL, headers = ?8, body = ?9 WHERE row_id = ?1",
            )?
            .execute(params![
                cur.row_id,
                row.destination_id,
                row.due_ms,
                row.scheduled_ms,
                row.body_bytes,
                row.content_type_id,
                row.state.code(),
                row.headers,
                s.body
            ])?;
        self.index_headers(
            cur.row_id,
            row.due_ms,
            row.owner_id,
            row.destination_id,
            &s.headers,
        )
    }

    /// The row of `owner`'s message `id`, or of every owner's when `owner` is `None`.
    fn targets(&mut self, owner: Option<&str>, id: &str) -> Result<Vec<Current>> {
        check_id(id)?;
        let Some(o) = owner else {
            let owners: Vec<i64> = self
                .tx
                .prepare_cached("SELECT name_id FROM names WHERE kind = ?1")?
                .query_map([OWNER], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            let mut v = Vec::new();
            for owner_id in owners {
                v.extend(self.current_of(owner_id, &StoredId::of(id))?);
            }
            return Ok(v);
        };
        Ok(self.current(o, id)?.into_iter().collect())
    }

    fn current(&mut self, owner: &str, id: &str) -> Result<Option<Current>> {
        check_id(id)?;
        match self.names.lookup(self.tx, OWNER, owner, "")? {
            Some(owner_id) => self.current_of(owner_id, &StoredId::of(id)),
            None => Ok(None),
        }
    }

    fn current_of(&self, owner_id: i64, id: &StoredId) -> Result<Option<Current>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT row_id, destination_id, due_ms, scheduled_ms, state, headers, events \
                 FROM messages WHERE owner_id = ?1 AND message_id = ?2",
            )?
            .query_row(params![owner_id, id], |r| {
                let headers: Option<Vec<u8>> = r.get(5)?;
                Ok(Current {
                    row_id: r.get(0)?,
                    owner_id,
                    destination_id: r.get(1)?,
                    due_ms: r.get(2)?,
                    scheduled_ms: r.get(3)?,
                    state: State::of(r.get(4)?),
                    headers: headers.and_then(|b| decode_headers(&b)).unwrap_or_default(),
                    events: r.get(6)?,
                })
            })
            .optional()?)
    }

    /// Appends one history event to `cur` (its `events + 1`-th).
    fn event(&self, cur: &Current, h: &Happened<'_>) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO history (row_id, seq, kind, at_ms, by_user, lateness_ms, \
                 from_due_ms, to_due_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                cur.row_id,
                cur.events + 1,
                h.kind,
                h.at_ms,
                h.by,
                h.lateness_ms,
                h.from_due_ms,
                h.to_due_ms
            ])?;
        self.tx
            .prepare_cached("UPDATE messages SET events = events + 1 WHERE row_id = ?1")?
            .execute([cur.row_id])?;
        Ok(())
    }

    /// Moves `cur` to `state` and `due_ms`, keeping the listing and header indexes in step.
    fn move_to(
        &self,
        cur: &Current,
        state: State,
        due_ms: i64,
        finished_ms: Option<i64>,
    ) -> Result<()> {
        let was = cur.state.listing() == Some(1);
        let is = state.listing() == Some(1);
        if was && (!is || due_ms != cur.due_ms) {
            self.unindex_headers(cur.row_id, cur.due_ms, cur.owner_id, &cur.headers)?;
        }
        self.tx
            .prepare_cached(
                "UPDATE messages SET state = ?2, listing = ?3, due_ms = ?4, finished_ms = ?5 \
                 WHERE row_id = ?1",
            )?
            .execute(params![
                cur.row_id,
                state.code(),
                state.listing(),
                due_ms,
                finished_ms
            ])?;
        if is && (!was || due_ms != cur.due_ms) {
            let (id, owner, dest) = (cur.row_id, cur.owner_id, cur.destination_id);
            self.index_headers(id, due_ms, owner, dest, &cur.headers)?;
        }
        Ok(())
    }

    /// The header index's keys of `headers`: the indexed names' pairs, once each.
    pub(super) fn hashes(&self, headers: &[(String, String)]) -> Vec<i64> {
        let mut h: Vec<i64> = headers
            .iter()
            .filter(|(k, _)| indexed(self.indexed_headers, k))
            .map(|(k, v)| header_hash(k, v))
            .collect();
        h.sort_unstable();
        h.dedup();
        h
    }

    fn index_headers(
        &self,
        row_id: i64,
        due_ms: i64,
        owner_id: i64,
        destination_id: i64,
        headers: &[(String, String)],
    ) -> Result<()> {
        if self.rebuilding {
            return Ok(());
        }
        for h in self.hashes(headers) {
            self.tx
                .prepare_cached(
                    "INSERT OR IGNORE INTO header_index (header_hash, due_ms, owner_id, row_id, \
                     destination_id) VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![h, due_ms, owner_id, row_id, destination_id])?;
        }
        Ok(())
    }

    pub(super) fn unindex_headers(
        &self,
        row_id: i64,
        due_ms: i64,
        owner_id: i64,
        headers: &[(String, String)],
    ) -> Result<()> {
        if self.rebuilding {
            return Ok(());
        }
        for h in self.hashes(headers) {
            self.tx
                .prepare_cached(
                    "DELETE FROM header_index WHERE header_hash = ?1 AND due_ms = ?2 \
                     AND owner_id = ?3 AND row_id = ?4",
                )?
                .execute(params![h, due_ms, owner_id, row_id])?;
        }
        Ok(())
    }
}

/// The fields of a schedule as stored.
struct NewRow {
    owner_id: i64,
    destination_id: i64,
    due_ms: i64,
    scheduled_ms: i64,
    body_bytes: i64,
    content_type_id: Option<i64>,
    state: State,
    headers: Option<Vec<u8>>,
}
