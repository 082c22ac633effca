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
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
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
        # The migrations create the role <schema>_api (the SQL API's): it outlives the
        # schema unless dropped.
        subprocess.run(
            ["psql", PG_URL, "-qc", f"DROP SCHEMA IF EXISTS {self.schema} CASCADE",
             "-c", f"DROP ROLE IF EXISTS {self.schema}_api"],
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


def doc_region(path, lang):
    """The lines between `docs: begin <lang>` and `docs: end` of an example file."""
    lines = path.read_text().splitlines()
    begin = [i for i, line in enumerate(lines) if line.endswith(f"docs: begin {lang}")]
    end = [i for i, line in enumerate(lines) if line.endswith("docs: end")]
    if len(begin) != 1 or len(end) != 1 or end[0] <= begin[0]:
        raise Failed(f"{path.name}: no single docs: begin {lang} ... docs: end region")
    return "\n".join(lines[begin[0] + 1:end[0]]).rstrip("\n") + "\n"


def check_doc(example, lang):
    """The example code is the doc's: the region appears, as is, in a fenced block of
    docs/integrating/languages.md."""
    doc = (ROOT / "docs" / "integrating" / "languages.md").read_text()
    region = doc_region(HERE / example, lang)
    fence = {"python": "python", "node": "js", "java": "java", "go": "go"}[lang]
    if f"```{fence}\n{region}```" not in doc:
        raise Failed(f"docs/integrating/languages.md does not hold {example} as it is "
                     f"(the region docs: begin {lang} ... docs: end, in one fenced block)")
    return f"{example}: the code of docs/integrating/languages.md, as it is"


def with_user(url, user, password):
    """`url` for another role."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    netloc = f"{urllib.parse.quote(user)}:{urllib.parse.quote(password)}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def jdbc_url(url, user, password):
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.urlencode({"user": user, "password": password})
    return f"jdbc:postgresql://{parts.hostname}:{parts.port or 5432}{parts.path}?{query}"


JDBC_JAR = Path("/usr/share/java/postgresql.jar")  # Debian's libpostgresql-jdbc-java


def java_driver():
    if not JDBC_JAR.exists() or not shutil.which("java"):
        raise Failed(f"needs java and {JDBC_JAR} (apt-get install libpostgresql-jdbc-java)")
    classes = CACHE / "java"
    build = subprocess.run(["javac", "-d", str(classes), "-cp", str(JDBC_JAR),
                            "SqlApiExample.java"], cwd=HERE, capture_output=True, text=True)
    if build.returncode:
        raise Failed(f"javac: {build.stderr}")
    return ["java", "-cp", f"{JDBC_JAR}:{classes}", "SqlApiExample"]


def go_driver():
    """tests/recipes/go built against Debian's pgx v4 (golang-github-jackc-pgx-v4-dev),
    its import path rewritten from v5: Debian 12 packages no pgx v5 (the code uses
    nothing that differs between the two)."""
    gocode = Path("/usr/share/gocode")
    if not shutil.which("go") or not (gocode / "src/github.com/jackc/pgx/v4").is_dir():
        raise Failed("needs go and Debian's golang-github-jackc-pgx-v4-dev")
    gopath = CACHE / "gopath"
    shutil.rmtree(gopath, ignore_errors=True)
    src = gopath / "src" / "timeoutd.test" / "sqlapi"
    shutil.copytree(HERE / "go", src)
    for f in src.rglob("*.go"):
        f.write_text(f.read_text().replace("github.com/jackc/pgx/v5", "github.com/jackc/pgx/v4"))
    binary = CACHE / "sqlapi-go"
    env = dict(os.environ, GO111MODULE="off", GOPATH=f"{gopath}:{gocode}",
               GOCACHE=str(CACHE / "gocache"), GOFLAGS="")
    build = subprocess.run(["go", "build", "-o", str(binary), "."], cwd=src, env=env,
                           capture_output=True, text=True)
    if build.returncode:
        raise Failed(f"go build: {build.stderr}")
    return [str(binary)]


def run_sqlapi(name, driver, example, lang):
    """Every SQL API function from one language (tests/recipes/sqlapi_drive.*), as login
    roles granted only <schema>_api, against a timeoutd of its own, started first (it
    writes the rules the API judges by): what the driver says arrives, arrives once, on
    time, with its headers; what it says never comes (rolled back, cancelled, held),
    never does; nothing else arrives. TimeOuts go to an exchange of their own: the
    default exchange is refused unless timeouts.allow_default_exchange is set."""
    import psycopg  # the venv's (tests/recipes/requirements.txt)

    lines = [check_doc(example, lang)]
    tag = uuid.uuid4().hex[:8]
    queue, out, timeouts = f"sqlapi.{tag}", f"sqlapi.{tag}.out", f"sqlapi.{tag}.timeouts"
    late, denied = f"sqlapi.{tag}.late", f"sqlapi.{tag}.denied"
    d = Daemon(name, {
        "TIMEOUTD__DELAY__TARGET_EXCHANGE": out,
        "TIMEOUTD__DELAY__ALLOWED_EXCHANGES": f"{late}.*",
        # A failed publish waits this long: only retry_* explains a quick second attempt.
        "TIMEOUTD__SCAN__RETRY_MIN": "30s",
    })
    roles = [f"{d.schema}_app", f"{d.schema}_other"]
    password = uuid.uuid4().hex
    params = pika.URLParameters(AMQP_URL)
    with pika.BlockingConnection(params) as c:
        ch = c.channel()
        ch.queue_declare(queue, durable=True)
        for x in (out, timeouts, denied):
            ch.exchange_declare(x, "topic", durable=True)
            ch.queue_bind(queue, x, "#")
    d.start()
    admin = psycopg.connect(PG_URL, autocommit=True)
    proc = None
    try:
        for role in roles:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
            admin.execute(f"GRANT {d.schema}_api TO {role}")
            admin.execute(f"ALTER ROLE {role} SET search_path = public, {d.schema}")
        env = dict(
            os.environ,
            APP_PG_URL=with_user(PG_URL, roles[0], password),
            OTHER_PG_URL=with_user(PG_URL, roles[1], password),
            APP_JDBC_URL=jdbc_url(PG_URL, roles[0], password),
            ADMIN_PG_URL=PG_URL,
            SCHEMA=d.schema, QUEUE=queue, TIMEOUTS_EXCHANGE=timeouts, OUT_EXCHANGE=out,
            LATE_EXCHANGE=late, DENIED_EXCHANGE=denied, INGRESS_EXCHANGE=d.ingress,
            AMQP_URL=AMQP_URL, WORKERS="4", TXNS="8",
            NODE_PATH=str(CACHE / "node" / "node_modules"),
        )
        proc, ev = spawn(name, driver, env, CACHE / f"{name}.log")
        got = {}  # message_id -> [(received at, properties, body, exchange, routing key)]
        with pika.BlockingConnection(params) as c:
            ch = c.channel()

            def drain(seconds):
                for method, props, body in ch.consume(queue, auto_ack=True,
                                                      inactivity_timeout=0.02):
                    if method is None:
                        break
                    got.setdefault(props.message_id, []).append(
                        (time.time(), props, body, method.exchange, method.routing_key))
                ch.connection.sleep(seconds)

            deadline = time.monotonic() + PATIENCE
            while proc.poll() is None and time.monotonic() < deadline:
                drain(0.01)
            if proc.poll() is None:
                raise Failed(f"{name}: the driver did not finish within {PATIENCE} s")
            fires = ev.of("fires")
            while time.monotonic() < deadline and any(f["id"] not in got for f in fires):
                drain(0.01)
            # A rolled-back or cancelled one would have come due within 3 s of the end.
            quiet_until = time.monotonic() + 3.5
            while time.monotonic() < quiet_until:
                drain(0.05)
            ch.cancel()
        if proc.returncode:
            raise Failed(f"{name}: the driver exited {proc.returncode}; see "
                         f"{CACHE / (name + '.log')}")
        lines += judge_sqlapi(name, ev.poll(), got)
        return lines
    finally:
        if proc:
            end(proc)
        d.stop()
        for role in roles:
            admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.close()
        broker_cleanup(queues=[queue],
                       exchanges=[out, timeouts, denied, f"{late}.timeouts", f"{late}.delayed"])


def judge_sqlapi(name, events, got):
    lines = []
    if not any(e["event"] == "done" for e in events):
        raise Failed(f"{name}: the driver did not say done")
    wrong = [e for e in events if e["event"] == "returned" and e["got"] != e["want"]]
    if wrong:
        raise Failed(f"{name}: " + "; ".join(
            f"{e['what']}: {e['got']!r}, not {e['want']!r}" for e in wrong))
    returns = [e for e in events if e["event"] == "returned"]
    lines.append(f"{len(returns)} answers as documented (" + ", ".join(
        e["what"] for e in returns[:4]) + ", ...)")
    fires = [e for e in events if e["event"] == "fires"]
    # A message whose id the example does not return (Java's placeOrder): found by body.
    for e in (e for e in events if e["event"] == "fires-body"):
        ids = [i for i, copies in got.items() if any(
            body.startswith(b"{") and json.loads(body) == e["body"] for _, _, body, _, _ in copies)]
        if len(ids) != 1:
            raise Failed(f"{name}: {e['what']}: {len(ids)} messages with its body")
        fires.append({**e, "id": ids[0], "body": json.dumps(e["body"])})
    never = [e for e in events if e["event"] == "never"]
    outbox_ms = []
    for f in fires:
        copies = got.get(f["id"], [])
        if len(copies) != 1:
            raise Failed(f"{name}: {f['what']} ({f['id']}) arrived {len(copies)} times")
        at, props, body, _, _ = copies[0]
        if at < f["not_before"]:
            raise Failed(f"{name}: {f['what']} arrived {f['not_before'] - at:.3f} s early")
        if "not_after" in f and at > f["not_after"]:
            raise Failed(f"{name}: {f['what']} arrived late: {at - f['not_after']:.3f} s "
                         "after its bound")
        headers = props.headers or {}
        if f["kind"] == "timeout":
            if props.type != "TimeOut":
                raise Failed(f"{name}: {f['what']}: type {props.type!r}")
            message = json.loads(body)
            if message["expectation_id"] != f["id"]:
                raise Failed(f"{name}: {f['what']}: expectation_id {message['expectation_id']}")
            if "process_id" in f and props.correlation_id != f["process_id"]:
                raise Failed(f"{name}: {f['what']}: correlation_id {props.correlation_id}")
            if "payload" in f and message["payload"] != f["payload"]:
                raise Failed(f"{name}: {f['what']}: payload {message['payload']}")
        else:
            if json.loads(body) != json.loads(f["body"]):
                raise Failed(f"{name}: {f['what']}: body {body!r}")
            for k, v in f.get("headers", {}).items():
                if headers.get(k) != v:
                    raise Failed(f"{name}: {f['what']}: header {k} = {headers.get(k)!r}")
            if f["kind"] == "outbox":
                outbox_ms.append((at - f["committed"]) * 1000)
        if "traceparent" in f and headers.get("traceparent") != f["traceparent"]:
            raise Failed(f"{name}: {f['what']}: traceparent {headers.get('traceparent')!r}, "
                         f"not {f['traceparent']}")
    kinds = {k: sum(1 for f in fires if f["kind"] == k) for k in ("timeout", "outbox", "delayed")}
    lines.append(f"arrived once each, on time, with their headers: {kinds['timeout']} TimeOuts "
                 f"(message_id = the expectation's id, traceparent kept), {kinds['outbox']} "
                 f"outbox and {kinds['delayed']} delayed messages (body, traceparent, headers)")
    for e in never:
        if e["id"] in got:
            raise Failed(f"{name}: {e['what']} ({e['id']}) arrived")
    # Rolled back before the API's answer reached the caller (Node's placeOrder throws):
    # known by its process, and by its order in an outbox body.
    for e in (e for e in events if e["event"] == "never-process"):
        order = int(e["process_id"].split("-")[1])
        for copies in got.values():
            for _, props, body, _, _ in copies:
                try:
                    outbox = json.loads(body) == {"order": order}
                except ValueError:
                    outbox = False
                if props.correlation_id == e["process_id"] or outbox:
                    raise Failed(f"{name}: {e['what']} arrived")
        never.append(e)
    rolled = sum(1 for e in never if e["what"].startswith("rolled-back"))
    lines.append(f"never arrived: {len(never)} ({rolled} written in rolled-back transactions, "
                 "the rest cancelled or held)")
    known = {f["id"] for f in fires}
    stray = [i for i in got if i not in known]
    if stray:
        raise Failed(f"{name}: unexpected messages arrived: {stray[:5]}")
    if outbox_ms:
        outbox_ms.sort()
        lines.append(f"outbox: commit to receipt p50 {outbox_ms[len(outbox_ms) // 2]:.1f} ms, "
                     f"max {outbox_ms[-1]:.1f} ms over {len(outbox_ms)}")
    return lines


def run_signature(name, consumer, example, lang):
    """A timeoutd with amqp.signing_key fires a TimeOut and delivers a delayed message;
    the verification snippet of docs/integrating/timeouts.md (the region of `example`,
    as it is there) accepts both as they arrive, and refuses each with another routing
    key or another body."""
    doc = (ROOT / "docs" / "integrating" / "timeouts.md").read_text()
    fence = {"python": "python", "node": "js"}[lang]
    if f"```{fence}\n{doc_region(HERE / example, lang)}```" not in doc:
        raise Failed(f"docs/integrating/timeouts.md does not hold {example}'s docs region")
    tag = uuid.uuid4().hex[:8]
    queue, out = f"signed.{tag}", f"signed.{tag}.out"
    key, key_id = uuid.uuid4().hex, f"k-{tag}"
    d = Daemon(name, {
        "TIMEOUTD__AMQP__SIGNING_KEY": key,
        "TIMEOUTD__AMQP__SIGNING_KEY_ID": key_id,
        "TIMEOUTD__DELAY__TARGET_EXCHANGE": out,
        "TIMEOUTD__TIMEOUTS__ALLOW_DEFAULT_EXCHANGE": "true",
    })
    with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as c:
        ch = c.channel()
        ch.queue_declare(queue, durable=True)
        ch.exchange_declare(out, "topic", durable=True)
        ch.queue_bind(queue, out, "#")
    d.start()
    proc = None
    try:
        env = dict(os.environ, AMQP_URL=AMQP_URL, QUEUE=queue, KEY=key, KEY_ID=key_id,
                   COUNT="2", NODE_PATH=str(CACHE / "node" / "node_modules"))
        proc, ev = spawn(name, consumer, env, CACHE / f"{name}.log")
        subprocess.run(
            ["psql", PG_URL, "-qc",
             f"SELECT {d.schema}.expect('order-42', 'PaymentReceived', '{queue}', "
             "now() + interval '1 second', exchange => '', payload => '{\"order\": 42}')"],
            check=True, capture_output=True,
        )
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as c:
            c.channel().basic_publish(
                d.ingress, "orders.paid", b'{"paid": 42}',
                pika.BasicProperties(message_id=f"delayed-{tag}", headers={"x-delay": 500}),
            )
        wait(lambda: len(ev.of("verified")) >= 2, f"the {name} verdicts")
        got = ev.of("verified")
        for v in got:
            if not v["ok"] or v["other_key"] or v["other_body"]:
                raise Failed(f"{name}: {v}")
        if sorted(str(v.get("type")) for v in got) != ["None", "TimeOut"]:
            raise Failed(f"{name}: not a TimeOut and a delayed message: {got}")
        return [f"{example}: the code of docs/integrating/timeouts.md, as it is",
                "a signed TimeOut and a signed delayed message verify; with another "
                "routing key or body they do not"]
    finally:
        if proc:
            end(proc)
        d.stop()
        broker_cleanup(queues=[queue], exchanges=[out])


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
    "signature-python": lambda: run_signature(
        "signature-python", [PY, "verify_signature.py"], "verify_signature.py", "python"
    ),
    "signature-node": lambda: run_signature(
        "signature-node", ["node", "verify_signature.js"], "verify_signature.js", "node"
    ),
    "sql-api-python": lambda: run_sqlapi(
        "sql-api-python", [PY, "sqlapi_drive.py"], "sqlapi_example.py", "python"
    ),
    "sql-api-node": lambda: run_sqlapi(
        "sql-api-node", ["node", "sqlapi_drive.js"], "sqlapi_example.js", "node"
    ),
    "sql-api-java": lambda: run_sqlapi(
        "sql-api-java", java_driver(), "SqlApiExample.java", "java"
    ),
    "sql-api-go": lambda: run_sqlapi(
        "sql-api-go", go_driver(), "go/orders/orders.go", "go"
    ),
}
# Run only when named: needs Go and Debian's pgx v4, which CI does not install.
OPTIONAL = {"sql-api-go"}


def main():
    names = sys.argv[1:] or [n for n in RECIPES if n not in OPTIONAL]
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
