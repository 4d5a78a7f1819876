//! amqp-delay: delayed delivery for RabbitMQ built only from stock features — tier queues with
//! one fixed TTL each, dead-letter exchanges and topic routing. `ARCHITECTURE.md` is the map;
//! `docs/DESIGN.md` has the broker rules and the cost model.
//!
//! What an application needs is at the root: [`Topology`] declares the tiers, [`Publisher`]
//! schedules [`Message`]s, a [`Worker`] runs a [`Handler`] on every due [`Delivery`] and acts on
//! its [`Outcome`]. [`Settings`] holds every setting (defaults < TOML file < environment).
//!
//! ```no_run
//! # async fn demo() -> amqp_delay::Result<()> {
//! use amqp_delay::{Message, Publisher, Settings, Topology};
//! let settings = Settings::default();
//! let conn = amqp_delay::connection::connect(&settings.url, "example").await?;
//! Topology::new(settings.layout()?).declare(&conn).await?;
//! let publisher = Publisher::connect(&settings).await?;
//! let s = publisher.schedule(Message::new("orders.timeout", 30 * 60_000, r#"{"order":42}"#)).await?;
//! println!("{} due at {}", s.message_id, s.due_at_ms);
//! # Ok(()) }
//! ```
//!
//! The modules are layered and only point down (checked by a test, see `ARCHITECTURE.md`):
//! pure core ([`time`], `endpoints`, [`layout`], [`planner`], [`headers`], `envelope`,
//! [`batch`], `message`, `retry`, [`jsonl`], [`metrics`], [`settings`], `error`) → broker edge
//! ([`broker`], [`connection`], `control`, [`cancel`], [`management`], `topology`, `publisher`,
//! `worker`) → applications ([`gateway`], [`actions`], [`admin`], [`bulk`], [`observe`]) → the
//! binaries' shared [`cli`] pieces.

#![warn(missing_docs)]

// ---- pure core: no I/O ---------------------------------------------------------------------
pub mod batch;
mod endpoints;
mod envelope;
mod error;
pub mod headers;
pub mod jsonl;
pub mod layout;
mod message;
pub mod metrics;
pub mod planner;
mod retry;
pub mod settings;
pub mod tally;
pub mod time;

// ---- broker edge ---------------------------------------------------------------------------
pub mod broker;
pub mod cancel;
pub mod connection;
mod control;
pub mod ledger;
pub mod management;
mod publisher;
mod topology;
mod worker;

// ---- applications --------------------------------------------------------------------------
pub mod actions;
pub mod admin;
pub mod bulk;
pub mod gateway;
pub mod observe;

// ---- shared by the binaries ----------------------------------------------------------------
pub mod cli;

pub use envelope::Delivery;
pub use error::{Error, Result, chain as error_chain};
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
