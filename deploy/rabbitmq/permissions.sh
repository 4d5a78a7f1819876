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
#   --relay S:Q         delay-consumer --queue S --relay Q (S a destination, Q a plain
#                       queue its consumer is not ours); repeatable
#   --proxy             the set of delay-proxy's own user
#   --app USER:X[,X...][:Q[,Q...]]
#                       an application behind delay-proxy, user USER, that declares the
#                       x-delayed-message exchanges X and consumes the queues Q; repeatable.
#                       It may write its own pairs' ingresses only (P.gw.x.X), never another
#                       application's
#   --gateway-app USER:I[,I...]
#                       an application of configured gateway pairs, user USER, that
#                       publishes to their ingresses I; repeatable. Name USER in those
#                       pairs' `writers`. Add what it needs for its own queues
#   --recurring USER    a tenant USER of recurring schedules (`recurring add|list|...|serve`
#                       as USER); repeatable
#   --user-prefix U     users are U-admin, U-publisher, U-worker, U-gateway, U-relay,
#                       U-proxy, U-pending, U-keda (default: the prefix)
#   --apply             run the commands instead of printing them
#
# The users must exist (rabbitmqctl add_user NAME, which asks for the password). Names are
# matched exactly: regex characters in P, Q, I, T are escaped. Roles:
#   admin      declare, declare --queue Q --worker, gateway --declare-only, teardown
#   publisher  send, cancel (applications)
#   worker     delay-consumer --queue Q (all the --queue Q given here); with --forward X,
#              add write on X by hand
#   gateway    delay-publisher gateway (all the --gateway pairs given here) and, with
#              --follow-pairs, the pairs of the --app exchanges (beside the proxy's own
#              gateway, with trust.peers naming the proxy's user)
#   relay      delay-consumer --queue S --relay Q (all the --relay given here)
#   proxy      delay-proxy's own user: declares the pairs of the applications' exchanges (the
#              --app ones) and delivers what waits in them
#   pending    delay-publisher pending serve and delay-console's own user: reads the journal and
#              the control stream (and appends its barriers through P.streams); what it shows
#              and steers is the logged-in user's
#   USER       (--recurring) a publisher that also reads the control stream (its schedules
#              are records there) and holds its recurring serve's lock queue
#   keda       KEDA's rabbitmq trigger over the management API: the monitoring tag, no rights
#   USER       (--app) an application behind delay-proxy: its exchanges, its pairs'
#              ingresses, its queues; (--gateway-app) an application of configured pairs:
#              write on its own ingresses only (give each application ingresses of its own)

set -euo pipefail

PREFIX="amqp-delay"
VHOST="/"
USER_PREFIX=""
APPLY=0
PROXY=0
QUEUES=()
INGRESSES=()
TARGETS=()
RELAY_FROM=()
RELAY_TO=()
APPS=()
GATEWAY_APPS=()
RECURRING=()

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
        --relay)
            pair="${2:?--relay needs S:Q}"
            [[ "${pair}" == *:* ]] || die "--relay takes S:Q, got '${pair}'"
            RELAY_FROM+=("${pair%%:*}")
            RELAY_TO+=("${pair#*:}")
            shift 2
            ;;
        --proxy) PROXY=1; shift ;;
        --gateway-app)
            app="${2:?--gateway-app needs USER:INGRESSES}"
            [[ "${app}" == *:?* ]] || die "--gateway-app takes USER:INGRESSES, got '${app}'"
            GATEWAY_APPS+=("${app}")
            shift 2
            ;;
        --app)
            app="${2:?--app needs USER:EXCHANGES[:QUEUES]}"
            [[ "${app}" == *:?* ]] || die "--app takes USER:EXCHANGES[:QUEUES], got '${app}'"
            APPS+=("${app}")
            shift 2
            ;;
        --recurring) RECURRING+=("${2:?--recurring needs a USER}"); shift 2 ;;
        --user-prefix) USER_PREFIX="${2:?--user-prefix needs a value}"; shift 2 ;;
        --apply) APPLY=1; shift ;;
        -h | --help) sed -n '2,53p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
RS="$(alt ${RELAY_FROM[@]+"${RELAY_FROM[@]}"})"
# every application's exchanges: the targets a gateway following the pairs delivers to
APP_X=()
for app in ${APPS[@]+"${APPS[@]}"}; do
    rest="${app#*:}"
    IFS=, read -r -a xs <<<"${rest%%:*}"
    APP_X+=("${xs[@]}")
done
AX="$(alt ${APP_X[@]+"${APP_X[@]}"})"

# admin: everything under the prefix, the destination queues and the gateway ingresses (the
# control stream's records go through the stream exchange P.streams; no role needs amq.default,
# which writes into any queue of the vhost)
ADMIN="^(${P}\\..*${Q:+|${Q}}${RS:+|${RS}}${I:+|${I}})\$"

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

# RabbitMQ 4.3.1+ (and 4.2.7+) lets a passive declare through on any one right on the object:
# each role writes (a right that is harmless there: the layout's signature exchange and the
# batch and hold markers are exchanges bound to nothing, so nothing published to them goes
# anywhere; a write on a queue only lets one bind it, which needs read on an exchange too) the
# objects it checks and has no other right on. 3.x and 4.0-4.2.5 check nothing on a passive
# declare; 4.2.6 and 4.3.0 want configure (README, "Broker versions").
CHECKED="layout\\..+"
marks() { printf '(parked|holds|batched)\\.(%s)' "$1"; }
run set_permissions -p "${VHOST}" "${USER_PREFIX}-admin" "${ADMIN}" "${ADMIN}" "${ADMIN}"
run set_permissions -p "${VHOST}" "${USER_PREFIX}-publisher" '^$' \
    "^(${TIERS}|${P}\\.(streams|control|ledger|journal|${CHECKED}|(holds|batched)\\..+))\$" '^$'
for u in ${RECURRING[@]+"${RECURRING[@]}"}; do
    # a publisher that reads the control stream and declares its own exclusive lock queue;
    # not the journal, which holds every user's ids, headers and kept bodies
    run set_permissions -p "${VHOST}" "${u}" "^${P}\\.recurring\\.lock\\.$(esc "${u}")\$" \
        "^(${TIERS}|${P}\\.(streams|control|ledger|journal|${CHECKED}|(holds|batched)\\..+))\$" \
        "^${P}\\.control\$"
done
if [[ -n "${Q}" ]]; then
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-worker" '^$' \
        "^(${TIERS}|${P}\\.(streams|park|journal|${CHECKED}|$(marks "${Q}")))\$" \
        "^(${Q}|${P}\\.(control|ledger))\$"
fi
if [[ -n "${I}${AX}" ]]; then
    # the ingresses and targets of the configured pairs, and (following the pairs) every
    # application exchange behind delay-proxy as a target
    GI="${I}${I:+|}"
    GT="${T}${T:+${AX:+|}}${AX}"
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-gateway" '^$' \
        "^(${GI}${GT}|${P}\\.(gw\\..*|parking|streams|park|journal|${CHECKED}|$(marks "${P}\\.gw\\..+"))|${TIERS})\$" \
        "^(${GI}${P}\\.gw\\..*|${P}\\.(control|ledger))\$"
fi
if [[ -n "${RS}" ]]; then
    # a relay is a worker of S that re-publishes into Q through the default exchange
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-relay" '^$' \
        "^(amq\\.default|${TIERS}|${P}\\.(streams|park|journal|${CHECKED}|$(marks "${RS}")))\$" \
        "^(${RS}|${P}\\.(control|ledger))\$"
fi
if [[ ${PROXY} -eq 1 ]]; then
    # declares the pairs (and the tiers when they are missing) under the prefix and, as the
    # gateway of those pairs, delivers to the --app exchanges (write)
    run set_permissions -p "${VHOST}" "${USER_PREFIX}-proxy" "^${P}\\..*\$" \
        "^(${P}\\..*${AX:+|${AX}})\$" "^${P}\\..*\$"
fi
for app in ${APPS[@]+"${APPS[@]}"}; do
    user="${app%%:*}"
    rest="${app#*:}"
    IFS=, read -r -a xs <<<"${rest%%:*}"
    qs=()
    [[ "${rest}" == *:* ]] && IFS=, read -r -a qs <<<"${rest#*:}"
    X="$(alt "${xs[@]}")"
    AQ="$(alt ${qs[@]+"${qs[@]}"})"
    OWN="${X}${AQ:+|${AQ}}"
    # its exchanges and queues, and the ingresses of its own pairs: never P.gw.x.* as a whole,
    # which would let it deliver through another application's pairs
    run set_permissions -p "${VHOST}" "${user}" "^(${OWN})\$" \
        "^(${OWN}|${P}\\.gw\\.x\\.(${X}))\$" "^(${OWN})\$"
done
for app in ${GATEWAY_APPS[@]+"${GATEWAY_APPS[@]}"}; do
    IFS=, read -r -a is <<<"${app#*:}"
    run set_permissions -p "${VHOST}" "${app%%:*}" '^$' "^($(alt "${is[@]}"))\$" '^$'
done
# reads the two streams the index follows; writes P.streams for its barriers and the streams it
# checks with a passive declare (RabbitMQ 4.3); no right on the tiers or any destination
run set_permissions -p "${VHOST}" "${USER_PREFIX}-pending" '^$' \
    "^${P}\\.(streams|journal|control)\$" "^${P}\\.(journal|control)\$"
run set_permissions -p "${VHOST}" "${USER_PREFIX}-keda" '^$' '^$' '^$'
run set_user_tags "${USER_PREFIX}-keda" monitoring
