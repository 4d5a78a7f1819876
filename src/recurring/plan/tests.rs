use proptest::prelude::*;

use super::*;
use crate::recurring::rfc3339;

const MIN: u64 = 60_000;
/// 2026-12-07T00:00:00Z
const T0: u64 = 1_796_601_600_000;

fn def(cron: &str, misfire: Misfire) -> (Definition, Ticks) {
    let mut d = Definition::new("n", cron, "q", "b");
    d.misfire = misfire;
    let t = d.check().unwrap();
    (d, t)
}

fn window(now_ms: u64) -> Window {
    Window {
        now_ms,
        ahead_ms: MIN,
        grace_ms: 0,
        max: 1_000,
        max_delay_ms: u64::MAX,
    }
}

fn ticks_of(p: &Plan) -> Vec<String> {
    p.occurrences.iter().map(|o| rfc3339(o.tick_ms)).collect()
}

#[test]
fn a_minute_ahead_or_the_next_tick_whichever_is_later() {
    let (d, t) = def("*/20 * * * * *", Misfire::Once);
    let p = plan(&d, &t, T0, window(T0 + 5_000));
    assert_eq!(
        ticks_of(&p),
        [
            "2026-12-07T00:00:20Z",
            "2026-12-07T00:00:40Z",
            "2026-12-07T00:01:00Z"
        ]
    );
    assert!(!p.missed && p.occurrences.iter().all(|o| o.due_ms == o.tick_ms));
    assert_eq!(p.through_ms, T0 + 5_000 + MIN);
    assert_eq!(p.next_tick_ms, Some(T0 + 80_000));
    // a daily schedule: its next tick, a day ahead
    let (d, t) = def("0 2 * * *", Misfire::Once);
    let p = plan(&d, &t, T0, window(T0 + 5_000));
    assert_eq!(ticks_of(&p), ["2026-12-07T02:00:00Z"]);
    // no further than the topology's longest delay: the rest in a later plan
    let w = Window {
        max_delay_ms: 3_600_000,
        ..window(T0 + 5_000)
    };
    assert!(plan(&d, &t, T0, w).occurrences.is_empty());
    // planned again at once: nothing more
    let again = plan(&d, &t, p.through_ms, window(T0 + 6_000));
    assert!(again.occurrences.is_empty(), "{again:?}");
}

#[test]
fn after_an_outage_once_runs_one_catch_up_and_skip_none() {
    let (d, t) = def("* * * * *", Misfire::Once);
    let now = T0 + 10 * MIN + 30_000;
    let p = plan(&d, &t, T0, window(now));
    assert!(p.missed);
    let first = p.occurrences[0];
    assert!(first.catch_up && first.tick_ms == T0 + MIN && first.due_ms == now);
    assert_eq!(ticks_of(&p)[1..], ["2026-12-07T00:11:00Z"]);
    let (d, t) = def("* * * * *", Misfire::Skip);
    let p = plan(&d, &t, T0, window(now));
    assert!(p.missed);
    assert_eq!(ticks_of(&p), ["2026-12-07T00:11:00Z"]);
    // a tick late by less than the grace runs as itself, at once
    let w = Window {
        grace_ms: MIN,
        ..window(now)
    };
    let p = plan(&d, &t, T0 + 9 * MIN, w);
    assert!(!p.missed);
    assert_eq!(p.occurrences[0].tick_ms, T0 + 10 * MIN);
    assert_eq!(p.occurrences[0].due_ms, now);
}

#[test]
fn from_until_and_max_bound_a_plan() {
    let (mut d, t) = def("*/10 * * * * *", Misfire::Once);
    d.from_ms = Some(T0 + 30_000);
    d.until_ms = Some(T0 + 50_000);
    let p = plan(&d, &t, T0, window(T0));
    assert_eq!(
        ticks_of(&p),
        [
            "2026-12-07T00:00:30Z",
            "2026-12-07T00:00:40Z",
            "2026-12-07T00:00:50Z"
        ]
    );
    assert_eq!(p.next_tick_ms, None, "ended");
    assert!(
        plan(&d, &t, p.through_ms, window(T0 + MIN))
            .occurrences
            .is_empty()
    );
    d.until_ms = None;
    let w = Window {
        max: 2,
        ..window(T0)
    };
    let p = plan(&d, &t, T0, w);
    assert_eq!(p.occurrences.len(), 2);
    assert_eq!(p.through_ms, T0 + 40_000, "the rest in the next plan");
    let p = plan(&d, &t, p.through_ms, w);
    assert_eq!(p.occurrences[0].tick_ms, T0 + 50_000);
    let w = Window {
        max: 0,
        ..window(T0)
    };
    let p = plan(&d, &t, T0, w);
    assert!(
        p.occurrences.is_empty() && p.through_ms < T0 + 30_000,
        "nothing dealt with"
    );
}

proptest! {
    /// A scheduler that plans again within the window each time, from the watermark the last
    /// plan gave, publishes every tick exactly once and each before it is due.
    #[test]
    fn plans_in_turn_publish_every_tick_once_and_never_late(
        steps in proptest::collection::vec(1u64..MIN, 1..40),
        c in 0..3usize,
        max in 1usize..8,
    ) {
        let cron = ["*/7 * * * * *", "* * * * *", "*/3 * * * * *"][c];
        let (d, t) = def(cron, Misfire::Once);
        let mut done = T0;
        let mut now = T0;
        let mut seen = Vec::new();
        for s in steps {
            let p = plan(&d, &t, done, Window { max, ..window(now) });
            prop_assert!(!p.missed);
            for o in &p.occurrences {
                prop_assert!(o.tick_ms >= now && o.due_ms == o.tick_ms);
                seen.push(o.tick_ms);
            }
            prop_assert!(p.through_ms >= done);
            done = p.through_ms;
            // the next plan comes before the earliest tick left is due
            now = (now + s).min(t.next_after(done).unwrap());
        }
        let all = t.between(T0, done, usize::MAX);
        prop_assert_eq!(seen, all);
    }
}
