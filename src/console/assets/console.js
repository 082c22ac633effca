// The timeoutd console (docs/operating/console.md). Plain script, no framework.
// Everything that comes from the database or the node is put on the page as text
// (textContent), never as markup. The token lives in this tab's sessionStorage and is
// sent only as an Authorization header to this console's own API.
'use strict';

const TOKEN_KEY = 'timeoutd-console-token';
const $ = (id) => document.getElementById(id);
let summary = null;
let current = null; // the row shown in the detail

function token() { return sessionStorage.getItem(TOKEN_KEY) || ''; }

async function api(path, options) {
  const opts = Object.assign({ credentials: 'omit', cache: 'no-store' }, options || {});
  opts.headers = Object.assign({}, opts.headers || {});
  if (token()) opts.headers['Authorization'] = 'Bearer ' + token();
  const res = await fetch('api/' + path, opts);
  let body = null;
  try { body = await res.json(); } catch (_) { body = null; }
  if (!res.ok) {
    const e = new Error((body && body.error) || (res.status + ' ' + res.statusText));
    e.status = res.status;
    throw e;
  }
  return body;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function cells(tr, values) {
  for (const v of values) {
    const td = document.createElement('td');
    if (v instanceof Node) td.appendChild(v);
    else td.textContent = (v === null || v === undefined || v === '') ? '—' : String(v);
    tr.appendChild(td);
  }
  return tr;
}

function when(iso) {
  if (!iso) return '—';
  const d = new Date(iso);
  if (isNaN(d)) return String(iso);
  const s = (d.getTime() - Date.now()) / 1000;
  return d.toLocaleString() + ' (' + relative(s) + ')';
}

function relative(s) {
  const a = Math.abs(s);
  const t = a < 1 ? a.toFixed(2) + ' s' : a < 120 ? a.toFixed(0) + ' s' : a < 7200 ? (a / 60).toFixed(0) + ' min'
    : a < 172800 ? (a / 3600).toFixed(1) + ' h' : (a / 86400).toFixed(1) + ' d';
  return s < 0 ? t + ' ago' : 'in ' + t;
}

function problem(text) {
  const p = $('problem');
  p.textContent = text || '';
  p.hidden = !text;
}

// --- summary: the group and the pending counts, every 2 s ----------------------------

async function refresh() {
  try {
    summary = await api('summary');
    problem('');
  } catch (e) {
    problem('Cannot reach the console: ' + e.message);
    return;
  }
  const n = summary.node;
  $('where').textContent = 'group ' + n.group + ' · node ' + n.node_id.slice(0, 8) + ' (' + n.role + ')';
  const active = n.members.find((m) => m.active);
  $('group-line').textContent = [
    n.members.length + ' member(s)',
    'active: ' + (active ? active.node_id : 'none known'),
    n.settled ? 'settled' : 'settling',
    'broker ' + (n.bus_connected ? 'connected' : 'NOT connected'),
    'database ' + (n.database_ok === null ? 'not reached yet' : n.database_ok ? 'ok' : 'NOT ok'),
    'rejected announcements: ' + rejected(n.rejected_announcements),
  ].join(' · ');
  const members = $('members').tBodies[0];
  members.replaceChildren();
  for (const m of n.members) {
    const state = [m.withdrawn ? 'withdrawn' : 'candidate', m.probing ? 'probing' : ''].filter(Boolean).join(', ');
    const tr = cells(el('tr'), [m.node_id + (m.node_id === n.node_id ? ' (this node)' : ''),
      m.active ? 'active' : 'passive', (m.last_seen_ms / 1000).toFixed(1) + ' s ago', state]);
    if (m.active) tr.className = 'active';
    members.appendChild(tr);
  }
  const pending = $('pending').tBodies[0];
  pending.replaceChildren();
  for (const p of summary.pending) {
    const due = summary.due.find((d) => d.kind === p.kind);
    const tr = cells(el('tr'), [p.kind, p.pending, p.due, p.overdue, p.failing,
      due ? when(due.earliest_due) : 'not probed here',
      p.counted_s_ago.toFixed(0) + ' s ago',
      p.fired_here + (p.mean_lateness_s === null ? '' : ' (' + (p.mean_lateness_s * 1000).toFixed(1) + ' ms)')]);
    for (const i of [1, 2, 3, 4]) tr.children[i].className = 'num';
    pending.appendChild(tr);
  }
  if (summary.pending.length === 0) pending.appendChild(cells(el('tr'), ['not counted yet']));
  access();
}

function rejected(r) {
  if (!r || !r.total) return 'none';
  const parts = Object.entries(r.by_reason || {}).map(([k, v]) => k + ' ' + v);
  return r.total + ' (' + parts.join(', ') + ')';
}

function access() {
  const a = $('access');
  if (!summary) return;
  if (!summary.rows) a.textContent = 'read-only: no token configured';
  else if (!token()) a.textContent = 'no token: summary only';
  else a.textContent = summary.actions ? 'token set' : 'token set (no actions: no admin token configured)';
  $('rows-locked').hidden = Boolean(summary.rows && token());
}

// --- rows: lists, search, detail ------------------------------------------------------

function rowState(r) {
  if (r.held) return el('span', r.kind === 'delayed' ? 'held' : 'parked', 'state-held');
  if (r.attempts > 0) return el('span', 'failing', 'state-failing');
  return 'pending';
}

function showRows(rows, note) {
  const body = $('rows').tBodies[0];
  body.replaceChildren();
  $('rows-note').textContent = note + ': ' + rows.length + (rows.length >= 100 ? ' (the first 100)' : '') + ' row(s)';
  for (const r of rows) {
    const e = r.kind === 'expectation';
    const tr = cells(el('tr'), [r.kind, el('code', r.id), e ? r.process_id + ' / ' + r.message_type : r.message_id + (r.owner ? ' (owner ' + r.owner + ')' : ''),
      when(e ? r.timeout_at : r.deliver_at), (r.exchange || '(default)') + ' → ' + r.routing_key, r.attempts,
      rowState(r), r.last_error]);
    tr.className = 'openable';
    tr.dataset.kind = r.kind;
    tr.dataset.id = r.id;
    tr.tabIndex = 0;
    tr.addEventListener('click', () => openRow(r.kind, r.id));
    tr.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') openRow(r.kind, r.id); });
    body.appendChild(tr);
  }
}

async function list(ev) {
  if (ev) ev.preventDefault();
  try {
    const kind = $('kind').value, state = $('state').value;
    showRows(await api('rows?kind=' + encodeURIComponent(kind) + '&state=' + encodeURIComponent(state)), kind + ', ' + state);
  } catch (e) { $('rows-note').textContent = e.message; }
}

async function search(ev) {
  ev.preventDefault();
  const q = $('q').value.trim();
  if (!q) return;
  try { showRows(await api('search?q=' + encodeURIComponent(q)), 'search “' + q + '”'); } catch (e) { $('rows-note').textContent = e.message; }
}

function dd(dl, term, value) {
  dl.appendChild(el('dt', term));
  const d = el('dd', (value === null || value === undefined || value === '') ? '—' : value);
  dl.appendChild(d);
}

async function openRow(kind, id) {
  let d;
  try { d = await api('row?kind=' + encodeURIComponent(kind) + '&id=' + encodeURIComponent(id)); } catch (e) {
    $('rows-note').textContent = e.message;
    return;
  }
  current = d.row;
  const r = d.row, e = r.kind === 'expectation';
  $('detail-section').hidden = false;
  $('detail-title').textContent = r.kind + ' ' + r.id;
  const dl = $('detail');
  dl.replaceChildren();
  if (e) {
    dd(dl, 'process id', r.process_id);
    dd(dl, 'message type', r.message_type);
    dd(dl, 'timeout at', when(r.timeout_at));
    dd(dl, 'traceparent', d.traceparent);
    dd(dl, 'idempotency key', d.idempotency_key);
  } else {
    dd(dl, 'message id', r.message_id);
    dd(dl, 'owner', r.owner === '' ? '(anonymous)' : r.owner);
    dd(dl, 'deliver at', when(r.deliver_at));
  }
  dd(dl, 'to', 'exchange “' + r.exchange + '”, routing key “' + r.routing_key + '”');
  dd(dl, 'created', when(d.created_at));
  dd(dl, 'attempts', String(r.attempts));
  dd(dl, 'next attempt', r.retry_at ? when(r.retry_at) : (r.held ? 'never by itself (held)' : '—'));
  dd(dl, 'last error', r.last_error);
  $('preview-size').textContent = d.size === null ? '(none)' : '(' + d.size + ' bytes' + (d.preview_hex ? ', shown in hex' : '') + (d.body_dropped ? ', not stored: larger than delay.max_body' : '') + ')';
  $('preview').textContent = d.preview === null ? '' : d.preview;
  $('properties-block').hidden = e;
  $('properties').textContent = e ? '' : properties(d.properties);
  $('action-result').textContent = '';
  $('action-result').className = '';
  for (const b of document.querySelectorAll('#actions button')) {
    const a = b.dataset.action;
    const allowed = summary && summary.actions;
    b.disabled = !allowed || (a === 'release' && !r.held) || (a === 'retry' && !(r.attempts > 0 && !r.held && r.retry_at));
    b.title = allowed ? '' : 'actions need console.admin_token';
  }
  $('detail-section').scrollIntoView({ behavior: 'smooth', block: 'start' });
}

// Stored AMQP properties; headers as [name, {t: type, v: value}] pairs.
function properties(p) {
  if (!p) return '';
  const lines = [];
  for (const [k, v] of Object.entries(p)) {
    if (k === 'headers' && Array.isArray(v)) continue;
    lines.push(k + ': ' + JSON.stringify(v));
  }
  if (p.headers && Array.isArray(p.headers)) {
    lines.push('headers:');
    for (const h of p.headers) {
      const [name, val] = Array.isArray(h) ? h : [String(h), null];
      lines.push('  ' + name + ': ' + (val && 'v' in val ? JSON.stringify(val.v) : 'null') + (val && val.t ? '  (' + val.t + ')' : ''));
    }
  }
  return lines.join('\n');
}

async function act(action) {
  if (!current) return;
  const r = current;
  const body = { kind: r.kind, action };
  if (r.kind === 'expectation') body.id = r.id; else { body.message_id = r.message_id; body.owner = r.owner; }
  if (action === 'reschedule') {
    const v = $('at').value;
    if (!v) { result(false, 'Pick the new due time first.'); return; }
    body.at = new Date(v).toISOString();
  }
  if (action === 'cancel' && !window.confirm('Cancel this ' + r.kind + '? It will never be sent.')) return;
  try {
    const res = await api('action', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
    result(res.done, res.done ? action + ': done' : action + ': nothing changed (fired already, gone, or not in a state for it)');
  } catch (e) { result(false, action + ' refused: ' + e.message); }
}

function result(ok, text) {
  const p = $('action-result');
  p.textContent = text;
  p.className = ok ? 'ok' : 'bad';
}

document.addEventListener('DOMContentLoaded', () => {
  $('token-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = $('token').value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    $('token').value = '';
    access();
  });
  $('forget').addEventListener('click', () => { sessionStorage.removeItem(TOKEN_KEY); access(); });
  $('rows-form').addEventListener('submit', list);
  $('search-form').addEventListener('submit', search);
  for (const b of document.querySelectorAll('#actions button')) b.addEventListener('click', () => act(b.dataset.action));
  refresh();
  setInterval(refresh, 2000);
});
