//! What a replica that becomes active finds already published: the occurrences the replica
//! before it published (confirmed, or at least journaled) but had not yet marked when it died.
//!
//! Every occurrence is journaled before it is published (the journal's group commit is
//! confirmed first), under the id `NAME@<tick>`, in a record whose `user_id` the broker
//! checked. So the new replica collects the ids of its own schedules' occurrences past their
//! marks that its user journaled (less those a confirm names as refused), and publishes none of
//! them again. It asks, in this order:
//!
//! * the `pending serve` of `pending.index_url`, as its own user (who sees only its own
//!   messages there: what the documented `recurring` permission set allows), once that index
//!   holds everything journaled before the takeover ([`from_index`]); or
//! * the journal itself, read back from a little before the oldest moment such a publish can
//!   have happened, when its user may read `P.journal` ([`read`]).
//!
//! What stays open, and is documented (OPERATIONS, recurring):
//!
//! * an intent journaled whose publish never left the dead process (killed between the
//!   journal's confirm and the publish): that tick is taken as published and does not run;
//! * publishes the journal did not hold (a journal outage lets publishes go on unjournaled),
//!   or older than the look-back: published again (a duplicate is possible);
//! * with the index, a tick whose first copy already ran (no longer pending: a takeover later
//!   than `--ahead`) is taken as not published;
//! * neither an index nor a journal the replica can read: everything past the marks is
//!   published again, counted in `amqp_delay_recurring_takeover_unchecked_total`.

use std::collections::HashSet;
use std::time::Duration;

use amqp_delay::ops::journal::{self, Record, Start};
use amqp_delay::recurring::{Book, occurrence_id};
use amqp_delay::settings::Settings;
use amqp_delay::{Error, Layout, Result};
use lapin::Connection;

use crate::pending::client::{Remote, Source, index_server};
use crate::pending::service::Query;

/// Read back at least this far: a replica standing by takes over within seconds of a death,
/// so the dead one's last publish is this recent unless no replica was running.
const LOOK_BACK_MS: u64 = 10 * 60_000;
/// And at most this far (the cost of a takeover after a long outage stays bounded).
const MAX_LOOK_BACK_MS: u64 = 24 * 3_600_000;
/// How long the read waits for the next record before it gives up.
const READ_STALL: Duration = Duration::from_secs(10);
/// How long the index may take to hold what was journaled before the takeover.
const INDEX_CATCH_UP: Duration = Duration::from_secs(20);
/// Rows a page of the index's answer holds.
const INDEX_PAGE: usize = 1_000;

/// The occurrence ids of `user`'s live schedules in `book` past their marks that the journal
/// holds as published by `user`: from `settings`' pending index when it names one, else from
/// the journal read from the look-back on (`now`, after the lock was taken: the replica
/// before can journal nothing later; `ahead_ms` is how far ahead the replicas publish). An
/// empty set, counted and logged, when neither can be read.
pub(super) async fn already_published(
    conn: &Connection,
    settings: &Settings,
    user: &str,
    book: &Book,
    now: u64,
    ahead_ms: u64,
) -> HashSet<String> {
    // the first unmarked tick of each live schedule: how far back its publish can be
    let mut earliest = now.saturating_sub(LOOK_BACK_MS);
    let mut names = HashSet::new();
    for e in book.iter().filter(|e| e.owner == user && !e.paused) {
        names.insert(e.def.name.clone());
        let first = e.def.check().ok().and_then(|t| t.next_after(e.done_ms()));
        if let Some(t) = first {
            earliest = earliest.min(t.saturating_sub(ahead_ms + 60_000));
        }
    }
    if names.is_empty() {
        return HashSet::new();
    }
    let from = earliest.max(now.saturating_sub(MAX_LOOK_BACK_MS));
    // only ids of this user's live schedules past their marks are kept: as many as the replica
    // before can have left unmarked, whatever else the user journaled
    let keep = |id: &str| past_mark(book, user, id);
    let found = match index_server(settings) {
        Ok(Some(remote)) => {
            let queues: HashSet<&str> = (book.iter())
                .filter(|e| e.owner == user && !e.paused)
                .map(|e| e.def.queue.as_str())
                .collect();
            from_index(remote, user, &queues, from, now, keep)
                .await
                .map_err(|e| format!("the pending index (pending.index_url): {e}"))
        }
        Ok(None) => match settings.layout() {
            Ok(layout) => read(conn, &layout, user, from, keep)
                .await
                .map_err(|e| format!("the journal: {}", amqp_delay::error_chain(&e))),
            Err(e) => Err(amqp_delay::error_chain(&e)),
        },
        Err(f) => Err(format!("pending.index_url: {f}")),
    };
    match found {
        Ok(ids) => ids,
        Err(why) => {
            amqp_delay::metrics::global()
                .recurring_takeover_unchecked
                .inc();
            tracing::warn!(
                "recurring serve: what the replica before published cannot be read back \
                 ({why}): occurrences past each schedule's mark are published again, so one \
                 it published just now may run twice"
            );
            HashSet::new()
        }
    }
}

/// The ids `keep` takes among `user`'s messages to `queues` due from `from_ms` on that the
/// pending index at `remote` lists, once it holds everything journaled before `since_ms`.
async fn from_index(
    remote: Remote,
    user: &str,
    queues: &HashSet<&str>,
    from_ms: u64,
    since_ms: u64,
    keep: impl Fn(&str) -> bool,
) -> std::result::Result<HashSet<String>, String> {
    let source = Source::Remote(remote);
    // the first end polled after the takeover began, then the index applied up to it
    let deadline = tokio::time::Instant::now() + INDEX_CATCH_UP;
    let mut end = None;
    loop {
        let lag = source.status().await.map_err(|f| f.to_string())?.lag;
        if end.is_none() && lag.end_polled_ms.is_some_and(|t| t >= since_ms) {
            end = lag.journal_end;
        }
        if let Some(end) = end
            && lag.journal_position.is_some_and(|p| p >= end)
        {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "it did not catch up with the journal within {INDEX_CATCH_UP:?} ({})",
                lag.describe()
                    .unwrap_or_else(|| "not polled since the takeover".into())
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut ids = HashSet::new();
    for queue in queues {
        let mut q = Query {
            queue: Some(queue.to_string()),
            due_after_ms: Some(from_ms.saturating_sub(1)),
            limit: Some(INDEX_PAGE),
            ..Query::default()
        };
        loop {
            let page = source.list(&q).await.map_err(|f| f.to_string())?;
            let mine = (page.rows.into_iter())
                .filter(|r| r.owner == user && r.state != "refused" && keep(&r.id));
            ids.extend(mine.map(|r| r.id));
            match page.next {
                Some(next) => q.after = Some(next),
                None => break,
            }
        }
    }
    Ok(ids)
}

/// Whether `id` (`NAME@<tick>`) names a tick of `user`'s live schedule past its mark.
fn past_mark(book: &Book, user: &str, id: &str) -> bool {
    let Some((name, _)) = id.rsplit_once('@') else {
        return false;
    };
    let Some(e) = book.get(user, name) else {
        return false;
    };
    // the id's tick, read back: past the mark, and named as the scheduler names it
    let tick = humantime::parse_rfc3339(&id[name.len() + 1..])
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_millis()).ok());
    tick.is_some_and(|t| t > e.done_ms() && occurrence_id(name, t) == id)
}

/// The ids `keep` takes that `user` journaled from `from_ms` to the journal's end (a barrier
/// of ours), less those a confirm names as refused.
async fn read(
    conn: &Connection,
    layout: &Layout,
    user: &str,
    from_ms: u64,
    keep: impl Fn(&str) -> bool,
) -> Result<HashSet<String>> {
    let nonce = journal::barrier(conn, layout).await?;
    let mut tail = journal::tail(conn, layout, Start::Since(from_ms)).await?;
    let mut ids = HashSet::new();
    let mut refused = HashSet::new();
    let r = loop {
        let e = match tokio::time::timeout(READ_STALL, tail.next()).await {
            Err(_) => break Err(Error::Stopped("the journal's reader stalled".into())),
            Ok(None) => break Err(Error::Stopped("the journal's reader ended".into())),
            Ok(Some(Err(e))) => break Err(e),
            Ok(Some(Ok(e))) => e,
        };
        let mine = e.by.as_deref() == Some(user);
        match e.record {
            Some(Record::Barrier { nonce: n }) if n == nonce => break Ok(()),
            Some(Record::Scheduled {
                items, confirmed, ..
            }) if mine => {
                let items = items.into_iter().filter(|i| i.owner.is_none());
                ids.extend(items.map(|i| i.id).filter(|id| keep(id)));
                let failed = confirmed.into_iter().flat_map(|f| f.failed);
                refused.extend(failed.filter(|id| ids.contains(id)));
            }
            Some(Record::Confirmed { flushes, .. }) if mine => {
                let failed = flushes.into_iter().flat_map(|f| f.failed);
                refused.extend(failed.filter(|id| ids.contains(id)));
            }
            _ => {}
        }
    };
    tail.end().await;
    r.map(|()| ids.into_iter().filter(|i| !refused.contains(i)).collect())
}

#[cfg(test)]
mod tests {
    use amqp_delay::ops::trust::Trust;
    use amqp_delay::recurring::{Add, Definition, Mark};
    use amqp_delay::settings::TrustSettings;

    use super::*;

    /// 2026-12-07T02:00:00Z.
    const T: u64 = 1_796_608_800_000;

    #[test]
    fn only_ticks_of_the_users_own_schedules_past_their_mark_count() {
        let trust = Trust::new(Some("alice".into()), &TrustSettings::default());
        let mut book = Book::default();
        let add = |name: &str| Add {
            rev: format!("r-{name}"),
            at_ms: T - 3_600_000,
            schedule: Definition::new(name, "0 * * * *", "q", ""),
        };
        book.add(Some("alice"), &add("hourly"), &trust).unwrap();
        book.add(Some("bob"), &add("bobs"), &trust).unwrap();
        let mark = Mark {
            owner: "alice".into(),
            name: "hourly".into(),
            rev: "r-hourly".into(),
            through_ms: T,
        };
        book.mark(Some("alice"), &mark, &trust).unwrap();
        let at = |h: u64| occurrence_id("hourly", T + h * 3_600_000);
        assert!(past_mark(&book, "alice", &at(1)));
        assert!(past_mark(&book, "alice", &at(5)));
        // at or before the mark: dealt with already
        assert!(!past_mark(&book, "alice", &at(0)));
        // another user's schedule, an unknown one, what no tick is called
        assert!(!past_mark(
            &book,
            "alice",
            &occurrence_id("bobs", T + 3_600_000)
        ));
        assert!(!past_mark(&book, "bob", &at(1)));
        assert!(!past_mark(&book, "alice", "nope@2026-12-07T03:00:00Z"));
        assert!(!past_mark(&book, "alice", "hourly@soon"));
        assert!(!past_mark(&book, "alice", "hourly"));
    }
}
