"""Every function of the SQL API (migrations/0009_sql_api.sql) from Python, through the
example code of docs/integrating/languages.md (sqlapi_example.py), as a login role
granted only <schema>_api, against a running timeoutd. Started by tests/recipes/run.py,
which set up the roles, the queue and the exchanges, and judges: this script prints one
JSON line per fact ({"event": "fires"|"never"|"returned", ...}) and asserts nothing.

Environment: APP_PG_URL, OTHER_PG_URL (a second API role), ADMIN_PG_URL (the schema's
owner: only to see or set row states the API cannot, and says so), SCHEMA, QUEUE (every
message arrives there), TIMEOUTS_EXCHANGE (TimeOuts go there, bound to QUEUE),
OUT_EXCHANGE (delay.target_exchange), LATE_EXCHANGE (the prefix of two exchanges not
there yet, .timeouts and .delayed; the second allowed for delayed messages),
DENIED_EXCHANGE (not allowed for delayed messages, bound to QUEUE), INGRESS_EXCHANGE
(the daemon's), AMQP_URL, WORKERS, TXNS.

The daemon has written the rules the API judges by (<schema>.api_rules) before this runs:
run.py starts it first.
"""

import json
import os
import random
import sys
import threading
import time
import uuid
from datetime import timedelta

import pika
import psycopg

import sqlapi_example as api

E = os.environ
SCHEMA, QUEUE = E["SCHEMA"], E["QUEUE"]
OUT, LATE, DENIED = E["OUT_EXCHANGE"], E["LATE_EXCHANGE"], E["DENIED_EXCHANGE"]
TIMEOUTS, INGRESS = E["TIMEOUTS_EXCHANGE"], E["INGRESS_EXCHANGE"]
TIMEOUT = timedelta(milliseconds=1500)
lock = threading.Lock()


def emit(event, **fields):
    with lock:
        print(json.dumps({"event": event, **fields}), flush=True)


def connect(url):
    return psycopg.connect(url, autocommit=True)


def traceparent():
    return f"00-{uuid.uuid4().hex}-{os.urandom(8).hex()}-01"


def one(conn, sql, args=()):
    return conn.execute(sql, args).fetchone()[0]


def sqlstate(conn, sql, args=()):
    """The SQLSTATE the statement fails with (None: it did not)."""
    try:
        with conn.transaction():
            conn.execute(sql, args)
    except psycopg.Error as e:
        return e.sqlstate
    return None


def returned(what, got, want):
    emit("returned", what=what, got=got, want=want)


def wait_row(admin, table, where, args, what, limit=30.0):
    """Poll, as the schema's owner, until a row of `table` matches (the API role may
    not read the tables)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if one(admin, f"SELECT count(*) FROM {SCHEMA}.{table} WHERE {where}", args):
            return True
        time.sleep(0.05)
    emit("returned", what=f"waited for: {what}", got="timed out", want="the row")
    return False


def worker(n, txns):
    """The application's transactions, concurrently: each places an order (an
    expectation and an outbox message) in an outer transaction that sometimes rolls
    back. The first of each worker rolls back, the second commits."""
    rng = random.Random()
    with connect(E["APP_PG_URL"]) as conn:
        for t in range(txns):
            order = n * 1000 + t
            rollback = t == 0 or (t > 1 and rng.random() < 0.35)
            tp = traceparent()
            begun = time.time()
            try:
                with conn.transaction():
                    eid, mid = api.place_order(conn, order, traceparent=tp)
                    conn.execute("SELECT pg_sleep(%s)", (rng.random() * 0.03,))
                    if rollback:
                        raise psycopg.Rollback()
            except Exception as e:  # noqa: BLE001 (reported, judged by run.py)
                returned(f"worker {n} transaction {t}", repr(e), "no error")
                continue
            committed = time.time()
            if rollback:
                emit("never", id=str(eid), what=f"rolled-back expectation order-{order}")
                emit("never", id=mid, what=f"rolled-back outbox message order-{order}")
                continue
            emit("fires", id=str(eid), kind="timeout", what=f"expectation order-{order}",
                 not_before=begun + TIMEOUT.total_seconds(), traceparent=tp,
                 process_id=f"order-{order}", payload={"order": order})
            emit("fires", id=mid, kind="outbox", what=f"outbox order-{order}",
                 not_before=begun, committed=committed, traceparent=tp,
                 body=json.dumps({"order": order}))


def expectations(app, other, admin):
    tag = uuid.uuid4().hex[:8]
    # Idempotency: the same key, twice, in two transactions: one row, one TimeOut.
    key = f"order-{tag}-timeout"
    begun = time.time()
    with app.transaction():
        first = api.expect_timeout(app, f"idem-{tag}", "PaymentReceived", TIMEOUTS, QUEUE,
                                   TIMEOUT, idempotency_key=key)
    with app.transaction():
        again = api.expect_timeout(app, f"idem-{tag}", "PaymentReceived", TIMEOUTS, QUEUE,
                                   TIMEOUT, idempotency_key=key)
    returned("expect() twice with one idempotency_key: the same id", str(again), str(first))
    emit("fires", id=str(first), kind="timeout", what="idempotent expectation",
         not_before=begun + TIMEOUT.total_seconds())

    # Another role's expectation answers as one that never existed; naming its owner is
    # refused. It fires as if untouched (above).
    owner = one(app, "SELECT 'sql:' || session_user")
    returned("cancel_expectation of another role's expectation",
             one(other, "SELECT cancel_expectation(%s)", (first,)), False)
    returned("reschedule_expectation of another role's expectation",
             one(other, "SELECT reschedule_expectation(%s, now())", (first,)), False)
    returned("cancel_expectations of another role's process",
             one(other, "SELECT cancel_expectations(%s)", (f"idem-{tag}",)), 0)
    returned("cancel_expectation naming another owner", sqlstate(
        other, "SELECT cancel_expectation(%s, %s)", (first, owner)), "42501")

    # Where a TimeOut may never go: refused by expect() (42501), nothing stored.
    for what, exchange in (("the default exchange", ""), ("an amq.* exchange", "amq.topic"),
                           ("the ingress exchange", INGRESS),
                           ("the announcement exchange", "timeoutd.announcements")):
        returned(f"expect() to {what}", sqlstate(
            app, "SELECT expect('refused', 'PaymentReceived', %s, now(), exchange => %s)",
            (QUEUE, exchange)), "42501")

    # A row written to the table directly (here by the schema's owner, for the API role)
    # with a TimeOut to the default exchange is held when due, never published; released,
    # it is judged again and held again; cancelled.
    held = uuid.uuid4()
    admin.execute(f"INSERT INTO {SCHEMA}.expected_messages (id, owner, process_id, "
                  "message_type, timeout_at, exchange, routing_key) VALUES (%s, %s, %s, "
                  "'PaymentReceived', now(), '', %s)", (held, owner, f"held-{tag}", QUEUE))
    if wait_row(admin, "expected_messages", "id = %s AND retry_at = 'infinity' "
                "AND last_error IS NOT NULL", (held,), "the TimeOut to the default exchange held"):
        returned("release_expectation of a held row",
                 one(app, "SELECT release_expectation(%s)", (held,)), True)
        wait_row(admin, "expected_messages", "id = %s AND retry_at = 'infinity'", (held,),
                 "the released row held again")
        returned("cancel_expectation of a held row",
                 one(app, "SELECT cancel_expectation(%s)", (held,)), True)
    emit("never", id=str(held), what="TimeOut to the default exchange (held)")

    # cancel_expectation before the deadline: true, then false; no TimeOut.
    with app.transaction():
        eid = api.expect_timeout(app, f"cancel-{tag}", "PaymentReceived", TIMEOUTS, QUEUE,
                                 timedelta(seconds=3))
    returned("cancel_expectation in time", api.cancel_timeout(app, eid), True)
    returned("cancel_expectation again", api.cancel_timeout(app, eid), False)
    emit("never", id=str(eid), what="cancelled expectation")

    # cancel_expectations: by process and message type, then the rest of the process.
    ids = []
    with app.transaction():
        for kind in ("PaymentReceived", "Shipped", "Delivered"):
            ids.append(api.expect_timeout(app, f"proc-{tag}", kind, TIMEOUTS, QUEUE,
                                          timedelta(seconds=3)))
    returned("cancel_expectations(process, type)",
             one(app, "SELECT cancel_expectations(%s, %s)", (f"proc-{tag}", "Shipped")), 1)
    returned("cancel_expectations(process)",
             one(app, "SELECT cancel_expectations(%s)", (f"proc-{tag}",)), 2)
    for i in ids:
        emit("never", id=str(i), what="expectation cancelled by process")

    # reschedule_expectation: from a minute to 1.5 s; unknown id: false. retry and
    # release on a row that is neither failing nor parked: false.
    with app.transaction():
        eid = api.expect_timeout(app, f"move-{tag}", "PaymentReceived", TIMEOUTS, QUEUE,
                                 timedelta(minutes=1))
    moved = time.time()
    returned("reschedule_expectation",
             one(app, "SELECT reschedule_expectation(%s, now() + %s)", (eid, TIMEOUT)), True)
    returned("reschedule_expectation of an unknown id",
             one(app, "SELECT reschedule_expectation(%s, now())", (uuid.uuid4(),)), False)
    returned("retry_expectation of a pending row",
             one(app, "SELECT retry_expectation(%s)", (eid,)), False)
    returned("release_expectation of a pending row",
             one(app, "SELECT release_expectation(%s)", (eid,)), False)
    emit("fires", id=str(eid), kind="timeout", what="rescheduled expectation",
         not_before=moved + TIMEOUT.total_seconds(), not_after=moved + 30)

    # release_expectation: a parked row (its TimeOut confirmed, the row not deletable)
    # is what the daemon leaves with retry_at = 'infinity'; the owner sets that state
    # here, the API releases it and the TimeOut goes.
    with app.transaction():
        eid = api.expect_timeout(app, f"parked-{tag}", "PaymentReceived", TIMEOUTS, QUEUE,
                                 timedelta(minutes=1))
    admin.execute(f"UPDATE {SCHEMA}.expected_messages SET retry_at = 'infinity', "
                  "timeout_at = now() WHERE id = %s", (eid,))
    time.sleep(0.3)  # a parked row is not fired: nothing may arrive before the release
    released = time.time()
    returned("release_expectation of a parked row",
             one(app, "SELECT release_expectation(%s)", (eid,)), True)
    emit("fires", id=str(eid), kind="timeout", what="released expectation",
         not_before=released, not_after=released + 10)

    # retry_expectation: a TimeOut to an exchange that is not there yet fails and waits
    # scan.retry_min (30 s here); once it exists, retry_expectation sends it now.
    with app.transaction():
        eid = api.expect_timeout(app, f"late-{tag}", "PaymentReceived", f"{LATE}.timeouts",
                                 "late", timedelta(0))
    if wait_row(admin, "expected_messages", "id = %s AND attempts >= 1 AND retry_at > now()",
                (eid,), "the TimeOut to a missing exchange failing"):
        declare(f"{LATE}.timeouts")
        retried = time.time()
        returned("retry_expectation of a failing row",
                 one(app, "SELECT retry_expectation(%s)", (eid,)), True)
        emit("fires", id=str(eid), kind="timeout", what="retried expectation",
             not_before=retried, not_after=retried + 10)


def delayed(app, other, admin):
    tag = uuid.uuid4().hex[:8]
    body = json.dumps({"tag": tag}).encode()
    props = {"content_type": "application/json",
             "headers": {"traceparent": traceparent(), "x-n": 7}}
    mid = f"delayed-{tag}"
    begun = time.time()
    returned("schedule_delayed", one(
        app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + %s, %s, %s)",
        (OUT, body, TIMEOUT, psycopg.types.json.Jsonb(props), mid)), mid)
    returned("schedule_delayed again with its message_id", one(
        app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + %s, %s, %s)",
        (OUT, body, TIMEOUT, psycopg.types.json.Jsonb(props), mid)), mid)
    emit("fires", id=mid, kind="delayed", what="scheduled delayed message",
         not_before=begun + TIMEOUT.total_seconds(), body=body.decode(),
         traceparent=props["headers"]["traceparent"], headers={"x-n": 7})

    # Another role's message: its owner is not ours; acting for it is refused.
    owner = one(app, "SELECT 'sql:' || session_user")
    returned("cancel_delayed of another owner's message", sqlstate(
        other, "SELECT cancel_delayed(%s, %s)", (mid, owner)), "42501")
    returned("reschedule_delayed of another owner's message", sqlstate(
        other, "SELECT reschedule_delayed(%s, now(), %s)", (mid, owner)), "42501")
    returned("release_delayed of another owner's message", sqlstate(
        other, "SELECT release_delayed(%s, %s)", (mid, owner)), "42501")
    returned("cancel_delayed of an id the other role does not own", one(
        other, "SELECT cancel_delayed(%s)", (mid,)), False)

    # reschedule_delayed: from a minute to 1.5 s. retry/release of a pending one: false.
    moved_id = f"moved-{tag}"
    one(app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + interval '1 minute',"
        " %s, %s)", (OUT, body, psycopg.types.json.Jsonb(props), moved_id))
    moved = time.time()
    returned("reschedule_delayed", one(
        app, "SELECT reschedule_delayed(%s, now() + %s)", (moved_id, TIMEOUT)), True)
    returned("retry_delayed of a pending message",
             one(app, "SELECT retry_delayed(%s)", (moved_id,)), False)
    returned("release_delayed of a pending message",
             one(app, "SELECT release_delayed(%s)", (moved_id,)), False)
    emit("fires", id=moved_id, kind="delayed", what="rescheduled delayed message",
         not_before=moved + TIMEOUT.total_seconds(), not_after=moved + 30, body=body.decode())

    # cancel_delayed: true, then false; never delivered.
    gone = f"cancelled-{tag}"
    # One without a message_id: a new uuid, delivered in 3 s.
    begun = time.time()
    fresh = one(app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + interval "
                "'3 s')", (OUT, body))
    returned("schedule_delayed without a message_id: a uuid", str(uuid.UUID(fresh)), fresh)
    emit("fires", id=fresh, kind="delayed", what="delayed message with a new id",
         not_before=begun + 3, body=body.decode())
    one(app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + interval '3 s', "
        "message_id => %s)", (OUT, body, gone))
    returned("cancel_delayed in time", one(app, "SELECT cancel_delayed(%s)", (gone,)), True)
    returned("cancel_delayed again", one(app, "SELECT cancel_delayed(%s)", (gone,)), False)
    emit("never", id=gone, what="cancelled delayed message")

    # retry_delayed: to an allowed exchange that is not there yet: fails, waits 30 s;
    # declared, retry_delayed delivers it now.
    with app.transaction():
        late = api.publish_at_commit(app, f"{LATE}.delayed", "late", body)
    if wait_row(admin, "delayed_messages", "message_id = %s AND attempts >= 1 "
                "AND retry_at > now() AND retry_at < 'infinity'", (late,),
                "the delayed message to a missing exchange failing"):
        declare(f"{LATE}.delayed")
        retried = time.time()
        returned("retry_delayed of a failing message",
                 one(app, "SELECT retry_delayed(%s)", (late,)), True)
        emit("fires", id=late, kind="delayed", what="retried delayed message",
             not_before=retried, not_after=retried + 10, body=body.decode())

    # To an exchange the daemons do not allow, or beyond their bounds: refused by the call.
    returned("publish_at_commit to an exchange not allowed", sqlstate(
        app, "SELECT publish_at_commit(%s, 'denied', %s)", (DENIED, body)), "42501")
    returned("schedule_delayed to an exchange not allowed", sqlstate(
        app, "SELECT schedule_delayed(%s, 'denied', %s, now() + %s)", (DENIED, body, TIMEOUT)),
        "42501")
    returned("schedule_delayed to the default exchange", sqlstate(
        app, "SELECT schedule_delayed('', %s, %s, now())", (QUEUE, body)), "42501")
    returned("schedule_delayed beyond delay.max_delay", sqlstate(
        app, "SELECT schedule_delayed(%s, 'orders.delayed', %s, now() + interval '1000 days')",
        (OUT, body)), "54000")
    returned("publish_at_commit with properties over 64 KiB", sqlstate(
        app, "SELECT publish_at_commit(%s, 'orders.placed', %s, %s)",
        (OUT, body, psycopg.types.json.Jsonb({"headers": {"x-big": "x" * 70000}}))), "54000")

    # release_delayed: a message written to the table directly (here by the schema's
    # owner, for the API role) to an exchange not allowed is held when due; released,
    # judged again and held again; cancelled.
    held = f"held-{tag}"
    admin.execute(f"INSERT INTO {SCHEMA}.delayed_messages (owner, message_id, deliver_at, "
                  "exchange, routing_key, body) VALUES (%s, %s, now(), %s, 'denied', %s)",
                  (owner, held, DENIED, body))
    if wait_row(admin, "delayed_messages", "message_id = %s AND retry_at = 'infinity'",
                (held,), "the message to an exchange not allowed held"):
        returned("release_delayed of a held message",
                 one(app, "SELECT release_delayed(%s)", (held,)), True)
        wait_row(admin, "delayed_messages", "message_id = %s AND retry_at = 'infinity' "
                 "AND attempts >= 2", (held,), "the released message held again")
        returned("cancel_delayed of a held message",
                 one(app, "SELECT cancel_delayed(%s)", (held,)), True)
    emit("never", id=held, what="message to an exchange not allowed")


def declare(exchange):
    """The missing exchange appears, routing to the queue."""
    with pika.BlockingConnection(pika.URLParameters(E["AMQP_URL"])) as c:
        ch = c.channel()
        ch.exchange_declare(exchange, "direct", durable=False, auto_delete=False)
        ch.queue_bind(QUEUE, exchange, "late")


def main():
    api.ORDERS_EXCHANGE = OUT
    api.TIMEOUTS_EXCHANGE = TIMEOUTS
    api.PAYMENT_TIMEOUT = TIMEOUT
    with connect(E["APP_PG_URL"]) as app, connect(E["OTHER_PG_URL"]) as other, \
            connect(E["ADMIN_PG_URL"]) as admin:
        returned("api_version()", one(app, "SELECT api_version()"), 1)
        returned("the role's search_path", one(app, "SHOW search_path"), f"public, {SCHEMA}")
        returned("SELECT on expected_messages", sqlstate(
            app, f"SELECT * FROM {SCHEMA}.expected_messages"), "42501")
        returned("INSERT into delayed_messages", sqlstate(
            app, f"INSERT INTO {SCHEMA}.delayed_messages (owner, message_id, deliver_at, "
            "exchange, routing_key, properties, body) VALUES ('', 'x', now(), '', '', "
            "'{}', '')"), "42501")
        threads = [threading.Thread(target=worker, args=(n, int(E["TXNS"])))
                   for n in range(int(E["WORKERS"]))]
        for t in threads:
            t.start()
        expectations(app, other, admin)
        delayed(app, other, admin)
        for t in threads:
            t.join()
    emit("done")


if __name__ == "__main__":
    sys.exit(main())
