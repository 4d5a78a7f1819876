#!/usr/bin/env bash
# scripts/runbook-nodes.sh — the throwaway RabbitMQ 3.10 nodes of tests/runbooks/ (MIGRATING's
# runbooks run as written), beside the machine's main broker, which is never touched:
#
#   a      adrunbooka@localhost    AMQP 5933, management 15933, dist 25933, /tmp/amqp-delay-runbook-a
#          runbook A's broker: the plugin (scripts/plugin-node.sh) and the management plugin,
#          whose API rabbitmqadmin uses
#   b-old  adrunbookb@localhost    AMQP 5934, dist 25934, /tmp/amqp-delay-runbook-b
#          runbook B's old cluster: the plugin (scripts/plugin-node.sh)
#   b-new  adrunbooknew@localhost  AMQP 5935 (AMQPS 5936), management 15935, dist 25935,
#          /tmp/amqp-delay-runbook-new: runbook B's new cluster, a stock node with the management
#          plugin (scripts/tls-node.sh)
#
# Usage (as root): runbook-nodes.sh NODE up|down      NODE: a, b-old, b-new (down: also all)
#   up    stops the node if it runs, deletes its files, starts it afresh and prints the
#         script's KEY=VALUE lines, then NAME= (the node), CONF_ENV_FILE= (its rabbitmq-env.conf:
#         with RABBITMQ_CONF_ENV_FILE set to it, the machine's packaged rabbitmqctl and
#         rabbitmq-plugins address the node as they would on its own host) and MGMT_PORT=.
#   down  stops it by name and deletes its files; safe when nothing runs.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() {
    printf '[runbook-nodes.sh] ERROR: %s\n' "$*" >&2
    exit 2
}

# node NAME ACTION: runs the node's script with its names, ports and directory
node() {
    case "$1" in
        a)
            PLUGIN_NODE_NAME=adrunbooka@localhost PLUGIN_NODE_AMQP_PORT=5933 PLUGIN_NODE_DIST_PORT=25933 \
                PLUGIN_NODE_MGMT_PORT=15933 PLUGIN_NODE_DIR=/tmp/amqp-delay-runbook-a PLUGIN_NODE_MANAGEMENT=1 \
                bash "${SCRIPT_DIR}/plugin-node.sh" 3.10 "$2"
            ;;
        b-old)
            PLUGIN_NODE_NAME=adrunbookb@localhost PLUGIN_NODE_AMQP_PORT=5934 PLUGIN_NODE_DIST_PORT=25934 \
                PLUGIN_NODE_MGMT_PORT=15934 PLUGIN_NODE_DIR=/tmp/amqp-delay-runbook-b PLUGIN_NODE_MANAGEMENT=0 \
                bash "${SCRIPT_DIR}/plugin-node.sh" 3.10 "$2"
            ;;
        b-new)
            TLS_NODE_NAME=adrunbooknew@localhost TLS_NODE_AMQP_PORT=5935 TLS_NODE_AMQPS_PORT=5936 \
                TLS_NODE_DIST_PORT=25935 TLS_NODE_MGMT_PORT=15935 TLS_NODE_DIR=/tmp/amqp-delay-runbook-new \
                bash "${SCRIPT_DIR}/tls-node.sh" "$2"
            ;;
        *) die "unknown node '$1' (a, b-old, b-new)" ;;
    esac
}

info() {
    case "$1" in
        a) printf 'NAME=adrunbooka@localhost\nCONF_ENV_FILE=/tmp/amqp-delay-runbook-a/node/rabbitmq-env.conf\nMGMT_PORT=15933\n' ;;
        b-old) printf 'NAME=adrunbookb@localhost\nCONF_ENV_FILE=/tmp/amqp-delay-runbook-b/node/rabbitmq-env.conf\n' ;;
        b-new) printf 'NAME=adrunbooknew@localhost\nCONF_ENV_FILE=/tmp/amqp-delay-runbook-new/node/rabbitmq-env.conf\nMGMT_PORT=15935\n' ;;
    esac
}

[[ $# -eq 2 ]] || die "usage: runbook-nodes.sh a|b-old|b-new|all up|down"
case "$2" in
    up)
        [[ "$1" != all ]] || die "up takes one node"
        node "$1" down >/dev/null
        node "$1" up
        info "$1"
        ;;
    down)
        if [[ "$1" == all ]]; then
            for n in a b-old b-new; do node "${n}" down >/dev/null; done
        else
            node "$1" down >/dev/null
        fi
        ;;
    *) die "unknown action '$2' (up or down)" ;;
esac
