//! `recurring add|list|show|pause|resume|remove|run-now|purge|serve`: recurring schedules,
//! each a record of the control stream written as this user (`amqp_delay::recurring`); the
//! current set is the fold of the stream, of which this user sees its own schedules (an
//! admin: all). `serve` is `amqp_delay_cli::recurring`.

use amqp_delay::headers;
use amqp_delay::ops::control::{self, PurgeScope, Record};
use amqp_delay::ops::trust::Trust;
use amqp_delay::recurring::{Action, Add, Book, Definition, Entry, Set, rfc3339};
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay::{Error, Publisher};
use amqp_delay_cli::cli::escape_controls;
use amqp_delay_cli::outln;
use amqp_delay_cli::recurring::{ServeOptions, occurrence, serve};

use crate::args::{RecurringAddArgs, RecurringCmd, RecurringName};
use crate::connected;

/// Ticks `show` prints.
const SHOWN_TICKS: usize = 5;

/// Runs one `recurring` subcommand; its exit code.
pub(crate) async fn run(settings: &Settings, cmd: RecurringCmd) -> amqp_delay::Result<i32> {
    match cmd {
        RecurringCmd::Add(a) => add(settings, a).await,
        RecurringCmd::List { json } => list(settings, json).await,
        RecurringCmd::Show(n) => show(settings, &n).await,
        RecurringCmd::Pause(n) => set(settings, &n, Action::Pause).await,
        RecurringCmd::Resume(n) => set(settings, &n, Action::Resume).await,
        RecurringCmd::Remove(n) => set(settings, &n, Action::Remove).await,
        RecurringCmd::RunNow(n) => run_now(settings, &n).await,
        RecurringCmd::Purge(n) => purge(settings, &n).await,
        RecurringCmd::Serve { ahead, grace } => {
            let opts = ServeOptions {
                ahead_ms: ahead.as_millis(),
                grace_ms: grace.as_millis(),
            };
            amqp_delay_cli::cli::start_metrics(settings).await?;
            serve(settings, opts, amqp_delay_cli::cli::shutdown_signal()).await?;
            Ok(0)
        }
    }
}

/// `add`: the definition checked (cron, zone, fields, a next tick), its queue checked by the
/// broker as this user (as `send` does), then written.
async fn add(settings: &Settings, a: RecurringAddArgs) -> amqp_delay::Result<i32> {
    let def = Definition {
        headers: a.headers,
        misfire: a.misfire,
        from_ms: a.from,
        until_ms: a.until,
        tz: a.tz,
        ..Definition::new(&a.name, &a.cron, &a.queue, &a.body)
    };
    let ticks = def.check().map_err(Error::Invalid)?;
    let now = now_ms();
    let next = ticks
        .next_after(now.max(def.from_ms.unwrap_or(0)))
        .filter(|&t| def.until_ms.is_none_or(|u| t <= u))
        .ok_or_else(|| Error::Invalid(format!("'{}' never ticks again", def.cron)))?;
    let layout = settings.layout()?;
    let record = Record::RecurringAdd(Add {
        rev: uuid::Uuid::now_v7().to_string(),
        at_ms: now,
        schedule: def.clone(),
    });
    connected(settings, "amqp-delay recurring add", async |conn| {
        check_queue(conn, &def.queue).await?;
        control::append(conn, &layout, &record).await
    })
    .await?;
    outln!(
        "added recurring schedule '{}': next tick {}",
        def.name,
        rfc3339(next)
    );
    Ok(0)
}

/// Whether this user may send to `queue`, as far as the broker tells: it must exist (a
/// passive declare); a broker that refuses to say (RabbitMQ 4.3 checks the user's rights on
/// the queue, which a publisher has not) leaves the check to each occurrence's publish.
async fn check_queue(conn: &lapin::Connection, queue: &str) -> amqp_delay::Result<()> {
    match amqp_delay::ops::broker::queue_state(conn, queue).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(Error::UnknownDestination(queue.into())),
        Err(Error::Amqp { source, .. }) if matches!(source.kind(), lapin::ErrorKind::ProtocolError(r) if r.get_id() == 403) => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The book of the control stream, the user this command runs as, and its trust.
async fn book(settings: &Settings) -> amqp_delay::Result<(Book, String, Trust)> {
    let layout = settings.layout()?;
    connected(settings, "amqp-delay recurring", async |conn| {
        let user = conn.status().username();
        let trust = Trust::new(Some(user.clone()), &settings.trust);
        let (book, _) = control::read_schedules(conn, &layout, &settings.trust).await?;
        Ok((book, user, trust))
    })
    .await
}

/// `list`: the schedules this user sees, by owner and name.
async fn list(settings: &Settings, json: bool) -> amqp_delay::Result<i32> {
    let (book, user, trust) = book(settings).await?;
    let now = now_ms();
    for e in book.visible_to(&user, &trust) {
        let next = next_ticks(e, now, 1).first().copied();
        if json {
            outln!("{}", entry_json(e, next.into_iter().collect()));
        } else {
            outln!(
                "{}\t{}\t{}\t{}\t{}\t{}",
                escape_controls(&e.owner),
                e.def.name,
                escape_controls(&e.def.cron),
                e.def.tz,
                escape_controls(&e.def.queue),
                match (e.paused, next) {
                    (true, _) => "paused".to_string(),
                    (false, Some(t)) => format!("next {}", rfc3339(t)),
                    (false, None) => "ended".to_string(),
                }
            );
        }
    }
    Ok(0)
}

/// `show`: one schedule and its next ticks.
async fn show(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let (book, user, trust) = book(settings).await?;
    let e = visible(&book, &user, &trust, n)?;
    let ticks = next_ticks(e, now_ms(), SHOWN_TICKS);
    if n.json {
        outln!("{}", entry_json(e, ticks));
        return Ok(0);
    }
    outln!(
        "{}",
        serde_json::to_string_pretty(&entry_json(e, ticks)).unwrap_or_default()
    );
    Ok(0)
}

/// `pause`, `resume`, `remove`: the schedule must be one this user sees.
async fn set(settings: &Settings, n: &RecurringName, action: Action) -> amqp_delay::Result<i32> {
    let (book, user, trust) = book(settings).await?;
    let e = visible(&book, &user, &trust, n)?;
    let record = Record::RecurringSet(Set {
        name: e.def.name.clone(),
        owner: (e.owner != user).then(|| e.owner.clone()),
        action,
        at_ms: now_ms(),
    });
    let layout = settings.layout()?;
    connected(settings, "amqp-delay recurring", async |conn| {
        control::append(conn, &layout, &record).await
    })
    .await?;
    let done = match action {
        Action::Pause => "paused",
        Action::Resume => "resumed",
        Action::Remove => "removed",
    };
    outln!(
        "{done} recurring schedule '{}' of {}",
        e.def.name,
        escape_controls(&e.owner)
    );
    Ok(0)
}

/// `run-now`: one occurrence due now, published as this user.
async fn run_now(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let (book, user, trust) = book(settings).await?;
    let e = visible(&book, &user, &trust, n)?;
    let msg = occurrence(&e.def, now_ms() / 1000 * 1000, 0);
    let publisher = Publisher::connect(settings).await?;
    let r = publisher.schedule(msg).await;
    publisher.close().await;
    outln!("sent {}", escape_controls(&r?.message_id));
    Ok(0)
}

/// `purge`: one purge record covering the schedule's occurrences in its queue.
async fn purge(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let (book, user, trust) = book(settings).await?;
    let e = visible(&book, &user, &trust, n)?;
    let p = PurgeScope {
        owner: (e.owner != user).then(|| e.owner.clone()),
        header: Some((headers::RECURRING.to_string(), e.def.name.clone())),
        ..PurgeScope::queue(e.def.queue.clone())
    };
    let publisher = Publisher::connect(settings).await?;
    let r = publisher.purge(p).await;
    publisher.close().await;
    r?;
    outln!(
        "purged the scheduled occurrences of '{}' of {}",
        e.def.name,
        escape_controls(&e.owner)
    );
    Ok(0)
}

/// The schedule `n` names, if `user` sees it (its own, or as an admin `--owner`'s).
fn visible<'a>(
    book: &'a Book,
    user: &str,
    trust: &Trust,
    n: &RecurringName,
) -> amqp_delay::Result<&'a Entry> {
    let owner = match &n.owner {
        Some(o) if trust.is_admin(user) => o.as_str(),
        Some(_) => {
            return Err(Error::Invalid(
                "--owner is an admin's (trust.admins)".into(),
            ));
        }
        None => user,
    };
    book.get(owner, &n.name)
        .ok_or_else(|| Error::Invalid(format!("{owner} has no recurring schedule '{}'", n.name)))
}

/// The next `n` ticks of `e` after `now`, within its window (none when paused).
fn next_ticks(e: &Entry, now: u64, n: usize) -> Vec<u64> {
    let Ok(ticks) = e.def.check() else {
        return Vec::new();
    };
    if e.paused {
        return Vec::new();
    }
    let after = now.max(e.def.from_ms.map_or(0, |f| f.saturating_sub(1)));
    ticks.between(after, e.def.until_ms.unwrap_or(u64::MAX), n)
}

fn entry_json(e: &Entry, next: Vec<u64>) -> serde_json::Value {
    serde_json::json!({
        "owner": e.owner,
        "name": e.def.name,
        "cron": e.def.cron,
        "tz": e.def.tz,
        "queue": e.def.queue,
        "headers": e.def.headers,
        "misfire": e.def.misfire,
        "from": e.def.from_ms.map(rfc3339),
        "until": e.def.until_ms.map(rfc3339),
        "paused": e.paused,
        "rev": e.rev,
        "scheduled_through": e.through_ms.map(rfc3339),
        "next_ticks": next.into_iter().map(rfc3339).collect::<Vec<_>>(),
    })
}
