//! A purge: every pending message of one destination that matches a filter, cancelled in one
//! transaction whatever their number. The rows are chosen by one range read of the destination
//! (what a purge always names), kept in a temporary table, and then changed by a few set
//! statements over that table; only the header index is maintained row by row (its keys are
//! hashes the SQL cannot compute), by primary key. Memory stays bounded: the chosen rows live
//! in the temporary file, never in a `Vec`.

use rusqlite::params;

use super::codec::decode_headers;
use super::{DESTINATION, Destination, EV_CANCELLED, OWNER, Result, State, Writer, check_user, ms};

/// What a purge record covers, as its reader decided (the owner follows the writer's rights:
/// `amqp_delay::ops::control::Record::Purge`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purge {
    /// Whose messages (`None`: everyone's, an admin's purge).
    pub owner: Option<String>,
    /// Only this destination.
    pub destination: Destination,
    /// Only due strictly after (ms since the epoch).
    pub due_after_ms: Option<u64>,
    /// Only due strictly before (ms since the epoch).
    pub due_before_ms: Option<u64>,
    /// Only with this user header `(key, value)`.
    pub header: Option<(String, String)>,
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
        let due_after = p.due_after_ms.map(|v| ms(v, "due_after")).transpose()?;
        let due_before = p.due_before_ms.map(|v| ms(v, "due_before")).transpose()?;
        let (ex, rkey) = p.destination.parts();
        let Some(dest) = self.names.lookup(self.tx, DESTINATION, ex, rkey)? else {
            return Ok(0);
        };
        let own = match &p.owner {
            Some(o) => match self.names.lookup(self.tx, OWNER, o, "")? {
                Some(n) => Some(n),
                None => return Ok(0),
            },
            None => None,
        };
        self.tx.execute_batch(
            "DROP TABLE IF EXISTS temp.purged;
             CREATE TEMP TABLE purged (rk INTEGER PRIMARY KEY, own INTEGER, due INTEGER, hdrs BLOB);",
        )?;
        let n = self.choose(
            dest,
            own,
            due_after,
            due_before,
            sched_before,
            p.header.as_ref(),
        )?;
        if n > 0 {
            self.unindex_headers()?;
            self.tx
                .prepare(
                    "INSERT INTO history (rk, n, kind, at, by, x, y) \
                     SELECT r.rk, r.nev + 1, ?1, ?2, ?3, NULL, NULL \
                     FROM temp.purged t CROSS JOIN records r ON r.rk = t.rk",
                )?
                .execute(params![EV_CANCELLED, at, p.by])?;
            self.tx
                .prepare(
                    "UPDATE records SET nev = nev + 1, state = ?1, lst = NULL, fin = ?2 \
                     WHERE rk IN (SELECT rk FROM temp.purged)",
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
        // `lst = 1` (pending or unconfirmed) and the destination: a range of its listing
        // index (the other bounds are added only when given, so that they narrow the range)
        let mut sql = "SELECT rk, own, due, hdrs FROM records WHERE lst = 1 AND dest = :dest \
                       AND sched < :sb"
            .to_string();
        let mut p: Vec<(&str, i64)> = vec![(":dest", dest), (":sb", sched_before)];
        for (cond, name, v) in [
            (" AND own = :own", ":own", own),
            (" AND due > :da", ":da", due_after),
            (" AND due < :db", ":db", due_before),
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
        let mut put = self
            .tx
            .prepare("INSERT INTO temp.purged (rk, own, due, hdrs) VALUES (?1, ?2, ?3, ?4)")?;
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
    fn unindex_headers(&self) -> Result<()> {
        let mut read = self
            .tx
            .prepare("SELECT rk, own, due, hdrs FROM temp.purged WHERE hdrs IS NOT NULL")?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let (rk, own, due): (i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            let b: Vec<u8> = r.get(3)?;
            self.hdr_remove(rk, due, own, &decode_headers(&b).unwrap_or_default())?;
        }
        Ok(())
    }
}
