//! What the proxy changes in a connection's frames, and nothing else (pure: no I/O). Towards
//! the broker: `exchange.declare` of type `x-delayed-message` becomes a declare of its
//! `x-delayed-type`, and a `basic.publish` to a delayed exchange whose content header carries a
//! positive (or unreadable) `x-delay` goes to the pair's ingress instead. Towards the client: a
//! `basic.return` naming an ingress names the application's exchange again. Every other frame
//! passes as it arrived.

use std::collections::HashMap;
use std::sync::RwLock;

use amq_protocol::frame::AMQPFrameType;
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, exchange};
use amq_protocol::types::{AMQPValue, FieldTable};
use amqp_delay::gateway::x_delay::parse_x_delay;
use amqp_delay::headers::X_DELAY;

use super::frames::{self, Raw};

/// The exchange type applications of the plugin declare.
pub const DELAYED_TYPE: &str = "x-delayed-message";
/// The plugin's argument naming the real exchange type.
pub const DELAYED_TYPE_ARG: &str = "x-delayed-type";

/// The delayed exchanges this process knows (registered by it, or read from the control
/// stream): application exchange ↔ pair ingress. Shared by every connection.
#[derive(Debug, Default)]
pub struct Pairs {
    by_exchange: RwLock<HashMap<String, String>>,
    by_ingress: RwLock<HashMap<String, String>>,
}

impl Pairs {
    /// The ingress of delayed exchange `exchange`, if it is one.
    pub fn ingress_of(&self, exchange: &str) -> Option<String> {
        let map = self.by_exchange.read().unwrap_or_else(|e| e.into_inner());
        map.get(exchange).cloned()
    }

    /// The application's exchange of ingress `ingress`, if it is a pair's.
    pub fn exchange_of(&self, ingress: &str) -> Option<String> {
        let map = self.by_ingress.read().unwrap_or_else(|e| e.into_inner());
        map.get(ingress).cloned()
    }

    /// Remembers a pair; true when it was new.
    pub fn insert(&self, exchange: &str, ingress: &str) -> bool {
        let mut a = self.by_exchange.write().unwrap_or_else(|e| e.into_inner());
        let new = a.insert(exchange.into(), ingress.into()).is_none();
        drop(a);
        let mut b = self.by_ingress.write().unwrap_or_else(|e| e.into_inner());
        b.insert(ingress.into(), exchange.into());
        let known = i64::try_from(b.len()).unwrap_or(i64::MAX);
        drop(b);
        amqp_delay::metrics::global().proxy_pairs_known.set(known);
        new
    }

    /// Forgets delayed exchange `exchange` (its pair ended); true when it was known.
    pub fn remove(&self, exchange: &str) -> bool {
        let mut a = self.by_exchange.write().unwrap_or_else(|e| e.into_inner());
        let Some(ingress) = a.remove(exchange) else {
            return false;
        };
        drop(a);
        let mut b = self.by_ingress.write().unwrap_or_else(|e| e.into_inner());
        b.remove(&ingress);
        let known = i64::try_from(b.len()).unwrap_or(i64::MAX);
        drop(b);
        amqp_delay::metrics::global().proxy_pairs_known.set(known);
        true
    }

    /// How many pairs are known.
    pub fn len(&self) -> usize {
        self.by_exchange.read().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether no pair is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The methods of a client the proxy parses (every other passes unparsed): `basic.publish`,
/// `exchange.declare`, `exchange.delete`, `connection.tune-ok`.
const CLIENT_METHODS: [frames::MethodId; 4] = [(60, 40), (40, 10), (40, 20), (10, 31)];
/// The methods of the broker the proxy parses: `basic.return`, `exchange.declare-ok`,
/// `exchange.delete-ok`, `channel.close`, `connection.close`, `connection.open-ok`.
const SERVER_METHODS: [frames::MethodId; 6] =
    [(60, 50), (40, 11), (40, 21), (20, 40), (10, 50), (10, 41)];

/// Whether `raw` is a method frame of one of `methods`.
fn is_one_of(raw: &Raw<'_>, methods: &[frames::MethodId]) -> bool {
    raw.kind == AMQPFrameType::Method
        && frames::method_id(raw.payload).is_some_and(|id| methods.contains(&id))
}

/// What to do with a frame.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Forward the frame's bytes as they arrived.
    Pass,
    /// Keep it: a publish waiting for its content header.
    Held,
    /// Forward these bytes instead (held frames, possibly rewritten, then this one).
    Bytes(Vec<u8>),
    /// A delayed exchange's declare, rewritten to its real type: send `bytes`, then wait for
    /// the broker's answer before reading the client further.
    Declare(DelayedDeclare),
    /// A passive declare of a delayed exchange: pass it, knowing the exchange's pair first.
    Lookup(String),
    /// A delayed exchange's delete, asking for the broker's answer: send `bytes`, then wait
    /// for it (the pair ends once the broker deleted the exchange).
    Delete(DelayedDeclare),
    /// `exchange.declare-ok` on `channel` (from the broker).
    DeclareOk(u16),
    /// `exchange.delete-ok` on `channel` (from the broker).
    DeleteOk(u16),
    /// The broker closed `channel` (or, for 0, the connection).
    Closed(u16),
    /// `connection.open-ok`: the handshake is over.
    Opened,
}

/// A declare of type `x-delayed-message` (or a delete of such an exchange) as the broker gets
/// it.
#[derive(Debug, PartialEq)]
pub struct DelayedDeclare {
    /// The channel it was sent on.
    pub channel: u16,
    /// The application's exchange.
    pub exchange: String,
    /// Whether the client asked for no answer (the broker is asked for one all the same).
    pub nowait: bool,
    /// The rewritten frame.
    pub bytes: Vec<u8>,
}

/// A publish held until its content header says whether it is delayed.
#[derive(Debug)]
struct Held {
    method: Vec<u8>,
    publish: basic::Publish,
    ingress: String,
}

/// The client's side of a connection: publishes waiting for their header, per channel, and
/// the `frame_max` it agreed to.
#[derive(Debug, Default)]
pub struct ClientSide {
    held: HashMap<u16, Held>,
    /// `frame_max` of the client's `connection.tune-ok` (0 until then).
    pub frame_max: Option<u32>,
}

impl ClientSide {
    /// What to do with the client's frame `raw`, given the delayed exchanges `pairs` and the
    /// longest delay the tiers take.
    pub fn frame(
        &mut self,
        raw: &Raw<'_>,
        pairs: &Pairs,
        max_delay_ms: u64,
    ) -> Result<Step, String> {
        if let Some(held) = self.held.remove(&raw.channel) {
            return release(held, raw, max_delay_ms);
        }
        if !is_one_of(raw, &CLIENT_METHODS) {
            return Ok(Step::Pass);
        }
        match frames::method(raw.payload)? {
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => {
                let Some(ingress) = pairs.ingress_of(p.exchange.as_str()) else {
                    return Ok(Step::Pass);
                };
                let method = raw.bytes.to_vec();
                self.held.insert(
                    raw.channel,
                    Held {
                        method,
                        publish: p,
                        ingress,
                    },
                );
                Ok(Step::Held)
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))
                if d.kind.as_str() == DELAYED_TYPE =>
            {
                Ok(declare(raw.channel, d)?)
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d))
                if pairs.ingress_of(d.exchange.as_str()).is_some() =>
            {
                Ok(delete(raw.channel, d)?)
            }
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(t)) => {
                self.frame_max = Some(t.frame_max);
                Ok(Step::Pass)
            }
            _ => Ok(Step::Pass),
        }
    }
}

/// The held publish, to the exchange its header asks for, followed by `raw`.
fn release(held: Held, raw: &Raw<'_>, max_delay_ms: u64) -> Result<Step, String> {
    let mut out = held.method;
    if raw.kind == AMQPFrameType::Header {
        let h = frames::content_header(raw.payload)?;
        let value = h
            .properties
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get(X_DELAY));
        // present and not "no delay": the gateway delays it, or parks what it cannot read
        if value.is_some() && parse_x_delay(value, max_delay_ms) != Ok(0) {
            let publish = basic::Publish {
                exchange: held.ingress.as_str().into(),
                ..held.publish
            };
            amqp_delay::metrics::global().proxy_delayed_publishes.inc();
            out = frames::encode_method(
                raw.channel,
                AMQPClass::Basic(basic::AMQPMethod::Publish(publish)),
            )?;
        }
    }
    out.extend_from_slice(raw.bytes);
    Ok(Step::Bytes(out))
}

/// A declare of type `x-delayed-message`: a passive one passes (the broker checks only that
/// the exchange exists); one naming its real type is rewritten to it; one without passes as it
/// is, and a stock broker refuses it, as the plugin refuses it.
fn declare(channel: u16, d: exchange::Declare) -> Result<Step, String> {
    if d.passive {
        return Ok(Step::Lookup(d.exchange.to_string()));
    }
    let Some(kind) = real_type(&d.arguments) else {
        return Ok(Step::Pass);
    };
    let mut arguments = FieldTable::default();
    for (k, v) in d.arguments.inner() {
        if k.as_str() != DELAYED_TYPE_ARG {
            arguments.insert(k.clone(), v.clone());
        }
    }
    let nowait = d.nowait;
    let exchange = d.exchange.to_string();
    let rewritten = exchange::Declare {
        kind: kind.as_str().into(),
        nowait: false,
        arguments,
        ..d
    };
    let bytes = frames::encode_method(
        channel,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(rewritten)),
    )?;
    Ok(Step::Declare(DelayedDeclare {
        channel,
        exchange,
        nowait,
        bytes,
    }))
}

/// A delete of a delayed exchange, asking for the broker's delete-ok even when the client did
/// not (the pair ends only once the broker deleted the exchange under the client's own
/// permissions).
fn delete(channel: u16, d: exchange::Delete) -> Result<Step, String> {
    let (nowait, exchange) = (d.nowait, d.exchange.to_string());
    let bytes = frames::encode_method(
        channel,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            nowait: false,
            ..d
        })),
    )?;
    Ok(Step::Delete(DelayedDeclare {
        channel,
        exchange,
        nowait,
        bytes,
    }))
}

/// `x-delayed-type`, when it is a text.
fn real_type(args: &FieldTable) -> Option<String> {
    match args.inner().get(DELAYED_TYPE_ARG)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
    .filter(|k| !k.is_empty() && k != DELAYED_TYPE)
}

/// What to do with the broker's frame `raw`: a return naming an ingress names the
/// application's exchange again; the answers the proxy waits for are named.
pub fn server_frame(raw: &Raw<'_>, pairs: &Pairs) -> Result<Step, String> {
    if !is_one_of(raw, &SERVER_METHODS) {
        return Ok(Step::Pass);
    }
    Ok(match frames::method(raw.payload)? {
        AMQPClass::Basic(basic::AMQPMethod::Return(r)) => {
            match pairs.exchange_of(r.exchange.as_str()) {
                Some(x) => {
                    let r = basic::Return {
                        exchange: x.as_str().into(),
                        ..r
                    };
                    Step::Bytes(frames::encode_method(
                        raw.channel,
                        AMQPClass::Basic(basic::AMQPMethod::Return(r)),
                    )?)
                }
                None => Step::Pass,
            }
        }
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => Step::DeclareOk(raw.channel),
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(_)) => Step::DeleteOk(raw.channel),
        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => Step::Closed(raw.channel),
        AMQPClass::Connection(connection::AMQPMethod::Close(_)) => Step::Closed(0),
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => Step::Opened,
        _ => Step::Pass,
    })
}

/// `connection.close` from the proxy to the client, when it cannot go on.
pub fn close_connection(code: u16, text: &str) -> Result<Vec<u8>, String> {
    let text: String = text.chars().take(200).collect();
    frames::encode_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: code,
            reply_text: text.as_str().into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

#[cfg(test)]
mod tests;
