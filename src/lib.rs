//! amqp-delay: delayed delivery for RabbitMQ built only from stock features — tier queues with
//! one fixed TTL each, dead-letter exchanges and topic routing. `ARCHITECTURE.md` is the map;
//! `docs/DESIGN.md` has the broker rules, the guarantees and the cost model.
//!
//! What an application needs is at the root: [`Topology`] declares the tiers, [`Publisher`]
//! schedules [`Message`]s, a [`Worker`] runs a [`Handler`] on every due [`Delivery`] and acts on
//! its [`Outcome`]; a [`Gateway`] serves plugin-style `x-delay` publishers. [`Settings`] holds
//! every setting (defaults < TOML file < environment). Errors are [`Error`]s, by kind.
//!
//! ```no_run
//! # async fn demo() -> amqp_delay::Result<()> {
//! use amqp_delay::{Message, Publisher, Settings, Topology};
//! let settings = Settings::default();
//! let conn = amqp_delay::connect(&settings.url, "example").await?;
//! Topology::new(settings.layout()?).declare(&conn).await?;
//! let publisher = Publisher::connect(&settings).await?;
//! let s = publisher.schedule(Message::new("orders.timeout", 30 * 60_000, r#"{"order":42}"#)).await?;
//! println!("{} due at {}", s.message_id, s.due_at_ms);
//! # Ok(()) }
//! ```
//!
//! Public modules: [`settings`] (every setting), [`layout`] (tier names and sizes), [`headers`]
//! (the header names on the wire), [`time`] (durations as written in settings), [`trust`]
//! (whose records and messages count for what), [`metrics`] (the Prometheus registry the
//! library fills), [`batch`] (the batch envelope on the wire), [`recurring`] (recurring
//! schedules: cron ticks in a time zone, the occurrences to publish, the book of definitions); for tools that operate a deployment, as the amqp-delay tools do:
//! [`connection`] (brokers' URLs, connecting and reconnecting), [`broker`] (the AMQP
//! primitives the library is built on), [`control`] (the control stream's records: gateway
//! pairs, batch markers, cancels), [`cancel`] (following the cancels), [`ledger`] (counting
//! the messages that wait), [`parked`] (list, retry and drop parked messages; an admin's
//! tool) and [`gateway`] (the `x-delay` gateway's pairs); with the
//! `management` feature, `management` (RabbitMQ's HTTP API, to count messages its dead-letter
//! worker holds).
//!
//! Features: `management` (an HTTP client, for `Topology::stats_with`).
//!
//! Lints (Cargo.toml): `unsafe_code` forbidden, `unreachable_pub` denied: an item is `pub` only
//! when a public module or the root re-exports reach it.

// ---- pure core: no I/O ---------------------------------------------------------------------
pub mod batch;
mod endpoints;
mod envelope;
mod error;
pub mod headers;
pub mod layout;
mod message;
pub mod metrics;
mod planner;
pub mod recurring;
mod retry;
pub mod settings;
mod tally;
pub mod time;
pub mod trust;

// ---- broker edge ---------------------------------------------------------------------------
pub mod broker;
pub mod cancel;
pub mod connection;
pub mod control;
pub mod journal;
pub mod ledger;
#[cfg(feature = "management")]
pub mod management;
pub mod parked;
mod publisher;
// the one log both streams use
mod stream_log;
mod topology;
mod worker;

// ---- applications --------------------------------------------------------------------------
pub mod gateway;

pub use connection::{Connector, connect};
pub use envelope::Delivery;
pub use error::{Error, ErrorKind, Result, chain as error_chain};
pub use gateway::Gateway;
pub use layout::{Layout, QueueType, TopologySettings};
pub use message::{Message, Scheduled};
pub use planner::{Precision, Route, plan};
pub use publisher::Publisher;
pub use retry::RetryPolicy;
pub use settings::Settings;
pub use topology::{QueueStat, Topology};
pub use worker::{Context, Counters, Handler, Outcome, Worker};

#[cfg(test)]
mod layering;
