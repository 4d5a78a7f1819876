//! Time, pure: [`DurationMs`] (a duration in whole milliseconds, as written in settings and on
//! the command line), parsing and compact printing of durations, and the wall clock in
//! milliseconds since the Unix epoch (the unit of every due time we write).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize};

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A duration in whole milliseconds, written as `1500` (ms), `"1500ms"`, `"30s"`, `"1m30s"`,
/// `"24h"`, `"365d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(into = "String")]
pub struct DurationMs(pub u64);

impl DurationMs {
    /// The duration in milliseconds.
    pub fn as_millis(self) -> u64 {
        self.0
    }

    /// The duration as a [`Duration`], for timers and timeouts.
    pub fn as_duration(self) -> Duration {
        Duration::from_millis(self.0)
    }
}

impl From<DurationMs> for Duration {
    fn from(d: DurationMs) -> Duration {
        d.as_duration()
    }
}

impl From<DurationMs> for String {
    fn from(d: DurationMs) -> String {
        d.to_string()
    }
}

impl fmt::Display for DurationMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&compact_duration(self.0))
    }
}

impl FromStr for DurationMs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration_ms(s).map(DurationMs)
    }
}

impl<'de> Deserialize<'de> for DurationMs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) if n >= 0 => Ok(DurationMs(n as u64)),
            Raw::Int(n) => Err(serde::de::Error::custom(format!(
                "duration must not be negative, got {n}"
            ))),
            Raw::Str(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Parses a delay: a plain integer is milliseconds; otherwise humantime syntax (`1m30s`, `24h`,
/// `500ms`). Negative and sub-millisecond parts are errors.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty duration".into());
    }
    if t.starts_with('-') {
        return Err(format!("negative duration '{t}'"));
    }
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let d = humantime::parse_duration(t).map_err(|e| {
        format!("invalid duration '{t}': {e} (use e.g. 1500, 1500ms, 30s, 1m30s, 24h)")
    })?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!(
            "duration '{t}' has a sub-millisecond part; the finest resolution is 1 ms"
        ));
    }
    u64::try_from(d.as_millis()).map_err(|_| format!("duration '{t}' is too long"))
}

/// `1800000` → `30m`, `86400000` → `24h`, `1500` → `1500ms`.
pub fn compact_duration(ms: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(3_600_000, "h"), (60_000, "m"), (1000, "s")];
    for (size, name) in UNITS {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{name}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration_ms("1500"), Ok(1500));
        assert_eq!(parse_duration_ms("1m30s"), Ok(90_000));
        assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
        assert!(parse_duration_ms("-5s").unwrap_err().contains("negative"));
        assert!(
            parse_duration_ms("soon")
                .unwrap_err()
                .contains("invalid duration 'soon'")
        );
        assert!(
            parse_duration_ms("1us")
                .unwrap_err()
                .contains("sub-millisecond")
        );
    }

    #[test]
    fn compact_durations() {
        assert_eq!(compact_duration(1_800_000), "30m");
        assert_eq!(compact_duration(86_400_000), "24h");
        assert_eq!(compact_duration(1500), "1500ms");
        assert_eq!(DurationMs(30_000).to_string(), "30s");
    }

    #[test]
    fn a_duration_ms_is_a_duration() {
        assert_eq!(
            DurationMs(1_500).as_duration(),
            Duration::from_millis(1_500)
        );
        assert_eq!(Duration::from(DurationMs(0)), Duration::ZERO);
    }
}
