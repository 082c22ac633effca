//! Judging a running stack from the outside, shared by the compose scenarios
//! (`compose_e2e.rs`: `docker-compose.yml`) and the topology scenarios (`topology_e2e.rs`:
//! `tests/topology/compose.yml`). A scenario puts a steady load on the running stack —
//! expectations due shortly (TimeOuts routed to a durable queue of its own) and, where
//! the stack says so, delayed messages through the group's ingress — injects its fault
//! with `docker`, and audits what a consumer received and what the tables hold: lost,
//! early, duplicates, each message's lateness (its first copy after its due time: p99 and
//! the latest), and the longest gap in arrivals while messages were due. A message is
//! judged alone: others flowing does not excuse one that waited for the fault.

// Each test binary uses a part of this module; the rest would be dead code there.
#![allow(dead_code)]

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Expectations per second of the steady load.
pub const RATE: u64 = 200;
/// Delayed messages per second of the steady load, when the stack has a delay ingress.
pub const DELAYED_RATE: u64 = 50;
/// How far ahead each expectation is due, and each delayed message's `x-delay`.
pub const AHEAD: Duration = Duration::from_millis(1500);
/// The prefix of the delayed messages' ids (TimeOuts carry the row's uuid).
const DELAYED: &str = "delayed-";

/// A running stack, as the scenarios see it from the host.
pub struct Stack {
    /// What the summary lines start with ("compose", "topology").
    pub label: &'static str,
    /// The broker's URLs, tried in turn by the test's consumer and publisher.
    pub amqp: &'static [&'static str],
    /// The database's URLs: the one that takes writes is used.
    pub pg: &'static [&'static str],
    /// The schema the group's tables are in.
    pub schema: &'static str,
    /// The daemons of the group and their published HTTP ports.
    pub replicas: &'static [(&'static str, u16)],
    /// The group's ingress exchange: delayed messages join the load when set.
    pub delay_exchange: Option<&'static str>,
    /// Declare the test's queues as quorum queues (they then survive a broker node).
    pub quorum_queues: bool,
    /// Whatever else must be healthy before and after a scenario (the brokers, the
    /// database replication), checked from the outside.
    pub infra_settled: fn() -> bool,
}

/// `docker compose …` in the repository (the environment of `.ci/compose-env` or
/// `.ci/topology-env` names the project and file).
pub fn compose(args: &[&str]) -> String {
    run("docker", &[&["compose"], args].concat())
}

pub fn docker(args: &[&str]) -> String {
    run("docker", args)
}

pub fn run(cmd: &str, args: &[&str]) -> String {
    try_run(cmd, args).unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}"))
}

/// A command's stdout, or its stderr as the error.
pub fn try_run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The container of a compose service.
pub fn container(service: &str) -> String {
    compose(&["ps", "-aq", service])
}

/// A compose network by its name in the file.
pub fn network(name: &str) -> String {
    let project = std::env::var("COMPOSE_PROJECT_NAME").unwrap_or_else(|_| "timeoutd-ci".into());
    format!("{project}_{name}")
}

pub fn healthy(service: &str) -> bool {
    let id = container(service);
    !id.is_empty()
        && try_run(
            "docker",
            &["inspect", "-f", "{{.State.Health.Status}}", &id],
        )
        .as_deref()
            == Ok("healthy")
}

pub async fn status(port: u16) -> Option<serde_json::Value> {
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

pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut cond: F)
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

impl Stack {
    /// The replica that is active now, with its node id: exactly one must say so.
    pub async fn the_active(&self) -> Option<(&'static str, Uuid)> {
        let mut active = Vec::new();
        for &(service, port) in self.replicas {
            if let Some(s) = status(port).await
                && s["role"] == "active"
            {
                let id = s["node_id"].as_str()?.parse().ok()?;
                active.push((service, id));
            }
        }
        (active.len() == 1).then(|| active[0])
    }

    /// Everything running and healthy, exactly one replica active: the state each
    /// scenario starts from and must return to.
    pub async fn settled(&self) -> (&'static str, Uuid) {
        wait_until(
            Duration::from_secs(180),
            "the infrastructure healthy",
            || async { (self.infra_settled)() },
        )
        .await;
        wait_until(Duration::from_secs(120), "healthy replicas", || async {
            self.replicas.iter().all(|(s, _)| healthy(s))
        })
        .await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(found) = self.the_active().await {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "timed out: exactly one active replica"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The first broker URL that accepts a connection, starting at a random one (and
    /// skipping the one [`avoid_broker`] names).
    pub async fn broker(&self) -> Option<Connection> {
        let start = rand::random_range(0..self.amqp.len());
        let avoid = *AVOID.lock().expect("lock");
        for i in 0..self.amqp.len() {
            let index = (start + i) % self.amqp.len();
            if avoid == Some(index) {
                continue;
            }
            let url = self.amqp[index];
            let connect = Connection::connect(url, ConnectionProperties::default());
            if let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(5), connect).await {
                return Some(conn);
            }
        }
        None
    }

    fn queue_args(&self) -> FieldTable {
        let mut args = FieldTable::default();
        if self.quorum_queues {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args
    }

    pub async fn drop_queue(&self, queue: &str) {
        if let Some(conn) = self.broker().await {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.queue_delete(queue.into(), Default::default()).await;
            }
            let _ = conn.close(200, "done".into()).await;
        }
    }
}

/// The broker URL (by its index in [`Stack::amqp`]) that the test's own consumers and
/// publishers must not use: a node about to be partitioned keeps its connections in
/// RabbitMQ 4.3, and a consumer there would see nothing the daemons deliver meanwhile.
static AVOID: Mutex<Option<usize>> = Mutex::new(None);

pub fn avoid_broker(index: Option<usize>) {
    *AVOID.lock().expect("lock") = index;
}

/// The database as the test's load and audit use it: the first of the stack's URLs
/// whose server takes writes, found again after an error (a failover).
pub struct Db {
    urls: &'static [&'static str],
    current: Mutex<Option<PgPool>>,
}

impl Db {
    pub fn new(urls: &'static [&'static str]) -> Arc<Self> {
        Arc::new(Self {
            urls,
            current: Mutex::new(None),
        })
    }

    /// The pool of the server that takes writes, if one does now.
    pub async fn pool(&self) -> Option<PgPool> {
        if let Some(pool) = self.current.lock().expect("lock").clone() {
            return Some(pool);
        }
        for url in self.urls {
            let Ok(pool) = PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(2))
                .connect_lazy(url)
            else {
                continue;
            };
            let writable = sqlx::query_scalar::<_, bool>(
                "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'",
            )
            .fetch_one(&pool);
            if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(3), writable).await {
                *self.current.lock().expect("lock") = Some(pool.clone());
                return Some(pool);
            }
            pool.close().await;
        }
        None
    }

    /// After an error: the next use looks for the server that takes writes again.
    pub fn forget(&self) {
        if let Some(pool) = self.current.lock().expect("lock").take() {
            tokio::spawn(async move { pool.close().await });
        }
    }
}

/// One received message (a TimeOut or a delayed message).
#[derive(Debug, Clone)]
pub struct Got {
    pub at: DateTime<Utc>,
    pub sender: String,
}

/// A durable queue of the scenario's own on the stack's broker (bound to the delayed
/// messages' target exchange with its own name as the key), consumed with acks and
/// re-consumed after a connection loss; a redelivery of something already recorded (an
/// ack lost with the connection) is the consumer's duplicate, not the daemon's.
pub struct Consumer {
    pub queue: String,
    got: Arc<Mutex<HashMap<String, Vec<Got>>>>,
    pub stop: CancellationToken,
}

impl Consumer {
    pub async fn start(stack: &'static Stack, queue: &str) -> Self {
        let got = Arc::new(Mutex::new(HashMap::new()));
        let stop = CancellationToken::new();
        let first = connect_consumer(stack, queue)
            .await
            .expect("consumer connects");
        tokio::spawn(consume(
            stack,
            queue.to_owned(),
            first,
            got.clone(),
            stop.clone(),
        ));
        Self {
            queue: queue.to_owned(),
            got,
            stop,
        }
    }

    pub fn snapshot(&self) -> HashMap<String, Vec<Got>> {
        self.got.lock().expect("lock").clone()
    }
}

async fn connect_consumer(stack: &Stack, queue: &str) -> Option<(Connection, lapin::Consumer)> {
    let conn = stack.broker().await?;
    let ch = conn.create_channel().await.ok()?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(queue.into(), durable, stack.queue_args())
        .await
        .ok()?;
    if stack.delay_exchange.is_some() {
        ch.queue_bind(
            queue.into(),
            "timeoutd.delayed".into(),
            queue.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .ok()?;
    }
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
    stack: &'static Stack,
    queue: String,
    first: (Connection, lapin::Consumer),
    got: Arc<Mutex<HashMap<String, Vec<Got>>>>,
    stop: CancellationToken,
) {
    let mut current = Some(first);
    while !stop.is_cancelled() {
        let Some((_conn, mut consumer)) = current.take() else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            current = connect_consumer(stack, &queue).await;
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

/// What the load sent: each message's id and the time before which it must not arrive.
/// A send whose outcome is unknown (the database or the broker went away) is kept as
/// "maybe": it counts if it arrived or is still stored.
#[derive(Default, Clone)]
pub struct Sent {
    pub due: HashMap<String, DateTime<Utc>>,
    pub maybe: Vec<String>,
}

/// The steady load: RATE expectations a second, each due AHEAD later, routed to the
/// consumer's queue; and, with a delay ingress, DELAYED_RATE delayed messages a second
/// with `x-delay` AHEAD, delivered to the same queue.
pub struct Load {
    timeouts: Arc<Mutex<Sent>>,
    delayed: Arc<Mutex<Sent>>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(stack: &'static Stack, db: Arc<Db>, scenario: &str, queue: &str) -> Self {
        let timeouts = Arc::new(Mutex::new(Sent::default()));
        let delayed = Arc::new(Mutex::new(Sent::default()));
        let stop = CancellationToken::new();
        let mut tasks = vec![tokio::spawn(insert_steadily(
            stack.schema,
            db,
            scenario.to_owned(),
            queue.to_owned(),
            timeouts.clone(),
            stop.clone(),
        ))];
        if let Some(exchange) = stack.delay_exchange {
            tasks.push(tokio::spawn(publish_steadily(
                stack,
                exchange,
                queue.to_owned(),
                delayed.clone(),
                stop.clone(),
            )));
        }
        Self {
            timeouts,
            delayed,
            stop,
            tasks,
        }
    }

    /// Stop sending: what was sent, TimeOuts then delayed messages.
    pub async fn stop(self) -> (Sent, Sent) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        let timeouts = self.timeouts.lock().expect("lock").clone();
        let delayed = self.delayed.lock().expect("lock").clone();
        (timeouts, delayed)
    }
}

async fn insert_steadily(
    schema: &'static str,
    db: Arc<Db>,
    scenario: String,
    queue: String,
    sent: Arc<Mutex<Sent>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let sql = format!(
        "INSERT INTO {schema}.expected_messages \
         (id, process_id, message_type, timeout_at, exchange, routing_key) \
         VALUES ($1, $2, 'Reply', $3, '', $4)"
    );
    let mut n = 0u64;
    while !stop.is_cancelled() {
        tick.tick().await;
        // No server takes writes now: nothing sent.
        let Some(pool) = db.pool().await else {
            continue;
        };
        n += 1;
        let id = Uuid::new_v4();
        let due = Utc::now() + chrono::Duration::from_std(AHEAD).expect("duration");
        // The schema is the stack's own constant, never input.
        let insert = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .bind(id)
            .bind(format!("{scenario}-{n}"))
            .bind(due)
            .bind(&queue)
            .execute(&pool);
        let outcome = tokio::time::timeout(Duration::from_secs(2), insert).await;
        let mut sent = sent.lock().expect("lock");
        match outcome {
            Ok(Ok(_)) => {
                sent.due.insert(id.to_string(), due);
            }
            // Refused before it reached the database: nothing to expect.
            Ok(Err(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))) => db.forget(),
            _ => {
                db.forget();
                sent.maybe.push(id.to_string());
                sent.due.insert(id.to_string(), due);
            }
        }
    }
}

/// Delayed messages with publisher confirms, through whichever broker node accepts a
/// connection: a confirmed one must arrive, one whose confirm never came may.
async fn publish_steadily(
    stack: &'static Stack,
    exchange: &'static str,
    queue: String,
    sent: Arc<Mutex<Sent>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / DELAYED_RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut channel: Option<(Connection, lapin::Channel)> = None;
    while !stop.is_cancelled() {
        tick.tick().await;
        if channel
            .as_ref()
            .is_none_or(|(c, ch)| !c.status().connected() || !ch.status().connected())
        {
            channel = None;
            if let Some(conn) = stack.broker().await
                && let Ok(ch) = conn.create_channel().await
                && ch
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .is_ok()
            {
                channel = Some((conn, ch));
            }
        }
        let Some((_, ch)) = &channel else { continue };
        let id = format!("{DELAYED}{}", Uuid::new_v4());
        let mut headers = FieldTable::default();
        let delay_ms = i64::try_from(AHEAD.as_millis()).expect("delay");
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        // Due no earlier than the broker could have had it: its delay counts from when a
        // daemon stored it, later than this.
        let due = Utc::now() + chrono::Duration::from_std(AHEAD).expect("duration");
        let publish = async {
            let confirm = ch
                .basic_publish(
                    exchange.into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    id.as_bytes(),
                    props,
                )
                .await?;
            confirm.await
        };
        let outcome = tokio::time::timeout(Duration::from_secs(5), publish).await;
        let mut sent = sent.lock().expect("lock");
        match outcome {
            Ok(Ok(confirm)) if confirm.is_ack() => {
                sent.due.insert(id, due);
            }
            // Refused by the broker: nothing to expect.
            Ok(Ok(_)) => {}
            _ => {
                channel = None;
                sent.maybe.push(id.clone());
                sent.due.insert(id, due);
            }
        }
    }
}

/// What one kind of message measured in one scenario.
#[derive(Debug, Default)]
pub struct Counts {
    pub sent: usize,
    pub lost: usize,
    pub early: usize,
    pub duplicates: usize,
    /// Each message's first copy after its due time: the 99th percentile and the latest.
    pub late_p99: Duration,
    pub late_max: Duration,
    /// Of the duplicates, those sent by the node that sent the first copy (a retry after
    /// an unknown outcome) rather than by another (a takeover).
    pub same_node: usize,
    /// The longest time between a message's first copy and its last.
    pub dup_spread: Duration,
}

impl Counts {
    /// `N` or `N (K by the same node, copies up to S apart)`.
    fn duplicates(&self) -> String {
        if self.duplicates == 0 {
            return "0".to_owned();
        }
        format!(
            "{} ({} by the same node, copies up to {:.2}s apart)",
            self.duplicates,
            self.same_node,
            self.dup_spread.as_secs_f64()
        )
    }
}

/// What one scenario measured.
#[derive(Debug)]
pub struct Audit {
    pub timeouts: Counts,
    pub delayed: Counts,
    pub longest_gap: Duration,
    /// From the fault to the first TimeOut sent by another node than the victim.
    pub successor: Option<Duration>,
}

/// Run `fault` against the stack under the steady load and audit it: nothing lost or
/// early, nothing later than `limit`, and no gap in the arrivals longer than it. Prints
/// one summary line; `cause` says why duplicates may happen (CONTRACT.md section 6).
pub async fn scenario<F, Fut>(
    stack: &'static Stack,
    name: &str,
    cause: &str,
    limit: Duration,
    fault: F,
) -> Audit
where
    F: FnOnce((&'static str, Uuid)) -> Fut,
    Fut: Future<Output = ()>,
{
    let victim = stack.settled().await;
    let db = Db::new(stack.pg);
    let queue = format!("e2e-{name}-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let consumer = Consumer::start(stack, &queue).await;
    let load = Load::start(stack, db.clone(), name, &queue);
    // A few seconds of normal flow first.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let fault_at = Utc::now();
    let started = Instant::now();
    fault(victim).await;
    let fault_took = started.elapsed();
    // The stack is back (the fault restores it): a few more seconds of load.
    stack.settled().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (timeouts, delayed) = load.stop().await;
    let mut audit = audit(stack, name, &consumer, &db, &timeouts, &delayed, fault_at).await;
    audit.successor = first_from_another(&consumer.snapshot(), victim.1, fault_at);
    let successor = audit
        .successor
        .map_or("-".to_owned(), |d| format!("{:.2}s", d.as_secs_f64()));
    let t = &audit.timeouts;
    let mut line = format!(
        "{} scenario={name} rows={} lost={} early={} duplicates={} (same message_id; \
         cause: {cause}) lateness_p99={:.2}s latest_row={:.2}s (limit {:.2}s) \
         longest_gap_without_timeouts={:.2}s first_timeout_from_another_node={successor}",
        stack.label,
        t.sent,
        t.lost,
        t.early,
        t.duplicates(),
        t.late_p99.as_secs_f64(),
        t.late_max.as_secs_f64(),
        limit.as_secs_f64(),
        audit.longest_gap.as_secs_f64()
    );
    if stack.delay_exchange.is_some() {
        let d = &audit.delayed;
        line += &format!(
            " delayed: sent={} lost={} early={} duplicates={} lateness_p99={:.2}s latest={:.2}s",
            d.sent,
            d.lost,
            d.early,
            d.duplicates(),
            d.late_p99.as_secs_f64(),
            d.late_max.as_secs_f64()
        );
    }
    line += &format!(" fault_took={:.1}s", fault_took.as_secs_f64());
    println!("{line}");
    consumer.stop.cancel();
    stack.drop_queue(&consumer.queue).await;
    db.forget();
    for (kind, c) in [("timeouts", &audit.timeouts), ("delayed", &audit.delayed)] {
        assert_eq!(c.lost, 0, "{name}: {kind} lost: {audit:?}");
        assert_eq!(c.early, 0, "{name}: {kind} early: {audit:?}");
        assert!(
            c.late_max <= limit,
            "{name}: a {kind} message waited {:?} (limit {limit:?}): {audit:?}",
            c.late_max
        );
    }
    assert!(
        audit.longest_gap <= limit,
        "{name}: {audit:?} (limit {limit:?})"
    );
    audit
}

async fn audit(
    stack: &Stack,
    name: &str,
    consumer: &Consumer,
    db: &Db,
    timeouts: &Sent,
    delayed: &Sent,
    fault_at: DateTime<Utc>,
) -> Audit {
    let prefix = format!("{name}-%");
    let left_sql = format!(
        "SELECT (SELECT count(*) FROM {s}.expected_messages WHERE process_id LIKE $1) \
              + (SELECT count(*) FROM {s}.delayed_messages WHERE routing_key = $2)",
        s = stack.schema
    );
    // Everything fired (none of the scenario's left), every certain one received. Past
    // the limit, what is missing is named: rows still in the tables, certain messages
    // not received (by kind, with a few ids).
    let limit = Duration::from_secs(120);
    let deadline = Instant::now() + limit;
    loop {
        let left: Option<i64> = match db.pool().await {
            Some(pool) => {
                let left = sqlx::query_scalar(sqlx::AssertSqlSafe(left_sql.as_str()))
                    .bind(&prefix)
                    .bind(&consumer.queue)
                    .fetch_one(&pool)
                    .await;
                if left.is_err() {
                    db.forget();
                }
                left.ok()
            }
            None => None,
        };
        let got = consumer.snapshot();
        let missing: Vec<(&str, Vec<&String>)> = [("TimeOuts", timeouts), ("delayed", delayed)]
            .into_iter()
            .map(|(kind, sent)| {
                let ids = sent
                    .due
                    .keys()
                    .filter(|id| !sent.maybe.contains(*id) && !got.contains_key(*id))
                    .collect();
                (kind, ids)
            })
            .collect();
        if left == Some(0) && missing.iter().all(|(_, ids)| ids.is_empty()) {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> = missing
                .iter()
                .map(|(kind, ids)| {
                    let some: Vec<&&String> = ids.iter().take(5).collect();
                    format!("{kind}: {} not received (e.g. {some:?})", ids.len())
                })
                .collect();
            panic!(
                "{name}: timed out after {limit:?}: the scenario's rows all fired and every \
                 certain message arrived; rows left in the tables: {left:?}; {}",
                missing.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = consumer.snapshot();
    Audit {
        timeouts: count(timeouts, &got),
        delayed: count(delayed, &got),
        longest_gap: longest_gap(&got, fault_at),
        successor: None,
    }
}

/// Lost, early, duplicates and lateness of what was sent, against what arrived.
fn count(sent: &Sent, got: &HashMap<String, Vec<Got>>) -> Counts {
    let mut c = Counts::default();
    let mut lateness = Vec::new();
    for (id, due) in &sent.due {
        let copies = got.get(id).map(Vec::as_slice).unwrap_or_default();
        if copies.is_empty() && sent.maybe.contains(id) {
            continue;
        }
        c.sent += 1;
        c.lost += usize::from(copies.is_empty());
        c.early += copies.iter().filter(|g| g.at < *due).count();
        c.duplicates += copies.len().saturating_sub(1);
        if let [first, rest @ ..] = copies {
            c.same_node += rest.iter().filter(|g| g.sender == first.sender).count();
            if let Some(last) = rest.iter().map(|g| g.at).max() {
                let spread = (last - first.at).to_std().unwrap_or_default();
                c.dup_spread = c.dup_spread.max(spread);
            }
        }
        if let Some(first) = copies.iter().map(|g| g.at).min() {
            lateness.push((first - *due).to_std().unwrap_or_default());
        }
    }
    lateness.sort();
    if let Some(max) = lateness.last() {
        c.late_max = *max;
        c.late_p99 = lateness[lateness.len() * 99 / 100];
    }
    c
}

/// From `from` to the first TimeOut that a node other than `victim` sent after it.
fn first_from_another(
    got: &HashMap<String, Vec<Got>>,
    victim: Uuid,
    from: DateTime<Utc>,
) -> Option<Duration> {
    let victim = victim.to_string();
    let first = got
        .iter()
        .filter(|(id, _)| !id.starts_with(DELAYED))
        .flat_map(|(_, copies)| copies)
        .filter(|g| g.at >= from && g.sender != victim)
        .map(|g| g.at)
        .min()?;
    (first - from).to_std().ok()
}

/// The longest time after the fault with nothing arriving, while messages kept coming
/// due.
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
