//! The shape of the delay topology, computed from settings without any I/O: which tier queues
//! exist, their TTLs, their names, where each one dead-letters to, and the binding patterns.
//!
//! Three kinds of tier (see docs/DESIGN.md, "The shape"):
//! * **cascade levels** `0..levels`: level `k` holds one queue per digit `d = 1..radix` with
//!   TTL `d · radix^k · unit`, and one topic exchange. The routing key carries one word per level
//!   (highest level first) followed by the destination. Digit 0 passes through an
//!   exchange-to-exchange binding to the next level down; level 0 ends in the delivery exchange.
//! * **fixed levels**: one queue per configured common delay (e.g. 30m) that dead-letters into the
//!   top of the cascade, so that delay is exactly one hop.
//! * **overflow chain**: a broker TTL is at most 2^32−1 ms, so a cascade of 1 ms units cannot
//!   reach a year. Delays beyond the cascade's range first walk `q` equal-TTL queues of a chain
//!   (each visited once), whose last element dead-letters into the top of the cascade.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::time::{DurationMs, compact_duration};

mod names;

/// The broker's limit for `x-message-ttl` (milliseconds, unsigned 32-bit).
pub const BROKER_MAX_TTL_MS: u64 = u32::MAX as u64;
/// Topic routing keys are at most 255 bytes (DESIGN rule 9).
pub const MAX_ROUTING_KEY_LEN: usize = 255;
/// Upper bound on the overflow chain, so a misconfiguration cannot create thousands of queues
/// (each quorum queue holds broker file handles: DESIGN rule 11).
pub const MAX_OVERFLOW_QUEUES: u64 = 64;
/// Digit alphabet of routing-key words (radix up to 36).
const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// The shape of the tier topology. Changing any of these for an existing prefix is refused at
/// declare time (see `Topology::declare`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TopologySettings {
    /// Digits per cascade level (2..=36). Larger means fewer hops and more queues.
    pub radix: u32,
    /// Time unit of the lowest level: the finest precision (whole milliseconds).
    pub unit: DurationMs,
    /// Longest accepted delay.
    pub max_delay: DurationMs,
    /// Delays that get their own one-hop tier.
    pub fixed_levels: Vec<DurationMs>,
    /// Queues each fixed level is spread over (publishers take turns): one quorum queue
    /// dead-letters through one broker process, so a single hot fixed level is limited by it.
    pub fixed_shards: u32,
    /// `quorum` (at-least-once dead-lettering, the default) or `classic` (at-most-once).
    pub queue_type: QueueType,
    /// Optional `x-max-length` of every tier; a full tier makes publishes fail (nack).
    pub max_tier_length: Option<u64>,
    /// Largest TTL of a single tier queue: the broker's limit ([`BROKER_MAX_TTL_MS`]). Not a
    /// setting for users (it is in no example and no table): the tests lower it to exercise the
    /// overflow chain in a second instead of 49 days.
    #[doc(hidden)]
    pub max_tier_ttl: DurationMs,
}

impl Default for TopologySettings {
    fn default() -> Self {
        TopologySettings {
            radix: 16,
            unit: DurationMs(1),
            max_delay: DurationMs(365 * 24 * 3_600_000),
            fixed_levels: ["30s", "5m", "30m", "24h"]
                .iter()
                .map(|s| s.parse().expect("valid default"))
                .collect(),
            fixed_shards: 1,
            queue_type: QueueType::Quorum,
            max_tier_length: None,
            max_tier_ttl: DurationMs(BROKER_MAX_TTL_MS),
        }
    }
}

/// Queue type of tier and parking queues.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Quorum queues, `x-dead-letter-strategy=at-least-once`, `x-overflow=reject-publish`:
    /// nothing is lost on dead-lettering (duplicates are possible; DESIGN rule 4).
    #[default]
    Quorum,
    /// Classic queues: dead-lettering is at-most-once (a message can be lost if the broker
    /// fails while moving it between tiers).
    Classic,
}

impl std::str::FromStr for QueueType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "quorum" => Ok(QueueType::Quorum),
            "classic" => Ok(QueueType::Classic),
            other => Err(format!("unknown queue type '{other}': quorum or classic")),
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        })
    }
}

/// One tier queue of the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tier {
    /// What kind of tier it is.
    pub kind: TierKind,
    /// Queue name.
    pub queue: String,
    /// Queue-level `x-message-ttl` in milliseconds.
    pub ttl_ms: u64,
    /// Exchange the queue dead-letters into (routing key kept, so the key carries the rest of
    /// the route: DESIGN rule 2).
    pub dead_letter_exchange: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
/// Which kind of tier a queue is.
pub enum TierKind {
    /// Cascade level `level`, digit `digit`.
    Cascade {
        /// Cascade level (0 = finest).
        level: u32,
        /// Digit `1..radix`.
        digit: u32,
    },
    /// Fixed level with this TTL.
    Fixed {
        /// Its TTL.
        ttl_ms: u64,
    },
    /// Element `index` (1-based) of the overflow chain.
    Overflow {
        /// 1-based index in the chain.
        index: u32,
    },
}

/// The computed topology. Cheap to clone; every name the code uses comes from here.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    prefix: String,
    radix: u32,
    unit_ms: u64,
    levels: u32,
    overflow_ttl_ms: u64,
    overflow_count: u32,
    fixed_ms: Vec<u64>,
    fixed_shards: u32,
    max_delay_ms: u64,
    queue_type: QueueType,
    max_tier_length: Option<u64>,
}

/// A configuration that cannot produce a valid topology.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid topology settings: {0}")]
pub struct LayoutError(pub String);

impl Layout {
    /// Computes the layout, validating everything the broker would otherwise reject later:
    /// the cascade gets the fewest levels that cover `max_delay` without a tier over the TTL
    /// limit, the overflow chain what lies beyond, the fixed levels their own tiers.
    pub fn new(prefix: &str, t: &TopologySettings) -> Result<Layout, LayoutError> {
        validate_prefix(prefix).map_err(LayoutError)?;
        let (radix, unit, max_ttl) = (t.radix, t.unit.as_millis(), t.max_tier_ttl.as_millis());
        validate_units(radix, unit, max_ttl)?;
        let max_delay_ms = t.max_delay.as_millis();
        let levels = cascade_levels(u64::from(radix), unit, max_ttl, max_delay_ms)?;
        let cascade_ms = cascade_range(u64::from(radix), unit, levels);
        let (overflow_ttl_ms, overflow_count) =
            overflow_chain(unit, max_ttl, cascade_ms, max_delay_ms)?;
        let fixed_ms = fixed_levels(&t.fixed_levels, max_ttl, max_delay_ms)?;
        if !(1..=16).contains(&t.fixed_shards) {
            return Err(LayoutError(format!(
                "fixed_shards must be between 1 and 16, got {}",
                t.fixed_shards
            )));
        }
        if let Some(0) = t.max_tier_length {
            return Err(LayoutError(
                "max_tier_length must be at least 1 when set".into(),
            ));
        }
        Ok(Layout {
            prefix: prefix.to_string(),
            radix,
            unit_ms: unit,
            levels,
            overflow_ttl_ms,
            overflow_count,
            fixed_ms,
            fixed_shards: t.fixed_shards,
            max_delay_ms,
            queue_type: t.queue_type,
            max_tier_length: t.max_tier_length,
        })
    }

    /// Prefix of every name.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// What every queue and exchange name under this prefix starts with: `<prefix>.`.
    pub fn namespace(&self) -> String {
        Self::namespace_of(&self.prefix)
    }
    /// [`Layout::namespace`] for a prefix alone (where no layout is at hand).
    pub fn namespace_of(prefix: &str) -> String {
        format!("{prefix}.")
    }
    /// Digits per cascade level.
    pub fn radix(&self) -> u32 {
        self.radix
    }
    /// Finest precision in ms.
    pub fn unit_ms(&self) -> u64 {
        self.unit_ms
    }
    /// Number of cascade levels (= digit words in every routing key).
    pub fn levels(&self) -> u32 {
        self.levels
    }
    /// Queue type of tiers and parking queues.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }
    /// `x-max-length` of every tier, if set.
    pub fn max_tier_length(&self) -> Option<u64> {
        self.max_tier_length
    }
    /// Longest accepted delay.
    pub fn max_delay_ms(&self) -> u64 {
        self.max_delay_ms
    }
    /// Largest delay the cascade alone represents: `(radix^levels − 1) · unit`.
    pub fn cascade_max_ms(&self) -> u64 {
        (u64::from(self.radix).pow(self.levels) - 1) * self.unit_ms
    }
    /// TTL of each overflow tier.
    pub fn overflow_ttl_ms(&self) -> u64 {
        self.overflow_ttl_ms
    }
    /// Number of overflow tiers.
    pub fn overflow_count(&self) -> u32 {
        self.overflow_count
    }
    /// Fixed-level TTLs, ascending.
    pub fn fixed_ms(&self) -> &[u64] {
        &self.fixed_ms
    }
    /// Number of queues each fixed level is spread over.
    pub fn fixed_shards(&self) -> u32 {
        self.fixed_shards
    }
    /// The longest a message waiting in tier `kind` can still take to fall due: what remains
    /// of its tier's TTL plus every tier it may visit after (for `stats`' "due within").
    /// Batches fire within their members' budgets, so this bounds them too.
    pub fn due_within_ms(&self, kind: TierKind) -> u64 {
        let after_top = self.cascade_max_ms().min(self.max_delay_ms);
        match kind {
            TierKind::Cascade { level, digit } => {
                (u64::from(digit) + 1) * self.level_weight_ms(level) - self.unit_ms
            }
            TierKind::Fixed { ttl_ms } => {
                ttl_ms + after_top.min(self.max_delay_ms - ttl_ms.min(self.max_delay_ms))
            }
            TierKind::Overflow { index } => {
                u64::from(self.overflow_count - index + 1) * self.overflow_ttl_ms + after_top
            }
        }
    }

    /// Weight of one digit at `level`: `radix^level · unit` ms.
    pub fn level_weight_ms(&self, level: u32) -> u64 {
        u64::from(self.radix).pow(level) * self.unit_ms
    }

    /// One line that identifies everything the shape of the topology depends on. Stored in the
    /// broker at declare time so a re-declare with other settings fails with a clear message.
    pub fn signature(&self) -> String {
        // Compact: the broker's error text quoting two of these must fit in 255 bytes.
        format!(
            "r={} u={} L={} o={}x{} t={} m={}",
            self.radix,
            self.unit_ms,
            self.levels,
            self.overflow_count,
            self.overflow_ttl_ms,
            self.queue_type,
            self.max_tier_length
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
        )
    }

    /// The exchange whose existence proves the topology was declared with exactly this layout:
    /// its name carries the signature (`<prefix>.layout.r16.u1.L8.o0x...` — a hash if that would
    /// pass 255 bytes), so anyone can check it with a passive declare, without any permission.
    /// It is also the `alternate-exchange` argument of [`Layout::layout_marker`], which the broker
    /// compares on every re-declare (and which lies inside the prefix, where an admin's
    /// permissions reach).
    pub fn signature_exchange(&self) -> String {
        let slug = self.signature().replace('=', "").replace(' ', ".");
        let name = format!("{}.layout.{slug}", self.prefix);
        if name.len() <= 255 {
            return name;
        }
        // FNV-1a: stable across builds and platforms
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.signature().bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{}.layout.h{h:016x}", self.prefix)
    }

    /// Names of the [`Layout::signature`] keys, for error messages.
    pub fn signature_key_name(key: &str) -> &str {
        match key {
            "r" => "radix",
            "u" => "unit",
            "L" => "levels",
            "o" => "overflow tiers",
            "t" => "queue_type",
            "m" => "max_tier_length",
            other => other,
        }
    }

    /// Every tier queue, in declaration order (lowest level first, so each dead-letter target
    /// exists before the queue pointing at it).
    pub fn tiers(&self) -> Vec<Tier> {
        let mut out = Vec::new();
        for k in 0..self.levels {
            let dlx = if k == 0 {
                self.delivery_exchange()
            } else {
                self.level_exchange(k - 1)
            };
            for d in 1..self.radix {
                out.push(Tier {
                    kind: TierKind::Cascade { level: k, digit: d },
                    queue: self.cascade_queue(k, d),
                    ttl_ms: u64::from(d) * self.level_weight_ms(k),
                    dead_letter_exchange: dlx.clone(),
                });
            }
        }
        for &ms in &self.fixed_ms {
            for shard in 0..self.fixed_shards {
                out.push(Tier {
                    kind: TierKind::Fixed { ttl_ms: ms },
                    queue: self.fixed_shard_exchange(ms, shard),
                    ttl_ms: ms,
                    dead_letter_exchange: self.top_exchange(),
                });
            }
        }
        for i in (1..=self.overflow_count).rev() {
            let dlx = if i == self.overflow_count {
                self.top_exchange()
            } else {
                self.overflow_exchange(i + 1)
            };
            out.push(Tier {
                kind: TierKind::Overflow { index: i },
                queue: self.overflow_queue(i),
                ttl_ms: self.overflow_ttl_ms,
                dead_letter_exchange: dlx,
            });
        }
        out
    }
}

/// The radix, the unit and the TTL limit each within its bounds (the unit within the limit).
fn validate_units(radix: u32, unit: u64, max_ttl: u64) -> Result<(), LayoutError> {
    let err = |m: String| Err(LayoutError(m));
    if !(2..=36).contains(&radix) {
        return err(format!("radix must be between 2 and 36, got {radix}"));
    }
    if max_ttl == 0 || max_ttl > BROKER_MAX_TTL_MS {
        return err(format!(
            "max_tier_ttl must be between 1 and {BROKER_MAX_TTL_MS} ms (the broker's limit), got {max_ttl} ms"
        ));
    }
    if unit == 0 || unit > max_ttl {
        return err(format!(
            "unit must be between 1 ms and the longest tier TTL ({max_ttl} ms), got {unit} ms"
        ));
    }
    Ok(())
}

/// The largest delay `levels` cascade levels represent: `(r^levels − 1) · unit`, saturating.
fn cascade_range(r: u64, unit: u64, levels: u32) -> u64 {
    r.checked_pow(levels)
        .and_then(|p| (p - 1).checked_mul(unit))
        .unwrap_or(u64::MAX)
}

/// Cascade levels: add levels while the range does not cover `max_delay_ms` and the new
/// level's largest digit still fits the TTL limit. Level 0 must fit it.
fn cascade_levels(r: u64, unit: u64, max_ttl: u64, max_delay_ms: u64) -> Result<u32, LayoutError> {
    if (r - 1).saturating_mul(unit) > max_ttl {
        return Err(LayoutError(format!(
            "the largest level-0 tier ({} x {unit} ms) exceeds the longest tier TTL ({max_ttl} ms); use a smaller radix or unit",
            r - 1
        )));
    }
    let mut levels: u32 = 1;
    let mut weight = unit; // r^(levels-1) * unit, the weight of the top level
    while cascade_range(r, unit, levels) < max_delay_ms {
        let next_weight = weight.saturating_mul(r);
        if (r - 1).saturating_mul(next_weight) > max_ttl {
            break;
        }
        weight = next_weight;
        levels += 1;
    }
    Ok(levels)
}

/// Overflow chain: equal tiers of T ms, T a multiple of the unit, at most one unit more than
/// the cascade can represent, so every remainder is reachable; as many as the delays beyond
/// the cascade's range need, at most [`MAX_OVERFLOW_QUEUES`]. Returns T and their number.
fn overflow_chain(
    unit: u64,
    max_ttl: u64,
    cascade_ms: u64,
    max_delay_ms: u64,
) -> Result<(u64, u32), LayoutError> {
    let overflow_ttl_ms = ((max_ttl / unit).min(cascade_ms / unit + 1)) * unit;
    let overflow_count = if max_delay_ms > cascade_ms {
        (max_delay_ms - cascade_ms).div_ceil(overflow_ttl_ms)
    } else {
        0
    };
    if overflow_count > MAX_OVERFLOW_QUEUES {
        return Err(LayoutError(format!(
            "max_delay {} ms needs {overflow_count} overflow tiers of {overflow_ttl_ms} ms beyond the cascade's {cascade_ms} ms (limit {MAX_OVERFLOW_QUEUES}); raise unit, or lower max_delay",
            max_delay_ms
        )));
    }
    Ok((overflow_ttl_ms, overflow_count as u32))
}

/// The fixed levels in ms, ascending and distinct, each a tier within the TTL limit and no
/// longer than `max_delay_ms`.
fn fixed_levels(
    levels: &[DurationMs],
    max_ttl: u64,
    max_delay_ms: u64,
) -> Result<Vec<u64>, LayoutError> {
    let mut fixed_ms = Vec::new();
    for f in levels {
        let ms = f.as_millis();
        if ms == 0 || ms > max_ttl {
            return Err(LayoutError(format!(
                "fixed level {f} must be between 1 ms and the longest tier TTL ({max_ttl} ms)"
            )));
        }
        if ms > max_delay_ms {
            return Err(LayoutError(format!(
                "fixed level {f} is longer than max_delay ({max_delay_ms} ms)"
            )));
        }
        fixed_ms.push(ms);
    }
    fixed_ms.sort_unstable();
    fixed_ms.dedup();
    Ok(fixed_ms)
}

/// Prefix rules: it names every exchange and queue we create.
pub fn validate_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty() {
        return Err("prefix must not be empty".into());
    }
    if prefix.len() > 200 {
        return Err(format!(
            "prefix is {} bytes; at most 200 leave room for the suffixes",
            prefix.len()
        ));
    }
    if prefix.starts_with("amq.") {
        return Err("prefix must not start with 'amq.' (reserved by the broker)".into());
    }
    if prefix.contains(['*', '#']) {
        return Err("prefix must not contain '*' or '#'".into());
    }
    Ok(())
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "radix {} x {} ms units, {} levels (cascade up to {} ms), {} overflow tiers of {} ms, fixed levels [{}], max delay {} ms, {} queues",
            self.radix,
            self.unit_ms,
            self.levels,
            self.cascade_max_ms(),
            self.overflow_count,
            self.overflow_ttl_ms,
            self.fixed_ms
                .iter()
                .map(|&m| compact_duration(m))
                .collect::<Vec<_>>()
                .join(", "),
            self.max_delay_ms,
            self.queue_type,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tier_bounds_when_its_messages_fall_due() {
        let t = TopologySettings {
            radix: 4,
            unit: DurationMs(1),
            max_delay: DurationMs(1_500),
            fixed_levels: vec![DurationMs(150)],
            fixed_shards: 1,
            queue_type: QueueType::Quorum,
            max_tier_length: None,
            max_tier_ttl: DurationMs(200),
        };
        let l = Layout::new("p", &t).unwrap();
        // level 1, digit 2: 8..=11 ms of delay left when it enters
        assert_eq!(
            l.due_within_ms(TierKind::Cascade { level: 1, digit: 2 }),
            11
        );
        for tier in l.tiers() {
            let within = l.due_within_ms(tier.kind);
            assert!(within >= tier.ttl_ms, "{tier:?}");
            assert!(within <= l.max_delay_ms() + l.cascade_max_ms(), "{tier:?}");
        }
    }
}
