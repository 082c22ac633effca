// The web console in a real browser (docs/operating/console.md): Debian's chromium,
// driven by playwright-core, against a timeoutd of its own with the console enabled, on
// the RabbitMQ and Postgres of TIMEOUTD_TEST_AMQP_URL / TIMEOUTD_TEST_PG_URL, in a schema
// and group of its own. What it checks, from the outside (psql, not only the page):
//   - an expectation and a delayed message appear in the console;
//   - an action is refused without a token and with the read token, and the row is
//     still in Postgres;
//   - with the admin token a cancel removes the row from Postgres;
//   - a page of another origin cannot act (the row stays; the refusal is counted);
//   - what rows hold is shown as text, never as markup.
// Run by .ci/console-test, which installs chromium and playwright-core first.
// Usage: node tests/console/console.test.mjs <node_modules dir> <timeoutd binary> [screenshot.png]

import { spawn, execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import readline from 'node:readline';
import path from 'node:path';

const [modules, binary, screenshot] = process.argv.slice(2);
if (!modules || !binary) {
  console.error('usage: console.test.mjs <node_modules dir> <timeoutd binary> [screenshot.png]');
  process.exit(2);
}
const require = createRequire(path.resolve(modules) + '/');
const { chromium } = require('playwright-core');

const AMQP = process.env.TIMEOUTD_TEST_AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/%2f';
const PG = process.env.TIMEOUTD_TEST_PG_URL || 'postgres://postgres@127.0.0.1:5432/postgres';
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const tag = randomBytes(6).toString('hex');
const schema = 'console_' + tag;
const group = 'console-' + tag;
const ADMIN = 'admin-' + randomBytes(16).toString('hex');
const READ = 'read-' + randomBytes(16).toString('hex');
const WAIT = 20000;

let failures = 0;
function check(ok, what) {
  console.log((ok ? 'ok   ' : 'FAIL ') + what);
  if (!ok) failures += 1;
}

function sql(text) {
  return execFileSync('psql', [PG, '-v', 'ON_ERROR_STOP=1', '-tAqc', 'SET client_min_messages = warning; ' + text], { encoding: 'utf8' }).trim();
}

function startDaemon() {
  const env = Object.assign({}, process.env, {
    TIMEOUTD__AMQP__URL: AMQP,
    TIMEOUTD__POSTGRES__URL: PG,
    TIMEOUTD__POSTGRES__SCHEMA: schema,
    TIMEOUTD__ELECTION__GROUP: group,
    TIMEOUTD__HTTP__LISTEN: '127.0.0.1:0',
    // Nothing durable on the broker: no ingress exchange or queue to clean up.
    TIMEOUTD__DELAY__ENABLED: 'false',
    // The pending counts of the summary (and the screenshot) within a second.
    TIMEOUTD__HTTP__PENDING_REFRESH: '500ms',
    TIMEOUTD__CONSOLE__ENABLED: 'true',
    TIMEOUTD__CONSOLE__ADMIN_TOKEN: ADMIN,
    TIMEOUTD__CONSOLE__READ_TOKEN: READ,
    TIMEOUTD__LOG__FORMAT: 'json',
    RUST_LOG: 'info',
  });
  const child = spawn(binary, ['run'], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  const log = [];
  readline.createInterface({ input: child.stderr }).on('line', (l) => log.push(l));
  const ready = new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('no ready line within 60 s:\n' + log.slice(-30).join('\n'))), 60000);
    readline.createInterface({ input: child.stdout }).once('line', (line) => {
      clearTimeout(timer);
      try { resolve(JSON.parse(line)); } catch (e) { reject(e); }
    });
    child.once('exit', (code) => reject(new Error('timeoutd exited (' + code + '):\n' + log.slice(-30).join('\n'))));
  });
  return { child, ready, log };
}

async function until(what, f) {
  const end = Date.now() + WAIT;
  for (;;) {
    try { if (await f()) return true; } catch (_) { /* not yet */ }
    if (Date.now() > end) { check(false, what + ' (waited ' + WAIT / 1000 + ' s)'); return false; }
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function refusedMetric(base, reason) {
  const text = await (await fetch(base + '/metrics')).text();
  const line = text.split('\n').find((l) => l.startsWith('timeoutd_console_refused_total{') && l.includes('reason="' + reason + '"'));
  return line ? Number(line.split(' ').pop()) : 0;
}

const daemon = startDaemon();
let browser;
let other;
try {
  const ready = await daemon.ready;
  const base = 'http://' + ready.http_addr;
  const consoleUrl = base + '/console/';
  console.log('timeoutd ' + ready.node_id + ' at ' + base + ', schema ' + schema);
  // Ready once migrated, connected and settled.
  await until('the daemon is ready', async () => (await fetch(base + '/readyz')).status === 200);

  // The rows, written through the SQL API as a process manager would (after the daemon
  // started: it writes the rules the API judges by), to exchanges the daemon allows.
  const expectation = sql(`SELECT ${schema}.expect('order-4711', 'PaymentReceived', 'orders.timeouts', now() + interval '1 hour', 'orders', '{"order": 4711, "note": "<script>alert(1)</script>"}')`);
  sql(`SELECT ${schema}.expect('order-4712', 'Shipped', 'orders.timeouts', now() + interval '3 hours', 'orders')`);
  sql(`SELECT ${schema}.schedule_delayed('timeoutd.delayed', 'billing.reminder', convert_to('{"invoice": 99}', 'UTF8'), now() + interval '30 minutes', '{"content_type": "application/json", "headers": {"x-tenant": "<img src=x onerror=alert(1)>"}}', 'reminder-99')`);
  const present = (where) => sql(`SELECT count(*) FROM ${schema}.${where}`) === '1';

  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error' && !/401|403|Failed to load resource/.test(m.text())) errors.push(m.text()); });
  page.on('dialog', (d) => d.accept());
  await page.goto(consoleUrl);
  await until('the summary shows the group', async () => (await page.textContent('#where')).includes(group));
  await until('the node is active and the pending counts are shown', async () =>
    (await page.textContent('#members')).includes('active') && (await page.textContent('#pending')).includes('expectation'));

  // Without a token: no rows.
  await page.click('#search-form button');
  await page.fill('#q', 'order-4711');
  await page.click('#search-form button');
  await until('without a token the search is refused', async () => (await page.textContent('#rows-note')).includes('token'));

  // The read token: the rows appear; an action is refused, the row stays.
  await page.fill('#token', READ);
  await page.click('#token-form button[type=submit]');
  await page.click('#search-form button');
  await until('the expectation appears (read token)', async () => (await page.textContent('#rows')).includes(expectation));
  await page.click(`#rows tr[data-id="${expectation}"]`);
  await until('its detail shows the payload as text', async () => (await page.textContent('#preview')).includes('<script>alert(1)</script>'));
  check(await page.locator('#preview script').count() === 0, 'a payload is text, not markup');
  await page.click('#actions button[data-action=cancel]');
  await until('cancel with the read token is refused', async () => (await page.textContent('#action-result')).includes('refused'));
  check(present(`expected_messages WHERE id = '${expectation}'`), 'refused with the read token: the expectation is still in Postgres');

  // No token at all: refused, still there.
  await page.click('#forget');
  await page.click('#actions button[data-action=cancel]');
  await until('cancel without a token is refused', async () => /refused: a valid token/.test(await page.textContent('#action-result')));
  check(present(`expected_messages WHERE id = '${expectation}'`), 'refused without a token: the expectation is still in Postgres');

  // The admin token: the delayed message appears, with its headers as text.
  await page.fill('#token', ADMIN);
  await page.click('#token-form button[type=submit]');
  await page.selectOption('#kind', 'delayed');
  await page.click('#rows-form button');
  await until('the delayed message appears (admin token)', async () => (await page.textContent('#rows')).includes('reminder-99'));
  await page.click('#rows tbody tr.openable');
  await until('its headers are shown as text', async () => (await page.textContent('#properties')).includes('<img src=x onerror=alert(1)>'));
  check(await page.locator('#properties img, #detail img').count() === 0, 'a header is text, not markup');
  await page.click('#actions button[data-action=cancel]');
  await until('the delayed message is cancelled', async () => (await page.textContent('#action-result')).includes('cancel: done'));
  check(!present(`delayed_messages WHERE message_id = 'reminder-99'`), 'cancelled with the admin token: the delayed message is gone from Postgres');

  // The screenshot of the docs: both expectations listed, one open.
  await page.selectOption('#kind', 'expectation');
  await page.click('#rows-form button');
  await until('the expectations are listed', async () => (await page.textContent('#rows')).includes('order-4712'));
  await page.click(`#rows tr[data-id="${expectation}"]`);
  await until('the detail is open', async () => (await page.textContent('#detail-title')).includes(expectation));
  await until('the summary counts the pending expectations', async () =>
    /expectation\s+[1-9]/.test(await page.innerText('#pending tbody')));
  await page.evaluate(() => window.scrollTo(0, 0));
  if (screenshot) {
    await page.screenshot({ path: screenshot, fullPage: true });
    console.log('screenshot: ' + screenshot);
  }

  // A page of another origin: neither a simple POST (no preflight) nor one with the
  // token (preflighted, and answered without CORS headers) acts.
  other = http.createServer((req, res) => {
    res.writeHead(200, { 'Content-Type': 'text/html' });
    res.end('<!doctype html><title>elsewhere</title><p>another site</p>');
  });
  await new Promise((r) => other.listen(0, '127.0.0.1', r));
  const elsewhere = 'http://127.0.0.1:' + other.address().port + '/';
  const evil = await browser.newPage();
  await evil.goto(elsewhere);
  const crossBefore = await refusedMetric(base, 'cross_site');
  const body = JSON.stringify({ kind: 'expectation', action: 'cancel', id: expectation });
  const attempts = await evil.evaluate(async ({ url, body, token }) => {
    const out = [];
    try {
      await fetch(url, { method: 'POST', mode: 'no-cors', headers: { 'Content-Type': 'text/plain' }, body });
      out.push('simple: sent (opaque answer)');
    } catch (e) { out.push('simple: sent, answer withheld from the page (' + e.message + ')'); }
    try {
      const r = await fetch(url, { method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: 'Bearer ' + token }, body });
      out.push('with token: ' + r.status);
    } catch (e) { out.push('with token: blocked (' + e.message + ')'); }
    return out;
  }, { url: base + '/console/api/action', body, token: ADMIN });
  console.log('cross-origin attempts: ' + attempts.join('; '));
  check(attempts[1].startsWith('with token: blocked'), 'a cross-origin request with the token is blocked by the browser (no CORS)');
  if (await until('the cross-origin POST is counted as refused', async () => (await refusedMetric(base, 'cross_site')) > crossBefore)) {
    check(true, 'the cross-origin POST reached the console and was refused (timeoutd_console_refused_total{reason="cross_site"})');
  }
  check(present(`expected_messages WHERE id = '${expectation}'`), 'after the cross-origin attempts the expectation is still in Postgres');

  // The admin token in the console itself: cancelled, gone from Postgres.
  await page.click('#actions button[data-action=cancel]');
  await until('the expectation is cancelled', async () => (await page.textContent('#action-result')).includes('cancel: done'));
  check(!present(`expected_messages WHERE id = '${expectation}'`), 'cancelled with the admin token: the expectation is gone from Postgres');
  check(errors.length === 0, 'no script errors on the page' + (errors.length ? ': ' + errors.join(' | ') : ''));
} catch (e) {
  check(false, 'the test ran: ' + (e && e.stack ? e.stack : e));
  console.log(daemon.log.slice(-30).join('\n'));
} finally {
  if (browser) await browser.close().catch(() => {});
  if (other) other.close();
  daemon.child.kill('SIGTERM');
  await new Promise((r) => { daemon.child.once('exit', r); setTimeout(r, 15000); });
  try {
    sql(`DROP SCHEMA IF EXISTS ${schema} CASCADE; DROP ROLE IF EXISTS ${schema}_api`);
  } catch (e) { console.log('cleanup: ' + e.message); }
}
console.log(failures === 0 ? 'console browser test: passed' : 'console browser test: ' + failures + ' failure(s)');
process.exit(failures === 0 ? 0 : 1);
