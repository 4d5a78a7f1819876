//! The ticks of a cron expression in an IANA time zone, pure. `croner` reads the expression
//! and finds the next wall-clock time it matches (asked on a zone-less clock: UTC as a plain
//! calendar); `jiff` and its bundled time-zone database place each wall time on an instant:
//! the first instant whose local time is at or after it. That rule runs a skipped wall time
//! once at the change, a repeated one once on its first pass, and keeps ticks in order.

use chrono::Utc;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::Timestamp;
use jiff::civil::DateTime as Wall;
use jiff::tz::{AmbiguousOffset, Offset, TimeZone};

/// The longest cron expression accepted.
pub const MAX_CRON_BYTES: usize = 255;

/// Wall-clock steps [`Ticks::next_after`] takes at most: one to the match, one past a fold
/// whose first pass is behind, and spares for zones with changes back to back.
const MAX_STEPS: usize = 8;

/// When a cron expression matches, in one time zone.
#[derive(Debug, Clone)]
pub struct Ticks {
    cron: Cron,
    tz: TimeZone,
}

impl Ticks {
    /// The ticks of `expr` (five fields, six with seconds first, or `@hourly`-style names)
    /// read in the IANA zone `tz`; a clear reason when either is not one.
    pub fn new(expr: &str, tz: &str) -> Result<Ticks, String> {
        if expr.len() > MAX_CRON_BYTES {
            return Err(format!(
                "a cron expression is at most {MAX_CRON_BYTES} bytes, not {}",
                expr.len()
            ));
        }
        let tz = TimeZone::get(tz)
            .map_err(|e| format!("no time zone {tz:?} in the IANA database ({e})"))?;
        let cron = parse(expr)?;
        Ok(Ticks { cron, tz })
    }

    /// The first tick strictly after `after_ms` (ms since the epoch), to the second; `None`
    /// when the expression never matches again (or not before the year 9999).
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        let t = Timestamp::from_millisecond(i64::try_from(after_ms).ok()?).ok()?;
        let mut wall = self.tz.to_datetime(t);
        let mut inclusive = false;
        for _ in 0..MAX_STEPS {
            let w = self.next_wall(wall, inclusive)?;
            let at = self.instant(w)?;
            if at > t {
                return u64::try_from(at.as_millisecond()).ok();
            }
            // `t` is in a fold's second pass: the fold's wall times fell on its first
            (wall, inclusive) = match self.fold_end(w) {
                Some(end) => (end, true),
                None => (w, false),
            };
        }
        None
    }

    /// The ticks after `after_ms` up to and including `until_ms`, at most `max`.
    pub fn between(&self, after_ms: u64, until_ms: u64, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = after_ms;
        while out.len() < max {
            match self.next_after(at) {
                Some(next) if next <= until_ms => {
                    out.push(next);
                    at = next;
                }
                _ => break,
            }
        }
        out
    }

    /// The next wall-clock time the expression matches after `w` (or at it, `inclusive`).
    fn next_wall(&self, w: Wall, inclusive: bool) -> Option<Wall> {
        let secs = Offset::UTC.to_timestamp(w).ok()?.as_second();
        let from = chrono::DateTime::<Utc>::from_timestamp(secs, 0)?;
        let next = self.cron.find_next_occurrence(&from, inclusive).ok()?;
        let ts = Timestamp::from_second(next.timestamp()).ok()?;
        Some(Offset::UTC.to_datetime(ts))
    }

    /// The first instant whose local time is at or after `w`.
    fn instant(&self, w: Wall) -> Option<Timestamp> {
        match self.tz.to_ambiguous_timestamp(w).offset() {
            AmbiguousOffset::Unambiguous { offset } => offset.to_timestamp(w).ok(),
            // repeated: its first pass
            AmbiguousOffset::Fold { before, .. } => before.to_timestamp(w).ok(),
            // skipped: the change itself (read with the new offset, `w` falls before it)
            AmbiguousOffset::Gap { after, .. } => {
                let ahead = after.to_timestamp(w).ok()?;
                Some(self.tz.following(ahead).next()?.timestamp())
            }
        }
    }

    /// The first wall time after the fold `w` is in, if it is in one.
    fn fold_end(&self, w: Wall) -> Option<Wall> {
        match self.tz.to_ambiguous_timestamp(w).offset() {
            AmbiguousOffset::Fold { before, .. } => {
                let first = before.to_timestamp(w).ok()?;
                let change = self.tz.following(first).next()?.timestamp();
                // the change read with the old offset: where the repeated wall times end
                Some(before.to_datetime(change))
            }
            _ => None,
        }
    }
}

/// A cron expression: five fields, or six with seconds first, or a name.
fn parse(expr: &str) -> Result<Cron, String> {
    let fields = expr.split_whitespace().count();
    let named = expr.trim_start().starts_with('@');
    if !named && !(5..=6).contains(&fields) {
        return Err(format!(
            "a cron expression has five fields (minute hour day-of-month month day-of-week), \
             or six with seconds first, or is @yearly, @monthly, @weekly, @daily or @hourly: \
             not {expr:?}"
        ));
    }
    let parsed = CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(expr);
    parsed.map_err(|e| format!("not a cron expression {expr:?}: {e}"))
}

/// `ms` as RFC 3339 in UTC to the second (`2026-12-07T02:00:00Z`); past the year 9999, the
/// number of ms.
pub fn rfc3339(ms: u64) -> String {
    i64::try_from(ms / 1000)
        .ok()
        .and_then(|s| Timestamp::from_second(s).ok())
        .map_or_else(|| ms.to_string(), |t| t.to_string())
}

#[cfg(test)]
mod tests;
