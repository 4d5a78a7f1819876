//! What `pending` answers, as JSON: the HTTP API's bodies, `--json`'s lines, and what the CLI
//! reads back from a `pending serve`. Made from the index's rows here and nowhere else.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::follow::Lag;
use super::when::format_time;
use crate::pending_index::{Destination, Event, Outcome, Record, Row, State};

/// Where a message goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationOut {
    /// The destination queue (a message to a queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The gateway's target exchange (a gateway message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<String>,
    /// Its routing key (a gateway message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
}

impl DestinationOut {
    fn of(d: &Destination) -> DestinationOut {
        match d {
            Destination::Queue(q) => DestinationOut {
                queue: Some(q.clone()),
                exchange: None,
                routing_key: None,
            },
            Destination::Exchange {
                exchange,
                routing_key,
            } => DestinationOut {
                queue: None,
                exchange: Some(exchange.clone()),
                routing_key: Some(routing_key.clone()),
            },
        }
    }

    /// `queue Q` or `exchange X key K`, for people.
    pub fn describe(&self) -> String {
        match (&self.queue, &self.exchange) {
            (Some(q), _) => format!("queue {q}"),
            (None, Some(x)) => format!(
                "exchange {x} key {}",
                self.routing_key.as_deref().unwrap_or("")
            ),
            (None, None) => "-".into(),
        }
    }
}

/// One message of a page: every field but the body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowOut {
    /// The message id.
    pub id: String,
    /// Its owner (who scheduled it).
    pub owner: String,
    /// Where it goes.
    pub destination: DestinationOut,
    /// When it is due (ms since the epoch).
    pub due_at_ms: u64,
    /// The same, RFC 3339.
    pub due_at: String,
    /// When it was scheduled (ms since the epoch).
    pub scheduled_at_ms: u64,
    /// Its body's size in bytes.
    pub size: u64,
    /// Its content type.
    pub content_type: Option<String>,
    /// The journal's copy of its user headers, in order.
    pub headers: Vec<(String, String)>,
    /// `unconfirmed`, `pending`, `cancelled`, `done`, `parked` or `refused`.
    pub state: String,
    /// Whether its body was kept (what moving it earlier needs).
    pub body_kept: bool,
    /// A page that ends here continues after this (`after=`).
    pub cursor: String,
}

/// A state's name on the wire.
pub fn state_name(s: State) -> &'static str {
    match s {
        State::Unconfirmed => "unconfirmed",
        State::Pending => "pending",
        State::Cancelled => "cancelled",
        State::Done => "done",
        State::Parked => "parked",
        State::Refused => "refused",
    }
}

impl RowOut {
    /// The wire form of `r`.
    pub fn of(r: &Row) -> RowOut {
        RowOut {
            id: r.id.clone(),
            owner: r.owner.clone(),
            destination: DestinationOut::of(&r.destination),
            due_at_ms: r.due_at_ms,
            due_at: format_time(r.due_at_ms),
            scheduled_at_ms: r.scheduled_at_ms,
            size: r.size,
            content_type: r.content_type.clone(),
            headers: r.headers.clone(),
            state: state_name(r.state).into(),
            body_kept: r.body_kept,
            cursor: r.cursor.to_string(),
        }
    }
}

/// One page of `pending list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageOut {
    /// The messages, by due time.
    pub rows: Vec<RowOut>,
    /// Where the next page starts (`after=`); none after the last page.
    pub next: Option<String>,
    /// How far behind the index is.
    pub lag: Lag,
}

/// What happened to a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventOut {
    /// `scheduled`, `rescheduled`, `cancelled`, `done`, `retried` or `parked`.
    pub event: String,
    /// When (ms since the epoch).
    pub at_ms: u64,
    /// The same, RFC 3339.
    pub at: String,
    /// Who (a reschedule, a cancel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// The due time it was given (scheduled), or moved to (rescheduled, retried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_at_ms: Option<u64>,
    /// The due time before (rescheduled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_due_at_ms: Option<u64>,
    /// How late it ran (done, retried, parked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lateness_ms: Option<u64>,
}

impl EventOut {
    fn of(e: &Event) -> EventOut {
        let mut out = EventOut {
            event: String::new(),
            at_ms: e.at_ms(),
            at: format_time(e.at_ms()),
            by: None,
            due_at_ms: None,
            from_due_at_ms: None,
            lateness_ms: None,
        };
        match e {
            Event::Scheduled { due_at_ms, .. } => {
                out.event = "scheduled".into();
                out.due_at_ms = Some(*due_at_ms);
            }
            Event::Rescheduled {
                by,
                from_due_at_ms,
                to_due_at_ms,
                ..
            } => {
                out.event = "rescheduled".into();
                out.by = Some(by.clone());
                out.from_due_at_ms = Some(*from_due_at_ms);
                out.due_at_ms = Some(*to_due_at_ms);
            }
            Event::Cancelled { by, .. } => {
                out.event = "cancelled".into();
                out.by = Some(by.clone());
            }
            Event::Ran {
                lateness_ms,
                outcome,
                ..
            } => {
                out.lateness_ms = Some(*lateness_ms);
                out.event = match outcome {
                    Outcome::Done => "done".into(),
                    Outcome::Parked => "parked".into(),
                    Outcome::Retried { next_due_at_ms } => {
                        out.due_at_ms = Some(*next_due_at_ms);
                        "retried".into()
                    }
                };
            }
        }
        out
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        let mut s = format!("{} {}", self.at, self.event);
        if let Some(b) = &self.by {
            s.push_str(&format!(" by {b}"));
        }
        if let Some(f) = self.from_due_at_ms {
            s.push_str(&format!(" from {}", format_time(f)));
        }
        if let Some(d) = self.due_at_ms {
            s.push_str(&format!(" due {}", format_time(d)));
        }
        if let Some(l) = self.lateness_ms {
            s.push_str(&format!(" ({l} ms late)"));
        }
        s
    }
}

/// One message with its body and history: `pending show`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageOut {
    /// Its fields.
    #[serde(flatten)]
    pub row: RowOut,
    /// The kept body: UTF-8 text, else base64 (see `body_encoding`).
    pub body: Option<String>,
    /// `utf-8` or `base64`, when the body was kept.
    pub body_encoding: Option<String>,
    /// What happened to it, oldest first.
    pub history: Vec<EventOut>,
}

impl MessageOut {
    /// The wire form of `r`.
    pub fn of(r: &Record) -> MessageOut {
        let (body, body_encoding) = match &r.body {
            None => (None, None),
            Some(b) => match std::str::from_utf8(b) {
                Ok(s) => (Some(s.to_string()), Some("utf-8".to_string())),
                Err(_) => (
                    Some(base64::engine::general_purpose::STANDARD.encode(b)),
                    Some("base64".to_string()),
                ),
            },
        };
        MessageOut {
            row: RowOut::of(&r.row),
            body,
            body_encoding,
            history: r.history.iter().map(EventOut::of).collect(),
        }
    }
}

/// `pending show`: every message of that id the asker sees (one per owner, for an admin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShowOut {
    /// The messages.
    pub messages: Vec<MessageOut>,
    /// How far behind the index is.
    pub lag: Lag,
}

/// What a purge covered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurgeOut {
    /// Pending messages it covers, as the index counts them now.
    pub covered: u64,
    /// The destination queue.
    pub queue: String,
    /// Whether the purge record was written (not on a dry run).
    pub written: bool,
    /// How far behind the index is (what it does not know yet is covered too, but not
    /// counted).
    pub lag: Lag,
}

/// What a steering action on one message did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SteeredOut {
    /// The message id.
    pub id: String,
    /// Its owner.
    pub owner: String,
    /// `rescheduled` or `cancelled`.
    pub action: String,
    /// Its due time before.
    pub from_due_at_ms: u64,
    /// Its due time now (a reschedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_at_ms: Option<u64>,
    /// Whether the message was sent again now (moved earlier, from its kept body).
    #[serde(default)]
    pub resent: bool,
}

/// The status of a `pending serve`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusOut {
    /// How far behind the index is.
    pub lag: Lag,
}

/// An error answer of the HTTP API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorOut {
    /// What is wrong and what to do.
    pub error: String,
}
