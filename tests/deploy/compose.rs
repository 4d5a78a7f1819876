//! The compose files: images, commands, environment, mounts, the cluster's nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::broker_conf::broker_conf;
use crate::cli::{check_invocation, load_settings, port_of, script_invocations};
use crate::{read, root, s, strings, yaml_one};

const COMPOSE_FILES: [&str; 2] = ["docker-compose.yml", "deploy/compose-cluster.yml"];

/// The RabbitMQ image everything uses (compose files and the RabbitmqCluster): 4.x, with the
/// management plugin (`stats`, `teardown` and the tier-depth metrics read its API).
pub(crate) fn assert_broker_image(image: &str, what: &str) {
    let tag = image
        .strip_prefix("rabbitmq:")
        .unwrap_or_else(|| panic!("{what}: broker image '{image}' is not the official rabbitmq"));
    assert!(
        tag.starts_with("4.") && tag.ends_with("-management"),
        "{what}: '{image}' must be a RabbitMQ 4.x management tag"
    );
    assert_eq!(
        image,
        s(&yaml_one("docker-compose.yml")["services"]["rabbitmq"]["image"]),
        "{what}: every file uses the same RabbitMQ image"
    );
}

/// `(source, target)` of a compose bind mount, the source resolved against the file's folder.
fn bind_mounts(service: &Value, dir: &Path) -> Vec<(PathBuf, String)> {
    let Some(list) = service.get("volumes") else {
        return Vec::new();
    };
    strings(list)
        .iter()
        .filter(|v| v.starts_with('.'))
        .map(|v| {
            let mut parts = v.split(':');
            let src = dir.join(parts.next().unwrap());
            let dst = parts
                .next()
                .expect("a bind mount names its target")
                .to_string();
            assert!(
                src.exists(),
                "bind mount source {} is missing",
                src.display()
            );
            (src, dst)
        })
        .collect()
}

#[test]
fn compose_files_run_what_the_code_accepts() {
    for file in COMPOSE_FILES {
        let doc = yaml_one(file);
        let dir = root().join(file).parent().unwrap().to_path_buf();
        let services = doc["services"]
            .as_object()
            .unwrap_or_else(|| panic!("{file}: no services"));
        let names: BTreeSet<&String> = services.keys().collect();
        let mut declared = BTreeSet::new();
        let mut consumed = Vec::new();
        for (name, svc) in services {
            let what = format!("{file}: service {name}");
            let image = s(&svc["image"]);
            assert!(
                image.contains(':') && !image.ends_with(":latest"),
                "{what}: pin the image tag ({image})"
            );
            if let Some(ports) = svc.get("ports") {
                for p in ports.as_array().unwrap() {
                    // unquoted 5672:5672 is a base-60 number to YAML 1.1 parsers
                    assert!(p.is_string(), "{what}: quote the port mapping {p}");
                }
            }
            if let Some(deps) = svc.get("depends_on") {
                let deps: Vec<String> = match deps {
                    Value::Array(_) => strings(deps),
                    Value::Object(m) => m.keys().cloned().collect(),
                    other => panic!("{what}: depends_on {other}"),
                };
                for d in deps {
                    assert!(names.contains(&d), "{what}: depends on unknown service {d}");
                }
            }
            if image.starts_with("rabbitmq:") {
                check_compose_broker(svc, &dir, &what);
                continue;
            }
            if !image.starts_with("amqp-delay:") {
                continue;
            }
            // our image: built from the repository's Dockerfile
            let ctx = dir.join(s(&svc["build"]));
            assert!(
                ctx.join("Dockerfile").exists(),
                "{what}: build context {} has no Dockerfile",
                ctx.display()
            );
            let env: BTreeMap<String, String> = svc["environment"]
                .as_object()
                .unwrap_or_else(|| panic!("{what}: environment as a mapping"))
                .iter()
                .map(|(k, v)| (k.clone(), s(v).to_string()))
                .collect();
            load_settings(None, &env, &what);
            let argv = strings(&svc["command"]);
            let invocations = if argv[0] == "sh" {
                assert_eq!(argv[1], "-c", "{what}");
                assert!(
                    !argv[2].replace("$$", "").contains('$'),
                    "{what}: write $$ for a shell's $ (Compose interpolates $VAR)"
                );
                script_invocations(&argv[2], &what)
            } else {
                vec![check_invocation(&argv, &what)]
            };
            assert!(!invocations.is_empty(), "{what}: runs none of our binaries");
            for inv in invocations {
                if inv.sub.as_deref() == Some("declare") && inv.has("worker") {
                    declared.extend(inv.values("queue").into_iter().map(String::from));
                }
                if inv.bin == "delay-consumer" {
                    consumed.extend(inv.values("queue").into_iter().map(String::from));
                }
                if let Some(addr) = inv.value("metrics-addr") {
                    let port = port_of(addr);
                    assert!(
                        addr.starts_with("0.0.0.0:"),
                        "{what}: metrics must listen beyond the container"
                    );
                    let published = strings(&svc["ports"]);
                    assert!(
                        published.iter().any(|p| p.ends_with(&format!(":{port}"))),
                        "{what}: metrics port {port} is not published ({published:?})"
                    );
                }
            }
        }
        assert!(!consumed.is_empty(), "{file}: no worker");
        for q in consumed {
            assert!(
                declared.contains(&q),
                "{file}: the worker's queue {q} is never declared with --worker"
            );
        }
    }
}

fn check_compose_broker(svc: &Value, dir: &Path, what: &str) {
    assert_broker_image(s(&svc["image"]), what);
    // DESIGN rule 11: every quorum queue holds broker file handles
    let nofile = &svc["ulimits"]["nofile"];
    for k in ["soft", "hard"] {
        let n = nofile[k]
            .as_i64()
            .unwrap_or_else(|| panic!("{what}: ulimits.nofile.{k}"));
        assert!(
            n >= 65_536,
            "{what}: nofile {k} {n}: quorum queues need a real open-files limit"
        );
    }
    assert!(svc.get("healthcheck").is_some(), "{what}: no healthcheck");
    let mounts = bind_mounts(svc, dir);
    let target_of = |file: &str| {
        mounts
            .iter()
            .find(|(src, _)| src.ends_with(file))
            .map(|(_, dst)| dst.clone())
            .unwrap_or_else(|| panic!("{what}: {file} is not mounted"))
    };
    assert_eq!(
        target_of("rabbitmq/advanced.config"),
        "/etc/rabbitmq/advanced.config",
        "{what}"
    );
    let conf = target_of("rabbitmq/rabbitmq.conf");
    assert!(
        conf.starts_with("/etc/rabbitmq/conf.d/") && conf.ends_with(".conf"),
        "{what}: rabbitmq.conf goes into conf.d (keeping the image's defaults), not {conf}"
    );
}

#[test]
fn the_single_node_stack_is_what_scripts_test_sh_starts() {
    let doc = yaml_one("docker-compose.yml");
    let rabbit = &doc["services"]["rabbitmq"];
    assert!(
        strings(&rabbit["ports"]).contains(&"5672:5672".to_string()),
        "scripts/test.sh connects to localhost:5672"
    );
    let test_sh = read("scripts/test.sh");
    assert!(test_sh.contains("docker-compose.yml\" up -d rabbitmq"));
}

#[test]
fn the_cluster_nodes_know_each_other_and_the_clients_know_all_of_them() {
    let doc = yaml_one("deploy/compose-cluster.yml");
    let services = doc["services"].as_object().unwrap();
    let nodes: Vec<(&String, &Value)> = services
        .iter()
        .filter(|(_, v)| s(&v["image"]).starts_with("rabbitmq:"))
        .collect();
    assert_eq!(nodes.len(), 3, "three RabbitMQ nodes");
    let conf = broker_conf("deploy/rabbitmq/cluster.conf");
    assert_eq!(
        conf.get("cluster_formation.peer_discovery_backend")
            .map(String::as_str),
        Some("classic_config")
    );
    let listed: BTreeSet<&str> = conf
        .iter()
        .filter(|(k, _)| k.starts_with("cluster_formation.classic_config.nodes."))
        .map(|(_, v)| v.as_str())
        .collect();
    let mut cookies = BTreeSet::new();
    let mut hosts = BTreeSet::new();
    for (name, svc) in &nodes {
        let host = s(&svc["hostname"]);
        assert_eq!(host, name.as_str(), "the hostname is the service name");
        assert!(
            listed.contains(format!("rabbit@{host}").as_str()),
            "cluster.conf does not list rabbit@{host}"
        );
        cookies.insert(s(&svc["environment"]["RABBITMQ_ERLANG_COOKIE"]).to_string());
        hosts.insert(host.to_string());
        let mounts: Vec<String> = bind_mounts(svc, &root().join("deploy"))
            .into_iter()
            .map(|(_, d)| d)
            .collect();
        assert!(
            mounts.iter().any(|m| m.ends_with("cluster.conf")),
            "{name}: cluster.conf is not mounted"
        );
    }
    assert_eq!(cookies.len(), 1, "one Erlang cookie for all nodes");
    assert_eq!(listed.len(), 3);
    for (name, svc) in services {
        if !s(&svc["image"]).starts_with("amqp-delay:") {
            continue;
        }
        let urls = s(&svc["environment"]["AMQP_URL"]);
        let in_url: BTreeSet<String> = amqp_delay::ops::connection::split_urls(urls)
            .iter()
            .map(|u| url::Url::parse(u).unwrap().host_str().unwrap().to_string())
            .collect();
        assert_eq!(in_url, hosts, "{name}: AMQP_URL lists every node");
    }
}
