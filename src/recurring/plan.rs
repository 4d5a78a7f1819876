//! Which occurrences of a schedule to publish now, pure: every tick not yet dealt with up to
//! the horizon (the schedule-ahead window, or the next tick when that is later), each due at
//! its tick; ticks missed by more than the grace follow the schedule's [`Misfire`].

use super::{Definition, Misfire, Ticks};

/// When a plan is made and how far it looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// How far ahead occurrences are published (at least this, or up to the next tick).
    pub ahead_ms: u64,
    /// How late a tick may be and still run as itself (due at once); an older one is missed.
    pub grace_ms: u64,
    /// The most occurrences one plan holds (the rest wait for the next plan).
    pub max: usize,
    /// The longest delay the topology takes: nothing is planned due later than this from now.
    pub max_delay_ms: u64,
}

/// One occurrence to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrence {
    /// The tick it stands for (its id's).
    pub tick_ms: u64,
    /// When it is due: its tick, or now when that has passed.
    pub due_ms: u64,
    /// Whether it stands for every missed tick from its own on (`--misfire once`).
    pub catch_up: bool,
}

/// What to publish, and how far that deals with the schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The occurrences, in tick order.
    pub occurrences: Vec<Occurrence>,
    /// Whether ticks were missed (run as one catch-up, or skipped).
    pub missed: bool,
    /// Every tick up to here is dealt with once these are published: the watermark to record.
    pub through_ms: u64,
    /// The next tick after `through_ms`, when the schedule has one: when to plan again, at
    /// the latest (less the window).
    pub next_tick_ms: Option<u64>,
}

/// The plan of `def` (whose ticks are `ticks`) at `w`, every tick up to `done_ms` dealt with
/// already (the schedule's watermark, or when it was added or resumed).
pub fn plan(def: &Definition, ticks: &Ticks, done_ms: u64, w: Window) -> Plan {
    let after = done_ms.max(def.from_ms.map_or(0, |f| f.saturating_sub(1)));
    let until = def.until_ms.unwrap_or(u64::MAX);
    let ahead = w.now_ms.saturating_add(w.ahead_ms);
    let horizon = ticks
        .next_after(w.now_ms)
        .map_or(ahead, |t| t.max(ahead))
        .min(until)
        .min(w.now_ms.saturating_add(w.max_delay_ms));
    let mut out = Plan {
        occurrences: Vec::new(),
        missed: false,
        through_ms: after.max(horizon),
        next_tick_ms: None,
    };
    if after >= horizon {
        out.through_ms = after;
        out.next_tick_ms = ticks.next_after(after).filter(|&t| t <= until);
        return out;
    }
    let late = w.now_ms.saturating_sub(w.grace_ms);
    let mut cursor = after;
    if let Some(first) = ticks.next_after(after).filter(|&t| t < late && t <= until) {
        out.missed = true;
        if def.misfire == Misfire::Once && w.max > 0 {
            out.occurrences.push(Occurrence {
                tick_ms: first,
                due_ms: w.now_ms,
                catch_up: true,
            });
        }
        // every tick before `late` is dealt with: the catch-up stands for them, or none runs
        cursor = late.saturating_sub(1).max(first);
    }
    let room = w.max.saturating_sub(out.occurrences.len());
    let run = ticks.between(cursor, horizon, room);
    if run.len() == room {
        // cut short by `max`: dealt with up to what it holds
        out.through_ms = run.last().copied().unwrap_or(cursor);
    }
    out.occurrences.extend(run.into_iter().map(|t| Occurrence {
        tick_ms: t,
        due_ms: t.max(w.now_ms),
        catch_up: false,
    }));
    if w.max == 0 {
        out.through_ms = after;
    }
    out.next_tick_ms = ticks.next_after(out.through_ms).filter(|&t| t <= until);
    out
}

#[cfg(test)]
mod tests;
