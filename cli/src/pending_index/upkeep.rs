//! Keeping the index: a rebuild from the journal's start (rows appended without the listing
//! and header indexes, which are then sorted into place) and expiry of what finished.

use rusqlite::{Connection, OptionalExtension, params};

use super::codec::decode_headers;
use super::schema::LISTING_INDEXES;
use super::write::Writer;
use super::{Error, PendingIndex, Result, ms};

/// Rows [`PendingIndex::expire`] removes per transaction.
const EXPIRE_CHUNK: usize = 50_000;

/// Whether the file at `conn` says a rebuild is under way.
pub(super) fn rebuilding_in(conn: &Connection) -> Result<bool> {
    let r: Option<i64> = conn
        .query_row("SELECT value FROM meta WHERE key = 'rebuilding'", [], |r| {
            r.get(0)
        })
        .optional()?;
    Ok(r.is_some())
}

/// A row expiry removes: its key, owner, due time and headers (for the header index).
type Victim = (i64, i64, i64, Option<Vec<u8>>);

impl PendingIndex {
    /// Starts a rebuild from the journal's start (on an empty index, or one to be refilled):
    /// drops the listing indexes and empties the header index, so that applying is appending
    /// rows. `list` and `count` refuse until [`PendingIndex::finish_rebuild`]; `show` works.
    /// The state is in the file: a follower that restarts mid-rebuild is still rebuilding.
    pub fn begin_rebuild(&mut self) -> Result<()> {
        let tx = self.conn.transaction()?;
        tx.execute_batch(
            "DROP INDEX IF EXISTS by_dest; DROP INDEX IF EXISTS by_owner;
             DROP INDEX IF EXISTS by_due; DELETE FROM header_index;
             INSERT OR REPLACE INTO meta (key, value) VALUES ('rebuilding', 1);",
        )?;
        tx.commit()?;
        self.rebuilding = true;
        Ok(())
    }

    /// Ends a rebuild, once the follower has caught up with the journal: sorts the listing
    /// indexes and the header index into place, each in one pass.
    pub fn finish_rebuild(&mut self) -> Result<()> {
        if !self.rebuilding {
            return Ok(());
        }
        // The sorts take as much memory as the page cache is allowed: halve the cache meanwhile,
        // so the two together stay within `cache_bytes`.
        let cache: i64 = self.conn.query_row("PRAGMA cache_size", [], |r| r.get(0))?;
        self.conn
            .execute_batch(&format!("PRAGMA cache_size = {};", cache / 2))?;
        let result = self.sort_indexes();
        self.conn
            .execute_batch(&format!("PRAGMA cache_size = {cache};"))?;
        result?;
        // the rebuild's last transaction went to the WAL whole: give the space back
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        self.rebuilding = false;
        Ok(())
    }

    fn sort_indexes(&mut self) -> Result<()> {
        let tx = self.conn.transaction()?;
        // a temporary table: its pages live in a temporary file, not as free pages of the index
        tx.execute_batch(
            "DROP TABLE IF EXISTS temp.header_stage;
             CREATE TEMP TABLE header_stage (header_hash INTEGER, due_ms INTEGER,
                 owner_id INTEGER, row_id INTEGER, destination_id INTEGER);",
        )?;
        {
            let w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: false,
            };
            let mut read = tx.prepare(
                "SELECT row_id, owner_id, due_ms, destination_id, headers FROM messages \
                 WHERE listing = 1 AND headers IS NOT NULL",
            )?;
            let mut rows = read.query([])?;
            let mut put = tx.prepare(
                "INSERT INTO header_stage (header_hash, due_ms, owner_id, row_id, destination_id) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            while let Some(r) = rows.next()? {
                let (row_id, owner_id, due_ms, destination_id): (i64, i64, i64, i64) =
                    (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?);
                let b: Vec<u8> = r.get(4)?;
                for h in w.hashes(&decode_headers(&b).unwrap_or_default()) {
                    put.execute(params![h, due_ms, owner_id, row_id, destination_id])?;
                }
            }
        }
        tx.execute_batch(&format!(
            "DELETE FROM header_index;
             INSERT INTO header_index (header_hash, due_ms, owner_id, row_id, destination_id)
                 SELECT header_hash, due_ms, owner_id, row_id, destination_id FROM header_stage
                 ORDER BY header_hash, due_ms, owner_id, row_id;
             DROP TABLE temp.header_stage;
             {LISTING_INDEXES}
             DELETE FROM meta WHERE key = 'rebuilding';"
        ))?;
        tx.commit()?;
        Ok(())
    }

    /// Whether a rebuild is under way ([`PendingIndex::begin_rebuild`]).
    pub fn rebuilding(&self) -> bool {
        self.rebuilding
    }

    /// Whether a rebuild is under way now, as the file says: another connection (the
    /// follower's) may have begun or finished one since this one opened.
    pub fn rebuilding_now(&mut self) -> Result<bool> {
        self.rebuilding = rebuilding_in(&self.conn)?;
        Ok(self.rebuilding)
    }

    pub(super) fn check_not_rebuilding(&self) -> Result<()> {
        if self.rebuilding {
            return Err(Error::Store(
                "the index is being rebuilt from the journal; pages and counts come back when \
                 it has caught up"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Removes what finished (cancelled or done) before `now_ms - window_ms`, and intents never
    /// confirmed whose due time is that old; returns how many. Parked messages stay until they
    /// leave their parking queue. Works in transactions of [`EXPIRE_CHUNK`] rows.
    pub fn expire(&mut self, window_ms: u64, now_ms: u64) -> Result<u64> {
        let cut = ms(now_ms, "now")?.saturating_sub(ms(window_ms, "the history window")?);
        let mut removed = 0u64;
        loop {
            let tx = self.conn.transaction()?;
            let victims = expired(&tx, cut)?;
            let w = Writer {
                tx: &tx,
                names: &mut self.names,
                indexed_headers: self.indexed_headers.as_deref(),
                rebuilding: self.rebuilding,
            };
            for (row_id, owner_id, due_ms, headers) in &victims {
                if let Some(b) = headers {
                    let headers = decode_headers(b).unwrap_or_default();
                    w.unindex_headers(*row_id, *due_ms, *owner_id, &headers)?;
                }
                tx.prepare_cached("DELETE FROM history WHERE row_id = ?1")?
                    .execute([row_id])?;
                tx.prepare_cached("DELETE FROM messages WHERE row_id = ?1")?
                    .execute([row_id])?;
            }
            tx.commit()?;
            removed += victims.len() as u64;
            if victims.len() < EXPIRE_CHUNK {
                return Ok(removed);
            }
        }
    }
}

/// Up to [`EXPIRE_CHUNK`] rows finished before `cut`, then intents due before it.
fn expired(tx: &Connection, cut: i64) -> Result<Vec<Victim>> {
    let victim = |r: &rusqlite::Row<'_>| -> rusqlite::Result<Victim> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    };
    let mut v: Vec<Victim> = tx
        .prepare_cached(
            "SELECT row_id, owner_id, due_ms, NULL FROM messages INDEXED BY by_fin \
             WHERE finished_ms < ?1 LIMIT ?2",
        )?
        .query_map(params![cut, EXPIRE_CHUNK as i64], victim)?
        .collect::<rusqlite::Result<_>>()?;
    let left = EXPIRE_CHUNK - v.len();
    if left > 0 {
        v.extend(
            tx.prepare_cached(
                "SELECT row_id, owner_id, due_ms, headers FROM messages INDEXED BY by_unconfirmed \
                 WHERE state = 0 AND due_ms < ?1 LIMIT ?2",
            )?
            .query_map(params![cut, left as i64], victim)?
            .collect::<rusqlite::Result<Vec<_>>>()?,
        );
    }
    Ok(v)
}
