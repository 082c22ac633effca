// Recipe (docs/recipes.md, Node with amqplib): publish delayed messages through timeoutd,
// and cancel one. Usage: node amqplib_send.js DELAY_MS
const amqp = require('amqplib');
const { randomUUID } = require('crypto');

const url = process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672';
const ingress = process.env.TIMEOUTD_INGRESS || 'timeoutd.delay.default';

async function main() {
  const delayMs = Number(process.argv[2]);
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel(); // confirms: sent means stored by the broker
  const send = (routingKey, body, headers, messageId) =>
    new Promise((resolve, reject) =>
      ch.publish(ingress, routingKey, Buffer.from(body),
        { messageId, persistent: true, contentType: 'application/json', headers },
        (err) => (err ? reject(err) : resolve())));

  // Whole numbers go out as integers, fractions as doubles: both work.
  for (const delay of [delayMs, delayMs + 0.5]) {
    const id = randomUUID();
    const at = Date.now() / 1000;
    await send('orders.retry', JSON.stringify({ order: 42 }), { 'x-delay': delay }, id);
    console.log(JSON.stringify({ event: 'sent', id, at, delay_ms: Math.trunc(delay) }));
  }
  const doomed = randomUUID();
  const at = Date.now() / 1000;
  await send('orders.retry', '{}', { 'x-delay': delayMs }, doomed);
  console.log(JSON.stringify({ event: 'sent', id: doomed, at, delay_ms: delayMs }));
  // Cancel: a message with header x-timeoutd-cancel naming the message_id.
  await send('orders.retry', '', { 'x-timeoutd-cancel': doomed });
  console.log(JSON.stringify({ event: 'cancelled', id: doomed }));
  await ch.close();
  await conn.close();
}

main().catch((e) => { console.error(e); process.exit(1); });
