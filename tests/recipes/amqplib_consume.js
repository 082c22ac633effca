// Recipe (docs/recipes.md, Node with amqplib): consume delayed messages where timeoutd
// delivers them, the target exchange timeoutd.delayed (delay.target_exchange).
const amqp = require('amqplib');

const url = process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672';
const queue = `recipes.amqplib.${process.env.RECIPE_TAG || 'demo'}`;

async function main() {
  const conn = await amqp.connect(url);
  const ch = await conn.createChannel();
  // timeoutd declares its target exchange as a durable topic exchange: declare alike.
  await ch.assertExchange('timeoutd.delayed', 'topic', { durable: true });
  await ch.assertQueue(queue, { durable: true });
  await ch.bindQueue(queue, 'timeoutd.delayed', 'orders.#');
  await ch.consume(queue, (msg) => {
    const h = msg.properties.headers;
    console.log(JSON.stringify({
      event: 'ran', id: msg.properties.messageId, at: Date.now() / 1000,
      held_ms: h['x-timeoutd-delayed-ms'],
    }));
    ch.ack(msg);
  });
  console.log(JSON.stringify({ event: 'listening' }));
}

main().catch((e) => { console.error(e); process.exit(1); });
