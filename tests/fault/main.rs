//! The fault suite: amqp-delay on a real 3-node RabbitMQ cluster started by
//! `scripts/cluster.sh` beside the main broker (nodes adfault1..3@localhost, AMQP 5701..5703,
//! management 15701..15703;
//! the broker on 5672 is never touched). The cluster comes up once per binary (the tests FAIL
//! when it cannot), the tests run one at a time, each under its own prefix `fault-<random>` on a
//! 1 ms-unit topology with delays of a few seconds, with every node's URL comma-separated, and
//! each prints one line: scheduled / delivered / lost / duplicates / early / worst lateness.
//! The last test stops the cluster (set FAULT_KEEP_CLUSTER=1 to keep it for another run);
//! `scripts/test.sh` stops it on exit in any case.

mod conn_cut;
mod dest_deleted;
mod dlx_stuck;
mod harness;
mod kill_node;
mod leaders;
mod node_lost;
mod restart_all;
mod tier_deleted;
