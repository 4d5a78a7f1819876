//! The `x-delay` rules, pure: reading the plugin's header ([`parse_x_delay`]), moving what the
//! tiers must not carry into `x-delay-*` headers at the ingress ([`stash`]), and rebuilding the
//! message as the application published it at the due stage ([`restore`]).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::envelope::{Omit, copy_properties};
use crate::headers::{
    self, ADDED_USER_ID, BCC, CC, DELIVERY_MODE, EXPIRATION, INVALID, NO_HEADERS, NO_MESSAGE_ID,
    ROUTING_KEY, USER_ID, X_DELAY, is_ours,
};

/// The broker's copy headers and where they wait in the tiers.
const STASHED_ROUTES: [(&str, &str); 2] = [("CC", CC), ("BCC", BCC)];

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(lapin::types::LongString::from(s))
}

fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::ByteArray(_) => "a byte array",
        AMQPValue::Timestamp(_) => "a timestamp",
        AMQPValue::Void => "void",
        _ => "a value of another type",
    }
}

fn parse_int_text(bytes: &[u8]) -> Result<i128, String> {
    let shown = String::from_utf8_lossy(bytes);
    let shown: String = shown.chars().take(40).collect();
    std::str::from_utf8(bytes)
        .ok()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .and_then(|t| t.parse::<i128>().ok())
        .ok_or_else(|| format!("x-delay '{shown}' is not an integer number of milliseconds"))
}

/// Milliseconds of a fractional delay, rounded up (never early).
fn float_ms(f: f64) -> Result<i128, String> {
    if !f.is_finite() {
        return Err(format!("x-delay {f} is not a number of milliseconds"));
    }
    if f <= 0.0 {
        return Ok(0);
    }
    let c = f.ceil();
    Ok(if c >= i128::MAX as f64 {
        i128::MAX
    } else {
        c as i128
    })
}

/// The delay an `x-delay` header asks for, as the plugin reads it: absent, zero or negative →
/// no delay; any integer type; an integer in a string (`"1500"`); a float or decimal (the plugin
/// truncates, we round up so a message is never early). Anything else, and a delay over
/// `max_delay_ms`, is refused with a reason (the plugin would deliver it at once).
pub fn parse_x_delay(value: Option<&AMQPValue>, max_delay_ms: u64) -> Result<u64, String> {
    let Some(v) = value else { return Ok(0) };
    let ms: i128 = match v {
        AMQPValue::LongString(s) => parse_int_text(s.as_bytes())?,
        AMQPValue::ShortString(s) => parse_int_text(s.as_str().as_bytes())?,
        AMQPValue::Float(f) => float_ms(f64::from(*f))?,
        AMQPValue::Double(f) => float_ms(*f)?,
        AMQPValue::DecimalValue(d) => {
            float_ms(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))?
        }
        AMQPValue::Timestamp(_) => {
            return Err("x-delay is a timestamp, not a number of milliseconds".into());
        }
        other => match headers::as_int(other) {
            Some(n) => i128::from(n),
            None => {
                return Err(format!(
                    "x-delay is {}, not a number of milliseconds",
                    type_name(other)
                ));
            }
        },
    };
    if ms <= 0 {
        return Ok(0);
    }
    if ms > i128::from(max_delay_ms) {
        return Err(format!(
            "x-delay {ms} ms is longer than the longest delay this gateway accepts ({max_delay_ms} ms, topology.max_delay)"
        ));
    }
    Ok(ms as u64)
}

/// Properties for the trip through the tiers: the application's, with what the tiers must not
/// carry moved into headers — the routing key, `expiration` (it would expire inside a tier,
/// DESIGN rule 1), `delivery_mode` (the tiers are persistent), `user_id` (see the module doc;
/// DESIGN rule 15), `CC` and `BCC` (the broker would route a copy per key at every hop,
/// docs/DESIGN.md rule 14), and markers for an absent `message_id` (the publisher generates
/// one) or `headers` table. `x-delay-*` headers the application set, `x-opt-delivery-time`
/// (the broker's native delay, which would delay the message again at the target:
/// DESIGN rule 16) and those the broker adds (`x-death` history, `x-delivery-count`:
/// DESIGN rule 3) are removed. `invalid` is the reason the message must be parked instead of
/// delivered.
pub(crate) fn stash(
    p: &BasicProperties,
    routing_key: &str,
    invalid: Option<&str>,
) -> BasicProperties {
    let empty = FieldTable::default();
    let app = p.headers().as_ref().unwrap_or(&empty);
    let mut h = headers::filter(app, |k| {
        !headers::is_reserved(k) && !headers::is_broker_header(k)
    });
    for (theirs, ours) in STASHED_ROUTES {
        if let Some(v) = app.inner().get(theirs) {
            h.insert(ours.into(), v.clone());
        }
    }
    h.insert(ROUTING_KEY.into(), long_string(routing_key));
    if let Some(e) = p.expiration() {
        h.insert(EXPIRATION.into(), long_string(e.as_str()));
    }
    if let Some(m) = p.delivery_mode() {
        h.insert(DELIVERY_MODE.into(), AMQPValue::ShortShortUInt(*m));
    }
    // one `delay-proxy` added for its client is not the application's: not delivered
    if let Some(u) = p.user_id()
        && !app.contains_key(ADDED_USER_ID)
    {
        h.insert(USER_ID.into(), long_string(u.as_str()));
    }
    if p.message_id().is_none() {
        h.insert(NO_MESSAGE_ID.into(), AMQPValue::Boolean(true));
    }
    if p.headers().is_none() {
        h.insert(NO_HEADERS.into(), AMQPValue::Boolean(true));
    }
    if let Some(reason) = invalid {
        h.insert(INVALID.into(), long_string(reason));
    }
    copy_properties(
        p,
        Omit {
            expiration: true,
            user_id: true,
            delivery_mode: true,
            ..Omit::default()
        },
    )
    .with_headers(h)
}

pub(crate) fn text_header(h: &FieldTable, name: &str) -> Result<Option<String>, String> {
    match h.inner().get(name) {
        None => Ok(None),
        Some(AMQPValue::LongString(s)) => Ok(Some(String::from_utf8_lossy(s.as_bytes()).into())),
        Some(AMQPValue::ShortString(s)) => Ok(Some(s.as_str().to_string())),
        Some(_) => Err(format!("header '{name}' is not a string")),
    }
}

fn short(name: &str, v: String) -> Result<ShortString, String> {
    ShortString::try_new(v).map_err(|_| format!("header '{name}' is longer than 255 bytes"))
}

/// The message as the application published it, from a due message: its original routing key
/// and properties, the `expiration` and `delivery_mode` it had, its `CC` and `BCC` back (the
/// broker routes them once, at the target, as the plugin does), no `message_id` or `headers`
/// if it had none, our `x-delay-*` headers (but [`USER_ID`]) and the broker's (`x-death`
/// history, `x-delivery-count`: DESIGN rule 3) removed,
/// and `x-delay` rewritten to minus the delay when there was one, a signed 32-bit integer
/// whatever type was sent (one queue type cannot be matched for all: the 3.10 plugin does this in
/// a quorum queue and leaves `x-delay` as sent in a classic one, 4.0's writes a 64-bit integer
/// in both; docs/MIGRATING.md); a zero or negative `x-delay` is left as it was. An error names
/// what is missing or malformed.
pub(crate) fn restore(p: &BasicProperties) -> Result<(String, BasicProperties), String> {
    let empty = FieldTable::default();
    let h = p.headers().as_ref().unwrap_or(&empty);
    let key = text_header(h, ROUTING_KEY)?.ok_or_else(|| {
        format!(
            "header '{}' is missing: the message did not come through a gateway ingress",
            ROUTING_KEY
        )
    })?;
    if key.len() > 255 {
        return Err(format!("header '{}' is longer than 255 bytes", ROUTING_KEY));
    }
    let expiration = text_header(h, EXPIRATION)?;
    let delivery_mode = match h.inner().get(DELIVERY_MODE) {
        None => None,
        Some(v) => match headers::as_int(v).and_then(|n| u8::try_from(n).ok()) {
            Some(m) => Some(m),
            None => return Err(format!("header '{DELIVERY_MODE}' is not a delivery mode")),
        },
    };
    let had_headers = !h.contains_key(NO_HEADERS);
    let had_message_id = !h.contains_key(NO_MESSAGE_ID);
    // accepted at the ingress (under the limit of that time)
    let delay = parse_x_delay(h.inner().get(X_DELAY), u64::MAX)?;
    let mut out = headers::filter(h, |k| {
        (!is_ours(k) || k == USER_ID) && !headers::is_broker_header(k)
    });
    for (theirs, ours) in STASHED_ROUTES {
        if let Some(v) = h.inner().get(ours) {
            out.insert(theirs.into(), v.clone());
        }
    }
    if delay > 0 {
        let neg = -(delay as i64);
        let v = match i32::try_from(neg) {
            Ok(n) => AMQPValue::LongInt(n), // the plugin's type (signedint)
            Err(_) => AMQPValue::LongLongInt(neg),
        };
        out.insert(X_DELAY.into(), v);
    }
    let mut props = copy_properties(
        p,
        Omit {
            headers: true,
            delivery_mode: true,
            expiration: true,
            message_id: !had_message_id,
            user_id: true,
        },
    );
    if had_headers || !out.inner().is_empty() {
        props = props.with_headers(out);
    }
    if let Some(e) = expiration {
        props = props.with_expiration(short(EXPIRATION, e)?);
    }
    if let Some(m) = delivery_mode {
        props = props.with_delivery_mode(m);
    }
    Ok((key, props))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{DecimalValue, FieldArray, LongString};

    const MAX: u64 = 10_000;

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v))
    }

    #[test]
    fn x_delay_like_the_plugin() {
        assert_eq!(parse_x_delay(None, MAX), Ok(0));
        for v in [
            AMQPValue::LongInt(1500),
            AMQPValue::LongLongInt(1500),
            AMQPValue::ShortUInt(1500),
            AMQPValue::LongUInt(1500),
            s("1500"),
            s(" 1500 "),
            s("+1500"),
            AMQPValue::ShortString("1500".into()),
            AMQPValue::Double(1500.0),
            AMQPValue::Float(1499.5),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 1,
                value: 14_991,
            }),
        ] {
            assert_eq!(parse_x_delay(Some(&v), MAX), Ok(1500), "{v:?}");
        }
        for v in [
            AMQPValue::LongInt(0),
            AMQPValue::LongInt(-5),
            AMQPValue::ShortShortInt(-1),
            s("-200"),
            s("0"),
            AMQPValue::Double(-3.5),
        ] {
            assert_eq!(parse_x_delay(Some(&v), MAX), Ok(0), "{v:?}");
        }
    }

    #[test]
    fn bad_x_delay_is_a_reason() {
        let e = parse_x_delay(Some(&s("abc")), MAX).unwrap_err();
        assert_eq!(e, "x-delay 'abc' is not an integer number of milliseconds");
        assert!(parse_x_delay(Some(&s("")), MAX).is_err());
        assert!(parse_x_delay(Some(&s("15.5")), MAX).is_err());
        let e = parse_x_delay(Some(&AMQPValue::Boolean(true)), MAX).unwrap_err();
        assert!(e.contains("boolean"), "{e}");
        assert!(parse_x_delay(Some(&AMQPValue::Void), MAX).is_err());
        assert!(parse_x_delay(Some(&AMQPValue::Timestamp(5)), MAX).is_err());
        assert!(parse_x_delay(Some(&AMQPValue::Double(f64::NAN)), MAX).is_err());
        assert!(parse_x_delay(Some(&AMQPValue::FieldArray(FieldArray::default())), MAX).is_err());
        let e = parse_x_delay(Some(&AMQPValue::LongInt(10_001)), MAX).unwrap_err();
        assert!(
            e.contains("10001 ms is longer") && e.contains("10000 ms"),
            "{e}"
        );
        assert!(parse_x_delay(Some(&s("99999999999999999999999")), MAX).is_err());
        assert!(parse_x_delay(Some(&AMQPValue::Double(1e300)), MAX).is_err());
        assert_eq!(
            parse_x_delay(Some(&AMQPValue::LongInt(10_000)), MAX),
            Ok(10_000)
        );
    }

    fn app_props() -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert(X_DELAY.into(), AMQPValue::LongInt(1500));
        h.insert("app".into(), s("v"));
        h.insert("n".into(), AMQPValue::LongLongInt(-7));
        h.insert("x-death".into(), AMQPValue::Void);
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1));
        h.insert("x-delay-attempt".into(), AMQPValue::LongInt(9));
        h.insert(
            headers::NATIVE_DELIVERY_TIME.into(),
            AMQPValue::LongLongInt(1_900_000_000_000),
        );
        h.insert(
            "CC".into(),
            AMQPValue::FieldArray(vec![s("b.q"), s("jobs")].into()),
        );
        h.insert("BCC".into(), AMQPValue::FieldArray(vec![s("audit")].into()));
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_headers(h)
            .with_delivery_mode(1)
            .with_priority(3)
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_message_id("m".into())
            .with_timestamp(42)
            .with_type("t".into())
            .with_user_id("alice".into())
            .with_app_id("a".into())
    }

    /// What the publisher does to the properties in the tiers.
    fn through_tiers(p: BasicProperties, generated_id: &str) -> BasicProperties {
        let mut h = p.headers().clone().unwrap();
        headers::set_schedule_headers(&mut h, 1500, 99, 0);
        h.insert("x-death".into(), AMQPValue::Void);
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
        let id = p
            .message_id()
            .clone()
            .unwrap_or_else(|| generated_id.into());
        p.with_message_id(id).with_delivery_mode(2).with_headers(h)
    }

    #[test]
    fn stash_keeps_the_tiers_clean() {
        let t = stash(&app_props(), "orders.eu", None);
        assert_eq!(t.expiration(), &None);
        assert_eq!(t.user_id(), &None);
        assert_eq!(t.delivery_mode(), &None);
        let h = t.headers().clone().unwrap();
        assert_eq!(h.inner().get(ROUTING_KEY), Some(&s("orders.eu")));
        assert_eq!(h.inner().get(EXPIRATION), Some(&s("60000")));
        assert_eq!(h.inner().get(USER_ID), Some(&s("alice")));
        for gone in [
            "x-death",
            "x-delivery-count",
            "x-delay-attempt",
            headers::NATIVE_DELIVERY_TIME,
            "CC",
            "BCC",
        ] {
            assert!(!h.contains_key(gone), "{gone}");
        }
        // the copy headers wait in ours, for the target
        assert!(
            matches!(h.inner().get(CC), Some(AMQPValue::FieldArray(a)) if a.as_slice().len() == 2)
        );
        assert!(
            matches!(h.inner().get(BCC), Some(AMQPValue::FieldArray(a)) if a.as_slice().len() == 1)
        );
        assert!(!h.contains_key(NO_MESSAGE_ID) && !h.contains_key(NO_HEADERS));
        // none of the schedule headers the publisher sets itself
        for ours in headers::RESERVED {
            assert!(!h.contains_key(ours), "{ours}");
        }
    }

    #[test]
    fn restore_gives_back_what_was_published() {
        let original = app_props();
        let tiers = through_tiers(stash(&original, "orders.eu", None), "gen");
        let (key, p) = restore(&tiers).unwrap();
        assert_eq!(key, "orders.eu");
        let mut want_h = FieldTable::default();
        want_h.insert(X_DELAY.into(), AMQPValue::LongInt(-1500));
        want_h.insert("app".into(), s("v"));
        want_h.insert("n".into(), AMQPValue::LongLongInt(-7));
        want_h.insert(USER_ID.into(), s("alice"));
        want_h.insert(
            "CC".into(),
            AMQPValue::FieldArray(vec![s("b.q"), s("jobs")].into()),
        );
        want_h.insert("BCC".into(), AMQPValue::FieldArray(vec![s("audit")].into()));
        let mut want = copy_properties(
            &original,
            Omit {
                user_id: true,
                ..Omit::default()
            },
        );
        want = want.with_headers(want_h);
        assert_eq!(p, want);
    }

    #[test]
    fn a_user_id_delay_proxy_added_is_not_delivered() {
        // the proxy's client set no user_id: the proxy named its login, for the writer check
        let mut h = FieldTable::default();
        h.insert(X_DELAY.into(), AMQPValue::LongInt(500));
        let original = BasicProperties::default().with_headers(h.clone());
        h.insert(ADDED_USER_ID.into(), AMQPValue::Boolean(true));
        let proxied = original
            .clone()
            .with_user_id("app-a".into())
            .with_headers(h);
        let tiers = stash(&proxied, "k", None);
        let th = tiers.headers().clone().unwrap_or_default();
        assert!(!th.contains_key(USER_ID) && !th.contains_key(ADDED_USER_ID));
        let (_, p) = restore(&through_tiers(tiers, "g")).unwrap();
        let mut want = FieldTable::default();
        want.insert(X_DELAY.into(), AMQPValue::LongInt(-500));
        assert_eq!(p, BasicProperties::default().with_headers(want));
    }

    #[test]
    fn restore_keeps_absent_things_absent() {
        let original = BasicProperties::default();
        let tiers = through_tiers(stash(&original, "k", None), "generated");
        let (key, p) = restore(&tiers).unwrap();
        assert_eq!((key.as_str(), p), ("k", BasicProperties::default()));
        // an empty table stays an empty table; zero and negative x-delay are kept as sent
        for x in [AMQPValue::LongInt(0), AMQPValue::LongInt(-30), s("-5")] {
            let mut h = FieldTable::default();
            h.insert(X_DELAY.into(), x.clone());
            let original = BasicProperties::default().with_headers(h);
            let (_, p) = restore(&through_tiers(stash(&original, "", None), "g")).unwrap();
            assert_eq!(p, original, "{x:?}");
        }
        let original = BasicProperties::default().with_headers(FieldTable::default());
        let (_, p) = restore(&through_tiers(stash(&original, "", None), "g")).unwrap();
        assert_eq!(p, original);
    }

    #[test]
    fn string_delays_become_the_plugins_negative_integer() {
        let mut h = FieldTable::default();
        h.insert(X_DELAY.into(), s("1500"));
        let original = BasicProperties::default().with_headers(h);
        let (_, p) = restore(&through_tiers(stash(&original, "k", None), "g")).unwrap();
        let got = p.headers().clone().unwrap();
        assert_eq!(got.inner().get(X_DELAY), Some(&AMQPValue::LongInt(-1500)));
        // beyond 32 bits the negative delay is a 64-bit integer
        let mut h = FieldTable::default();
        h.insert(X_DELAY.into(), AMQPValue::LongLongInt(5_000_000_000));
        let original = BasicProperties::default().with_headers(h);
        let (_, p) = restore(&through_tiers(stash(&original, "k", None), "g")).unwrap();
        let got = p.headers().clone().unwrap();
        assert_eq!(
            got.inner().get(X_DELAY),
            Some(&AMQPValue::LongLongInt(-5_000_000_000))
        );
    }

    #[test]
    fn restore_refuses_foreign_messages() {
        let e = restore(&BasicProperties::default()).unwrap_err();
        assert!(e.contains("x-delay-routing-key"), "{e}");
        let mut h = FieldTable::default();
        h.insert(ROUTING_KEY.into(), AMQPValue::LongInt(3));
        let e = restore(&BasicProperties::default().with_headers(h)).unwrap_err();
        assert!(e.contains("not a string"), "{e}");
    }

    #[test]
    fn invalid_reason_travels_in_a_header() {
        let t = stash(&app_props(), "k", Some("x-delay 'abc' is not ..."));
        let h = t.headers().clone().unwrap();
        assert_eq!(h.inner().get(INVALID), Some(&s("x-delay 'abc' is not ...")));
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use lapin::types::{DecimalValue, LongString};
    use proptest::prelude::*;

    fn any_value() -> impl Strategy<Value = AMQPValue> {
        prop_oneof![
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            any::<i32>().prop_map(AMQPValue::LongInt),
            any::<u32>().prop_map(AMQPValue::LongUInt),
            any::<f64>().prop_map(AMQPValue::Double),
            any::<f32>().prop_map(AMQPValue::Float),
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<u64>().prop_map(AMQPValue::Timestamp),
            (any::<u8>(), any::<u32>())
                .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
            proptest::collection::vec(any::<u8>(), 0..64)
                .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
            Just(AMQPValue::Void),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Any x-delay value is a delay or a reason, never a panic, and never above the limit.
        #[test]
        fn any_x_delay_is_a_delay_or_a_reason(v in any_value(), max in 0u64..u64::MAX) {
            if let Ok(ms) = parse_x_delay(Some(&v), max) {
                prop_assert!(ms <= max);
            }
        }

        /// Any headers at the due stage restore or give a reason, never a panic.
        #[test]
        fn any_headers_restore_or_say_why(
            entries in proptest::collection::vec(
                (prop_oneof![Just(ROUTING_KEY.to_string()), Just(EXPIRATION.to_string()),
                             Just(DELIVERY_MODE.to_string()), Just(X_DELAY.to_string()),
                             Just(USER_ID.to_string()), ".{0,20}"], any_value()),
                0..8)
        ) {
            let mut h = FieldTable::default();
            for (k, v) in entries {
                if let Ok(k) = ShortString::try_new(k) {
                    h.insert(k, v);
                }
            }
            let _ = restore(&BasicProperties::default().with_headers(h));
        }
    }
}
