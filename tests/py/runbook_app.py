"""A plugin-era application for tests/runbooks/: it knows only the plugin's contract.

    python3 runbook_app.py URL ID_PREFIX N MIN_MS MAX_MS [declare]

Publishes N messages to the exchange orders.delayed with the routing key order.timeout, each
with an x-delay header (ms, spread over MIN_MS..MAX_MS), the message_id ID_PREFIX-i and a body
naming it, persistent and confirmed: a nack raises, and the script exits non-zero. Not
mandatory, as a plugin-era application publishes: the plugin returns every delayed message
published with mandatory. With `declare` it first declares what a plugin-era application declares at start-up:
orders.delayed of type x-delayed-message (x-delayed-type direct), its durable queue
order-timeouts and the binding.

Prints one JSON line per confirmed message: {"id", "body", "delay", "sent_ms"}, sent_ms taken
just before the publish (the message cannot be due before sent_ms + delay). Connecting is
retried for 30 s: a proxy started a moment ago may not listen yet.
"""

import json
import sys
import time

import pika

EXCHANGE = "orders.delayed"
QUEUE = "order-timeouts"
KEY = "order.timeout"


def connect(url):
    deadline = time.time() + 30
    while True:
        try:
            return pika.BlockingConnection(pika.URLParameters(url))
        except pika.exceptions.AMQPConnectionError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def main():
    url, prefix, n, lo, hi = sys.argv[1:6]
    n, lo, hi = int(n), int(lo), int(hi)
    declare = sys.argv[6:] == ["declare"]
    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    if declare:
        ch.exchange_declare(
            EXCHANGE,
            "x-delayed-message",
            durable=True,
            arguments={"x-delayed-type": "direct"},
        )
        ch.queue_declare(QUEUE, durable=True)
        ch.queue_bind(QUEUE, EXCHANGE, routing_key=KEY)
    for i in range(n):
        delay = lo + (i * 7919) % max(1, hi - lo)
        mid = f"{prefix}-{i}"
        body = json.dumps({"order": mid}).encode()
        props = pika.BasicProperties(
            headers={"x-delay": delay}, delivery_mode=2, message_id=mid
        )
        sent = time.time() * 1000.0
        ch.basic_publish(EXCHANGE, KEY, body, props)
        print(json.dumps({"id": mid, "body": body.decode(), "delay": delay, "sent_ms": sent}))
    sys.stdout.flush()
    conn.close()


if __name__ == "__main__":
    main()
