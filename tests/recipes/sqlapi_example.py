"""The Python (psycopg 3) example of docs/integrating/languages.md: the code between the
`docs:` markers is the doc's, character for character (tests/recipes/run.py checks it),
and tests/recipes/sqlapi_drive.py runs it against a real timeoutd."""

# docs: begin python
import json
from datetime import timedelta

import psycopg
from psycopg.types.json import Jsonb

# The role's search_path holds timeoutd's schema (see "The role" above): the functions
# are called by name. Each takes the caller's connection and runs in its transaction.

ORDERS_EXCHANGE = "orders"                # delay.target_exchange or delay.allowed_exchanges
TIMEOUTS_EXCHANGE = "orders.timeouts"     # TimeOuts: an exchange timeouts.allowed_exchanges allows
TIMEOUTS_ROUTING_KEY = "payment.timeout"  # bound there to the process manager's queue
PAYMENT_TIMEOUT = timedelta(minutes=30)


def expect_timeout(conn, process_id, message_type, exchange, routing_key, timeout: timedelta,
                   payload=None, idempotency_key=None, traceparent=None):
    """Start waiting: the TimeOut (message_id = the returned id) goes to
    exchange/routing_key after `timeout` from now (the database's clock), unless
    cancelled first. Nothing happens if the transaction rolls back."""
    return conn.execute(
        """SELECT expect(process_id => %s, message_type => %s, routing_key => %s,
                         timeout_at => now() + %s, exchange => %s, payload => %s,
                         idempotency_key => %s, traceparent => %s)""",
        (process_id, message_type, routing_key, timeout, exchange,
         Jsonb(payload) if payload is not None else None, idempotency_key, traceparent),
    ).fetchone()[0]


def cancel_timeout(conn, expectation_id) -> bool:
    """Stop waiting. True: cancelled in time, no TimeOut comes. False: it fired already
    (a TimeOut with this message_id is on its way or delivered)."""
    return conn.execute("SELECT cancel_expectation(%s)", (expectation_id,)).fetchone()[0]


def publish_at_commit(conn, exchange, routing_key, body: bytes, headers=None,
                      content_type="application/json", message_id=None) -> str:
    """The transactional outbox: the message is published as soon as the transaction
    commits, never if it rolls back. Returns its message_id (a new uuid by default)."""
    properties = {"content_type": content_type, "headers": headers or {}}
    return conn.execute(
        "SELECT publish_at_commit(%s, %s, %s, %s, %s)",
        (exchange, routing_key, body, Jsonb(properties), message_id),
    ).fetchone()[0]


def place_order(conn, order_id, traceparent=None):
    """An application transaction: its own writes, an expectation and an outbox message
    commit together or not at all. Returns (expectation id, outbox message_id)."""
    with conn.transaction():
        # conn.execute("INSERT INTO orders ...")   -- the application's own writes
        expectation_id = expect_timeout(
            conn, f"order-{order_id}", "PaymentReceived", TIMEOUTS_EXCHANGE,
            TIMEOUTS_ROUTING_KEY, PAYMENT_TIMEOUT, payload={"order": order_id},
            traceparent=traceparent)
        message_id = publish_at_commit(
            conn, ORDERS_EXCHANGE, "orders.placed", json.dumps({"order": order_id}).encode(),
            headers={"traceparent": traceparent} if traceparent else None)
    return expectation_id, message_id


# with psycopg.connect("postgresql://orders_pm@db/orders", autocommit=True) as conn:
#     expectation_id, _ = place_order(conn, 42)
#     ...                                    # later, the payment arrived:
#     with conn.transaction():
#         cancel_timeout(conn, expectation_id)
# docs: end
