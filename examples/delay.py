#!/usr/bin/env python3
"""Publish a delayed message through timeoutd, cancel one, or watch them arrive.

Publish any AMQP message to the ingress exchange ``timeoutd.delay.<group>`` (a durable
topic exchange the daemon declares) with one of these headers:

  x-delay: <ms>                    hold it this many milliseconds (as with the plugin)
  x-timeoutd-deliver-at: <time>    or deliver it at this RFC 3339 instant (wins)
  x-timeoutd-exchange: <name>      deliver to this exchange, not ``timeoutd.delayed``
                                   (one the daemons allow: delay.allowed_exchanges)
  x-timeoutd-cancel: <message_id>  drop the pending message with this message_id

timeoutd stores it in Postgres and, when due, publishes it with its routing key, body and
properties (message_id included: a cancel names it) to the target exchange, adding
``x-timeoutd-delayed-ms`` (how long it was held) and ``x-timeoutd-node``.

Moving off rabbitmq-delayed-message-exchange: publishers keep their ``x-delay`` header,
only the exchange they publish to changes; consumers bind their queues to the target
exchange with the same keys. Or keep even the exchange name: delete the plugin's
exchange and set ``delay.exchange`` to its name in timeoutd's configuration.

    python delay.py --consume                        # in one terminal
    python delay.py --delay-ms 3000 --routing-key orders.retry --body hello
    python delay.py --cancel 8d0c...                 # message_id printed above

With ``delay.exchange`` set (say, to the plugin exchange's old name) name it with
``--ingress``; with ``delay.target_exchange`` set, consume with ``--exchange``:

    python delay.py --consume --exchange billing.delayed.out
    python delay.py --ingress billing.delayed --delay-ms 3000 --routing-key payment.test

Needs only pika (pip install pika).
"""

import argparse
import sys
import uuid
from datetime import datetime

import pika

TARGET = "timeoutd.delayed"


def publish(channel, args):
    if args.cancel:
        message_id = args.cancel
        headers = {"x-timeoutd-cancel": args.cancel}
    else:
        message_id = args.message_id or str(uuid.uuid4())
        headers = {"x-delay": args.delay_ms}
        if args.deliver_at:
            headers["x-timeoutd-deliver-at"] = args.deliver_at
        if args.exchange:
            headers["x-timeoutd-exchange"] = args.exchange
    properties = pika.BasicProperties(
        message_id=None if args.cancel else message_id,
        delivery_mode=pika.DeliveryMode.Persistent,
        content_type="text/plain",
        headers=headers,
    )
    channel.confirm_delivery()
    # Raises if refused (no ingress exchange: is timeoutd running for this group?).
    channel.basic_publish(
        exchange=args.ingress or f"timeoutd.delay.{args.group}",
        routing_key=args.routing_key,
        body=args.body.encode(),
        properties=properties,
        mandatory=True,
    )
    print(message_id)


def consume(channel, args):
    exchange = args.exchange or TARGET
    # Declared as timeoutd declares its default target; a different type fails here.
    channel.exchange_declare(exchange, exchange_type="topic", durable=True)
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, exchange, routing_key="#")
    print(f"waiting on {exchange} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    def show(ch, method, props, body):
        headers = props.headers or {}
        print(
            datetime.now().strftime("%H:%M:%S.%f")[:-3],
            f"routing_key={method.routing_key}",
            f"message_id={props.message_id}",
            f"delayed_ms={headers.get('x-timeoutd-delayed-ms')}",
            f"node={headers.get('x-timeoutd-node')}",
            f"body={body.decode(errors='replace')!r}",
            flush=True,
        )

    channel.basic_consume(queue, show, auto_ack=True)
    try:
        channel.start_consuming()
    except KeyboardInterrupt:
        channel.stop_consuming()


def rfc3339(s):
    # Rejected here, else timeoutd would hold it as failing. Python < 3.11 reads no "Z".
    at = datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: FURB162
    if at.tzinfo is None:
        raise ValueError("no UTC offset")
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2f")
    p.add_argument("--group", default="default", help="timeoutd's election.group")
    p.add_argument(
        "--ingress",
        metavar="EXCHANGE",
        help="the ingress exchange, timeoutd's delay.exchange "
        "(default timeoutd.delay.<group>)",
    )
    p.add_argument("--delay-ms", type=int, default=5000, help="x-delay (ms)")
    p.add_argument(
        "--deliver-at",
        type=rfc3339,
        help="x-timeoutd-deliver-at (RFC 3339, wins over --delay-ms)",
    )
    p.add_argument("--routing-key", default="demo")
    p.add_argument("--body", default="hello")
    p.add_argument(
        "--exchange",
        help=f"publish: x-timeoutd-exchange; consume: the exchange to watch "
        f"(default {TARGET})",
    )
    p.add_argument("--message-id", help="default: a random UUID")
    p.add_argument("--cancel", metavar="MESSAGE_ID", help="cancel a pending message")
    p.add_argument("--consume", action="store_true", help="print deliveries")
    args = p.parse_args()
    try:
        with pika.BlockingConnection(pika.URLParameters(args.url)) as connection:
            (consume if args.consume else publish)(connection.channel(), args)
    except pika.exceptions.AMQPError as e:  # unreachable, refused, unroutable, nacked
        sys.exit(f"delay.py: {e!r}")


if __name__ == "__main__":
    main()
