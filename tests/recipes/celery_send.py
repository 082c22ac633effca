"""Recipe (docs/recipes.md, Celery): send a task through timeoutd with a delay, and
cancel one. Usage: python celery_send.py DELAY_MS"""

import json
import os
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

from celery_tasks import QUEUE, app, charge

INGRESS = os.environ.get("TIMEOUTD_INGRESS", "timeoutd.delay.default")


def send_later(task, args, countdown_ms, task_id=None):
    """`task.apply_async(args, countdown=...)`, held by timeoutd instead of the worker."""
    task_id = task_id or str(uuid.uuid4())
    task.apply_async(
        args,
        task_id=task_id,
        message_id=task_id,  # the AMQP message_id: what a cancel names
        exchange=INGRESS,  # publish to timeoutd's ingress exchange...
        routing_key=QUEUE,  # ...with the queue's routing key (required, see below)
        headers={
            "x-delay": countdown_ms,  # int or float: kombu sends 2500.0 as a double
            "x-timeoutd-exchange": "celery",  # where the task message would have gone
        },
    )
    return task_id


def send_at(task, args, eta, task_id=None):
    """`task.apply_async(args, eta=...)` (an aware datetime), held by timeoutd."""
    task_id = task_id or str(uuid.uuid4())
    task.apply_async(
        args,
        task_id=task_id,
        message_id=task_id,
        exchange=INGRESS,
        routing_key=QUEUE,
        headers={
            "x-timeoutd-deliver-at": eta.isoformat(),  # RFC 3339, with its offset
            "x-timeoutd-exchange": "celery",
        },
    )
    return task_id


def cancel(task_id):
    """Drop a pending task: a message with header x-timeoutd-cancel to the ingress."""
    with app.producer_or_acquire() as producer:
        producer.publish(
            b"", exchange=INGRESS, routing_key=QUEUE, headers={"x-timeoutd-cancel": task_id}
        )


if __name__ == "__main__":
    delay_ms = int(sys.argv[1])
    if sys.argv[2:] == ["--no-routing-key"]:
        # The mistake the recipe warns of: Celery then publishes to the default
        # exchange, straight to the queue, and the task runs at once.
        at = time.time()
        tid = str(uuid.uuid4())
        charge.apply_async(("order-45",), task_id=tid, message_id=tid, exchange=INGRESS,
                           headers={"x-delay": delay_ms, "x-timeoutd-exchange": "celery"})
        print(json.dumps({"event": "sent", "id": tid, "at": at, "delay_ms": delay_ms}))
        sys.exit(0)
    for delay in (delay_ms, float(delay_ms), delay_ms + 0.75):  # int, kombu's double, a fraction
        at = time.time()
        tid = send_later(charge, ("order-42",), delay)
        print(json.dumps({"event": "sent", "id": tid, "at": at, "delay_ms": int(delay)}))
    at = time.time()
    tid = send_at(charge, ("order-44",), datetime.now(timezone.utc) + timedelta(milliseconds=delay_ms))
    print(json.dumps({"event": "sent", "id": tid, "at": at, "delay_ms": delay_ms}))
    at = time.time()
    doomed = send_later(charge, ("order-43",), delay_ms)
    print(json.dumps({"event": "sent", "id": doomed, "at": at, "delay_ms": delay_ms}))
    cancel(doomed)
    print(json.dumps({"event": "cancelled", "id": doomed}))
