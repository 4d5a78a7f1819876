//! MIGRATING's runbooks, run as written against the real plugin: A (in place) on a plugin node
//! with the management plugin, B (blue-green) from a plugin node to a stock node. Before step 0
//! the plugin holds a backlog (a plugin-era application's, 2–60 s); after step 1 the application
//! publishes through the proxy, again between the two dry runs of step 2 and (A) after step 5,
//! declaring its exchange at start-up where the text says it may. At the end every message has
//! arrived in `order-timeouts` (of either cluster), none early, none altered, duplicates only
//! as import-plugin counted them.
//!
//! What the text says in prose the test does as a user would: step 2's dry run twice (the
//! total must not grow), step 4 after the leave window that step 3 printed, its last line as
//! the text of A4 says.

use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use crate::app::{self, Collector, Sent};
use crate::markdown::{self, Block};
use crate::nodes::{ADMIN, APP, Node, PROXY, Users};
use crate::shell::{Ran, Session};

/// The plugin's backlog, loaded before the runbook: messages and their x-delay (ms).
const BACKLOG: u32 = 200;
const BACKLOG_DELAYS: (u64, u64) = (2_000, 60_000);
/// Each batch the application publishes through the proxy.
const BATCH: u32 = 30;
const BATCH_DELAYS: (u64, u64) = (5_000, 25_000);
/// How long after the last message is due the test waits for what is missing.
const MARGIN: Duration = Duration::from_secs(120);

/// The runbook's session and what the application published.
struct Driver {
    title: &'static str,
    session: Session,
    sent: Vec<Sent>,
    /// The application's URL: the proxy's address, its own user.
    app_url: String,
    /// Whether the application declares its exchange at start-up before step 5.
    declares: bool,
    batches: u32,
    /// Duplicates import-plugin counted (the text allows these).
    counted: u64,
    /// Step 3's leave window, as it printed it, and when it ended.
    imported: Option<(Instant, Duration)>,
    /// What A4 says the last dry run must end with.
    empty: String,
}

impl Driver {
    /// A session in `dir` with `vars` besides a user's own environment; `sent` is the backlog.
    fn new(
        title: &'static str,
        dir: &std::path::Path,
        vars: &[(&str, String)],
        sent: Vec<Sent>,
        app_url: String,
        declares: bool,
        doc: &str,
    ) -> Driver {
        Driver {
            title,
            session: Session::new(dir, env(vars, dir)),
            sent,
            app_url,
            declares,
            batches: 0,
            counted: 0,
            imported: None,
            empty: empty_pattern(doc),
        }
    }

    /// Runs every block in order (`after_intro` once the blocks before step 0 ran), then waits
    /// for the messages and judges.
    fn run_all(
        mut self,
        blocks: &[Block],
        collector: &Collector,
        t0: Instant,
        after_intro: &dyn Fn(),
    ) {
        eprintln!(
            "[runbooks] {}: nodes, users and backlog in {:.0}s",
            self.title,
            t0.elapsed().as_secs_f64()
        );
        for b in blocks {
            if b.step == Some(0) {
                after_intro();
            }
            self.block(b, collector);
        }
        let (title, dir) = (self.title, self.session.dir().to_path_buf());
        self.finish(collector);
        eprintln!("[runbooks] {title} took {:.0}s", t0.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(dir);
    }

    fn block(&mut self, b: &Block, collector: &Collector) {
        let what = match b.step {
            Some(n) => format!("{} step {n}", self.title),
            None => format!("{} (before the steps)", self.title),
        };
        eprintln!("[runbooks] {what}");
        match b.step {
            Some(2) => self.dry_run_twice(&what, b, collector),
            Some(3) => self.import(&what, b),
            Some(4) => self.check_empty(&what, b),
            _ => {
                self.run(&what, b);
            }
        }
        match b.step {
            Some(1) => self.batch(self.declares),
            Some(5) => self.batch(true),
            _ => {}
        }
    }

    /// Runs the block; a failure shows it, what it printed and what runs in the background.
    fn run(&mut self, what: &str, b: &Block) -> Ran {
        let r = self.session.run(what, &b.code);
        assert!(
            r.status.success(),
            "{}\n{}(every block's output: {})",
            r.report(),
            self.session.logs(),
            self.session.dir().display()
        );
        r
    }

    fn batch(&mut self, declare: bool) {
        self.batches += 1;
        let prefix = format!("proxy{}", self.batches);
        let sent = app::publish(&self.app_url, &prefix, BATCH, BATCH_DELAYS, declare);
        self.sent.extend(sent);
    }

    /// "Twice, a minute apart, the total must not grow": the application publishes between.
    /// And more exactly: the plugin holds no more than what of the backlog has not arrived.
    fn dry_run_twice(&mut self, what: &str, b: &Block, collector: &Collector) {
        let first = self.holds_only_the_backlog(what, b, collector);
        self.batch(self.declares);
        let second = self.holds_only_the_backlog(what, b, collector);
        assert!(
            second <= first,
            "{what}: the plugin held {first}, then {second} after the application published \
             through the proxy: new delays went to the plugin\n{}",
            self.session.logs()
        );
    }

    fn holds_only_the_backlog(&mut self, what: &str, b: &Block, collector: &Collector) -> u64 {
        let backlog = app::outstanding(&self.sent, &collector.got(), "backlog-");
        let holds = holds(&self.run(what, b));
        assert!(
            holds <= backlog,
            "{what}: the plugin holds {holds} messages, more than the {backlog} of the backlog \
             that had not arrived: the application's delays through the proxy went to the plugin"
        );
        holds
    }

    fn import(&mut self, what: &str, b: &Block) {
        let r = self.run(what, b);
        let summary = r
            .stdout
            .lines()
            .rfind(|l| l.starts_with("moved "))
            .unwrap_or_else(|| panic!("{what}: no summary line\n{}", r.report()))
            .to_string();
        self.counted += number_after(&summary, "duplicates ");
        let leave = summary
            .split_once("due within ")
            .and_then(|(_, rest)| rest.split_once(':'))
            .and_then(|(d, _)| amqp_delay::time::parse_duration_ms(d).ok())
            .unwrap_or_else(|| panic!("{what}: no leave window in '{summary}'"));
        eprintln!("[runbooks] {what}: {summary}");
        self.imported = Some((Instant::now(), Duration::from_millis(leave)));
    }

    /// After the leave window, the dry run ends as A4 says.
    fn check_empty(&mut self, what: &str, b: &Block) {
        if let Some((at, leave)) = self.imported {
            let until = at + leave + Duration::from_secs(2);
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
        }
        let r = self.run(what, b);
        let last = r.stdout.lines().last().unwrap_or_default().to_string();
        assert!(
            ends_as(&last, &self.empty),
            "{what}: the dry run ends with '{last}', not '{}'\n{}",
            self.empty,
            r.report()
        );
    }

    /// Waits for every message, stops what the runbook left running, and judges.
    fn finish(mut self, collector: &Collector) {
        let got = collector.wait_for(&self.sent, MARGIN, Duration::from_secs(3));
        let stubborn = self.session.stop_all(Duration::from_secs(20));
        let (problems, summary) = app::verdict(&self.sent, &got, self.counted);
        eprintln!("[runbooks] {}: {summary}", self.title);
        assert!(
            problems.is_empty(),
            "{}: {summary}\n{}\n{}",
            self.title,
            problems.join("\n"),
            self.session.logs()
        );
        assert!(
            stubborn.is_empty(),
            "{}: background jobs ignored SIGTERM for 20 s (process groups {stubborn:?})",
            self.title
        );
    }
}

/// `N` in "... the plugin holds N" of a dry run's last line.
fn holds(r: &Ran) -> u64 {
    let last = r.stdout.lines().last().unwrap_or_default();
    assert!(last.contains("the plugin holds "), "{}", r.report());
    number_after(last, "the plugin holds ")
}

/// The number right after `label` in `text` (0 when there is none).
fn number_after(text: &str, label: &str) -> u64 {
    text.split_once(label)
        .map(|(_, rest)| {
            rest.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Whether `line` ends as `pattern` says, `...` standing for any text.
fn ends_as(line: &str, pattern: &str) -> bool {
    let parts: Vec<&str> = pattern
        .split("...")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let mut at = 0;
    for p in &parts {
        match line[at..].find(p) {
            Some(i) => at += i + p.len(),
            None => return false,
        }
    }
    parts.last().is_none_or(|p| line.trim_end().ends_with(p))
}

/// What A4 says the dry run must end with (B4 is "as A4").
fn empty_pattern(doc: &str) -> String {
    let a = markdown::sh_blocks(doc, "Runbook A:").unwrap();
    let step = markdown::step(&a, 4).unwrap();
    markdown::code_spans(&step.prose)
        .into_iter()
        .find(|s| s.contains("would move"))
        .unwrap_or_else(|| panic!("A4 names no `would move ...` line: {}", step.prose))
        .to_string()
}

fn env(pairs: &[(&str, String)], dir: &std::path::Path) -> Vec<(String, String)> {
    let mut env = crate::base_env(dir);
    env.extend(pairs.iter().map(|(k, v)| (k.to_string(), v.clone())));
    env
}

/// The users the runbook's `permissions.sh` line names (the users must exist before it runs
/// with `--apply`; without, it prints its `rabbitmqctl` commands): run without `--apply`.
fn users_of_permissions_sh(blocks: &[Block], dir: &std::path::Path) -> Vec<String> {
    let line = blocks
        .iter()
        .flat_map(|b| b.code.lines())
        .find(|l| l.starts_with("deploy/rabbitmq/permissions.sh"))
        .expect("the runbook has no deploy/rabbitmq/permissions.sh line");
    let printing = line.replace(" --apply", "");
    let out = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", &printing])
        .current_dir(dir)
        .env_clear()
        .envs(crate::base_env(dir))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printing}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut users: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["rabbitmqctl", "set_permissions", "-p", _, user, ..] => Some(user.to_string()),
                ["rabbitmqctl", "set_user_tags", user, ..] => Some(user.to_string()),
                _ => None,
            }
        })
        .map(|u| u.trim_matches('\'').to_string())
        .collect();
    users.sort();
    users.dedup();
    users
}

/// Debian's rabbitmqadmin on `node`'s management API as the broker's administrator.
fn rabbitmqadmin(node: &Node) -> String {
    let port = node.mgmt_port.expect("a node with the management plugin");
    format!("rabbitmqadmin -P {port} -u guest -p guest")
}

/// `url` of `node` with the proxy's address `listen` instead of the node's.
fn through(url: &str, node: &Node, listen: &str) -> String {
    url.replace(&format!("127.0.0.1:{}", node.amqp_port), listen)
}

/// The blocks of a runbook, after checking that the steps the test drives exist.
fn runbook(doc: &str, title: &str, steps: std::ops::RangeInclusive<u32>) -> Vec<Block> {
    let blocks = markdown::sh_blocks(doc, title).unwrap_or_else(|e| panic!("MIGRATING: {e}"));
    for n in steps {
        markdown::step(&blocks, n).unwrap_or_else(|e| panic!("MIGRATING {title} {e}"));
    }
    blocks
}

#[test]
fn runbook_a_in_place_moves_the_backlog_and_every_message_arrives_on_time() {
    crate::machine_lock();
    let t0 = Instant::now();
    let doc = crate::read_doc("docs/MIGRATING.md");
    let blocks = runbook(&doc, "Runbook A:", 0..=5);
    let intro = &blocks[0].prose;
    for user in [ADMIN, PROXY, APP] {
        assert!(
            intro.contains(user),
            "runbook A no longer names the user {user}: {intro}"
        );
    }
    let dir = crate::workdir("a");
    let node = Node::up("a");
    let users = Users::make(&node, &users_of_permissions_sh(&blocks, &dir));
    let rt = Runtime::new().unwrap();
    let mut collector = Collector::new();
    collector.watch(&rt, node.guest_url(), node.amqp_port);
    let backlog = app::publish(&node.guest_url(), "backlog", BACKLOG, BACKLOG_DELAYS, true);
    let listen = "127.0.0.1:5937";
    let vars = [
        ("RABBITMQ_CONF_ENV_FILE", node.conf_env_file.clone()),
        ("ADMIN_URL", users.url(&node, ADMIN)),
        ("PROXY_URL", users.url(&node, PROXY)),
        ("NODE", node.name.clone()),
        ("PROXY_LISTEN", listen.into()),
        ("RABBITMQADMIN", rabbitmqadmin(&node)),
    ];
    let app_url = through(&users.url(&node, APP), &node, listen);
    let d = Driver::new("runbook A", &dir, &vars, backlog, app_url, false, &doc);
    d.run_all(&blocks, &collector, t0, &|| {
        let with = node.users_with_permissions();
        for u in users.passwords.keys() {
            assert!(
                with.iter().any(|w| w == u),
                "the runbook gave {u} no permissions"
            );
        }
    });
}

#[test]
fn runbook_b_blue_green_moves_the_backlog_and_every_message_arrives_on_time() {
    crate::machine_lock();
    let t0 = Instant::now();
    let doc = crate::read_doc("docs/MIGRATING.md");
    let blocks = runbook(&doc, "Runbook B:", 0..=4);
    let (old, new) = std::thread::scope(|s| {
        let old = s.spawn(|| Node::up("b-old"));
        let new = s.spawn(|| Node::up("b-new"));
        (old.join().unwrap(), new.join().unwrap())
    });
    let dir = crate::workdir("b");
    let users = Users::make(&new, &users_of_permissions_sh(&blocks, &dir));
    let rt = Runtime::new().unwrap();
    let mut collector = Collector::new();
    collector.watch(&rt, old.guest_url(), old.amqp_port);
    collector.watch(&rt, new.guest_url(), new.amqp_port);
    let backlog = app::publish(&old.guest_url(), "backlog", BACKLOG, BACKLOG_DELAYS, true);
    let listen = "127.0.0.1:5938";
    let vars = [
        ("RABBITMQ_CONF_ENV_FILE", new.conf_env_file.clone()),
        ("NEW_ADMIN_URL", users.url(&new, ADMIN)),
        ("NEW_PROXY_URL", users.url(&new, PROXY)),
        ("OLD_NODE", old.name.clone()),
        ("OLD_RABBITMQCTL", crate::nodes::RABBITMQCTL.into()),
        ("NEW_RABBITMQADMIN", rabbitmqadmin(&new)),
        ("PROXY_LISTEN", listen.into()),
    ];
    let app_url = through(&users.url(&new, APP), &new, listen);
    let d = Driver::new("runbook B", &dir, &vars, backlog, app_url, true, &doc);
    d.run_all(&blocks, &collector, t0, &|| {});
}

#[test]
fn a_dry_runs_last_line_is_matched_as_the_text_writes_it() {
    let p = "would move 0; skipped 0 ...; left 0; the plugin holds 0";
    let ok = "would move 0; skipped 0 (due within 10s: left to the plugin, which delivers them); left 0; the plugin holds 0";
    assert!(ends_as(ok, p));
    assert!(!ends_as(&ok.replace("holds 0", "holds 10"), p));
    assert!(!ends_as(&ok.replace("skipped 0", "skipped 3"), p));
    assert_eq!(
        number_after("moved 12, duplicates 3; skipped", "duplicates "),
        3
    );
}
