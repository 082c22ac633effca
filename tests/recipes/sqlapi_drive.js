// Every function of the SQL API (migrations/0009_sql_api.sql) from Node, through the
// example code of docs/integrating/languages.md (sqlapi_example.js), as a login role
// granted only <schema>_api, against a running timeoutd (started first: it writes the
// rules the API judges by). The twin of sqlapi_drive.py (its docstring says what the
// environment holds); run.py judges what this prints.

const crypto = require('crypto');
const amqp = require('amqplib');
const { Client } = require('pg');
const api = require('./sqlapi_example');

const E = process.env;
const SCHEMA = E.SCHEMA;
const QUEUE = E.QUEUE;
const OUT = E.OUT_EXCHANGE;
const LATE = E.LATE_EXCHANGE;
const DENIED = E.DENIED_EXCHANGE;
const TIMEOUTS = E.TIMEOUTS_EXCHANGE;
const INGRESS = E.INGRESS_EXCHANGE;
const TIMEOUT_MS = 1500;
const TIMEOUT = `${TIMEOUT_MS} milliseconds`;

const emit = (event, fields = {}) => process.stdout.write(`${JSON.stringify({ event, ...fields })}\n`);
const returned = (what, got, want) => emit('returned', { what, got, want });
const now = () => Date.now() / 1000;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const traceparent = () => `00-${crypto.randomBytes(16).toString('hex')}-${crypto.randomBytes(8).toString('hex')}-01`;
const tag = () => crypto.randomBytes(4).toString('hex');

async function connect(url) {
  const client = new Client({ connectionString: url });
  await client.connect();
  return client;
}

async function one(client, sql, args = []) {
  const { rows } = await client.query(sql, args);
  return Object.values(rows[0])[0];
}

// The SQLSTATE the statement fails with (null: it did not; rolled back either way).
async function sqlstate(client, sql, args = []) {
  await client.query('BEGIN');
  try {
    await client.query(sql, args);
    return null;
  } catch (err) {
    return err.code;
  } finally {
    await client.query('ROLLBACK');
  }
}

// Poll, as the schema's owner, until a row of `table` matches.
async function waitRow(admin, table, where, args, what, limitMs = 30000) {
  const deadline = Date.now() + limitMs;
  while (Date.now() < deadline) {
    if (Number(await one(admin, `SELECT count(*) FROM ${SCHEMA}.${table} WHERE ${where}`, args))) return true;
    await sleep(50);
  }
  returned(`waited for: ${what}`, 'timed out', 'the row');
  return false;
}

// The missing exchange appears, routing to the queue.
async function declare(exchange) {
  const conn = await amqp.connect(E.AMQP_URL);
  const ch = await conn.createChannel();
  await ch.assertExchange(exchange, 'direct', { durable: false });
  await ch.bindQueue(QUEUE, exchange, 'late');
  await conn.close();
}

class Rollback extends Error {}

// The application's transactions, concurrently: each places an order in a transaction
// that sometimes rolls back (its own writes fail). The first of each worker rolls
// back, the second commits.
async function worker(n, txns) {
  const client = await connect(E.APP_PG_URL);
  try {
    for (let t = 0; t < txns; t += 1) {
      const order = n * 1000 + t;
      const rollback = t === 0 || (t > 1 && Math.random() < 0.35);
      const tp = traceparent();
      const begun = now();
      let ids = null;
      const ownWrites = async (c) => {
        await c.query('SELECT pg_sleep($1)', [Math.random() * 0.03]);
        if (rollback) throw new Rollback('the order could not be stored');
      };
      try {
        ids = await api.placeOrder(client, order, { traceparent: tp, ownWrites });
      } catch (err) {
        if (!(err instanceof Rollback)) {
          returned(`worker ${n} transaction ${t}`, String(err), 'no error');
          continue;
        }
      }
      const committed = now();
      if (rollback) {
        // The ids were never returned: the rolled-back rows are looked for by process.
        emit('never-process', { process_id: `order-${order}`, what: `rolled-back order-${order}` });
        continue;
      }
      const [eid, mid] = ids;
      emit('fires', { id: eid, kind: 'timeout', what: `expectation order-${order}`,
        not_before: begun + TIMEOUT_MS / 1000, traceparent: tp, process_id: `order-${order}`,
        payload: { order } });
      emit('fires', { id: mid, kind: 'outbox', what: `outbox order-${order}`, not_before: begun,
        committed, traceparent: tp, body: JSON.stringify({ order }) });
    }
  } finally {
    await client.end();
  }
}

async function expectations(app, other, admin) {
  const t = tag();
  const expect = (processId, timeout, extra = {}) => api.expectTimeout(app, {
    processId, messageType: 'PaymentReceived', exchange: TIMEOUTS, routingKey: QUEUE, timeout, ...extra });
  // Idempotency: the same key, twice, in two transactions: one row, one TimeOut.
  const key = `order-${t}-timeout`;
  const begun = now();
  const first = await expect(`idem-${t}`, TIMEOUT, { idempotencyKey: key });
  const again = await expect(`idem-${t}`, TIMEOUT, { idempotencyKey: key });
  returned('expect() twice with one idempotency_key: the same id', again, first);
  emit('fires', { id: first, kind: 'timeout', what: 'idempotent expectation', not_before: begun + TIMEOUT_MS / 1000 });

  // Another role's expectation answers as one that never existed; naming its owner is
  // refused. It fires as if untouched (above).
  const owner = await one(app, 'SELECT \'sql:\' || session_user');
  returned('cancel_expectation of another role\'s expectation', await one(other, 'SELECT cancel_expectation($1)', [first]), false);
  returned('reschedule_expectation of another role\'s expectation', await one(other, 'SELECT reschedule_expectation($1, now())', [first]), false);
  returned('cancel_expectations of another role\'s process', await one(other, 'SELECT cancel_expectations($1)', [`idem-${t}`]), 0);
  returned('cancel_expectation naming another owner', await sqlstate(other, 'SELECT cancel_expectation($1, $2)', [first, owner]), '42501');

  // Where a TimeOut may never go: refused by expect() (42501), nothing stored.
  for (const [what, exchange] of [['the default exchange', ''], ['an amq.* exchange', 'amq.topic'],
    ['the ingress exchange', INGRESS], ['the announcement exchange', 'timeoutd.announcements']]) {
    returned(`expect() to ${what}`, await sqlstate(app, 'SELECT expect(\'refused\', \'PaymentReceived\', $1, now(), exchange => $2)', [QUEUE, exchange]), '42501');
  }

  // A row written to the table directly (here by the schema's owner, for the API role)
  // with a TimeOut to the default exchange is held when due, never published; released,
  // it is judged again and held again; cancelled.
  const held = crypto.randomUUID();
  await admin.query(`INSERT INTO ${SCHEMA}.expected_messages (id, owner, process_id, message_type, timeout_at, exchange, routing_key) VALUES ($1, $2, $3, 'PaymentReceived', now(), '', $4)`, [held, owner, `held-${t}`, QUEUE]);
  if (await waitRow(admin, 'expected_messages', 'id = $1 AND retry_at = \'infinity\' AND last_error IS NOT NULL', [held], 'the TimeOut to the default exchange held')) {
    returned('release_expectation of a held row', await one(app, 'SELECT release_expectation($1)', [held]), true);
    await waitRow(admin, 'expected_messages', 'id = $1 AND retry_at = \'infinity\'', [held], 'the released row held again');
    returned('cancel_expectation of a held row', await one(app, 'SELECT cancel_expectation($1)', [held]), true);
  }
  emit('never', { id: held, what: 'TimeOut to the default exchange (held)' });

  // cancel_expectation before the deadline: true, then false; no TimeOut.
  let eid = await expect(`cancel-${t}`, '3 seconds');
  returned('cancel_expectation in time', await api.cancelTimeout(app, eid), true);
  returned('cancel_expectation again', await api.cancelTimeout(app, eid), false);
  emit('never', { id: eid, what: 'cancelled expectation' });

  // cancel_expectations: by process and message type, then the rest of the process.
  const ids = [];
  await app.query('BEGIN');
  for (const messageType of ['PaymentReceived', 'Shipped', 'Delivered']) {
    ids.push(await api.expectTimeout(app, { processId: `proc-${t}`, messageType, exchange: TIMEOUTS, routingKey: QUEUE, timeout: '3 seconds' }));
  }
  await app.query('COMMIT');
  returned('cancel_expectations(process, type)', await one(app, 'SELECT cancel_expectations($1, $2)', [`proc-${t}`, 'Shipped']), 1);
  returned('cancel_expectations(process)', await one(app, 'SELECT cancel_expectations($1)', [`proc-${t}`]), 2);
  for (const i of ids) emit('never', { id: i, what: 'expectation cancelled by process' });

  // reschedule_expectation: from a minute to 1.5 s; unknown id: false. retry and
  // release of a row neither failing nor parked: false.
  eid = await expect(`move-${t}`, '1 minute');
  const moved = now();
  returned('reschedule_expectation', await one(app, 'SELECT reschedule_expectation($1, now() + $2::interval)', [eid, TIMEOUT]), true);
  returned('reschedule_expectation of an unknown id', await one(app, 'SELECT reschedule_expectation($1, now())', [crypto.randomUUID()]), false);
  returned('retry_expectation of a pending row', await one(app, 'SELECT retry_expectation($1)', [eid]), false);
  returned('release_expectation of a pending row', await one(app, 'SELECT release_expectation($1)', [eid]), false);
  emit('fires', { id: eid, kind: 'timeout', what: 'rescheduled expectation', not_before: moved + TIMEOUT_MS / 1000, not_after: moved + 30 });

  // release_expectation: a parked row is what the daemon leaves with retry_at =
  // 'infinity'; the owner sets that state here, the API releases it, the TimeOut goes.
  eid = await expect(`parked-${t}`, '1 minute');
  await admin.query(`UPDATE ${SCHEMA}.expected_messages SET retry_at = 'infinity', timeout_at = now() WHERE id = $1`, [eid]);
  await sleep(300);
  const released = now();
  returned('release_expectation of a parked row', await one(app, 'SELECT release_expectation($1)', [eid]), true);
  emit('fires', { id: eid, kind: 'timeout', what: 'released expectation', not_before: released, not_after: released + 10 });

  // retry_expectation: a TimeOut to an exchange not there yet fails and waits
  // scan.retry_min (30 s here); once it exists, retry_expectation sends it now.
  eid = await expect(`late-${t}`, '0 seconds', { routingKey: 'late', exchange: `${LATE}.timeouts` });
  if (await waitRow(admin, 'expected_messages', 'id = $1 AND attempts >= 1 AND retry_at > now()', [eid], 'the TimeOut to a missing exchange failing')) {
    await declare(`${LATE}.timeouts`);
    const retried = now();
    returned('retry_expectation of a failing row', await one(app, 'SELECT retry_expectation($1)', [eid]), true);
    emit('fires', { id: eid, kind: 'timeout', what: 'retried expectation', not_before: retried, not_after: retried + 10 });
  }
}

async function delayed(app, other, admin) {
  const t = tag();
  const body = JSON.stringify({ tag: t });
  const props = JSON.stringify({ content_type: 'application/json', headers: { traceparent: traceparent(), 'x-n': 7 } });
  const tp = JSON.parse(props).headers.traceparent;
  const mid = `delayed-${t}`;
  const schedule = 'SELECT schedule_delayed($1, \'orders.delayed\', $2, now() + $3::interval, $4::jsonb, $5)';
  const begun = now();
  returned('schedule_delayed', await one(app, schedule, [OUT, Buffer.from(body), TIMEOUT, props, mid]), mid);
  returned('schedule_delayed again with its message_id', await one(app, schedule, [OUT, Buffer.from(body), TIMEOUT, props, mid]), mid);
  emit('fires', { id: mid, kind: 'delayed', what: 'scheduled delayed message', not_before: begun + TIMEOUT_MS / 1000, body, traceparent: tp, headers: { 'x-n': 7 } });

  // Another role's message: acting for its owner is refused.
  const owner = await one(app, 'SELECT \'sql:\' || session_user');
  returned('cancel_delayed of another owner\'s message', await sqlstate(other, 'SELECT cancel_delayed($1, $2)', [mid, owner]), '42501');
  returned('reschedule_delayed of another owner\'s message', await sqlstate(other, 'SELECT reschedule_delayed($1, now(), $2)', [mid, owner]), '42501');
  returned('release_delayed of another owner\'s message', await sqlstate(other, 'SELECT release_delayed($1, $2)', [mid, owner]), '42501');
  returned('cancel_delayed of an id the other role does not own', await one(other, 'SELECT cancel_delayed($1)', [mid]), false);

  // reschedule_delayed: from a minute to 1.5 s. retry/release of a pending one: false.
  const movedId = `moved-${t}`;
  await one(app, schedule, [OUT, Buffer.from(body), '1 minute', props, movedId]);
  const moved = now();
  returned('reschedule_delayed', await one(app, 'SELECT reschedule_delayed($1, now() + $2::interval)', [movedId, TIMEOUT]), true);
  returned('retry_delayed of a pending message', await one(app, 'SELECT retry_delayed($1)', [movedId]), false);
  returned('release_delayed of a pending message', await one(app, 'SELECT release_delayed($1)', [movedId]), false);
  emit('fires', { id: movedId, kind: 'delayed', what: 'rescheduled delayed message', not_before: moved + TIMEOUT_MS / 1000, not_after: moved + 30, body });

  // cancel_delayed: true, then false; never delivered.
  const gone = `cancelled-${t}`;
  await one(app, 'SELECT schedule_delayed($1, \'orders.delayed\', $2, now() + interval \'3 s\', message_id => $3)', [OUT, Buffer.from(body), gone]);
  returned('cancel_delayed in time', await one(app, 'SELECT cancel_delayed($1)', [gone]), true);
  returned('cancel_delayed again', await one(app, 'SELECT cancel_delayed($1)', [gone]), false);
  emit('never', { id: gone, what: 'cancelled delayed message' });

  // retry_delayed: to an allowed exchange not there yet: fails, waits 30 s; declared,
  // retry_delayed delivers it now.
  const late = await api.publishAtCommit(app, `${LATE}.delayed`, 'late', body);
  if (await waitRow(admin, 'delayed_messages', 'message_id = $1 AND attempts >= 1 AND retry_at > now() AND retry_at < \'infinity\'', [late], 'the delayed message to a missing exchange failing')) {
    await declare(`${LATE}.delayed`);
    const retried = now();
    returned('retry_delayed of a failing message', await one(app, 'SELECT retry_delayed($1)', [late]), true);
    emit('fires', { id: late, kind: 'delayed', what: 'retried delayed message', not_before: retried, not_after: retried + 10, body });
  }

  // To an exchange the daemons do not allow, or beyond their bounds: refused by the call.
  returned('publish_at_commit to an exchange not allowed', await sqlstate(app, 'SELECT publish_at_commit($1, \'denied\', $2)', [DENIED, Buffer.from(body)]), '42501');
  returned('schedule_delayed to an exchange not allowed', await sqlstate(app, 'SELECT schedule_delayed($1, \'denied\', $2, now() + $3::interval)', [DENIED, Buffer.from(body), TIMEOUT]), '42501');
  returned('schedule_delayed to the default exchange', await sqlstate(app, 'SELECT schedule_delayed(\'\', $1, $2, now())', [QUEUE, Buffer.from(body)]), '42501');
  returned('schedule_delayed beyond delay.max_delay', await sqlstate(app, 'SELECT schedule_delayed($1, \'orders.delayed\', $2, now() + interval \'1000 days\')', [OUT, Buffer.from(body)]), '54000');
  returned('publish_at_commit with properties over 64 KiB', await sqlstate(app, 'SELECT publish_at_commit($1, \'orders.placed\', $2, $3::jsonb)', [OUT, Buffer.from(body), JSON.stringify({ headers: { 'x-big': 'x'.repeat(70000) } })]), '54000');

  // release_delayed: a message written to the table directly (here by the schema's
  // owner, for the API role) to an exchange not allowed is held when due; released,
  // judged again and held again; cancelled.
  const held = `held-${t}`;
  await admin.query(`INSERT INTO ${SCHEMA}.delayed_messages (owner, message_id, deliver_at, exchange, routing_key, body) VALUES ($1, $2, now(), $3, 'denied', $4)`, [owner, held, DENIED, Buffer.from(body)]);
  if (await waitRow(admin, 'delayed_messages', 'message_id = $1 AND retry_at = \'infinity\'', [held], 'the message to an exchange not allowed held')) {
    returned('release_delayed of a held message', await one(app, 'SELECT release_delayed($1)', [held]), true);
    await waitRow(admin, 'delayed_messages', 'message_id = $1 AND retry_at = \'infinity\' AND attempts >= 2', [held], 'the released message held again');
    returned('cancel_delayed of a held message', await one(app, 'SELECT cancel_delayed($1)', [held]), true);
  }
  emit('never', { id: held, what: 'message to an exchange not allowed' });
}

async function main() {
  api.config.ordersExchange = OUT;
  api.config.timeoutsExchange = TIMEOUTS;
  api.config.paymentTimeout = TIMEOUT;
  const app = await connect(E.APP_PG_URL);
  const other = await connect(E.OTHER_PG_URL);
  const admin = await connect(E.ADMIN_PG_URL);
  try {
    returned('api_version()', await one(app, 'SELECT api_version()'), 1);
    returned('the role\'s search_path', await one(app, 'SHOW search_path'), `public, ${SCHEMA}`);
    returned('SELECT on expected_messages', await sqlstate(app, `SELECT * FROM ${SCHEMA}.expected_messages`), '42501');
    returned('INSERT into delayed_messages', await sqlstate(app, `INSERT INTO ${SCHEMA}.delayed_messages (owner, message_id, deliver_at, exchange, routing_key, properties, body) VALUES ('', 'x', now(), '', '', '{}', '')`), '42501');
    const workers = [];
    for (let n = 0; n < Number(E.WORKERS); n += 1) workers.push(worker(n, Number(E.TXNS)));
    await expectations(app, other, admin);
    await delayed(app, other, admin);
    await Promise.all(workers);
  } finally {
    await Promise.all([app.end(), other.end(), admin.end()]);
  }
  emit('done');
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
