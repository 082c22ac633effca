//! Postgres: connection pool, embedded migrations, and the statements of the scan.
//!
//! Every statement names `<schema>.expected_messages`; the schema is a validated plain
//! identifier (see `config`), so formatting it into SQL is safe. The statements are built
//! once per store so sqlx's per-connection statement cache prepares each of them once.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgSslMode};
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::config;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid postgres.url: {0}")]
    Url(#[source] sqlx::Error),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// One due row, locked by the scan's transaction.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct DueRow {
    pub id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    pub payload: Option<serde_json::Value>,
    pub attempts: i32,
    /// Database clock when the row was read: never before `timeout_at`.
    pub fired_at: DateTime<Utc>,
}

/// A publish that did not go through: the row stays and is retried after `delay`.
#[derive(Debug, Clone)]
pub struct Failure {
    pub id: Uuid,
    pub error: String,
    pub delay: Duration,
}

/// What `timeoutd pending` and the gauges report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PendingCounts {
    pub pending: i64,
    pub due: i64,
    pub overdue: i64,
    pub failing: i64,
}

/// One row as `timeoutd pending --list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct PendingRow {
    pub id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub retry_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingFilter {
    All,
    Failing,
}

#[derive(Debug, Clone)]
struct Sql {
    lock_due: Arc<str>,
    next_due: Arc<str>,
    delete: Arc<str>,
    fail: Arc<str>,
    counts: Arc<str>,
    list_all: Arc<str>,
    list_failing: Arc<str>,
}

impl Sql {
    fn new(schema: &str) -> Self {
        let t = format!("{schema}.expected_messages");
        let due = "coalesce(retry_at, timeout_at)";
        // Clamped so '-infinity' / 'infinity' deadlines still decode (and fire, if due).
        let deadline = "least(greatest(timeout_at, '0001-01-01T00:00:00Z'), \
                        '9999-12-31T23:59:59Z') AS timeout_at";
        let cols = format!(
            "id, process_id, message_type, {deadline}, exchange, routing_key, attempts, \
             last_error, retry_at"
        );
        Self {
            lock_due: format!(
                "SELECT id, process_id, message_type, {deadline}, exchange, routing_key, \
                 payload, attempts, clock_timestamp() AS fired_at \
                 FROM {t} WHERE {due} <= now() ORDER BY {due} LIMIT $1 \
                 FOR UPDATE SKIP LOCKED"
            )
            .into(),
            // Seconds from now (database clock) to the earliest deadline: one index probe.
            next_due: format!(
                "SELECT extract(epoch FROM ({due} - now()))::float8 FROM {t} \
                 ORDER BY {due} LIMIT 1"
            )
            .into(),
            delete: format!("DELETE FROM {t} WHERE id = ANY($1)").into(),
            fail: format!(
                "UPDATE {t} AS m SET attempts = m.attempts + 1, last_error = f.error, \
                 retry_at = now() + make_interval(secs => f.delay) \
                 FROM unnest($1::uuid[], $2::text[], $3::float8[]) AS f(id, error, delay) \
                 WHERE m.id = f.id"
            )
            .into(),
            counts: format!(
                "SELECT count(*) AS pending, \
                 count(*) FILTER (WHERE timeout_at <= now()) AS due, \
                 count(*) FILTER (WHERE timeout_at <= now() - $1::interval) AS overdue, \
                 count(*) FILTER (WHERE attempts > 0) AS failing FROM {t}"
            )
            .into(),
            list_all: format!("SELECT {cols} FROM {t} ORDER BY timeout_at LIMIT $1").into(),
            list_failing: format!(
                "SELECT {cols} FROM {t} WHERE attempts > 0 ORDER BY timeout_at LIMIT $1"
            )
            .into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    schema: String,
    sql: Sql,
}

impl Store {
    /// A lazy pool: nothing connects until the first statement, so the daemon can start
    /// (and join the election) while the database is still down.
    pub fn connect(settings: &config::Postgres) -> Result<Self, StoreError> {
        Self::connect_as(settings, "timeoutd")
    }

    /// As [`Store::connect`], naming the sessions (`application_name`) so an operator
    /// can tell the nodes' backends apart in `pg_stat_activity`.
    pub fn connect_as(settings: &config::Postgres, name: &str) -> Result<Self, StoreError> {
        let options = connect_options(settings, name)?;
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.connect_timeout)
            .connect_lazy_with(options);
        Ok(Self {
            pool,
            schema: settings.schema.clone(),
            sql: Sql::new(&settings.schema),
        })
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Create the schema and apply the embedded migrations. The migrator holds an
    /// advisory lock, so replicas starting together apply them once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut migrator = sqlx::migrate!();
        migrator.create_schema(self.schema.clone());
        migrator.dangerous_set_table_name(format!("{}._sqlx_migrations", self.schema));
        migrator.run(&self.pool).await?;
        Ok(())
    }

    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        Ok(self.pool.begin().await?)
    }

    /// Lock up to `limit` due rows, oldest deadline first, skipping rows another scan holds.
    pub async fn lock_due(
        &self,
        tx: &mut PgConnection,
        limit: u32,
    ) -> Result<Vec<DueRow>, StoreError> {
        let rows = sqlx::query_as(safe(&self.sql.lock_due))
            .bind(i64::from(limit))
            .fetch_all(tx)
            .await?;
        Ok(rows)
    }

    /// Time until the earliest deadline by the database's clock (negative when rows are
    /// due, e.g. locked by another scan); `None` for an empty table. An infinite deadline
    /// reads as `None` too.
    pub async fn next_due_in(&self) -> Result<Option<f64>, StoreError> {
        let secs: Option<Option<f64>> = sqlx::query_scalar(safe(&self.sql.next_due))
            .fetch_optional(&self.pool)
            .await?;
        Ok(secs.flatten().filter(|s| s.is_finite()))
    }

    /// The channel the migrations' trigger notifies on new or moved deadlines.
    pub fn notify_channel(&self) -> String {
        let mut channel = format!("timeoutd_{}", self.schema);
        channel.truncate(63);
        channel
    }

    /// A listener on [`Store::notify_channel`] (one pooled connection, held).
    pub async fn listener(&self) -> Result<PgListener, StoreError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(&self.notify_channel()).await?;
        Ok(listener)
    }

    /// Delete the rows whose TimeOut was confirmed.
    pub async fn delete(&self, tx: &mut PgConnection, ids: &[Uuid]) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(safe(&self.sql.delete))
            .bind(ids)
            .execute(tx)
            .await?;
        Ok(done.rows_affected())
    }

    /// Keep the rows whose publish failed: attempts + 1, last_error, retry_at = now + delay.
    pub async fn record_failures(
        &self,
        tx: &mut PgConnection,
        failures: &[Failure],
    ) -> Result<(), StoreError> {
        if failures.is_empty() {
            return Ok(());
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<String> = failures.iter().map(|f| f.error.clone()).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
        sqlx::query(safe(&self.sql.fail))
            .bind(ids)
            .bind(errors)
            .bind(delays)
            .execute(tx)
            .await?;
        Ok(())
    }

    /// Counts for operators; `overdue` means due for longer than `late`.
    pub async fn pending_counts(&self, late: Duration) -> Result<PendingCounts, StoreError> {
        let row = sqlx::query(safe(&self.sql.counts))
            .bind(format!("{} milliseconds", late.as_millis()))
            .fetch_one(&self.pool)
            .await?;
        Ok(PendingCounts {
            pending: row.try_get("pending")?,
            due: row.try_get("due")?,
            overdue: row.try_get("overdue")?,
            failing: row.try_get("failing")?,
        })
    }

    /// Peek at rows, earliest deadline first; never changes them.
    pub async fn list(
        &self,
        filter: PendingFilter,
        limit: i64,
    ) -> Result<Vec<PendingRow>, StoreError> {
        let sql = match filter {
            PendingFilter::All => &self.sql.list_all,
            PendingFilter::Failing => &self.sql.list_failing,
        };
        Ok(sqlx::query_as(safe(sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// A round trip to the database, bounded by `limit`.
    pub async fn ping(&self, limit: Duration) -> Result<(), String> {
        let ping = sqlx::query("SELECT 1").execute(&self.pool);
        match tokio::time::timeout(limit, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {limit:?}")),
        }
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The statements are built from a validated identifier only (see `Sql::new`).
fn safe(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(sql.clone())
}

fn connect_options(
    settings: &config::Postgres,
    name: &str,
) -> Result<PgConnectOptions, StoreError> {
    let timeout = settings.statement_timeout.as_millis().to_string();
    let mut options = PgConnectOptions::from_str(&settings.url)
        .map_err(StoreError::Url)?
        .application_name(name)
        .options([
            ("search_path", settings.schema.clone()),
            ("statement_timeout", timeout.clone()),
            // A scanner frozen mid-batch (SIGSTOP, a dead VM) must not hold its row locks
            // forever: the server ends the session and the rows become visible again.
            ("idle_in_transaction_session_timeout", timeout),
        ]);
    if let Some(ca) = &settings.ca_file {
        options = options.ssl_root_cert(ca);
        // As libpq: given a root certificate, `require` also verifies the chain.
        if matches!(options.get_ssl_mode(), PgSslMode::Require) {
            options = options.ssl_mode(PgSslMode::VerifyCa);
        }
    }
    Ok(options)
}
