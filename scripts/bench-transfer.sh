#!/usr/bin/env bash
# scripts/bench-transfer.sh — measures `delay-publisher transfer`: N messages waiting on the old
# cluster (the main broker, 3.10), a share BATCHED of them to a destination whose workers read
# batches, the rest plain, all due in about two hours, moved to the new one (the 4.3 node of
# `RABBITMQ4_SERIES=4.3 scripts/rabbitmq4.sh up`, or NEW_URL). Prints the fill time, the
# transfer's wall time and peak RSS (/usr/bin/time -v), what the new cluster then holds; tears
# down both sides. Take `flock /tmp/adbench.lock` around it.
#
# Usage: scripts/bench-transfer.sh [N] [BATCHED_PERCENT]      (defaults 100000, 90)
# Environment: BIN (the tools' directory, default target/release), OLD_URL, NEW_URL, PREFETCH
# (transfer --prefetch, default 50, as the command).

set -euo pipefail

N=${1:-100000}
BATCHED=${2:-90}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=${BIN:-${ROOT}/target/release}
OLD_URL=${OLD_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
NEW_URL=${NEW_URL:-amqp://guest:guest@127.0.0.1:5841/%2f}
P=hbto$(printf '%06x' $((RANDOM * RANDOM)))
NP=hbtn${P#hbto}
WORK=$(mktemp -d /tmp/bench-transfer.XXXXXX)
CFG=${WORK}/transfer.toml
printf '[trust]\nadmins = ["guest"]\n' >"${CFG}"

old() { "${BIN}/delay-publisher" --config "${CFG}" --url "${OLD_URL}" --prefix "${P}" "$@"; }
new() { "${BIN}/delay-publisher" --config "${CFG}" --url "${NEW_URL}" --prefix "${NP}" "$@"; }

cleanup() {
    for side in old new; do
        for q in "${P}-batched" "${P}-plain"; do
            "${side}" teardown --queue "${q}" --force >/dev/null 2>&1 || true
        done
        "${side}" teardown --force >/dev/null 2>&1 || true
    done
    rm -rf "${WORK}"
}
trap cleanup EXIT

for side in old new; do
    "${side}" declare --queue "${P}-batched" --worker >/dev/null
    "${side}" declare --queue "${P}-plain" >/dev/null
done

nb=$((N * BATCHED / 100))
# due in 2 h, spread over 10 min: a batch per due window (the lateness budget)
awk -v n="${N}" -v nb="${nb}" -v p="${P}" 'BEGIN {
    for (i = 0; i < n; i++) {
        q = (i < nb) ? p "-batched" : p "-plain";
        printf "{\"queue\":\"%s\",\"delay_ms\":%d,\"id\":\"m%d\",\"body\":\"order %d\"}\n", q, 7200000 + (i * 600000) / n, i, i;
    }
}' >"${WORK}/fill.jsonl"

t0=$(date +%s.%N)
old send --jsonl "${WORK}/fill.jsonl" >"${WORK}/fill.out"
t1=$(date +%s.%N)
echo "fill: ${N} messages (${nb} batched) in $(echo "${t1} - ${t0}" | bc) s"
old stats --summary | tail -3

t0=$(date +%s.%N)
/usr/bin/time -v "${BIN}/delay-publisher" --config "${CFG}" --url "${OLD_URL}" --prefix "${P}" \
    transfer --to "${NEW_URL}" --to-prefix "${NP}" --prefetch "${PREFETCH:-50}" >"${WORK}/transfer.out" 2>"${WORK}/transfer.err" || true
t1=$(date +%s.%N)
echo "transfer: $(echo "${t1} - ${t0}" | bc) s; $(tail -1 "${WORK}/transfer.out")"
grep -E "Maximum resident set size|Elapsed" "${WORK}/transfer.err"
echo "new cluster:"
new stats --summary | tail -3
echo "old cluster:"
old stats --summary | tail -3
