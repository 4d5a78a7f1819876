#!/usr/bin/env bash
# deploy/rabbitmq/permissions.sh — the least-privilege permission sets of the README
# ("Security", tested in tests/it/permissions.rs) for one amqp-delay topology, as rabbitmqctl
# commands: one user per role.
#
#   deploy/rabbitmq/permissions.sh --prefix amqp-delay --queue orders.timeout \
#       --gateway orders.delayed:orders                    # prints the commands
#   deploy/rabbitmq/permissions.sh ... --apply             # runs them (rabbitmqctl on PATH)
#
# Options:
#   --prefix P          the topology's prefix (default amqp-delay)
#   --vhost V           virtual host (default /)
#   --queue Q           a destination queue consumed by delay-consumer; repeatable
#   --gateway I:T       a gateway pair, ingress exchange I -> target exchange T; repeatable
#   --user-prefix U     users are U-admin, U-publisher, U-worker, U-gateway, U-keda
#                       (default: the prefix)
#   --apply             run the commands instead of printing them
#
# The users must exist (rabbitmqctl add_user NAME, which asks for the password). Names are
# matched exactly: regex characters in P, Q, I, T are escaped. Roles:
#   admin      declare, declare --queue Q --worker, gateway --declare-only, teardown
#   publisher  send, cancel (applications)
#   worker     delay-consumer --queue Q (all the --queue Q given here); with --forward X,
#              add write on X by hand
#   gateway    delay-publisher gateway (all the --gateway pairs given here)
#   keda       KEDA's rabbitmq trigger over the management API: the monitoring tag, no rights

set -euo pipefail

PREFIX="amqp-delay"
VHOST="/"
USER_PREFIX=""
APPLY=0
QUEUES=()
INGRESSES=()
TARGETS=()

die() {
    echo "permissions.sh: $*" >&2
    exit 2
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a value}"; shift 2 ;;
        --vhost) VHOST="${2:?--vhost needs a value}"; shift 2 ;;
        --queue) QUEUES+=("${2:?--queue needs a value}"); shift 2 ;;
        --gateway)
            pair="${2:?--gateway needs INGRESS:TARGET}"
            [[ "${pair}" == *:* ]] || die "--gateway takes INGRESS:TARGET, got '${pair}'"
            INGRESSES+=("${pair%%:*}")
            TARGETS+=("${pair#*:}")
            shift 2
            ;;
        --user-prefix) USER_PREFIX="${2:?--user-prefix needs a value}"; shift 2 ;;
        --apply) APPLY=1; shift ;;
        -h | --help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ -n "${USER_PREFIX}" ]] || USER_PREFIX="${PREFIX}"

# A name as a regex matching exactly that name.
esc() { printf '%s' "$1" | sed -e 's/[][\.^$*+?(){}|\\/]/\\&/g'; }
# Names joined with | (each escaped).
alt() {
    local out="" n
    for n in "$@"; do out+="${out:+|}$(esc "${n}")"; done
    printf '%s' "${out}"
}

P="$(esc "${PREFIX}")"
TIERS="${P}\\.(level\\d+|fixed\\..+|overflow\\d+|deliver)"
Q="$(alt ${QUEUES[@]+"${QUEUES[@]}"})"
I="$(alt ${INGRESSES[@]+"${INGRESSES[@]}"})"
T="$(alt ${TARGETS[@]+"${TARGETS[@]}"})"

# admin: everything under the prefix, the destination queues and the gateway ingresses (the
# control stream's records go through the stream exchange P.streams; no role needs amq.default,
# which writes into any queue of the vhost)
ADMIN="^(${P}\\..*${Q:+|${Q}}${I:+|${I}})\$"

run() {
    if [[ ${APPLY} -eq 1 ]]; then
        rabbitmqctl "$@"
    else
        local out="rabbitmqctl" a
        for a in "$@"; do
            if [[ "${a}" =~ ^[A-Za-z0-9_./-]+$ ]]; then
                out+=" ${a}"
            else
                out+=" '${a//\'/\'\\\'\'}'"
            fi
        done
        printf '%s\n' "${out}"
    fi
}

run set_permissions -p "${VHOST}" "${USER_PREFIX}-admin" "${ADMIN}" "${ADMIN}" "${ADMIN}"
run set_permissions -p "${VHOST}" "${USER_PREFIX}-publisher" '^$' "^(${TIERS}|${P}\\.streams)\$" '^$'
if [[ -n "${Q}" ]]; then
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-worker" '^$' \
        "^(${TIERS}|${P}\\.(streams|park))\$" "^(${Q}|${P}\\.(control|ledger))\$"
fi
if [[ -n "${I}" ]]; then
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-gateway" '^$' \
        "^(${I}|${T}|${P}\\.(gw\\..*|parking|streams|park)|${TIERS})\$" \
        "^(${I}|${P}\\.gw\\..*|${P}\\.(control|ledger))\$"
fi
run set_permissions -p "${VHOST}" "${USER_PREFIX}-keda" '^$' '^$' '^$'
run set_user_tags "${USER_PREFIX}-keda" monitoring
