//! The first page's summary per viewer, made off the request path. A summary is one pass
//! over the viewer's entries of the index: under a millisecond at thousands, a second or two at
//! ten million. A summary stays fresh for [`FRESH`], or five times as long as it took to make,
//! whichever is longer, so a large index is not scanned back to back. Past that, a page asks
//! for a new one: when the last one took under [`QUICK`] it waits for it (at most [`WAIT`]);
//! otherwise it shows the last one at once, with its age, while the new one is made in the
//! background. The very first waits at most [`WAIT`], then shows a "counting" note. At most
//! [`MAX_VIEWERS`] viewers' summaries are kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};

use super::store::{Store, StoreError};
use crate::pending_index::{Summary, Viewer};

/// How long a page waits for a summary being made.
pub const WAIT: Duration = Duration::from_millis(150);
/// A summary made faster than this is waited for; a slower one is shown stale meanwhile.
pub const QUICK: Duration = Duration::from_millis(20);
/// How long a summary is shown without being made again, at least.
pub const FRESH: Duration = Duration::from_secs(2);
/// Viewers whose summaries are kept at most.
pub const MAX_VIEWERS: usize = 256;

type Making = Shared<BoxFuture<'static, Result<Arc<Summary>, StoreError>>>;

struct Made {
    summary: Arc<Summary>,
    at: Instant,
    took: Duration,
}

/// A summary as a page shows it.
pub struct Shown {
    /// The summary.
    pub summary: Arc<Summary>,
    /// How old it is.
    pub age: Duration,
}

/// The summaries of the viewers.
pub struct Summaries {
    store: Store,
    state: Arc<Mutex<State>>,
}

/// A viewer as a key: `None` for an admin, else the user.
type Key = Option<String>;

fn key(v: &Viewer) -> Key {
    match v {
        Viewer::Admin => None,
        Viewer::User(u) => Some(u.clone()),
    }
}

#[derive(Default)]
struct State {
    made: HashMap<Key, Made>,
    making: HashMap<Key, Making>,
}

impl Summaries {
    /// No summary yet.
    pub fn new(store: Store) -> Summaries {
        Summaries {
            store,
            state: Arc::default(),
        }
    }

    /// `viewer`'s summary: a fresh one, or the last one made while a new one is under way,
    /// or `None` while the first is being made. `Err` when making it failed.
    pub async fn get(&self, viewer: &Viewer) -> Result<Option<Shown>, StoreError> {
        let k = key(viewer);
        let making = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let mut stale = None;
            if let Some(m) = st.made.get(&k) {
                let shown = Shown {
                    summary: m.summary.clone(),
                    age: m.at.elapsed(),
                };
                if shown.age < FRESH.max(m.took * 5) {
                    return Ok(Some(shown));
                }
                if m.took >= QUICK {
                    stale = Some(shown);
                }
            }
            if !st.making.contains_key(&k) {
                let f = self.make(viewer.clone());
                st.making.insert(k.clone(), f);
            }
            if stale.is_some() {
                // a large index: the new one is made in the background
                return Ok(stale);
            }
            st.making.get(&k).cloned().expect("inserted above")
        };
        match tokio::time::timeout(WAIT, making).await {
            Ok(Ok(summary)) => Ok(Some(Shown {
                summary,
                age: Duration::ZERO,
            })),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                Ok(st.made.get(&k).map(|m| Shown {
                    summary: m.summary.clone(),
                    age: m.at.elapsed(),
                }))
            }
        }
    }

    /// Starts making `viewer`'s summary in a task of its own (it finishes whoever waits).
    fn make(&self, viewer: Viewer) -> Making {
        let store = self.store.clone();
        let state = self.state.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let v = viewer.clone();
            let k = key(&viewer);
            let r = store
                .read_summary(move |ix| ix.summary(&v, amqp_delay::time::now_ms()))
                .await
                .map(Arc::new);
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            st.making.remove(&k);
            if let Ok(s) = &r {
                tracing::debug!(
                    took_ms = started.elapsed().as_millis() as u64,
                    destinations = s.destinations.len(),
                    "console: summary made"
                );
                if st.made.len() >= MAX_VIEWERS && !st.made.contains_key(&k) {
                    st.made.clear();
                }
                st.made.insert(
                    k,
                    Made {
                        summary: s.clone(),
                        at: started,
                        took: started.elapsed(),
                    },
                );
            }
            r
        });
        async move {
            task.await
                .unwrap_or_else(|e| Err(StoreError::Failed(format!("making the summary: {e}"))))
        }
        .boxed()
        .shared()
    }
}
