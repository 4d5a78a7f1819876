//! The Kubernetes manifests: what they run, the ConfigMap's settings, the RabbitmqCluster's
//! broker settings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use amqp_delay::Settings;
use serde_json::Value;

use crate::broker_conf::{broker_conf, broker_conf_text, erl_terms};
use crate::cli::{check_invocation, load_settings, port_of};
use crate::compose::assert_broker_image;
use crate::{read, root, s, strings, temp_file, yaml_docs, yaml_one};

fn manifests() -> Vec<(String, Value)> {
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .to_string();
        for d in yaml_docs(&rel) {
            if d.is_null() {
                continue;
            }
            assert!(d["apiVersion"].is_string(), "{rel}: apiVersion");
            assert!(d["kind"].is_string(), "{rel}: kind");
            out.push((rel.clone(), d));
        }
    }
    out
}

fn object<'a>(all: &'a [(String, Value)], kind: &str, name: &str) -> &'a Value {
    all.iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes"))
}

fn configmap_toml() -> PathBuf {
    let all = manifests();
    let cm = object(&all, "ConfigMap", "amqp-delay-config");
    temp_file("amqp-delay.toml", s(&cm["data"]["amqp-delay.toml"]))
}

pub(crate) fn configmap_settings() -> Settings {
    let path = configmap_toml();
    let s = load_settings(
        Some(&path),
        &BTreeMap::new(),
        "the ConfigMap's amqp-delay.toml",
    );
    let _ = std::fs::remove_file(path);
    s
}

#[test]
fn every_config_file_loads_with_the_real_loader() {
    let example = "deploy/amqp-delay.toml";
    load_settings(Some(&root().join(example)), &BTreeMap::new(), example);
    let s = configmap_settings();
    assert!(!s.consumer.routes.is_empty(), "the workers need a route");
    assert!(!s.gateway.pairs.is_empty(), "the gateways need a pair");
}

#[test]
fn kubernetes_manifests_run_what_the_code_accepts() {
    let all = manifests();
    let settings = configmap_settings();
    let toml = configmap_toml();
    let route_queues: BTreeSet<&str> = settings
        .consumer
        .routes
        .iter()
        .map(|r| r.queue.as_str())
        .collect();

    // kustomization names files that exist
    let k = yaml_one("deploy/kubernetes/kustomization.yaml");
    for r in strings(&k["resources"]) {
        assert!(
            root().join("deploy/kubernetes").join(&r).exists(),
            "kustomization: {r}"
        );
    }
    let secret = object(&all, "Secret", "amqp-delay-broker");
    let secret_data = secret["stringData"].as_object().unwrap();
    let dockerfile = read("Dockerfile");
    let image_user = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the Dockerfile sets USER")
        .split(':')
        .next()
        .unwrap()
        .trim()
        .parse::<i64>()
        .expect("a numeric USER");
    assert_ne!(image_user, 0);

    let mut declared_queues = BTreeSet::new();
    let mut declared_pairs = false;
    for (file, d) in &all {
        let kind = s(&d["kind"]);
        if kind != "Deployment" && kind != "Job" {
            continue;
        }
        let name = s(&d["metadata"]["name"]);
        let pod = &d["spec"]["template"]["spec"];
        let what = format!("{file}: {kind} {name}");
        assert_eq!(
            pod["securityContext"]["runAsNonRoot"], true,
            "{what}: runAsNonRoot"
        );
        assert_eq!(
            pod["securityContext"]["runAsUser"].as_i64(),
            Some(image_user),
            "{what}: the Dockerfile's user"
        );
        let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
        let containers: Vec<&Value> = pod["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(pod["containers"].as_array().unwrap())
            .collect();
        for c in containers {
            let what = format!("{what}, container {}", s(&c["name"]));
            assert!(
                s(&c["image"]).starts_with("amqp-delay:"),
                "{what}: our image"
            );
            for r in ["cpu", "memory"] {
                assert!(
                    c["resources"]["requests"][r].is_string(),
                    "{what}: resources.requests.{r}"
                );
            }
            // environment: AMQP_URL from the Secret, AMQP_DELAY_* from literals
            let mut env = BTreeMap::new();
            for e in c["env"].as_array().into_iter().flatten() {
                let var = s(&e["name"]).to_string();
                let value = if let Some(v) = e.get("value") {
                    s(v).to_string()
                } else {
                    let r = &e["valueFrom"]["secretKeyRef"];
                    assert_eq!(s(&r["name"]), "amqp-delay-broker", "{what}: {var}");
                    let key = s(&r["key"]);
                    s(secret_data
                        .get(key)
                        .unwrap_or_else(|| panic!("{what}: the Secret has no key {key}")))
                    .to_string()
                };
                env.insert(var, value);
            }
            assert!(env.contains_key("AMQP_URL"), "{what}: AMQP_URL");
            let mut argv = strings(&c["command"]);
            argv.extend(strings(&c["args"]));
            let inv = check_invocation(&argv, &what);
            // --config names the ConfigMap's file where it is mounted
            let config = inv.value("config").expect("--config");
            let (dir, file) = config.rsplit_once('/').unwrap();
            let mount = c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| s(&m["mountPath"]) == dir)
                .unwrap_or_else(|| panic!("{what}: nothing mounted at {dir}"));
            let volume = volumes
                .iter()
                .find(|v| v["name"] == mount["name"])
                .unwrap_or_else(|| panic!("{what}: no volume {}", mount["name"]));
            assert_eq!(s(&volume["configMap"]["name"]), "amqp-delay-config");
            assert_eq!(file, "amqp-delay.toml");
            load_settings(Some(&toml), &env, &what);
            match (inv.bin.as_str(), inv.sub.as_deref()) {
                ("delay-publisher", Some("declare")) => {
                    assert!(inv.has("worker"), "{what}: declare --worker");
                    declared_queues.extend(inv.values("queue").into_iter().map(String::from));
                }
                ("delay-publisher", Some("gateway")) if inv.has("declare-only") => {
                    declared_pairs = true;
                }
                _ => {
                    assert_eq!(kind, "Deployment", "{what}: long-running");
                    let addr = inv.value("metrics-addr").expect("--metrics-addr");
                    let port = port_of(addr);
                    let named = c["ports"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|p| p["containerPort"].as_i64() == Some(port.into()))
                        .unwrap_or_else(|| panic!("{what}: port {port} is not a containerPort"));
                    for (probe, path) in
                        [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]
                    {
                        let get = &c[probe]["httpGet"];
                        assert_eq!(s(&get["path"]), path, "{what}: {probe}");
                        assert!(
                            get["port"] == named["name"]
                                || get["port"].as_i64() == Some(port.into()),
                            "{what}: {probe} asks another port"
                        );
                    }
                    let grace = pod["terminationGracePeriodSeconds"]
                        .as_u64()
                        .expect("terminationGracePeriodSeconds");
                    assert!(
                        grace * 1000 > settings.consumer.shutdown_grace.as_millis(),
                        "{what}: the pod is killed before consumer.shutdown_grace ends"
                    );
                    assert_eq!(
                        inv.value("log-format"),
                        Some("json"),
                        "{what}: JSON logs for the collector"
                    );
                }
            }
        }
    }
    for q in &route_queues {
        assert!(
            declared_queues.contains(*q),
            "the declare Job does not declare the route queue {q} with --worker"
        );
    }
    assert!(declared_pairs, "the declare Job declares the gateway pairs");
    let _ = std::fs::remove_file(toml);

    // KEDA scales the worker Deployment on a route's queue, counting unacked messages too
    let so = object(&all, "ScaledObject", "amqp-delay-worker");
    let target = s(&so["spec"]["scaleTargetRef"]["name"]);
    let worker = object(&all, "Deployment", target);
    assert!(
        worker["spec"].get("replicas").is_none(),
        "KEDA owns the worker's replica count: leave spec.replicas out"
    );
    assert!(so["spec"]["minReplicaCount"].as_i64().unwrap() >= 1);
    let triggers = so["spec"]["triggers"].as_array().unwrap();
    assert_eq!(triggers.len(), 1);
    let t = &triggers[0];
    assert_eq!(s(&t["type"]), "rabbitmq");
    let m = &t["metadata"];
    assert!(
        route_queues.contains(s(&m["queueName"])),
        "KEDA watches a route's queue"
    );
    assert_eq!(s(&m["mode"]), "QueueLength");
    assert_eq!(
        s(&m["protocol"]),
        "http",
        "over amqp KEDA sees only ready messages"
    );
    let value: u64 = s(&m["value"]).parse().unwrap();
    assert!(
        value >= u64::from(settings.consumer.prefetch),
        "a target below one prefetch window scales on work already in hand"
    );
    let auth = object(
        &all,
        "TriggerAuthentication",
        s(&t["authenticationRef"]["name"]),
    );
    for r in auth["spec"]["secretTargetRef"].as_array().unwrap() {
        assert_eq!(s(&r["name"]), "amqp-delay-broker");
        let key = s(&r["key"]);
        let host = s(&secret_data[key]);
        assert!(
            host.starts_with("http"),
            "protocol http needs the management API: {host}"
        );
    }
    for (k, v) in secret_data {
        if k.ends_with("-url") {
            amqp_delay::ops::connection::validate_urls(s(v)).unwrap_or_else(|e| panic!("{k}: {e}"));
        }
    }
}

#[test]
fn the_rabbitmq_cluster_has_the_broker_settings() {
    let all = manifests();
    let c = object(&all, "RabbitmqCluster", "amqp-delay-rabbitmq");
    assert_eq!(s(&c["apiVersion"]), "rabbitmq.com/v1beta1");
    assert_eq!(c["spec"]["replicas"].as_i64(), Some(3));
    assert_broker_image(s(&c["spec"]["image"]), "rabbitmq-cluster.yaml");
    // the operator's CRD limits these fields to 2000 and 100000 characters
    assert!(s(&c["spec"]["rabbitmq"]["additionalConfig"]).len() <= 2000);
    assert!(s(&c["spec"]["rabbitmq"]["advancedConfig"]).len() <= 100_000);
    let extra = broker_conf_text(
        s(&c["spec"]["rabbitmq"]["additionalConfig"]),
        "additionalConfig",
    );
    assert_eq!(extra, broker_conf("deploy/rabbitmq/rabbitmq.conf"));
    let advanced = s(&c["spec"]["rabbitmq"]["advancedConfig"]);
    match (
        erl_terms(advanced),
        erl_terms(&read("deploy/rabbitmq/advanced.config")),
    ) {
        (Some(a), Some(b)) => assert_eq!(a, b, "advancedConfig differs from advanced.config"),
        _ => {
            let strip = |t: &str| -> String {
                t.lines()
                    .map(|l| l.split("%%").next().unwrap())
                    .collect::<String>()
                    .split_whitespace()
                    .collect()
            };
            assert_eq!(
                strip(advanced),
                strip(&read("deploy/rabbitmq/advanced.config"))
            );
        }
    }
}
