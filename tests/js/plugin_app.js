// An application of the delayed-message-exchange plugin in Node (amqplib), used by
// tests/it/proxy.rs through delay-proxy: it declares its x-delayed-message exchange as the
// plugin's README does, publishes with x-delay on a confirm channel (mandatory), consumes from
// its own queue and prints one JSON report: {published, received, returned, errors: [...]}.
//
//     AMQP_URL=... NODE_PATH=.../node_modules node plugin_app.js CONFIG_JSON

const amqp = require('amqplib');

async function main() {
  const cfg = JSON.parse(process.argv[2]);
  const conn = await amqp.connect(process.env.AMQP_URL);
  const ch = await conn.createConfirmChannel();
  const errors = [];
  await ch.assertExchange(cfg.exchange, 'x-delayed-message', {
    durable: true,
    arguments: { 'x-delayed-type': 'direct' },
  });
  await ch.assertQueue(cfg.queue, { exclusive: true });
  await ch.bindQueue(cfg.queue, cfg.exchange, 'k');

  const got = [];
  await ch.consume(cfg.queue, (m) => {
    got.push({ body: m.content.toString(), at: Date.now(), m });
    ch.ack(m);
  });
  const returned = [];
  ch.on('return', (m) => returned.push(m));

  const delays = [250, 0, 700, -100, 1300, 60];
  const sent = {};
  delays.forEach((d, i) => {
    const body = `node ${i} delay ${d}`;
    sent[body] = { delay: d, at: Date.now() };
    ch.publish(cfg.exchange, 'k', Buffer.from(body), {
      headers: { 'x-delay': d, n: i },
      messageId: `n${i}`,
      persistent: true,
      mandatory: true,
    });
  });
  // unroutable, no delay: the broker returns it, naming the app's exchange
  ch.publish(cfg.exchange, 'nobody', Buffer.from('unroutable'), { mandatory: true });
  await ch.waitForConfirms();

  const deadline = Date.now() + 20000;
  while (got.length < delays.length && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
  }
  await new Promise((r) => setTimeout(r, 500));

  const seen = {};
  for (const g of got) {
    const s = sent[g.body];
    if (!s) {
      errors.push(`unexpected message ${g.body}`);
      continue;
    }
    seen[g.body] = (seen[g.body] || 0) + 1;
    const waited = g.at - s.at;
    if (waited < s.delay) errors.push(`${g.body}: early, after ${waited} ms`);
    const want = s.delay > 0 ? -s.delay : s.delay;
    const h = g.m.properties.headers || {};
    if (h['x-delay'] !== want) errors.push(`${g.body}: x-delay ${h['x-delay']}, expected ${want}`);
    if (g.m.fields.routingKey !== 'k') errors.push(`${g.body}: routing key ${g.m.fields.routingKey}`);
    if (g.m.properties.deliveryMode !== 2) errors.push(`${g.body}: not persistent`);
  }
  for (const body of Object.keys(sent)) {
    if (seen[body] !== 1) errors.push(`${body}: arrived ${seen[body] || 0} times`);
  }
  if (returned.length !== 1 || returned[0].fields.exchange !== cfg.exchange) {
    errors.push(`returns: ${JSON.stringify(returned.map((r) => r.fields))}`);
  }
  await ch.close();
  await conn.close();
  console.log(JSON.stringify({
    published: delays.length, received: got.length, returned: returned.length, errors,
  }));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
