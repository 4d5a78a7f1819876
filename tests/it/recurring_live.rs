//! `pending serve`'s live book of recurring schedules: it follows the control stream after it
//! started (and after losing its connection), answers each login with its own schedules only,
//! and `recurring list|show` through `pending.index_url` say what the local replay says.

use crate::permissions::{cli_as, tls_node_name};
use crate::recurring::{add_as, call, rows, tenants};

/// `pending serve`'s API on a free port as the world's pending user (its documented set), the
/// admin its `trust.admins`; its address, its task and its live book of schedules.
async fn api_as_pending(
    w: &crate::trust::World,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<amqp_delay_cli::pending::http::Api>,
) {
    use amqp_delay_cli::pending::follow::Status;
    use amqp_delay_cli::pending::http::{Api, listen, router};
    use amqp_delay_cli::pending::service::Service;
    use amqp_delay_cli::pending_index::{Options, PendingIndex};
    use std::sync::{Arc, Mutex};
    let settings = w.as_role("pending");
    let ix = PendingIndex::open(std::path::Path::new(":memory:"), Options::default()).unwrap();
    let service = Service::new(settings.clone(), Arc::new(Mutex::new(ix)), Status::new());
    let api = Arc::new(Api::new(service, settings));
    api.schedules().start();
    let book = api.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = listen::serve(listener, router(api), std::future::pending()).await;
    });
    (addr, server, book)
}

/// Closes, from the test node's side, every connection of `user`; how many.
fn close_connections_of(user: &str) -> usize {
    let node = tls_node_name();
    let out = crate::harness::rabbitmqctl()
        .args(["-n", &node, "-q", "list_connections", "pid", "user"])
        .output()
        .expect("rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut n = 0;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(pid), Some(u)) = (words.next(), words.next()) else {
            continue;
        };
        if u != user {
            continue;
        }
        let st = crate::harness::rabbitmqctl()
            .args(["-n", &node, "-q", "close_connection", pid, "test: lost"])
            .status()
            .unwrap();
        assert!(st.success());
        n += 1;
    }
    n
}

/// `recurring ARGS --json` as `role`, through `index_url` when given: its lines.
async fn recurring_json(
    w: &crate::trust::World,
    role: &str,
    args: &[&str],
    index_url: Option<&str>,
) -> Vec<String> {
    let mut all = vec!["recurring"];
    all.extend(args);
    all.push("--json");
    if let Some(u) = index_url {
        all.extend(["--index-url", u]);
    }
    let out = cli_as("recurring --json", &w.cfg, &w.url(role), &all).await;
    out.lines().map(str::to_string).collect()
}

/// A schedule added after the server started (through its API, and with the CLI) is listed
/// through the API at once; another tenant still sees none of it and cannot name it; after
/// the server lost its connection it follows again; `recurring list|show` through
/// `pending.index_url` say what the local replay says, for the owner, the other tenant and
/// the admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_book_follows_the_stream_and_answers_each_login_its_own() {
    let w = tenants().await;
    let (alice, mallory) = (w.user("alice"), w.user("mallory"));
    let (addr, server, api) = api_as_pending(&w).await;
    // started: the book is read, and empty
    let (status, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!((status, rows(&out)), (200, vec![]), "{out}");

    // added through the API after the start: the next GET sees it
    let def = serde_json::json!({
        "name": "nightly", "cron": "0 2 * * *", "tz": "Europe/Berlin", "queue": w.q,
    });
    let (status, out) = call(addr, "POST", "/api/v1/schedules", &alice, Some(def)).await;
    assert_eq!(status, 201, "{out}");
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!(rows(&out), [(alice.clone(), "nightly".into(), false)]);
    // added by the CLI, not through the server: seen too
    add_as(&w, "alice", "weekly").await;
    let (_, out) = call(addr, "GET", "/api/v1/schedules", &alice, None).await;
    assert_eq!(
        rows(&out),
        [
            (alice.clone(), "nightly".into(), false),
            (alice.clone(), "weekly".into(), false)
        ]
    );
    // paused through the API: the next GET says so
    let (status, out) = call(addr, "POST", "/api/v1/schedules/weekly/pause", &alice, None).await;
    assert_eq!(status, 200, "{out}");
    let (_, out) = call(addr, "GET", "/api/v1/schedules/weekly", &alice, None).await;
    assert_eq!(out["paused"], true, "{out}");

    // mallory sees none of alice's and cannot name them
    let (status, out) = call(addr, "GET", "/api/v1/schedules", &mallory, None).await;
    assert_eq!((status, rows(&out)), (200, vec![]), "{out}");
    let (status, out) = call(addr, "GET", "/api/v1/schedules/nightly", &mallory, None).await;
    assert_eq!(status, 404, "{out}");
    let path = format!("/api/v1/schedules/nightly?owner={alice}");
    let (status, out) = call(addr, "GET", &path, &mallory, None).await;
    assert_eq!(status, 400, "{out}");
    let (status, out) = call(
        addr,
        "POST",
        "/api/v1/schedules/nightly/pause",
        &mallory,
        None,
    )
    .await;
    assert_eq!(status, 404, "{out}");

    // questions asked at once share barriers: 40 GETs append far fewer than 40 records to
    // the control stream, and each still sees what was confirmed before it
    let before = api.schedules().barriers();
    let gets = (0..40).map(|_| call(addr, "GET", "/api/v1/schedules", &alice, None));
    for (status, out) in futures::future::join_all(gets).await {
        assert_eq!((status, rows(&out).len()), (200, 2), "{out}");
    }
    let appended = api.schedules().barriers() - before;
    assert!(
        (1..=20).contains(&appended),
        "40 GETs appended {appended} barriers"
    );

    // the server loses its connection; what is written meanwhile is seen once it follows again
    assert!(close_connections_of(&w.user("pending")) >= 1);
    add_as(&w, "mallory", "nightly").await;
    let (status, out) = call(addr, "GET", "/api/v1/schedules", &mallory, None).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(rows(&out), [(mallory.clone(), "nightly".into(), false)]);

    // the CLI through the server says what the local replay says
    let index_url = format!("http://{addr}");
    for role in ["alice", "mallory", "adm"] {
        let remote = recurring_json(&w, role, &["list"], Some(&index_url)).await;
        let local = recurring_json(&w, role, &["list"], None).await;
        assert_eq!(remote, local, "{role}'s list");
        assert!(!remote.is_empty(), "{role} sees its own");
    }
    // a page at a time: the admin's first page of one names the cursor of the next, and the
    // pages together are the whole list, through the server and replayed alike
    let whole = recurring_json(&w, "adm", &["list"], None).await;
    assert!(whole.len() >= 2, "{whole:?}");
    for url in [Some(index_url.as_str()), None] {
        let (mut pages, mut after) = (Vec::new(), None::<String>);
        loop {
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"));
            cmd.arg("--config").arg(&w.cfg);
            cmd.args(["--url", &w.url("adm"), "recurring", "list", "--json"]);
            cmd.args(["--limit", "1"]);
            if let Some(a) = &after {
                cmd.args(["--after", a]);
            }
            if let Some(u) = url {
                cmd.args(["--index-url", u]);
            }
            let out = cmd.output().await.unwrap();
            assert!(out.status.success(), "{out:?}");
            let page: Vec<String> = (String::from_utf8_lossy(&out.stdout).lines())
                .map(str::to_string)
                .collect();
            assert_eq!(page.len(), 1, "{page:?}");
            pages.extend(page);
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            match err.split("more follow: --after ").nth(1) {
                Some(c) => after = Some(c.trim().to_string()),
                None => break,
            }
        }
        assert_eq!(pages, whole, "pages through {url:?}");
    }
    for bad in ["limit=0", "limit=10001", "after=no-cursor", "limit=x"] {
        let (status, out) = call(
            addr,
            "GET",
            &format!("/api/v1/schedules?{bad}"),
            &alice,
            None,
        )
        .await;
        assert_eq!(status, 400, "{bad}: {out}");
    }

    let remote = recurring_json(&w, "alice", &["show", "weekly"], Some(&index_url)).await;
    let local = recurring_json(&w, "alice", &["show", "weekly"], None).await;
    assert_eq!(remote, local);
    let args = ["show", "nightly", "--owner", alice.as_str()];
    let remote = recurring_json(&w, "adm", &args, Some(&index_url)).await;
    assert_eq!(remote, recurring_json(&w, "adm", &args, None).await);
    // and through the server mallory still cannot name alice's
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&w.cfg)
        .args(["--url", &w.url("mallory"), "recurring", "show", "weekly"])
        .args(["--index-url", &index_url])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has no recurring schedule"),
        "{err}"
    );
    server.abort();
}
