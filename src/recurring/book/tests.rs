use proptest::prelude::*;

use super::*;
use crate::settings::TrustSettings;

fn trust() -> Trust {
    Trust::new(
        Some("scheduler".into()),
        &TrustSettings {
            admins: vec!["admin".into()],
            peers: vec!["scheduler2".into()],
            ..Default::default()
        },
    )
}

fn add(name: &str, rev: &str, at_ms: u64) -> Add {
    Add {
        rev: rev.into(),
        at_ms,
        schedule: Definition::new(name, "* * * * *", "q", "b"),
    }
}

fn set(name: &str, owner: Option<&str>, action: Action, at_ms: u64) -> Set {
    Set {
        name: name.into(),
        owner: owner.map(Into::into),
        action,
        at_ms,
    }
}

fn mark(owner: &str, name: &str, rev: &str, through_ms: u64) -> Mark {
    Mark {
        owner: owner.into(),
        name: name.into(),
        rev: rev.into(),
        through_ms,
    }
}

#[test]
fn a_schedule_is_its_writers_and_only_it_or_an_admin_steers_it() {
    let t = trust();
    let mut b = Book::default();
    b.add(Some("alice"), &add("n", "r1", 10), &t).unwrap();
    b.add(Some("bob"), &add("n", "r2", 20), &t).unwrap();
    assert_eq!(b.len(), 2, "the same name, two owners");
    assert!(b.add(None, &add("x", "r3", 0), &t).is_err());
    // bob's pause naming alice pauses bob's own
    b.set(Some("bob"), &set("n", Some("alice"), Action::Pause, 30), &t)
        .unwrap();
    assert!(!b.get("alice", "n").unwrap().paused);
    assert!(b.get("bob", "n").unwrap().paused);
    // mallory has none of that name
    assert!(
        b.set(Some("mallory"), &set("n", None, Action::Remove, 30), &t)
            .is_err()
    );
    // an admin steers anyone's
    b.set(
        Some("admin"),
        &set("n", Some("alice"), Action::Pause, 40),
        &t,
    )
    .unwrap();
    assert!(b.get("alice", "n").unwrap().paused);
    let seen: Vec<_> = b
        .visible_to("alice", &t)
        .map(|e| e.owner.as_str())
        .collect();
    assert_eq!(seen, ["alice"]);
    assert_eq!(b.visible_to("admin", &t).count(), 2);
    assert_eq!(b.visible_to("mallory", &t).count(), 0);
}

#[test]
fn resume_runs_nothing_of_the_pause_and_remove_forgets() {
    let t = trust();
    let mut b = Book::default();
    b.add(Some("alice"), &add("n", "r1", 10), &t).unwrap();
    assert_eq!(b.get("alice", "n").unwrap().done_ms(), 10);
    b.set(Some("alice"), &set("n", None, Action::Pause, 100), &t)
        .unwrap();
    b.set(Some("alice"), &set("n", None, Action::Resume, 500), &t)
        .unwrap();
    let e = b.get("alice", "n").unwrap();
    assert!(!e.paused && e.done_ms() == 500);
    b.set(Some("alice"), &set("n", None, Action::Remove, 600), &t)
        .unwrap();
    assert!(b.is_empty());
}

#[test]
fn marks_and_keeps_count_only_from_the_owner_or_a_scheduler_and_for_their_revision() {
    let t = trust();
    let mut b = Book::default();
    b.add(Some("alice"), &add("n", "r1", 10), &t).unwrap();
    assert!(
        b.mark(Some("bob"), &mark("alice", "n", "r1", 99), &t)
            .is_err()
    );
    b.mark(Some("alice"), &mark("alice", "n", "r1", 5), &t)
        .unwrap();
    b.mark(Some("scheduler2"), &mark("alice", "n", "r1", 50), &t)
        .unwrap();
    b.mark(Some("scheduler"), &mark("alice", "n", "r1", 40), &t)
        .unwrap();
    assert_eq!(
        b.get("alice", "n").unwrap().through_ms,
        Some(50),
        "never back"
    );
    // replaced: the old revision's marks no longer count, nor its keeps
    b.add(Some("alice"), &add("n", "r2", 60), &t).unwrap();
    let old = Keep {
        through_ms: Some(1_000),
        ..b.get("alice", "n").unwrap().keep()
    };
    assert!(
        b.mark(Some("scheduler"), &mark("alice", "n", "r1", 70), &t)
            .is_err()
    );
    let stale = Keep {
        rev: "r1".into(),
        ..old.clone()
    };
    assert!(b.keep(Some("scheduler"), &stale, &t).is_err());
    let e = b.get("alice", "n").unwrap();
    assert_eq!(
        (e.rev.as_str(), e.through_ms, e.done_ms()),
        ("r2", None, 60)
    );
    // a keep of the live revision takes only its mark
    b.keep(Some("scheduler"), &old, &t).unwrap();
    assert_eq!(b.get("alice", "n").unwrap().through_ms, Some(1_000));
    // a stream that no longer holds the add: the keep brings the schedule back as it was
    let mut fresh = Book::default();
    let paused = Keep {
        paused: true,
        ..old.clone()
    };
    assert!(fresh.keep(Some("mallory"), &paused, &t).is_err());
    fresh.keep(Some("scheduler"), &paused, &t).unwrap();
    let e = fresh.get("alice", "n").unwrap();
    assert!(e.paused && e.owner == "alice" && e.done_ms() == 1_000);
    // removed: no keep brings it back
    fresh
        .set(Some("alice"), &set("n", None, Action::Remove, 0), &t)
        .unwrap();
    assert!(fresh.keep(Some("scheduler"), &old, &t).is_err());
    assert!(fresh.is_empty());
}

#[test]
fn an_owner_and_the_admins_are_capped() {
    let t = trust();
    let mut b = Book::default();
    for i in 0..MAX_PER_OWNER {
        b.add(
            Some("alice"),
            &add(&format!("n{i}"), &format!("r{i}"), 0),
            &t,
        )
        .unwrap();
    }
    let e = b
        .add(Some("alice"), &add("one-more", "x", 0), &t)
        .unwrap_err();
    assert!(e.contains("the most a user may"), "{e}");
    // a replace is no new schedule
    b.add(Some("alice"), &add("n0", "r0b", 0), &t).unwrap();
    b.add(Some("admin"), &add("one-more", "y", 0), &t).unwrap();
    b.set(Some("alice"), &set("n1", None, Action::Remove, 0), &t)
        .unwrap();
    b.add(Some("alice"), &add("one-more", "z", 0), &t).unwrap();
    assert_eq!(b.len(), MAX_PER_OWNER + 1);
}

#[test]
fn tenants_at_their_caps_crowd_out_no_one() {
    // 21 tenants of 10 000 each hold more than the 200 000 all shared before: the 22nd and
    // the admins still add
    let t = Trust::new(
        Some("scheduler".into()),
        &TrustSettings {
            admins: vec!["admin".into()],
            max_schedules_per_user: 10_000,
            ..Default::default()
        },
    );
    let mut b = Book::default();
    for u in 0..21 {
        let user = format!("tenant{u}");
        for i in 0..10_000 {
            b.add(
                Some(&user),
                &add(&format!("n{i}"), &format!("{user}-{i}"), 0),
                &t,
            )
            .unwrap();
        }
        assert!(b.admits(&user, "one-more", &t).is_err());
    }
    assert_eq!(b.len(), 210_000);
    b.add(Some("latecomer"), &add("n", "late", 0), &t).unwrap();
    b.add(Some("admin"), &add("n", "adm", 0), &t).unwrap();
    assert_eq!(b.len(), 210_002);
}

#[test]
fn another_tenants_churn_never_brings_a_removed_schedule_back() {
    let t = Trust::new(
        Some("scheduler".into()),
        &TrustSettings {
            max_schedules_per_user: 3,
            ..Default::default()
        },
    );
    let mut b = Book::default();
    b.add(Some("alice"), &add("n", "ra", 0), &t).unwrap();
    let kept = b.get("alice", "n").unwrap().keep();
    b.set(Some("alice"), &set("n", None, Action::Remove, 1), &t)
        .unwrap();
    // mallory adds and removes far more than any one owner's remembered removals
    for i in 0..100 {
        b.add(Some("mallory"), &add("m", &format!("m{i}"), 0), &t)
            .unwrap();
        b.set(Some("mallory"), &set("m", None, Action::Remove, 1), &t)
            .unwrap();
    }
    let e = b.keep(Some("scheduler"), &kept, &t).unwrap_err();
    assert!(e.contains("removed or replaced"), "{e}");
    assert!(b.get("alice", "n").is_none());
}

#[test]
fn a_book_of_one_owner_keeps_nothing_of_anyone_else() {
    let t = trust();
    let mut b = Book::of_owner("alice");
    b.add(Some("alice"), &add("a", "ra", 0), &t).unwrap();
    b.add(Some("bob"), &add("b", "rb", 0), &t).unwrap();
    b.set(Some("bob"), &set("b", None, Action::Pause, 1), &t)
        .unwrap();
    // an admin's pause of alice's counts; of bob's, not here
    b.set(
        Some("admin"),
        &set("a", Some("alice"), Action::Pause, 1),
        &t,
    )
    .unwrap();
    b.marks(
        Some("scheduler"),
        &Marks::of("bob", &[("rb".into(), 9)], 99)[0],
        &t,
    )
    .unwrap();
    assert_eq!(b.len(), 1);
    assert!(b.get("alice", "a").unwrap().paused);
    assert!(b.keeps("alice") && !b.keeps("bob"));
    assert!(Book::default().keeps("bob"));
}

#[test]
fn the_per_user_cap_is_a_setting() {
    let t = Trust::new(
        Some("scheduler".into()),
        &TrustSettings {
            max_schedules_per_user: 2,
            ..Default::default()
        },
    );
    let mut b = Book::default();
    b.add(Some("alice"), &add("a", "r1", 0), &t).unwrap();
    b.add(Some("alice"), &add("b", "r2", 0), &t).unwrap();
    // what an add is told before it writes is what the fold does with it
    let told = b.admits("alice", "c", &t).unwrap_err();
    let e = b.add(Some("alice"), &add("c", "r3", 0), &t).unwrap_err();
    assert_eq!(told, e);
    assert!(e.contains("trust.max_schedules_per_user"), "{e}");
    // a replacement of one she has is no new schedule
    b.admits("alice", "a", &t).unwrap();
    // another user is not crowded out
    b.add(Some("bob"), &add("a", "r4", 0), &t).unwrap();
    assert_eq!(b.len(), 3);
}

#[test]
fn a_round_of_marks_is_one_record_believed_as_a_mark() {
    let t = trust();
    let mut b = Book::default();
    b.add(Some("alice"), &add("a", "ra", 0), &t).unwrap();
    b.add(Some("alice"), &add("b", "rb", 0), &t).unwrap();
    b.add(Some("bob"), &add("c", "rc", 0), &t).unwrap();
    let marks = [("ra".to_string(), 60_000), ("rb".to_string(), 120_000)];
    let records = Marks::of("alice", &marks, 1 << 20);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].groups.len(), 2);
    // only alice or a scheduler marks alice's
    assert!(b.marks(Some("mallory"), &records[0], &t).is_err());
    assert_eq!(b.get("alice", "a").unwrap().through_ms, None);
    b.marks(Some("alice"), &records[0], &t).unwrap();
    assert_eq!(b.get("alice", "a").unwrap().through_ms, Some(60_000));
    assert_eq!(b.get("alice", "b").unwrap().through_ms, Some(120_000));
    // bob's revision named as alice's marks nothing of bob's
    let e = b
        .marks(
            Some("scheduler"),
            &Marks::of("alice", &[("rc".into(), 9)], 99)[0],
            &t,
        )
        .unwrap_err();
    assert!(e.contains("1 revisions"), "{e}");
    assert_eq!(b.get("bob", "c").unwrap().through_ms, None);
    // a replaced revision takes no mark; its replacement does
    b.add(Some("alice"), &add("a", "ra2", 0), &t).unwrap();
    assert!(
        b.marks(Some("alice"), &Marks::of("alice", &marks[..1], 99)[0], &t)
            .is_err()
    );
    assert_eq!(b.get("alice", "a").unwrap().through_ms, None);
    let again = Marks::of("alice", &[("ra2".into(), 5)], 99);
    b.marks(Some("alice"), &again[0], &t).unwrap();
    assert_eq!(b.get("alice", "a").unwrap().through_ms, Some(5));
    // removed: forgotten
    b.set(Some("alice"), &set("a", None, Action::Remove, 0), &t)
        .unwrap();
    assert!(b.marks(Some("alice"), &again[0], &t).is_err());
}

#[test]
fn marks_are_split_by_bytes() {
    let marks: Vec<(String, u64)> = (0..1000)
        .map(|i| (format!("{i:036}"), 1_000 * (i % 3)))
        .collect();
    let records = Marks::of("alice", &marks, 4_000);
    assert!(records.len() >= 10, "{}", records.len());
    let mut seen = 0;
    for r in &records {
        let bytes = serde_json::to_vec(r).unwrap().len();
        assert!(bytes <= 4_000 + 100, "{bytes}");
        for g in &r.groups {
            seen += g.revs.len();
        }
    }
    assert_eq!(seen, 1000);
}

proptest! {
    /// Whatever records arrive, from whomever, a user's schedules are only those it added,
    /// and nothing panics.
    #[test]
    fn a_users_schedules_are_those_it_added(
        ops in proptest::collection::vec((0..4u8, 0..4usize, 0..3usize, 0..3usize, 0..5u64), 0..60),
    ) {
        let t = trust();
        let users = ["alice", "bob", "admin", "scheduler"];
        let names = ["a", "b", "c"];
        let mut b = Book::default();
        let mut added: HashSet<(String, String)> = HashSet::new();
        for (i, (kind, u, n, o, at)) in ops.into_iter().enumerate() {
            let (by, name, other) = (users[u], names[n], users[o]);
            let _ = match kind {
                0 => b.add(Some(by), &add(name, &format!("r{i}"), at), &t).map(|_| {
                    added.insert((by.into(), name.into()));
                }),
                1 => b.set(Some(by), &set(name, Some(other), Action::Pause, at), &t),
                2 => b.set(Some(by), &set(name, Some(other), Action::Remove, at), &t),
                _ => b.mark(Some(by), &mark(other, name, &format!("r{at}"), at), &t),
            };
        }
        for e in b.iter() {
            prop_assert!(added.contains(&(e.owner.clone(), e.def.name.clone())));
        }
    }
}

#[test]
fn pages_walk_what_a_user_sees_in_order_and_say_whether_more_follow() {
    let t = Trust::new(
        Some("scheduler".into()),
        &TrustSettings {
            admins: vec!["adm".into()],
            ..Default::default()
        },
    );
    let mut b = Book::default();
    for (who, name, rev) in [
        ("alice", "a", "r1"),
        ("alice", "b", "r2"),
        ("alice", "c", "r3"),
        ("bob", "a", "r4"),
        ("carol", "z", "r5"),
    ] {
        b.add(Some(who), &add(name, rev, 0), &t).unwrap();
    }
    let names = |p: &[&Entry]| {
        p.iter()
            .map(|e| format!("{}/{}", e.owner, e.def.name))
            .collect::<Vec<_>>()
    };
    let (p, more) = b.page("alice", &t, None, 2);
    assert_eq!(
        (names(&p), more),
        (vec!["alice/a".into(), "alice/b".into()], true)
    );
    let (p, more) = b.page("alice", &t, Some(("alice", "b")), 2);
    assert_eq!((names(&p), more), (vec!["alice/c".to_string()], false));
    // a cursor elsewhere never shows another owner's
    assert!(b.page("bob", &t, Some(("alice", "z")), 10).0.len() == 1);
    assert!(b.page("bob", &t, Some(("carol", "a")), 10).0.is_empty());
    // an admin walks everyone's, across owners
    let (p, more) = b.page("adm", &t, Some(("alice", "c")), 10);
    assert_eq!(
        (names(&p), more),
        (vec!["bob/a".into(), "carol/z".into()], false)
    );
    let (all, _) = b.page("adm", &t, None, 100);
    assert_eq!(all.len(), 5);
}
