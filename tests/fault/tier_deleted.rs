//! A tier queue deleted by an operator: `stats` names it as missing, `declare` says it
//! re-created it, and messages routed through it arrive again.

use std::collections::HashSet;
use std::time::Duration;

use rand::Rng;

use crate::harness::*;

const MAX_MS: u64 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tier_queue_deleted_by_an_operator_is_reported_and_repaired() {
    let mut f = Fault::begin("tier-deleted", MAX_MS).await;
    let q = f.destination("dest");
    f.declare(&[&q]).await;
    // radix 4, 1 ms units: level 3 digit 2 holds delays of 128..191 ms
    let tier = format!("{}.level3.d2", f.prefix);
    cluster(&["ctl", "2", "delete_queue", &tier]).await;

    let stats = f.publisher_ok(&["stats"]).await;
    let row = stats
        .stdout
        .lines()
        .find(|l| l.starts_with(&tier))
        .unwrap_or_else(|| panic!("stats does not list {tier}:\n{}", stats.stdout));
    assert!(row.contains("MISSING"), "{}", stats.stdout);
    assert!(
        stats.stdout.contains("1 queue(s) missing"),
        "{}",
        stats.stdout
    );
    let json = f.publisher_ok(&["stats", "--json", "--non-empty"]).await;
    let json: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    let missing: Vec<&str> = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["missing"] == true)
        .map(|s| s["queue"].as_str().unwrap())
        .collect();
    assert_eq!(missing, vec![tier.as_str()]);

    let declared = f.declare(&[&q]).await;
    assert!(
        declared
            .stdout
            .contains(&format!("re-created missing queue '{tier}'")),
        "declare did not say what it repaired:\n{}",
        declared.stdout
    );
    let stats = f.publisher_ok(&["stats"]).await;
    assert!(!stats.stdout.contains("MISSING"), "{}", stats.stdout);
    assert!(!stats.stdout.contains("missing"), "{}", stats.stdout);

    // messages through the re-created tier (and the rest) arrive
    let worker = f.worker(&q).await;
    let mut rng = rand::rng();
    let ids: Vec<String> = (0..400).map(|i| format!("t{i}")).collect();
    let text: String = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let delay = if i % 2 == 0 {
                rng.random_range(128..192)
            } else {
                rng.random_range(0..MAX_MS)
            };
            line(&q, id, delay) + "\n"
        })
        .collect();
    f.send_confirmed("bulk.jsonl", text, ids.len()).await;
    let scheduled: HashSet<String> = ids.into_iter().collect();
    worker
        .wait_for(
            &scheduled,
            Duration::from_secs(30),
            Duration::from_millis(500),
        )
        .await;
    let t = Tally::of(&scheduled, &worker.delivered());
    t.print("tier queue deleted by an operator");
    t.assert_sound("tier-deleted");
    worker.stop().await;
}
