//! `delay-publisher`: declare the topology, schedule messages (one, or a JSONL bulk file), show
//! tier depths, plan a delay, remove the topology, run the `x-delay` gateway. Thin: the work is
//! in the library.

mod args;

use std::io::IsTerminal;
use std::path::PathBuf;

use amqp_delay::connection::{self, Connector};
use amqp_delay::gateway::Gateway;
use amqp_delay::headers;
use amqp_delay::settings::{GatewaySettings, Settings};
use amqp_delay::{Error, Message, Publisher, Topology};
use amqp_delay_cli::admin;
use amqp_delay_cli::bulk;
use amqp_delay_cli::cli::{self, EXIT_FAILURES, EXIT_USAGE};
use args::{CancelArgs, Cli, Cmd, SendArgs};
use clap::Parser;
use tokio::io::AsyncRead;

#[tokio::main]
async fn main() {
    let args = Cli::parse();
    cli::init_logging_as(args.global.log_format);
    let settings = match args.global.settings() {
        Ok(s) => s,
        Err(e) => cli::fail(&e, EXIT_USAGE),
    };
    let code = match run(args.cmd, settings).await {
        Ok(code) => code,
        Err(e) => {
            let code = match e {
                Error::Settings(_) | Error::Invalid(_) | Error::Plan(_) => EXIT_USAGE,
                _ => EXIT_FAILURES,
            };
            cli::fail(&e, code)
        }
    };
    std::process::exit(code);
}

async fn run(cmd: Cmd, settings: Settings) -> amqp_delay::Result<i32> {
    let layout = settings
        .layout()
        .map_err(amqp_delay::settings::SettingsError::from)?;
    match cmd {
        Cmd::Plan { delay } => {
            let r = amqp_delay::plan(&layout, &settings.precision, delay.as_millis())?;
            amqp_delay_cli::outln!(
                "{}",
                serde_json::json!({
                    "delay_ms": r.delay_ms,
                    "total_ms": r.total_ms,
                    "lateness_ms": r.lateness_ms(),
                    "hops": r.hops(),
                    "route": r.describe(),
                    "exchange": r.exchange(&layout),
                    "routing_key": r.routing_key(&layout, "<queue>"),
                })
            );
            Ok(0)
        }
        Cmd::Declare { queues, worker } => {
            let conn = Connector::new(&settings)?
                .connect("amqp-delay declare")
                .await?;
            let topo = Topology::new(layout.clone());
            // queues deleted from a topology declared before (e.g. by an operator) are named
            // once re-created, so a repair says what it repaired
            let missing: Vec<String> = match topo.verify(&conn).await {
                Ok(()) => topo
                    .stats(&conn)
                    .await
                    .map(|s| {
                        s.into_iter()
                            .filter(|s| s.missing)
                            .map(|s| s.queue)
                            .collect()
                    })
                    .unwrap_or_default(),
                Err(_) => Vec::new(),
            };
            topo.declare(&conn).await?;
            for q in &missing {
                amqp_delay_cli::outln!("re-created missing queue '{q}'");
            }
            for q in &queues {
                let created = topo.declare_destination(&conn, q).await?;
                if worker {
                    topo.declare_parking(&conn, q).await?;
                    topo.declare_batch_marker(&conn, q).await?;
                }
                amqp_delay_cli::outln!(
                    "destination queue '{q}' {}{}",
                    if created { "created" } else { "exists" },
                    if worker {
                        ", with its parking queue and batch marker"
                    } else {
                        ""
                    }
                );
            }
            amqp_delay::broker::close_connection(&conn, "bye").await;
            amqp_delay_cli::outln!(
                "declared '{}' on {}: {layout}",
                layout.prefix(),
                connection::redact_url(&settings.url)
            );
            Ok(0)
        }
        Cmd::Stats {
            json,
            non_empty,
            summary,
        } => {
            let conn = Connector::new(&settings)?
                .connect("amqp-delay stats")
                .await?;
            let management = admin::management(&settings).await;
            let stats = Topology::new(layout.clone())
                .stats_with(&conn, management.as_ref())
                .await;
            // messages rather than broker messages: a failure to count is said, not fatal
            let counted = match &stats {
                Ok(_) => amqp_delay::ledger::count(&conn, &layout).await,
                Err(_) => Ok(None),
            };
            amqp_delay::broker::close_connection(&conn, "bye").await;
            let stats = stats?;
            let totals = admin::StatsSummary::of(&stats, counted);
            if summary {
                if json {
                    amqp_delay_cli::outln!(
                        "{}",
                        serde_json::to_string_pretty(&totals).expect("serialisable")
                    );
                } else {
                    print_summary(&totals, management.is_some());
                }
                return Ok(0);
            }
            let shown: Vec<_> = stats
                .iter()
                .filter(|s| !non_empty || s.messages > 0 || s.missing)
                .collect();
            if json {
                amqp_delay_cli::outln!(
                    "{}",
                    serde_json::to_string_pretty(&shown).expect("serialisable")
                );
            } else {
                amqp_delay_cli::outln!(
                    "{:<48} {:>9} {:>14} {:>14} {:>10} {:>10} {:>10}  leader",
                    "queue",
                    "kind",
                    "ttl_ms",
                    "due_within_ms",
                    "messages",
                    "ready",
                    "unacked"
                );
                for s in &shown {
                    let ttl = s.ttl_ms.map_or_else(|| "-".into(), |t| t.to_string());
                    let unacked = s.unacked.map_or_else(|| "?".into(), |n| n.to_string());
                    if s.missing {
                        amqp_delay_cli::outln!(
                            "{:<48} {:>9} {:>14} MISSING (`declare` re-creates it)",
                            s.queue,
                            s.kind,
                            ttl
                        );
                        continue;
                    }
                    amqp_delay_cli::outln!(
                        "{:<48} {:>9} {:>14} {:>14} {:>10} {:>10} {:>10}  {}",
                        s.queue,
                        s.kind,
                        ttl,
                        s.due_within_ms
                            .map_or_else(|| "-".into(), |t| t.to_string()),
                        s.messages,
                        s.ready,
                        unacked,
                        s.leader.as_deref().unwrap_or("-")
                    );
                }
                print_summary(&totals, management.is_some());
            }
            Ok(0)
        }
        Cmd::Teardown { force, queue } if !queue.is_empty() => {
            let conn = Connector::new(&settings)?
                .connect("amqp-delay teardown")
                .await?;
            let management = admin::management(&settings).await;
            for q in &queue {
                let done =
                    admin::teardown_destination(&conn, &layout, management.as_ref(), q, force)
                        .await;
                let done = match done {
                    Ok(d) => d,
                    Err(e) => {
                        amqp_delay::broker::close_connection(&conn, "bye").await;
                        return Err(e);
                    }
                };
                let mut removed: Vec<String> =
                    done.queues.iter().map(|q| format!("queue '{q}'")).collect();
                if done.marker {
                    removed.push("its batch marker".into());
                }
                if removed.is_empty() {
                    amqp_delay_cli::outln!("'{q}': nothing to remove");
                } else {
                    amqp_delay_cli::outln!(
                        "removed {} (messages still in the tiers for '{q}' will be parked in '{}' when they fall due)",
                        removed.join(", "),
                        layout.unroutable_queue()
                    );
                }
            }
            amqp_delay::broker::close_connection(&conn, "bye").await;
            Ok(0)
        }
        Cmd::Teardown { force, .. } => {
            let conn = Connector::new(&settings)?
                .connect("amqp-delay teardown")
                .await?;
            let management = admin::management(&settings).await;
            let done = admin::teardown(&conn, &layout, management.as_ref(), force).await;
            amqp_delay::broker::close_connection(&conn, "bye").await;
            let done = done?;
            amqp_delay_cli::outln!(
                "removed the topology under prefix '{}' and {} gateway pair(s){}",
                layout.prefix(),
                done.pairs.len(),
                done.pairs
                    .iter()
                    .map(|p| format!(" '{p}'"))
                    .collect::<String>()
            );
            Ok(0)
        }
        Cmd::Gateway(a) => {
            let mut settings = settings;
            if !a.ingress.is_empty() || !a.target.is_empty() {
                // the flags name the pairs; `gateway.batch_linger` and `gateway.hold` still
                // come from the configuration
                settings.gateway.pairs = GatewaySettings::from_flags(&a.ingress, &a.target)
                    .map_err(Error::Invalid)?
                    .pairs;
            }
            let gateway = Gateway::new(settings.clone())?;
            if a.declare_only {
                let conn = Connector::new(&settings)?
                    .connect("amqp-delay gateway declare")
                    .await?;
                let r = gateway.declare(&conn).await;
                amqp_delay::broker::close_connection(&conn, "bye").await;
                r?;
                for p in gateway.pairs() {
                    amqp_delay_cli::outln!(
                        "declared gateway pair '{}' -> '{}' under prefix '{}'",
                        p.ingress,
                        p.target,
                        settings.prefix
                    );
                }
                return Ok(0);
            }
            cli::start_metrics(&settings).await?;
            gateway.run(cli::shutdown_signal()).await?;
            Ok(0)
        }
        Cmd::Cancel(a) => {
            let publisher = Publisher::connect(&settings).await?;
            let code = cancel(&publisher, a).await;
            publisher.close().await;
            code
        }
        Cmd::Send(a) => {
            // a single message is checked before anything is connected
            let one = match a.jsonl {
                None => Some(one_message(&a, &settings).await?),
                Some(_) => None,
            };
            let publisher = Publisher::connect(&settings).await?;
            let code = match (one, a.jsonl.clone()) {
                (Some(m), _) => send_one(&publisher, m).await,
                (None, Some(path)) => send_jsonl(&publisher, &a, &path).await,
                (None, None) => Ok(EXIT_USAGE),
            };
            publisher.close().await;
            code
        }
    }
}

async fn cancel(p: &Publisher, a: CancelArgs) -> amqp_delay::Result<i32> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        id: String,
        #[serde(default)]
        due_at: Option<u64>,
    }
    let show = |c: &amqp_delay::cancel::Cancelled| {
        amqp_delay_cli::outln!(
            "{}",
            serde_json::json!({"id": c.id, "until": c.until_ms, "verdict": c.verdict})
        )
    };
    let Some(path) = a.jsonl else {
        let id = a.id.unwrap_or_default();
        let c = p.cancel(&id, a.due_at).await?;
        show(&c);
        return Ok(0);
    };
    let text = if path.as_os_str() == "-" {
        let mut v = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::stdin(), &mut v)
            .await
            .map_err(|e| Error::Invalid(format!("reading stdin: {e}")))?;
        v
    } else {
        tokio::fs::read_to_string(&path)
            .await
            .map_err(|e| Error::Invalid(format!("cannot read {}: {e}", path.display())))?
    };
    let mut failed = 0u64;
    let mut items = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Line>(line) {
            Ok(l) => items.push((n + 1, l.id, l.due_at)),
            Err(e) => {
                eprintln!("line {}: not a cancel request: {e}", n + 1);
                failed += 1;
            }
        }
    }
    let mut done = 0u64;
    let mut results = std::pin::pin!(p.cancel_all(futures::stream::iter(items)));
    while let Some((n, r)) = futures::StreamExt::next(&mut results).await {
        match r {
            Ok(c) => {
                done += 1;
                show(&c);
            }
            Err(e) => {
                failed += 1;
                eprintln!("line {n}: {}", cli::chain(&e));
            }
        }
    }
    eprintln!("{done} cancelled, {failed} failed");
    Ok(if failed > 0 { EXIT_FAILURES } else { 0 })
}

/// The message of a single `send`, checked (every rule the publisher applies but the broker's).
async fn one_message(a: &SendArgs, settings: &Settings) -> amqp_delay::Result<Message> {
    let (Some(queue), Some(delay)) = (&a.queue, a.delay) else {
        return Err(Error::Invalid(
            "--queue and --delay are required without --jsonl".into(),
        ));
    };
    let body: Vec<u8> = match (&a.body, &a.body_file) {
        (Some(b), None) => b.clone().into_bytes(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut v = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut tokio::io::stdin(), &mut v)
                .await
                .map_err(|e| Error::Invalid(format!("reading the body from stdin: {e}")))?;
            v
        }
        (None, Some(f)) => tokio::fs::read(f)
            .await
            .map_err(|e| Error::Invalid(format!("cannot read --body-file {}: {e}", f.display())))?,
        _ => {
            return Err(Error::Invalid(
                "give the body with --body TEXT or --body-file FILE ('-' for stdin)".into(),
            ));
        }
    };
    let mut m = Message::new(queue.clone(), delay.as_millis(), body);
    if let Some(id) = &a.id {
        m = m.with_id(id.clone());
    }
    if let Some(ct) = &a.content_type {
        m = m.with_content_type(ct.clone());
    }
    if !a.headers.is_empty() {
        let mut obj = serde_json::Map::new();
        for h in &a.headers {
            match h.split_once('=') {
                Some((k, v)) if !k.is_empty() => {
                    obj.insert(k.to_string(), serde_json::Value::String(v.to_string()));
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "--header '{h:.60}' is not NAME=VALUE with a non-empty NAME"
                    )));
                }
            }
        }
        m = m.with_headers(headers::json_to_table(&obj).map_err(Error::Invalid)?);
    }
    m.check(settings.publisher.max_message_bytes)
        .map_err(Error::Invalid)?;
    amqp_delay::plan(&settings.layout()?, &settings.precision, m.delay_ms)?;
    settings
        .layout()?
        .validate_destination(&m.destination)
        .map_err(Error::Invalid)?;
    Ok(m)
}

async fn send_one(p: &Publisher, m: Message) -> amqp_delay::Result<i32> {
    let queue = m.destination.clone();
    let s = p.schedule(m).await?;
    cli::print_line(
        &serde_json::json!({
            "id": s.message_id,
            "queue": queue,
            "delay_ms": s.delay_ms,
            "due_at": s.due_at_ms,
            "hops": s.route.hops(),
            "route": s.route.describe(),
        })
        .to_string(),
    );
    Ok(0)
}

async fn send_jsonl(
    p: &Publisher,
    a: &SendArgs,
    path: &std::path::Path,
) -> amqp_delay::Result<i32> {
    let stdin = path.as_os_str() == "-";
    let input: Box<dyn AsyncRead + Unpin + Send> = if stdin {
        Box::new(tokio::io::stdin())
    } else {
        Box::new(
            tokio::fs::File::open(path)
                .await
                .map_err(|e| Error::Invalid(format!("cannot open {}: {e}", path.display())))?,
        )
    };
    let derived =
        |suffix: &str| (!stdin).then(|| PathBuf::from(format!("{}.{suffix}", path.display())));
    let resend = bulk::ResendFiles {
        not_sent: a.unsent.clone().or_else(|| derived("unsent")),
        maybe_sent: a.maybe_sent.clone().or_else(|| derived("maybe-sent")),
    };
    let progress = std::io::stderr().is_terminal();
    let summary = bulk::send_jsonl(
        p,
        input,
        &resend,
        |line, s| {
            if progress {
                eprint!("\r\x1b[K");
            }
            match line {
                Some((n, bulk::LineEnd::MaybeSent, reason)) => {
                    eprintln!(
                        "line {n}: maybe sent (confirm lost; may have been delivered): {reason}"
                    )
                }
                Some((n, bulk::LineEnd::NotSent, reason)) => {
                    eprintln!("line {n}: not sent: {reason}")
                }
                Some((n, _, reason)) => eprintln!("line {n}: {reason}"),
                None => eprint!("{} confirmed, {} failed", s.confirmed, s.failed()),
            }
        },
        progress,
    )
    .await?;
    if progress {
        eprint!("\r\x1b[K");
    }
    amqp_delay_cli::outln!(
        "{} confirmed, {} failed ({} invalid, {} not sent, {} maybe sent)",
        summary.confirmed,
        summary.failed(),
        summary.invalid,
        summary.not_sent,
        summary.maybe_sent
    );
    for (n, file, what) in [
        (
            summary.not_sent,
            &resend.not_sent,
            "not sent: send this file again",
        ),
        (
            summary.maybe_sent,
            &resend.maybe_sent,
            "maybe sent: re-sending may duplicate them (same ids)",
        ),
    ] {
        if let (true, Some(f)) = (n > 0, file) {
            amqp_delay_cli::outln!("{what}: {}", f.display());
        }
    }
    Ok(if summary.failed() > 0 {
        EXIT_FAILURES
    } else {
        0
    })
}

/// The totals under `stats`' table (and all of `stats --summary`).
fn print_summary(t: &admin::StatsSummary, with_management: bool) {
    match (&t.messages, &t.messages_error) {
        (Some(m), _) => amqp_delay_cli::outln!(
            "messages not yet due: {} (due within 1 minute: {}, within 1 hour: {}, within 1 day: {}), counted from the ledger",
            m.pending.total,
            m.pending.within_1m,
            m.pending.within_1h,
            m.pending.within_1d
        ),
        (None, Some(e)) => amqp_delay_cli::outln!("messages not yet due: unknown ({e})"),
        (None, None) => amqp_delay_cli::outln!(
            "messages not yet due: unknown (the topology has no ledger stream: `delay-publisher declare` adds it; until then only broker messages are counted)"
        ),
    }
    let b = &t.broker_messages;
    amqp_delay_cli::outln!(
        "broker messages in the tiers: {} (a batch counts once; due within 1 minute: {}, within 1 hour: {}, within 1 day: {}, later: {}, by their tier's longest wait), parked: {}",
        b.in_tiers,
        b.within_1m,
        b.within_1h,
        b.within_1d,
        b.later,
        b.parked
    );
    if t.missing_queues > 0 {
        amqp_delay_cli::outln!(
            "{} queue(s) missing: run `delay-publisher declare` to re-create them",
            t.missing_queues
        );
    }
    if !t.dead_lettered_waiting.is_empty() {
        amqp_delay_cli::outln!(
            "dead-lettered, waiting for the broker's dead-letter worker: {}. Normal for a moment after a restart or failover; if it does not shrink, restart the RabbitMQ application of the node leading the tier (OPERATIONS.md, \"Dead-lettered messages that do not move\")",
            t.dead_lettered_waiting.join(", ")
        );
    }
    if !with_management {
        amqp_delay_cli::outln!(
            "(ready messages only: without the management API, messages held by the broker's dead-letter worker are not counted)"
        );
    }
}
