//! `recurring add|list|show|pause|resume|remove|run-now|purge|serve`: recurring schedules,
//! each a record of the control stream written as this user (`amqp_delay::recurring`); the
//! current set is the fold of the stream, of which this user sees its own schedules (an
//! admin: all), through `amqp_delay_cli::schedules`, which the API and the console share. `serve`
//! is `amqp_delay_cli::recurring`.

use amqp_delay::recurring::{Action, Definition, rfc3339};
use amqp_delay::settings::Settings;
use amqp_delay::time::now_ms;
use amqp_delay_cli::cli::escape_controls;
use amqp_delay_cli::outln;
use amqp_delay_cli::recurring::{ServeOptions, serve};
use amqp_delay_cli::schedules::{self, ScheduleOut};

use crate::args::{RecurringAddArgs, RecurringCmd, RecurringName};

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
    let next = schedules::add(settings, &def).await?;
    outln!(
        "added recurring schedule '{}': next tick {}",
        def.name,
        rfc3339(next)
    );
    Ok(0)
}

/// `list`: the schedules this user sees, by owner and name.
async fn list(settings: &Settings, json: bool) -> amqp_delay::Result<i32> {
    let v = schedules::view(settings).await?;
    let now = now_ms();
    for e in v.visible() {
        let next = schedules::next_ticks(e, now, 1).first().copied();
        if json {
            outln!("{}", to_json(&ScheduleOut::of(e, now, 1)));
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

fn to_json(s: &ScheduleOut) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `show`: one schedule and its next ticks.
async fn show(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let v = schedules::view(settings).await?;
    let e = v.get(&n.name, n.owner.as_deref())?;
    let out = ScheduleOut::of(e, now_ms(), schedules::SHOWN_TICKS);
    if n.json {
        outln!("{}", to_json(&out));
    } else {
        outln!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    }
    Ok(0)
}

/// `pause`, `resume`, `remove`: the schedule must be one this user sees.
async fn set(settings: &Settings, n: &RecurringName, action: Action) -> amqp_delay::Result<i32> {
    let e = schedules::set(settings, &n.name, n.owner.as_deref(), action).await?;
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
    let id = schedules::run_now(settings, &n.name, n.owner.as_deref()).await?;
    outln!("sent {}", escape_controls(&id));
    Ok(0)
}

/// `purge`: one purge record covering the schedule's occurrences in its queue.
async fn purge(settings: &Settings, n: &RecurringName) -> amqp_delay::Result<i32> {
    let e = schedules::purge(settings, &n.name, n.owner.as_deref()).await?;
    outln!(
        "purged the scheduled occurrences of '{}' of {}",
        e.def.name,
        escape_controls(&e.owner)
    );
    Ok(0)
}
