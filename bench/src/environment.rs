//! The machine and the broker around a run: CPU and cores, whether the broker is local, and
//! what `rabbitmqctl` / `rabbitmq-diagnostics` say about it (version, dead-letter worker
//! prefetch, memory, `file_handle_cache`). The broker's answers are `None` when it is remote or
//! the local tools do not reach it.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::report::MemorySample;

/// The CPU model from /proc/cpuinfo and the number of cores.
pub(crate) fn machine() -> (String, usize) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpu, cores)
}

/// Whether the URL points at this machine (then `rabbitmqctl` can ask the broker directly).
pub(crate) fn is_local(url: &str) -> bool {
    url::Url::parse(url).ok().is_some_and(|u| {
        matches!(
            u.host_str(),
            Some("localhost" | "127.0.0.1" | "::1" | "[::1]")
        )
    })
}

async fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let fut = tokio::process::Command::new(cmd)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(20), fut).await {
        Ok(Ok(o)) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        _ => None,
    }
}

/// The AMQP port `url` points at (5672, or 5671 for amqps, unless given).
fn url_port(url: &str) -> Option<u16> {
    let u = url::Url::parse(url).ok()?;
    u.port().or(match u.scheme() {
        "amqps" => Some(5671),
        _ => Some(5672),
    })
}

/// Whether a `listeners` list (from `rabbitmqctl status` or `rabbitmq-diagnostics listeners`)
/// contains the AMQP port of `url`: then the local CLI talks to the broker we measure.
fn serves(listeners: &serde_json::Value, url: &str) -> bool {
    let Some(port) = url_port(url) else {
        return false;
    };
    listeners.as_array().is_some_and(|a| {
        a.iter().any(|l| {
            l["port"].as_u64() == Some(u64::from(port))
                && l["protocol"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("amqp"))
        })
    })
}

/// `rabbitmqctl status` of the local node (the one `RABBITMQ_NODENAME` names), if it is the
/// broker at `url`.
async fn local_status(url: &str) -> Option<serde_json::Value> {
    if !is_local(url) {
        return None;
    }
    let out = command_output("rabbitmqctl", &["status", "--formatter", "json"]).await?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    serves(&v["listeners"], url).then_some(v)
}

/// Broker memory: `rabbitmqctl status` (the total the memory alarm uses, and its breakdown),
/// else `rabbitmq-diagnostics memory_breakdown`; `None` for a remote broker, a local node that
/// is not the one at `url`, or when neither tool answers.
pub(crate) async fn broker_memory(url: &str) -> Option<MemorySample> {
    if !is_local(url) {
        return None;
    }
    let numbers = |v: &serde_json::Value, inner: Option<&str>| -> BTreeMap<String, u64> {
        v.as_object()
            .map(|o| {
                o.iter()
                    .filter_map(|(k, c)| {
                        let c = inner.map_or(c, |f| &c[f]);
                        c.as_u64().map(|n| (k.clone(), n))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    if let Some(v) = local_status(url).await {
        let mem = &v["memory"];
        let strategy = mem["strategy"].as_str().unwrap_or("rss");
        let total = &mem["total"];
        let bytes = total[strategy]
            .as_u64()
            .or_else(|| total["rss"].as_u64())
            .or_else(|| total["erlang"].as_u64());
        if let Some(total) = bytes {
            return Some(MemorySample {
                source: format!("rabbitmqctl status (memory.total.{strategy})"),
                total,
                categories: numbers(mem, None),
            });
        }
    }
    let listeners = command_output(
        "rabbitmq-diagnostics",
        &["-q", "listeners", "--formatter", "json"],
    )
    .await
    .and_then(|o| serde_json::from_str::<serde_json::Value>(&o).ok())?;
    if !serves(&listeners, url) {
        return None;
    }
    let out = command_output(
        "rabbitmq-diagnostics",
        &["-q", "memory_breakdown", "--formatter", "json"],
    )
    .await?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let categories = numbers(&v, Some("bytes"));
    Some(MemorySample {
        source: "rabbitmq-diagnostics memory_breakdown (sum)".into(),
        total: categories.values().sum(),
        categories,
    })
}

/// Version, dead-letter worker prefetch, and whether the local CLI reaches this broker.
pub(crate) async fn broker_info(url: &str) -> (Option<String>, Option<u64>, bool) {
    let Some(status) = local_status(url).await else {
        return (None, None, false);
    };
    let version = status["rabbitmq_version"].as_str().map(str::to_string);
    let prefetch = command_output(
        "rabbitmqctl",
        &[
            "eval",
            "application:get_env(rabbit, dead_letter_worker_consumer_prefetch).",
        ],
    )
    .await
    .and_then(|o| {
        o.trim()
            .trim_start_matches("{ok,")
            .trim_end_matches('}')
            .parse()
            .ok()
    });
    (version, prefetch, true)
}

/// File handles of RabbitMQ 3.x's `file_handle_cache` a quorum queue keeps (measured on 3.10.8:
/// declaring the 132 quorum queues of the default topology takes 396).
pub(crate) const HANDLES_PER_QUORUM_QUEUE: u64 = 3;

/// `(total_used, total_limit)` of the local node's `file_handle_cache` (RabbitMQ 3.x).
pub(crate) async fn file_handles() -> Option<(u64, u64)> {
    let out = command_output("rabbitmqctl", &["eval", "file_handle_cache:info()."]).await?;
    let field = |name: &str| -> Option<u64> {
        let rest = &out[out.find(&format!("{{{name},"))? + name.len() + 2..];
        rest[..rest.find('}')?].trim().parse().ok()
    };
    Some((field("total_used")?, field("total_limit")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_node_must_serve_the_url_port() {
        let l = serde_json::json!([
            {"port": 25672, "protocol": "clustering"},
            {"port": 5673, "protocol": "amqp"}
        ]);
        assert!(serves(&l, "amqp://guest:guest@127.0.0.1:5673/%2f"));
        assert!(!serves(&l, "amqp://guest:guest@127.0.0.1/%2f"));
        assert!(is_local("amqp://localhost"));
        assert!(!is_local("amqp://rabbit.example.com"));
    }
}
