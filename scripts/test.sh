#!/usr/bin/env bash
# scripts/test.sh — THE test command for amqp-delay.
#
#   ./scripts/test.sh [CARGO_TEST_ARGS...]
#   ./scripts/test.sh --broker-only
#
# What it does, in order:
#   1. Makes sure a RabbitMQ broker answers AMQP 0-9-1 at $AMQP_URL
#      (default amqp://guest:guest@127.0.0.1:5672/%2f). If nothing answers
#      there and the URL points at this machine, it brings a broker up, trying
#      in this order:
#        a) something already answers AMQP on the port   -> use it as is
#        b) a usable Docker engine (`docker info` works)
#           and ./docker-compose.yml exists               -> docker compose up -d rabbitmq
#        c) `rabbitmq-server` is installed                -> rabbitmq-server -detached
#        d) running as root with apt-get                  -> apt-get install rabbitmq-server,
#                                                            then as in c)
#        e) otherwise                                     -> explain what to install, exit 1
#      and then waits (up to $BROKER_WAIT_SECS, default 120 s) until the broker
#      really answers the AMQP protocol header, not just until a process exists.
#   2. Makes sure Python 3 can `import pika`, Node has `amqplib` and a JDK has Debian's
#      RabbitMQ Java client (the integration tests drive Python, Node and Java AMQP clients as
#      independent peers).
#   3. Runs `cargo test "$@"` (unit, integration and doc tests, the benchmark's smoke test,
#      bench/tests/smoke.rs, the fault suite, tests/fault, which starts its own 3-node
#      cluster with scripts/cluster.sh, and tests/runbooks, MIGRATING's runbooks and the
#      README's quick start run as written, on nodes of scripts/runbook-nodes.sh and the main
#      broker) with AMQP_URL exported: the suites on the machine's RabbitMQ (Debian 12's 3.10.8).
#   4. Runs the broker suites again on each RabbitMQ 4.x series, one after the other, each from
#      the root that scripts/rabbitmq4.sh builds once and caches outside the clone:
#        4.0  Debian 13's 4.0.5 (RABBITMQ4_SERIES=4.0; single node AMQP 5741, TLS node 5761/5762,
#             cluster 5751..5753)
#        4.3  Debian sid's 4.3.x (RABBITMQ4_SERIES=4.3; single node 5841, TLS node 5861/5862,
#             cluster 5851..5853; Khepri is its metadata store)
#      the integration suite and the benchmark's smoke test (a tiny delay-bench run, under a
#      minute) against the series' single node (the TLS and permission tests on its TLS node),
#      the fault suite on its 3-node cluster. Without arguments that is `cargo test --test it
#      --test fault --test smoke -- --skip _on_3_10 --skip _on_4_0` (unit, doc and
#      deploy tests need no broker and ran in step 3; so did the import tests that copy within
#      the plugin's own nodes, the same whatever the series, and tests/runbooks, whose brokers
#      are 3.10 nodes of its own whatever the series); with arguments, `cargo test "$@"` again. A series' nodes are stopped
#      before the next series starts.
#   Exits non-zero when any run failed. Every run happens even if an earlier one fails, and each
#   runs every test binary (--no-fail-fast: a failing fault suite does not hide the
#   integration suite's results). The last lines say how long each run took.
#   On exit, whatever happened, stops the throwaway nodes the tests may have started
#   (`scripts/cluster.sh down`, `scripts/tls-node.sh down`, `scripts/plugin-node.sh 3.10|4.0 down`,
#   `scripts/runbook-nodes.sh all down`, `scripts/rabbitmq4.sh all-down` of each series); the main
#   broker is left running.
#
# Options / environment:
#   --broker-only        (first argument) stop after step 1: only make sure the
#                        broker is up. Same as BROKER_ONLY=1.
#   AMQP_URL             broker the tests use in step 3; exported to cargo test.
#   TEST_BROKERS         which runs, in order (default "3.10 4.0 4.3"): 3.10 is steps 1-3, 4.0
#                        and 4.3 (4 means 4.0) a run of step 4 each; the main broker is not
#                        needed without 3.10. A 4.x entry may name its suites after a colon,
#                        comma separated (it, fault, smoke), e.g. "3.10 4.0:fault 4.3" runs only the
#                        fault suite on 4.0.5 (`cargo test --test fault`; ignored when
#                        arguments are given).
#   BROKER_WAIT_SECS     how long to wait for the broker to come up (default 120).
#   RUST_TEST_THREADS    tests run at once in each suite (default 4: most of a test waits on
#                        the broker; the fault and runbook suites take a lock per test anyway).
#   Anything else (RUST_BACKTRACE, RUST_LOG, ...) passes through to cargo test.
#
# Needs bash (for /dev/tcp) and coreutils `timeout`. Runs unattended in CI
# (CI=true, no stdin, as root).

set -euo pipefail

# --- setup -------------------------------------------------------------------

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"
cd "${REPO_ROOT}"

BROKER_ONLY="${BROKER_ONLY:-0}"
if [[ "${1:-}" == "--broker-only" ]]; then
    BROKER_ONLY=1
    shift
fi

: "${AMQP_URL:=amqp://guest:guest@127.0.0.1:5672/%2f}"
export AMQP_URL
BROKER_WAIT_SECS="${BROKER_WAIT_SECS:-120}"

# Last error seen by a probe; printed when we give up.
LAST_ERR=""
# Set once `apt-get update` has run in this invocation.
APT_UPDATED=0

log() { printf '[test.sh] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }
is_root() { [[ "$(id -u)" -eq 0 ]]; }

# --- where is the broker? ----------------------------------------------------

# Split AMQP_URL (amqp[s]://[user[:pass]@]host[:port][/vhost][?query]) into
# BROKER_SCHEME, BROKER_HOST and BROKER_PORT.
parse_amqp_url() {
    local rest hostport
    BROKER_SCHEME="${AMQP_URL%%://*}"
    rest="${AMQP_URL#*://}"
    hostport="${rest%%/*}"        # drop /vhost
    hostport="${hostport%%\?*}"   # drop ?query (when there is no vhost)
    hostport="${hostport##*@}"    # drop user:pass@
    if [[ "${hostport}" == \[* ]]; then
        # IPv6 literal: [::1]:5672
        BROKER_HOST="${hostport#\[}"
        BROKER_HOST="${BROKER_HOST%%\]*}"
        rest="${hostport#*\]}"
        BROKER_PORT="${rest#:}"
    elif [[ "${hostport}" == *:* ]]; then
        BROKER_HOST="${hostport%%:*}"
        BROKER_PORT="${hostport##*:}"
    else
        BROKER_HOST="${hostport}"
        BROKER_PORT=""
    fi
    [[ -n "${BROKER_HOST}" ]] || BROKER_HOST="localhost"
    if [[ -z "${BROKER_PORT}" ]]; then
        if [[ "${BROKER_SCHEME}" == "amqps" ]]; then BROKER_PORT=5671; else BROKER_PORT=5672; fi
    fi
    [[ "${BROKER_PORT}" =~ ^[0-9]+$ ]] || die "cannot parse a port out of AMQP_URL=${AMQP_URL}"
}

# True when BROKER_HOST is this machine, i.e. a broker we may start ourselves.
broker_is_local() {
    case "${BROKER_HOST}" in
        localhost | 127.* | ::1 | 0.0.0.0) return 0 ;;
        *) return 1 ;;
    esac
}

# --- probes ------------------------------------------------------------------

# Succeeds when an AMQP 0-9-1 server answers on BROKER_HOST:BROKER_PORT: we
# send the protocol header and expect either a frame (first byte 0x01, the
# METHOD frame carrying connection.start) or the server's own protocol header
# ("AMQP...", sent on a version mismatch: still an AMQP server). For amqps we
# can only check that the TCP port accepts connections. On failure the reason
# is left in LAST_ERR.
amqp_probe() {
    local out
    # The inner script runs in its own bash under `timeout`, so a connect or
    # read that hangs cannot hang us. Arguments: $1 host, $2 port, $3 scheme,
    # $4 the byte 0x01 (passed in to keep the quoting readable).
    # shellcheck disable=SC2016  # expanded by the inner bash, on purpose
    if out="$(timeout 8 bash -c '
            exec 3<>"/dev/tcp/$1/$2" || exit 2
            [[ "$3" == "amqps" ]] && exit 0
            printf "AMQP\x00\x00\x09\x01" >&3
            first=""
            if ! IFS= read -r -t 5 -N 1 first <&3; then
                echo "port $2 accepted the connection but sent no AMQP reply"
                exit 3
            fi
            if [[ "$first" == "$4" || "$first" == A ]]; then
                exit 0
            fi
            echo "port $2 answered, but not with AMQP 0-9-1"
            exit 4
        ' amqp-probe "${BROKER_HOST}" "${BROKER_PORT}" "${BROKER_SCHEME}" $'\x01' 2>&1)"; then
        return 0
    fi
    # Keep one line: bash reports a refused connect twice, prefixed "amqp-probe: line N:".
    out="$(printf '%s\n' "${out}" | head -n 1 | sed -E 's/^amqp-probe: (line [0-9]+: )?//')"
    LAST_ERR="AMQP probe of ${BROKER_HOST}:${BROKER_PORT}: ${out:-timed out}"
    return 1
}

# Print the tail of the local broker's logs (best effort) to help diagnose a
# broker that never came up.
dump_broker_logs() {
    local f
    for f in /var/log/rabbitmq/startup_err /var/log/rabbitmq/startup_log /var/log/rabbitmq/rabbit@*.log; do
        [[ -s "${f}" ]] || continue
        log "---- last lines of ${f} ----"
        tail -n 25 "${f}" >&2 || true
    done
}

# Wait until the broker answers. With "native", also require
# `rabbitmqctl await_startup` to succeed (the local node finished booting);
# for a broker in a container the local rabbitmqctl cannot reach the node,
# so only the AMQP probe is used.
wait_for_broker() {
    local mode="$1" start=${SECONDS} deadline=$((SECONDS + BROKER_WAIT_SECS)) ready err
    log "waiting up to ${BROKER_WAIT_SECS}s for the broker at ${BROKER_HOST}:${BROKER_PORT} ..."
    while :; do
        ready=1
        if [[ "${mode}" == "native" ]] && have rabbitmqctl; then
            if ! err="$(rabbitmqctl await_startup --timeout 5 2>&1)"; then
                ready=0
                LAST_ERR="rabbitmqctl await_startup: $(printf '%s' "${err}" | grep -v '^[[:space:]]*$' | head -n 3 | tr '\n' ' ')"
            fi
        fi
        if [[ ${ready} -eq 1 ]] && amqp_probe; then
            log "broker is up (answered AMQP after $((SECONDS - start))s)"
            return 0
        fi
        if ((SECONDS >= deadline)); then
            [[ "${mode}" == "native" ]] && dump_broker_logs
            die "broker did not come up within ${BROKER_WAIT_SECS}s. Last error: ${LAST_ERR}"
        fi
        log "  ... not up yet ($((SECONDS - start))s): ${LAST_ERR}"
        sleep 2
    done
}

# --- bring-up strategies -----------------------------------------------------

apt_update_once() {
    if [[ ${APT_UPDATED} -eq 0 ]]; then
        log "apt-get update"
        apt-get update -qq
        APT_UPDATED=1
    fi
}

# (b) A Docker engine that actually works (not just the client binary) plus
# our compose file.
docker_usable() {
    have docker && [[ -f "${REPO_ROOT}/docker-compose.yml" ]] && docker info >/dev/null 2>&1
}

start_with_docker() {
    log "starting RabbitMQ with Docker Compose (service 'rabbitmq')"
    if docker compose version >/dev/null 2>&1; then
        docker compose -f "${REPO_ROOT}/docker-compose.yml" up -d rabbitmq
    elif have docker-compose; then
        docker-compose -f "${REPO_ROOT}/docker-compose.yml" up -d rabbitmq
    else
        return 1
    fi
    wait_for_broker container
}

# Every quorum queue holds ~3 file handles and the broker stops accepting connections,
# silently, when it runs out. Debian's wrapper starts the node through `su`, which resets
# the soft open-files limit to 1024 (~900 handles for RabbitMQ, ~300 quorum queues), so as
# root we start it the same way but raise the soft limit to the hard one first.
start_native_node() {
    local node=/usr/lib/rabbitmq/bin/rabbitmq-server
    if is_root && [[ -x "${node}" ]] && id rabbitmq >/dev/null 2>&1; then
        log "starting the local RabbitMQ node with a raised open-files limit"
        (cd /var/lib/rabbitmq && su rabbitmq -s /bin/sh -c \
            "ulimit -n \$(ulimit -Hn) 2>/dev/null || ulimit -n 65536 2>/dev/null; ${node} -detached")
    else
        rabbitmq-server -detached
    fi
}

# (c) A natively installed broker. `rabbitmq-server -detached` returns
# before the node has booted, hence the wait afterwards. (Debian's wrapper
# switches to the rabbitmq user when run as root.)
start_native() {
    if pgrep -f -- '-s rabbit boot' >/dev/null 2>&1 \
        || { have rabbitmq-diagnostics && timeout 15 rabbitmq-diagnostics -q ping >/dev/null 2>&1; }; then
        # A node process exists but does not answer AMQP yet: it is still booting (or
        # wedged). Never start a second node next to it: it would spin fighting for the
        # node name and the port.
        log "a local RabbitMQ node is running but not answering yet; waiting for it"
    else
        log "starting the local RabbitMQ node: rabbitmq-server -detached"
        # Not fatal by itself (e.g. a node started by a package's postinst
        # won the race): the wait below decides, and prints the logs if not.
        start_native_node || log "starting the node exited with $?; waiting anyway"
    fi
    wait_for_broker native
}

# (d) Install Debian's rabbitmq-server. Its postinst tries to start the
# service and may fail (no systemd in containers, or policy-rc.d forbids
# it): that is tolerated, we start it ourselves afterwards.
install_with_apt() {
    log "rabbitmq-server is not installed; installing it with apt-get"
    apt_update_once
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server \
        || log "apt-get install reported an error (often just the service failing to start without systemd); continuing"
    have rabbitmq-server || die "apt-get did not install rabbitmq-server"
}

ensure_broker() {
    parse_amqp_url
    log "broker: ${BROKER_HOST}:${BROKER_PORT} (from AMQP_URL)"

    # (a) something already answers
    if amqp_probe; then
        log "a broker already answers AMQP on ${BROKER_HOST}:${BROKER_PORT}; using it"
        return 0
    fi
    log "nothing answers AMQP yet (${LAST_ERR})"

    if ! broker_is_local; then
        die "AMQP_URL points at ${BROKER_HOST}, which is not this machine and does not answer; start that broker, or unset AMQP_URL to use a local one"
    fi

    # (b) Docker
    if docker_usable; then
        start_with_docker && return 0
        log "Docker Compose could not start the broker; trying a native broker"
    fi

    # (c) native install
    if have rabbitmq-server; then
        start_native
        return 0
    fi

    # (d) install it
    if is_root && have apt-get; then
        install_with_apt
        # The postinst may have started it after all.
        if amqp_probe; then
            log "the package's postinst started the broker"
            return 0
        fi
        start_native
        return 0
    fi

    # (e) give up with instructions
    die "no RabbitMQ broker answers on ${BROKER_HOST}:${BROKER_PORT}, and none could be started.
  Do one of:
    - start Docker and run:  docker compose up -d rabbitmq
    - install RabbitMQ:      sudo apt-get install rabbitmq-server   (Debian/Ubuntu)
                             brew install rabbitmq                  (macOS)
    - point AMQP_URL at a running broker, e.g.
                             AMQP_URL=amqp://guest:guest@host:5672/%2f ./scripts/test.sh"
}

# --- Python client for the integration tests ---------------------------------

ensure_pika() {
    if ! have python3; then
        if is_root && have apt-get; then
            log "python3 is missing; installing python3 and python3-pika with apt-get"
            apt_update_once
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pika
        else
            die "python3 is required by the integration tests; please install Python 3 and the 'pika' package"
        fi
    fi
    if python3 -c 'import pika' >/dev/null 2>&1; then
        return 0
    fi
    log "installing the Python package 'pika' (python3 -m pip install --quiet pika)"
    # Quiet pip: no "running as root" warning and no version nag in CI logs.
    if ! PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        python3 -m pip install --quiet pika; then
        # e.g. Debian's own python3 refuses pip installs (PEP 668).
        if is_root && have apt-get; then
            log "pip failed; trying Debian's python3-pika"
            apt_update_once
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pika || true
        fi
    fi
    python3 -c 'import pika' || die "python3 cannot import pika; install it (pip install pika) and retry"
}

# The proxy tests (tests/it/proxy/apps.rs) drive a Node app with amqplib, installed into
# the directory they use (outside the clone) so that the test run itself needs no registry.
ensure_amqplib() {
    if ! have node || ! have npm; then
        if is_root && have apt-get; then
            log "node or npm is missing; installing nodejs and npm with apt-get"
            apt_update_once
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
        else
            die "node and npm are required by the proxy tests; please install Node.js and npm"
        fi
    fi
    local dir="${TMPDIR:-/tmp}/amqp-delay-tests-amqplib"
    if [ -d "${dir}/node_modules/amqplib" ]; then
        return 0
    fi
    log "installing the Node package 'amqplib' into ${dir}"
    mkdir -p "${dir}"
    npm install --silent --no-audit --no-fund --prefix "${dir}" amqplib \
        || die "npm could not install amqplib into ${dir}"
}

# The proxy tests (tests/it/proxy/apps.rs) compile tests/java/PluginApp.java with javac against
# Debian's RabbitMQ Java client (librabbitmq-client-java; it brings the slf4j jars it needs).
ensure_java_client() {
    local jars=(/usr/share/java/amqp-client.jar /usr/share/java/slf4j-api.jar /usr/share/java/slf4j-nop.jar)
    local missing=0 jar
    for jar in "${jars[@]}"; do
        [ -f "${jar}" ] || missing=1
    done
    if ((missing == 0)) && have javac && have java; then
        return 0
    fi
    if ! is_root || ! have apt-get; then
        die "the proxy tests need a JDK (javac) and Debian's RabbitMQ Java client: apt-get install librabbitmq-client-java default-jdk-headless"
    fi
    local pkgs=(librabbitmq-client-java)
    have javac || pkgs+=(default-jdk-headless)
    log "installing ${pkgs[*]} with apt-get"
    apt_update_once
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" \
        || die "apt-get could not install ${pkgs[*]}"
    for jar in "${jars[@]}"; do
        [ -f "${jar}" ] || die "${jar} is still missing after installing librabbitmq-client-java"
    done
    have javac || die "javac is still missing after installing default-jdk-headless"
}

# The console's browser test (tests/console/) drives headless Chromium through chromedriver
# (Debian's chromium and chromium-driver), and checks its HTTPS with curl.
ensure_chromium() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && have curl; then
        return 0
    fi
    if is_root && have apt-get; then
        log "chromium, chromedriver or curl is missing; installing chromium, chromium-driver and curl with apt-get"
        apt_update_once
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver curl \
            || die "apt-get could not install chromium, chromium-driver and curl"
    else
        die "the console's browser test needs Chromium, chromedriver and curl: apt-get install chromium chromium-driver curl"
    fi
}

# --- main --------------------------------------------------------------------

TEST_BROKERS="${TEST_BROKERS:-3.10 4.0 4.3}"
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-4}"
RUN_310=0
RUNS_4=()   # "SERIES SUITES" per 4.x run, in order (SUITES: comma separated, or "all")
for b in ${TEST_BROKERS}; do
    series="${b%%:*}"
    suites="all"
    [[ "${b}" == *:* ]] && suites="${b#*:}"
    case "${series}" in
        3 | 3.10 | 3.10.*) RUN_310=1 ;;
        4 | 4.0 | 4.0.*) RUNS_4+=("4.0 ${suites}") ;;
        4.3 | 4.3.*) RUNS_4+=("4.3 ${suites}") ;;
        *) die "TEST_BROKERS: unknown broker '${b}' (use 3.10, 4.0 and/or 4.3)" ;;
    esac
    if [[ "${suites}" != all ]]; then
        [[ "${series}" != 3* ]] || die "TEST_BROKERS: '${b}': only a 4.x run can name its suites"
        [[ "${suites}" =~ ^(it|fault|smoke)(,(it|fault|smoke))*$ ]] || die "TEST_BROKERS: '${b}': suites are it, fault and/or smoke"
    fi
done
RUN_4=${#RUNS_4[@]}
((RUN_310 + RUN_4 > 0)) || die "TEST_BROKERS names no broker"

if ((RUN_310)) || [[ "${BROKER_ONLY}" == "1" ]]; then
    ensure_broker
fi

if [[ "${BROKER_ONLY}" == "1" ]]; then
    log "--broker-only: broker is up, not running the tests"
    exit 0
fi

if ((RUN_4)) && ! is_root; then
    die "the RabbitMQ 4.x run needs root (scripts/rabbitmq4.sh uses chroot and mount); run as root, or TEST_BROKERS=3.10 for the 3.10 run alone"
fi

ensure_pika
ensure_amqplib
ensure_java_client
ensure_chromium

# The fault suite's cluster and the TLS test node are throwaway: stop them however the
# tests end (both scripts are safe to run when nothing is up, and never touch the main broker).
stop_test_nodes() {
    bash "${SCRIPT_DIR}/cluster.sh" down >/dev/null 2>&1 || log "warning: scripts/cluster.sh down failed"
    bash "${SCRIPT_DIR}/tls-node.sh" down >/dev/null 2>&1 || log "warning: scripts/tls-node.sh down failed"
    # the delayed-message plugin's nodes of tests/it/import.rs
    bash "${SCRIPT_DIR}/plugin-node.sh" 3.10 down >/dev/null 2>&1 || log "warning: scripts/plugin-node.sh 3.10 down failed"
    bash "${SCRIPT_DIR}/plugin-node.sh" 4.0 down >/dev/null 2>&1 || log "warning: scripts/plugin-node.sh 4.0 down failed"
    # the nodes MIGRATING's runbooks run on (tests/runbooks/)
    bash "${SCRIPT_DIR}/runbook-nodes.sh" all down >/dev/null 2>&1 || log "warning: scripts/runbook-nodes.sh all down failed"
}
# stop_rabbitmq4_nodes SERIES...: every node of those series
stop_rabbitmq4_nodes() {
    local series
    for series in "$@"; do
        RABBITMQ4_SERIES="${series}" bash "${SCRIPT_DIR}/rabbitmq4.sh" all-down >/dev/null 2>&1 ||
            log "warning: RABBITMQ4_SERIES=${series} scripts/rabbitmq4.sh all-down failed"
    done
}
SERIES_4=()
for r in "${RUNS_4[@]}"; do SERIES_4+=("${r%% *}"); done
if is_root; then
    trap 'stop_test_nodes; ((RUN_4)) && stop_rabbitmq4_nodes "${SERIES_4[@]}"' EXIT
fi

rc=0
summary=()
if ((RUN_310)); then
    v310="$(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || echo '?')"
    log "== RabbitMQ ${v310} (the machine's broker): cargo test $*  (broker ${BROKER_HOST}:${BROKER_PORT})"
    t0=${SECONDS}
    set +e
    cargo test --no-fail-fast "$@"
    rc310=$?
    set -e
    log "cargo test on RabbitMQ ${v310} exited with ${rc310} ($((SECONDS - t0))s)"
    summary+=("RabbitMQ ${v310}: $([[ ${rc310} -eq 0 ]] && echo ok || echo "FAILED (${rc310})") in $((SECONDS - t0))s")
    ((rc310 == 0)) || rc=${rc310}
    # its throwaway nodes are done: free the machine for the 4.x nodes
    is_root && stop_test_nodes
fi

for run in "${RUNS_4[@]}"; do
    series="${run%% *}"
    suites="${run#* }"
    t0=${SECONDS}
    # builds the cached root when it is missing (a minute or a few, once per machine and series)
    if info4="$(RABBITMQ4_SERIES="${series}" bash "${SCRIPT_DIR}/rabbitmq4.sh" up)"; then
        v4="$(sed -n 's/^VERSION=//p' <<<"${info4}")"
        args4=("$@")
        if ((${#args4[@]} == 0)); then
            [[ "${suites}" == all ]] && suites="it,fault,smoke"
            IFS=, read -r -a names <<<"${suites}"
            for n in "${names[@]}"; do args4+=(--test "${n}"); done
            # the import tests that copy within the plugin's own 3.10 and 4.0 nodes run the same
            # whatever the series: once, in the 3.10 run, is enough (blue-green, whose new
            # cluster is the series' broker, runs in every run); so does tests/runbooks, not
            # named here, whose brokers are its own 3.10 nodes and the main broker
            [[ " ${names[*]} " == *" it "* ]] && args4+=(-- --skip _on_3_10 --skip _on_4_0)
        fi
        log "== RabbitMQ ${v4} (RABBITMQ4_SERIES=${series} scripts/rabbitmq4.sh): cargo test ${args4[*]}"
        set +e
        (
            eval "$(RABBITMQ4_SERIES="${series}" bash "${SCRIPT_DIR}/rabbitmq4.sh" env)"
            cargo test --no-fail-fast "${args4[@]}"
        )
        rc4=$?
        set -e
        log "cargo test on RabbitMQ ${v4} exited with ${rc4} ($((SECONDS - t0))s)"
    else
        rc4=1
        v4="${series}.x"
        args4=()
        log "ERROR: RABBITMQ4_SERIES=${series} scripts/rabbitmq4.sh up failed; the ${series} run did not happen"
    fi
    summary+=("RabbitMQ ${v4} (${args4[*]:-no tests}): $([[ ${rc4} -eq 0 ]] && echo ok || echo "FAILED (${rc4})") in $((SECONDS - t0))s")
    ((rc4 == 0)) || rc=${rc4}
    # its nodes are done: free the machine for the next series
    stop_rabbitmq4_nodes "${series}"
done

for line in "${summary[@]}"; do log "${line}"; done
exit "${rc}"
