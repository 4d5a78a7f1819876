#!/usr/bin/env bash
# scripts/rabbitmq4.sh — throwaway RabbitMQ 4.x nodes beside the machine's 3.10 broker.
#
# Two series, picked by RABBITMQ4_SERIES (default 4.0):
#   4.0   Debian 13 (trixie)'s rabbitmq-server 4.0.5 (Erlang/OTP 27).
#   4.3   Debian sid's rabbitmq-server 4.3.x (Erlang/OTP 29): a trixie root whose apt source is
#         switched to `deb [check-valid-until=no] http://deb.debian.org/debian sid main` (sid's
#         Release file as served here is past its Valid-Until) before rabbitmq-server is
#         installed; apt pulls in sid's libc and Erlang with it.
# This script builds, once per series, a minimal Debian root with that package in it, cached
# OUTSIDE the clone (CI runs from fresh clones on the same machine; a new machine builds it when
# it is missing), and runs nodes from that root with `chroot`. The nodes share the host's epmd
# (4369) under names of their own and never touch the main broker (rabbit@localhost on 5672),
# the 3.10 test nodes of scripts/cluster.sh and scripts/tls-node.sh, or the other series' nodes:
#
#                 series 4.0                              series 4.3
#   single node   ad4single@localhost                     ad43single@localhost     (RABBITMQ4_*)
#                 AMQP 5741  mgmt 15741  dist 25741       AMQP 5841  mgmt 15841  dist 25841
#   TLS node      ad4tls@localhost                        ad43tls@localhost        (tls-node.sh)
#                 AMQP 5761  AMQPS 5762  dist 25761       AMQP 5861  AMQPS 5862  dist 25861
#   cluster       ad4c1..3@localhost                      ad43c1..3@localhost      (cluster.sh)
#                 AMQP 5751..5753  mgmt 15751..15753      AMQP 5851..5853  mgmt 15851..15853
#                 dist 25751..25753                       dist 25851..25853
#   root          /var/cache/amqp-delay/rabbitmq4-root    /var/cache/amqp-delay/rabbitmq43-root
#                                                                                  (RABBITMQ4_ROOT)
#   node files    <root>/tmp/amqp-delay-rmq4/ (single), <root>/tmp/amqp-delay-rmq4-cluster/,
#                 <root>/tmp/amqp-delay-rmq4-tls/ (4.3: rmq43 in place of rmq4); each also
#                 reachable from the host at the same path through a symlink, so one path works
#                 inside and outside the root.
#
# Usage (as root; non-interactive):
#   rabbitmq4.sh root              build the root if it is missing (debootstrap --variant=minbase
#                                  trixie, for 4.3 the apt source switched to sid, then apt-get
#                                  install rabbitmq-server inside it, with a policy-rc.d that
#                                  starts no service), print its path. Idempotent;
#                                  a lock keeps two callers from building at once; a half-built
#                                  root is thrown away and built again.
#   rabbitmq4.sh up                root, then the single node (management on); print KEY=VALUE
#                                  lines: NODE= AMQP_PORT= MGMT_PORT= AMQP_URL= MGMT_URL= VERSION=.
#                                  Idempotent: a node that answers is only printed.
#   rabbitmq4.sh down              stop the single node (by name), delete its files; unmount the
#                                  root's /proc when no process runs in the root any more.
#   rabbitmq4.sh status            exit 0 when the single node answers AMQP and rabbitmqctl.
#   rabbitmq4.sh print             the KEY=VALUE lines, starting nothing.
#   rabbitmq4.sh ctl ARGS...       the root's rabbitmqctl against the single node.
#   rabbitmq4.sh rabbitmqctl ARGS...  the root's rabbitmqctl as is (default node: the single
#                                  node; -n NODE picks another 4.x node). For tests that need a
#                                  rabbitmqctl: TEST_RABBITMQCTL="bash <this> rabbitmqctl".
#   rabbitmq4.sh plugins ARGS...   the root's rabbitmq-plugins against the single node.
#   rabbitmq4.sh cluster ARGS...   scripts/cluster.sh ARGS with the 4.x root, names and ports
#                                  (up [N], down, status, kill I, start I, stop I, ctl I ...).
#   rabbitmq4.sh tls ARGS...       scripts/tls-node.sh ARGS (up, down, print, status) likewise.
#   rabbitmq4.sh env               shell lines (export ...) that point scripts/cluster.sh,
#                                  scripts/tls-node.sh and the test suites at the series' nodes
#                                  (TEST_RABBITMQCTL carries RABBITMQ4_SERIES along).
#   rabbitmq4.sh all-down          the series' cluster, TLS node and single node down, its root's
#                                  /proc unmounted. Safe when nothing is up.
#   rabbitmq4.sh series            print the series and its root, suite and version.
#
# Every command acts on one series: RABBITMQ4_SERIES=4.0|4.3 (4.3.x, 43 and 4.3.6 also name 4.3;
# 4, 4.0.x and 40 name 4.0), e.g. `RABBITMQ4_SERIES=4.3 scripts/rabbitmq4.sh up`.
#
# Environment: RABBITMQ4_SERIES, RABBITMQ4_ROOT, RABBITMQ4_SUITE (debootstrap suite, default
# trixie), RABBITMQ4_APT_SOURCE (the root's apt source line; 4.0: none, debootstrap's own; 4.3:
# the sid line above), RABBITMQ4_NODE,
# RABBITMQ4_AMQP_PORT, RABBITMQ4_MGMT_PORT, RABBITMQ4_DIST_PORT, RABBITMQ4_DIR (inside the root),
# RABBITMQ4_WAIT_SECS (default 120), RABBITMQ4_CONF_EXTRA (extra rabbitmq.conf lines for the
# single node), RABBITMQ4_ADVANCED_CONFIG (its advanced.config terms; default: the settings we
# ship, deploy/rabbitmq/advanced.config), RABBITMQ4_ENABLED_PLUGINS (the single node's
# enabled_plugins list, comma separated; default rabbitmq_management), RABBITMQ4_PLUGINS_EXTRA
# (host paths of directory plugins, NAME-VERSION/ebin, space separated: copied into the node's
# own DIR/node/plugins, which comes before the root's plugins directory; nothing in the root's
# /usr/lib changes; scripts/plugin-node.sh uses it for the delayed-message-exchange plugin).
#
# Logs go to stderr; stdout carries only the KEY=VALUE lines, the path (root) or ctl's output.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The series' defaults: root, apt source, names and ports (every one overridable).
case "${RABBITMQ4_SERIES:-4.0}" in
    4 | 4.0 | 4.0.* | 40)
        SERIES=4.0
        D_ROOT=/var/cache/amqp-delay/rabbitmq4-root
        D_APT_SOURCE=""
        D_TAG=rmq4 D_NAME=ad4 D_PORT=57
        ;;
    4.3 | 4.3.* | 43)
        SERIES=4.3
        D_ROOT=/var/cache/amqp-delay/rabbitmq43-root
        D_APT_SOURCE="deb [check-valid-until=no] http://deb.debian.org/debian sid main"
        D_TAG=rmq43 D_NAME=ad43 D_PORT=58
        ;;
    *)
        printf '[rabbitmq4.sh] ERROR: RABBITMQ4_SERIES=%s: use 4.0 or 4.3\n' "${RABBITMQ4_SERIES}" >&2
        exit 2
        ;;
esac
ROOT="${RABBITMQ4_ROOT:-${D_ROOT}}"
ROOT="${ROOT%/}"
SUITE="${RABBITMQ4_SUITE:-trixie}"
APT_SOURCE="${RABBITMQ4_APT_SOURCE-${D_APT_SOURCE}}"
NODE="${RABBITMQ4_NODE:-${D_NAME}single@localhost}"
SHORT="${NODE%@*}"
AMQP_PORT="${RABBITMQ4_AMQP_PORT:-${D_PORT}41}"
MGMT_PORT="${RABBITMQ4_MGMT_PORT:-1${D_PORT}41}"
DIST_PORT="${RABBITMQ4_DIST_PORT:-2${D_PORT}41}"
DIR="${RABBITMQ4_DIR:-/tmp/amqp-delay-${D_TAG}}"
WAIT_SECS="${RABBITMQ4_WAIT_SECS:-120}"
READY="${ROOT}/.amqp-delay-root-ready"
RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ_USER=rabbitmq
RMQ_HOME=/var/lib/rabbitmq
ENABLED_PLUGINS="${RABBITMQ4_ENABLED_PLUGINS:-rabbitmq_management}"
PLUGINS_EXTRA="${RABBITMQ4_PLUGINS_EXTRA:-}"

log() { printf '[rabbitmq4.sh] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

[[ "$(id -u)" -eq 0 ]] || die "run as root (chroot, mount)"
[[ "${ROOT}" == /* && "${ROOT}" != / ]] || die "RABBITMQ4_ROOT must be an absolute path other than /"
# node directories are deleted on down: never / or a top-level directory
[[ "${DIR}" =~ ^/[^/]+/[^/]+ ]] || die "RABBITMQ4_DIR must be an absolute path at least two levels deep, got '${DIR}'"

# --- the root ----------------------------------------------------------------

root_ready() { [[ -s "${READY}" && -x "${ROOT}${RMQ_BIN}/rabbitmq-server" ]]; }

# Is /proc mounted in the root DIR?
proc_mounted() { mountpoint -q "$1/proc"; }

mount_proc() {
    local r="${1:-${ROOT}}"
    proc_mounted "${r}" || mount -t proc proc "${r}/proc"
}

# PIDs of processes whose root directory is the root (nodes, epmd started in it, rabbitmqctl).
root_pids() {
    local p r
    for p in /proc/[0-9]*; do
        r="$(readlink "${p}/root" 2>/dev/null)" || continue
        [[ "${r}" == "${ROOT}" ]] && echo "${p#/proc/}"
    done
    return 0
}

# Unmount the root's /proc, unless something still runs in the root.
maybe_umount_proc() {
    proc_mounted "${ROOT}" || return 0
    if [[ -n "$(root_pids)" ]]; then
        log "processes still run in ${ROOT} ($(root_pids | tr '\n' ' ')); /proc stays mounted"
        return 0
    fi
    umount "${ROOT}/proc" || log "warning: could not unmount ${ROOT}/proc"
}

# Build the root in ROOT.partial and move it into place when it is complete.
build_root() {
    local part="${ROOT}.partial" t0=${SECONDS} ver
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap on the host"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
    fi
    if [[ -e "${part}" ]]; then
        log "removing a half-built root ${part}"
        proc_mounted "${part}" && umount "${part}/proc"
        rm -rf --one-file-system "${part}"
    fi
    mkdir -p "$(dirname "${ROOT}")"
    log "building a Debian ${SUITE} root for RabbitMQ ${SERIES} in ${part} (debootstrap --variant=minbase; a few minutes)"
    debootstrap --variant=minbase "${SUITE}" "${part}" >"${part}.log" 2>&1 ||
        { tail -n 30 "${part}.log" >&2; die "debootstrap failed (whole log: ${part}.log)"; }
    log "debootstrap done ($((SECONDS - t0))s)"
    # No service may start inside the root: the package's postinst would start a node on 5672.
    printf '#!/bin/sh\nexit 101\n' >"${part}/usr/sbin/policy-rc.d"
    chmod 755 "${part}/usr/sbin/policy-rc.d"
    mount_proc "${part}"
    if [[ -n "${APT_SOURCE}" ]]; then
        log "apt source of the root: ${APT_SOURCE}"
        printf '%s\n' "${APT_SOURCE}" >"${part}/etc/apt/sources.list"
        rm -f "${part}"/etc/apt/sources.list.d/*.list "${part}"/etc/apt/sources.list.d/*.sources
    fi
    log "installing rabbitmq-server in the root"
    # Check-Valid-Until=false: sid's Release file as served here is past its Valid-Until date.
    if ! chroot "${part}" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -c 'apt-get -o Acquire::Check-Valid-Until=false update -qq &&
               apt-get install -y -qq --no-install-recommends rabbitmq-server' \
        >>"${part}.log" 2>&1; then
        umount "${part}/proc" || true
        tail -n 30 "${part}.log" >&2
        die "apt-get install rabbitmq-server in the root failed (whole log: ${part}.log)"
    fi
    chroot "${part}" apt-get clean >/dev/null 2>&1 || true
    umount "${part}/proc"
    ver="$(chroot "${part}" dpkg-query -W -f '${Version}' rabbitmq-server)"
    [[ -x "${part}${RMQ_BIN}/rabbitmq-server" ]] || die "the root has no ${RMQ_BIN}/rabbitmq-server"
    echo "rabbitmq-server ${ver}; built $(date -u '+%F %T') in $((SECONDS - t0))s; series ${SERIES}; source ${APT_SOURCE:-debootstrap ${SUITE}}" >"${part}/.amqp-delay-root-ready"
    mv "${part}" "${ROOT}"
    mv "${part}.log" "${ROOT}.build.log" 2>/dev/null || true
    log "root ready: ${ROOT} (rabbitmq-server ${ver}, built in $((SECONDS - t0))s)"
}

# The root, built if missing, with /proc mounted. Serialised with a lock.
ensure_root() {
    mkdir -p "$(dirname "${ROOT}")"
    exec 9>"${ROOT}.lock"
    if ! flock -n 9; then
        log "another caller is building or using the root's lock; waiting"
        flock 9
    fi
    root_ready || build_root
    mount_proc "${ROOT}"
    # Erlang resolves the node's host (localhost) through the root's /etc/hosts. trixie's
    # rabbitmq-server pulls in netbase, which ships one; sid's (4.3) does not, and without it
    # the node's boot fails: "epmd error for host localhost: nxdomain".
    if ! grep -qE '^127\.0\.0\.1[[:space:]].*\blocalhost\b' "${ROOT}/etc/hosts" 2>/dev/null; then
        log "writing ${ROOT}/etc/hosts (127.0.0.1 localhost)"
        printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >>"${ROOT}/etc/hosts"
    fi
    # One cookie for every node of the root, made before any starts (nodes started together
    # would each write a random one of their own).
    if [[ ! -s "${ROOT}${RMQ_HOME}/.erlang.cookie" ]]; then
        log "writing the root's Erlang cookie"
        head -c 15 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr 'a-f' 'A-F' >"${ROOT}${RMQ_HOME}/.erlang.cookie"
        chroot "${ROOT}" chown "${RMQ_USER}:" "${RMQ_HOME}/.erlang.cookie"
        chmod 400 "${ROOT}${RMQ_HOME}/.erlang.cookie"
    fi
    flock -u 9
    exec 9>&-
}

root_version() { sed -nE 's/^rabbitmq-server ([^;]*);.*/\1/p' "${READY}" 2>/dev/null; }

# --- running things in the root ------------------------------------------------

# ctl SECS ARGS... : the root's rabbitmqctl as its rabbitmq user (its cookie), killed after SECS.
# The default node is the single node; -n in ARGS picks another.
ctl() {
    local secs="$1"
    shift
    timeout --kill-after=5 "${secs}" chroot "${ROOT}" runuser -u "${RMQ_USER}" -- \
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="${RMQ_HOME}" LANG=C.UTF-8 \
        RABBITMQ_NODENAME="${NODE}" "${RMQ_BIN}/rabbitmqctl" "$@"
}

plugins() {
    timeout --kill-after=5 120 chroot "${ROOT}" runuser -u "${RMQ_USER}" -- \
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="${RMQ_HOME}" LANG=C.UTF-8 \
        RABBITMQ_NODENAME="${NODE}" RABBITMQ_ENABLED_PLUGINS_FILE="${DIR}/enabled_plugins" \
        "${RMQ_BIN}/rabbitmq-plugins" -n "${NODE}" "$@"
}

epmd_has() { epmd -names 2>/dev/null | grep -qE "^name $1 at port "; }

amqp_probe() {
    timeout 6 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 2
        printf "AMQP\x00\x00\x09\x01" >&3
        IFS= read -r -t 4 -N 1 first <&3 || exit 3
        [[ "$first" == $'"'"'\x01'"'"' || "$first" == A ]]
    ' probe "$1" 2>/dev/null
}

# Make DIR (a path inside the root) a real directory in the root and the same path on the host
# a symlink to it, so that files have one name on both sides.
link_dir() {
    local d="$1"
    mkdir -p "${ROOT}${d}"
    if [[ -L "${d}" ]]; then
        [[ "$(readlink "${d}")" == "${ROOT}${d}" ]] && return 0
        rm -f "${d}"
    elif [[ -e "${d}" ]]; then
        die "${d} exists on the host and is not our symlink into ${ROOT}; remove it"
    fi
    mkdir -p "$(dirname "${d}")"
    ln -s "${ROOT}${d}" "${d}"
}

unlink_dir() {
    local d="$1"
    [[ -L "${d}" ]] && rm -f "${d}"
    [[ -d "${ROOT}${d}" ]] && rm -rf --one-file-system "${ROOT:?}${d}"
    return 0
}

# --- the single node -------------------------------------------------------------

NDIR="${DIR}/node"

node_pid() {
    local pid=""
    [[ -s "${NDIR}/pid" ]] && pid="$(tr -dc '0-9' <"${NDIR}/pid")"
    if [[ -n "${pid}" ]] && [[ "$(cat "/proc/${pid}/comm" 2>/dev/null)" == beam* ]] &&
        tr '\0' '\n' <"/proc/${pid}/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=${NODE}"; then
        echo "${pid}"
    fi
    return 0
}

env_lines() {
    cat <<EOF
RABBITMQ_NODENAME=${NODE}
RABBITMQ_DIST_PORT=${DIST_PORT}
RABBITMQ_CONFIG_FILE=${NDIR}/rabbitmq.conf
RABBITMQ_ADVANCED_CONFIG_FILE=${NDIR}/advanced.config
RABBITMQ_ENABLED_PLUGINS_FILE=${NDIR}/enabled_plugins
RABBITMQ_MNESIA_BASE=${NDIR}/mnesia
RABBITMQ_MNESIA_DIR=${NDIR}/mnesia/${NODE}
RABBITMQ_LOG_BASE=${NDIR}/log
RABBITMQ_PID_FILE=${NDIR}/pid
RABBITMQ_CONF_ENV_FILE=${NDIR}/rabbitmq-env.conf
ERL_EPMD_ADDRESS=127.0.0.1
ERL_FLAGS=-kernel inet_dist_use_interface {127,0,0,1}
EOF
    # RABBITMQ4_PLUGINS_EXTRA: the node's own plugins directory first, then the root's
    if [[ -n "${PLUGINS_EXTRA}" ]]; then
        local d
        d="$(cd "${ROOT}" && ls -d usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins | head -n 1)"
        echo "RABBITMQ_PLUGINS_DIR=${NDIR}/plugins:/${d}"
    fi
}

write_node_files() {
    mkdir -p "${NDIR}/mnesia" "${NDIR}/log"
    cat >"${NDIR}/rabbitmq.conf" <<EOF
# generated by scripts/rabbitmq4.sh
listeners.tcp.default = 127.0.0.1:${AMQP_PORT}
management.tcp.ip = 127.0.0.1
management.tcp.port = ${MGMT_PORT}
vm_memory_high_watermark.absolute = 1GiB
disk_free_limit.absolute = 20MB
log.file.level = info
log.console = false
EOF
    if [[ -n "${RABBITMQ4_CONF_EXTRA:-}" ]]; then
        printf '# from RABBITMQ4_CONF_EXTRA\n%s\n' "${RABBITMQ4_CONF_EXTRA}" >>"${NDIR}/rabbitmq.conf"
    fi
    # The broker settings we ship (deploy/rabbitmq/advanced.config: dead-letter confirm timeout
    # 5 s, prefetch 256). With 4.0.5's default 180 s a message dead-lettered into a full tier
    # (reject-publish) waits that long before it is sent again, where 3.10.8 sends it again at
    # once: tests/it's gateway full-tier test fails on 4.0.5 with the default.
    if [[ -n "${RABBITMQ4_ADVANCED_CONFIG:-}" ]]; then
        printf '%s\n' "${RABBITMQ4_ADVANCED_CONFIG}" >"${NDIR}/advanced.config"
    elif [[ -r "${SCRIPT_DIR}/../deploy/rabbitmq/advanced.config" ]]; then
        cat "${SCRIPT_DIR}/../deploy/rabbitmq/advanced.config" >"${NDIR}/advanced.config"
    else
        echo "[]." >"${NDIR}/advanced.config"
    fi
    echo "[${ENABLED_PLUGINS}]." >"${NDIR}/enabled_plugins"
    if [[ -n "${PLUGINS_EXTRA}" ]]; then
        local p
        mkdir -p "${NDIR}/plugins"
        for p in ${PLUGINS_EXTRA}; do
            [[ -d "${p}/ebin" ]] || die "RABBITMQ4_PLUGINS_EXTRA: ${p} is not a directory plugin (no ebin/)"
            cp -R "${p%/}" "${NDIR}/plugins/"
        done
        chmod -R u+w,a+rX "${NDIR}/plugins"
    fi
    env_lines | sed -E "s/^([A-Z_]+)=(.*)$/\\1='\\2'/" >"${NDIR}/rabbitmq-env.conf"
    # the root's rabbitmq user (its uid differs from the host's)
    chroot "${ROOT}" chown -R "${RMQ_USER}:" "${NDIR}"
    chmod 755 "${ROOT}${DIR}"
}

dump_logs() {
    local f
    f="${NDIR}/startup.log"
    if [[ -s "${f}" ]]; then
        log "---- last lines of ${f} ----"
        tail -n 20 "${f}" >&2 || true
    fi
    f="${NDIR}/log/${NODE}.log"
    if [[ -s "${f}" ]]; then
        log "---- last lines of ${f} ----"
        tail -n 40 "${f}" >&2 || true
    fi
    return 0
}

launch_node() {
    local envs=() line
    while IFS= read -r line; do envs+=("${line}"); done < <(env_lines)
    log "starting ${NODE} from ${ROOT} (AMQP ${AMQP_PORT}, management ${MGMT_PORT}, dist ${DIST_PORT})"
    rm -f "${NDIR}/pid"
    printf '\n==== %s start\n' "$(date '+%F %T')" >>"${NDIR}/startup.log"
    chroot "${ROOT}" chown "${RMQ_USER}:" "${NDIR}/startup.log"
    # In its own session with stdout/stderr in startup.log (boot errors land there), as the
    # root's rabbitmq user, with 20000 open files (quorum queues need ~3 each).
    chroot "${ROOT}" runuser -u "${RMQ_USER}" -- env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        HOME="${RMQ_HOME}" LANG=C.UTF-8 "${envs[@]}" \
        sh -c 'cd "$2" && { ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"; }
               setsid "$0" >>"$1" 2>&1 </dev/null &' \
        "${RMQ_BIN}/rabbitmq-server" "${NDIR}/startup.log" "${NDIR}" ||
        { dump_logs; die "could not launch rabbitmq-server for ${NODE}"; }
}

wait_node() {
    local deadline=$((SECONDS + WAIT_SECS)) start=${SECONDS} err=""
    while :; do
        if amqp_probe "${AMQP_PORT}"; then
            if err="$(ctl 30 -q await_startup --timeout 20 2>&1)"; then
                log "${NODE} is up ($((SECONDS - start))s)"
                return 0
            fi
        else
            err="AMQP port ${AMQP_PORT} does not answer yet"
        fi
        if ((SECONDS >= deadline)); then
            dump_logs
            die "${NODE} did not come up within ${WAIT_SECS}s: $(printf '%s' "${err}" | head -n 3 | tr '\n' ' ')"
        fi
        if ((SECONDS - start > 20)) && ! epmd_has "${SHORT}" && [[ -z "$(node_pid)" ]]; then
            dump_logs
            die "${NODE} is not running (its VM exited during boot)"
        fi
        sleep 1
    done
}

print_info() {
    cat <<EOF
NODE=${NODE}
AMQP_PORT=${AMQP_PORT}
MGMT_PORT=${MGMT_PORT}
AMQP_URL=amqp://guest:guest@127.0.0.1:${AMQP_PORT}/%2f
MGMT_URL=http://guest:guest@127.0.0.1:${MGMT_PORT}/
ROOT=${ROOT}
VERSION=$(root_version)
EOF
}

cmd_up() {
    local t0=${SECONDS}
    ensure_root
    if epmd_has "${SHORT}" && [[ -f "${NDIR}/rabbitmq.conf" ]] && amqp_probe "${AMQP_PORT}"; then
        log "${NODE} is already up"
        print_info
        return 0
    fi
    if epmd_has "${SHORT}" || [[ -n "$(node_pid)" ]]; then
        log "${NODE} runs but is not healthy (or its files are gone); restarting it"
        stop_single
    fi
    unlink_dir "${DIR}"
    link_dir "${DIR}"
    write_node_files
    launch_node
    wait_node
    log "up in $((SECONDS - t0))s"
    print_info
}

stop_single() {
    local pid
    if epmd_has "${SHORT}" || [[ -n "$(node_pid)" ]]; then
        log "stopping ${NODE}"
        if [[ -s "${NDIR}/pid" ]]; then
            ctl 60 -q stop "${NDIR}/pid" >&2 2>/dev/null || true
        else
            ctl 60 -q stop >&2 2>/dev/null || true
        fi
        pid="$(node_pid)"
        if [[ -n "${pid}" ]]; then
            log "${NODE} did not stop in time; kill -9 ${pid} (its own PID)"
            kill -9 "${pid}" 2>/dev/null || true
            sleep 1
        fi
    fi
}

cmd_down() {
    if [[ -d "${ROOT}" ]]; then
        stop_single
        unlink_dir "${DIR}"
        maybe_umount_proc
    fi
    log "down: ${NODE} stopped, ${DIR} removed"
}

# --- the cluster and the TLS node: scripts/cluster.sh and scripts/tls-node.sh with the root ----

cluster_env() {
    cat <<EOF
export CLUSTER_ROOT='${ROOT}'
export CLUSTER_BASE_DIR='${RABBITMQ4_CLUSTER_DIR:-/tmp/amqp-delay-${D_TAG}-cluster}'
export CLUSTER_NODE_PREFIX='${RABBITMQ4_CLUSTER_PREFIX:-${D_NAME}c}'
export CLUSTER_AMQP_PORT_BASE='${RABBITMQ4_CLUSTER_AMQP_BASE:-${D_PORT}50}'
export CLUSTER_DIST_PORT_BASE='${RABBITMQ4_CLUSTER_DIST_BASE:-2${D_PORT}50}'
export CLUSTER_MGMT_PORT_BASE='${RABBITMQ4_CLUSTER_MGMT_BASE:-1${D_PORT}50}'
EOF
}

tls_env() {
    cat <<EOF
export TLS_NODE_ROOT='${ROOT}'
export TLS_NODE_DIR='${RABBITMQ4_TLS_DIR:-/tmp/amqp-delay-${D_TAG}-tls}'
export TLS_NODE_NAME='${RABBITMQ4_TLS_NODE:-${D_NAME}tls@localhost}'
export TLS_NODE_AMQP_PORT='${RABBITMQ4_TLS_AMQP_PORT:-${D_PORT}61}'
export TLS_NODE_AMQPS_PORT='${RABBITMQ4_TLS_AMQPS_PORT:-${D_PORT}62}'
export TLS_NODE_DIST_PORT='${RABBITMQ4_TLS_DIST_PORT:-2${D_PORT}61}'
export TLS_NODE_MGMT_PORT='${RABBITMQ4_TLS_MGMT_PORT:-1${D_PORT}61}'
EOF
}

cmd_env() {
    cluster_env
    tls_env
    cat <<EOF
export RABBITMQ4_SERIES='${SERIES}'
export AMQP_URL='amqp://guest:guest@127.0.0.1:${AMQP_PORT}/%2f'
export TEST_RABBITMQCTL='env RABBITMQ4_SERIES=${SERIES} bash ${SCRIPT_DIR}/rabbitmq4.sh rabbitmqctl'
EOF
}

# Run scripts/cluster.sh or scripts/tls-node.sh with the 4.x variables.
with_env() {
    local script="$1"
    shift
    ensure_root
    eval "$(cluster_env)"
    eval "$(tls_env)"
    local rc=0
    bash "${SCRIPT_DIR}/${script}" "$@" || rc=$?
    return "${rc}"
}

cmd_all_down() {
    root_ready || { log "no root at ${ROOT}; nothing runs from it"; return 0; }
    # cluster.sh and tls-node.sh run rabbitmqctl in the root, which needs /proc
    mount_proc
    (eval "$(cluster_env)" && bash "${SCRIPT_DIR}/cluster.sh" down) || log "warning: cluster down failed"
    (eval "$(tls_env)" && bash "${SCRIPT_DIR}/tls-node.sh" down) || log "warning: TLS node down failed"
    cmd_down
}

usage() {
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "${cmd}" in
    root)
        ensure_root
        echo "${ROOT}"
        ;;
    up) cmd_up ;;
    down) cmd_down ;;
    all-down | all_down) cmd_all_down ;;
    status) root_ready && epmd_has "${SHORT}" && amqp_probe "${AMQP_PORT}" && ctl 30 -q status >/dev/null ;;
    print) print_info ;;
    ctl)
        root_ready || die "no root at ${ROOT}; run: $0 up"
        mount_proc
        ctl 300 -n "${NODE}" "$@"
        ;;
    rabbitmqctl)
        root_ready || die "no root at ${ROOT}; run: $0 up"
        mount_proc
        ctl 300 "$@"
        ;;
    plugins)
        root_ready || die "no root at ${ROOT}; run: $0 up"
        mount_proc
        plugins "$@"
        ;;
    cluster) with_env cluster.sh "$@" ;;
    tls) with_env tls-node.sh "$@" ;;
    env) cmd_env ;;
    series)
        echo "SERIES=${SERIES}"
        echo "ROOT=${ROOT}"
        echo "SUITE=${SUITE}"
        echo "APT_SOURCE=${APT_SOURCE}"
        echo "VERSION=$(root_version)"
        ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
