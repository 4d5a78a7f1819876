//! The crate's error type: every failure a caller can see, with text that says what happened
//! and, where we know, what to do about it. Pure: it names lapin's error type but does no I/O.

use crate::layout::LayoutError;
use crate::planner::PlanError;
use crate::settings::SettingsError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid (named key and value).
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// The topology settings cannot produce a valid layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The delay cannot be served by this topology.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The request itself is malformed (bad destination, reserved header, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The destination queue does not exist, so nothing was scheduled.
    #[error("destination queue '{0}' does not exist (declare it first); nothing was scheduled")]
    UnknownDestination(String),
    /// The delay topology (or a part of it) is missing on the broker.
    #[error(
        "the delay topology under prefix '{prefix}' is not declared on this broker{detail}; run `delay-publisher declare` (with the same --prefix and settings) first"
    )]
    NotDeclared {
        /// The prefix looked for.
        prefix: String,
        /// What exactly is missing, as `": queue 'x' is missing"` (may be empty).
        detail: String,
    },
    /// The existing broker objects were declared with other settings.
    #[error("topology conflict: {0}")]
    Conflict(String),
    /// The broker refused the message (nack): a tier is full or unavailable.
    #[error(
        "the broker rejected the message (nack) publishing to '{exchange}': a tier queue is full (x-max-length with reject-publish) or unavailable; nothing was scheduled"
    )]
    Nacked {
        /// The exchange published to.
        exchange: String,
    },
    /// The broker returned the message as unroutable (topology incomplete).
    #[error(
        "the broker returned the message as unroutable ({code} {text}) from exchange '{exchange}' with key '{routing_key}': is the topology declared (`delay-publisher declare`)?"
    )]
    Returned {
        /// The exchange published to.
        exchange: String,
        /// The routing key used.
        routing_key: String,
        /// The broker's reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The broker cancelled a worker's consumer (its queue was deleted, or the node holding it
    /// went away).
    #[error("the broker cancelled the consumer of queue '{queue}' (queue deleted or unavailable)")]
    ConsumerCancelled {
        /// The queue whose consumer was cancelled.
        queue: String,
    },
    /// Messages wait in a queue the worker consumes, yet none has reached it for a while
    /// although it has room: the subscription stalled (seen after a full cluster restart, the
    /// broker holding a prefetch's worth of messages as delivered to a consumer that never
    /// received them). The worker reconnects, which returns them to the queue.
    #[error(
        "consuming '{queue}': {ready} messages are ready but none has reached this idle worker for {idle_ms} ms"
    )]
    ConsumerStalled {
        /// The queue.
        queue: String,
        /// Its ready messages.
        ready: u32,
        /// How long nothing arrived.
        idle_ms: u64,
    },
    /// A handler asked for the message to be put back unchanged ([`crate::Outcome::Requeue`]).
    #[error("the handler could not process the message now and put it back: {reason}")]
    Requeued {
        /// What the handler said.
        reason: String,
    },
    /// Connecting to the broker failed.
    #[error("cannot connect to the broker at {url}: {source}")]
    Connect {
        /// The broker URL, password redacted.
        url: String,
        #[source]
        /// lapin's error.
        source: lapin::Error,
    },
    /// The broker did not answer in time.
    #[error("{context}: no answer from the broker within {timeout_ms} ms")]
    Timeout {
        /// What we were doing.
        context: String,
        /// How long we waited.
        timeout_ms: u64,
    },
    /// The message was sent but the broker's confirm never came (the connection or channel
    /// was lost meanwhile): it may or may not have been delivered. Re-sending it can create a
    /// duplicate; its message id lets consumers recognise one.
    #[error("{context}: the confirm was lost, the message MAY have been delivered: {source}")]
    MaybeSent {
        /// What we were doing.
        context: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// Any other AMQP failure, with what we were doing.
    #[error("{context}: {source}")]
    Amqp {
        /// What we were doing.
        context: String,
        #[source]
        /// lapin's error.
        source: lapin::Error,
    },
}

impl Error {
    /// The same error, for each member of a batch that failed as one (lapin's errors are
    /// cloneable; settings errors, which cannot occur there, keep their text).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::Settings(e) => Error::Invalid(e.to_string()),
            Error::Layout(e) => Error::Layout(e.clone()),
            Error::Plan(e) => Error::Plan(e.clone()),
            Error::Invalid(s) => Error::Invalid(s.clone()),
            Error::UnknownDestination(s) => Error::UnknownDestination(s.clone()),
            Error::NotDeclared { prefix, detail } => Error::NotDeclared {
                prefix: prefix.clone(),
                detail: detail.clone(),
            },
            Error::Conflict(s) => Error::Conflict(s.clone()),
            Error::Nacked { exchange } => Error::Nacked {
                exchange: exchange.clone(),
            },
            Error::Returned {
                exchange,
                routing_key,
                code,
                text,
            } => Error::Returned {
                exchange: exchange.clone(),
                routing_key: routing_key.clone(),
                code: *code,
                text: text.clone(),
            },
            Error::ConsumerCancelled { queue } => Error::ConsumerCancelled {
                queue: queue.clone(),
            },
            Error::ConsumerStalled {
                queue,
                ready,
                idle_ms,
            } => Error::ConsumerStalled {
                queue: queue.clone(),
                ready: *ready,
                idle_ms: *idle_ms,
            },
            Error::Requeued { reason } => Error::Requeued {
                reason: reason.clone(),
            },
            Error::Connect { url, source } => Error::Connect {
                url: url.clone(),
                source: source.clone(),
            },
            Error::Timeout {
                context,
                timeout_ms,
            } => Error::Timeout {
                context: context.clone(),
                timeout_ms: *timeout_ms,
            },
            Error::Amqp { context, source } => Error::Amqp {
                context: context.clone(),
                source: source.clone(),
            },
            Error::MaybeSent { context, source } => Error::MaybeSent {
                context: context.clone(),
                source: source.clone(),
            },
        }
    }

    /// Whether the message may have reached the broker anyway ([`Error::MaybeSent`]): every
    /// other error means it was not scheduled.
    pub fn maybe_sent(&self) -> bool {
        matches!(self, Error::MaybeSent { .. })
    }
}

/// Adds what we were doing to a lapin result.
pub trait ResultExt<T> {
    /// Wraps a lapin error into [`Error::Amqp`] with `what` we were doing.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> ResultExt<T> for std::result::Result<T, lapin::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Amqp {
            context: what(),
            source,
        })
    }
}

/// `outer: inner: innermost` (skipping a cause already contained in the text before it): how
/// every error is printed.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: inner detail")]
    struct Outer(#[source] Inner);
    #[derive(Debug, thiserror::Error)]
    #[error("inner detail")]
    struct Inner;

    #[test]
    fn chain_skips_repeated_causes() {
        assert_eq!(chain(&Outer(Inner)), "outer: inner detail");
        let e = Error::Invalid("bad".into());
        assert_eq!(chain(&e), "invalid request: bad");
    }
}
