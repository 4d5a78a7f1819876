//! Metric names of the dashboard, the Prometheus configuration and the operations guide
//! against the process's registry.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::cli::port_of;
use crate::{read, s, strings, yaml_one};

/// Every sample name of the registry (each family touched once) → its label names.
fn registry_samples() -> BTreeMap<String, BTreeSet<String>> {
    use amqp_delay::metrics::{DueLabel, Metrics, TierLabel, global};
    let m = global();
    let q = Metrics::queue("q");
    let _ = m.delivered.get_or_create(&q);
    let _ = m.executed.get_or_create(&q);
    let _ = m.retried.get_or_create(&q);
    let _ = m.cancelled.get_or_create(&q);
    let _ = m.cancel_too_late.get_or_create(&q);
    let _ = m.untrusted_headers_removed.get_or_create(&q);
    let _ = m.lateness.get_or_create(&q);
    let _ = m.handler_duration.get_or_create(&q);
    m.park("q", "permanent");
    let _ = m.skip("control", "oversize");
    let _ = m.tier_messages.get_or_create(&TierLabel {
        queue: "q".into(),
        kind: "cascade".into(),
    });
    let _ = m.tier_dead_lettered.get_or_create(&TierLabel {
        queue: "q".into(),
        kind: "cascade".into(),
    });
    let _ = m.messages_pending.get_or_create(&DueLabel {
        due_within: "all".into(),
    });
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in m.encode().lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap();
        let name = &line[..name_end];
        let labels = out.entry(name.to_string()).or_default();
        if line[name_end..].starts_with('{') {
            let body = &line[name_end + 1..line.find('}').unwrap()];
            for pair in body.split(',') {
                if let Some((k, _)) = pair.split_once('=') {
                    labels.insert(k.to_string());
                }
            }
        }
    }
    out
}

/// Whether `name` is a sample name of the registry, or a histogram's family name.
fn exported(samples: &BTreeMap<String, BTreeSet<String>>, name: &str) -> bool {
    samples.contains_key(name)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .any(|suffix| samples.contains_key(&format!("{name}{suffix}")))
}

/// Metric names in a PromQL expression (or any text).
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("amqp_delay_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if end > "amqp_delay_".len() {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Label names a PromQL expression uses: in `{...}` matchers and `by (...)` / `without (...)`.
fn label_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (open, close) in [("{", "}"), ("by (", ")"), ("without (", ")")] {
        let mut rest = expr;
        while let Some(at) = rest.find(open) {
            let tail = &rest[at + open.len()..];
            let end = tail.find(close).unwrap();
            for part in tail[..end].split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn the_dashboard_shows_metrics_that_exist() {
    let text = read("deploy/grafana/amqp-delay.json");
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(s(&dash["uid"]), "amqp-delay");
    let vars: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| s(&v["name"]))
        .collect();
    assert!(
        vars.contains(&"datasource"),
        "imports anywhere: a data source variable"
    );
    let samples = registry_samples();
    // every name anywhere in it (descriptions too) is one we export
    for n in metric_names(&text) {
        assert!(
            exported(&samples, &n),
            "the dashboard names {n}, which is not exported"
        );
    }
    let mut all_exprs = Vec::new();
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        let title = s(&p["title"]);
        assert!(
            ids.insert(p["id"].as_i64().unwrap()),
            "panel ids are unique"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(
            s(&p["datasource"]["uid"]),
            "${datasource}",
            "{title}: uses the data source variable"
        );
        for t in p["targets"].as_array().unwrap() {
            let expr = s(&t["expr"]).to_string();
            let names = metric_names(&expr);
            assert!(
                !names.is_empty(),
                "{title}: {expr} shows none of our metrics"
            );
            let mut labels: BTreeSet<String> =
                ["instance", "job"].iter().map(|l| l.to_string()).collect();
            for n in &names {
                let l = samples.get(n).unwrap_or_else(|| {
                    panic!(
                        "{title}: {n} is not a metric amqp-delay exports ({:?})",
                        samples.keys()
                    )
                });
                labels.extend(l.iter().cloned());
            }
            for l in label_names(&expr) {
                assert!(
                    labels.contains(&l),
                    "{title}: {expr} uses the label '{l}', which {names:?} do not have"
                );
            }
            all_exprs.push(expr);
        }
    }
    // what the dashboard must show
    let joined = all_exprs.join("\n");
    for (needle, what) in [
        (
            "rate(amqp_delay_executed_total",
            "throughput per queue from rates",
        ),
        (
            "histogram_quantile(0.5, sum by (queue, le) (rate(amqp_delay_lateness_seconds_bucket",
            "lateness p50",
        ),
        (
            "histogram_quantile(0.99, sum by (queue, le) (rate(amqp_delay_lateness_seconds_bucket",
            "lateness p99",
        ),
        (
            "sum by (queue, reason) (increase(amqp_delay_parked_total",
            "parked by reason",
        ),
        ("amqp_delay_cancelled_total", "cancelled"),
        ("amqp_delay_in_flight", "in flight"),
        ("amqp_delay_tier_messages", "tier depths"),
        ("amqp_delay_messages_pending", "messages not yet due"),
        ("amqp_delay_connected", "connected"),
    ] {
        assert!(
            joined.contains(needle),
            "the dashboard does not show {what}"
        );
    }
}

#[test]
fn prometheus_and_grafana_of_the_compose_stack_point_at_the_services() {
    let compose = yaml_one("docker-compose.yml");
    let p = yaml_one("deploy/prometheus/prometheus.yml");
    let mut targets = BTreeSet::new();
    for job in p["scrape_configs"].as_array().unwrap() {
        for sc in job["static_configs"].as_array().unwrap() {
            targets.extend(strings(&sc["targets"]));
        }
    }
    for t in &targets {
        let (host, _) = t.split_once(':').unwrap();
        assert!(
            compose["services"].get(host).is_some(),
            "prometheus scrapes {t}, not a compose service"
        );
    }
    let worker = strings(&compose["services"]["worker"]["command"]).join(" ");
    let port = port_of(
        worker
            .split("--metrics-addr ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap(),
    );
    assert!(targets.contains(&format!("worker:{port}")));
    let ds = yaml_one("deploy/grafana/provisioning/datasources/prometheus.yml");
    assert_eq!(s(&ds["datasources"][0]["type"]), "prometheus");
    let dp = yaml_one("deploy/grafana/provisioning/dashboards/amqp-delay.yml");
    let path = s(&dp["providers"][0]["options"]["path"]);
    let mounted = strings(&compose["services"]["grafana"]["volumes"]);
    assert!(
        mounted
            .iter()
            .any(|m| m.contains("amqp-delay.json") && m.contains(path)),
        "the dashboard is mounted where the provider reads"
    );
}

#[test]
fn the_operations_guide_lists_every_metric() {
    let doc = read("docs/OPERATIONS.md");
    let samples = registry_samples();
    let families: BTreeSet<String> = samples
        .keys()
        .map(|n| {
            n.trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count")
                .to_string()
        })
        .collect();
    for f in &families {
        assert!(
            doc.contains(&format!("`{f}`")) || doc.contains(&format!("`{f}{{")),
            "docs/OPERATIONS.md does not list {f}"
        );
    }
    for n in metric_names(&doc) {
        assert!(
            exported(&samples, &n),
            "docs/OPERATIONS.md names {n}, which is not exported"
        );
    }
}
