//! The broker's configuration files: every rabbitmq.conf key one the installed broker knows,
//! advanced.config readable by `erl`, the settings where the broker reads them.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::k8s::configmap_settings;
use crate::{read, temp_file};

/// `key = value` lines of a rabbitmq.conf-style file, comments and blank lines left out.
pub(crate) fn broker_conf_text(text: &str, what: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{what}: '{line}' is not key = value"));
        assert!(
            out.insert(k.trim().to_string(), v.trim().to_string())
                .is_none(),
            "{what}: {k} set twice"
        );
    }
    out
}

pub(crate) fn broker_conf(rel: &str) -> BTreeMap<String, String> {
    broker_conf_text(&read(rel), rel)
}

/// The `rabbitmq.conf` keys the installed broker knows (its cuttlefish schemas), as patterns
/// (`$name` matches one segment); None when no broker is installed here.
fn schema_keys() -> Option<Vec<String>> {
    let base = Path::new("/usr/lib/rabbitmq/lib");
    let mut keys = Vec::new();
    let mut stack = vec![base.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "schema") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for part in text.split("{mapping, \"").skip(1) {
                    if let Some(end) = part.find('"') {
                        keys.push(part[..end].to_string());
                    }
                }
            }
        }
    }
    (!keys.is_empty()).then_some(keys)
}

fn key_matches(pattern: &str, key: &str) -> bool {
    let (p, k): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), key.split('.').collect());
    p.len() == k.len() && p.iter().zip(&k).all(|(a, b)| a.starts_with('$') || a == b)
}

/// The Erlang terms of an advanced.config text, as `erl` prints them (`~w`), or None when no
/// `erl` is installed.
pub(crate) fn erl_terms(text: &str) -> Option<String> {
    let path = temp_file("advanced.config", text);
    let out = Command::new("erl")
        .args([
            "-noshell",
            "-eval",
            &format!(
                "case file:consult(\"{}\") of {{ok, T}} -> io:format(\"~w\", [T]); E -> io:format(\"ERROR ~p\", [E]) end, halt().",
                path.display()
            ),
        ])
        .output();
    let _ = std::fs::remove_file(&path);
    let out = out.ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && !text.starts_with("ERROR"),
        "erl cannot read advanced.config: {text}"
    );
    Some(text)
}

#[test]
fn the_broker_settings_are_where_the_broker_reads_them() {
    let conf = broker_conf("deploy/rabbitmq/rabbitmq.conf");
    assert_eq!(
        conf.get("queue_leader_locator").map(String::as_str),
        Some("balanced")
    );
    // the broker's consumer_timeout is the one the workers assume (the ConfigMap leaves
    // consumer.consumer_timeout at its default)
    let ms: u64 = conf["consumer_timeout"].parse().unwrap();
    let cm = configmap_settings();
    assert_eq!(ms, cm.consumer.consumer_timeout.as_millis());
    for file in [
        "deploy/rabbitmq/rabbitmq.conf",
        "deploy/rabbitmq/cluster.conf",
    ] {
        let conf = broker_conf(file);
        for key in conf.keys() {
            assert!(
                !key.contains("dead_letter_worker"),
                "{file}: {key} has no rabbitmq.conf key: the node would not boot (advanced.config)"
            );
        }
        match schema_keys() {
            Some(known) => {
                for key in conf.keys() {
                    assert!(
                        known.iter().any(|p| key_matches(p, key)),
                        "{file}: the installed RabbitMQ does not know the key {key}"
                    );
                }
            }
            None => eprintln!("no RabbitMQ schema installed here: {file}'s keys not checked"),
        }
    }

    let advanced = read("deploy/rabbitmq/advanced.config");
    let prefetch = advanced
        .split("{dead_letter_worker_consumer_prefetch,")
        .nth(1)
        .and_then(|r| r.split('}').next())
        .map(|n| n.trim().parse::<u32>().expect("a number"))
        .expect("dead_letter_worker_consumer_prefetch is set");
    match erl_terms(&advanced) {
        Some(terms) => {
            assert!(
                terms.contains("{dead_letter_worker_publisher_confirm_timeout,5000}"),
                "{terms}"
            );
            assert!(
                terms.contains(&format!(
                    "{{dead_letter_worker_consumer_prefetch,{prefetch}}}"
                )),
                "{terms}"
            );
            assert!(terms.starts_with("[[{rabbit,["), "{terms}");
        }
        None => {
            eprintln!("no erl here: advanced.config checked as text only");
            assert!(advanced.contains("{dead_letter_worker_publisher_confirm_timeout, 5000}"));
            assert!(advanced.trim_end().ends_with("]."));
        }
    }
}
