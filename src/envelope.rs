//! What a worker hands its handler, decoded from a raw delivery, pure: attempt, due time and
//! message id from our headers, with clear reasons when a header has the wrong type (such a
//! message is parked, never retried in a loop).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use crate::headers::{self, ATTEMPT, DELAY_MS, DUE_AT, ROUTING_KEY};

/// A due message, as a handler sees it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Queue it was consumed from.
    pub queue: String,
    /// Body, byte for byte as published.
    pub body: Vec<u8>,
    /// Properties as delivered (headers include ours and the broker's).
    pub properties: BasicProperties,
    /// `message_id` property (empty if the publisher set none).
    pub message_id: String,
    /// 0 on the first execution, +1 per retry.
    pub attempt: u32,
    /// When it was due (ms since the Unix epoch), if it came through amqp-delay.
    pub due_at_ms: Option<u64>,
    /// The requested delay, if it came through amqp-delay.
    pub delay_ms: Option<u64>,
    /// The broker delivered it before (a previous worker died or gave it back).
    pub redelivered: bool,
    /// Routing key as delivered.
    pub routing_key: String,
    /// Exchange it was delivered from.
    pub exchange: String,
    /// Who scheduled it, as the broker checked (`user_id`; see [`crate::trust`]): a cancel
    /// stops it only when its owner or an admin wrote it. `None` when it carries no `user_id`.
    pub owner: Option<String>,
}

impl Delivery {
    /// Its properties for a copy a handler re-publishes (a forward, a relay): `headers`
    /// instead of its own, without `expiration` (it would make a parked copy vanish) and
    /// `user_id` (the broker refuses one that is not the publishing connection's user).
    pub fn republished_properties(&self, headers: FieldTable) -> BasicProperties {
        republish_properties(&self.properties, headers)
    }

    /// The headers table, if any.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    /// The routing key the message had before it entered the tiers: the
    /// `x-delay-routing-key` header if set, else the delivered key without its digit words
    /// (`levels` of them), i.e. the destination queue name.
    pub fn original_routing_key(&self, levels: u32) -> String {
        if let Some(AMQPValue::LongString(s)) =
            self.headers().and_then(|h| h.inner().get(ROUTING_KEY))
        {
            return String::from_utf8_lossy(s.as_bytes()).into_owned();
        }
        let mut rest = self.routing_key.as_str();
        for _ in 0..levels {
            match rest.split_once('.') {
                Some((_, r)) => rest = r,
                None => return self.routing_key.clone(),
            }
        }
        rest.to_string()
    }
}

fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => "a string",
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::Float(_) | AMQPValue::Double(_) | AMQPValue::DecimalValue(_) => "a fraction",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::Void => "void",
        _ => "an integer",
    }
}

fn non_negative(table: &FieldTable, name: &str) -> Result<Option<u64>, String> {
    let Some(v) = table.inner().get(name) else {
        return Ok(None);
    };
    match headers::as_int(v) {
        Some(n) if n >= 0 => Ok(Some(n as u64)),
        Some(n) => Err(format!("header '{name}' must not be negative, got {n}")),
        None => Err(format!(
            "header '{name}' must be an integer, got {}",
            type_name(v)
        )),
    }
}

/// Decodes a delivery. The second value is the reason the envelope is invalid, if it is (the
/// delivery then carries defaults for what could not be read).
pub(crate) fn decode(
    queue: &str,
    body: Vec<u8>,
    properties: BasicProperties,
    routing_key: &str,
    exchange: &str,
    redelivered: bool,
) -> (Delivery, Option<String>) {
    let empty = FieldTable::default();
    let table = properties.headers().as_ref().unwrap_or(&empty);
    let parsed = (|| {
        let attempt = non_negative(table, ATTEMPT)?.unwrap_or(0);
        let attempt = u32::try_from(attempt)
            .map_err(|_| format!("header '{ATTEMPT}' is out of range: {attempt}"))?;
        Ok::<_, String>((
            attempt,
            non_negative(table, DUE_AT)?,
            non_negative(table, DELAY_MS)?,
        ))
    })();
    let mut d = Delivery {
        queue: queue.to_string(),
        message_id: properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default(),
        body,
        properties,
        attempt: 0,
        due_at_ms: None,
        delay_ms: None,
        redelivered,
        routing_key: routing_key.to_string(),
        exchange: exchange.to_string(),
        owner: None,
    };
    match parsed {
        Ok((attempt, due, delay)) => {
            d.attempt = attempt;
            d.due_at_ms = due;
            d.delay_ms = delay;
            (d, None)
        }
        Err(reason) => (d, Some(format!("invalid envelope: {reason}"))),
    }
}

/// Which properties [`copy_properties`] leaves out.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Omit {
    /// Leave out `headers`.
    pub headers: bool,
    /// Leave out `delivery_mode`.
    pub delivery_mode: bool,
    /// Leave out `expiration`.
    pub expiration: bool,
    /// Leave out `message_id`.
    pub message_id: bool,
    /// Leave out `user_id`.
    pub user_id: bool,
}

/// `p` without the properties named in `omit` (lapin has setters but no way to unset).
pub(crate) fn copy_properties(p: &BasicProperties, omit: Omit) -> BasicProperties {
    let mut o = BasicProperties::default();
    if let Some(v) = p.content_type() {
        o = o.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        o = o.with_content_encoding(v.clone());
    }
    if let Some(v) = p.headers().as_ref().filter(|_| !omit.headers) {
        o = o.with_headers(v.clone());
    }
    if let Some(v) = p.delivery_mode().filter(|_| !omit.delivery_mode) {
        o = o.with_delivery_mode(v);
    }
    if let Some(v) = p.priority() {
        o = o.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        o = o.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        o = o.with_reply_to(v.clone());
    }
    if let Some(v) = p.expiration().as_ref().filter(|_| !omit.expiration) {
        o = o.with_expiration(v.clone());
    }
    if let Some(v) = p.message_id().as_ref().filter(|_| !omit.message_id) {
        o = o.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        o = o.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        o = o.with_type(v.clone());
    }
    if let Some(v) = p.user_id().as_ref().filter(|_| !omit.user_id) {
        o = o.with_user_id(v.clone());
    }
    if let Some(v) = p.app_id() {
        o = o.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        o = o.with_cluster_id(v.clone());
    }
    o
}

/// Properties for anything a worker re-publishes (retry, park, forward): `headers` replaced,
/// `expiration` dropped (it would make a scheduled copy fail and a parked copy vanish:
/// DESIGN rule 1) and `user_id` dropped (the broker refuses a publish whose user_id is not the
/// connection's user: DESIGN rule 15).
pub(crate) fn republish_properties(p: &BasicProperties, headers: FieldTable) -> BasicProperties {
    copy_properties(
        p,
        Omit {
            headers: true,
            expiration: true,
            user_id: true,
            ..Omit::default()
        },
    )
    .with_headers(headers)
}

/// Headers for re-scheduling a message owned by `owner`: the original ones without the
/// broker's death history (DESIGN rule 3: a retry revisits tiers it has seen), `CC` and `BCC`
/// (DESIGN rule 14), our schedule headers (set again by the publisher) and parking headers,
/// naming its owner ([`headers::OWNER`]) for whoever reads the copy.
pub(crate) fn headers_for_reschedule(
    original: Option<&FieldTable>,
    owner: Option<&str>,
) -> FieldTable {
    let empty = FieldTable::default();
    let mut h = headers::filter(original.unwrap_or(&empty), |k| {
        !headers::is_broker_header(k)
            && !headers::RESERVED.contains(&k)
            && k != headers::OWNER
            && !k.starts_with(headers::PARKED_PREFIX)
    });
    if let Some(owner) = owner {
        h.insert(headers::OWNER.into(), AMQPValue::LongString(owner.into()));
    }
    h
}

/// The owner a copy names ([`headers::OWNER`]), if it names one as a string.
pub(crate) fn owner_header(p: &BasicProperties) -> Option<String> {
    match p.headers().as_ref()?.inner().get(headers::OWNER)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::PARKED_REASON;
    use lapin::types::LongString;

    fn ok((d, invalid): (Delivery, Option<String>)) -> Delivery {
        assert_eq!(invalid, None);
        d
    }

    fn props(h: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut t = FieldTable::default();
        for (k, v) in h {
            t.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(t)
    }

    #[test]
    fn decodes_our_headers_of_any_integer_width() {
        let p = props(&[
            (ATTEMPT, AMQPValue::ShortShortUInt(2)),
            (DUE_AT, AMQPValue::LongLongInt(99)),
        ]);
        let d = ok(decode("q", vec![], p, "0.0.q", "x", true));
        assert_eq!((d.attempt, d.due_at_ms, d.redelivered), (2, Some(99), true));
        // a plain message that never went through amqp-delay is fine
        let d = ok(decode(
            "q",
            vec![],
            BasicProperties::default(),
            "q",
            "",
            false,
        ));
        assert_eq!((d.attempt, d.due_at_ms), (0, None));
    }

    #[test]
    fn wrong_types_are_reasons_not_crashes() {
        let p = props(&[(ATTEMPT, AMQPValue::LongString(LongString::from("two")))]);
        let reason = decode("q", vec![], p, "q", "", false).1.unwrap();
        assert_eq!(
            reason,
            "invalid envelope: header 'x-delay-attempt' must be an integer, got a string"
        );
        let p = props(&[(DUE_AT, AMQPValue::LongInt(-5))]);
        assert!(
            decode("q", vec![], p, "q", "", false)
                .1
                .unwrap()
                .contains("negative")
        );
    }

    #[test]
    fn original_routing_key() {
        let d = ok(decode(
            "orders.timeout",
            vec![],
            BasicProperties::default(),
            "0.1.f.orders.timeout",
            "",
            false,
        ));
        assert_eq!(d.original_routing_key(3), "orders.timeout");
        let p = props(&[(ROUTING_KEY, AMQPValue::LongString(LongString::from("a.b")))]);
        let d = ok(decode("q", vec![], p, "0.0.0.q", "", false));
        assert_eq!(d.original_routing_key(3), "a.b");
    }

    #[test]
    fn republished_copies_drop_expiration_and_user_id_only() {
        let p = BasicProperties::default()
            .with_expiration("5000".into())
            .with_user_id("someone-else".into())
            .with_correlation_id("c".into())
            .with_priority(3)
            .with_app_id("shop".into());
        let out = republish_properties(&p, FieldTable::default());
        assert!(out.expiration().is_none() && out.user_id().is_none());
        assert_eq!(out.correlation_id().as_ref().unwrap().as_str(), "c");
        assert_eq!(
            (*out.priority(), out.app_id().as_ref().unwrap().as_str()),
            (Some(3), "shop")
        );
    }

    #[test]
    fn reschedule_headers_drop_history_and_ours() {
        let p = props(&[
            ("x-death", AMQPValue::Void),
            ("x-delivery-count", AMQPValue::LongInt(2)),
            (ATTEMPT, AMQPValue::LongInt(1)),
            (PARKED_REASON, AMQPValue::Void),
            (headers::OWNER, AMQPValue::LongString("earlier".into())),
            ("app", AMQPValue::Boolean(true)),
        ]);
        let h = headers_for_reschedule(p.headers().as_ref(), None);
        assert_eq!(
            h.inner().keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            ["app"]
        );
        // the copy names the owner the worker knows, never the one it was handed
        let h = headers_for_reschedule(p.headers().as_ref(), Some("alice"));
        let copy = BasicProperties::default().with_headers(h);
        assert_eq!(owner_header(&copy).as_deref(), Some("alice"));
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use lapin::types::{LongString, ShortString};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Whatever our headers hold, decoding gives a delivery (with a reason when they are
        /// wrong), never a panic.
        #[test]
        fn any_header_values_decode_or_give_a_reason(
            attempt in any::<i64>(), due in any::<i64>(), text in ".{0,40}", pick in 0u8..4,
            id in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut t = FieldTable::default();
            t.insert(ATTEMPT.into(), AMQPValue::LongLongInt(attempt));
            t.insert(DUE_AT.into(), match pick {
                0 => AMQPValue::LongLongInt(due),
                1 => AMQPValue::LongString(LongString::from(text.as_str())),
                2 => AMQPValue::Double(due as f64),
                _ => AMQPValue::Void,
            });
            t.insert(ROUTING_KEY.into(), AMQPValue::LongString(LongString::from(text.as_str())));
            let mut p = BasicProperties::default().with_headers(t);
            if let Ok(s) = ShortString::try_new(String::from_utf8_lossy(&id).into_owned()) {
                p = p.with_message_id(s);
            }
            let (d, _) = decode("q", vec![], p, &text, "", false);
            let _ = d.original_routing_key(3);
        }
    }
}
