//! `import-plugin`: flags to options, the progress line on a terminal, the summary.

use std::io::IsTerminal;
use std::time::Duration;

use amqp_delay::settings::Settings;
use amqp_delay_cli::cli::{EXIT_FAILURES, escape_controls};
use amqp_delay_cli::import::{self, Counts, Node, Options};
use amqp_delay_cli::plugin_store::Period;

use crate::args::ImportArgs;

/// Runs the import (or the count of `--dry-run`) and prints what happened; exit 1 when
/// anything was left in the plugin for a reason.
pub(crate) async fn import_plugin(settings: &Settings, a: ImportArgs) -> amqp_delay::Result<i32> {
    let node = Node::new(
        &a.rabbitmqctl,
        a.node.clone(),
        Duration::from_millis(a.call_timeout.as_millis()),
    )?;
    let opts = Options {
        node,
        exchanges: a.exchanges.clone(),
        dry_run: a.dry_run,
        leave_ms: a.leave.as_millis(),
        batch: a.batch as usize,
        batch_bytes: a.batch_bytes,
        declare_pairs: a.declare_pairs,
    };
    let tty = std::io::stderr().is_terminal();
    let counts = import::run(settings, opts, |c| {
        if tty {
            eprint!("\r\x1b[K{}", progress(c));
        }
    })
    .await;
    if tty {
        eprint!("\r\x1b[K");
    }
    let c = counts?;
    if a.dry_run {
        print_dry_run(&c);
    }
    for (reason, n) in &c.left {
        amqp_delay_cli::outln!("left {n}: {}", escape_controls(reason));
    }
    amqp_delay_cli::outln!("{}", summary(&c, a.dry_run));
    Ok(if c.left_total() > 0 { EXIT_FAILURES } else { 0 })
}

fn progress(c: &Counts) -> String {
    format!(
        "read {} · moved {} · copying {} · skipped {} · left {} · duplicates {} · the plugin holds {}",
        c.read,
        c.moved,
        c.copying,
        c.skipped,
        c.left_total(),
        c.duplicates,
        c.plugin_holds
    )
}

fn summary(c: &Counts, dry_run: bool) -> String {
    let leave = amqp_delay::time::compact_duration(c.leave_ms);
    let moved = if dry_run {
        format!(
            "would move {}",
            c.by_exchange.values().flatten().sum::<u64>()
        )
    } else {
        format!("moved {}, duplicates {}", c.moved, c.duplicates)
    };
    let mut s = format!(
        "{moved}; skipped {} (due within {leave}: left to the plugin, which delivers them); left {}",
        c.skipped,
        c.left_total()
    );
    if c.not_selected > 0 {
        s.push_str(&format!("; not selected {}", c.not_selected));
    }
    s.push_str(&format!("; the plugin holds {}", c.plugin_holds));
    s
}

fn print_dry_run(c: &Counts) {
    let head: Vec<&str> = Period::ALL.iter().map(|p| p.label()).collect();
    amqp_delay_cli::outln!(
        "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "exchange",
        head[0],
        head[1],
        head[2],
        head[3],
        "total"
    );
    let mut totals = [0u64; 4];
    for (x, row) in &c.by_exchange {
        row.iter().enumerate().for_each(|(i, n)| totals[i] += n);
        amqp_delay_cli::outln!(
            "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
            escape_controls(x),
            row[0],
            row[1],
            row[2],
            row[3],
            row.iter().sum::<u64>()
        );
    }
    amqp_delay_cli::outln!(
        "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "total",
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        totals.iter().sum::<u64>()
    );
}
