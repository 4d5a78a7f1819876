//! Configuration: the settings structs with their defaults, loading them from a TOML file and
//! `AMQP_DELAY_*` environment variables (the `config` crate), duration parsing, and validation.
//! No broker I/O.
//!
//! Precedence, lowest first: built-in defaults, the `--config` TOML file, environment variables
//! (`AMQP_DELAY_<KEY>` at the top level, `AMQP_DELAY_<SECTION>__<KEY>` in a section, e.g.
//! `AMQP_DELAY_TOPOLOGY__RADIX=8`), then command-line flags.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::{Layout, LayoutError, TopologySettings};
use crate::planner::Precision;
use crate::retry::RetryPolicy;
use crate::time::DurationMs;

mod consumer;
mod gateway;

pub use consumer::{ConsumerSettings, RouteConfig};
pub use gateway::{GatewaySettings, PairConfig};

/// Default broker URL.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default name prefix of every exchange and queue we create.
pub const DEFAULT_PREFIX: &str = "amqp-delay";

/// Everything configurable, as read from the config file and environment.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// AMQP URL of the broker; several, comma-separated, are tried in turn (cluster nodes).
    pub url: String,
    /// The broker's management API, for `stats` and `teardown` to count unacknowledged
    /// messages and see queue leaders (default: derived from the first URL, port 15672).
    pub management_url: Option<String>,
    /// TLS for `amqps://` URLs: extra CA certificates, client certificate.
    pub tls: TlsSettings,
    /// Where long-running commands (worker, gateway, relay) serve `/metrics`, `/healthz` and
    /// `/readyz` (`HOST:PORT`); off when empty.
    pub metrics_addr: Option<String>,
    /// How often the tier depths are sampled into the metrics.
    pub metrics_sample: DurationMs,
    /// Prefix of every exchange and queue name we create.
    pub prefix: String,
    /// Shape of the tier topology.
    pub topology: TopologySettings,
    /// Lateness budget of the planner.
    pub precision: Precision,
    /// Publisher tuning.
    pub publisher: PublisherSettings,
    /// Worker settings.
    pub consumer: ConsumerSettings,
    /// `x-delay` gateway pairs (`delay-publisher gateway`).
    pub gateway: GatewaySettings,
    /// Cancelling scheduled messages.
    pub cancel: CancelSettings,
    /// Whose records and messages count for what (see `amqp_delay::trust`).
    pub trust: TrustSettings,
    /// The journal of what is scheduled (`amqp_delay::ops::journal`).
    pub journal: JournalSettings,
    /// The `pending` commands and `pending serve` (the tools' index of what is scheduled).
    pub pending: PendingSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            url: DEFAULT_URL.into(),
            management_url: None,
            tls: TlsSettings::default(),
            metrics_addr: None,
            metrics_sample: DurationMs(15_000),
            prefix: DEFAULT_PREFIX.into(),
            topology: TopologySettings::default(),
            precision: Precision::default(),
            publisher: PublisherSettings::default(),
            consumer: ConsumerSettings::default(),
            gateway: GatewaySettings::default(),
            cancel: CancelSettings::default(),
            trust: TrustSettings::default(),
            journal: JournalSettings::default(),
            pending: PendingSettings::default(),
        }
    }
}

/// `[pending]`: where the `pending` commands find an index, and how `pending serve` runs.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PendingSettings {
    /// A running `pending serve` the `pending` commands ask (`http://HOST:PORT`); without one
    /// they read the journal into a temporary index of their own (fine at thousands pending).
    pub index_url: Option<String>,
    /// Where `pending serve` listens (`HOST:PORT`).
    pub listen: String,
    /// The index file of `pending serve` (made, and rebuilt from the journal, when missing).
    pub index: Option<std::path::PathBuf>,
}

impl Default for PendingSettings {
    fn default() -> Self {
        PendingSettings {
            index_url: None,
            listen: "127.0.0.1:8471".into(),
            index: None,
        }
    }
}

/// The largest body the journal keeps (`journal.max_body` is at most this).
pub const MAX_KEPT_BODY: usize = 1 << 20;

/// `[journal]`: what publishers and workers record of each scheduled message in the journal
/// stream `<prefix>.journal`, which `pending` reads.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JournalSettings {
    /// Whether publishers and workers write the journal. Off, nothing is recorded and
    /// `pending` lists nothing new; scheduling works the same.
    pub enabled: bool,
    /// Whether a scheduled message's body is kept in the journal (up to `journal.max_body`):
    /// what lets `pending reschedule` move it earlier or run it now.
    pub keep_body: bool,
    /// The largest body kept, in bytes; a larger one is journaled without its body.
    pub max_body: usize,
    /// How long `pending` keeps a finished message (ran, cancelled) listed in its history: how
    /// far back "did it run?" has an answer. At most 7 days, what the journal stream keeps
    /// beyond the longest delay (its `x-max-age`, like the control stream's).
    pub history: DurationMs,
}

impl Default for JournalSettings {
    fn default() -> Self {
        JournalSettings {
            enabled: true,
            keep_body: false,
            max_body: 64 * 1024,
            history: DurationMs(7 * 24 * 3600 * 1000),
        }
    }
}

impl JournalSettings {
    /// A kept body fits one journal record with room for the rest; history is at least a
    /// minute.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_body > MAX_KEPT_BODY {
            return Err(format!(
                "journal.max_body is at most {} bytes (one journal record holds the bodies of \
                 many messages), got {}",
                MAX_KEPT_BODY, self.max_body
            ));
        }
        if !(60_000..=7 * 24 * 3600 * 1000).contains(&self.history.0) {
            return Err(format!(
                "journal.history is 1m to 7d (the journal stream keeps records 7 days beyond \
                 the longest delay), got {}",
                self.history
            ));
        }
        Ok(())
    }
}

/// Recurring schedules the admins own together, at most (`amqp_delay::recurring`); each other
/// user has `trust.max_schedules_per_user` of its own.
pub const MAX_SCHEDULES: usize = 200_000;
/// `trust.max_schedules_per_user` by default.
pub const DEFAULT_MAX_SCHEDULES_PER_USER: usize = 10_000;

/// `[trust]`: the users whose records and messages count beyond their own (the broker checks
/// every `user_id`, so a name here is who wrote it). Every process also trusts its own user.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrustSettings {
    /// Users who may cancel any message (not only their own), and whose checkpoints, ledger
    /// snapshots, gateway pairs and batch markers count: the users of `declare`, `teardown`,
    /// `gateway --declare-only` and of operators' `cancel`.
    pub admins: Vec<String>,
    /// The users of the other workers and gateways of this topology: their checkpoints and
    /// snapshots count, their copies of others' messages (retries, gateway hops) name the
    /// owner, and the gateway's due stage takes what they wrote.
    pub peers: Vec<String>,
    /// Recurring schedules one user who is no admin may have, at most: its own room, which
    /// no other tenant's schedules take (a book holds at most users × this, plus the admins'
    /// [`MAX_SCHEDULES`]).
    /// Every process reading the control stream must hold the same value.
    pub max_schedules_per_user: usize,
}

impl Default for TrustSettings {
    fn default() -> Self {
        TrustSettings {
            admins: Vec::new(),
            peers: Vec::new(),
            max_schedules_per_user: DEFAULT_MAX_SCHEDULES_PER_USER,
        }
    }
}

impl TrustSettings {
    /// Names must be user names: non-empty short strings; the per-user cap is 1 to
    /// [`MAX_SCHEDULES`].
    pub fn validate(&self) -> Result<(), String> {
        let most = MAX_SCHEDULES;
        if !(1..=most).contains(&self.max_schedules_per_user) {
            return Err(format!(
                "trust.max_schedules_per_user is 1 to {most}, got {}",
                self.max_schedules_per_user
            ));
        }
        for (key, names) in [("trust.admins", &self.admins), ("trust.peers", &self.peers)] {
            if let Some(bad) = names.iter().find(|n| n.is_empty() || n.len() > 255) {
                return Err(format!(
                    "{key} holds user names of 1 to 255 bytes, got one of {} bytes",
                    bad.len()
                ));
            }
        }
        Ok(())
    }
}

/// Cancelling scheduled messages (tombstones in the control stream).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CancelSettings {
    /// The guarantee: a cancel confirmed at least this long before the message falls due is
    /// always honoured. Every worker, gateway and relay syncs with the control stream before it
    /// runs a message due at `D` whenever its last sync started before `D − notice`.
    pub notice: DurationMs,
    /// How long after its due time a cancelled message may still arrive (retries, handler
    /// timeouts, redeliveries): its tombstone is live that long (then kept, bounded in number,
    /// for a week more; see `amqp_delay::ops::cancel`). At least the consumer's retry horizon.
    pub horizon: DurationMs,
}

impl Default for CancelSettings {
    fn default() -> Self {
        CancelSettings {
            notice: DurationMs(1_000),
            horizon: DurationMs(3_600_000),
        }
    }
}

/// TLS for `amqps://` URLs. The server's certificate is always verified: against the system's
/// CA certificates and those of `ca_file`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file of CA certificates trusted besides the system's (a private CA).
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM certificate for client-certificate authentication (with `client_key`).
    pub client_cert: Option<std::path::PathBuf>,
    /// PEM private key (PKCS#8) of `client_cert`.
    pub client_key: Option<std::path::PathBuf>,
}

impl TlsSettings {
    /// Checks that a client certificate comes with its key.
    pub fn validate(&self) -> Result<(), String> {
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(
                "tls.client_cert and tls.client_key go together: give both or neither".into(),
            );
        }
        Ok(())
    }
}

/// Publisher tuning.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PublisherSettings {
    /// Broker messages (single messages or batches) awaiting their confirm at once.
    pub max_in_flight: usize,
    /// Messages `schedule_all` (and `send --jsonl`) keeps in hand at once: the pool batches
    /// are formed from.
    pub max_pending: usize,
    /// How long a destination binding is trusted before it is re-declared (a queue deleted and
    /// re-created loses its binding; its messages are parked until the binding is renewed).
    pub binding_cache: DurationMs,
    /// Most messages in one batch; 1 turns batching off.
    pub batch_max_messages: usize,
    /// Largest batch body in bytes (RabbitMQ 4.x refuses messages over 16 MiB by default).
    pub batch_max_bytes: usize,
    /// How long a single `schedule` call may wait for concurrent calls to share its batch
    /// (never past its lateness budget); 0 = do not wait. Every publisher but the gateway's,
    /// which lingers the grain's linger instead ([`PublisherSettings::gateway_linger`]).
    pub batch_linger: DurationMs,
    /// The timing wheel's last grain: to a destination whose consumers hold early messages
    /// until they are due (ours: a worker, a relay, a gateway's due stage), messages due in
    /// the same window of this width travel through the tiers together, one batch, on a
    /// coarse route that reaches the consumer before the first of them is due; the consumer
    /// runs each at its exact due time. 0 = exact routes only (every member due within its
    /// lateness budget).
    ///
    /// It also sets how grain batches are timed: a batch is planned to reach its consumer a
    /// fifth of a grain before its first member is due (the lead: room for its route's own
    /// latency, dead-letter hops and the delivery, a few ms each on an idle broker, more under
    /// load), and while messages to a destination arrive steadily (the previous one less than
    /// `batch_linger` ago) one waits in the publisher up to a tenth of a grain (at most 1 s)
    /// for others of its window (the linger), never past its due time − the lead; a
    /// `schedule` call returns when its batch is confirmed. An occasional message waits
    /// `batch_linger` only. With the journal on, one in such a flow waits at least a twentieth
    /// of a grain (at most half the time until it is due), so that its intent shares a journal
    /// record with others (`amqp_delay::journal`).
    pub grain: DurationMs,
    /// Largest body accepted (RabbitMQ 4.x's default `max_message_size` is 16 MiB; 3.x's
    /// 128 MiB); larger is refused before anything is published.
    pub max_message_bytes: usize,
    /// After losing its connection, how long a publisher keeps trying to reconnect (with
    /// backoff, every node of `url` in turn) before a publish fails; also how long it publishes
    /// a message again that a tier without `max_tier_length` refused (nack: the tier's leader
    /// is moving).
    pub reconnect_timeout: DurationMs,
}

impl Default for PublisherSettings {
    fn default() -> Self {
        PublisherSettings {
            max_in_flight: 512,
            max_pending: 20_000,
            binding_cache: DurationMs(60_000),
            batch_max_messages: 1_000,
            batch_max_bytes: 1 << 20,
            batch_linger: DurationMs(5),
            grain: DurationMs(1_000),
            max_message_bytes: 16 << 20,
            reconnect_timeout: DurationMs(60_000),
        }
    }
}

impl PublisherSettings {
    /// Checks the bounds are usable.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_in_flight == 0 {
            return Err("publisher.max_in_flight must be at least 1".into());
        }
        if self.max_pending == 0 {
            return Err("publisher.max_pending must be at least 1".into());
        }
        if self.batch_max_messages == 0 {
            return Err("publisher.batch_max_messages must be at least 1 (1 = no batching)".into());
        }
        if !(1..=512 << 20).contains(&self.max_message_bytes) {
            return Err(format!(
                "publisher.max_message_bytes must be between 1 and 512 MiB (the broker's limit), got {}",
                self.max_message_bytes
            ));
        }
        if !(1024..=16 << 20).contains(&self.batch_max_bytes) {
            return Err(format!(
                "publisher.batch_max_bytes must be between 1 KiB and 16 MiB (RabbitMQ 4.x's default max_message_size), got {}",
                self.batch_max_bytes
            ));
        }
        if self.batch_linger.as_millis() > MAX_LINGER_MS {
            return Err(format!(
                "publisher.batch_linger must be at most {}, got {}",
                DurationMs(MAX_LINGER_MS),
                self.batch_linger
            ));
        }
        let grain = self.grain.as_millis();
        if grain != 0 && !(MIN_GRAIN_MS..=MAX_GRAIN_MS).contains(&grain) {
            return Err(format!(
                "publisher.grain must be 0 (exact routes only) or between {} and {}, got {}: a grain batch is planned to arrive a fifth of a grain before it is due, which below {} leaves no room for its route's own latency (dead-letter hops, a few ms each), and a consumer holds a grain's messages unacked, in memory",
                DurationMs(MIN_GRAIN_MS),
                DurationMs(MAX_GRAIN_MS),
                self.grain,
                DurationMs(MIN_GRAIN_MS),
            ));
        }
        Ok(())
    }

    /// The grain batches are formed with (`None`: exact routes only): `grain` wide, planned
    /// to reach their consumer [`PublisherSettings::grain_lead`] before their first member is
    /// due.
    pub fn grain(&self) -> Option<crate::batch::Grain> {
        (self.grain.as_millis() > 0).then_some(crate::batch::Grain {
            width_ms: self.grain.as_millis(),
            lead_ms: self.grain_lead().as_millis(),
        })
    }

    /// How long before its first member is due a grain batch is planned to reach its
    /// consumer: a fifth of `grain` (200 ms at the default 1 s), the room for its route's own
    /// latency.
    pub fn grain_lead(&self) -> DurationMs {
        DurationMs(self.grain.as_millis() / 5)
    }

    /// While messages to a destination arrive steadily, how long one may wait in the
    /// publisher for others of its grain window: a tenth of `grain` (100 ms at the default
    /// 1 s), at most [`MAX_LINGER_MS`] (a `schedule` call waits that long); 0 without grains.
    pub fn grain_linger(&self) -> DurationMs {
        DurationMs((self.grain.as_millis() / 10).min(MAX_LINGER_MS))
    }

    /// How long the gateway's publisher lets an ingress message wait to share a batch (never
    /// past a member's deadline): the grain's linger, or `batch_linger` without grains. Here
    /// the ingress message waits, not an application's call, so it may wait longer than a
    /// caller of `schedule`.
    pub fn gateway_linger(&self) -> DurationMs {
        if self.grain.as_millis() == 0 {
            self.batch_linger
        } else {
            self.grain_linger()
        }
    }

    /// Whether messages are batched at all.
    pub fn batching(&self) -> bool {
        self.batch_max_messages > 1
    }
}

/// Longest `publisher.grain`: its messages wait unacked in a consumer for up to a grain.
pub const MAX_GRAIN_MS: u64 = 60_000;

/// Longest a message waits in a publisher to share a batch (`publisher.batch_linger`, the
/// grain's linger): a `schedule` call returns only when its batch is confirmed.
pub const MAX_LINGER_MS: u64 = 1_000;

/// Shortest `publisher.grain` (but 0): its lead, a fifth of it (10 ms), is still room for a
/// route's own latency.
pub const MIN_GRAIN_MS: u64 = 50;

/// A settings problem, with the key and value named.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("configuration: {0}")]
    /// The file or environment could not be read or has an unknown key.
    Load(#[from] config::ConfigError),
    #[error(transparent)]
    /// The topology settings are invalid.
    Layout(#[from] LayoutError),
    #[error("configuration: {0}")]
    /// A setting has an invalid value.
    Invalid(String),
}

/// `AMQP_DELAY_*` variables that configure the command line, not [`Settings`].
pub const CLI_ONLY_VARIABLES: &[&str] = &["AMQP_DELAY_LOG_FORMAT"];

impl Settings {
    /// Loads defaults, then `file` (TOML) if given, then `AMQP_DELAY_*` environment variables.
    /// A key that is no setting (a typo, a key of another version) is an error naming it.
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
        // variables that only the command line reads (clap) are not settings
        // (vars_os: a variable that is not UTF-8 must not panic; ours are ignored if so)
        let map = env.unwrap_or_else(|| {
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .filter(|(k, _)| k.starts_with("AMQP_DELAY_"))
                .collect()
        });
        let map = map
            .into_iter()
            .filter(|(k, _)| !CLI_ONLY_VARIABLES.contains(&k.as_str()))
            .collect();
        envsrc = envsrc.source(Some(map));
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
        if !self.gateway.pairs.is_empty() {
            self.validate_gateway().map_err(SettingsError::Invalid)?;
        }
        self.publisher.validate().map_err(SettingsError::Invalid)?;
        let early = self.publisher.grain.as_millis() + self.publisher.grain_lead().as_millis();
        if early >= self.consumer.max_hold.as_millis() {
            return Err(SettingsError::Invalid(format!(
                "consumer.max_hold ({}) must be longer than publisher.grain and its lead, a fifth of it ({}): a grain batch reaches its consumer up to that early",
                self.consumer.max_hold,
                DurationMs(early)
            )));
        }
        crate::endpoints::validate_urls(&self.url).map_err(SettingsError::Invalid)?;
        self.tls.validate().map_err(SettingsError::Invalid)?;
        self.trust.validate().map_err(SettingsError::Invalid)?;
        self.journal.validate().map_err(SettingsError::Invalid)?;
        if self.cancel.notice.as_millis() == 0 {
            return Err(SettingsError::Invalid(
                "cancel.notice must be positive".into(),
            ));
        }
        let horizon = self
            .consumer
            .retry
            .horizon_ms(self.consumer.handler_timeout.as_millis());
        if self.cancel.horizon.as_millis() < horizon {
            return Err(SettingsError::Invalid(format!(
                "cancel.horizon ({}) is shorter than a cancelled message can keep arriving with these retry settings ({}): raise it, or a retried message could run after its tombstone is forgotten",
                self.cancel.horizon,
                DurationMs(horizon)
            )));
        }
        Layout::new(&self.prefix, &self.topology)?;
        Ok(())
    }

    /// Checks what a gateway needs of these settings: `gateway` itself, at least one pair, and
    /// how holding fits the consumer settings. [`Settings::validate`] runs it when the settings
    /// name pairs; `Gateway::new` always (its pairs may come from flags).
    pub fn validate_gateway(&self) -> Result<(), String> {
        let (g, c) = (&self.gateway, &self.consumer);
        g.validate()?;
        // a held message waits in the worker's hold, which takes nothing due further off than
        // consumer.max_hold
        if g.hold >= c.max_hold {
            return Err(format!(
                "gateway.hold ({}) must be shorter than consumer.max_hold ({})",
                g.hold, c.max_hold
            ));
        }
        // the gateway's prefetch: its handlers in flight plus the messages it holds
        let prefetch = c.io_concurrency + usize::from(c.hold_prefetch) + g.max_held;
        if g.hold.as_millis() > 0 && prefetch > usize::from(u16::MAX) {
            return Err(format!(
                "consumer.io_concurrency ({}) + consumer.hold_prefetch ({}) + gateway.max_held ({}) must be at most 65535: together they are the gateway's prefetch",
                c.io_concurrency, c.hold_prefetch, g.max_held
            ));
        }
        if g.pairs.is_empty() && !g.follow {
            return Err(
                "the gateway has no pair: give --ingress EXCHANGE --target EXCHANGE, or [[gateway.pairs]] in --config, or follow the pairs registered at run time (--follow-pairs)".into(),
            );
        }
        Ok(())
    }

    /// The topology layout these settings describe.
    pub fn layout(&self) -> Result<Layout, LayoutError> {
        Layout::new(&self.prefix, &self.topology)
    }
}

#[cfg(test)]
mod tests;
