//! The search field and list filters, as a page's query string says them, pure: what a
//! [`Filter`] of the index is made of, the times people type, and the query string of the
//! next page. Every error names the field and what it accepts.

use serde::{Deserialize, Serialize};

use amqp_delay::ops::control::PurgeScope;

use super::MAX_PAGE;
use crate::pending_index::{Cursor, Destination, Filter, Listing, MAX_ID_BYTES, Viewer};

/// Rows a page lists when the query does not say.
pub const DEFAULT_PAGE: usize = 50;
/// The longest value a search field takes (a queue name, an exchange, a header, a time).
pub const MAX_FIELD: usize = 1024;

/// What a list or search page was asked (every field optional, as a form sends them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct Query {
    /// A message id: its page.
    pub id: String,
    /// Only this queue.
    pub queue: String,
    /// Only this gateway target exchange (with `routing_key`).
    pub exchange: String,
    /// The routing key of `exchange`.
    pub routing_key: String,
    /// Only with this header, `K=V`.
    pub header: String,
    /// Only due after this time.
    pub due_after: String,
    /// Only due before this time.
    pub due_before: String,
    /// `pending` (the default) or `parked`.
    pub listing: String,
    /// Continue after this cursor.
    pub after: String,
    /// Rows a page.
    pub limit: String,
}

impl Query {
    /// Whether the query names no filter (a search with the id only, or nothing).
    pub fn filters_nothing(&self) -> bool {
        self.queue.is_empty()
            && self.exchange.is_empty()
            && self.header.is_empty()
            && self.due_after.is_empty()
            && self.due_before.is_empty()
    }

    /// The destination it names, if any.
    pub fn destination(&self) -> Result<Option<Destination>, String> {
        match (self.queue.trim(), self.exchange.trim()) {
            ("", "") => Ok(None),
            (q, "") => Ok(Some(Destination::Queue(q.to_string()))),
            ("", x) => Ok(Some(Destination::Exchange {
                exchange: x.to_string(),
                routing_key: self.routing_key.clone(),
            })),
            _ => Err("give a queue or an exchange, not both".into()),
        }
    }

    /// Whether it lists parked messages.
    pub fn parked(&self) -> Result<bool, String> {
        match self.listing.as_str() {
            "" | "pending" => Ok(false),
            "parked" => Ok(true),
            other => Err(format!(
                "listing '{other}' is neither 'pending' nor 'parked'"
            )),
        }
    }

    /// The index's filter for `viewer`, times relative to `now_ms`.
    pub fn filter(&self, viewer: Viewer, now_ms: u64) -> Result<Filter, String> {
        for (name, v) in [
            ("id", &self.id),
            ("queue", &self.queue),
            ("exchange", &self.exchange),
            ("routing_key", &self.routing_key),
            ("header", &self.header),
            ("due_after", &self.due_after),
            ("due_before", &self.due_before),
            ("after", &self.after),
        ] {
            if v.len() > MAX_FIELD {
                return Err(format!("{name} is longer than {MAX_FIELD} bytes"));
            }
        }
        let mut f = Filter::new(viewer);
        f.listing = if self.parked()? {
            Listing::Parked
        } else {
            Listing::Pending
        };
        f.destination = self.destination()?;
        f.header = header(&self.header)?;
        f.due_after = time_field("due after", &self.due_after, now_ms)?;
        f.due_before = time_field("due before", &self.due_before, now_ms)?;
        if let (Some(a), Some(b)) = (f.due_after, f.due_before)
            && a >= b
        {
            return Err("'due after' must come before 'due before'".into());
        }
        f.limit = limit(&self.limit)?;
        if !self.after.is_empty() {
            f.after = Some(self.after.parse::<Cursor>()?);
        }
        Ok(f)
    }

    /// The purge of what this query lists, times relative to `now_ms`: pending messages of one
    /// queue, narrowed by header and due times (what the purge form shows and posts back).
    pub fn purge_scope(&self, now_ms: u64) -> Result<PurgeScope, String> {
        if self.parked()? {
            return Err("a purge cancels pending messages; drop parked ones one by one".into());
        }
        let f = self.filter(Viewer::Admin, now_ms)?;
        let queue = match f.destination {
            Some(Destination::Queue(q)) => q,
            Some(Destination::Exchange { .. }) => {
                return Err(
                    "a purge names a queue: a gateway's messages are purged by its due \
                            queue (delay-publisher pending purge --queue)"
                        .into(),
                );
            }
            None => return Err("a purge names the queue whose messages it cancels".into()),
        };
        let scope = PurgeScope {
            queue,
            owner: None,
            due_after_ms: f.due_after,
            due_before_ms: f.due_before,
            header: f.header,
        };
        scope.check()?;
        Ok(scope)
    }

    /// The query string of this query continuing after `cursor` (the "next page" link).
    pub fn next_page(&self, cursor: &Cursor) -> String {
        let mut q = self.clone();
        q.after = cursor.to_string();
        q.id.clear();
        q.to_query_string()
    }

    /// The query string of this query from its first page.
    pub fn first_page(&self) -> String {
        let mut q = self.clone();
        q.after.clear();
        q.id.clear();
        q.to_query_string()
    }

    /// The fields that are set, as a query string.
    pub fn to_query_string(&self) -> String {
        let mut s = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("id", &self.id),
            ("queue", &self.queue),
            ("exchange", &self.exchange),
            ("routing_key", &self.routing_key),
            ("header", &self.header),
            ("due_after", &self.due_after),
            ("due_before", &self.due_before),
            ("listing", &self.listing),
            ("after", &self.after),
            ("limit", &self.limit),
        ] {
            if !v.is_empty() {
                s.append_pair(k, v);
            }
        }
        s.finish()
    }
}

/// A message id as a search gives it: 1 to 255 bytes once trimmed.
pub fn message_id(id: &str) -> Result<&str, String> {
    let id = id.trim();
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(format!("a message id has 1 to {MAX_ID_BYTES} bytes"));
    }
    Ok(id)
}

fn header(s: &str) -> Result<Option<(String, String)>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok(Some((k.trim().to_string(), v.to_string()))),
        _ => Err(format!(
            "header '{s}' is not K=V (a header name, '=', its value)"
        )),
    }
}

fn limit(s: &str) -> Result<usize, String> {
    if s.is_empty() {
        return Ok(DEFAULT_PAGE);
    }
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
        _ => Err(format!("limit '{s}' is not a number from 1 to {MAX_PAGE}")),
    }
}

fn time_field(name: &str, s: &str, now_ms: u64) -> Result<Option<u64>, String> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    parse_time(s, now_ms)
        .map(Some)
        .map_err(|e| format!("{name}: {e}"))
}

/// A time as people type it: `now`; a delay from now (`10m`, `+2h`, `1h 30m`) or before now
/// (`-15m`); or a UTC date and time (`2026-12-06T10:00:00Z`, `2026-12-06 10:00`, seconds and
/// the `Z` optional). Milliseconds since the epoch.
pub fn parse_time(s: &str, now_ms: u64) -> Result<u64, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("now") {
        return Ok(now_ms);
    }
    let relative = |d: &str| {
        humantime::parse_duration(d.trim()).map(|d| d.as_millis().min(u64::MAX as u128) as u64)
    };
    if let Some(d) = t.strip_prefix('-') {
        return relative(d)
            .map(|d| now_ms.saturating_sub(d))
            .map_err(|e| format!("'{t}': {e}"));
    }
    if let Ok(d) = relative(t.strip_prefix('+').unwrap_or(t)) {
        return Ok(now_ms.saturating_add(d));
    }
    let mut iso = t.replace(' ', "T");
    if !iso.ends_with('Z') && !iso.ends_with('z') {
        iso.push('Z');
    }
    if iso.len() == "2026-12-06T10:00Z".len() {
        iso.insert_str(iso.len() - 1, ":00");
    }
    humantime::parse_rfc3339_weak(&iso)
        .ok()
        .and_then(|st| st.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .ok_or_else(|| {
            format!(
                "'{t}' is not a time: write 'now', a delay such as 10m, +2h or -15m, or a UTC time such as 2026-12-06T10:00:00Z"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn times_are_now_delays_or_utc_dates() {
        assert_eq!(parse_time("now", NOW), Ok(NOW));
        assert_eq!(parse_time("10m", NOW), Ok(NOW + 600_000));
        assert_eq!(parse_time(" +1h 30m ", NOW), Ok(NOW + 5_400_000));
        assert_eq!(parse_time("-15s", NOW), Ok(NOW - 15_000));
        assert_eq!(
            parse_time("2027-01-15T08:00:00Z", NOW),
            Ok(1_800_000_000_000)
        );
        assert_eq!(parse_time("2027-01-15 08:00", NOW), Ok(1_800_000_000_000));
        assert_eq!(
            parse_time("2027-01-15T08:00:00.5", NOW),
            Ok(1_800_000_000_500)
        );
        let e = parse_time("tomorrow", NOW).unwrap_err();
        assert!(
            e.contains("'tomorrow' is not a time") && e.contains("10m"),
            "{e}"
        );
        assert!(parse_time("-x", NOW).is_err());
    }

    #[test]
    fn a_query_becomes_the_indexs_filter() {
        let q = Query {
            queue: "orders".into(),
            header: "tenant=t=1".into(),
            due_after: "now".into(),
            due_before: "1h".into(),
            limit: "100".into(),
            ..Query::default()
        };
        let f = q.filter(Viewer::User("ann".into()), NOW).unwrap();
        assert_eq!(f.viewer, Viewer::User("ann".into()));
        assert_eq!(f.destination, Some(Destination::Queue("orders".into())));
        assert_eq!(f.header, Some(("tenant".into(), "t=1".into())));
        assert_eq!(
            (f.due_after, f.due_before),
            (Some(NOW), Some(NOW + 3_600_000))
        );
        assert_eq!((f.limit, f.listing), (100, Listing::Pending));
        let x = Query {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            listing: "parked".into(),
            ..Query::default()
        };
        let f = x.filter(Viewer::Admin, NOW).unwrap();
        assert_eq!(f.listing, Listing::Parked);
        assert_eq!(f.limit, DEFAULT_PAGE);
        assert_eq!(
            f.destination,
            Some(Destination::Exchange {
                exchange: "ex".into(),
                routing_key: "rk".into()
            })
        );
    }

    #[test]
    fn a_purge_is_parsed_once_into_its_scope_and_names_a_queue() {
        let q = Query {
            queue: "orders".into(),
            header: "tenant=t1".into(),
            due_before: "1h".into(),
            after: "1.2.3".into(),
            ..Query::default()
        };
        let s = q.purge_scope(NOW).unwrap();
        assert_eq!(s.queue, "orders");
        assert_eq!(s.owner, None);
        assert_eq!(s.header, Some(("tenant".into(), "t1".into())));
        assert_eq!(
            (s.due_after_ms, s.due_before_ms),
            (None, Some(NOW + 3_600_000))
        );
        for (q, why) in [
            (Query::default(), "names the queue"),
            (
                Query {
                    exchange: "ex".into(),
                    ..Query::default()
                },
                "due queue",
            ),
            (
                Query {
                    queue: "orders".into(),
                    listing: "parked".into(),
                    ..Query::default()
                },
                "parked",
            ),
            (
                Query {
                    queue: "orders".into(),
                    header: format!("k={}", "v".repeat(1_025)),
                    ..Query::default()
                },
                "header",
            ),
        ] {
            let e = q.purge_scope(NOW).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let bad = |q: Query| q.filter(Viewer::Admin, NOW).unwrap_err();
        let e = bad(Query {
            limit: "500".into(),
            ..Query::default()
        });
        assert!(e.contains("limit '500'") && e.contains("1 to 100"), "{e}");
        let e = bad(Query {
            header: "=v".into(),
            ..Query::default()
        });
        assert!(e.contains("K=V"), "{e}");
        let e = bad(Query {
            due_after: "1h".into(),
            due_before: "10m".into(),
            ..Query::default()
        });
        assert!(e.contains("must come before"), "{e}");
        let e = bad(Query {
            after: "1.2".into(),
            ..Query::default()
        });
        assert!(e.contains("cursor"), "{e}");
        let e = bad(Query {
            listing: "done".into(),
            ..Query::default()
        });
        assert!(e.contains("'done'"), "{e}");
        let e = bad(Query {
            queue: "q".repeat(2000),
            ..Query::default()
        });
        assert!(e.contains("queue is longer"), "{e}");
        let e = bad(Query {
            queue: "a".into(),
            exchange: "b".into(),
            ..Query::default()
        });
        assert!(e.contains("not both"), "{e}");
        assert!(message_id("  ").is_err());
        assert_eq!(message_id(" b-7 "), Ok("b-7"));
    }

    #[test]
    fn the_next_page_keeps_the_filters_and_moves_the_cursor() {
        let q = Query {
            id: "x".into(),
            queue: "a b&c".into(),
            after: "1.1.1".into(),
            ..Query::default()
        };
        let c: Cursor = "5.2.9".parse().unwrap();
        assert_eq!(q.next_page(&c), "queue=a+b%26c&after=5.2.9");
        assert_eq!(q.first_page(), "queue=a+b%26c");
    }
}
