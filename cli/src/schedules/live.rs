//! One book of the control stream's schedules that a server (`pending serve`, `delay-console`)
//! keeps live: read once, then followed record by record, so that a list of 100,000 is a walk
//! of memory, not a replay of the stream.
//!
//! Each answer is fresh: [`Live::view`] first appends a barrier on the follower's connection
//! and waits (at most [`SYNC_TIMEOUT`]) until the follower has read it, so whatever was
//! confirmed before the question (an add through the API, or the CLI's) is in the answer.
//! Questions share barriers: one is in flight at a time, and a question is answered by the
//! first barrier appended after it was asked, so however many come at once they append at
//! most one barrier per round trip of the stream, not one each. A
//! lost connection is followed again from the last record applied; a read that loses its
//! connection on a record over `frame_max` is read again past it (as [`super::view`] does).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::control::{self, Record, Start};
use amqp_delay::ops::trust::Trust;
use amqp_delay::recurring::Book;
use amqp_delay::settings::Settings;
use amqp_delay::{Error, Result};
use lapin::Connection;
use tokio::sync::{RwLock, RwLockReadGuard, watch};

use super::View;

/// How long an answer waits for the book to catch up with the stream.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the follower waits before it connects again after losing its connection.
const RETRY: Duration = Duration::from_secs(1);

/// A live book and its follower (started by [`Live::start`], or by the first question); the
/// follower ends when the `Live` is dropped.
pub struct Live {
    shared: Arc<Shared>,
    settings: Settings,
    started: AtomicBool,
    stop: watch::Sender<bool>,
    /// When the last barrier that was read back was appended; held while one is in flight.
    synced: tokio::sync::Mutex<Option<Instant>>,
    /// Barriers appended so far.
    barriers: std::sync::atomic::AtomicU64,
}

struct Shared {
    book: RwLock<Book>,
    state: Mutex<State>,
    /// Bumped after each record applied and each (re)connection.
    moved: watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    /// The follower's connection, once its book is read (barriers are appended on it).
    conn: Option<Arc<Connection>>,
    /// The offset of the last record applied (or of the barrier the first read ended at).
    at: Option<u64>,
    /// Why the follower is not following now.
    error: Option<String>,
    /// The barriers answers wait for: whether each was read.
    waiting: HashMap<String, bool>,
}

impl Live {
    /// A book of the control stream of `settings`' prefix, followed as its user.
    pub fn new(settings: Settings) -> Live {
        Live {
            shared: Arc::new(Shared {
                book: RwLock::new(Book::default()),
                state: Mutex::new(State::default()),
                moved: watch::channel(0).0,
            }),
            settings,
            started: AtomicBool::new(false),
            stop: watch::channel(false).0,
            synced: tokio::sync::Mutex::new(None),
            barriers: Default::default(),
        }
    }

    /// How many barriers this book has appended to the control stream.
    pub fn barriers(&self) -> u64 {
        self.barriers.load(Ordering::Relaxed)
    }

    /// Starts the follower (once; in a tokio runtime).
    pub fn start(&self) {
        if self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        let (shared, settings) = (self.shared.clone(), self.settings.clone());
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                () = follow(&shared, &settings) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
            shared.state().conn = None;
        });
    }

    /// The book as `user` (logged in) sees it, caught up with everything the stream held
    /// when asked.
    pub async fn view(&self, user: &str) -> Result<View<RwLockReadGuard<'_, Book>>> {
        self.sync().await?;
        Ok(View {
            book: self.shared.book.read().await,
            user: user.to_string(),
            trust: Trust::new(Some(user.to_string()), &self.settings.trust),
        })
    }

    /// Waits until the follower has read a barrier appended after now (its own, or one that
    /// another question appended meanwhile), at most [`SYNC_TIMEOUT`] in all.
    pub async fn sync(&self) -> Result<()> {
        self.start();
        let asked = Instant::now();
        match tokio::time::timeout(SYNC_TIMEOUT, self.sync_after(asked)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                context: format!(
                    "the schedules this server follows did not catch up with the control \
                     stream ({})",
                    self.shared
                        .state()
                        .error
                        .clone()
                        .as_deref()
                        .unwrap_or("still reading it")
                ),
                timeout_ms: SYNC_TIMEOUT.as_millis() as u64,
            }),
        }
    }

    /// One barrier at a time: a question that waited for another's uses it when it was
    /// appended after the question was asked.
    async fn sync_after(&self, asked: Instant) -> Result<()> {
        let mut last = self.synced.lock().await;
        if last.is_some_and(|appended| appended >= asked) {
            return Ok(());
        }
        let appended = Instant::now();
        let nonce = uuid::Uuid::now_v7().to_string();
        let mut moved = self.shared.moved.subscribe();
        let waiting = Waiting::new(&self.shared, nonce);
        self.wait_for(&waiting.0, &mut moved).await?;
        *last = Some(appended);
        Ok(())
    }

    async fn wait_for(&self, nonce: &str, moved: &mut watch::Receiver<u64>) -> Result<()> {
        let layout = self.settings.layout()?;
        let mut appended = false;
        loop {
            let conn = {
                let s = self.shared.state();
                if s.waiting.get(nonce) == Some(&true) {
                    return Ok(());
                }
                s.conn.clone()
            };
            if let (false, Some(conn)) = (appended, conn) {
                let barrier = Record::Barrier {
                    nonce: nonce.to_string(),
                };
                control::append(&conn, &layout, &barrier).await?;
                self.barriers.fetch_add(1, Ordering::Relaxed);
                appended = true;
                continue;
            }
            if moved.changed().await.is_err() {
                return Err(Error::Stopped("the schedules' follower ended".into()));
            }
        }
    }
}

/// A barrier's nonce that the follower marks when it reads it; forgotten when dropped (also
/// when the question timed out).
struct Waiting<'a>(String, &'a Shared);

impl<'a> Waiting<'a> {
    fn new(shared: &'a Shared, nonce: String) -> Waiting<'a> {
        shared.state().waiting.insert(nonce.clone(), false);
        Waiting(nonce, shared)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.1.state().waiting.remove(&self.0);
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn moved(&self) {
        self.moved.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Follows the stream until dropped, connecting again after each loss.
async fn follow(shared: &Shared, settings: &Settings) {
    loop {
        let e = match Connector::new(settings) {
            Ok(c) => match c.connect("amqp-delay schedules").await {
                Ok(conn) => {
                    let conn = Arc::new(conn);
                    let e = follow_on(shared, settings, &conn).await;
                    shared.state().conn = None;
                    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
                    e
                }
                Err(e) => e,
            },
            Err(e) => e,
        };
        let why = amqp_delay::error_chain(&e);
        tracing::warn!("following the schedules: {why}; connecting again");
        shared.state().error = Some(why);
        shared.moved();
        tokio::time::sleep(RETRY).await;
    }
}

/// One connection's following: the whole stream read first (when nothing was), then each
/// record as it comes. Ends with why it stopped.
async fn follow_on(shared: &Shared, settings: &Settings, conn: &Arc<Connection>) -> Error {
    let layout = match settings.layout() {
        Ok(l) => l,
        Err(e) => return e.into(),
    };
    let trust = Trust::new(Some(conn.status().username()), &settings.trust);
    let at = shared.state().at;
    let from = match at {
        Some(o) => Start::Offset(o + 1),
        None => match control::read_schedules(conn, &layout, &settings.trust, None).await {
            Ok((book, None)) => {
                // no stream yet: an empty book, read again on the next connection
                *shared.book.write().await = book;
                return Error::Stopped("the control stream does not exist yet".into());
            }
            Ok((book, Some(at))) => {
                tracing::info!(schedules = book.len(), "read the schedules; following");
                *shared.book.write().await = book;
                shared.state().at = Some(at);
                Start::Offset(at + 1)
            }
            Err(e) => return e,
        },
    };
    let mut tail = match control::tail(conn, &layout, from).await {
        Ok(t) => t,
        Err(e) => return e,
    };
    {
        let mut s = shared.state();
        s.conn = Some(conn.clone());
        s.error = None;
    }
    shared.moved();
    let e = loop {
        let entry = match tail.next().await {
            Some(Ok(e)) => e,
            Some(Err(e)) => break e,
            None => break Error::Stopped("the control stream's reader ended".into()),
        };
        match &entry.record {
            Some(Record::Barrier { nonce }) => {
                if let Some(seen) = shared.state().waiting.get_mut(nonce) {
                    *seen = true;
                }
            }
            Some(
                r @ (Record::RecurringAdd(_)
                | Record::RecurringSet(_)
                | Record::RecurringMark(_)
                | Record::RecurringMarks(_)
                | Record::RecurringKeep(_)),
            ) => {
                let mut book = shared.book.write().await;
                r.apply_to(&mut book, entry.by.as_deref(), &trust);
            }
            _ => {}
        }
        shared.state().at = Some(entry.offset);
        shared.moved();
    };
    tail.end().await;
    e
}
