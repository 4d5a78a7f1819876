//! What a caller schedules and what it gets back, pure: a [`Message`] (destination, delay, body,
//! properties) and the [`Scheduled`] confirmation with its route; and [`Message::check`], the
//! rules every input path (library, CLI, JSONL) shares: AMQP short strings within 255 bytes,
//! bounded body and headers, no `expiration`, the `x-delay-*` names and the broker's native
//! `x-opt-delivery-time` reserved.

use lapin::BasicProperties;
use lapin::types::{FieldTable, ShortString};

use crate::headers;
use crate::planner::Route;

/// The most header bytes (AMQP field-table encoding) a scheduled message may carry: a message
/// travelling alone carries them in its content header frame, which the broker's tier hops
/// grow by an `x-death` entry each, and which must stay within the negotiated `frame_max`
/// (128 KiB by default) or no consumer can receive it. Every connection we make negotiates at
/// least [`crate::endpoints::MIN_FRAME_MAX`] (this plus room for the rest), so the whole cap is
/// always usable.
pub(crate) const MAX_HEADER_BYTES: usize = 32 << 10;

/// A message to deliver to `destination` (a queue name) after `delay_ms`.
#[derive(Debug, Clone)]
pub struct Message {
    /// Destination queue.
    pub destination: String,
    /// Requested delay in milliseconds.
    pub delay_ms: u64,
    /// Body, delivered byte-for-byte.
    pub body: Vec<u8>,
    /// The caller's properties (content type, headers, correlation id, ...), kept as they are.
    /// `message_id` is generated (UUID v7) when absent; `delivery_mode` is always persistent.
    pub properties: BasicProperties,
    /// Delivery attempt written to `x-delay-attempt` (0 on first schedule).
    pub attempt: u32,
    /// What a builder method could not take (a string over 255 bytes), refused by
    /// [`Message::check`] instead of a panic.
    problem: Option<String>,
    /// Set by the worker and the gateway, which carry our own `x-delay-*` headers on.
    pub(crate) internal: bool,
    /// Whether the publisher journals it (not a worker's retry or a rescheduled copy: the
    /// journal already has them).
    pub(crate) journaled: bool,
    /// A gateway's message: the target exchange it is published to when due (journaled).
    pub(crate) target: Option<String>,
    /// Due at exactly this time (ms since the epoch) rather than `delay_ms` from its publish:
    /// a rescheduled copy, which its worker tells from the old copy by its due time.
    pub(crate) due_at: Option<u64>,
    /// An occurrence of this recurring schedule at this tick ([`Message::occurrence`]).
    pub(crate) occurrence: Option<(String, u64)>,
    /// A copy `transfer` moved from another cluster: journaled and counted as scheduled
    /// whatever its attempt (the new cluster's journal has not seen it).
    pub(crate) transferred: bool,
    /// The user it is scheduled for ([`Message::for_owner`]).
    pub(crate) for_owner: Option<String>,
}

impl Message {
    /// A message to `destination` after `delay_ms`, with default properties.
    pub fn new(destination: impl Into<String>, delay_ms: u64, body: impl Into<Vec<u8>>) -> Self {
        Message {
            destination: destination.into(),
            delay_ms,
            body: body.into(),
            properties: BasicProperties::default(),
            attempt: 0,
            problem: None,
            internal: false,
            journaled: true,
            target: None,
            due_at: None,
            occurrence: None,
            transferred: false,
            for_owner: None,
        }
    }
    /// Sets the message id (default: a generated UUID v7); 1 to 255 bytes.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        let id = id.into();
        match short("message id", id) {
            Ok(s) => self.properties = self.properties.with_message_id(s),
            Err(e) => self.problem = Some(e),
        }
        self
    }
    /// Schedules it for `owner` (1 to 255 bytes): named in `x-delay-owner` and in the journal,
    /// so it is that user's to list, cancel and purge. Believed only when the publishing user
    /// is an admin of the readers' `trust.admins` or their own user; anyone else's message
    /// stays its publisher's ([`crate::ops::trust`]).
    pub fn for_owner(mut self, owner: impl Into<String>) -> Self {
        let owner = owner.into();
        match short("owner", owner) {
            Ok(s) => self.for_owner = Some(s.to_string()),
            Err(e) => self.problem = Some(e),
        }
        self
    }
    /// Makes it the occurrence of recurring schedule `schedule` at `tick_ms`
    /// ([`crate::recurring`]): the publisher names it `NAME@<tick>` and adds the headers
    /// `x-delay-recurring` (the name) and `x-delay-recurring-tick` (the tick, ms).
    pub fn occurrence(mut self, schedule: &str, tick_ms: u64) -> Self {
        // `recurring::MAX_NAME_BYTES`: the id stays a short string
        if schedule.is_empty() || schedule.len() > 100 {
            self.problem = Some(format!(
                "a schedule name is 1 to 100 bytes, not {}",
                schedule.len()
            ));
        }
        self.occurrence = Some((schedule.to_string(), tick_ms));
        self
    }
    /// Sets the content type (at most 255 bytes).
    pub fn with_content_type(mut self, ct: impl Into<String>) -> Self {
        match short("content type", ct.into()) {
            Ok(s) => self.properties = self.properties.with_content_type(s),
            Err(e) => self.problem = Some(e),
        }
        self
    }
    /// Sets the application headers (`x-delay-*` names are reserved).
    pub fn with_headers(mut self, h: FieldTable) -> Self {
        self.properties = self.properties.with_headers(h);
        self
    }
    /// Replaces all properties.
    pub fn with_properties(mut self, p: BasicProperties) -> Self {
        self.properties = p;
        self
    }
    /// Sets the attempt counter (used by retries).
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }

    /// Marks a message the library re-publishes itself (a retry, a gateway hop): its own
    /// `x-delay-*` headers are allowed.
    pub(crate) fn internal(mut self) -> Self {
        self.internal = true;
        self
    }

    /// Marks a copy the journal already has (a retry, a rescheduled copy).
    pub(crate) fn unjournaled(mut self) -> Self {
        self.journaled = false;
        self
    }

    /// The rules every scheduled message follows, with a reason naming what is wrong: what a
    /// builder could not take, an empty id, `expiration` (it would expire inside a tier and
    /// arrive early), `CC` or `BCC` (the broker would route copies at every tier hop; what the
    /// library re-publishes has them removed), a reserved `x-delay-*` header (unless the library
    /// re-publishes its own),
    /// headers over 32 KiB encoded, a body over `max_body_bytes`.
    pub fn check(&self, max_body_bytes: usize) -> Result<(), String> {
        if let Some(p) = &self.problem {
            return Err(p.clone());
        }
        if self
            .properties
            .message_id()
            .as_ref()
            .is_some_and(|id| id.as_str().is_empty())
        {
            return Err("the message id must not be empty".into());
        }
        if self.properties.expiration().is_some() {
            return Err("the 'expiration' property is not allowed on a delayed message: it would expire inside a tier and be delivered early (docs/DESIGN.md rule 1); set it when the message is delivered instead".into());
        }
        if let Some(h) = self.properties.headers() {
            let routed = h
                .inner()
                .keys()
                .find(|k| headers::is_routing_header(k.as_str()));
            if let (false, Some(k)) = (self.internal, routed) {
                return Err(format!(
                    "header '{k}' is not allowed on a delayed message: the broker would route a \
                     copy to every key it names at every tier hop (docs/DESIGN.md rule 14); \
                     schedule one message per destination instead"
                ));
            }
            let reserved = h.inner().keys().find(|k| headers::is_reserved(k.as_str()));
            if let (false, Some(k)) = (self.internal, reserved) {
                // DESIGN rule 16: RabbitMQ's own delay would act again at the destination
                return Err(if k.as_str() == headers::NATIVE_DELIVERY_TIME {
                    format!(
                        "header '{k}' is reserved: it is RabbitMQ's own publish-time delay, which \
                         would delay the message once more at its destination; give amqp-delay \
                         the delay instead"
                    )
                } else {
                    format!("header '{k}' is reserved: every x-delay-* header is amqp-delay's own")
                });
            }
            let size = headers::encoded_len(h);
            if size > MAX_HEADER_BYTES {
                return Err(format!(
                    "the headers take {size} bytes encoded; at most {MAX_HEADER_BYTES} are accepted (each tier hop adds to them, and a consumer cannot take a header larger than the broker's frame_max)"
                ));
            }
        }
        if self.body.len() > max_body_bytes {
            // DESIGN rule 12: RabbitMQ 4.x's max_message_size
            return Err(format!(
                "the body is {} bytes; at most {max_body_bytes} are accepted (publisher.max_message_bytes; RabbitMQ 4.x refuses messages over 16 MiB by default)",
                self.body.len()
            ));
        }
        Ok(())
    }
}

/// An AMQP short string (at most 255 bytes), or why not.
pub(crate) fn short(what: &str, s: String) -> Result<ShortString, String> {
    let len = s.len();
    ShortString::try_new(s)
        .map_err(|_| format!("the {what} is {len} bytes; AMQP allows at most 255"))
}

/// A message the broker has confirmed.
#[derive(Debug, Clone)]
pub struct Scheduled {
    /// The message id (given or generated).
    pub message_id: String,
    /// The requested delay.
    pub delay_ms: u64,
    /// Requested due time, ms since the Unix epoch.
    pub due_at_ms: u64,
    /// The route through the tiers (of its batch, when it travels in one).
    pub route: Route,
    /// How many messages share its broker message (1: it travels alone).
    pub batched_with: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::AMQPValue;

    fn with_header(name: &str) -> Message {
        let mut h = FieldTable::default();
        h.insert(name.into(), AMQPValue::LongLongInt(1_900_000_000_000));
        Message::new("q", 1_000, "x").with_headers(h)
    }

    #[test]
    fn the_brokers_native_delay_is_reserved_like_ours() {
        let e = with_header(headers::NATIVE_DELIVERY_TIME)
            .check(1 << 20)
            .unwrap_err();
        assert!(e.contains("'x-opt-delivery-time' is reserved"), "{e}");
        assert!(e.contains("RabbitMQ's own publish-time delay"), "{e}");
        let e = with_header("x-delay-attempt").check(1 << 20).unwrap_err();
        assert!(e.contains("every x-delay-* header"), "{e}");
        assert!(with_header("x-opt-other").check(1 << 20).is_ok());
    }

    #[test]
    fn the_brokers_copy_headers_are_refused() {
        for name in ["CC", "BCC"] {
            let e = with_header(name).check(1 << 20).unwrap_err();
            assert!(e.contains(&format!("'{name}' is not allowed")), "{e}");
            assert!(e.contains("every tier hop"), "{e}");
            // a copy the library re-publishes is checked as it is; the publisher drops them
            assert!(with_header(name).internal().check(1 << 20).is_ok());
        }
        assert!(with_header("cc").check(1 << 20).is_ok());
    }
}
