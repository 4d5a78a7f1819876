//! The index's schema: versioned migrations (`migrations/*.sql`, in order, through
//! `rusqlite_migration`, which keeps the version in `PRAGMA user_version`) run when the file
//! opens, and the codes the SQL stores.
//!
//! The index is a cache of the streams. A file written before the schema lived in migrations
//! (tables `records` and `hdr`, columns `rk, own, lst, fin, nev, x, y`) is not migrated: it is
//! emptied, said in a log line, and filled again by the follower from the streams' start, as a
//! new index is. A file of a later schema than this build knows is refused.

use std::path::Path;

use rusqlite::Connection;
use rusqlite_migration::{M, Migrations};

use super::{Error, Options, Result, file};

/// The listing indexes (pages, counts, purges and summaries read them): the second migration,
/// and what a rebuild sorts again.
pub(super) const LISTING_INDEXES: &str = include_str!("migrations/002_listing_indexes.sql");

/// The schema, oldest first: a migration is never edited once released, only added.
fn migrations() -> Migrations<'static> {
    Migrations::new(vec![
        M::up(include_str!("migrations/001_messages.sql")),
        M::up(LISTING_INDEXES),
    ])
}

// `names.kind`
pub(super) const OWNER: i64 = 0;
pub(super) const CONTENT_TYPE: i64 = 1;
pub(super) const DESTINATION: i64 = 2;

// `history.kind`
pub(super) const EV_SCHEDULED: i64 = 0;
pub(super) const EV_RESCHEDULED: i64 = 1;
pub(super) const EV_CANCELLED: i64 = 2;
pub(super) const EV_DONE: i64 = 3;
pub(super) const EV_RETRIED: i64 = 4;
pub(super) const EV_PARKED: i64 = 5;

/// Opens the file at `path` ([`file::open`]), sets the connection up for `options` and brings
/// the schema to this build's.
pub(super) fn open(path: &Path, options: &Options) -> Result<Connection> {
    let mut conn = file::open(path)?;
    let cache_kib = (options.cache_bytes / 1024).max(64);
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = {};
         PRAGMA cache_size = -{cache_kib};
         PRAGMA mmap_size = 0;
         PRAGMA temp_store = FILE;
         PRAGMA journal_size_limit = 67108864;
         PRAGMA soft_heap_limit = {};",
        if options.durable { "NORMAL" } else { "OFF" },
        options.cache_bytes + (16 << 20),
    ))?;
    conn.set_prepared_statement_cache_capacity(64);
    if is_unversioned_layout(&conn)? {
        tracing::warn!(
            path = %path.display(),
            "pending index: the file has the layout of an older version; emptying it, the \
             follower rebuilds it from the streams"
        );
        empty(&conn)?;
    }
    migrations().to_latest(&mut conn).map_err(|e| {
        Error::Store(format!(
            "{}: {e} (an index of a later version? delete the file and let the index rebuild \
             from the journal)",
            path.display()
        ))
    })?;
    Ok(conn)
}

/// Whether the file holds the layout written before migrations (a `records` table).
fn is_unversioned_layout(conn: &Connection) -> Result<bool> {
    let n: i64 = conn.query_row(
        "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN ('records', 'hdr')",
        [],
        |r| r.get(0),
    )?;
    Ok(n > 0)
}

/// Drops every table (their indexes go with them) and sets the version back to none, in one
/// transaction.
fn empty(conn: &Connection) -> Result<()> {
    let tables: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
        )?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut sql = String::from("BEGIN IMMEDIATE;");
    for t in tables {
        sql.push_str(&format!(
            "DROP TABLE IF EXISTS \"{}\";",
            t.replace('"', "\"\"")
        ));
    }
    sql.push_str("PRAGMA user_version = 0; COMMIT;");
    conn.execute_batch(&sql)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_migrations_are_valid() {
        assert!(super::migrations().validate().is_ok());
    }
}
