#!/usr/bin/env bash
# scripts/demo.sh — amqp-delay in one command: schedule a few dozen messages with delays from
# 100 ms to 10 s, watch each one fire with its lateness, then a summary.
#
#   ./scripts/demo.sh            # 36 messages, delays 100 ms .. 10 s (about 20 s in all)
#   ./scripts/demo.sh --quick    # delays 100 ms .. 2 s (for CI)
#   ./scripts/demo.sh --keep     # leave the topology and the queue behind (prints how to remove them)
#
# What it does:
#   1. makes sure a broker answers at $AMQP_URL the way the tests do
#      (./scripts/test.sh --broker-only: a running broker, Docker, an installed
#      rabbitmq-server, or apt-get as root);
#   2. builds delay-publisher and delay-consumer (debug: much faster to build than --release,
#      and the waiting is the broker's, not ours); DEMO_BIN_DIR=DIR uses binaries already built;
#   3. declares a topology under its own random prefix demo-<random> (radix 16, 1 ms unit,
#      delays up to 1 minute, quorum queues) and a destination queue <prefix>-due;
#   4. starts `delay-consumer --queue <prefix>-due --log` and, once it consumes, schedules the
#      messages with one `delay-publisher send --jsonl -`;
#   5. prints each message as it fires with its lateness (fired_at - due_at, from the worker's
#      JSON lines), then: count, how many were on time, min / p50 / max lateness, none early;
#   6. stops the worker and removes what it declared (teardown --queue for the queue, its
#      parking queue and batch marker, then teardown) — also after Ctrl-C or an error.
#
# Options: --quick, --keep, --release (build and run release binaries), --count N (default 36),
# --on-time-ms MS (lateness still counted "on time", default 100). Environment: AMQP_URL
# (default amqp://guest:guest@127.0.0.1:5672/%2f), DEMO_BIN_DIR, BROKER_WAIT_SECS.
# Exit code: 0 when every message fired and none was early, 1 otherwise, 2 for bad usage.
# Needs bash, coreutils and awk.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"

QUICK=0
KEEP=0
RELEASE=0
COUNT=36
ON_TIME_MS=100
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1; shift ;;
        --keep) KEEP=1; shift ;;
        --release) RELEASE=1; shift ;;
        --count) COUNT="${2:-}"; shift 2 || true ;;
        --on-time-ms) ON_TIME_MS="${2:-}"; shift 2 || true ;;
        -h | --help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "demo.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ "${COUNT}" =~ ^[0-9]+$ && "${COUNT}" -ge 2 && "${COUNT}" -le 1000 ]] \
    || { echo "demo.sh: --count takes a number from 2 to 1000" >&2; exit 2; }
[[ "${ON_TIME_MS}" =~ ^[0-9]+$ ]] || { echo "demo.sh: --on-time-ms takes a number" >&2; exit 2; }

MIN_MS=100
MAX_MS=10000
[[ ${QUICK} -eq 1 ]] && MAX_MS=2000

: "${AMQP_URL:=amqp://guest:guest@127.0.0.1:5672/%2f}"
export AMQP_URL
# The demo's settings come from its own config file, not from the caller's environment.
while IFS='=' read -r name _; do
    [[ "${name}" == AMQP_DELAY_* ]] && unset "${name}"
done < <(env)

say() { printf '[demo] %s\n' "$*"; }
warn() { printf '[demo] %s\n' "$*" >&2; }

# --- 1. the broker -------------------------------------------------------------
say "broker: making sure one answers (./scripts/test.sh --broker-only)"
"${REPO_ROOT}/scripts/test.sh" --broker-only

# --- 2. the binaries -----------------------------------------------------------
if [[ -n "${DEMO_BIN_DIR:-}" ]]; then
    BIN_DIR="${DEMO_BIN_DIR}"
else
    profile=debug
    flags=()
    if [[ ${RELEASE} -eq 1 ]]; then
        profile=release
        flags=(--release)
    fi
    say "building delay-publisher and delay-consumer (cargo build ${flags[*]:-(debug)})"
    (cd "${REPO_ROOT}" && cargo build --quiet ${flags[@]+"${flags[@]}"} \
        --bin delay-publisher --bin delay-consumer)
    BIN_DIR="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}/${profile}"
fi
PUBLISHER="${BIN_DIR}/delay-publisher"
CONSUMER="${BIN_DIR}/delay-consumer"
[[ -x "${PUBLISHER}" && -x "${CONSUMER}" ]] || { warn "no binaries in ${BIN_DIR}"; exit 1; }

# --- 3. a topology of its own ----------------------------------------------------
PREFIX="demo-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
QUEUE="${PREFIX}-due"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/amqp-delay-${PREFIX}.XXXXXX")"
CONFIG="${WORK}/demo.toml"
cat >"${CONFIG}" <<EOF
# written by scripts/demo.sh
prefix = "${PREFIX}"
[topology]
radix = 16
unit = "1ms"
max_delay = "1m"
fixed_levels = ["1s"]
queue_type = "quorum"
EOF

WORKER_PID=""
DECLARED=0
CLEANED=0

# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    local rc=$?
    [[ ${CLEANED} -eq 1 ]] && return
    CLEANED=1
    trap - INT TERM
    if [[ -n "${WORKER_PID}" ]] && kill -0 "${WORKER_PID}" 2>/dev/null; then
        say "stopping the worker"
        kill -TERM "${WORKER_PID}" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "${WORKER_PID}" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "${WORKER_PID}" 2>/dev/null || true
        wait "${WORKER_PID}" 2>/dev/null || true
    fi
    if [[ ${DECLARED} -eq 1 && ${KEEP} -eq 1 ]]; then
        say "--keep: left the topology '${PREFIX}' and the queue '${QUEUE}'. Remove them with:"
        say "  ${PUBLISHER} --config ${CONFIG} teardown --queue ${QUEUE} --force"
        say "  ${PUBLISHER} --config ${CONFIG} teardown --force"
        return
    fi
    if [[ ${DECLARED} -eq 1 ]]; then
        say "removing the topology '${PREFIX}' and the queue '${QUEUE}'"
        "${PUBLISHER}" --config "${CONFIG}" teardown --queue "${QUEUE}" --force >/dev/null \
            || warn "could not remove the queue: run '${PUBLISHER} --config ${CONFIG} teardown --queue ${QUEUE} --force'"
        "${PUBLISHER}" --config "${CONFIG}" teardown --force >/dev/null \
            || warn "teardown failed: run '${PUBLISHER} --config ${CONFIG} teardown --force'"
    fi
    rm -rf "${WORK}"
    return "${rc}"
}
trap cleanup EXIT
trap 'warn "interrupted"; exit 130' INT
trap 'warn "terminated"; exit 143' TERM

say "declaring the topology '${PREFIX}' and the queue '${QUEUE}'"
DECLARED=1
"${PUBLISHER}" --config "${CONFIG}" declare --queue "${QUEUE}" --worker >/dev/null

# --- 4. the worker, then the messages ------------------------------------------
OUT="${WORK}/worker.jsonl"
ERR="${WORK}/worker.log"
RUST_LOG="warn,amqp_delay=info" "${CONSUMER}" --config "${CONFIG}" --queue "${QUEUE}" --log \
    >"${OUT}" 2>"${ERR}" &
WORKER_PID=$!
deadline=$((SECONDS + 30))
until grep -q "worker consuming" "${ERR}" 2>/dev/null; do
    if ! kill -0 "${WORKER_PID}" 2>/dev/null || ((SECONDS >= deadline)); then
        warn "the worker did not start consuming; its log:"
        cat "${ERR}" >&2
        exit 1
    fi
    sleep 0.1
done
say "worker consuming '${QUEUE}' (delay-consumer --log)"

declare -A DELAY=()
JSONL="${WORK}/messages.jsonl"
: >"${JSONL}"
for ((i = 0; i < COUNT; i++)); do
    id="$(printf 'demo-%03d' "$((i + 1))")"
    d=$((MIN_MS + i * (MAX_MS - MIN_MS) / (COUNT - 1)))
    DELAY[${id}]=${d}
    printf '{"queue":"%s","delay_ms":%d,"id":"%s","body":"message %d of %d"}\n' \
        "${QUEUE}" "${d}" "${id}" "$((i + 1))" "${COUNT}" >>"${JSONL}"
done
say "scheduling ${COUNT} messages, delays ${MIN_MS} ms .. ${MAX_MS} ms (delay-publisher send --jsonl -)"
"${PUBLISHER}" --config "${CONFIG}" send --jsonl - <"${JSONL}" | sed 's/^/[demo]   /'

# --- 5. watch them fire ----------------------------------------------------------
declare -A SEEN=()
LATENESS=()
seen_lines=0
deadline=$((SECONDS + MAX_MS / 1000 + 30))
while ((${#SEEN[@]} < COUNT)); do
    if ((SECONDS >= deadline)); then
        warn "timed out waiting for $((COUNT - ${#SEEN[@]})) message(s)"
        break
    fi
    if ! kill -0 "${WORKER_PID}" 2>/dev/null; then
        warn "the worker exited; its log:"
        cat "${ERR}" >&2
        break
    fi
    complete=$(wc -l <"${OUT}")
    if ((complete > seen_lines)); then
        mapfile -t lines < <(tail -n "+$((seen_lines + 1))" "${OUT}" | head -n "$((complete - seen_lines))")
        seen_lines=${complete}
        for line in "${lines[@]}"; do
            [[ "${line}" =~ \"id\":\"([^\"]+)\" ]] || continue
            id="${BASH_REMATCH[1]}"
            [[ "${line}" =~ \"lateness_ms\":(-?[0-9]+) ]] || continue
            late="${BASH_REMATCH[1]}"
            [[ -n "${DELAY[${id}]:-}" && -z "${SEEN[${id}]:-}" ]] || continue
            SEEN[${id}]=1
            LATENESS+=("${late}")
            note=""
            ((late < 0)) && note="  EARLY"
            printf '  fired %s  delay %6d ms  lateness %4d ms%s\n' "${id}" "${DELAY[${id}]}" "${late}" "${note}"
        done
    else
        sleep 0.05
    fi
done

# --- summary ---------------------------------------------------------------------
fired=${#SEEN[@]}
if ((fired == 0)); then
    echo "summary: 0/${COUNT} fired"
    exit 1
fi
read -r early on_time lmin lp50 lmax < <(printf '%s\n' "${LATENESS[@]}" | sort -n | awk -v ok="${ON_TIME_MS}" '
    { v[NR] = $1; if ($1 < 0) early++; else if ($1 <= ok) on++ }
    END { printf "%d %d %d %d %d\n", early, on, v[1], v[int((NR + 1) / 2)], v[NR] }')
if ((early == 0)); then early_text="none early"; else early_text="${early} EARLY"; fi
echo "summary: ${fired}/${COUNT} fired, ${on_time} on time (<= ${ON_TIME_MS} ms late), ${early_text}; lateness min ${lmin} ms, p50 ${lp50} ms, max ${lmax} ms"
if ((fired == COUNT && early == 0)); then
    exit 0
fi
exit 1
