"""Recipe (docs/recipes.md, taskiq-aio-pika in plugin mode): the broker, a task, and the
one change that keeps every delayed task from running twice.

In plugin mode taskiq-aio-pika declares its delay exchange as `x-delayed-message` (which
a broker without the plugin refuses: COMMAND_INVALID) and binds every task queue to it.
With timeoutd the delay exchange is timeoutd's ingress, a topic exchange: a queue bound
to it gets each delayed message at once, and again from timeoutd when it is due. So:
name the ingress as the delay exchange with declare=False, let timeoutd deliver to the
task exchange (delay.target_exchange), and declare the task queue yourself (declare=False
in taskiq, which then binds it nowhere)."""

import json
import os
import time

import aio_pika
from taskiq import Context, TaskiqDepends, TaskiqEvents
from taskiq_aio_pika import AioPikaBroker, Exchange, Queue

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
INGRESS = os.environ.get("TIMEOUTD_INGRESS", "timeoutd.delay.default")
EXCHANGE = "recipes.taskiq"  # taskiq's exchange, and timeoutd's delay.target_exchange
QUEUE = f"recipes.taskiq.{os.environ.get('RECIPE_TAG', 'demo')}"
# What the recipe runner tries besides the recipe: taskiq's defaults, and the queue left
# to taskiq (bound to the ingress too).
VARIANT = os.environ.get("RECIPE_VARIANT", "recipe")

if VARIANT == "plugin-defaults":
    broker = AioPikaBroker(URL, delayed_message_exchange_plugin=True)
else:
    broker = AioPikaBroker(
        URL,
        exchange=Exchange(name=EXCHANGE),  # a durable topic exchange, as timeoutd's target
        task_queues=[Queue(name=QUEUE, declare=VARIANT == "bound-twice")],
        delayed_message_exchange_plugin=True,
        # timeoutd's ingress, declared by timeoutd: never declared here.
        delayed_message_exchange=Exchange(name=INGRESS, declare=False),
    )


@broker.on_event(TaskiqEvents.WORKER_STARTUP, TaskiqEvents.CLIENT_STARTUP)
async def declare_the_queue(state):
    """The task queue, bound to the task exchange only (runs before taskiq's own
    declarations, which then find the queue there)."""
    if VARIANT == "recipe":
        await declare(QUEUE)
    if broker.is_worker_process:
        print(json.dumps({"event": "listening"}), flush=True)


async def declare(name):
    connection = await aio_pika.connect_robust(URL)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(
            name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await queue.bind(exchange, routing_key=name)


@broker.task(task_name="recipes.charge")
async def charge(order_id: str, context: Context = TaskiqDepends()) -> None:
    print(json.dumps({"event": "ran", "id": context.message.task_id, "at": time.time()}),
          flush=True)
