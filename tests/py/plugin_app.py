"""An application written for the delayed-message-exchange plugin, used by tests/gateway.rs.

It only knows the plugin's contract: publish to an exchange with an `x-delay` header (ms) and
the usual routing key, and consume from its own queues bound to the exchange that routes the
messages. It checks what it receives against what it published and prints one JSON report on
stdout: {"published", "received", "duplicates", "errors": [...], ...}. The Rust test asserts on
the report; this script exits non-zero only when it crashes.

    python3 plugin_app.py MODE CONFIG_JSON       (AMQP_URL from the environment)

Modes: routing (direct and topic targets, properties, headers, bodies), edges (x-delay edge
values and an unroutable key; both declare their x-delayed-message exchanges with
`"declare": true`, for tests/it/proxy.rs), stream (many messages over a few seconds, random delays or
`delay` for all; for the crash and the full-tier tests), x_delay (what `x-delay` a consumer
reads on delivery per type sent, in a classic and a quorum queue: its report's `cases` are those
of tests/java/PluginApp.java; run against the plugin itself and through delay-proxy by
tests/it/proxy/apps.rs).
"""

import decimal
import json
import os
import random
import sys
import time
from datetime import datetime, timezone

import pika

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def now_ms():
    return time.time() * 1000.0


class App:
    def __init__(self):
        self.conn = pika.BlockingConnection(pika.URLParameters(URL))
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()
        self.errors = []
        self.got = []  # (queue, method, properties, body, arrived_ms)

    def queue(self, name, bindings):
        """Declares the app's own queue (exclusive: gone with the app) with its bindings."""
        self.ch.queue_declare(name, exclusive=True)
        for exchange, key in bindings:
            self.ch.queue_bind(name, exchange, routing_key=key)

    def publish(self, exchange, key, body, props):
        sent = now_ms()
        # mandatory + confirms: raises when the broker does not take it
        self.ch.basic_publish(exchange, key, body, props, mandatory=True)
        return sent

    def consume(self, queues, want, timeout_s, linger_s):
        """Consumes until `want` messages arrived or the timeout, then lingers for extras."""

        def on_message(queue):
            def cb(ch, method, props, body):
                self.got.append((queue, method, props, body, now_ms()))
                ch.basic_ack(method.delivery_tag)

            return cb

        for q in queues:
            self.ch.basic_consume(q, on_message(q))
        deadline = time.time() + timeout_s
        lingering = False
        while time.time() < deadline:
            self.conn.process_data_events(time_limit=0.05)
            if len(self.got) >= want and not lingering:
                lingering = True
                deadline = time.time() + linger_s

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass


PROPS = [
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
]


def expected_props(props, delay):
    """What the gateway delivers: the same properties, `x-delay` set to minus the delay when
    there was one (the 3.10 plugin does so in a quorum queue only: mode x_delay). The gateway cannot re-publish `user_id` (documented): it moves into the
    header `x-delay-user-id`."""
    want = {p: getattr(props, p) for p in PROPS}
    headers = dict(want["headers"]) if want["headers"] is not None else None
    if delay > 0:
        headers["x-delay"] = -delay
    if want["user_id"] is not None:
        headers = headers if headers is not None else {}
        headers["x-delay-user-id"] = want["user_id"]
        want["user_id"] = None
    want["headers"] = headers
    return want


def check(app, sent, errors):
    """sent: body -> dict(queues, key, props, delay, at). Checks every arrival."""
    seen = {}
    for queue, method, props, body, arrived in app.got:
        s = sent.get(body)
        if s is None:
            errors.append(f"unexpected message in {queue}: {body[:40]!r}")
            continue
        seen.setdefault(body, []).append(queue)
        if queue not in s["queues"]:
            errors.append(f"{s['name']}: arrived in {queue}, expected only {s['queues']}")
        if method.routing_key != s["key"]:
            errors.append(f"{s['name']}: routing key {method.routing_key!r}, published {s['key']!r}")
        want = expected_props(s["props"], s["delay"])
        for p in PROPS:
            got = getattr(props, p)
            if got != want[p]:
                errors.append(f"{s['name']}: property {p} is {got!r}, expected {want[p]!r}")
        waited = arrived - s["at"]
        if waited < s["delay"]:
            errors.append(f"{s['name']}: early: arrived after {waited:.0f} ms, delay {s['delay']} ms")
        if s.get("max_wait") is not None and waited > s["max_wait"]:
            errors.append(f"{s['name']}: arrived after {waited:.0f} ms, expected at most {s['max_wait']} ms")
    duplicates = 0
    for body, s in sent.items():
        queues = seen.get(body, [])
        if sorted(set(queues)) != sorted(s["queues"]):
            errors.append(f"{s['name']}: arrived in {sorted(queues)}, expected {sorted(s['queues'])}")
        duplicates += len(queues) - len(set(queues))
    return duplicates


def declare_delayed(app, cfg, exchanges):
    """With `"declare": true` (through delay-proxy), the app declares its exchanges itself, as the
    plugin's README does: type x-delayed-message with the real type in x-delayed-type."""
    if not cfg.get("declare"):
        return
    for name, kind in exchanges:
        app.ch.exchange_declare(
            exchange=name,
            exchange_type="x-delayed-message",
            durable=True,
            arguments={"x-delayed-type": kind},
        )


def routing(cfg):
    d_in, d_x = cfg["direct"]["ingress"], cfg["direct"]["target"]
    t_in, t_x = cfg["topic"]["ingress"], cfg["topic"]["target"]
    p = cfg["prefix"]
    app = App()
    declare_delayed(app, cfg, [(d_in, "direct"), (t_in, "topic")])
    q_alpha, q_beta, q_eu, q_pay = (f"{p}-app-{n}" for n in ("alpha", "beta", "eu", "pay"))
    app.queue(q_alpha, [(d_x, "alpha")])
    app.queue(q_beta, [(d_x, "beta")])
    app.queue(q_eu, [(t_x, "eu.#")])
    app.queue(q_pay, [(t_x, "*.payments")])

    every_type = {
        "s": "text ünïcødé",
        "i": 42,
        "neg": -7,
        "big": 2**40,
        "t": True,
        "f": False,
        "dec": decimal.Decimal("12.345"),
        "when": datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc),
        "none": None,
        "list": [1, "two", [3], {"four": 4}],
        "table": {"nested": {"deep": "yes"}, "n": 1},
        "raw": b"\x00\x01\xfe\xff",
    }
    full = pika.BasicProperties(
        content_type="application/octet-stream",
        content_encoding="identity",
        headers=dict(every_type, **{"x-delay": 300}),
        priority=5,
        correlation_id="corr-1",
        reply_to="replies",
        message_id="full-1",
        timestamp=1700000000,
        type="order.created",
        app_id="plugin-app",
    )
    cases = [
        # name, exchange, key, body, props, delay, expected queues
        ("full", d_in, "alpha", bytes(range(256)) + b"\x00\xff", full, 300, [q_alpha]),
        (
            "expiring",
            d_in,
            "beta",
            b"expiring",
            pika.BasicProperties(
                headers={"x-delay": 1200, "k": "v"},
                expiration="60000",
                delivery_mode=1,
                message_id="exp-1",
            ),
            1200,
            [q_beta],
        ),
        ("bare", d_in, "alpha", b"bare: no properties at all", pika.BasicProperties(), 0, [q_alpha]),
        (
            "persistent",
            d_in,
            "beta",
            b"persistent",
            pika.BasicProperties(headers={"x-delay": 50}, delivery_mode=2, message_id="per-1"),
            50,
            [q_beta],
        ),
        (
            "user-id",
            d_in,
            "alpha",
            b"with user id",
            pika.BasicProperties(headers={"x-delay": 200}, user_id="guest", message_id="uid-1"),
            200,
            [q_alpha],
        ),
        ("empty-body", d_in, "beta", b"", pika.BasicProperties(headers={"x-delay": 0}), 0, [q_beta]),
        (
            "eu-orders",
            t_in,
            "eu.orders.created",
            b"eu orders",
            pika.BasicProperties(headers={"x-delay": 500}, message_id="t-1", correlation_id="c"),
            500,
            [q_eu],
        ),
        (
            "us-pay",
            t_in,
            "us.payments",
            b"us payments",
            pika.BasicProperties(headers={"x-delay": 800}, message_id="t-2", type="pay"),
            800,
            [q_pay],
        ),
        (
            "eu-pay",
            t_in,
            "eu.payments",
            b"eu payments: two queues",
            pika.BasicProperties(headers={"x-delay": 100, "region": "eu"}, message_id="t-3"),
            100,
            [q_eu, q_pay],
        ),
    ]
    sent = {}
    for name, x, key, body, props, delay, queues in cases:
        at = app.publish(x, key, body, props)
        sent[body] = dict(name=name, key=key, props=props, delay=delay, queues=queues, at=at)
    want = sum(len(s["queues"]) for s in sent.values())
    app.consume([q_alpha, q_beta, q_eu, q_pay], want, cfg.get("timeout", 15), 0.5)
    errors = []
    dups = check(app, sent, errors)
    app.close()
    return dict(published=len(sent), received=len(app.got), duplicates=dups, errors=errors)


def edges(cfg):
    x_in, x_t, p = cfg["ingress"], cfg["target"], cfg["prefix"]
    app = App()
    declare_delayed(app, cfg, [(x_in, "direct")])
    q = f"{p}-app-edge"
    app.queue(q, [(x_t, "edge")])
    quick = 1000  # "without delay": well under any real delay in this test
    cases = [
        # name, x-delay (absent when missing), expected delay, delivered?, key
        ("absent", (), 0, True, "edge"),
        ("zero", (0,), 0, True, "edge"),
        ("negative", (-250,), 0, True, "edge"),
        ("string", ("1500",), 1500, True, "edge"),
        ("decimal", (decimal.Decimal("1200.5"),), 1201, True, "edge"),
        ("abc", ("abc",), 0, False, "edge"),
        ("over-range", (999999,), 0, False, "edge"),
        ("unroutable", (100,), 100, False, "nobody-binds-this"),
    ]
    sent = {}
    for name, xd, delay, delivered, key in cases:
        headers = {"case": name}
        if xd:
            headers["x-delay"] = xd[0]
        props = pika.BasicProperties(headers=headers, message_id=f"edge-{name}")
        body = f"edge {name}".encode()
        at = app.publish(x_in, key, body, props)
        sent[body] = dict(
            name=name,
            key=key,
            props=props,
            delay=delay,
            queues=[q] if delivered else [],
            at=at,
            max_wait=quick if delivered and delay == 0 else None,
        )
    want = sum(len(s["queues"]) for s in sent.values())
    app.consume([q], want, cfg.get("timeout", 15), 1.0)
    errors = []
    dups = check(app, sent, errors)
    app.close()
    return dict(published=len(sent), received=len(app.got), duplicates=dups, errors=errors)


def stream(cfg):
    x_in, x_t, p = cfg["ingress"], cfg["target"], cfg["prefix"]
    n, spread = cfg["n"], cfg["publish_seconds"]
    app = App()
    q = f"{p}-app-stream"
    app.queue(q, [(x_t, "s")])
    rng = random.Random(7)
    sent = {}
    start = time.time()
    for i in range(n):
        delay = cfg["delay"] if "delay" in cfg else rng.randint(0, 1000)
        props = pika.BasicProperties(headers={"x-delay": delay}, message_id=f"s-{i}")
        body = f"stream {i}".encode()
        at = app.publish(x_in, "s", body, props)
        sent[body] = dict(name=f"s-{i}", key="s", props=props, delay=delay, queues=[q], at=at)
        lag = start + spread * (i + 1) / n - time.time()
        if lag > 0:
            time.sleep(lag)
    app.consume([q], n, cfg.get("timeout", 20), 1.0)
    # a redelivered copy is a duplicate, allowed: counted, not an error
    errors = []
    dups = check(app, sent, errors)
    missing = [s["name"] for b, s in sent.items() if not any(g[3] == b for g in app.got)]
    app.close()
    return dict(
        published=len(sent),
        received=len(app.got),
        duplicates=dups,
        missing=missing,
        errors=errors,
    )


def typed(v):
    """An x-delay as {"type", "value"}, its AMQP field type as pika reads it; None when absent."""
    if v is None:
        return None
    kinds = [(bool, "t"), (pika.compat.long, "l"), (int, "I"), (str, "S"), (float, "d")]
    kinds += [(decimal.Decimal, "D"), (bytes, "x")]
    kind = next((k for t, k in kinds if isinstance(v, t)), type(v).__name__)
    return {"type": kind, "value": str(int(v)) if isinstance(v, int) else str(v)}


def x_delay(cfg):
    x, p = cfg["exchange"], cfg["prefix"]
    app = App()
    declare_delayed(app, dict(cfg, declare=True), [(x, "direct")])
    queues = {"classic": f"{p}-pika-classic", "quorum": f"{p}-pika-quorum"}
    app.ch.queue_declare(queues["classic"], exclusive=True)
    app.ch.queue_declare(queues["quorum"], durable=True, arguments={"x-queue-type": "quorum"})
    for q in queues.values():
        app.ch.queue_bind(q, x, routing_key="k")
    cases = [
        # name, x-delay (None: absent), delay, expiration
        ("int", 300, 300, None),
        ("long", pika.compat.long(400), 400, None),
        ("string", "500", 500, None),
        ("zero", 0, 0, None),
        ("negative", -200, 0, None),
        ("absent", None, 0, None),
        ("int-expiring", 350, 350, "60000"),
    ]
    sent = {}
    for name, xd, delay, expiration in cases:
        headers = {} if xd is None else {"x-delay": xd}
        props = pika.BasicProperties(headers=headers, message_id=f"m-{name}", expiration=expiration)
        body = f"pika {name}".encode()
        at = now_ms()
        # not mandatory: the plugin returns every mandatory delayed publish (pika raises)
        app.ch.basic_publish(x, "k", body, props)
        sent[body] = dict(name=name, xd=xd, delay=delay, expiration=expiration, at=at)
    app.consume(list(queues.values()), 2 * len(cases), cfg.get("timeout", 20), 0.5)
    kind = {q: k for k, q in queues.items()}
    copies, errors = {}, []
    for queue, _method, props, body, arrived in app.got:
        s = sent.get(body)
        if s is None:
            errors.append(f"unexpected message in {queue}: {body[:40]!r}")
            continue
        waited = arrived - s["at"]
        if waited < s["delay"]:
            errors.append(f"{s['name']}: early: arrived after {waited:.0f} ms, delay {s['delay']} ms")
        copy = {
            "queue": kind[queue],
            "lateness_ms": round(waited - s["delay"]),
            "x_delay": typed((props.headers or {}).get("x-delay")),
        }
        copies.setdefault(s["name"], []).append(copy)
    app.ch.queue_delete(queues["quorum"])
    if cfg.get("delete_exchange"):
        app.ch.exchange_delete(x)
    app.close()
    report = [
        dict(
            id=s["name"],
            sent=typed(s["xd"]),
            delay=s["delay"],
            routable=True,
            expiration=s["expiration"] is not None,
            copies=copies.get(s["name"], []),
        )
        for s in sent.values()
    ]
    return dict(published=len(sent), received=len(app.got), errors=errors, cases=report)


def main():
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    modes = {"routing": routing, "edges": edges, "stream": stream, "x_delay": x_delay}
    report = modes[mode](cfg)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
