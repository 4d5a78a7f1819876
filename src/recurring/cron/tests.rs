use proptest::prelude::*;

use super::*;

/// ms since the epoch of an RFC 3339 instant.
fn at(s: &str) -> u64 {
    s.parse::<Timestamp>().unwrap().as_millisecond() as u64
}

fn ticks(cron: &str, tz: &str, from: &str, n: usize) -> Vec<String> {
    let t = Ticks::new(cron, tz).unwrap();
    t.between(at(from), u64::MAX, n)
        .into_iter()
        .map(rfc3339)
        .collect()
}

#[test]
fn five_and_six_fields_and_names_tick_in_utc() {
    assert_eq!(
        ticks("0 2 * * *", "UTC", "2026-12-07T01:00:00Z", 2),
        ["2026-12-07T02:00:00Z", "2026-12-08T02:00:00Z"]
    );
    assert_eq!(
        ticks("*/20 * * * * *", "UTC", "2026-12-07T01:00:00.500Z", 3),
        [
            "2026-12-07T01:00:20Z",
            "2026-12-07T01:00:40Z",
            "2026-12-07T01:01:00Z"
        ]
    );
    assert_eq!(
        ticks("@hourly", "UTC", "2026-12-07T01:00:00Z", 2),
        ["2026-12-07T02:00:00Z", "2026-12-07T03:00:00Z"]
    );
    assert_eq!(
        ticks("@daily", "UTC", "2026-12-07T01:00:00Z", 1),
        ["2026-12-08T00:00:00Z"]
    );
    // a tick is strictly after: the instant of a tick itself gives the next
    assert_eq!(
        ticks("0 2 * * *", "UTC", "2026-12-07T02:00:00Z", 1),
        ["2026-12-08T02:00:00Z"]
    );
}

#[test]
fn what_is_no_cron_or_no_zone_is_refused_with_a_reason() {
    for bad in [
        "",
        "* * * *",
        "* * * * * * * *",
        "61 * * * *",
        "@sometimes",
        "a b c d e",
    ] {
        let e = Ticks::new(bad, "UTC").unwrap_err();
        assert!(e.contains("cron"), "{bad:?}: {e}");
    }
    let e = Ticks::new("* * * * *", "Europe/Atlantis").unwrap_err();
    assert!(e.contains("time zone"), "{e}");
    let long = format!("{} * * * *", "0,".repeat(200));
    assert!(Ticks::new(&long, "UTC").unwrap_err().contains("at most"));
}

#[test]
fn in_berlin_the_skipped_hour_runs_once_at_the_change() {
    // 2026-03-29: 02:00 CET becomes 03:00 CEST (01:00 UTC)
    assert_eq!(
        ticks("30 2 * * *", "Europe/Berlin", "2026-03-28T00:00:00Z", 3),
        [
            "2026-03-28T01:30:00Z", // 02:30 CET
            "2026-03-29T01:00:00Z", // 02:30 does not exist: at the change, 03:00 CEST
            "2026-03-30T00:30:00Z", // 02:30 CEST
        ]
    );
    // every quarter: 02:00 to 02:45 do not exist and fall on the change with 03:00: once
    assert_eq!(
        ticks("*/15 * * * *", "Europe/Berlin", "2026-03-29T00:40:00Z", 3),
        [
            "2026-03-29T00:45:00Z",
            "2026-03-29T01:00:00Z",
            "2026-03-29T01:15:00Z"
        ]
    );
}

#[test]
fn in_berlin_the_repeated_hour_runs_once_on_its_first_pass() {
    // 2026-10-25: 03:00 CEST becomes 02:00 CET (01:00 UTC)
    assert_eq!(
        ticks("30 2 * * *", "Europe/Berlin", "2026-10-24T00:00:00Z", 3),
        [
            "2026-10-24T00:30:00Z", // 02:30 CEST
            "2026-10-25T00:30:00Z", // 02:30 CEST, the first pass; not again at 02:30 CET
            "2026-10-26T01:30:00Z", // 02:30 CET
        ]
    );
    assert_eq!(
        ticks("0 * * * *", "Europe/Berlin", "2026-10-24T22:30:00Z", 4),
        [
            "2026-10-24T23:00:00Z", // 01:00 CEST
            "2026-10-25T00:00:00Z", // 02:00 CEST
            "2026-10-25T02:00:00Z", // 03:00 CET: 02:00 CET was 02:00 again
            "2026-10-25T03:00:00Z",
        ]
    );
    // asked during the second pass (02:10 CET): the next tick is past the fold
    assert_eq!(
        ticks("*/15 * * * *", "Europe/Berlin", "2026-10-25T01:10:00Z", 1),
        ["2026-10-25T02:00:00Z"]
    );
}

#[test]
fn a_cron_that_never_matches_has_no_next_tick() {
    let t = Ticks::new("0 0 31 2 *", "UTC").unwrap();
    assert_eq!(t.next_after(at("2026-01-01T00:00:00Z")), None);
    assert_eq!(t.next_after(u64::MAX), None);
}

const ZONES: &[&str] = &[
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe", // a half-hour change
    "Asia/Kathmandu",      // +05:45
    "America/Santiago",    // changes at midnight, southern hemisphere
];
const CRONS: &[&str] = &[
    "*/15 * * * *",
    "30 2 * * *",
    "0 * * * *",
    "0 0 * * *",
    "*/20 * * * * *",
    "45 1,2,3 * * SUN",
    "@hourly",
];

/// 2026 and 2027, where every zone above changes its clocks.
fn instants() -> impl Strategy<Value = u64> {
    at("2026-01-01T00:00:00Z")..at("2028-01-01T00:00:00Z")
}

/// Whether `wall` is a wall time the expression matches.
fn matches(t: &Ticks, wall: Wall) -> bool {
    let secs = Offset::UTC.to_timestamp(wall).unwrap().as_second();
    let dt = chrono::DateTime::<Utc>::from_timestamp(secs, 0).unwrap();
    t.cron.is_time_matching(&dt).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Ticks come in order, none is skipped (any instant between two gives the second), and
    /// each falls on a wall time the expression matches, or on a change of the clocks that
    /// skipped one; no wall time ticks twice.
    #[test]
    fn ticks_are_ordered_complete_and_each_wall_time_runs_once(
        t in instants(), z in 0..ZONES.len(), c in 0..CRONS.len(), frac in 0.0f64..1.0,
    ) {
        let ticks = Ticks::new(CRONS[c], ZONES[z]).unwrap();
        let run = ticks.between(t, u64::MAX, 6);
        prop_assert_eq!(run.len(), 6);
        let mut prev = t;
        let mut walls = std::collections::BTreeSet::new();
        for &n in &run {
            prop_assert!(n > prev && n % 1000 == 0);
            let mid = prev + ((n - prev - 1) as f64 * frac) as u64;
            prop_assert_eq!(ticks.next_after(mid), Some(n), "from {}", rfc3339(mid));
            let ts = Timestamp::from_millisecond(n as i64).unwrap();
            let wall = ticks.tz.to_datetime(ts);
            let changed = ticks.tz.preceding(ts + jiff::SignedDuration::from_secs(1))
                .next()
                .is_some_and(|tr| tr.timestamp() == ts);
            prop_assert!(matches(&ticks, wall) || changed, "{} at {}", CRONS[c], rfc3339(n));
            prop_assert!(walls.insert(wall), "{} twice", wall);
            prev = n;
        }
    }

    /// A wall time the expression matches that the zone has exactly once is a tick.
    #[test]
    fn every_unambiguous_match_is_a_tick(
        t in instants(), z in 0..ZONES.len(), c in 0..CRONS.len(),
    ) {
        let ticks = Ticks::new(CRONS[c], ZONES[z]).unwrap();
        let from = ticks.tz.to_datetime(Timestamp::from_millisecond(t as i64).unwrap());
        let wall = ticks.next_wall(from, false).unwrap();
        let offset = ticks.tz.to_ambiguous_timestamp(wall).offset();
        if let AmbiguousOffset::Unambiguous { offset } = offset {
            let exact = offset.to_timestamp(wall).unwrap().as_millisecond() as u64;
            prop_assume!(exact > t);
            let run = ticks.between(t, exact, 100);
            prop_assert_eq!(run.last(), Some(&exact), "{} missed {}", CRONS[c], wall);
        }
    }
}
