//! The operator API: what a tool that runs or operates a deployment needs beyond an
//! application's API at the crate root. The amqp-delay tools (`delay-publisher`,
//! `delay-consumer`, `delay-proxy`, `delay-console`) are built on it; an application that
//! schedules, consumes or serves `x-delay` publishers needs none of it.
//!
//! | module | what | used by |
//! |---|---|---|
//! | [`connection`] | brokers' URLs, connecting and reconnecting (the root re-exports [`crate::connect`] and [`crate::Connector`]) | every tool |
//! | [`broker`] | the AMQP primitives the library is built on: declares, passive checks, queue states | `declare`, `teardown`, `stats`, the proxy |
//! | [`control`] | the control stream's records: gateway pairs, batch markers, cancels, purges, reschedules | `cancel`, `pending`, the proxy, `teardown` |
//! | [`cancel`] | following cancels, purges and reschedules; each owner's quota | `pending`, the console |
//! | [`journal`] | the journal stream's records: what was scheduled and what became of it | `pending`, the console |
//! | [`ledger`] | counting the messages that wait | `stats`, `/metrics` |
//! | [`parked`] | listing, retrying and dropping parked messages (an admin's) | `parked` |
//! | [`trust`] | whose records and messages count for what (admins, peers, a record's writer) | every follower: `pending`, the console, the proxy |
//! | [`transfer`] | the copies that move what waits to another cluster | `transfer` |
//! | [`batch`] | the batch envelope on the wire | `send --jsonl`, the bench |
//! | `management` (feature `management`) | RabbitMQ's HTTP API: messages its dead-letter worker holds | `stats`, `teardown` |

#[path = "batch.rs"]
pub mod batch;
#[path = "broker.rs"]
pub mod broker;
#[path = "cancel/mod.rs"]
pub mod cancel;
#[path = "connection.rs"]
pub mod connection;
#[path = "control.rs"]
pub mod control;
#[path = "journal.rs"]
pub mod journal;
#[path = "ledger.rs"]
pub mod ledger;
#[cfg(feature = "management")]
#[path = "management.rs"]
pub mod management;
#[path = "parked.rs"]
pub mod parked;
#[path = "transfer.rs"]
pub mod transfer;
#[path = "trust.rs"]
pub mod trust;
