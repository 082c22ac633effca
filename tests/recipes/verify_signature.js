// Verify the signatures of what timeoutd publishes (docs/integrating/timeouts.md,
// Signatures), as an amqplib consumer: reads COUNT messages of QUEUE and prints one JSON
// line per message with the verdict, and the verdicts of the same message with another
// routing key and another body. Run by tests/recipes/run.py.
const amqp = require("amqplib");

// docs: begin node
const crypto = require("crypto");

// The bytes timeoutd signs: each field as a 4-byte big-endian length and its bytes.
function timeoutdCanonical(keyId, m) {
  const fields = ["timeoutd-signature-v1", keyId, m.exchange, m.routingKey, m.messageId,
    m.correlationId, m.type, m.timestamp, m.node, m.userId, m.delayedMs, m.body];
  return Buffer.concat(fields.flatMap((v) => {
    const b = Buffer.isBuffer(v) ? v : Buffer.from(v == null ? "" : String(v));
    const len = Buffer.alloc(4);
    len.writeUInt32BE(b.length);
    return [len, b];
  }));
}

// Whether `header` (x-timeoutd-signature) signs `m` under one of `keys` ({id: key}).
function timeoutdVerify(header, m, keys) {
  const [version, keyId, tag] = String(header || "").split(":");
  const key = Object.hasOwn(keys, keyId) ? keys[keyId] : null;
  if (version !== "v1" || !key || !/^[0-9a-f]{64}$/.test(tag || "")) return false;
  const mac = crypto.createHmac("sha256", key).update(timeoutdCanonical(keyId, m)).digest();
  return crypto.timingSafeEqual(mac, Buffer.from(tag, "hex"));
}

// What the signature covers, from an amqplib message.
function timeoutdFields(msg) {
  const p = msg.properties;
  const h = p.headers || {};
  return { exchange: msg.fields.exchange, routingKey: msg.fields.routingKey,
    messageId: p.messageId, correlationId: p.correlationId, type: p.type,
    timestamp: p.timestamp, node: h["x-timeoutd-node"], userId: h["x-timeoutd-user-id"],
    delayedMs: h["x-timeoutd-delayed-ms"], body: msg.content };
}

// On each delivery: refuse what does not verify.
// const keys = { k1: Buffer.from(process.env.TIMEOUTD_SIGNING_KEY) };
// if (!timeoutdVerify(msg.properties.headers["x-timeoutd-signature"], timeoutdFields(msg), keys)) {
//   channel.reject(msg, false);
// }
// docs: end

async function main() {
  const keys = { [process.env.KEY_ID]: Buffer.from(process.env.KEY) };
  const count = Number(process.env.COUNT || "1");
  const conn = await amqp.connect(process.env.AMQP_URL);
  const ch = await conn.createChannel();
  let seen = 0;
  await new Promise((resolve) => {
    ch.consume(process.env.QUEUE, (msg) => {
      const m = timeoutdFields(msg);
      const header = (msg.properties.headers || {})["x-timeoutd-signature"];
      console.log(JSON.stringify({
        event: "verified", message_id: msg.properties.messageId, type: msg.properties.type,
        ok: timeoutdVerify(header, m, keys),
        other_key: timeoutdVerify(header, { ...m, routingKey: "elsewhere" }, keys),
        other_body: timeoutdVerify(header, { ...m, body: Buffer.concat([msg.content, Buffer.from(" ")]) }, keys),
      }));
      seen += 1;
      if (seen >= count) resolve();
    }, { noAck: true });
  });
  await conn.close();
}

main().catch((e) => { console.error(e); process.exit(1); });
