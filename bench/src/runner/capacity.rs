//! Capacity mode: M messages all held for the same time (in the tiers, or in batches to the
//! library's worker), the broker's memory read before the first publish, right after the last
//! and after the drain, then everything drained and counted like any pass.

use std::time::Duration;

use amqp_delay::time::compact_duration;
use amqp_delay::{Layout, Result, Topology};

use super::Bench;
use super::stage::Path;
use crate::environment::broker_memory;
use crate::report::{CapacityResult, MemoryResult, MemorySample, fmt_bytes, round1, round3};

impl Bench<'_> {
    pub(super) async fn capacity(
        &mut self,
        m: u64,
        publish_rate_hint: f64,
    ) -> Result<CapacityResult> {
        let cfg = self.cfg;
        let hold_ms = cfg
            .capacity_hold_ms
            .unwrap_or_else(|| default_hold_ms(m, publish_rate_hint));
        let layout = self.capacity_layout(hold_ms)?;
        self.progress.note(&format!(
            "capacity: {m} messages held {}",
            compact_duration(hold_ms)
        ));
        self.declare(&layout).await?;
        let pubs = self
            .publishers(&layout, self.cfg.settings.precision, &cfg.settings.url)
            .await?;
        let before = broker_memory(&cfg.settings.url).await;
        let n = usize::try_from(m).expect("capacity fits memory");
        let delays = vec![hold_ms; n];
        let queue = format!("{}.capacity", cfg.settings.prefix);
        let path = if cfg.capacity_batched {
            Path::Worker(Box::new(cfg.capacity_settings(hold_ms)))
        } else {
            Path::Tiers
        };
        let run = self.start("capacity publish", &queue, n, &path).await?;
        let published = self.publish(&run, &pubs.pubs, Some(&delays), None).await;
        let pending = self.pending(&layout).await?;
        let peak = broker_memory(&cfg.settings.url).await;
        let ok = (n - published.failed.len()) as f64;
        let publish_rate = ok / published.publish_s.max(1e-9);
        self.progress.note(&format!(
            "capacity: {ok} published at {publish_rate:.0} msg/s, {pending} pending, memory {} → {}",
            fmt_bytes(before.as_ref().map(|m| m.total)),
            fmt_bytes(peak.as_ref().map(|m| m.total)),
        ));
        self.progress.phase("capacity drain", n as u64);
        let stall = Duration::from_millis(hold_ms) + self.stall;
        let out = self.finish(run, published, stall).await?;
        self.check("capacity", &out);
        let after = broker_memory(&cfg.settings.url).await;
        pubs.close().await;
        self.delete(&layout).await?;
        let drain_s = (out.e2e_s - hold_ms as f64 / 1e3).max(1e-3);
        Ok(CapacityResult {
            batched: cfg.capacity_batched,
            messages: m,
            hold_ms,
            publish_msgs_per_s: round1(publish_rate),
            pending_at_peak: pending,
            memory: memory_result(before, peak, after, pending, ok),
            drain_s: round3(drain_s),
            drain_msgs_per_s: round1(out.unique as f64 / drain_s),
            lost: out.lost,
            duplicates: out.duplicates,
            publish_errors: out.publish_errors,
            early: out.lateness.early,
            lateness_ms: out.lateness.summary(),
        })
    }

    fn capacity_layout(&self, hold_ms: u64) -> Result<Layout> {
        Ok(self.cfg.capacity_layout(hold_ms)?)
    }

    /// Broker messages in `layout`'s queues.
    async fn pending(&self, layout: &Layout) -> Result<u64> {
        Ok(Topology::new(layout.clone())
            .stats(&self.admin)
            .await?
            .iter()
            .map(|s| s.messages)
            .sum())
    }
}

/// Long enough that the last message is published before the first one expires (at the
/// publish rate raw measured, or a guess), within 20 s and 4 h.
fn default_hold_ms(m: u64, publish_rate_hint: f64) -> u64 {
    let secs = m as f64 / publish_rate_hint.max(500.0) * 1.5 + 10.0;
    ((secs * 1000.0) as u64).clamp(20_000, 4 * 3_600_000)
}

/// The memory readings, the growth per message published (`ok` of them) while `pending` broker
/// messages held them, and the categories that grew or shrank most.
fn memory_result(
    before: Option<MemorySample>,
    peak: Option<MemorySample>,
    after: Option<MemorySample>,
    pending: u64,
    ok: f64,
) -> MemoryResult {
    let source = before
        .as_ref()
        .or(peak.as_ref())
        .map_or_else(|| "n/a".to_string(), |m| m.source.clone());
    let by_category = growth_by_category(before.as_ref(), peak.as_ref());
    let (b, p) = (before.map(|m| m.total), peak.map(|m| m.total));
    let growth = b.zip(p).map(|(b, p)| p as i64 - b as i64);
    MemoryResult {
        source,
        before_bytes: b,
        peak_bytes: p,
        growth_bytes: growth,
        // per message scheduled (a batch holds many of them)
        bytes_per_message: growth
            .filter(|_| pending > 0 && ok > 0.0)
            .map(|g| round1(g as f64 / ok)),
        after_drain_bytes: after.map(|m| m.total),
        growth_by_category: by_category.into_iter().collect(),
    }
}

/// The six categories of the breakdown whose size changed most from `before` to `peak`.
fn growth_by_category(
    before: Option<&MemorySample>,
    peak: Option<&MemorySample>,
) -> Vec<(String, i64)> {
    let mut by_category: Vec<(String, i64)> = match (before, peak) {
        (Some(b), Some(p)) => p
            .categories
            .iter()
            .map(|(k, &v)| {
                let was = b.categories.get(k).copied().unwrap_or(0);
                (k.clone(), v as i64 - was as i64)
            })
            .collect(),
        _ => Vec::new(),
    };
    by_category.sort_by_key(|(_, g)| std::cmp::Reverse(g.abs()));
    by_category.truncate(6);
    by_category
}
