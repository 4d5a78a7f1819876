//! `delay-publisher send --jsonl` in a scenario: request lines, the summary and re-send files it
//! leaves, the reasons it gave.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Child;

/// A JSONL request line.
pub(crate) fn line(queue: &str, id: &str, delay_ms: u64) -> String {
    format!(r#"{{"queue":"{queue}","delay_ms":{delay_ms},"body":"{id}","id":"{id}"}}"#)
}

/// Ids in a JSONL file (empty when it does not exist).
pub(crate) fn ids_in(path: &Path) -> HashSet<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["id"].as_str().map(str::to_string))
        .collect()
}

/// What a bulk send (`Fault::bulk_send`) ended with.
pub(crate) struct BulkOutcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub confirmed: u64,
    pub invalid: u64,
    pub not_sent: u64,
    pub maybe_sent: u64,
    /// Ids in its "not sent" and "maybe sent" files.
    pub unsent_ids: HashSet<String>,
    pub maybe_ids: HashSet<String>,
}

/// Where [`Fault::bulk_send`] writes the send's stderr (beside its `unsent` file).
pub(super) fn stderr_file(unsent: &Path) -> PathBuf {
    unsent.with_extension("stderr")
}

/// Waits (up to 120 s) for a bulk send whose stdin was closed, and reads its summary line and
/// re-send files.
pub(crate) async fn finish_bulk_send(send: Child, unsent: &Path, maybe: &Path) -> BulkOutcome {
    let out = tokio::time::timeout(Duration::from_secs(120), send.wait_with_output())
        .await
        .expect("the bulk send did not finish in 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (confirmed, invalid, not_sent, maybe_sent) = summary(&stdout);
    let stderr = std::fs::read_to_string(stderr_file(unsent)).unwrap_or_default();
    let _ = std::fs::remove_file(stderr_file(unsent));
    BulkOutcome {
        code: out.status.code(),
        stderr,
        stdout,
        confirmed,
        invalid,
        not_sent,
        maybe_sent,
        unsent_ids: ids_in(unsent),
        maybe_ids: ids_in(maybe),
    }
}

/// The counts of a bulk send's summary line: (confirmed, invalid, not sent, maybe sent).
pub(crate) fn summary(stdout: &str) -> (u64, u64, u64, u64) {
    let l = stdout
        .lines()
        .find(|l| l.contains(" confirmed, "))
        .unwrap_or_else(|| panic!("no summary line in: {stdout}"));
    let nums: Vec<u64> = l
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    // "{c} confirmed, {f} failed ({i} invalid, {n} not sent, {m} maybe sent)"
    assert_eq!(nums.len(), 5, "summary line: {l}");
    (nums[0], nums[2], nums[3], nums[4])
}

/// The reasons a bulk send gave for its failed lines ("line N: " and the prefix taken out),
/// with how often each was given, most frequent first.
pub(crate) fn reasons(stderr: &str) -> Vec<(usize, String)> {
    let mut m: HashMap<String, usize> = HashMap::new();
    for l in stderr.lines().filter(|l| l.starts_with("line ")) {
        let reason = l.split_once(": ").map_or(l, |(_, r)| r);
        let reason: String = reason
            .split('\'')
            .map(|w| if w.starts_with("fault-") { "<tier>" } else { w })
            .collect::<Vec<_>>()
            .join("'");
        *m.entry(reason).or_default() += 1;
    }
    let mut v: Vec<(usize, String)> = m.into_iter().map(|(r, n)| (n, r)).collect();
    v.sort_by(|a, b| b.cmp(a));
    v
}
