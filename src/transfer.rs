//! Moving what waits to another cluster (`delay-publisher transfer`), pure: which queues of a
//! layout hold messages that have not run, in the order messages flow through them, and the
//! copy of each message read from one of them (a plain message, or every member of a batch),
//! scheduled on the other cluster for its original due time.
//!
//! A copy keeps the message's id, properties (not `user_id`, which the broker checks against
//! the writing connection, nor `expiration`), headers and body. It names the message's owner
//! on the old cluster in [`crate::headers::OWNER`], and carries the other `x-delay-*` headers
//! only when the old copy's writer is believed in them ([`Trust::vouches_for_headers`]): the
//! copy is written by the transfer's user, whose headers the new cluster believes, so it must
//! not launder what a stranger forged. The schedule headers are set again by the publisher.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use crate::batch;
use crate::cancel::Subject;
use crate::envelope::{self, Omit};
use crate::headers;
use crate::layout::{Layout, TierKind};
use crate::message::Message;
use crate::trust::Trust;

/// The tier queues of `layout` in the order messages flow through them: the overflow chain
/// from its first element, the fixed levels, then the cascade from its top level down. Read in
/// this order, a message that moves on while the transfer runs moves into a queue not read yet.
pub fn tier_queues(layout: &Layout) -> Vec<String> {
    let mut tiers = layout.tiers();
    tiers.sort_by_key(|t| match t.kind {
        TierKind::Overflow { index } => (0, u64::from(index), 0),
        TierKind::Fixed { ttl_ms } => (1, u64::MAX - ttl_ms, 0),
        TierKind::Cascade { level, digit } => (2, u64::from(u32::MAX - level), digit),
    });
    tiers.into_iter().map(|t| t.queue).collect()
}

/// The gateway ingress whose due queue `queue` is, when it is one of `layout`'s.
pub fn due_queue_ingress<'a>(layout: &Layout, queue: &'a str) -> Option<&'a str> {
    queue
        .strip_prefix(layout.gateway_due_queue("").as_str())
        .filter(|i| !i.is_empty())
}

/// The name on the new cluster of destination `destination` of the old one: a gateway's due
/// and ingress queues are renamed into the new prefix, any other destination keeps its name.
pub fn destination_on(from: &Layout, to: &Layout, destination: &str) -> String {
    if let Some(ingress) = due_queue_ingress(from, destination) {
        return to.gateway_due_queue(ingress);
    }
    match destination
        .strip_prefix(from.gateway_ingress_queue("").as_str())
        .filter(|i| !i.is_empty())
    {
        Some(ingress) => to.gateway_ingress_queue(ingress),
        None => destination.to_string(),
    }
}

/// Whose parking queue a queue of the old cluster is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parking<'a> {
    /// `<prefix>.parked`: what no destination took.
    Unroutable,
    /// `<prefix>.parked.<destination>`.
    Of(&'a str),
}

/// Whose parking queue `queue` is on the old cluster `from`, if it is one.
pub fn parking_of<'a>(from: &Layout, queue: &'a str) -> Option<Parking<'a>> {
    if queue == from.unroutable_queue() {
        return Some(Parking::Unroutable);
    }
    queue
        .strip_prefix(from.parked_prefix().as_str())
        .filter(|d| !d.is_empty())
        .map(Parking::Of)
}

/// A parked message's copy for the new cluster's parking queue of the same destination.
#[derive(Debug, Clone)]
pub struct ParkedCopy {
    /// Where to publish it: the new cluster's park exchange (or, for what no destination
    /// took, its parking exchange).
    pub exchange: String,
    /// Its routing key there: the destination on the new cluster (else the one it had).
    pub routing_key: String,
    /// Its properties: as parked (not `user_id`, `expiration`), the parking headers kept, the
    /// owner named in [`crate::headers::OWNER`].
    pub properties: BasicProperties,
    /// `x-delay-*` headers left out because its writer is not believed in them.
    pub headers_removed: usize,
}

/// The copy of a message read from the old cluster's parking queue `queue` with
/// `routing_key`: body and properties as parked (a batch in `<prefix>.parked` moves whole), the
/// parking headers (reason, attempts, from, at) kept when its writer is believed in them (an
/// unsigned one came through the park exchange, which only workers write), the queue it was
/// parked from renamed as [`destination_on`] does, its owner named.
pub fn parked_copy(
    r: &Reading<'_>,
    queue: &str,
    routing_key: &str,
    p: &BasicProperties,
) -> Result<ParkedCopy, String> {
    let (exchange, key) = match parking_of(r.from, queue) {
        Some(Parking::Unroutable) => (r.to.parking_exchange(), routing_key.to_string()),
        Some(Parking::Of(d)) => (r.to.park_exchange(), destination_on(r.from, r.to, d)),
        None => return Err(format!("'{queue}' is no parking queue")),
    };
    // a worker parks without a `user_id`: unsigned, it came through the park exchange, which
    // only the worker roles (and admins) may write, and is believed as `parked` believes it
    let writer = p.user_id().as_ref().map(|u| u.as_str());
    let (owner, believed) = match writer {
        None => (envelope::owner_header(p).filter(|o| !o.is_empty()), true),
        w => (
            r.trust.owner(w, envelope::owner_header(p).as_deref()),
            r.trust.vouches_for_headers(w),
        ),
    };
    let removed = std::cell::Cell::new(0);
    let empty = FieldTable::default();
    let mut kept = headers::filter(p.headers().as_ref().unwrap_or(&empty), |k| {
        if headers::is_broker_header(k) || k == headers::OWNER {
            return false;
        }
        let stranger = headers::is_ours(k) && !headers::is_schedule_header(k) && !believed;
        if stranger {
            removed.set(removed.get() + 1);
        }
        !stranger
    });
    let from = kept
        .inner()
        .get(headers::PARKED_FROM)
        .and_then(|v| match v {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        });
    if let Some(f) = from {
        let renamed = destination_on(r.from, r.to, &f);
        kept.insert(
            headers::PARKED_FROM.into(),
            AMQPValue::LongString(renamed.as_str().into()),
        );
    }
    Ok(ParkedCopy {
        exchange,
        routing_key: key,
        properties: copied_properties(p, kept, owner.as_deref()),
        headers_removed: removed.get(),
    })
}

/// What a transfer reads with.
#[derive(Debug, Clone, Copy)]
pub struct Reading<'a> {
    /// The old cluster's layout.
    pub from: &'a Layout,
    /// The new cluster's layout.
    pub to: &'a Layout,
    /// Whose messages and headers count for what on the old cluster.
    pub trust: &'a Trust,
    /// The most members a batch may hold (`publisher.batch_max_messages`, at least its default).
    pub max_members: usize,
}

/// A message read from the old cluster and the copy that replaces it on the new one.
#[derive(Debug, Clone)]
pub struct Copy {
    /// Its message id (empty when it has none: the publisher gives the copy one).
    pub id: String,
    /// Its owner on the old cluster ([`Trust::owner`]), named by the copy.
    pub owner: Option<String>,
    /// Its destination on the old cluster.
    pub destination: String,
    /// Its original due time (ms since the epoch).
    pub due_ms: u64,
    /// The delay it was scheduled with on the old cluster.
    pub delay_ms: Option<u64>,
    /// Its delivery attempt.
    pub attempt: u32,
    /// Its headers as read (for the old cluster's purges, which match headers).
    pub headers: Option<FieldTable>,
    /// `x-delay-*` headers left out because its writer is not believed in them.
    pub headers_removed: usize,
    /// The copy, for the new cluster: due at [`Copy::due_ms`]; set its `delay_ms` to what is
    /// left until then just before it is scheduled ([`Copy::message_now`]).
    message: Message,
}

impl Copy {
    /// The copy as the old cluster's cancels, purges and reschedules see it.
    pub fn subject(&self) -> Subject<'_> {
        Subject {
            id: &self.id,
            owner: self.owner.as_deref(),
            queue: &self.destination,
            due_at_ms: Some(self.due_ms),
            delay_ms: self.delay_ms,
            attempt: self.attempt,
            headers: self.headers.as_ref(),
        }
    }

    /// Moves it to `due_ms` (a reschedule on the old cluster moved it).
    pub fn move_to(&mut self, due_ms: u64) {
        self.due_ms = due_ms;
        self.message.due_at = Some(due_ms);
    }

    /// Its destination on the new cluster.
    pub fn new_destination(&self) -> &str {
        &self.message.destination
    }

    /// The gateway target it is delivered to (journaled on the new cluster), if a gateway's.
    pub fn set_target(&mut self, target: Option<String>) {
        self.message.target = target;
    }

    /// The copy to schedule at `now_ms`: due at its original due time (at once when that has
    /// passed).
    pub fn message_now(mut self, now_ms: u64) -> Message {
        self.message.delay_ms = self.due_ms.saturating_sub(now_ms);
        self.message
    }
}

/// The copies of a message read from `queue` with `routing_key` (one per member of a batch),
/// or why there can be none (the message stays on the old cluster).
pub fn copies(
    r: &Reading<'_>,
    queue: &str,
    routing_key: &str,
    properties: &BasicProperties,
    body: &[u8],
) -> Result<Vec<Copy>, String> {
    // a tier's routing key is one digit word per level, then the destination; a message in a
    // due queue has arrived at its destination
    let destination = if due_queue_ingress(r.from, queue).is_some() {
        queue.to_string()
    } else {
        let mut rest = routing_key;
        for _ in 0..r.from.levels() {
            rest = rest
                .split_once('.')
                .map(|(_, d)| d)
                .ok_or_else(|| format!("routing key '{routing_key}' names no destination"))?;
        }
        rest.to_string()
    };
    if !batch::is_batch(properties) {
        return Ok(vec![copy(
            r,
            &destination,
            properties,
            None,
            body.to_vec(),
        )?]);
    }
    let members = batch::decode_bounded(body, batch::announced_count(properties), r.max_members)?;
    members
        .into_iter()
        .map(|m| copy(r, &destination, &m.properties, Some(properties), m.body))
        .collect()
}

/// The copy of one message (`batch`: the batch it travelled in, whose writer the broker
/// checked).
fn copy(
    r: &Reading<'_>,
    destination: &str,
    p: &BasicProperties,
    batch: Option<&BasicProperties>,
    body: Vec<u8>,
) -> Result<Copy, String> {
    let writer = batch.unwrap_or(p).user_id().as_ref().map(|u| u.as_str());
    let owner = r.trust.owner(writer, envelope::owner_header(p).as_deref());
    let read = p.headers().clone();
    let empty = FieldTable::default();
    let h = read.as_ref().unwrap_or(&empty);
    let int = |name| match h.inner().get(name) {
        None => Ok(None),
        Some(v) => headers::as_int(v)
            .and_then(|n| u64::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| format!("header '{name}' is not a non-negative integer")),
    };
    let due_ms = int(headers::DUE_AT)?
        .ok_or_else(|| format!("no '{}' header: not a message of ours", headers::DUE_AT))?;
    let delay_ms = int(headers::DELAY_MS)?;
    let attempt = u32::try_from(int(headers::ATTEMPT)?.unwrap_or(0))
        .map_err(|_| format!("header '{}' is out of range", headers::ATTEMPT))?;
    let believed = r.trust.vouches_for_headers(writer);
    let removed = std::cell::Cell::new(0);
    let kept = headers::filter(h, |k| {
        let ours = headers::is_ours(k);
        let drop = headers::is_broker_header(k)
            || headers::is_schedule_header(k)
            || k == headers::OWNER
            || k.starts_with(headers::PARKED_PREFIX);
        if ours && !drop && !believed {
            removed.set(removed.get() + 1);
            return false;
        }
        !drop
    });
    let properties = copied_properties(p, kept, owner.as_deref());
    let id = p
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let mut message = Message::new(destination_on(r.from, r.to, destination), 0, body)
        .with_properties(properties)
        .with_attempt(attempt)
        .internal();
    message.due_at = Some(due_ms);
    message.transferred = true;
    Ok(Copy {
        id,
        owner,
        destination: destination.to_string(),
        due_ms,
        delay_ms,
        attempt,
        headers: read,
        headers_removed: removed.get(),
        message,
    })
}

/// A copy's properties: `p`'s but `user_id` (the broker checks it against the writer) and
/// `expiration`, with `table` as headers, naming `owner`.
fn copied_properties(
    p: &BasicProperties,
    mut table: FieldTable,
    owner: Option<&str>,
) -> BasicProperties {
    if let Some(o) = owner {
        table.insert(headers::OWNER.into(), AMQPValue::LongString(o.into()));
    }
    let omit = Omit {
        headers: true,
        expiration: true,
        user_id: true,
        ..Omit::default()
    };
    envelope::copy_properties(p, omit).with_headers(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{Settings, TrustSettings};

    fn layouts() -> (Layout, Layout) {
        let s = Settings::default();
        let from = Layout::new("old", &s.topology).unwrap();
        let to = Layout::new("new", &s.topology).unwrap();
        (from, to)
    }

    fn trust() -> Trust {
        Trust::new(
            Some("mover".into()),
            &TrustSettings {
                admins: vec!["mover".into()],
                peers: vec!["worker".into()],
                ..TrustSettings::default()
            },
        )
    }

    fn props(user: &str, h: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut t = FieldTable::default();
        for (k, v) in h {
            t.insert((*k).into(), v.clone());
        }
        BasicProperties::default()
            .with_user_id(user.into())
            .with_message_id("m1".into())
            .with_headers(t)
    }

    #[test]
    fn tiers_are_read_upstream_first() {
        let (from, _) = layouts();
        let q = tier_queues(&from);
        assert_eq!(q.len(), from.tiers().len());
        let top = from.cascade_queue(from.levels() - 1, 1);
        let bottom = from.cascade_queue(0, 1);
        let pos = |n: &str| q.iter().position(|x| x == n).unwrap();
        assert!(pos(&from.fixed_queue(30_000)) < pos(&top));
        assert!(pos(&top) < pos(&bottom));
    }

    #[test]
    fn a_copy_keeps_its_due_time_and_owner_and_drops_what_a_stranger_forged() {
        let (from, to) = layouts();
        let t = trust();
        let r = Reading {
            from: &from,
            to: &to,
            trust: &t,
            max_members: 100,
        };
        let due = AMQPValue::LongLongInt(1_900_000_000_000);
        let forged = AMQPValue::LongString("k".into());
        // an application's own message: owned by its writer; its forged routing key dropped
        let p = props(
            "alice",
            &[
                (headers::DUE_AT, due.clone()),
                (headers::ROUTING_KEY, forged.clone()),
                (headers::OWNER, AMQPValue::LongString("bob".into())),
                ("x-death", AMQPValue::Void),
                ("app", AMQPValue::Boolean(true)),
            ],
        );
        let key = from.routing_key(&[1], "orders");
        let c = copies(&r, "old.level0.d1", &key, &p, b"x").unwrap();
        assert_eq!(c.len(), 1);
        let c = c.into_iter().next().unwrap();
        assert_eq!(
            (c.owner.as_deref(), c.due_ms),
            (Some("alice"), 1_900_000_000_000)
        );
        assert_eq!((c.destination.as_str(), c.headers_removed), ("orders", 1));
        let m = c.message_now(1_899_999_999_000);
        assert_eq!(m.delay_ms, 1_000);
        let h = m.properties.headers().clone().unwrap();
        let keys: Vec<_> = h.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["app", headers::OWNER]);
        assert_eq!(
            envelope::owner_header(&m.properties).as_deref(),
            Some("alice")
        );
        assert!(m.properties.user_id().is_none());
        // a worker's retry names its owner, and its headers are believed
        let p = props(
            "worker",
            &[
                (headers::DUE_AT, due),
                (headers::OWNER, AMQPValue::LongString("bob".into())),
                (headers::ROUTING_KEY, forged),
            ],
        );
        let c = copies(&r, "old.gw.due.in", "x", &p, b"x").unwrap();
        let c = &c[0];
        assert_eq!(c.owner.as_deref(), Some("bob"));
        assert_eq!(c.new_destination(), "new.gw.due.in");
        assert_eq!(c.headers_removed, 0);
        // no due time: not ours, stays
        let p = props("alice", &[]);
        assert!(copies(&r, "old.level0.d1", "1.x", &p, b"x").is_err());
    }

    #[test]
    fn a_parked_copy_goes_to_the_same_destinations_parking_queue_with_its_parking_headers() {
        let (from, to) = layouts();
        let t = trust();
        let r = Reading {
            from: &from,
            to: &to,
            trust: &t,
            max_members: 100,
        };
        let s = |v: &str| AMQPValue::LongString(v.into());
        let parked = [
            (headers::PARKED_REASON, s("no")),
            (headers::PARKED_FROM, s("old.gw.due.in")),
            (headers::PARKED_ATTEMPTS, AMQPValue::LongLongInt(3)),
            (headers::OWNER, s("bob")),
            ("x-death", AMQPValue::Void),
            ("app", AMQPValue::Boolean(true)),
        ];
        let c = parked_copy(
            &r,
            "old.parked.old.gw.due.in",
            "k",
            &props("worker", &parked),
        )
        .unwrap();
        assert_eq!(
            (c.exchange.as_str(), c.routing_key.as_str()),
            ("new.park", "new.gw.due.in")
        );
        let h = c.properties.headers().clone().unwrap();
        let get = |k: &str| h.inner().get(k).cloned();
        assert_eq!(get(headers::PARKED_FROM), Some(s("new.gw.due.in")));
        assert_eq!(get(headers::OWNER), Some(s("bob")));
        assert_eq!(get(headers::PARKED_REASON), Some(s("no")));
        assert!(get("x-death").is_none() && get("app").is_some());
        assert!(c.properties.user_id().is_none());
        // what no destination took goes to the new parking exchange, its key kept
        let c = parked_copy(&r, "old.parked", "1.2.q", &props("worker", &[])).unwrap();
        assert_eq!(
            (c.exchange.as_str(), c.routing_key.as_str()),
            ("new.parking", "1.2.q")
        );
        // a stranger's parking headers are not believed; it owns what it wrote
        let c = parked_copy(&r, "old.parked.q", "q", &props("alice", &parked)).unwrap();
        assert_eq!(c.headers_removed, 3);
        let h = c.properties.headers().clone().unwrap();
        assert_eq!(h.inner().get(headers::OWNER), Some(&s("alice")));
        // unsigned, as a worker parks: believed
        let unsigned =
            BasicProperties::default().with_headers(props("x", &parked).headers().clone().unwrap());
        let c = parked_copy(&r, "old.parked.q", "q", &unsigned).unwrap();
        let h = c.properties.headers().clone().unwrap();
        assert_eq!(c.headers_removed, 0);
        assert_eq!(h.inner().get(headers::OWNER), Some(&s("bob")));
        assert!(parked_copy(&r, "old.level0.d1", "q", &props("worker", &[])).is_err());
    }
}
