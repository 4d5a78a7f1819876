//! Configuration: the settings structs with their defaults, loading them from a TOML file and
//! `AMQP_DELAY_*` environment variables (the `config` crate), duration parsing, and validation.
//! No broker I/O.
//!
//! Precedence, lowest first: built-in defaults, the `--config` TOML file, environment variables
//! (`AMQP_DELAY_<KEY>` at the top level, `AMQP_DELAY_<SECTION>__<KEY>` in a section, e.g.
//! `AMQP_DELAY_TOPOLOGY__RADIX=8`), then command-line flags.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

use crate::layout::{BROKER_MAX_TTL_MS, Layout, LayoutError};
use crate::planner::Precision;

/// Default broker URL.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default name prefix of every exchange and queue we create.
pub const DEFAULT_PREFIX: &str = "amqp-delay";

/// Everything configurable, as read from the config file and environment.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// AMQP URL of the broker.
    pub url: String,
    /// Prefix of every exchange and queue name we create.
    pub prefix: String,
    pub topology: TopologySettings,
    pub precision: Precision,
    pub publisher: PublisherSettings,
    pub consumer: ConsumerSettings,
    /// `x-delay` gateway pairs (`delay-publisher gateway`).
    pub gateway: crate::gateway::GatewaySettings,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            url: DEFAULT_URL.into(),
            prefix: DEFAULT_PREFIX.into(),
            topology: TopologySettings::default(),
            precision: Precision::default(),
            publisher: PublisherSettings::default(),
            consumer: ConsumerSettings::default(),
            gateway: crate::gateway::GatewaySettings::default(),
        }
    }
}

/// The shape of the tier topology. Changing any of these for an existing prefix is refused at
/// declare time (see `Topology::declare`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TopologySettings {
    /// Digits per cascade level (2..=36). Larger means fewer hops and more queues.
    pub radix: u32,
    /// Time unit of the lowest level, in milliseconds: the finest precision.
    pub unit_ms: u64,
    /// Longest accepted delay.
    pub max_delay: DurationMs,
    /// Delays that get their own one-hop tier.
    pub fixed_levels: Vec<DurationMs>,
    /// `quorum` (at-least-once dead-lettering, the default) or `classic` (at-most-once).
    pub queue_type: QueueType,
    /// Optional `x-max-length` of every tier; a full tier makes publishes fail (nack).
    pub max_tier_length: Option<u64>,
    /// Largest TTL of a single tier queue; the broker's limit unless lowered (tests lower it to
    /// exercise the overflow chain quickly).
    pub max_tier_ttl_ms: u64,
}

impl Default for TopologySettings {
    fn default() -> Self {
        TopologySettings {
            radix: 16,
            unit_ms: 1,
            max_delay: DurationMs(365 * 24 * 3_600_000),
            fixed_levels: ["30s", "5m", "30m", "24h"]
                .iter()
                .map(|s| s.parse().expect("valid default"))
                .collect(),
            queue_type: QueueType::Quorum,
            max_tier_length: None,
            max_tier_ttl_ms: BROKER_MAX_TTL_MS,
        }
    }
}

/// Queue type of tier and parking queues.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Quorum queues, `x-dead-letter-strategy=at-least-once`, `x-overflow=reject-publish`:
    /// nothing is lost on dead-lettering (duplicates are possible).
    #[default]
    Quorum,
    /// Classic queues: dead-lettering is at-most-once (a message can be lost if the broker
    /// fails while moving it between tiers).
    Classic,
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        })
    }
}

/// Publisher tuning.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PublisherSettings {
    /// Publishes awaiting their broker confirm at once (batch mode).
    pub max_in_flight: usize,
    /// Seconds a destination binding is trusted before it is re-declared (a queue deleted and
    /// re-created loses its binding; its messages are parked until the binding is renewed).
    pub binding_cache_secs: u64,
}

impl Default for PublisherSettings {
    fn default() -> Self {
        PublisherSettings {
            max_in_flight: 512,
            binding_cache_secs: 60,
        }
    }
}

/// Worker (`delay-consumer`) settings.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ConsumerSettings {
    /// Unacknowledged deliveries the broker sends ahead, per queue.
    pub prefetch: u16,
    /// Handlers running at once, over all queues.
    pub concurrency: usize,
    /// A handler running longer counts as a retryable failure.
    pub handler_timeout: DurationMs,
    /// The broker's `consumer_timeout` (30 min by default): handler_timeout must stay below it,
    /// or the broker closes the channel under a slow handler.
    pub consumer_timeout: DurationMs,
    /// On SIGTERM/SIGINT, how long in-flight handlers may finish before the worker exits
    /// (what did not finish is returned to the queue by the broker).
    pub shutdown_grace: DurationMs,
    pub retry: crate::retry::RetryPolicy,
    /// Exit code of an `exec` action that means "permanent failure: park, don't retry".
    pub permanent_exit_code: i32,
    /// Queue → action mappings for `delay-consumer` (instead of `--queue` + action flag).
    pub routes: Vec<RouteConfig>,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        ConsumerSettings {
            prefetch: 32,
            concurrency: 8,
            handler_timeout: DurationMs(5 * 60_000),
            consumer_timeout: DurationMs(30 * 60_000),
            shutdown_grace: DurationMs(30_000),
            retry: crate::retry::RetryPolicy::default(),
            permanent_exit_code: 65,
            routes: Vec::new(),
        }
    }
}

/// One queue and the action `delay-consumer` runs for its messages (exactly one of
/// `exec`, `http`, `forward`, `log`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RouteConfig {
    pub queue: String,
    /// Command line; the body on stdin, DELAY_MESSAGE_ID / DELAY_ATTEMPT / DELAY_DUE_AT set.
    pub exec: Option<String>,
    /// URL to POST the body to.
    pub http: Option<String>,
    /// `EXCHANGE[:ROUTING_KEY]` to re-publish to.
    pub forward: Option<String>,
    /// Print one JSON line per message to stdout.
    pub log: bool,
}

impl RouteConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.queue.is_empty() {
            return Err("consumer.routes: every route needs a 'queue'".into());
        }
        let n = [
            self.exec.is_some(),
            self.http.is_some(),
            self.forward.is_some(),
            self.log,
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            return Err(format!(
                "consumer.routes: queue '{}' needs exactly one action of exec, http, forward, log (has {n})",
                self.queue
            ));
        }
        Ok(())
    }
}

impl ConsumerSettings {
    pub fn validate(&self) -> Result<(), String> {
        if self.prefetch == 0 {
            return Err("consumer.prefetch must be at least 1".into());
        }
        if self.concurrency == 0 {
            return Err("consumer.concurrency must be at least 1".into());
        }
        if self.handler_timeout.as_millis() == 0 {
            return Err("consumer.handler_timeout must be positive".into());
        }
        if self.handler_timeout >= self.consumer_timeout {
            return Err(format!(
                "consumer.handler_timeout ({}) must be shorter than the broker's consumer_timeout ({}), or the broker closes the channel under a slow handler and the message is redelivered",
                self.handler_timeout, self.consumer_timeout
            ));
        }
        self.retry.validate()?;
        for r in &self.routes {
            r.validate()?;
        }
        Ok(())
    }
}

/// A duration in whole milliseconds, written as `1500` (ms), `"1500ms"`, `"30s"`, `"1m30s"`,
/// `"24h"`, `"365d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(into = "String")]
pub struct DurationMs(pub u64);

impl DurationMs {
    pub fn as_millis(self) -> u64 {
        self.0
    }
}

impl From<DurationMs> for String {
    fn from(d: DurationMs) -> String {
        d.to_string()
    }
}

impl fmt::Display for DurationMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::layout::compact_duration(self.0))
    }
}

impl FromStr for DurationMs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration_ms(s).map(DurationMs)
    }
}

impl<'de> Deserialize<'de> for DurationMs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) if n >= 0 => Ok(DurationMs(n as u64)),
            Raw::Int(n) => Err(serde::de::Error::custom(format!(
                "duration must not be negative, got {n}"
            ))),
            Raw::Str(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Parses a delay: a plain integer is milliseconds; otherwise humantime syntax (`1m30s`, `24h`,
/// `500ms`). Negative and sub-millisecond parts are errors.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty duration".into());
    }
    if t.starts_with('-') {
        return Err(format!("negative duration '{t}'"));
    }
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let d = humantime::parse_duration(t).map_err(|e| {
        format!("invalid duration '{t}': {e} (use e.g. 1500, 1500ms, 30s, 1m30s, 24h)")
    })?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!(
            "duration '{t}' has a sub-millisecond part; the finest resolution is 1 ms"
        ));
    }
    u64::try_from(d.as_millis()).map_err(|_| format!("duration '{t}' is too long"))
}

/// A settings problem, with the key and value named.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("configuration: {0}")]
    Invalid(String),
}

impl Settings {
    /// Loads defaults, then `file` (TOML) if given, then `AMQP_DELAY_*` environment variables.
    pub fn load(file: Option<&Path>) -> Result<Settings, SettingsError> {
        Self::load_with_env(file, None)
    }

    /// Like [`Settings::load`], with the environment given explicitly (for tests).
    pub fn load_with_env(
        file: Option<&Path>,
        env: Option<std::collections::HashMap<String, String>>,
    ) -> Result<Settings, SettingsError> {
        let defaults = config::Config::try_from(&Settings::default())?;
        let mut b = config::Config::builder().add_source(defaults);
        if let Some(path) = file {
            if !path.exists() {
                return Err(SettingsError::Invalid(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            b = b.add_source(
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(true),
            );
        }
        let mut envsrc = config::Environment::with_prefix("AMQP_DELAY")
            .prefix_separator("_")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("topology.fixed_levels")
            .ignore_empty(true);
        if let Some(map) = env {
            envsrc = envsrc.source(Some(map));
        }
        let cfg = b.add_source(envsrc).build()?;
        let s: Settings = cfg.try_deserialize()?;
        s.validate()?;
        Ok(s)
    }

    /// Checks everything that can be checked without a broker.
    pub fn validate(&self) -> Result<(), SettingsError> {
        self.precision.validate().map_err(SettingsError::Invalid)?;
        self.consumer.validate().map_err(SettingsError::Invalid)?;
        self.gateway.validate().map_err(SettingsError::Invalid)?;
        if self.publisher.max_in_flight == 0 {
            return Err(SettingsError::Invalid(
                "publisher.max_in_flight must be at least 1".into(),
            ));
        }
        Layout::new(&self.prefix, &self.topology)?;
        Ok(())
    }

    /// The topology layout these settings describe.
    pub fn layout(&self) -> Result<Layout, LayoutError> {
        Layout::new(&self.prefix, &self.topology)
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(s.topology, TopologySettings::default());
        assert_eq!(s.consumer.routes.len(), 2);
        assert_eq!(s.consumer.routes[0].queue, "orders.timeout");
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

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration_ms("1500"), Ok(1500));
        assert_eq!(parse_duration_ms("1m30s"), Ok(90_000));
        assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
        assert!(parse_duration_ms("-5s").unwrap_err().contains("negative"));
        assert!(
            parse_duration_ms("soon")
                .unwrap_err()
                .contains("invalid duration 'soon'")
        );
        assert!(
            parse_duration_ms("1us")
                .unwrap_err()
                .contains("sub-millisecond")
        );
    }
}
