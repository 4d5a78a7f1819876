//! Every name of the topology (exchanges, queues, streams, markers: all `<prefix>.…`) and the
//! routing keys and binding patterns that carry a message's route: one digit word per cascade
//! level, highest level first, then the destination.

use super::{DIGITS, Layout, MAX_ROUTING_KEY_LEN};
use crate::time::compact_duration;

impl Layout {
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
    /// Direct exchange in front of the streams (the control and ledger streams, each bound
    /// with its own name as the key): appends go through it, so that no role needs the
    /// default exchange, which writes into any queue of the vhost.
    pub fn stream_exchange(&self) -> String {
        format!("{}.streams", self.prefix)
    }
    /// The lock of `user`'s `recurring serve`: an exclusive queue, so that one of its
    /// replicas is active at a time (the others wait to declare it).
    pub fn recurring_lock(&self, user: &str) -> String {
        format!("{}.recurring.lock.{user}", self.prefix)
    }
    /// The lock a `transfer` holds while it moves what waits to another cluster: an exclusive
    /// queue, so that two transfers never read the same tiers at once.
    pub fn transfer_lock(&self) -> String {
        format!("{}.transfer-lock", self.prefix)
    }
    /// Direct exchange in front of the destinations' parking queues (each bound with its
    /// destination's name as the key): where a worker parks, without the default exchange.
    pub fn park_exchange(&self) -> String {
        format!("{}.park", self.prefix)
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
    /// The lock a `parked` command holds while it reads the parking queue of `queue` (`None`:
    /// of [`Layout::unroutable_queue`]): an exclusive queue, `<prefix>.parked-lock.<queue>`.
    pub fn parked_lock_queue(&self, queue: Option<&str>) -> String {
        match queue {
            Some(q) => format!("{}.parked-lock.{q}", self.prefix),
            None => format!("{}.parked-lock", self.prefix),
        }
    }
    /// What the name of every destination's parking queue ([`Layout::parked_queue`]) starts with.
    pub fn parked_prefix(&self) -> String {
        format!("{}.parked.", self.prefix)
    }
    /// Queue of gateway ingress exchange `ingress`: bound to it, consumed by the gateway.
    pub fn gateway_ingress_queue(&self, ingress: &str) -> String {
        format!("{}.gw.in.{ingress}", self.prefix)
    }
    /// The ingress exchange `delay-proxy` registers for an application's delayed exchange
    /// `exchange` (its pair's target): what a proxied publish with a positive `x-delay` goes to.
    pub fn proxy_ingress(&self, exchange: &str) -> String {
        format!("{}.gw.x.{exchange}", self.prefix)
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
    /// The journal stream: what publishers scheduled and what workers did with it, which
    /// `pending` reads (see `journal`). Kept as long as the control stream.
    pub fn journal_stream(&self) -> String {
        format!("{}.journal", self.prefix)
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
    /// The exchange whose existence says that the consumers of `queue` also hold an early
    /// message until it is due (the timing wheel's last grain, `publisher.grain`): publishers
    /// then send it grain batches on coarse routes. Declared by the worker together with the
    /// batch marker, which publishers without grains look for instead. `None` when the name
    /// would not fit 255 bytes.
    pub fn hold_marker(&self, queue: &str) -> Option<String> {
        let name = format!("{}.holds.{queue}", self.prefix);
        (name.len() <= 255).then_some(name)
    }
    /// Both markers of `queue` (batch, hold) whose names fit: what `teardown` removes.
    pub fn markers(&self, queue: &str) -> Vec<String> {
        [self.batch_marker(queue), self.hold_marker(queue)]
            .into_iter()
            .flatten()
            .collect()
    }
    /// Exchange that never routes anything; its `alternate-exchange` argument records the
    /// layout signature (the broker compares it on every re-declare). An exchange has no home
    /// node, so the marker stays readable while any minority of a cluster is down.
    pub fn layout_marker(&self) -> String {
        format!("{}.layout", self.prefix)
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
