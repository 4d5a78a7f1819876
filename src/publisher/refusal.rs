//! Which publishes a refusal took down with it.
//!
//! A publish the broker refuses closes its channel with 403 ACCESS_REFUSED, naming the exchange
//! (`access to exchange 'X' in vhost …`) or, with topic permissions, the exchange and the key
//! (`access to topic 'K' in exchange 'X' in vhost …`). lapin then fails every confirm awaited on
//! that channel with that same error, whatever exchange it was for. Measured on RabbitMQ 3.10
//! (`tests/it/cli_files.rs`), 40 lines of `send --jsonl` pipelined on one channel, the 21st
//! refused: the 20 before it arrived, the refused one and the 19 after it never did.
//!
//! The broker takes a channel's publishes in the order their frames go out and, once it closed
//! the channel, discards whatever follows (AMQP 0-9-1, `channel.close`). A right is the same for
//! every publish to one exchange (and key), so the publish it refused is the first one to that
//! exchange (and key) still awaiting its confirm. That one and every later one were not taken:
//! refused, nothing scheduled. An earlier one was taken, its confirm is lost: it may have been
//! delivered. (Unless the right was revoked while they were in flight: then an earlier publish
//! to that exchange may have been taken, and is said refused.)

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::broker::{self, ACCESS_REFUSED};
use crate::error::Error;

/// The publishes of one channel awaiting their confirm, by number (the order the broker takes
/// them in), and the number of the one the broker refused, once it has.
#[derive(Default)]
pub(super) struct Flight {
    /// Number → exchange, routing key.
    pending: BTreeMap<u64, (String, String)>,
    /// `Some(n)`: the broker refused publish `n` (`u64::MAX`: one this channel did not send).
    refused: Option<u64>,
}

impl Flight {
    fn lock(flight: &Mutex<Flight>) -> std::sync::MutexGuard<'_, Flight> {
        flight.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One publish in [`Flight`], from when its frames are queued until this is dropped.
pub(super) struct InFlight<'a> {
    flight: &'a Mutex<Flight>,
    number: std::sync::OnceLock<u64>,
}

impl<'a> InFlight<'a> {
    pub(super) fn new(flight: &'a Mutex<Flight>) -> Self {
        InFlight {
            flight,
            number: Default::default(),
        }
    }

    /// Records the publish numbered `number` to `exchange` with `routing_key` (called while it
    /// holds the channel's turn, before the broker can answer it).
    pub(super) fn queued(&self, number: u64, exchange: &str, routing_key: &str) {
        Flight::lock(self.flight)
            .pending
            .insert(number, (exchange.to_string(), routing_key.to_string()));
        let _ = self.number.set(number);
    }

    /// What the publish came to when its confirm ended with `source` instead of an ack or a
    /// nack (see the module's text).
    pub(super) fn unconfirmed(&self, exchange: &str, source: lapin::Error) -> Error {
        let refused = broker::reply(&source)
            .filter(|(code, _)| *code == ACCESS_REFUSED)
            .map(|(_, text)| {
                let f = &mut *Flight::lock(self.flight);
                *f.refused
                    .get_or_insert_with(|| refused_publish(&f.pending, &text).unwrap_or(u64::MAX))
            });
        unconfirmed(self.number.get().copied(), refused, exchange, source)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.number.get() {
            Flight::lock(self.flight).pending.remove(n);
        }
    }
}

/// The number of the publish the broker's 403 reply `text` refused, among `pending` (number →
/// exchange, routing key): the first to the exchange (and key) it names.
fn refused_publish(pending: &BTreeMap<u64, (String, String)>, text: &str) -> Option<u64> {
    pending
        .iter()
        .find(|(_, (exchange, key))| {
            text.contains(&format!("access to exchange '{exchange}' in vhost '"))
                || text.contains(&format!(
                    "access to topic '{key}' in exchange '{exchange}' in vhost '"
                ))
        })
        .map(|(n, _)| *n)
}

/// What publish `number` to `exchange` came to when its confirm ended with `source`, the broker
/// having refused publish `refused` of its channel (`None`: no refusal).
fn unconfirmed(
    number: Option<u64>,
    refused: Option<u64>,
    exchange: &str,
    source: lapin::Error,
) -> Error {
    let context = match (number, refused) {
        (Some(n), Some(r)) if n == r => format!(
            "publishing to '{exchange}' (refused, nothing was scheduled: the user needs the write right on it, README \"Security\")"
        ),
        (Some(n), Some(r)) if n > r => format!(
            "publishing to '{exchange}' (not taken, nothing was scheduled: the broker refused an earlier publish on the same channel and discarded what followed it)"
        ),
        _ => {
            return Error::MaybeSent {
                context: format!("awaiting the confirm from '{exchange}'"),
                source,
            };
        }
    };
    Error::Amqp { context, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(code: u16, text: &str) -> lapin::Error {
        let amqp = lapin::protocol::AMQPError::from_id(code, text.into()).expect("a reply code");
        lapin::Error::from(lapin::ErrorKind::ProtocolError(amqp))
    }

    fn pending(p: &[(u64, &str, &str)]) -> BTreeMap<u64, (String, String)> {
        p.iter()
            .map(|(n, x, k)| (*n, (x.to_string(), k.to_string())))
            .collect()
    }

    const DENIED: &str =
        "ACCESS_REFUSED - access to exchange 'p.deliver' in vhost '/' refused for user 'u'";
    const TOPIC: &str = "ACCESS_REFUSED - write access to topic 'q.a' in exchange 'p.deliver' in vhost 'v' refused for user 'u'";

    /// The refused publish is the first in flight to the exchange (and key) the reply names.
    #[test]
    fn the_refused_publish_is_the_first_to_what_the_reply_names() {
        let p = pending(&[
            (3, "p.level2", "q.a"),
            (4, "p.deliv", "q.a"),
            (5, "p.deliver", "q.b"),
            (6, "p.deliver", "q.a"),
            (7, "p.level2", "q.a"),
        ]);
        assert_eq!(refused_publish(&p, DENIED), Some(5));
        assert_eq!(refused_publish(&p, TOPIC), Some(6));
        assert_eq!(
            refused_publish(
                &p,
                "ACCESS_REFUSED - access to exchange 'other' in vhost '/' refused for user 'u'"
            ),
            None
        );
        assert_eq!(refused_publish(&BTreeMap::new(), DENIED), None);
    }

    /// The refused publish and those after it were not taken; one before it, or any publish
    /// whose confirm ended otherwise, may have been delivered.
    #[test]
    fn a_refusal_takes_down_the_publishes_from_it_on() {
        let refused = |n, r| unconfirmed(Some(n), r, "p.level2", reply(403, DENIED));
        for (n, r, maybe) in [
            (4, Some(5), true),
            (5, Some(5), false),
            (6, Some(5), false),
            (6, Some(u64::MAX), true),
            (6, None, true),
        ] {
            let e = refused(n, r);
            assert_eq!(e.maybe_sent(), maybe, "{n} {r:?}: {e}");
            if !maybe {
                assert_eq!(e.kind(), crate::error::ErrorKind::Refused, "{e}");
                assert!(crate::error::chain(&e).contains(DENIED), "{e}");
            }
        }
        assert!(
            crate::error::chain(&refused(5, Some(5))).contains("refused, nothing was scheduled")
        );
        assert!(crate::error::chain(&refused(6, Some(5))).contains("refused an earlier publish"));
        let lost = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(unconfirmed(Some(5), None, "p.deliver", lost).maybe_sent());
        assert!(unconfirmed(None, Some(5), "p.deliver", reply(403, DENIED)).maybe_sent());
    }

    /// Through [`InFlight`]: the first publish to see the refusal decides for the channel, with
    /// every publish still in flight in view; a publish leaves the flight when dropped.
    #[test]
    fn publishes_in_flight_are_judged_by_their_order() {
        let flight = Mutex::new(Flight::default());
        let publishes: Vec<InFlight> = [
            ("p.level2", "q.a"),
            ("p.deliver", "q.a"),
            ("p.level2", "q.b"),
        ]
        .iter()
        .enumerate()
        .map(|(n, (x, k))| {
            let p = InFlight::new(&flight);
            p.queued(10 + n as u64, x, k);
            p
        })
        .collect();
        let mut fates: Vec<(u64, bool)> = publishes
            .iter()
            .rev()
            .map(|p| {
                let e = p.unconfirmed("x", reply(403, DENIED));
                (*p.number.get().unwrap(), e.maybe_sent())
            })
            .collect();
        fates.sort();
        assert_eq!(fates, [(10, true), (11, false), (12, false)]);
        drop(publishes);
        assert!(Flight::lock(&flight).pending.is_empty());
        // a 404 (an exchange deleted meanwhile) pins nothing on a publish
        let flight = Mutex::new(Flight::default());
        let p = InFlight::new(&flight);
        p.queued(0, "p.deliver", "q.a");
        assert!(
            p.unconfirmed(
                "p.deliver",
                reply(404, "NOT_FOUND - no exchange 'p.deliver' in vhost '/'")
            )
            .maybe_sent()
        );
    }
}
