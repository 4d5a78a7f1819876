//! Publisher confirms whose returned messages reach the publish they belong to.
//!
//! A `basic.return` carries no delivery tag. lapin 4 keeps returned messages in one queue per
//! channel and hands each to whichever confirm completes next. When one ack covers several
//! publishes (RabbitMQ acks with `multiple`), that is any publish of the group, in hash-map
//! order. Measured with 2,000 pipelined mandatory publishes on one channel, every 7th
//! unroutable: 26 of the 286 returns went to another publish. So 26 unroutable messages looked
//! confirmed (lost, as far as their caller knew), and 26 routed ones looked returned.
//!
//! Here one task per channel awaits every confirm of that channel. It puts every return on hand
//! as soon as any confirm brings it, lets each completed publish wait a few milliseconds (so
//! that the other completions of lapin's pass are seen too), then gives each return to the
//! publish that carries its exchange, routing key, message id and body. Two publishes identical
//! in all four are interchangeable, so swapping their outcomes changes nothing a caller can
//! tell.

use std::collections::VecDeque;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::{mpsc, oneshot};

/// How long a return whose publish has not been decided yet is kept for it. A return comes just
/// before its own ack, so its publish is decided within [`SETTLE`] of it.
const KEEP_UNMATCHED: Duration = Duration::from_secs(5);

/// What the broker said of one publish.
#[derive(Debug)]
pub(super) enum Outcome {
    Ack,
    Nack,
    /// Unroutable (mandatory): the broker dropped it after returning it. Its confirm is an ack
    /// all the same (DESIGN rule 6).
    Returned(Box<BasicReturnMessage>),
}

/// The identity a returned message is matched by.
pub(super) fn key(exchange: &str, routing_key: &str, message_id: Option<&str>, body: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    (exchange, routing_key, message_id, body).hash(&mut h);
    h.finish()
}

fn key_of(m: &BasicReturnMessage) -> u64 {
    key(
        m.delivery.exchange.as_str(),
        m.delivery.routing_key.as_str(),
        m.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        &m.delivery.data,
    )
}

struct Waiting {
    key: u64,
    confirm: PublisherConfirm,
    answer: oneshot::Sender<lapin::Result<Outcome>>,
}

/// The confirm collector of one channel; it stops once this is dropped and every confirm it
/// holds has completed (a closed channel completes them all, with an error).
pub(super) struct Confirms {
    tx: mpsc::UnboundedSender<Waiting>,
}

impl Confirms {
    pub(super) fn start(channel_id: u16) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(collect(channel_id, rx));
        Self { tx }
    }

    /// The outcome of the publish `confirm` belongs to, whose identity is `key`.
    pub(super) async fn outcome(
        &self,
        key: u64,
        confirm: PublisherConfirm,
    ) -> lapin::Result<Outcome> {
        let (answer, rx) = oneshot::channel();
        let gone = || -> lapin::Error {
            lapin::ErrorKind::InvalidChannelState(
                lapin::ChannelState::Closed,
                "the confirm collector stopped",
            )
            .into()
        };
        self.tx
            .send(Waiting {
                key,
                confirm,
                answer,
            })
            .map_err(|_| gone())?;
        rx.await.unwrap_or_else(|_| Err(gone()))
    }
}

/// How long a completed publish waits before its outcome is decided. lapin completes the
/// publishes one ack covers in one pass on its own thread, handing out waiting returns as it
/// goes, so the publish a return belongs to may complete before the one that carries it, and a
/// publish whose confirm completed before it was handed over here arrives a moment late. Both
/// are seen within this (unless a thread stalls longer; then the return is logged as an error
/// when it expires).
const SETTLE: Duration = Duration::from_millis(3);

/// A completed publish waiting out [`SETTLE`]: when it was seen, its identity, who asked, and
/// whether it was nacked (or the error it ended with).
type Settling = (
    Instant,
    u64,
    oneshot::Sender<lapin::Result<Outcome>>,
    lapin::Result<bool>,
);

async fn collect(channel_id: u16, mut rx: mpsc::UnboundedReceiver<Waiting>) {
    let mut pending = FuturesUnordered::new();
    let mut open = true;
    // returns not yet matched to a decided publish, with when they came
    let mut unmatched: Vec<(u64, Box<BasicReturnMessage>, Instant)> = Vec::new();
    let mut settling: VecDeque<Settling> = VecDeque::new();
    let watch = |w: Waiting| w.confirm.map(move |r| (w.key, w.answer, r));
    // a completion's returns go on hand at once, whoever they belong to
    let completed = |(key, answer, result): (u64, _, lapin::Result<Confirmation>),
                     unmatched: &mut Vec<(u64, Box<BasicReturnMessage>, Instant)>,
                     settling: &mut VecDeque<Settling>| {
        let result = result.map(|c| {
            let nack = c.is_nack();
            if let Some(m) = c.take_message() {
                unmatched.push((key_of(&m), Box::new(m), Instant::now()));
            }
            nack
        });
        settling.push_back((Instant::now(), key, answer, result));
    };
    loop {
        let due = settling
            .front()
            .map(|(seen, ..)| tokio::time::Instant::from_std(*seen + SETTLE));
        tokio::select! {
            w = rx.recv(), if open => match w {
                Some(w) => pending.push(watch(w)),
                None => open = false,
            },
            Some(d) = pending.next(), if !pending.is_empty() => {
                completed(d, &mut unmatched, &mut settling);
            }
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                // what is complete by now, with its returns, first
                while let Ok(w) = rx.try_recv() {
                    pending.push(watch(w));
                }
                while let Some(Some(d)) = pending.next().now_or_never() {
                    completed(d, &mut unmatched, &mut settling);
                }
                let now = Instant::now();
                while let Some((seen, ..)) = settling.front() {
                    if *seen + SETTLE > now {
                        break;
                    }
                    let Some((_, key, answer, result)) = settling.pop_front() else {
                        break;
                    };
                    let outcome = result.map(|nack| {
                        match unmatched.iter().position(|(k, _, _)| *k == key) {
                            Some(i) => Outcome::Returned(unmatched.swap_remove(i).1),
                            None if nack => Outcome::Nack,
                            None => Outcome::Ack,
                        }
                    });
                    let _ = answer.send(outcome);
                }
                unmatched.retain(|(_, m, at)| {
                    let keep = at.elapsed() < KEEP_UNMATCHED;
                    if !keep {
                        tracing::error!(
                            channel = channel_id,
                            exchange = %m.delivery.exchange,
                            routing_key = %m.delivery.routing_key,
                            message_id = ?m.delivery.properties.message_id(),
                            "the broker returned a message (unroutable) whose publish had already been decided: it may have been reported as confirmed"
                        );
                    }
                    keep
                });
            }
            else => return,
        }
    }
}
