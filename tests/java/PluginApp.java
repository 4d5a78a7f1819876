// An application of the delayed-message-exchange plugin in Java (the RabbitMQ Java client, Debian's
// librabbitmq-client-java), used by tests/it/proxy/apps.rs against the plugin itself and through
// delay-proxy. It knows only the plugin's contract: it declares an x-delayed-message exchange
// (x-delayed-type direct), a classic and a quorum queue bound to it, publishes with x-delay of
// the Java types a plugin-era application sends (Integer, Long, String, Short, Byte, Float,
// Double, BigDecimal), with confirms, mandatory on some, consumes both queues and prints one JSON
// report on stdout:
//
//   {"published", "confirmed", "nacked", "returned": [{"id", "code", "text", "exchange"}],
//    "closed": [{"id", "reason"}], "received", "errors": [...],
//    "cases": [{"id", "sent": {"type", "value"} | null, "delay", "mandatory", "routable",
//        "expiration", "copies": [
//        {"queue": "classic"|"quorum", "lateness_ms", "x_delay": {"type", "value"} | null}]}]}
//
// `errors` lists what is wrong whatever the broker behind: a body or a property (headers with
// their types; x-delay aside) not as published, an arrival before the delay, a copy in a queue
// twice. x-delay on delivery, returns and closed connections are reported for the caller to
// compare. Exits non-zero only when it crashes.
//
//     AMQP_URL=... java -cp CLASSPATH PluginApp exchange=X queue=Q [n=40] [timeout=30]
//         [delete-exchange=true]

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import com.rabbitmq.client.DefaultConsumer;
import com.rabbitmq.client.Envelope;
import com.rabbitmq.client.LongString;
import java.math.BigDecimal;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Date;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.SortedSet;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentLinkedQueue;

public class PluginApp {
    /** One message the app publishes: its x-delay (null: none), the delay it means, its key. */
    static final class Case {
        final String id;
        final Object xDelay;
        final long delayMs;
        final String key;
        final boolean mandatory;
        final boolean ownConnection;
        AMQP.BasicProperties props;
        byte[] body;
        long sentMs;
        boolean published;

        Case(String id, Object xDelay, long delayMs, String key, boolean mandatory, boolean own) {
            this.id = id;
            this.xDelay = xDelay;
            this.delayMs = delayMs;
            this.key = key;
            this.mandatory = mandatory;
            this.ownConnection = own;
        }

        boolean routable() {
            return key.equals("k");
        }
    }

    /** A delivery as it arrived. */
    static final class Got {
        final String queue;
        final Envelope env;
        final AMQP.BasicProperties props;
        final byte[] body;
        final long atMs;

        Got(String queue, Envelope env, AMQP.BasicProperties props, byte[] body, long atMs) {
            this.queue = queue;
            this.env = env;
            this.props = props;
            this.body = body;
            this.atMs = atMs;
        }
    }

    /** A confirm channel: its outstanding publishes, acks, nacks and returns. */
    static final class Pub {
        final Channel ch;
        final SortedSet<Long> outstanding = new TreeSet<>();
        final Map<Long, Case> bySeq = new HashMap<>();
        final List<Case> acked = new ArrayList<>();
        int nacked;

        Pub(Connection conn, List<String> returns) throws Exception {
            ch = conn.createChannel();
            ch.confirmSelect();
            ch.addConfirmListener(
                    (tag, multiple) -> settle(tag, multiple, true),
                    (tag, multiple) -> settle(tag, multiple, false));
            ch.addReturnListener(r -> {
                String id = r.getProperties().getMessageId();
                synchronized (returns) {
                    returns.add(obj("id", str(id), "code", Integer.toString(r.getReplyCode()),
                            "text", str(r.getReplyText()), "exchange", str(r.getExchange())));
                }
            });
        }

        synchronized void settle(long tag, boolean multiple, boolean ack) {
            SortedSet<Long> done = multiple ? new TreeSet<>(outstanding.headSet(tag + 1))
                    : new TreeSet<>(outstanding.contains(tag) ? List.of(tag) : List.of());
            for (Long t : done) {
                outstanding.remove(t);
                if (ack) {
                    acked.add(bySeq.get(t));
                } else {
                    nacked++;
                }
            }
        }

        void publish(String exchange, Case c) throws Exception {
            synchronized (this) {
                long seq = ch.getNextPublishSeqNo();
                outstanding.add(seq);
                bySeq.put(seq, c);
            }
            c.sentMs = System.currentTimeMillis();
            ch.basicPublish(exchange, c.key, c.mandatory, c.props, c.body);
            c.published = true;
        }
    }

    static final List<String> errors = new ArrayList<>();

    public static void main(String[] args) throws Exception {
        Map<String, String> cfg = new HashMap<>();
        for (String a : args) {
            int eq = a.indexOf('=');
            cfg.put(a.substring(0, eq), a.substring(eq + 1));
        }
        String exchange = cfg.get("exchange");
        String queue = cfg.get("queue");
        int n = Integer.parseInt(cfg.getOrDefault("n", "40"));
        long timeoutMs = 1000L * Integer.parseInt(cfg.getOrDefault("timeout", "30"));

        ConnectionFactory f = new ConnectionFactory();
        f.setUri(System.getenv("AMQP_URL"));
        f.setAutomaticRecoveryEnabled(false);
        Connection conn = f.newConnection("java plugin app");
        Channel admin = conn.createChannel();
        Map<String, Object> xargs = new HashMap<>();
        xargs.put("x-delayed-type", "direct");
        admin.exchangeDeclare(exchange, "x-delayed-message", true, false, xargs);
        Map<String, String> queues = new LinkedHashMap<>();
        queues.put("classic", queue + "-classic");
        queues.put("quorum", queue + "-quorum");
        // durable: RabbitMQ 4 deprecates transient queues that are not exclusive (the app
        // deletes both at the end)
        admin.queueDeclare(queues.get("classic"), true, false, false, null);
        admin.queueDeclare(queues.get("quorum"), true, false, false,
                Map.of("x-queue-type", "quorum"));
        for (String q : queues.values()) {
            admin.queueBind(q, exchange, "k");
        }

        ConcurrentLinkedQueue<Got> got = new ConcurrentLinkedQueue<>();
        Channel consumer = conn.createChannel();
        consumer.basicQos(200);
        for (Map.Entry<String, String> q : queues.entrySet()) {
            String kind = q.getKey();
            consumer.basicConsume(q.getValue(), false, new DefaultConsumer(consumer) {
                @Override
                public void handleDelivery(String tag, Envelope env, AMQP.BasicProperties p,
                        byte[] body) throws java.io.IOException {
                    got.add(new Got(kind, env, p, body, System.currentTimeMillis()));
                    getChannel().basicAck(env.getDeliveryTag(), false);
                }
            });
        }

        List<Case> cases = cases(n);
        List<String> returns = new ArrayList<>();
        List<String> closed = new ArrayList<>();
        List<Pub> pubs = new ArrayList<>();
        Pub shared = new Pub(conn, returns);
        pubs.add(shared);
        List<Connection> own = new ArrayList<>();
        for (Case c : cases) {
            Pub p = shared;
            if (c.ownConnection) {
                Connection oc = f.newConnection("java plugin app " + c.id);
                own.add(oc);
                p = new Pub(oc, returns);
                pubs.add(p);
            }
            try {
                p.publish(exchange, c);
            } catch (Exception e) {
                closed.add(obj("id", str(c.id), "reason", str(reason(e))));
            }
        }
        for (Pub p : pubs) {
            try {
                p.ch.waitForConfirms(10000);
            } catch (Exception e) {
                String id = p.bySeq.values().iterator().next().id;
                closed.add(obj("id", str(id), "reason", str(reason(e))));
            }
        }
        List<Case> confirmed = new ArrayList<>();
        int nacked = 0;
        for (Pub p : pubs) {
            synchronized (p) {
                confirmed.addAll(p.acked);
                nacked += p.nacked;
            }
        }
        long want = 2L * confirmed.stream().filter(Case::routable).count();
        long deadline = System.currentTimeMillis() + timeoutMs;
        while (got.size() < want && System.currentTimeMillis() < deadline) {
            Thread.sleep(20);
        }
        Thread.sleep(1000); // extras, duplicates
        consumer.close();
        String report = report(cases, confirmed.size(), nacked, returns, closed, new ArrayList<>(got));
        for (String q : queues.values()) {
            admin.queueDelete(q);
        }
        if ("true".equals(cfg.get("delete-exchange"))) {
            admin.exchangeDelete(exchange);
        }
        for (Connection oc : own) {
            if (oc.isOpen()) {
                oc.close();
            }
        }
        conn.close();
        System.out.println(report);
    }

    static String reason(Exception e) {
        Throwable t = e;
        while (t.getCause() != null && t.getMessage() == null) {
            t = t.getCause();
        }
        String m = String.valueOf(t.getMessage());
        return t.getClass().getSimpleName() + ": " + m;
    }

    /** The type cases (one message each), then `n` messages of varied Java types and delays. */
    static List<Case> cases(int n) {
        List<Case> cs = new ArrayList<>();
        cs.add(new Case("int", 300, 300, "k", false, false));
        cs.add(new Case("long", 400L, 400, "k", false, false));
        cs.add(new Case("string", "500", 500, "k", false, false));
        cs.add(new Case("short", (short) 600, 600, "k", false, false));
        cs.add(new Case("byte", (byte) 100, 100, "k", false, false));
        cs.add(new Case("float", 250.5f, 250, "k", false, false));
        cs.add(new Case("double", 350.25d, 350, "k", false, false));
        // the 3.10 plugin closes the connection on a decimal x-delay: a connection of its own
        cs.add(new Case("decimal", new BigDecimal("450.5"), 450, "k", false, true));
        cs.add(new Case("zero", 0, 0, "k", false, false));
        cs.add(new Case("negative", -200, 0, "k", false, false));
        cs.add(new Case("absent", null, 0, "k", false, false));
        cs.add(new Case("int-mandatory", 700, 700, "k", true, false));
        cs.add(new Case("long-mandatory", 800L, 800, "k", true, false));
        cs.add(new Case("unroutable-delayed", 300, 300, "nobody", true, false));
        cs.add(new Case("unroutable-now", null, 0, "nobody", true, false));
        Random rng = new Random(7);
        for (int i = 0; i < n; i++) {
            long d = 100 + rng.nextInt(1400);
            Object x = switch (i % 4) {
                case 0 -> (int) d;
                case 1 -> d;
                case 2 -> Long.toString(d);
                default -> (short) d;
            };
            cs.add(new Case("bulk-" + i, x, d, "k", i % 5 == 0, false));
        }
        for (int i = 0; i < cs.size(); i++) {
            Case c = cs.get(i);
            c.props = properties(c, i);
            byte[] text = ("java " + c.id + " ").getBytes(StandardCharsets.UTF_8);
            c.body = Arrays.copyOf(text, text.length + 256);
            for (int b = 0; b < 256; b++) {
                c.body[text.length + b] = (byte) b;
            }
        }
        return cs;
    }

    static AMQP.BasicProperties properties(Case c, int i) {
        Map<String, Object> h = new LinkedHashMap<>();
        if (c.xDelay != null) {
            h.put("x-delay", c.xDelay);
        }
        h.put("case", c.id);
        h.put("int", 42);
        h.put("long", -7L);
        h.put("big", 1L << 40);
        h.put("short", (short) -3);
        h.put("byte", (byte) 9);
        h.put("bool", true);
        h.put("double", 1.5d);
        h.put("float", 2.25f);
        h.put("decimal", new BigDecimal("12.345"));
        h.put("when", new Date(1700000000000L));
        h.put("raw", new byte[] {0, 1, (byte) 0xfe, (byte) 0xff});
        h.put("list", List.of(1, "two", List.of(3L)));
        h.put("table", Map.of("nested", Map.of("deep", "yes"), "n", 1));
        h.put("text", "ünïcødé");
        AMQP.BasicProperties.Builder b = new AMQP.BasicProperties.Builder()
                .headers(h)
                .messageId("m-" + c.id)
                .correlationId("corr-" + i)
                .contentType(i % 2 == 0 ? "application/json" : "text/plain")
                .deliveryMode(i % 3 == 0 ? 1 : 2)
                .priority(i % 10);
        if (i % 4 == 0) {
            b.contentEncoding("identity").replyTo("replies").type("order.created").appId("java-app")
                    .timestamp(new Date(1700000000000L));
        }
        if (i % 7 == 1) {
            b.expiration("60000");
        }
        return b.build();
    }

    static String report(List<Case> cases, int confirmed, int nacked, List<String> returns,
            List<String> closed, List<Got> got) {
        Map<String, Case> byBody = new HashMap<>();
        for (Case c : cases) {
            byBody.put(new String(c.body, StandardCharsets.ISO_8859_1), c);
        }
        Map<String, List<String>> copies = new TreeMap<>();
        Map<String, Integer> seen = new HashMap<>();
        for (Got g : got) {
            Case c = byBody.get(new String(g.body, StandardCharsets.ISO_8859_1));
            if (c == null) {
                errors.add("unexpected message in " + g.queue + ": " + g.props.getMessageId());
                continue;
            }
            String where = c.id + " in " + g.queue;
            if (seen.merge(where, 1, Integer::sum) > 1) {
                errors.add(where + ": a second copy");
            }
            long waited = g.atMs - c.sentMs;
            if (waited < c.delayMs) {
                errors.add(where + ": early: after " + waited + " ms, delay " + c.delayMs + " ms");
            }
            if (!g.env.getRoutingKey().equals(c.key)) {
                errors.add(where + ": routing key " + g.env.getRoutingKey());
            }
            for (String d : differences(c.props, g.props)) {
                errors.add(where + ": " + d);
            }
            Object xd = g.props.getHeaders() == null ? null : g.props.getHeaders().get("x-delay");
            String xdJson = xd == null ? "null" : obj("type", str(code(xd)), "value", str(text(xd)));
            copies.computeIfAbsent(c.id, k -> new ArrayList<>()).add(obj(
                    "queue", str(g.queue), "lateness_ms", Long.toString(waited - c.delayMs),
                    "x_delay", xdJson));
        }
        List<String> cs = new ArrayList<>();
        for (Case c : cases) {
            String sent = c.xDelay == null ? "null"
                    : obj("type", str(code(c.xDelay)), "value", str(text(c.xDelay)));
            cs.add(obj("id", str(c.id), "sent", sent, "delay", Long.toString(c.delayMs),
                    "mandatory", Boolean.toString(c.mandatory), "routable",
                    Boolean.toString(c.routable()), "expiration",
                    Boolean.toString(c.props.getExpiration() != null), "copies",
                    arr(copies.getOrDefault(c.id, List.of()))));
        }
        List<String> errs = new ArrayList<>();
        for (String e : errors) {
            errs.add(str(e));
        }
        long published = cases.stream().filter(c -> c.published).count();
        return obj("published", Long.toString(published), "confirmed", Integer.toString(confirmed),
                "nacked", Integer.toString(nacked), "returned", arr(returns), "closed", arr(closed),
                "received", Integer.toString(got.size()), "errors", arr(errs), "cases", arr(cs));
    }

    /** What differs between the properties sent and those received, x-delay aside. */
    static List<String> differences(AMQP.BasicProperties s, AMQP.BasicProperties r) {
        List<String> d = new ArrayList<>();
        Object[][] pairs = {
            {"content_type", s.getContentType(), r.getContentType()},
            {"content_encoding", s.getContentEncoding(), r.getContentEncoding()},
            {"delivery_mode", s.getDeliveryMode(), r.getDeliveryMode()},
            {"priority", s.getPriority(), r.getPriority()},
            {"correlation_id", s.getCorrelationId(), r.getCorrelationId()},
            {"reply_to", s.getReplyTo(), r.getReplyTo()},
            {"expiration", s.getExpiration(), r.getExpiration()},
            {"message_id", s.getMessageId(), r.getMessageId()},
            {"timestamp", s.getTimestamp(), r.getTimestamp()},
            {"type", s.getType(), r.getType()},
            {"user_id", s.getUserId(), r.getUserId()},
            {"app_id", s.getAppId(), r.getAppId()},
            {"cluster_id", s.getClusterId(), r.getClusterId()},
        };
        for (Object[] p : pairs) {
            if (!text(p[1]).equals(text(p[2]))) {
                d.add("property " + p[0] + " is " + text(p[2]) + ", sent " + text(p[1]));
            }
        }
        Map<String, Object> sh = new TreeMap<>(s.getHeaders() == null ? Map.of() : s.getHeaders());
        Map<String, Object> rh = new TreeMap<>(r.getHeaders() == null ? Map.of() : r.getHeaders());
        sh.remove("x-delay");
        rh.remove("x-delay");
        if (!typed(sh).equals(typed(rh))) {
            d.add("headers are " + typed(rh) + ", sent " + typed(sh));
        }
        return d;
    }

    /** The AMQP field type the Java client writes for (or read as) `v`. */
    static String code(Object v) {
        if (v == null) return "V";
        if (v instanceof String || v instanceof LongString) return "S";
        if (v instanceof Integer) return "I";
        if (v instanceof Long) return "l";
        if (v instanceof Short) return "s";
        if (v instanceof Byte) return "b";
        if (v instanceof Float) return "f";
        if (v instanceof Double) return "d";
        if (v instanceof BigDecimal) return "D";
        if (v instanceof Boolean) return "t";
        if (v instanceof Date) return "T";
        if (v instanceof byte[]) return "x";
        if (v instanceof List) return "A";
        if (v instanceof Map) return "F";
        return v.getClass().getSimpleName();
    }

    static String text(Object v) {
        if (v instanceof byte[]) return Arrays.toString((byte[]) v);
        if (v instanceof Date) return Long.toString(((Date) v).getTime());
        return String.valueOf(v);
    }

    /** A value with its type, nested values too: what "as published" compares. */
    static String typed(Object v) {
        if (v instanceof Map) {
            StringBuilder b = new StringBuilder("{");
            for (Map.Entry<?, ?> e : new TreeMap<>((Map<?, ?>) v).entrySet()) {
                b.append(e.getKey()).append('=').append(typed(e.getValue())).append(',');
            }
            return b.append('}').toString();
        }
        if (v instanceof List) {
            StringBuilder b = new StringBuilder("[");
            for (Object o : (List<?>) v) {
                b.append(typed(o)).append(',');
            }
            return b.append(']').toString();
        }
        return code(v) + ":" + text(v);
    }

    static String str(String s) {
        if (s == null) return "null";
        StringBuilder b = new StringBuilder("\"");
        for (char ch : s.toCharArray()) {
            if (ch == '"' || ch == '\\') {
                b.append('\\').append(ch);
            } else if (ch < 0x20) {
                b.append(String.format("\\u%04x", (int) ch));
            } else {
                b.append(ch);
            }
        }
        return b.append('"').toString();
    }

    /** A JSON object from key, JSON value pairs. */
    static String obj(String... kv) {
        StringBuilder b = new StringBuilder("{");
        for (int i = 0; i < kv.length; i += 2) {
            b.append(i == 0 ? "" : ",").append(str(kv[i])).append(':').append(kv[i + 1]);
        }
        return b.append('}').toString();
    }

    static String arr(List<String> items) {
        return "[" + String.join(",", items) + "]";
    }
}
