//! How pages look: the templates (files under `templates/`, embedded at compile time and
//! rendered by minijinja, which escapes every value in HTML), the stylesheet, times and
//! durations as people read them, and the due-time chart as SVG drawn here (no script).

use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use minijinja::{Environment, Value};

use crate::pending_index::{DUE_BUCKETS, LATER};

const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("index.html", include_str!("templates/index.html")),
    ("messages.html", include_str!("templates/messages.html")),
    ("message.html", include_str!("templates/message.html")),
    ("confirm.html", include_str!("templates/confirm.html")),
    ("notice.html", include_str!("templates/notice.html")),
    ("schedules.html", include_str!("templates/schedules.html")),
];

const STYLESHEET: &str = include_str!("templates/console.css");
const FAVICON: &str = include_str!("templates/favicon.svg");

/// The compiled templates.
pub struct Views {
    env: Environment<'static>,
}

impl Default for Views {
    fn default() -> Views {
        Views::new()
    }
}

impl Views {
    /// Loads every template (they are part of the binary: a broken one fails the unit tests).
    pub fn new() -> Views {
        let mut env = Environment::new();
        // a template's typo shows as an error page, not as an empty value
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        for (name, source) in TEMPLATES {
            if let Err(e) = env.add_template(name, source) {
                tracing::error!("console template {name}: {e}");
            }
        }
        Views { env }
    }

    /// `name` rendered with `ctx` as an HTML page with `status`; an error page if it fails.
    pub fn page(&self, status: StatusCode, name: &str, ctx: Value) -> Response {
        match self.env.get_template(name).and_then(|t| t.render(ctx)) {
            Ok(html) => (status, no_store(), Html(html)).into_response(),
            Err(e) => {
                tracing::error!("console: rendering {name}: {e:#}");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the page {name} could not be rendered: {e}\n"),
                )
                    .into_response()
            }
        }
    }
}

/// Pages show what the index holds now: never cached by the browser or a proxy.
fn no_store() -> [(header::HeaderName, &'static str); 3] {
    [
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    ]
}

/// `GET /static/console.css`.
pub async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// `GET /static/favicon.svg` (and `/favicon.ico`, which browsers ask for on their own).
pub async fn favicon() -> Response {
    (
        [
            (header::CONTENT_TYPE, "image/svg+xml"),
            (header::CACHE_CONTROL, "max-age=86400"),
        ],
        FAVICON,
    )
        .into_response()
}

/// `ms` since the epoch as `2026-12-06 10:13:19.123 UTC`.
pub fn time(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    let s = humantime::format_rfc3339_millis(t).to_string();
    format!("{} UTC", s.trim_end_matches('Z').replacen('T', " ", 1))
}

/// A duration as people read it: `850 ms`, `4.2 s`, `3m 12s`, `2h 5m`, `3d 4h`.
pub fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m {}s", s / 60, s % 60),
        3_600_000..86_400_000 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// When `ms` is relative to `now`: `in 3m 12s`, `4.2 s ago`, `now`.
pub fn relative(ms: u64, now: u64) -> String {
    if ms == now {
        "now".into()
    } else if ms > now {
        format!("in {}", duration(ms - now))
    } else {
        format!("{} ago", duration(now - ms))
    }
}

/// The due-time chart of one destination: a bar per bucket (next minute, hour, day, week,
/// later), heights relative to the largest, each with its count as a tooltip and text.
pub fn due_chart(due: &[u64; 5]) -> String {
    const W: u64 = 36;
    const H: u64 = 40;
    let max = due.iter().copied().max().unwrap_or(0).max(1);
    let labels = ["1m", "1h", "1d", "1w", "later"];
    let names: Vec<&str> = DUE_BUCKETS.iter().map(|(_, n)| *n).chain([LATER]).collect();
    let mut bars = String::new();
    for (i, n) in due.iter().enumerate() {
        let h = if *n == 0 { 0 } else { (n * H / max).max(2) };
        let x = i as u64 * W;
        bars.push_str(&format!(
            "<g><title>{}: {n}</title><rect class=\"bar\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{h}\"/>\
             <text class=\"n\" x=\"{}\" y=\"{}\">{}</text>\
             <text class=\"axis\" x=\"{}\" y=\"{}\">{}</text></g>",
            names[i],
            x + 4,
            12 + H - h,
            W - 8,
            x + W / 2,
            10 + H - h,
            compact(*n),
            x + W / 2,
            H + 24,
            labels[i],
        ));
    }
    let total: u64 = due.iter().sum();
    format!(
        "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" \
         viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"due times of {total} pending: {}\">{bars}</svg>",
        W * 5,
        H + 28,
        W * 5,
        H + 28,
        due.iter()
            .zip(&names)
            .map(|(n, l)| format!("{l} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A count with its thousands apart: `1 320 479` (narrow no-break spaces).
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() * 2);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

/// A count in at most four characters: `950`, `12k`, `3.4M`.
pub fn compact(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..10_000 => format!("{:.1}k", n as f64 / 1e3),
        10_000..1_000_000 => format!("{}k", n / 1_000),
        1_000_000..10_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{}M", n / 1_000_000),
    }
}

/// A body as a page shows it: its text when it is UTF-8 (escaped by the template), else its
/// bytes in hex; at most `max` bytes, and whether it was cut.
pub fn body_text(body: &[u8], max: usize) -> (String, bool, bool) {
    let cut = body.len() > max;
    let shown = &body[..body.len().min(max)];
    match std::str::from_utf8(shown) {
        Ok(s) => (s.to_string(), true, cut),
        Err(e) if cut && e.valid_up_to() + 4 > shown.len() => (
            String::from_utf8_lossy(&shown[..e.valid_up_to()]).into_owned(),
            true,
            cut,
        ),
        Err(_) => {
            let hex: Vec<String> = shown
                .chunks(32)
                .map(|c| {
                    c.iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            (hex.join("\n"), false, cut)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_durations_read_well() {
        assert_eq!(time(1_800_000_000_123), "2027-01-15 08:00:00.123 UTC");
        assert_eq!(duration(850), "850 ms");
        assert_eq!(duration(4_200), "4.2 s");
        assert_eq!(duration(192_000), "3m 12s");
        assert_eq!(duration(7_500_000), "2h 5m");
        assert_eq!(duration(288_000_000), "3d 8h");
        assert_eq!(relative(10_000, 4_000), "in 6.0 s");
        assert_eq!(relative(4_000, 10_000), "6.0 s ago");
        assert_eq!(relative(5, 5), "now");
        assert_eq!(count(999), "999");
        assert_eq!(count(1_320_479), "1\u{202f}320\u{202f}479");
        assert_eq!(count(100_000), "100\u{202f}000");
        assert_eq!(compact(999), "999");
        assert_eq!(compact(1_337_270), "1.3M");
        assert_eq!(compact(12_345), "12k");
    }

    #[test]
    fn the_chart_is_svg_with_a_bar_per_bucket() {
        let svg = due_chart(&[1, 0, 300, 7, 2]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("<rect").count(), 5);
        assert!(svg.contains("<title>next day: 300</title>"), "{svg}");
        assert!(svg.contains("height=\"0\""), "an empty bucket has no bar");
        assert!(svg.contains("height=\"40\""), "the largest fills the chart");
        assert!(
            svg.contains("next minute 1, next hour 0, next day 300"),
            "{svg}"
        );
        assert!(!due_chart(&[0; 5]).contains("NaN"));
    }

    #[test]
    fn bodies_are_text_when_they_can_be_and_hex_else() {
        assert_eq!(
            body_text(b"<b>hi</b>", 100),
            ("<b>hi</b>".into(), true, false)
        );
        assert_eq!(body_text(b"abcdef", 3), ("abc".into(), true, true));
        // cut inside a multi-byte character: the text up to it
        assert_eq!(body_text("aé".as_bytes(), 2), ("a".into(), true, true));
        assert_eq!(
            body_text(&[0xff, 0x00, 0x10], 10),
            ("ff 00 10".into(), false, false)
        );
    }

    #[test]
    fn every_template_compiles() {
        let v = Views::new();
        for (name, _) in TEMPLATES {
            assert!(v.env.get_template(name).is_ok(), "{name}");
        }
    }
}
