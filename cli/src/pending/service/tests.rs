use super::*;

use std::sync::{Arc, Mutex};

use crate::pending_index::{Entry, PendingIndex, Scheduled};

fn settings() -> Settings {
    let mut s = Settings::default();
    s.trust.admins = vec!["root".into()];
    s
}

fn sched(owner: &str, id: &str, due: u64, body: Option<&[u8]>) -> Entry {
    Entry::Scheduled(Scheduled {
        id: id.into(),
        owner: owner.into(),
        destination: Destination::Queue("orders".into()),
        due_at_ms: due,
        scheduled_at_ms: 1_000,
        size: 3,
        content_type: Some("text/plain".into()),
        headers: vec![("tenant".into(), "t1".into())],
        body: body.map(<[u8]>::to_vec),
        confirmed: true,
    })
}

fn service(entries: &[Entry]) -> Service {
    let mut ix = PendingIndex::open(std::path::Path::new(":memory:"), Default::default()).unwrap();
    ix.apply(entries).unwrap();
    Service::new(settings(), Arc::new(Mutex::new(ix)), Status::new())
}

#[test]
fn a_query_refuses_what_it_cannot_serve_with_a_reason() {
    let v = Viewer::Admin;
    for (q, want) in [
        (
            Query {
                limit: Some(0),
                ..Query::default()
            },
            "1 to 1000",
        ),
        (
            Query {
                limit: Some(MAX_PAGE + 1),
                ..Query::default()
            },
            "1 to 1000",
        ),
        (
            Query {
                queue: Some(String::new()),
                ..Query::default()
            },
            "queue name",
        ),
        (
            Query {
                header: Some((String::new(), "v".into())),
                ..Query::default()
            },
            "NAME=VALUE",
        ),
        (
            Query {
                after: Some("x".into()),
                ..Query::default()
            },
            "not a cursor",
        ),
    ] {
        let e = q.filter(v.clone()).unwrap_err();
        assert!(matches!(e, Failure::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains(want), "{e}");
        assert!(e.is_usage());
        assert_eq!(e.http_status(), 400);
    }
    let f = Query::default().filter(v).unwrap();
    assert_eq!(f.limit, DEFAULT_PAGE);
}

#[test]
fn admins_see_everything_and_users_their_own() {
    assert_eq!(viewer_of(&settings(), "root"), Viewer::Admin);
    assert_eq!(
        viewer_of(&settings(), "alice"),
        Viewer::User("alice".into())
    );
}

#[tokio::test]
async fn list_show_and_count_answer_with_the_viewers_rows() {
    let s = service(&[
        sched("alice", "a", 5_000, None),
        sched("bob", "b", 6_000, Some(b"hi")),
        sched("bob", "a", 7_000, None),
    ]);
    let alice = s.viewer("alice");
    let page = s.list(alice.clone(), &Query::default()).await.unwrap();
    assert_eq!(page.rows.len(), 1);
    assert_eq!(page.rows[0].owner, "alice");
    assert_eq!(page.rows[0].state, "pending");
    assert_eq!(
        s.count(s.viewer("root"), &Query::default()).await.unwrap(),
        3
    );
    // pages continue after their cursor
    let first = s
        .list(
            Viewer::Admin,
            &Query {
                limit: Some(2),
                ..Query::default()
            },
        )
        .await
        .unwrap();
    let rest = s
        .list(
            Viewer::Admin,
            &Query {
                after: first.next.clone(),
                ..Query::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(first.rows.len() + rest.rows.len(), 3);
    assert!(rest.next.is_none());
    // show: one per owner for an admin, narrowed by owner; a user never sees another's
    assert_eq!(
        s.show(Viewer::Admin, "a", None)
            .await
            .unwrap()
            .messages
            .len(),
        2
    );
    assert_eq!(
        s.show(Viewer::Admin, "a", Some("bob"))
            .await
            .unwrap()
            .messages
            .len(),
        1
    );
    let b = s.show(Viewer::Admin, "b", None).await.unwrap();
    assert_eq!(b.messages[0].body.as_deref(), Some("hi"));
    assert_eq!(b.messages[0].history[0].event, "scheduled");
    let e = s.show(alice, "b", None).await.unwrap_err();
    assert!(matches!(e, Failure::NotFound(_)), "{e:?}");
    assert_eq!(e.http_status(), 404);
    let e = s.show(Viewer::Admin, "", None).await.unwrap_err();
    assert!(e.to_string().contains("1 to 255 bytes"), "{e}");
}

#[tokio::test]
async fn steering_needs_a_pending_message_of_one_owner() {
    let s = service(&[
        sched("alice", "a", 5_000, None),
        sched("bob", "a", 6_000, None),
        Entry::Cancelled {
            owner: Some("alice".into()),
            id: "gone".into(),
            by: "alice".into(),
            at_ms: 1,
        },
        sched("alice", "c", 5_000, None),
        Entry::Cancelled {
            owner: Some("alice".into()),
            id: "c".into(),
            by: "alice".into(),
            at_ms: 2,
        },
    ]);
    let mut root = settings();
    root.url = "amqp://root:pw@127.0.0.1:1/%2f".into();
    let e = s.cancel(&root, "a", None).await.unwrap_err();
    assert!(
        e.to_string().contains("several owners") && e.to_string().contains("alice, bob"),
        "{e}"
    );
    let mut alice = settings();
    alice.url = "amqp://alice:pw@127.0.0.1:1/%2f".into();
    let e = s.cancel(&alice, "c", None).await.unwrap_err();
    assert!(e.to_string().contains("is cancelled, not pending"), "{e}");
    let e = s
        .reschedule(
            &alice,
            &Reschedule {
                id: "gone".into(),
                owner: None,
                due_at_ms: 5,
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Failure::NotFound(_)), "{e:?}");
    let mut nobody = settings();
    nobody.url = "amqp://127.0.0.1:1/%2f".into();
    let e = s.cancel(&nobody, "a", None).await.unwrap_err();
    assert!(e.to_string().contains("names no user"), "{e}");
}

#[test]
fn moving_earlier_needs_the_kept_body_of_a_queue_message() {
    let record = |body: Option<&[u8]>, destination: Destination| Record {
        row: crate::pending_index::Row {
            id: "m1".into(),
            owner: "alice".into(),
            destination,
            due_at_ms: 9_000,
            scheduled_at_ms: 1_000,
            size: 2,
            content_type: Some("text/plain".into()),
            headers: vec![("tenant".into(), "t1".into())],
            state: State::Pending,
            body_kept: body.is_some(),
            cursor: "1.1.1".parse().unwrap(),
        },
        body: body.map(<[u8]>::to_vec),
        history: vec![],
    };
    let q = Destination::Queue("orders".into());
    let e = copy_of(&record(None, q.clone()), 5).unwrap_err();
    assert!(
        e.to_string()
            .contains("the body was not kept (journal.keep_body is off"),
        "{e}"
    );
    let gw = Destination::Exchange {
        exchange: "x".into(),
        routing_key: "k".into(),
    };
    assert!(
        copy_of(&record(Some(b"hi"), gw), 5)
            .unwrap_err()
            .to_string()
            .contains("gateway")
    );
    let m = copy_of(&record(Some(b"hi"), q), 5).unwrap();
    assert_eq!(
        (m.destination.as_str(), m.delay_ms, m.body.as_slice()),
        ("orders", 5, &b"hi"[..])
    );
    assert_eq!(
        m.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("m1")
    );
    assert_eq!(
        m.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("text/plain")
    );
    assert!(m.check(1 << 20).is_ok());
}
