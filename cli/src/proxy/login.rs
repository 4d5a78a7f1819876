//! Who a client is, from its `connection.start-ok` (pure: no I/O): the user of the SASL
//! mechanisms whose response names it the way the broker reads it, PLAIN (`\0user\0password`)
//! and AMQPLAIN (the `LOGIN` field). The password is never kept: only the user leaves here.
//! The broker checks the password; a response it refuses opens no connection, so a user read
//! here is the one the broker logged in whenever the connection opens.

use amq_protocol::types::AMQPValue;
use amq_protocol::types::parsing::{parse_short_string, parse_value};

/// The user a client logs in as with `mechanism` and SASL `response`, or `None` when the proxy
/// cannot know it (EXTERNAL: a certificate's name; any other mechanism; a response the broker
/// would refuse).
pub fn user_of(mechanism: &str, response: &[u8]) -> Option<String> {
    let user = match mechanism {
        "PLAIN" => plain_user(response)?,
        "AMQPLAIN" => amqplain_user(response)?,
        _ => return None,
    };
    String::from_utf8(user.to_vec())
        .ok()
        .filter(|u| !u.is_empty())
}

/// PLAIN as RabbitMQ reads it: a NUL, the user up to the next NUL, a NUL, the password to the
/// end (no NUL in it, no authorization identity before the user).
fn plain_user(response: &[u8]) -> Option<&[u8]> {
    let rest = response.strip_prefix(&[0])?;
    let end = rest.iter().position(|b| *b == 0)?;
    let (user, password) = (&rest[..end], &rest[end + 1..]);
    (!password.contains(&0)).then_some(user)
}

/// AMQPLAIN: a field table without its length, whose first `LOGIN` names the user (RabbitMQ
/// takes the first). Only a table of long strings is read, the one shape every client sends,
/// so that no difference between two parsers of the other field types can name another user.
fn amqplain_user(response: &[u8]) -> Option<&[u8]> {
    let mut rest = response;
    let mut user = None;
    while !rest.is_empty() {
        let (after, name) = parse_short_string(rest).ok()?;
        if after.first() != Some(&b'S') {
            return None;
        }
        let (after, value) = parse_value(after).ok()?;
        let AMQPValue::LongString(text) = value else {
            return None;
        };
        if user.is_none() && name.as_str() == "LOGIN" {
            // the same bytes, borrowed from the response
            let len = text.as_bytes().len();
            let start = response.len() - after.len() - len;
            user = Some(&response[start..start + len]);
        }
        rest = after;
    }
    user
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::auth::{Credentials, SASLMechanism};

    fn response(mechanism: SASLMechanism, user: &str, password: &str) -> Vec<u8> {
        Credentials::new(user.into(), password.into())
            .sasl_auth_string(mechanism)
            .as_bytes()
            .to_vec()
    }

    #[test]
    fn plain_and_amqplain_name_the_user_as_clients_send_them() {
        let plain = response(SASLMechanism::Plain, "app-a", "s3cret");
        assert_eq!(user_of("PLAIN", &plain).as_deref(), Some("app-a"));
        let amqplain = response(SASLMechanism::AMQPlain, "app-b", "s3cret");
        assert_eq!(user_of("AMQPLAIN", &amqplain).as_deref(), Some("app-b"));
        assert_eq!(user_of("EXTERNAL", b""), None, "a certificate's name");
        assert_eq!(user_of("RABBIT-CR-DEMO", b"app-a"), None);
    }

    #[test]
    fn responses_the_broker_refuses_name_nobody() {
        for bad in [
            &b"app-a\0s3cret"[..],
            b"authz\0app-a\0s3cret",
            b"\0app-a\0s3c\0ret",
            b"\0app-a",
            b"\0\0s3cret",
            b"",
            b"\0\xff\xfe\0pw",
        ] {
            assert_eq!(user_of("PLAIN", bad), None, "{bad:?}");
        }
        // AMQPLAIN: only long strings, read to the end; the first LOGIN counts
        let table = |entries: &[(&str, u8, &[u8])]| {
            let mut out = Vec::new();
            for (name, kind, value) in entries {
                out.push(name.len() as u8);
                out.extend_from_slice(name.as_bytes());
                out.push(*kind);
                if *kind == b'S' {
                    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
                }
                out.extend_from_slice(value);
            }
            out
        };
        let two = table(&[("LOGIN", b'S', b"first"), ("LOGIN", b'S', b"second")]);
        assert_eq!(user_of("AMQPLAIN", &two).as_deref(), Some("first"));
        let other_type = table(&[("X", b't', &[1]), ("LOGIN", b'S', b"u")]);
        assert_eq!(user_of("AMQPLAIN", &other_type), None);
        let mut cut = table(&[("LOGIN", b'S', b"user")]);
        cut.pop();
        assert_eq!(user_of("AMQPLAIN", &cut), None);
        assert_eq!(
            user_of("AMQPLAIN", &table(&[("PASSWORD", b'S', b"p")])),
            None
        );
    }
}
