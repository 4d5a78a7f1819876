#!/usr/bin/env bash
# scripts/tls-node.sh — a throwaway standalone RabbitMQ node with TLS, for TLS tests.
#
# Runs one extra node next to the machine's main broker (rabbit@localhost on 5672, never
# touched), from the Debian package in /usr/lib/rabbitmq:
#
#   node        adtls@localhost            (TLS_NODE_NAME)
#   AMQP        127.0.0.1:5721             (TLS_NODE_AMQP_PORT)
#   AMQPS       127.0.0.1:5722             (TLS_NODE_AMQPS_PORT)
#   management  127.0.0.1:15721            (TLS_NODE_MGMT_PORT; the HTTP API the KEDA role reads)
#   dist port   25721                      (TLS_NODE_DIST_PORT)
#   files       /tmp/amqp-delay-tls/       (TLS_NODE_DIR)
#     ca.pem ca.key                 throwaway CA ("amqp-delay test CA")
#     server.pem server.key         server cert signed by it: CN=localhost,
#                                   SAN DNS:localhost, IP:127.0.0.1
#     client.pem client.key         client cert signed by the same CA (CN=amqp-delay-client)
#     wrong-ca.pem wrong-ca.key     an unrelated CA ("amqp-delay wrong CA")
#     wrong-client.pem wrong-client.key   client cert signed by the wrong CA
#     node/                         config, data, logs of the node
#
# The TLS listener uses ssl_options.verify = verify_peer and fail_if_no_peer_cert = false:
# clients without a certificate are accepted, clients with a certificate that does not chain
# to ca.pem are refused in the handshake.
#
# Usage (as root; non-interactive):
#   tls-node.sh up      make the certificates (if missing), start the node, wait until the
#                       TLS port completes a handshake verified against ca.pem, then print
#                       KEY=VALUE lines (shell-sourceable):
#                         TLS_NODE=  AMQP_PORT=  AMQPS_PORT=  CA_CERT=  WRONG_CA_CERT=
#                         CLIENT_CERT=  CLIENT_KEY=  WRONG_CLIENT_CERT=  WRONG_CLIENT_KEY=
#                         SERVER_CERT=  AMQP_URL=  AMQPS_URL=  MGMT_PORT=
#                       Idempotent: if the node already runs and answers TLS, only prints.
#   tls-node.sh down    stop the node (by name) and delete TLS_NODE_DIR. Safe when nothing runs.
#   tls-node.sh print   print the KEY=VALUE lines without starting anything.
#   tls-node.sh status  exit 0 if the node answers a verified TLS handshake, else 1.
#
# Environment: TLS_NODE_CONF_EXTRA (extra rabbitmq.conf lines), TLS_NODE_WAIT_SECS (default 90),
# and the layout overrides named above. TLS_NODE_ROOT: run the node from the RabbitMQ installed
# in this root directory (chroot, its rabbitmq user and rabbitmqctl; /proc mounted in it), with
# TLS_NODE_DIR inside the root and the same path on the host a symlink to it;
# `scripts/rabbitmq4.sh tls ...` sets it (4.0.5, or 4.3.x with RABBITMQ4_SERIES=4.3) with names and
# ports of its own.

set -euo pipefail

DIR="${TLS_NODE_DIR:-/tmp/amqp-delay-tls}"
NODE="${TLS_NODE_NAME:-adtls@localhost}"
AMQP_PORT="${TLS_NODE_AMQP_PORT:-5721}"
AMQPS_PORT="${TLS_NODE_AMQPS_PORT:-5722}"
DIST_PORT="${TLS_NODE_DIST_PORT:-25721}"
MGMT_PORT="${TLS_NODE_MGMT_PORT:-15721}"
WAIT_SECS="${TLS_NODE_WAIT_SECS:-90}"
NDIR="${DIR}/node"
SHORT="${NODE%@*}"
RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ_USER=rabbitmq
RMQ_HOME=/var/lib/rabbitmq
TROOT="${TLS_NODE_ROOT:-}"
TROOT="${TROOT%/}"

log() { printf '[tls-node.sh] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

# IN: prefix that runs a command in the root the node comes from (empty: the host).
IN=()
if [[ -n "${TROOT}" ]]; then
    [[ "$(id -u)" -eq 0 ]] || die "TLS_NODE_ROOT needs root (chroot)"
    [[ -x "${TROOT}${RMQ_BIN}/rabbitmq-server" ]] || die "no RabbitMQ in TLS_NODE_ROOT=${TROOT}"
    mountpoint -q "${TROOT}/proc" || die "/proc is not mounted in ${TROOT} (scripts/rabbitmq4.sh mounts it)"
    IN=(chroot "${TROOT}")
    RUNUSER=("${IN[@]}" runuser -u "${RMQ_USER}" --)
elif [[ "$(id -u)" -eq 0 ]]; then
    RUNUSER=(runuser -u "${RMQ_USER}" --)
elif [[ "$(id -un)" == "${RMQ_USER}" ]]; then
    RUNUSER=()
else
    die "run as root (or as ${RMQ_USER})"
fi

ctl() {
    local secs="$1"
    shift
    (cd / && timeout --kill-after=5 "${secs}" \
        "${RUNUSER[@]}" env HOME="${RMQ_HOME}" "${RMQ_BIN}/rabbitmqctl" -q -n "${NODE}" "$@")
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

# A TLS handshake on the AMQPS port that verifies the server against ca.pem.
tls_probe() {
    timeout 10 openssl s_client -connect "127.0.0.1:${AMQPS_PORT}" -servername localhost \
        -CAfile "${DIR}/ca.pem" -verify_return_error </dev/null >"${DIR}/s_client.out" 2>&1 &&
        grep -q 'Verify return code: 0 (ok)' "${DIR}/s_client.out"
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

# --- certificates --------------------------------------------------------------

# make_ca NAME CN
make_ca() {
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 30 \
        -keyout "${DIR}/$1.key" -out "${DIR}/$1.pem" -subj "/CN=$2/O=amqp-delay tests" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

# make_leaf NAME CA CN EXTENSIONS
make_leaf() {
    local name="$1" ca="$2" cn="$3" ext="$4"
    openssl req -newkey rsa:2048 -nodes -sha256 -keyout "${DIR}/${name}.key" \
        -out "${DIR}/${name}.csr" -subj "/CN=${cn}/O=amqp-delay tests" 2>/dev/null
    printf '%s\n' "${ext}" >"${DIR}/${name}.ext"
    openssl x509 -req -in "${DIR}/${name}.csr" -CA "${DIR}/${ca}.pem" -CAkey "${DIR}/${ca}.key" \
        -CAcreateserial -days 30 -sha256 -extfile "${DIR}/${name}.ext" \
        -out "${DIR}/${name}.pem" 2>/dev/null
    rm -f "${DIR}/${name}.csr" "${DIR}/${name}.ext"
}

make_certs() {
    local f ok=1
    for f in ca server client wrong-ca wrong-client; do
        [[ -s "${DIR}/${f}.pem" && -s "${DIR}/${f}.key" ]] || ok=0
    done
    ((ok)) && return 0
    command -v openssl >/dev/null || die "openssl is required"
    log "generating a throwaway CA, server and client certificates in ${DIR}"
    make_ca ca "amqp-delay test CA"
    make_ca wrong-ca "amqp-delay wrong CA"
    make_leaf server ca localhost "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1"
    make_leaf client ca amqp-delay-client "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    make_leaf wrong-client wrong-ca amqp-delay-client "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    openssl verify -CAfile "${DIR}/ca.pem" "${DIR}/server.pem" "${DIR}/client.pem" >/dev/null ||
        die "generated certificates do not verify"
}

# --- node ------------------------------------------------------------------------

# DIR: a directory on the host, or with TLS_NODE_ROOT a directory in the root and the same path
# on the host a symlink to it (one name for the files inside and outside the root).
# With a root, DIR and its twin in the root are deleted on down: never / or a top-level
# directory.
if [[ -n "${TROOT}" && ! "${DIR}" =~ ^/[^/]+/[^/]+ ]]; then
    die "TLS_NODE_DIR must be an absolute path at least two levels deep with a root, got '${DIR}'"
fi

make_dir() {
    if [[ -z "${TROOT}" ]]; then
        mkdir -p "${DIR}"
        return 0
    fi
    mkdir -p "${TROOT}${DIR}"
    if [[ -L "${DIR}" ]]; then
        [[ "$(readlink "${DIR}")" == "${TROOT}${DIR}" ]] && return 0
        rm -f "${DIR}"
    elif [[ -e "${DIR}" ]]; then
        die "${DIR} exists on the host and is not a symlink into ${TROOT}; remove it"
    fi
    mkdir -p "$(dirname "${DIR}")"
    ln -s "${TROOT}${DIR}" "${DIR}"
}

remove_dir() {
    if [[ -n "${TROOT}" ]]; then
        [[ -L "${DIR}" ]] && rm -f "${DIR}"
        rm -rf --one-file-system "${TROOT:?}${DIR}"
    else
        rm -rf "${DIR}"
    fi
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
}

write_node_files() {
    mkdir -p "${NDIR}/mnesia" "${NDIR}/log"
    cat >"${NDIR}/rabbitmq.conf" <<EOF
# generated by scripts/tls-node.sh
# RABBITMQ_CONFIG_FILE points here, so the shared /etc/rabbitmq/rabbitmq.conf is not read.
listeners.tcp.default = 127.0.0.1:${AMQP_PORT}
listeners.ssl.default = 127.0.0.1:${AMQPS_PORT}
ssl_options.cacertfile = ${DIR}/ca.pem
ssl_options.certfile = ${DIR}/server.pem
ssl_options.keyfile = ${DIR}/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
management.tcp.ip = 127.0.0.1
management.tcp.port = ${MGMT_PORT}
vm_memory_high_watermark.absolute = 512MiB
disk_free_limit.absolute = 20MB
log.file.level = info
log.console = false
EOF
    if [[ -n "${TLS_NODE_CONF_EXTRA:-}" ]]; then
        printf '# from TLS_NODE_CONF_EXTRA\n%s\n' "${TLS_NODE_CONF_EXTRA}" >>"${NDIR}/rabbitmq.conf"
    fi
    echo "[]." >"${NDIR}/advanced.config"
    echo "[rabbitmq_management]." >"${NDIR}/enabled_plugins"
    env_lines | sed -E "s/^([A-Z_]+)=(.*)$/\\1='\\2'/" >"${NDIR}/rabbitmq-env.conf"
}

dump_logs() {
    local f section
    f="${NDIR}/startup.log"
    if [[ -s "${f}" ]]; then
        section="$(awk '/^==== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "${f}")"
        if grep -q '\[error\]' <<<"${section}"; then
            log "---- first errors in ${f} ----"
            grep -m 12 '\[error\]' <<<"${section}" >&2 || true
        fi
        log "---- last lines of ${f} ----"
        tail -n 15 <<<"${section}" >&2 || true
    fi
    f="${NDIR}/log/${NODE}.log"
    if [[ -s "${f}" ]]; then
        log "---- last lines of ${f} ----"
        tail -n 40 "${f}" >&2 || true
    fi
    [[ -s "${DIR}/s_client.out" ]] && { log "---- last TLS probe ----"; tail -n 8 "${DIR}/s_client.out" >&2; }
    return 0
}

launch_node() {
    local envs=() line
    while IFS= read -r line; do envs+=("${line}"); done < <(env_lines)
    log "starting ${NODE} (AMQP ${AMQP_PORT}, AMQPS ${AMQPS_PORT}, dist ${DIST_PORT})"
    rm -f "${NDIR}/pid"
    printf '\n==== %s start\n' "$(date '+%F %T')" >>"${NDIR}/startup.log"
    "${IN[@]}" chown "${RMQ_USER}:" "${NDIR}/startup.log" 2>/dev/null || true
    # Backgrounded in its own session rather than -detached, so boot errors land in startup.log.
    (cd "${NDIR}" && "${RUNUSER[@]}" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        HOME="${RMQ_HOME}" LANG=C.UTF-8 "${envs[@]}" \
        sh -c 'cd "$2" 2>/dev/null; ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
               setsid "$0" >>"$1" 2>&1 </dev/null &' \
        "${RMQ_BIN}/rabbitmq-server" "${NDIR}/startup.log" "${NDIR}") ||
        die "could not launch rabbitmq-server for ${NODE}"
}

wait_node() {
    local deadline=$((SECONDS + WAIT_SECS)) start=${SECONDS} err=""
    while :; do
        if amqp_probe "${AMQP_PORT}"; then
            if err="$(ctl 20 await_startup --timeout 15 2>&1)"; then
                if tls_probe; then
                    log "${NODE} is up and answers TLS ($((SECONDS - start))s)"
                    return 0
                fi
                err="TLS handshake on ${AMQPS_PORT} failed: $(grep -m1 -iE 'error|verify' "${DIR}/s_client.out" || true)"
            fi
        else
            err="AMQP port ${AMQP_PORT} does not answer yet"
        fi
        if ((SECONDS >= deadline)); then
            dump_logs
            die "${NODE} did not come up within ${WAIT_SECS}s: $(printf '%s' "${err}" | head -n 3 | tr '\n' ' ')"
        fi
        if ((SECONDS - start > 15)) && ! epmd_has && [[ -z "$(node_pid)" ]]; then
            dump_logs
            die "${NODE} is not running (its VM exited during boot)"
        fi
        sleep 1
    done
}

print_info() {
    cat <<EOF
TLS_NODE=${NODE}
AMQP_PORT=${AMQP_PORT}
AMQPS_PORT=${AMQPS_PORT}
CA_CERT=${DIR}/ca.pem
WRONG_CA_CERT=${DIR}/wrong-ca.pem
CLIENT_CERT=${DIR}/client.pem
CLIENT_KEY=${DIR}/client.key
WRONG_CLIENT_CERT=${DIR}/wrong-client.pem
WRONG_CLIENT_KEY=${DIR}/wrong-client.key
SERVER_CERT=${DIR}/server.pem
AMQP_URL=amqp://guest:guest@127.0.0.1:${AMQP_PORT}/%2f
AMQPS_URL=amqps://guest:guest@localhost:${AMQPS_PORT}/%2f
MGMT_PORT=${MGMT_PORT}
EOF
}

cmd_up() {
    [[ "$(id -u)" -eq 0 ]] || die "up must run as root"
    if epmd_has && [[ -s "${DIR}/ca.pem" ]] && amqp_probe "${AMQP_PORT}" && tls_probe; then
        log "${NODE} is already up"
        print_info
        return 0
    fi
    if epmd_has; then
        log "${NODE} runs but is not healthy (or its files are gone); restarting it"
        cmd_down
    fi
    make_dir
    chmod 755 "${DIR}/"
    make_certs
    write_node_files
    # The node runs as rabbitmq and must read the server key; the client keys stay root's.
    "${IN[@]}" chown -R "${RMQ_USER}:" "${NDIR}"
    "${IN[@]}" chown "${RMQ_USER}:" "${DIR}/server.key"
    chmod 600 "${DIR}"/*.key
    chmod 644 "${DIR}"/*.pem
    launch_node
    wait_node
    print_info
}

cmd_down() {
    local pid
    if epmd_has || [[ -n "$(node_pid)" ]]; then
        log "stopping ${NODE}"
        if [[ -s "${NDIR}/pid" ]]; then
            ctl 60 stop "${NDIR}/pid" >&2 2>/dev/null || true
        else
            ctl 60 stop >&2 2>/dev/null || true
        fi
        pid="$(node_pid)"
        if [[ -n "${pid}" ]]; then
            log "${NODE} did not stop in time; kill -9 ${pid}"
            kill -9 "${pid}" 2>/dev/null || true
            sleep 1
        fi
    fi
    remove_dir
    log "down: removed ${DIR}"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    print) print_info ;;
    status) epmd_has && amqp_probe "${AMQP_PORT}" && tls_probe ;;
    *)
        sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
esac
