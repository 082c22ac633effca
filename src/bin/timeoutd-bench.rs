//! timeoutd-bench: measures the `timeoutd` daemon against raw lapin and sqlx baselines,
//! in one run, against the RabbitMQ and Postgres given on the command line.
//!
//! ```sh
//! cargo build --release --bins
//! cargo run --release --bin timeoutd-bench -- [--quick] [--out bench-results]
//! ```
//!
//! Phases, in order (each run uses its own schema, group and queue, removed at the end):
//! 1. baseline publish: the burst's TimeOut messages (built by `scan::timeout_message`)
//!    published with lapin, mandatory, confirms awaited per window of 500, until a
//!    consumer has received them all;
//! 2. baseline delete: the same number of due rows deleted with sqlx, 500 per
//!    `DELETE … RETURNING *` (no broker);
//! 3. the daemon (`timeoutd run`, a child process) starts; idle RSS is read;
//! 4. burst: N rows, all due at the same instant T0 (committed before T0), fired by the
//!    daemon; the clock runs from T0 to the consumer's receipt of the last TimeOut;
//! 5. steady: rows due at R/s for S s, each inserted ~1.5 s before its deadline;
//!    lateness = consumer receipt − deadline;
//! 6. idle RSS again, the daemon stopped (SIGTERM);
//! 7. idle scan: the daemon's due-row query run directly over tables of 10k/100k/1M rows
//!    that are not due (one schema each, made by the daemon's migrations), median of 200
//!    runs per table taken round-robin, plus `EXPLAIN (ANALYZE, BUFFERS)`.
//!
//! Results: a table on stdout, `<out>/bench.json`, `<out>/bench.svg`. Missed targets are
//! reported, never turned into a failing exit code.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, SubsecRound, Utc};
use clap::Parser;
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, Consumer};
use serde::Serialize;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection};
use timeoutd::client::{self, Expectation};
use timeoutd::config::Settings;
use timeoutd::store::{DueRow, Store};
use timeoutd::wire::timeout::timeout as timeout_message;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use uuid::Uuid;

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Rows per publish window, per delete statement, and per idle-scan `LIMIT`.
const WINDOW: usize = 500;
/// Rows per INSERT statement when filling tables.
const INSERT_CHUNK: usize = 10_000;
/// How long before its deadline a steady row is inserted.
const STEADY_LEAD: Duration = Duration::from_millis(1500);
const STEADY_TICK: Duration = Duration::from_millis(10);
const MIB: f64 = 1024.0 * 1024.0;
/// Untimed idle scans first: they prepare the statement and warm the caches.
const WARMUP_RUNS: usize = 50;

/// Benchmark timeoutd: burst throughput, steady lateness, idle scan cost, memory.
#[derive(Debug, Clone, Parser)]
#[command(name = "timeoutd-bench")]
struct Args {
    /// Small sizes for a smoke run: 10k burst, 5 s steady, idle scans over 10k and 100k.
    #[arg(long)]
    quick: bool,
    /// Rows in the burst (and in both baselines). Default 100000 (10000 with --quick).
    #[arg(long)]
    burst: Option<usize>,
    /// Duration of the steady phase in seconds. Default 30 (5 with --quick).
    #[arg(long)]
    steady_secs: Option<u64>,
    /// Rows due per second in the steady phase.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Table sizes of the idle-scan phase, comma-separated. Default 10000,100000,1000000
    /// (10000,100000 with --quick).
    #[arg(long, value_delimiter = ',')]
    idle_rows: Option<Vec<u64>>,
    /// Timed runs of the due-row query per idle table size.
    #[arg(long, default_value_t = 200)]
    scan_runs: usize,
    /// Directory for bench.json and bench.svg.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// The timeoutd binary. Default: `timeoutd` next to this program.
    #[arg(long)]
    daemon: Option<PathBuf>,
    #[arg(long, default_value = AMQP_URL)]
    amqp_url: String,
    #[arg(long, default_value = PG_URL)]
    pg_url: String,
}

/// The sizes of one run, resolved from the flags.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    quick: bool,
    burst: usize,
    steady_secs: u64,
    rate: u32,
    idle_rows: Vec<u64>,
    scan_runs: usize,
}

impl Plan {
    fn from(args: &Args) -> Result<Self> {
        let (burst, secs, idle) = if args.quick {
            (10_000, 5, vec![10_000, 100_000])
        } else {
            (100_000, 30, vec![10_000, 100_000, 1_000_000])
        };
        let mut idle_rows = args.idle_rows.clone().unwrap_or(idle);
        idle_rows.sort_unstable();
        idle_rows.dedup();
        let plan = Self {
            quick: args.quick,
            burst: args.burst.unwrap_or(burst),
            steady_secs: args.steady_secs.unwrap_or(secs),
            rate: args.rate,
            idle_rows,
            scan_runs: args.scan_runs,
        };
        if plan.burst == 0 || plan.rate == 0 || plan.scan_runs == 0 || plan.idle_rows.is_empty() {
            bail!("--burst, --rate, --scan-runs and --idle-rows must be greater than 0");
        }
        Ok(plan)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let plan = Plan::from(&args)?;
    let daemon_bin = daemon_path(&args)?;
    let env = Env::setup(&args, daemon_bin).await?;
    println!(
        "timeoutd-bench: schema {}, group {}, queue {}; daemon scan.batch_size {}, \
         election.tick {:?}",
        env.schema, env.group, env.queue, env.settings.scan.batch_size, env.settings.election.tick
    );
    let outcome = tokio::select! {
        r = run(&env, &plan) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    env.cleanup().await;
    let report = outcome?;
    print_table(&report);
    write_results(&args.out, &report)?;
    println!(
        "\nwrote {}/bench.json and {}/bench.svg",
        args.out.display(),
        args.out.display()
    );
    Ok(())
}

fn daemon_path(args: &Args) -> Result<PathBuf> {
    let path = match &args.daemon {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("locating this program")?
            .with_file_name("timeoutd"),
    };
    if !path.is_file() {
        bail!(
            "daemon binary {} not found: build it first with `cargo build --release --bins` \
             (or pass --daemon PATH)",
            path.display()
        );
    }
    Ok(path)
}

/// All phases, in order. The daemon is killed if anything fails (kill_on_drop).
async fn run(env: &Env, plan: &Plan) -> Result<Report> {
    let started_at = Utc::now();
    let publish = phase("baseline publish", baseline_publish(env, plan.burst)).await?;
    let delete = phase("baseline delete", baseline_delete(env, plan.burst)).await?;
    let mut daemon = phase("daemon start", Daemon::start(env)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_before = daemon.memory()?;
    let burst = phase(
        "burst",
        burst(env, &mut daemon, plan.burst, delete.insert_rows_per_sec),
    )
    .await?;
    let peak = daemon.memory()?;
    let steady = phase("steady", steady(env, &mut daemon, plan)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_after = daemon.memory()?;
    let daemon_warnings = daemon.log.warnings.load(Ordering::Relaxed);
    let daemon_stop = match daemon.stop().await {
        Ok(()) => "exit 0 after SIGTERM".to_owned(),
        Err(e) => {
            eprintln!("warning: {e:#}");
            format!("{e:#}")
        }
    };
    let idle_scan = phase("idle scan", idle_scans(env, plan)).await?;
    let memory = Memory::from(idle_before, peak, idle_after);
    Ok(Report::new(
        env,
        plan,
        started_at,
        publish,
        delete,
        burst,
        steady,
        idle_scan,
        memory,
        (daemon_warnings, daemon_stop),
    ))
}

async fn phase<T>(name: &str, fut: impl Future<Output = Result<T>>) -> Result<T> {
    println!("-- {name} …");
    let started = Instant::now();
    let out = fut.await.with_context(|| format!("phase {name}"))?;
    println!("   {name} done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// The environment: schema, queue, consumer.

struct Env {
    schema: String,
    group: String,
    queue: String,
    pool: PgPool,
    amqp: Connection,
    inbox: Arc<Inbox>,
    settings: Settings,
    /// Schemas of the idle-scan tables, dropped with the main one.
    idle_schemas: Mutex<Vec<String>>,
    daemon_bin: PathBuf,
    amqp_url: String,
    pg_url: String,
}

impl Env {
    async fn setup(args: &Args, daemon_bin: PathBuf) -> Result<Self> {
        let tag = Uuid::new_v4().simple().to_string()[..10].to_owned();
        let schema = format!("bench_{tag}");
        let group = format!("bench-{tag}");
        let queue = format!("timeoutd-bench-{tag}");
        let settings = daemon_settings(args, &schema, &group)?;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&args.pg_url)
            .await
            .context("connecting to Postgres")?;
        let amqp = bounded(
            "connect to RabbitMQ",
            Duration::from_secs(10),
            Connection::connect(&args.amqp_url, ConnectionProperties::default()),
        )
        .await??;
        let inbox = Arc::new(Inbox::default());
        let consumer = declare_queue(&amqp, &queue).await?;
        tokio::spawn(consume(consumer, inbox.clone()));
        let env = Self {
            schema,
            group,
            queue,
            pool,
            amqp,
            inbox,
            settings,
            idle_schemas: Mutex::new(Vec::new()),
            daemon_bin,
            amqp_url: args.amqp_url.clone(),
            pg_url: args.pg_url.clone(),
        };
        if let Err(e) = migrate(&env.settings.postgres).await {
            env.cleanup().await;
            return Err(e.context("creating the schema"));
        }
        Ok(env)
    }

    /// The daemon's environment: isolated schema and group, a free HTTP port.
    fn daemon_env(&self) -> Vec<(String, String)> {
        overrides(&self.amqp_url, &self.pg_url, &self.schema, &self.group)
    }

    fn table(&self) -> String {
        format!("{}.expected_messages", self.schema)
    }

    async fn execute(&self, sql: String) -> Result<u64> {
        let done = sqlx::query(AssertSqlSafe(sql)).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }

    async fn count_rows(&self) -> Result<i64> {
        let sql = format!("SELECT count(*) FROM {}", self.table());
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await?)
    }

    /// A fresh `expected_messages` in its own schema, made by the daemon's migrations.
    async fn idle_table(&self, rows: u64) -> Result<String> {
        let schema = format!("{}_idle_{rows}", self.schema);
        if let Ok(mut schemas) = self.idle_schemas.lock() {
            schemas.push(schema.clone());
        }
        let mut settings = self.settings.postgres.clone();
        settings.schema = schema.clone();
        migrate(&settings).await?;
        Ok(format!("{schema}.expected_messages"))
    }

    /// Drop the schemas and the queue; errors are printed, not returned.
    async fn cleanup(&self) {
        let mut schemas = vec![self.schema.clone()];
        if let Ok(idle) = self.idle_schemas.lock() {
            schemas.extend(idle.iter().cloned());
        }
        for schema in schemas {
            let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
            if let Err(e) = self.execute(drop).await {
                eprintln!("warning: could not drop schema {schema}: {e:#}");
            }
        }
        if let Err(e) = self.delete_queue().await {
            eprintln!("warning: could not delete queue {}: {e:#}", self.queue);
        }
        let _ = bounded(
            "close",
            Duration::from_secs(5),
            self.amqp.close(200, "bye".into()),
        )
        .await;
        self.pool.close().await;
    }

    async fn delete_queue(&self) -> Result<()> {
        let channel = self.amqp.create_channel().await?;
        let delete =
            channel.queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default());
        bounded("queue delete", Duration::from_secs(5), delete).await??;
        Ok(())
    }
}

/// Create the schema and table exactly as the daemon does (its embedded migrations).
async fn migrate(settings: &timeoutd::config::Postgres) -> Result<()> {
    let store = Store::connect(settings)?;
    let done = bounded("migrate", Duration::from_secs(30), store.migrate()).await;
    store.close().await;
    done??;
    Ok(())
}

fn overrides(amqp: &str, pg: &str, schema: &str, group: &str) -> Vec<(String, String)> {
    [
        ("TIMEOUTD__AMQP__URL", amqp),
        ("TIMEOUTD__POSTGRES__URL", pg),
        ("TIMEOUTD__POSTGRES__SCHEMA", schema),
        ("TIMEOUTD__ELECTION__GROUP", group),
        ("TIMEOUTD__HTTP__LISTEN", "127.0.0.1:0"),
        ("TIMEOUTD__LOG__FORMAT", "json"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The settings the daemon will run with: this process' environment (the child inherits
/// it, so `TIMEOUTD__SCAN__BATCH_SIZE=…` applies) plus the run's overrides.
fn daemon_settings(args: &Args, schema: &str, group: &str) -> Result<Settings> {
    let env = std::env::vars().chain(overrides(&args.amqp_url, &args.pg_url, schema, group));
    Ok(Settings::load_from(None, env)?)
}

async fn bounded<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("{what}: no answer within {limit:?}"))
}

/// A durable, auto-delete queue (TimeOuts are persistent messages, as in production),
/// consumed without acks.
async fn declare_queue(amqp: &Connection, queue: &str) -> Result<Consumer> {
    let channel = amqp.create_channel().await?;
    let options = QueueDeclareOptions {
        durable: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?;
    let options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    Ok(channel
        .basic_consume(queue.into(), "bench".into(), options, FieldTable::default())
        .await?)
}

/// What the consumer received: `message_id` and wall-clock receipt time.
#[derive(Default)]
struct Inbox {
    got: Mutex<Vec<(Uuid, DateTime<Utc>)>>,
    count: AtomicUsize,
}

impl Inbox {
    fn push(&self, id: Uuid, at: DateTime<Utc>) {
        if let Ok(mut got) = self.got.lock() {
            got.push((id, at));
            self.count.store(got.len(), Ordering::Release);
        }
    }

    fn take(&self) -> Vec<(Uuid, DateTime<Utc>)> {
        let got = self.got.lock().map(|mut g| std::mem::take(&mut *g));
        self.count.store(0, Ordering::Release);
        got.unwrap_or_default()
    }

    fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Wait until `n` messages arrived; `false` after `limit`.
    async fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.len() < n {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        true
    }
}

async fn consume(mut consumer: Consumer, inbox: Arc<Inbox>) {
    while let Some(Ok(delivery)) = consumer.next().await {
        let at = Utc::now();
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|s| s.as_str().parse().ok())
            .unwrap_or(Uuid::nil());
        inbox.push(id, at);
    }
}

/// Distinct ids received, duplicates, and expected ids never received.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Delivery {
    received: usize,
    distinct: usize,
    duplicates: usize,
    missing: usize,
}

impl Delivery {
    fn check(got: &[(Uuid, DateTime<Utc>)], expected: &HashSet<Uuid>) -> Self {
        let distinct: HashSet<Uuid> = got.iter().map(|(id, _)| *id).collect();
        Self {
            received: got.len(),
            distinct: distinct.len(),
            duplicates: got.len() - distinct.len(),
            missing: expected.difference(&distinct).count(),
        }
    }

    fn exact(&self, n: usize) -> bool {
        self.received == n && self.distinct == n && self.duplicates == 0 && self.missing == 0
    }
}

// ---------------------------------------------------------------------------------------
// Inserting rows.

/// Insert `ids` (one transaction per call) due at `due` (`None`: already due, a second ago).
async fn insert_due(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    ids: &[Uuid],
    due: Option<DateTime<Utc>>,
) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'bench-' || ($4 + u.ord), 'BenchExpected', \
                coalesce($2, now() - interval '1 second'), '', $3, \
                jsonb_build_object('i', $4 + u.ord) \
         FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)"
    );
    for (i, chunk) in ids.chunks(INSERT_CHUNK).enumerate() {
        let offset = i64::try_from(i * INSERT_CHUNK)?;
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(chunk)
            .bind(due)
            .bind(queue)
            .bind(offset)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

fn fresh_ids(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
}

// ---------------------------------------------------------------------------------------
// Baselines.

#[derive(Debug, Clone, Serialize)]
struct PublishBaseline {
    rows: usize,
    secs: f64,
    rows_per_sec: f64,
    not_confirmed: usize,
    delivery: Delivery,
}

/// The burst's TimeOuts, published pipelined in windows of 500 (publish all, then await
/// all confirms), mandatory, until the consumer has them all. Like the daemon, the
/// publisher has its own connection; one untimed window warms it up.
async fn baseline_publish(env: &Env, n: usize) -> Result<PublishBaseline> {
    let mut messages = baseline_messages(&env.queue, n + WINDOW)?;
    let timed = messages.split_off(WINDOW);
    let expected: HashSet<Uuid> = timed.iter().map(|(id, _)| *id).collect();
    let conn = bounded(
        "connect to RabbitMQ",
        Duration::from_secs(10),
        Connection::connect(&env.amqp_url, ConnectionProperties::default()),
    )
    .await??;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    publish_window(&channel, &messages).await?;
    env.inbox.wait_for(WINDOW, receive_limit(WINDOW)).await;
    env.inbox.take();
    let started = Instant::now();
    let mut not_confirmed = 0;
    for window in timed.chunks(WINDOW) {
        not_confirmed += publish_window(&channel, window).await?;
    }
    let all = env.inbox.wait_for(n, receive_limit(n)).await;
    let secs = started.elapsed().as_secs_f64();
    let delivery = Delivery::check(&env.inbox.take(), &expected);
    if !all {
        eprintln!(
            "   baseline publish: only {} of {n} received",
            delivery.received
        );
    }
    let _ = bounded(
        "close",
        Duration::from_secs(5),
        conn.close(200, "done".into()),
    )
    .await;
    Ok(PublishBaseline {
        rows: n,
        secs,
        rows_per_sec: n as f64 / secs,
        not_confirmed,
        delivery,
    })
}

/// The same messages the daemon would send for these rows (same body, properties).
fn baseline_messages(queue: &str, n: usize) -> Result<Vec<(Uuid, timeoutd::wire::Message)>> {
    let node = Uuid::new_v4();
    let now = Utc::now().trunc_subsecs(6);
    (0..n)
        .map(|i| {
            let row = DueRow {
                id: Uuid::new_v4(),
                process_id: format!("bench-{i}"),
                message_type: "BenchExpected".into(),
                timeout_at: now,
                exchange: String::new(),
                routing_key: queue.to_owned(),
                payload: Some(serde_json::json!({ "i": i }).to_string()),
                payload_bytes: None,
                attempts: 0,
                fired_at: now,
            };
            let message = timeout_message(&row, node).map_err(|e| anyhow!("{e}"))?;
            Ok((row.id, message))
        })
        .collect()
}

/// Publish one window; returns how many were not confirmed (nacked, returned, error).
async fn publish_window(
    channel: &lapin::Channel,
    window: &[(Uuid, timeoutd::wire::Message)],
) -> Result<usize> {
    let mut confirms = Vec::with_capacity(window.len());
    for (_, m) in window {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirm = channel
            .basic_publish(
                m.exchange.as_str().into(),
                m.routing_key.as_str().into(),
                options,
                &m.body,
                timeoutd::bus::lapin_properties(&m.properties)?,
            )
            .await?;
        confirms.push(confirm);
    }
    let mut failed = 0;
    for confirm in confirms {
        let c = bounded("publisher confirm", Duration::from_secs(30), confirm).await??;
        if c.is_nack() || c.take_message().is_some() {
            failed += 1;
        }
    }
    Ok(failed)
}

fn receive_limit(n: usize) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(5 * n as u64)
}

#[derive(Debug, Clone, Serialize)]
struct DeleteBaseline {
    rows: usize,
    secs: f64,
    rows_per_sec: f64,
    deleted: usize,
    statements: usize,
    /// Rows inserted per second while preparing (used to schedule the burst).
    insert_rows_per_sec: f64,
}

/// Delete `n` due rows, 500 per statement, through the daemon's due index.
async fn baseline_delete(env: &Env, n: usize) -> Result<DeleteBaseline> {
    let mut conn = env.pool.acquire().await?;
    let ids = fresh_ids(n);
    let started = Instant::now();
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    insert_due(&mut tx, &env.table(), &env.queue, &ids, None).await?;
    tx.commit().await?;
    let insert_rows_per_sec = n as f64 / started.elapsed().as_secs_f64();
    analyze(env).await?;
    let due = "coalesce(retry_at, timeout_at)";
    let sql = format!(
        "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE {due} <= now() \
         ORDER BY {due} LIMIT {WINDOW} FOR UPDATE SKIP LOCKED) RETURNING *",
        t = env.table()
    );
    let started = Instant::now();
    let (mut deleted, mut statements) = (0, 0);
    loop {
        let rows = sqlx::query(AssertSqlSafe(sql.clone()))
            .fetch_all(&mut *conn)
            .await?;
        statements += 1;
        if rows.is_empty() {
            break;
        }
        deleted += rows.len();
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(DeleteBaseline {
        rows: n,
        secs,
        rows_per_sec: deleted as f64 / secs,
        deleted,
        statements,
        insert_rows_per_sec,
    })
}

async fn analyze(env: &Env) -> Result<()> {
    env.execute(format!("ANALYZE {}", env.table())).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The daemon as a child process.

/// One "fired batch" (debug) log line of the daemon.
#[derive(Debug, Clone)]
struct BatchLog {
    at: DateTime<Utc>,
    fired: u64,
    duration_ms: f64,
}

#[derive(Default)]
struct DaemonLog {
    active: AtomicBool,
    batches: Mutex<Vec<BatchLog>>,
    tail: Mutex<VecDeque<String>>,
    warnings: AtomicUsize,
}

impl DaemonLog {
    fn batches_between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<BatchLog> {
        let batches = self.batches.lock().map(|b| b.clone()).unwrap_or_default();
        batches
            .into_iter()
            .filter(|b| b.at >= from && b.at <= to)
            .collect()
    }

    fn tail(&self) -> String {
        let tail = self.tail.lock().map(|t| t.clone()).unwrap_or_default();
        tail.into_iter().collect::<Vec<_>>().join("\n")
    }

    fn read(&self, line: &str) {
        if let Ok(mut tail) = self.tail.lock() {
            if tail.len() >= 20 {
                tail.pop_front();
            }
            tail.push_back(line.to_owned());
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default();
        if matches!(field("level"), "WARN" | "ERROR") {
            self.warnings.fetch_add(1, Ordering::Relaxed);
        }
        match field("message") {
            "role changed" => self
                .active
                .store(field("role") == "active", Ordering::Release),
            "fired batch" => self.batch(&v),
            _ => {}
        }
    }

    fn batch(&self, v: &serde_json::Value) {
        let at = v
            .get("timestamp")
            .and_then(|t| t.as_str())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(Utc::now);
        let fired = v.get("fired").and_then(|f| f.as_u64()).unwrap_or(0);
        let duration_ms = v
            .get("duration")
            .and_then(|d| d.as_str())
            .and_then(debug_duration_ms)
            .unwrap_or(0.0);
        if let Ok(mut b) = self.batches.lock() {
            b.push(BatchLog {
                at,
                fired,
                duration_ms,
            });
        }
    }
}

/// A `Debug`-formatted `Duration` ("12.5ms", "850µs", "1.2s") in milliseconds.
fn debug_duration_ms(s: &str) -> Option<f64> {
    let split = s.find(|c: char| c.is_alphabetic())?;
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale = match unit {
        "s" => 1e3,
        "ms" => 1.0,
        "µs" | "us" => 1e-3,
        "ns" => 1e-6,
        _ => return None,
    };
    Some(number * scale)
}

/// Resident memory of the daemon, from /proc/<pid>/status, in bytes.
#[derive(Debug, Clone, Copy, Serialize)]
struct Mem {
    rss: u64,
    hwm: u64,
}

struct Daemon {
    child: Child,
    pid: u32,
    log: Arc<DaemonLog>,
}

impl Daemon {
    /// Spawn `timeoutd run` and wait until it is the active node (its "role changed" log).
    async fn start(env: &Env) -> Result<Self> {
        let mut cmd = Command::new(&env.daemon_bin);
        cmd.arg("run")
            .envs(env.daemon_env())
            .env(
                "RUST_LOG",
                "warn,timeoutd::daemon=info,timeoutd::scheduler=debug",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", env.daemon_bin.display()))?;
        let pid = child.id().context("daemon has no pid")?;
        let stderr = child.stderr.take().context("daemon stderr")?;
        let log = Arc::new(DaemonLog::default());
        tokio::spawn(read_log(stderr, log.clone()));
        let mut daemon = Self { child, pid, log };
        daemon.wait_active(Duration::from_secs(30)).await?;
        Ok(daemon)
    }

    async fn wait_active(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while !self.log.active.load(Ordering::Acquire) {
            if let Some(status) = self.child.try_wait()? {
                bail!("daemon exited ({status}):\n{}", self.log.tail());
            }
            if Instant::now() >= deadline {
                bail!("daemon not active within {limit:?}:\n{}", self.log.tail());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Fails if the daemon has exited (a crash mid-run must not pass unnoticed).
    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("daemon exited ({status}):\n{}", self.log.tail());
        }
        Ok(())
    }

    fn memory(&self) -> Result<Mem> {
        let path = format!("/proc/{}/status", self.pid);
        let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let kib = |key: &str| -> Result<u64> {
            let line = status
                .lines()
                .find(|l| l.starts_with(key))
                .with_context(|| format!("{key} missing in {path}"))?;
            let value = line.trim_start_matches(key).trim().trim_end_matches("kB");
            Ok(value.trim().parse::<u64>()? * 1024)
        };
        Ok(Mem {
            rss: kib("VmRSS:")?,
            hwm: kib("VmHWM:")?,
        })
    }

    /// SIGTERM, then wait (bounded); SIGKILL if it does not stop.
    async fn stop(mut self) -> Result<()> {
        let term = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        if !term.is_ok_and(|s| s.success()) {
            self.child.start_kill()?;
        }
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) if status.as_ref().is_ok_and(|s| s.success()) => Ok(()),
            Ok(status) => bail!("daemon stopped with {status:?}:\n{}", self.log.tail()),
            Err(_) => {
                self.child.start_kill()?;
                bail!("daemon did not stop within 20 s after SIGTERM; killed")
            }
        }
    }
}

async fn read_log(stderr: tokio::process::ChildStderr, log: Arc<DaemonLog>) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        log.read(&line);
    }
}

// ---------------------------------------------------------------------------------------
// Burst.

#[derive(Debug, Clone, Serialize)]
struct Burst {
    rows: usize,
    /// Time to insert the rows (one transaction), committed before they were due.
    insert_secs: f64,
    /// Milliseconds from the deadline (T0) to the first and the last TimeOut received.
    first_ms: f64,
    last_ms: f64,
    /// Rows / (last − T0): the burst throughput.
    rows_per_sec: f64,
    /// Rows / (last − first): without the wait for the first tick after T0.
    drain_rows_per_sec: f64,
    delivery: Delivery,
    left_in_table: i64,
    batches: usize,
    mean_batch_ms: f64,
    max_batch_ms: f64,
    /// Every batch's duration, in the order the daemon logged them.
    batch_ms: Vec<f64>,
    /// Sum of batch durations / (last − T0): the share of the wall time spent in batches.
    busy_fraction: f64,
    complete: bool,
}

/// N rows, all due at T0 (committed before T0); the clock runs from T0 to the receipt of
/// the last TimeOut.
async fn burst(env: &Env, daemon: &mut Daemon, n: usize, insert_rate: f64) -> Result<Burst> {
    let ids = fresh_ids(n);
    let lead = Duration::from_secs_f64(n as f64 / insert_rate * 1.5 + 1.0);
    let t0 = (Utc::now() + chrono::Duration::from_std(lead)?).trunc_subsecs(6);
    env.inbox.take();
    let started = Instant::now();
    let mut tx = env.pool.begin().await?;
    insert_due(&mut tx, &env.table(), &env.queue, &ids, Some(t0)).await?;
    tx.commit().await?;
    let insert_secs = started.elapsed().as_secs_f64();
    let start = t0.max(Utc::now());
    if start > t0 {
        eprintln!("   burst: insert committed after T0; the clock starts at the commit");
    }
    let complete = env.inbox.wait_for(n, lead + receive_limit(n)).await;
    daemon.check_alive()?;
    let got = env.inbox.take();
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    let delivery = Delivery::check(&got, &expected);
    let first = got.iter().map(|(_, at)| *at).min().unwrap_or(start);
    let last = got.iter().map(|(_, at)| *at).max().unwrap_or(start);
    let last_ms = ms(last - start);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batches = daemon
        .log
        .batches_between(t0, last + chrono::Duration::seconds(1));
    let busy: f64 = batches.iter().map(|b| b.duration_ms).sum();
    Ok(Burst {
        rows: n,
        insert_secs,
        first_ms: ms(first - start),
        last_ms,
        rows_per_sec: delivery.distinct as f64 / (last_ms / 1e3),
        drain_rows_per_sec: delivery.distinct as f64 / (ms(last - first) / 1e3),
        delivery,
        left_in_table: env.count_rows().await?,
        batches: batches.iter().filter(|b| b.fired > 0).count(),
        mean_batch_ms: busy / batches.len().max(1) as f64,
        max_batch_ms: batches.iter().map(|b| b.duration_ms).fold(0.0, f64::max),
        batch_ms: batches.iter().map(|b| b.duration_ms).collect(),
        busy_fraction: busy / last_ms,
        complete,
    })
}

fn ms(d: chrono::Duration) -> f64 {
    d.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e3
}

// ---------------------------------------------------------------------------------------
// Steady.

#[derive(Debug, Clone, Serialize)]
struct Steady {
    rate: u32,
    secs: u64,
    rows: usize,
    delivery: Delivery,
    /// Received before their deadline (a contract violation).
    early: usize,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    mean_ms: f64,
    /// Smallest (deadline − insert commit) over all rows: > 0 means every row existed
    /// before it was due, so lateness is the daemon's.
    min_insert_lead_ms: f64,
    histogram: Vec<(String, usize)>,
    complete: bool,
}

/// Rows due at `rate`/s for `steady_secs`, inserted through `client::expect` ~1.5 s ahead,
/// in one transaction every 10 ms; lateness = receipt − deadline.
async fn steady(env: &Env, daemon: &mut Daemon, plan: &Plan) -> Result<Steady> {
    let total = plan.rate as usize * plan.steady_secs as usize;
    let step = 1e6 / f64::from(plan.rate);
    let first = (Utc::now() + chrono::Duration::from_std(STEADY_LEAD)?).trunc_subsecs(6);
    let deadline = |k: usize| first + chrono::Duration::microseconds((k as f64 * step) as i64);
    env.inbox.take();
    let (deadlines, min_lead) = steady_insert(env, total, deadline).await?;
    let limit = STEADY_LEAD + Duration::from_secs(30);
    let complete = env.inbox.wait_for(total, limit).await;
    daemon.check_alive()?;
    let got = env.inbox.take();
    let expected: HashSet<Uuid> = deadlines.keys().copied().collect();
    let delivery = Delivery::check(&got, &expected);
    let lateness = lateness_ms(&got, &deadlines);
    let early = lateness.iter().filter(|l| **l < 0.0).count();
    Ok(Steady {
        rate: plan.rate,
        secs: plan.steady_secs,
        rows: total,
        delivery,
        early,
        p50_ms: percentile(&lateness, 50.0),
        p90_ms: percentile(&lateness, 90.0),
        p99_ms: percentile(&lateness, 99.0),
        max_ms: lateness.last().copied().unwrap_or(f64::NAN),
        mean_ms: lateness.iter().sum::<f64>() / lateness.len().max(1) as f64,
        min_insert_lead_ms: min_lead,
        histogram: histogram(&lateness),
        complete,
    })
}

/// The inserter: every 10 ms, one transaction with every row due within the lead.
async fn steady_insert(
    env: &Env,
    total: usize,
    deadline: impl Fn(usize) -> DateTime<Utc>,
) -> Result<(HashMap<Uuid, DateTime<Utc>>, f64)> {
    let lead = chrono::Duration::from_std(STEADY_LEAD)?;
    let mut deadlines = HashMap::with_capacity(total);
    let mut min_lead = f64::INFINITY;
    let mut tick = tokio::time::interval(STEADY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0;
    while next < total {
        tick.tick().await;
        let horizon = Utc::now() + lead;
        let mut tx = env.pool.begin().await?;
        let mut batch = Vec::new();
        while next < total && deadline(next) <= horizon {
            let e = Expectation::new(&format!("steady-{next}"), "BenchExpected", &env.queue)
                .due_at(deadline(next))
                .payload(serde_json::json!({ "k": next }));
            client::expect(&mut tx, &env.schema, &e).await?;
            batch.push((e.id, e.timeout_at));
            next += 1;
        }
        tx.commit().await?;
        let committed = Utc::now();
        for (id, due) in batch {
            min_lead = min_lead.min(ms(due - committed));
            deadlines.insert(id, due);
        }
    }
    Ok((deadlines, min_lead))
}

/// Sorted lateness of every received id with a known deadline, in milliseconds.
fn lateness_ms(
    got: &[(Uuid, DateTime<Utc>)],
    deadlines: &HashMap<Uuid, DateTime<Utc>>,
) -> Vec<f64> {
    let mut late: Vec<f64> = got
        .iter()
        .filter_map(|(id, at)| deadlines.get(id).map(|due| ms(*at - *due)))
        .collect();
    late.sort_by(f64::total_cmp);
    late
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

const BUCKETS_MS: [f64; 11] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 300.0, 500.0, 1000.0,
];

fn histogram(sorted: &[f64]) -> Vec<(String, usize)> {
    let mut counts = vec![0; BUCKETS_MS.len() + 1];
    for v in sorted {
        let i = BUCKETS_MS
            .iter()
            .position(|b| v < b)
            .unwrap_or(BUCKETS_MS.len());
        counts[i] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, c)| (bucket_label(i), c))
        .collect()
}

fn bucket_label(i: usize) -> String {
    match i {
        0 => format!("<{}", BUCKETS_MS[0]),
        i if i == BUCKETS_MS.len() => format!("≥{}", BUCKETS_MS[i - 1]),
        i => format!("{}–{}", BUCKETS_MS[i - 1], BUCKETS_MS[i]),
    }
}

// ---------------------------------------------------------------------------------------
// Idle scan.

#[derive(Debug, Clone, Serialize)]
struct IdleScan {
    rows: u64,
    runs: usize,
    median_ms: f64,
    p90_ms: f64,
    /// "Execution Time" of `EXPLAIN (ANALYZE, BUFFERS)` (server side, no round trip).
    explain_ms: f64,
    index_used: bool,
    plan: Vec<String>,
}

/// One table per size, each in its own schema made by the daemon's migrations, filled
/// with rows due in a day; the due query is then timed round-robin over the tables, so a
/// change in machine load hits every size alike.
async fn idle_scans(env: &Env, plan: &Plan) -> Result<Vec<IdleScan>> {
    let mut tables = Vec::new();
    for &size in &plan.idle_rows {
        let table = env.idle_table(size).await?;
        fill_not_due(env, &table, size).await?;
        env.execute(format!("ANALYZE {table}")).await?;
        tables.push((size, table));
    }
    let mut conn = env.pool.acquire().await?;
    tokio::time::sleep(Duration::from_secs(1)).await; // let the fills' writes settle
    let timings = time_scans(&mut conn, &tables, plan.scan_runs).await?;
    let mut out = Vec::new();
    for ((rows, table), mut times) in tables.into_iter().zip(timings) {
        let (plan_lines, explain_ms) = explain(&mut conn, &table).await?;
        times.sort_by(f64::total_cmp);
        let scan = IdleScan {
            rows,
            runs: times.len(),
            median_ms: percentile(&times, 50.0),
            p90_ms: percentile(&times, 90.0),
            explain_ms,
            index_used: plan_lines
                .iter()
                .any(|l| l.contains("Index Scan using expected_messages_due_at_idx")),
            plan: plan_lines,
        };
        let access = scan.plan.iter().find(|l| l.contains(" Scan "));
        println!(
            "   {rows} rows: median {:.3} ms; {}",
            scan.median_ms,
            access.map_or("(no scan node in the plan)", |l| l.trim())
        );
        out.push(scan);
    }
    Ok(out)
}

async fn fill_not_due(env: &Env, table: &str, rows: u64) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (process_id, message_type, timeout_at, exchange, routing_key, \
         payload) \
         SELECT 'idle-' || g, 'BenchIdle', now() + interval '1 day' + g * interval '1 ms', \
                '', 'nowhere', jsonb_build_object('i', g) \
         FROM generate_series($1::bigint, $2::bigint) AS g"
    );
    let chunk = 100_000;
    let mut start = 1;
    while start <= rows {
        let end = (start + chunk - 1).min(rows);
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(i64::try_from(start)?)
            .bind(i64::try_from(end)?)
            .execute(&env.pool)
            .await?;
        start = end + 1;
    }
    Ok(())
}

/// The daemon's own due-row statement (`store::lock_due_sql`), run with its binds: a
/// batch of `WINDOW`, payloads up to 16 MiB, nothing skipped.
fn lock_due(sql: &str) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .bind(WINDOW as i64)
        .bind(16i64 << 20)
        .bind(Vec::<Uuid>::new())
}

/// Timed runs, round-robin over the tables: one list of milliseconds per table.
async fn time_scans(
    conn: &mut PgConnection,
    tables: &[(u64, String)],
    runs: usize,
) -> Result<Vec<Vec<f64>>> {
    let statements: Vec<String> = tables
        .iter()
        .map(|(_, t)| timeoutd::store::lock_due_sql(t))
        .collect();
    let mut timings = vec![Vec::with_capacity(runs); tables.len()];
    for i in 0..runs + WARMUP_RUNS {
        for (sql, times) in statements.iter().zip(&mut timings) {
            let ms = time_scan(conn, sql).await?;
            if i >= WARMUP_RUNS {
                times.push(ms);
            }
        }
    }
    Ok(timings)
}

/// One scan as the daemon runs it: in a transaction (rolled back), timed on the client.
async fn time_scan(conn: &mut PgConnection, sql: &str) -> Result<f64> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let started = Instant::now();
    let found = lock_due(sql).fetch_all(&mut *tx).await?;
    let elapsed = started.elapsed().as_secs_f64() * 1e3;
    tx.rollback().await?;
    if !found.is_empty() {
        bail!("idle scan found {} due rows", found.len());
    }
    Ok(elapsed)
}

async fn explain(conn: &mut PgConnection, table: &str) -> Result<(Vec<String>, f64)> {
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS) {}",
        timeoutd::store::lock_due_sql(table)
    );
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let plan: Vec<String> = lock_due(&sql)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| sqlx::Row::try_get::<String, _>(r, 0))
        .collect::<Result<_, _>>()?;
    tx.rollback().await?;
    let exec = plan
        .iter()
        .find_map(|l| l.trim().strip_prefix("Execution Time:"))
        .and_then(|s| s.trim().trim_end_matches("ms").trim().parse().ok())
        .unwrap_or(f64::NAN);
    Ok((plan, exec))
}

// ---------------------------------------------------------------------------------------
// Report.

#[derive(Debug, Clone, Copy, Serialize)]
struct Memory {
    idle_before_mib: f64,
    burst_peak_mib: f64,
    idle_after_mib: f64,
}

impl Memory {
    fn from(before: Mem, peak: Mem, after: Mem) -> Self {
        Self {
            idle_before_mib: before.rss as f64 / MIB,
            burst_peak_mib: peak.hwm as f64 / MIB,
            idle_after_mib: after.rss as f64 / MIB,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct Line {
    measurement: String,
    result: String,
    target: String,
    /// `None`: no target.
    pass: Option<bool>,
}

fn line(measurement: &str, result: String, target: &str, pass: Option<bool>) -> Line {
    Line {
        measurement: measurement.to_owned(),
        result,
        target: target.to_owned(),
        pass,
    }
}

#[derive(Debug, Clone, Serialize)]
struct Meta {
    started_at: DateTime<Utc>,
    plan: Plan,
    cpus: usize,
    bench_profile: &'static str,
    daemon: String,
    daemon_scan_batch_size: u32,
    daemon_election_tick_ms: u128,
    daemon_warnings: usize,
    daemon_stop: String,
    schema: String,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    meta: Meta,
    publish: PublishBaseline,
    delete: DeleteBaseline,
    burst: Burst,
    steady: Steady,
    idle_scan: Vec<IdleScan>,
    memory: Memory,
    lines: Vec<Line>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    fn new(
        env: &Env,
        plan: &Plan,
        started_at: DateTime<Utc>,
        publish: PublishBaseline,
        delete: DeleteBaseline,
        burst: Burst,
        steady: Steady,
        idle_scan: Vec<IdleScan>,
        memory: Memory,
        (daemon_warnings, daemon_stop): (usize, String),
    ) -> Self {
        let meta = Meta {
            started_at,
            plan: plan.clone(),
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            bench_profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            daemon: env.daemon_bin.display().to_string(),
            daemon_scan_batch_size: env.settings.scan.batch_size,
            daemon_election_tick_ms: env.settings.election.tick.as_millis(),
            daemon_warnings,
            daemon_stop,
            schema: env.schema.clone(),
        };
        let mut report = Self {
            meta,
            publish,
            delete,
            burst,
            steady,
            idle_scan,
            memory,
            lines: Vec::new(),
        };
        report.lines = report.table_lines();
        report
    }

    fn table_lines(&self) -> Vec<Line> {
        let mut lines = self.throughput_lines();
        lines.extend(self.steady_lines());
        lines.extend(self.idle_lines());
        lines.extend(self.memory_lines());
        lines
    }

    fn throughput_lines(&self) -> Vec<Line> {
        let (p, d, b) = (&self.publish, &self.delete, &self.burst);
        let ratio = b.rows_per_sec / p.rows_per_sec;
        vec![
            line(
                "baseline publish (lapin, confirms, window 500)",
                format!(
                    "{} msgs in {:.2} s = {:.0}/s ({} unconfirmed)",
                    p.rows, p.secs, p.rows_per_sec, p.not_confirmed
                ),
                "",
                None,
            ),
            line(
                "baseline delete (sqlx, DELETE … RETURNING, 500/stmt)",
                format!(
                    "{} rows in {:.2} s = {:.0}/s",
                    d.deleted, d.secs, d.rows_per_sec
                ),
                "",
                None,
            ),
            line(
                "burst: due (T0) → last TimeOut received",
                format!(
                    "{} rows in {:.2} s = {:.0}/s",
                    b.rows,
                    b.last_ms / 1e3,
                    b.rows_per_sec
                ),
                "",
                None,
            ),
            line(
                "burst: how the daemon spent it",
                format!(
                    "first TimeOut {:.0} ms after T0, first→last {:.0}/s; {} batches, \
                     mean {:.1} ms, max {:.1} ms; in a batch {:.0}% of the time",
                    b.first_ms,
                    b.drain_rows_per_sec,
                    b.batches,
                    b.mean_batch_ms,
                    b.max_batch_ms,
                    b.busy_fraction * 100.0
                ),
                "",
                None,
            ),
            line(
                "burst / baseline publish",
                format!("{:.0}%", ratio * 100.0),
                "≥ 80%",
                Some(ratio >= 0.8),
            ),
            line(
                "burst: each row exactly once",
                delivery_text(&b.delivery, b.left_in_table),
                "= rows, 0 dup",
                Some(b.delivery.exact(b.rows) && b.left_in_table == 0),
            ),
        ]
    }

    fn steady_lines(&self) -> Vec<Line> {
        let s = &self.steady;
        vec![
            line(
                &format!("steady {}/s for {} s: lateness p50 / p90", s.rate, s.secs),
                format!(
                    "{:.1} ms / {:.1} ms (mean {:.1} ms)",
                    s.p50_ms, s.p90_ms, s.mean_ms
                ),
                "",
                None,
            ),
            line(
                "steady: lateness p99",
                format!("{:.1} ms", s.p99_ms),
                "≤ 20 ms",
                Some(s.p99_ms <= 20.0),
            ),
            line(
                "steady: lateness max",
                format!("{:.1} ms", s.max_ms),
                "≤ 100 ms",
                Some(s.max_ms <= 100.0),
            ),
            line(
                "steady: each row once, none early",
                format!(
                    "{}; {} early; rows inserted ≥ {:.0} ms before due",
                    delivery_text(&s.delivery, 0),
                    s.early,
                    s.min_insert_lead_ms
                ),
                "= rows, 0 dup, 0 early",
                Some(s.delivery.exact(s.rows) && s.early == 0),
            ),
        ]
    }

    fn idle_lines(&self) -> Vec<Line> {
        let mut lines: Vec<Line> = self
            .idle_scan
            .iter()
            .map(|s| {
                line(
                    &format!("idle scan, {} rows not due", human(s.rows)),
                    format!(
                        "median {:.3} ms (p90 {:.3}, server {:.3} ms)",
                        s.median_ms, s.p90_ms, s.explain_ms
                    ),
                    "index scan",
                    Some(s.index_used),
                )
            })
            .collect();
        if let (Some(small), Some(big)) = (self.idle_scan.first(), self.idle_scan.last()) {
            let ratio = big.median_ms / small.median_ms;
            lines.push(line(
                &format!("idle scan {} vs {}", human(big.rows), human(small.rows)),
                format!("{ratio:.2}×, {:.3} ms", big.median_ms),
                "≤ 2× and < 1 ms",
                Some(ratio <= 2.0 && big.median_ms < 1.0),
            ));
        }
        lines
    }

    fn memory_lines(&self) -> Vec<Line> {
        let m = &self.memory;
        vec![
            line(
                "daemon RSS idle, before burst",
                format!("{:.1} MiB", m.idle_before_mib),
                "≤ 32 MiB",
                Some(m.idle_before_mib <= 32.0),
            ),
            line(
                "daemon peak RSS (VmHWM) after burst",
                format!("{:.1} MiB", m.burst_peak_mib),
                "≤ 96 MiB",
                Some(m.burst_peak_mib <= 96.0),
            ),
            line(
                "daemon RSS idle, after steady",
                format!("{:.1} MiB", m.idle_after_mib),
                "≤ 32 MiB",
                Some(m.idle_after_mib <= 32.0),
            ),
        ]
    }
}

fn delivery_text(d: &Delivery, left: i64) -> String {
    let mut s = format!(
        "received {}, distinct {}, dup {}, missing {}",
        d.received, d.distinct, d.duplicates, d.missing
    );
    if left != 0 {
        s.push_str(&format!(", {left} rows left"));
    }
    s
}

fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

fn verdict(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "PASS",
        Some(false) => "FAIL",
        None => "",
    }
}

/// A Markdown table, so it can be pasted as is.
fn print_table(report: &Report) {
    let m = &report.meta;
    println!(
        "\ntimeoutd-bench {} · {} CPUs · bench {} · daemon: scan.batch_size {}, \
         election.tick {} ms",
        m.started_at.format("%Y-%m-%d %H:%M UTC"),
        m.cpus,
        m.bench_profile,
        m.daemon_scan_batch_size,
        m.daemon_election_tick_ms
    );
    let width = |f: fn(&Line) -> usize, head: &str| {
        report
            .lines
            .iter()
            .map(f)
            .max()
            .unwrap_or(0)
            .max(head.chars().count())
    };
    let w0 = width(|l| l.measurement.chars().count(), "measurement");
    let w1 = width(|l| l.result.chars().count(), "result");
    let w2 = width(|l| l.target.chars().count(), "target");
    let row = |a: &str, b: &str, c: &str, d: &str| {
        println!("| {a:<w0$} | {b:<w1$} | {c:<w2$} | {d:<7} |");
    };
    println!();
    row("measurement", "result", "target", "verdict");
    row(&"-".repeat(w0), &"-".repeat(w1), &"-".repeat(w2), "-------");
    for l in &report.lines {
        row(&l.measurement, &l.result, &l.target, verdict(l.pass));
    }
    if m.plan.quick {
        println!(
            "\nnote: --quick is a smoke run; a burst this short is dominated by the wait for \
             the first scan, so its ratio to the baseline means little"
        );
    }
    let failed = report
        .lines
        .iter()
        .filter(|l| l.pass == Some(false))
        .count();
    println!(
        "\n{failed} target(s) missed; daemon warnings/errors logged: {}; daemon stop: {}",
        m.daemon_warnings, m.daemon_stop
    );
    if let Some(big) = report.idle_scan.last() {
        println!(
            "\nEXPLAIN (ANALYZE, BUFFERS), {} rows not due:",
            human(big.rows)
        );
        for l in &big.plan {
            println!("  {l}");
        }
    }
}

fn write_results(out: &Path, report: &Report) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(out.join("bench.json"), json).context("writing bench.json")?;
    std::fs::write(out.join("bench.svg"), svg::chart(report)).context("writing bench.svg")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The chart: hand-written SVG, one panel per measurement.

mod svg {
    use super::{Report, human};

    const WIDTH: f64 = 960.0;
    const LABEL_W: f64 = 250.0;
    const BAR_W: f64 = 560.0;
    const BAR_H: f64 = 22.0;
    const GAP: f64 = 8.0;
    const BLUE: &str = "#4e79a7";
    const ORANGE: &str = "#f28e2b";
    const GREEN: &str = "#59a14f";
    const RED: &str = "#e15759";

    pub struct Bar {
        pub label: String,
        pub value: f64,
        pub color: &'static str,
    }

    fn bar(label: impl Into<String>, value: f64, color: &'static str) -> Bar {
        Bar {
            label: label.into(),
            value,
            color,
        }
    }

    fn esc(s: &str) -> String {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    }

    fn fmt(v: f64) -> String {
        match v {
            v if !v.is_finite() => "n/a".into(),
            v if v >= 100.0 => format!("{v:.0}"),
            v if v >= 1.0 => format!("{v:.1}"),
            v => format!("{v:.3}"),
        }
    }

    /// Horizontal bars with optional vertical target markers; returns (svg, height).
    fn hbars(
        title: &str,
        unit: &str,
        bars: &[Bar],
        marks: &[(f64, String)],
        y0: f64,
    ) -> (String, f64) {
        let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
        let max = bars
            .iter()
            .map(|b| finite(b.value))
            .chain(marks.iter().map(|m| m.0))
            .fold(0.0, f64::max)
            .max(1e-9)
            * 1.1;
        let x = |v: f64| LABEL_W + finite(v).max(0.0) / max * BAR_W;
        let mut s = format!(
            r#"<text x="10" y="{}" font-size="15" font-weight="bold">{}</text>"#,
            y0 + 16.0,
            esc(title)
        );
        let top = y0 + 28.0;
        for (i, b) in bars.iter().enumerate() {
            let y = top + i as f64 * (BAR_H + GAP);
            s += &format!(
                r#"<text x="{}" y="{}" text-anchor="end">{}</text><rect x="{LABEL_W}" y="{y}" width="{}" height="{BAR_H}" fill="{}"/><text x="{}" y="{}">{} {}</text>"#,
                LABEL_W - 8.0,
                y + 15.0,
                esc(&b.label),
                x(b.value) - LABEL_W,
                b.color,
                x(b.value) + 6.0,
                y + 15.0,
                fmt(b.value),
                esc(unit)
            );
        }
        let bottom = top + bars.len() as f64 * (BAR_H + GAP);
        for (v, label) in marks {
            s += &format!(
                r#"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="{RED}" stroke-dasharray="5,3" stroke-width="1.5"/><text x="{0}" y="{3}" fill="{RED}" font-size="11" text-anchor="middle">{4}</text>"#,
                x(*v),
                top - 4.0,
                bottom,
                bottom + 12.0,
                esc(label)
            );
        }
        (s, bottom + 30.0 - y0)
    }

    /// Vertical histogram bars of counts per bucket; returns (svg, height).
    fn histogram(title: &str, buckets: &[(String, usize)], y0: f64) -> (String, f64) {
        let plot_h = 150.0;
        let max = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64;
        let slot = (WIDTH - 80.0) / buckets.len().max(1) as f64;
        let base = y0 + 40.0 + plot_h;
        let mut s = format!(
            r#"<text x="10" y="{}" font-size="15" font-weight="bold">{}</text>"#,
            y0 + 16.0,
            esc(title)
        );
        for (i, (label, count)) in buckets.iter().enumerate() {
            let h = *count as f64 / max * plot_h;
            let x = 40.0 + i as f64 * slot;
            let mid = x + slot / 2.0;
            s += &format!(
                r#"<rect x="{}" y="{}" width="{}" height="{h}" fill="{BLUE}"/><text x="{mid}" y="{}" text-anchor="middle" font-size="11">{count}</text><text x="{mid}" y="{}" text-anchor="middle" font-size="11">{}</text>"#,
                x + 4.0,
                base - h,
                slot - 8.0,
                base - h - 4.0,
                base + 14.0,
                esc(label)
            );
        }
        s += &format!(
            r#"<line x1="40" y1="{base}" x2="{}" y2="{base}" stroke="black"/><text x="{}" y="{}" text-anchor="middle" font-size="11">lateness bucket (ms): rows received</text>"#,
            WIDTH - 40.0,
            WIDTH / 2.0,
            base + 30.0
        );
        (s, base + 44.0 - y0)
    }

    pub fn chart(r: &Report) -> String {
        let mut panels = Vec::new();
        let mut bottom = 50.0;
        let mut add = |(s, h): (String, f64)| {
            panels.push(s);
            bottom += h;
            bottom
        };
        let p = r.publish.rows_per_sec;
        let throughput = [
            bar("baseline publish (lapin)", p, BLUE),
            bar("baseline delete (sqlx)", r.delete.rows_per_sec, GREEN),
            bar(
                format!(
                    "burst (timeoutd), {:.0}% of publish",
                    100.0 * r.burst.rows_per_sec / p
                ),
                r.burst.rows_per_sec,
                ORANGE,
            ),
        ];
        let marks = [(0.8 * p, "target 80% of publish".to_owned())];
        let y1 = add(hbars("Throughput", "rows/s", &throughput, &marks, 50.0));
        let s = &r.steady;
        let title = format!("Steady {}/s for {} s: lateness histogram", s.rate, s.secs);
        let y2 = add(histogram(&title, &s.histogram, y1));
        let pct = [
            bar("p50", s.p50_ms, BLUE),
            bar("p90", s.p90_ms, BLUE),
            bar("p99", s.p99_ms, ORANGE),
            bar("max", s.max_ms, RED),
        ];
        let marks = [
            (20.0, "p99 ≤ 20".to_owned()),
            (100.0, "max ≤ 100".to_owned()),
        ];
        let y3 = add(hbars("Steady lateness percentiles", "ms", &pct, &marks, y2));
        let idle: Vec<Bar> = r
            .idle_scan
            .iter()
            .map(|i| {
                bar(
                    format!("{} rows not due", human(i.rows)),
                    i.median_ms,
                    GREEN,
                )
            })
            .collect();
        let marks = [(1.0, "1 ms".to_owned())];
        let y4 = add(hbars("Idle scan (median)", "ms", &idle, &marks, y3));
        let m = &r.memory;
        let mem = [
            bar("idle, before burst", m.idle_before_mib, BLUE),
            bar("peak (VmHWM), burst", m.burst_peak_mib, ORANGE),
            bar("idle, after steady", m.idle_after_mib, BLUE),
        ];
        let marks = [
            (32.0, "32 MiB idle".to_owned()),
            (96.0, "96 MiB peak".to_owned()),
        ];
        let height = add(hbars("Daemon memory (RSS)", "MiB", &mem, &marks, y4));
        let header = format!(
            "timeoutd-bench {} · batch {} · tick {} ms · burst {} rows",
            r.meta.started_at.format("%Y-%m-%d %H:%M UTC"),
            r.meta.daemon_scan_batch_size,
            r.meta.daemon_election_tick_ms,
            r.burst.rows
        );
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="10" y="28" font-size="18" font-weight="bold">{}</text>{}</svg>
"#,
            esc(&header),
            panels.join("")
        )
    }
}
