//! The batcher task: turns the messages in hand into groups, one broker message each (a batch
//! for a destination whose consumers read batches, else one per message), and publishes them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::mpsc;

use super::{Inner, Prepared, Reads};
use crate::batch::{self, Candidate, Limits};
use crate::time::now_ms;

/// The batcher: holds prepared messages — a whole chunk from `schedule_all` leaves at once,
/// a single `schedule` call may wait up to `batch_linger` (never past its deadline), or the
/// grain's linger while messages to its destination arrive steadily (never past its grain's
/// slack, unless its journal intent waits to share a record: [`queue_intent`]) — and
/// publishes them grouped per destination and firing window, one broker message
/// per group, concurrently. Each group leaves when one of its members must: a group of messages that
/// fall due later keeps collecting members while an earlier one leaves (flushing everything
/// at the first deadline kept the gateway's batches at ~6 members).
pub(super) async fn run_batcher(inner: Arc<Inner>, mut rx: mpsc::UnboundedReceiver<Vec<Prepared>>) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut linger = Linger::new(&inner);
    let limit = inner.settings.max_pending.max(1);
    // every message in hand, with the instant it must leave by
    let mut held: Vec<Held> = Vec::new();
    let mut open = true;
    while open || !held.is_empty() {
        let next = held.iter().map(|h| h.leave_by).min();
        let more = match next {
            None => rx.recv().await,
            Some(at) => tokio::select! {
                m = rx.recv() => m,
                _ = tokio::time::sleep_until(at.into()) => Some(Vec::new()),
            },
        };
        match more {
            Some(first) => {
                hold(&inner, &mut held, first, &mut linger);
                while held.len() < limit {
                    match rx.try_recv() {
                        Ok(more) => hold(&inner, &mut held, more, &mut linger),
                        Err(_) => break,
                    }
                }
            }
            None => open = false,
        }
        let now = Instant::now();
        // everything leaves when the publisher closes or too much is in hand
        let all = !open || held.len() >= limit;
        if !all && !held.iter().any(|h| h.leave_by <= now) {
            continue;
        }
        let mut leaving: Vec<Group> = Vec::new();
        for (members, window) in plan_groups(&inner, std::mem::take(&mut held)) {
            if all || members.iter().any(|h| h.leave_by <= now) {
                leaving.push((members.into_iter().map(|h| h.prepared).collect(), window));
            } else {
                held.extend(members);
            }
        }
        while tasks.try_join_next().is_some() {}
        tasks.spawn(publish_groups(inner.clone(), leaving));
    }
    while tasks.join_next().await.is_some() {}
}

/// A message in the batcher's hands.
struct Held {
    leave_by: Instant,
    /// Its size as a batch member (computed once: it is grouped again every round).
    bytes: usize,
    prepared: Prepared,
}

/// How long a single message may wait in the batcher.
struct Linger {
    /// `batch_linger`: what an occasional message waits.
    short: Duration,
    /// The grain's linger: what a message to a destination with a steady flow waits.
    long: Duration,
    /// When a single message to each destination last came (pruned as it grows).
    last: HashMap<String, Instant>,
}

impl Linger {
    fn new(inner: &Inner) -> Self {
        let short = inner.settings.batch_linger.as_duration();
        let long = match inner.settings.grain() {
            Some(_) => inner.settings.grain_linger().as_duration().max(short),
            None => short,
        };
        Linger {
            short,
            long,
            last: HashMap::new(),
        }
    }

    /// What a single message to `destination` that arrived `now` may wait (before its slack):
    /// long when the previous one came less than the short linger ago (another is likely to
    /// come while it waits), short otherwise (a caller that awaits each `schedule` in turn is
    /// never made to wait long).
    fn for_one(&mut self, destination: &str, now: Instant) -> Duration {
        if self.long == self.short {
            return self.short;
        }
        let gap = self.short.max(Duration::from_millis(1));
        let steady = self
            .last
            .get(destination)
            .is_some_and(|&t| now.duration_since(t) < gap);
        if self.last.len() >= 10_000 {
            self.last.retain(|_, t| now.duration_since(*t) < gap);
        }
        self.last.insert(destination.to_string(), now);
        if steady { self.long } else { self.short }
    }
}

/// Takes `batch` into `held`: a chunk of several leaves at once, a single message after its
/// linger, never past the latest it may leave (`leave_by_ms`).
fn hold(inner: &Inner, held: &mut Vec<Held>, batch: Vec<Prepared>, linger: &mut Linger) {
    let now = Instant::now();
    let bulk = batch.len() > 1;
    let now_ms = now_ms();
    held.extend(batch.into_iter().map(|mut p| {
        let wait = if bulk {
            Duration::ZERO
        } else {
            let slack = Duration::from_millis(p.leave_by_ms.saturating_sub(now_ms));
            let lingers = linger.for_one(&p.destination, now);
            let steady = lingers > linger.short;
            queue_intent(inner, &mut p, now, now_ms, lingers.min(slack), steady)
        };
        Held {
            leave_by: now + wait,
            bytes: batch::member_len(batch::encode_properties(&p.properties).len(), p.body.len()),
            prepared: p,
        }
    }));
}

/// Queues the intent of a single message to a destination that holds early messages, to be
/// written by the time it leaves (`wait` from `now`): messages that linger share intent
/// records instead of writing one per batch. In a `steady` flow, one that would leave sooner
/// waits a twentieth of a grain (50 ms at the default 1 s; never more than half the time left
/// until it is due) so that its intent shares a record too. Returns how long it waits.
fn queue_intent(
    inner: &Inner,
    p: &mut Prepared,
    now: Instant,
    now_ms: u64,
    wait: Duration,
    steady: bool,
) -> Duration {
    let (Some(j), true) = (&inner.journal, p.holds) else {
        return wait;
    };
    let item = match p.journal.take() {
        Some(super::journal::Pending::Item(item)) => item,
        other => {
            p.journal = other;
            return wait;
        }
    };
    let wait = match steady {
        true => {
            let shared = Duration::from_millis(inner.settings.grain.as_millis() / 20);
            let until_due = Duration::from_millis(p.due_at_ms.saturating_sub(now_ms) / 2);
            wait.max(shared.min(until_due))
        }
        false => wait,
    };
    p.journal = Some(j.queue(item, now + wait));
    wait
}

/// Messages that travel as one broker message, with their firing window (`None`: alone, in
/// its own budget).
type Group<T = Prepared> = (Vec<T>, Option<(u64, u64)>);

/// Groups `held` per destination: a destination that reads batches into groups whose members
/// all fall due within a common window (`batch::group`), any other message alone.
fn plan_groups(inner: &Inner, held: Vec<Held>) -> Vec<Group<Held>> {
    let mut by_dest: HashMap<String, Vec<Held>> = HashMap::new();
    for h in held {
        by_dest
            .entry(h.prepared.destination.clone())
            .or_default()
            .push(h);
    }
    let limits = Limits {
        max_members: inner.settings.batch_max_messages,
        max_bytes: inner.settings.batch_max_bytes,
    };
    let mut groups = Vec::new();
    for (dest, members) in by_dest {
        let reads = inner
            .bound
            .lock()
            .expect("binding cache")
            .get(&dest)
            .map_or(Reads::Plain, |b| b.reads);
        let grain = inner.settings.grain().filter(|_| reads == Reads::Holds);
        if reads == Reads::Plain {
            groups.extend(members.into_iter().map(|m| (vec![m], None)));
            continue;
        }
        let cands: Vec<Candidate> = members
            .iter()
            .map(|h| Candidate {
                due_at_ms: h.prepared.due_at_ms,
                deadline_ms: h.prepared.deadline_ms,
                bytes: h.bytes,
            })
            .collect();
        let plan = match grain {
            Some(g) => batch::group_grains(&cands, g, limits),
            None => batch::group(&cands, limits),
        };
        let mut slots: Vec<Option<Held>> = members.into_iter().map(Some).collect();
        for g in plan {
            let ms: Vec<Held> = g
                .members
                .iter()
                .map(|&i| slots[i].take().expect("each member in one group"))
                .collect();
            groups.push((ms, Some((g.earliest_ms, g.latest_ms))));
        }
    }
    groups
}

/// Publishes every group concurrently.
async fn publish_groups(inner: Arc<Inner>, groups: Vec<Group>) {
    let now = now_ms();
    futures::stream::iter(groups)
        .for_each_concurrent(None, |(members, window)| {
            let inner = &inner;
            async move {
                let _ = inner.publish_group(now, members, window).await;
            }
        })
        .await;
}
