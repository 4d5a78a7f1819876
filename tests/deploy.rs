//! The deployment files say only what the code accepts, checked without Docker or Kubernetes:
//! every compose file, Kubernetes manifest, broker configuration file and the Grafana dashboard
//! is parsed with a real parser (serde_json, yaml-rust2, erl when installed), and what they
//! name is checked against the real thing — CLI flags and subcommands against the binaries'
//! own `--help` and clap's parser, `AMQP_DELAY_*` variables and TOML files against
//! `Settings::load_with_env`, metric names against the process's registry, rabbitmq.conf keys
//! against the installed broker's schema. The last test runs `scripts/demo.sh --quick` against
//! the local broker.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use amqp_delay::Settings;
use serde_json::Value;
use yaml_rust2::{Yaml, YamlLoader};

// --- files -----------------------------------------------------------------------------------

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// A file of its own in the temp directory (removed by the caller or left for inspection).
fn temp_file(name: &str, text: &str) -> PathBuf {
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
fn yaml_docs(rel: &str) -> Vec<Value> {
    let docs = YamlLoader::load_from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    docs.iter().map(|d| to_json(d, rel)).collect()
}

fn yaml_one(rel: &str) -> Value {
    let mut d = yaml_docs(rel);
    assert_eq!(d.len(), 1, "{rel}: one document expected");
    d.remove(0)
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| s(x).to_string())
        .collect()
}

// --- the binaries' command lines ---------------------------------------------------------------

fn bin_path(name: &str) -> &'static str {
    match name {
        "delay-publisher" => env!("CARGO_BIN_EXE_delay-publisher"),
        "delay-consumer" => env!("CARGO_BIN_EXE_delay-consumer"),
        other => panic!("'{other}' is not one of our binaries (delay-publisher, delay-consumer)"),
    }
}

/// Runs one of our binaries with `args`, in an empty environment (no AMQP_* variable can
/// change what it accepts); returns (exit code, stdout + stderr).
fn run_bin(name: &str, args: &[String]) -> (i32, String) {
    let out = Command::new(bin_path(name))
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// What `--help` of a binary (or of one of its subcommands) lists.
#[derive(Clone, Debug, Default)]
struct Help {
    /// `--long` flag → takes a value
    flags: HashMap<String, bool>,
    /// `-c` short flag → takes a value
    shorts: HashMap<String, bool>,
    subcommands: BTreeSet<String>,
}

fn help(bin: &str, sub: Option<&str>) -> Help {
    static CACHE: OnceLock<Mutex<HashMap<String, Help>>> = OnceLock::new();
    let key = format!("{bin} {}", sub.unwrap_or(""));
    let cache = CACHE.get_or_init(Default::default);
    if let Some(h) = cache.lock().unwrap().get(&key) {
        return h.clone();
    }
    let mut args: Vec<String> = sub.map(|s| vec![s.to_string()]).unwrap_or_default();
    args.push("--help".into());
    let (code, text) = run_bin(bin, &args);
    assert_eq!(code, 0, "{key} --help failed:\n{text}");
    let mut h = Help::default();
    let mut in_commands = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
            continue;
        }
        if in_commands {
            if line.trim().is_empty() || !line.starts_with("  ") {
                in_commands = false;
            } else if let Some(word) = line.split_whitespace().next() {
                h.subcommands.insert(word.to_string());
            }
            continue;
        }
        let t = line.trim_start();
        if !t.starts_with('-') {
            continue;
        }
        for part in t.split(", ") {
            let mut words = part.splitn(2, ' ');
            let flag = words.next().unwrap_or_default();
            let takes_value = words.next().is_some_and(|w| w.starts_with('<'));
            if let Some(long) = flag.strip_prefix("--") {
                h.flags.insert(long.to_string(), takes_value);
            } else if let Some(short) = flag.strip_prefix('-') {
                // "-c, --config <FILE>": the value is shown after the long form
                let takes = t.contains(" <");
                h.shorts.insert(short.to_string(), takes);
            }
        }
    }
    cache.lock().unwrap().insert(key, h.clone());
    h
}

/// One invocation of our binaries as written in a deployment file, parsed the way clap
/// parses it: the subcommand, and every flag with its value.
#[derive(Debug)]
struct Invocation {
    bin: String,
    sub: Option<String>,
    flags: Vec<(String, Option<String>)>,
}

impl Invocation {
    fn value(&self, flag: &str) -> Option<&str> {
        self.flags
            .iter()
            .find(|(f, _)| f == flag)
            .and_then(|(_, v)| v.as_deref())
    }
    fn values(&self, flag: &str) -> Vec<&str> {
        self.flags
            .iter()
            .filter(|(f, _)| f == flag)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }
    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|(f, _)| f == flag)
    }
}

/// Checks `argv` (`delay-publisher ...` or `delay-consumer ...`): the binary exists, the
/// subcommand is one its `--help` lists, every flag is one that the (sub)command's `--help`
/// lists, flags that take a value have one; then clap itself parses the very same arguments
/// (with `--help` appended, so nothing connects anywhere): a value clap refuses (a bad
/// `--log-format`, a malformed `--delay`) fails here.
fn check_invocation(argv: &[String], what: &str) -> Invocation {
    let bin = argv
        .first()
        .unwrap_or_else(|| panic!("{what}: empty command"));
    let top = help(bin, None);
    let mut inv = Invocation {
        bin: bin.clone(),
        sub: None,
        flags: Vec::new(),
    };
    let mut current = top.clone();
    let mut i = 1;
    while i < argv.len() {
        let a = &argv[i];
        if let Some(long) = a.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (long.to_string(), None),
            };
            let takes = *current.flags.get(&name).unwrap_or_else(|| {
                panic!(
                    "{what}: `{}` has no flag --{name} (its --help lists: {:?})",
                    [bin.as_str(), inv.sub.as_deref().unwrap_or("")].join(" "),
                    current.flags.keys().collect::<BTreeSet<_>>()
                )
            });
            let value = if takes && inline.is_none() {
                i += 1;
                Some(
                    argv.get(i)
                        .unwrap_or_else(|| panic!("{what}: --{name} needs a value"))
                        .clone(),
                )
            } else {
                assert!(takes || inline.is_none(), "{what}: --{name} takes no value");
                inline
            };
            inv.flags.push((name, value));
        } else if a.starts_with('-') && a.len() == 2 {
            let short = &a[1..];
            let takes = *current
                .shorts
                .get(short)
                .unwrap_or_else(|| panic!("{what}: `{bin}` has no flag {a}"));
            let value = if takes {
                i += 1;
                argv.get(i).cloned()
            } else {
                None
            };
            let long = match short {
                "c" => "config",
                "q" => "queue",
                other => other,
            };
            inv.flags.push((long.to_string(), value));
        } else if inv.sub.is_none() && !top.subcommands.is_empty() {
            assert!(
                top.subcommands.contains(a),
                "{what}: `{bin}` has no subcommand '{a}' (it has {:?})",
                top.subcommands
            );
            inv.sub = Some(a.clone());
            current = help(bin, Some(a));
        } else {
            panic!("{what}: unexpected argument '{a}' for `{bin}`");
        }
        i += 1;
    }
    assert!(
        top.subcommands.is_empty() || inv.sub.is_some(),
        "{what}: `{bin}` needs a subcommand"
    );
    let mut args = argv[1..].to_vec();
    args.push("--help".into());
    let (code, text) = run_bin(bin, &args);
    assert_eq!(
        code, 0,
        "{what}: clap refuses {argv:?} (run with --help appended):\n{text}"
    );
    inv
}

/// The invocations of our binaries inside a `sh -c` script of a compose file (`$$` is
/// Compose's escape for a literal `$`).
fn script_invocations(script: &str, what: &str) -> Vec<Invocation> {
    let script = script.replace("$$", "$");
    let mut out = Vec::new();
    for line in script.lines() {
        for start in ["delay-publisher", "delay-consumer"] {
            let mut rest = line;
            while let Some(at) = rest.find(start) {
                let tail = &rest[at..];
                let end = tail.find(['|', ';', '&', ')']).unwrap_or(tail.len());
                let words = shell_words::split(&tail[..end])
                    .unwrap_or_else(|e| panic!("{what}: cannot split '{}': {e}", &tail[..end]));
                out.push(check_invocation(&words, what));
                rest = &tail[end..];
            }
        }
    }
    out
}

/// `0.0.0.0:9464` → 9464.
fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("'{addr}' is not HOST:PORT"))
}

// --- settings ------------------------------------------------------------------------------------

/// Loads settings the way the binaries do, from the optional TOML file and exactly the
/// `AMQP_DELAY_*` variables given (unknown keys are errors); AMQP_URL is checked as the URL list.
fn load_settings(toml: Option<&Path>, env: &BTreeMap<String, String>, what: &str) -> Settings {
    let mut map = HashMap::new();
    for (k, v) in env {
        if k == "AMQP_URL" {
            amqp_delay::connection::validate_urls(v)
                .unwrap_or_else(|e| panic!("{what}: AMQP_URL: {e}"));
            continue;
        }
        assert!(
            k.starts_with("AMQP_DELAY_"),
            "{what}: {k} is not a variable amqp-delay reads"
        );
        map.insert(k.clone(), v.clone());
    }
    let mut s = Settings::load_with_env(toml, Some(map))
        .unwrap_or_else(|e| panic!("{what}: the settings do not load: {e}"));
    if let Some(u) = env.get("AMQP_URL") {
        s.url = u.clone();
    }
    s
}

// --- compose -------------------------------------------------------------------------------------

const COMPOSE_FILES: [&str; 2] = ["docker-compose.yml", "deploy/compose-cluster.yml"];

/// The RabbitMQ image everything uses (compose files and the RabbitmqCluster): 4.x, with the
/// management plugin (`stats`, `teardown` and the tier-depth metrics read its API).
fn assert_broker_image(image: &str, what: &str) {
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
        let in_url: BTreeSet<String> = amqp_delay::connection::split_urls(urls)
            .iter()
            .map(|u| url::Url::parse(u).unwrap().host_str().unwrap().to_string())
            .collect();
        assert_eq!(in_url, hosts, "{name}: AMQP_URL lists every node");
    }
}

// --- the broker's configuration ------------------------------------------------------------------

/// `key = value` lines of a rabbitmq.conf-style file, comments and blank lines left out.
fn broker_conf_text(text: &str, what: &str) -> BTreeMap<String, String> {
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

fn broker_conf(rel: &str) -> BTreeMap<String, String> {
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
fn erl_terms(text: &str) -> Option<String> {
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
    // the broker's consumer_timeout is the one the workers are configured with
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

// --- Kubernetes ----------------------------------------------------------------------------------

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

fn configmap_settings() -> Settings {
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
            amqp_delay::connection::validate_urls(s(v)).unwrap_or_else(|e| panic!("{k}: {e}"));
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

// --- the image -----------------------------------------------------------------------------------

#[test]
fn the_image_is_multi_stage_small_and_not_root() {
    let d = read("Dockerfile");
    let froms: Vec<&str> = d.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(froms.len() >= 2, "a build stage and a runtime stage");
    assert!(froms.last().unwrap().contains("-slim"), "a slim runtime");
    for bin in ["delay-publisher", "delay-consumer"] {
        assert!(
            d.contains(&format!("target/release/{bin}")),
            "{bin} in the image"
        );
    }
    assert!(d.contains("--locked"), "builds what Cargo.lock says");
    assert!(d.contains("EXPOSE 9464"));
    let user = d.lines().rev().find(|l| l.starts_with("USER ")).unwrap();
    assert!(!user.contains(" 0") && !user.contains("root"), "{user}");
}

// --- metrics and the dashboard -------------------------------------------------------------------

/// Every sample name of the registry (each family touched once) → its label names.
fn registry_samples() -> BTreeMap<String, BTreeSet<String>> {
    use amqp_delay::metrics::{Metrics, TierLabel, global};
    let m = global();
    let q = Metrics::queue("q");
    let _ = m.delivered.get_or_create(&q);
    let _ = m.executed.get_or_create(&q);
    let _ = m.retried.get_or_create(&q);
    let _ = m.cancelled.get_or_create(&q);
    let _ = m.lateness.get_or_create(&q);
    let _ = m.handler_duration.get_or_create(&q);
    m.park("q", "permanent");
    let _ = m.tier_messages.get_or_create(&TierLabel {
        queue: "q".into(),
        kind: "cascade".into(),
    });
    let _ = m.tier_dead_lettered.get_or_create(&TierLabel {
        queue: "q".into(),
        kind: "cascade".into(),
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

// --- least privilege -----------------------------------------------------------------------------

#[test]
fn the_permission_script_prints_the_documented_sets() {
    let out = Command::new("bash")
        .arg(root().join("deploy/rabbitmq/permissions.sh"))
        .args(["--prefix", "p", "--queue", "q", "--gateway", "i:t"])
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
        format!("set_permissions -p / p-publisher '^$' '^({tiers}|amq\\.default)$' '^$'"),
        format!(
            "set_permissions -p / p-worker '^$' '^(amq\\.default|{tiers})$' '^(q|p\\.control)$'"
        ),
        format!(
            "set_permissions -p / p-gateway '^$' '^(amq\\.default|i|t|p\\.(gw\\..*|parking)|{tiers})$' '^(i|p\\.gw\\..*|p\\.control)$'"
        ),
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
