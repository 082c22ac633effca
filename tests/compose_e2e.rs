//! The compose deployment, for real: `.ci/compose-test` brings up the stack of
//! `docker-compose.yml` (CI stand-in images, ports moved by `.ci/compose.ci.yml`:
//! RabbitMQ 4.3 on 127.0.0.1:35672, Postgres 18 on :35432, the replicas' HTTP on
//! :39464-39466) and runs these one at a time. Each scenario puts a steady load of
//! expectations on the running stack (hundreds due per second, routed to a durable queue
//! of its own), injects its fault with `docker`, and audits from the outside — what a
//! consumer received and what the table holds: lost, early, duplicates (with their
//! cause), each row's lateness (its first TimeOut after its deadline: p99 and the
//! latest), and the longest gap in the TimeOuts arriving while rows were due. A row is
//! judged alone: other rows flowing does not excuse one that waited for the fault. One
//! summary line per scenario.
//!
//! Ignored by a plain `cargo nextest run` (they need Docker and the stack);
//! `.ci/compose-test` runs them with `--run-ignored only`.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const AMQP: &str = "amqp://guest:guest@127.0.0.1:35672/%2f";
const PG: &str = "postgres://postgres@127.0.0.1:35432/postgres";
/// The replicas and their published HTTP ports (`.ci/compose.ci.yml`).
const REPLICAS: [(&str, u16); 3] = [
    ("timeoutd-1", 39464),
    ("timeoutd-2", 39465),
    ("timeoutd-3", 39466),
];
/// Expectations per second of the steady load.
const RATE: u64 = 200;
/// How far ahead each expectation is due when inserted.
const AHEAD: Duration = Duration::from_millis(1500);

/// `docker compose …` in the repository (the environment of `.ci/compose-env`).
fn compose(args: &[&str]) -> String {
    run("docker", &[&["compose"], args].concat())
}

fn docker(args: &[&str]) -> String {
    run("docker", args)
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("docker runs");
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The container of a compose service.
fn container(service: &str) -> String {
    compose(&["ps", "-q", service])
}

fn network(name: &str) -> String {
    let project = std::env::var("COMPOSE_PROJECT_NAME").unwrap_or_else(|_| "timeoutd-ci".into());
    format!("{project}_{name}")
}

async fn status(port: u16) -> Option<serde_json::Value> {
    let url = format!("http://127.0.0.1:{port}/status");
    let body = tokio::time::timeout(Duration::from_secs(2), http_get(&url))
        .await
        .ok()??;
    serde_json::from_str(&body).ok()
}

/// A minimal HTTP/1.1 GET (the tests need no HTTP client beyond this).
async fn http_get(url: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://")?;
    let (addr, path) = rest.split_once('/')?;
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET /{path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf).to_string();
    Some(text.split_once("\r\n\r\n")?.1.to_owned())
}

/// The replica that is active now, with its node id: exactly one must say so.
async fn the_active() -> Option<(&'static str, Uuid)> {
    let mut active = Vec::new();
    for (service, port) in REPLICAS {
        if let Some(s) = status(port).await
            && s["role"] == "active"
        {
            let id = s["node_id"].as_str()?.parse().ok()?;
            active.push((service, id));
        }
    }
    (active.len() == 1).then(|| active[0])
}

async fn wait_until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every replica running and healthy, exactly one active: the state each scenario starts
/// from and must return to.
async fn settled_stack() -> (&'static str, Uuid) {
    wait_until(
        Duration::from_secs(90),
        "three healthy replicas",
        || async {
            REPLICAS.iter().all(|(s, _)| {
                let id = container(s);
                !id.is_empty()
                    && docker(&["inspect", "-f", "{{.State.Health.Status}}", &id]) == "healthy"
            })
        },
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = the_active().await {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "timed out: exactly one active replica"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One received TimeOut.
#[derive(Debug, Clone)]
struct Got {
    at: DateTime<Utc>,
    sender: String,
}

/// A durable queue of the scenario's own on the stack's broker, consumed with acks and
/// re-consumed after a broker restart; a redelivery of something already recorded (an
/// ack lost with the connection) is the consumer's duplicate, not the daemon's.
struct Consumer {
    queue: String,
    got: Arc<Mutex<HashMap<String, Vec<Got>>>>,
    stop: CancellationToken,
}

impl Consumer {
    async fn start(queue: &str) -> Self {
        let got = Arc::new(Mutex::new(HashMap::new()));
        let stop = CancellationToken::new();
        let first = connect_consumer(queue).await.expect("consumer connects");
        tokio::spawn(consume(queue.to_owned(), first, got.clone(), stop.clone()));
        Self {
            queue: queue.to_owned(),
            got,
            stop,
        }
    }

    fn snapshot(&self) -> HashMap<String, Vec<Got>> {
        self.got.lock().expect("lock").clone()
    }
}

async fn connect_consumer(queue: &str) -> Option<(Connection, lapin::Consumer)> {
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .ok()?;
    let ch = conn.create_channel().await.ok()?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .ok()?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .ok()?;
    Some((conn, consumer))
}

async fn consume(
    queue: String,
    first: (Connection, lapin::Consumer),
    got: Arc<Mutex<HashMap<String, Vec<Got>>>>,
    stop: CancellationToken,
) {
    let mut current = Some(first);
    while !stop.is_cancelled() {
        let Some((_conn, mut consumer)) = current.take() else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            current = connect_consumer(&queue).await;
            continue;
        };
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                n = consumer.next() => n,
            };
            let Some(Ok(d)) = next else { break };
            record(&got, &d);
            let _ = d.ack(BasicAckOptions::default()).await;
        }
    }
}

fn record(got: &Mutex<HashMap<String, Vec<Got>>>, d: &lapin::message::Delivery) {
    let id = d
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let sender = d
        .properties
        .headers()
        .as_ref()
        .and_then(|h| match h.inner().get("x-timeoutd-node") {
            Some(AMQPValue::LongString(s)) => Some(s.to_string()),
            _ => None,
        })
        .unwrap_or_default();
    let mut got = got.lock().expect("lock");
    let copies = got.entry(id).or_default();
    if d.redelivered && !copies.is_empty() {
        return;
    }
    copies.push(Got {
        at: Utc::now(),
        sender,
    });
}

/// The steady load: RATE expectations a second, each due AHEAD later, routed to the
/// consumer's queue. An insert whose outcome is unknown (the database went away) is kept
/// as "maybe": it counts if it arrived or is still in the table.
struct Load {
    deadlines: Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>,
    maybe: Arc<Mutex<Vec<Uuid>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    fn start(pool: PgPool, scenario: &str, queue: &str) -> Self {
        let deadlines = Arc::new(Mutex::new(HashMap::new()));
        let maybe = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(insert_steadily(
            pool,
            scenario.to_owned(),
            queue.to_owned(),
            deadlines.clone(),
            maybe.clone(),
            stop.clone(),
        ));
        Self {
            deadlines,
            maybe,
            stop,
            task,
        }
    }

    async fn stop(self) -> (HashMap<Uuid, DateTime<Utc>>, Vec<Uuid>) {
        self.stop.cancel();
        let _ = self.task.await;
        let deadlines = self.deadlines.lock().expect("lock").clone();
        let maybe = self.maybe.lock().expect("lock").clone();
        (deadlines, maybe)
    }
}

async fn insert_steadily(
    pool: PgPool,
    scenario: String,
    queue: String,
    deadlines: Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>,
    maybe: Arc<Mutex<Vec<Uuid>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut n = 0u64;
    while !stop.is_cancelled() {
        tick.tick().await;
        n += 1;
        let id = Uuid::new_v4();
        let due = Utc::now() + chrono::Duration::from_std(AHEAD).expect("duration");
        let insert = sqlx::query(
            "INSERT INTO timeoutd.expected_messages \
             (id, process_id, message_type, timeout_at, exchange, routing_key) \
             VALUES ($1, $2, 'Reply', $3, '', $4)",
        )
        .bind(id)
        .bind(format!("{scenario}-{n}"))
        .bind(due)
        .bind(&queue)
        .execute(&pool);
        match tokio::time::timeout(Duration::from_secs(2), insert).await {
            Ok(Ok(_)) => {
                deadlines.lock().expect("lock").insert(id, due);
            }
            // Refused before it reached the database: nothing to expect.
            Ok(Err(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))) => {}
            _ => {
                maybe.lock().expect("lock").push(id);
                deadlines.lock().expect("lock").insert(id, due);
            }
        }
    }
}

/// What one scenario measured.
#[derive(Debug)]
struct Audit {
    rows: usize,
    lost: usize,
    early: usize,
    duplicates: usize,
    /// Each row's first TimeOut after its deadline: the 99th percentile and the latest.
    late_p99: Duration,
    late_max: Duration,
    longest_gap: Duration,
    /// From the fault to the first TimeOut sent by another node than the victim.
    successor: Option<Duration>,
}

/// Run `fault` against the stack under the steady load and audit it: no row lost or
/// early, none later than `limit`, and no gap in the stream longer than it.
async fn scenario<F, Fut>(name: &str, cause: &str, limit: Duration, fault: F) -> Audit
where
    F: FnOnce((&'static str, Uuid)) -> Fut,
    Fut: Future<Output = ()>,
{
    let victim = settled_stack().await;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(PG)
        .expect("pool");
    let queue = format!("e2e-{name}-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let consumer = Consumer::start(&queue).await;
    let load = Load::start(pool.clone(), name, &queue);
    // A few seconds of normal flow first.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let fault_at = Utc::now();
    fault(victim).await;
    // The stack is back (the fault restores it): a few more seconds of load.
    settled_stack().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (deadlines, maybe) = load.stop().await;
    let mut audit = audit(name, &consumer, &pool, &deadlines, &maybe, fault_at).await;
    audit.successor = first_from_another(&consumer.snapshot(), victim.1, fault_at);
    let successor = audit
        .successor
        .map_or("-".to_owned(), |d| format!("{:.2}s", d.as_secs_f64()));
    println!(
        "compose scenario={name} rows={} lost={} early={} duplicates={} (same message_id; \
         cause: {cause}) lateness_p99={:.2}s latest_row={:.2}s (limit {:.2}s) \
         longest_gap_without_timeouts={:.2}s first_timeout_from_another_node={successor}",
        audit.rows,
        audit.lost,
        audit.early,
        audit.duplicates,
        audit.late_p99.as_secs_f64(),
        audit.late_max.as_secs_f64(),
        limit.as_secs_f64(),
        audit.longest_gap.as_secs_f64()
    );
    consumer.stop.cancel();
    drop_queue(&consumer.queue).await;
    pool.close().await;
    assert_eq!(audit.lost, 0, "{name}: {audit:?}");
    assert_eq!(audit.early, 0, "{name}: {audit:?}");
    assert!(
        audit.late_max <= limit,
        "{name}: a row waited {:?} (limit {limit:?}): {audit:?}",
        audit.late_max
    );
    assert!(
        audit.longest_gap <= limit,
        "{name}: {audit:?} (limit {limit:?})"
    );
    audit
}

async fn audit(
    name: &str,
    consumer: &Consumer,
    pool: &PgPool,
    deadlines: &HashMap<Uuid, DateTime<Utc>>,
    maybe: &[Uuid],
    fault_at: DateTime<Utc>,
) -> Audit {
    let prefix = format!("{name}-%");
    // Every row fired (none of the scenario's left), every certain one received.
    wait_until(
        Duration::from_secs(90),
        "the scenario's rows all fired",
        || async {
            let left: Result<i64, _> = sqlx::query_scalar(
                "SELECT count(*) FROM timeoutd.expected_messages WHERE process_id LIKE $1",
            )
            .bind(&prefix)
            .fetch_one(pool)
            .await;
            let got = consumer.snapshot();
            let certain = deadlines
                .keys()
                .filter(|id| !maybe.contains(id))
                .all(|id| got.contains_key(&id.to_string()));
            matches!(left, Ok(0)) && certain
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = consumer.snapshot();
    let mut audit = Audit {
        rows: 0,
        lost: 0,
        early: 0,
        duplicates: 0,
        late_p99: Duration::ZERO,
        late_max: Duration::ZERO,
        longest_gap: longest_gap(&got, fault_at),
        successor: None,
    };
    let mut lateness = Vec::new();
    for (id, due) in deadlines {
        let copies = got
            .get(&id.to_string())
            .map(Vec::as_slice)
            .unwrap_or_default();
        if copies.is_empty() && maybe.contains(id) {
            continue;
        }
        audit.rows += 1;
        audit.lost += usize::from(copies.is_empty());
        audit.early += copies.iter().filter(|c| c.at < *due).count();
        audit.duplicates += copies.len().saturating_sub(1);
        if let Some(first) = copies.iter().map(|c| c.at).min() {
            lateness.push((first - *due).to_std().unwrap_or_default());
        }
    }
    lateness.sort();
    if let Some(max) = lateness.last() {
        audit.late_max = *max;
        audit.late_p99 = lateness[lateness.len() * 99 / 100];
    }
    audit
}

/// From `from` to the first TimeOut that a node other than `victim` sent after it.
fn first_from_another(
    got: &HashMap<String, Vec<Got>>,
    victim: Uuid,
    from: DateTime<Utc>,
) -> Option<Duration> {
    let victim = victim.to_string();
    let first = got
        .values()
        .flatten()
        .filter(|g| g.at >= from && g.sender != victim)
        .map(|g| g.at)
        .min()?;
    (first - from).to_std().ok()
}

/// The longest time after the fault with no TimeOut arriving, while rows kept coming due.
fn longest_gap(got: &HashMap<String, Vec<Got>>, from: DateTime<Utc>) -> Duration {
    let mut times: Vec<DateTime<Utc>> = got.values().flatten().map(|g| g.at).collect();
    times.sort();
    let mut last = from;
    let mut gap = chrono::Duration::zero();
    for t in times.into_iter().filter(|t| *t >= from) {
        gap = gap.max(t - last);
        last = t;
    }
    gap.to_std().unwrap_or_default()
}

async fn drop_queue(queue: &str) {
    if let Ok(conn) = Connection::connect(AMQP, ConnectionProperties::default()).await {
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch.queue_delete(queue.into(), Default::default()).await;
        }
        let _ = conn.close(200, "done".into()).await;
    }
}

/// member_ttl 3 s + tick 250 ms + settling, a probe interval (1 s) for the rows a
/// departed node held until the successor ended its sessions, and scheduling slack on a
/// 2-core machine shared with the stack.
const TAKEOVER: Duration = Duration::from_millis(6000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn up_three_healthy_one_active_and_the_demo_fires_each_expectation_once() {
    let (_, active) = settled_stack().await;
    println!("compose up: three healthy replicas, one active ({active})");
    // The demo producer registers one expectation every 3 s, due 5 s later. Only what
    // this test sees counts: other scenarios' faults may legitimately duplicate some.
    let since = Utc::now().to_rfc3339();
    wait_until(
        Duration::from_secs(60),
        "the demo consumer prints TimeOuts",
        || async { demo_counts(&since).len() >= 4 },
    )
    .await;
    let counts = demo_counts(&since);
    assert!(
        counts.values().all(|n| *n == 1),
        "one TimeOut per expectation: {counts:?}"
    );
    println!(
        "compose demo: {} expectations, each TimeOut exactly once",
        counts.len()
    );
}

/// TimeOuts the demo consumer printed since `since`, by process id.
fn demo_counts(since: &str) -> HashMap<String, usize> {
    let log = compose(&["logs", "--no-log-prefix", "--since", since, "demo-consumer"]);
    let mut counts = HashMap::new();
    for line in log.lines() {
        if let Some(rest) = line.split("correlation_id=Some(\"").nth(1)
            && let Some(process) = rest.split('"').next()
        {
            *counts.entry(process.to_owned()).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn stop_of_the_active_replica() {
    let cause = "none expected: a stopped replica commits its batch before leaving";
    scenario(
        "stop",
        cause,
        Duration::from_secs(2),
        |(service, _)| async move {
            compose(&["stop", service]);
            tokio::time::sleep(Duration::from_secs(2)).await;
            compose(&["start", service]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn kill_of_the_active_replica() {
    let cause = "the killed replica had published and not committed";
    scenario("kill", cause, TAKEOVER, |(service, _)| async move {
        docker(&["kill", "-s", "KILL", &container(service)]);
        tokio::time::sleep(Duration::from_secs(5)).await;
        compose(&["start", service]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn pause_of_the_active_replica_longer_than_member_ttl() {
    let cause = "TimeOuts the paused replica had published and not deleted when it froze";
    scenario("pause", cause, TAKEOVER, |(service, _)| async move {
        let id = container(service);
        docker(&["pause", &id]);
        tokio::time::sleep(Duration::from_secs(8)).await;
        docker(&["unpause", &id]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_active_replica_cut_from_postgres_only() {
    let cause = "the cut replica had confirmed TimeOuts it could not commit";
    scenario("cut-postgres", cause, TAKEOVER, |(service, _)| async move {
        let (id, net) = (container(service), network("db"));
        docker(&["network", "disconnect", &net, &id]);
        tokio::time::sleep(Duration::from_secs(8)).await;
        docker(&["network", "connect", &net, &id]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_active_replica_cut_from_rabbitmq_only() {
    // The others see it depart after member_ttl; the successor ends its sessions.
    let cause = "TimeOuts published before the cut whose confirms never came";
    scenario("cut-rabbitmq", cause, TAKEOVER, |(service, _)| async move {
        let (id, net) = (container(service), network("bus"));
        docker(&["network", "disconnect", &net, &id]);
        tokio::time::sleep(Duration::from_secs(12)).await;
        docker(&["network", "connect", &net, &id]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn restart_of_rabbitmq() {
    let cause = "TimeOuts published whose confirms were lost with the broker";
    scenario(
        "restart-rabbitmq",
        cause,
        Duration::from_secs(40),
        |_| async move {
            compose(&["restart", "rabbitmq"]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn restart_of_postgres() {
    let cause = "confirmed TimeOuts whose commit the restart cut off";
    scenario(
        "restart-postgres",
        cause,
        Duration::from_secs(40),
        |_| async move {
            compose(&["restart", "postgres"]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn rolling_restart_of_all_replicas() {
    let cause = "none expected: each replica stops gracefully";
    scenario("rolling-restart", cause, TAKEOVER, |_| async move {
        for (service, _) in REPLICAS {
            compose(&["restart", service]);
            settled_stack().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_runtime_image_runs_as_non_root_and_its_commands_work() {
    settled_stack().await;
    let uid = compose(&["exec", "-T", "timeoutd-1", "id", "-u"]);
    assert_ne!(uid, "0", "runs as non-root");
    compose(&["exec", "-T", "timeoutd-1", "timeoutd", "check-config"]);
    let members = compose(&[
        "exec",
        "-T",
        "timeoutd-1",
        "timeoutd",
        "members",
        "--once",
        "--json",
    ]);
    let members: serde_json::Value = serde_json::from_str(&members).expect("members --json");
    assert_eq!(members.as_array().map(Vec::len), Some(3), "{members}");
    let health = docker(&[
        "inspect",
        "-f",
        "{{.State.Health.Status}}",
        &container("timeoutd-1"),
    ]);
    assert_eq!(health, "healthy");
    println!("compose runtime image: uid {uid}, check-config ok, members --once sees 3, healthy");
}

/// Delayed messages confirmed by the broker are never lost across a broker restart: with
/// every replica stopped, 300 messages (x-delay 2 s, publisher confirms) wait in the
/// ingress quorum queue; RabbitMQ restarts; the replicas start again, store them and
/// deliver each one to the target exchange, never before its delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn delayed_messages_in_the_quorum_queue_survive_a_rabbitmq_restart() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
    settled_stack().await;
    let key = format!("e2e.delayed.{}", Uuid::new_v4().simple());
    let queue = format!("e2e-{key}");
    let consumer = Consumer::start(&queue).await;
    bind_target(&queue, &key).await;
    for (service, _) in REPLICAS {
        compose(&["stop", service]);
    }
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("broker");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut sent = HashMap::new();
    for i in 0..300 {
        let id = format!("{key}-{i}");
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongInt(2000));
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(h);
        let confirm = ch
            .basic_publish(
                "timeoutd.delay.demo".into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "confirmed");
        sent.insert(id, Utc::now());
    }
    let _ = conn.close(200, "done".into()).await;
    compose(&["restart", "rabbitmq"]);
    for (service, _) in REPLICAS {
        compose(&["start", service]);
    }
    settled_stack().await;
    wait_until(Duration::from_secs(90), "every delayed message", || async {
        consumer.snapshot().len() == sent.len()
    })
    .await;
    let got = consumer.snapshot();
    for (id, at) in &sent {
        let first = got[id].iter().map(|g| g.at).min().expect("received");
        assert!(
            first >= *at + chrono::Duration::milliseconds(2000),
            "{id} early"
        );
    }
    let copies: usize = got.values().map(|v| v.len() - 1).sum();
    println!(
        "compose delayed-restart-rabbitmq: {} confirmed while no replica ran, broker restarted: \
         lost 0, early 0, extra copies {copies}",
        sent.len()
    );
    consumer.stop.cancel();
    drop_queue(&queue).await;

    async fn bind_target(queue: &str, key: &str) {
        let conn = Connection::connect(AMQP, ConnectionProperties::default())
            .await
            .expect("broker");
        let ch = conn.create_channel().await.expect("channel");
        ch.queue_bind(
            queue.into(),
            "timeoutd.delayed".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind to the target exchange the replicas declared");
        let _ = conn.close(200, "done".into()).await;
    }
}
