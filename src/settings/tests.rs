//! Unit tests of the settings: loading, unknown keys, validation, the docs table.

use super::*;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

#[test]
fn deploy_example_config_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/amqp-delay.toml");
    let s = Settings::load_with_env(Some(&path), env(&[])).unwrap();
    // every value shown is the default (but the routes and pairs, which are examples)
    let defaults = Settings::default();
    assert_eq!(s.topology, defaults.topology);
    assert_eq!(s.precision, defaults.precision);
    assert_eq!(s.publisher, defaults.publisher);
    assert_eq!(s.cancel, defaults.cancel);
    assert_eq!(
        ConsumerSettings {
            routes: vec![],
            ..s.consumer.clone()
        },
        defaults.consumer
    );
    assert_eq!(s.consumer.routes.len(), 3);
    assert_eq!(s.consumer.routes[0].queue, "orders.timeout");
    assert_eq!(s.consumer.routes[2].relay.as_deref(), Some("billing.due"));
    assert_eq!(s.gateway.hold, defaults.gateway.hold);
    assert_eq!(s.gateway.pairs.len(), 1);
}

#[test]
fn the_gateway_lingers_longer_than_a_caller_and_holds_short_delays_bounded() {
    let s = Settings::load_with_env(None, env(&[])).unwrap();
    assert_eq!(s.publisher.gateway_linger(), DurationMs(100));
    assert!(s.publisher.gateway_linger() > s.publisher.batch_linger);
    assert_eq!(s.gateway.hold, DurationMs(100));
    // without grains the gateway lingers as any publisher
    let s = Settings::load_with_env(None, env(&[("AMQP_DELAY_PUBLISHER__GRAIN", "0")])).unwrap();
    assert_eq!(s.publisher.gateway_linger(), DurationMs(5));
    let s = Settings::load_with_env(None, env(&[("AMQP_DELAY_GATEWAY__BATCH_LINGER", "2s")]));
    let e = s.unwrap_err().to_string();
    assert!(e.contains("batch_linger"), "no such key: {e}");
    let s = Settings::load_with_env(None, env(&[("AMQP_DELAY_GATEWAY__HOLD", "1500ms")]));
    let e = s.unwrap_err().to_string();
    assert!(e.contains("gateway.hold must be at most 1s"), "{e}");
    let s = Settings::load_with_env(None, env(&[("AMQP_DELAY_GATEWAY__HOLD", "0")])).unwrap();
    assert_eq!(s.gateway.hold, DurationMs(0));
    let s = Settings::load_with_env(None, env(&[])).unwrap();
    assert_eq!(s.gateway.max_held, 1536);
    let s = Settings::load_with_env(None, env(&[("AMQP_DELAY_GATEWAY__MAX_HELD", "0")]));
    let e = s.unwrap_err().to_string();
    assert!(e.contains("gateway.max_held must be at least 1"), "{e}");
}

#[test]
fn the_grain_sets_its_lead_and_its_linger() {
    let s = Settings::load_with_env(None, env(&[])).unwrap();
    let p = &s.publisher;
    assert_eq!(p.grain, DurationMs(1_000));
    assert_eq!(
        (p.grain_lead(), p.grain_linger()),
        (DurationMs(200), DurationMs(100))
    );
    assert_eq!(
        p.grain(),
        Some(crate::batch::Grain {
            width_ms: 1_000,
            lead_ms: 200
        })
    );
    let at = |grain: &str| {
        Settings::load_with_env(None, env(&[("AMQP_DELAY_PUBLISHER__GRAIN", grain)]))
            .map(|s| s.publisher)
    };
    let p = at("0").unwrap();
    assert_eq!((p.grain(), p.grain_linger()), (None, DurationMs(0)));
    let p = at("50ms").unwrap();
    assert_eq!(
        (p.grain_lead(), p.grain_linger()),
        (DurationMs(10), DurationMs(5))
    );
    // a long grain: the lead grows with it, a caller's wait stops at 1 s
    let file = TempToml::new(
        "long-grain",
        "[publisher]\ngrain = \"20s\"\n[consumer]\nmax_hold = \"30s\"\n",
    );
    let p = Settings::load_with_env(Some(&file.0), env(&[]))
        .unwrap()
        .publisher;
    assert_eq!(
        (p.grain_lead(), p.grain_linger()),
        (DurationMs(4_000), DurationMs(1_000))
    );
    for bad in ["49ms", "61s"] {
        let e = at(bad).unwrap_err().to_string();
        assert!(
            e.contains("publisher.grain must be 0 (exact routes only) or between 50ms and"),
            "{bad}: {e}"
        );
    }
    // the lead counts in how early a grain batch may come
    let e = at("9s").unwrap_err().to_string();
    assert!(
        e.contains("consumer.max_hold (10s) must be longer than publisher.grain and its lead"),
        "{e}"
    );
    for gone in ["GRAIN_LEAD", "GRAIN_LINGER"] {
        let key = format!("AMQP_DELAY_PUBLISHER__{gone}");
        let e = Settings::load_with_env(None, env(&[(key.as_str(), "100ms")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&gone.to_lowercase()), "no such key: {e}");
    }
}

#[test]
fn command_line_variables_are_not_settings() {
    // AMQP_DELAY_LOG_FORMAT is read by clap; as a setting it would be an unknown field
    let s = Settings::load_with_env(
        None,
        env(&[
            ("AMQP_DELAY_LOG_FORMAT", "json"),
            ("AMQP_DELAY_TOPOLOGY__RADIX", "8"),
        ]),
    )
    .unwrap();
    assert_eq!(s.topology.radix, 8);
}

#[test]
fn environment_overrides_the_file_and_lists_split() {
    let s = Settings::load_with_env(
        None,
        env(&[
            ("AMQP_DELAY_PREFIX", "custom"),
            ("AMQP_DELAY_TOPOLOGY__RADIX", "8"),
            ("AMQP_DELAY_TOPOLOGY__FIXED_LEVELS", "30s,5m"),
            ("AMQP_DELAY_CONSUMER__RETRY__MAX_ATTEMPTS", "3"),
        ]),
    )
    .unwrap();
    assert_eq!(s.prefix, "custom");
    assert_eq!(s.topology.radix, 8);
    assert_eq!(
        s.topology.fixed_levels,
        vec![DurationMs(30_000), DurationMs(300_000)]
    );
    assert_eq!(s.consumer.retry.max_attempts, 3);
}

#[test]
fn bad_settings_are_named() {
    let e = Settings::load_with_env(None, env(&[("AMQP_DELAY_TOPOLOGY__RADIX", "1")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("radix must be between 2 and 36"), "{e}");
    let e = Settings::load_with_env(None, env(&[("AMQP_DELAY_TOPOLGY__RADIX", "8")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("topolgy"), "unknown key named: {e}");
    let e = Settings::load_with_env(
        None,
        env(&[("AMQP_DELAY_CONSUMER__HANDLER_TIMEOUT", "45m")]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("consumer_timeout"), "{e}");
    let e = Settings::load_with_env(Some(Path::new("/nonexistent.toml")), env(&[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent.toml does not exist"), "{e}");
}
/// A TOML file of `text`, unique to `name`, removed on drop.
struct TempToml(std::path::PathBuf);
impl TempToml {
    fn new(name: &str, text: &str) -> TempToml {
        let path = std::env::temp_dir().join(format!(
            "amqp-delay-settings-{name}-{}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).unwrap();
        TempToml(path)
    }
}
impl Drop for TempToml {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_key_that_is_no_setting_is_refused_by_name() {
    // the names of durations before they took a unit are no settings either
    let file = TempToml::new("old-keys", "[topology]\nunit_ms = 2\n");
    let e = Settings::load_with_env(Some(&file.0), env(&[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `unit_ms`"), "{e}");
    let e = Settings::load_with_env(
        None,
        env(&[("AMQP_DELAY_PUBLISHER__BINDING_CACHE_SECS", "90")]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("binding_cache_secs"), "{e}");
}

#[test]
fn holding_is_checked_against_the_longest_hold_and_the_prefetch() {
    let mut s = Settings::default();
    assert!(
        s.validate().is_ok(),
        "no pairs: the gateway's checks do not apply"
    );
    let e = s.validate_gateway().unwrap_err();
    assert!(e.contains("the gateway has no pair"), "{e}");
    s.gateway.pairs = vec![PairConfig {
        ingress: "i".into(),
        target: "t".into(),
        writers: Vec::new(),
    }];
    assert!(s.validate().is_ok());
    let mut short = s.clone();
    short.gateway.hold = DurationMs(1_000);
    short.consumer.max_hold = DurationMs(1_000);
    let e = short.validate().unwrap_err().to_string();
    assert!(
        e.contains("gateway.hold (1s) must be shorter than consumer.max_hold (1s)"),
        "{e}"
    );
    assert_eq!(
        short.validate_gateway().unwrap_err(),
        e.trim_start_matches("configuration: ")
    );
    short.gateway.hold = DurationMs(0);
    short.consumer.max_hold = Settings::default().consumer.max_hold;
    assert!(short.validate().is_ok(), "holding nothing needs no time");
    let mut many = s;
    many.gateway.max_held = 65_100;
    let e = many.validate().unwrap_err().to_string();
    assert!(
        e.contains(
            "consumer.io_concurrency (512) + consumer.hold_prefetch (512) + gateway.max_held (65100) must be at most 65535"
        ),
        "{e}"
    );
    many.gateway.hold = DurationMs(0);
    assert!(many.validate().is_ok(), "holding nothing needs no slots");
    // from a file: refused when loading
    let file = TempToml::new(
        "gateway",
        "[gateway]\nhold = \"1s\"\n[consumer]\nmax_hold = \"1s\"\n\
         [[gateway.pairs]]\ningress = \"i\"\ntarget = \"t\"\n",
    );
    let e = Settings::load_with_env(Some(&file.0), env(&[]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gateway.hold (1s) must be shorter than consumer.max_hold"),
        "{e}"
    );
}

/// Keys that are settings but in no table or example: they describe the broker (or are
/// lowered only by the tests), nobody tunes them.
const HIDDEN_KEYS: &[&str] = &["topology.max_tier_ttl", "consumer.consumer_timeout"];

fn flat_keys(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flat_keys(&key, v, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

#[test]
fn the_settings_table_of_operations_md_lists_every_key_and_no_other() {
    let mut keys = Vec::new();
    flat_keys(
        "",
        &serde_json::to_value(Settings::default()).unwrap(),
        &mut keys,
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPERATIONS.md");
    let text = std::fs::read_to_string(path).unwrap();
    let section = text
        .split("\n## Settings\n")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .expect("a Settings section");
    let mut documented = Vec::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let cell = row.split('|').nth(1).unwrap();
        for token in cell.split('`').skip(1).step_by(2) {
            if let Some(list) = token.strip_prefix("[[").and_then(|t| t.strip_suffix("]]")) {
                documented.push(list.to_string());
                break; // the rest are the entries' own keys
            }
            match token.split_once(".{") {
                Some((head, rest)) => {
                    for k in rest.trim_end_matches('}').split(',') {
                        documented.push(format!("{head}.{k}"));
                    }
                }
                None => documented.push(token.to_string()),
            }
        }
    }
    for k in &keys {
        let hidden = HIDDEN_KEYS.contains(&k.as_str());
        assert_eq!(
            documented.contains(k),
            !hidden,
            "docs/OPERATIONS.md's settings table and the key {k} (hidden: {hidden})"
        );
    }
    for d in &documented {
        assert!(
            keys.contains(d),
            "docs/OPERATIONS.md documents {d}, which is no setting"
        );
    }
}

#[test]
fn pair_settings_are_validated() {
    let f = |i: &[&str], t: &[&str]| {
        GatewaySettings::from_flags(
            &i.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &t.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    };
    assert_eq!(f(&["a", "b"], &["x", "y"]).unwrap().pairs.len(), 2);
    assert!(
        f(&["a"], &[])
            .unwrap_err()
            .contains("one --target per --ingress")
    );
    assert!(f(&["a"], &["a"]).unwrap_err().contains("come back"));
    assert!(f(&["a", "a"], &["x", "y"]).unwrap_err().contains("twice"));
    assert!(f(&["amq.x"], &["y"]).unwrap_err().contains("amq."));
    assert!(f(&[""], &["y"]).is_err());
}
