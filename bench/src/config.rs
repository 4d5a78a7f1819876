//! What a run measures and with which settings: the scenarios, `BenchConfig` (defaults,
//! validation before anything is declared) and the bench layouts derived from it.

use serde::Serialize;

use amqp_delay::Layout;
use amqp_delay::TopologySettings;
use amqp_delay::settings::{Settings, SettingsError};
use amqp_delay::time::DurationMs;

/// One measured path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Scenario {
    /// Publish → one plain queue → consume: the ceiling.
    Raw,
    /// Every message on one fixed level (one hop).
    Fixed,
    /// Uniform 0–max delays through the cascade.
    Uniform,
    /// 60% on fixed levels, 40% uniform 0–max.
    Mix,
    /// Uniform 0–max through a radix-2 cascade, exact (NServiceBus-style reference).
    Binary,
    /// As `fixed`, to a destination the library's worker consumes: the publisher batches.
    #[value(name = "fixed_batched")]
    #[serde(rename = "fixed_batched")]
    FixedBatched,
    /// As `uniform`, to a destination the library's worker consumes: the publisher batches.
    #[value(name = "uniform_batched")]
    #[serde(rename = "uniform_batched")]
    UniformBatched,
    /// As `uniform_batched`, but the worker is a relay (`delay-consumer --relay`) unpacking
    /// into a plain queue that a raw consumer reads.
    Relay,
    /// Plugin-style: `x-delay` 1–100 ms to the ingress of an in-process gateway, raw consumer
    /// on a queue bound to its target exchange.
    Gateway,
    /// As `gateway` with `x-delay` 1–5,000 ms: all but the shortest delays are longer than
    /// `gateway.hold`, so the messages cross the tiers (in batches to the due stage).
    #[value(name = "gateway_long")]
    #[serde(rename = "gateway_long")]
    GatewayLong,
    /// A plugin-era application on a broker that runs the delayed-message-exchange plugin
    /// (`--plugin-url`): it declares an `x-delayed-message` exchange, binds its queue and
    /// publishes `x-delay` 1–5,000 ms to it at once; a raw consumer reads the queue.
    Plugin,
    /// The same application through a `delay-proxy` process (`--proxy-url`, else one the bench
    /// starts from the `delay-proxy` binary beside its own), which runs the gateway itself.
    Proxy,
}

impl Scenario {
    pub(crate) const ALL: [Scenario; 12] = [
        Scenario::Raw,
        Scenario::Fixed,
        Scenario::Uniform,
        Scenario::Mix,
        Scenario::Binary,
        Scenario::FixedBatched,
        Scenario::UniformBatched,
        Scenario::Relay,
        Scenario::Gateway,
        Scenario::GatewayLong,
        Scenario::Plugin,
        Scenario::Proxy,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::Raw => "raw",
            Scenario::Fixed => "fixed",
            Scenario::Uniform => "uniform",
            Scenario::Mix => "mix",
            Scenario::Binary => "binary",
            Scenario::FixedBatched => "fixed_batched",
            Scenario::UniformBatched => "uniform_batched",
            Scenario::Relay => "relay",
            Scenario::Gateway => "gateway",
            Scenario::GatewayLong => "gateway_long",
            Scenario::Plugin => "plugin",
            Scenario::Proxy => "proxy",
        }
    }

    /// Those a run without `--scenarios` measures: all but `uniform_batched`, `relay`,
    /// `gateway_long` and `proxy`, which need more messages than the default to measure the
    /// broker rather than their 5 s delays (`--batched-messages`), and a minute each, and
    /// `plugin`, which needs a broker with the plugin.
    pub(crate) fn defaults() -> Vec<Scenario> {
        Scenario::ALL
            .into_iter()
            .filter(|s| {
                !matches!(
                    s,
                    Scenario::UniformBatched
                        | Scenario::Relay
                        | Scenario::GatewayLong
                        | Scenario::Plugin
                        | Scenario::Proxy
                )
            })
            .collect()
    }

    /// A plugin-era application's: `x-delayed-message` exchanges declared and published to
    /// over plain AMQP connections (to the plugin's broker or through `delay-proxy`).
    pub(crate) fn app(self) -> bool {
        matches!(self, Scenario::Plugin | Scenario::Proxy)
    }

    /// The `x-delay` 1–5,000 ms of `gateway_long` (the same delays for a seed, so that the
    /// three paths are compared on the same messages).
    pub(crate) fn long_x_delay(self) -> bool {
        matches!(
            self,
            Scenario::GatewayLong | Scenario::Plugin | Scenario::Proxy
        )
    }

    /// Published plugin-style with `x-delay` to an in-process gateway.
    pub(crate) fn gateway(self) -> bool {
        matches!(self, Scenario::Gateway | Scenario::GatewayLong)
    }

    /// Delivered through batches (the destination is consumed by the library's worker, a relay
    /// or a gateway, which read batches; the proxy's gateway too).
    pub(crate) fn batched(self) -> bool {
        matches!(
            self,
            Scenario::FixedBatched
                | Scenario::UniformBatched
                | Scenario::Relay
                | Scenario::Gateway
                | Scenario::GatewayLong
                | Scenario::Proxy
        )
    }
}

/// Share of the realistic mix that uses a fixed level exactly.
pub(crate) const MIX_FIXED_SHARE: f64 = 0.6;
/// The `x-delay` range of the gateway scenario, in ms.
pub(crate) const GATEWAY_DELAYS_MS: std::ops::RangeInclusive<u64> = 1..=100;
/// The `x-delay` range of the `gateway_long` scenario, in ms (its topology holds at least this,
/// whatever `--max-delay`).
pub(crate) const GATEWAY_LONG_DELAYS_MS: std::ops::RangeInclusive<u64> = 1..=5_000;
/// Real-world upper bound of the mix's arbitrary delays (scaled down to `max_delay` in the run).
pub(crate) const MIX_REAL_MAX_MS: u64 = 24 * 3_600_000;

/// Everything a run needs. Build with [`BenchConfig::new`], then adjust the fields.
#[derive(Debug, Clone)]
pub(crate) struct BenchConfig {
    /// URL, the run's own prefix, the topology shape (radix, unit, queue type, tier limits),
    /// the precision policy and `publisher.max_in_flight` come from here.
    pub(crate) settings: Settings,
    /// Messages per saturating run.
    pub(crate) messages: usize,
    /// Messages per saturating run of the batched scenarios.
    pub(crate) batched_messages: usize,
    pub(crate) scenarios: Vec<Scenario>,
    /// Rate of the lateness runs (msg/s); default half of each scenario's measured capacity.
    pub(crate) rate: Option<f64>,
    /// Duration of publishing in each lateness run.
    pub(crate) lateness_secs: f64,
    /// Largest delay of the distributions (the fixed levels are 1/20, 1/5, 1/2 and 1/1 of it).
    pub(crate) max_delay_ms: u64,
    /// Consumer prefetch (per consumer channel).
    pub(crate) prefetch: u16,
    /// Publisher instances (each its own connection and channel).
    pub(crate) publishers: usize,
    /// Consumer channels on the destination queue.
    pub(crate) consumers: usize,
    pub(crate) body_bytes: usize,
    /// Capacity mode: messages to hold in the tiers.
    pub(crate) capacity: Option<u64>,
    /// How long the capacity messages wait (default: long enough to publish them all).
    pub(crate) capacity_hold_ms: Option<u64>,
    /// Capacity mode through batches, to a worker.
    pub(crate) capacity_batched: bool,
    /// Seed of the delay distributions (the same seed gives the same delays).
    pub(crate) seed: u64,
    /// How long to wait for duplicates after the last distinct message.
    pub(crate) linger_ms: u64,
    /// Investigation knob: spread the fixed scenario over this many one-hop tiers (TTLs F,
    /// F+1 ms, …) to see whether a sharded fixed level scales past one queue.
    pub(crate) fixed_shards: u32,
    /// Sustained-rate mode: search each scenario's highest steady rate whose p99 lateness
    /// stays within `objective_ms`.
    pub(crate) sustained: bool,
    /// The p99 lateness objective of the sustained-rate mode, in ms.
    pub(crate) objective_ms: u64,
    /// Seconds of publishing in each probe of the sustained-rate mode.
    pub(crate) probe_secs: f64,
    /// Probes per scenario in the sustained-rate mode (the search may stop earlier).
    pub(crate) probes: usize,
    /// The gateway scenarios publish through an in-process `delay-proxy`, to an
    /// `x-delayed-message` exchange declared through it.
    pub(crate) via_proxy: bool,
    /// The broker with the delayed-message-exchange plugin of the `plugin` scenario.
    pub(crate) plugin_url: Option<String>,
    /// A running `delay-proxy` for the `proxy` scenario (else the bench starts one).
    pub(crate) proxy_url: Option<String>,
    /// Show a progress bar on stderr.
    pub(crate) progress: bool,
    pub(crate) quick: bool,
}

impl BenchConfig {
    /// Defaults for a full run against `settings`.
    pub(crate) fn new(settings: Settings) -> Self {
        BenchConfig {
            settings,
            messages: 50_000,
            batched_messages: 50_000,
            scenarios: Scenario::defaults(),
            rate: None,
            lateness_secs: 20.0,
            max_delay_ms: 5_000,
            prefetch: 256,
            publishers: 1,
            consumers: 1,
            body_bytes: 100,
            capacity: None,
            capacity_hold_ms: None,
            capacity_batched: false,
            seed: 1,
            linger_ms: 300,
            fixed_shards: 1,
            sustained: false,
            via_proxy: false,
            plugin_url: None,
            proxy_url: None,
            objective_ms: 25,
            probe_secs: 2.0,
            probes: 5,
            progress: false,
            quick: false,
        }
    }

    /// The fixed levels of the distributions: 1/20, 1/5, 1/2 and all of `max_delay`.
    pub(crate) fn fixed_levels(&self) -> Vec<u64> {
        let m = self.max_delay_ms;
        let mut v: Vec<u64> = [m / 20, m / 5, m / 2, m]
            .into_iter()
            .filter(|&x| x > 0)
            .collect();
        v.dedup();
        v
    }

    /// The fixed levels the bench topology declares: [`BenchConfig::fixed_levels`] plus, with
    /// `fixed_shards` > 1, the extra tiers `F+1 ms, F+2 ms, …` the fixed scenario spreads over.
    fn declared_fixed_levels(&self) -> Vec<u64> {
        let mut v = self.fixed_levels();
        let f = v[0];
        v.extend((1..u64::from(self.fixed_shards)).map(|k| f + k));
        v.sort_unstable();
        v.dedup();
        v
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.messages == 0 || self.batched_messages == 0 {
            return Err("--messages and --batched-messages must be at least 1".into());
        }
        if self.max_delay_ms < 20 {
            return Err("--max-delay must be at least 20 ms".into());
        }
        if self.publishers == 0 || self.consumers == 0 || self.prefetch == 0 {
            return Err("--publishers, --consumers and --prefetch must be at least 1".into());
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(format!("--rate must be a positive number, got {r}"));
        }
        if !(self.lateness_secs.is_finite() && self.lateness_secs > 0.0) {
            return Err("--lateness-secs must be positive".into());
        }
        if self.fixed_shards == 0 || u64::from(self.fixed_shards) >= self.max_delay_ms / 20 {
            return Err("--fixed-shards must be at least 1 and below max_delay/20 ms".into());
        }
        if self.objective_ms == 0 || self.probes == 0 {
            return Err("--objective-ms and --probes must be at least 1".into());
        }
        if !(self.probe_secs.is_finite() && self.probe_secs > 0.0 && self.probe_secs <= 600.0) {
            return Err("--probe-secs must be positive and at most 600".into());
        }
        if self.capacity == Some(0) {
            return Err("--capacity must be at least 1".into());
        }
        if self.scenarios.contains(&Scenario::Plugin) && self.plugin_url.is_none() {
            return Err(
                "the plugin scenario needs --plugin-url: a broker that runs \
                        rabbitmq_delayed_message_exchange (`bash scripts/plugin-node.sh 3.10 up` \
                        starts one, amqp://guest:guest@127.0.0.1:5931/%2f)"
                    .into(),
            );
        }
        self.settings.validate().map_err(|e| e.to_string())?;
        self.main_layout(true).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn topology(&self, radix: u32, fixed: Vec<u64>, max_delay_ms: u64) -> TopologySettings {
        let t = &self.settings.topology;
        TopologySettings {
            radix,
            unit: t.unit,
            max_delay: DurationMs(max_delay_ms),
            fixed_levels: fixed.into_iter().map(DurationMs).collect(),
            fixed_shards: t.fixed_shards,
            queue_type: t.queue_type,
            max_tier_length: t.max_tier_length,
            max_tier_ttl: t.max_tier_ttl,
        }
    }

    /// `settings` for a library worker or gateway running on `layout`'s prefix and topology
    /// (one of the layouts below, built from `self.settings`).
    pub(crate) fn settings_for(&self, prefix: &str, with_fixed: bool) -> Settings {
        let fixed = if with_fixed {
            self.declared_fixed_levels()
        } else {
            Vec::new()
        };
        let mut s = self.settings.clone();
        s.prefix = prefix.to_string();
        s.topology = self.topology(self.settings.topology.radix, fixed, self.max_delay_ms);
        s
    }

    /// The layout of the gateway scenario: the main shape under `<prefix>-gw` (the gateway
    /// declares and owns it).
    pub(crate) fn gateway_settings(&self) -> Settings {
        self.settings_for(&format!("{}-gw", self.settings.prefix), false)
    }

    /// The layout of the `gateway_long` scenario: the main shape under `<prefix>-gwl`, its
    /// longest delay at least [`GATEWAY_LONG_DELAYS_MS`]'s (a longer `x-delay` is parked).
    pub(crate) fn gateway_long_settings(&self) -> Settings {
        let mut s = self.settings_for(&format!("{}-gwl", self.settings.prefix), false);
        let max = self.max_delay_ms.max(*GATEWAY_LONG_DELAYS_MS.end());
        s.topology.max_delay = DurationMs(max);
        s
    }

    /// The settings of the `proxy` scenario's `delay-proxy` (and of the topology the bench
    /// declares for it): `gateway_long`'s, under `<prefix>-px`.
    pub(crate) fn proxy_settings(&self) -> Settings {
        let mut s = self.gateway_long_settings();
        s.prefix = format!("{}-px", self.settings.prefix);
        s
    }

    /// The configured radix and unit, delays up to `max_delay`, with or without the fixed levels
    /// (both have the same cascade queues and signature, so both plan onto one declared topology).
    pub(crate) fn main_layout(&self, with_fixed: bool) -> Result<Layout, SettingsError> {
        let fixed = if with_fixed {
            self.declared_fixed_levels()
        } else {
            Vec::new()
        };
        let t = self.topology(self.settings.topology.radix, fixed, self.max_delay_ms);
        Ok(Layout::new(&self.settings.prefix, &t)?)
    }

    pub(crate) fn binary_layout(&self) -> Result<Layout, SettingsError> {
        let t = self.topology(2, Vec::new(), self.max_delay_ms);
        Ok(Layout::new(&format!("{}-r2", self.settings.prefix), &t)?)
    }

    pub(crate) fn capacity_layout(&self, hold_ms: u64) -> Result<Layout, SettingsError> {
        let s = self.capacity_settings(hold_ms);
        Ok(Layout::new(&s.prefix, &s.topology)?)
    }

    /// The settings of the capacity run's topology: one fixed level of `hold_ms`.
    pub(crate) fn capacity_settings(&self, hold_ms: u64) -> Settings {
        let mut s = self.settings.clone();
        s.prefix = format!("{}-cap", self.settings.prefix);
        s.topology = self.topology(self.settings.topology.radix, vec![hold_ms], hold_ms);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BenchConfig {
        BenchConfig::new(Settings {
            prefix: "bench-test".into(),
            ..Settings::default()
        })
    }

    #[test]
    fn layouts_share_the_prefix_rules() {
        let c = cfg();
        assert_eq!(c.fixed_levels(), vec![250, 1000, 2500, 5000]);
        assert_eq!(c.binary_layout().unwrap().prefix(), "bench-test-r2");
        assert!(c.validate().is_ok());
    }

    #[test]
    fn sustained_flags_are_checked() {
        for bad in [
            BenchConfig {
                objective_ms: 0,
                ..cfg()
            },
            BenchConfig { probes: 0, ..cfg() },
            BenchConfig {
                probe_secs: f64::NAN,
                ..cfg()
            },
            BenchConfig {
                probe_secs: 0.0,
                ..cfg()
            },
        ] {
            assert!(bad.validate().is_err());
        }
    }
}
