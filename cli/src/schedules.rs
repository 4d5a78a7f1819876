//! Recurring schedules seen and steered as the user who asks: the one implementation behind
//! `delay-publisher recurring add|list|show|pause|resume|remove|run-now|purge`, `pending
//! serve`'s `/api/v1/schedules` and the console's Schedules page.
//!
//! Each call connects as the asking user (its settings carry that user's login), reads the
//! schedules the control stream's records make (`amqp_delay::recurring::Book`, each record
//! believed by its writer's broker-checked `user_id`; the CLI replays the stream for the call,
//! a server asks its [`Live`] book, caught up first), and writes a control record on that
//! user's connection, so the broker and the trust model decide: a user sees and steers its own
//! schedules, an admin (`trust.admins`) everyone's, naming the owner.

use std::collections::HashMap;
use std::sync::Arc;

use amqp_delay::headers;
use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::control::{self, PurgeScope, Record};
use amqp_delay::ops::trust::Trust;
use amqp_delay::recurring::{Action, Add, Book, Definition, Entry, Set, Ticks, rfc3339};
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Message, Publisher, Result};
use lapin::types::{AMQPValue, FieldTable};
use serde::{Deserialize, Serialize};

pub mod live;

pub use live::Live;

/// What the error of a schedule nobody the user sees has says (the API answers it with 404).
pub const NO_SUCH: &str = "has no recurring schedule";
/// Schedules a list shows by default (`recurring list --limit`, the API's `limit`).
pub const PAGE: usize = 1_000;
/// The most a list shows at once.
pub const MAX_PAGE: usize = 10_000;

/// Which page of a list: at most `limit` schedules after the one `after` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The (owner, name) the page starts after.
    pub after: Option<(String, String)>,
    /// Schedules it holds, at most (1 to [`MAX_PAGE`]).
    pub limit: usize,
}

impl Page {
    /// A page from a cursor (`OWNER/NAME`, as a list prints it) and a limit, or why not.
    pub fn parse(after: Option<&str>, limit: Option<usize>) -> Result<Page> {
        let limit = limit.unwrap_or(PAGE);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(Error::Invalid(format!(
                "a list's limit is 1 to {MAX_PAGE}, not {limit}"
            )));
        }
        let after = match after {
            None => None,
            Some(c) => match c.rsplit_once('/') {
                Some((o, n)) if !o.is_empty() && !n.is_empty() => Some((o.into(), n.into())),
                _ => {
                    return Err(Error::Invalid(format!(
                        "'{c}' is not a cursor a list printed (OWNER/NAME)"
                    )));
                }
            },
        };
        Ok(Page { after, limit })
    }

    /// The cursor of the page after one that ended at `e`.
    pub fn cursor(e: &Entry) -> String {
        format!("{}/{}", e.owner, e.def.name)
    }

    /// This page of what `v`'s user sees, each with its next tick, and the cursor of the next
    /// page when more follow.
    pub fn of<B: std::ops::Deref<Target = Book>>(
        &self,
        v: &View<B>,
    ) -> (Vec<ScheduleOut>, Option<String>) {
        let after = self.after.as_ref().map(|(o, n)| (o.as_str(), n.as_str()));
        let (page, more) = v.book.page(&v.user, &v.trust, after, self.limit);
        let next = more.then(|| page.last().map(|e| Page::cursor(e))).flatten();
        let (now, mut crons) = (now_ms(), Crons::default());
        let rows = (page.into_iter())
            .map(|e| ScheduleOut::of_with(e, now, 1, &mut crons))
            .collect();
        (rows, next)
    }
}

/// Ticks one schedule's answer shows ahead.
pub const SHOWN_TICKS: usize = 5;
/// Times a stream read is tried again on a new connection when it loses the connection on a
/// record over `frame_max` (the process learns the record and reads past it).
const STREAM_TRIES: u32 = 16;

/// The schedules as one user sees them: the book (read for this call, or a server's
/// [`Live`] one), the user, and its trust.
pub struct View<B: std::ops::Deref<Target = Book> = Box<Book>> {
    /// Every schedule of the control stream.
    pub book: B,
    /// Who asks.
    pub user: String,
    /// Its trust (whether it is an admin).
    pub trust: Trust,
}

impl<B: std::ops::Deref<Target = Book>> View<B> {
    /// The schedules this user sees, by owner and name.
    pub fn visible(&self) -> impl Iterator<Item = &Entry> {
        self.book.visible_to(&self.user, &self.trust)
    }

    /// Schedule `name` of `owner` (an admin's question; others ask for their own).
    pub fn get(&self, name: &str, owner: Option<&str>) -> Result<&Entry> {
        let owner = match owner {
            Some(o) if o != self.user && !self.trust.is_admin(&self.user) => {
                return Err(Error::Invalid(
                    "--owner is an admin's (trust.admins)".into(),
                ));
            }
            Some(o) => o,
            None => self.user.as_str(),
        };
        self.book
            .get(owner, name)
            .ok_or_else(|| Error::Invalid(format!("{owner} {NO_SUCH} '{name}'")))
    }
}

/// The schedules as `as_user`'s user sees them (the control stream read to its end; read
/// again on a new connection when a read lost the connection on a record over `frame_max`:
/// the process learns the record and reads past it).
pub async fn view(as_user: &Settings) -> Result<View> {
    let layout = as_user.layout()?;
    let connector = Connector::new(as_user)?;
    let mut tries = 1;
    loop {
        let conn = connector.connect("amqp-delay recurring").await?;
        let user = conn.status().username();
        let trust = Trust::new(Some(user.clone()), &as_user.trust);
        // an admin sees every owner's; a user keeps only its own in memory
        let only = (!trust.is_admin(&user)).then_some(user.as_str());
        let r = control::read_schedules(&conn, &layout, &as_user.trust, only).await;
        amqp_delay::ops::broker::close_connection(&conn, "bye").await;
        match r {
            Ok((book, _)) => {
                return Ok(View {
                    book: Box::new(book),
                    user,
                    trust,
                });
            }
            Err(e) if control::is_record_over_frame_max(&e) && tries < STREAM_TRIES => {
                tracing::warn!(
                    tries,
                    "{}; reading again on a new connection",
                    amqp_delay::error_chain(&e)
                );
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Where a call finds the schedules it shows or steers.
#[derive(Clone, Copy)]
pub enum Books<'a> {
    /// The control stream, read to its end for this call as the asking user (the CLI).
    Replay,
    /// A server's live book, as the logged-in user named.
    Live(&'a Live, &'a str),
}

/// Schedule `name` (of `owner`, an admin's) as the asking user sees it, and that user.
async fn lookup(
    as_user: &Settings,
    books: Books<'_>,
    name: &str,
    owner: Option<&str>,
) -> Result<(Entry, String)> {
    match books {
        Books::Replay => {
            let v = view(as_user).await?;
            let e = v.get(name, owner)?.clone();
            Ok((e, v.user))
        }
        Books::Live(live, user) => {
            let v = live.view(user).await?;
            let e = v.get(name, owner)?.clone();
            Ok((e, v.user.clone()))
        }
    }
}

/// Appends `record` on a connection of `as_user`'s user, the queue `check` names checked
/// first.
async fn write(as_user: &Settings, check: Option<&str>, record: &Record) -> Result<()> {
    let layout = as_user.layout()?;
    let conn = Connector::new(as_user)?
        .connect("amqp-delay recurring")
        .await?;
    let r = match check {
        Some(q) => check_queue(&conn, q).await,
        None => Ok(()),
    };
    let r = match r {
        Ok(()) => control::append(&conn, &layout, record).await,
        Err(e) => Err(e),
    };
    amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    r
}

/// Adds `def` as `as_user`'s user (or replaces its schedule of that name): the definition
/// checked (cron, zone, fields, a next tick), its queue checked by the broker as this user,
/// then written. Its next tick.
pub async fn add(as_user: &Settings, books: Books<'_>, def: &Definition) -> Result<u64> {
    let ticks = def.check().map_err(Error::Invalid)?;
    let now = now_ms();
    let next = ticks
        .next_after(now.max(def.from_ms.unwrap_or(0)))
        .filter(|&t| def.until_ms.is_none_or(|u| t <= u))
        .ok_or_else(|| Error::Invalid(format!("'{}' never ticks again", def.cron)))?;
    // A record past a cap is skipped by every reader: refuse it here, where the user sees why.
    match books {
        Books::Replay => {
            let v = view(as_user).await?;
            v.book.admits(&v.user, &def.name, &v.trust)
        }
        Books::Live(live, user) => {
            let v = live.view(user).await?;
            v.book.admits(&v.user, &def.name, &v.trust)
        }
    }
    .map_err(Error::Invalid)?;
    let record = Record::RecurringAdd(Add {
        rev: uuid::Uuid::now_v7().to_string(),
        at_ms: now,
        schedule: def.clone(),
    });
    write(as_user, Some(&def.queue), &record).await?;
    Ok(next)
}

/// Whether this user may send to `queue`, as far as the broker tells: it must exist (a
/// passive declare); a broker that refuses to say (RabbitMQ 4.3 checks the user's rights on
/// the queue, which a publisher has not) leaves the check to each occurrence's publish.
async fn check_queue(conn: &lapin::Connection, queue: &str) -> Result<()> {
    match amqp_delay::ops::broker::queue_state(conn, queue).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(Error::UnknownDestination(queue.into())),
        Err(Error::Amqp { source, .. }) if matches!(source.kind(), lapin::ErrorKind::ProtocolError(r) if r.get_id() == 403) => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Pauses, resumes or removes schedule `name` (of `owner`, an admin's) as `as_user`'s user:
/// it must be one the user sees. The schedule as it was.
pub async fn set(
    as_user: &Settings,
    books: Books<'_>,
    name: &str,
    owner: Option<&str>,
    action: Action,
) -> Result<Entry> {
    let (e, user) = lookup(as_user, books, name, owner).await?;
    let record = Record::RecurringSet(Set {
        name: e.def.name.clone(),
        owner: (e.owner != user).then(|| e.owner.clone()),
        action,
        at_ms: now_ms(),
    });
    write(as_user, None, &record).await?;
    Ok(e)
}

/// One occurrence of schedule `name` (of `owner`) due now, besides the ticks (named by this
/// second), published as `as_user`'s user; its message id. An admin's run of another user's
/// schedule is that user's message ([`amqp_delay::Message::for_owner`]): listed, cancelled
/// and purged by the schedule's owner, as its ticks are.
pub async fn run_now(
    as_user: &Settings,
    books: Books<'_>,
    name: &str,
    owner: Option<&str>,
) -> Result<String> {
    let (e, user) = lookup(as_user, books, name, owner).await?;
    let mut msg = occurrence(&e.def, now_ms() / 1000 * 1000, 0);
    if e.owner != user {
        msg = msg.for_owner(e.owner.as_str());
    }
    let publisher = Publisher::connect(as_user).await?;
    let r = publisher.schedule(msg).await;
    publisher.close().await;
    Ok(r?.message_id)
}

/// One purge record covering the scheduled occurrences of schedule `name` (of `owner`) in
/// its queue, written as `as_user`'s user. The schedule.
pub async fn purge(
    as_user: &Settings,
    books: Books<'_>,
    name: &str,
    owner: Option<&str>,
) -> Result<Entry> {
    let (e, user) = lookup(as_user, books, name, owner).await?;
    let p = PurgeScope {
        owner: (e.owner != user).then(|| e.owner.clone()),
        header: Some((headers::RECURRING.to_string(), e.def.name.clone())),
        ..PurgeScope::queue(e.def.queue.clone())
    };
    let publisher = Publisher::connect(as_user).await?;
    let r = publisher.purge(p).await;
    publisher.close().await;
    r?;
    Ok(e)
}

/// Cron expressions parsed once for an answer of many schedules (most share a few), by
/// expression and zone, each with its last answer (schedules of one expression and window
/// share their next ticks); at most [`MAX_CRONS`] kept (some 8 KB each).
#[derive(Default)]
pub struct Crons {
    by_cron: HashMap<String, HashMap<String, Parsed>>,
    kept: usize,
}

/// One expression in one zone, and the ticks it last gave: (after, until, n) and them.
struct Parsed {
    ticks: Option<Arc<Ticks>>,
    last: Option<((u64, u64, usize), Vec<u64>)>,
}

/// Parsed cron expressions a [`Crons`] keeps, at most.
const MAX_CRONS: usize = 1_024;

impl Crons {
    /// `e`'s expression parsed; its ticks `None` when it is not one (a book holds none such).
    fn of(&mut self, e: &Entry) -> &mut Parsed {
        let (cron, tz) = (&e.def.cron, &e.def.tz);
        let known = self.by_cron.get(cron).is_some_and(|z| z.contains_key(tz));
        if !known {
            if self.kept >= MAX_CRONS {
                self.by_cron.clear();
                self.kept = 0;
            }
            let ticks = e.def.check().ok().map(Arc::new);
            self.kept += 1;
            self.by_cron
                .entry(cron.clone())
                .or_default()
                .insert(tz.clone(), Parsed { ticks, last: None });
        }
        self.by_cron
            .get_mut(cron)
            .and_then(|z| z.get_mut(tz))
            .expect("inserted above")
    }
}

/// The next `n` ticks of `e` after `now`, within its window (none when paused).
pub fn next_ticks(e: &Entry, now: u64, n: usize) -> Vec<u64> {
    next_ticks_with(e, now, n, &mut Crons::default())
}

/// [`next_ticks`], its cron expression parsed once in `crons`.
pub fn next_ticks_with(e: &Entry, now: u64, n: usize, crons: &mut Crons) -> Vec<u64> {
    if e.paused {
        return Vec::new();
    }
    let after = now.max(e.def.from_ms.map_or(0, |f| f.saturating_sub(1)));
    let key = (after, e.def.until_ms.unwrap_or(u64::MAX), n);
    let p = crons.of(e);
    if let Some((k, v)) = &p.last
        && *k == key
    {
        return v.clone();
    }
    let Some(ticks) = &p.ticks else {
        return Vec::new();
    };
    let v = ticks.between(key.0, key.1, n);
    p.last = Some((key, v.clone()));
    v
}

/// The last ticks of `e` at or before `now`, at most `n`, oldest first: those within four of
/// its current periods (the gap between its next two ticks), after it was added or resumed
/// (what a page shows as its last runs; a schedule whose gaps vary may show fewer).
pub fn last_ticks(e: &Entry, now: u64, n: usize) -> Vec<u64> {
    let Ok(ticks) = e.def.check() else {
        return Vec::new();
    };
    let Some(next) = ticks.next_after(now) else {
        return Vec::new();
    };
    let step = ticks.next_after(next).map_or(0, |t| t - next);
    let since = now
        .saturating_sub(step.saturating_mul(4))
        .max(e.since_ms)
        .max(e.def.from_ms.map_or(0, |f| f.saturating_sub(1)));
    let mut all = ticks.between(since, now, 64);
    let keep = all.len().saturating_sub(n);
    all.drain(..keep);
    all
}

/// A schedule as the CLI's `--json`, the API and the console give it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleOut {
    /// Its owner.
    pub owner: String,
    /// Its name.
    pub name: String,
    /// Its cron expression.
    pub cron: String,
    /// Its time zone.
    pub tz: String,
    /// The queue its occurrences go to.
    pub queue: String,
    /// Their headers.
    pub headers: Vec<(String, String)>,
    /// What a missed tick does.
    pub misfire: amqp_delay::recurring::Misfire,
    /// No tick before (RFC 3339).
    pub from: Option<String>,
    /// No tick after.
    pub until: Option<String>,
    /// Whether it is paused.
    pub paused: bool,
    /// Its revision.
    pub rev: String,
    /// Every tick up to here is published (the scheduler's mark).
    pub scheduled_through: Option<String>,
    /// Its next ticks (none when paused or ended).
    pub next_ticks: Vec<String>,
}

impl ScheduleOut {
    /// `e` with its next `n` ticks after `now`.
    pub fn of(e: &Entry, now: u64, n: usize) -> ScheduleOut {
        ScheduleOut::of_with(e, now, n, &mut Crons::default())
    }

    /// [`ScheduleOut::of`], its cron expression parsed once in `crons`.
    pub fn of_with(e: &Entry, now: u64, n: usize, crons: &mut Crons) -> ScheduleOut {
        ScheduleOut {
            owner: e.owner.clone(),
            name: e.def.name.clone(),
            cron: e.def.cron.clone(),
            tz: e.def.tz.clone(),
            queue: e.def.queue.clone(),
            headers: e.def.headers.clone(),
            misfire: e.def.misfire,
            from: e.def.from_ms.map(rfc3339),
            until: e.def.until_ms.map(rfc3339),
            paused: e.paused,
            rev: e.rev.clone(),
            scheduled_through: e.through_ms.map(rfc3339),
            next_ticks: next_ticks_with(e, now, n, crons)
                .into_iter()
                .map(rfc3339)
                .collect(),
        }
    }
}

/// The occurrence of `def` at `tick_ms`, due after `delay_ms`: its queue, body and headers,
/// named by its tick.
pub fn occurrence(def: &Definition, tick_ms: u64, delay_ms: u64) -> Message {
    let mut headers = FieldTable::default();
    for (k, v) in &def.headers {
        headers.insert(k.as_str().into(), AMQPValue::LongString(v.as_str().into()));
    }
    Message::new(def.queue.as_str(), delay_ms, def.body.as_bytes().to_vec())
        .with_headers(headers)
        .occurrence(&def.name, tick_ms)
}
