//! Recurring schedules, pure: a [`Definition`] (a cron expression in an IANA time zone, the
//! message each tick sends, what a missed tick does), its [`Ticks`] (the instants it falls on,
//! correct across daylight-saving changes), the [`plan`] of which occurrences to schedule
//! ahead, and the [`Book`] of schedules a control stream's records make.
//!
//! Each occurrence is an ordinary delayed message whose id is [`occurrence_id`]
//! (`NAME@<tick>`, the tick in RFC 3339 UTC): scheduling a tick twice names the same message
//! twice, which a reader of the journal can tell.
//!
//! **Time zones.** A tick is a wall-clock time the cron matches in the schedule's zone; it
//! falls on the first instant whose local time is at or after it. So a wall time the clocks
//! skip (spring forward) runs once, at the change; a wall time they repeat (fall back) runs
//! once, on its first pass; and two wall times that fall on the same instant run once.

use serde::{Deserialize, Serialize};

use crate::headers;

mod book;
mod cron;
mod plan;

pub use book::{
    Action, Add, Book, Entry, Keep, MAX_PER_OWNER, MAX_SCHEDULES, Mark, MarkGroup, Marks, Set,
};
pub use cron::{MAX_CRON_BYTES, Ticks, rfc3339};
pub use plan::{Occurrence, Plan, Window, plan};

/// The longest schedule name: its occurrence ids (`NAME@2026-12-07T02:00:00Z`) stay well
/// within AMQP's 255-byte message id.
pub const MAX_NAME_BYTES: usize = 100;
/// The largest body a schedule's occurrences carry: every definition lives in the control
/// stream and in each scheduler's memory.
pub const MAX_BODY_BYTES: usize = 16 * 1024;
/// The most headers a schedule's occurrences carry.
pub const MAX_HEADERS: usize = 32;
/// The longest header value.
pub const MAX_HEADER_VALUE_BYTES: usize = 1024;

/// What a tick missed by more than the scheduler's grace does (an outage longer than the
/// schedule-ahead window, a resume after the schedule's window opened).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Misfire {
    /// One catch-up occurrence for all the ticks missed, at once (named by the latest).
    #[default]
    Once,
    /// None: the next tick runs as planned.
    Skip,
}

impl std::str::FromStr for Misfire {
    type Err = String;
    fn from_str(s: &str) -> Result<Misfire, String> {
        match s {
            "once" => Ok(Misfire::Once),
            "skip" => Ok(Misfire::Skip),
            _ => Err(format!("--misfire is 'once' or 'skip', not '{s}'")),
        }
    }
}

/// A recurring schedule as its owner wrote it. Its owner is the user who wrote the record
/// (broker-checked `user_id`), never a field of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Definition {
    /// Its name: 1 to [`MAX_NAME_BYTES`] of ASCII letters, digits, `.`, `_` and `-`; an
    /// owner's names are its own (another user's schedule of the same name is another one).
    pub name: String,
    /// Five fields (minute hour day-of-month month day-of-week), six with seconds first, or
    /// `@yearly`, `@monthly`, `@weekly`, `@daily`, `@hourly`.
    pub cron: String,
    /// The IANA time zone the cron is read in.
    #[serde(default = "utc")]
    pub tz: String,
    /// The destination queue of its occurrences.
    pub queue: String,
    /// Their body.
    pub body: String,
    /// Their headers (no `x-delay-*`, no `CC`/`BCC`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
    /// What a missed tick does.
    #[serde(default)]
    pub misfire: Misfire,
    /// No tick before (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ms: Option<u64>,
    /// No tick after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
}

fn utc() -> String {
    "UTC".into()
}

impl Definition {
    /// A schedule of `name` sending `body` to `queue` on every tick of `cron` in UTC, a
    /// missed tick caught up once.
    pub fn new(name: &str, cron: &str, queue: &str, body: &str) -> Definition {
        Definition {
            name: name.into(),
            cron: cron.into(),
            tz: utc(),
            queue: queue.into(),
            body: body.into(),
            headers: Vec::new(),
            misfire: Misfire::Once,
            from_ms: None,
            until_ms: None,
        }
    }

    /// Its ticks, or why it has none: every rule of the fields above, a cron that parses
    /// and a zone the database knows.
    pub fn check(&self) -> Result<Ticks, String> {
        check_name(&self.name)?;
        if self.queue.is_empty() || self.queue.len() > 255 {
            return Err(format!(
                "a queue name is 1 to 255 bytes, not {}",
                self.queue.len()
            ));
        }
        if self.body.len() > MAX_BODY_BYTES {
            return Err(format!(
                "a schedule's body is at most {MAX_BODY_BYTES} bytes, not {}",
                self.body.len()
            ));
        }
        check_headers(&self.headers)?;
        if let (Some(from), Some(until)) = (self.from_ms, self.until_ms)
            && until < from
        {
            return Err("--until is before --from: the schedule would never tick".into());
        }
        Ticks::new(&self.cron, &self.tz)
    }
}

/// Whether `name` is a schedule name (see [`Definition::name`]).
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_NAME_BYTES || !name.chars().all(ok) {
        return Err(format!(
            "a schedule name is 1 to {MAX_NAME_BYTES} ASCII letters, digits, '.', '_' or '-', \
             not {name:?}"
        ));
    }
    Ok(())
}

fn check_headers(h: &[(String, String)]) -> Result<(), String> {
    if h.len() > MAX_HEADERS {
        return Err(format!("at most {MAX_HEADERS} headers, not {}", h.len()));
    }
    for (k, v) in h {
        if k.is_empty() || k.len() > 255 || v.len() > MAX_HEADER_VALUE_BYTES {
            return Err(format!(
                "a header is NAME=VALUE, the name 1 to 255 bytes and the value at most \
                 {MAX_HEADER_VALUE_BYTES}, not {} and {}",
                k.len(),
                v.len()
            ));
        }
        if headers::is_reserved(k) || headers::is_routing_header(k) {
            return Err(format!("header '{k}' is reserved: no schedule may set it"));
        }
    }
    Ok(())
}

/// The id of `name`'s occurrence at `tick_ms`: `NAME@<tick>` (RFC 3339, UTC, to the second),
/// the same whoever schedules it and however often.
pub fn occurrence_id(name: &str, tick_ms: u64) -> String {
    format!("{name}@{}", rfc3339(tick_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_definition_is_checked_field_by_field() {
        let d = Definition::new("nightly-report", "0 2 * * *", "reports", "{}");
        assert!(d.check().is_ok());
        let bad = |f: &dyn Fn(&mut Definition)| {
            let mut d = d.clone();
            f(&mut d);
            d.check().unwrap_err()
        };
        assert!(bad(&|d| d.name = "a@b".into()).contains("schedule name"));
        assert!(bad(&|d| d.name = "x".repeat(101)).contains("schedule name"));
        assert!(bad(&|d| d.queue = String::new()).contains("queue"));
        assert!(bad(&|d| d.body = "b".repeat(MAX_BODY_BYTES + 1)).contains("body"));
        assert!(bad(&|d| d.headers = vec![("x-delay-ms".into(), "1".into())]).contains("reserved"));
        assert!(bad(&|d| d.headers = vec![("CC".into(), "q".into())]).contains("reserved"));
        assert!(bad(&|d| d.tz = "Mars/Olympus".into()).contains("time zone"));
        assert!(bad(&|d| d.cron = "61 * * * *".into()).contains("cron"));
        assert!(
            bad(&|d| {
                d.from_ms = Some(2);
                d.until_ms = Some(1)
            })
            .contains("--until")
        );
    }

    #[test]
    fn an_occurrence_is_named_by_its_schedule_and_tick() {
        assert_eq!(
            occurrence_id("nightly", 1_796_608_800_000),
            "nightly@2026-12-07T02:00:00Z"
        );
        let longest = occurrence_id(&"n".repeat(MAX_NAME_BYTES), u64::MAX / 2);
        assert!(longest.len() <= 255, "{longest}");
    }

    #[test]
    fn definitions_keep_their_wire_form() {
        let d = Definition::new("n", "@hourly", "q", "b");
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(
            json,
            r#"{"name":"n","cron":"@hourly","tz":"UTC","queue":"q","body":"b","misfire":"once"}"#
        );
        let back: Definition =
            serde_json::from_str(r#"{"name":"n","cron":"@hourly","queue":"q","body":"b"}"#)
                .unwrap();
        assert_eq!(back, d);
    }
}
