//! One scenario: its topology (the main one it shares, or its own), its publishers, and its
//! two passes, a saturating one for throughput and hops, then a paced one for lateness; the
//! `ScenarioResult` and the progress line made of them.

use std::collections::BTreeMap;

use amqp_delay::time::compact_duration;
use amqp_delay::{Layout, Precision, Result};

use super::Bench;
use super::app::Sender;
use super::measure::RunOutcome;
use super::stage::Path;
use crate::config::{
    BenchConfig, GATEWAY_DELAYS_MS, GATEWAY_LONG_DELAYS_MS, MIX_FIXED_SHARE, MIX_REAL_MAX_MS,
    Scenario,
};
use crate::hops::{delays_for, mix_avg_hops, real_layout};
use crate::report::{ScenarioResult, SustainedResult, describe_precision, round1, round3};

impl Bench<'_> {
    /// Raw: publish with a confirm into one plain queue and consume, the ceiling the delayed
    /// scenarios are measured against.
    async fn raw(&mut self, main: &Layout) -> Result<ScenarioResult> {
        let url = self.cfg.settings.url.clone();
        let pubs = self
            .publishers(main, self.cfg.settings.precision, &url)
            .await?;
        let r = self
            .scenario(
                Scenario::Raw,
                &pubs.pubs,
                Some(main),
                Precision::EXACT,
                None,
                &Path::Raw,
            )
            .await;
        pubs.close().await;
        let mut r = r?;
        r.ratio_to_raw = Some(1.0);
        r.precision = "n/a".into();
        Ok(r)
    }

    /// The scenarios `cfg` asks for that share the main topology's tiers: raw first, then the
    /// delayed ones, unbatched through the tiers, batched to the library's worker or through the
    /// relay. Declares the topology, checks it empty after and deletes it. Returns raw's result.
    pub(super) async fn on_main_topology(
        &mut self,
        main: &Layout,
        main_nofixed: &Layout,
        scenarios: &mut BTreeMap<String, ScenarioResult>,
    ) -> Result<Option<ScenarioResult>> {
        let cfg = self.cfg;
        self.declare(main).await?;
        let mut raw = None;
        if cfg.scenarios.contains(&Scenario::Raw) {
            raw = Some(self.raw(main).await?);
        }
        let raw_rate = raw.as_ref().map(|r| r.msgs_per_s).filter(|&r| r > 0.0);
        let worker = Path::Worker(Box::new(cfg.settings_for(main.prefix(), true)));
        let relay = Path::Relay(Box::new(cfg.settings_for(main.prefix(), true)));
        let delayed = [
            (Scenario::Fixed, main, &Path::Tiers),
            (Scenario::Uniform, main_nofixed, &Path::Tiers),
            (Scenario::Mix, main, &Path::Tiers),
            (Scenario::FixedBatched, main, &worker),
            (Scenario::UniformBatched, main_nofixed, &worker),
            (Scenario::Relay, main_nofixed, &relay),
        ];
        let precision = cfg.settings.precision;
        for (sc, layout, path) in delayed {
            if cfg.scenarios.contains(&sc) {
                let r = self.delayed(sc, layout, precision, raw_rate, path).await?;
                scenarios.insert(sc.name().to_string(), r);
            }
        }
        self.check_empty(main).await;
        self.delete(main).await?;
        Ok(raw)
    }

    /// The gateway's own topology (as `delay-publisher gateway` declares it), its settings the
    /// configuration's (the defaults unless configured): x-delay publishes to an in-process
    /// gateway. `gateway_long` has a topology of its own (its delays may be longer than
    /// `--max-delay`).
    pub(super) async fn gateway(
        &mut self,
        sc: Scenario,
        raw_rate: Option<f64>,
    ) -> Result<ScenarioResult> {
        let settings = match sc {
            Scenario::GatewayLong => self.cfg.gateway_long_settings(),
            _ => self.cfg.gateway_settings(),
        };
        let layout = settings.layout()?;
        if !self.cfg.via_proxy {
            let path = Path::Gateway(Box::new(settings.clone()), None);
            return self
                .on_own_topology(sc, &layout, settings.precision, raw_rate, &path)
                .await;
        }
        // the proxy reads the pairs of the control stream at its start: after the declare
        self.declare(&layout).await?;
        let (url, stop) = crate::amqp::start_proxy(&settings).await?;
        let path = Path::Gateway(Box::new(settings.clone()), Some(url));
        let r = self
            .delayed(sc, &layout, settings.precision, raw_rate, &path)
            .await;
        let _ = stop.send(());
        let r = r?;
        self.check_empty(&layout).await;
        self.delete(&layout).await?;
        Ok(r)
    }

    /// A scenario on a topology of its own: declared, run, checked empty, deleted.
    pub(super) async fn on_own_topology(
        &mut self,
        sc: Scenario,
        layout: &Layout,
        precision: Precision,
        raw_rate: Option<f64>,
        path: &Path,
    ) -> Result<ScenarioResult> {
        self.declare(layout).await?;
        let r = self.delayed(sc, layout, precision, raw_rate, path).await?;
        self.check_empty(layout).await;
        self.delete(layout).await?;
        Ok(r)
    }

    /// Saturating run, then the rate-limited lateness run (at `--rate`, else half the
    /// saturating rate, for `--lateness-secs`), each with its own destination queue; with
    /// `--sustained`, the search for the highest steady rate on time.
    pub(super) async fn scenario(
        &mut self,
        sc: Scenario,
        pubs: &[Sender],
        layout: Option<&Layout>,
        precision: Precision,
        raw_rate: Option<f64>,
        path: &Path,
    ) -> Result<ScenarioResult> {
        let cfg = self.cfg;
        let mut passes = self.passes(sc, pubs, path).await?;
        if cfg.sustained {
            passes.sustained = Some(self.sustained(sc, pubs, path, &passes.sat).await?);
        }
        let real_scale = real_scale_avg_hops(cfg, sc);
        let result = passes.result(
            description(cfg, sc),
            layout,
            &precision,
            raw_rate,
            real_scale,
        );
        self.progress.note(&passes.summary(&result));
        Ok(result)
    }

    /// The saturating pass and the paced lateness pass of `sc`.
    async fn passes(&mut self, sc: Scenario, pubs: &[Sender], path: &Path) -> Result<Passes> {
        let cfg = self.cfg;
        let prefix = &cfg.settings.prefix;
        let raw = sc == Scenario::Raw;
        let n = if sc.batched() {
            cfg.batched_messages
        } else {
            cfg.messages
        };
        let delays = (!raw).then(|| delays_for(sc, cfg, n, cfg.seed));
        let sat = self
            .run_once(
                &format!("{} saturating", sc.name()),
                &format!("{prefix}.{}.sat", sc.name()),
                pubs,
                delays.as_deref(),
                n,
                None,
                path,
            )
            .await?;
        let rate = cfg.rate.unwrap_or(sat.msgs_per_s() / 2.0).max(1.0);
        let n_lat = self.lateness_count(rate);
        let delays_lat = (!raw).then(|| delays_for(sc, cfg, n_lat, cfg.seed + 1));
        let lat = self
            .run_once(
                &format!("{} @ {rate:.0}/s", sc.name()),
                &format!("{prefix}.{}.lat", sc.name()),
                pubs,
                delays_lat.as_deref(),
                n_lat,
                Some(rate),
                path,
            )
            .await?;
        Ok(Passes {
            sc,
            n,
            sat,
            n_lat,
            lat,
            rate,
            sustained: None,
        })
    }

    fn lateness_count(&self, rate: f64) -> usize {
        ((rate * self.cfg.lateness_secs).ceil() as usize).max(1)
    }

    /// A delayed scenario with its own publishers.
    async fn delayed(
        &mut self,
        sc: Scenario,
        layout: &Layout,
        precision: Precision,
        raw_rate: Option<f64>,
        path: &Path,
    ) -> Result<ScenarioResult> {
        let url = match path {
            Path::Gateway(_, Some(proxy)) => proxy.clone(),
            _ => self.cfg.settings.url.clone(),
        };
        let pubs = self.publishers(layout, precision, &url).await?;
        let r = self
            .scenario(sc, &pubs.pubs, Some(layout), precision, raw_rate, path)
            .await;
        pubs.close().await;
        r
    }
}

/// The two passes of a scenario: `n` messages saturating, then `n_lat` at `rate`; and the
/// sustained-rate search when there was one.
struct Passes {
    sc: Scenario,
    n: usize,
    sat: RunOutcome,
    n_lat: usize,
    lat: RunOutcome,
    rate: f64,
    sustained: Option<SustainedResult>,
}

impl Passes {
    /// The scenario's numbers: throughput and hops from the saturating pass, lateness from
    /// the paced one, losses, duplicates, publish errors and early messages from both.
    fn result(
        &self,
        description: String,
        layout: Option<&Layout>,
        precision: &Precision,
        raw_rate: Option<f64>,
        real_scale_avg_hops: Option<f64>,
    ) -> ScenarioResult {
        let (sc, sat, lat) = (self.sc, &self.sat, &self.lat);
        let measured = sat.msgs_per_s();
        let ok_n = (self.n - sat.publish_errors).max(1) as f64;
        let ok_lat = (self.n_lat - lat.publish_errors).max(1) as f64;
        let per_msg = |r: &RunOutcome| r.broker_msgs_per_msg_of(sc);
        // an application's tiers, if any, are in the proxy's process: not counted here
        let counted = sc != Scenario::Raw && !sc.app();
        // raw's own sustained rate is measured against its saturating rate
        let baseline = if sc == Scenario::Raw {
            Some(measured).filter(|&m| m > 0.0)
        } else {
            raw_rate
        };
        let sustained = self.sustained.clone().map(|mut st| {
            st.ratio_to_raw = st.msgs_per_s.zip(baseline).map(|(s, r)| round3(s / r));
            st
        });
        ScenarioResult {
            description,
            radix: layout.map(Layout::radix),
            unit_ms: layout.map(Layout::unit_ms),
            precision: describe_precision(precision),
            messages: self.n,
            msgs_per_s: round1(measured),
            ratio_to_raw: raw_rate.map(|r| round3(measured / r)),
            avg_hops: round3(sat.hops_sum as f64 / ok_n),
            lateness_avg_hops: round3(lat.hops_sum as f64 / ok_lat),
            // a batch member, a relayed or a gateway's message carries no `x-death` of its own
            observed_avg_hops: (!sc.batched())
                .then(|| round3(sat.observed_hops as f64 / sat.unique.max(1) as f64)),
            broker_msgs_per_msg: per_msg(sat).filter(|_| !sc.app()).map(round3),
            lateness_broker_msgs_per_msg: per_msg(lat).filter(|_| !sc.app()).map(round3),
            tiers_share: counted.then(|| sat.tiers_share().map(round3)).flatten(),
            lateness_tiers_share: counted.then(|| lat.tiers_share().map(round3)).flatten(),
            lateness_messages: self.n_lat,
            lateness_release_lag_ms: lat.release_lag_ms,
            real_scale_avg_hops: real_scale_avg_hops.map(round3),
            e2e_s: round3(sat.e2e_s),
            publish_s: round3(sat.publish_s),
            publish_msgs_per_s: round1(sat.publish_msgs_per_s()),
            backlog_p50_ms: sat.lateness.summary().p50,
            delay_bound: sc != Scenario::Raw && sat.delay_bound(),
            lateness_ms: lat.lateness.summary(),
            lateness_from_first_ms: lat.lateness.summary_from_first(),
            lateness_rate_msgs_per_s: round1(self.rate),
            lost: sat.lost + lat.lost,
            duplicates: sat.duplicates + lat.duplicates,
            publish_errors: sat.publish_errors + lat.publish_errors,
            early: sat.lateness.early + lat.lateness.early,
            sustained,
        }
    }

    /// The progress line for `result`.
    fn summary(&self, result: &ScenarioResult) -> String {
        let (sc, l) = (self.sc, &result.lateness_ms);
        format!(
            "{:<15} {:>8.0} msg/s{}  hops {:.2}{}  lateness @{:.0}/s min {} p50 {} p99 {} max {} ms{}",
            sc.name(),
            result.msgs_per_s,
            result
                .ratio_to_raw
                .map(|r| format!(" ({r:.2} of raw)"))
                .unwrap_or_default(),
            result.avg_hops,
            result
                .broker_msgs_per_msg
                .filter(|_| sc.batched())
                .map(|b| format!("  {b:.3} broker msgs/msg"))
                .unwrap_or_default(),
            self.rate,
            l.min,
            l.p50,
            l.p99,
            l.max,
            result
                .lateness_broker_msgs_per_msg
                .map(|b| format!(", {b:.3} broker msgs/msg"))
                .unwrap_or_default(),
        )
    }
}

/// For the mix: the hops the same mix would take at real scale (24 h, the configured fixed
/// levels; NaN when that layout cannot be built).
fn real_scale_avg_hops(cfg: &BenchConfig, sc: Scenario) -> Option<f64> {
    (sc == Scenario::Mix).then(|| {
        let real = real_layout(&cfg.settings);
        real.map_or(f64::NAN, |l| {
            mix_avg_hops(
                &l,
                &cfg.settings.precision,
                MIX_REAL_MAX_MS,
                20_000,
                cfg.seed,
            )
        })
    })
}

/// The line the report shows for scenario `sc`.
fn description(cfg: &BenchConfig, sc: Scenario) -> String {
    let max_s = compact_duration(cfg.max_delay_ms);
    let qt = cfg.settings.topology.queue_type;
    let fixed = cfg.fixed_levels();
    let fixed_name = compact_duration(fixed[0]);
    let via = if cfg.via_proxy {
        " via delay-proxy"
    } else {
        ""
    };
    match sc {
        Scenario::Raw => format!("raw: publish → one {qt} queue → consume"),
        Scenario::Fixed if cfg.fixed_shards > 1 => format!(
            "one fixed level ({fixed_name}) over {} shards",
            cfg.fixed_shards
        ),
        Scenario::Fixed => format!("one fixed level ({fixed_name})"),
        Scenario::Uniform => format!("uniform 0–{max_s}"),
        Scenario::Mix => format!(
            "mix: {:.0}% fixed [{}], {:.0}% uniform 0–{max_s}",
            MIX_FIXED_SHARE * 100.0,
            fixed
                .iter()
                .map(|&f| compact_duration(f))
                .collect::<Vec<_>>()
                .join(", "),
            (1.0 - MIX_FIXED_SHARE) * 100.0
        ),
        Scenario::FixedBatched => format!("batched: one fixed level ({fixed_name}) → worker"),
        Scenario::UniformBatched => format!("batched: uniform 0–{max_s} → worker"),
        Scenario::Relay => format!("batched: uniform 0–{max_s} → relay → {qt} queue"),
        Scenario::Binary => format!("binary cascade (radix 2, exact), uniform 0–{max_s}"),
        Scenario::Gateway => format!(
            "gateway{via}: x-delay {}–{} ms → ingress → target → {qt} queue",
            GATEWAY_DELAYS_MS.start(),
            GATEWAY_DELAYS_MS.end()
        ),
        Scenario::GatewayLong => format!(
            "gateway{via}: x-delay {}–{} ms → ingress → tiers → target → {qt} queue",
            GATEWAY_LONG_DELAYS_MS.start(),
            GATEWAY_LONG_DELAYS_MS.end()
        ),
        Scenario::Plugin => format!(
            "plugin: x-delay {}–{} ms → x-delayed-message exchange → {qt} queue",
            GATEWAY_LONG_DELAYS_MS.start(),
            GATEWAY_LONG_DELAYS_MS.end()
        ),
        Scenario::Proxy => format!(
            "delay-proxy: x-delay {}–{} ms → ingress → tiers → exchange → {qt} queue",
            GATEWAY_LONG_DELAYS_MS.start(),
            GATEWAY_LONG_DELAYS_MS.end()
        ),
    }
}
