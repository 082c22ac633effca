// The Node (pg) example of docs/integrating/languages.md: the code between the `docs:`
// markers is the doc's, character for character (tests/recipes/run.py checks it), and
// tests/recipes/sqlapi_drive.js runs it against a real timeoutd.

// docs: begin node
const { Pool } = require('pg');

// The role's search_path holds timeoutd's schema (see "The role" above): the functions
// are called by name. Each takes the caller's client and runs in its transaction.
const config = {
  ordersExchange: 'orders',              // delay.target_exchange or delay.allowed_exchanges
  timeoutsExchange: 'orders.timeouts',   // TimeOuts: an exchange timeouts.allowed_exchanges allows
  timeoutsRoutingKey: 'payment.timeout', // bound there to the process manager's queue
  paymentTimeout: '30 minutes',          // a Postgres interval
};

// Start waiting: the TimeOut (message_id = the returned id) goes to exchange/routingKey
// after `timeout` from now (the database's clock), unless cancelled first. Nothing
// happens if the transaction rolls back.
async function expectTimeout(client, { processId, messageType, exchange, routingKey, timeout,
  payload = null, idempotencyKey = null, traceparent = null }) {
  const { rows } = await client.query(
    `SELECT expect(process_id => $1, message_type => $2, routing_key => $3,
                   timeout_at => now() + $4::interval, exchange => $5, payload => $6::jsonb,
                   idempotency_key => $7, traceparent => $8) AS id`,
    [processId, messageType, routingKey, timeout, exchange,
      payload === null ? null : JSON.stringify(payload), idempotencyKey, traceparent]);
  return rows[0].id;
}

// Stop waiting. true: cancelled in time, no TimeOut comes. false: it fired already (a
// TimeOut with this message_id is on its way or delivered).
async function cancelTimeout(client, expectationId) {
  const { rows } = await client.query('SELECT cancel_expectation($1) AS done', [expectationId]);
  return rows[0].done;
}

// The transactional outbox: published as soon as the transaction commits, never if it
// rolls back. Returns its message_id (a new uuid by default).
async function publishAtCommit(client, exchange, routingKey, body, { headers = {},
  contentType = 'application/json', messageId = null } = {}) {
  const properties = { content_type: contentType, headers };
  const { rows } = await client.query(
    'SELECT publish_at_commit($1, $2, $3, $4::jsonb, $5) AS id',
    [exchange, routingKey, Buffer.from(body), JSON.stringify(properties), messageId]);
  return rows[0].id;
}

// An application transaction: its own writes, an expectation and an outbox message
// commit together or not at all (ownWrites throws: nothing happened). Returns
// [expectation id, outbox message_id].
async function placeOrder(client, orderId, { traceparent = null, ownWrites = async () => {} } = {}) {
  await client.query('BEGIN');
  try {
    const expectationId = await expectTimeout(client, {
      processId: `order-${orderId}`, messageType: 'PaymentReceived',
      exchange: config.timeoutsExchange, routingKey: config.timeoutsRoutingKey,
      timeout: config.paymentTimeout,
      payload: { order: orderId }, traceparent });
    const messageId = await publishAtCommit(client, config.ordersExchange, 'orders.placed',
      JSON.stringify({ order: orderId }), { headers: traceparent ? { traceparent } : {} });
    await ownWrites(client); // e.g. client.query('INSERT INTO orders ...'); any place before COMMIT
    await client.query('COMMIT');
    return [expectationId, messageId];
  } catch (err) {
    await client.query('ROLLBACK');
    throw err;
  }
}

// const pool = new Pool({ connectionString: 'postgresql://orders_pm@db/orders' });
// const client = await pool.connect();
// try {
//   const [expectationId] = await placeOrder(client, 42);
//   ...                                      // later, the payment arrived:
//   await cancelTimeout(client, expectationId);
// } finally { client.release(); }
// docs: end

module.exports = { Pool, config, expectTimeout, cancelTimeout, publishAtCommit, placeOrder };
