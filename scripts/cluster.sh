#!/usr/bin/env bash
# scripts/cluster.sh — a throwaway local RabbitMQ cluster for fault tests.
#
# Runs extra RabbitMQ nodes next to the machine's main broker (rabbit@localhost
# on 5672, which this script never touches), all from the Debian package in
# /usr/lib/rabbitmq, each with its own config, data, logs and ports:
#
#   node i (1-based)   ${CLUSTER_NODE_PREFIX}i@localhost   (default adfault1@localhost, ...)
#   AMQP port          CLUSTER_AMQP_PORT_BASE + i           (default 5701, 5702, ...)
#   dist port          CLUSTER_DIST_PORT_BASE + i           (default 25701, 25702, ...)
#   files              CLUSTER_BASE_DIR/<short name>/       (default /tmp/amqp-delay-cluster/adfault1/)
#                        rabbitmq.conf advanced.config enabled_plugins rabbitmq-env.conf
#                        pid mnesia/ log/ startup.log
#
# Usage (as root; non-interactive):
#   cluster.sh [OPTIONS] up [N]     start N nodes (default 3), cluster 2..N onto node 1,
#                                   print "NODE PORT" per node. Idempotent: a healthy cluster
#                                   with the same N and config is only printed; missing or
#                                   dead nodes are started (and joined); a different N or a
#                                   different config tears everything down and rebuilds it.
#   cluster.sh down                 stop every node (by name) and delete CLUSTER_BASE_DIR.
#                                   Safe when nothing is up.
#   cluster.sh status               "NODE PORT up|down" per configured node (exit 1 if any is down
#                                   or no cluster is set up).
#   cluster.sh kill I               kill -9 node I's OS process (PID from its pid file, else
#                                   from `rabbitmqctl eval 'os:getpid().'`, checked against
#                                   the process command line). Waits until it is gone.
#   cluster.sh start I              start node I again (same env/config), wait until it is up
#                                   and running in the cluster again.
#   cluster.sh stop I               graceful stop of node I (rabbitmqctl -n NODE stop).
#   cluster.sh stop-app I           rabbitmqctl -n NODE stop_app
#   cluster.sh start-app I          rabbitmqctl -n NODE start_app, wait until rejoined.
#   cluster.sh restart-all          stop all nodes, start them all again in parallel (in 3.10
#                                   a node restarted after a full stop waits for its peers),
#                                   wait until all are up and clustered; a node that dies
#                                   syncing feature flags with a peer still booting (a 3.10
#                                   race) is started again at once, up to 3 times.
#   cluster.sh ctl I ARGS...        run `rabbitmqctl -n NODE ARGS...` against node I.
#   cluster.sh node I | port I      print node I's name | AMQP port.
#
# Options (before the command) / environment:
#   --conf FILE                 append FILE's lines to every node's rabbitmq.conf (repeatable).
#   CLUSTER_BROKER_CONF_EXTRA   extra rabbitmq.conf lines (newline separated), appended too.
#   --advanced FILE             use FILE as every node's advanced.config.
#   CLUSTER_ADVANCED_CONFIG     same, as a path, or the Erlang terms themselves (text starting
#                               with "[", e.g. "[{rabbit,[{dead_letter_worker_publisher_confirm_timeout,5000}]}].")
#   --dlx-confirm-timeout MS    shorthand: advanced.config with
#   CLUSTER_DLX_CONFIRM_TIMEOUT_MS  {rabbit,[{dead_letter_worker_publisher_confirm_timeout,MS}]}
#                               (3.10's rabbitmq.conf schema has no key for it; a cuttlefish key
#                               would stop the node from booting). Not combinable with --advanced.
#   CLUSTER_WAIT_SECS           how long to wait for a node (default 90).
#   CLUSTER_BASE_DIR, CLUSTER_NODE_PREFIX, CLUSTER_AMQP_PORT_BASE, CLUSTER_DIST_PORT_BASE
#                               layout overrides (defaults above).
#   CLUSTER_MGMT_PORT_BASE      when set, every node runs the management plugin on
#                               127.0.0.1:(CLUSTER_MGMT_PORT_BASE + i). Default: no plugins.
#   CLUSTER_ROOT                run the nodes from the RabbitMQ installed in this root directory
#                               (chroot; scripts/rabbitmq4.sh builds Debian roots with 4.0.5 and 4.3.x
#                               and sets this with its own names and ports: use
#                               `scripts/rabbitmq4.sh cluster ...`). The root's rabbitmq user and
#                               rabbitmqctl are used, /proc must be mounted in it; the node files
#                               live in CLUSTER_ROOT/CLUSTER_BASE_DIR, with CLUSTER_BASE_DIR on
#                               the host a symlink to them. Default: the host's package.
#   The config only takes effect when nodes are (re)built by `up`; `start`/`restart-all`
#   reuse the files written then.
#
# Logs go to stderr; stdout carries only the "NODE PORT" lines (up, status) or the ctl output.

set -euo pipefail

BASE="${CLUSTER_BASE_DIR:-/tmp/amqp-delay-cluster}"
PREFIX="${CLUSTER_NODE_PREFIX:-adfault}"
AMQP_BASE="${CLUSTER_AMQP_PORT_BASE:-5700}"
DIST_BASE="${CLUSTER_DIST_PORT_BASE:-25700}"
WAIT_SECS="${CLUSTER_WAIT_SECS:-90}"
MGMT_BASE="${CLUSTER_MGMT_PORT_BASE:-}"
CROOT="${CLUSTER_ROOT:-}"
CROOT="${CROOT%/}"
RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ_USER=rabbitmq
RMQ_HOME=/var/lib/rabbitmq
HOST=localhost

log() { printf '[cluster.sh] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

# --- names, ports, paths -----------------------------------------------------

short() { echo "${PREFIX}$1"; }
node() { echo "${PREFIX}$1@${HOST}"; }
amqp_port() { echo $((AMQP_BASE + $1)); }
mgmt_port() { echo $((MGMT_BASE + $1)); }
dist_port() { echo $((DIST_BASE + $1)); }
ndir() { echo "${BASE}/$(short "$1")"; }

# Node count recorded by `up`.
count() {
    if [[ -s "${BASE}/count" ]]; then cat "${BASE}/count"; else echo 0; fi
}

check_index() {
    local i="${1:-}" n
    [[ "${i}" =~ ^[1-9][0-9]*$ ]] || die "expected a node index (1..N), got '${i}'"
    n="$(count)"
    ((n > 0)) || die "no cluster set up (${BASE}/count missing); run: $0 up"
    ((i <= n)) || die "node index ${i} out of range 1..${n}"
}

# --- running things as the rabbitmq user -------------------------------------

# Prefix that runs a command as the rabbitmq user (so rabbitmqctl finds the shared cookie
# in /var/lib/rabbitmq/.erlang.cookie).
# IN: prefix that runs a command in the root the nodes come from (empty: the host).
IN=()
if [[ -n "${CROOT}" ]]; then
    [[ "$(id -u)" -eq 0 ]] || die "CLUSTER_ROOT needs root (chroot)"
    [[ -x "${CROOT}${RMQ_BIN}/rabbitmq-server" ]] || die "no RabbitMQ in CLUSTER_ROOT=${CROOT}"
    mountpoint -q "${CROOT}/proc" || die "/proc is not mounted in ${CROOT} (scripts/rabbitmq4.sh mounts it)"
    IN=(chroot "${CROOT}")
    RUNUSER=("${IN[@]}" runuser -u "${RMQ_USER}" --)
elif [[ "$(id -u)" -eq 0 ]]; then
    RUNUSER=(runuser -u "${RMQ_USER}" --)
elif [[ "$(id -un)" == "${RMQ_USER}" ]]; then
    RUNUSER=()
else
    die "run as root (or as ${RMQ_USER})"
fi

# ctl SECS NODE ARGS... : rabbitmqctl against NODE, killed after SECS.
ctl() {
    local secs="$1" nodename="$2"
    shift 2
    (cd / && timeout --kill-after=5 "${secs}" \
        "${RUNUSER[@]}" env HOME="${RMQ_HOME}" "${RMQ_BIN}/rabbitmqctl" -q -n "${nodename}" "$@")
}

# Is NAME (short name) registered with epmd? Cheap check, no Erlang VM started.
epmd_has() {
    epmd -names 2>/dev/null | grep -qE "^name $1 at port "
}

# Short names of our nodes registered with epmd.
epmd_ours() {
    epmd -names 2>/dev/null | sed -nE "s/^name (${PREFIX}[0-9]+) at port .*/\1/p"
}

# AMQP 0-9-1 answers on 127.0.0.1:PORT (connection.start frame or protocol header back).
amqp_probe() {
    timeout 6 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 2
        printf "AMQP\x00\x00\x09\x01" >&3
        IFS= read -r -t 4 -N 1 first <&3 || exit 3
        [[ "$first" == $'"'"'\x01'"'"' || "$first" == A ]]
    ' probe "$1" 2>/dev/null
}

# OS PID of node I's VM, or nothing. Only a PID whose command line names the node counts.
node_pid() {
    local i="$1" d pid=""
    d="$(ndir "$i")"
    if [[ -s "${d}/pid" ]]; then
        pid="$(tr -dc '0-9' <"${d}/pid")"
    fi
    if [[ -z "${pid}" ]] || ! pid_is_node "${pid}" "$i"; then
        pid=""
        if epmd_has "$(short "$i")"; then
            pid="$(ctl 20 "$(node "$i")" eval 'os:getpid().' 2>/dev/null | tr -dc '0-9' || true)"
            [[ -n "${pid}" ]] && ! pid_is_node "${pid}" "$i" && pid=""
        fi
    fi
    [[ -n "${pid}" ]] && echo "${pid}"
    return 0
}

# True when PID is node I's Erlang VM: a beam process started with RABBITMQ_NODENAME=<node>
# (3.10 sets the node name at runtime, so it is not on the command line).
pid_is_node() {
    local pid="$1" i="$2"
    [[ "$(cat "/proc/${pid}/comm" 2>/dev/null)" == beam* ]] || return 1
    tr '\0' '\n' <"/proc/${pid}/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=$(node "$i")"
}

# --- config ------------------------------------------------------------------

CONF_FILES=()
ADVANCED_FILE=""
DLX_TIMEOUT="${CLUSTER_DLX_CONFIRM_TIMEOUT_MS:-}"

# The shared part of rabbitmq.conf (everything but the listeners), and advanced.config.
desired_conf() {
    cat <<'EOF'
# generated by scripts/cluster.sh
vm_memory_high_watermark.absolute = 512MiB
disk_free_limit.absolute = 20MB
log.file.level = info
log.console = false
EOF
    local f
    for f in "${CONF_FILES[@]}"; do
        echo "# from ${f}"
        cat "${f}"
        echo
    done
    if [[ -n "${CLUSTER_BROKER_CONF_EXTRA:-}" ]]; then
        echo "# from CLUSTER_BROKER_CONF_EXTRA"
        printf '%s\n' "${CLUSTER_BROKER_CONF_EXTRA}"
    fi
}

desired_advanced() {
    local adv="${ADVANCED_FILE:-${CLUSTER_ADVANCED_CONFIG:-}}"
    if [[ -n "${adv}" && -n "${DLX_TIMEOUT}" ]]; then
        die "--dlx-confirm-timeout/CLUSTER_DLX_CONFIRM_TIMEOUT_MS cannot be combined with an advanced.config; put {dead_letter_worker_publisher_confirm_timeout, MS} into that file"
    fi
    if [[ -n "${DLX_TIMEOUT}" ]]; then
        [[ "${DLX_TIMEOUT}" =~ ^[0-9]+$ ]] || die "DLX confirm timeout must be milliseconds, got '${DLX_TIMEOUT}'"
        echo "[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, ${DLX_TIMEOUT}}]}]."
    elif [[ -z "${adv}" ]]; then
        echo "[]."
    elif [[ "${adv}" == \[* ]]; then
        printf '%s\n' "${adv}"
    else
        [[ -r "${adv}" ]] || die "advanced config file not readable: ${adv}"
        cat "${adv}"
    fi
}

# Signature of what `up` would build: N + config. A different one means rebuild.
desired_signature() {
    {
        echo "N=$1 prefix=${PREFIX} amqp=${AMQP_BASE} dist=${DIST_BASE} mgmt=${MGMT_BASE} root=${CROOT}"
        desired_conf
        echo "---"
        desired_advanced
    } | sha256sum | cut -d' ' -f1
}

write_node_files() {
    local i="$1" d
    d="$(ndir "$i")"
    mkdir -p "${d}/mnesia" "${d}/log"
    {
        desired_conf
        echo "# per node"
        # RABBITMQ_CONFIG_FILE points here, so the shared /etc/rabbitmq/rabbitmq.conf (with
        # listeners.tcp.local = 127.0.0.1:5672) is not read. (Setting both .default and .local
        # to the same address fails the boot with {could_not_start_listener,..,already_started}.)
        echo "listeners.tcp.default = 127.0.0.1:$(amqp_port "$i")"
    } >"${d}/rabbitmq.conf"
    desired_advanced >"${d}/advanced.config"
    if [[ -n "${MGMT_BASE}" ]]; then
        {
            echo "management.tcp.ip = 127.0.0.1"
            echo "management.tcp.port = $(mgmt_port "$i")"
        } >>"${d}/rabbitmq.conf"
        echo "[rabbitmq_management]." >"${d}/enabled_plugins"
    else
        echo "[]." >"${d}/enabled_plugins"
    fi
    # Our own env file: otherwise /etc/rabbitmq/rabbitmq-env.conf (NODENAME=rabbit@localhost)
    # would be sourced. Variables given in the environment win over this file; we set both.
    env_lines "$i" | sed -E "s/^([A-Z_]+)=(.*)$/\\1='\\2'/" >"${d}/rabbitmq-env.conf"
    "${IN[@]}" chown -R "${RMQ_USER}:" "${d}" 2>/dev/null || true
    chmod 755 "${BASE}"
}

# KEY=VALUE lines for node I.
env_lines() {
    local i="$1" d
    d="$(ndir "$i")"
    cat <<EOF
RABBITMQ_NODENAME=$(node "$i")
RABBITMQ_DIST_PORT=$(dist_port "$i")
RABBITMQ_CONFIG_FILE=${d}/rabbitmq.conf
RABBITMQ_ADVANCED_CONFIG_FILE=${d}/advanced.config
RABBITMQ_ENABLED_PLUGINS_FILE=${d}/enabled_plugins
RABBITMQ_MNESIA_BASE=${d}/mnesia
RABBITMQ_MNESIA_DIR=${d}/mnesia/$(node "$i")
RABBITMQ_LOG_BASE=${d}/log
RABBITMQ_PID_FILE=${d}/pid
RABBITMQ_CONF_ENV_FILE=${d}/rabbitmq-env.conf
ERL_EPMD_ADDRESS=127.0.0.1
ERL_FLAGS=-kernel inet_dist_use_interface {127,0,0,1}
EOF
}

# BASE: a directory on the host, or with CLUSTER_ROOT a directory in the root and the same
# path on the host a symlink to it (one name for the files inside and outside the root).
# With a root, BASE and its twin in the root are deleted on down: never / or a top-level
# directory.
if [[ -n "${CROOT}" && ! "${BASE}" =~ ^/[^/]+/[^/]+ ]]; then
    die "CLUSTER_BASE_DIR must be an absolute path at least two levels deep with a root, got '${BASE}'"
fi

make_base() {
    if [[ -z "${CROOT}" ]]; then
        mkdir -p "${BASE}"
        return 0
    fi
    mkdir -p "${CROOT}${BASE}"
    if [[ -L "${BASE}" ]]; then
        [[ "$(readlink "${BASE}")" == "${CROOT}${BASE}" ]] && return 0
        rm -f "${BASE}"
    elif [[ -e "${BASE}" ]]; then
        die "${BASE} exists on the host and is not a symlink into ${CROOT}; remove it"
    fi
    mkdir -p "$(dirname "${BASE}")"
    ln -s "${CROOT}${BASE}" "${BASE}"
}

remove_base() {
    if [[ -n "${CROOT}" ]]; then
        [[ -L "${BASE}" ]] && rm -f "${BASE}"
        rm -rf --one-file-system "${CROOT:?}${BASE}"
    else
        rm -rf "${BASE}"
    fi
}

# --- node lifecycle ----------------------------------------------------------

node_log() { echo "$(ndir "$1")/log/$(node "$1").log"; }

dump_logs() {
    local i="$1" d f section
    d="$(ndir "$i")"
    f="${d}/startup.log"
    if [[ -s "${f}" ]]; then
        # Only the output of the latest start; its first errors say why a boot failed.
        section="$(awk '/^==== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "${f}")"
        if grep -q '\[error\]' <<<"${section}"; then
            log "---- first errors in ${f} ----"
            grep -m 12 '\[error\]' <<<"${section}" >&2 || true
        fi
        log "---- last lines of ${f} ----"
        tail -n 15 <<<"${section}" >&2 || true
    fi
    f="$(node_log "$i")"
    if [[ -s "${f}" ]]; then
        log "---- last lines of ${f} ----"
        tail -n 40 "${f}" >&2 || true
    fi
}

# The lines node I's VM wrote to startup.log since its last launch.
last_start_log() {
    awk '/^==== .* start$/ { buf = "" } { buf = buf $0 "\n" } END { printf "%s", buf }' \
        "$(ndir "$1")/startup.log" 2>/dev/null
}

# Launch node I's VM (detached). Does not wait.
launch_node() {
    local i="$1" d envs=() line
    d="$(ndir "$i")"
    [[ -f "${d}/rabbitmq.conf" ]] || die "node $i has no files in ${d}; run: $0 up"
    while IFS= read -r line; do envs+=("${line}"); done < <(env_lines "$i")
    log "starting $(node "$i") (AMQP $(amqp_port "$i"), dist $(dist_port "$i"))"
    rm -f "${d}/pid"
    printf '\n==== %s start\n' "$(date '+%F %T')" >>"${d}/startup.log"
    "${IN[@]}" chown "${RMQ_USER}:" "${d}/startup.log"
    # The main broker's file-descriptor limit is 1024; raise ours (hard limit of the user).
    # Not `rabbitmq-server -detached`: a detached VM's stdout goes nowhere, so a node that dies
    # early in boot (e.g. an unknown rabbitmq.conf key) leaves nothing but erl_crash.dump.
    # Instead the server runs in the background in its own session with stdout/stderr in
    # startup.log; its VM writes RABBITMQ_PID_FILE as with -detached.
    (cd "${d}" && "${RUNUSER[@]}" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        HOME="${RMQ_HOME}" LANG=C.UTF-8 "${envs[@]}" \
        sh -c 'cd "$2" 2>/dev/null; ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
               setsid "$0" >>"$1" 2>&1 </dev/null &' \
        "${RMQ_BIN}/rabbitmq-server" "${d}/startup.log" "${d}") ||
        { dump_logs "$i"; die "could not launch rabbitmq-server for $(node "$i")"; }
}

# Wait until node I answers AMQP and `rabbitmqctl await_startup`.
wait_node() {
    local i="$1" deadline=$((SECONDS + WAIT_SECS)) start=${SECONDS} err="" n
    n="$(node "$i")"
    while :; do
        if amqp_probe "$(amqp_port "$i")"; then
            if err="$(ctl 20 "$n" await_startup --timeout 15 2>&1)"; then
                log "$n is up ($((SECONDS - start))s)"
                return 0
            fi
        else
            err="AMQP port $(amqp_port "$i") does not answer yet"
        fi
        if ((SECONDS >= deadline)); then
            dump_logs "$i"
            die "$n did not come up within ${WAIT_SECS}s: $(printf '%s' "${err}" | head -n 3 | tr '\n' ' ')"
        fi
        # A VM that died during boot: no point in waiting the whole time.
        if ((SECONDS - start > 15)) && ! epmd_has "$(short "$i")" && [[ -z "$(node_pid "$i")" ]]; then
            dump_logs "$i"
            die "$n is not running (its VM exited during boot)"
        fi
        sleep 1
    done
}

node_up() {
    local i="$1"
    epmd_has "$(short "$i")" && amqp_probe "$(amqp_port "$i")"
}

# Erlang list of running cluster members as seen by node I, one per line. (4.x: rabbit_nodes,
# which is right with Khepri too; 3.10 has only rabbit_mnesia's.)
running_members() {
    ctl 30 "$(node "$1")" eval 'case erlang:function_exported(rabbit_nodes, list_running, 0) of true -> rabbit_nodes:list_running(); false -> rabbit_mnesia:cluster_nodes(running) end.' 2>/dev/null |
        tr -d "[]' \n" | tr ',' '\n' | grep -v '^$' || true
}
all_members() {
    ctl 30 "$(node "$1")" eval 'case erlang:function_exported(rabbit_nodes, list_members, 0) of true -> rabbit_nodes:list_members(); false -> rabbit_mnesia:cluster_nodes(all) end.' 2>/dev/null |
        tr -d "[]' \n" | tr ',' '\n' | grep -v '^$' || true
}

# Does node 1 see nodes 1..N as running cluster members?
all_running_on_first() {
    local n="$1" members j
    members="$(running_members 1)"
    for ((j = 1; j <= n; j++)); do
        grep -qx "$(node "$j")" <<<"${members}" || return 1
    done
}

# Make node I (>1) a member of node 1's cluster if it is not one yet.
join_node() {
    local i="$1" n first
    n="$(node "$i")"
    first="$(node 1)"
    if all_members 1 | grep -qx "$n"; then
        return 0
    fi
    log "joining $n to ${first}"
    local out step
    for step in stop_app reset "join_cluster ${first}" start_app; do
        # shellcheck disable=SC2086  # "join_cluster NODE" is two words on purpose
        if ! out="$(ctl 120 "$n" ${step} 2>&1)"; then
            printf '%s\n' "${out}" >&2
            dump_logs "$i"
            die "rabbitmqctl -n $n ${step} failed"
        fi
    done
    wait_node "$i"
}

# Wait until node I is running and sees every member of the cluster as running
# (all nodes whose VM is up).
wait_rejoined() {
    local i="$1" n deadline=$((SECONDS + WAIT_SECS)) want j members missing
    n="$(node "$i")"
    want="$(count)"
    while :; do
        members="$(running_members "$i")"
        missing=""
        for ((j = 1; j <= want; j++)); do
            if epmd_has "$(short "$j")" && ! grep -qx "$(node "$j")" <<<"${members}"; then
                missing+=" $(node "$j")"
            fi
        done
        if [[ -z "${missing}" ]] && grep -qx "$n" <<<"${members}"; then
            return 0
        fi
        if ((SECONDS >= deadline)); then
            dump_logs "$i"
            die "$n did not rejoin within ${WAIT_SECS}s (running members seen: $(tr '\n' ' ' <<<"${members}"); missing:${missing})"
        fi
        sleep 2
    done
}

stop_node() {
    local i="$1" n d pid
    n="$(node "$i")"
    d="$(ndir "$i")"
    if ! epmd_has "$(short "$i")"; then
        pid="$(node_pid "$i")"
        if [[ -z "${pid}" ]]; then
            log "$n is not running"
            return 0
        fi
    fi
    log "stopping $n"
    if [[ -s "${d}/pid" ]]; then
        # With a pid file, `stop` also waits for the OS process to exit.
        ctl 60 "$n" stop "${d}/pid" >&2 2>/dev/null || true
    else
        ctl 60 "$n" stop >&2 2>/dev/null || true
    fi
    # Still there (hung)? Kill it, by its own PID.
    pid="$(node_pid "$i")"
    if [[ -n "${pid}" ]]; then
        log "$n did not stop in time; kill -9 ${pid}"
        kill -9 "${pid}" 2>/dev/null || true
        wait_pid_gone "${pid}"
    fi
}

wait_pid_gone() {
    local pid="$1" t
    for ((t = 0; t < 100; t++)); do
        [[ -d "/proc/${pid}" ]] || return 0
        sleep 0.1
    done
    log "warning: PID ${pid} still exists"
}

print_nodes() {
    local n i
    n="$(count)"
    for ((i = 1; i <= n; i++)); do
        echo "$(node "$i") $(amqp_port "$i")"
    done
}

# --- commands ----------------------------------------------------------------

cmd_up() {
    local n="${1:-3}" sig i healthy=1 pids=() p
    [[ "${n}" =~ ^[1-9][0-9]*$ ]] || die "up: N must be a positive integer, got '${n}'"
    ((n <= 9)) || die "up: at most 9 nodes"
    [[ "$(id -u)" -eq 0 ]] || die "up must run as root"
    sig="$(desired_signature "$n")"

    if [[ -d "${BASE}" ]]; then
        if [[ "$(cat "${BASE}/signature" 2>/dev/null)" != "${sig}" ]]; then
            log "existing cluster in ${BASE} has a different size or config; rebuilding it"
            cmd_down
        fi
    fi
    # Nodes of ours that run without files (e.g. the dir was deleted by hand) would hold the ports.
    if [[ ! -d "${BASE}" ]] && [[ -n "$(epmd_ours)" ]]; then
        log "nodes $(epmd_ours | tr '\n' ' ')are registered but ${BASE} is gone; stopping them"
        cmd_down
    fi

    if [[ ! -d "${BASE}" ]]; then
        make_base
        echo "${n}" >"${BASE}/count"
        for ((i = 1; i <= n; i++)); do write_node_files "$i"; done
        echo "${sig}" >"${BASE}/signature"
    fi

    # Start whatever is not running, in parallel (nodes that stopped together wait for each other).
    for ((i = 1; i <= n; i++)); do
        if ! epmd_has "$(short "$i")"; then
            healthy=0
            launch_node "$i"
        fi
    done
    for ((i = 1; i <= n; i++)); do
        wait_node "$i" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do
        wait "$p" || exit 1
    done
    if ((n > 1)) && ! all_running_on_first "$n"; then
        healthy=0
        for ((i = 2; i <= n; i++)); do join_node "$i"; done
        for ((i = 1; i <= n; i++)); do wait_rejoined "$i"; done
    fi
    ((healthy)) && log "cluster was already up"
    print_nodes
}

cmd_down() {
    local names=() s i d seen=" " pids=() p
    if [[ -d "${BASE}" ]]; then
        for d in "${BASE}/${PREFIX}"*; do
            [[ -d "$d" ]] || continue
            s="$(basename "$d")"
            [[ "$s" =~ ^${PREFIX}[0-9]+$ ]] && names+=("$s")
        done
    fi
    while IFS= read -r s; do [[ -n "$s" ]] && names+=("$s"); done < <(epmd_ours)
    for s in "${names[@]}"; do
        [[ "${seen}" == *" ${s} "* ]] && continue
        seen+="${s} "
        i="${s#"${PREFIX}"}"
        stop_node "$i" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    remove_base
    if [[ "${seen}" == " " ]]; then log "down: no nodes were running; removed ${BASE}"; else log "down: stopped${seen% } and removed ${BASE}"; fi
}

cmd_kill() {
    local i="$1" pid
    check_index "$i"
    pid="$(node_pid "$i")"
    [[ -n "${pid}" ]] || die "$(node "$i") has no running OS process"
    log "kill -9 ${pid} ($(node "$i"))"
    kill -9 "${pid}"
    wait_pid_gone "${pid}"
    # epmd drops the name when the VM's connection to it closes.
    for _ in $(seq 50); do epmd_has "$(short "$i")" || break; sleep 0.1; done
}

cmd_start() {
    local i="$1"
    check_index "$i"
    if ! epmd_has "$(short "$i")"; then
        launch_node "$i"
    else
        log "$(node "$i") is already running"
    fi
    wait_node "$i"
    (($(count) > 1)) && wait_rejoined "$i"
    echo "$(node "$i") $(amqp_port "$i")"
}

cmd_stop() {
    check_index "$1"
    stop_node "$1"
}

cmd_stop_app() {
    check_index "$1"
    ctl 120 "$(node "$1")" stop_app >&2
}

cmd_start_app() {
    local i="$1"
    check_index "$i"
    ctl 180 "$(node "$i")" start_app >&2
    wait_node "$i"
    (($(count) > 1)) && wait_rejoined "$i"
    return 0
}

cmd_restart_all() {
    local n i pids=() p
    n="$(count)"
    ((n > 0)) || die "no cluster set up; run: $0 up"
    for ((i = 1; i <= n; i++)); do
        stop_node "$i" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    for ((i = 1; i <= n; i++)); do launch_node "$i"; done
    wait_all_relaunching "$n"
    if ((n > 1)); then
        for ((i = 1; i <= n; i++)); do wait_rejoined "$i"; done
    fi
    print_nodes
}

# Wait until nodes 1..N are all up, polling them together. RabbitMQ 3.10: a node that syncs its
# feature flags with a peer still booting can die with `incompatible_feature_flags`
# ({badmap,undefined}), and after a full stop its peers wait for it, so it is started again at
# once (up to 3 times per node) rather than after the others' wait. Any other death, or no
# cluster within 2 x CLUSTER_WAIT_SECS, stands.
wait_all_relaunching() {
    local n="$1" i deadline=$((SECONDS + 2 * WAIT_SECS)) start=${SECONDS} pending
    local -a up=() tries=() since=()
    for ((i = 1; i <= n; i++)); do
        up[i]=0
        tries[i]=0
        since[i]=${SECONDS}
    done
    while :; do
        pending=0
        for ((i = 1; i <= n; i++)); do
            ((up[i])) && continue
            if amqp_probe "$(amqp_port "$i")" && ctl 20 "$(node "$i")" await_startup --timeout 5 >/dev/null 2>&1; then
                up[i]=1
                log "$(node "$i") is up ($((SECONDS - start))s)"
                continue
            fi
            pending=1
            if ((SECONDS - since[i] > 10)) && ! epmd_has "$(short "$i")" && [[ -z "$(node_pid "$i")" ]]; then
                if [[ "$(last_start_log "$i")" == *incompatible_feature_flags* ]] && ((tries[i] < 3)); then
                    tries[i]=$((tries[i] + 1))
                    log "$(node "$i") died syncing feature flags with a booting peer; starting it again (${tries[i]}/3)"
                    launch_node "$i"
                    since[i]=${SECONDS}
                else
                    dump_logs "$i"
                    die "$(node "$i") is not running (its VM exited during boot)"
                fi
            fi
        done
        ((pending)) || return 0
        if ((SECONDS >= deadline)); then
            for ((i = 1; i <= n; i++)); do ((up[i])) || dump_logs "$i"; done
            die "the cluster did not come back within $((2 * WAIT_SECS))s"
        fi
        sleep 1
    done
}

cmd_status() {
    local n i rc=0 st
    n="$(count)"
    if ((n == 0)); then
        log "no cluster set up (${BASE}/count missing)"
        return 1
    fi
    for ((i = 1; i <= n; i++)); do
        if node_up "$i"; then st=up; else st=down; rc=1; fi
        echo "$(node "$i") $(amqp_port "$i") ${st}"
    done
    return "${rc}"
}

usage() {
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --conf)
            [[ -r "${2:-}" ]] || die "--conf needs a readable file"
            CONF_FILES+=("$2")
            shift 2
            ;;
        --advanced)
            [[ -r "${2:-}" ]] || die "--advanced needs a readable file"
            ADVANCED_FILE="$2"
            shift 2
            ;;
        --dlx-confirm-timeout)
            DLX_TIMEOUT="${2:-}"
            shift 2
            ;;
        -h | --help) usage ;;
        --*) die "unknown option $1" ;;
        *) break ;;
    esac
done

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "${cmd}" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    kill) cmd_kill "${1:-}" ;;
    start) cmd_start "${1:-}" ;;
    stop) cmd_stop "${1:-}" ;;
    stop-app | stop_app) cmd_stop_app "${1:-}" ;;
    start-app | start_app) cmd_start_app "${1:-}" ;;
    restart-all | restart_all) cmd_restart_all ;;
    ctl)
        check_index "${1:-}"
        i="$1"
        shift
        ctl 300 "$(node "$i")" "$@"
        ;;
    node) check_index "${1:-}" && node "$1" ;;
    port) check_index "${1:-}" && amqp_port "$1" ;;
    *) usage ;;
esac
