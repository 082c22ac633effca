//! Postgres: connection pool, embedded migrations, and the statements of the scan.
//!
//! A kind of due row lives in a [`Table`]; the writes of the firing transaction (delete,
//! charge, park, delete-if-unchanged) are the same statements for every table. Every
//! statement names `<schema>.<table>`; the schema is a validated plain identifier (see
//! `config`) and the table a constant, so formatting them into SQL is safe. The
//! statements are built once per store so sqlx's per-connection statement cache prepares
//! each of them once.

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
    #[error("invalid postgres.url")]
    Url(#[source] sqlx::Error),
    #[error("database")]
    Db(#[from] sqlx::Error),
    #[error("migration")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database: no answer within {0:?}")]
    NoAnswer(Duration),
    #[error("no statements for table {0}")]
    UnknownTable(&'static str),
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
    /// The payload as Postgres prints it (always valid JSON), embedded in the TimeOut as
    /// is: jsonb holds numbers and nesting depths that a JSON library may refuse, and
    /// such a row must still fire. `None` for SQL NULL, and for a payload larger than the
    /// limit the scan asked for (then `payload_bytes` says how large).
    pub payload: Option<String>,
    pub payload_bytes: Option<i32>,
    pub attempts: i32,
    /// Database clock when the row was read: never before `timeout_at`.
    pub fired_at: DateTime<Utc>,
}

impl DueRow {
    /// The payload was left in the database because it is larger than the limit.
    pub fn payload_withheld(&self) -> Option<usize> {
        match (&self.payload, self.payload_bytes) {
            (None, Some(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => None,
        }
    }
}

/// A publish that did not go through: the row stays and is retried after `delay`.
#[derive(Debug, Clone)]
pub struct Failure {
    pub id: Uuid,
    pub error: String,
    pub delay: Duration,
}

/// A row whose message was confirmed but whose batch did not commit: it is deleted
/// later if it still has the deadline it was fired for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fired {
    pub id: Uuid,
    pub deadline: DateTime<Utc>,
}

/// A table of due rows: its name and the column holding the deadline. Everything the
/// firing transaction writes is the same for every such table (see [`Writes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Table {
    name: &'static str,
    deadline: &'static str,
}

/// The process manager's expectations (contract section 2).
pub const EXPECTATIONS: Table = Table {
    name: "expected_messages",
    deadline: "timeout_at",
};

/// Every table the scan fires from.
const TABLES: [Table; 1] = [EXPECTATIONS];

/// What [`Store::settle`] could not do the fast way.
#[derive(Debug, Default)]
pub struct Settlement {
    /// Confirmed rows that could not be deleted (a constraint or trigger of the process
    /// manager refused): kept with `retry_at = 'infinity'` so they never fire again.
    pub parked: Vec<(Uuid, String)>,
    /// Confirmed rows whose delete waited too long for a lock: to delete later, in a
    /// transaction of their own.
    pub later: Vec<Uuid>,
    /// Confirmed rows that could be neither deleted nor parked: they must not be
    /// published again by this process.
    pub stuck: Vec<(Uuid, String)>,
    /// Failed rows whose failure could not be written: not to be retried at once.
    pub uncharged: Vec<(Uuid, String)>,
}

/// Why the database did not take one write.
#[derive(Debug, Clone)]
struct Refusal {
    /// It waited too long (a lock held by someone else, the statement timeout): it may
    /// well pass later.
    busy: bool,
    reason: String,
}

/// Longest `last_error` stored; the rest of a long error message adds nothing.
const MAX_ERROR_CHARS: usize = 1000;
/// `attempts + 1` that cannot overflow (rows written by other tools may hold anything).
const NEXT_ATTEMPT: &str = "CASE WHEN m.attempts < 2147483647 THEN m.attempts + 1 \
                            ELSE m.attempts END";

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
    /// Its TimeOut was delivered but the row could not be deleted: it never fires again
    /// and waits for an operator (see `last_error`).
    pub parked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingFilter {
    All,
    Failing,
}

impl Table {
    /// Due means: the deadline has passed and so has any retry time (`greatest` ignores
    /// NULL). The expression index of migration 0003 serves exactly this expression.
    fn due_at(&self) -> String {
        format!("greatest(m.{}, m.retry_at)", self.deadline)
    }

    /// The deadline clamped so '-infinity' / 'infinity' still decode (and fire, if due).
    fn deadline(&self) -> String {
        format!(
            "least(greatest(m.{}, '0001-01-01T00:00:00Z'), '9999-12-31T23:59:59Z')",
            self.deadline
        )
    }

    /// Which rows are due: `deadline <= now()` is implied by the due expression; it is
    /// spelled out so that no change to the bookkeeping can ever make a row fire before
    /// its deadline.
    fn due(&self) -> String {
        format!(
            "{} <= now() AND m.{} <= now()",
            self.due_at(),
            self.deadline
        )
    }
}

/// The statement that finds and locks due rows, for `table` (bound: `$1` limit, `$2`
/// largest payload to fetch with the row, in bytes, `$3` ids to skip). The benchmark
/// runs it too.
pub fn lock_due_sql(table: &str) -> String {
    // The payload is rendered once per row (OFFSET 0 keeps the subquery from being
    // inlined into each use) and left behind when it is large (see `Store::payload`), so
    // that a batch of large payloads cannot take batch_size × max_message_size of memory.
    let (deadline, due, due_at) = (
        EXPECTATIONS.deadline(),
        EXPECTATIONS.due(),
        EXPECTATIONS.due_at(),
    );
    format!(
        "SELECT m.id, m.process_id, m.message_type, {deadline} AS timeout_at, m.exchange, \
         m.routing_key, CASE WHEN octet_length(p.text) <= $2 THEN p.text END AS payload, \
         octet_length(p.text) AS payload_bytes, m.attempts, clock_timestamp() AS fired_at \
         FROM {table} AS m, LATERAL (SELECT m.payload::text OFFSET 0) AS p(text) \
         WHERE {due} AND m.id <> ALL($3) ORDER BY {due_at} LIMIT $1 FOR UPDATE OF m SKIP LOCKED"
    )
}

/// The writes of the firing transaction on one table, and its next-deadline probe.
#[derive(Debug, Clone)]
struct Writes {
    table: Table,
    next_due: Arc<str>,
    delete: Arc<str>,
    delete_fired: Arc<str>,
    fail: Arc<str>,
    park: Arc<str>,
}

impl Writes {
    fn new(schema: &str, table: Table) -> Self {
        let t = format!("{schema}.{}", table.name);
        let (deadline, due_at) = (table.deadline(), table.due_at());
        Self {
            table,
            // Seconds from now (database clock) to the earliest deadline: one index probe.
            next_due: format!(
                "SELECT extract(epoch FROM ({due_at} - now()))::float8 FROM {t} AS m \
                 ORDER BY {due_at} LIMIT 1"
            )
            .into(),
            delete: format!("DELETE FROM {t} WHERE id = ANY($1)").into(),
            delete_fired: format!(
                "DELETE FROM {t} AS m USING unnest($1::uuid[], $2::timestamptz[]) AS f(id, at) \
                 WHERE m.id = f.id AND {deadline} = f.at"
            )
            .into(),
            fail: format!(
                "UPDATE {t} AS m SET attempts = {NEXT_ATTEMPT}, last_error = f.error, \
                 retry_at = now() + make_interval(secs => f.delay) \
                 FROM unnest($1::uuid[], $2::text[], $3::float8[]) AS f(id, error, delay) \
                 WHERE m.id = f.id"
            )
            .into(),
            park: format!(
                "UPDATE {t} AS m SET attempts = {NEXT_ATTEMPT}, last_error = $2, \
                 retry_at = 'infinity' WHERE m.id = $1"
            )
            .into(),
        }
    }
}

#[derive(Debug, Clone)]
struct Sql {
    lock_due: Arc<str>,
    payload: Arc<str>,
    writes: Vec<Writes>,
    counts: Arc<str>,
    list_all: Arc<str>,
    list_failing: Arc<str>,
}

impl Sql {
    fn new(schema: &str) -> Self {
        let t = format!("{schema}.expected_messages");
        // A parked row's retry_at is 'infinity', which no client type holds: it is shown
        // as `parked` instead.
        let deadline = EXPECTATIONS.deadline();
        let cols = format!(
            "m.id, m.process_id, m.message_type, {deadline} AS timeout_at, m.exchange, \
             m.routing_key, m.attempts, m.last_error, \
             CASE WHEN isfinite(m.retry_at) THEN m.retry_at END AS retry_at, \
             coalesce(m.retry_at = 'infinity', false) AS parked"
        );
        Self {
            lock_due: lock_due_sql(&t).into(),
            payload: format!("SELECT payload::text FROM {t} WHERE id = $1").into(),
            writes: TABLES.iter().map(|t| Writes::new(schema, *t)).collect(),
            counts: format!(
                "SELECT count(*) AS pending, \
                 count(*) FILTER (WHERE timeout_at <= now()) AS due, \
                 count(*) FILTER (WHERE timeout_at <= now() - $1::interval) AS overdue, \
                 count(*) FILTER (WHERE attempts > 0) AS failing FROM {t}"
            )
            .into(),
            list_all: format!("SELECT {cols} FROM {t} AS m ORDER BY m.timeout_at LIMIT $1").into(),
            list_failing: format!(
                "SELECT {cols} FROM {t} AS m WHERE m.attempts > 0 ORDER BY m.timeout_at LIMIT $1"
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

    /// A scan transaction. READ COMMITTED whatever the server's default (a serialization
    /// failure at commit would fail a batch whose TimeOuts are already confirmed), and
    /// every deferred constraint checked at its statement instead of at COMMIT, so that a
    /// row the process manager's constraints refuse to delete fails in `settle`, alone,
    /// and never the commit of the whole batch.
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        let begin = "BEGIN ISOLATION LEVEL READ COMMITTED; SET CONSTRAINTS ALL IMMEDIATE";
        Ok(self.pool.begin_with(begin).await?)
    }

    /// Lock up to `limit` due rows, oldest due first, skipping rows another scan holds and
    /// the ids in `skip`. Payloads over `inline` bytes are left in the database.
    pub async fn lock_due(
        &self,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
    ) -> Result<Vec<DueRow>, StoreError> {
        let rows = sqlx::query_as(safe(&self.sql.lock_due))
            .bind(i64::from(limit))
            .bind(i64::try_from(inline).unwrap_or(i64::MAX))
            .bind(skip)
            .fetch_all(tx)
            .await?;
        Ok(rows)
    }

    /// The payload of one (locked) row as text, for payloads `lock_due` left behind.
    pub async fn payload(
        &self,
        tx: &mut PgConnection,
        id: Uuid,
    ) -> Result<Option<String>, StoreError> {
        let text = sqlx::query_scalar(safe(&self.sql.payload))
            .bind(id)
            .fetch_optional(tx)
            .await?;
        Ok(text.flatten())
    }

    /// Time until the earliest deadline of any table by the database's clock (negative
    /// when rows are due, e.g. locked by another scan); `None` when nothing is pending.
    /// An infinite deadline reads as `None` too.
    pub async fn next_due_in(&self) -> Result<Option<f64>, StoreError> {
        let mut earliest: Option<f64> = None;
        for writes in &self.sql.writes {
            let secs: Option<Option<f64>> = sqlx::query_scalar(safe(&writes.next_due))
                .fetch_optional(&self.pool)
                .await?;
            if let Some(s) = secs.flatten().filter(|s| s.is_finite()) {
                earliest = Some(earliest.map_or(s, |e| e.min(s)));
            }
        }
        Ok(earliest)
    }

    fn writes(&self, table: Table) -> Result<&Writes, StoreError> {
        self.sql
            .writes
            .iter()
            .find(|w| w.table == table)
            .ok_or(StoreError::UnknownTable(table.name))
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

    /// Write the fate of a batch whose TimeOuts were published: delete the confirmed
    /// rows, charge the failed ones. One row must not be able to fail it (a confirmed
    /// batch is never rolled back): a write the database refuses is undone to a
    /// savepoint and retried on halves until the refusing rows stand alone; those are
    /// parked (confirmed) or reported (failed). Only a broken connection is an error.
    pub async fn settle(
        &self,
        tx: &mut PgConnection,
        table: Table,
        confirmed: &[Uuid],
        failures: &[Failure],
    ) -> Result<Settlement, StoreError> {
        let w = self.writes(table)?;
        let both = attempt(tx, w, Write::Both(confirmed, failures)).await?;
        if both.is_ok() {
            return Ok(Settlement::default());
        }
        let refused = in_halves(tx, w, confirmed, Write::Delete).await?;
        let mut out = park_refused(tx, w, refused).await?;
        let refused = in_halves(tx, w, failures, Write::Charge).await?;
        out.uncharged
            .extend(refused.into_iter().map(|(f, r)| (f.id, r.reason)));
        Ok(out)
    }

    /// Delete rows fired by a batch that failed to commit, if they still have the
    /// deadline they were fired for (a moved deadline is the process manager's new
    /// intent: that row fires again). Its own transaction; a row the database will not
    /// let go is parked, as in [`Store::settle`].
    pub async fn delete_fired(
        &self,
        table: Table,
        fired: &[Fired],
    ) -> Result<Settlement, StoreError> {
        let w = self.writes(table)?;
        let mut tx = self.begin().await?;
        let refused = in_halves(&mut tx, w, fired, Write::DeleteFired).await?;
        let refused = refused.into_iter().map(|(f, r)| (f.id, r)).collect();
        let out = park_refused(&mut tx, w, refused).await?;
        tx.commit().await?;
        Ok(out)
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

/// Confirmed rows the database did not let us delete: busy ones are left for later,
/// refused ones are parked.
async fn park_refused(
    tx: &mut PgConnection,
    w: &Writes,
    refused: Vec<(Uuid, Refusal)>,
) -> Result<Settlement, StoreError> {
    let mut out = Settlement::default();
    for (id, r) in refused {
        if r.busy {
            out.later.push(id);
            continue;
        }
        let why = format!("delivered, but the row cannot be deleted: {}", r.reason);
        match attempt(tx, w, Write::Park(id, &why)).await? {
            Ok(()) => out.parked.push((id, why)),
            Err(r) if r.busy => out.later.push(id),
            Err(r) => out.stuck.push((id, r.reason)),
        }
    }
    Ok(out)
}

/// Run `write` on all `items`; where the database refuses, on each half, down to
/// single items, which are returned with the database's reason.
async fn in_halves<'a, T: Clone>(
    tx: &mut PgConnection,
    w: &Writes,
    items: &'a [T],
    write: impl Fn(&'a [T]) -> Write<'a>,
) -> Result<Vec<(T, Refusal)>, StoreError> {
    let mut refused = Vec::new();
    let mut todo = vec![items];
    while let Some(part) = todo.pop() {
        match (attempt(tx, w, write(part)).await?, part) {
            (Ok(()), _) | (_, []) => {}
            (Err(e), [one]) => refused.push((one.clone(), e)),
            (Err(_), _) => {
                let (a, b) = part.split_at(part.len() / 2);
                todo.extend([b, a]);
            }
        }
    }
    Ok(refused)
}

/// One write inside a savepoint: `Ok(Err(refusal))` when the database refused it
/// (and it was undone), `Err` when the connection failed.
async fn attempt(
    tx: &mut PgConnection,
    w: &Writes,
    write: Write<'_>,
) -> Result<Result<(), Refusal>, StoreError> {
    sqlx::query("SAVEPOINT settle").execute(&mut *tx).await?;
    match apply(tx, w, write).await {
        Ok(()) => Ok(Ok(())),
        Err(sqlx::Error::Database(e)) => {
            sqlx::query("ROLLBACK TO SAVEPOINT settle")
                .execute(&mut *tx)
                .await?;
            let code = e.code();
            let busy = matches!(code.as_deref(), Some(QUERY_CANCELED | LOCK_NOT_AVAILABLE));
            Ok(Err(Refusal {
                busy,
                reason: e.to_string(),
            }))
        }
        Err(e) => Err(e.into()),
    }
}

async fn apply(tx: &mut PgConnection, w: &Writes, write: Write<'_>) -> Result<(), sqlx::Error> {
    match write {
        Write::Both(ids, failures) => {
            delete(tx, w, ids).await?;
            charge(tx, w, failures).await
        }
        Write::Delete(ids) => delete(tx, w, ids).await,
        Write::DeleteFired(fired) => {
            let ids: Vec<Uuid> = fired.iter().map(|f| f.id).collect();
            let at: Vec<DateTime<Utc>> = fired.iter().map(|f| f.deadline).collect();
            sqlx::query(safe(&w.delete_fired))
                .bind(ids)
                .bind(at)
                .execute(tx)
                .await?;
            Ok(())
        }
        Write::Charge(failures) => charge(tx, w, failures).await,
        Write::Park(id, why) => {
            sqlx::query(safe(&w.park))
                .bind(id)
                .bind(truncate(why))
                .execute(tx)
                .await?;
            Ok(())
        }
    }
}

async fn delete(tx: &mut PgConnection, w: &Writes, ids: &[Uuid]) -> Result<(), sqlx::Error> {
    if !ids.is_empty() {
        sqlx::query(safe(&w.delete)).bind(ids).execute(tx).await?;
    }
    Ok(())
}

/// attempts + 1 (saturating), last_error, retry_at = now + delay.
async fn charge(
    tx: &mut PgConnection,
    w: &Writes,
    failures: &[Failure],
) -> Result<(), sqlx::Error> {
    if failures.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
    let errors: Vec<String> = failures.iter().map(|f| truncate(&f.error)).collect();
    let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
    sqlx::query(safe(&w.fail))
        .bind(ids)
        .bind(errors)
        .bind(delays)
        .execute(tx)
        .await?;
    Ok(())
}

/// One write of [`Store::settle`].
enum Write<'a> {
    Both(&'a [Uuid], &'a [Failure]),
    Delete(&'a [Uuid]),
    DeleteFired(&'a [Fired]),
    Charge(&'a [Failure]),
    Park(Uuid, &'a str),
}

/// SQLSTATEs of a write that waited too long (`statement_timeout`, `lock_timeout`).
const QUERY_CANCELED: &str = "57014";
const LOCK_NOT_AVAILABLE: &str = "55P03";

fn truncate(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
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
    // A delete that waits for a lock of the process manager's (a foreign key, a
    // trigger) gives up early and is retried later; the scan itself never waits for row
    // locks (SKIP LOCKED).
    let lock_timeout = (settings.statement_timeout / 4).min(Duration::from_secs(1));
    let mut options = PgConnectOptions::from_str(settings.url.expose())
        .map_err(StoreError::Url)?
        .application_name(name)
        .options([
            ("search_path", settings.schema.clone()),
            ("statement_timeout", timeout.clone()),
            ("lock_timeout", lock_timeout.as_millis().to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner uses an expression index only for the very expression it was built
    /// on: each table's due expression must be its migration's index, word for word.
    #[test]
    fn the_due_expression_is_the_indexed_one() {
        let migration = include_str!("../migrations/0003_due_never_before_deadline.sql");
        let indexed = EXPECTATIONS.due_at().replace("m.", "");
        assert!(migration.contains(&format!("(({indexed}))")), "{indexed}");
        assert!(lock_due_sql("t").contains(&format!("ORDER BY {}", EXPECTATIONS.due_at())));
    }

    #[test]
    fn every_table_has_its_writes() {
        let sql = Sql::new("s");
        for table in TABLES {
            let w = sql.writes.iter().find(|w| w.table == table).expect("writes");
            assert!(w.delete.contains(&format!("s.{}", table.name)));
            assert!(w.delete_fired.contains(&table.deadline()));
        }
    }
}
