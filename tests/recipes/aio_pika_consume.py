"""Recipe (docs/recipes.md, Python asyncio with aio-pika): consume delayed messages where
timeoutd delivers them, the target exchange timeoutd.delayed (delay.target_exchange)."""

import asyncio
import json
import os
import time

import aio_pika

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
QUEUE = f"recipes.aio-pika.{os.environ.get('RECIPE_TAG', 'demo')}"


async def main():
    connection = await aio_pika.connect_robust(URL)
    channel = await connection.channel()
    # Declared as timeoutd declares its target: a durable topic exchange.
    target = await channel.declare_exchange(
        "timeoutd.delayed", aio_pika.ExchangeType.TOPIC, durable=True
    )
    queue = await channel.declare_queue(QUEUE, durable=True)
    await queue.bind(target, routing_key="orders.#")

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage):
        async with message.process():
            held = message.headers.get("x-timeoutd-delayed-ms")
            print(json.dumps({"event": "ran", "id": message.message_id, "at": time.time(),
                              "held_ms": held}), flush=True)

    await queue.consume(on_message)
    print(json.dumps({"event": "listening"}), flush=True)
    await asyncio.Future()


asyncio.run(main())
