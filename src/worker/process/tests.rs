use super::{believed_headers, prep_lead_ms};
use crate::settings::TrustSettings;
use crate::trust::Trust;
use crate::worker::hold::hold_sleep;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use proptest::prelude::*;

#[test]
fn only_users_of_ours_are_believed_in_more_than_the_schedule_headers() {
    let mut h = FieldTable::default();
    for k in [
        "x-delay-due-at",
        "x-delay-attempt",
        "x-delay-ms",
        "x-delay-batch",
    ] {
        h.insert(k.into(), AMQPValue::LongLongInt(1));
    }
    for k in [
        "x-delay-routing-key",
        "x-delay-user-id",
        "x-delay-owner",
        "app",
    ] {
        h.insert(k.into(), AMQPValue::LongString("forged".into()));
    }
    let props = BasicProperties::default().with_headers(h);
    let trust = Trust::new(
        Some("worker".into()),
        &TrustSettings {
            admins: vec!["admin".into()],
            peers: vec!["gateway".into()],
            ..Default::default()
        },
    );
    let keys = |p: BasicProperties| -> Vec<String> {
        let h = p.headers().clone().unwrap_or_default();
        h.inner().keys().map(|k| k.to_string()).collect()
    };
    for ours in ["worker", "admin", "gateway"] {
        let kept = believed_headers(props.clone(), Some(ours), &trust, "q");
        assert_eq!(kept, props, "{ours}");
    }
    for stranger in [Some("publisher"), None] {
        let kept = keys(believed_headers(props.clone(), stranger, &trust, "q"));
        assert_eq!(
            kept,
            [
                "app",
                "x-delay-attempt",
                "x-delay-batch",
                "x-delay-due-at",
                "x-delay-ms"
            ],
            "{stranger:?}"
        );
    }
}

proptest! {
    /// The hold ends only once the wall clock has reached its target, however the clock
    /// moves while it sleeps (a timer that wakes late, a wall clock that lags the timer or
    /// stands still), and it never sleeps past the target by its own choice.
    #[test]
    fn the_hold_never_ends_before_its_target(
        start in 0u64..1_000_000,
        wait in 0u64..20_000,
        may_skip in any::<bool>(),
        // per wake-up: how far the wall clock moved, in % of the step slept
        drift in proptest::collection::vec(0u64..300, 1..400),
    ) {
        let target = start + wait;
        let mut now = start;
        let mut wakes = drift.iter().cycle();
        let mut slept = 0u32;
        while let Some(step) = hold_sleep(now, target, may_skip) {
            prop_assert!(now < target, "sleeping at {now} for a target of {target}");
            prop_assert!(step >= 1 && step <= target - now);
            prop_assert!(!may_skip || step <= 100);
            let pct = *wakes.next().expect("cycled");
            // a clock that stood still for the whole list moves by the step after it
            let moved = if slept as usize >= drift.len() * 4 { step } else { step * pct / 100 };
            now += moved;
            slept += 1;
            prop_assert!(slept < 100_000, "no end");
        }
        prop_assert!(now >= target, "ended at {now} before {target}");
    }
}

#[test]
fn an_exact_timer_ends_the_hold_on_its_target() {
    // a wall clock that moves exactly as slept: no extra wake-up, no lateness
    for (wait, may_skip, wakes) in [
        (0, false, 0),
        (1, false, 1),
        (250, false, 1),
        (250, true, 3),
    ] {
        let (target, mut now, mut n) = (1_000 + wait, 1_000, 0);
        while let Some(step) = hold_sleep(now, target, may_skip) {
            now += step;
            n += 1;
        }
        assert_eq!(
            (now, n),
            (target, wakes),
            "wait {wait}, may_skip {may_skip}"
        );
    }
}

#[test]
fn a_batch_member_is_prepared_within_half_a_notice_of_its_due_time() {
    // the default notice (1 s): 100 ms ahead
    assert_eq!(prep_lead_ms(1_000), 100);
    // a short notice: its half, so the sync still starts within the notice
    assert_eq!(prep_lead_ms(50), 25);
    assert_eq!(prep_lead_ms(1), 0);
}
