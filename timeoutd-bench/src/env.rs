//! The environment: schema, queue, consumer.

use crate::prelude::*;
use crate::*;

pub(crate) struct Env {
    pub(crate) schema: String,
    pub(crate) group: String,
    pub(crate) queue: String,
    pub(crate) pool: PgPool,
    pub(crate) amqp: Connection,
    pub(crate) inbox: Arc<Inbox>,
    pub(crate) settings: Settings,
    /// Schemas of the idle-scan tables, dropped with the main one.
    pub(crate) idle_schemas: Mutex<Vec<String>>,
    pub(crate) daemon_bin: PathBuf,
    /// `--daemon-log`: where daemon logs are written, if anywhere.
    pub(crate) daemon_log: Option<PathBuf>,
    pub(crate) daemon_rust_log: String,
    /// `--burst-hook`.
    pub(crate) burst_hook: Option<PathBuf>,
    pub(crate) amqp_url: String,
    pub(crate) pg_url: String,
}

impl Env {
    pub(crate) async fn setup(args: &Args, daemon_bin: PathBuf) -> Result<Self> {
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
        let amqp = connect_amqp(&args.amqp_url).await?;
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
            daemon_log: args.daemon_log.clone(),
            daemon_rust_log: args.daemon_rust_log.clone(),
            burst_hook: args.burst_hook.clone(),
            amqp_url: args.amqp_url.clone(),
            pg_url: args.pg_url.clone(),
        };
        if let Err(e) = migrate(&env.settings).await {
            env.cleanup().await;
            return Err(e.context("creating the schema"));
        }
        let target = env.settings.delay.target_exchange.as_str();
        if let Err(e) = declare_target(&env.amqp, target).await {
            env.cleanup().await;
            return Err(e.context("declaring the delayed messages' target exchange"));
        }
        Ok(env)
    }

    /// A daemon's environment: its schema and group, `/metrics` on `http`.
    pub(crate) fn daemon_env(
        &self,
        http: SocketAddr,
        schema: &str,
        group: &str,
    ) -> Vec<(String, String)> {
        let mut env = overrides(&self.amqp_url, &self.pg_url, schema, group);
        env.push(("TIMEOUTD__HTTP__LISTEN".to_owned(), http.to_string()));
        env
    }

    /// Run `--burst-hook` with `what` (start, stop) and the daemon's pid; a failure is
    /// printed, not returned.
    pub(crate) fn burst_hook(&self, what: &str, pid: u32) {
        let Some(hook) = &self.burst_hook else {
            return;
        };
        match std::process::Command::new(hook)
            .args([what, &pid.to_string()])
            .status()
        {
            Ok(s) if s.success() => {}
            Ok(s) => eprintln!("warning: {} {what} {pid}: {s}", hook.display()),
            Err(e) => eprintln!("warning: {} {what} {pid}: {e}", hook.display()),
        }
    }

    pub(crate) fn table(&self) -> String {
        format!("{}.expected_messages", self.schema)
    }

    pub(crate) async fn execute(&self, sql: String) -> Result<u64> {
        let done = sqlx::query(AssertSqlSafe(sql)).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }

    pub(crate) async fn count_rows(&self) -> Result<i64> {
        let sql = format!("SELECT count(*) FROM {}", self.table());
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await?)
    }

    /// A fresh `expected_messages` in its own schema, made by the daemon's migrations.
    pub(crate) async fn idle_table(&self, rows: u64) -> Result<String> {
        let schema = format!("{}_idle_{rows}", self.schema);
        if let Ok(mut schemas) = self.idle_schemas.lock() {
            schemas.push(schema.clone());
        }
        let mut settings = self.settings.clone();
        settings.postgres.schema = schema.clone();
        migrate(&settings).await?;
        Ok(format!("{schema}.expected_messages"))
    }

    /// Drop the schemas and the queue; errors are printed, not returned.
    pub(crate) async fn cleanup(&self) {
        let mut schemas = vec![self.schema.clone()];
        if let Ok(idle) = self.idle_schemas.lock() {
            schemas.extend(idle.iter().cloned());
        }
        for schema in schemas {
            self.drop_schema(&schema).await;
        }
        if let Err(e) = self.delete_queue().await {
            eprintln!("warning: could not delete queue {}: {e:#}", self.queue);
        }
        // Every daemon of the run declared the delayed-message ingress and target.
        delete_delayed_topology(self, &delayed_queues(self), true).await;
        let _ = bounded(
            "close",
            Duration::from_secs(5),
            self.amqp.close(200, "bye".into()),
        )
        .await;
        self.pool.close().await;
    }

    /// Drop a schema the daemon's migrations made, and the SQL API's role they made with
    /// it (`<schema>_api`, cluster-wide); errors are printed.
    pub(crate) async fn drop_schema(&self, schema: &str) {
        for drop in [
            format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
            format!("DROP ROLE IF EXISTS {schema}_api"),
        ] {
            if let Err(e) = self.execute(drop.clone()).await {
                eprintln!("warning: {drop}: {e:#}");
            }
        }
    }

    pub(crate) async fn delete_queue(&self) -> Result<()> {
        let channel = self.amqp.create_channel().await?;
        let delete =
            channel.queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default());
        bounded("queue delete", Duration::from_secs(5), delete).await??;
        Ok(())
    }
}

/// Create the schema and table exactly as the daemon does (its embedded migrations),
/// and write the rules of the SQL API from the daemon's settings, as it does.
pub(crate) async fn migrate(settings: &Settings) -> Result<()> {
    let store = Store::connect(&settings.postgres)?;
    let migrate = store.migrate_for(settings, "timeoutd-bench");
    let done = bounded("migrate", Duration::from_secs(30), migrate).await;
    store.close().await;
    done??;
    Ok(())
}

/// The run's own names for the daemon. Delayed messages go to an exchange of the run's
/// own (`delay.target_exchange`), removed at the end like the schema.
pub(crate) fn overrides(amqp: &str, pg: &str, schema: &str, group: &str) -> Vec<(String, String)> {
    let target = target_exchange(group);
    [
        ("TIMEOUTD__AMQP__URL", amqp),
        ("TIMEOUTD__POSTGRES__URL", pg),
        ("TIMEOUTD__POSTGRES__SCHEMA", schema),
        ("TIMEOUTD__ELECTION__GROUP", group),
        ("TIMEOUTD__LOG__FORMAT", "json"),
        ("TIMEOUTD__DELAY__TARGET_EXCHANGE", &target),
        // The bench's TimeOuts go through the default exchange straight to its queue
        // (rows written to the table directly): a benchmark of that path, held unless
        // allowed.
        ("TIMEOUTD__TIMEOUTS__ALLOW_DEFAULT_EXCHANGE", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Where the run's daemons deliver delayed messages.
pub(crate) fn target_exchange(group: &str) -> String {
    format!("timeoutd.delayed.{group}")
}

/// The settings the daemon will run with: this process' environment (the child inherits
/// it, so `TIMEOUTD__SCAN__BATCH_SIZE=…` applies) plus the run's overrides.
pub(crate) fn daemon_settings(args: &Args, schema: &str, group: &str) -> Result<Settings> {
    let env = std::env::vars().chain(overrides(&args.amqp_url, &args.pg_url, schema, group));
    Ok(Settings::load_from(None, env)?)
}

pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = T>,
) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("{what}: no answer within {limit:?}"))
}

/// A durable, auto-delete queue (TimeOuts are persistent messages, as in production),
/// consumed without acks.
pub(crate) async fn declare_queue(amqp: &Connection, queue: &str) -> Result<Consumer> {
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
pub(crate) struct Inbox {
    pub(crate) got: Mutex<Vec<(Uuid, DateTime<Utc>)>>,
    pub(crate) count: AtomicUsize,
    /// How many messages `wait_for` waits for (`usize::MAX`: nobody waits).
    awaited: AtomicUsize,
    /// Rung once `awaited` is reached: the waiter sleeps until then instead of polling,
    /// which would cost the bench's process CPU (and wake-ups) in one phase and not in
    /// another (the hand-rolled loop's phase waits for its process to say it is done).
    reached: tokio::sync::Notify,
}

impl Default for Inbox {
    fn default() -> Self {
        Self {
            got: Mutex::default(),
            count: AtomicUsize::new(0),
            awaited: AtomicUsize::new(usize::MAX),
            reached: tokio::sync::Notify::new(),
        }
    }
}

impl Inbox {
    pub(crate) fn push(&self, id: Uuid, at: DateTime<Utc>) {
        let Ok(mut got) = self.got.lock() else {
            return;
        };
        got.push((id, at));
        let count = got.len();
        // SeqCst here and in `wait_for`: each writes one of `count` and `awaited` and
        // then reads the other, so at least one of them sees the other's write.
        self.count.store(count, Ordering::SeqCst);
        drop(got);
        if count >= self.awaited.load(Ordering::SeqCst) {
            self.reached.notify_waiters();
        }
    }

    pub(crate) fn take(&self) -> Vec<(Uuid, DateTime<Utc>)> {
        let got = self.got.lock().map(|mut g| std::mem::take(&mut *g));
        self.count.store(0, Ordering::SeqCst);
        got.unwrap_or_default()
    }

    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Wait until `n` messages arrived; `false` after `limit`.
    pub(crate) async fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        self.awaited.store(n, Ordering::SeqCst);
        let arrived = loop {
            // Registered before the count is read, so a ring in between is not lost.
            let rung = self.reached.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            if self.len() >= n {
                break true;
            }
            if tokio::time::timeout_at(deadline, rung).await.is_err() {
                break self.len() >= n;
            }
        };
        self.awaited.store(usize::MAX, Ordering::SeqCst);
        arrived
    }
}

pub(crate) async fn consume(mut consumer: Consumer, inbox: Arc<Inbox>) {
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
pub(crate) struct Delivery {
    pub(crate) received: usize,
    pub(crate) distinct: usize,
    pub(crate) duplicates: usize,
    pub(crate) missing: usize,
}

impl Delivery {
    pub(crate) fn check(got: &[(Uuid, DateTime<Utc>)], expected: &HashSet<Uuid>) -> Self {
        let distinct: HashSet<Uuid> = got.iter().map(|(id, _)| *id).collect();
        Self {
            received: got.len(),
            distinct: distinct.len(),
            duplicates: got.len() - distinct.len(),
            missing: expected.difference(&distinct).count(),
        }
    }

    pub(crate) fn exact(&self, n: usize) -> bool {
        self.received == n && self.distinct == n && self.duplicates == 0 && self.missing == 0
    }
}

/// A connection to RabbitMQ of its own, given 10 s.
pub(crate) async fn connect_amqp(url: &str) -> Result<Connection> {
    Ok(bounded(
        "connect to RabbitMQ",
        Duration::from_secs(10),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await??)
}

/// A channel in confirm mode on `conn`.
pub(crate) async fn confirm_channel(conn: &Connection) -> Result<lapin::Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
