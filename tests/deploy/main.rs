//! The deployment files say only what the code accepts, checked without Docker or Kubernetes:
//! every compose file, Kubernetes manifest, broker configuration file and the Grafana dashboard
//! is parsed with a real parser (serde_json, yaml-rust2, erl when installed), and what they
//! name is checked against the real thing — CLI flags and subcommands against the binaries'
//! own `--help` and clap's parser, `AMQP_DELAY_*` variables and TOML files against
//! `Settings::load_with_env`, metric names against the process's registry, rabbitmq.conf keys
//! against the installed broker's schema. The last test runs `scripts/demo.sh --quick` against
//! the local broker.
//!
//! One test binary, a module per kind of file; the helpers they share (files, YAML) are here.

mod broker_conf;
mod cli;
mod compose;
mod image;
mod k8s;
mod metrics;
mod scripts;

use std::path::PathBuf;

use serde_json::Value;
use yaml_rust2::{Yaml, YamlLoader};

// --- files -----------------------------------------------------------------------------------

pub(crate) fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

pub(crate) fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// A file of its own in the temp directory (removed by the caller or left for inspection).
pub(crate) fn temp_file(name: &str, text: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = std::env::temp_dir().join(format!(
        "amqp-delay-deploy-{}-{n}-{name}",
        std::process::id()
    ));
    std::fs::write(&p, text).unwrap();
    p
}

// --- YAML ------------------------------------------------------------------------------------

/// YAML → JSON values. Anchors are already resolved by the loader; merge keys (`<<: *anchor`,
/// which Compose uses) are applied here, explicit keys winning.
fn to_json(y: &Yaml, what: &str) -> Value {
    match y {
        Yaml::Real(s) => Value::from(s.parse::<f64>().unwrap_or_else(|_| panic!("{what}: {s}"))),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::String(s) => Value::from(s.clone()),
        Yaml::Boolean(b) => Value::from(*b),
        Yaml::Null => Value::Null,
        Yaml::Array(a) => Value::Array(a.iter().map(|v| to_json(v, what)).collect()),
        Yaml::Hash(h) => {
            let mut out = serde_json::Map::new();
            let mut merged = serde_json::Map::new();
            for (k, v) in h {
                let key = match k {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    other => panic!("{what}: unexpected mapping key {other:?}"),
                };
                if key == "<<" {
                    let sources = match to_json(v, what) {
                        Value::Array(a) => a,
                        one => vec![one],
                    };
                    for s in sources {
                        let Value::Object(m) = s else {
                            panic!("{what}: a merge key must name a mapping")
                        };
                        for (k, v) in m {
                            merged.entry(k).or_insert(v);
                        }
                    }
                } else {
                    assert!(
                        out.insert(key.clone(), to_json(v, what)).is_none(),
                        "{what}: key '{key}' appears twice"
                    );
                }
            }
            for (k, v) in merged {
                out.entry(k).or_insert(v);
            }
            Value::Object(out)
        }
        Yaml::Alias(_) | Yaml::BadValue => panic!("{what}: unresolved alias or bad value"),
    }
}

/// Every document of a YAML file, as JSON.
pub(crate) fn yaml_docs(rel: &str) -> Vec<Value> {
    let docs = YamlLoader::load_from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    docs.iter().map(|d| to_json(d, rel)).collect()
}

pub(crate) fn yaml_one(rel: &str) -> Value {
    let mut d = yaml_docs(rel);
    assert_eq!(d.len(), 1, "{rel}: one document expected");
    d.remove(0)
}

pub(crate) fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}"))
}

pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| s(x).to_string())
        .collect()
}
