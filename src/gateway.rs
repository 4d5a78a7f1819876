//! The `x-delay` gateway: a drop-in successor to the delayed-message-exchange plugin, built on
//! the tiers. Applications keep publishing to an exchange with an `x-delay` header (milliseconds)
//! and their usual routing key; when the delay is over the message is published to a target
//! exchange with its original routing key, body and properties, so the bindings the
//! application already has on that exchange route it as before.
//!
//! One gateway *pair* (ingress exchange `I`, target exchange `T`) is made of:
//! * `I`, a durable **fanout** exchange (any routing key reaches us, so `x-delayed-type` is not
//!   needed), bound to the ingress queue `<prefix>.gw.in.<I>`;
//! * the due queue `<prefix>.gw.due.<I>`, an ordinary amqp-delay destination (queue type of
//!   the tiers).
//!
//! A [`Worker`] consumes both queues:
//! * **ingress**: reads `x-delay` ([`parse_x_delay`]), moves what the tiers must not carry into
//!   `x-delay-*` headers ([`stash`]: the routing key, `expiration`, `delivery_mode`, `user_id`,
//!   whether `message_id` or `headers` were absent) and schedules the message to the due queue.
//!   The ingress message is acked only after the broker confirmed that publish; if it fails the
//!   message is requeued unchanged ([`Outcome::Requeue`]), never re-scheduled as a modified copy.
//!   A non-numeric or over-range `x-delay` goes to the due queue at once, marked, and is parked
//!   there with the reason.
//! * **due**: rebuilds the message as published ([`restore`]: original routing key and
//!   properties, `x-delay` rewritten to minus the delay as the plugin does, our headers and the
//!   broker's `x-death` history removed) and publishes it to `T` with `mandatory` and a confirm.
//!   Unroutable at `T` → parked in `<prefix>.parked.<prefix>.gw.due.<I>` with the reason (the
//!   plugin drops it); a nack or a broker error → retried with backoff, then parked.
//!
//! Delivery is at-least-once: a gateway that dies between a confirm and its ack leaves a message
//! that is delivered again (a duplicate). Any number of gateway processes may consume the same
//! pairs (competing consumers; they hold no state).
//!
//! `user_id` is not re-published: the broker refuses (and closes the channel of) a publish whose
//! `user_id` differs from the publishing connection's user, and the gateway's user is generally
//! not the application's. The value, validated by the broker when the application published it,
//! is delivered in the header `x-delay-user-id` instead.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use serde::{Deserialize, Serialize};

use crate::envelope::{self, Delivery};
use crate::error::{Context as _, Error, Result, broker_error};
use crate::headers;
use crate::layout::Layout;
use crate::publisher::Message;
use crate::settings::Settings;
use crate::topology::Topology;
use crate::worker::{Context, Handler, Outcome, Worker, parked_queue};

/// The plugin's delay header, in milliseconds.
pub const X_DELAY: &str = "x-delay";
/// Headers the gateway sets between ingress and delivery (besides [`envelope::ROUTING_KEY`]).
/// Every `x-delay-*` header is ours: those an application sends are removed at the ingress.
pub const EXPIRATION: &str = "x-delay-expiration";
pub const DELIVERY_MODE: &str = "x-delay-delivery-mode";
pub const NO_MESSAGE_ID: &str = "x-delay-no-message-id";
pub const NO_HEADERS: &str = "x-delay-no-headers";
/// The `user_id` the application published with; kept on the delivered message.
pub const USER_ID: &str = "x-delay-user-id";
/// Why the ingress refused the message; the due handler parks it with this reason.
pub const INVALID: &str = "x-delay-invalid";

/// `[gateway]` section of the configuration.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySettings {
    /// `[[gateway.pairs]]`: ingress exchange → target exchange.
    pub pairs: Vec<PairConfig>,
}

/// One `[[gateway.pairs]]` entry.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PairConfig {
    /// Exchange applications publish to with `x-delay` (declared by the gateway, fanout).
    pub ingress: String,
    /// Existing exchange the due message is published to, with its original routing key.
    pub target: String,
}

impl GatewaySettings {
    /// Pairs from repeated `--ingress I --target T` flags, matched in order.
    pub fn from_flags(ingress: &[String], target: &[String]) -> Result<GatewaySettings, String> {
        if ingress.len() != target.len() {
            return Err(format!(
                "give one --target per --ingress (got {} --ingress and {} --target)",
                ingress.len(),
                target.len()
            ));
        }
        let pairs = ingress
            .iter()
            .zip(target)
            .map(|(i, t)| PairConfig {
                ingress: i.clone(),
                target: t.clone(),
            })
            .collect();
        let s = GatewaySettings { pairs };
        s.validate()?;
        Ok(s)
    }

    /// Checks what can be checked without the layout or a broker.
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for p in &self.pairs {
            for (what, name) in [("ingress", &p.ingress), ("target", &p.target)] {
                if name.is_empty() {
                    return Err(format!(
                        "gateway.pairs: every pair needs a non-empty '{what}'"
                    ));
                }
                if name.len() > 255 {
                    return Err(format!(
                        "gateway.pairs: {what} exchange name is {} bytes, more than 255",
                        name.len()
                    ));
                }
            }
            if p.ingress.starts_with("amq.") {
                return Err(format!(
                    "gateway.pairs: ingress '{}' starts with 'amq.', which the broker reserves",
                    p.ingress
                ));
            }
            if p.ingress == p.target {
                return Err(format!(
                    "gateway.pairs: ingress and target are both '{}'; the message would come back to the gateway",
                    p.ingress
                ));
            }
            if !seen.insert(p.ingress.as_str()) {
                return Err(format!(
                    "gateway.pairs: ingress '{}' appears twice; one ingress has one target",
                    p.ingress
                ));
            }
        }
        Ok(())
    }
}

// ---- pure rules ----------------------------------------------------------------------------

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

/// Which properties to copy in [`copy_props`].
#[derive(Default)]
struct Without {
    headers: bool,
    delivery_mode: bool,
    expiration: bool,
    message_id: bool,
    user_id: bool,
}

/// `p` without the properties named in `drop` (lapin has setters but no way to unset).
fn copy_props(p: &BasicProperties, drop: Without) -> BasicProperties {
    let mut o = BasicProperties::default();
    if let Some(v) = p.content_type() {
        o = o.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        o = o.with_content_encoding(v.clone());
    }
    if let Some(v) = p.headers().as_ref().filter(|_| !drop.headers) {
        o = o.with_headers(v.clone());
    }
    if let Some(v) = p.delivery_mode().filter(|_| !drop.delivery_mode) {
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
    if let Some(v) = p.expiration().as_ref().filter(|_| !drop.expiration) {
        o = o.with_expiration(v.clone());
    }
    if let Some(v) = p.message_id().as_ref().filter(|_| !drop.message_id) {
        o = o.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        o = o.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        o = o.with_type(v.clone());
    }
    if let Some(v) = p.user_id().as_ref().filter(|_| !drop.user_id) {
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

fn is_ours(name: &str) -> bool {
    name.starts_with("x-delay-")
}

/// Headers the broker adds: the dead-letter history, and the redelivery count of quorum queues
/// (set when a gateway died holding the message). Never re-published.
fn is_broker_added(name: &str) -> bool {
    headers::is_death_header(name) || name == "x-delivery-count"
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Properties for the trip through the tiers: the application's, with what the tiers must not
/// carry moved into headers — the routing key, `expiration` (it would expire inside a tier),
/// `delivery_mode` (the tiers are persistent), `user_id` (see the module doc), and markers for
/// an absent `message_id` (the publisher generates one) or `headers` table. `x-delay-*`
/// headers the application set and those the broker adds (`x-death` history,
/// `x-delivery-count`) are removed. `invalid` is
/// the reason the message must be parked instead of delivered.
pub fn stash(p: &BasicProperties, routing_key: &str, invalid: Option<&str>) -> BasicProperties {
    let empty = FieldTable::default();
    let mut h = headers::filter(p.headers().as_ref().unwrap_or(&empty), |k| {
        !is_ours(k) && !is_broker_added(k)
    });
    h.insert(envelope::ROUTING_KEY.into(), long_string(routing_key));
    if let Some(e) = p.expiration() {
        h.insert(EXPIRATION.into(), long_string(e.as_str()));
    }
    if let Some(m) = p.delivery_mode() {
        h.insert(DELIVERY_MODE.into(), AMQPValue::ShortShortUInt(*m));
    }
    if let Some(u) = p.user_id() {
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
    copy_props(
        p,
        Without {
            expiration: true,
            user_id: true,
            delivery_mode: true,
            ..Without::default()
        },
    )
    .with_headers(h)
}

fn text_header(h: &FieldTable, name: &str) -> Result<Option<String>, String> {
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
/// and properties, the `expiration` and `delivery_mode` it had, no `message_id` or `headers`
/// if it had none, our `x-delay-*` headers (but [`USER_ID`]) and the broker's (`x-death`
/// history, `x-delivery-count`) removed,
/// and `x-delay` rewritten to minus the delay when there was one (as the plugin does; a zero or
/// negative `x-delay` is left as it was). An error names what is missing or malformed.
pub fn restore(p: &BasicProperties) -> Result<(String, BasicProperties), String> {
    let empty = FieldTable::default();
    let h = p.headers().as_ref().unwrap_or(&empty);
    let key = text_header(h, envelope::ROUTING_KEY)?.ok_or_else(|| {
        format!(
            "header '{}' is missing: the message did not come through a gateway ingress",
            envelope::ROUTING_KEY
        )
    })?;
    if key.len() > 255 {
        return Err(format!(
            "header '{}' is longer than 255 bytes",
            envelope::ROUTING_KEY
        ));
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
    let mut out = headers::filter(h, |k| (!is_ours(k) || k == USER_ID) && !is_broker_added(k));
    if delay > 0 {
        let neg = -(delay as i64);
        let v = match i32::try_from(neg) {
            Ok(n) => AMQPValue::LongInt(n), // the plugin's type (signedint)
            Err(_) => AMQPValue::LongLongInt(neg),
        };
        out.insert(X_DELAY.into(), v);
    }
    let mut props = copy_props(
        p,
        Without {
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

// ---- names ---------------------------------------------------------------------------------

/// Queue bound to the ingress exchange `ingress`.
pub fn ingress_queue(prefix: &str, ingress: &str) -> String {
    format!("{prefix}.gw.in.{ingress}")
}

/// Destination queue of the messages of `ingress` while they wait.
pub fn due_queue(prefix: &str, ingress: &str) -> String {
    format!("{prefix}.gw.due.{ingress}")
}

/// One ingress → target pair with its queue names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub ingress: String,
    pub target: String,
    pub ingress_queue: String,
    pub due_queue: String,
}

impl Pair {
    /// Computes the names and checks they are valid for `layout` (destination rules, lengths
    /// of the parking queues the worker declares).
    pub fn new(layout: &Layout, cfg: &PairConfig) -> Result<Pair, String> {
        let p = layout.prefix();
        let pair = Pair {
            ingress: cfg.ingress.clone(),
            target: cfg.target.clone(),
            ingress_queue: ingress_queue(p, &cfg.ingress),
            due_queue: due_queue(p, &cfg.ingress),
        };
        for q in [&pair.ingress_queue, &pair.due_queue] {
            layout
                .validate_destination(q)
                .map_err(|e| format!("ingress '{}': {e}", cfg.ingress))?;
            let parked = parked_queue(p, q);
            if parked.len() > 255 {
                return Err(format!(
                    "ingress '{}': its parking queue name '{parked:.60}…' would be {} bytes, more than 255; use a shorter ingress name or prefix",
                    cfg.ingress,
                    parked.len()
                ));
            }
        }
        Ok(pair)
    }

    /// Where messages of this pair are parked (refused `x-delay`, unroutable at the target).
    pub fn parked_queue(&self, prefix: &str) -> String {
        parked_queue(prefix, &self.due_queue)
    }
}

// ---- the handler ---------------------------------------------------------------------------

struct PairCtx {
    pair: Pair,
    max_delay_ms: u64,
    /// Longest wait for the tier publish's confirm before the ingress message is requeued.
    confirm_timeout: Duration,
}

/// The gateway's [`Handler`]: one value per subscribed queue.
#[derive(Clone)]
pub struct GatewayHandler {
    ctx: Arc<PairCtx>,
    ingress: bool,
}

impl Handler for GatewayHandler {
    async fn handle(&self, d: &Delivery, ctx: &Context) -> Outcome {
        if self.ingress {
            self.handle_ingress(d, ctx).await
        } else {
            self.handle_due(d, ctx).await
        }
    }
}

impl GatewayHandler {
    async fn handle_ingress(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        let value = d.headers().and_then(|h| h.inner().get(X_DELAY));
        let (delay_ms, invalid) = match parse_x_delay(value, c.max_delay_ms) {
            Ok(ms) => (ms, None),
            Err(reason) => (0, Some(reason)),
        };
        let msg = Message {
            destination: c.pair.due_queue.clone(),
            delay_ms,
            body: d.body.clone(),
            properties: stash(&d.properties, &d.routing_key, invalid.as_deref()),
            attempt: 0,
        };
        let sent = tokio::time::timeout(c.confirm_timeout, ctx.publisher().schedule(msg)).await;
        match sent {
            Ok(Ok(_)) => Outcome::Success,
            // Cannot happen: the delay was checked against the same layout.
            Ok(Err(e @ Error::Plan(_))) => {
                Outcome::Permanent(format!("cannot schedule: {}", crate::cli::chain(&e)))
            }
            // Everything else (nack, lost channel, missing delivery exchange or due queue) is
            // the infrastructure's: the message waits in the ingress queue, unchanged.
            Ok(Err(e)) => Outcome::Requeue(format!(
                "moving the message into the tiers failed: {}",
                crate::cli::chain(&e)
            )),
            Err(_) => Outcome::Requeue(format!(
                "the broker did not confirm the tier publish within {:?}",
                c.confirm_timeout
            )),
        }
    }

    async fn handle_due(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        let empty = FieldTable::default();
        match text_header(d.headers().unwrap_or(&empty), INVALID) {
            Ok(Some(reason)) => return Outcome::Permanent(reason),
            Ok(None) => {}
            Err(e) => return Outcome::Permanent(e),
        }
        let (key, props) = match restore(&d.properties) {
            Ok(r) => r,
            Err(reason) => return Outcome::Permanent(reason),
        };
        let target = &c.pair.target;
        match ctx
            .publisher()
            .publish_confirmed(target, &key, &d.body, props)
            .await
        {
            Ok(()) => Outcome::Success,
            Err(Error::Returned { .. }) => Outcome::Permanent(format!(
                "unroutable at exchange '{target}' with routing key '{key}': no binding matches"
            )),
            Err(e) => Outcome::Retry(format!(
                "publishing to '{target}': {}",
                crate::cli::chain(&e)
            )),
        }
    }
}

// ---- broker I/O ----------------------------------------------------------------------------

/// The gateway of [`Settings::gateway`]'s pairs.
pub struct Gateway {
    settings: Settings,
    layout: Layout,
    pairs: Vec<Pair>,
}

async fn open(conn: &Connection) -> Result<Channel> {
    conn.create_channel()
        .await
        .context(|| "opening a channel".into())
}

impl Gateway {
    /// Validates the pairs of `settings.gateway` against the layout (no I/O).
    pub fn new(settings: Settings) -> Result<Gateway> {
        settings.gateway.validate().map_err(Error::Invalid)?;
        if settings.gateway.pairs.is_empty() {
            return Err(Error::Invalid(
                "the gateway has no pair: give --ingress EXCHANGE --target EXCHANGE, or [[gateway.pairs]] in --config".into(),
            ));
        }
        let layout = settings
            .layout()
            .map_err(crate::settings::SettingsError::from)?;
        let pairs = settings
            .gateway
            .pairs
            .iter()
            .map(|p| Pair::new(&layout, p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(Error::Invalid)?;
        Ok(Gateway {
            settings,
            layout,
            pairs,
        })
    }

    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }

    /// Declares the tier topology, then per pair the ingress exchange (durable fanout), the
    /// ingress and due queues and the binding; checks that every target exchange exists.
    /// Idempotent.
    pub async fn declare(&self, conn: &Connection) -> Result<()> {
        Topology::new(self.layout.clone()).declare(conn).await?;
        let mut qargs = FieldTable::default();
        qargs.insert(
            "x-queue-type".into(),
            long_string(&self.layout.queue_type().to_string()),
        );
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for p in &self.pairs {
            let ch = open(conn).await?;
            if let Err(e) = ch
                .exchange_declare(
                    p.target.as_str().into(),
                    ExchangeKind::Fanout,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                return Err(match broker_error(&e) {
                    Some((404, _)) => Error::Invalid(format!(
                        "target exchange '{}' does not exist: declare it, with the bindings your queues had on the delayed exchange, before starting the gateway",
                        p.target
                    )),
                    _ => Error::Amqp {
                        context: format!("checking target exchange '{}'", p.target),
                        source: e,
                    },
                });
            }
            if let Err(e) = ch
                .exchange_declare(
                    p.ingress.as_str().into(),
                    ExchangeKind::Fanout,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                return Err(match broker_error(&e) {
                    Some((406, text)) => Error::Conflict(format!(
                        "exchange '{}' exists with another type or arguments (the plugin's x-delayed-message exchange?): {text}. Delete it once it is drained, or choose another ingress name",
                        p.ingress
                    )),
                    _ => Error::Amqp {
                        context: format!("declaring ingress exchange '{}'", p.ingress),
                        source: e,
                    },
                });
            }
            for q in [&p.ingress_queue, &p.due_queue] {
                ch.queue_declare(q.as_str().into(), durable, qargs.clone())
                    .await
                    .context(|| format!("declaring queue '{q}'"))?;
            }
            ch.queue_bind(
                p.ingress_queue.as_str().into(),
                p.ingress.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .context(|| format!("binding '{}' to '{}'", p.ingress_queue, p.ingress))?;
            let _ = ch.close(200, "declared".into()).await;
        }
        Ok(())
    }

    /// Deletes what [`Gateway::declare`] created for the pairs (ingress exchanges, ingress, due
    /// and parking queues; messages in them are lost). Leaves the targets and the tier topology.
    pub async fn delete(&self, conn: &Connection) -> Result<()> {
        let ch = open(conn).await?;
        let prefix = self.layout.prefix();
        for p in &self.pairs {
            for q in [
                p.ingress_queue.clone(),
                p.due_queue.clone(),
                parked_queue(prefix, &p.ingress_queue),
                parked_queue(prefix, &p.due_queue),
            ] {
                ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .context(|| format!("deleting queue '{q}'"))?;
            }
            ch.exchange_delete(p.ingress.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .context(|| format!("deleting exchange '{}'", p.ingress))?;
        }
        let _ = ch.close(200, "deleted".into()).await;
        Ok(())
    }

    /// The worker consuming every pair's ingress and due queues.
    pub fn worker(&self) -> Worker<GatewayHandler> {
        // The tier publish must be given up (and the ingress message requeued) before the
        // worker's handler timeout would turn it into a retry.
        let handler_ms = self.settings.consumer.handler_timeout.as_millis();
        let confirm_timeout = Duration::from_millis((handler_ms / 2).clamp(1, 30_000));
        let mut w = Worker::new(self.settings.clone());
        for p in &self.pairs {
            let ctx = Arc::new(PairCtx {
                pair: p.clone(),
                max_delay_ms: self.layout.max_delay_ms(),
                confirm_timeout,
            });
            w = w
                .subscribe(
                    p.ingress_queue.clone(),
                    GatewayHandler {
                        ctx: ctx.clone(),
                        ingress: true,
                    },
                )
                .subscribe(
                    p.due_queue.clone(),
                    GatewayHandler {
                        ctx,
                        ingress: false,
                    },
                );
        }
        w
    }

    /// Declares everything, then relays messages until `shutdown` completes (the worker
    /// reconnects after a connection loss).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let conn = crate::connection::connect(&self.settings.url, "amqp-delay gateway").await?;
        let declared = self.declare(&conn).await;
        let _ = conn.close(200, "declared".into()).await;
        declared?;
        for p in &self.pairs {
            tracing::info!(
                ingress = %p.ingress,
                target = %p.target,
                parked = %p.parked_queue(self.layout.prefix()),
                "gateway pair ready"
            );
        }
        self.worker().run(shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{DecimalValue, FieldArray};

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
        assert_eq!(h.inner().get(envelope::ROUTING_KEY), Some(&s("orders.eu")));
        assert_eq!(h.inner().get(EXPIRATION), Some(&s("60000")));
        assert_eq!(h.inner().get(USER_ID), Some(&s("alice")));
        for gone in ["x-death", "x-delivery-count", "x-delay-attempt"] {
            assert!(!h.contains_key(gone), "{gone}");
        }
        assert!(!h.contains_key(NO_MESSAGE_ID) && !h.contains_key(NO_HEADERS));
        // accepted by the publisher's rules
        headers::check_not_reserved(&h).unwrap();
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
        let mut want = copy_props(
            &original,
            Without {
                user_id: true,
                ..Without::default()
            },
        );
        want = want.with_headers(want_h);
        assert_eq!(p, want);
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
        h.insert(envelope::ROUTING_KEY.into(), AMQPValue::LongInt(3));
        let e = restore(&BasicProperties::default().with_headers(h)).unwrap_err();
        assert!(e.contains("not a string"), "{e}");
    }

    #[test]
    fn invalid_reason_travels_in_a_header() {
        let t = stash(&app_props(), "k", Some("x-delay 'abc' is not ..."));
        let h = t.headers().clone().unwrap();
        assert_eq!(h.inner().get(INVALID), Some(&s("x-delay 'abc' is not ...")));
    }

    #[test]
    fn pair_names_never_collide_and_are_checked() {
        let layout = Settings::default().layout().unwrap();
        let pair = |i: &str| {
            Pair::new(
                &layout,
                &PairConfig {
                    ingress: i.into(),
                    target: "t".into(),
                },
            )
        };
        let a = pair("x").unwrap();
        let b = pair("x.due").unwrap();
        let c = pair("due.x").unwrap();
        let names = [
            &a.ingress_queue,
            &a.due_queue,
            &b.ingress_queue,
            &b.due_queue,
            &c.ingress_queue,
            &c.due_queue,
        ];
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert!(pair("a..b").is_err());
        assert!(pair("a.*").is_err());
        assert!(pair(&"x".repeat(220)).unwrap_err().contains("255"));
        assert!(pair(&"x".repeat(240)).is_err());
    }

    #[test]
    fn pair_settings_are_validated() {
        let f = |i: &[&str], t: &[&str]| {
            GatewaySettings::from_flags(
                &i.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                &t.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
        };
        assert_eq!(f(&["a", "b"], &["x", "y"]).unwrap().pairs.len(), 2);
        assert!(
            f(&["a"], &[])
                .unwrap_err()
                .contains("one --target per --ingress")
        );
        assert!(f(&["a"], &["a"]).unwrap_err().contains("come back"));
        assert!(f(&["a", "a"], &["x", "y"]).unwrap_err().contains("twice"));
        assert!(f(&["amq.x"], &["y"]).unwrap_err().contains("amq."));
        assert!(f(&[""], &["y"]).is_err());
    }
}
