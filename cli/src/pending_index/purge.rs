//! A purge: every pending message of one destination that matches a filter, cancelled in one
//! transaction whatever their number. The rows are chosen by one range read of the destination
//! (what a purge always names), kept in a temporary table, and then changed by a few set
//! statements over that table; only the header index is maintained row by row (its keys are
//! hashes the SQL cannot compute), by primary key. Memory stays bounded: the chosen rows live
//! in the temporary file, never in a `Vec`.

use amqp_delay::ops::control::PurgeScope;
use rusqlite::params;

use super::codec::decode_headers;
use super::schema::{DESTINATION, EV_CANCELLED, OWNER};
use super::write::Writer;
use super::{Result, State, check_user, ms};

/// A purge record as the index applies it: its scope with the owner its reader decided (the
/// writer's rights: `amqp_delay::ops::control::Record::Purge`), when and by whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purge {
    /// What it covers: the destination queue, due range and header as asked; the owner as
    /// believed (`None`: everyone's, an admin's purge).
    pub scope: PurgeScope,
    /// Only what was scheduled strictly before this (ms since the epoch): what was scheduled
    /// after the purge was recorded is not covered.
    pub scheduled_before_ms: u64,
    /// Who purged.
    pub by: String,
    /// When (ms since the epoch).
    pub at_ms: u64,
}

impl Writer<'_> {
    /// Cancels every pending (or unconfirmed) row `p` covers; how many.
    pub(super) fn purge(&mut self, p: &Purge) -> Result<u64> {
        check_user(&p.by, "a purge's writer")?;
        let at = ms(p.at_ms, "a purge's time")?;
        let sched_before = ms(p.scheduled_before_ms, "a purge's schedule bound")?;
        let scope = &p.scope;
        let due_after = scope.due_after_ms.map(|v| ms(v, "due_after")).transpose()?;
        let due_before = scope
            .due_before_ms
            .map(|v| ms(v, "due_before"))
            .transpose()?;
        let Some(dest) = self.names.lookup(self.tx, DESTINATION, "", &scope.queue)? else {
            return Ok(0);
        };
        let own = match &scope.owner {
            Some(o) => match self.names.lookup(self.tx, OWNER, o, "")? {
                Some(n) => Some(n),
                None => return Ok(0),
            },
            None => None,
        };
        self.tx.execute_batch(
            "DROP TABLE IF EXISTS temp.purged;
             CREATE TEMP TABLE purged (row_id INTEGER PRIMARY KEY, owner_id INTEGER,
                 due_ms INTEGER, headers BLOB);",
        )?;
        let n = self.choose(
            dest,
            own,
            due_after,
            due_before,
            sched_before,
            scope.header.as_ref(),
        )?;
        if n > 0 {
            self.unindex_purged()?;
            self.tx
                .prepare(
                    "INSERT INTO history (row_id, seq, kind, at_ms, by_user) \
                     SELECT r.row_id, r.events + 1, ?1, ?2, ?3 \
                     FROM temp.purged t CROSS JOIN messages r ON r.row_id = t.row_id",
                )?
                .execute(params![EV_CANCELLED, at, p.by])?;
            self.tx
                .prepare(
                    "UPDATE messages SET events = events + 1, state = ?1, listing = NULL, \
                     finished_ms = ?2 WHERE row_id IN (SELECT row_id FROM temp.purged)",
                )?
                .execute(params![State::Cancelled.code(), at])?;
        }
        self.tx.execute_batch("DROP TABLE temp.purged;")?;
        Ok(n)
    }

    /// Fills `temp.purged` with the rows covered; how many.
    fn choose(
        &self,
        dest: i64,
        own: Option<i64>,
        due_after: Option<i64>,
        due_before: Option<i64>,
        sched_before: i64,
        header: Option<&(String, String)>,
    ) -> Result<u64> {
        // `listing = 1` (pending or unconfirmed) and the destination: a range of its listing
        // index (the other bounds are added only when given, so that they narrow the range)
        let mut sql = "SELECT row_id, owner_id, due_ms, headers FROM messages \
                       WHERE listing = 1 AND destination_id = :dest AND scheduled_ms < :sb"
            .to_string();
        let mut p: Vec<(&str, i64)> = vec![(":dest", dest), (":sb", sched_before)];
        for (cond, name, v) in [
            (" AND owner_id = :own", ":own", own),
            (" AND due_ms > :da", ":da", due_after),
            (" AND due_ms < :db", ":db", due_before),
        ] {
            if let Some(v) = v {
                sql.push_str(cond);
                p.push((name, v));
            }
        }
        let bound: Vec<(&str, &dyn rusqlite::ToSql)> = p
            .iter()
            .map(|(n, v)| (*n, v as &dyn rusqlite::ToSql))
            .collect();
        let mut read = self.tx.prepare(&sql)?;
        let mut rows = read.query(&*bound)?;
        let mut put = self.tx.prepare(
            "INSERT INTO temp.purged (row_id, owner_id, due_ms, headers) VALUES (?1, ?2, ?3, ?4)",
        )?;
        let mut n = 0u64;
        while let Some(r) = rows.next()? {
            let hdrs: Option<Vec<u8>> = r.get(3)?;
            if let Some(h) = header {
                let has = hdrs
                    .as_deref()
                    .and_then(decode_headers)
                    .is_some_and(|hs| hs.contains(h));
                if !has {
                    continue;
                }
            }
            let (rk, o, due): (i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            put.execute(params![rk, o, due, hdrs])?;
            n += 1;
        }
        Ok(n)
    }

    /// Removes the header index's entries of every row in `temp.purged`.
    fn unindex_purged(&self) -> Result<()> {
        let mut read = self.tx.prepare(
            "SELECT row_id, owner_id, due_ms, headers FROM temp.purged WHERE headers IS NOT NULL",
        )?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let (rk, own, due): (i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            let b: Vec<u8> = r.get(3)?;
            self.unindex_headers(rk, due, own, &decode_headers(&b).unwrap_or_default())?;
        }
        Ok(())
    }
}
