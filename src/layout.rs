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

/// The broker's limit for `x-message-ttl` (milliseconds, unsigned 32-bit).
pub const BROKER_MAX_TTL_MS: u64 = u32::MAX as u64;
/// Topic routing keys are at most 255 bytes.
pub const MAX_ROUTING_KEY_LEN: usize = 255;
/// Upper bound on the overflow chain, so a misconfiguration cannot create thousands of queues.
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
    /// Time unit of the lowest level, in milliseconds: the finest precision.
    pub unit_ms: u64,
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
            fixed_shards: 1,
            queue_type: QueueType::Quorum,
            max_tier_length: None,
            max_tier_ttl_ms: BROKER_MAX_TTL_MS,
        }
    }
}

/// Queue type of tier and parking queues.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
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
    /// Exchange the queue dead-letters into (routing key kept).
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
    /// Computes the layout, validating everything the broker would otherwise reject later.
    pub fn new(prefix: &str, t: &TopologySettings) -> Result<Layout, LayoutError> {
        let err = |m: String| Err(LayoutError(m));
        validate_prefix(prefix).map_err(LayoutError)?;
        let radix = t.radix;
        if !(2..=36).contains(&radix) {
            return err(format!("radix must be between 2 and 36, got {radix}"));
        }
        let unit = t.unit_ms;
        let max_ttl = t.max_tier_ttl_ms;
        if max_ttl == 0 || max_ttl > BROKER_MAX_TTL_MS {
            return err(format!(
                "max_tier_ttl_ms must be between 1 and {BROKER_MAX_TTL_MS} (the broker's limit), got {max_ttl}"
            ));
        }
        if unit == 0 || unit > max_ttl {
            return err(format!(
                "unit_ms must be between 1 and max_tier_ttl_ms ({max_ttl}), got {unit}"
            ));
        }
        let r = u64::from(radix);
        // Cascade levels: add levels while the range is not covered and the new level's largest
        // digit still fits the TTL limit.
        let mut levels: u32 = 1;
        let mut weight = unit; // r^(levels-1) * unit, the weight of the top level
        let cap = |levels: u32| -> u64 {
            // (r^levels - 1) * unit, saturating
            r.checked_pow(levels)
                .and_then(|p| (p - 1).checked_mul(unit))
                .unwrap_or(u64::MAX)
        };
        if (r - 1).saturating_mul(unit) > max_ttl {
            return err(format!(
                "the largest level-0 tier ({} x {unit} ms) exceeds max_tier_ttl_ms ({max_ttl}); use a smaller radix or unit",
                r - 1
            ));
        }
        let max_delay_ms = t.max_delay.as_millis();
        while cap(levels) < max_delay_ms {
            let next_weight = weight.saturating_mul(r);
            if (r - 1).saturating_mul(next_weight) > max_ttl {
                break;
            }
            weight = next_weight;
            levels += 1;
        }
        let cascade_ms = cap(levels);
        // Overflow chain: equal tiers of T ms, T a multiple of the unit, at most one unit more
        // than the cascade can represent, so every remainder is reachable.
        let overflow_ttl_ms = ((max_ttl / unit).min(cascade_ms / unit + 1)) * unit;
        let overflow_count = if max_delay_ms > cascade_ms {
            (max_delay_ms - cascade_ms).div_ceil(overflow_ttl_ms)
        } else {
            0
        };
        if overflow_count > MAX_OVERFLOW_QUEUES {
            return err(format!(
                "max_delay {} ms needs {overflow_count} overflow tiers of {overflow_ttl_ms} ms beyond the cascade's {cascade_ms} ms (limit {MAX_OVERFLOW_QUEUES}); raise unit_ms or max_tier_ttl_ms, or lower max_delay",
                max_delay_ms
            ));
        }
        let mut fixed_ms = Vec::new();
        for f in &t.fixed_levels {
            let ms = f.as_millis();
            if ms == 0 || ms > max_ttl {
                return err(format!(
                    "fixed level {f} must be between 1 ms and max_tier_ttl_ms ({max_ttl} ms)"
                ));
            }
            if ms > max_delay_ms {
                return err(format!(
                    "fixed level {f} is longer than max_delay ({max_delay_ms} ms)"
                ));
            }
            fixed_ms.push(ms);
        }
        fixed_ms.sort_unstable();
        fixed_ms.dedup();
        if !(1..=16).contains(&t.fixed_shards) {
            return err(format!(
                "fixed_shards must be between 1 and 16, got {}",
                t.fixed_shards
            ));
        }
        if let Some(0) = t.max_tier_length {
            return err("max_tier_length must be at least 1 when set".into());
        }
        Ok(Layout {
            prefix: prefix.to_string(),
            radix,
            unit_ms: unit,
            levels,
            overflow_ttl_ms,
            overflow_count: overflow_count as u32,
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
            "u" => "unit_ms",
            "L" => "levels",
            "o" => "overflow tiers",
            "t" => "queue_type",
            "m" => "max_tier_length",
            other => other,
        }
    }

    // ---- names -------------------------------------------------------------------------------

    /// Topic exchange of cascade level `k`.
    pub fn level_exchange(&self, k: u32) -> String {
        format!("{}.level{k}", self.prefix)
    }
    /// Queue of cascade level `k`, digit `d`.
    pub fn cascade_queue(&self, k: u32, d: u32) -> String {
        format!("{}.level{k}.d{d}", self.prefix)
    }
    /// Exchange at the top of the cascade (where fixed levels and the overflow chain end).
    pub fn top_exchange(&self) -> String {
        self.level_exchange(self.levels - 1)
    }
    /// Fanout exchange in front of overflow queue `i` (1-based).
    pub fn overflow_exchange(&self, i: u32) -> String {
        format!("{}.overflow{i}", self.prefix)
    }
    /// Queue `i` (1-based) of the overflow chain.
    pub fn overflow_queue(&self, i: u32) -> String {
        self.overflow_exchange(i)
    }
    /// Fanout exchange in front of shard 0 of the fixed level of `ms`.
    pub fn fixed_exchange(&self, ms: u64) -> String {
        self.fixed_shard_exchange(ms, 0)
    }
    /// Queue of shard 0 of the fixed level of `ms`.
    pub fn fixed_queue(&self, ms: u64) -> String {
        self.fixed_exchange(ms)
    }
    /// Number of queues each fixed level is spread over.
    pub fn fixed_shards(&self) -> u32 {
        self.fixed_shards
    }
    /// Fanout exchange (and queue) of shard `shard` of the fixed level of `ms`: shard 0 is
    /// `p.fixed.30m`, shard 2 `p.fixed.30m.s2`.
    pub fn fixed_shard_exchange(&self, ms: u64, shard: u32) -> String {
        match shard {
            0 => format!("{}.fixed.{}", self.prefix, compact_duration(ms)),
            s => format!("{}.fixed.{}.s{s}", self.prefix, compact_duration(ms)),
        }
    }
    /// Topic exchange routing due messages to their destination queue.
    pub fn delivery_exchange(&self) -> String {
        format!("{}.deliver", self.prefix)
    }
    /// Fanout exchange, alternate exchange of the delivery exchange.
    pub fn parking_exchange(&self) -> String {
        format!("{}.parking", self.prefix)
    }
    /// Queue holding messages whose destination did not exist at delivery time (the parking
    /// exchange's queue).
    pub fn unroutable_queue(&self) -> String {
        format!("{}.parked", self.prefix)
    }
    /// Where a worker parks the messages of `queue` it gave up on (permanent failure, last
    /// attempt failed, invalid envelope).
    pub fn parked_queue(&self, queue: &str) -> String {
        format!("{}{queue}", self.parked_prefix())
    }
    /// What the name of every destination's parking queue ([`Layout::parked_queue`]) starts with.
    pub fn parked_prefix(&self) -> String {
        format!("{}.parked.", self.prefix)
    }
    /// Queue of gateway ingress exchange `ingress`: bound to it, consumed by the gateway.
    pub fn gateway_ingress_queue(&self, ingress: &str) -> String {
        format!("{}.gw.in.{ingress}", self.prefix)
    }
    /// Destination queue of gateway ingress `ingress`'s messages while they wait.
    pub fn gateway_due_queue(&self, ingress: &str) -> String {
        format!("{}.gw.due.{ingress}", self.prefix)
    }
    /// The control stream: gateway pairs and other records the topology remembers.
    pub fn control_stream(&self) -> String {
        format!("{}.control", self.prefix)
    }
    /// The ledger stream: how many messages (not broker messages) publishers put into the
    /// tiers, by due time (see `tally`). Kept as long as the control stream.
    pub fn ledger_stream(&self) -> String {
        format!("{}.ledger", self.prefix)
    }
    /// How long the control stream keeps a record: the longest delay plus a week (for
    /// retries after it), in seconds.
    pub fn control_max_age_secs(&self) -> u64 {
        self.max_delay_ms.div_ceil(1000) + 7 * 24 * 3600
    }
    /// The exchange whose existence says that the consumers of `queue` read batches (declared
    /// by the worker, checked by publishers). `None` when the name would not fit 255 bytes:
    /// such a destination gets plain messages.
    pub fn batch_marker(&self, queue: &str) -> Option<String> {
        let name = format!("{}.batched.{queue}", self.prefix);
        (name.len() <= 255).then_some(name)
    }
    /// Exchange that never routes anything; its `alternate-exchange` argument records the
    /// layout signature (the broker compares it on every re-declare). An exchange has no home
    /// node, so the marker stays readable while any minority of a cluster is down.
    pub fn layout_marker(&self) -> String {
        format!("{}.layout", self.prefix)
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

    // ---- routing keys --------------------------------------------------------------------------

    /// The digit word for `digit`.
    pub fn digit_word(digit: u32) -> char {
        DIGITS[digit as usize] as char
    }

    /// Binding pattern on level `k`'s exchange for digit `d` (`*` in every other digit position,
    /// `#` for the destination).
    pub fn level_binding(&self, k: u32, d: u32) -> String {
        let mut words: Vec<String> = (0..self.levels).map(|_| "*".to_string()).collect();
        words[(self.levels - 1 - k) as usize] = Self::digit_word(d).to_string();
        words.push("#".into());
        words.join(".")
    }

    /// Binding pattern of a destination queue on the delivery exchange: one `*` per digit word,
    /// then the destination's own words, which contain no wildcard (see [`Layout::validate_destination`]).
    pub fn destination_binding(&self, destination: &str) -> String {
        let mut s = "*.".repeat(self.levels as usize);
        s.push_str(destination);
        s
    }

    /// Routing key for `digits` (indexed by level) and `destination`.
    pub fn routing_key(&self, digits: &[u32], destination: &str) -> String {
        let mut s = String::with_capacity(2 * self.levels as usize + destination.len());
        for k in (0..self.levels).rev() {
            s.push(Self::digit_word(
                digits.get(k as usize).copied().unwrap_or(0),
            ));
            s.push('.');
        }
        s.push_str(destination);
        s
    }

    /// Longest destination name that still fits the 255-byte routing key.
    pub fn max_destination_len(&self) -> usize {
        MAX_ROUTING_KEY_LEN - 2 * self.levels as usize
    }

    /// Rules for a destination queue name (DESIGN rule 9): non-empty, fits the routing key,
    /// no empty word and no `*` / `#` word that would turn its binding into a wildcard.
    pub fn validate_destination(&self, destination: &str) -> Result<(), String> {
        if destination.is_empty() {
            return Err("destination queue name is empty".into());
        }
        let max = self.max_destination_len();
        if destination.len() > max {
            return Err(format!(
                "destination queue name is {} bytes; at most {max} fit in the routing key with {} digit words",
                destination.len(),
                self.levels
            ));
        }
        for word in destination.split('.') {
            if word.is_empty() {
                return Err(format!(
                    "destination queue name '{destination}' has an empty dot-separated word (leading, trailing or double dot)"
                ));
            }
            if word == "*" || word == "#" {
                return Err(format!(
                    "destination queue name '{destination}' contains the wildcard word '{word}', which would make its binding match other queues' messages"
                ));
            }
        }
        Ok(())
    }
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
            unit_ms: 1,
            max_delay: DurationMs(1_500),
            fixed_levels: vec![DurationMs(150)],
            fixed_shards: 1,
            queue_type: QueueType::Quorum,
            max_tier_length: None,
            max_tier_ttl_ms: 200,
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
