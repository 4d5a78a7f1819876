//! Bulk scheduling from JSONL (`delay-publisher send --jsonl`): reads lines (bounded in length,
//! non-UTF-8 reported), parses each ([`crate::jsonl`]), gives a line without an `id` a generated
//! one (so a re-send can be deduplicated), schedules the valid ones pipelined and batched, and
//! sorts every line into one of four ends: confirmed, invalid (never a request), not sent (the
//! broker refused it or it could not be published: safe to re-send) or maybe sent (the confirm
//! was lost: it may have been delivered; re-sending may duplicate it, the id lets consumers tell).

use std::io::Write as _;
use std::path::PathBuf;

use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

use crate::jsonl;
use amqp_delay::error::{Error, Result, chain};
use amqp_delay::publisher::Publisher;

/// Longest line accepted: a body of the broker's maximum message size (16 MiB on RabbitMQ 4.x)
/// written as a JSON string fits with room to spare.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// Where a line ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineEnd {
    /// The broker confirmed it.
    Confirmed,
    /// Not a valid request (never sent).
    Invalid,
    /// Not scheduled (refused or not published): safe to send again.
    NotSent,
    /// Published, confirm lost: it may have been delivered.
    MaybeSent,
}

/// Counts per end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Confirmed lines.
    pub confirmed: u64,
    /// Invalid lines.
    pub invalid: u64,
    /// Lines not scheduled.
    pub not_sent: u64,
    /// Lines whose confirm was lost.
    pub maybe_sent: u64,
}

impl Summary {
    /// Lines that did not end confirmed.
    pub fn failed(&self) -> u64 {
        self.invalid + self.not_sent + self.maybe_sent
    }
}

/// Files the not-sent and maybe-sent lines are written to (each line as read, with its `id`
/// filled in), created only when there is something to write.
#[derive(Debug, Clone, Default)]
pub struct ResendFiles {
    /// For lines that were not scheduled: send this file again.
    pub not_sent: Option<PathBuf>,
    /// For lines whose confirm was lost.
    pub maybe_sent: Option<PathBuf>,
}

/// A line whose `id` is filled in (generated when absent), as it is written to a resend file.
fn with_id(text: &str, id: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(mut o)) => {
            o.entry("id")
                .or_insert_with(|| serde_json::Value::String(id.to_string()));
            serde_json::Value::Object(o).to_string()
        }
        _ => text.trim_end().to_string(),
    }
}

/// Reads one line of at most [`MAX_LINE_BYTES`]; a longer one is consumed and reported.
async fn read_line<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
) -> std::io::Result<Option<std::result::Result<String, String>>> {
    let mut buf = Vec::new();
    let mut too_long = false;
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            if buf.is_empty() && !too_long {
                return Ok(None);
            }
            break;
        }
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        if !too_long {
            if buf.len() + take > MAX_LINE_BYTES {
                too_long = true;
                buf = Vec::new();
            } else {
                buf.extend_from_slice(&chunk[..take]);
            }
        }
        r.consume(take);
        if done {
            break;
        }
    }
    if too_long {
        return Ok(Some(Err(format!(
            "line is longer than {} MiB",
            MAX_LINE_BYTES >> 20
        ))));
    }
    Ok(Some(
        String::from_utf8(buf).map_err(|_| "line is not valid UTF-8".to_string()),
    ))
}

/// The numbered lines of `input` (from 1), each of at most [`MAX_LINE_BYTES`] and UTF-8 or a
/// reason why not; a read error ends the stream after one last item that says it.
pub fn lines<R: AsyncRead + Unpin + Send>(
    input: R,
) -> impl futures::Stream<Item = (usize, std::result::Result<String, String>)> + Send {
    let reader = BufReader::with_capacity(1 << 16, input);
    futures::stream::unfold((reader, 0usize, false), |(mut r, n, done)| async move {
        if done {
            return None;
        }
        match read_line(&mut r).await {
            Ok(None) => None,
            Ok(Some(line)) => Some(((n + 1, line), (r, n + 1, false))),
            Err(e) => Some(((n + 1, Err(format!("reading: {e}"))), (r, n + 1, true))),
        }
    })
}

/// The input named on the command line: a file, or standard input for `-`.
pub async fn open_input(path: &std::path::Path) -> Result<Box<dyn AsyncRead + Unpin + Send>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(tokio::io::stdin()));
    }
    let f = tokio::fs::File::open(path)
        .await
        .map_err(|e| Error::Invalid(format!("cannot open {}: {e}", path.display())))?;
    Ok(Box::new(f))
}

/// Where a line whose scheduling failed with `e` ended.
fn end_of(e: &Error) -> LineEnd {
    match e {
        e if e.maybe_sent() => LineEnd::MaybeSent,
        // the request itself is wrong: sending it again would not help
        Error::Invalid(_) | Error::Plan(_) | Error::UnknownDestination(_) => LineEnd::Invalid,
        _ => LineEnd::NotSent,
    }
}

/// One line of `cancel --jsonl`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelLine {
    id: String,
    #[serde(default)]
    due_at: Option<u64>,
}

/// Cancels the message of every line of `input` (`{"id": …, "due_at": …}`), read as a bounded
/// stream like `send --jsonl`; `done` is called with each verdict and `failed` with each line
/// that failed and why. Returns (cancelled, failed).
pub async fn cancel_jsonl<R: AsyncRead + Unpin + Send>(
    publisher: &Publisher,
    input: R,
    mut done: impl FnMut(&amqp_delay::cancel::Cancelled),
    failed: impl FnMut(usize, &str),
) -> (u64, u64) {
    let failed = std::cell::RefCell::new((0u64, failed));
    let fail = |n: usize, why: &str| {
        let mut f = failed.borrow_mut();
        f.0 += 1;
        (f.1)(n, why);
    };
    let items = lines(input).filter_map(|(n, line)| {
        let parsed = line.and_then(|l| {
            if l.trim().is_empty() {
                return Ok(None);
            }
            serde_json::from_str::<CancelLine>(&l)
                .map(Some)
                .map_err(|e| format!("not a cancel request: {e}"))
        });
        futures::future::ready(match parsed {
            Ok(Some(l)) => Some((n, l.id, l.due_at)),
            Ok(None) => None,
            Err(why) => {
                fail(n, &why);
                None
            }
        })
    });
    let mut cancelled = 0u64;
    let mut results = std::pin::pin!(publisher.cancel_all(items));
    while let Some((n, r)) = results.next().await {
        match r {
            Ok(c) => {
                cancelled += 1;
                done(&c);
            }
            Err(e) => fail(n, &chain(&e)),
        }
    }
    let failures = failed.borrow().0;
    (cancelled, failures)
}

/// What `send_jsonl` calls with a line's end (or `None` for progress) and the counts so far.
type Reporter<'a> = dyn FnMut(Option<(usize, LineEnd, &str)>, &Summary) + 'a;

/// Schedules every line of `input`; `report(line number, end, reason)` is called for each line
/// that did not end confirmed, and for progress every 250 ms (`None` line) when `progress`.
pub async fn send_jsonl<R: AsyncRead + Unpin + Send>(
    publisher: &Publisher,
    input: R,
    resend: &ResendFiles,
    mut report: impl FnMut(Option<(usize, LineEnd, &str)>, &Summary),
    progress: bool,
) -> Result<Summary> {
    let summary = std::cell::RefCell::new(Summary::default());
    let invalid = std::cell::RefCell::new(Vec::<(usize, String)>::new());
    let requests = lines(input).filter_map(|(n, line)| {
        let out = match line.and_then(|l| jsonl::parse_line(&l).map(|m| (l, m))) {
            Ok((_, None)) => None,
            Ok((text, Some(mut m))) => {
                let id = match m.properties.message_id() {
                    Some(id) => id.to_string(),
                    None => {
                        let id = uuid::Uuid::now_v7().to_string();
                        m = m.with_id(id.clone());
                        id
                    }
                };
                Some(((n, with_id(&text, &id)), m))
            }
            Err(reason) => {
                invalid.borrow_mut().push((n, reason));
                None
            }
        };
        futures::future::ready(out)
    });
    let mut not_sent = Vec::new();
    let mut maybe = Vec::new();
    let mut results = std::pin::pin!(publisher.schedule_all(requests));
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
    let flush_invalid = |report: &mut Reporter<'_>| {
        for (n, reason) in invalid.borrow_mut().drain(..) {
            summary.borrow_mut().invalid += 1;
            report(Some((n, LineEnd::Invalid, &reason)), &summary.borrow());
        }
    };
    loop {
        tokio::select! {
            r = results.next() => {
                flush_invalid(&mut report);
                match r {
                    Some((_, Ok(_))) => summary.borrow_mut().confirmed += 1,
                    Some(((n, text), Err(e))) => {
                        let end = end_of(&e);
                        {
                            let mut s = summary.borrow_mut();
                            match end {
                                LineEnd::MaybeSent => {
                                    s.maybe_sent += 1;
                                    maybe.push(text);
                                }
                                LineEnd::NotSent => {
                                    s.not_sent += 1;
                                    not_sent.push(text);
                                }
                                _ => s.invalid += 1,
                            }
                        }
                        report(Some((n, end, &chain(&e))), &summary.borrow());
                    }
                    None => break,
                }
            }
            _ = tick.tick(), if progress => report(None, &summary.borrow()),
        }
    }
    flush_invalid(&mut report);
    for (path, lines) in [(&resend.not_sent, &not_sent), (&resend.maybe_sent, &maybe)] {
        if let (Some(path), false) = (path, lines.is_empty()) {
            write_lines(path, lines)?;
        }
    }
    Ok(summary.into_inner())
}

fn write_lines(path: &std::path::Path, lines: &[String]) -> Result<()> {
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for l in lines {
            writeln!(f, "{l}")?;
        }
        f.flush()
    };
    write().map_err(|e| Error::Invalid(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_filled_in_for_a_resend() {
        assert_eq!(
            with_id(r#"{"queue":"q","delay_ms":1,"body":"x"}"#, "gen"),
            r#"{"body":"x","delay_ms":1,"id":"gen","queue":"q"}"#
        );
        assert_eq!(
            with_id(r#"{"queue":"q","id":"mine"}"#, "gen"),
            r#"{"id":"mine","queue":"q"}"#
        );
    }

    #[tokio::test]
    async fn long_and_broken_lines_are_reasons() {
        let mut input = vec![b'x'; MAX_LINE_BYTES + 10];
        input.extend_from_slice(b"\nok\n\xff\xfe\nlast");
        let mut r = BufReader::new(&input[..]);
        assert!(
            read_line(&mut r)
                .await
                .unwrap()
                .unwrap()
                .unwrap_err()
                .contains("longer")
        );
        assert_eq!(read_line(&mut r).await.unwrap().unwrap().unwrap(), "ok\n");
        assert!(
            read_line(&mut r)
                .await
                .unwrap()
                .unwrap()
                .unwrap_err()
                .contains("UTF-8")
        );
        assert_eq!(read_line(&mut r).await.unwrap().unwrap().unwrap(), "last");
        assert!(read_line(&mut r).await.unwrap().is_none());
    }
}
