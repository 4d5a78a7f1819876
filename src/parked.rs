//! The parked messages (`<prefix>.parked.<queue>`, and `<prefix>.parked` for what no queue
//! took): list them, and retry or drop some by id. v1 reads the parking queue itself, which is
//! fit for thousands of messages; it needs `read` (and for retry/drop, the admin's rights) on
//! the parking queue, which the documented publisher set does not have.
//!
//! Reading a quorum queue over AMQP always moves something, so every command here is one
//! **whole-queue rotation** (docs/reports/2026-12-06-parked-browse.md): take a lock of our own
//! (an exclusive queue `<prefix>.parked-lock.<queue>`: a second command gets
//! `RESOURCE_LOCKED`), learn the ready count with a passive declare, consume exactly that many
//! with prefetch ≥ the count and manual acks, ack the chosen ones (a retry only once its copy is
//! confirmed), then cancel the consumer and close the channel, so that everything else goes
//! back in its order (kept on 3.10.8, 4.0.5 and 4.3.6). Never a partial read (it reorders),
//! never `basic.get` with a give-back per message (reorders on 3.10). The parking queues'
//! `x-delivery-limit` of 10^9 makes the +1 each rotation adds to a message's count harmless.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};

use crate::broker;
use crate::envelope;
use crate::error::{Error, Result, ResultExt};
use crate::headers;
use crate::layout::Layout;
use crate::message::Message;
use crate::publisher::Publisher;

/// The most messages one rotation takes: above it, commands refuse and say what to do.
pub const MAX_MESSAGES: u32 = 10_000;

/// The most body bytes one rotation holds: past it, it gives everything back and says so
/// (every message it reads stays in memory until the rotation ends).
pub const MAX_BYTES: usize = 256 << 20;

/// How many body bytes [`list`] keeps of each message.
pub const PREVIEW_BYTES: usize = 256;

/// How long a rotation waits for the next of the messages the queue said it holds.
const TAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a rotation waits for what it gave back to be ready again.
const RETURN_TIMEOUT: Duration = Duration::from_secs(10);

/// The broker's reply when an exclusive queue is declared by another connection.
const RESOURCE_LOCKED: u16 = 405;

/// One parked message, as read from its parking queue.
#[derive(Debug, Clone)]
pub struct Parked {
    /// 1 for the head of the queue.
    pub position: u64,
    /// Its `message_id` (empty when it has none).
    pub message_id: String,
    /// The queue it was parked from (`x-delay-parked-from`).
    pub parked_from: Option<String>,
    /// Why (`x-delay-parked-reason`).
    pub reason: Option<String>,
    /// How many executions it had (`x-delay-parked-attempts`).
    pub attempts: Option<u64>,
    /// When it was parked, ms since the Unix epoch (`x-delay-parked-at`).
    pub parked_at_ms: Option<u64>,
    /// Who scheduled it: `x-delay-owner`, else its `user_id`.
    pub owner: Option<String>,
    /// Body size in bytes.
    pub size: usize,
    /// Its `content_type`.
    pub content_type: Option<String>,
    /// Every header it carries, ours and the broker's included.
    pub headers: FieldTable,
    /// The body, cut to the bound the caller asked for ([`PREVIEW_BYTES`] for [`list`]).
    pub body: Vec<u8>,
}

impl Parked {
    /// The application's own headers: not `x-delay-*` and not the broker's.
    pub fn user_headers(&self) -> FieldTable {
        headers::filter(&self.headers, |k| {
            !headers::is_ours(k) && !headers::is_broker_header(k)
        })
    }
}

/// What [`retry`] or [`drop`] did with each id asked for.
#[derive(Debug, Clone, Default)]
pub struct Changed {
    /// Ids found and retried or dropped (each message with that id).
    pub done: Vec<String>,
    /// Ids no message in the queue has.
    pub not_found: Vec<String>,
    /// Ids found but left parked, with why (a retry that could not be scheduled).
    pub failed: Vec<(String, String)>,
}

/// The parking queue's name: of destination `queue`, or `<prefix>.parked` for `None`.
pub fn queue_name(layout: &Layout, queue: Option<&str>) -> String {
    match queue {
        Some(q) => layout.parked_queue(q),
        None => layout.unroutable_queue(),
    }
}

/// Every message in the parking queue of `queue` (`None`: `<prefix>.parked`), in order, the
/// first `limit`; bodies cut to `body_bytes`. The queue is left as it was.
pub async fn list(
    conn: &Connection,
    layout: &Layout,
    queue: Option<&str>,
    limit: usize,
    body_bytes: usize,
) -> Result<Vec<Parked>> {
    let mut out = Vec::new();
    rotate(conn, layout, queue, async |taken, _ch| {
        out = taken
            .iter()
            .take(limit)
            .enumerate()
            .map(|(i, d)| describe(i as u64 + 1, d, body_bytes))
            .collect();
        Ok(0)
    })
    .await?;
    Ok(out)
}

/// Drops (acks) every message of the parking queue of `queue` whose id is one of `ids`; the
/// others stay, in their order.
pub async fn drop(
    conn: &Connection,
    layout: &Layout,
    queue: Option<&str>,
    ids: &[String],
) -> Result<Changed> {
    let name = queue_name(layout, queue);
    let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let mut changed = Changed::default();
    rotate(conn, layout, queue, async |taken, ch| {
        let mut found = BTreeSet::new();
        let mut acked = 0;
        for d in taken.iter().filter(|d| wanted.contains(id_of(d).as_str())) {
            ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
                .await
                .context(|| format!("acking a parked message in '{name}'"))?;
            acked += 1;
            found.insert(id_of(d));
        }
        changed.done = found.into_iter().collect();
        Ok(acked)
    })
    .await?;
    changed.not_found = missing(ids, &changed.done);
    Ok(changed)
}

/// Schedules a copy of every message of the parking queue of `queue` whose id is one of `ids`
/// to the queue it was parked from (or `queue`), after `delay_ms`, with attempt 0 and without
/// the parking, dead-letter and schedule headers; acks each parked message once its copy is
/// confirmed. The others stay, in their order.
pub async fn retry(
    conn: &Connection,
    layout: &Layout,
    publisher: &Publisher,
    queue: Option<&str>,
    ids: &[String],
    delay_ms: u64,
) -> Result<Changed> {
    let name = queue_name(layout, queue);
    let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let mut changed = Changed::default();
    rotate(conn, layout, queue, async |taken, ch| {
        let mut done = BTreeSet::new();
        let mut acked = 0;
        for d in taken.iter().filter(|d| wanted.contains(id_of(d).as_str())) {
            let id = id_of(d);
            let Some(dest) = text(d.properties.headers().as_ref(), headers::PARKED_FROM)
                .or(queue.map(str::to_string))
            else {
                changed
                    .failed
                    .push((id, "it names no queue it was parked from".into()));
                continue;
            };
            match publisher.schedule(copy_of(d, &dest, delay_ms)).await {
                Ok(_) => {
                    ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await
                        .context(|| format!("acking a parked message in '{name}'"))?;
                    tracing::info!(id = %id, destination = %dest, delay_ms, "parked message retried");
                    acked += 1;
                    done.insert(id);
                }
                Err(e) => changed.failed.push((id, crate::error::chain(&e))),
            }
        }
        changed.done = done.into_iter().collect();
        Ok(acked)
    })
    .await?;
    let mut seen: Vec<String> = changed.done.clone();
    seen.extend(changed.failed.iter().map(|(id, _)| id.clone()));
    changed.not_found = missing(ids, &seen);
    Ok(changed)
}

/// The copy [`retry`] schedules: body and properties as parked, headers as a worker's retry
/// has them (no dead-letter history, `CC`/`BCC`, schedule or parking headers), owner kept, a
/// fresh attempt count.
fn copy_of(d: &lapin::message::Delivery, dest: &str, delay_ms: u64) -> Message {
    let owner = envelope::owner_header(&d.properties)
        .or_else(|| d.properties.user_id().as_ref().map(|u| u.to_string()));
    let h = envelope::headers_for_reschedule(d.properties.headers().as_ref(), owner.as_deref());
    let props = envelope::republish_properties(&d.properties, h);
    Message::new(dest, delay_ms, d.data.clone())
        .with_properties(props)
        .with_attempt(0)
        .internal()
}

/// The ids of `asked` not in `found`, each once, in the order asked.
fn missing(asked: &[String], found: &[String]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    asked
        .iter()
        .filter(|id| !found.contains(id) && seen.insert(id.as_str()))
        .cloned()
        .collect()
}

fn id_of(d: &lapin::message::Delivery) -> String {
    d.properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default()
}

fn text(h: Option<&FieldTable>, name: &str) -> Option<String> {
    match h?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn int(h: Option<&FieldTable>, name: &str) -> Option<u64> {
    h.and_then(|h| h.inner().get(name))
        .and_then(headers::as_int)
        .and_then(|n| u64::try_from(n).ok())
}

fn describe(position: u64, d: &lapin::message::Delivery, body_bytes: usize) -> Parked {
    let p: &BasicProperties = &d.properties;
    let h = p.headers().as_ref();
    Parked {
        position,
        message_id: id_of(d),
        parked_from: text(h, headers::PARKED_FROM),
        reason: text(h, headers::PARKED_REASON),
        attempts: int(h, headers::PARKED_ATTEMPTS),
        parked_at_ms: int(h, headers::PARKED_AT),
        owner: envelope::owner_header(p).or_else(|| p.user_id().as_ref().map(|u| u.to_string())),
        size: d.data.len(),
        content_type: p.content_type().as_ref().map(|c| c.to_string()),
        headers: h.cloned().unwrap_or_default(),
        body: d.data[..d.data.len().min(body_bytes)].to_vec(),
    }
}

/// One whole-queue rotation of `name` under the lock: `act` gets every ready message, in
/// order, and the channel to ack on; whatever it did not ack goes back when the channel closes.
async fn rotate(
    conn: &Connection,
    layout: &Layout,
    queue: Option<&str>,
    act: impl AsyncFnOnce(&[lapin::message::Delivery], &lapin::Channel) -> Result<usize>,
) -> Result<()> {
    let lock = lock(conn, layout, queue).await?;
    let r = rotate_locked(conn, &queue_name(layout, queue), act).await;
    // an exclusive queue lives as long as its connection, which a library caller may keep:
    // delete it (a crash releases it with the connection)
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        lock.queue_delete(
            layout.parked_lock_queue(queue).as_str().into(),
            QueueDeleteOptions::default(),
        ),
    )
    .await;
    broker::close(&lock, "parked command done").await;
    r
}

/// Takes the lock on the parking queue of `queue`: an exclusive, auto-delete queue declared on
/// a channel of its own; [`rotate`] deletes it, and it goes away with the connection.
async fn lock(conn: &Connection, layout: &Layout, queue: Option<&str>) -> Result<lapin::Channel> {
    let name = queue_name(layout, queue);
    let lock_name = layout.parked_lock_queue(queue);
    let ch = broker::open(conn).await?;
    let opts = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    match ch
        .queue_declare(lock_name.as_str().into(), opts, FieldTable::default())
        .await
    {
        Ok(_) => Ok(ch),
        Err(e) if broker::is_reply(&e, RESOURCE_LOCKED) => Err(Error::Stopped(format!(
            "another parked command is running on '{name}' (it holds the lock queue \
             '{lock_name}'); wait for it to end and try again"
        ))),
        Err(e) => Err(e).context(|| format!("taking the lock '{lock_name}' for '{name}'")),
    }
}

async fn rotate_locked(
    conn: &Connection,
    name: &str,
    act: impl AsyncFnOnce(&[lapin::message::Delivery], &lapin::Channel) -> Result<usize>,
) -> Result<()> {
    let Some(state) = broker::queue_state(conn, name).await? else {
        return Err(Error::Missing {
            object: format!("parking queue '{name}'"),
            hint: "check --queue and --prefix; a queue that never had a worker has none".into(),
        });
    };
    if state.consumers > 0 {
        return Err(Error::Invalid(format!(
            "parking queue '{name}' has {} consumer(s); reading it beside them would see only \
             part of it and reorder it: stop them first",
            state.consumers
        )));
    }
    if state.ready > MAX_MESSAGES {
        return Err(Error::Invalid(format!(
            "parking queue '{name}' holds {} messages, more than the {MAX_MESSAGES} a parked \
             command reads at once; purge it or use the management UI",
            state.ready
        )));
    }
    let ch = broker::open(conn).await?;
    if state.ready == 0 {
        let r = act(&[], &ch).await;
        broker::close(&ch, "parked rotation done").await;
        return r.map(|_| ());
    }
    let prefetch = u16::try_from(state.ready).unwrap_or(u16::MAX);
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .context(|| "setting the prefetch".into())?;
    let mut consumer = ch
        .basic_consume(
            name.into(),
            "amqp-delay parked".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .context(|| format!("consuming '{name}'"))?;
    let (taken, short) = take_all(&mut consumer, state.ready).await;
    let r = match short {
        // never act on part of the queue: give it all back
        Some(why) => Err(Error::Stopped(format!(
            "could not read the whole of parking queue '{name}' ({why}); nothing was changed"
        ))),
        None => act(&taken, &ch).await,
    };
    // cancel, then close: every message not acked goes back, in order (the report's rotation)
    broker::end_consumer(&ch, &consumer, "parked rotation done").await;
    // a quorum queue applies the return through its log: hold the lock until it is back, so
    // that the next command reads the whole queue, not the part already returned
    let back = taken.len().saturating_sub(*r.as_ref().unwrap_or(&0));
    wait_until_ready(conn, name, back).await;
    r.map(|_| ())
}

/// Takes the `ready` messages the queue said it holds, one by one; and why it stopped short
/// (a failed or cancelled consumer, nothing for [`TAKE_TIMEOUT`], past [`MAX_BYTES`]).
async fn take_all(
    consumer: &mut lapin::Consumer,
    ready: u32,
) -> (Vec<lapin::message::Delivery>, Option<String>) {
    let mut taken = Vec::with_capacity(ready as usize);
    let mut bytes = 0usize;
    while taken.len() < ready as usize {
        let why = match tokio::time::timeout(TAKE_TIMEOUT, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                bytes = bytes.saturating_add(d.data.len());
                taken.push(d);
                if bytes <= MAX_BYTES {
                    continue;
                }
                format!(
                    "its bodies pass {} MiB after {} of {ready} messages, more than a parked \
                     command holds at once; purge it or use the management UI",
                    MAX_BYTES >> 20,
                    taken.len(),
                )
            }
            Ok(Some(Err(e))) => format!("the consumer failed: {e}"),
            Ok(None) => "the consumer was cancelled".into(),
            Err(_) => format!(
                "no message for {} s after {} of {ready}",
                TAKE_TIMEOUT.as_secs(),
                taken.len(),
            ),
        };
        return (taken, Some(why));
    }
    (taken, None)
}

/// Waits (at most [`RETURN_TIMEOUT`]) until `name` holds `back` ready messages again: a quorum
/// queue applies a return through its log.
async fn wait_until_ready(conn: &Connection, name: &str, back: usize) {
    let deadline = tokio::time::Instant::now() + RETURN_TIMEOUT;
    while tokio::time::Instant::now() < deadline {
        match broker::queue_state(conn, name).await {
            Ok(Some(s)) if s.ready as usize >= back => break,
            Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
            _ => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_not_found_is_named_once_in_the_order_asked() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            missing(&v(&["b", "x", "a", "x", "y"]), &v(&["a", "b"])),
            v(&["x", "y"])
        );
        assert!(missing(&v(&["a"]), &v(&["a"])).is_empty());
    }

    #[test]
    fn each_parking_queue_has_its_own_lock() {
        let layout = crate::settings::Settings::default().layout().unwrap();
        assert_eq!(queue_name(&layout, Some("q")), layout.parked_queue("q"));
        assert_eq!(queue_name(&layout, None), layout.unroutable_queue());
        let p = "amqp-delay";
        assert_eq!(
            layout.parked_lock_queue(Some("q")),
            format!("{p}.parked-lock.q")
        );
        assert_eq!(layout.parked_lock_queue(None), format!("{p}.parked-lock"));
    }
}
