#!/usr/bin/env bash
# scripts/bench-transfer.sh — measures `delay-publisher transfer`: N messages waiting on the old
# cluster (the main broker, 3.10), a share BATCHED of them to a destination whose workers read
# batches, the rest plain, due DUE_IN s after the fill starts, spread over SPREAD s, moved to the
# new one (the 4.3 node of `RABBITMQ4_SERIES=4.3 scripts/rabbitmq4.sh up`, or NEW_URL). Prints
# the fill time, the transfer's wall time and peak RSS (/usr/bin/time -v), what the new cluster
# then holds; tears down both sides. Take `flock /tmp/adbench.lock` around it.
#
# With MEASURE=1 the moved messages are then run on the new cluster (our worker on the batched
# destination, a plain AMQP consumer on the plain one, both started before the transfer), and a
# control set (a tenth of N, the same due times, sent straight to the
# new cluster after the transfer) beside them; when the last is due (+30 s) it prints, for the
# moved and the control messages, how many arrived, were doubled or early, their lateness
# (fired - due) p50/p99/p99.9/max, and how many passed the budget of their original delay
# (max(5 ms, delay/1000), the planner's default). DUE_IN must leave room for the fill and the
# transfer: a message due before it moved runs on neither cluster (no worker on the old one).
#
# Usage: scripts/bench-transfer.sh [N] [BATCHED_PERCENT]      (defaults 100000, 90)
# Environment: BIN (the tools' directory, default target/release), OLD_URL, NEW_URL, PREFETCH
# (transfer --prefetch, default 50, as the command), DUE_IN (s, default 7200), SPREAD (s,
# default 600), MEASURE.

set -euo pipefail

N=${1:-100000}
BATCHED=${2:-90}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=${BIN:-${ROOT}/target/release}
OLD_URL=${OLD_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
NEW_URL=${NEW_URL:-amqp://guest:guest@127.0.0.1:5841/%2f}
DUE_IN=${DUE_IN:-7200}
SPREAD=${SPREAD:-600}
P=hbto$(printf '%06x' $((RANDOM * RANDOM)))
NP=hbtn${P#hbto}
WORK=$(mktemp -d /tmp/bench-transfer.XXXXXX)
CFG=${WORK}/transfer.toml
printf '[trust]\nadmins = ["guest"]\n' >"${CFG}"

old() { "${BIN}/delay-publisher" --config "${CFG}" --url "${OLD_URL}" --prefix "${P}" "$@"; }
new() { "${BIN}/delay-publisher" --config "${CFG}" --url "${NEW_URL}" --prefix "${NP}" "$@"; }

cleanup() {
    for pid in ${CONSUMERS:-}; do kill "${pid}" 2>/dev/null || true; done
    wait 2>/dev/null || true
    # a topology left behind holds the broker's file handles (3 a quorum queue): say so loudly
    for side in old new; do
        for q in "${P}-batched" "${P}-plain"; do
            "${side}" teardown --queue "${q}" --force >/dev/null 2>&1 || true
        done
        local prefix=${P}
        [[ "${side}" == new ]] && prefix=${NP}
        "${side}" teardown --force >/dev/null 2>"${WORK}/teardown.err" ||
            echo "bench-transfer.sh: the ${side} cluster's topology '${prefix}' was NOT removed ($(tail -1 "${WORK}/teardown.err")); remove it with: delay-publisher --prefix ${prefix} teardown --force" >&2
    done
    rm -rf "${WORK}"
}
trap cleanup EXIT

for side in old new; do
    "${side}" declare --queue "${P}-batched" --worker >/dev/null
    "${side}" declare --queue "${P}-plain" >/dev/null
done

nb=$((N * BATCHED / 100))
# message i (id m<i>) due DUE_IN s after the fill starts, plus its share of SPREAD: a batch per
# due window (the lateness budget)
awk -v n="${N}" -v nb="${nb}" -v p="${P}" -v d="${DUE_IN}" -v w="${SPREAD}" 'BEGIN {
    for (i = 0; i < n; i++) {
        q = (i < nb) ? p "-batched" : p "-plain";
        printf "{\"queue\":\"%s\",\"delay_ms\":%d,\"id\":\"m%d\",\"body\":\"order %d\"}\n", q, d * 1000 + int(i * w * 1000 / n), i, i;
    }
}' >"${WORK}/fill.jsonl"

FILL_MS=$(date +%s%3N)
t0=$(date +%s.%N)
old send --jsonl "${WORK}/fill.jsonl" >"${WORK}/fill.out"
t1=$(date +%s.%N)
echo "fill: ${N} messages (${nb} batched) in $(echo "${t1} - ${t0}" | bc) s"
old stats --summary | tail -3

# with MEASURE=1, the new cluster's consumers run from before the transfer, as in a blue-green
# move: our worker on the batched destination (logging each message it runs), and a plain AMQP
# consumer (not ours: no hold marker) on the plain one, logging each arrival
CONSUMERS=""
if [[ "${MEASURE:-0}" == 1 ]]; then
    "${BIN}/delay-consumer" --config "${CFG}" --url "${NEW_URL}" --prefix "${NP}" \
        --queue "${P}-batched" --log >"${WORK}/got-batched.jsonl" 2>"${WORK}/consumer.err" &
    CONSUMERS="$!"
    python3 - "${NEW_URL}" "${P}-plain" >"${WORK}/got-plain.jsonl" <<'PY' &
import json, signal, sys, time, pika
url, queue = sys.argv[1], sys.argv[2]
ch = pika.BlockingConnection(pika.URLParameters(url)).channel()
ch.basic_qos(prefetch_count=1000)
def got(ch, method, props, body):
    at = int(time.time() * 1000)
    due = (props.headers or {}).get("x-delay-due-at")
    print(json.dumps({"id": props.message_id, "queue": queue,
                      "lateness_ms": None if due is None else at - int(due)}), flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
ch.basic_consume(queue, got, auto_ack=True)
ch.start_consuming()
PY
    CONSUMERS="${CONSUMERS} $!"
    sleep 3
fi

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

[[ "${MEASURE:-0}" == 1 ]] || exit 0

# the control set: every tenth message's due time, sent straight to the new cluster
python3 - "${N}" "${nb}" "${P}" "${FILL_MS}" "${DUE_IN}" "${SPREAD}" >"${WORK}/control.jsonl" <<'PY'
import json, sys, time
n, nb, p, fill, due_in, spread = sys.argv[1:]
n, nb, fill, due_in, spread = int(n), int(nb), int(fill), int(due_in), int(spread)
now = int(time.time() * 1000)
for i in range(0, n, 10):
    due = fill + due_in * 1000 + i * spread * 1000 // n
    q = p + ("-batched" if i < nb else "-plain")
    print(json.dumps({"queue": q, "delay_ms": max(0, due - now), "id": f"c{i}", "body": f"control {i}"}))
PY
new send --jsonl "${WORK}/control.jsonl" >/dev/null
end_ms=$((FILL_MS + (DUE_IN + SPREAD + 30) * 1000))
while (($(date +%s%3N) < end_ms)); do sleep 5; done
for pid in ${CONSUMERS}; do kill -TERM "${pid}"; done
wait
CONSUMERS=""
python3 - "${N}" "${DUE_IN}" "${SPREAD}" "${WORK}"/got-*.jsonl <<'PY'
import json, sys
n, due_in, spread = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
got, doubled = {}, {}
for path in sys.argv[4:]:
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        kind = ("control" if r["id"].startswith("c") else "moved", r["queue"].rsplit("-", 1)[1])
        seen = got.setdefault(kind, {})
        if r["id"] in seen:
            doubled[kind] = doubled.get(kind, 0) + 1
            continue
        seen[r["id"]] = r["lateness_ms"]
# the budget of a message's original delay: max(5 ms, delay / 1000)
budget = lambda i: max(5, (due_in * 1000 + int(i[1:]) * spread * 1000 // n) // 1000)
for kind in sorted(got):
    seen = got[kind]
    late = sorted(seen.values())
    pct = lambda q: late[min(len(late) - 1, int(q * len(late)))]
    over = sum(1 for i, l in seen.items() if l > budget(i))
    print(f"{kind[0]} {kind[1]}: arrived {len(seen)}, doubled {doubled.get(kind, 0)}, "
          f"early {sum(1 for l in late if l < 0)}; lateness ms p50 {pct(0.5)} p99 {pct(0.99)} "
          f"p99.9 {pct(0.999)} max {late[-1]}; over the original budget {over}")
moved = sum(len(v) for k, v in got.items() if k[0] == "moved")
control = sum(len(v) for k, v in got.items() if k[0] == "control")
print(f"arrived: moved {moved} of {n}, control {control} of {len(range(0, n, 10))}")
PY
cp "${WORK}"/got-*.jsonl /tmp/ 2>/dev/null || true
