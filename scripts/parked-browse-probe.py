#!/usr/bin/env python3
# scripts/parked-browse-probe.py — what does browsing a parking queue cost the messages in it?
# Issue 47 wants `parked list` to never lose, reorder or use up the delivery limit of what it
# looks at. This probe declares throwaway queues the way src/topology.rs declares a parking
# queue (`x-queue-type: quorum`, nothing else: no x-delivery-limit, no dead-letter exchange),
# fills each with N messages (message_id m00, m01, ...), and browses it R times in one way,
# printing per round: how many messages are still there, whether a full read sees the first
# order, and the broker's counters (x-delivery-count, x-acquired-count) on the messages.
# Report: docs/reports/2026-12-06-parked-browse.md.
#
#   python3 scripts/parked-browse-probe.py --url amqp://guest:guest@127.0.0.1:5672/%2f --label 3.10.8
#   python3 scripts/parked-browse-probe.py --url amqp://guest:guest@127.0.0.1:5741/%2f --label 4.0.5 \
#       --ctl "env RABBITMQ4_SERIES=4.0 bash scripts/rabbitmq4.sh rabbitmqctl"
#   ... --only get-nack,stream     # a subset of the experiments (names: --list)
#
# --ctl is a command that runs rabbitmqctl against the node (the peek experiment uses
# `rabbitmqctl eval rabbit_quorum_queue:peek/3`, and the policy experiment set_policy and
# clear_policy, on a pattern that matches only this probe's queues). Without it those two are
# skipped. The policy experiment runs only when --only names it (never on a shared broker).
# Queue names start with `spk47-` (--prefix) and every queue is deleted afterwards.
# Needs pika.
import argparse
import re
import shlex
import subprocess
import sys
import time
import uuid

import pika

ap = argparse.ArgumentParser()
ap.add_argument("--url", required=True)
ap.add_argument("--label", required=True)
ap.add_argument("--ctl", default="")
ap.add_argument("--prefix", default="spk47-")
ap.add_argument("-n", type=int, default=10, help="messages per queue")
ap.add_argument("-r", "--rounds", type=int, default=25, help="browses per experiment")
ap.add_argument("--only", default="")
ap.add_argument("--list", action="store_true")
args = ap.parse_args()

RUN = uuid.uuid4().hex[:6]
PARKING = {"x-queue-type": "quorum"}  # what Topology::parked_args declares (the leader locator aside)
IDS = [f"m{i:02d}" for i in range(args.n)]
created = []


def out(*a):
    print(*a, flush=True)


def connect():
    p = pika.URLParameters(args.url)
    p.heartbeat = 0
    return pika.BlockingConnection(p)


def qname(tag):
    return f"{args.prefix}{tag}-{RUN}"


def declare(conn, tag, arguments):
    name = qname(tag)
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments=arguments)
    ch.close()
    created.append(name)
    return name


def fill(conn, q, ids=IDS):
    ch = conn.channel()
    ch.confirm_delivery()
    for i in ids:
        ch.basic_publish("", q, i.encode(), pika.BasicProperties(delivery_mode=2, message_id=i),
                         mandatory=True)
    ch.close()


def ready(conn, q):
    ch = conn.channel()
    n = ch.queue_declare(q, passive=True).method.message_count
    ch.close()
    return n


def settle_wait(conn, q, expect, secs=3.0):
    """Waits until the queue counts `expect` ready messages again (the returns applied), or
    `secs`; returns the ready count seen last."""
    end = time.time() + secs
    n = ready(conn, q)
    while n < expect and time.time() < end:
        time.sleep(0.02)
        n = ready(conn, q)
    return n


def rec(method, props):
    h = props.headers or {}
    return (props.message_id, h.get("x-delivery-count"), h.get("x-acquired-count"),
            bool(method.redelivered))


def get_all(ch, q, limit=None):
    """basic.get (no_ack=False) until empty or `limit`; returns [(id, dc, ac, redelivered, tag)]."""
    got = []
    while limit is None or len(got) < limit:
        m, p, _ = ch.basic_get(q, auto_ack=False)
        if m is None:
            break
        got.append(rec(m, p) + (m.delivery_tag,))
    return got


def consume_n(ch, q, n, prefetch, cargs=None, secs=3.0):
    ch.basic_qos(prefetch_count=prefetch)
    got = []

    def on(_ch, m, p, _b):
        got.append(rec(m, p) + (m.delivery_tag,))

    tag = ch.basic_consume(q, on, auto_ack=False, arguments=cargs or {})
    end = time.time() + secs
    while len(got) < n and time.time() < end:
        ch.connection.process_data_events(time_limit=0.05)
    return tag, got


def summary(got):
    dc = sorted({g[1] or 0 for g in got})
    ac = sorted({g[2] for g in got if g[2] is not None})
    fmt = lambda s: (str(s[0]) if len(s) == 1 else f"{s[0]}..{s[-1]}") if s else "-"
    return fmt(dc), fmt(ac)


def rounds(conn, q, browse, label, rounds=None, expect=None):
    """Runs `browse(conn, q)` (one browse: takes messages, gives them back) `rounds` times.
    Before every browse a reading of the whole queue is made by the browse itself (it returns
    what it saw). Prints a line per round where something changed, and the last."""
    rounds = rounds or args.rounds
    expect = args.n if expect is None else expect
    last = None
    lost_at = None
    for r in range(1, rounds + 1):
        got = browse(conn, q)
        after = settle_wait(conn, q, expect)
        ids = [g[0] for g in got]
        order = "same" if ids == IDS[: len(ids)] else "CHANGED " + ",".join(ids)
        dc, ac = summary(got)
        line = (f"{label}: browse {r:2d}: saw {len(got):2d} (order {order}; x-delivery-count {dc};"
                f" x-acquired-count {ac}; redelivered {sum(g[3] for g in got)}) -> ready after {after}")
        key = (len(got), order, after)
        if key != last or r == rounds or r <= 2 or after < expect:
            out(line)
        last = key
        if after < expect and lost_at is None:
            lost_at = r
            out(f"{label}: LOST {expect - after} message(s) at browse {r}")
            expect = after
            if after == 0:
                break
    if lost_at is None:
        out(f"{label}: nothing lost in {rounds} browses")
    return lost_at


# --- the ways to browse -----------------------------------------------------------------------

def b_get_nack(conn, q):
    ch = conn.channel()
    got = get_all(ch, q)
    if got:
        ch.basic_nack(got[-1][4], multiple=True, requeue=True)
    ch.close()
    return got


def b_get_reject(conn, q):
    ch = conn.channel()
    got = get_all(ch, q)
    for g in got:
        ch.basic_reject(g[4], requeue=True)
    ch.close()
    return got


def b_get_close(conn, q):
    ch = conn.channel()
    got = get_all(ch, q)
    ch.close()
    return got


def b_get_recover(conn, q):
    ch = conn.channel()
    got = get_all(ch, q)
    ch.basic_recover(requeue=True)
    ch.close()
    return got


def b_consume_cancel_close(conn, q):
    ch = conn.channel()
    tag, got = consume_n(ch, q, args.n, prefetch=args.n)
    ch.basic_cancel(tag)
    ch.close()
    return got


def b_consume_nack_close(conn, q):
    ch = conn.channel()
    tag, got = consume_n(ch, q, args.n, prefetch=args.n)
    ch.basic_cancel(tag)
    if got:
        ch.basic_nack(got[-1][4], multiple=True, requeue=True)
    ch.close()
    return got


def b_consume_nack_wait_close(conn, q):
    """As b_consume_nack_close, but the channel closes only once the queue counts every
    message ready again (the nack applied)."""
    ch = conn.channel()
    tag, got = consume_n(ch, q, args.n, prefetch=args.n)
    ch.basic_cancel(tag)
    if got:
        ch.basic_nack(got[-1][4], multiple=True, requeue=True)
    settle_wait(conn, q, len(got))
    ch.close()
    return got


def b_connection_close(conn, q):
    c = connect()
    ch = c.channel()
    _, got = consume_n(ch, q, args.n, prefetch=args.n)
    c.close()
    return got


BROWSES = {
    "get-nack": (b_get_nack, "basic.get x N, one basic.nack(multiple, requeue), close"),
    "get-reject": (b_get_reject, "basic.get x N, basic.reject(requeue) each, close"),
    "get-close": (b_get_close, "basic.get x N, channel.close without settling"),
    "get-recover": (b_get_recover, "basic.get x N, basic.recover(requeue), close"),
    "consume-cancel-close": (b_consume_cancel_close,
                             "consumer prefetch N, basic.cancel, channel.close without settling"),
    "consume-nack-close": (b_consume_nack_close,
                           "consumer prefetch N, basic.cancel, basic.nack(multiple, requeue), close at once"),
    "consume-nack-wait-close": (b_consume_nack_wait_close,
                                "as consume-nack-close, closing once the nack applied"),
    "conn-close": (b_connection_close, "consumer prefetch N on its own connection, connection.close"),
}


# --- experiments ------------------------------------------------------------------------------

def exp_browse(name):
    fn, what = BROWSES[name]

    def run(conn):
        out(f"\n## {name}: {what}; parking-queue arguments {PARKING}")
        q = declare(conn, name, PARKING)
        fill(conn, q)
        rounds(conn, q, fn, name)
    return run


def exp_partial(tag, extra):
    def run(conn):
        a = dict(PARKING)
        a.update(extra)
        out(f"\n## partial-{tag}: arguments {a}: take the first 3 with basic.get, nack them,"
            " then a full read (get-nack)")
        try:
            q = declare(conn, f"partial-{tag}", a)
        except pika.exceptions.ChannelClosedByBroker as e:
            out(f"partial-{tag}: declare refused: {e}")
            return
        fill(conn, q)
        ch = conn.channel()
        got = get_all(ch, q, limit=3)
        ch.basic_nack(got[-1][4], multiple=True, requeue=True)
        ch.close()
        settle_wait(conn, q, args.n)
        full = b_get_nack(conn, q)
        ids = [g[0] for g in full]
        out(f"partial-{tag}: took {[g[0] for g in got]}; the next full read: {ids}"
            f" ({'same order' if ids == IDS else 'ORDER CHANGED'})")
        out(f"partial-{tag}: counters on the full read: {[(g[0], g[1], g[2]) for g in full]}")
        # a message parked while a browse holds the whole queue
        settle_wait(conn, q, args.n)
        ch = conn.channel()
        held = get_all(ch, q)
        fill(conn, q, ["new"])
        if held:
            ch.basic_nack(held[-1][4], multiple=True, requeue=True)
        ch.close()
        settle_wait(conn, q, args.n + 1)
        full = b_get_nack(conn, q)
        ids = [g[0] for g in full]
        where = ids.index("new") if "new" in ids else None
        out(f"partial-{tag}: a message parked during a browse of all: the next full read: {ids}"
            f" ('new' at position {where} of {len(ids)}; {'order kept' if ids == IDS + ['new'] else 'ORDER CHANGED'})")
        # drop one by id from the middle, reading only up to it
        settle_wait(conn, q, args.n + 1)
        ch = conn.channel()
        ch.basic_qos(prefetch_count=0)
        before, target = [], None
        while True:
            m, p, _ = ch.basic_get(q, auto_ack=False)
            if m is None:
                break
            if p.message_id == "m05":
                target = m.delivery_tag
                break
            before.append(rec(m, p) + (m.delivery_tag,))
        if target is None:
            out(f"partial-{tag}: m05 not found")
            ch.close()
            return
        ch.basic_ack(target)
        if before:
            ch.basic_nack(before[-1][4], multiple=True, requeue=True)
        ch.close()
        settle_wait(conn, q, args.n)
        full = b_get_nack(conn, q)
        ids = [g[0] for g in full]
        out(f"partial-{tag}: after dropping m05 by reading up to it: {ids}"
            f" ({'order kept' if ids == [i for i in IDS + ['new'] if i != 'm05'] else 'ORDER CHANGED'})")
    return run


def exp_limit(tag, value):
    def run(conn):
        out(f"\n## limit-{tag}: x-delivery-limit {value!r}, browsed with get-nack")
        a = dict(PARKING)
        a["x-delivery-limit"] = value
        try:
            q = declare(conn, f"limit-{tag}", a)
        except pika.exceptions.ChannelClosedByBroker as e:
            out(f"limit-{tag}: declare refused: {e}")
            return
        fill(conn, q)
        rounds(conn, q, b_get_nack, f"limit-{tag}")
    return run


def exp_concurrent(conn):
    out("\n## concurrent: two browsers at once, consumers with prefetch N/2 each on their own"
        " channel; B gives back before A; then a full read")
    q = declare(conn, "concurrent", PARKING)
    fill(conn, q)
    half = max(1, args.n // 2)
    cha, chb = conn.channel(), conn.channel()
    ta, a = consume_n(cha, q, half, prefetch=half)
    tb, b = consume_n(chb, q, half, prefetch=half)
    out(f"concurrent: A saw {[g[0] for g in a]}; B saw {[g[0] for g in b]}")
    chb.basic_cancel(tb)
    chb.basic_nack(b[-1][4], multiple=True, requeue=True)
    settle_wait(conn, q, len(b))
    cha.basic_cancel(ta)
    cha.basic_nack(a[-1][4], multiple=True, requeue=True)
    settle_wait(conn, q, args.n)
    cha.close()
    chb.close()
    full = b_get_nack(conn, q)
    ids = [g[0] for g in full]
    out(f"concurrent: the next full read: {ids} ({'same order' if ids == IDS else 'ORDER CHANGED'})")
    # and a browser running beside a consumer that holds part of the queue
    settle_wait(conn, q, args.n)
    chw = conn.channel()
    tw, w = consume_n(chw, q, 3, prefetch=3)
    seen = b_get_nack(conn, q)
    out(f"concurrent: while a consumer holds {[g[0] for g in w]}, a browser sees"
        f" {[g[0] for g in seen]} ({len(seen)} of {args.n})")
    chw.basic_cancel(tw)
    chw.basic_nack(w[-1][4], multiple=True, requeue=True)
    settle_wait(conn, q, args.n)
    chw.close()
    # an exclusive consumer as a browsers' lock: does a second one get refused?
    chx = conn.channel()
    chx.basic_qos(prefetch_count=1)
    tx = chx.basic_consume(q, lambda *a: None, auto_ack=False, exclusive=True)
    conn.process_data_events(time_limit=0.2)
    c2 = connect()
    try:
        c2.channel().basic_consume(q, lambda *a: None, auto_ack=False, exclusive=True)
        out("concurrent: a second exclusive consumer was ACCEPTED (no lock)")
    except pika.exceptions.ChannelClosedByBroker as e:
        out(f"concurrent: a second exclusive consumer is refused: {e}")
    try:
        ch2 = c2.channel()
        m, p, _ = ch2.basic_get(q, auto_ack=False)
        out(f"concurrent: basic.get beside an exclusive consumer: {'got ' + p.message_id if m else 'empty'}")
        if m:
            ch2.basic_nack(m.delivery_tag, requeue=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        out(f"concurrent: basic.get beside an exclusive consumer is refused: {e}")
    c2.close()
    chx.close()
    settle_wait(conn, q, args.n)


def exp_by_id(conn):
    out("\n## by-id: drop m05 by reading from the head: basic.get until m05, basic.ack it,"
        " one basic.nack(multiple, requeue) for those before it; then a full read")
    q = declare(conn, "by-id", PARKING)
    fill(conn, q)
    ch = conn.channel()
    before, target = [], None
    while True:
        m, p, _ = ch.basic_get(q, auto_ack=False)
        if m is None:
            break
        if p.message_id == "m05":
            target = m.delivery_tag
            break
        before.append(rec(m, p) + (m.delivery_tag,))
    ch.basic_ack(target)
    if before:
        ch.basic_nack(before[-1][4], multiple=True, requeue=True)
    ch.close()
    settle_wait(conn, q, args.n - 1)
    full = b_get_nack(conn, q)
    out(f"by-id: the next full read: {[(g[0], g[1], g[2]) for g in full]}")
    exp = [i for i in IDS if i != "m05"]
    out(f"by-id: {'same order without m05' if [g[0] for g in full] == exp else 'ORDER CHANGED'}")
    out("by-id: the same with a consumer (prefetch N) that acks m05 and nacks the rest at once:")
    ch = conn.channel()
    tag, got = consume_n(ch, q, args.n - 1, prefetch=args.n)
    ch.basic_cancel(tag)
    t6 = [g for g in got if g[0] == "m06"][0][4]
    ch.basic_ack(t6)
    ch.basic_nack(got[-1][4], multiple=True, requeue=True)
    ch.close()
    settle_wait(conn, q, args.n - 2)
    full = b_get_nack(conn, q)
    out(f"by-id: after dropping m06 so: {[(g[0], g[1], g[2]) for g in full]}")


def exp_stream(conn):
    out("\n## stream: x-queue-type stream, read twice from the first offset by consumers")
    q = declare(conn, "stream", {"x-queue-type": "stream"})
    fill(conn, q)
    for r in (1, 2):
        ch = conn.channel()
        tag, got = consume_n(ch, q, args.n, prefetch=args.n * 2, cargs={"x-stream-offset": "first"})
        ch.basic_ack(got[-1][4], multiple=True) if got else None
        ch.close()
        ids = [g[0] for g in got]
        out(f"stream: read {r}: saw {len(ids)} ({'same order' if ids == IDS else ids});"
            f" counters {summary(got)}; queue counts {ready(conn, q)}")


def ctl(*a, secs=60):
    cmd = shlex.split(args.ctl) + list(a)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=secs)


def exp_peek(conn):
    if not args.ctl:
        out("\n## peek: skipped (no --ctl)")
        return
    out("\n## peek: rabbitmqctl eval rabbit_quorum_queue:peek/3 at positions 1..N+1, twice,"
        " then one get-nack browse, then peek again")
    q = declare(conn, "peek", PARKING)
    fill(conn, q)

    def peek_all():
        expr = ("[case rabbit_quorum_queue:peek(<<\"/\">>, <<\"%s\">>, P) of {ok, M} -> "
                "{P, proplists:get_value(<<\"message_id\">>, M), "
                "proplists:get_value(<<\"header.x-delivery-count\">>, M), "
                "proplists:get_value(<<\"header.x-acquired-count\">>, M)}; E -> {P, E} end "
                "|| P <- lists:seq(1, %d)]." % (q, args.n + 1))
        t = time.time()
        r = ctl("eval", expr)
        dt = time.time() - t
        text = (r.stdout + r.stderr).strip()
        return re.sub(r"\s+", " ", text), dt

    for label in ("first", "second"):
        text, dt = peek_all()
        out(f"peek: {label} pass ({dt:.1f} s incl. rabbitmqctl start): {text}")
    b_get_nack(conn, q)
    settle_wait(conn, q, args.n)
    text, dt = peek_all()
    out(f"peek: after one get-nack browse: {text}")
    ch = conn.channel()
    held = get_all(ch, q, limit=2)
    text, _ = peek_all()
    out(f"peek: while a channel holds {[g[0] for g in held]}: {text}")
    ch.close()


def exp_policy(conn):
    if not args.ctl:
        out("\n## policy: skipped (no --ctl)")
        return
    out("\n## policy: a queue declared like a parking queue (no x-delivery-limit), then a policy"
        " delivery-limit -1 on this probe's queues, browsed with get-nack")
    q = declare(conn, "policy", PARKING)
    fill(conn, q)
    pol = f"spk47-{RUN}"
    r = ctl("set_policy", "--apply-to", "quorum_queues", pol, f"^{re.escape(q)}$",
            '{"delivery-limit": -1}')
    out(f"policy: set_policy: rc {r.returncode} {(r.stdout + r.stderr).strip()[-200:]}")
    time.sleep(1)
    try:
        rounds(conn, q, b_get_nack, "policy")
    finally:
        r = ctl("clear_policy", pol)
        out(f"policy: clear_policy: rc {r.returncode}")


def exp_peek_scale(conn):
    if not args.ctl:
        out("\n## peek-scale: skipped (no --ctl)")
        return
    for n in (1000, 5000):
        q = declare(conn, f"peek{n}", PARKING)
        fill(conn, q, [f"m{i:05d}" for i in range(n)])
        expr = ("T0 = erlang:monotonic_time(millisecond), "
                "L = [element(1, rabbit_quorum_queue:peek(<<\"/\">>, <<\"%s\">>, P)) || P <- lists:seq(1, %d)], "
                "{length([ok || ok <- L]), erlang:monotonic_time(millisecond) - T0}." % (q, n))
        r = ctl("eval", expr, secs=300)
        out(f"\n## peek-scale: {n} messages, peek at every position in one eval: "
            f"{{peeked, ms}} = {(r.stdout + r.stderr).strip()}")
        ch = conn.channel()
        ch.queue_delete(q)
        ch.close()


def exp_rotation_scale(conn):
    """The cost of one whole-queue browse (a consumer takes every message, one nack gives them
    back) at 5000 messages, with and without the huge delivery limit."""
    big = {"x-delivery-limit": 1_000_000_000}
    for tag, extra, run in (("none", {}, 0), ("1e9", big, 0), ("1e9-nack-runs-of-32", big, 32),
                            ("1e9-nack-runs-of-32-each-applied", big, -32),
                            ("1e9-channel-close", big, None)):
        n = 5000
        a = dict(PARKING)
        a.update(extra)
        q = declare(conn, f"rot{n}-{len(tag)}", a)
        ids = [f"m{i:05d}" for i in range(n)]
        ch = conn.channel()
        ch.confirm_delivery()
        for i in ids:
            ch.basic_publish("", q, b"x" * 512, pika.BasicProperties(delivery_mode=2, message_id=i))
        ch.close()
        for r in (1, 2, 3):
            t = time.time()
            ch = conn.channel()
            tag_, got = consume_n(ch, q, n, prefetch=n, secs=60)
            t_read = time.time() - t
            ch.basic_cancel(tag_)
            if run is None:
                pass  # the channel's close gives them back
            elif run:
                step = abs(run)
                for k in range(step - 1, len(got) + step - 1, step):
                    k = min(k, len(got) - 1)
                    ch.basic_nack(got[k][4], multiple=True, requeue=True)
                    if run < 0:  # wait until this run is back before the next
                        settle_wait(conn, q, n - len(got) + k + 1, secs=10)
            else:
                ch.basic_nack(got[-1][4], multiple=True, requeue=True)
            if run is None:
                ch.close()
            back = settle_wait(conn, q, n, secs=60)
            if ch.is_open:
                ch.close()
            seen = [g[0] for g in got]
            diff = ""
            if seen != ids:
                k = next((i for i, (x, y) in enumerate(zip(seen, ids)) if x != y), min(len(seen), n))
                moved = sum(1 for i, x in enumerate(seen) if i >= len(ids) or x != ids[i])
                diff = f" (first at position {k}: {seen[k:k + 4]}; {moved} positions differ)"
            out(f"\n## rotation-scale {tag}: {n} messages of 512 B, browse {r}: read {len(got)} in"
                f" {t_read:.2f} s, all back after {time.time() - t:.2f} s ({back} ready);"
                f" order {'same' if seen == ids else 'CHANGED'}{diff}")


EXPERIMENTS = {name: exp_browse(name) for name in BROWSES}
EXPERIMENTS.update({
    "partial": exp_partial("none", {}),
    "partial-1e9": exp_partial("1e9", {"x-delivery-limit": 1_000_000_000}),
    "partial-minus-1": exp_partial("minus-1", {"x-delivery-limit": -1}),
    "limit-minus-1": exp_limit("minus-1", -1),
    "limit-0": exp_limit("0", 0),
    "limit-2": exp_limit("2", 2),
    "limit-1e9": exp_limit("1e9", 1_000_000_000),
    "limit-i64max": exp_limit("i64max", 2**63 - 1),
    "concurrent": exp_concurrent,
    "by-id": exp_by_id,
    "stream": exp_stream,
    "peek": exp_peek,
    "policy": exp_policy,
    "peek-scale": exp_peek_scale,
    "rotation-scale": exp_rotation_scale,
})

if args.list:
    for k in EXPERIMENTS:
        print(k)
    sys.exit(0)

# the policy experiment changes the broker's policies (on this probe's queue only): run it only
# when named, and never on a broker that is not yours
only = [s for s in args.only.split(",") if s] or [k for k in EXPERIMENTS if k != "policy"]
conn = connect()
out(f"# {args.label}: broker {conn._impl.server_properties.get('version', b'?')!r},"
    f" {args.n} messages per queue, {args.rounds} browses, run {RUN}")
try:
    for name in only:
        try:
            EXPERIMENTS[name](conn)
        except Exception as e:  # one experiment's failure is a finding, not the end
            out(f"{name}: FAILED: {type(e).__name__}: {e}")
            if conn.is_closed:
                conn = connect()
finally:
    if conn.is_closed:
        conn = connect()
    for q in created:
        try:
            ch = conn.channel()
            ch.queue_delete(q)
            ch.close()
        except Exception as e:
            out(f"delete {q}: {e}")
            conn = connect()
    out(f"# deleted {len(created)} queue(s)")
    conn.close()
