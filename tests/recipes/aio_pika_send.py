"""Recipe (docs/recipes.md, Python asyncio with aio-pika): publish delayed messages
through timeoutd, and cancel one. Usage: python aio_pika_send.py DELAY_MS"""

import asyncio
import json
import os
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import aio_pika

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
INGRESS = os.environ.get("TIMEOUTD_INGRESS", "timeoutd.delay.default")


async def main(delay_ms):
    connection = await aio_pika.connect_robust(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        # The daemon declares it; ensure=False: no declare (and no passive check) here.
        ingress = await channel.get_exchange(INGRESS, ensure=False)

        async def send(headers, message_id=None, body=b"{}"):
            message = aio_pika.Message(
                body,
                message_id=message_id,
                headers=headers,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await ingress.publish(message, routing_key="orders.retry")

        mid = str(uuid.uuid4())
        at = time.time()
        await send({"x-delay": delay_ms}, mid)
        print(json.dumps({"event": "sent", "id": mid, "at": at, "delay_ms": delay_ms}))
        # Or an instant (RFC 3339): header x-timeoutd-deliver-at.
        mid = str(uuid.uuid4())
        at = time.time()
        when = datetime.now(timezone.utc) + timedelta(milliseconds=delay_ms)
        await send({"x-timeoutd-deliver-at": when.isoformat()}, mid)
        print(json.dumps({"event": "sent", "id": mid, "at": at, "delay_ms": delay_ms}))
        doomed = str(uuid.uuid4())
        at = time.time()
        await send({"x-delay": delay_ms}, doomed)
        print(json.dumps({"event": "sent", "id": doomed, "at": at, "delay_ms": delay_ms}))
        await send({"x-timeoutd-cancel": doomed}, body=b"")
        print(json.dumps({"event": "cancelled", "id": doomed}))


asyncio.run(main(int(sys.argv[1])))
