//! What the proxy changes in a connection's frames, and nothing else (pure: no I/O). Towards
//! the broker: `exchange.declare` of type `x-delayed-message` becomes a declare of its
//! `x-delayed-type`, a `basic.publish` to a delayed exchange whose content header carries a
//! positive (or unreadable) `x-delay` goes to the pair's ingress instead (with the client's
//! user as `user_id` when it set none), and the client's `connection.tune-ok` names the
//! `frame_max` and `channel_max` both sides keep to. Towards the client: the broker's
//! `connection.tune` offers at most the proxy's caps, and a `basic.return` naming an ingress
//! names the application's exchange again. Only a client in the proxy's own virtual host gets
//! delayed exchanges; in any other, its frames pass as they came. Every other frame passes as it
//! arrived.

use std::collections::HashMap;
use std::sync::RwLock;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrameType};
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, exchange};
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use amqp_delay::gateway::x_delay::parse_x_delay;
use amqp_delay::headers::{ADDED_USER_ID, PUBLISHED_AT, X_DELAY};

use super::frames::{self, HANDSHAKE_FRAME_MAX, Raw};
use super::login;
use super::replies::Ask;
use crate::logline::escape_controls;

/// The exchange type applications of the plugin declare.
pub const DELAYED_TYPE: &str = "x-delayed-message";
/// The plugin's argument naming the real exchange type.
pub const DELAYED_TYPE_ARG: &str = "x-delayed-type";
/// The most channels a client may open on one connection (RabbitMQ's default `channel_max`):
/// each may hold one publish while its content header is on its way.
pub const MAX_CHANNELS: u16 = 2047;

/// One delayed exchange: its pair's ingress, and the users known to have asked for it (the
/// writers of its records since its last end).
#[derive(Debug, Default)]
struct Known {
    ingress: String,
    writers: Vec<String>,
}

/// The delayed exchanges this process knows (registered by it, or read from the control
/// stream): application exchange ↔ pair ingress, with the pair's writers. Shared by every
/// connection.
#[derive(Debug, Default)]
pub struct Pairs {
    by_exchange: RwLock<HashMap<String, Known>>,
    by_ingress: RwLock<HashMap<String, String>>,
}

impl Pairs {
    /// The ingress of delayed exchange `exchange`, if it is one.
    pub fn ingress_of(&self, exchange: &str) -> Option<String> {
        let map = self.by_exchange.read().unwrap_or_else(|e| e.into_inner());
        map.get(exchange).map(|k| k.ingress.clone())
    }

    /// The application's exchange of ingress `ingress`, if it is a pair's.
    pub fn exchange_of(&self, ingress: &str) -> Option<String> {
        let map = self.by_ingress.read().unwrap_or_else(|e| e.into_inner());
        map.get(ingress).cloned()
    }

    /// Every delayed exchange known, with its ingress.
    pub fn all(&self) -> Vec<(String, String)> {
        let map = self.by_exchange.read().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(x, k)| (x.clone(), k.ingress.clone()))
            .collect()
    }

    /// Whether `user` is one of the writers of delayed exchange `exchange`.
    pub fn has_writer(&self, exchange: &str, user: &str) -> bool {
        let map = self.by_exchange.read().unwrap_or_else(|e| e.into_inner());
        map.get(exchange)
            .is_some_and(|k| k.writers.iter().any(|w| w == user))
    }

    /// One writer of delayed exchange `exchange` (the first recorded), if it is known.
    pub fn a_writer(&self, exchange: &str) -> Option<String> {
        let map = self.by_exchange.read().unwrap_or_else(|e| e.into_inner());
        map.get(exchange).and_then(|k| k.writers.first().cloned())
    }

    /// Remembers a pair and adds `writers` to its own; true when the pair was new.
    pub fn insert(&self, exchange: &str, ingress: &str, writers: &[String]) -> bool {
        let mut a = self.by_exchange.write().unwrap_or_else(|e| e.into_inner());
        let known = a.entry(exchange.into()).or_default();
        let new = known.ingress.is_empty();
        known.ingress = ingress.into();
        for w in writers {
            if !known.writers.contains(w) {
                known.writers.push(w.clone());
            }
        }
        drop(a);
        let mut b = self.by_ingress.write().unwrap_or_else(|e| e.into_inner());
        b.insert(ingress.into(), exchange.into());
        let known = i64::try_from(b.len()).unwrap_or(i64::MAX);
        drop(b);
        amqp_delay::metrics::global().proxy_pairs_known.set(known);
        new
    }

    /// Forgets delayed exchange `exchange` and its writers (its pair ended); true when it was
    /// known.
    pub fn remove(&self, exchange: &str) -> bool {
        let mut a = self.by_exchange.write().unwrap_or_else(|e| e.into_inner());
        let Some(known) = a.remove(exchange) else {
            return false;
        };
        drop(a);
        let mut b = self.by_ingress.write().unwrap_or_else(|e| e.into_inner());
        b.remove(&known.ingress);
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
/// `exchange.declare`, `exchange.delete`, `connection.tune-ok`, `connection.start-ok`,
/// `connection.open`.
const CLIENT_METHODS: [frames::MethodId; 6] =
    [(60, 40), (40, 10), (40, 20), (10, 31), (10, 11), (10, 40)];
/// The methods of the broker the proxy parses: `basic.return`, `exchange.declare-ok`,
/// `exchange.delete-ok`, `channel.close`, `connection.close`, `connection.open-ok`,
/// `connection.tune`, `channel.open-ok`.
const SERVER_METHODS: [frames::MethodId; 8] = [
    (60, 50),
    (40, 11),
    (40, 21),
    (20, 40),
    (10, 50),
    (10, 41),
    (10, 30),
    (20, 11),
];
/// The client's methods that open or close a channel: `channel.open`, `channel.close`.
const CHANNEL_METHODS: [frames::MethodId; 2] = [(20, 10), (20, 40)];
/// The client's requests whose answer the proxy may wait for: `exchange.declare`,
/// `exchange.delete`.
const ASKING_METHODS: [frames::MethodId; 2] = [(40, 10), (40, 20)];

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
    /// `channel.open-ok` on `channel` (from the broker).
    ChannelOpened(u16),
    /// `connection.open-ok`: the handshake is over.
    Opened,
    /// The broker's `connection.tune`, as offered to the client: forward these bytes.
    Tuned(Offer, Vec<u8>),
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

/// A publish held until its content header says whether it is delayed: its frame as it came
/// (parsed again only when it goes to the ingress) and the ingress.
#[derive(Debug)]
struct Held {
    method: Vec<u8>,
    ingress: String,
}

/// What the proxy offers a client in the broker's `connection.tune`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// At most the broker's and the proxy's cap (the cap when the broker's is 0, unlimited).
    pub frame_max: u32,
    /// At most the broker's and [`MAX_CHANNELS`].
    pub channel_max: u16,
}

impl Offer {
    /// The offer of a broker that tunes `frame_max` and `channel_max`, under the proxy's
    /// `cap` of `frame_max`.
    pub fn of(frame_max: u32, channel_max: u16, cap: u32) -> Offer {
        let lowest = |theirs: u32, ours: u32| if theirs == 0 { ours } else { theirs.min(ours) };
        Offer {
            frame_max: lowest(frame_max, cap),
            channel_max: lowest(channel_max.into(), MAX_CHANNELS.into()) as u16,
        }
    }

    /// What the client and the broker keep to after the client's `tune-ok`: the lower of its
    /// values and the offer's (its 0, "no limit", is the offer's).
    pub fn agree(&self, t: &connection::TuneOk) -> (u32, u16) {
        let lowest = |theirs: u32, ours: u32| if theirs == 0 { ours } else { theirs.min(ours) };
        let channel_max = lowest(t.channel_max.into(), self.channel_max.into());
        (lowest(t.frame_max, self.frame_max), channel_max as u16)
    }
}

/// What a client frame is judged by, besides the frame itself.
pub struct Seen<'a> {
    /// The delayed exchanges known.
    pub pairs: &'a Pairs,
    /// The longest delay the tiers take.
    pub max_delay_ms: u64,
    /// The frame's channel is open: the client opened it and neither side closed it.
    pub open: bool,
    /// What the proxy offered the client (`None` before the broker's `connection.tune`).
    pub offered: Option<Offer>,
}

/// The client's side of a connection: who logged in and where (from its handshake), what it
/// agreed to, and publishes waiting for their header, per channel.
#[derive(Debug)]
pub struct ClientSide {
    held: HashMap<u16, Held>,
    /// The virtual host of the proxy's own URL: the only one where it rewrites anything.
    home: String,
    /// The user the client logged in as, when its SASL mechanism names it (never the
    /// password).
    pub user: Option<String>,
    /// Its SASL mechanism.
    pub mechanism: String,
    /// The virtual host of its `connection.open`.
    pub vhost: Option<String>,
    /// `frame_max` after its `connection.tune-ok` (`None` until then).
    pub frame_max: Option<u32>,
    /// `channel_max` after its `connection.tune-ok` (`None` until then).
    pub channel_max: Option<u16>,
}

impl ClientSide {
    /// A client of a proxy whose URL names virtual host `home`.
    pub fn new(home: &str) -> ClientSide {
        ClientSide {
            held: HashMap::new(),
            home: home.to_string(),
            user: None,
            mechanism: String::new(),
            vhost: None,
            frame_max: None,
            channel_max: None,
        }
    }

    /// Whether the client opened the proxy's own virtual host, where delayed exchanges live.
    pub fn acts(&self) -> bool {
        self.vhost.as_deref() == Some(self.home.as_str())
    }

    /// Publishes held now (at most one per open channel).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// What to do with the client's frame `raw`.
    pub fn frame(&mut self, raw: &Raw<'_>, seen: &Seen<'_>) -> Result<Step, String> {
        if let Some(held) = self.held.remove(&raw.channel) {
            return self.release(held, raw, seen.max_delay_ms);
        }
        if !is_one_of(raw, &CLIENT_METHODS) {
            return Ok(Step::Pass);
        }
        match frames::method(raw.payload)? {
            AMQPClass::Connection(m) => self.handshake(raw.channel, m, seen.offered),
            m if !self.acts() => {
                self.elsewhere(&m);
                Ok(Step::Pass)
            }
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => Ok(self.hold(raw, p, seen)),
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))
                if d.kind.as_str() == DELAYED_TYPE =>
            {
                declare(raw.channel, d)
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d))
                if seen.pairs.ingress_of(d.exchange.as_str()).is_some() =>
            {
                delete(raw.channel, d)
            }
            _ => Ok(Step::Pass),
        }
    }

    /// The client's login, virtual host and tuning; its `tune-ok` rewritten to what the proxy
    /// offered, when it asked for more.
    fn handshake(
        &mut self,
        channel: u16,
        m: connection::AMQPMethod,
        offered: Option<Offer>,
    ) -> Result<Step, String> {
        match m {
            connection::AMQPMethod::StartOk(s) => {
                // the response holds the password: only the user is kept
                self.user = login::user_of(s.mechanism.as_str(), s.response.as_bytes());
                self.mechanism = escape_controls(s.mechanism.as_str()).into_owned();
                Ok(Step::Pass)
            }
            connection::AMQPMethod::Open(o) => {
                self.vhost = Some(o.virtual_host.to_string());
                Ok(Step::Pass)
            }
            connection::AMQPMethod::TuneOk(t) => {
                // before the broker's tune (the broker refuses that): the handshake's size
                let offer =
                    offered.unwrap_or(Offer::of(HANDSHAKE_FRAME_MAX, 0, HANDSHAKE_FRAME_MAX));
                let (frame_max, channel_max) = offer.agree(&t);
                self.frame_max = Some(frame_max);
                self.channel_max = Some(channel_max);
                if (frame_max, channel_max) == (t.frame_max, t.channel_max) {
                    return Ok(Step::Pass);
                }
                let agreed = connection::TuneOk {
                    frame_max,
                    channel_max,
                    ..t
                };
                let m = AMQPClass::Connection(connection::AMQPMethod::TuneOk(agreed));
                Ok(Step::Bytes(frames::encode_method(channel, m)?))
            }
            _ => Ok(Step::Pass),
        }
    }

    /// A method the proxy would rewrite, from a client in another virtual host: it passes as
    /// it came; a delayed declare is logged (the broker refuses its type).
    fn elsewhere(&self, m: &AMQPClass) {
        if let AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) = m
            && d.kind.as_str() == DELAYED_TYPE
        {
            let vhost = escape_controls(self.vhost.as_deref().unwrap_or_default());
            tracing::warn!(
                exchange = %escape_controls(d.exchange.as_str()),
                %vhost,
                home = %escape_controls(&self.home),
                "a delayed exchange declared in another virtual host passes unchanged (the broker refuses its type): delay-proxy serves only the virtual host of its --url"
            );
        }
    }

    /// A publish to a delayed exchange on an open channel is held until its header comes;
    /// any other passes.
    fn hold(&mut self, raw: &Raw<'_>, publish: basic::Publish, seen: &Seen<'_>) -> Step {
        if !seen.open {
            return Step::Pass;
        }
        let Some(ingress) = seen.pairs.ingress_of(publish.exchange.as_str()) else {
            return Step::Pass;
        };
        let method = raw.bytes.to_vec();
        self.held.insert(raw.channel, Held { method, ingress });
        Step::Held
    }

    /// The held publish, to the exchange its header asks for, followed by `raw`.
    fn release(&self, held: Held, raw: &Raw<'_>, max_delay_ms: u64) -> Result<Step, String> {
        let mut out = held.method;
        let mut header = None;
        if raw.kind == AMQPFrameType::Header {
            let h = frames::content_header(raw.payload)?;
            let value = h
                .properties
                .headers()
                .as_ref()
                .and_then(|t| t.inner().get(X_DELAY));
            // present and not "no delay": the gateway delays it, or parks what it cannot read
            if value.is_some() && parse_x_delay(value, max_delay_ms) != Ok(0) {
                // mandatory whatever the client asked: when the pair's ingress queue is gone
                // nothing holds the message, and the client is told (a return) rather than
                // confirmed a message dropped unseen
                let publish = basic::Publish {
                    exchange: ShortString::try_new(held.ingress)
                        .map_err(|e| format!("a pair's ingress name: {e}"))?,
                    mandatory: true,
                    ..held_publish(&out)?
                };
                amqp_delay::metrics::global().proxy_delayed_publishes.inc();
                out = frames::encode_method(
                    raw.channel,
                    AMQPClass::Basic(basic::AMQPMethod::Publish(publish)),
                )?;
                header = self.stamped(raw.channel, h);
            }
        }
        out.extend_from_slice(header.as_deref().unwrap_or(raw.bytes));
        Ok(Step::Bytes(out))
    }

    /// The delayed publish's content header `h` with the time the proxy took it
    /// ([`PUBLISHED_AT`], so that the gateway counts the delay from the publish, not from when
    /// it reads the ingress queue), and, when it has no `user_id`, the client's user as
    /// `user_id` (which the broker checks against the connection's, DESIGN rule 15, so the
    /// gateway knows who wrote it) with the header [`ADDED_USER_ID`] (so that the target's copy
    /// does not name it, as the plugin's would not). `None` (sent as it came) when the frame
    /// would outgrow `frame_max`.
    fn stamped(&self, channel: u16, h: AMQPContentHeader) -> Option<Vec<u8>> {
        let mut headers = h.properties.headers().clone().unwrap_or_default();
        let now = i64::try_from(amqp_delay::time::now_ms()).unwrap_or(i64::MAX);
        headers.insert(PUBLISHED_AT.into(), AMQPValue::LongLongInt(now));
        let mut properties = h.properties.clone();
        if properties.user_id().is_none()
            && let Some(user) = self.user.clone().and_then(|u| ShortString::try_new(u).ok())
        {
            headers.insert(ADDED_USER_ID.into(), AMQPValue::Boolean(true));
            properties = properties.with_user_id(user);
        }
        let properties = properties.with_headers(headers);
        let bytes = frames::encode_header(channel, AMQPContentHeader { properties, ..h }).ok()?;
        let frame_max = self.frame_max.unwrap_or(HANDSHAKE_FRAME_MAX);
        (bytes.len() <= frame_max as usize).then_some(bytes)
    }
}

/// The `basic.publish` of a held frame (parsed when it was held).
fn held_publish(frame: &[u8]) -> Result<basic::Publish, String> {
    let frames::Split::Frame(raw) = frames::split(frame) else {
        return Err("a held publish is not a whole frame".into());
    };
    match frames::method(raw.payload)? {
        AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => Ok(p),
        _ => Err("a held frame is not a publish".into()),
    }
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
    let kind = ShortString::try_new(kind).map_err(|e| format!("x-delayed-type: {e}"))?;
    let rewritten = exchange::Declare {
        kind,
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

/// What a client's frame does to the requests a connection counts ([`super::replies`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `channel.open`.
    Open,
    /// `channel.close`.
    Close,
    /// A declare or delete that asks for an answer (not `nowait`; passive ones too).
    Asks(Ask),
}

/// The [`Request`] the client's frame `raw` makes, if any.
pub fn request(raw: &Raw<'_>) -> Result<Option<Request>, String> {
    if is_one_of(raw, &CHANNEL_METHODS) {
        let open = frames::method_id(raw.payload) == Some(CHANNEL_METHODS[0]);
        return Ok(Some(if open { Request::Open } else { Request::Close }));
    }
    if !is_one_of(raw, &ASKING_METHODS) {
        return Ok(None);
    }
    Ok(match frames::method(raw.payload)? {
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) if !d.nowait => {
            Some(Request::Asks(Ask::Declare))
        }
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(d)) if !d.nowait => {
            Some(Request::Asks(Ask::Delete))
        }
        _ => None,
    })
}

/// What to do with the broker's frame `raw` for a client that `acts` in the proxy's virtual
/// host: a return naming an ingress names the application's exchange again; the tune offers
/// at most `cap` bytes a frame; the answers the proxy waits for are named.
pub fn server_frame(raw: &Raw<'_>, pairs: &Pairs, acts: bool, cap: u32) -> Result<Step, String> {
    if !is_one_of(raw, &SERVER_METHODS) {
        return Ok(Step::Pass);
    }
    Ok(match frames::method(raw.payload)? {
        AMQPClass::Basic(basic::AMQPMethod::Return(r)) if acts => {
            match pairs.exchange_of(r.exchange.as_str()) {
                Some(x) => {
                    amqp_delay::metrics::global().proxy_delayed_returned.inc();
                    tracing::error!(
                        exchange = %escape_controls(&x),
                        ingress = %escape_controls(r.exchange.as_str()),
                        code = r.reply_code,
                        "a delayed publish was returned to its client: nothing held it (the pair's ingress queue is gone?); the proxy declares it again within seconds"
                    );
                    let exchange = ShortString::try_new(x)
                        .map_err(|e| format!("a delayed exchange's name: {e}"))?;
                    let r = basic::Return { exchange, ..r };
                    Step::Bytes(frames::encode_method(
                        raw.channel,
                        AMQPClass::Basic(basic::AMQPMethod::Return(r)),
                    )?)
                }
                None => Step::Pass,
            }
        }
        AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => {
            let offer = Offer::of(t.frame_max, t.channel_max, cap);
            let offered = connection::Tune {
                frame_max: offer.frame_max,
                channel_max: offer.channel_max,
                ..t
            };
            let m = AMQPClass::Connection(connection::AMQPMethod::Tune(offered));
            Step::Tuned(offer, frames::encode_method(raw.channel, m)?)
        }
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => Step::DeclareOk(raw.channel),
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(_)) => Step::DeleteOk(raw.channel),
        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => Step::Closed(raw.channel),
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Step::ChannelOpened(raw.channel),
        AMQPClass::Connection(connection::AMQPMethod::Close(_)) => Step::Closed(0),
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => Step::Opened,
        _ => Step::Pass,
    })
}

/// `connection.close` from the proxy to the client, when it cannot go on.
pub fn close_connection(code: u16, text: &str) -> Result<Vec<u8>, String> {
    // within a short string's 255 bytes, at a character's boundary
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let text = &text[..end];
    frames::encode_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: code,
            reply_text: text.into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

#[cfg(test)]
mod tests;
