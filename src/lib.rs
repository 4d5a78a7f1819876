//! amqp-delay: delayed delivery for RabbitMQ built only from stock features — tier queues with
//! one fixed TTL each, dead-letter exchanges and topic routing. See `ARCHITECTURE.md` for the map.
//!
//! ```no_run
//! # async fn demo() -> amqp_delay::Result<()> {
//! use amqp_delay::{Message, Publisher, Settings, Topology};
//! let settings = Settings::default();
//! let conn = amqp_delay::connection::connect(&settings.url, "example").await?;
//! Topology::new(settings.layout().unwrap()).declare(&conn).await?;
//! let publisher = Publisher::connect(&settings).await?;
//! let s = publisher.schedule(Message::new("orders.timeout", 30 * 60_000, r#"{"order":42}"#)).await?;
//! println!("{} due at {}", s.message_id, s.due_at_ms);
//! # Ok(()) }
//! ```

pub mod actions;
pub mod cli;
pub mod connection;
pub mod envelope;
pub mod error;
pub mod gateway;
pub mod headers;
pub mod jsonl;
pub mod layout;
pub mod planner;
pub mod publisher;
pub mod retry;
pub mod settings;
pub mod topology;
pub mod worker;

pub use error::{Error, Result};
pub use layout::Layout;
pub use planner::{Precision, Route, plan};
pub use publisher::{Message, Publisher, Scheduled};
pub use settings::Settings;
pub use topology::Topology;
