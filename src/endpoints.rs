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
            Ok(p) if matches!(p.scheme(), "amqp" | "amqps") && p.host_str().is_some() => {}
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
}
