#!/usr/bin/env bash
# scripts/plugin-node.sh — a throwaway RabbitMQ node with the archived delayed-message-exchange
# plugin enabled, beside the machine's main broker, to compare with it and to migrate from it.
#
# The plugin builds are read-only in /work/shared/plugin (PLUGIN_NODE_PLUGIN_BASE; its README).
# The version's folder is copied into a plugins directory of the node's own, put before the
# broker's: nothing is copied into /usr/lib, and the main broker (rabbit@localhost on 5672) is
# never touched. Two series, each its own node, names and ports:
#
#   3.10  adplug310@localhost  AMQP 5931  dist 25931  (management 15931 with PLUGIN_NODE_MANAGEMENT=1)
#         the host's RabbitMQ 3.10.8 (/usr/lib/rabbitmq), plugin 3.10.2;
#         files /tmp/amqp-delay-plugin310/: plugins/ (the copy), node/ (config, mnesia/, log/,
#         startup.log, pid)
#   4.0   adplug40@localhost   AMQP 5941  dist 25941  (management 15941 with PLUGIN_NODE_MANAGEMENT=1)
#         RabbitMQ 4.0.5 from scripts/rabbitmq4.sh's Debian 13 root, run by rabbitmq4.sh itself
#         (its single-node commands with RABBITMQ4_* overrides and RABBITMQ4_PLUGINS_EXTRA), plugin
#         4.0.7; files <root>/tmp/amqp-delay-plugin40/node/ (plugins/ is the copy), reachable from
#         the host at /tmp/amqp-delay-plugin40 through a symlink.
#
# The series comes from the first argument (3.10 or 4.0) or PLUGIN_NODE_SERIES (default 3.10).
#
# Usage (as root; non-interactive):
#   plugin-node.sh [SERIES] up        start the node with the plugin enabled (4.0: builds the
#                                     root first if it is missing), check that the plugin runs,
#                                     print the KEY=VALUE lines. Idempotent: a node that answers
#                                     and runs the plugin is only printed.
#   plugin-node.sh [SERIES] down      stop the node by name, delete its files. Safe when nothing
#                                     runs. Everything the plugin held is gone with them.
#   plugin-node.sh [SERIES] status    exit 0 when the node answers AMQP and runs the plugin.
#   plugin-node.sh [SERIES] print     the KEY=VALUE lines (shell-sourceable), starting nothing:
#                                     SERIES= NODE= AMQP_PORT= AMQP_URL= VERSION= (the broker's
#                                     package) PLUGIN_VERSION= PLUGIN_DIR= (the node's copy)
#                                     TABLE= INDEX_TABLE= (the plugin's Mnesia tables)
#                                     RABBITMQCTL= (a command line; append rabbitmqctl's
#                                     arguments) and MGMT_PORT= MGMT_URL= with management.
#   plugin-node.sh [SERIES] ctl ARGS...   rabbitmqctl -n NODE ARGS... (the series' rabbitmqctl).
#   plugin-node.sh [SERIES] eval EXPR     rabbitmqctl -q eval EXPR on the node; EXPR "-" reads the
#                                     expression from stdin (for long ones: eval - <file.erl).
#
# Environment: PLUGIN_NODE_SERIES, PLUGIN_NODE_MANAGEMENT (1: the management plugin too; default
# 0), PLUGIN_NODE_PLUGIN_BASE (default /work/shared/plugin), PLUGIN_NODE_WAIT_SECS (default 120),
# PLUGIN_NODE_CONF_EXTRA (extra rabbitmq.conf lines), and per series PLUGIN_NODE_NAME,
# PLUGIN_NODE_AMQP_PORT, PLUGIN_NODE_DIST_PORT, PLUGIN_NODE_MGMT_PORT, PLUGIN_NODE_DIR
# (defaults above). The 4.0 series also takes rabbitmq4.sh's RABBITMQ4_ROOT.
#
# Logs go to stderr; stdout carries only the KEY=VALUE lines or rabbitmqctl's output.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="${SCRIPT_DIR}/$(basename "${BASH_SOURCE[0]}")"

log() { printf '[plugin-node.sh] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

usage() {
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

SERIES="${PLUGIN_NODE_SERIES:-3.10}"
case "${1:-}" in
    3.10 | 4.0)
        SERIES="$1"
        shift
        ;;
esac

PLUGIN_BASE="${PLUGIN_NODE_PLUGIN_BASE:-/work/shared/plugin}"
MANAGEMENT="${PLUGIN_NODE_MANAGEMENT:-0}"
WAIT_SECS="${PLUGIN_NODE_WAIT_SECS:-120}"
PLUGIN_APP=rabbitmq_delayed_message_exchange

case "${SERIES}" in
    3.10)
        NODE="${PLUGIN_NODE_NAME:-adplug310@localhost}"
        AMQP_PORT="${PLUGIN_NODE_AMQP_PORT:-5931}"
        DIST_PORT="${PLUGIN_NODE_DIST_PORT:-25931}"
        MGMT_PORT="${PLUGIN_NODE_MGMT_PORT:-15931}"
        DIR="${PLUGIN_NODE_DIR:-/tmp/amqp-delay-plugin310}"
        ;;
    4.0)
        NODE="${PLUGIN_NODE_NAME:-adplug40@localhost}"
        AMQP_PORT="${PLUGIN_NODE_AMQP_PORT:-5941}"
        DIST_PORT="${PLUGIN_NODE_DIST_PORT:-25941}"
        MGMT_PORT="${PLUGIN_NODE_MGMT_PORT:-15941}"
        DIR="${PLUGIN_NODE_DIR:-/tmp/amqp-delay-plugin40}"
        ;;
    *) die "unknown series '${SERIES}' (3.10 or 4.0)" ;;
esac
SHORT="${NODE%@*}"
# down deletes DIR: never / or a top-level directory
[[ "${DIR}" =~ ^/[^/]+/[^/]+ ]] || die "PLUGIN_NODE_DIR must be an absolute path at least two levels deep, got '${DIR}'"

# The plugin build of the series: PLUGIN_BASE/SERIES/rabbitmq_delayed_message_exchange-X.Y.Z
plugin_src() {
    local d
    d="$(ls -d "${PLUGIN_BASE}/${SERIES}/${PLUGIN_APP}"-* 2>/dev/null | head -n 1)"
    [[ -n "${d}" && -d "${d}/ebin" ]] || die "no ${PLUGIN_APP} build for ${SERIES} in ${PLUGIN_BASE}/${SERIES}"
    echo "${d}"
}
plugin_version() { local d; d="$(plugin_src)"; echo "${d##*/"${PLUGIN_APP}"-}"; }

enabled_list() {
    if [[ "${MANAGEMENT}" == 1 ]]; then
        echo "rabbitmq_management,${PLUGIN_APP}"
    else
        echo "${PLUGIN_APP}"
    fi
}

epmd_has() { epmd -names 2>/dev/null | grep -qE "^name ${SHORT} at port "; }

amqp_probe() {
    timeout 6 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 2
        printf "AMQP\x00\x00\x09\x01" >&3
        IFS= read -r -t 4 -N 1 first <&3 || exit 3
        [[ "$first" == $'"'"'\x01'"'"' || "$first" == A ]]
    ' probe "$1" 2>/dev/null
}

# ---- 4.0: scripts/rabbitmq4.sh's single node with our names, ports and the plugin ----------

r4() {
    RABBITMQ4_NODE="${NODE}" RABBITMQ4_AMQP_PORT="${AMQP_PORT}" RABBITMQ4_DIST_PORT="${DIST_PORT}" \
        RABBITMQ4_MGMT_PORT="${MGMT_PORT}" RABBITMQ4_DIR="${DIR}" RABBITMQ4_WAIT_SECS="${WAIT_SECS}" \
        RABBITMQ4_ENABLED_PLUGINS="$(enabled_list)" RABBITMQ4_PLUGINS_EXTRA="$(plugin_src)" \
        RABBITMQ4_CONF_EXTRA="${PLUGIN_NODE_CONF_EXTRA:-}" RABBITMQ4_SERIES=4.0 \
        bash "${SCRIPT_DIR}/rabbitmq4.sh" "$@"
}

# ---- 3.10: the host's package, in the style of scripts/tls-node.sh ---------------------------

RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ_USER=rabbitmq
RMQ_HOME=/var/lib/rabbitmq
NDIR="${DIR}/node"

if [[ "$(id -u)" -eq 0 ]]; then
    RUNUSER=(runuser -u "${RMQ_USER}" --)
elif [[ "$(id -un)" == "${RMQ_USER}" && "${SERIES}" == 3.10 ]]; then
    RUNUSER=()
else
    die "run as root"
fi

ctl310() {
    local secs="$1"
    shift
    (cd / && timeout --kill-after=5 "${secs}" \
        "${RUNUSER[@]}" env HOME="${RMQ_HOME}" "${RMQ_BIN}/rabbitmqctl" -n "${NODE}" "$@")
}

node_pid() {
    local pid=""
    [[ -s "${NDIR}/pid" ]] && pid="$(tr -dc '0-9' <"${NDIR}/pid")"
    if [[ -n "${pid}" ]] && [[ "$(cat "/proc/${pid}/comm" 2>/dev/null)" == beam* ]] &&
        tr '\0' '\n' <"/proc/${pid}/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=${NODE}"; then
        echo "${pid}"
    fi
    return 0
}

rmq_plugins_dir() { ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins | head -n 1; }

env_lines() {
    cat <<EOF
RABBITMQ_NODENAME=${NODE}
RABBITMQ_DIST_PORT=${DIST_PORT}
RABBITMQ_CONFIG_FILE=${NDIR}/rabbitmq.conf
RABBITMQ_ADVANCED_CONFIG_FILE=${NDIR}/advanced.config
RABBITMQ_ENABLED_PLUGINS_FILE=${NDIR}/enabled_plugins
RABBITMQ_PLUGINS_DIR=${DIR}/plugins:$(rmq_plugins_dir)
RABBITMQ_MNESIA_BASE=${NDIR}/mnesia
RABBITMQ_MNESIA_DIR=${NDIR}/mnesia/${NODE}
RABBITMQ_LOG_BASE=${NDIR}/log
RABBITMQ_PID_FILE=${NDIR}/pid
RABBITMQ_CONF_ENV_FILE=${NDIR}/rabbitmq-env.conf
ERL_EPMD_ADDRESS=127.0.0.1
ERL_FLAGS=-kernel inet_dist_use_interface {127,0,0,1}
EOF
}

write_files_310() {
    local src
    src="$(plugin_src)"
    mkdir -p "${DIR}/plugins" "${NDIR}/mnesia" "${NDIR}/log"
    cp -R "${src}" "${DIR}/plugins/"
    chmod -R u+w,a+rX "${DIR}/plugins"
    cat >"${NDIR}/rabbitmq.conf" <<EOF
# generated by scripts/plugin-node.sh
# RABBITMQ_CONFIG_FILE points here, so the shared /etc/rabbitmq/rabbitmq.conf is not read.
listeners.tcp.default = 127.0.0.1:${AMQP_PORT}
vm_memory_high_watermark.absolute = 1GiB
disk_free_limit.absolute = 20MB
log.file.level = info
log.console = false
EOF
    if [[ "${MANAGEMENT}" == 1 ]]; then
        printf 'management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\n' "${MGMT_PORT}" >>"${NDIR}/rabbitmq.conf"
    fi
    if [[ -n "${PLUGIN_NODE_CONF_EXTRA:-}" ]]; then
        printf '# from PLUGIN_NODE_CONF_EXTRA\n%s\n' "${PLUGIN_NODE_CONF_EXTRA}" >>"${NDIR}/rabbitmq.conf"
    fi
    echo "[]." >"${NDIR}/advanced.config"
    echo "[$(enabled_list)]." >"${NDIR}/enabled_plugins"
    env_lines | sed -E "s/^([A-Z_]+)=(.*)$/\\1='\\2'/" >"${NDIR}/rabbitmq-env.conf"
    chmod 755 "${DIR}"
    [[ "$(id -u)" -eq 0 ]] && chown -R "${RMQ_USER}:" "${NDIR}"
    return 0
}

dump_logs_310() {
    local f
    for f in "${NDIR}/startup.log" "${NDIR}/log/${NODE}.log"; do
        if [[ -s "${f}" ]]; then
            log "---- last lines of ${f} ----"
            tail -n 30 "${f}" >&2 || true
        fi
    done
    return 0
}

launch_310() {
    local envs=() line
    while IFS= read -r line; do envs+=("${line}"); done < <(env_lines)
    log "starting ${NODE} (RabbitMQ 3.10, AMQP ${AMQP_PORT}, dist ${DIST_PORT}, plugin $(plugin_version))"
    rm -f "${NDIR}/pid"
    printf '\n==== %s start\n' "$(date '+%F %T')" >>"${NDIR}/startup.log"
    [[ "$(id -u)" -eq 0 ]] && chown "${RMQ_USER}:" "${NDIR}/startup.log"
    # In its own session, boot errors in startup.log, 20000 open files.
    (cd "${NDIR}" && "${RUNUSER[@]}" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        HOME="${RMQ_HOME}" LANG=C.UTF-8 "${envs[@]}" \
        sh -c 'cd "$2" 2>/dev/null; ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
               setsid "$0" >>"$1" 2>&1 </dev/null &' \
        "${RMQ_BIN}/rabbitmq-server" "${NDIR}/startup.log" "${NDIR}") ||
        die "could not launch rabbitmq-server for ${NODE}"
}

wait_310() {
    local deadline=$((SECONDS + WAIT_SECS)) start=${SECONDS} err=""
    while :; do
        if amqp_probe "${AMQP_PORT}"; then
            if err="$(ctl310 30 -q await_startup --timeout 20 2>&1)"; then
                log "${NODE} is up ($((SECONDS - start))s)"
                return 0
            fi
        else
            err="AMQP port ${AMQP_PORT} does not answer yet"
        fi
        if ((SECONDS >= deadline)); then
            dump_logs_310
            die "${NODE} did not come up within ${WAIT_SECS}s: $(printf '%s' "${err}" | head -n 3 | tr '\n' ' ')"
        fi
        if ((SECONDS - start > 20)) && ! epmd_has && [[ -z "$(node_pid)" ]]; then
            dump_logs_310
            die "${NODE} is not running (its VM exited during boot)"
        fi
        sleep 1
    done
}

stop_310() {
    local pid
    if epmd_has || [[ -n "$(node_pid)" ]]; then
        log "stopping ${NODE}"
        if [[ -s "${NDIR}/pid" ]]; then
            ctl310 60 -q stop "${NDIR}/pid" >&2 2>/dev/null || true
        else
            ctl310 60 -q stop >&2 2>/dev/null || true
        fi
        pid="$(node_pid)"
        if [[ -n "${pid}" ]]; then
            log "${NODE} did not stop in time; kill -9 ${pid} (its own PID)"
            kill -9 "${pid}" 2>/dev/null || true
            sleep 1
        fi
    fi
}

# ---- both ------------------------------------------------------------------------------------

ctl() {
    case "${SERIES}" in
        3.10) ctl310 300 "$@" ;;
        4.0) r4 ctl "$@" ;;
    esac
}

plugin_runs() {
    [[ "$(ctl -q eval "lists:keymember(${PLUGIN_APP}, 1, application:which_applications())." 2>/dev/null)" == true ]]
}

version() {
    case "${SERIES}" in
        3.10) dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || true ;;
        4.0) r4 print 2>/dev/null | sed -n 's/^VERSION=//p' ;;
    esac
}

print_info() {
    cat <<EOF
SERIES=${SERIES}
NODE=${NODE}
AMQP_PORT=${AMQP_PORT}
AMQP_URL=amqp://guest:guest@127.0.0.1:${AMQP_PORT}/%2f
VERSION=$(version)
PLUGIN_VERSION=$(plugin_version)
EOF
    case "${SERIES}" in
        3.10) echo "PLUGIN_DIR=${DIR}/plugins/${PLUGIN_APP}-$(plugin_version)" ;;
        4.0) echo "PLUGIN_DIR=${DIR}/node/plugins/${PLUGIN_APP}-$(plugin_version)" ;;
    esac
    cat <<EOF
TABLE=rabbit_delayed_message${NODE}
INDEX_TABLE=rabbit_delayed_message${NODE}_index
RABBITMQCTL=bash ${SELF} ${SERIES} ctl
EOF
    if [[ "${MANAGEMENT}" == 1 ]]; then
        echo "MGMT_PORT=${MGMT_PORT}"
        echo "MGMT_URL=http://guest:guest@127.0.0.1:${MGMT_PORT}/"
    fi
}

node_healthy() { epmd_has && amqp_probe "${AMQP_PORT}" && plugin_runs; }

cmd_up() {
    local t0=${SECONDS}
    [[ "$(id -u)" -eq 0 ]] || die "up must run as root"
    plugin_src >/dev/null
    case "${SERIES}" in
        3.10)
            if [[ -f "${NDIR}/rabbitmq.conf" ]] && node_healthy; then
                log "${NODE} is already up with the plugin"
                print_info
                return 0
            fi
            if epmd_has || [[ -n "$(node_pid)" ]]; then
                log "${NODE} runs but is not healthy (or its files are gone); restarting it"
                stop_310
            fi
            rm -rf "${DIR}"
            write_files_310
            launch_310
            wait_310
            ;;
        4.0)
            if node_healthy; then
                log "${NODE} is already up with the plugin"
                print_info
                return 0
            fi
            # rabbitmq4.sh up: only prints a node that answers, else (re)builds its files,
            # our copy of the plugin with them, and starts it
            if epmd_has; then
                log "${NODE} answers but does not run the plugin; restarting it"
                r4 down
            fi
            r4 up >/dev/null
            ;;
    esac
    plugin_runs || die "${NODE} is up but ${PLUGIN_APP} does not run (see ${DIR}/node/log/)"
    log "${NODE} up with ${PLUGIN_APP} $(plugin_version) in $((SECONDS - t0))s"
    print_info
}

cmd_down() {
    case "${SERIES}" in
        3.10)
            stop_310
            rm -rf "${DIR}"
            log "down: ${NODE} stopped, ${DIR} removed"
            ;;
        4.0) r4 down ;;
    esac
}

cmd_eval() {
    local expr="${1:-}"
    [[ -n "${expr}" ]] || die "eval needs an expression (or - to read it from stdin)"
    [[ "${expr}" == - ]] && expr="$(cat)"
    ctl -q eval "${expr}"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "${cmd}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) node_healthy ;;
    print) print_info ;;
    ctl) ctl "$@" ;;
    eval) cmd_eval "${1:-}" ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
