//! The crate's error type: every failure a caller can see, with text that says what happened
//! and, where we know, what to do about it. Pure: it names lapin's error type but does no I/O.

use std::sync::Arc;

use crate::layout::LayoutError;
use crate::planner::PlanError;
use crate::settings::SettingsError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, one variant per thing a caller can act on; [`Error::kind`]
/// sorts them into the few kinds a program reacts to (a command's exit code, whether to try
/// again). Cheap to clone: a batch that failed as one gives each member the same error.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid (named key and value), or a file it names cannot be read.
    #[error(transparent)]
    Settings(Arc<SettingsError>),
    /// The topology settings cannot produce a valid layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The delay cannot be served by this topology.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The request itself is malformed (bad destination, reserved header, a missing flag, an
    /// operation refused as asked, ...): the caller's mistake, the same request fails again.
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
    /// Another object the request or the configuration names (an exchange to forward to, a
    /// gateway's target, a queue to consume) does not exist on the broker.
    #[error("{object} does not exist: {hint}")]
    Missing {
        /// The object, as `"exchange 'x'"` with its role.
        object: String,
        /// What to do about it.
        hint: String,
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
    /// Reading or appending to a stream (the control or the ledger stream) failed part-way:
    /// the read ended early, or the follower that reads it stopped. Reconnecting reads it again.
    #[error("stream '{stream}': {what}")]
    Stream {
        /// The stream's name.
        stream: String,
        /// What failed, and why when known.
        what: String,
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
    /// Something the call needs has stopped: the publisher is closing, the connection it was
    /// given is closed. Nothing was done; a new one (or the owner's reconnect) can.
    #[error("{0}")]
    Stopped(String),
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
    /// The broker's management API (HTTP) could not be asked or gave no usable answer.
    #[error("management API at {url}: {reason}")]
    Management {
        /// Its URL, password redacted.
        url: String,
        /// What went wrong.
        reason: String,
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
    /// Any other AMQP failure, with what we were doing: the broker's refusal (its reply code
    /// says which, see [`Error::kind`]) or a lost connection or channel.
    #[error("{context}: {source}")]
    Amqp {
        /// What we were doing.
        context: String,
        #[source]
        /// lapin's error.
        source: lapin::Error,
    },
}

/// The kinds of [`Error`]: what a program does about one. Binaries take their exit code from
/// it (`Usage` and `Topology` are 2, the rest 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request or the configuration is wrong ([`Error::Settings`], [`Error::Layout`],
    /// [`Error::Plan`], [`Error::Invalid`]): fix it, the same call fails the same way.
    Usage,
    /// The broker's objects are not what the call needs ([`Error::NotDeclared`],
    /// [`Error::UnknownDestination`], [`Error::Missing`], [`Error::Conflict`]): declare them (or
    /// fix the settings) first; trying again as is fails the same way.
    Topology,
    /// The broker refused ([`Error::Nacked`], [`Error::Returned`], an [`Error::Amqp`] with an
    /// access, not-found, precondition or not-allowed reply): nothing was done.
    Refused,
    /// The broker (or something the call needs) could not be reached, stopped answering or
    /// went away ([`Error::Connect`], [`Error::Timeout`], [`Error::Management`],
    /// [`Error::Stopped`], any other [`Error::Amqp`], a cancelled or stalled consumer, a
    /// handler's requeue): nothing was done; trying again later may work.
    Unavailable,
    /// A stream read or append failed part-way ([`Error::Stream`]); reading again may work.
    Stream,
    /// The confirm was lost ([`Error::MaybeSent`]): the message may have been delivered.
    MaybeSent,
}

/// AMQP replies by which the broker refuses a request (rather than failing to serve it):
/// access refused, not found, resource locked, precondition failed, not allowed.
const REFUSALS: [u16; 5] = [403, 404, 405, 406, 530];

impl Error {
    /// A configuration problem that only a check outside [`crate::Settings::validate`] finds
    /// (a file it names, a combination of sections, the metrics address): an [`Error::Settings`].
    pub(crate) fn config(why: impl Into<String>) -> Error {
        Error::from(SettingsError::Invalid(why.into()))
    }

    /// A stream read or append on `stream` that failed: an [`Error::Stream`].
    pub(crate) fn stream(stream: impl Into<String>, what: impl Into<String>) -> Error {
        Error::Stream {
            stream: stream.into(),
            what: what.into(),
        }
    }

    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Settings(_) | Error::Layout(_) | Error::Plan(_) | Error::Invalid(_) => {
                ErrorKind::Usage
            }
            Error::UnknownDestination(_)
            | Error::NotDeclared { .. }
            | Error::Missing { .. }
            | Error::Conflict(_) => ErrorKind::Topology,
            Error::Nacked { .. } | Error::Returned { .. } => ErrorKind::Refused,
            Error::Amqp { source, .. } => match source.kind() {
                lapin::ErrorKind::ProtocolError(reply) if REFUSALS.contains(&reply.get_id()) => {
                    ErrorKind::Refused
                }
                _ => ErrorKind::Unavailable,
            },
            Error::Stream { .. } => ErrorKind::Stream,
            Error::MaybeSent { .. } => ErrorKind::MaybeSent,
            Error::ConsumerCancelled { .. }
            | Error::ConsumerStalled { .. }
            | Error::Requeued { .. }
            | Error::Stopped(_)
            | Error::Connect { .. }
            | Error::Timeout { .. }
            | Error::Management { .. } => ErrorKind::Unavailable,
        }
    }

    /// Whether the message may have reached the broker anyway ([`Error::MaybeSent`]): every
    /// other error means it was not scheduled.
    pub fn maybe_sent(&self) -> bool {
        matches!(self, Error::MaybeSent { .. })
    }
}

impl From<SettingsError> for Error {
    fn from(e: SettingsError) -> Error {
        Error::Settings(Arc::new(e))
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

    /// The broker's reply `code` as lapin reports it.
    fn reply(code: u16) -> lapin::Error {
        let amqp = lapin::protocol::AMQPError::from_id(code, "REPLY".into()).expect("a reply code");
        lapin::Error::from(lapin::ErrorKind::ProtocolError(amqp))
    }

    fn io() -> lapin::Error {
        lapin::Error::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }

    fn amqp(source: lapin::Error) -> Error {
        Error::Amqp {
            context: "declaring".into(),
            source,
        }
    }

    /// One of every variant, with the kind it must have.
    fn every_variant() -> Vec<(Error, ErrorKind)> {
        use ErrorKind::*;
        let s = |t: &str| t.to_string();
        vec![
            (SettingsError::Invalid(s("x")).into(), Usage),
            (LayoutError(s("radix")).into(), Usage),
            (
                PlanError::TooLong {
                    delay_ms: 2,
                    max_ms: 1,
                }
                .into(),
                Usage,
            ),
            (Error::Invalid(s("bad id")), Usage),
            (Error::UnknownDestination(s("q")), Topology),
            (
                Error::NotDeclared {
                    prefix: s("p"),
                    detail: s(""),
                },
                Topology,
            ),
            (
                Error::Missing {
                    object: s("forward exchange 'x'"),
                    hint: s("declare it"),
                },
                Topology,
            ),
            (Error::Conflict(s("radix: 4 → 8")), Topology),
            (Error::Nacked { exchange: s("x") }, Refused),
            (
                Error::Returned {
                    exchange: s("x"),
                    routing_key: s("k"),
                    code: 312,
                    text: s("NO_ROUTE"),
                },
                Refused,
            ),
            (amqp(reply(403)), Refused),
            (amqp(reply(404)), Refused),
            (amqp(reply(406)), Refused),
            (amqp(reply(320)), Unavailable),
            (amqp(io()), Unavailable),
            (Error::stream("p.control", "the follower stopped"), Stream),
            (Error::ConsumerCancelled { queue: s("q") }, Unavailable),
            (
                Error::ConsumerStalled {
                    queue: s("q"),
                    ready: 3,
                    idle_ms: 10,
                },
                Unavailable,
            ),
            (Error::Requeued { reason: s("busy") }, Unavailable),
            (Error::Stopped(s("the publisher is closing")), Unavailable),
            (
                Error::Connect {
                    url: s("amqp://h"),
                    source: io(),
                },
                Unavailable,
            ),
            (
                Error::Timeout {
                    context: s("declaring"),
                    timeout_ms: 5,
                },
                Unavailable,
            ),
            (
                Error::Management {
                    url: s("http://h/api"),
                    reason: s("answered HTTP 500"),
                },
                Unavailable,
            ),
            (
                Error::MaybeSent {
                    context: s("publishing"),
                    source: io(),
                },
                MaybeSent,
            ),
        ]
    }

    #[test]
    fn every_error_has_the_kind_of_its_failure() {
        for (e, kind) in every_variant() {
            assert_eq!(e.kind(), kind, "{e:?}");
            assert_eq!(e.maybe_sent(), kind == ErrorKind::MaybeSent, "{e:?}");
        }
    }

    /// Each member of a batch that failed as one gets the same error: the same variant, the
    /// same text and cause (what `duplicate` did by hand).
    #[test]
    fn a_clone_is_the_same_error() {
        for (e, _) in every_variant() {
            let c = e.clone();
            assert_eq!(chain(&c), chain(&e));
            assert_eq!(std::mem::discriminant(&c), std::mem::discriminant(&e));
        }
    }

    /// A stream that stops mid-read is no longer an "invalid request".
    #[test]
    fn a_stream_failure_names_the_stream() {
        let e = Error::stream("p.control", "the broker ended the read before the barrier");
        assert_eq!(
            chain(&e),
            "stream 'p.control': the broker ended the read before the barrier"
        );
        let e: Error = SettingsError::Invalid("tls.ca_file x is not PEM text".into()).into();
        assert_eq!(chain(&e), "configuration: tls.ca_file x is not PEM text");
        assert_eq!(Error::config("y").kind(), ErrorKind::Usage);
    }

    #[test]
    fn chain_skips_repeated_causes() {
        assert_eq!(chain(&Outer(Inner)), "outer: inner detail");
        let e = Error::Invalid("bad".into());
        assert_eq!(chain(&e), "invalid request: bad");
    }
}
