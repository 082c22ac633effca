#!/usr/bin/env python3
"""Run every recipe of docs/recipes.md against the real client library and a timeoutd of
its own, and judge it from the outside: each delayed message arrives once, never before
its delay, and a cancelled one never. Started by .ci/recipes (which prepares the venv and
node_modules); runnable alone as `target/recipes/venv/bin/python tests/recipes/run.py
[NAME...]` once those exist.

Each recipe runs in a world of its own: a Postgres schema, an election group (so its own
ingress exchange and queue), its own queues and exchanges, all removed afterwards. The
recipe scripts print one JSON line per event ({"event": "sent"|"ran"|..., ...}); only
this file asserts.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pika

# The recipe scripts import each other from tests/recipes: no __pycache__ left there.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = ROOT / "target" / "recipes"
PY = CACHE / "venv" / "bin" / "python"
AMQP_URL = os.environ.get("TIMEOUTD_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:24672/%2f")
PG_URL = os.environ.get("TIMEOUTD_TEST_PG_URL", "postgres://postgres@127.0.0.1:24432/postgres")
DAEMON = ROOT / "target" / "debug" / "timeoutd"
# How long a recipe may take to show its messages (generous: a loaded CI machine).
PATIENCE = 60.0
# Every recipe delays by this much; "early" means before it, counted from the publish.
DELAY_MS = 2500
# Clock slack between the recipe's own stamps (same machine, same clock): none needed,
# but a delivery later than this after its due time is reported as late.
LATE_S = 5.0


class Failed(Exception):
    pass


class Daemon:
    """`timeoutd run` for one recipe, stopped with SIGTERM."""

    def __init__(self, name, overrides):
        tag = uuid.uuid4().hex[:10]
        self.schema = f"r_{tag}"
        self.group = f"recipes-{name}-{tag}"
        self.env = dict(os.environ)
        self.env.update(
            {
                "TIMEOUTD__AMQP__URL": AMQP_URL,
                "TIMEOUTD__POSTGRES__URL": PG_URL,
                "TIMEOUTD__POSTGRES__SCHEMA": self.schema,
                "TIMEOUTD__ELECTION__GROUP": self.group,
                "TIMEOUTD__HTTP__LISTEN": "127.0.0.1:0",
                "TIMEOUTD__LOG__FORMAT": "json",
                "RUST_LOG": "info",
            }
        )
        self.env.update(overrides)
        self.ingress = self.env.get("TIMEOUTD__DELAY__EXCHANGE", f"timeoutd.delay.{self.group}")
        self.log = CACHE / f"{name}.daemon.log"
        self.proc = None

    def start(self):
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [DAEMON, "run"], env=self.env, stdout=subprocess.PIPE, stderr=log
            )
        line = self.proc.stdout.readline()
        if not line:
            raise Failed(f"timeoutd exited at start; see {self.log}")
        self.http = json.loads(line)["http_addr"]
        wait(lambda: self.ready(), "timeoutd ready (its ingress consuming)")

    def ready(self):
        try:
            with urllib.request.urlopen(f"http://{self.http}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        subprocess.run(
            ["psql", PG_URL, "-qc", f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"],
            check=False,
            capture_output=True,
        )
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as c:
            ch = c.channel()
            ch.queue_delete(self.ingress)
            ch.exchange_delete(self.ingress)


def wait(cond, what, limit=PATIENCE):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise Failed(f"timed out waiting for {what}")


def broker_cleanup(queues=(), exchanges=()):
    with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as c:
        ch = c.channel()
        for q in queues:
            ch.queue_delete(q)
        for x in exchanges:
            ch.exchange_delete(x)


class Events:
    """The JSON lines a recipe process prints, read as they come."""

    def __init__(self, proc, name):
        self.proc, self.name, self.seen = proc, name, []
        os.set_blocking(proc.stdout.fileno(), False)
        self.buf = b""

    def poll(self):
        try:
            chunk = self.proc.stdout.read()
        except (BlockingIOError, ValueError):
            chunk = None
        if chunk:
            self.buf += chunk
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                if line.strip().startswith(b"{"):
                    self.seen.append(json.loads(line))
        return self.seen

    def of(self, event):
        return [e for e in self.poll() if e["event"] == event]


def spawn(name, argv, env, log):
    out = open(log, "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        argv, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=out, start_new_session=True
    )
    return proc, Events(proc, name)


def end(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def judge(name, sent, ran, cancelled=()):
    """Each sent id ran once, not before its delay; each cancelled id never."""
    by_id = {}
    for r in ran:
        by_id.setdefault(r["id"], []).append(r)
    lines = []
    for s in sent:
        got = by_id.get(s["id"], [])
        if s["id"] in cancelled:
            if got:
                raise Failed(f"{name}: cancelled {s['id']} ran anyway")
            lines.append(f"{s['id']}: cancelled, never ran")
            continue
        if len(got) != 1:
            raise Failed(f"{name}: {s['id']} ran {len(got)} times: {got}")
        waited = got[0]["at"] - s["at"]
        if waited < s["delay_ms"] / 1000:
            raise Failed(f"{name}: {s['id']} ran {waited:.3f}s after sending, before its delay")
        if waited > s["delay_ms"] / 1000 + LATE_S:
            raise Failed(f"{name}: {s['id']} ran {waited:.3f}s after sending: late")
        lines.append(f"{s['id']}: delay {s['delay_ms']} ms, ran once after {waited:.3f}s")
    return lines


def judge_at_once(name, sent, ran, cancelled=()):
    """What the docs say of a Celery send without routing_key: it runs at once."""
    lines = []
    for s in sent:
        waited = [r["at"] - s["at"] for r in ran if r["id"] == s["id"]]
        if len(waited) != 1 or waited[0] >= s["delay_ms"] / 1000:
            raise Failed(f"{name}: {s['id']} expected once, at once: {waited}")
        lines.append(f"{s['id']}: delay {s['delay_ms']} ms asked, ran after {waited[0]:.3f}s "
                     "(at once, as the docs say)")
    return lines


def run_celery(name, extra=(), judged=judge):
    d = Daemon(name, {"TIMEOUTD__DELAY__ALLOWED_EXCHANGES": "celery"})
    queue = f"recipes.celery.{d.group}"
    env = dict(os.environ, AMQP_URL=AMQP_URL, TIMEOUTD_INGRESS=d.ingress, CELERY_QUEUE=queue)
    d.start()
    worker = None
    try:
        worker, wev = spawn(
            "celery-worker",
            [PY, "-m", "celery", "-A", "celery_tasks", "worker", "--pool", "solo",
             "--concurrency", "1", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-Q", queue, "--loglevel", "INFO"],
            env,
            CACHE / "celery-worker.log",
        )
        # The worker says it is ready in its log.
        wait(lambda: b"ready." in (CACHE / "celery-worker.log").read_bytes(), "celery worker")
        pub = subprocess.run(
            [PY, "celery_send.py", str(DELAY_MS), *extra], cwd=HERE, env=env,
            capture_output=True,
            timeout=PATIENCE,
        )
        if pub.returncode:
            raise Failed(f"celery_send.py failed: {pub.stderr.decode()}")
        ev = [json.loads(line) for line in pub.stdout.splitlines() if line.startswith(b"{")]
        sent = [e for e in ev if e["event"] == "sent"]
        cancelled = {e["id"] for e in ev if e["event"] == "cancelled"}
        expect = len(sent) - len(cancelled)
        wait(lambda: len(wev.of("ran")) >= expect, "the celery tasks")
        time.sleep(DELAY_MS / 1000 + 2)  # a cancelled one, or a second copy, would come
        return judged(name, sent, wev.of("ran"), cancelled)
    finally:
        if worker:
            end(worker)
        d.stop()
        broker_cleanup(queues=[queue])


def judge_twice(name, sent, ran, cancelled=()):
    """What the docs say of a queue bound to the ingress: each message twice, once at
    once and once on time."""
    lines = []
    for s in sent:
        waited = sorted(r["at"] - s["at"] for r in ran if r["id"] == s["id"])
        delay = s["delay_ms"] / 1000
        if len(waited) != 2 or waited[0] >= delay or waited[1] < delay:
            raise Failed(f"{name}: {s['id']} not twice (at once, then on time): {waited}")
        lines.append(
            f"{s['id']}: delay {s['delay_ms']} ms, ran twice, after {waited[0]:.3f}s "
            f"and {waited[1]:.3f}s (as the docs say)"
        )
    return lines


def run_plugin_defaults(name):
    """taskiq-aio-pika's plugin mode as it comes: the broker refuses the exchange type."""
    d = Daemon(name, {})
    env = dict(os.environ, AMQP_URL=AMQP_URL, TIMEOUTD_INGRESS=d.ingress,
               RECIPE_VARIANT="plugin-defaults")
    d.start()
    try:
        pub = subprocess.run(
            [PY, "taskiq_send.py", str(DELAY_MS)], cwd=HERE, env=env, capture_output=True,
            timeout=PATIENCE,
        )
        err = pub.stderr.decode()
        if pub.returncode == 0 or "COMMAND_INVALID" not in err:
            raise Failed(f"expected COMMAND_INVALID at startup: {pub.returncode} {err[-500:]}")
        return [err.strip().splitlines()[-1] + " (as the docs say)"]
    finally:
        d.stop()


def run_pair(name, consumer, publisher, overrides=None, queues=(), exchanges=(),
             variant="recipe", judged=judge):
    """A consumer process that prints what arrives, and a publisher run once."""
    d = Daemon(name, overrides or {})
    tag = uuid.uuid4().hex[:8]
    env = dict(
        os.environ,
        RECIPE_VARIANT=variant,
        AMQP_URL=AMQP_URL,
        TIMEOUTD_INGRESS=d.ingress,
        RECIPE_TAG=tag,
        NODE_PATH=str(CACHE / "node" / "node_modules"),
    )
    d.start()
    cons = None
    try:
        cons, cev = spawn(f"{name}-consumer", consumer, env, CACHE / f"{name}-consumer.log")
        wait(lambda: cev.of("listening"), f"{name} consumer listening")
        pub = subprocess.run(
            publisher + [str(DELAY_MS)], cwd=HERE, env=env, capture_output=True,
            timeout=PATIENCE,
        )
        if pub.returncode:
            raise Failed(f"{name} publisher failed: {pub.stderr.decode()}")
        ev = [json.loads(line) for line in pub.stdout.splitlines() if line.startswith(b"{")]
        sent = [e for e in ev if e["event"] == "sent"]
        cancelled = {e["id"] for e in ev if e["event"] == "cancelled"}
        expect = len(sent) - len(cancelled)
        wait(lambda: len(cev.of("ran")) >= expect, f"the {name} messages")
        time.sleep(DELAY_MS / 1000 + 2)
        return judged(name, sent, cev.of("ran"), cancelled)
    finally:
        if cons:
            end(cons)
        d.stop()
        broker_cleanup(
            queues=[q.format(tag=tag) for q in queues],
            exchanges=[x.format(tag=tag) for x in exchanges],
        )


def run_migration(name):
    """docs/migrating.md, step by step, on a broker without the plugin: its exchange is
    played by one of another type (what timeoutd meets while the plugin's still exists),
    the examples/delay.py test command as written there, and clients that re-declare."""
    tag = uuid.uuid4().hex[:8]
    old, out, queue = f"billing-{tag}.delayed", f"billing-{tag}.delayed.out", f"billing-{tag}.retries"
    params = pika.URLParameters(AMQP_URL)
    lines = []

    def channel():
        return pika.BlockingConnection(params).channel()

    def received(limit):
        """What reaches the consumers' queue within `limit` seconds: (seconds, message)."""
        got, start = [], time.monotonic()
        ch = channel()
        while time.monotonic() - start < limit:
            method, props, _ = ch.basic_get(queue, auto_ack=True)
            if method:
                got.append((time.monotonic() - start, props))
            else:
                time.sleep(0.05)
        ch.connection.close()
        return got

    def test_message(delay_ms=3000):
        """The test command of docs/migrating.md, in the background; what arrived."""
        cmd = [PY, ROOT / "examples" / "delay.py", "--url", AMQP_URL, "--ingress", old,
               "--delay-ms", str(delay_ms), "--routing-key", "payment.test"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        got = received(delay_ms / 1000 + 3)
        out_, err = proc.communicate(timeout=PATIENCE)
        if proc.returncode:
            raise Failed(f"delay.py failed: {err.decode()}")
        return got

    # Before: the plugin's exchange (stand-in: a direct exchange with the plugin's argument)
    # and the consumers' queue bound to it.
    ch = channel()
    ch.exchange_declare(old, "direct", durable=True, arguments={"x-delayed-type": "topic"})
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, old, "payment.#")
    # Step 1: the way out, bound alike.
    ch.exchange_declare(out, "topic", durable=True)
    ch.queue_bind(queue, out, "payment.#")
    ch.connection.close()
    d = Daemon(name, {"TIMEOUTD__DELAY__EXCHANGE": old, "TIMEOUTD__DELAY__TARGET_EXCHANGE": out})
    try:
        # Step 2 in the wrong order: timeoutd started while the old exchange is there.
        with open(d.log, "wb") as log:
            d.proc = subprocess.Popen([DAEMON, "run"], env=d.env, stdout=subprocess.PIPE,
                                      stderr=log)
        d.http = json.loads(d.proc.stdout.readline())["http_addr"]

        def readyz():
            try:
                with urllib.request.urlopen(f"http://{d.http}/readyz", timeout=2) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
            except OSError as e:
                return 0, str(e)

        wait(lambda: "exists with another type" in readyz()[1], "/readyz naming the old exchange")
        lines.append(f"old exchange still there: /readyz {readyz()[0]}: {readyz()[1][:160]}...")
        ch = channel()
        ch.exchange_delete(old)
        ch.connection.close()
        wait(d.ready, "ready once the old exchange is deleted")
        lines.append("old exchange deleted: /readyz 200")
        got = test_message()
        if len(got) != 1 or got[0][0] < 3.0:
            raise Failed(f"the test message: {[(round(t, 3), p.message_id) for t, p in got]}")
        held = got[0][1].headers.get("x-timeoutd-delayed-ms")
        lines.append(f"test command: arrived once on the queue after {got[0][0]:.3f}s "
                     f"(x-timeoutd-delayed-ms {held})")
        # A publisher that still declares the plugin's exchange type.
        ch = channel()
        try:
            ch.exchange_declare(old, "x-delayed-message", durable=True,
                                arguments={"x-delayed-type": "topic"})
            raise Failed("declaring x-delayed-message passed")
        except pika.exceptions.ConnectionClosedByBroker as e:
            lines.append(f"publisher declaring x-delayed-message: {e.reply_code} {e.reply_text}")
        ch = channel()
        ch.exchange_declare(old, "topic", durable=True, arguments={"x-delayed-type": "topic"})
        ch.exchange_declare(old, "topic", passive=True)
        lines.append("publisher declaring it as a durable topic exchange (or passive): accepted")
        # A consumer that binds its queue to the old exchange again: twice, once at once.
        ch.queue_bind(queue, old, "payment.#")
        ch.connection.close()
        got = test_message()
        times = [round(t, 3) for t, _ in got]
        if len(got) != 2 or got[0][0] >= 3.0 or got[1][0] < 3.0:
            raise Failed(f"a queue bound to the ingress: expected twice, got {times}")
        lines.append(f"consumer bound to the old name again: twice, after {times[0]}s and {times[1]}s")
        ch = channel()
        ch.queue_unbind(queue, old, "payment.#")
        ch.connection.close()
        got = test_message()
        if len(got) != 1 or got[0][0] < 3.0:
            raise Failed(f"after unbinding: {[round(t, 3) for t, _ in got]}")
        lines.append(f"binding removed: once again, after {got[0][0]:.3f}s")
        return lines
    finally:
        d.stop()
        broker_cleanup(queues=[queue], exchanges=[out, old])


RECIPES = {
    "celery": lambda: run_celery("celery"),
    "celery-no-routing-key": lambda: run_celery(
        "celery-no-routing-key", ["--no-routing-key"], judge_at_once
    ),
    "amqplib": lambda: run_pair(
        "amqplib",
        ["node", "amqplib_consume.js"],
        ["node", "amqplib_send.js"],
        queues=["recipes.amqplib.{tag}"],
    ),
    "aio-pika": lambda: run_pair(
        "aio-pika",
        [PY, "aio_pika_consume.py"],
        [PY, "aio_pika_send.py"],
        queues=["recipes.aio-pika.{tag}"],
    ),
    "taskiq": lambda: run_pair(
        "taskiq",
        [PY, "-m", "taskiq", "worker", "taskiq_tasks:broker", "--workers", "1"],
        [PY, "taskiq_send.py"],
        overrides={"TIMEOUTD__DELAY__TARGET_EXCHANGE": "recipes.taskiq"},
        queues=["recipes.taskiq.{tag}"],
        exchanges=["recipes.taskiq"],
    ),
    "migration": lambda: run_migration("migration"),
    "taskiq-plugin-defaults": lambda: run_plugin_defaults("taskiq-plugin-defaults"),
    "taskiq-bound-twice": lambda: run_pair(
        "taskiq-bound-twice",
        [PY, "-m", "taskiq", "worker", "taskiq_tasks:broker", "--workers", "1"],
        [PY, "taskiq_send.py"],
        overrides={"TIMEOUTD__DELAY__TARGET_EXCHANGE": "recipes.taskiq"},
        queues=["recipes.taskiq.{tag}"],
        exchanges=["recipes.taskiq"],
        variant="bound-twice",
        judged=judge_twice,
    ),
}


def main():
    names = sys.argv[1:] or list(RECIPES)
    CACHE.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        started = time.monotonic()
        try:
            lines = RECIPES[name]()
            print(f"recipe {name}: ok ({time.monotonic() - started:.1f}s)")
            for line in lines:
                print(f"  {line}")
        except Exception as e:  # noqa: BLE001 (each recipe judged alone)
            failed += 1
            print(f"recipe {name}: FAILED: {e} (logs in {CACHE})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
