//! Times as `pending` takes them, pure: RFC 3339 with any UTC offset
//! (`2026-12-24T18:00:00+01:00`), milliseconds since the epoch (what `send` prints as
//! `due_at`), `now`, or a duration from now (`+10m`, `-1h`, `+1500`).

use amqp_delay::time::parse_duration_ms;

/// `s` as ms since the epoch, relative ones counted from `now_ms`; the error names the value
/// and the forms it takes.
pub fn parse_time(s: &str, now_ms: u64) -> Result<u64, String> {
    let t = s.trim();
    let bad = |why: &str| {
        format!(
            "'{t}' is not a time ({why}): give RFC 3339 (2026-12-24T18:00:00Z, \
             2026-12-24T18:00:00+01:00), ms since the epoch, now, or a duration from now (+10m, -1h)"
        )
    };
    if t == "now" {
        return Ok(now_ms);
    }
    if let Some(d) = t.strip_prefix('+') {
        let d = parse_duration_ms(d).map_err(|e| bad(&e))?;
        return now_ms.checked_add(d).ok_or_else(|| bad("too far off"));
    }
    if let Some(d) = t.strip_prefix('-') {
        let d = parse_duration_ms(d).map_err(|e| bad(&e))?;
        return Ok(now_ms.saturating_sub(d));
    }
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map_err(|_| bad("too large"));
    }
    let dt = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map_err(|e| bad(&e.to_string()))?;
    let ms = dt.unix_timestamp_nanos() / 1_000_000;
    u64::try_from(ms).map_err(|_| bad("before 1970"))
}

/// `ms` since the epoch as RFC 3339 in UTC, to the millisecond.
pub fn format_time(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_reads_and_a_bad_one_says_what_to_give() {
        let now = 1_800_000_000_000;
        assert_eq!(parse_time("now", now), Ok(now));
        assert_eq!(parse_time("+10m", now), Ok(now + 600_000));
        assert_eq!(parse_time("-1h", now), Ok(now - 3_600_000));
        assert_eq!(parse_time("+1500", now), Ok(now + 1_500));
        assert_eq!(parse_time("1796000000000", now), Ok(1_796_000_000_000));
        assert_eq!(
            parse_time("2026-12-24T18:00:00Z", now),
            Ok(1_798_135_200_000)
        );
        assert_eq!(
            parse_time("2026-12-24T19:00:00.250+01:00", now),
            Ok(1_798_135_200_250)
        );
        for bad in [
            "",
            "tomorrow",
            "+",
            "+-3s",
            "2026-12-24",
            "1969-01-01T00:00:00Z",
            "99999999999999999999999",
        ] {
            let e = parse_time(bad, now).unwrap_err();
            assert!(e.contains("RFC 3339"), "{bad}: {e}");
        }
        assert_eq!(format_time(1_798_135_200_250), "2026-12-24T18:00:00.250Z");
    }
}
