use super::paging::bind;
use super::read::ROW_COLUMNS;
use super::*;

use std::collections::BTreeSet;
use std::path::PathBuf;

use rusqlite::Connection;

use proptest::prelude::*;

/// A fresh index file in a directory of its own, removed on drop.
struct Temp {
    dir: PathBuf,
}

impl Temp {
    fn new() -> Temp {
        let dir = std::env::temp_dir().join(format!(
            "pending-index-test-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Temp { dir }
    }

    fn open(&self) -> PendingIndex {
        self.open_with(Options::default())
    }

    fn open_with(&self, o: Options) -> PendingIndex {
        PendingIndex::open(&self.dir.join("index.db"), o).unwrap()
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn q(name: &str) -> Destination {
    Destination::Queue(name.into())
}

fn sched(owner: &str, id: &str, queue: &str, due: u64) -> Scheduled {
    Scheduled {
        id: id.into(),
        owner: owner.into(),
        destination: q(queue),
        due_at_ms: due,
        scheduled_at_ms: 1_000,
        size: 10,
        content_type: Some("application/json".into()),
        headers: vec![("tenant".into(), "t1".into())],
        body: None,
        confirmed: true,
    }
}

fn put(ix: &mut PendingIndex, owner: &str, id: &str, queue: &str, due: u64) {
    ix.apply(&[Entry::Scheduled(sched(owner, id, queue, due))])
        .unwrap();
}

fn user(u: &str) -> Viewer {
    Viewer::User(u.into())
}

fn ids(p: &Page) -> Vec<String> {
    p.rows.iter().map(|r| r.id.clone()).collect()
}

/// Every row `f` covers, page by page.
fn all_pages(ix: &mut PendingIndex, f: &Filter) -> Vec<Row> {
    let mut f = f.clone();
    let mut out = Vec::new();
    loop {
        let p = ix.list(&f).unwrap();
        out.extend(p.rows);
        match p.next {
            Some(c) => f.after = Some(c),
            None => return out,
        }
    }
}

#[test]
fn a_scheduled_message_shows_with_every_field_and_its_first_event() {
    let t = Temp::new();
    let mut ix = t.open();
    let mut s = sched(
        "alice",
        "01890a5d-ac96-774b-bcce-b302099a8057",
        "orders",
        5_000,
    );
    s.destination = Destination::Exchange {
        exchange: "target".into(),
        routing_key: "a.b".into(),
    };
    s.body = Some(b"{\"order\":42}".to_vec());
    s.headers = vec![("tenant".into(), "t1".into()), ("k".into(), "v".into())];
    ix.apply(&[Entry::Scheduled(s.clone())]).unwrap();
    let got = ix.show(&s.id, &user("alice")).unwrap();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.row.id, s.id);
    assert_eq!(r.row.owner, "alice");
    assert_eq!(r.row.destination, s.destination);
    assert_eq!(r.row.due_at_ms, 5_000);
    assert_eq!(r.row.scheduled_at_ms, 1_000);
    assert_eq!(r.row.size, 10);
    assert_eq!(r.row.content_type.as_deref(), Some("application/json"));
    assert_eq!(r.row.headers, s.headers);
    assert_eq!(r.row.state, State::Pending);
    assert!(r.row.body_kept);
    assert_eq!(r.body, s.body);
    assert_eq!(
        r.history,
        vec![Event::Scheduled {
            at_ms: 1_000,
            due_at_ms: 5_000
        }]
    );
}

#[test]
fn a_user_sees_only_its_own_and_an_admin_sees_all() {
    let t = Temp::new();
    let mut ix = t.open();
    put(&mut ix, "alice", "same", "orders", 5_000);
    put(&mut ix, "bob", "same", "orders", 6_000);
    put(&mut ix, "bob", "bobs", "orders", 7_000);

    let a = ix.show("same", &user("alice")).unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].row.owner, "alice");
    assert!(ix.show("bobs", &user("alice")).unwrap().is_empty());
    assert!(ix.show("same", &user("mallory")).unwrap().is_empty());
    let all = ix.show("same", &Viewer::Admin).unwrap();
    assert_eq!(
        all.iter().map(|r| r.row.owner.as_str()).collect::<Vec<_>>(),
        ["alice", "bob"]
    );

    let mut f = Filter::new(user("alice"));
    f.destination = Some(q("orders"));
    assert_eq!(ids(&ix.list(&f).unwrap()), ["same"]);
    assert_eq!(ix.count(&f).unwrap(), 1);
    f.viewer = user("bob");
    assert_eq!(ids(&ix.list(&f).unwrap()), ["same", "bobs"]);
    f.viewer = user("mallory");
    assert!(ix.list(&f).unwrap().rows.is_empty());
    assert_eq!(ix.count(&f).unwrap(), 0);
    f.viewer = Viewer::Admin;
    assert_eq!(ix.list(&f).unwrap().rows.len(), 3);
    assert_eq!(ix.count(&f).unwrap(), 3);
    // without a queue: the owner's index and the due index
    let mut f = Filter::new(user("bob"));
    assert_eq!(ix.count(&f).unwrap(), 2);
    f.viewer = Viewer::Admin;
    assert_eq!(ix.count(&f).unwrap(), 3);
    // header filters apply the viewer too
    f.viewer = user("alice");
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ids(&ix.list(&f).unwrap()), ["same"]);
    assert_eq!(ix.count(&f).unwrap(), 1);
}

#[test]
fn a_cancel_by_a_user_stops_only_its_own_and_an_admins_stops_every_owners() {
    let t = Temp::new();
    let mut ix = t.open();
    put(&mut ix, "alice", "x", "orders", 5_000);
    put(&mut ix, "bob", "x", "orders", 5_000);
    ix.apply(&[Entry::Cancelled {
        owner: Some("alice".into()),
        id: "x".into(),
        by: "alice".into(),
        at_ms: 2_000,
    }])
    .unwrap();
    let states = |ix: &mut PendingIndex| {
        ix.show("x", &Viewer::Admin)
            .unwrap()
            .iter()
            .map(|r| r.row.state)
            .collect::<Vec<_>>()
    };
    assert_eq!(states(&mut ix), [State::Cancelled, State::Pending]);
    let a = &ix.show("x", &user("alice")).unwrap()[0];
    assert_eq!(
        a.history[1],
        Event::Cancelled {
            at_ms: 2_000,
            by: "alice".into()
        }
    );
    ix.apply(&[Entry::Cancelled {
        owner: None,
        id: "x".into(),
        by: "root".into(),
        at_ms: 3_000,
    }])
    .unwrap();
    assert_eq!(states(&mut ix), [State::Cancelled, State::Cancelled]);
    assert_eq!(ix.count(&Filter::new(Viewer::Admin)).unwrap(), 0);
    // nothing twice: alice's record has one cancel only
    assert_eq!(ix.show("x", &user("alice")).unwrap()[0].history.len(), 2);
}

#[test]
fn runs_reschedules_and_confirms_make_the_history_and_move_the_row() {
    let t = Temp::new();
    let mut ix = t.open();
    let mut s = sched("alice", "m", "orders", 5_000);
    s.confirmed = false;
    ix.apply(&[Entry::Scheduled(s.clone())]).unwrap();
    let f = Filter::new(user("alice"));
    assert_eq!(ix.list(&f).unwrap().rows[0].state, State::Unconfirmed);
    ix.apply(&[
        Entry::Confirmed {
            owner: "alice".into(),
            id: "m".into(),
        },
        Entry::Rescheduled {
            owner: Some("alice".into()),
            id: "m".into(),
            due_at_ms: 9_000,
            by: "alice".into(),
            at_ms: 2_000,
        },
    ])
    .unwrap();
    let r = &ix.list(&f).unwrap().rows[0];
    assert_eq!((r.state, r.due_at_ms), (State::Pending, 9_000));
    ix.apply(&[Entry::Ran {
        owner: "alice".into(),
        id: "m".into(),
        at_ms: 9_010,
        lateness_ms: 10,
        outcome: Outcome::Retried {
            next_due_at_ms: 10_000,
        },
    }])
    .unwrap();
    let r = &ix.list(&f).unwrap().rows[0];
    assert_eq!((r.state, r.due_at_ms), (State::Pending, 10_000));
    // the header index follows the due time
    let mut fh = f.clone();
    fh.header = Some(("tenant".into(), "t1".into()));
    fh.due_after = Some(9_500);
    assert_eq!(ix.list(&fh).unwrap().rows.len(), 1);
    let done = Entry::Ran {
        owner: "alice".into(),
        id: "m".into(),
        at_ms: 10_003,
        lateness_ms: 3,
        outcome: Outcome::Done,
    };
    ix.apply(&[done.clone(), done]).unwrap();
    assert!(ix.list(&f).unwrap().rows.is_empty());
    assert!(ix.list(&fh).unwrap().rows.is_empty());
    let rec = &ix.show("m", &user("alice")).unwrap()[0];
    assert_eq!(rec.row.state, State::Done);
    assert_eq!(
        rec.history,
        vec![
            Event::Scheduled {
                at_ms: 1_000,
                due_at_ms: 5_000
            },
            Event::Rescheduled {
                at_ms: 2_000,
                by: "alice".into(),
                from_due_at_ms: 5_000,
                to_due_at_ms: 9_000
            },
            Event::Ran {
                at_ms: 9_010,
                lateness_ms: 10,
                outcome: Outcome::Retried {
                    next_due_at_ms: 10_000
                }
            },
            Event::Ran {
                at_ms: 10_003,
                lateness_ms: 3,
                outcome: Outcome::Done
            },
        ]
    );
    // too late: a cancel or a reschedule of what ran changes nothing
    ix.apply(&[
        Entry::Cancelled {
            owner: Some("alice".into()),
            id: "m".into(),
            by: "alice".into(),
            at_ms: 11_000,
        },
        Entry::Rescheduled {
            owner: Some("alice".into()),
            id: "m".into(),
            due_at_ms: 20_000,
            by: "alice".into(),
            at_ms: 11_000,
        },
    ])
    .unwrap();
    assert_eq!(ix.show("m", &user("alice")).unwrap()[0].history.len(), 4);
}

#[test]
fn a_replayed_schedule_changes_nothing_and_a_new_one_keeps_both_in_the_history() {
    let t = Temp::new();
    let mut ix = t.open();
    let s = sched("alice", "m", "orders", 5_000);
    ix.apply(&[Entry::Scheduled(s.clone())]).unwrap();
    ix.apply(&[
        Entry::Ran {
            owner: "alice".into(),
            id: "m".into(),
            at_ms: 5_001,
            lateness_ms: 1,
            outcome: Outcome::Done,
        },
        Entry::Scheduled(s.clone()),
    ])
    .unwrap();
    assert_eq!(
        ix.show("m", &user("alice")).unwrap()[0].row.state,
        State::Done
    );
    let mut again = s.clone();
    again.scheduled_at_ms = 6_000;
    again.due_at_ms = 8_000;
    again.destination = q("other");
    ix.apply(&[Entry::Scheduled(again)]).unwrap();
    let rec = &ix.show("m", &user("alice")).unwrap()[0];
    assert_eq!(rec.row.state, State::Pending);
    assert_eq!(rec.row.destination, q("other"));
    assert_eq!(
        rec.history,
        vec![
            Event::Scheduled {
                at_ms: 1_000,
                due_at_ms: 5_000
            },
            Event::Ran {
                at_ms: 5_001,
                lateness_ms: 1,
                outcome: Outcome::Done
            },
            Event::Scheduled {
                at_ms: 6_000,
                due_at_ms: 8_000
            },
        ]
    );
    let mut f = Filter::new(Viewer::Admin);
    f.destination = Some(q("orders"));
    assert_eq!(ix.count(&f).unwrap(), 0);
    f.destination = Some(q("other"));
    assert_eq!(ix.count(&f).unwrap(), 1);
}

#[test]
fn parked_messages_leave_pending_and_are_listed_as_parked() {
    let t = Temp::new();
    let mut ix = t.open();
    put(&mut ix, "alice", "p", "orders", 5_000);
    ix.apply(&[Entry::Ran {
        owner: "alice".into(),
        id: "p".into(),
        at_ms: 5_000,
        lateness_ms: 0,
        outcome: Outcome::Parked,
    }])
    .unwrap();
    let mut f = Filter::new(user("alice"));
    assert!(ix.list(&f).unwrap().rows.is_empty());
    f.listing = Listing::Parked;
    assert_eq!(ids(&ix.list(&f).unwrap()), ["p"]);
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ids(&ix.list(&f).unwrap()), ["p"]);
    assert_eq!(ix.count(&f).unwrap(), 1);
    f.header = Some(("tenant".into(), "t2".into()));
    assert_eq!(ix.count(&f).unwrap(), 0);
    // parked outlives the history window
    assert_eq!(ix.expire(0, 1_000_000).unwrap(), 0);
}

#[test]
fn filters_narrow_by_queue_due_time_and_header() {
    let t = Temp::new();
    let mut ix = t.open();
    let mut entries = Vec::new();
    for i in 0..40u64 {
        let mut s = sched(
            "alice",
            &format!("m{i:02}"),
            ["a", "b"][(i % 2) as usize],
            1_000 + i,
        );
        s.headers = vec![("tenant".into(), format!("t{}", i % 4))];
        entries.push(Entry::Scheduled(s));
    }
    ix.apply(&entries).unwrap();
    let mut f = Filter::new(Viewer::Admin);
    f.limit = 1_000;
    f.destination = Some(q("a"));
    assert_eq!(ix.count(&f).unwrap(), 20);
    f.due_after = Some(1_009);
    f.due_before = Some(1_020);
    // a, due 1010..1019: even i from 10 to 18
    assert_eq!(
        ids(&ix.list(&f).unwrap()),
        ["m10", "m12", "m14", "m16", "m18"]
    );
    assert_eq!(ix.count(&f).unwrap(), 5);
    f.header = Some(("tenant".into(), "t2".into()));
    assert_eq!(ids(&ix.list(&f).unwrap()), ["m10", "m14", "m18"]);
    assert_eq!(ix.count(&f).unwrap(), 3);
    f.destination = None;
    f.due_after = None;
    f.due_before = None;
    assert_eq!(ix.count(&f).unwrap(), 10);
    f.header = Some(("tenant".into(), "nobody".into()));
    assert_eq!(ix.count(&f).unwrap(), 0);
    f.destination = Some(q("never-seen"));
    f.header = None;
    assert!(ix.list(&f).unwrap().rows.is_empty());
    assert_eq!(ix.count(&f).unwrap(), 0);
}

#[test]
fn a_header_that_is_not_indexed_is_still_filtered_right() {
    let t = Temp::new();
    let mut ix = t.open_with(Options {
        indexed_headers: Some(vec!["tenant".into()]),
        ..Options::default()
    });
    for i in 0..10u64 {
        let mut s = sched("alice", &format!("m{i}"), "a", 1_000 + i);
        s.headers = vec![
            ("tenant".into(), "t".into()),
            ("kind".into(), format!("k{}", i % 2)),
        ];
        ix.apply(&[Entry::Scheduled(s)]).unwrap();
    }
    let mut f = Filter::new(Viewer::Admin);
    f.header = Some(("kind".into(), "k1".into()));
    assert_eq!(ids(&ix.list(&f).unwrap()), ["m1", "m3", "m5", "m7", "m9"]);
    assert_eq!(ix.count(&f).unwrap(), 5);
    f.header = Some(("tenant".into(), "t".into()));
    assert_eq!(ix.count(&f).unwrap(), 10);
}

#[test]
fn bad_input_gets_a_clear_error() {
    let t = Temp::new();
    let mut ix = t.open();
    let long = "x".repeat(256);
    for (s, want) in [
        (sched("alice", "", "a", 1), "1 to 255 bytes"),
        (sched("alice", &long, "a", 1), "1 to 255 bytes"),
        (sched("", "m", "a", 1), "owner is empty"),
        (sched("alice", "m", "", 1), "no destination"),
        (sched("alice", "m", "a", u64::MAX), "past any real time"),
    ] {
        let e = ix.apply(&[Entry::Scheduled(s)]).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    let mut f = Filter::new(Viewer::Admin);
    f.limit = 0;
    assert!(ix.list(&f).unwrap_err().to_string().contains("1 to"));
    f.limit = 10;
    f.due_after = Some(10);
    f.due_before = Some(10);
    assert!(ix.list(&f).unwrap_err().to_string().contains("before"));
    f.due_before = None;
    f.header = Some((String::new(), "v".into()));
    assert!(ix.count(&f).unwrap_err().to_string().contains("name"));
    assert!(ix.show("", &Viewer::Admin).is_err());
    // a failed batch leaves nothing behind, names included
    let ok = sched("alice", "fine", "new-queue", 5);
    let bad = sched("alice", "", "a", 1);
    assert!(
        ix.apply(&[Entry::Scheduled(ok.clone()), Entry::Scheduled(bad)])
            .is_err()
    );
    assert!(ix.show("fine", &Viewer::Admin).unwrap().is_empty());
    ix.apply(&[Entry::Scheduled(ok)]).unwrap();
    let mut f = Filter::new(Viewer::Admin);
    f.destination = Some(q("new-queue"));
    assert_eq!(ix.count(&f).unwrap(), 1);
}

#[test]
fn the_position_commits_with_its_entries_and_survives_a_reopen() {
    let t = Temp::new();
    {
        let mut ix = t.open();
        assert_eq!(ix.position().unwrap(), None);
        ix.apply_at(&[Entry::Scheduled(sched("alice", "m", "a", 5))], 41)
            .unwrap();
        assert!(
            ix.apply_at(&[Entry::Scheduled(sched("alice", "", "a", 5))], 42)
                .is_err()
        );
        assert_eq!(ix.position().unwrap(), Some(41));
        ix.set_position(50).unwrap();
    }
    let mut ix = t.open();
    assert_eq!(ix.position().unwrap(), Some(50));
    assert_eq!(ix.show("m", &user("alice")).unwrap().len(), 1);
}

#[test]
fn expire_removes_what_finished_before_the_window_and_stale_intents() {
    let t = Temp::new();
    let mut ix = t.open();
    for (id, due) in [("old", 1_000), ("recent", 1_000), ("waiting", 50_000)] {
        put(&mut ix, "alice", id, "a", due);
    }
    let mut intent = sched("alice", "never-confirmed", "a", 2_000);
    intent.confirmed = false;
    ix.apply(&[
        Entry::Scheduled(intent),
        Entry::Ran {
            owner: "alice".into(),
            id: "old".into(),
            at_ms: 1_000,
            lateness_ms: 0,
            outcome: Outcome::Done,
        },
        Entry::Cancelled {
            owner: Some("alice".into()),
            id: "recent".into(),
            by: "alice".into(),
            at_ms: 9_000,
        },
    ])
    .unwrap();
    assert_eq!(ix.expire(5_000, 10_000).unwrap(), 2);
    let left: Vec<String> = ["old", "recent", "waiting", "never-confirmed"]
        .into_iter()
        .filter(|id| !ix.show(id, &Viewer::Admin).unwrap().is_empty())
        .map(String::from)
        .collect();
    assert_eq!(left, ["recent", "waiting"]);
    let mut f = Filter::new(Viewer::Admin);
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ix.count(&f).unwrap(), 1);
}

#[test]
fn a_schema_of_another_version_is_refused_with_what_to_do() {
    let t = Temp::new();
    drop(t.open());
    let c = Connection::open(t.dir.join("index.db")).unwrap();
    c.execute_batch("PRAGMA user_version = 99").unwrap();
    drop(c);
    let e = PendingIndex::open(&t.dir.join("index.db"), Options::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("rebuild from the journal"), "{e}");
}

/// The layout the index had before its schema lived in migrations, as that version wrote it.
const UNVERSIONED_LAYOUT: &str = "
CREATE TABLE names (nid INTEGER PRIMARY KEY, kind INTEGER NOT NULL, a TEXT NOT NULL,
    b TEXT NOT NULL, UNIQUE (kind, a, b));
CREATE TABLE records (rk INTEGER PRIMARY KEY, own INTEGER NOT NULL, id ANY NOT NULL,
    dest INTEGER NOT NULL, due INTEGER NOT NULL, sched INTEGER NOT NULL, size INTEGER NOT NULL,
    ctype INTEGER, state INTEGER NOT NULL, lst INTEGER, fin INTEGER, nev INTEGER NOT NULL,
    hdrs BLOB, body BLOB);
CREATE UNIQUE INDEX by_id ON records (own, id);
CREATE INDEX by_fin ON records (fin) WHERE fin IS NOT NULL;
CREATE INDEX by_unconfirmed ON records (due) WHERE state = 0;
CREATE TABLE hdr (h INTEGER NOT NULL, due INTEGER NOT NULL, own INTEGER NOT NULL,
    rk INTEGER NOT NULL, dest INTEGER NOT NULL, PRIMARY KEY (h, due, own, rk)) WITHOUT ROWID;
CREATE TABLE history (rk INTEGER NOT NULL, n INTEGER NOT NULL, kind INTEGER NOT NULL,
    at INTEGER NOT NULL, by TEXT, x INTEGER, y INTEGER, PRIMARY KEY (rk, n)) WITHOUT ROWID;
CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX by_dest ON records (lst, dest, due, own) WHERE lst IS NOT NULL;
CREATE INDEX by_owner ON records (lst, own, due) WHERE lst IS NOT NULL;
CREATE INDEX by_due ON records (lst, due, own) WHERE lst IS NOT NULL;
INSERT INTO names (nid, kind, a, b) VALUES (1, 0, 'alice', ''), (2, 2, '', 'q');
INSERT INTO records VALUES (1, 1, 'old', 2, 5000, 1000, 3, NULL, 1, 1, NULL, 0, NULL, NULL);
INSERT INTO meta (k, v) VALUES ('position', 41), ('control_position', 7);
PRAGMA user_version = 1;
";

/// `t`'s index opened, with what it logged.
fn opened_logging(t: &Temp) -> (PendingIndex, String) {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let out = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || out.clone())
        .with_ansi(false)
        .finish();
    let ix = tracing::subscriber::with_default(subscriber, || t.open());
    let logged = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (ix, logged)
}

#[test]
fn an_index_of_the_unversioned_layout_is_emptied_for_a_rebuild_and_then_written_as_new() {
    let t = Temp::new();
    let path = t.dir.join("index.db");
    let c = Connection::open(&path).unwrap();
    c.execute_batch(UNVERSIONED_LAYOUT).unwrap();
    drop(c);
    let (mut ix, logged) = opened_logging(&t);
    assert!(
        logged.contains("WARN") && logged.contains("older version") && logged.contains("rebuilds"),
        "{logged}"
    );
    // nothing of the old file is believed: the follower starts from the streams' start
    assert_eq!(ix.position().unwrap(), None);
    assert_eq!(ix.mark("control_position").unwrap(), None);
    assert!(ix.show("old", &Viewer::Admin).unwrap().is_empty());
    let tables: Vec<String> = ix
        .conn
        .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    assert_eq!(
        tables,
        ["header_index", "history", "messages", "meta", "names"]
    );
    // and it works as a new index, here and after it is opened again
    put(&mut ix, "alice", "m", "q", 5_000);
    ix.apply_at(&[], 3).unwrap();
    drop(ix);
    let (mut ix, logged) = opened_logging(&t);
    assert_eq!(logged, "", "a file of this layout is opened as it is");
    assert_eq!(ix.position().unwrap(), Some(3));
    assert_eq!(ix.count(&Filter::new(Viewer::Admin)).unwrap(), 1);
}

#[test]
fn the_list_plans_are_index_range_scans_never_a_full_sort() {
    let t = Temp::new();
    let mut ix = t.open();
    put(&mut ix, "alice", "m", "a", 5);
    let cursor = Cursor {
        due: 1,
        owner: 1,
        row: 1,
    };
    for (dest, viewer, header) in [
        (true, user("alice"), false),
        (false, user("alice"), false),
        (false, Viewer::Admin, false),
        (true, Viewer::Admin, true),
        (false, Viewer::Admin, true),
    ] {
        let mut f = Filter::new(viewer);
        f.destination = dest.then(|| q("a"));
        f.header = header.then(|| ("tenant".into(), "t1".into()));
        f.after = Some(cursor);
        f.due_before = Some(100);
        let plan = ix.plan(&f).unwrap().unwrap();
        let (fw, p) = plan.sql_from_where(true);
        let sql = format!(
            "EXPLAIN QUERY PLAN SELECT {ROW_COLUMNS} {fw}{}",
            plan.order()
        );
        let mut stmt = ix.conn.prepare(&sql).unwrap();
        let details: Vec<String> = stmt
            .query_map(&*bind(&p), |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let text = details.join(" | ");
        // SQLite may sort the rows of one (due, owner) among themselves by row ("LAST TERM
        // OF ORDER BY": a block sort of ties, streamed), never the whole range
        assert!(!text.contains("TEMP B-TREE FOR ORDER BY"), "{sql}: {text}");
        assert!(!text.contains("SCAN"), "{sql}: {text}");
        assert!(
            text.contains('>'),
            "the cursor bounds the range: {sql}: {text}"
        );
    }
}

/// A step of the paging property: insert a row, or read the next page.
#[derive(Debug, Clone)]
enum Step {
    Insert { due: u64, owner: usize },
    Page,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..30, 0usize..3).prop_map(|(due, owner)| Step::Insert { due, owner }),
        Just(Step::Page),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Paging while rows are inserted never repeats a row, never skips one that was there
    /// when paging began, and returns each page in (due, owner, row) order.
    #[test]
    fn paging_under_inserts_never_skips_nor_repeats(
        initial in proptest::collection::vec((0u64..30, 0usize..3), 0..40),
        steps in proptest::collection::vec(step(), 0..60),
        limit in 1usize..7,
        admin in any::<bool>(),
        by_queue in any::<bool>(),
    ) {
        let owners = ["alice", "bob", "carol"];
        let t = Temp::new();
        let mut ix = t.open();
        let mut n = 0;
        let next_id = |n: &mut usize| { *n += 1; format!("id{n}") };
        let mut seen_before = BTreeSet::new();
        let viewer = if admin { Viewer::Admin } else { user("alice") };
        let visible = |owner: usize| admin || owner == 0;
        let mut entries = Vec::new();
        for (due, owner) in &initial {
            let id = next_id(&mut n);
            if visible(*owner) {
                seen_before.insert((owners[*owner].to_string(), id.clone()));
            }
            entries.push(Entry::Scheduled(sched(owners[*owner], &id, "q", *due)));
        }
        ix.apply(&entries).unwrap();
        let mut f = Filter::new(viewer);
        f.limit = limit;
        if by_queue { f.destination = Some(q("q")); }
        let mut got: Vec<Row> = Vec::new();
        let mut done = false;
        let mut steps = steps.into_iter();
        while !done {
            match steps.next().unwrap_or(Step::Page) {
                Step::Insert { due, owner } => {
                    let id = next_id(&mut n);
                    ix.apply(&[Entry::Scheduled(sched(owners[owner], &id, "q", due))]).unwrap();
                }
                Step::Page => {
                    let p = ix.list(&f).unwrap();
                    prop_assert!(p.rows.len() <= limit);
                    got.extend(p.rows);
                    match p.next { Some(c) => f.after = Some(c), None => done = true }
                }
            }
        }
        let keys: Vec<Cursor> = got.iter().map(|r| r.cursor).collect();
        prop_assert!(keys.windows(2).all(|w| w[0] < w[1]), "not strictly ascending: {:?}", keys);
        let listed: BTreeSet<(String, String)> =
            got.iter().map(|r| (r.owner.clone(), r.id.clone())).collect();
        prop_assert!(got.iter().all(|r| visible(owners.iter().position(|o| *o == r.owner).unwrap())));
        prop_assert!(seen_before.is_subset(&listed), "skipped: {:?}", seen_before.difference(&listed).collect::<Vec<_>>());
    }
}

#[test]
fn a_count_agrees_with_the_pages() {
    let t = Temp::new();
    let mut ix = t.open();
    let entries: Vec<Entry> = (0..500u64)
        .map(|i| {
            let mut s = sched(
                ["alice", "bob"][(i % 2) as usize],
                &format!("m{i}"),
                ["a", "b", "c"][(i % 3) as usize],
                (i * 7919) % 1000,
            );
            s.headers = vec![("tenant".into(), format!("t{}", i % 5))];
            Entry::Scheduled(s)
        })
        .collect();
    ix.apply(&entries).unwrap();
    for viewer in [Viewer::Admin, user("alice")] {
        for dest in [None, Some(q("b"))] {
            for header in [None, Some(("tenant".to_string(), "t3".to_string()))] {
                let mut f = Filter::new(viewer.clone());
                f.destination = dest.clone();
                f.header = header.clone();
                f.due_after = Some(100);
                f.limit = 7;
                let rows = all_pages(&mut ix, &f);
                assert_eq!(rows.len() as u64, ix.count(&f).unwrap(), "{f:?}");
                assert!(rows.windows(2).all(|w| w[0].due_at_ms <= w[1].due_at_ms));
            }
        }
    }
}

#[test]
fn a_rebuild_ends_with_the_same_pages_as_applying_one_by_one() {
    let mut entries: Vec<Entry> = (0..300u64)
        .map(|i| {
            let mut s = sched(
                ["alice", "bob"][(i % 2) as usize],
                &format!("m{i}"),
                ["a", "b"][(i % 2) as usize],
                (i * 7919) % 1000,
            );
            s.headers = vec![("tenant".into(), format!("t{}", i % 3))];
            s.confirmed = i % 10 != 0;
            Entry::Scheduled(s)
        })
        .collect();
    for i in (0..300u64).step_by(7) {
        entries.push(Entry::Ran {
            owner: ["alice", "bob"][(i % 2) as usize].into(),
            id: format!("m{i}"),
            at_ms: 2_000,
            lateness_ms: 0,
            outcome: if i % 3 == 0 {
                Outcome::Retried {
                    next_due_at_ms: 3_000 + i,
                }
            } else {
                Outcome::Done
            },
        });
    }
    entries.push(Entry::Cancelled {
        owner: None,
        id: "m5".into(),
        by: "root".into(),
        at_ms: 2_500,
    });
    let (one, bulk) = (Temp::new(), Temp::new());
    let mut a = one.open();
    a.apply(&entries).unwrap();
    let mut b = bulk.open();
    b.begin_rebuild().unwrap();
    b.apply_at(&entries[..100], 100).unwrap();
    assert!(b.list(&Filter::new(Viewer::Admin)).is_err());
    assert_eq!(b.show("m0", &Viewer::Admin).unwrap().len(), 1);
    drop(b);
    // a restart mid-rebuild is still rebuilding
    let mut b = bulk.open();
    assert!(b.rebuilding());
    b.apply_at(&entries[100..], entries.len() as u64).unwrap();
    b.finish_rebuild().unwrap();
    assert!(!b.rebuilding());
    for header in [None, Some(("tenant".to_string(), "t1".to_string()))] {
        for viewer in [Viewer::Admin, user("bob")] {
            let mut f = Filter::new(viewer);
            f.header = header.clone();
            f.limit = 9;
            let strip = |rows: Vec<Row>| {
                rows.into_iter()
                    .map(|r| (r.id, r.owner, r.due_at_ms, r.state))
                    .collect::<Vec<_>>()
            };
            let want = strip(all_pages(&mut a, &f));
            assert!(!want.is_empty());
            assert_eq!(strip(all_pages(&mut b, &f)), want);
            assert_eq!(b.count(&f).unwrap(), want.len() as u64);
        }
    }
}

fn purge_of(queue: &str, owner: Option<&str>) -> Purge {
    Purge {
        scope: amqp_delay::ops::control::PurgeScope {
            owner: owner.map(Into::into),
            ..amqp_delay::ops::control::PurgeScope::queue(queue)
        },
        scheduled_before_ms: 10_000,
        by: "root".into(),
        at_ms: 3_000,
    }
}

#[test]
fn a_purge_cancels_exactly_what_it_covers() {
    let t = Temp::new();
    let mut ix = t.open();
    for (owner, id, queue, due) in [
        ("alice", "a1", "orders", 5_000),
        ("alice", "a2", "orders", 6_000),
        ("alice", "a3", "orders", 9_000),
        ("alice", "a4", "other", 5_000),
        ("bob", "b1", "orders", 5_000),
    ] {
        put(&mut ix, owner, id, queue, due);
    }
    let mut late = sched("alice", "a5", "orders", 5_000);
    late.scheduled_at_ms = 20_000; // after the purge was recorded
    let mut tenant2 = sched("alice", "a6", "orders", 5_000);
    tenant2.headers = vec![("tenant".into(), "t2".into())];
    let mut unconfirmed = sched("alice", "a7", "orders", 5_500);
    unconfirmed.confirmed = false;
    ix.apply(&[
        Entry::Scheduled(late),
        Entry::Scheduled(tenant2),
        Entry::Scheduled(unconfirmed),
    ])
    .unwrap();
    let mut p = purge_of("orders", Some("alice"));
    p.scope.due_before_ms = Some(8_000);
    p.scope.header = Some(("tenant".into(), "t1".into()));
    ix.apply(&[Entry::Purged(p.clone())]).unwrap();
    let mut f = Filter::new(Viewer::Admin);
    let mut left = ids(&ix.list(&f).unwrap());
    left.sort();
    assert_eq!(left, ["a3", "a4", "a5", "a6", "b1"]);
    for id in ["a1", "a2", "a7"] {
        let r = &ix.show(id, &Viewer::Admin).unwrap()[0];
        assert_eq!(r.row.state, State::Cancelled, "{id}");
        assert_eq!(
            r.history.last(),
            Some(&Event::Cancelled {
                at_ms: 3_000,
                by: "root".into()
            })
        );
    }
    // the header index lost exactly the purged rows
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ix.count(&f).unwrap(), 4);
    let mut with_header = ids(&ix.list(&f).unwrap());
    with_header.sort();
    assert_eq!(with_header, ["a3", "a4", "a5", "b1"]);
    // again: nothing more; an unknown destination or owner: nothing
    ix.apply(&[
        Entry::Purged(p),
        Entry::Purged(purge_of("nowhere", None)),
        Entry::Purged(purge_of("orders", Some("nobody"))),
    ])
    .unwrap();
    assert_eq!(ix.count(&Filter::new(Viewer::Admin)).unwrap(), 5);
    // everyone's (an admin's purge without an owner)
    ix.apply(&[Entry::Purged(purge_of("orders", None))])
        .unwrap();
    let mut left = ids(&ix.list(&Filter::new(Viewer::Admin)).unwrap());
    left.sort();
    assert_eq!(left, ["a4", "a5"]);
}

#[test]
fn a_purge_of_many_rows_is_one_transaction_and_keeps_the_indexes_right() {
    let t = Temp::new();
    let mut ix = t.open();
    let n = 20_000u64;
    let batch: Vec<Entry> = (0..n)
        .map(|i| {
            let mut s = sched("alice", &format!("m{i}"), "orders", 5_000 + i);
            s.headers = vec![("tenant".into(), format!("t{}", i % 2))];
            Entry::Scheduled(s)
        })
        .collect();
    ix.apply(&batch).unwrap();
    put(&mut ix, "alice", "kept", "other", 5_000);
    let mut p = purge_of("orders", None);
    p.scope.header = Some(("tenant".into(), "t0".into()));
    let started = std::time::Instant::now();
    ix.apply_at(&[Entry::Purged(p)], 77).unwrap();
    println!("purged {} rows in {:?}", n / 2, started.elapsed());
    assert_eq!(ix.position().unwrap(), Some(77));
    let mut f = Filter::new(Viewer::Admin);
    assert_eq!(ix.count(&f).unwrap(), n / 2 + 1);
    f.header = Some(("tenant".into(), "t0".into()));
    assert_eq!(ix.count(&f).unwrap(), 0);
    assert!(ix.list(&f).unwrap().rows.is_empty());
    // `kept` has tenant=t1 too
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ix.count(&f).unwrap(), n / 2 + 1);
    assert_eq!(all_pages(&mut ix, &f).len() as u64, n / 2 + 1);
}

#[test]
fn a_refused_intent_is_never_listed_and_a_later_schedule_stays() {
    let t = Temp::new();
    let mut ix = t.open();
    let mut s = sched("alice", "x", "orders", 5_000);
    s.confirmed = false;
    let mut y = sched("alice", "y", "orders", 5_000);
    y.confirmed = false;
    ix.apply(&[Entry::Scheduled(s.clone()), Entry::Scheduled(y)])
        .unwrap();
    // a refusal of another schedule of the id changes nothing
    ix.apply(&[Entry::Refused {
        owner: "alice".into(),
        id: "x".into(),
        scheduled_at_ms: 999,
    }])
    .unwrap();
    assert_eq!(ix.count(&Filter::new(Viewer::Admin)).unwrap(), 2);
    ix.apply(&[
        Entry::Refused {
            owner: "alice".into(),
            id: "x".into(),
            scheduled_at_ms: s.scheduled_at_ms,
        },
        Entry::Refused {
            owner: "nobody".into(),
            id: "x".into(),
            scheduled_at_ms: s.scheduled_at_ms,
        },
    ])
    .unwrap();
    assert_eq!(ids(&ix.list(&Filter::new(Viewer::Admin)).unwrap()), ["y"]);
    assert_eq!(
        ix.show("x", &user("alice")).unwrap()[0].row.state,
        State::Refused
    );
    // a confirmed message is never refused
    put(&mut ix, "alice", "z", "orders", 5_000);
    ix.apply(&[Entry::Refused {
        owner: "alice".into(),
        id: "z".into(),
        scheduled_at_ms: 1_000,
    }])
    .unwrap();
    assert_eq!(
        ix.show("z", &user("alice")).unwrap()[0].row.state,
        State::Pending
    );
    // it expires with the finished ones (and y, an intent long past its due time)
    assert_eq!(ix.expire(10, 1_000_000).unwrap(), 2);
    assert!(ix.show("x", &user("alice")).unwrap().is_empty());
}

#[test]
fn marks_commit_with_their_entries_and_survive_a_reopen() {
    let t = Temp::new();
    {
        let mut ix = t.open();
        ix.apply_marked(
            &[Entry::Scheduled(sched("alice", "x", "orders", 5_000))],
            &[("control_position", Some(12)), ("replay_from", Some(3))],
        )
        .unwrap();
        ix.apply_marked(&[], &[("replay_from", None)]).unwrap();
        assert!(ix.apply_marked(&[], &[("rebuilding", Some(1))]).is_err());
        assert!(ix.mark("Bad Name").is_err());
    }
    let ix = t.open();
    assert_eq!(ix.mark("control_position").unwrap(), Some(12));
    assert_eq!(ix.mark("replay_from").unwrap(), None);
    assert_eq!(ix.position().unwrap(), None);
}

/// A purge of 1,000,000 pending messages of one destination, among 1,100,000: one transaction,
/// timed (`cargo test --release -p amqp-delay-cli --lib a_purge_of_a_million -- --ignored
/// --nocapture`).
#[test]
#[ignore = "a measurement: about a minute in release"]
fn a_purge_of_a_million_rows_is_one_transaction() {
    let t = Temp::new();
    let mut ix = t.open();
    let started = std::time::Instant::now();
    for chunk in 0..110u64 {
        let batch: Vec<Entry> = (0..10_000u64)
            .map(|i| {
                let n = chunk * 10_000 + i;
                let queue = if chunk < 100 { "orders" } else { "other" };
                let mut s = sched("alice", &uuid::Uuid::now_v7().to_string(), queue, 5_000 + n);
                s.headers = vec![("tenant".into(), format!("t{}", n % 100))];
                Entry::Scheduled(s)
            })
            .collect();
        ix.apply(&batch).unwrap();
    }
    println!("1,100,000 scheduled in {:?}", started.elapsed());
    let started = std::time::Instant::now();
    ix.apply(&[Entry::Purged(purge_of("orders", None))])
        .unwrap();
    println!("1,000,000 purged in {:?}", started.elapsed());
    let f = Filter::new(Viewer::Admin);
    assert_eq!(ix.count(&f).unwrap(), 100_000);
    let mut f = Filter::new(Viewer::Admin);
    f.header = Some(("tenant".into(), "t1".into()));
    assert_eq!(ix.count(&f).unwrap(), 1_000);
}
