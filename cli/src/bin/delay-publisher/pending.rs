//! `pending list|show|purge|reschedule|cancel|status|serve`: what is scheduled and not yet
//! run, from a running `pending serve` or from the streams read for this command
//! (`amqp_delay_cli::pending::client::Source`), printed for people or as JSON.

use std::io::{BufRead, IsTerminal, Write};

use amqp_delay::ops::control::PurgeScope;
use amqp_delay::ops::control::Reschedule;
use amqp_delay::settings::Settings;
use amqp_delay_cli::cli::{self, escape_controls};
use amqp_delay_cli::outln;
use amqp_delay_cli::pending::client::Source;
use amqp_delay_cli::pending::follow::{FollowOptions, Lag};
use amqp_delay_cli::pending::http;
use amqp_delay_cli::pending::service::{Failure, Query};
use amqp_delay_cli::pending::when::format_time;
use amqp_delay_cli::pending::wire::{MessageOut, RowOut, SteeredOut};

use crate::args::{IndexSource, PendingCmd};

/// Runs one `pending` subcommand; its exit code.
pub(crate) async fn run(mut settings: Settings, cmd: PendingCmd) -> amqp_delay::Result<i32> {
    if let PendingCmd::Serve { listen, index } = cmd {
        return serve(settings, listen, index).await;
    }
    let source = match &cmd {
        PendingCmd::List { source, .. }
        | PendingCmd::Show { source, .. }
        | PendingCmd::Purge { source, .. }
        | PendingCmd::Reschedule { source, .. }
        | PendingCmd::Cancel { source, .. }
        | PendingCmd::Status { source, .. } => source,
        PendingCmd::Serve { .. } => unreachable!("served above"),
    };
    use_source(&mut settings, source);
    match answer(&settings, cmd).await {
        Ok(code) => Ok(code),
        Err(f) => {
            cli::print_error(&f.to_string());
            Ok(exit_code(&f))
        }
    }
}

/// 2 when the request must change (an id, a filter, a time, a setting), else 1.
pub(crate) fn exit_code(f: &Failure) -> i32 {
    match f {
        Failure::Broker(e) => cli::exit_code(e),
        f if f.is_usage() => cli::EXIT_USAGE,
        _ => cli::EXIT_FAILURES,
    }
}

fn use_source(settings: &mut Settings, source: &IndexSource) {
    if let Some(u) = &source.index_url {
        settings.pending.index_url = Some(u.clone());
    }
}

async fn answer(settings: &Settings, cmd: PendingCmd) -> Result<i32, Failure> {
    let src = Source::open(settings).await?;
    match cmd {
        PendingCmd::List {
            queue,
            filter,
            limit,
            after,
            json,
            ..
        } => {
            let q = Query {
                queue,
                due_after_ms: filter.due_after,
                due_before_ms: filter.due_before,
                header: filter.header,
                limit: Some(usize::from(limit)),
                after,
            };
            list(&src, &q, json).await
        }
        PendingCmd::Show {
            id, owner, json, ..
        } => {
            let s = src.show(&id, owner.as_deref()).await?;
            if json {
                outln!("{}", to_json(&s));
            } else {
                s.messages.iter().for_each(show);
            }
            behind(&s.lag);
            Ok(0)
        }
        PendingCmd::Purge {
            queue,
            owner,
            filter,
            yes,
            ..
        } => purge(&src, queue, owner, filter, yes).await,
        PendingCmd::Reschedule {
            id,
            delay,
            at,
            owner,
            ..
        } => {
            let due_at_ms = match (delay, at) {
                (Some(d), _) => amqp_delay::time::now_ms().saturating_add(d.as_millis()),
                (None, Some(t)) => t,
                (None, None) => return Err(Failure::Invalid("give --delay or --at".into())),
            };
            let r = Reschedule {
                id,
                owner,
                due_at_ms,
            };
            steered(&src.reschedule(&r).await?);
            Ok(0)
        }
        PendingCmd::Cancel { id, owner, .. } => {
            steered(&src.cancel(&id, owner.as_deref()).await?);
            Ok(0)
        }
        PendingCmd::Status { json, .. } => {
            let s = src.status().await?;
            if json {
                outln!("{}", to_json(&s));
            } else {
                outln!(
                    "{}",
                    s.lag
                        .describe()
                        .unwrap_or_else(|| "the index is up to date".into())
                );
            }
            Ok(0)
        }
        PendingCmd::Serve { .. } => unreachable!("served before"),
    }
}

async fn list(src: &Source, q: &Query, json: bool) -> Result<i32, Failure> {
    let page = src.list(q).await?;
    if json {
        outln!("{}", to_json(&page));
    } else {
        for r in &page.rows {
            outln!("{}", line(r));
        }
        if let Some(n) = &page.next {
            eprintln!("more: --after {n}");
        }
    }
    behind(&page.lag);
    Ok(0)
}

async fn purge(
    src: &Source,
    queue: String,
    owner: Option<String>,
    filter: crate::args::PendingFilter,
    yes: bool,
) -> Result<i32, Failure> {
    let scope = PurgeScope {
        queue,
        owner,
        due_after_ms: filter.due_after,
        due_before_ms: filter.due_before,
        header: filter.header,
    };
    if !yes {
        if !std::io::stdin().is_terminal() {
            return Err(Failure::Invalid(
                "purge cancels every message it covers: give --yes (stdin is not a terminal to \
                 ask on)"
                    .into(),
            ));
        }
        let n = src.purge(&scope, true).await?;
        behind(&n.lag);
        if !confirm(n.covered, &scope.queue) {
            outln!("nothing purged");
            return Ok(cli::EXIT_FAILURES);
        }
    }
    let done = src.purge(&scope, false).await?;
    outln!(
        "purged {} pending message(s) of queue {}",
        done.covered,
        escape_controls(&done.queue)
    );
    behind(&done.lag);
    Ok(0)
}

fn confirm(n: u64, queue: &str) -> bool {
    let mut err = std::io::stderr();
    let _ = write!(
        err,
        "purge {n} messages of queue '{}'? [y/N] ",
        escape_controls(queue)
    );
    let _ = err.flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    matches!(answer.trim(), "y" | "Y" | "yes")
}

/// Tells on stderr how far behind the index is, when it is.
fn behind(lag: &Lag) {
    if let Some(l) = lag.describe() {
        eprintln!("note: {}", escape_controls(&l));
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// `due id owner destination state size`, control characters escaped.
fn line(r: &RowOut) -> String {
    format!(
        "{} {} owner={} {} state={} size={}",
        r.due_at,
        escape_controls(&r.id),
        escape_controls(&r.owner),
        escape_controls(&r.destination.describe()),
        r.state,
        r.size
    )
}

fn show(m: &MessageOut) {
    let r = &m.row;
    outln!("{}", line(r));
    outln!("scheduled_at: {}", format_time(r.scheduled_at_ms));
    outln!(
        "content_type: {}",
        escape_controls(r.content_type.as_deref().unwrap_or("-"))
    );
    for (k, v) in &r.headers {
        outln!("header {}: {}", escape_controls(k), escape_controls(v));
    }
    for e in &m.history {
        outln!("event: {}", escape_controls(&e.describe()));
    }
    match (&m.body, m.body_encoding.as_deref()) {
        (Some(b), Some("base64")) => outln!("body (base64): {b}"),
        (Some(b), _) => outln!("body: {}", escape_controls(b)),
        (None, _) => outln!("body: not kept"),
    }
}

fn steered(s: &SteeredOut) {
    match s.due_at_ms {
        Some(due) => outln!(
            "{} {} (owner {}) from {} to {}{}",
            s.action,
            escape_controls(&s.id),
            escape_controls(&s.owner),
            format_time(s.from_due_at_ms),
            format_time(due),
            if s.resent {
                " (sent again from its kept body)"
            } else {
                ""
            }
        ),
        None => outln!(
            "{} {} (owner {}), due {}",
            s.action,
            escape_controls(&s.id),
            escape_controls(&s.owner),
            format_time(s.from_due_at_ms)
        ),
    }
}

/// `pending serve`: the follower and the HTTP API until a signal.
async fn serve(
    settings: Settings,
    listen: Option<String>,
    index: Option<std::path::PathBuf>,
) -> amqp_delay::Result<i32> {
    let listen = listen.unwrap_or_else(|| settings.pending.listen.clone());
    let Some(index) = index.or_else(|| settings.pending.index.clone()) else {
        return Err(amqp_delay::Error::Invalid(
            "pending serve keeps its index in a file: give --index PATH (or pending.index)".into(),
        ));
    };
    cli::start_metrics(&settings).await?;
    let options = FollowOptions {
        history: settings.journal.history.as_duration(),
        ..FollowOptions::default()
    };
    http::serve(settings, &listen, &index, options, cli::shutdown_signal()).await?;
    Ok(0)
}
