"""Recipe (docs/recipes.md, taskiq-aio-pika): kick a task with a delay, as taskiq users
do: the `delay` label in seconds. Usage: python taskiq_send.py DELAY_MS"""

import asyncio
import json
import sys
import time

from taskiq_tasks import broker, charge


async def main(delay_ms):
    await broker.startup()
    at = time.time()
    task = await charge.kicker().with_labels(delay=delay_ms / 1000).kiq("order-42")
    print(json.dumps({"event": "sent", "id": task.task_id, "at": at, "delay_ms": delay_ms}))
    await broker.shutdown()


asyncio.run(main(int(sys.argv[1])))
