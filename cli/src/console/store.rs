//! The console's reads of the pending index: two connections to the file (SQLite in WAL mode
//! lets them read while a follower writes), one for pages and one for summaries, so that a
//! summary that scans millions of entries never holds a page up. Each is used on a blocking
//! thread behind its own lock; their page caches share [`super::Config::cache_bytes`].

use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::pending_index::{self, Options, PendingIndex};

/// What a read of the index can fail with.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// The request is invalid (the index said why).
    Invalid(String),
    /// The follower is rebuilding the index from the journal: lists and counts wait for it.
    Rebuilding,
    /// The index could not answer.
    Failed(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Invalid(m) | StoreError::Failed(m) => f.write_str(m),
            StoreError::Rebuilding => f.write_str(
                "the index is being rebuilt from the journal; pages come back when it has caught up",
            ),
        }
    }
}

impl From<pending_index::Error> for StoreError {
    fn from(e: pending_index::Error) -> StoreError {
        match e {
            pending_index::Error::Invalid(m) => StoreError::Invalid(m),
            e => StoreError::Failed(e.to_string()),
        }
    }
}

/// The index, as the console reads it.
#[derive(Clone)]
pub struct Store {
    pages: Arc<Mutex<PendingIndex>>,
    summaries: Arc<Mutex<PendingIndex>>,
}

impl Store {
    /// Opens `path` twice (creating it when missing), the caches splitting `cache_bytes`: a
    /// quarter for pages (a page reads ~100 rows), the rest for the summaries' scans.
    pub fn open(path: &Path, cache_bytes: u64) -> amqp_delay::Result<Store> {
        let open = |bytes: u64| {
            PendingIndex::open(
                path,
                Options {
                    cache_bytes: bytes,
                    durable: true,
                    indexed_headers: None,
                },
            )
            .map_err(|e| super::config(format!("the pending index {}: {e}", path.display())))
        };
        let pages = open(cache_bytes / 4)?;
        // the last open sets SQLite's process-wide soft heap limit: the larger share
        let summaries = open(cache_bytes - cache_bytes / 4)?;
        Ok(Store {
            pages: Arc::new(Mutex::new(pages)),
            summaries: Arc::new(Mutex::new(summaries)),
        })
    }

    /// Runs `f` on the pages' connection, on a blocking thread.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut PendingIndex) -> pending_index::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        run(self.pages.clone(), f).await
    }

    /// Runs `f` on the summaries' connection, on a blocking thread.
    pub async fn read_summary<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut PendingIndex) -> pending_index::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        run(self.summaries.clone(), f).await
    }
}

async fn run<T: Send + 'static>(
    ix: Arc<Mutex<PendingIndex>>,
    f: impl FnOnce(&mut PendingIndex) -> pending_index::Result<T> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(move || {
        let mut guard = ix.lock().unwrap_or_else(|e| e.into_inner());
        // the follower's connection begins and ends rebuilds: this one learns it here
        if guard.rebuilding_now()? {
            return Ok(Err(StoreError::Rebuilding));
        }
        f(&mut guard).map(Ok)
    })
    .await
    .map_err(|e| StoreError::Failed(format!("reading the pending index: {e}")))?
    .map_err(StoreError::from)?
}
