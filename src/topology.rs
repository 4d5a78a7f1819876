//! Broker I/O for the topology: declaring it (idempotently, refusing a different existing shape
//! with a clear message), reading queue depths for `stats`, and deleting it.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::error::{Context, Error, Result, broker_error};
use crate::layout::{Layout, Tier, TierKind};
use crate::settings::QueueType;

/// AMQP reply codes we react to.
const NOT_FOUND: u16 = 404;
const PRECONDITION_FAILED: u16 = 406;

/// The delay topology on one broker.
#[derive(Debug, Clone)]
pub struct Topology {
    layout: Layout,
}

/// Depth of one queue, for `stats`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QueueStat {
    pub queue: String,
    /// `cascade`, `fixed`, `overflow` or `parked`.
    pub kind: &'static str,
    /// Queue TTL (none for the parking queue).
    pub ttl_ms: Option<u64>,
    /// Ready messages.
    pub messages: u32,
}

impl Topology {
    pub fn new(layout: Layout) -> Topology {
        Topology { layout }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Declares every exchange, queue and binding. Idempotent. Fails with
    /// [`Error::Conflict`] when objects under this prefix exist with other settings.
    pub async fn declare(&self, conn: &Connection) -> Result<()> {
        let l = &self.layout;
        let ch = open(conn).await?;
        self.declare_marker(&ch).await?;

        // Parking first: the delivery exchange's alternate exchange must exist before anything
        // can be delivered.
        declare_exchange(
            &ch,
            &l.parking_exchange(),
            ExchangeKind::Fanout,
            FieldTable::default(),
        )
        .await?;
        let parked = l.parked_queue();
        declare_queue(&ch, &parked, self.parked_args()).await?;
        ch.queue_bind(
            parked.as_str().into(),
            l.parking_exchange().as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .context(|| format!("binding '{parked}'"))?;

        let mut ae = FieldTable::default();
        ae.insert(
            "alternate-exchange".into(),
            AMQPValue::LongString(LongString::from(l.parking_exchange())),
        );
        declare_exchange(&ch, &l.delivery_exchange(), ExchangeKind::Topic, ae).await?;
        for k in 0..l.levels() {
            declare_exchange(
                &ch,
                &l.level_exchange(k),
                ExchangeKind::Topic,
                FieldTable::default(),
            )
            .await?;
        }

        // Tier queues (declared concurrently on a few channels: quorum queue creation is slow).
        let tiers = l.tiers();
        let chans = {
            let mut v = vec![ch.clone()];
            for _ in 1..4.min(tiers.len().max(1)) {
                v.push(open(conn).await?);
            }
            v
        };
        let work = tiers.chunks(tiers.len().div_ceil(chans.len()).max(1));
        futures::future::try_join_all(work.zip(chans.iter()).map(|(chunk, c)| async move {
            for t in chunk {
                declare_queue(c, &t.queue, self.tier_args(t)).await?;
            }
            Ok::<_, Error>(())
        }))
        .await?;
        for c in chans.into_iter().skip(1) {
            let _ = c.close(200, "declared".into()).await;
        }

        // Cascade bindings: digit d → its queue, digit 0 → next level down.
        for k in 0..l.levels() {
            let x = l.level_exchange(k);
            for d in 1..l.radix() {
                bind_queue(&ch, &l.cascade_queue(k, d), &x, &l.level_binding(k, d)).await?;
            }
            let below = if k == 0 {
                l.delivery_exchange()
            } else {
                l.level_exchange(k - 1)
            };
            ch.exchange_bind(
                below.as_str().into(),
                x.as_str().into(),
                l.level_binding(k, 0).as_str().into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .context(|| format!("binding exchange '{below}' to '{x}'"))?;
        }
        // Fixed levels and overflow chain: a fanout exchange in front of each queue.
        for t in &tiers {
            if matches!(t.kind, TierKind::Cascade { .. }) {
                continue;
            }
            declare_exchange(&ch, &t.queue, ExchangeKind::Fanout, FieldTable::default()).await?;
            bind_queue(&ch, &t.queue, &t.queue, "").await?;
        }
        let _ = ch.close(200, "declared".into()).await;
        Ok(())
    }

    /// Makes sure destination queue `queue` exists (creating it durable, of the tiers' queue type,
    /// when it does not; an existing queue is left as it is) and is bound on the delivery
    /// exchange. Returns whether it was created.
    pub async fn declare_destination(&self, conn: &Connection, queue: &str) -> Result<bool> {
        let l = &self.layout;
        l.validate_destination(queue).map_err(Error::Invalid)?;
        let ch = open(conn).await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let created = match ch
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
        {
            Ok(_) => false,
            Err(e) if broker_error(&e).is_some_and(|(c, _)| c == NOT_FOUND) => {
                let ch = open(conn).await?;
                declare_queue(&ch, queue, self.base_queue_args()).await?;
                let _ = ch.close(200, "declared".into()).await;
                true
            }
            Err(e) => return Err(e).context(|| format!("checking queue '{queue}'")),
        };
        let ch = open(conn).await?;
        bind_queue(
            &ch,
            queue,
            &l.delivery_exchange(),
            &l.destination_binding(queue),
        )
        .await?;
        let _ = ch.close(200, "declared".into()).await;
        Ok(created)
    }

    /// Checks that the topology exists and was declared with these settings, without creating
    /// anything else. Used by publishers before their first message.
    pub async fn verify(&self, conn: &Connection) -> Result<()> {
        let ch = open(conn).await?;
        let marker = self.layout.layout_marker_queue();
        match ch
            .queue_declare(
                marker.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if broker_error(&e).is_some_and(|(c, _)| c == NOT_FOUND) => {
                return Err(not_declared(&self.layout));
            }
            Err(e) => return Err(e).context(|| format!("checking '{marker}'")),
        }
        // One channel for every check: any failure ends the check anyway.
        self.declare_marker(&ch).await?;
        // Fixed levels can be added to a topology later, so they are not in the signature:
        // check that every one this configuration may use exists.
        for &ms in self.layout.fixed_ms() {
            let x = self.layout.fixed_exchange(ms);
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            match ch
                .exchange_declare(
                    x.as_str().into(),
                    ExchangeKind::Fanout,
                    passive,
                    FieldTable::default(),
                )
                .await
            {
                Ok(()) => {}
                Err(e) if broker_error(&e).is_some_and(|(c, _)| c == NOT_FOUND) => {
                    return Err(Error::Invalid(format!(
                        "fixed level {} is configured but not declared under prefix '{}'; run `delay-publisher declare` with this configuration",
                        crate::layout::compact_duration(ms),
                        self.layout.prefix()
                    )));
                }
                Err(e) => return Err(e).context(|| format!("checking exchange '{x}'")),
            }
        }
        let _ = ch.close(200, "verified".into()).await;
        Ok(())
    }

    /// Message count of every tier queue and of the parking queue.
    pub async fn stats(&self, conn: &Connection) -> Result<Vec<QueueStat>> {
        let l = &self.layout;
        let ch = open(conn).await?;
        let mut out = Vec::new();
        let mut queues: Vec<(String, &'static str, Option<u64>)> = l
            .tiers()
            .into_iter()
            .map(|t| {
                let kind = match t.kind {
                    TierKind::Cascade { .. } => "cascade",
                    TierKind::Fixed { .. } => "fixed",
                    TierKind::Overflow { .. } => "overflow",
                };
                (t.queue, kind, Some(t.ttl_ms))
            })
            .collect();
        queues.push((l.parked_queue(), "parked", None));
        for (queue, kind, ttl_ms) in queues {
            match ch
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                Ok(q) => out.push(QueueStat {
                    queue,
                    kind,
                    ttl_ms,
                    messages: q.message_count(),
                }),
                Err(e) if broker_error(&e).is_some_and(|(c, _)| c == NOT_FOUND) => {
                    return Err(Error::Invalid(format!(
                        "queue '{queue}' is missing: {}",
                        not_declared(l)
                    )));
                }
                Err(e) => return Err(e).context(|| format!("reading depth of '{queue}'")),
            }
        }
        let _ = ch.close(200, "stats".into()).await;
        Ok(out)
    }

    /// Deletes every exchange and queue of this layout (messages in them are lost). Missing
    /// objects are ignored, so it is safe to run twice.
    pub async fn delete(&self, conn: &Connection) -> Result<()> {
        let l = &self.layout;
        let mut queues: Vec<String> = l.tiers().into_iter().map(|t| t.queue).collect();
        queues.push(l.parked_queue());
        queues.push(l.layout_marker_queue());
        let mut exchanges: Vec<String> = (0..l.levels()).map(|k| l.level_exchange(k)).collect();
        exchanges.extend(l.tiers().into_iter().filter_map(|t| match t.kind {
            TierKind::Cascade { .. } => None,
            _ => Some(t.queue),
        }));
        exchanges.push(l.delivery_exchange());
        exchanges.push(l.parking_exchange());
        let ch = open(conn).await?;
        for q in &queues {
            ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .context(|| format!("deleting queue '{q}'"))?;
        }
        for x in &exchanges {
            ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .context(|| format!("deleting exchange '{x}'"))?;
        }
        let _ = ch.close(200, "deleted".into()).await;
        Ok(())
    }

    async fn declare_marker(&self, ch: &Channel) -> Result<()> {
        let l = &self.layout;
        let marker = l.layout_marker_queue();
        let mut args = FieldTable::default();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(l.signature())),
        );
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
        let opts = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        match ch.queue_declare(marker.as_str().into(), opts, args).await {
            Ok(_) => Ok(()),
            Err(e) => match broker_error(&e) {
                Some((PRECONDITION_FAILED, text)) => {
                    let existing = parse_inequivalent(&text)
                        .map(|i| i.current)
                        .unwrap_or_else(|| "(unknown)".into());
                    Err(Error::Conflict(format!(
                        "the topology under prefix '{}' was declared with other settings: {}. \
                         The broker has [{existing}], this configuration wants [{}]. \
                         Use the original settings, or another --prefix, or drain the old \
                         topology and remove it with `delay-publisher teardown`.",
                        l.prefix(),
                        describe_differences(&existing, &l.signature()),
                        l.signature()
                    )))
                }
                _ => Err(e).context(|| format!("declaring '{marker}'")),
            },
        }
    }

    fn base_queue_args(&self) -> FieldTable {
        let mut a = FieldTable::default();
        let qt = match self.layout.queue_type() {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        };
        a.insert("x-queue-type".into(), AMQPValue::LongString(qt.into()));
        a
    }

    fn parked_args(&self) -> FieldTable {
        self.base_queue_args()
    }

    /// Arguments of a tier queue (design.md rules 1, 4 and 7: one queue-level TTL, at-least-once
    /// dead-lettering with reject-publish on quorum queues, never `x-expires`).
    pub fn tier_args(&self, t: &Tier) -> FieldTable {
        let mut a = self.base_queue_args();
        a.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(t.ttl_ms as i64),
        );
        a.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(t.dead_letter_exchange.as_str())),
        );
        a.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        if self.layout.queue_type() == QueueType::Quorum {
            a.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
        }
        if let Some(n) = self.layout.max_tier_length() {
            a.insert("x-max-length".into(), AMQPValue::LongLongInt(n as i64));
        }
        a
    }
}

fn not_declared(l: &Layout) -> Error {
    Error::Invalid(format!(
        "the delay topology under prefix '{}' is not declared on this broker; run `delay-publisher declare` (with the same --prefix and settings) first",
        l.prefix()
    ))
}

async fn open(conn: &Connection) -> Result<Channel> {
    conn.create_channel()
        .await
        .context(|| "opening a channel".into())
}

async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
    args: FieldTable,
) -> Result<()> {
    let opts = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    ch.exchange_declare(name.into(), kind, opts, args)
        .await
        .map_err(|e| conflict_or(e, "exchange", name))
}

async fn declare_queue(ch: &Channel, name: &str, args: FieldTable) -> Result<()> {
    let opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(name.into(), opts, args)
        .await
        .map(|_| ())
        .map_err(|e| conflict_or(e, "queue", name))
}

async fn bind_queue(ch: &Channel, queue: &str, exchange: &str, key: &str) -> Result<()> {
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .context(|| format!("binding queue '{queue}' to '{exchange}' with '{key}'"))
}

/// Turns a PRECONDITION_FAILED on declare into a [`Error::Conflict`] that names the object and
/// the differing argument.
fn conflict_or(e: lapin::Error, what: &str, name: &str) -> Error {
    match broker_error(&e) {
        Some((PRECONDITION_FAILED, text)) => match parse_inequivalent(&text) {
            Some(i) => Error::Conflict(format!(
                "{what} '{name}' already exists with {} = {} but these settings need {}. \
                 It was declared with other settings (radix, unit, TTL or queue type): use the \
                 original settings or another --prefix.",
                i.argument, i.current, i.received
            )),
            None => Error::Conflict(format!(
                "{what} '{name}' already exists with different properties: {text}"
            )),
        },
        _ => Error::Amqp {
            context: format!("declaring {what} '{name}'"),
            source: e,
        },
    }
}

/// The parts of the broker's "inequivalent arg" message.
#[derive(Debug, PartialEq, Eq)]
pub struct Inequivalent {
    pub argument: String,
    pub received: String,
    pub current: String,
}

/// Parses `PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/':
/// received the value '2' of type 'signedint' but current is the value '1' of type 'signedint'`.
pub fn parse_inequivalent(text: &str) -> Option<Inequivalent> {
    let argument = between(text, "inequivalent arg '", "'")?;
    let received_part = between(text, "received ", " but current is ")?;
    let current_part = text.split(" but current is ").nth(1)?;
    // 3.10 writes `the value 'v' of type 't'` for some types and `'v'` for strings.
    let value = |s: &str| {
        let s = s.trim().trim_end_matches('"');
        between(s, "the value '", "' of type")
            .map(str::to_string)
            .unwrap_or_else(|| s.trim_matches('\'').to_string())
    };
    Some(Inequivalent {
        argument: argument.to_string(),
        received: value(received_part),
        current: value(current_part),
    })
}

fn between<'a>(s: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let i = s.find(start)? + start.len();
    let j = s[i..].find(end)? + i;
    Some(&s[i..j])
}

/// `radix=16 unit_ms=1` vs `radix=8 unit_ms=1` → `radix: 16 → 8`.
fn describe_differences(existing: &str, wanted: &str) -> String {
    let parse = |s: &str| -> Vec<(String, String)> {
        s.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let old = parse(existing);
    let diffs: Vec<String> = parse(wanted)
        .into_iter()
        .filter_map(|(k, v)| {
            let before = old
                .iter()
                .find(|(ok, _)| *ok == k)
                .map(|(_, ov)| ov.as_str());
            match before {
                Some(b) if b == v => None,
                Some(b) => Some(format!("{}: {b} → {v}", Layout::signature_key_name(&k))),
                None => Some(format!("{}: ? → {v}", Layout::signature_key_name(&k))),
            }
        })
        .collect();
    if diffs.is_empty() {
        "settings differ".into()
    } else {
        diffs.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_brokers_inequivalent_arg_message() {
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'p.level1.d1' in vhost '/': received the value '8' of type 'signedint' but current is the value '16' of type 'signedint'";
        assert_eq!(
            parse_inequivalent(t).unwrap(),
            Inequivalent {
                argument: "x-message-ttl".into(),
                received: "8".into(),
                current: "16".into()
            }
        );
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received none but current is the value 'quorum' of type 'longstr'";
        let i = parse_inequivalent(t).unwrap();
        assert_eq!(
            (i.received.as_str(), i.current.as_str()),
            ("none", "quorum")
        );
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'p.layout' in vhost '/': received 'r=8 u=1' but current is 'r=4 u=1'";
        let i = parse_inequivalent(t).unwrap();
        assert_eq!(
            (i.received.as_str(), i.current.as_str()),
            ("r=8 u=1", "r=4 u=1")
        );
    }

    #[test]
    fn differences_are_named() {
        assert_eq!(
            describe_differences("r=16 u=1 t=quorum", "r=8 u=1 t=quorum"),
            "radix: 16 → 8"
        );
    }
}
