//! The scripts an operator runs: the permission sets and the one-command demo.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::root;

#[test]
fn the_permission_script_prints_the_documented_sets() {
    let out = Command::new("bash")
        .arg(root().join("deploy/rabbitmq/permissions.sh"))
        .args([
            "--prefix",
            "p",
            "--queue",
            "q",
            "--gateway",
            "i:t",
            "--relay",
            "s:r",
        ])
        .args(["--proxy", "--app", "a:x1,x2:qa", "--gateway-app", "b:i"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let tiers = r"p\.(level\d+|fixed\..+|overflow\d+|deliver)";
    // the shapes of tests/it/permissions.rs, which proves them on a real broker
    for line in [
        // no role has amq.default (it writes into any queue of the vhost): the streams and the
        // parking queues have exchanges of their own; each role writes what it checks with a
        // passive declare and may not otherwise touch (RabbitMQ 4.3 wants a right on it)
        r"set_permissions -p / p-admin '^(p\..*|q|s|i)$' '^(p\..*|q|s|i)$' '^(p\..*|q|s|i)$'"
            .to_string(),
        format!(
            "set_permissions -p / p-publisher '^$' '^({tiers}|p\\.(streams|control|ledger|journal|layout\\..+|(holds|batched)\\..+))$' '^$'"
        ),
        format!(
            "set_permissions -p / p-worker '^$' '^({tiers}|p\\.(streams|park|journal|layout\\..+|(parked|holds|batched)\\.(q)))$' '^(q|p\\.(control|ledger))$'"
        ),
        // following the pairs, the applications' exchanges are targets too
        format!(
            "set_permissions -p / p-gateway '^$' '^(i|t|x1|x2|p\\.(gw\\..*|parking|streams|park|journal|layout\\..+|(parked|holds|batched)\\.(p\\.gw\\..+))|{tiers})$' '^(i|p\\.gw\\..*|p\\.(control|ledger))$'"
        ),
        format!(
            "set_permissions -p / p-relay '^$' '^(amq\\.default|{tiers}|p\\.(streams|park|journal|layout\\..+|(parked|holds|batched)\\.(s)))$' '^(s|p\\.(control|ledger))$'"
        ),
        // its own gateway delivers to the applications' exchanges
        r"set_permissions -p / p-proxy '^p\..*$' '^(p\..*|x1|x2)$' '^p\..*$'".to_string(),
        // the index's own user: the streams it follows, nothing of the tiers or destinations
        r"set_permissions -p / p-pending '^$' '^p\.(streams|journal|control)$' '^p\.(journal|control)$'"
            .to_string(),
        // an application writes its own pairs' ingresses, never p.gw.x.* as a whole
        r"set_permissions -p / a '^(x1|x2|qa)$' '^(x1|x2|qa|p\.gw\.x\.(x1|x2))$' '^(x1|x2|qa)$'"
            .to_string(),
        r"set_permissions -p / b '^$' '^(i)$' '^$'".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == format!("rabbitmqctl {line}")),
            "missing: {line}\nin:\n{text}"
        );
    }
}

// --- the demo ------------------------------------------------------------------------------------

#[test]
fn the_demo_runs_in_one_command() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_delay-publisher"))
        .parent()
        .unwrap()
        .to_path_buf();
    let start = Instant::now();
    let mut child = Command::new("bash")
        .arg(root().join("scripts/demo.sh"))
        .arg("--quick")
        .env("DEMO_BIN_DIR", &bin_dir)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // read both pipes on threads so that neither fills up
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).unwrap();
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).unwrap();
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("demo.sh --quick ran for more than 2 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (out, err) = (t_out.join().unwrap(), t_err.join().unwrap());
    let took = start.elapsed();
    assert!(
        status.success(),
        "demo.sh --quick failed ({status}):\n{out}\n{err}"
    );
    let fired: BTreeSet<&str> = out
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("fired "))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(fired.len(), 36, "every message fired once:\n{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("summary: "))
        .unwrap_or_else(|| panic!("no summary line:\n{out}"));
    assert!(summary.starts_with("summary: 36/36 fired"), "{summary}");
    assert!(summary.contains("none early"), "{summary}");
    assert!(!out.contains("EARLY"), "{out}");
    assert!(
        out.contains("removing the topology"),
        "the demo cleans up:\n{out}"
    );
    assert!(
        !err.contains("could not delete") && !err.contains("teardown failed"),
        "{err}"
    );
    // and nothing of its topology is left on the broker
    let prefix = out
        .lines()
        .find_map(|l| l.split("removing the topology '").nth(1))
        .and_then(|rest| rest.split('\'').next())
        .unwrap_or_else(|| panic!("no prefix in:\n{out}"))
        .to_string();
    let listed = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name"])
        .output()
        .expect("rabbitmqctl (the demo's broker is local)");
    assert!(listed.status.success(), "rabbitmqctl list_queues failed");
    let left: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(str::to_string)
        .collect();
    assert!(left.is_empty(), "the demo left queues behind: {left:?}");
    eprintln!("demo.sh --quick took {took:?}; {summary}");
}
