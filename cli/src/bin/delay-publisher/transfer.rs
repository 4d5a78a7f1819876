//! `transfer`: flags to options, the progress line on a terminal, the summary.

use std::io::IsTerminal;

use amqp_delay::settings::Settings;
use amqp_delay_cli::cli::{EXIT_FAILURES, escape_controls};
use amqp_delay_cli::plugin_store::Period;
use amqp_delay_cli::transfer::{self, Counts, Options};

use crate::args::TransferArgs;

/// Runs the transfer (or the count of `--dry-run`) and prints what happened; exit 1 when
/// anything was left on the old cluster for a reason.
pub(crate) async fn transfer(settings: &Settings, a: TransferArgs) -> amqp_delay::Result<i32> {
    let opts = Options {
        to: a.to.clone(),
        to_prefix: a.to_prefix.clone(),
        queues: a.queues.clone(),
        dry_run: a.dry_run,
        parked: a.parked,
        prefetch: a.prefetch,
    };
    let tty = std::io::stderr().is_terminal();
    let counts = transfer::run(settings, opts, |c| {
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
        "read {} ({} messages) · moved {} · parked moved {} · cancelled {} · left {} · possible duplicates {}",
        c.read,
        c.messages,
        c.moved,
        c.parked,
        c.cancelled,
        c.left_total(),
        c.maybe_duplicates
    )
}

fn summary(c: &Counts, dry_run: bool) -> String {
    let moved = if dry_run {
        format!(
            "would move {}",
            c.by_destination.values().flatten().sum::<u64>()
        )
    } else {
        format!(
            "moved {}, possible duplicates {}",
            c.moved, c.maybe_duplicates
        )
    };
    let mut s = format!(
        "{moved}; cancelled on the old cluster {}; left {}",
        c.cancelled,
        c.left_total()
    );
    if c.not_selected > 0 {
        s.push_str(&format!("; not selected {}", c.not_selected));
    }
    if c.parked > 0 {
        let verb = if dry_run { "would move" } else { "moved" };
        s.push_str(&format!("; parked {verb} {}", c.parked));
    }
    if c.parked_left > 0 {
        s.push_str(&format!(
            "; parked left on the old cluster {} (--parked moves them)",
            c.parked_left
        ));
    }
    if c.headers_removed > 0 {
        s.push_str(&format!(
            "; x-delay-* headers left out (their writer may not set them) {}",
            c.headers_removed
        ));
    }
    s
}

fn print_dry_run(c: &Counts) {
    let head: Vec<&str> = Period::ALL.iter().map(|p| p.label()).collect();
    let line = |name: &str, row: &[u64; 4]| {
        amqp_delay_cli::outln!(
            "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
            escape_controls(name),
            row[0],
            row[1],
            row[2],
            row[3],
            row.iter().sum::<u64>()
        );
    };
    amqp_delay_cli::outln!(
        "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "destination",
        head[0],
        head[1],
        head[2],
        head[3],
        "total"
    );
    let mut totals = [0u64; 4];
    for (d, row) in &c.by_destination {
        row.iter().enumerate().for_each(|(i, n)| totals[i] += n);
        line(d, row);
    }
    line("total", &totals);
}
