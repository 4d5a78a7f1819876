#!/usr/bin/env python3
# scripts/kill9-confirm-repro.py — does a plain client lose a confirmed message when the node
# leading a quorum queue is killed with kill -9? The minimal counterpart of the fault suite's
# kill -9 scenario (OPERATIONS.md, "Open finding: kill -9"): pika, one publish in flight,
# connected to node 2 (which leads the queue) and moving to a survivor when node 2 dies.
#
#   scripts/cluster.sh --dlx-confirm-timeout 5000 up 3
#   python3 scripts/kill9-confirm-repro.py RUN_NAME [hop]   # "hop": a 100 ms TTL tier first
#   scripts/cluster.sh down
#
# Prints "confirmed N maybe M in queue K lost L [...]". Needs pika (scripts/test.sh installs it).
import pika, subprocess, threading, time, sys
import os
CL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.sh")
def url(p): return pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{p}/%2f?heartbeat=0")
def sh(*a): return subprocess.run(["bash", CL, *a], capture_output=True, text=True)
run = sys.argv[1]
q = f"repro.{run}"
c2 = pika.BlockingConnection(url(5702)); ch = c2.channel()
hop = len(sys.argv) > 2 and sys.argv[2] == "hop"
final = q + ".final" if hop else q
ch.queue_declare(final, durable=True, arguments={"x-queue-type": "quorum"})  # client-local: led by node 2
if hop:
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum", "x-overflow": "reject-publish",
        "x-message-ttl": 100, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": final,
        "x-dead-letter-strategy": "at-least-once"})
c2.close()
print(sh("ctl", "1", "list_queues", "name", "leader").stdout.strip().splitlines()[-1])
confirmed, maybe = set(), set()
stop = False
def publisher():
    i = 0
    ports = [5702, 5701, 5703]
    conn = None
    while not stop:
        try:
            if conn is None or conn.is_closed:
                conn = pika.BlockingConnection(url(ports[0])); ch = conn.channel(); ch.confirm_delivery()
            ch.basic_publish("", q, str(i).encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
            confirmed.add(i)
        except Exception as e:
            maybe.add(i); conn = None
            if ports[0] == 5702: ports.pop(0)
            else: ports.reverse()
            time.sleep(0.01)
        i += 1
t = threading.Thread(target=publisher); t.start()
time.sleep(1.0)
k = sh("kill", "2"); print("killed node 2", k.returncode)
time.sleep(3.0)
stop = True; t.join()
print(sh("start", "2").returncode, "node 2 started")
time.sleep(15)
c = pika.BlockingConnection(url(5701)); ch = c.channel()
print(sh("ctl", "1", "list_queues", "name", "leader", "messages").stdout.strip())
got = set()
while True:
    m, p, b = ch.basic_get(final, auto_ack=True)
    if m is None: break
    got.add(int(b))
ch.queue_delete(q)
if hop:
    ch.queue_delete(final)
c.close()
lost = sorted(confirmed - got)
print(f"confirmed {len(confirmed)} maybe {len(maybe)} in queue {len(got)} lost {len(lost)} {lost[:10]}")
