//! Broker addresses, pure: a comma-separated list of AMQP URLs (the nodes of a cluster),
//! checked, and printed with passwords redacted so credentials never reach a log line.

/// `amqp://user:secret@host/vhost` → `amqp://user:***@host/vhost`. Unparseable input is
/// replaced entirely, since it might still contain a password. A comma-separated list is
/// redacted element by element.
pub fn redact_url(url: &str) -> String {
    if url.contains(',') {
        return split_urls(url)
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",");
    }
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparseable AMQP URL>".into(),
    }
}

/// The URLs of a comma-separated list, trimmed, empty entries dropped.
pub fn split_urls(urls: &str) -> Vec<String> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_string)
        .collect()
}

/// Checks every URL of the list parses as `amqp://` or `amqps://`, naming the bad one.
pub fn validate_urls(urls: &str) -> std::result::Result<(), String> {
    let list = split_urls(urls);
    if list.is_empty() {
        return Err("the broker URL is empty".into());
    }
    for u in &list {
        match url::Url::parse(u) {
            Ok(p) if matches!(p.scheme(), "amqp" | "amqps") && p.host_str().is_some() => {
                check_frame_max(&p).map_err(|e| format!("broker URL '{}': {e}", redact_url(u)))?;
            }
            Ok(p) => {
                return Err(format!(
                    "broker URL '{}' must be amqp://host or amqps://host, not {}:",
                    redact_url(u),
                    p.scheme()
                ));
            }
            Err(e) => {
                return Err(format!("broker URL '{}' is invalid: {e}", redact_url(u)));
            }
        }
    }
    Ok(())
}

/// AMQP's smallest `frame_max` (the spec's `frame-min-size`).
pub(crate) const AMQP_MIN_FRAME_MAX: u32 = 4096;

/// The largest `frame_max` a URL may ask for. lapin sets aside 32 frames each way per
/// connection before the broker answers (`frame_max=999999999` asked for ~64 GB and aborted the
/// process); at 1 MiB that is already 64 MiB per connection, and nothing amqp-delay sends needs
/// bigger frames (bodies span several frames; headers are bounded, see [`MIN_FRAME_MAX`]).
pub(crate) const MAX_FRAME_MAX: u32 = 1 << 20;

/// The smallest negotiated `frame_max` amqp-delay works with: a message's whole content header
/// (properties and headers) must fit one frame, at publishing and at each delivery after tier
/// hops. We accept headers up to [`crate::message::MAX_HEADER_BYTES`] (32 KiB) and keep
/// [`HEADER_GROWTH_MARGIN`] for the rest, so that the effective header cap,
/// min(32 KiB, frame_max − margin), is the full 32 KiB on every connection we make.
pub(crate) const MIN_FRAME_MAX: u32 =
    (crate::message::MAX_HEADER_BYTES + HEADER_GROWTH_MARGIN) as u32;

/// What a content header may carry besides the caller's headers: the other properties (ten
/// short strings, ≤ 2.6 KiB), our own `x-delay-*` headers (≤ 2 KiB), the broker's
/// `x-first-death-*`/`x-last-death-*` (≤ 1.7 KiB) and one `x-death` entry of ≤ 0.9 KiB per tier
/// queue a route passes (a year at radix 2 and 1 ms units passes 44: 32 levels, 8 overflow tiers,
/// a fixed level).
pub(crate) const HEADER_GROWTH_MARGIN: usize = 64 << 10;

/// The `frame_max` we ask for when a URL does not say (RabbitMQ's default): without one lapin
/// takes whatever the broker offers, and a broker that offers none (0) would make it set aside
/// 32 frames of 4 GiB.
pub(crate) const DEFAULT_FRAME_MAX: u32 = 128 << 10;

/// Checks the `frame_max` query parameter(s) of an AMQP URL: a number within
/// [`MIN_FRAME_MAX`] ..= [`MAX_FRAME_MAX`].
fn check_frame_max(u: &url::Url) -> Result<(), String> {
    for (k, v) in u.query_pairs() {
        if k != "frame_max" {
            continue;
        }
        let n: u64 = v
            .parse()
            .map_err(|_| format!("frame_max '{v:.20}' is not a whole number of bytes"))?;
        if n < u64::from(AMQP_MIN_FRAME_MAX) {
            return Err(format!(
                "frame_max {n} is below AMQP's minimum frame size of {AMQP_MIN_FRAME_MAX} bytes"
            ));
        }
        if n < u64::from(MIN_FRAME_MAX) {
            return Err(format!(
                "frame_max {n} is too small for amqp-delay: a message's headers (up to {} bytes, \
                 plus what the tier hops add) must fit one frame; use at least {MIN_FRAME_MAX}, \
                 or leave frame_max out (the broker's default is 131072)",
                crate::message::MAX_HEADER_BYTES
            ));
        }
        if n > u64::from(MAX_FRAME_MAX) {
            return Err(format!(
                "frame_max {n} is above {MAX_FRAME_MAX} bytes (1 MiB): the AMQP client reserves 64 \
                 frames per connection up front, and amqp-delay needs no bigger frame; leave \
                 frame_max out (the broker's default is 131072)"
            ));
        }
    }
    Ok(())
}

/// `url` (one AMQP URL) ready to connect with: its `frame_max` checked (see [`validate_urls`]),
/// and [`DEFAULT_FRAME_MAX`] asked for when it gives none.
pub(crate) fn connect_url(url: &str) -> Result<String, String> {
    let mut u = url::Url::parse(url)
        .map_err(|e| format!("broker URL '{}' is invalid: {e}", redact_url(url)))?;
    check_frame_max(&u).map_err(|e| format!("broker URL '{}': {e}", redact_url(url)))?;
    if u.query_pairs().any(|(k, _)| k == "frame_max") {
        return Ok(url.to_string());
    }
    u.query_pairs_mut()
        .append_pair("frame_max", &DEFAULT_FRAME_MAX.to_string());
    Ok(u.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://h/v"), "amqp://h/v");
        assert_eq!(redact_url("not a url :: secret"), "<unparseable AMQP URL>");
        assert_eq!(
            redact_url("amqp://u:p1@a:1/%2f, amqp://u:p2@b:2/%2f"),
            "amqp://u:***@a:1/%2f,amqp://u:***@b:2/%2f"
        );
    }

    #[test]
    fn url_lists_are_checked() {
        assert_eq!(
            split_urls(" amqp://a, ,amqp://b "),
            ["amqp://a", "amqp://b"]
        );
        assert!(validate_urls("amqp://a:5701,amqp://b:5702").is_ok());
        let e = validate_urls("amqp://a:5701,http://u:secret@b").unwrap_err();
        assert!(e.contains("amqp://host") && !e.contains("secret"), "{e}");
        assert!(validate_urls("amqp://a:notaport").is_err());
        assert!(validate_urls(" , ").is_err());
    }

    #[test]
    fn frame_max_is_bounded() {
        let url = |fm: &str| format!("amqp://u:secret@h:5672/%2f?heartbeat=10&frame_max={fm}");
        for (fm, want) in [
            ("999999999", "above 1048576 bytes"),
            ("4294967296", "above 1048576 bytes"),
            ("1048577", "above 1048576 bytes"),
            ("0", "below AMQP's minimum frame size of 4096"),
            ("4095", "below AMQP's minimum frame size of 4096"),
            ("4096", "too small for amqp-delay"),
            ("98303", "too small for amqp-delay"),
            ("-1", "not a whole number"),
            ("lots", "not a whole number"),
        ] {
            let e = validate_urls(&url(fm)).unwrap_err();
            assert!(e.contains(want) && !e.contains("secret"), "{fm}: {e}");
            let e = connect_url(&url(fm)).unwrap_err();
            assert!(e.contains(want), "{fm}: {e}");
        }
        // in a list, the bad node is named
        let e = validate_urls("amqp://a,amqp://b?frame_max=999999999").unwrap_err();
        assert!(e.contains("amqp://b"), "{e}");
        // a second frame_max is checked too
        assert!(validate_urls("amqp://a?frame_max=131072&frame_max=999999999").is_err());
        for fm in ["98304", "131072", "1048576"] {
            assert!(validate_urls(&url(fm)).is_ok(), "{fm}");
            assert_eq!(connect_url(&url(fm)).unwrap(), url(fm));
        }
        // without one, RabbitMQ's default is asked for; the rest of the URL is kept
        assert_eq!(
            connect_url("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=131072"
        );
        assert_eq!(
            connect_url("amqps://h/v?heartbeat=5").unwrap(),
            "amqps://h/v?heartbeat=5&frame_max=131072"
        );
        assert_eq!(MIN_FRAME_MAX, 98_304);
    }
}
