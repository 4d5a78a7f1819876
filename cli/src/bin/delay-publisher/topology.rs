//! The topology subcommands: `declare`, `stats` and `teardown`.

use amqp_delay::ops::connection;
use amqp_delay::settings::Settings;
use amqp_delay::{Layout, QueueStat, Topology};
use amqp_delay_cli::admin;

use crate::connected;

/// The layout the settings describe (a bad one is a settings error: exit 2).
pub(crate) fn layout(settings: &Settings) -> amqp_delay::Result<Layout> {
    Ok(settings
        .layout()
        .map_err(amqp_delay::settings::SettingsError::from)?)
}

/// `declare`: the tiers (naming queues it re-created) and each `--queue` destination, with its
/// parking queue and batch marker for `--worker`.
pub(crate) async fn declare(
    settings: &Settings,
    queues: &[String],
    worker: bool,
) -> amqp_delay::Result<i32> {
    let layout = layout(settings)?;
    let topo = Topology::new(layout.clone());
    connected(settings, "amqp-delay declare", async |conn| {
        let missing = missing_queues(&topo, conn).await;
        topo.declare(conn).await?;
        for q in &missing {
            amqp_delay_cli::outln!("re-created missing queue '{q}'");
        }
        for q in queues {
            let created = topo.declare_destination(conn, q).await?;
            if worker {
                topo.declare_parking(conn, q).await?;
                topo.declare_batch_marker(conn, q).await?;
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
        Ok(())
    })
    .await?;
    amqp_delay_cli::outln!(
        "declared '{}' on {}: {layout}",
        layout.prefix(),
        connection::redact_url(&settings.url)
    );
    Ok(0)
}

/// Queues of a topology declared before (e.g. deleted by an operator since), so that a repair
/// says what it repaired; none for a topology not declared yet.
async fn missing_queues(topo: &Topology, conn: &lapin::Connection) -> Vec<String> {
    if topo.verify(conn).await.is_err() {
        return Vec::new();
    }
    topo.stats(conn)
        .await
        .map(|s| {
            s.into_iter()
                .filter(|s| s.missing)
                .map(|s| s.queue)
                .collect()
        })
        .unwrap_or_default()
}

/// `stats`: every tier's depth (a table or JSON) and the totals, or the totals alone.
pub(crate) async fn stats(
    settings: &Settings,
    json: bool,
    non_empty: bool,
    summary: bool,
) -> amqp_delay::Result<i32> {
    let layout = layout(settings)?;
    let management = admin::management(settings).await;
    let (stats, counted, unserved) = connected(settings, "amqp-delay stats", async |conn| {
        let mut stats = Topology::new(layout.clone())
            .stats_with(conn, management.as_ref())
            .await;
        // every pair's and destination's parking queue, and the pairs no gateway serves
        let unserved = match &mut stats {
            Ok(s) => admin::pairs_and_parking(conn, &layout, s).await?,
            Err(_) => Vec::new(),
        };
        // messages rather than broker messages: a failure to count is said, not fatal (but a
        // record over frame_max is read past, on a new connection)
        let counted = match &stats {
            Ok(_) => amqp_delay::ops::ledger::count(conn, &layout, &settings.trust).await,
            Err(_) => Ok(None),
        };
        for e in [stats.as_ref().err(), counted.as_ref().err()]
            .into_iter()
            .flatten()
        {
            if amqp_delay::ops::control::is_record_over_frame_max(e) {
                return Err(e.clone());
            }
        }
        Ok((stats, counted, unserved))
    })
    .await?;
    let stats = stats?;
    let mut totals = admin::StatsSummary::of(&stats, counted);
    totals.unserved_pairs = unserved;
    if summary && json {
        amqp_delay_cli::outln!("{}", to_json(&totals));
        return Ok(0);
    }
    if !summary {
        let shown: Vec<_> = stats
            .iter()
            .filter(|s| !non_empty || s.messages > 0 || s.missing)
            .collect();
        if json {
            amqp_delay_cli::outln!("{}", to_json(&shown));
            return Ok(0);
        }
        print_table(&shown);
    }
    print_summary(&totals, management.is_some());
    Ok(0)
}

fn to_json(v: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(v).expect("our own structs serialise")
}

/// One line per queue.
fn print_table(shown: &[&QueueStat]) {
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
    for s in shown {
        let ttl = s.ttl_ms.map_or_else(|| "-".into(), |t| t.to_string());
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
            s.unacked.map_or_else(|| "?".into(), |n| n.to_string()),
            s.leader.as_deref().unwrap_or("-")
        );
    }
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
    if !t.unserved_pairs.is_empty() {
        amqp_delay_cli::outln!(
            "gateway pairs no gateway serves: {} (their messages wait, late, until one does: run delay-proxy, or `delay-publisher gateway --follow-pairs` with the pair's registrar in trust.peers)",
            t.unserved_pairs.join(", ")
        );
    }
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

/// `teardown`: the `--queue` destinations' own queues, or (without `--queue`) the whole
/// topology and its gateway pairs.
pub(crate) async fn teardown(
    settings: &Settings,
    queues: &[String],
    force: bool,
) -> amqp_delay::Result<i32> {
    let layout = layout(settings)?;
    let management = admin::management(settings).await;
    let management = management.as_ref();
    connected(settings, "amqp-delay teardown", async |conn| {
        if queues.is_empty() {
            let configured: Vec<String> =
                settings.gateway.pairs.iter().map(|p| p.ingress.clone()).collect();
            let done = admin::teardown_with(
                conn,
                &layout,
                management,
                force,
                &configured,
                &settings.trust,
            )
            .await?;
            print_teardown(&layout, &done);
            return Ok(if done.failed() {
                amqp_delay_cli::cli::EXIT_FAILURES
            } else {
                0
            });
        }
        for q in queues {
            let done = admin::teardown_destination(conn, &layout, management, q, force).await?;
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
        Ok(0)
    })
    .await
}

/// What `teardown` removed and, one line each, what it left and why.
fn print_teardown(layout: &Layout, done: &admin::Teardown) {
    amqp_delay_cli::outln!(
        "removed the topology under prefix '{}' and {} gateway pair(s){}",
        layout.prefix(),
        done.pairs.len(),
        done.pairs
            .iter()
            .map(|p| format!(" '{p}'"))
            .collect::<String>()
    );
    for l in &done.left {
        let how = if l.failed { "could not delete" } else { "left" };
        amqp_delay_cli::outln!("{how} {}: {}", l.object, l.reason);
    }
}
