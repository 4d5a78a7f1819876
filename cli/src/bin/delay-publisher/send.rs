//! The message subcommands: `send` (one message, or many from JSONL) and `cancel`.

use std::io::IsTerminal;
use std::path::PathBuf;

use amqp_delay::headers;
use amqp_delay::settings::Settings;
use amqp_delay::{Error, Message, Publisher};
use amqp_delay_cli::bulk;
use amqp_delay_cli::cli::{self, EXIT_FAILURES};

use crate::args::{CancelArgs, SendArgs};

/// What `send` sends.
enum Sending {
    /// One message.
    One(Box<Message>),
    /// The lines of `--jsonl`, and where those that fail go.
    Lines(bulk::Input, bulk::ResendFiles),
}

/// `send`: one message, or the lines of `--jsonl`; the message checked, or the input opened and
/// the resend files created, before anything is connected.
pub(crate) async fn send(settings: &Settings, a: SendArgs) -> amqp_delay::Result<i32> {
    let sending = match &a.jsonl {
        None => Sending::One(Box::new(one_message(&a, settings).await?)),
        Some(path) => {
            let (input, mode) = bulk::open_input(path).await?;
            let stdin = path.as_os_str() == "-";
            let derived = |suffix: &str| {
                (!stdin).then(|| PathBuf::from(format!("{}.{suffix}", path.display())))
            };
            let resend = bulk::ResendFiles::create(
                a.unsent.clone().or_else(|| derived("unsent")),
                a.maybe_sent.clone().or_else(|| derived("maybe-sent")),
                mode,
            )?;
            Sending::Lines(input, resend)
        }
    };
    let publisher = Publisher::connect(settings).await?;
    let code = match sending {
        Sending::One(m) => send_one(&publisher, *m).await,
        Sending::Lines(input, mut resend) => send_jsonl(&publisher, input, &mut resend).await,
    };
    publisher.close().await;
    code
}

/// `cancel`: one id, or every line of `--jsonl` (read as a bounded stream).
pub(crate) async fn cancel(settings: &Settings, a: CancelArgs) -> amqp_delay::Result<i32> {
    let input = match &a.jsonl {
        Some(path) => Some(bulk::open_input(path).await?.0),
        None => None,
    };
    let publisher = Publisher::connect(settings).await?;
    let code = match input {
        None => {
            let c = publisher
                .cancel(a.id.as_deref().unwrap_or_default(), a.due_at)
                .await;
            c.map(|c| {
                show_cancelled(&c);
                0
            })
        }
        Some(input) => {
            let (done, failed) = bulk::cancel_jsonl(&publisher, input, show_cancelled, |n, why| {
                eprintln!("line {n}: {}", cli::escape_controls(why))
            })
            .await;
            eprintln!("{done} cancelled, {failed} failed");
            Ok(if failed > 0 { EXIT_FAILURES } else { 0 })
        }
    };
    publisher.close().await;
    code
}

fn show_cancelled(c: &amqp_delay::ops::cancel::Cancelled) {
    amqp_delay_cli::outln!(
        "{}",
        serde_json::json!({"id": c.id, "until": c.until_ms, "verdict": c.verdict})
    )
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
    input: bulk::Input,
    resend: &mut bulk::ResendFiles,
) -> amqp_delay::Result<i32> {
    let progress = std::io::stderr().is_terminal();
    let summary = bulk::send_jsonl(
        p,
        input,
        resend,
        |line, s| {
            if progress {
                eprint!("\r\x1b[K");
            }
            // a reason may quote the line (an invalid value) or the broker's reply text
            let line = line.map(|(n, end, reason)| (n, end, cli::escape_controls(reason)));
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
    for (file, what) in [
        (&resend.not_sent, "not sent: send this file again"),
        (
            &resend.maybe_sent,
            "maybe sent: re-sending may duplicate them (same ids)",
        ),
    ] {
        if let Some(f) = file.as_ref().filter(|f| f.lines() > 0) {
            amqp_delay_cli::outln!("{what}: {}", f.path().display());
        }
    }
    Ok(if summary.failed() > 0 {
        EXIT_FAILURES
    } else {
        0
    })
}
