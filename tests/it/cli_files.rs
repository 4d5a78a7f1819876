//! What `send --jsonl` writes and logs is private and cannot be turned against its user (issue
//! 43, attack 8): the resend files take the input's privacy, a link or file planted where one
//! goes is never written through, a line the broker refused is "not sent" (never "maybe
//! sent"), and control characters in logged values cannot forge a log line.
//!
//! The refusal needs a user with an exact permission set: those tests run on our own TLS test
//! node's plain port (users are created there, never on the main broker), like `permissions`.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use amqp_delay::Message;

use crate::harness::*;
use crate::permissions::{Cleanup, cli_as, documented_sets, set_of, url, user};

/// A topology on the TLS test node, a destination queue, and a publisher `{p}-pub` who may write
/// every tier but the delivery exchange: whatever is due at once (`delay_ms: 0`) goes straight
/// there, and the broker refuses it with 403 ACCESS_REFUSED, closing the publish channel.
struct Refusing {
    p: String,
    q: String,
    cfg: PathBuf,
    root: String,
    publisher: String,
    _cleanup: Cleanup,
}

impl Refusing {
    async fn new() -> Refusing {
        let port = crate::security::tls_node()["AMQP_PORT"].clone();
        let p = random_prefix();
        let q = format!("{p}-orders");
        let root = url("guest", &port).replace("guest-pw", "guest");
        let cfg = small_config(&p, "files.toml", "");
        // the documented publisher set without `{p}.deliver`
        let sets = documented_sets(&["--prefix", &p]);
        let (_, c, w, r) = set_of(&sets, &format!("{p}-publisher"));
        let without = w.replacen("|deliver)", ")", 1);
        assert_ne!(
            &without, w,
            "the publisher's set names the delivery exchange"
        );
        user(&format!("{p}-pub"), c, &without, r);
        let cleanup = Cleanup {
            cfg: cfg.clone(),
            root: root.clone(),
            queues: vec![q.clone()],
            exchanges: Vec::new(),
            users: vec![format!("{p}-pub")],
        };
        cli_as("declare", &cfg, &root, &["declare"]).await;
        cli_as("declare --queue", &cfg, &root, &["declare", "--queue", &q]).await;
        Refusing {
            publisher: url(&format!("{p}-pub"), &port),
            p,
            q,
            cfg,
            root,
            _cleanup: cleanup,
        }
    }

    /// Runs `send --jsonl input` as the publisher.
    async fn send(&self, input: &Path) -> std::process::Output {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
            .arg("--config")
            .arg(&self.cfg)
            .args(["--url", &self.publisher, "send", "--jsonl"])
            .arg(input)
            .output()
            .await
            .unwrap()
    }

    /// Writes `lines` to a fresh input file of mode `mode`.
    fn input(&self, name: &str, lines: &[String], mode: u32) -> PathBuf {
        let file = temp_path(&self.p, name);
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        file
    }

    /// A line for the destination queue.
    fn line(&self, id: &str, delay_ms: u64) -> String {
        format!(
            r#"{{"queue":"{}","delay_ms":{delay_ms},"body":"card 4111 1111 1111 1111","id":"{id}"}}"#,
            self.q
        )
    }

    /// What reached the destination queue within `wait` (then 300 ms of quiet).
    async fn delivered(&self, wait: Duration) -> Vec<Received> {
        let conn = amqp_delay::ops::connection::connect(&self.root, "files check")
            .await
            .unwrap();
        let got = collect(&conn, &self.q, usize::MAX, wait, Duration::from_millis(300)).await;
        let _ = conn.close(200, "bye".into()).await;
        got
    }
}

fn with_suffix(file: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}.{suffix}", file.display()))
}

fn mode_of(file: &Path) -> u32 {
    std::fs::symlink_metadata(file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// The ids of the JSON lines of `file` (none when it does not exist).
fn ids_in(file: &Path) -> HashSet<String> {
    read_lines(file)
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["id"].as_str().map(str::to_string))
        .collect()
}

/// A publish the broker refused with 403 ACCESS_REFUSED was reported "maybe sent": the channel
/// close fails every confirm awaited on that channel, and each was taken for a lost one. The
/// refused line, and the lines published after it on that channel (the broker discarded them),
/// are certainly not sent: reported so and written to `FILE.unsent`. Those published before it
/// and still awaiting their confirm stay "maybe sent". None reported not sent reached the queue
/// (measured: the 20 lines before the refused one arrived, the 19 after it never did). The
/// input is mode 0600 (it holds card numbers): both files are 0600 too, never 0644.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_line_is_not_sent_and_the_resend_files_stay_private() {
    let node = Refusing::new().await;
    let mut lines: Vec<String> = (0..40)
        .map(|i| node.line(&format!("ok-{i}"), 100 + i * 10))
        .collect();
    lines[20] = node.line("refused", 0);
    let input = node.input("refused.jsonl", &lines, 0o600);
    let out = node.send(&input).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let refused_line = stderr
        .lines()
        .find(|l| l.starts_with("line 21:"))
        .unwrap_or_else(|| panic!("line 21 is not reported: {stderr}"));
    assert!(
        refused_line.starts_with("line 21: not sent:") && refused_line.contains("ACCESS_REFUSED"),
        "{refused_line}"
    );
    let (unsent, maybe) = (
        with_suffix(&input, "unsent"),
        with_suffix(&input, "maybe-sent"),
    );
    let (unsent_ids, maybe_ids) = (ids_in(&unsent), ids_in(&maybe));
    assert!(unsent_ids.contains("refused"), "{unsent_ids:?}\n{stderr}");
    assert!(!maybe_ids.contains("refused"), "{maybe_ids:?}\n{stderr}");
    assert_eq!(mode_of(&unsent), 0o600, "{}", unsent.display());
    if maybe.exists() {
        assert_eq!(mode_of(&maybe), 0o600, "{}", maybe.display());
    }
    // what was said not sent did not arrive; what arrived was confirmed or maybe sent
    let got = node.delivered(Duration::from_secs(3)).await;
    let arrived: HashSet<String> = got.iter().map(|r| r.id()).collect();
    let wrong: Vec<_> = arrived.intersection(&unsent_ids).collect();
    assert!(
        wrong.is_empty(),
        "reported not sent, yet delivered: {wrong:?}\n{stderr}"
    );
    assert!(!arrived.contains("refused"));
    for f in [&input, &unsent, &maybe] {
        let _ = std::fs::remove_file(f);
    }
}

/// `File::create` followed a symbolic link planted at `FILE.maybe-sent` and overwrote what it
/// pointed to, and truncated a file hard-linked there. A resend file is now created new: a
/// link, a dangling link or any file already at its path (`FILE.maybe-sent`, where main wrote
/// the refused line, or `FILE.unsent`, where it goes now) stops the run before anything is
/// sent, with an error naming it, and nothing it points to is created or changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_or_link_planted_at_a_resend_file_is_never_written_through() {
    let node = Refusing::new().await;
    let lines = [node.line("refused", 0), node.line("ok", 50)];
    let victim = temp_path(&node.p, "victim");
    let absent = temp_path(&node.p, "created-through-a-link");
    type Plant<'a> = &'a dyn Fn(&Path);
    let link: Plant = &|at| std::os::unix::fs::symlink(&victim, at).unwrap();
    let dangling: Plant = &|at| std::os::unix::fs::symlink(&absent, at).unwrap();
    let hard: Plant = &|at| std::fs::hard_link(&victim, at).unwrap();
    let plants = [
        ("a symbolic link", "maybe-sent", link),
        ("a dangling symbolic link", "maybe-sent", dangling),
        ("a hard link", "maybe-sent", hard),
        ("a symbolic link", "unsent", link),
        ("a dangling symbolic link", "unsent", dangling),
    ];
    for (what, suffix, plant) in plants {
        std::fs::write(&victim, "precious\n").unwrap();
        let input = node.input("planted.jsonl", &lines, 0o600);
        let at = with_suffix(&input, suffix);
        plant(&at);
        let what = format!("{what} at FILE.{suffix}");
        let out = node.send(&input).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        assert!(
            stderr.contains(&format!("{} already exists", at.display()))
                && stderr.contains("nothing was sent"),
            "{what}: {stderr}"
        );
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "precious\n",
            "{what}: written through"
        );
        assert!(!absent.exists(), "{what}: created through the link");
        for other in ["unsent", "maybe-sent"].iter().filter(|s| **s != suffix) {
            assert!(
                !with_suffix(&input, other).exists(),
                "{what}: FILE.{other} was left behind"
            );
        }
        assert!(
            std::fs::symlink_metadata(&at).is_ok(),
            "{what}: the plant was removed"
        );
        for f in [&input, &at] {
            let _ = std::fs::remove_file(f);
        }
    }
    assert!(
        node.delivered(Duration::from_millis(800)).await.is_empty(),
        "a run that stopped on a planted file sent something"
    );
    let _ = std::fs::remove_file(&victim);
}

/// A newline in a message id was written raw into a human log line, so whoever chooses an id
/// could forge log lines (or, with ESC, drive the reader's terminal). Every field and message
/// of a human log line now has its control characters escaped; the real consumer's stderr shows
/// the id as `\n` and `\u{1b}`, on one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_a_logged_id_cannot_forge_a_log_line() {
    let mut env = Env::new(small_topology()).await;
    let q = env.queue("logged").await;
    env.parked_queue(&q);
    let cfg = env.write_config("");
    // its parking queue and what the worker needs, as the admin declares them
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .arg("--config")
        .arg(&cfg)
        .args(["declare", "--queue", &q, "--worker"])
        .env("AMQP_URL", broker_url())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = temp_path(&env.settings.prefix, "consumer.log");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-consumer"))
        .arg("--config")
        .arg(&cfg)
        .args(["--queue", &q, "--exec", "false", "--max-attempts", "1"])
        .args(["--log-format", "human"])
        .env("AMQP_URL", broker_url())
        .env("RUST_LOG", "warn,amqp_delay=info")
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let id = "evil\n2030-01-01T00:00:00Z  INFO amqp_delay: FORGED\r\x1b[2J\x07\u{9b}";
    let p = env.publisher().await;
    p.schedule(Message::new(q.clone(), 10, "x").with_id(id))
        .await
        .unwrap();
    let parked = wait_until(Duration::from_secs(15), || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("parked"))
    })
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert!(parked, "the consumer did not park the message:\n{text}");
    assert!(
        !text.lines().any(|l| l.starts_with("2030-01-01")),
        "a forged line:\n{text}"
    );
    assert!(
        !text.contains(['\r', '\x1b', '\x07', '\u{9b}']),
        "raw control characters: {text:?}"
    );
    let parked_line = text
        .lines()
        .find(|l| l.contains("parked"))
        .unwrap_or_default();
    assert!(
        parked_line.contains(
            r"id=evil\n2030-01-01T00:00:00Z  INFO amqp_delay: FORGED\r\u{1b}[2J\u{7}\u{9b}"
        ),
        "{parked_line}"
    );
    p.close().await;
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(&cfg);
    env.cleanup().await;
}
