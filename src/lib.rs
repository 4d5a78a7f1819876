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
//! (whose records and messages count for what), [`metrics`]
//! (the Prometheus registry the library fills) and, with the `management` feature,
//! `management` (RabbitMQ's HTTP API, to count messages its dead-letter worker holds).
//!
//! Features: `management` (an HTTP client, for `Topology::stats_with`); `tools` (the
//! broker-edge modules the amqp-delay-cli tools and the test suites drive directly: hidden, no
//! stability promise).
//!
//! Lints (Cargo.toml): `unsafe_code` forbidden, `unreachable_pub` denied. An item is `pub` only
//! when the façade or the tools reach it: the modules the `tools` feature opens allow
//! `unreachable_pub` only in the build without it, where what the tools use is unreachable, and
//! items only the tools call say so with `cfg_attr(not(feature = "tools"), allow(dead_code))`.

// ---- pure core: no I/O ---------------------------------------------------------------------
pub mod headers;
pub mod layout;
pub mod metrics;
pub mod settings;
pub mod time;
pub mod trust;
// (each private unless the `tools` feature opens it; spelled out so that rustfmt sees it)
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod batch;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod batch;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod endpoints;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod endpoints;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod envelope;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod envelope;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod error;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod error;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod message;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod message;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod planner;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod planner;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod retry;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod retry;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod tally;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod tally;

// ---- broker edge ---------------------------------------------------------------------------
#[cfg(feature = "management")]
pub mod management;
// (each private unless the `tools` feature opens it; spelled out so that rustfmt sees it)
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod broker;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod broker;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod cancel;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod cancel;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod connection;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod connection;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod control;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod control;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod ledger;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod ledger;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod publisher;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod publisher;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod topology;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod topology;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod worker;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod worker;

// the one log both streams use (private to the library)
mod stream_log;

// ---- applications --------------------------------------------------------------------------
// (each private unless the `tools` feature opens it; spelled out so that rustfmt sees it)
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod gateway;
#[cfg(not(feature = "tools"))]
#[allow(unreachable_pub)]
mod gateway;

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
