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
use amqp_delay::Publisher;
use amqp_delay::{Error, Result, error_chain as chain};

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

/// The files the not-sent and maybe-sent lines are written to (each line as read, with its
/// `id` filled in). Create them with [`ResendFiles::create`] before anything is sent; one left
/// empty is removed when this is dropped.
#[derive(Debug, Default)]
pub struct ResendFiles {
    /// For lines that were not scheduled: send this file again.
    pub not_sent: Option<ResendFile>,
    /// For lines whose confirm was lost.
    pub maybe_sent: Option<ResendFile>,
}

impl ResendFiles {
    /// Creates the files named (`--unsent`, `--maybe-sent` or their defaults) with
    /// [`resend_mode`] of the input's mode: nothing is sent when one cannot be created.
    pub fn create(
        not_sent: Option<PathBuf>,
        maybe_sent: Option<PathBuf>,
        input_mode: Option<u32>,
    ) -> Result<ResendFiles> {
        if not_sent.is_some() && not_sent == maybe_sent {
            return Err(Error::Invalid(
                "--unsent and --maybe-sent name the same file: give each its own".into(),
            ));
        }
        let mode = resend_mode(input_mode);
        let create = |path: Option<PathBuf>, flag| {
            path.map(|p| ResendFile::create(p, mode, flag)).transpose()
        };
        Ok(ResendFiles {
            not_sent: create(not_sent, "--unsent")?,
            maybe_sent: create(maybe_sent, "--maybe-sent")?,
        })
    }
}

/// The mode of a resend file, from the input's (`None`: standard input): read and write for its
/// owner only, and read-only when the input is not writable by its owner. Its lines are the
/// input's, which may be private (card numbers, addresses): no one else may read them.
pub fn resend_mode(input_mode: Option<u32>) -> u32 {
    match input_mode {
        Some(m) if m & 0o200 == 0 => 0o400,
        _ => 0o600,
    }
}

/// A file some lines of a run are written to, created new: never through a symbolic link, never
/// over a file already there. Removed when dropped if nothing was written to it (and it is still
/// the file created).
#[derive(Debug)]
pub struct ResendFile {
    path: PathBuf,
    file: std::fs::File,
    lines: usize,
}

impl ResendFile {
    /// Creates `path` with `mode` (`O_CREAT|O_EXCL`, which never follows a symbolic link, not
    /// even a dangling one). A file or a link already there is an error naming it, and saying
    /// to move it away or name another file with `flag`.
    pub fn create(path: PathBuf, mode: u32, flag: &str) -> Result<ResendFile> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path);
        match opened {
            Ok(file) => Ok(ResendFile {
                path,
                file,
                lines: 0,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink());
                let what = if link {
                    " (a symbolic link: it is not followed)"
                } else {
                    " (an earlier run's lines? deal with them first)"
                };
                Err(Error::Invalid(format!(
                    "{} already exists{what}; it is never replaced or written through: move it away, or name another file with {flag}; nothing was sent",
                    path.display()
                )))
            }
            Err(e) => Err(Error::Invalid(format!(
                "cannot create {}: {e}; name another file with {flag}; nothing was sent",
                path.display()
            ))),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Lines written to it.
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// Writes `lines` (one per line) and syncs them to disk.
    fn write(&mut self, lines: &[String]) -> Result<()> {
        let mut out = std::io::BufWriter::new(&self.file);
        let written = lines
            .iter()
            .try_for_each(|l| writeln!(out, "{l}"))
            .and_then(|()| out.flush());
        drop(out);
        written.and_then(|()| self.file.sync_data()).map_err(|e| {
            Error::Invalid(format!(
                "cannot write {}: {e}; the lines are reported above by number",
                self.path.display()
            ))
        })?;
        self.lines += lines.len();
        Ok(())
    }
}

impl Drop for ResendFile {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt as _;
        if self.lines > 0 {
            return;
        }
        let ours = match (self.file.metadata(), std::fs::symlink_metadata(&self.path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
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

/// An input to read.
pub type Input = Box<dyn AsyncRead + Unpin + Send>;

/// The input named on the command line: a file, or standard input for `-`; with the file's
/// mode (`None` for standard input).
pub async fn open_input(path: &std::path::Path) -> Result<(Input, Option<u32>)> {
    use std::os::unix::fs::PermissionsExt as _;
    if path.as_os_str() == "-" {
        return Ok((Box::new(tokio::io::stdin()), None));
    }
    let cannot = |e: std::io::Error| Error::Invalid(format!("cannot open {}: {e}", path.display()));
    let f = tokio::fs::File::open(path).await.map_err(cannot)?;
    let mode = f.metadata().await.map_err(cannot)?.permissions().mode();
    Ok((Box::new(f), Some(mode)))
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
    mut done: impl FnMut(&amqp_delay::ops::cancel::Cancelled),
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
    resend: &mut ResendFiles,
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
    for (file, lines) in [
        (&mut resend.not_sent, &not_sent),
        (&mut resend.maybe_sent, &maybe),
    ] {
        if let (Some(file), false) = (file, lines.is_empty()) {
            file.write(lines)?;
        }
    }
    Ok(summary.into_inner())
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

    #[test]
    fn resend_files_are_for_their_owner_only() {
        assert_eq!(resend_mode(None), 0o600);
        for (input, mode) in [
            (0o100644, 0o600),
            (0o100666, 0o600),
            (0o100600, 0o600),
            (0o100640, 0o600),
            (0o100400, 0o400),
            (0o100444, 0o400),
            (0o100000, 0o400),
        ] {
            assert_eq!(resend_mode(Some(input)), mode, "{input:o}");
        }
    }

    /// A fresh path in the temporary directory.
    fn fresh(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("bulk-{}-{name}", uuid::Uuid::now_v7()))
    }

    fn mode_of(p: &std::path::Path) -> u32 {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_resend_file_is_created_new_with_its_mode_and_removed_when_empty() {
        let (kept, empty) = (fresh("kept"), fresh("empty"));
        let mut files =
            ResendFiles::create(Some(kept.clone()), Some(empty.clone()), Some(0o100644)).unwrap();
        assert_eq!((mode_of(&kept), mode_of(&empty)), (0o600, 0o600));
        let f = files.not_sent.as_mut().unwrap();
        f.write(&["a".into(), "b".into()]).unwrap();
        assert_eq!(f.lines(), 2);
        drop(files);
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "a\nb\n");
        assert!(!empty.exists(), "an empty resend file is left behind");
        // read-only for a read-only input
        let ro = fresh("ro");
        let mut f =
            ResendFile::create(ro.clone(), resend_mode(Some(0o100400)), "--unsent").unwrap();
        f.write(&["c".into()]).unwrap();
        drop(f);
        assert_eq!(mode_of(&ro), 0o400);
        for p in [kept, ro] {
            std::fs::remove_file(p).unwrap();
        }
    }

    /// Whatever is at the path already (a file, a link to one, a dangling link) stays as it was;
    /// the error names the path and says nothing was sent.
    #[test]
    fn nothing_already_at_a_resend_path_is_followed_or_replaced() {
        let victim = fresh("victim");
        std::fs::write(&victim, "precious").unwrap();
        let absent = fresh("absent");
        type Plant<'a> = &'a dyn Fn(&std::path::Path);
        let plants: [(&str, Plant); 4] = [
            ("a file", &|p| std::fs::write(p, "earlier run").unwrap()),
            ("a symbolic link", &|p| {
                std::os::unix::fs::symlink(&victim, p).unwrap()
            }),
            ("a dangling link", &|p| {
                std::os::unix::fs::symlink(&absent, p).unwrap()
            }),
            ("a hard link", &|p| std::fs::hard_link(&victim, p).unwrap()),
        ];
        for (what, plant) in plants {
            let at = fresh("planted");
            plant(&at);
            let before = std::fs::read_to_string(&at).ok();
            let e = ResendFile::create(at.clone(), 0o600, "--maybe-sent").unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(&format!("{} already exists", at.display()))
                    && text.contains("--maybe-sent")
                    && text.contains("nothing was sent"),
                "{what}: {text}"
            );
            assert_eq!(
                text.contains("symbolic link"),
                what.contains("symbolic") || what.contains("dangling"),
                "{what}: {text}"
            );
            assert_eq!(std::fs::read_to_string(&at).ok(), before, "{what}");
            assert!(!absent.exists(), "{what}");
            std::fs::remove_file(&at).unwrap();
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::remove_file(&victim).unwrap();
        // one file for both ends is refused before either is created
        let same = fresh("same");
        let e = ResendFiles::create(Some(same.clone()), Some(same.clone()), None).unwrap_err();
        assert!(e.to_string().contains("the same file"), "{e}");
        assert!(!same.exists());
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
