"""Verify the signatures of what timeoutd publishes (docs/integrating/timeouts.md,
Signatures), as a pika consumer: reads every message of QUEUE until it has COUNT, and
prints one JSON line per message with the verdict, and the verdicts of the same message
with another routing key and another body. Run by tests/recipes/run.py."""

import json
import os

import pika

# docs: begin python
import hashlib
import hmac
import struct


def timeoutd_canonical(key_id, m):
    """The bytes timeoutd signs: each field as a 4-byte big-endian length and its bytes."""
    fields = [b"timeoutd-signature-v1", key_id] + [m.get(k) for k in (
        "exchange", "routing_key", "message_id", "correlation_id", "type", "timestamp",
        "node", "user_id", "delayed_ms", "body")]
    out = b""
    for v in fields:
        v = b"" if v is None else v if isinstance(v, bytes) else str(v).encode()
        out += struct.pack(">I", len(v)) + v
    return out


def timeoutd_verify(header, m, keys):
    """Whether `header` (x-timeoutd-signature) signs `m` under one of `keys` ({id: key})."""
    if isinstance(header, bytes):
        header = header.decode()
    version, _, rest = (header or "").partition(":")
    key_id, _, tag = rest.partition(":")
    if version != "v1" or key_id not in keys:
        return False
    mac = hmac.new(keys[key_id], timeoutd_canonical(key_id, m), hashlib.sha256).hexdigest()
    return hmac.compare_digest(mac, tag)


def timeoutd_fields(method, props, body):
    """What the signature covers, from a pika delivery."""
    h = props.headers or {}
    return {"exchange": method.exchange, "routing_key": method.routing_key,
            "message_id": props.message_id, "correlation_id": props.correlation_id,
            "type": props.type, "timestamp": props.timestamp,
            "node": h.get("x-timeoutd-node"), "user_id": h.get("x-timeoutd-user-id"),
            "delayed_ms": h.get("x-timeoutd-delayed-ms"), "body": body}


# On each delivery: refuse what does not verify.
# keys = {"k1": os.environb[b"TIMEOUTD_SIGNING_KEY"]}
# if not timeoutd_verify((props.headers or {}).get("x-timeoutd-signature"),
#                        timeoutd_fields(method, props, body), keys):
#     channel.basic_reject(method.delivery_tag, requeue=False)
# docs: end


def main():
    keys = {os.environ["KEY_ID"]: os.environ["KEY"].encode()}
    count = int(os.environ.get("COUNT", "1"))
    conn = pika.BlockingConnection(pika.URLParameters(os.environ["AMQP_URL"]))
    ch = conn.channel()
    seen = 0
    for method, props, body in ch.consume(os.environ["QUEUE"], auto_ack=True,
                                          inactivity_timeout=60):
        if method is None:
            break
        m = timeoutd_fields(method, props, body)
        header = (props.headers or {}).get("x-timeoutd-signature")
        print(json.dumps({
            "event": "verified", "message_id": props.message_id, "type": props.type,
            "ok": timeoutd_verify(header, m, keys),
            "other_key": timeoutd_verify(header, dict(m, routing_key="elsewhere"), keys),
            "other_body": timeoutd_verify(header, dict(m, body=body + b" "), keys),
        }), flush=True)
        seen += 1
        if seen >= count:
            break
    conn.close()


if __name__ == "__main__":
    main()
