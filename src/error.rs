//! The crate's error type: every failure a caller can see, with text that says what happened
//! and, where we know, what to do about it.

use crate::planner::PlanError;
use crate::settings::SettingsError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The request itself is malformed (bad destination, reserved header, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The destination queue does not exist, so nothing was scheduled.
    #[error("destination queue '{0}' does not exist (declare it first); nothing was scheduled")]
    UnknownDestination(String),
    /// The existing broker objects were declared with other settings.
    #[error("topology conflict: {0}")]
    Conflict(String),
    /// The broker refused the message (nack): a tier is full or unavailable.
    #[error(
        "the broker rejected the message (nack) publishing to '{exchange}': a tier queue is full (x-max-length with reject-publish) or unavailable; nothing was scheduled"
    )]
    Nacked { exchange: String },
    /// The broker returned the message as unroutable (topology incomplete).
    #[error(
        "the broker returned the message as unroutable ({code} {text}) from exchange '{exchange}' with key '{routing_key}': is the topology declared (`delay-publisher declare`)?"
    )]
    Returned {
        exchange: String,
        routing_key: String,
        code: u16,
        text: String,
    },
    /// Connecting to the broker failed.
    #[error("cannot connect to the broker at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: lapin::Error,
    },
    /// Any other AMQP failure, with what we were doing.
    #[error("{context}: {source}")]
    Amqp {
        context: String,
        #[source]
        source: lapin::Error,
    },
}

/// Adds context to a lapin result.
pub trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, lapin::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Amqp {
            context: what(),
            source,
        })
    }
}

/// The broker's reply code and text when `e` is a channel or connection error it sent.
pub fn broker_error(e: &lapin::Error) -> Option<(u16, String)> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            Some((amqp.get_id(), amqp.get_message().as_str().to_string()))
        }
        _ => None,
    }
}
