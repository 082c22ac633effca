//! Test harness against a real RabbitMQ and Postgres: the test services of
//! `tests/services.yml`, or others the `TIMEOUTD_TEST_*` variables name. Every test gets
//! its own schema, group and queues, so tests run in parallel and repeatably.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use sqlx::PgPool;
use timeoutd::client::{self, Expectation};
use timeoutd::config::Settings;
use timeoutd::daemon::{self, Handle};
use timeoutd::wire::announcement::Announcement;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader, Lines};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The compose file of the test services (`docker compose -f tests/services.yml up -d
/// --wait`): where the tests find RabbitMQ and Postgres unless the `TIMEOUTD_TEST_*`
/// variables name others (CI's main stage: the machine's own, `.ci/local-services.env`).
/// The defaults below are its published ports; nothing falls back to the standard ones.
pub const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/services.yml");

/// What to do when a service does not answer, for panic messages.
pub const START_SERVICES: &str = "start the test services with `docker compose -f \
    tests/services.yml up -d --wait`, or point TIMEOUTD_TEST_* at others (docs/testing.md)";

pub fn amqp_url() -> String {
    service(
        "TIMEOUTD_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:24672/%2f",
    )
}

pub fn pg_url() -> String {
    service(
        "TIMEOUTD_TEST_PG_URL",
        "postgres://postgres@127.0.0.1:24432/postgres",
    )
}

/// The broker's TLS listener, its certificate signed by [`tls_ca`] for the URL's host.
pub fn amqps_url() -> String {
    service(
        "TIMEOUTD_TEST_AMQPS_URL",
        "amqps://guest:guest@localhost:24671/%2f",
    )
}

/// `host:port` of the broker, for proxies in front of it.
pub fn amqp_addr() -> String {
    host_port(&amqp_url())
}

/// `host:port` of the database, for proxies in front of it.
pub fn pg_addr() -> String {
    host_port(&pg_url())
}

/// `rabbitmqctl` for the broker under test: `TIMEOUTD_TEST_RABBITMQCTL` (words split at
/// white space, e.g. `rabbitmqctl` or `docker exec NAME rabbitmqctl`), by default the
/// test services' through `docker compose exec`.
pub fn rabbitmqctl() -> tokio::process::Command {
    match std::env::var("TIMEOUTD_TEST_RABBITMQCTL") {
        Ok(line) => {
            let mut words = line.split_whitespace();
            let mut cmd = tokio::process::Command::new(words.next().unwrap_or("rabbitmqctl"));
            cmd.args(words);
            cmd
        }
        Err(_) => {
            let mut cmd = services_exec("rabbitmq");
            cmd.arg("rabbitmqctl");
            cmd.into()
        }
    }
}

/// `docker compose exec -T SERVICE` in the test services.
fn services_exec(service: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new("docker");
    cmd.args(["compose", "-f", SERVICES, "exec", "-T", service])
        // The project is the file's own (`name:`), whatever a shell set for another.
        .env_remove("COMPOSE_PROJECT_NAME")
        .env_remove("COMPOSE_FILE");
    cmd
}

/// The CA that signed the TLS listeners' certificate (for [`amqps_url`] and for
/// [`pg_url`] with an `sslmode`): `TIMEOUTD_TEST_TLS_CA`, by default the test services'
/// (copied once per process from their volume). The server's own certificate,
/// `server.pem`, lies beside it (as `.ci/tls-setup` and the test services leave them).
pub fn tls_ca() -> Result<PathBuf, String> {
    static CA: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    CA.get_or_init(|| match std::env::var_os("TIMEOUTD_TEST_TLS_CA") {
        Some(path) => Ok(PathBuf::from(path)),
        None => copy_services_tls(),
    })
    .clone()
}

/// Copy `ca.pem` and `server.pem` out of the test services' `tls` volume into this
/// build's scratch directory. Each file is written whole under a name of this process's
/// and renamed: test processes run at once.
fn copy_services_tls() -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("test-services-tls");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for name in ["ca.pem", "server.pem"] {
        let out = services_exec("rabbitmq")
            .args(["cat", &format!("/tls/{name}")])
            .output()
            .map_err(|e| format!("docker compose exec: {e}"))?;
        if !out.status.success() || out.stdout.is_empty() {
            return Err(format!(
                "cannot read /tls/{name} from the test services ({}): {START_SERVICES}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let path = dir.join(name);
        let part = dir.join(format!("{name}.{}", std::process::id()));
        std::fs::write(&part, &out.stdout)
            .and_then(|()| std::fs::rename(&part, &path))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(dir.join("ca.pem"))
}

fn service(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// `host:port` of a service URL, with its scheme's standard port when it names none.
pub fn host_port(url: &str) -> String {
    let url = url::Url::parse(url).expect("service URL");
    let host = url.host_str().expect("host");
    let port = url.port_or_known_default().unwrap_or(match url.scheme() {
        "amqp" => 5672,
        "amqps" => 5671,
        _ => 5432,
    });
    format!("{host}:{port}")
}

/// One isolated test world: a schema, a group, env overrides.
pub struct World {
    pub schema: String,
    pub group: String,
    pub pool: PgPool,
    pub overrides: Vec<(String, String)>,
}

/// The in-process daemons' logs on stderr when `RUST_LOG` is set (e.g.
/// `RUST_LOG=timeoutd::firing=debug cargo test --test it firing:: -- --nocapture`).
/// Only then: the subscriber is the process's, and under `cargo test` every test of the
/// binary shares the process (each one's expected errors would be printed amid the rest).
pub fn trace_when_asked() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// Fail at once, with the cause, when Postgres is not there: a pool retries a refused
/// connection until its acquire timeout (30 s per test) and then names only the timeout.
/// Once per process.
async fn require_postgres(url: &str) {
    use sqlx::Connection as _;
    use std::sync::atomic::{AtomicBool, Ordering};
    static ANSWERED: AtomicBool = AtomicBool::new(false);
    if ANSWERED.load(Ordering::Relaxed) {
        return;
    }
    match sqlx::PgConnection::connect(url).await {
        Ok(conn) => {
            let _ = conn.close().await;
            ANSWERED.store(true, Ordering::Relaxed);
        }
        Err(e) => panic!("Postgres at {url} does not answer ({e}); {START_SERVICES}"),
    }
}

impl World {
    pub async fn new() -> Self {
        trace_when_asked();
        let tag = Uuid::new_v4().simple().to_string()[..12].to_owned();
        let url = pg_url();
        require_postgres(&url).await;
        let pool = PgPool::connect(&url).await.unwrap_or_else(|e| {
            panic!("Postgres at {url} does not answer ({e}); {START_SERVICES}")
        });
        let world = Self {
            schema: format!("t_{tag}"),
            group: format!("g-{tag}"),
            pool,
            overrides: Vec::new(),
        };
        world.settings().validate().expect("valid test settings");
        world
    }

    /// The environment a daemon of this world runs with. With
    /// `TIMEOUTD_TEST_THROUGH_POOLER` set (a transaction pooler's database in front of
    /// the test Postgres, docs/testing.md) the daemons' pool goes through it and their
    /// sessions (`postgres.session_url`) straight to the server; the test itself always
    /// uses the server.
    pub fn env(&self) -> Vec<(String, String)> {
        self.env_with(&[])
    }

    /// Whether the daemons' pool goes through a transaction pooler
    /// (`TIMEOUTD_TEST_THROUGH_POOLER`): then the server's sessions are the pooler's,
    /// shared by every client, and cannot be counted per node.
    pub fn through_pooler() -> bool {
        std::env::var("TIMEOUTD_TEST_THROUGH_POOLER").is_ok_and(|u| !u.trim().is_empty())
    }

    /// [`World::env`] with `extra` on top. A daemon given a Postgres of its own (a
    /// proxy, another cluster) connects there alone, never through the pooler.
    pub fn env_with(&self, extra: &[(String, String)]) -> Vec<(String, String)> {
        const URL: &str = "TIMEOUTD__POSTGRES__URL";
        const SESSION: &str = "TIMEOUTD__POSTGRES__SESSION_URL";
        let pooler = std::env::var("TIMEOUTD_TEST_THROUGH_POOLER")
            .ok()
            .filter(|u| !u.trim().is_empty());
        let mut env = vec![
            ("TIMEOUTD__AMQP__URL".to_owned(), amqp_url()),
            (URL.to_owned(), pooler.clone().unwrap_or_else(pg_url)),
            ("TIMEOUTD__POSTGRES__SCHEMA".to_owned(), self.schema.clone()),
            ("TIMEOUTD__ELECTION__GROUP".to_owned(), self.group.clone()),
            (
                "TIMEOUTD__HTTP__LISTEN".to_owned(),
                "127.0.0.1:0".to_owned(),
            ),
            // Inboxes are queues on the default exchange: a deployment's conscious
            // choice, and this suite's (tests/it/sql_principals.rs runs without it).
            (
                "TIMEOUTD__TIMEOUTS__ALLOW_DEFAULT_EXCHANGE".to_owned(),
                "true".to_owned(),
            ),
        ];
        if pooler.is_some() {
            env.push((SESSION.to_owned(), pg_url()));
        }
        let on_top: Vec<_> = self.overrides.iter().chain(extra).cloned().collect();
        let own = on_top.iter().any(|(k, _)| k == URL) && !on_top.iter().any(|(k, _)| k == SESSION);
        env.extend(on_top);
        if own {
            env.retain(|(k, _)| k != SESSION);
        }
        env
    }

    pub fn settings(&self) -> Settings {
        Settings::load_from(None, self.env()).expect("settings")
    }

    /// Create the schema (what `timeoutd run` does at start) without a daemon.
    pub async fn migrate(&self) {
        let settings = self.settings();
        let store = timeoutd::store::Store::connect(&settings.postgres).expect("store");
        store.migrate_for(&settings, "test").await.expect("migrate");
        store.close().await;
    }

    /// A daemon in this process.
    pub async fn start(&self) -> Handle {
        daemon::start(self.settings(), CancellationToken::new())
            .await
            .expect("daemon starts")
    }

    pub async fn expect(&self, e: &Expectation) -> Uuid {
        let mut conn = self.pool.acquire().await.expect("conn");
        client::expect(&mut conn, &self.schema, e)
            .await
            .expect("insert")
    }

    pub async fn count(&self, filter: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {}.expected_messages WHERE {filter}",
            self.schema
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    /// Run one statement of the test's own.
    pub async fn exec(&self, sql: &str) {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// The delayed-message ingress exchange and queue of this world's group.
    pub fn ingress(&self) -> String {
        format!("timeoutd.delay.{}", self.group)
    }

    pub async fn cleanup(self) {
        // The ingress queue and exchange are durable: remove them (best effort, bounded:
        // the verdict is in, a teardown must not hang the run).
        let broker = async {
            let conn = amqp().await;
            if let Ok(ch) = conn.create_channel().await {
                let name = self.ingress();
                let _ = ch
                    .queue_delete(name.as_str().into(), Default::default())
                    .await;
                let _ = ch
                    .exchange_delete(name.as_str().into(), Default::default())
                    .await;
            }
            let _ = conn.close(200, "OK".into()).await;
        };
        if tokio::time::timeout(PATIENCE, broker).await.is_err() {
            eprintln!("cleanup: the broker did not answer within {PATIENCE:?}; left as is");
        }
        self.drop_schema().await;
        self.pool.close().await;
    }

    /// DROP SCHEMA, which waits for every lock on its tables: sessions still holding
    /// one after the test (a daemon that did not let go) are named, then ended.
    async fn drop_schema(&self) {
        // The migrations create the role <schema>_api (cluster-wide): dropped with it.
        let drop = format!(
            "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {s} CASCADE; RESET lock_timeout; \
             DROP ROLE IF EXISTS {s}_api",
            s = self.schema
        );
        for _ in 0..3 {
            let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(drop.clone()))
                .execute(&self.pool)
                .await
            else {
                return;
            };
            let holders: Vec<(i32, Option<String>, Option<String>, String)> = sqlx::query_as(
                "SELECT DISTINCT a.pid, a.application_name, a.state, a.query \
                 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()",
            )
            .bind(&self.schema)
            .fetch_all(&self.pool)
            .await
            .unwrap_or_default();
            eprintln!(
                "cleanup: DROP SCHEMA {}: {e}; in its way: {holders:?}",
                self.schema
            );
            for (pid, ..) in holders {
                let _ = sqlx::query("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .execute(&self.pool)
                    .await;
            }
        }
        panic!("cleanup: could not drop schema {}", self.schema);
    }
}

pub async fn amqp() -> Connection {
    amqp_at(&amqp_url()).await
}

/// A connection as the user (and to the vhost) of `url`.
pub async fn amqp_at(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {url} does not answer ({e}); {START_SERVICES}"))
}

/// A received TimeOut.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: DateTime<Utc>,
    pub properties: lapin::BasicProperties,
    pub routing_key: String,
    pub body: serde_json::Value,
    /// The body as it arrived.
    pub raw: Vec<u8>,
}

impl Received {
    /// The `x-timeoutd-node` header: which node fired it.
    pub fn sender(&self) -> Option<String> {
        self.header_str("x-timeoutd-node")
    }

    /// A header whose value is a string.
    pub fn header_str(&self, name: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            lapin::types::AMQPValue::LongString(s) => Some(s.to_string()),
            _ => None,
        }
    }

    pub fn message_id(&self) -> String {
        let id = self.properties.message_id().as_ref();
        id.map(|s| s.to_string()).unwrap_or_default()
    }

    /// A TimeOut's `fired_at`: when the daemon sent it, by the database's clock. Unlike
    /// `at` it holds neither the broker's nor this test's scheduling.
    pub fn fired_at(&self) -> DateTime<Utc> {
        self.body["fired_at"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no fired_at in {}", self.body))
    }
}

/// An exclusive queue that collects what arrives, keyed by `message_id`.
pub struct Inbox {
    pub queue: String,
    pub got: Arc<Mutex<Vec<Received>>>,
    _conn: Connection,
}

impl Inbox {
    /// A queue reached through the default exchange with routing key = its name.
    pub async fn new() -> Self {
        Self::at(&amqp_url(), None).await
    }

    /// A queue bound to a fresh topic exchange `(exchange, key)`.
    pub async fn on_exchange(exchange: &str, key: &str) -> Self {
        Self::at(&amqp_url(), Some((exchange, key))).await
    }

    /// As [`Inbox::new`] or [`Inbox::on_exchange`], as the user and in the vhost of `url`.
    pub async fn at(url: &str, binding: Option<(&str, &str)>) -> Self {
        let conn = amqp_at(url).await;
        let ch = conn.create_channel().await.expect("channel");
        let auto_delete = ExchangeDeclareOptions {
            auto_delete: true,
            ..ExchangeDeclareOptions::default()
        };
        let (queue, mut consumer) =
            consumed_queue(&ch, binding.map(|(x, k)| (x, k, auto_delete))).await;
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let body = serde_json::from_slice(&d.data).unwrap_or(serde_json::Value::Null);
                sink.lock().expect("lock").push(Received {
                    at: Utc::now(),
                    properties: d.properties.clone(),
                    routing_key: d.routing_key.to_string(),
                    body,
                    raw: d.data,
                });
            }
        });
        Self {
            queue,
            got,
            _conn: conn,
        }
    }

    pub fn all(&self) -> Vec<Received> {
        self.got.lock().expect("lock").clone()
    }

    /// Also receive what a new auto-delete topic exchange `exchange` routes with `key`
    /// (declared and bound on the queue's own connection: the queue is exclusive).
    pub async fn bind_new_exchange(&self, exchange: &str, key: &str) {
        let ch = self._conn.create_channel().await.expect("channel");
        let opts = ExchangeDeclareOptions {
            auto_delete: true,
            ..ExchangeDeclareOptions::default()
        };
        bind_to_exchange(&ch, &self.queue, (exchange, key, opts)).await;
        let _ = ch.close(200, "OK".into()).await;
    }

    pub fn len(&self) -> usize {
        self.got.lock().expect("lock").len()
    }

    /// How many times each message_id arrived.
    pub fn counts(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for r in self.all() {
            *m.entry(r.message_id()).or_default() += 1;
        }
        m
    }
}

/// An exclusive server-named queue, optionally bound to `(exchange, key)` (declared with
/// the given options), consumed without acks.
pub async fn consumed_queue(
    ch: &lapin::Channel,
    binding: Option<(&str, &str, ExchangeDeclareOptions)>,
) -> (String, lapin::Consumer) {
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions::exclusive(),
            FieldTable::default(),
        )
        .await
        .expect("queue");
    if let Some(binding) = binding {
        bind_to_exchange(ch, q.name().as_str(), binding).await;
    }
    let opts = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    let consumer = ch
        .basic_consume(q.name().clone(), "".into(), opts, FieldTable::default())
        .await
        .expect("consume");
    (q.name().to_string(), consumer)
}

/// Declare the topic exchange of `(exchange, key, options)` and bind `queue` to it.
async fn bind_to_exchange(
    ch: &lapin::Channel,
    queue: &str,
    (exchange, key, opts): (&str, &str, ExchangeDeclareOptions),
) {
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        opts,
        FieldTable::default(),
    )
    .await
    .expect("exchange");
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
}

/// One announcement seen on the group's routing key.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: Instant,
    pub a: Announcement,
}

/// Listens to a group's announcements, like any member does.
pub struct Observer {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    _conn: Connection,
}

impl Observer {
    pub async fn new(group: &str) -> Self {
        let conn = amqp().await;
        let ch = conn.create_channel().await.expect("channel");
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let binding = ("timeoutd.announcements", group, durable);
        let (_, mut consumer) = consumed_queue(&ch, Some(binding)).await;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let group = group.to_owned();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                if let Ok(a) = Announcement::decode(None, &d.data, &group) {
                    sink.lock().expect("lock").push(Seen {
                        at: Instant::now(),
                        a,
                    });
                }
            }
        });
        Self { seen, _conn: conn }
    }

    pub fn all(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// First announcement after `since` matching `f`.
    pub fn first_after(&self, since: Instant, f: impl Fn(&Announcement) -> bool) -> Option<Seen> {
        self.all().into_iter().find(|s| s.at >= since && f(&s.a))
    }

    /// Wait for the first announcement after `since` matching `f`. What a node published
    /// before it exited may still be on its way to this observer when the exit is seen.
    pub async fn await_first_after(
        &self,
        since: Instant,
        what: &str,
        f: impl Fn(&Announcement) -> bool,
    ) -> Seen {
        let mut seen = None;
        wait_for(PATIENCE, what, || {
            seen = self.first_after(since, &f);
            seen.is_some()
        })
        .await;
        seen.expect("waited for")
    }
}

/// The most a test waits for something a healthy daemon does within a second or two: a
/// node becoming active, a TimeOut or a delayed message arriving, a row deleted, a line
/// logged. Waits poll and return as soon as their condition holds, so only a test that
/// fails anyway waits this long. It is this long because on a shared two-core machine
/// under load (builds and other test runs beside this one) every step behind such a
/// condition may queue for a core: a test must not fail for the machine's speed. Where
/// the time *is* the point (a promise of the contract), the test measures it with the
/// daemon's own stamps and bounds it by the settings, apart from these waits.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Slack on a promise measured by the daemons' own stamps (`sent_at` of announcements,
/// `fired_at` of TimeOuts), for what those stamps still hold of the machine: a message
/// from one node to another through the broker, a timer firing late while other work
/// takes the cores. Small beside what a broken promise costs (a `member_ttl`, a sweep).
pub const STAMP_SLACK: Duration = Duration::from_secs(1);

/// Wait until the lowest of `procs` claims the role (announced since `since`); its
/// index.
pub async fn lowest_active(observer: &Observer, procs: &[Proc], since: Instant) -> usize {
    let lowest = procs.iter().map(|p| p.node_id).min().expect("procs");
    observer
        .await_first_after(since, "lowest node active", |a| {
            a.active && a.node_id == lowest
        })
        .await;
    procs
        .iter()
        .position(|p| p.node_id == lowest)
        .expect("lowest")
}

/// Wait until `node` holds the active role.
pub async fn wait_active(node: &Handle) {
    wait_for(PATIENCE, "node active", || {
        *node.role.borrow() == timeoutd::election::Role::Active
    })
    .await;
}

/// How long a stopped daemon may take to exit: its own bound, `shutdown.timeout` by its
/// clock, and as much again for the exit to be seen here on a loaded machine.
pub fn exit_within(world: &World) -> Duration {
    world.settings().shutdown.timeout * 2
}

/// Poll `cond` every 20 ms until it holds or `limit` passes.
pub async fn wait_for<F: FnMut() -> bool>(limit: Duration, what: &str, mut cond: F) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Same as `wait_for` with an async condition.
pub async fn wait_for_async<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long a daemon may take to print its ready line (it connects to both services
/// first).
const READY_WITHIN: Duration = PATIENCE;

/// A `timeoutd run` process. Its node id and HTTP address come from the ready line it
/// prints on stdout (the documented interface, not the log text); its JSON log (stderr)
/// is collected for `logged` and for failure dumps.
pub struct Proc {
    pub child: tokio::process::Child,
    pub node_id: Uuid,
    /// Where it serves `/healthz`, `/readyz`, `/status` and `/metrics` (bound address).
    pub http_addr: SocketAddr,
    /// The ready line as printed.
    pub ready: serde_json::Value,
    /// Everything it printed on stdout, the ready line first.
    pub stdout: Arc<Mutex<Vec<String>>>,
    stdout_reader: tokio::task::JoinHandle<()>,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub async fn spawn(world: &World) -> Self {
        Self::spawn_with(world, &[]).await
    }

    /// A daemon of `world` with extra environment of its own (e.g. its own proxy).
    pub async fn spawn_with(world: &World, extra: &[(String, String)]) -> Self {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"));
        cmd.arg("run")
            .envs(world.env_with(extra))
            .env("TIMEOUTD__LOG__FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn timeoutd");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let logging = tokio::spawn(collect_lines(stderr, log.clone()));
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = match tokio::time::timeout(READY_WITHIN, lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(read) => {
                // stdout closed (or unreadable) without a line: the daemon is exiting.
                let status = match tokio::time::timeout(Duration::from_secs(10), child.wait()).await
                {
                    Ok(Ok(status)) => status.to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "still running 10 s later".to_owned(),
                };
                let _ = tokio::time::timeout(Duration::from_secs(2), logging).await;
                panic!(
                    "timeoutd exited before printing its ready line \
                     (stdout: {read:?}, {status}); its log:\n{}",
                    tail(&log)
                );
            }
            Err(_) => panic!(
                "timeoutd printed no ready line within {READY_WITHIN:?}; its log:\n{}",
                tail(&log)
            ),
        };
        let (node_id, http_addr, ready) = parse_ready(&first)
            .unwrap_or_else(|e| panic!("bad ready line {first:?}: {e}; log:\n{}", tail(&log)));
        let stdout = Arc::new(Mutex::new(vec![first]));
        let stdout_reader = tokio::spawn(collect_lines(lines, stdout.clone()));
        Self {
            child,
            node_id,
            http_addr,
            ready,
            stdout,
            stdout_reader,
            log,
        }
    }

    /// `n` daemons of one world, started one after the other.
    pub async fn group(world: &World, n: usize) -> Vec<Self> {
        let mut procs = Vec::new();
        for _ in 0..n {
            procs.push(Self::spawn(world).await);
        }
        procs
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGTERM, and its exit status once it exited, which it must within `exit_within`.
    pub async fn terminate(&mut self, world: &World) -> std::process::ExitStatus {
        self.signal("TERM");
        tokio::time::timeout(exit_within(world), self.child.wait())
            .await
            .expect("exits on SIGTERM within the shutdown bound")
            .expect("wait")
    }

    /// Whether stdout has been read to its end (the daemon closed it: it exited).
    pub fn stdout_closed(&self) -> bool {
        self.stdout_reader.is_finished()
    }

    pub fn logged(&self, needle: &str) -> bool {
        self.log
            .lock()
            .expect("lock")
            .iter()
            .any(|l| l.contains(needle))
    }
}

impl Drop for Proc {
    /// A failing test shows what its daemons said.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- log of node {} at {} (last 40 lines)\n{}",
                self.node_id,
                self.http_addr,
                tail(&self.log)
            );
        }
    }
}

/// Append each line of `lines` to `into` until end of file.
async fn collect_lines<R: AsyncBufRead + Unpin>(
    mut lines: Lines<R>,
    into: Arc<Mutex<Vec<String>>>,
) {
    while let Ok(Some(line)) = lines.next_line().await {
        into.lock().expect("lock").push(line);
    }
}

/// The node id, the HTTP address and the whole of a ready line.
fn parse_ready(line: &str) -> Result<(Uuid, SocketAddr, serde_json::Value), String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    if v["ready"] != true {
        return Err("no \"ready\": true".to_owned());
    }
    let field = |name: &str| v[name].as_str().ok_or(format!("no string {name:?}"));
    let node_id = field("node_id")?
        .parse()
        .map_err(|e| format!("node_id: {e}"))?;
    let http_addr = field("http_addr")?
        .parse()
        .map_err(|e| format!("http_addr: {e}"))?;
    Ok((node_id, http_addr, v))
}

/// The last 40 lines of a log, for panic messages.
fn tail(log: &Mutex<Vec<String>>) -> String {
    let log = log.lock().unwrap_or_else(|e| e.into_inner());
    let from = log.len().saturating_sub(40);
    log[from..].join("\n")
}

/// The defaults above are what `tests/services.yml` publishes, on loopback only.
#[test]
fn the_defaults_are_the_test_services_ports() {
    let text = std::fs::read_to_string(SERVICES).expect("tests/services.yml");
    let file: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    let published = |service: &str| -> Vec<String> {
        file["services"][service]["ports"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{service} publishes no ports"))
            .iter()
            .map(|p| p.as_str().expect("a port as a string").to_owned())
            .collect()
    };
    let port = |url: &str| host_port(url).rsplit(':').next().expect("port").to_owned();
    let defaults = [
        ("rabbitmq", "TIMEOUTD_TEST_AMQP_URL", amqp_url(), 5672),
        ("rabbitmq", "TIMEOUTD_TEST_AMQPS_URL", amqps_url(), 5671),
        ("postgres", "TIMEOUTD_TEST_PG_URL", pg_url(), 5432),
    ];
    for (service, var, url, inside) in defaults {
        if std::env::var_os(var).is_some() {
            continue; // another service: nothing to compare
        }
        let mapping = format!("127.0.0.1:{}:{inside}", port(&url));
        assert!(
            published(service).contains(&mapping),
            "{service} in tests/services.yml does not publish {mapping} ({var} default {url})"
        );
    }
}

/// `clients` clients on a thread and a runtime of their own (so that the node under test
/// does not serve its own flood), client `c` asking `ask(step)` for step `c`, `c + 1`, …
/// until `stopped`; what each answer counted, summed over all.
pub fn flood<T, F, Fut>(
    clients: usize,
    stopped: tokio::sync::watch::Receiver<bool>,
    ask: F,
) -> std::thread::JoinHandle<T>
where
    T: Default + std::ops::AddAssign + Send + 'static,
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the flood's clients");
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let mut set = tokio::task::JoinSet::new();
            for first in 0..clients {
                let (mut stopped, ask) = (stopped.clone(), ask.clone());
                set.spawn(async move {
                    let mut got = T::default();
                    for step in first.. {
                        tokio::select! {
                            _ = stopped.changed() => break,
                            one = ask(step) => got += one,
                        }
                    }
                    got
                });
            }
            let mut all = T::default();
            while let Some(Ok(got)) = set.join_next().await {
                all += got;
            }
            all
        })
    })
}
