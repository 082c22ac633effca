//! Randomized, adversarial mixes of rows in large concurrent batches, checked from the
//! outside: what a consumer received and what stays in the table.
//!
//! Each case draws a few hundred rows of every kind at random — routable (topic exchange
//! and default exchange), unroutable, missing exchange, internal exchange, payloads that a
//! JSON library refuses (numbers beyond f64, nesting deeper than 128), large payloads
//! (fetched one by one) and payloads over `amqp.max_message_size`, ±infinity and far-past deadlines, a process id over 255 bytes,
//! an exchange our broker user may not write to, `attempts` at `i32::MAX`, a row whose old retry time is earlier than its moved
//! deadline, a row the process manager's foreign key will not let go, and rows moved or
//! cancelled by the process manager while their batch may be in flight — and runs them
//! through two daemons with `scan.concurrency = 3` and small batches, into durable or
//! transient queues. Then it checks every row against the contract:
//! - every deliverable row arrives exactly once (no fault is injected here, so no
//!   duplicate is allowed), with its payload byte for byte;
//! - nothing arrives before its deadline (the moved one for a moved row);
//! - every row that cannot be delivered is never received, stays in the table with
//!   `attempts >= 1` and `last_error`, and is listed by `pending --failing`;
//! - a row cancelled in time (DELETE said 1) never arrives; one too late (0) arrives once;
//! - the row the foreign key keeps arrives once and is parked (never fired again).
//!
//! `ADVERSARIAL_CASES` (default 2), `ADVERSARIAL_ROWS` (default 300) and
//! `ADVERSARIAL_SEED` (default: fixed seeds) widen it by hand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::AssertSqlSafe;
use timeoutd::store::{PendingFilter, Store};
use uuid::Uuid;

use crate::common::{PATIENCE, World, amqp, wait_for, wait_for_async};

/// A small limit so that "too large" rows are cheap to make; above the 64 KiB a row
/// carries inline, so that large payloads take the daemon's one-by-one path.
const MAX_MESSAGE: usize = 256 * 1024;
/// The daemons connect as a user that may not write to exchanges named like this.
const DENIED_PREFIX: &str = "adv-denied-";
const USER: &str = "timeoutd_adversarial";

/// A broker user like guest but without write permission on `DENIED_PREFIX*` exchanges
/// (a publish there is refused with 403 ACCESS_REFUSED, closing the channel). Returns the
/// AMQP URL that logs in as that user.
async fn limited_user() -> String {
    let write = format!("^(?!{DENIED_PREFIX}).*");
    let steps: [&[&str]; 2] = [
        &["add_user", USER, USER],
        &["set_permissions", "-p", "/", USER, ".*", &write, ".*"],
    ];
    for args in steps {
        let out = crate::common::rabbitmqctl()
            .arg("-q")
            .args(args)
            .output()
            .await
            .expect("rabbitmqctl runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || err.contains("already exists"),
            "rabbitmqctl {args:?}: {err}"
        );
    }
    format!("amqp://{USER}:{USER}@{}/%2f", crate::common::amqp_addr())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Topic,
    DefaultExchange,
    Unroutable,
    MissingExchange,
    InternalExchange,
    DeniedExchange,
    HugeNumber,
    DeepNesting,
    LargePayload,
    TooLarge,
    Infinity,
    MinusInfinity,
    MaxAttemptsRoutable,
    MaxAttemptsUnroutable,
    LongProcessId,
    MovedAfterFailure,
    ForeignKey,
    Rescheduled,
    Cancelled,
}

/// Weighted draw: most rows are ordinary, every kind appears in a few hundred rows.
const KINDS: &[(Kind, u32)] = &[
    (Kind::Topic, 30),
    (Kind::DefaultExchange, 10),
    (Kind::Unroutable, 6),
    (Kind::MissingExchange, 4),
    (Kind::InternalExchange, 3),
    (Kind::DeniedExchange, 3),
    (Kind::HugeNumber, 4),
    (Kind::DeepNesting, 3),
    (Kind::LargePayload, 3),
    (Kind::TooLarge, 3),
    (Kind::Infinity, 2),
    (Kind::MinusInfinity, 2),
    (Kind::MaxAttemptsRoutable, 2),
    (Kind::MaxAttemptsUnroutable, 2),
    (Kind::LongProcessId, 2),
    (Kind::MovedAfterFailure, 3),
    (Kind::ForeignKey, 1),
    (Kind::Rescheduled, 6),
    (Kind::Cancelled, 6),
];

impl Kind {
    fn draw(rng: &mut StdRng) -> Self {
        let total: u32 = KINDS.iter().map(|(_, w)| w).sum();
        let mut pick = rng.random_range(0..total);
        for (kind, w) in KINDS {
            if pick < *w {
                return *kind;
            }
            pick -= w;
        }
        Kind::Topic
    }

    /// What `last_error` of an undeliverable row must say.
    fn reason(self) -> &'static str {
        match self {
            Kind::Unroutable | Kind::MaxAttemptsUnroutable => "NO_ROUTE",
            Kind::MissingExchange => "does not exist",
            Kind::InternalExchange | Kind::DeniedExchange => "ACCESS_REFUSED",
            Kind::TooLarge => "is over the limit of",
            Kind::LongProcessId => "longer than 255 bytes",
            _ => "",
        }
    }

    /// Rows that can never be delivered: they must stay, failing, never received.
    fn undeliverable(self) -> bool {
        matches!(
            self,
            Kind::Unroutable
                | Kind::MissingExchange
                | Kind::InternalExchange
                | Kind::DeniedExchange
                | Kind::TooLarge
                | Kind::MaxAttemptsUnroutable
                | Kind::LongProcessId
        )
    }
}

/// One planned row.
#[derive(Debug, Clone)]
struct Row {
    id: Uuid,
    kind: Kind,
    process_id: String,
    /// `timeout_at` as Postgres text (may be 'infinity').
    timeout_at: String,
    /// Deadline for the "never early" check; `None` = never due.
    deadline: Option<DateTime<Utc>>,
    exchange: String,
    routing_key: String,
    payload: Option<String>,
    attempts: i32,
    retry_at: Option<DateTime<Utc>>,
}

/// What the process manager did to a row while it was due.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// UPDATE … SET timeout_at = new: rows affected, the new deadline.
    Moved(u64, DateTime<Utc>),
    /// DELETE: rows affected.
    Deleted(u64),
}

/// Names of one case's RabbitMQ objects.
struct Topology {
    exchange: String,
    internal: String,
    denied: String,
    missing: String,
    queue: String,
    durable: bool,
}

struct Case {
    world: World,
    topo: Topology,
    rows: Vec<Row>,
    rng: StdRng,
}

fn ms(n: i64) -> chrono::Duration {
    chrono::Duration::milliseconds(n)
}

impl Case {
    fn plan(world: World, seed: u64, n: usize, durable: bool) -> Self {
        let tag = world.group.clone();
        let topo = Topology {
            exchange: format!("adv-{tag}"),
            internal: format!("adv-internal-{tag}"),
            denied: format!("{DENIED_PREFIX}{tag}"),
            missing: format!("adv-missing-{tag}"),
            queue: format!("adv-q-{tag}"),
            durable,
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let now = Utc::now();
        let rows = (0..n).map(|i| plan_row(&mut rng, &topo, i, now)).collect();
        Self {
            world,
            topo,
            rows,
            rng,
        }
    }

    async fn insert(&self) {
        let t = format!("{}.expected_messages", self.world.schema);
        let sql = format!(
            "INSERT INTO {t} (id, process_id, message_type, timeout_at, exchange, routing_key, \
             payload, attempts, retry_at) \
             SELECT id, p, 'Reply', at::timestamptz, x, k, pl::jsonb, a, r FROM unnest(\
             $1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
             $7::int4[], $8::timestamptz[]) AS u(id, p, at, x, k, pl, a, r)"
        );
        let col = |f: fn(&Row) -> String| self.rows.iter().map(f).collect::<Vec<_>>();
        sqlx::query(AssertSqlSafe(sql))
            .bind(self.rows.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(col(|r| r.process_id.clone()))
            .bind(col(|r| r.timeout_at.clone()))
            .bind(col(|r| r.exchange.clone()))
            .bind(col(|r| r.routing_key.clone()))
            .bind(
                self.rows
                    .iter()
                    .map(|r| r.payload.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(self.rows.iter().map(|r| r.attempts).collect::<Vec<_>>())
            .bind(self.rows.iter().map(|r| r.retry_at).collect::<Vec<_>>())
            .execute(&self.world.pool)
            .await
            .expect("insert rows");
        self.hold_with_foreign_key().await;
    }

    /// The process manager's own table references some expectations; deleting those
    /// fails (ON DELETE RESTRICT, checked at once or deferred to commit).
    async fn hold_with_foreign_key(&self) {
        let s = &self.world.schema;
        for (name, deferral) in [
            ("pm_refs", ""),
            ("pm_refs_deferred", "DEFERRABLE INITIALLY DEFERRED"),
        ] {
            let ddl = format!(
                "CREATE TABLE {s}.{name} (exp uuid REFERENCES {s}.expected_messages(id) \
                 ON DELETE RESTRICT {deferral})"
            );
            sqlx::query(AssertSqlSafe(ddl))
                .execute(&self.world.pool)
                .await
                .expect("pm table");
        }
        for (i, row) in self.of(Kind::ForeignKey).enumerate() {
            let table = if i % 2 == 0 {
                "pm_refs"
            } else {
                "pm_refs_deferred"
            };
            let sql = format!("INSERT INTO {s}.{table} VALUES ($1)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(row.id)
                .execute(&self.world.pool)
                .await
                .expect("reference");
        }
    }

    fn of(&self, kind: Kind) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(move |r| r.kind == kind)
    }

    /// Move or cancel the rows of those kinds around their deadline, as a process manager
    /// would when the awaited message arrives at the last moment.
    fn act_in_flight(&mut self) -> Vec<tokio::task::JoinHandle<(Uuid, Action)>> {
        let mut tasks = Vec::new();
        let targets: Vec<Row> = self
            .rows
            .iter()
            .filter(|r| matches!(r.kind, Kind::Rescheduled | Kind::Cancelled))
            .cloned()
            .collect();
        for row in targets {
            let deadline = row.deadline.expect("finite");
            let at = deadline + ms(self.rng.random_range(-60..120));
            let move_to = self.rng.random_range(800..2000);
            let pool = self.world.pool.clone();
            let table = format!("{}.expected_messages", self.world.schema);
            tasks.push(tokio::spawn(async move {
                let wait = (at - Utc::now()).to_std().unwrap_or_default();
                tokio::time::sleep(wait).await;
                let action = if row.kind == Kind::Cancelled {
                    let sql = format!("DELETE FROM {table} WHERE id = $1");
                    let done = sqlx::query(AssertSqlSafe(sql))
                        .bind(row.id)
                        .execute(&pool)
                        .await;
                    Action::Deleted(done.expect("delete").rows_affected())
                } else {
                    // A plain UPDATE, as a process manager that knows only the contract's
                    // columns writes it (any retry_at stays behind).
                    let sql = format!(
                        "UPDATE {table} SET timeout_at = now() + make_interval(secs => $2) \
                         WHERE id = $1 RETURNING timeout_at"
                    );
                    let moved: Option<DateTime<Utc>> = sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(row.id)
                        .bind(move_to as f64 / 1000.0)
                        .fetch_optional(&pool)
                        .await
                        .expect("update");
                    match moved {
                        Some(new) => Action::Moved(1, new),
                        None => Action::Moved(0, deadline),
                    }
                };
                (row.id, action)
            }));
        }
        tasks
    }
}

fn plan_row(rng: &mut StdRng, topo: &Topology, i: usize, now: DateTime<Utc>) -> Row {
    let kind = Kind::draw(rng);
    // Most rows come due over the next 2.5 s, in bursts; some are already overdue.
    let due = now + ms(rng.random_range(-2000..2500));
    let mut row = Row {
        id: Uuid::new_v4(),
        kind,
        process_id: format!("adv-{i}"),
        timeout_at: due.to_rfc3339(),
        deadline: Some(due),
        exchange: topo.exchange.clone(),
        routing_key: format!("ok.{i}"),
        payload: Some(format!(r#"{{"i": {i}, "kind": "{kind:?}"}}"#)),
        attempts: 0,
        retry_at: None,
    };
    match kind {
        Kind::Topic | Kind::Rescheduled | Kind::Cancelled | Kind::ForeignKey => {}
        Kind::DefaultExchange => {
            row.exchange = String::new();
            row.routing_key = topo.queue.clone();
        }
        Kind::Unroutable => row.routing_key = format!("nowhere.{i}"),
        Kind::MissingExchange => row.exchange = topo.missing.clone(),
        Kind::InternalExchange => row.exchange = topo.internal.clone(),
        Kind::DeniedExchange => row.exchange = topo.denied.clone(),
        Kind::HugeNumber => row.payload = Some(format!(r#"{{"big": 1e400, "i": {i}}}"#)),
        Kind::DeepNesting => {
            let depth = rng.random_range(130..400);
            row.payload = Some(format!("{}{i}{}", "[".repeat(depth), "]".repeat(depth)));
        }
        Kind::TooLarge => row.payload = Some(format!(r#""{}""#, "x".repeat(MAX_MESSAGE + 10))),
        Kind::LargePayload => {
            let size = rng.random_range(70 * 1024..MAX_MESSAGE - 1024);
            row.payload = Some(format!(r#"{{"i": {i}, "blob": "{}"}}"#, "y".repeat(size)));
        }
        Kind::Infinity => {
            row.timeout_at = "infinity".into();
            row.deadline = None;
        }
        Kind::MinusInfinity => {
            row.timeout_at = "-infinity".into();
            row.deadline = Some(DateTime::<Utc>::MIN_UTC);
        }
        Kind::MaxAttemptsRoutable => row.attempts = i32::MAX,
        Kind::MaxAttemptsUnroutable => {
            row.attempts = i32::MAX - rng.random_range(0..2);
            row.routing_key = format!("nowhere.{i}");
        }
        Kind::LongProcessId => row.process_id = "p".repeat(300),
        Kind::MovedAfterFailure => {
            // It failed once (retry_at set, long past) and its deadline was moved later
            // with a plain UPDATE: it must wait for the new deadline.
            let later = now + ms(rng.random_range(1500..3000));
            row.timeout_at = later.to_rfc3339();
            row.deadline = Some(later);
            row.attempts = 1;
            row.retry_at = Some(now - ms(5000));
        }
    }
    row
}

/// One received message: when, its id, its raw body.
#[derive(Debug, Clone)]
struct Got {
    at: DateTime<Utc>,
    id: String,
    body: Vec<u8>,
}

/// The case's consumer queue (durable or not), bound to the topic exchange with `ok.#`,
/// acknowledging what it took.
struct Consumer {
    got: Arc<Mutex<Vec<Got>>>,
    conn: Connection,
}

impl Consumer {
    async fn start(topo: &Topology) -> Self {
        let conn = amqp().await;
        let ch = conn.create_channel().await.expect("channel");
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let internal = ExchangeDeclareOptions {
            internal: true,
            ..ExchangeDeclareOptions::default()
        };
        for (name, opts) in [
            (&topo.exchange, durable),
            (&topo.internal, internal),
            (&topo.denied, durable),
        ] {
            ch.exchange_declare(
                name.as_str().into(),
                ExchangeKind::Topic,
                opts,
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        }
        let queue = QueueDeclareOptions {
            durable: topo.durable,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(topo.queue.as_str().into(), queue, FieldTable::default())
            .await
            .expect("queue");
        ch.queue_bind(
            topo.queue.as_str().into(),
            topo.exchange.as_str().into(),
            "ok.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
        let mut consumer = ch
            .basic_consume(
                topo.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                sink.lock().expect("lock").push(Got {
                    at: Utc::now(),
                    id,
                    body: d.data.clone(),
                });
                let _ = d.ack(BasicAckOptions::default()).await;
            }
        });
        Self { got, conn }
    }

    fn counts(&self) -> HashMap<String, Vec<Got>> {
        let mut m: HashMap<String, Vec<Got>> = HashMap::new();
        for g in self.got.lock().expect("lock").iter() {
            m.entry(g.id.clone()).or_default().push(g.clone());
        }
        m
    }

    async fn remove(self, topo: &Topology) {
        let ch = self.conn.create_channel().await.expect("channel");
        let _ = ch
            .queue_delete(topo.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        for x in [&topo.exchange, &topo.internal, &topo.denied] {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
        let _ = self.conn.close(200, "done".into()).await;
    }
}

/// What the table holds for one row after the case.
#[derive(Debug, sqlx::FromRow)]
struct Left {
    id: Uuid,
    attempts: i32,
    last_error: Option<String>,
    parked: bool,
}

async fn leftovers(world: &World) -> HashMap<Uuid, Left> {
    let sql = format!(
        "SELECT id, attempts, last_error, coalesce(retry_at = 'infinity', false) AS parked \
         FROM {}.expected_messages",
        world.schema
    );
    sqlx::query_as::<_, Left>(AssertSqlSafe(sql))
        .fetch_all(&world.pool)
        .await
        .expect("left rows")
        .into_iter()
        .map(|l| (l.id, l))
        .collect()
}

/// Each payload as Postgres prints it: what a TimeOut must carry, byte for byte.
async fn printed_payloads(world: &World) -> HashMap<Uuid, String> {
    let sql = format!(
        "SELECT id, payload::text FROM {}.expected_messages WHERE payload IS NOT NULL",
        world.schema
    );
    sqlx::query_as::<_, (Uuid, String)>(AssertSqlSafe(sql))
        .fetch_all(&world.pool)
        .await
        .expect("payloads")
        .into_iter()
        .collect()
}

/// How many copies of a row may arrive, and when at the earliest.
struct Copies {
    count: std::ops::RangeInclusive<usize>,
    /// No copy before this (`None` with a count of 0).
    not_before: Option<DateTime<Utc>>,
    /// The last copy not before this (a moved deadline).
    last_not_before: Option<DateTime<Utc>>,
}

impl Copies {
    /// From the row's kind and what the process manager did. With a fault injected (the
    /// active node's database sessions killed) the contract allows a second copy of a
    /// deliverable row: it may have been published by a batch whose session, and with
    /// it the row locks, died before the commit. For the same reason a cancel or a move
    /// may then win against a TimeOut already out.
    fn of(row: &Row, act: Option<&Action>, faulty: bool) -> Self {
        let extra = usize::from(faulty);
        let at = |d, count| Self {
            count,
            not_before: d,
            last_not_before: d,
        };
        match (row.kind, act) {
            (Kind::Infinity, _) => at(None, 0..=0),
            (k, _) if k.undeliverable() => at(None, 0..=0),
            (Kind::Cancelled, Some(Action::Deleted(1))) => at(row.deadline, 0..=extra),
            (Kind::Rescheduled, Some(Action::Moved(1, new))) => Self {
                count: 1..=1 + extra,
                not_before: if faulty { row.deadline } else { Some(*new) },
                last_not_before: Some(*new),
            },
            _ => at(row.deadline, 1..=1 + extra),
        }
    }
}

/// The checker: every row's fate against the contract. Returns a one-line summary.
fn check(
    case: &Case,
    printed: &HashMap<Uuid, String>,
    got: &HashMap<String, Vec<Got>>,
    left: &HashMap<Uuid, Left>,
    acts: &HashMap<Uuid, Action>,
    faulty: bool,
) -> String {
    let (mut delivered, mut kept, mut duplicates) = (0, 0, 0);
    for row in &case.rows {
        let id = row.id.to_string();
        let received = got.get(&id).map(Vec::as_slice).unwrap_or_default();
        let what = format!(
            "{:?} row {id}: received {}, left {:?}",
            row.kind,
            received.len(),
            left.get(&row.id)
        );
        let rule = Copies::of(row, acts.get(&row.id), faulty);
        assert!(
            rule.count.contains(&received.len()),
            "copies {:?}: {what}",
            rule.count
        );
        for (n, copy) in received.iter().enumerate() {
            let last = n + 1 == received.len();
            let not_before = if last {
                rule.last_not_before
            } else {
                rule.not_before
            };
            let early = not_before.is_none_or(|d| copy.at < d);
            assert!(
                !early,
                "early: {what} at {} not before {not_before:?}",
                copy.at
            );
            // Byte for byte what Postgres prints for the jsonb, at the end of the body.
            let payload = printed.get(&row.id).map_or("null", String::as_str);
            let tail = format!(",\"payload\":{payload}}}");
            assert!(
                copy.body.ends_with(tail.as_bytes()),
                "payload intact: {what}"
            );
        }
        delivered += usize::from(!received.is_empty());
        duplicates += received.len().saturating_sub(1);
        match row.kind {
            Kind::ForeignKey => {
                let l = left.get(&row.id).expect(&what);
                assert!(
                    l.parked
                        && l.last_error
                            .as_deref()
                            .is_some_and(|e| e.contains("cannot be deleted")),
                    "parked: {what}"
                );
            }
            Kind::Infinity => assert_eq!(left.get(&row.id).map(|l| l.attempts), Some(0), "{what}"),
            Kind::Cancelled => assert!(!left.contains_key(&row.id), "gone: {what}"),
            k if k.undeliverable() => {
                let l = left.get(&row.id).expect(&what);
                let why = l.last_error.as_deref().unwrap_or_default();
                assert!(
                    l.attempts >= 1 && why.contains(k.reason()) && !l.parked,
                    "failing with {:?}: {what}",
                    k.reason()
                );
                kept += 1;
            }
            _ => assert!(!left.contains_key(&row.id), "deleted: {what}"),
        }
    }
    format!(
        "rows={} delivered={delivered} kept_failing={kept} duplicates={duplicates} early=0",
        case.rows.len()
    )
}

async fn run_case(seed: u64, rows: usize, durable: bool, faulty: bool) {
    let mut world = World::new().await;
    world.overrides.extend(
        [
            ("TIMEOUTD__SCAN__CONCURRENCY", "3"),
            ("TIMEOUTD__SCAN__BATCH_SIZE", "40"),
            ("TIMEOUTD__SCAN__RETRY_MIN", "300ms"),
            ("TIMEOUTD__SCAN__RETRY_MAX", "1s"),
            ("TIMEOUTD__AMQP__MAX_MESSAGE_SIZE", "256KiB"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    world
        .overrides
        .push(("TIMEOUTD__AMQP__URL".to_owned(), limited_user().await));
    world.migrate().await;
    let mut case = Case::plan(world, seed, rows, durable);
    let consumer = Consumer::start(&case.topo).await;
    case.insert().await;
    let printed = printed_payloads(&case.world).await;
    let nodes = [case.world.start().await, case.world.start().await];
    let fault = faulty.then(|| {
        let ids = nodes.iter().map(|n| (n.node_id, n.role.clone())).collect();
        tokio::spawn(kill_sessions_of_the_active_node(
            case.world.pool.clone(),
            ids,
        ))
    });
    let tasks = case.act_in_flight();
    let mut acts = HashMap::new();
    for t in tasks {
        let (id, a) = t.await.expect("action");
        acts.insert(id, a);
    }
    let expected: Vec<String> = case
        .rows
        .iter()
        .filter(|r| match (r.kind, acts.get(&r.id)) {
            (Kind::Cancelled, Some(Action::Deleted(1))) | (Kind::Infinity, _) => false,
            (k, _) => !k.undeliverable(),
        })
        .map(|r| r.id.to_string())
        .collect();
    let limit = tokio::time::Instant::now() + PATIENCE * 2;
    loop {
        let got = consumer.counts();
        let missing: Vec<&String> = expected
            .iter()
            .filter(|id| !got.contains_key(*id))
            .collect();
        if missing.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= limit {
            let left = leftovers(&case.world).await;
            let detail: Vec<String> = case
                .rows
                .iter()
                .filter(|r| missing.contains(&&r.id.to_string()))
                .take(10)
                .map(|r| {
                    format!(
                        "{:?} {:?} due {:?}: {:?}",
                        r.kind,
                        r.id,
                        r.deadline,
                        left.get(&r.id)
                    )
                })
                .collect();
            panic!(
                "{} deliverable rows never received, e.g. {detail:#?}",
                missing.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let undeliverable = case.rows.iter().filter(|r| r.kind.undeliverable()).count() as i64;
    wait_for_async(PATIENCE, "every undeliverable row charged", || async {
        case.world
            .count("attempts >= 1 AND last_error IS NOT NULL AND retry_at <> 'infinity'")
            .await
            >= undeliverable
    })
    .await;
    // Retries keep running: give a second copy of anything the time to show up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let failing = Store::connect(&case.world.settings().postgres).expect("store");
    let listed = failing
        .list(&PendingFilter::failing(), 100_000)
        .await
        .expect("list failing");
    failing.close().await;
    let left = leftovers(&case.world).await;
    let summary = check(&case, &printed, &consumer.counts(), &left, &acts, faulty);
    assert!(
        listed.len() as i64 >= undeliverable,
        "pending --failing lists them"
    );
    if let Some(fault) = fault {
        let killed = fault.await.expect("fault task");
        assert!(killed > 0, "the fault hit some database session");
    }
    println!("adversarial seed={seed} durable={durable} faulty={faulty} {summary}");
    for node in nodes {
        node.stop().await;
    }
    consumer.remove(&case.topo).await;
    case.world.cleanup().await;
}

/// Twice, while the rows come due, terminate every Postgres session of the node that is
/// active at that moment (its pool, its LISTEN connection): batches in flight lose their
/// locks and their commit. Returns how many sessions were terminated.
async fn kill_sessions_of_the_active_node(
    pool: sqlx::PgPool,
    nodes: Vec<(Uuid, tokio::sync::watch::Receiver<timeoutd::election::Role>)>,
) -> i64 {
    // Counted from the moment a node acts, however long the nodes took to start.
    wait_for(PATIENCE, "an active node", || {
        nodes
            .iter()
            .any(|(_, role)| *role.borrow() == timeoutd::election::Role::Active)
    })
    .await;
    let mut killed = 0;
    for wait in [200, 700] {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let active = nodes
            .iter()
            .find(|(_, role)| *role.borrow() == timeoutd::election::Role::Active);
        let Some((id, _)) = active else { continue };
        killed += sqlx::query_scalar::<_, i64>(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
        )
        .bind(format!("timeoutd-{id}"))
        .fetch_one(&pool)
        .await
        .expect("terminate");
    }
    killed
}

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_mixes_of_hostile_rows_keep_every_promise() {
    crate::common::trace_when_asked();
    let cases = knob("ADVERSARIAL_CASES", 3);
    let rows = knob("ADVERSARIAL_ROWS", 300) as usize;
    let first = knob("ADVERSARIAL_SEED", 0x5eed);
    for k in 0..cases {
        // Alternate durable (slow confirms: fsync) and transient queues; every third
        // case kills the active node's database sessions while it fires.
        run_case(first + k, rows, k % 2 == 0, k % 3 == 2).await;
    }
}
