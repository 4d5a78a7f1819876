//! `delay-bench-recurring --list-only`: `recurring list` of N schedules through a `pending
//! serve` (run as a child, its index in a temporary file) at `pending.index_url`, and what it
//! is made of:
//!
//! * `serve_ready_ms`: from serve's start to its first answer (its one replay of the stream);
//! * `cli_ms`: `delay-publisher recurring list` through the server (its first page, 1 000 by
//!   default), the whole process, 5 runs;
//! * `get_ms`: every page of 10 000 (`Remote::schedules`, GET and JSON parse) in this process,
//!   5 runs;
//! * `show_ms`: `GET /api/v1/schedules/s0`: the server's catch-up (a barrier it appends and
//!   reads back) and one HTTP round trip, 5 runs;
//! * `walk_ms`, `serialize_ms`, `parse_ms`, `bytes`: the book walked into the answer's rows,
//!   the rows as JSON, and the JSON read back, in this process, on a book replayed here;
//! * `local_ms`: `recurring list` replaying the stream (no server; its first page), once.

use std::time::{Duration, Instant};

use amqp_delay::ops::control;
use amqp_delay::time::now_ms;
use amqp_delay::{Layout, Result, Settings, Topology};
use amqp_delay_cli::pending::client::Remote;
use amqp_delay_cli::schedules::{Crons, MAX_PAGE, Page, ScheduleOut};
use serde_json::json;

use super::{Args, add_schedules, child_env, invalid, note, publisher_bin};

/// Timed runs of each measure.
const RUNS: usize = 5;

pub(super) async fn measure(
    args: &Args,
    settings: &Settings,
    layout: &Layout,
    conn: &lapin::Connection,
    queue: &str,
) -> Result<serde_json::Value> {
    Topology::new(layout.clone()).declare(conn).await?;
    let n = args.schedules;
    let add_secs = add_schedules(conn, layout, queue, n).await?;

    // pending serve, as a child, on a free port
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| invalid(e.to_string()))?;
        l.local_addr().map_err(|e| invalid(e.to_string()))?.port()
    };
    let dir = std::env::temp_dir().join(format!("{}-list", settings.prefix));
    std::fs::create_dir_all(&dir).map_err(|e| invalid(e.to_string()))?;
    let index_url = format!("http://127.0.0.1:{port}");
    let bin = publisher_bin()?;
    let env = |c: &mut tokio::process::Command| child_env(c, settings, args);
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(["pending", "serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--index")
        .arg(dir.join("index.db"));
    env(&mut cmd);
    cmd.kill_on_drop(true)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let t = Instant::now();
    let mut serve = cmd
        .spawn()
        .map_err(|e| invalid(format!("{}: {e}", bin.display())))?;
    let mut asking = settings.clone();
    asking.pending.index_url = Some(index_url.clone());
    let remote = Remote::new(&index_url, &asking).map_err(|e| invalid(e.to_string()))?;
    let r = timed(
        &remote, &bin, &env, &index_url, t, n, settings, layout, conn,
    )
    .await;
    let _ = serve.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(10), serve.wait()).await;
    let _ = std::fs::remove_dir_all(&dir);
    let mut out = r?;
    out["add_secs"] = json!(add_secs);
    out["schedules"] = json!(n);
    out["prefix"] = json!(settings.prefix);
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
async fn timed(
    remote: &Remote,
    bin: &std::path::Path,
    env: &dyn Fn(&mut tokio::process::Command),
    index_url: &str,
    started: Instant,
    n: usize,
    settings: &Settings,
    layout: &Layout,
    conn: &lapin::Connection,
) -> Result<serde_json::Value> {
    // its first answer: after its one replay
    loop {
        match remote.schedule("s0", None).await {
            Ok(_) => break,
            Err(e) if started.elapsed() < Duration::from_secs(120) => {
                tracing::debug!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(invalid(format!("pending serve never answered: {e}"))),
        }
    }
    let serve_ready_ms = started.elapsed().as_millis() as u64;
    note(&format!("pending serve answers after {serve_ready_ms} ms"));

    let list = |url: Option<&str>| {
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["recurring", "list"]);
        if let Some(u) = url {
            cmd.args(["--index-url", u]);
        }
        env(&mut cmd);
        cmd
    };
    let (mut cli_ms, mut listed) = (Vec::new(), 0);
    for _ in 0..RUNS {
        let t = Instant::now();
        let out = list(Some(index_url))
            .output()
            .await
            .map_err(|e| invalid(e.to_string()))?;
        cli_ms.push(t.elapsed().as_millis() as u64);
        if !out.status.success() {
            return Err(invalid(format!(
                "recurring list failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        listed = out.stdout.iter().filter(|&&b| b == b'\n').count();
    }
    note(&format!(
        "recurring list through the server: {listed} lines in {cli_ms:?} ms"
    ));
    let (mut get_ms, mut show_ms) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        // every page, of the most a page holds
        let t = Instant::now();
        let (mut got, mut page) = (0, Page::parse(None, Some(MAX_PAGE))?);
        loop {
            let (rows, next) =
                (remote.schedules(&page).await).map_err(|e| invalid(e.to_string()))?;
            got += rows.len();
            match next {
                Some(c) => page = Page::parse(Some(&c), Some(MAX_PAGE))?,
                None => break,
            }
        }
        get_ms.push(t.elapsed().as_millis() as u64);
        assert_eq!(got, n, "the server's pages list every schedule");
        let t = Instant::now();
        remote
            .schedule("s0", None)
            .await
            .map_err(|e| invalid(e.to_string()))?;
        show_ms.push(t.elapsed().as_millis() as u64);
    }

    // the parts, in this process, on a book replayed here
    let (book, _) = control::read_schedules(conn, layout, &settings.trust, None).await?;
    let (t, now, mut crons) = (Instant::now(), now_ms(), Crons::default());
    let rows: Vec<ScheduleOut> = book
        .iter()
        .map(|e| ScheduleOut::of_with(e, now, 1, &mut crons))
        .collect();
    let walk_ms = t.elapsed().as_millis() as u64;
    let t = Instant::now();
    #[derive(serde::Serialize)]
    struct In<'a> {
        schedules: &'a [ScheduleOut],
    }
    let body = serde_json::to_vec(&In { schedules: &rows }).map_err(|e| invalid(e.to_string()))?;
    let serialize_ms = t.elapsed().as_millis() as u64;
    let t = Instant::now();
    let back: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| invalid(e.to_string()))?;
    let parse_value_ms = t.elapsed().as_millis() as u64;
    drop(back);
    #[derive(serde::Deserialize)]
    struct Out {
        schedules: Vec<ScheduleOut>,
    }
    let t = Instant::now();
    let back: Out = serde_json::from_slice(&body).map_err(|e| invalid(e.to_string()))?;
    let parse_ms = t.elapsed().as_millis() as u64;
    assert_eq!(back.schedules.len(), rows.len());

    let t = Instant::now();
    let out = list(None)
        .output()
        .await
        .map_err(|e| invalid(e.to_string()))?;
    let local_ms = t.elapsed().as_millis() as u64;
    let local_lines = out.stdout.iter().filter(|&&b| b == b'\n').count();
    note(&format!(
        "recurring list replaying: {local_lines} lines in {local_ms} ms"
    ));
    Ok(json!({
        "serve_ready_ms": serve_ready_ms,
        "listed": listed,
        "cli_ms": cli_ms,
        "get_ms": get_ms,
        "show_ms": show_ms,
        "walk_ms": walk_ms,
        "serialize_ms": serialize_ms,
        "parse_ms": parse_ms,
        "parse_value_ms": parse_value_ms,
        "bytes": body.len(),
        "local_ms": local_ms,
        "local_lines": local_lines,
    }))
}
