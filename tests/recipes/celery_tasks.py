"""Recipe (docs/recipes.md, Celery): the worker side. Nothing here knows of timeoutd:
the delayed task message arrives on the queue as any other, when it is due."""

import json
import os
import time

from celery import Celery
from kombu import Exchange, Queue

app = Celery("recipes", broker=os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"))
QUEUE = os.environ.get("CELERY_QUEUE", "celery")
# The default layout, named: a direct exchange "celery", the queue bound with its name.
app.conf.task_queues = [Queue(QUEUE, Exchange("celery", type="direct"), routing_key=QUEUE)]
app.conf.task_default_queue = QUEUE
app.conf.worker_redirect_stdouts = False  # the recipe runner reads what `charge` prints


@app.task(name="recipes.charge")
def charge(order_id):
    # What the recipe runner reads: which task ran, and when.
    print(json.dumps({"event": "ran", "id": charge.request.id, "at": time.time()}), flush=True)
