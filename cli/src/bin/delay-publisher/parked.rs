//! `parked list|show|retry|drop`: the parked messages of one destination (or of
//! `<prefix>.parked`), through `amqp_delay::ops::parked`, which reads the whole parking queue under a
//! lock and gives back what it does not change, in order.

use std::io::{BufRead, IsTerminal, Write};

use amqp_delay::Publisher;
use amqp_delay::ops::parked::{self, Changed, Parked};
use amqp_delay::settings::Settings;
use amqp_delay_cli::cli::EXIT_FAILURES;
use amqp_delay_cli::logline::escape_controls;
use amqp_delay_cli::outln;
use base64::Engine as _;
use lapin::types::{AMQPValue, FieldTable};

use crate::args::{ParkedCmd, ParkedQueue};

/// Runs one `parked` subcommand; its exit code.
pub(crate) async fn run(settings: &Settings, cmd: ParkedCmd) -> amqp_delay::Result<i32> {
    let layout = crate::topology::layout(settings)?;
    match cmd {
        ParkedCmd::List { queue, limit, json } => {
            let q = queue_of(&queue);
            let all = crate::connected(settings, "amqp-delay parked list", async |conn| {
                parked::list(conn, &layout, q, limit, parked::PREVIEW_BYTES).await
            })
            .await?;
            for p in &all {
                if json {
                    outln!("{}", to_json(p, false));
                } else {
                    outln!("{}", line(p));
                }
            }
            Ok(0)
        }
        ParkedCmd::Show { id, queue, json } => {
            let q = queue_of(&queue);
            let all = crate::connected(settings, "amqp-delay parked show", async |conn| {
                parked::list(conn, &layout, q, usize::MAX, usize::MAX).await
            })
            .await?;
            let found: Vec<&Parked> = all.iter().filter(|p| p.message_id == id).collect();
            if found.is_empty() {
                not_found(&[id], &parked::queue_name(&layout, q));
                return Ok(EXIT_FAILURES);
            }
            for p in found {
                if json {
                    outln!("{}", to_json(p, true));
                } else {
                    show(p);
                }
            }
            Ok(0)
        }
        ParkedCmd::Retry { ids, queue, delay } => {
            let q = queue_of(&queue);
            let publisher = Publisher::connect(settings).await?;
            let r = crate::connected(settings, "amqp-delay parked retry", async |conn| {
                parked::retry(conn, &layout, &publisher, q, &ids, delay.as_millis()).await
            })
            .await;
            publisher.close().await;
            Ok(report(&r?, "retried", &parked::queue_name(&layout, q)))
        }
        ParkedCmd::Drop { ids, queue, yes } => {
            let q = queue_of(&queue);
            let name = parked::queue_name(&layout, q);
            if !yes && !confirm(&ids, &name)? {
                outln!("nothing dropped");
                return Ok(EXIT_FAILURES);
            }
            let r = crate::connected(settings, "amqp-delay parked drop", async |conn| {
                parked::drop(conn, &layout, q, &ids).await
            })
            .await?;
            Ok(report(&r, "dropped", &name))
        }
    }
}

fn queue_of(q: &ParkedQueue) -> Option<&str> {
    q.queue.as_deref().filter(|_| !q.unroutable)
}

/// On a terminal, asks; elsewhere `--yes` is required.
fn confirm(ids: &[String], name: &str) -> amqp_delay::Result<bool> {
    if !std::io::stdin().is_terminal() {
        return Err(amqp_delay::Error::Invalid(
            "drop removes messages for good: give --yes (stdin is not a terminal to ask on)".into(),
        ));
    }
    let mut err = std::io::stderr();
    let _ = write!(
        err,
        "drop {} message id(s) from '{}' for good? [y/N] ",
        ids.len(),
        escape_controls(name)
    );
    let _ = err.flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

fn not_found(ids: &[String], name: &str) {
    for id in ids {
        eprintln!(
            "not found: no message with id '{}' in '{}'",
            escape_controls(id),
            escape_controls(name)
        );
    }
}

/// Prints what was done; exit code 1 when an id was not found or could not be retried.
fn report(c: &Changed, verb: &str, name: &str) -> i32 {
    for id in &c.done {
        outln!("{verb} {}", escape_controls(id));
    }
    for (id, why) in &c.failed {
        eprintln!(
            "not {verb}: '{}': {}",
            escape_controls(id),
            escape_controls(why)
        );
    }
    not_found(&c.not_found, name);
    if c.not_found.is_empty() && c.failed.is_empty() {
        0
    } else {
        EXIT_FAILURES
    }
}

fn parked_at(ms: Option<u64>) -> String {
    match ms {
        Some(ms) => humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
        )
        .to_string(),
        None => "-".into(),
    }
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".into(), T::to_string)
}

/// `position id reason attempts parked-at size`, one message, control characters escaped.
fn line(p: &Parked) -> String {
    format!(
        "{} {} reason={:?} attempts={} parked_at={} size={}",
        p.position,
        escape_controls(&p.message_id),
        escape_controls(&opt(&p.reason)),
        opt(&p.attempts),
        parked_at(p.parked_at_ms),
        p.size
    )
}

fn show(p: &Parked) {
    outln!("{}", line(p));
    outln!("parked_from: {}", escape_controls(&opt(&p.parked_from)));
    outln!("owner: {}", escape_controls(&opt(&p.owner)));
    outln!("content_type: {}", escape_controls(&opt(&p.content_type)));
    for (k, v) in p.headers.inner() {
        outln!(
            "header {}: {}",
            escape_controls(k.as_str()),
            escape_controls(&value_json(v).to_string())
        );
    }
    match std::str::from_utf8(&p.body) {
        Ok(s) => outln!("body: {}", escape_controls(s)),
        Err(_) => outln!(
            "body (base64): {}",
            base64::engine::general_purpose::STANDARD.encode(&p.body)
        ),
    }
}

fn to_json(p: &Parked, full: bool) -> serde_json::Value {
    let headers = if full {
        table_json(&p.headers)
    } else {
        table_json(&p.user_headers())
    };
    let (body, encoding) = match std::str::from_utf8(&p.body) {
        Ok(s) => (s.to_string(), "utf-8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(&p.body),
            "base64",
        ),
    };
    serde_json::json!({
        "position": p.position,
        "id": p.message_id,
        "parked_from": p.parked_from,
        "reason": p.reason,
        "attempts": p.attempts,
        "parked_at": p.parked_at_ms,
        "owner": p.owner,
        "size": p.size,
        "content_type": p.content_type,
        "headers": headers,
        if full { "body" } else { "body_preview" }: body,
        "body_encoding": encoding,
    })
}

fn table_json(t: &FieldTable) -> serde_json::Value {
    serde_json::Value::Object(
        t.inner()
            .iter()
            .map(|(k, v)| (k.to_string(), value_json(v)))
            .collect(),
    )
}

fn value_json(v: &AMQPValue) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(s) => J::from(s),
            Err(_) => J::from(base64::engine::general_purpose::STANDARD.encode(s.as_bytes())),
        },
        AMQPValue::ShortString(s) => J::from(s.as_str()),
        AMQPValue::Boolean(b) => J::from(*b),
        AMQPValue::FieldTable(t) => table_json(t),
        AMQPValue::FieldArray(a) => J::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::Float(f) => J::from(*f),
        AMQPValue::Double(f) => J::from(*f),
        AMQPValue::Void => J::Null,
        AMQPValue::ByteArray(b) => {
            J::from(base64::engine::general_purpose::STANDARD.encode(b.as_slice()))
        }
        other => match amqp_delay::headers::as_int(other) {
            Some(n) => J::from(n),
            None => J::from(format!("{other:?}")),
        },
    }
}
