//! The bulk input format of `delay-publisher send --jsonl`: one JSON object per line, turned
//! into a [`Message`] or a reason why not. Pure.
//!
//! `{"queue": "orders.timeout", "delay_ms": 1500 | "delay": "1m30s", "body": "...",
//!   "id": "...", "content_type": "...", "headers": {...}}`
//!
//! `body` may be a string (sent as its UTF-8 bytes) or any other JSON value (sent as compact
//! JSON with content type `application/json` unless one is given).

use serde::Deserialize;

use amqp_delay::Message;
use amqp_delay::headers;
use amqp_delay::time::parse_duration_ms;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    queue: String,
    #[serde(default)]
    delay_ms: Option<serde_json::Value>,
    #[serde(default)]
    delay: Option<serde_json::Value>,
    body: serde_json::Value,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    headers: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Parses one line. `Ok(None)` for a blank line.
pub fn parse_line(line: &str) -> Result<Option<Message>, String> {
    if line.trim().is_empty() {
        return Ok(None);
    }
    let l: Line = serde_json::from_str(line).map_err(|e| format!("not a valid request: {e}"))?;
    let delay_ms = match (&l.delay_ms, &l.delay) {
        (Some(_), Some(_)) => return Err("give either 'delay_ms' or 'delay', not both".into()),
        (None, None) => return Err("missing 'delay_ms' or 'delay'".into()),
        (Some(v), None) => match v {
            serde_json::Value::Number(n) => match n.as_u64() {
                Some(ms) => ms,
                None if n.as_i64().is_some() => {
                    return Err(format!("'delay_ms' must not be negative, got {n}"));
                }
                None => return Err(format!("'delay_ms' must be a whole number of ms, got {n}")),
            },
            other => return Err(format!("'delay_ms' must be an integer, got {other}")),
        },
        (None, Some(v)) => match v {
            serde_json::Value::String(s) => {
                parse_duration_ms(s).map_err(|e| format!("'delay': {e}"))?
            }
            serde_json::Value::Number(n) if n.as_u64().is_some() => n.as_u64().unwrap_or(0),
            other => {
                return Err(format!(
                    "'delay' must be a duration string such as \"1m30s\", got {other}"
                ));
            }
        },
    };
    let (body, default_ct) = match l.body {
        serde_json::Value::String(s) => (s.into_bytes(), None),
        v => (v.to_string().into_bytes(), Some("application/json")),
    };
    let mut m = Message::new(l.queue, delay_ms, body);
    if let Some(ct) = l.content_type.as_deref().or(default_ct) {
        m = m.with_content_type(ct);
    }
    if let Some(id) = l.id {
        if id.is_empty() || id.len() > 255 {
            return Err("'id' must be 1 to 255 bytes".into());
        }
        m = m.with_id(id);
    }
    if let Some(h) = l.headers {
        // as `send --header =v`: a header needs a name
        if h.contains_key("") {
            return Err("'headers' has an empty header name; every header needs a name".into());
        }
        m = m.with_headers(headers::json_to_table(&h)?);
    }
    // the body's size is the publisher's to check (its limit is configured)
    m.check(usize::MAX)?;
    Ok(Some(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_lines() {
        let m = parse_line(r#"{"queue":"a.b","delay":"1m30s","body":"hi","id":"x1"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            (m.destination.as_str(), m.delay_ms, m.body.as_slice()),
            ("a.b", 90_000, &b"hi"[..])
        );
        assert_eq!(m.properties.message_id().as_ref().unwrap().as_str(), "x1");
        let m = parse_line(r#"{"queue":"q","delay_ms":1500,"body":{"order":42}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(m.body, br#"{"order":42}"#);
        assert_eq!(
            m.properties.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert!(parse_line("   ").unwrap().is_none());
    }

    #[test]
    fn bad_lines_say_why() {
        let cases = [
            ("not json", "not a valid request"),
            (
                r#"{"queue":"q","body":"x"}"#,
                "missing 'delay_ms' or 'delay'",
            ),
            (
                r#"{"queue":"q","delay_ms":-5,"body":"x"}"#,
                "must not be negative",
            ),
            (
                r#"{"queue":"q","delay":"soon","body":"x"}"#,
                "invalid duration 'soon'",
            ),
            (
                r#"{"queue":"q","delay_ms":1,"delay":"1s","body":"x"}"#,
                "not both",
            ),
            (
                r#"{"queue":"q","delay_ms":1,"body":"x","colour":1}"#,
                "unknown field",
            ),
            (
                r#"{"queue":"q","delay_ms":1,"body":"x","headers":{"x-delay-ms":1}}"#,
                "reserved",
            ),
            (
                r#"{"queue":"q","delay_ms":1,"body":"x","headers":{"":"v"}}"#,
                "empty header name",
            ),
            (
                r#"{"queue":"q","delay_ms":1,"body":"x","headers":{"a":1,"":null}}"#,
                "empty header name",
            ),
        ];
        for (line, want) in cases {
            let e = parse_line(line).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Whatever a line holds, parsing gives a message or a reason, never a panic.
        #[test]
        fn arbitrary_lines_never_panic(line in ".{0,400}") {
            let _ = parse_line(&line);
        }

        /// JSON-shaped lines with every field of the right or wrong type and any length.
        #[test]
        fn arbitrary_json_lines_never_panic(
            queue in ".{0,300}",
            delay in prop_oneof![Just(serde_json::json!(5)), Just(serde_json::json!(-1)),
                                 Just(serde_json::json!("1s")), Just(serde_json::json!(1.5)),
                                 Just(serde_json::json!(null)), Just(serde_json::json!(u64::MAX))],
            id in ".{0,300}",
            ct in ".{0,300}",
            hname in ".{0,300}",
        ) {
            let line = serde_json::json!({
                "queue": queue, "delay_ms": delay, "body": "b", "id": id,
                "content_type": ct, "headers": {hname: "v"},
            });
            let _ = parse_line(&line.to_string());
        }
    }
}
