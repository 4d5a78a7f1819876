//! `recurring add|list|show|pause|resume|remove|run-now|purge|serve`: recurring schedules,
//! each a record of the control stream written as this user (`amqp_delay::recurring`); the
//! current set is the fold of the stream, of which this user sees its own schedules (an
//! admin: all), through `amqp_delay_cli::schedules`, which the API and the console share.
//! `list` and `show` ask `pending serve` when `pending.index_url` names one (its live book),
//! else replay the stream. `serve`
//! is `amqp_delay_cli::recurring`.

use amqp_delay::recurring::{Action, Definition, rfc3339};
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay_cli::cli::{self, escape_controls};
use amqp_delay_cli::outln;
use amqp_delay_cli::pending::client::index_server;
use amqp_delay_cli::pending::service::Failure;
use amqp_delay_cli::recurring::{ServeOptions, serve};
use amqp_delay_cli::schedules::{self, Books, ScheduleOut};

use crate::args::{IndexSource, RecurringAddArgs, RecurringCmd, RecurringName};

/// Runs one `recurring` subcommand; its exit code.
pub(crate) async fn run(settings: &Settings, cmd: RecurringCmd) -> amqp_delay::Result<i32> {
    match cmd {
        RecurringCmd::Add(a) => add(settings, a).await,
        RecurringCmd::List {
            json,
            limit,
            after,
            source,
        } => {
            let page = schedules::Page::parse(after.as_deref(), Some(limit))?;
            list(&with(settings, &source), &page, json).await
        }
        RecurringCmd::Show { name, source } => show(&with(settings, &source), &name).await,
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

/// `add`: the definition checked and written as this user ([`schedules::add`]).
async fn add(settings: &Settings, a: RecurringAddArgs) -> amqp_delay::Result<i32> {
    let def = Definition {
        headers: a.headers,
        misfire: a.misfire,
        from_ms: a.from,
        until_ms: a.until,
        tz: a.tz,
        ..Definition::new(&a.name, &a.cron, &a.queue, &a.body)
    };
    let next = schedules::add(settings, Books::Replay, &def).await?;
    outln!(
        "added recurring schedule '{}': next tick {}",
        def.name,
        rfc3339(next)
    );
    Ok(0)
}

/// `settings` with `--index-url`, when given.
fn with(settings: &Settings, source: &IndexSource) -> Settings {
    let mut s = settings.clone();
    if let Some(u) = &source.index_url {
        s.pending.index_url = Some(u.clone());
    }
    s
}

/// A failure of the index server as the command's end: its line and exit code.
fn failed(f: &Failure) -> i32 {
    cli::print_error(&f.to_string());
    crate::pending::exit_code(f)
}

/// `list`: the schedules this user sees, by owner and name: from the index server when
/// `pending.index_url` names one, else replayed from the control stream.
async fn list(settings: &Settings, page: &schedules::Page, json: bool) -> amqp_delay::Result<i32> {
    let (all, next) = match index_server(settings) {
        Err(f) => return Ok(failed(&f)),
        Ok(Some(r)) => match r.schedules(page).await {
            Ok(out) => out,
            Err(f) => return Ok(failed(&f)),
        },
        Ok(None) => page.of(&schedules::view(settings).await?),
    };
    if let Some(next) = &next {
        eprintln!("more follow: --after {}", escape_controls(next));
    }
    cli::print_lines(all.iter().map(|s| {
        if json {
            return to_json(s);
        }
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            escape_controls(&s.owner),
            s.name,
            escape_controls(&s.cron),
            s.tz,
            escape_controls(&s.queue),
            match (s.paused, s.next_ticks.first()) {
                (true, _) => "paused".to_string(),
                (false, Some(t)) => format!("next {t}"),
                (false, None) => "ended".to_string(),
            }
        )
    }));
    Ok(0)
}

fn to_json(s: &ScheduleOut) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `show`: one schedule and its next ticks.
async fn show(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let out = match index_server(settings) {
        Err(f) => return Ok(failed(&f)),
        Ok(Some(r)) => match r.schedule(&n.name, n.owner.as_deref()).await {
            Ok(out) => out,
            Err(f) => return Ok(failed(&f)),
        },
        Ok(None) => {
            let v = schedules::view(settings).await?;
            let e = v.get(&n.name, n.owner.as_deref())?;
            ScheduleOut::of(e, now_ms(), schedules::SHOWN_TICKS)
        }
    };
    if n.json {
        outln!("{}", to_json(&out));
    } else {
        outln!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    }
    Ok(0)
}

/// `pause`, `resume`, `remove`: the schedule must be one this user sees.
async fn set(settings: &Settings, n: &RecurringName, action: Action) -> amqp_delay::Result<i32> {
    let e = schedules::set(settings, Books::Replay, &n.name, n.owner.as_deref(), action).await?;
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
    let id = schedules::run_now(settings, Books::Replay, &n.name, n.owner.as_deref()).await?;
    outln!("sent {}", escape_controls(&id));
    Ok(0)
}

/// `purge`: one purge record covering the schedule's occurrences in its queue.
async fn purge(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let e = schedules::purge(settings, Books::Replay, &n.name, n.owner.as_deref()).await?;
    outln!(
        "purged the scheduled occurrences of '{}' of {}",
        e.def.name,
        escape_controls(&e.owner)
    );
    Ok(0)
}
