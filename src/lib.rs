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
//! Public modules, for applications: [`settings`] (every setting), [`layout`] (tier names and
//! sizes), [`headers`] (the header names on the wire), [`time`] (durations as written in
//! settings), [`metrics`] (the Prometheus registry the library fills), [`gateway`] (the
//! `x-delay` gateway's pairs) and [`recurring`] (recurring schedules: cron ticks in a time
//! zone, the occurrences to publish, the book of definitions). For tools that operate a
//! deployment, as the amqp-delay tools do: [`ops`] (the control and journal streams, cancels,
//! trust, the ledger, parked messages, broker primitives).
//!
//! Features: `management` (an HTTP client, for `Topology::stats_with`).
//!
//! Lints (Cargo.toml): `unsafe_code` forbidden, `unreachable_pub` denied: an item is `pub` only
//! when a public module or the root re-exports reach it.

// ---- pure core: no I/O ---------------------------------------------------------------------
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

// ---- broker edge ---------------------------------------------------------------------------
// the operator API's modules (batch, broker, cancel, connection, control, journal, ledger,
// management, parked) are declared in `ops`; the library names them from the root
pub mod ops;
#[cfg(feature = "management")]
use ops::management;
use ops::{batch, broker, cancel, connection, control, journal, ledger, trust};
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
