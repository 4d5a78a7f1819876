//! What the one-scenario benchmark binaries (`delay-bench-recurring`, `delay-bench-burst`)
//! share: their `main`, notes on stderr, the tools beside them, clean-up and percentiles.

use std::future::Future;
use std::path::PathBuf;

use amqp_delay::Result;
use amqp_delay::ops::broker;
use amqp_delay::time::now_ms;
use hdrhistogram::Histogram;
use serde_json::json;

/// Runs `run` on a two-thread runtime: exit 0 when it says the run passed, 1 when not, 2 on
/// an error (printed after `name`).
pub(crate) fn main(name: &str, run: impl Future<Output = Result<bool>>) -> std::process::ExitCode {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match rt.block_on(run) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("{name}: {}", amqp_delay::error_chain(&e));
            std::process::ExitCode::from(2)
        }
    }
}

/// An error of the benchmark's own making.
pub(crate) fn invalid(s: String) -> amqp_delay::Error {
    amqp_delay::Error::Invalid(s)
}

/// A line on stderr, with the time.
pub(crate) fn note(s: &str) {
    eprintln!("[{}] {s}", amqp_delay::recurring::rfc3339(now_ms()));
}

/// The tool `name` (`delay-publisher`, `delay-consumer`) beside this binary.
pub(crate) fn beside(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| invalid(format!("current exe: {e}")))?;
    existing(exe.with_file_name(name))
}

/// `bin`, if it exists.
pub(crate) fn existing(bin: PathBuf) -> Result<PathBuf> {
    if !bin.is_file() {
        return Err(invalid(format!(
            "{} does not exist: build it (`cargo build --release -p amqp-delay-cli`)",
            bin.display()
        )));
    }
    Ok(bin)
}

/// Deletes queue `q`, whatever it holds (gone already is fine).
async fn delete_queue(conn: &lapin::Connection, q: &str) -> Result<()> {
    let ch = broker::open(conn).await?;
    let _ = ch.queue_delete(q.into(), Default::default()).await;
    broker::close(&ch, "ok").await;
    Ok(())
}

/// A histogram of milliseconds, 1 ms to an hour.
pub(crate) fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000, 3).expect("histogram")
}

/// `h`'s count and percentiles, as the reports print them.
pub(crate) fn lat(h: &Histogram<u64>) -> serde_json::Value {
    json!({
        "n": h.len(),
        "p50": h.value_at_quantile(0.5),
        "p99": h.value_at_quantile(0.99),
        "p99.9": h.value_at_quantile(0.999),
        "max": h.max(),
    })
}

/// A consumer of `queue` without acks (5 000 prefetched), tagged `tag`, and its channel.
pub(crate) async fn consume_no_ack(
    conn: &lapin::Connection,
    queue: &str,
    tag: &str,
) -> Result<(lapin::Channel, lapin::Consumer)> {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    let ch = broker::open(conn).await?;
    ch.basic_qos(5_000, BasicQosOptions::default())
        .await
        .map_err(|e| invalid(format!("qos: {e}")))?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .map_err(|e| invalid(format!("consume: {e}")))?;
    Ok((ch, consumer))
}

/// Deletes `queues` and everything of `settings`' prefix (saying so when the teardown
/// fails), then closes `conn`.
pub(crate) async fn tear_down(
    conn: &lapin::Connection,
    settings: &amqp_delay::Settings,
    layout: &amqp_delay::Layout,
    queues: &[&str],
) {
    note("deleting what the run declared");
    for q in queues {
        let _ = delete_queue(conn, q).await;
    }
    let trust = settings.trust.clone();
    let t = amqp_delay_cli::admin::teardown_with(conn, layout, None, true, &[], &trust).await;
    if let Err(e) = t {
        eprintln!(
            "teardown of {}: {}",
            settings.prefix,
            amqp_delay::error_chain(&e)
        );
    }
    broker::close_connection(conn, "bye").await;
}
