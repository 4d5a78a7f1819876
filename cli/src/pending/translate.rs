//! Journal and control records into the index's entries, pure: what each record counts for
//! follows from its broker-checked writer (`amqp_delay::ops::trust`), exactly as the workers decide.
//!
//! * A `Scheduled` record counts for its writer `by`: each item is owned by `by`, or by the
//!   item's `owner` when `by` is a forwarder (a gateway, a worker: `Trust::owner`). Its items are
//!   intents (listed as unconfirmed) until a `Confirmed` record of the same `(by, session)`
//!   names their flush; a flush's `failed` ids were never scheduled and are marked refused,
//!   its `unsure` ones (a lost confirm) stay unconfirmed until their due time passes.
//!   Which items a flush holds is kept in a bounded map ([`Flushes`]); a confirm that arrives
//!   after its flush was forgotten leaves the intent unconfirmed until its due time passes.
//! * A `Ran` record counts only from a writer that may stand for others (`Trust::may_compact`:
//!   our own user, admins, peers).
//! * A cancel, a purge and a reschedule of the control stream cover the writer's own messages,
//!   or, from an admin, anyone's (the purge's and reschedule's `owner` is believed only then).
//! * Anything without a writer, or with a field the index cannot hold (an empty or overlong id,
//!   a time past any real one), is skipped and counted.
//! * A time its writer cannot have meant is skipped and counted (`reason="time"`): a flush or a
//!   run dated more than [`CLOCK_SKEW_MS`] ahead of the reader's clock, an item due later than
//!   the topology's `max_delay` (and the skew) after its flush.
//! * Each record costs time linear in its size, whatever it holds ([`Flushes`]).

use std::collections::HashSet;

use amqp_delay::ops::trust::Trust;
use indexmap::IndexSet;

use crate::pending_index::{Destination, Entry, MAX_ID_BYTES, Outcome, Purge, Scheduled};
use amqp_delay::ops::control::{PurgeScope, Record as ControlRecord};
use amqp_delay::ops::journal::{Flush, Item, Record, Run, RunOutcome};

mod flushes;
use flushes::Waiting;
pub use flushes::{FLUSH_WINDOW_MS, Flushes, MAX_FLUSH_MEMBERS};

/// How far a record's time may lie ahead of the reader's clock: clocks of writers and
/// readers agree within this, and no record of ours is dated further ahead.
pub const CLOCK_SKEW_MS: u64 = 5 * 60_000;
/// Header pairs of one item kept at most, and their bytes: the journal's copy is bounded by its
/// writer, a forged record is bounded here.
const MAX_HEADERS: usize = 64;
const MAX_HEADER_BYTES: usize = 16 << 10;
/// The latest time the index can hold (SQLite's integers are signed).
const MAX_MS: u64 = i64::MAX as u64;

/// Translates records for the index, with the trust of the follower's process.
#[derive(Debug)]
pub struct Translator {
    trust: Trust,
    /// The topology's longest delay: no item is due later than this after its record.
    max_delay_ms: u64,
    flushes: Flushes,
    skipped: u64,
    /// The reader's clock for the record being translated.
    now_ms: u64,
}

impl Translator {
    /// A translator believing what `trust` lets it, for a topology whose delays are at most
    /// `max_delay_ms`.
    pub fn new(trust: Trust, max_delay_ms: u64) -> Translator {
        Translator {
            trust,
            max_delay_ms,
            flushes: Flushes::default(),
            skipped: 0,
            now_ms: 0,
        }
    }

    /// Records and items skipped so far (no writer, not trusted, or unfit for the index).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The unconfirmed flushes.
    pub fn flushes(&self) -> &Flushes {
        &self.flushes
    }

    /// The entries of the journal record at `offset` written by `by`, read when the reader's
    /// clock says `now_ms`.
    pub fn journal(
        &mut self,
        offset: u64,
        by: Option<&str>,
        record: &Record,
        now_ms: u64,
    ) -> Vec<Entry> {
        let Some(by) = by.filter(|b| !b.is_empty()) else {
            self.skipped += 1;
            return Vec::new();
        };
        self.now_ms = now_ms;
        match record {
            Record::Scheduled {
                session,
                flush,
                at_ms,
                items,
                confirmed,
            } => {
                // a writer's clock is the reader's, within the skew: a record dated later
                // could only age every other writer's flushes
                if *at_ms > now_ms.saturating_add(CLOCK_SKEW_MS).min(MAX_MS) {
                    self.skip_time(by, "a flush", *at_ms);
                    return Vec::new();
                }
                let mut out = self.scheduled(offset, by, session, *flush, *at_ms, items);
                out.extend(self.confirmed(by, session, confirmed));
                out
            }
            Record::Confirmed { session, flushes } => self.confirmed(by, session, flushes),
            Record::Ran { items } => {
                if !self.trust.may_compact(Some(by)) {
                    self.skipped += 1;
                    return Vec::new();
                }
                items.iter().filter_map(|r| self.ran(by, r)).collect()
            }
            Record::Barrier { .. } => Vec::new(),
        }
    }

    /// Counts a record or item whose time its writer cannot have meant.
    fn skip_time(&mut self, by: &str, what: &str, at_ms: u64) {
        self.skipped += 1;
        let before = amqp_delay::metrics::global().skip("journal", "time");
        if before < 10 || before.is_multiple_of(1_000) {
            tracing::warn!(
                stream = "journal",
                reason = "time",
                skipped = before + 1,
                by = %crate::logline::escape_controls(by),
                "skipping {what} dated {at_ms}, which its writer cannot have meant (the reader's \
                 clock says {}; clocks agree within {} s, delays are at most {} ms)",
                self.now_ms,
                CLOCK_SKEW_MS / 1_000,
                self.max_delay_ms
            );
        }
    }

    fn scheduled(
        &mut self,
        offset: u64,
        by: &str,
        session: &str,
        flush: u64,
        at_ms: u64,
        items: &[Item],
    ) -> Vec<Entry> {
        let latest_due = at_ms
            .saturating_add(self.max_delay_ms)
            .saturating_add(CLOCK_SKEW_MS);
        let mut out = Vec::with_capacity(items.len());
        let mut members = IndexSet::with_capacity(items.len());
        for item in items {
            if item.due_ms > latest_due {
                self.skip_time(by, "an item due", item.due_ms);
                continue;
            }
            let Some(s) = self.item(by, at_ms, item) else {
                self.skipped += 1;
                continue;
            };
            members.insert((s.owner.clone(), s.id.clone()));
            out.push(Entry::Scheduled(s));
        }
        if !members.is_empty() {
            let w = Waiting {
                offset,
                at_ms,
                members,
            };
            let key = (session.to_string(), flush);
            self.flushes.insert(by, key, w, self.now_ms);
        }
        out
    }

    fn item(&self, by: &str, at_ms: u64, item: &Item) -> Option<Scheduled> {
        let owner = self.trust.owner(Some(by), item.owner.as_deref())?;
        if !fits_id(&item.id) || item.due_ms > MAX_MS || item.size > MAX_MS {
            return None;
        }
        let destination = match item.exchange.as_deref().filter(|e| !e.is_empty()) {
            Some(exchange) => Destination::Exchange {
                exchange: exchange.to_string(),
                routing_key: item.routing_key.clone().unwrap_or_default(),
            },
            None if !item.queue.is_empty() => Destination::Queue(item.queue.clone()),
            None => return None,
        };
        Some(Scheduled {
            id: item.id.clone(),
            owner,
            destination,
            due_at_ms: item.due_ms,
            scheduled_at_ms: at_ms,
            size: item.size,
            content_type: item.content_type.clone(),
            headers: bounded_headers(&item.headers),
            body: item.body.clone(),
            confirmed: false,
        })
    }

    /// The entries of confirmed flushes: each costs the size of the flush and of its lists.
    fn confirmed(&mut self, by: &str, session: &str, flushes: &[Flush]) -> Vec<Entry> {
        let mut out = Vec::new();
        for f in flushes {
            let key = (session.to_string(), f.flush);
            let Some(w) = self.flushes.take(by, &key) else {
                continue;
            };
            let failed: HashSet<&str> = f.failed.iter().map(String::as_str).collect();
            let unsure: HashSet<&str> = f.unsure.iter().map(String::as_str).collect();
            for (owner, id) in w.members {
                // a lost confirm: it may be in the tiers; listed unconfirmed until due
                if unsure.contains(id.as_str()) {
                    continue;
                }
                out.push(if failed.contains(id.as_str()) {
                    Entry::Refused {
                        owner,
                        id,
                        scheduled_at_ms: w.at_ms,
                    }
                } else {
                    Entry::Confirmed { owner, id }
                });
            }
        }
        out
    }

    fn ran(&mut self, by: &str, r: &Run) -> Option<Entry> {
        if r.at_ms > self.now_ms.saturating_add(CLOCK_SKEW_MS) {
            self.skip_time(by, "a run", r.at_ms);
            return None;
        }
        let owner = r.owner.clone().filter(|o| !o.is_empty());
        if owner.is_none() || !fits_id(&r.id) || r.at_ms > MAX_MS || r.due_ms > MAX_MS {
            self.skipped += 1;
            return None;
        }
        let (owner, id, at_ms) = (owner?, r.id.clone(), r.at_ms);
        let ran = |outcome| Entry::Ran {
            owner: owner.clone(),
            id: id.clone(),
            at_ms,
            lateness_ms: at_ms.saturating_sub(r.due_ms),
            outcome,
        };
        Some(match r.outcome {
            RunOutcome::Done => ran(Outcome::Done),
            RunOutcome::Parked => ran(Outcome::Parked),
            RunOutcome::Retried { next_due_ms } if next_due_ms <= MAX_MS => ran(Outcome::Retried {
                next_due_at_ms: next_due_ms,
            }),
            RunOutcome::Cancelled => Entry::Cancelled {
                owner: Some(owner),
                id,
                by: by.to_string(),
                at_ms,
            },
            RunOutcome::Rescheduled { due_ms } if due_ms <= MAX_MS => Entry::Rescheduled {
                owner: Some(owner),
                id,
                due_at_ms: due_ms,
                by: by.to_string(),
                at_ms,
            },
            // a newer copy of the message took over: the index follows that one
            RunOutcome::Superseded
            | RunOutcome::Retried { .. }
            | RunOutcome::Rescheduled { .. } => {
                return None;
            }
        })
    }

    /// The entries of a control record written by `by`, read at `now_ms` (control records carry
    /// no time of their own).
    pub fn control(&mut self, by: Option<&str>, record: &ControlRecord, now_ms: u64) -> Vec<Entry> {
        let Some(by) = by.filter(|b| !b.is_empty()) else {
            if is_steering(record) {
                self.skipped += 1;
            }
            return Vec::new();
        };
        let admin = self.trust.is_admin(by);
        let cancel = |id: &str| Entry::Cancelled {
            owner: (!admin).then(|| by.to_string()),
            id: id.to_string(),
            by: by.to_string(),
            at_ms: now_ms,
        };
        match record {
            ControlRecord::Cancel { id, .. } if fits_id(id) => vec![cancel(id)],
            ControlRecord::Cancels { items } => items
                .iter()
                .filter(|(id, _)| fits_id(id))
                .map(|(id, _)| cancel(id))
                .collect(),
            ControlRecord::Purge(p) if !p.scope.queue.is_empty() => vec![Entry::Purged(Purge {
                scope: PurgeScope {
                    owner: if admin {
                        p.scope.owner.clone()
                    } else {
                        Some(by.to_string())
                    },
                    due_after_ms: p.scope.due_after_ms.map(|v| v.min(MAX_MS)),
                    due_before_ms: p.scope.due_before_ms.map(|v| v.min(MAX_MS)),
                    ..p.scope.clone()
                },
                scheduled_before_ms: p.scheduled_before_ms.min(MAX_MS),
                by: by.to_string(),
                at_ms: now_ms,
            })],
            ControlRecord::Reschedule { to, .. } if fits_id(&to.id) && to.due_at_ms <= MAX_MS => {
                vec![Entry::Rescheduled {
                    // an admin's names its owner, or none: every owner's message of the id
                    owner: if admin {
                        to.owner.clone().filter(|o| !o.is_empty())
                    } else {
                        Some(by.to_string())
                    },
                    id: to.id.clone(),
                    due_at_ms: to.due_at_ms,
                    by: by.to_string(),
                    at_ms: now_ms,
                }]
            }
            ControlRecord::Cancel { .. }
            | ControlRecord::Purge(_)
            | ControlRecord::Reschedule { .. } => {
                self.skipped += 1;
                Vec::new()
            }
            // barriers, checkpoints, gateway pairs, batch markers: nothing for the index
            _ => Vec::new(),
        }
    }
}

fn is_steering(r: &ControlRecord) -> bool {
    matches!(
        r,
        ControlRecord::Cancel { .. }
            | ControlRecord::Cancels { .. }
            | ControlRecord::Purge(_)
            | ControlRecord::Reschedule { .. }
    )
}

fn fits_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_BYTES
}

fn bounded_headers(h: &[(String, String)]) -> Vec<(String, String)> {
    let mut bytes = 0;
    h.iter()
        .take(MAX_HEADERS)
        .take_while(|(k, v)| {
            bytes += k.len() + v.len();
            bytes <= MAX_HEADER_BYTES
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests;
