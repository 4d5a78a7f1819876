//! What `pending` does for whoever asks, over an index: list, show and count with the asker's
//! view, and purge, reschedule and cancel with the asker's own broker rights (a control record
//! written on a connection as that user, which the broker checks). Used by the CLI, the HTTP
//! API ([`super::http`]) and the console.
//!
//! A user sees and steers what it owns; an admin (`trust.admins`) everything. An admin naming
//! a message of another owner writes records naming that owner; a user's records cover its own
//! messages whatever they name (the readers decide, `amqp_delay::ops::trust`).

use std::fmt;

use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{ErrorKind, Message, Publisher};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::follow::{SharedIndex, Status, url_user, with_index};
use super::quota::{Ask, Passed, Quotas, Refused};
use super::wire::{MessageOut, PageOut, PurgeOut, RowOut, ShowOut, SteeredOut};
use crate::pending_index::{Cursor, Destination, Filter, MAX_ID_BYTES, Record, State, Viewer};
use amqp_delay::ops::control::{PurgeScope, Reschedule};

/// Rows a page holds at most through `pending` (the index allows more; a page's memory and an
/// HTTP answer stay small).
pub const MAX_PAGE: usize = 1_000;
/// Rows a page holds when no limit is given.
pub const DEFAULT_PAGE: usize = 100;

/// Why a request was not served.
#[derive(Debug)]
pub enum Failure {
    /// The request is wrong (an id, a filter, a time): the message says what and what to do.
    Invalid(String),
    /// Nothing the asker sees has that id.
    NotFound(String),
    /// The index cannot answer now (being rebuilt): try again later.
    Unavailable(String),
    /// The asker holds its quota of live purges or reschedules: the message says how many
    /// and when they are over.
    Quota(String),
    /// The broker refused or failed the steering action.
    Broker(amqp_delay::Error),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Invalid(m)
            | Failure::NotFound(m)
            | Failure::Unavailable(m)
            | Failure::Quota(m) => f.write_str(m),
            Failure::Broker(e) => f.write_str(&amqp_delay::error_chain(e)),
        }
    }
}

impl std::error::Error for Failure {}

impl Failure {
    /// Whether the request itself is wrong (a CLI exits with its usage code).
    pub fn is_usage(&self) -> bool {
        match self {
            Failure::Invalid(_) | Failure::NotFound(_) => true,
            Failure::Unavailable(_) | Failure::Quota(_) => false,
            Failure::Broker(e) => matches!(e.kind(), ErrorKind::Usage | ErrorKind::Topology),
        }
    }

    /// The HTTP status that says it.
    pub fn http_status(&self) -> u16 {
        match self {
            Failure::Invalid(_) => 400,
            Failure::NotFound(_) => 404,
            Failure::Unavailable(_) => 503,
            Failure::Quota(_) => 429,
            Failure::Broker(e) => match e.kind() {
                ErrorKind::Usage => 400,
                ErrorKind::Topology => 409,
                ErrorKind::Refused => 403,
                _ => 502,
            },
        }
    }
}

impl From<amqp_delay::Error> for Failure {
    fn from(e: amqp_delay::Error) -> Failure {
        match e {
            amqp_delay::Error::Invalid(m) => Failure::Invalid(m),
            amqp_delay::Error::Stopped(m) if m.contains("being rebuilt") => Failure::Unavailable(m),
            e => Failure::Broker(e),
        }
    }
}

/// What a list or a count covers, as the CLI and the HTTP API give it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Query {
    /// Only this destination queue.
    pub queue: Option<String>,
    /// Only due strictly after (ms since the epoch).
    pub due_after_ms: Option<u64>,
    /// Only due strictly before (ms since the epoch).
    pub due_before_ms: Option<u64>,
    /// Only with this user header `(key, value)`.
    pub header: Option<(String, String)>,
    /// Rows a page holds (1 to [`MAX_PAGE`]; default [`DEFAULT_PAGE`]).
    pub limit: Option<usize>,
    /// Continue after this cursor (a page's `next`).
    pub after: Option<String>,
}

impl Query {
    /// The index's filter for `viewer`; an error names what is wrong.
    pub fn filter(&self, viewer: Viewer) -> Result<Filter, Failure> {
        let mut f = Filter::new(viewer);
        f.limit = self.limit.unwrap_or(DEFAULT_PAGE);
        if f.limit == 0 || f.limit > MAX_PAGE {
            return Err(Failure::Invalid(format!(
                "a page holds 1 to {MAX_PAGE} messages, not {}",
                f.limit
            )));
        }
        if let Some(q) = &self.queue {
            if q.is_empty() || q.len() > 255 {
                return Err(Failure::Invalid("a queue name has 1 to 255 bytes".into()));
            }
            f.destination = Some(Destination::Queue(q.clone()));
        }
        if let Some((k, v)) = &self.header
            && (k.is_empty() || k.len() > 255 || v.len() > 65_535)
        {
            return Err(Failure::Invalid(
                "a header filter is NAME=VALUE, the name 1 to 255 bytes".into(),
            ));
        }
        f.due_after = self.due_after_ms;
        f.due_before = self.due_before_ms;
        f.header = self.header.clone();
        f.after = match &self.after {
            Some(c) => Some(c.parse::<Cursor>().map_err(Failure::Invalid)?),
            None => None,
        };
        Ok(f)
    }
}

/// Where a reschedule moves a message.
/// What `scope` covers in the index as `viewer` sees it: what a purge would cancel.
pub fn purge_filter(viewer: Viewer, scope: &PurgeScope) -> Filter {
    let mut f = Filter::new(viewer);
    f.destination = Some(Destination::Queue(scope.queue.clone()));
    f.due_after = scope.due_after_ms;
    f.due_before = scope.due_before_ms;
    f.header = scope.header.clone();
    f
}

/// The query and steering layer over one index.
#[derive(Clone)]
pub struct Service {
    index: SharedIndex,
    status: Status,
    settings: Settings,
    quotas: std::sync::Arc<Quotas>,
}

impl Service {
    /// Answers from `index`, which `status` tells the lag of; steers the broker of `settings`.
    pub fn new(settings: Settings, index: SharedIndex, status: Status) -> Service {
        Service {
            index,
            status,
            quotas: std::sync::Arc::new(Quotas::new(settings.clone())),
            settings,
        }
    }

    /// The follower's status (how far behind the index is).
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// The settings it steers with (a user's own come from [`super::auth::settings_as`]).
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// What `user` sees: everything when it is an admin, else what it owns.
    pub fn viewer(&self, user: &str) -> Viewer {
        viewer_of(&self.settings, user)
    }

    /// One page of what `viewer` sees, by due time.
    pub async fn list(&self, viewer: Viewer, q: &Query) -> Result<PageOut, Failure> {
        let f = q.filter(viewer)?;
        let page = with_index(&self.index, move |ix| ix.list(&f)).await?;
        Ok(PageOut {
            rows: page.rows.iter().map(RowOut::of).collect(),
            next: page.next.map(|c| c.to_string()),
            lag: self.status.lag(),
        })
    }

    /// How many messages `q` covers for `viewer`, whatever its page.
    pub async fn count(&self, viewer: Viewer, q: &Query) -> Result<u64, Failure> {
        let f = q.filter(viewer)?;
        Ok(with_index(&self.index, move |ix| ix.count(&f)).await?)
    }

    /// Every message `id` that `viewer` sees (of `owner` only, when given), with body and
    /// history.
    pub async fn show(
        &self,
        viewer: Viewer,
        id: &str,
        owner: Option<&str>,
    ) -> Result<ShowOut, Failure> {
        let found = self.find(viewer, id, owner).await?;
        Ok(ShowOut {
            messages: found.iter().map(MessageOut::of).collect(),
            lag: self.status.lag(),
        })
    }

    async fn find(
        &self,
        viewer: Viewer,
        id: &str,
        owner: Option<&str>,
    ) -> Result<Vec<Record>, Failure> {
        check_id(id)?;
        let key = id.to_string();
        let mut found = with_index(&self.index, move |ix| ix.show(&key, &viewer)).await?;
        if let Some(o) = owner {
            found.retain(|r| r.row.owner == o);
        }
        if found.is_empty() {
            return Err(Failure::NotFound(format!(
                "no message with id '{}' that you can see{}",
                crate::logline::escape_controls(id),
                self.status
                    .lag()
                    .describe()
                    .map(|l| format!(" ({l})"))
                    .unwrap_or_default()
            )));
        }
        Ok(found)
    }

    /// The one pending message `id` of `as_user`'s view (of `owner`, when given).
    async fn find_one(
        &self,
        as_user: &Settings,
        id: &str,
        owner: Option<&str>,
    ) -> Result<(String, Record), Failure> {
        let user = acting_user(as_user)?;
        let mut found = self
            .find(viewer_of(&self.settings, &user), id, owner)
            .await?;
        if found.len() > 1 {
            let owners: Vec<&str> = found.iter().map(|r| r.row.owner.as_str()).collect();
            return Err(Failure::Invalid(format!(
                "several owners have a message '{id}' ({}): name one with owner",
                owners.join(", ")
            )));
        }
        let r = found.remove(0);
        if !matches!(r.row.state, State::Pending | State::Unconfirmed) {
            return Err(Failure::Invalid(format!(
                "message '{id}' is {}, not pending: nothing to change",
                super::wire::state_name(r.row.state)
            )));
        }
        Ok((user, r))
    }

    /// Cancels every pending message `scope` covers with one control record written as the
    /// user of `as_user` (with `dry_run`, writes nothing); how many the index knows of. A
    /// user's purge covers its own messages, whatever owner it names (its record names none);
    /// an admin's the named owner's, or everyone's.
    pub async fn purge(
        &self,
        as_user: &Settings,
        scope: &PurgeScope,
        dry_run: bool,
    ) -> Result<PurgeOut, Failure> {
        let user = acting_user(as_user)?;
        let admin = viewer_of(&self.settings, &user) == Viewer::Admin;
        scope.check().map_err(Failure::Invalid)?;
        let (viewer, scope) = match (admin, &scope.owner) {
            (true, Some(o)) => (Viewer::User(o.clone()), scope.clone()),
            (true, None) => (Viewer::Admin, scope.clone()),
            (false, _) => (
                Viewer::User(user.clone()),
                PurgeScope {
                    owner: None,
                    ..scope.clone()
                },
            ),
        };
        let f = purge_filter(viewer, &scope);
        let covered = with_index(&self.index, move |ix| ix.count(&f)).await?;
        let queue = scope.queue.clone();
        if !dry_run {
            let _passed = self.may(&user, admin, Ask::Purge).await?;
            let publisher = Publisher::connect(as_user).await?;
            let r = publisher.purge(scope).await;
            publisher.close().await;
            r?;
        }
        Ok(PurgeOut {
            covered,
            queue,
            written: !dry_run,
            lag: self.status.lag(),
        })
    }

    /// Moves pending message `r.id` (of `r.owner`, for an admin naming another's) to
    /// `r.due_at_ms`, as the user of `as_user`. Later: one control record. Earlier: the
    /// message is sent again from its kept body, then the record; without a kept body, an error
    /// saying why. The record is `r` with its owner as found in the index.
    pub async fn reschedule(
        &self,
        as_user: &Settings,
        r: &Reschedule,
    ) -> Result<SteeredOut, Failure> {
        r.check().map_err(Failure::Invalid)?;
        let id = r.id.as_str();
        let (user, found) = self.find_one(as_user, id, r.owner.as_deref()).await?;
        let now = now_ms();
        let due = r.due_at_ms.max(now);
        let from = found.row.due_at_ms;
        let copy = if due < from {
            Some(copy_of(&found, due.saturating_sub(now))?)
        } else {
            None
        };
        let resent = copy.is_some();
        let to = Reschedule {
            owner: (found.row.owner != user).then(|| found.row.owner.clone()),
            due_at_ms: due,
            ..r.clone()
        };
        let admin = viewer_of(&self.settings, &user) == Viewer::Admin;
        let _passed = self.may(&user, admin, Ask::Reschedule(id)).await?;
        let publisher = Publisher::connect(as_user).await?;
        let res = publisher.reschedule(&to, from, copy).await;
        publisher.close().await;
        res?;
        Ok(SteeredOut {
            id: id.to_string(),
            owner: found.row.owner.clone(),
            action: "rescheduled".into(),
            from_due_at_ms: from,
            due_at_ms: Some(due),
            resent,
        })
    }

    /// Whether `user` may write what it asks, within its quota (an admin always may); hold
    /// the answer until the record is written.
    async fn may(&self, user: &str, admin: bool, ask: Ask<'_>) -> Result<Passed<'_>, Failure> {
        if admin {
            return Ok(Passed::admin());
        }
        self.quotas.check(user, ask).await.map_err(|r| match r {
            Refused::Quota(m) => Failure::Quota(m),
            Refused::Broker(e) => Failure::Broker(e),
        })
    }

    /// Cancels pending message `id` (with its due time from the index) as the user of
    /// `as_user`. An admin's cancel stops every owner's message of that id.
    pub async fn cancel(
        &self,
        as_user: &Settings,
        id: &str,
        owner: Option<&str>,
    ) -> Result<SteeredOut, Failure> {
        let (_, r) = self.find_one(as_user, id, owner).await?;
        let publisher = Publisher::connect(as_user).await?;
        let res = publisher.cancel(id, Some(r.row.due_at_ms)).await;
        publisher.close().await;
        res?;
        Ok(SteeredOut {
            id: id.to_string(),
            owner: r.row.owner.clone(),
            action: "cancelled".into(),
            from_due_at_ms: r.row.due_at_ms,
            due_at_ms: None,
            resent: false,
        })
    }
}

/// What `user` sees with `settings`' admins.
pub fn viewer_of(settings: &Settings, user: &str) -> Viewer {
    if settings.trust.admins.iter().any(|a| a == user) {
        Viewer::Admin
    } else {
        Viewer::User(user.to_string())
    }
}

fn acting_user(as_user: &Settings) -> Result<String, Failure> {
    url_user(as_user).ok_or_else(|| {
        Failure::Invalid("the broker URL names no user: pending acts as a user, give one".into())
    })
}

fn check_id(id: &str) -> Result<(), Failure> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(Failure::Invalid(format!(
            "a message id has 1 to {MAX_ID_BYTES} bytes, not {}",
            id.len()
        )));
    }
    Ok(())
}

/// The message `r` as it was scheduled, due in `delay_ms`, from its kept body: what moving it
/// earlier sends again.
pub fn copy_of(r: &Record, delay_ms: u64) -> Result<Message, Failure> {
    let Some(body) = &r.body else {
        return Err(Failure::Invalid(format!(
            "message '{}' can only be moved later: the body was not kept (journal.keep_body is \
             off, or the body was over journal.max_body), so it cannot be sent again earlier",
            r.row.id
        )));
    };
    let Destination::Queue(queue) = &r.row.destination else {
        return Err(Failure::Invalid(format!(
            "message '{}' is a gateway message: it can only be moved later",
            r.row.id
        )));
    };
    let mut headers = FieldTable::default();
    for (k, v) in &r.row.headers {
        headers.insert(
            ShortString::from(k.clone()),
            AMQPValue::LongString(LongString::from(v.clone())),
        );
    }
    let mut m = Message::new(queue.clone(), delay_ms, body.clone())
        .with_id(r.row.id.clone())
        .with_headers(headers);
    if let Some(ct) = &r.row.content_type {
        m = m.with_content_type(ct.clone());
    }
    Ok(m)
}

#[cfg(test)]
mod tests;
