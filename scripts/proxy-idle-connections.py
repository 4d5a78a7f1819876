#!/usr/bin/env python3
"""Idle-connection footprint of delay-proxy.

Opens N AMQP 0-9-1 connections (one channel each) through the proxy with pika
BlockingConnection, keeps them idle (heartbeats answered by pumping
process_data_events(0) on every connection every --pump-secs), and samples the
proxy process (RSS, fds, threads, utime+stime) from /proc at each stage, plus
the proxy's amqp_delay_proxy_connections gauge and the broker's connection count.

Needs a broker with file handles to spare (each client is also an upstream connection): the
RabbitMQ 4.0.5 node of scripts/rabbitmq4.sh, whose prefix must have its control stream
(`delay-publisher declare`). Measured so (docs/PERFORMANCE.md, "Through delay-proxy"):

  eval "$(scripts/rabbitmq4.sh up)"; ulimit -n 20000
  delay-publisher --url "$AMQP_URL" --prefix idlem declare
  delay-proxy --url "$AMQP_URL" --prefix idlem --listen 127.0.0.1:5690 \
      --idle-timeout 30m --metrics-addr 127.0.0.1:9690 &
  python3 scripts/proxy-idle-connections.py --proxy-pid $! --stages 100,500,1000,2000 \
      --idle-at 1000 --idle-secs 60
  kill %1; delay-publisher --url "$AMQP_URL" --prefix idlem teardown --force
  scripts/rabbitmq4.sh down
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import pika

CLK = os.sysconf("SC_CLK_TCK")


def proc_sample(pid):
    st = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            st[k] = v.strip()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime = field 14, stime = field 15
    utime, stime = int(fields[11]), int(fields[12])
    return {
        "rss_kib": int(st["VmRSS"].split()[0]),
        "hwm_kib": int(st["VmHWM"].split()[0]),
        "threads": int(st["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_ticks": utime + stime,
    }


def gauge(metrics_url):
    try:
        body = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"
    for line in body.splitlines():
        if line.startswith("amqp_delay_proxy_connections "):
            return int(float(line.split()[1]))
    return None


def broker_conns(ctl):
    if not ctl:
        return None
    try:
        out = subprocess.run(
            ctl + " list_connections -q --no-table-headers name",
            shell=True, capture_output=True, text=True, timeout=120,
        ).stdout
        return len([l for l in out.splitlines() if l.strip()])
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"


def pump(conns, errors):
    dead = []
    for c in conns:
        try:
            c.process_data_events(0)
        except Exception as e:  # noqa: BLE001
            errors.append(f"pump: {e!r}")
            dead.append(c)
    for c in dead:
        conns.remove(c)


def open_one(url):
    c = pika.BlockingConnection(pika.URLParameters(url))
    c.channel()
    return c


def check_new_connection(url):
    """connect + declare + publish + get + delete + close, each step timed (ms)."""
    t = {}
    t0 = time.monotonic()
    c = pika.BlockingConnection(pika.URLParameters(url))
    ch = c.channel()
    t["connect_ms"] = (time.monotonic() - t0) * 1000
    q = f"idlem-check-{os.getpid()}-{int(time.time())}"
    t1 = time.monotonic()
    ch.queue_declare(q, durable=False, auto_delete=False)
    ch.basic_publish("", q, b"hello")
    body = None
    deadline = time.monotonic() + 5
    while body is None and time.monotonic() < deadline:
        _, _, body = ch.basic_get(q, auto_ack=True)
    t["declare_publish_get_ms"] = (time.monotonic() - t1) * 1000
    ch.queue_delete(q)
    c.close()
    t["total_ms"] = (time.monotonic() - t0) * 1000
    t["got"] = body == b"hello"
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy-pid", type=int, required=True)
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5690/%2f")
    ap.add_argument("--metrics", default="http://127.0.0.1:9690/metrics")
    ap.add_argument("--ctl", default="bash " + os.path.join(os.path.dirname(os.path.abspath(__file__)), "rabbitmq4.sh") + " ctl")
    ap.add_argument("--stages", default="100,500,1000,2000")
    ap.add_argument("--idle-at", type=int, default=1000)
    ap.add_argument("--idle-secs", type=int, default=60)
    ap.add_argument("--heartbeat", type=int, default=60)
    ap.add_argument("--pump-secs", type=float, default=10)
    ap.add_argument("--out", default="/tmp/idle_conns.jsonl")
    a = ap.parse_args()

    url = a.url + ("&" if "?" in a.url else "?") + f"heartbeat={a.heartbeat}&connection_attempts=1"
    pid = a.proxy_pid
    conns, errors, rows = [], [], []
    out = open(a.out, "w")

    def record(label, **extra):
        row = {"label": label, "clients": len(conns), **proc_sample(pid),
               "gauge": gauge(a.metrics), "broker_conns": broker_conns(a.ctl), **extra}
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)
        return row

    record("before")
    for target in [int(s) for s in a.stages.split(",") if s]:
        t0 = time.monotonic()
        last_pump = t0
        while len(conns) < target:
            try:
                conns.append(open_one(url))
            except Exception as e:  # noqa: BLE001
                errors.append(f"open #{len(conns) + 1}: {e!r}")
                if len(errors) > 20:
                    break
            if time.monotonic() - last_pump > a.pump_secs:
                pump(conns, errors)
                last_pump = time.monotonic()
        open_secs = time.monotonic() - t0
        pump(conns, errors)
        time.sleep(2)
        record(f"at {target}", open_secs=round(open_secs, 2))
        if target == a.idle_at:
            s0 = proc_sample(pid)
            t_start = time.monotonic()
            while time.monotonic() - t_start < a.idle_secs:
                time.sleep(min(a.pump_secs, a.idle_secs - (time.monotonic() - t_start)))
                pump(conns, errors)
            s1 = proc_sample(pid)
            idle_wall = time.monotonic() - t_start
            ticks = s1["cpu_ticks"] - s0["cpu_ticks"]
            record(f"after {a.idle_secs}s idle at {target}", idle_ticks=ticks,
                   idle_wall_s=round(idle_wall, 1), idle_cpu_pct=round(100 * ticks / CLK / idle_wall, 3))
            chk = check_new_connection(a.url)
            record(f"new-connection check at {target}", check=chk)
            pump(conns, errors)
        if len(errors) > 20:
            break
    if len(conns) >= 2000:
        chk = check_new_connection(a.url)
        record(f"new-connection check at {len(conns)}", check=chk)

    t0 = time.monotonic()
    for c in conns:
        try:
            c.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"close: {e!r}")
    n = len(conns)
    conns.clear()
    close_secs = time.monotonic() - t0
    time.sleep(2)
    record("after close (+2s)", closed=n, close_secs=round(close_secs, 2))
    time.sleep(28)
    record("after close (+30s)")
    print("errors:", len(errors), errors[:20], flush=True)
    out.write(json.dumps({"errors": errors}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
