//! The cluster: `scripts/cluster.sh`, its nodes' ports and URLs, what `rabbitmqctl` and `ss`
//! say (queues, leaders, connections), the dead-letter supervisor remedy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{DLX_CONFIRM_TIMEOUT_MS, NODES};

/// Why the cluster did not come up: later tests fail at once with it.
static UP_FAILED: OnceLock<String> = OnceLock::new();

pub(crate) fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Runs `scripts/cluster.sh ARGS` (blocking); Ok(stdout) or Err(the whole output).
pub(crate) fn cluster_sh(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/cluster.sh"))
        .args(args)
        .env("CLUSTER_MGMT_PORT_BASE", mgmt_port_base().to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run scripts/cluster.sh: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "scripts/cluster.sh {} exited with {}\n--- stdout\n{stdout}\n--- stderr\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `cluster.sh ARGS` on a blocking thread; panics with its output when it fails.
pub(crate) async fn cluster(args: &[&str]) -> String {
    let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        cluster_sh(&refs)
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The queues under `prefix` that hold anything, as node `via` lists them (name, type, leader,
/// online members, ready, unacknowledged, consumers): where missing messages wait.
pub(crate) async fn queue_dump(prefix: &str, via: usize) -> String {
    let via = via.to_string();
    let out = tokio::task::spawn_blocking(move || {
        cluster_sh(&[
            "ctl",
            &via,
            "list_queues",
            "name",
            "type",
            "leader",
            "online",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
            // ready + unacknowledged + dead-lettered by a quorum queue and waiting for its
            // dead-letter worker (3.10's rabbitmqctl cannot show that part alone)
            "messages",
        ])
        .unwrap_or_else(|e| e)
    })
    .await
    .unwrap();
    out.lines()
        .filter(|l| l.contains(prefix))
        .filter(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            f.len() < 8 || f[4] != "0" || f[5] != "0" || f[7] != "0"
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every thread's backtrace of process `pid` (gdb), to see where a stalled worker waits.
pub(crate) async fn stacks(pid: u32) -> String {
    let out = tokio::process::Command::new("timeout")
        .args([
            "30",
            "gdb",
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt",
        ])
        .output()
        .await;
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(no backtraces: {e})"),
    }
}

/// Nodes on which RabbitMQ's supervisor of quorum queues' dead-letter workers
/// (`rabbit_fifo_dlx_sup`) is gone. RabbitMQ 3.10 gives it up after two worker crashes within
/// 5 s, which leader elections after a restart or a node loss cause (a worker whose queue's
/// leader moved while it registered exits with `ra_command_failed`); it is not restarted.
/// From then on a queue led from that node keeps what it dead-letters (TTL expiry) in its
/// dead-letter buffer: nothing moves on to the next tier, and a new queue whose leader lands
/// there fails to start (`INTERNAL_ERROR` on declare). docs/OPERATIONS.md has the remedy.
pub(crate) async fn nodes_without_dlx_supervisor() -> Vec<usize> {
    tokio::task::spawn_blocking(|| {
        (1..=NODES)
            .filter(|i| {
                cluster_sh(&[
                    "ctl",
                    &i.to_string(),
                    "eval",
                    "whereis(rabbit_fifo_dlx_sup).",
                ])
                .is_ok_and(|out| out.trim() == "undefined")
            })
            .collect()
    })
    .await
    .unwrap()
}

/// The queues under `prefix` that hold dead-lettered messages not yet moved on (`messages`
/// above ready + unacknowledged), with the node leading each, asked of any node that answers.
/// Called once they should have moved (two dead-letter confirm timeouts after the fault), these
/// are tiers whose dead-letter worker does not run or waits for confirms that never come.
pub(crate) async fn waiting_dead_letters(prefix: &str) -> Vec<(String, usize)> {
    let prefix = format!("{prefix}.");
    tokio::task::spawn_blocking(move || {
        for via in 1..=NODES {
            let Ok(out) = cluster_sh(&[
                "ctl",
                &via.to_string(),
                "list_queues",
                "name",
                "leader",
                "messages_ready",
                "messages_unacknowledged",
                "messages",
            ]) else {
                continue;
            };
            let mut queues: Vec<(String, usize)> = out
                .lines()
                .filter_map(|l| {
                    let c: Vec<&str> = l.split('\t').collect();
                    if c.len() < 5 || !c[0].starts_with(&prefix) {
                        return None;
                    }
                    let n = |i: usize| c[i].trim().parse::<u64>().unwrap_or(0);
                    let node = (1..=NODES).find(|i| c[1].starts_with(&node_name(*i)))?;
                    (n(4) > n(2) + n(3)).then(|| (c[0].to_string(), node))
                })
                .collect();
            queues.sort_unstable();
            return queues;
        }
        Vec::new()
    })
    .await
    .unwrap()
}

/// Nodes leading a queue under `prefix` that holds dead-lettered messages not yet moved on
/// ([`waiting_dead_letters`]).
pub(crate) async fn leaders_of_waiting_dead_letters(prefix: &str) -> Vec<usize> {
    let mut nodes: Vec<usize> = waiting_dead_letters(prefix)
        .await
        .into_iter()
        .map(|(_, node)| node)
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The `rabbitmqctl eval` expression that kills the dead-letter worker of quorum queue `queue`
/// (vhost `/`) on the node it runs on, and answers `{killed, Pid, StuckTargets, SupervisorAlive}`
/// (or `no_worker`). `StuckTargets` are the target queues whose quorum-queue client in the
/// worker never got going: no leader known, no queue status, and the first server it asks
/// (`{RaName, Node}`) is on a node that is down. The record positions are RabbitMQ 3.10.8's
/// (`rabbit_fifo_dlx_worker`'s `#state.queue_ref` 2 and `queue_type_state` 7,
/// `rabbit_fifo_client`'s `#state.leader` 3 and `queue_status` 4).
fn kill_dlx_worker_expr(queue: &str) -> String {
    format!(
        r#"R = rabbit_misc:r(<<"/">>, queue, <<"{queue}">>),
Ws = [P || {{_, P, _, _}} <- supervisor:which_children(rabbit_fifo_dlx_sup), is_pid(P)],
case [P || P <- Ws, element(2, sys:get_state(P)) =:= R] of
  [P | _] ->
    S = sys:get_state(P),
    Stuck = case element(7, S) of
      {{rabbit_queue_type, Ctxs, _}} ->
        [{{N, hd(element(3, element(2, C)))}} || {{{{resource, _, queue, N}}, {{ctx, rabbit_quorum_queue, _, C}}}} <- maps:to_list(Ctxs),
             element(3, C) =:= undefined, element(4, C) =:= undefined,
             not lists:member(element(2, hd(element(3, element(2, C)))), [node() | nodes()])];
      _ -> unknown
    end,
    exit(P, kill),
    timer:sleep(1000),
    {{killed, P, Stuck, whereis(rabbit_fifo_dlx_sup) =/= undefined}};
  [] -> no_worker
end."#
    )
}

/// A remedy for dead-lettered messages that do not move which restarts no node: kill the
/// dead-letter worker (`rabbit_fifo_dlx_worker`) of each tier whose dead-lettered messages wait
/// ([`waiting_dead_letters`]), on the tier's leader, with `rabbitmqctl eval` (see
/// docs/OPERATIONS.md). Found on RabbitMQ 3.10.8 after a node loss: the worker's client of a
/// target tier was set up while the target's recorded leader was the lost node; its first
/// publish asks that node for the machine version (`{badrpc, nodedown}`), which rejects the
/// publish and keeps nothing, so every retry asks the dead node again and is rejected for ever.
/// `rabbit_fifo_dlx_sup` restarts the killed worker at once (a permanent child), the new one
/// takes over the tier's dead-lettered messages and sets its clients up from the queues'
/// current records, and what waited moves on. The supervisor allows one restart in 5 s, so the
/// kills on one node are 6 s apart (a second one within 5 s would take the supervisor down:
/// [`nodes_without_dlx_supervisor`]). Up to 3 rounds, two confirm timeouts apart. Returns the
/// tiers whose worker was killed, with their leader.
pub(crate) async fn restart_stuck_dlx_workers(who: &str, prefix: &str) -> Vec<(String, usize)> {
    let mut killed = Vec::new();
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(2 * DLX_CONFIRM_TIMEOUT_MS + 2000)).await;
        }
        let waiting = waiting_dead_letters(prefix).await;
        if waiting.is_empty() {
            break;
        }
        let mut last_kill: HashMap<usize, Instant> = HashMap::new();
        for (queue, node) in waiting {
            if let Some(t) = last_kill.get(&node) {
                let gap = Duration::from_secs(6);
                tokio::time::sleep(gap.saturating_sub(t.elapsed())).await;
            }
            let expr = kill_dlx_worker_expr(&queue);
            let out = tokio::task::spawn_blocking({
                let node = node.to_string();
                move || cluster_sh(&["ctl", &node, "eval", &expr])
            })
            .await
            .unwrap();
            last_kill.insert(node, Instant::now());
            let out = out.unwrap_or_else(|e| e);
            eprintln!(
                "[{who}] {queue} (led by node {node}): its dead-lettered messages wait; killed its dead-letter worker: {}",
                out.split_whitespace().collect::<Vec<_>>().join(" ")
            );
            killed.push((queue, node));
        }
    }
    killed
}

/// The remedy docs/OPERATIONS.md gives for dead-lettered messages that do not move: restart
/// the RabbitMQ application (`stop_app`, `start_app`), one node at a time, of each node that
/// lost its dead-letter supervisor ([`nodes_without_dlx_supervisor`]) or leads a tier whose
/// dead-lettered messages wait ([`leaders_of_waiting_dead_letters`], with `prefix`). The
/// queues' leaders move to other nodes, whose dead-letter workers start afresh and forward
/// what waited, and the node comes back with a new supervisor. Up to 3 rounds, two
/// confirm timeouts apart, while the restarts' own elections leave something behind.
/// Returns the nodes restarted.
pub(crate) async fn unstick_dead_letters(who: &str, prefix: Option<&str>) -> Vec<usize> {
    let mut restarted = Vec::new();
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(2 * DLX_CONFIRM_TIMEOUT_MS + 2000)).await;
        }
        let mut nodes = nodes_without_dlx_supervisor().await;
        let no_sup = nodes.clone();
        if let Some(p) = prefix {
            nodes.extend(leaders_of_waiting_dead_letters(p).await);
        }
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.is_empty() {
            break;
        }
        for i in nodes {
            let why = if no_sup.contains(&i) {
                "its dead-letter worker supervisor is gone (3.10: two worker crashes in 5 s)"
            } else {
                "it leads a tier whose dead-lettered messages do not move"
            };
            eprintln!("[{who}] node {i}: {why}; restarting its app (OPERATIONS.md)");
            cluster(&["stop-app", &i.to_string()]).await;
            cluster(&["start-app", &i.to_string()]).await;
            restarted.push(i);
        }
    }
    restarted
}

/// Waits (up to 90 s) until every node can declare a quorum queue: right after a full restart
/// the nodes answer AMQP but refuse declares for a while (`INTERNAL_ERROR`), and a test that
/// starts then fails in its set-up, not in what it tests.
pub(super) async fn quorum_ready(prefix: &str) -> Result<(), String> {
    use amqp_delay::QueueType;
    use amqp_delay::ops::broker;
    use lapin::options::QueueDeleteOptions;
    let end = Instant::now() + Duration::from_secs(90);
    for i in 1..=NODES {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", port(i));
        loop {
            let attempt = async {
                let conn = amqp_delay::ops::connection::connect(&url, "fault probe")
                    .await
                    .map_err(|e| e.to_string())?;
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                let q = format!("{prefix}.probe{i}");
                let args = broker::queue_type_args(QueueType::Quorum);
                let r = broker::declare_queue(&ch, &q, args).await;
                if r.is_ok() {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                broker::close_connection(&conn, "probed").await;
                r.map_err(|e| amqp_delay::error_chain(&e))
            };
            let last = match tokio::time::timeout(Duration::from_secs(15), attempt).await {
                Ok(Ok(())) => break,
                Ok(Err(e)) => e,
                Err(_) => "no answer in 15 s".to_string(),
            };
            if Instant::now() > end {
                return Err(format!("node {i}: {last}"));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    Ok(())
}

/// Brings the cluster up (idempotent: a healthy one is reused, a dead node is started again).
pub(super) fn cluster_up() -> Result<(), String> {
    if let Some(e) = UP_FAILED.get() {
        return Err(format!("(it failed before, in an earlier test)\n{e}"));
    }
    let timeout = DLX_CONFIRM_TIMEOUT_MS.to_string();
    cluster_sh(&["--dlx-confirm-timeout", &timeout, "up", &NODES.to_string()])
        .map(|_| ())
        .inspect_err(|e| {
            let _ = UP_FAILED.set(e.clone());
        })
}

/// The node names' prefix: `CLUSTER_NODE_PREFIX`, as for `scripts/cluster.sh` (adfault; the
/// 4.x cluster of `scripts/rabbitmq4.sh cluster` is ad4c).
pub(crate) fn node_prefix() -> String {
    std::env::var("CLUSTER_NODE_PREFIX").unwrap_or_else(|_| "adfault".into())
}

/// Node `i`'s name up to the host: `adfault{i}@`.
pub(crate) fn node_name(i: usize) -> String {
    format!("{}{i}@", node_prefix())
}

/// Node `i`'s AMQP port: `CLUSTER_AMQP_PORT_BASE` (5700, as for `scripts/cluster.sh`) + i.
pub(crate) fn port(i: usize) -> u16 {
    let base = std::env::var("CLUSTER_AMQP_PORT_BASE")
        .ok()
        .and_then(|b| b.parse::<u16>().ok())
        .unwrap_or(5700);
    base + i as u16
}

/// Every node's URL, comma-separated.
/// Where the nodes' management APIs listen: `CLUSTER_MGMT_PORT_BASE` + i, as for
/// `scripts/cluster.sh` (15700 + i by default; `scripts/rabbitmq4.sh env` sets 15750). Every
/// node runs the management plugin, as in production: `stats` and `teardown` see what the
/// broker's dead-letter worker holds only through it.
pub(crate) fn mgmt_port_base() -> u16 {
    std::env::var("CLUSTER_MGMT_PORT_BASE")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(15700)
}

/// The management API of node 1, as `delay-publisher` takes it (`AMQP_DELAY_MANAGEMENT_URL`).
pub(crate) fn management_url() -> String {
    format!("http://guest:guest@127.0.0.1:{}/", mgmt_port_base() + 1)
}

pub(crate) fn urls() -> String {
    (1..=NODES).map(url).collect::<Vec<_>>().join(",")
}

/// Node `i`'s AMQP URL.
pub(crate) fn url(i: usize) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", port(i))
}

/// Node index of an AMQP port of the cluster.
pub(crate) fn node_of_port(p: u16) -> Option<usize> {
    (1..=NODES).find(|&i| port(i) == p)
}

/// Nodes (1-based) the process `pid` has AMQP connections to, from `ss`.
pub(crate) fn nodes_of(pid: u32) -> Vec<usize> {
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .expect("ss (iproute2) is needed by the fault suite");
    let needle = format!("pid={pid},");
    let mut nodes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains(&needle) {
            continue;
        }
        // Recv-Q Send-Q Local:Port Peer:Port Process
        let cols: Vec<&str> = line.split_whitespace().collect();
        if let Some(peer) = cols.get(3)
            && let Some(p) = peer.rsplit(':').next().and_then(|p| p.parse::<u16>().ok())
            && let Some(i) = node_of_port(p)
            && !nodes.contains(&i)
        {
            nodes.push(i);
        }
    }
    nodes
}

/// Local ports of `pid`'s connections to node `node`.
pub(crate) fn local_ports(pid: u32, node: usize) -> Vec<u16> {
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .expect("ss");
    let needle = format!("pid={pid},");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let peer: u16 = cols.get(3)?.rsplit(':').next()?.parse().ok()?;
            let local: u16 = cols.get(2)?.rsplit(':').next()?.parse().ok()?;
            (node_of_port(peer) == Some(node)).then_some(local)
        })
        .collect()
}

/// Leaders of the queues under `prefix`, per node (1-based), from `rabbitmqctl list_queues`
/// asked of `via`.
pub(crate) async fn leaders(prefix: &str, via: usize) -> HashMap<usize, usize> {
    let mut m = HashMap::new();
    for (_, i) in leader_of_each(prefix, via).await {
        *m.entry(i).or_insert(0) += 1;
    }
    m
}

/// The node (1-based) leading each queue under `prefix`, from `rabbitmqctl list_queues` asked
/// of `via`.
pub(crate) async fn leader_of_each(prefix: &str, via: usize) -> HashMap<String, usize> {
    let out = cluster(&["ctl", &via.to_string(), "list_queues", "name", "leader"]).await;
    let mut m = HashMap::new();
    for line in out.lines() {
        let mut cols = line.split_whitespace();
        let (Some(name), Some(leader)) = (cols.next(), cols.next()) else {
            continue;
        };
        if !name.starts_with(&format!("{prefix}.")) {
            continue;
        }
        if let Some(i) = (1..=NODES).find(|i| leader == format!("{}localhost", node_name(*i))) {
            m.insert(name.to_string(), i);
        }
    }
    m
}

/// The cluster's RabbitMQ version (`rabbit_misc:version()` on node 1, e.g. "4.0.5").
pub(crate) async fn broker_version() -> String {
    static VERSION: OnceLock<String> = OnceLock::new();
    if let Some(v) = VERSION.get() {
        return v.clone();
    }
    let out = cluster(&["ctl", "1", "eval", "rabbit_misc:version()."]).await;
    let v = out.trim().trim_matches('"').to_string();
    VERSION.get_or_init(|| v).clone()
}
