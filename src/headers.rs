//! Header rules, pure: the headers we set on every scheduled message, the reserved names, the
//! stripping of the broker's dead-letter history before anything is re-published
//! (docs/DESIGN.md rule 3), and conversion of JSON header values into AMQP field values.

use std::collections::BTreeMap;

use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

/// Requested delay in whole milliseconds.
pub const DELAY_MS: &str = "x-delay-ms";
/// Due time, milliseconds since the Unix epoch.
pub const DUE_AT: &str = "x-delay-due-at";
/// Delivery attempt: 0 on first schedule, +1 per retry.
pub const ATTEMPT: &str = "x-delay-attempt";

/// Headers only we set on every scheduled message.
pub const RESERVED: [&str; 3] = [DELAY_MS, DUE_AT, ATTEMPT];

/// What every parking header's name starts with.
pub const PARKED_PREFIX: &str = "x-delay-parked-";
/// Why a worker parked a message.
pub const PARKED_REASON: &str = "x-delay-parked-reason";
/// When it was parked (ms since the Unix epoch).
pub const PARKED_AT: &str = "x-delay-parked-at";
/// How many executions it had.
pub const PARKED_ATTEMPTS: &str = "x-delay-parked-attempts";
/// The queue it was consumed from.
pub const PARKED_FROM: &str = "x-delay-parked-from";

/// Original routing key of a message relayed for a plugin-style publisher (gateway, forward).
pub const ROUTING_KEY: &str = "x-delay-routing-key";
/// The plugin's delay header, in milliseconds (read at a gateway ingress).
pub const X_DELAY: &str = "x-delay";
/// Gateway: the `expiration` the application set (re-applied on delivery).
pub const EXPIRATION: &str = "x-delay-expiration";
/// Gateway: the `delivery_mode` the application set.
pub const DELIVERY_MODE: &str = "x-delay-delivery-mode";
/// Gateway: the application set no `message_id` (the publisher generated one).
pub const NO_MESSAGE_ID: &str = "x-delay-no-message-id";
/// Gateway: the application set no `headers` table.
pub const NO_HEADERS: &str = "x-delay-no-headers";
/// Gateway: the `user_id` the application published with; kept on the delivered message.
pub const USER_ID: &str = "x-delay-user-id";
/// `delay-proxy`: the message's `user_id` is the login of the proxy's client, set by the proxy
/// (the application set none), so the gateway does not name it in [`USER_ID`] at the target.
pub const ADDED_USER_ID: &str = "x-delay-added-user-id";
/// `delay-proxy`: when the proxy took the delayed publish (ms since the Unix epoch). A gateway's
/// ingress counts the delay from it, so that a message that waited in the ingress queue (a pair
/// not served yet, a gateway restarting) is not late by that wait. Whoever writes an ingress
/// can set it, and gains nothing by it: a time before now only shortens its own message's
/// delay, as a smaller `x-delay` would, and one after now counts as now.
pub const PUBLISHED_AT: &str = "x-delay-published-at";
/// Who owns a copy a worker or a gateway wrote on another user's behalf (a retry, a gateway
/// hop): believed only from such a writer (see `amqp_delay::trust`).
pub const OWNER: &str = "x-delay-owner";
/// Gateway: why the ingress refused the message; the due handler parks it with this reason.
pub const INVALID: &str = "x-delay-invalid";

/// The `http` action's request header with the message id.
pub const HTTP_MESSAGE_ID: &str = "x-delay-message-id";
/// The `http` action's request header with the delivery attempt (same name as the AMQP header).
pub const HTTP_ATTEMPT: &str = ATTEMPT;

/// An occurrence of a recurring schedule: the schedule's name (see `amqp_delay::recurring`).
pub const RECURRING: &str = "x-delay-recurring";
/// An occurrence of a recurring schedule: its tick, ms since the Unix epoch.
pub const RECURRING_TICK: &str = "x-delay-recurring-tick";

/// On a batch: the envelope version (see the `batch` module).
pub const BATCH: &str = "x-delay-batch";
/// On a batch: how many messages it carries.
pub const BATCH_COUNT: &str = "x-delay-batch-count";

/// Every `x-delay-*` name is ours: reserved on every input path.
pub fn is_ours(name: &str) -> bool {
    name.starts_with("x-delay-")
}

/// RabbitMQ's own publish-time delay for quorum queues (absolute epoch ms; 4.4, ignored on an
/// AMQP 0-9-1 publish by 4.3). A message that carried it through our tiers would be delayed
/// once more by a quorum destination on such a broker, so it is reserved like our own names
/// (DESIGN rule 16).
pub const NATIVE_DELIVERY_TIME: &str = "x-opt-delivery-time";

/// Whether an application may not set `name` on a message that goes through the tiers: one of
/// ours, or the broker's native delay.
pub fn is_reserved(name: &str) -> bool {
    is_ours(name) || name == NATIVE_DELIVERY_TIME
}

/// The quorum queues' count of earlier failed deliveries of a message (set by the broker; up to
/// RabbitMQ 4.2 every return counts, a consumer's requeue too).
pub const DELIVERY_COUNT: &str = "x-delivery-count";
/// RabbitMQ 4.3's quorum queues: how many times a message was acquired by a consumer and came
/// back, a consumer's requeue included, which no longer counts toward the delivery limit.
pub const ACQUIRED_COUNT: &str = "x-acquired-count";

/// How many times the broker says this delivery was returned to its queue before: the larger of
/// `x-delivery-count` and 4.3's `x-acquired-count` (0 when absent, negative or not an integer).
pub fn delivery_count(table: Option<&FieldTable>) -> u64 {
    let count = |name| {
        table
            .and_then(|t| get_int(t, name))
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0)
    };
    count(DELIVERY_COUNT).max(count(ACQUIRED_COUNT))
}

/// The broker's dead-letter history headers.
pub fn is_death_header(name: &str) -> bool {
    name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")
}

/// The sender-selected distribution headers: at every publish the broker routes one more copy
/// of the message per routing key they name (`CC` is delivered with the copies, `BCC` is
/// removed). At a tier hop each would be a copy to another destination, so they never enter
/// the tiers (docs/DESIGN.md rule 14): refused from `send`, JSONL and the library, moved into
/// [`CC`] and [`BCC`] at a gateway ingress and given back at the target, as the plugin routes
/// them once when the message is due.
pub const ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

/// Gateway: the `CC` header the application set, given back at the target.
pub const CC: &str = "x-delay-cc";
/// Gateway: the `BCC` header the application set, given back at the target.
pub const BCC: &str = "x-delay-bcc";

/// Whether the broker routes extra copies by header `name` (`CC`, `BCC`).
pub fn is_routing_header(name: &str) -> bool {
    ROUTING_HEADERS.contains(&name)
}

/// Headers the broker adds on its own (the dead-letter history and the quorum queues'
/// redelivery counters) or acts on at every publish (`CC`, `BCC`). Never carried into anything
/// we re-publish (DESIGN rules 3 and 14: a kept `x-death` can make the broker drop or strand the
/// copy, a kept `CC`/`BCC` routes a copy per key at every hop).
pub fn is_broker_header(name: &str) -> bool {
    is_death_header(name)
        || name == DELIVERY_COUNT
        || name == ACQUIRED_COUNT
        || is_routing_header(name)
}

/// The `x-delay-*` headers that steer only the message that carries them — its delay, due
/// time and attempt, and the batch envelope's version and count — and which anyone who may
/// schedule may therefore write. Every other `x-delay-*` header is believed only from a
/// trusted writer (see [`crate::trust`]).
pub fn is_schedule_header(name: &str) -> bool {
    RESERVED.contains(&name) || name == BATCH || name == BATCH_COUNT
}

/// Returns `table` without `x-death`, `x-first-death-*`, `x-last-death-*`,
/// `x-delivery-count`, `x-acquired-count`, `CC` and `BCC`.
pub fn strip_death(table: &FieldTable) -> FieldTable {
    filter(table, |k| !is_broker_header(k))
}

/// Returns `table` without the keys for which `keep` is false.
pub fn filter(table: &FieldTable, keep: impl Fn(&str) -> bool) -> FieldTable {
    let m: BTreeMap<ShortString, AMQPValue> = table
        .inner()
        .iter()
        .filter(|(k, _)| keep(k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    FieldTable::from(m)
}

/// Sets our three headers.
pub fn set_schedule_headers(table: &mut FieldTable, delay_ms: u64, due_at_ms: u64, attempt: u32) {
    table.insert(DELAY_MS.into(), AMQPValue::LongLongInt(delay_ms as i64));
    table.insert(DUE_AT.into(), AMQPValue::LongLongInt(due_at_ms as i64));
    table.insert(ATTEMPT.into(), AMQPValue::LongLongInt(i64::from(attempt)));
}

/// Sets the headers of an occurrence of recurring schedule `name` at `tick_ms`.
pub fn set_occurrence_headers(table: &mut FieldTable, name: &str, tick_ms: u64) {
    table.insert(RECURRING.into(), AMQPValue::LongString(name.into()));
    table.insert(
        RECURRING_TICK.into(),
        AMQPValue::LongLongInt(tick_ms as i64),
    );
}

/// Bytes `table` takes in AMQP's field-table encoding (as it travels in a content header).
pub fn encoded_len(table: &FieldTable) -> usize {
    cookie_factory::gen_simple(lapin::types::generation::gen_field_table(table), Vec::new())
        .map(|v| v.len())
        .unwrap_or(usize::MAX)
}

/// Reads an integer header of any AMQP integer type.
pub fn get_int(table: &FieldTable, name: &str) -> Option<i64> {
    as_int(table.inner().get(name)?)
}

/// An AMQP integer field as i64 (any width, signed or not).
pub fn as_int(v: &AMQPValue) -> Option<i64> {
    Some(match *v {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => i64::try_from(n).ok()?,
        _ => return None,
    })
}

/// Converts a JSON object into a header table: strings → long strings, integers → signed
/// 64-bit, other numbers → double, booleans, null → void, arrays and objects nested.
pub fn json_to_table(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    for (k, v) in obj {
        let key = ShortString::try_new(k.as_str())
            .map_err(|_| format!("header name '{k:.40}…' is longer than 255 bytes"))?;
        t.insert(key, json_to_value(v)?);
    }
    Ok(t)
}

fn json_to_value(v: &serde_json::Value) -> Result<AMQPValue, String> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                AMQPValue::LongLongInt(i)
            } else if let Some(f) = n.as_f64() {
                AMQPValue::Double(f)
            } else {
                return Err(format!("header value {n} does not fit a 64-bit number"));
            }
        }
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_value).collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Object(o) => AMQPValue::FieldTable(json_to_table(o)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parking_headers_share_the_prefix() {
        for name in [PARKED_REASON, PARKED_AT, PARKED_ATTEMPTS, PARKED_FROM] {
            assert!(name.starts_with(PARKED_PREFIX) && is_ours(name), "{name}");
        }
        assert!(is_ours(PARKED_PREFIX) && is_ours(HTTP_MESSAGE_ID));
    }

    #[test]
    fn strips_death_history_only() {
        let mut t = FieldTable::default();
        t.insert("x-death".into(), AMQPValue::Void);
        t.insert("x-first-death-queue".into(), AMQPValue::Void);
        t.insert("x-last-death-reason".into(), AMQPValue::Void);
        t.insert("x-deathly".into(), AMQPValue::Boolean(true));
        t.insert("app".into(), AMQPValue::Boolean(true));
        let s = strip_death(&t);
        let keys: Vec<_> = s.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["app", "x-deathly"]);
        // the broker's sender-selected distribution acts at every publish: never carried on
        for routed in ["CC", "BCC"] {
            t.insert(routed.into(), AMQPValue::Void);
        }
        t.insert("cc".into(), AMQPValue::Void);
        let s = strip_death(&t);
        let keys: Vec<_> = s.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["app", "cc", "x-deathly"]);
    }

    #[test]
    fn the_whole_x_delay_namespace_is_ours() {
        for name in [
            ATTEMPT,
            ROUTING_KEY,
            USER_ID,
            PARKED_REASON,
            "x-delay-anything",
        ] {
            assert!(is_ours(name), "{name}");
        }
        assert!(!is_ours("x-delay") && !is_ours("x-death") && !is_ours("app"));
        let mut t = FieldTable::default();
        t.insert("k".into(), AMQPValue::LongString("v".into()));
        assert_eq!(encoded_len(&t), 4 + 1 + 1 + 1 + 4 + 1);
    }

    #[test]
    fn json_headers_convert() {
        let v: serde_json::Value = serde_json::json!({"s": "x", "i": -3, "f": 1.5, "b": true, "n": null, "a": [1, "y"], "o": {"k": 1}});
        let t = json_to_table(v.as_object().unwrap()).unwrap();
        assert_eq!(get_int(&t, "i"), Some(-3));
        assert_eq!(t.inner()["f"], AMQPValue::Double(1.5));
        assert_eq!(t.inner()["s"], AMQPValue::LongString("x".into()));
        assert!(matches!(t.inner()["o"], AMQPValue::FieldTable(_)));
    }

    #[test]
    fn the_delivery_count_is_read_from_any_integer_and_absent_is_zero() {
        let mut t = FieldTable::default();
        assert_eq!(delivery_count(None), 0);
        assert_eq!(delivery_count(Some(&t)), 0);
        t.insert(DELIVERY_COUNT.into(), AMQPValue::LongInt(3));
        assert_eq!(delivery_count(Some(&t)), 3);
        t.insert(DELIVERY_COUNT.into(), AMQPValue::LongLongInt(-2));
        assert_eq!(delivery_count(Some(&t)), 0);
        t.insert(DELIVERY_COUNT.into(), AMQPValue::LongString("7".into()));
        assert_eq!(delivery_count(Some(&t)), 0);
        // 4.3 counts a requeue in x-acquired-count only
        t.insert(ACQUIRED_COUNT.into(), AMQPValue::LongLongInt(5));
        assert_eq!(delivery_count(Some(&t)), 5);
        t.insert(DELIVERY_COUNT.into(), AMQPValue::LongInt(6));
        assert_eq!(delivery_count(Some(&t)), 6);
        assert!(is_broker_header(ACQUIRED_COUNT));
    }
}
