//! Postgres: connection pool, embedded migrations, and the statements of the scan.
//!
//! Each [`Kind`] of due row lives in a table of its own; the writes of the firing transaction (delete,
//! charge, park, delete-if-unchanged) are the same statements for every table. Every
//! statement names `<schema>.<table>`; the schema is a validated plain identifier (see
//! `config`) and the table a constant, so formatting them into SQL is safe. The
//! statements are built once per store so sqlx's per-connection statement cache prepares
//! each of them once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgSslMode};
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

use crate::config;

mod api;
mod delayed;
mod expectations;
mod fence;
mod hosts;
mod settle;
pub(crate) mod sqlstate;

pub use api::{ApiRules, Refusal};
pub use delayed::{
    Bound, DelayedRow, Due, Held, Ingest, IngestOutcome, PendingDelayed, Quota, Stored,
    lock_delayed_sql,
};
pub use expectations::{DueRow, PendingFilter, PendingRow, lock_due_sql};
pub use fence::session_name;
use settle::Writes;
pub use settle::{Confirmed, Deletes, Failure, Fired, Settlement};
pub(crate) use sqlstate::{Blame, blame_of, refused_by_the_api, waited_too_long};

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
    #[error(
        "database: none of the {hosts} hosts of postgres.url is usable \
         (target_session_attrs {target:?}; each logged)"
    )]
    NoHost {
        hosts: usize,
        target: config::TargetSession,
    },
    #[error(
        "the database session has search_path {search_path:?}, not postgres.schema: the \
         session settings sent at connect were dropped (a pooler between? see \
         docs/operating/pgbouncer.md)"
    )]
    SessionSettings { search_path: String },
    /// The database refused an operator's verb (see [`Refusal`]); its message says why.
    #[error("refused by the database")]
    Refused(Refusal, #[source] sqlx::Error),
}

pub use crate::kind::Kind;

/// What `timeoutd pending` and the gauges report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PendingCounts {
    pub pending: i64,
    pub due: i64,
    pub overdue: i64,
    pub failing: i64,
}

impl PendingCounts {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, StoreError> {
        Ok(Self {
            pending: row.try_get("pending")?,
            due: row.try_get("due")?,
            overdue: row.try_get("overdue")?,
            failing: row.try_get("failing")?,
        })
    }
}

/// The text of [`BEGIN`], as a literal that [`SCAN_BEGIN`] extends.
macro_rules! begin {
    () => {
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET CONSTRAINTS ALL IMMEDIATE"
    };
}

/// How writing transactions begin: READ COMMITTED whatever the server's default (a
/// serialization failure at commit would fail a batch whose TimeOuts are already
/// confirmed), and every deferred constraint checked at its statement instead of at
/// COMMIT, so that a row the process manager's constraints refuse to delete fails in
/// `settle`, alone, and never the commit of the whole batch.
pub const BEGIN: &str = begin!();

/// How the firing transaction begins: as [`BEGIN`], and never sorting. Its lock
/// statement takes the first rows of a window in the due index's order. Right after a
/// mass insert the planner's statistics still describe the table before it: it then
/// believes a window holding 100,000 rows holds a hundred, reads them all with a bitmap
/// scan and sorts them for every batch (65 ms to 300 ms a batch in the delayed burst,
/// against under 1 ms in index order). Nothing in that transaction needs a sort, so
/// plans with one are priced out (a last resort: without the due index it would sort).
pub const SCAN_BEGIN: &str = concat!(begin!(), "; SET LOCAL enable_sort = off");

/// Where each kind's rows live. Everything the firing transaction writes is the same for
/// every kind (see [`Writes`]).
impl Kind {
    /// The table holding its rows.
    pub(crate) const fn table(self) -> &'static str {
        match self {
            Kind::Expectation => "expected_messages",
            Kind::Delayed => "delayed_messages",
        }
    }

    /// The table, schema-qualified: how every statement names it.
    pub(crate) fn qualified(self, schema: &str) -> String {
        format!("{schema}.{}", self.table())
    }

    /// The column holding its rows' deadline.
    const fn deadline_column(self) -> &'static str {
        match self {
            Kind::Expectation => "timeout_at",
            Kind::Delayed => "deliver_at",
        }
    }

    /// A row as the lists read it (`timeoutd pending --list`, the console): deadlines
    /// clamped so that '-infinity' and 'infinity' still decode; the 'infinity' of a held
    /// (or parked) row's `retry_at`, which no client type holds, selected as `held`
    /// instead (the command line reads it into `PendingRow::parked` and shows it so).
    pub(crate) fn list_columns(self) -> String {
        let (deadline, column) = (self.deadline(), self.deadline_column());
        let (own, size) = match self {
            Kind::Expectation => ("m.process_id, m.message_type", ""),
            Kind::Delayed => (
                "m.owner, m.message_id",
                "octet_length(m.body) AS body_bytes, ",
            ),
        };
        format!(
            "m.id, {own}, {deadline} AS {column}, m.exchange, m.routing_key, {size}\
             m.attempts, m.last_error, CASE WHEN isfinite(m.retry_at) THEN m.retry_at END \
             AS retry_at, coalesce(m.retry_at = 'infinity', false) AS held"
        )
    }

    /// Due means: the deadline has passed and so has any retry time (`greatest` ignores
    /// NULL). The expression index of migration 0003 serves exactly this expression.
    pub(crate) fn due_at(self) -> String {
        format!("greatest(m.{}, m.retry_at)", self.deadline_column())
    }

    /// The deadline clamped so '-infinity' / 'infinity' still decode (and fire, if due).
    fn deadline(self) -> String {
        format!(
            "least(greatest(m.{}, '0001-01-01T00:00:00Z'), '9999-12-31T23:59:59Z')",
            self.deadline_column()
        )
    }

    /// Which rows a batch may lock: due within the horizon (`$4` seconds) and, for a
    /// batch that serves only fresh rows, due no earlier than `$5` seconds ago, and for a
    /// backlog batch that continues after earlier ones, due no earlier than `$6` (NULL: no
    /// such bound). `deadline <= …` is implied by the due expression; it is spelled out
    /// so that no change to the bookkeeping can ever hold a row for sending before its
    /// deadline. The rows' own due times (`due_at` below) decide when each is sent.
    fn window(self) -> String {
        let due_at = self.due_at();
        format!(
            "{due_at} <= now() + make_interval(secs => $4) \
             AND m.{} <= now() + make_interval(secs => $4) \
             AND {due_at} >= greatest(coalesce(now() - make_interval(secs => $5), \
             '-infinity'), {})",
            self.deadline_column(),
            from_bound("$6")
        )
    }

    /// The instant a row may be sent (its deadline, or a later retry time), clamped as
    /// [`Kind::deadline`] is, and the database clock when it was read: together they
    /// tell the scan how long to hold the row. The end of the window the statement
    /// locked (every row due until then was taken, or held by another batch). And where
    /// the locked version of the row lies (its `ctid`), which the batch deletes it by
    /// (see [`Writes`](settle::Writes)), for a row of `table` itself only: a table
    /// inheriting from it can appear under the batch's lock, its rows at places of their
    /// own (NULL: the batch deletes by id).
    fn due_columns(self, table: &str) -> String {
        format!(
            "least(greatest({}, '0001-01-01T00:00:00Z'), '9999-12-31T23:59:59Z') AS due_at, \
             clock_timestamp() AS fired_at, now() + make_interval(secs => $4) AS window_end, \
             CASE WHEN m.tableoid = '{table}'::regclass THEN m.ctid::text END AS tid",
            self.due_at()
        )
    }
}

/// The lower bound `param` (a due time a batch returned, or NULL) puts on `due_at`. Due
/// times come back clamped to year 1 (see [`Kind::deadline`]): a bound there could be
/// any earlier time, even '-infinity', so it bounds nothing.
fn from_bound(param: &str) -> String {
    format!(
        "CASE WHEN {param}::timestamptz > '0001-01-01T00:00:00Z' THEN {param}::timestamptz \
         ELSE '-infinity'::timestamptz END"
    )
}

/// Which due rows a batch locks: those due within `horizon` from now (zero: only rows
/// due already), and with `fresh`, only rows that came due at most that long ago (the
/// share of batches kept for rows coming due while a backlog drains).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub horizon: Duration,
    pub fresh: Option<Duration>,
    /// Only rows due at or after this database instant (where the scan stands, see
    /// `firing/pacer.rs`): past the index entries of every row deleted before it
    /// (they stay in the index until vacuum, and each scan would pass them).
    pub from: Option<DateTime<Utc>>,
}

/// When the next rows of one table are due, from [`Store::probe`]: seconds from the
/// database's `now()` (negative: overdue; minus infinity for a row due at
/// '-infinity'), `None` when no such row is pending.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextDue {
    /// The earliest due row, locked by someone or not.
    pub earliest: Option<f64>,
    /// The earliest row due after the instant the caller asked about.
    pub beyond: Option<f64>,
    /// The database clock when it was read.
    pub now: DateTime<Utc>,
    /// The database's `now()` for the statement: what the seconds above count from, and
    /// about when its snapshot was taken (`now` is later by the statement's duration).
    pub start: DateTime<Utc>,
}

#[derive(Debug, Clone)]
struct Sql {
    api: api::Statements,
    expectations: expectations::Statements,
    delayed: delayed::Statements,
    writes: Vec<settle::Writes>,
}

impl Sql {
    fn new(schema: &str) -> Self {
        Self {
            api: api::Statements::new(schema),
            expectations: expectations::Statements::new(schema),
            delayed: delayed::Statements::new(schema),
            writes: Kind::ALL
                .iter()
                .map(|t| settle::Writes::new(schema, *t))
                .collect(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    schema: String,
    sql: Sql,
    /// Which host of a multi-host `postgres.url` the pool uses; `None` with one host
    /// and no `target_session_attrs`.
    hosts: Option<Arc<hosts::Hosts>>,
    /// Probes and counts share one connection (see [`Store::acquire`]).
    lean: Arc<AtomicBool>,
    /// With `postgres.session_url`: a pool of one on that address, for what needs a
    /// session of its own (see [`Store::session`]).
    session: Option<Box<Store>>,
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
        let pooled = settings.session_url().is_some();
        let mut store = Self::open(
            settings,
            &settings.url,
            name,
            settings.max_connections,
            pooled,
            None,
        )?;
        if let Some(url) = settings.session_url() {
            store.session = Some(Box::new(Self::open(settings, url, name, 1, false, None)?));
        }
        Ok(store)
    }

    /// A store of one connection, apart from the firing pool: what observers (the
    /// pending gauges) use, so that no number of them can take a connection the firing
    /// needs, nor run more than one statement at a time.
    pub(crate) fn observer(settings: &config::Postgres, name: &str) -> Result<Self, StoreError> {
        let pooled = settings.session_url().is_some();
        Self::open(settings, &settings.url, name, 1, pooled, None)
    }

    /// The web console's store: one connection, as [`Store::observer`], closed once it
    /// has been unused for `idle` (an operator's visit should not hold a session for the
    /// node's life).
    pub(crate) fn console(
        settings: &config::Postgres,
        name: &str,
        idle: Duration,
    ) -> Result<Self, StoreError> {
        let pooled = settings.session_url().is_some();
        Self::open(settings, &settings.url, name, 1, pooled, Some(idle))
    }

    /// A connection of this store's pool, its host found first; waits at most the
    /// pool's acquire timeout (`postgres.connect_timeout` of the settings it was opened
    /// with).
    pub(crate) async fn connection(&self) -> Result<PoolConnection<Postgres>, StoreError> {
        self.ready().await?;
        self.pool.acquire().await.map_err(|e| self.seen(e))
    }

    /// A lazy pool of up to `connections` on `url`. `pooled`: `url` goes through a
    /// transaction pooler, which cannot keep settings per client session: none are sent,
    /// and every new connection must find the server's own bounds in force. `idle`: a
    /// pool used now and then, whose connections are closed once unused that long
    /// (`None`: sqlx's defaults).
    fn open(
        settings: &config::Postgres,
        url: &config::SecretUrl,
        name: &str,
        connections: u32,
        pooled: bool,
        idle: Option<Duration>,
    ) -> Result<Self, StoreError> {
        let (options, hosts) = hosts::Hosts::new(url, settings, |o| {
            connect_options(settings, name, pooled, o)
        })?;
        let mut pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(settings.connect_timeout);
        if let Some(idle) = idle {
            // Nor is an idle connection pinged before each use: a wait for the pool is
            // bounded (`acquire_timeout`), and a ping cut short by that bound under load
            // closes the connection, so that the next request opens another (measured:
            // five sessions in ten seconds of the console flood test, one without it). A
            // connection that died while idle fails one request and is replaced.
            pool = pool
                .min_connections(0)
                .idle_timeout(idle)
                .test_before_acquire(false);
        }
        if let Some(hosts) = &hosts {
            pool = hosts.hooks(pool);
        }
        if hosts.is_some() || pooled {
            let hosts = hosts.clone();
            pool = pool.after_connect(move |conn, _| {
                let hosts = hosts.clone();
                Box::pin(async move {
                    if let Some(hosts) = hosts {
                        hosts.on_connect(conn).await?;
                    }
                    if pooled {
                        server_bounds(conn).await?;
                    }
                    Ok(())
                })
            });
        }
        Ok(Self {
            pool: pool.connect_lazy_with(options),
            schema: settings.schema.clone(),
            sql: Sql::new(&settings.schema),
            hosts,
            lean: Arc::default(),
            session: None,
        })
    }

    /// Where a session of its own goes — the LISTEN connection, the migrations'
    /// advisory lock: the `postgres.session_url` pool when set, else this one.
    fn session(&self) -> &Store {
        self.session.as_deref().unwrap_or(self)
    }

    /// Before using the pool: its host found (see `hosts`).
    async fn ready(&self) -> Result<(), StoreError> {
        match &self.hosts {
            Some(h) => h.ready(&self.pool).await,
            None => Ok(()),
        }
    }

    /// After an error: one that says the host is gone makes the next use look again.
    fn seen(&self, e: impl Into<StoreError>) -> StoreError {
        let e = e.into();
        if let Some(h) = &self.hosts
            && hosts::Hosts::is_host_lost(&e)
        {
            h.lost();
        }
        e
    }

    /// Changes each time the sessions' pool (see [`Store::session`]) moves to another
    /// host of its multi-host URL; `None` with nothing to move to. A session held outside the pool
    /// (the LISTEN connection) would otherwise stay on a host turned read-only but up,
    /// where no notice ever comes.
    pub(crate) fn host_moves(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.session().hosts.as_ref().map(|h| h.moves())
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// [`Store::migrate`], then write what the SQL door allows from `settings` (by
    /// `by`, a node or the command line), so the door follows them from the first call.
    pub async fn migrate_for(
        &self,
        settings: &config::Settings,
        by: &str,
    ) -> Result<(), StoreError> {
        self.migrate().await?;
        if let Some(rules) = ApiRules::new(settings) {
            self.write_api_rules(&rules, by).await?;
        }
        Ok(())
    }

    /// Create the schema and apply the embedded migrations. The migrator holds an
    /// advisory lock, so replicas starting together apply them once; migrations this
    /// version does not know (applied by a newer one) are left alone.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut migrator = sqlx::migrate!();
        migrator.create_schema(self.schema.clone());
        migrator.dangerous_set_table_name(format!("{}._sqlx_migrations", self.schema));
        // A node of this version must still start after a newer one migrated the schema
        // (a rolling upgrade, or a rollback): migrations only ever add.
        migrator.set_ignore_missing(true);
        let session = self.session();
        session.ready().await?;
        // One connection for the check and the migrations, closed (not pooled) when they
        // fail: the migrator's lock is a session-level advisory lock, and Postgres may
        // grant it to a `pg_advisory_lock` cancelled by `lock_timeout` at that moment,
        // reporting the error and keeping the lock. Taken again on that session by the
        // retry and released once, it would stay held as long as the node lives, and
        // every other node's migrations would wait for it (measured: 100 daemons started
        // together, 87 of them stuck for minutes).
        let mut conn = session.pool.acquire().await.map_err(|e| session.seen(e))?;
        let migrated = match session.check_session(&mut conn).await {
            Ok(()) => migrator
                .run_direct(None, &mut *conn, false)
                .await
                .map_err(|e| session.seen(e)),
            Err(e) => Err(e),
        };
        if migrated.is_err() {
            conn.close_on_drop();
        }
        migrated
    }

    /// The session settings the connections ask for at startup (see `connect_options`)
    /// are in force. A pooler may drop them silently (PgBouncer's
    /// `ignore_startup_parameters = options`): the migrations would then create the
    /// tables in whatever schema the server's `search_path` names, and statements would
    /// run unbounded. Refused instead, before anything is written.
    async fn check_session(&self, conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
        let search_path: String = sqlx::raw_sql("SELECT current_setting('search_path')")
            .fetch_one(conn)
            .await
            .map_err(|e| self.seen(e))?
            .try_get(0)?;
        if search_path != self.schema {
            return Err(StoreError::SessionSettings { search_path });
        }
        Ok(())
    }

    /// A writing transaction (see [`BEGIN`]).
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.ready().await?;
        self.pool.begin_with(BEGIN).await.map_err(|e| self.seen(e))
    }

    /// The firing transaction on `table` (see [`SCAN_BEGIN`]), holding the lock its
    /// deletes take, and how it may delete (see [`Deletes`]).
    pub async fn begin_batch(
        &self,
        kind: Kind,
    ) -> Result<(Transaction<'static, Postgres>, Deletes), StoreError> {
        let w = self.writes(kind);
        self.ready().await?;
        let mut tx = self
            .pool
            .begin_with(SCAN_BEGIN)
            .await
            .map_err(|e| self.seen(e))?;
        sqlx::raw_sql(safe(&w.lock)).execute(&mut *tx).await?;
        let refusable: bool = sqlx::query_scalar(safe(&w.guard))
            .bind(&w.table)
            .fetch_one(&mut *tx)
            .await?;
        let deletes = if refusable {
            Deletes::Guarded
        } else {
            Deletes::Direct
        };
        Ok((tx, deletes))
    }

    /// Lock up to `limit` rows of `kind` due within `window`, oldest due first, skipping
    /// rows another batch holds and the ids in `skip`. Contents over `inline` bytes are
    /// left in the database (the row says how large, where known). Binds: `$1` limit,
    /// `$2` inline, `$3` skip, `$4` horizon and `$5` freshness in seconds, `$6` the
    /// earliest due time (see [`Kind::window`]).
    pub async fn lock_due<R>(
        &self,
        tx: &mut sqlx::PgConnection,
        kind: Kind,
        limit: u32,
        inline: usize,
        skip: &[uuid::Uuid],
        window: Window,
    ) -> Result<Vec<R>, StoreError>
    where
        R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        let sql = match kind {
            Kind::Expectation => &self.sql.expectations.lock_due,
            Kind::Delayed => &self.sql.delayed.lock_due,
        };
        Ok(sqlx::query_as(safe(sql))
            .bind(i64::from(limit))
            .bind(i64::try_from(inline).unwrap_or(i64::MAX))
            .bind(skip)
            .bind(window.horizon.as_secs_f64())
            .bind(window.fresh.map(|f| f.as_secs_f64()))
            .bind(window.from)
            .fetch_all(tx)
            .await?)
    }

    /// When the next rows of `kind` are due: the earliest at or after `from` (where a
    /// backlog drain stands; `None`: of all), and the earliest due after `after` (a
    /// database instant; `None`: no bound) and no longer ago than `fresh`. A due time of 'infinity' (a held row) reads as `None`. Two probes of the
    /// due index, one round trip.
    pub async fn probe(
        &self,
        kind: Kind,
        after: Option<DateTime<Utc>>,
        fresh: Duration,
        from: Option<DateTime<Utc>>,
    ) -> Result<NextDue, StoreError> {
        self.ready().await?;
        let mut conn = self.acquire().await?;
        let row: (Option<f64>, Option<f64>, DateTime<Utc>, DateTime<Utc>) =
            sqlx::query_as(safe(&self.writes(kind).probe))
                .bind(after)
                .bind(fresh.as_secs_f64())
                .bind(from)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| self.seen(e))?;
        // '-infinity' is as overdue as can be; 'infinity' (a held row) is never due.
        let due = |s: Option<f64>| s.filter(|s| !s.is_nan() && *s != f64::INFINITY);
        Ok(NextDue {
            earliest: due(row.0),
            beyond: due(row.1),
            now: row.2,
            start: row.3,
        })
    }

    /// Counts of one table for operators; `overdue` means due for longer than `late`.
    pub async fn counts(&self, kind: Kind, late: Duration) -> Result<PendingCounts, StoreError> {
        self.ready().await?;
        let mut conn = self.acquire().await?;
        self.count(&mut conn, kind, late).await
    }

    async fn count(
        &self,
        conn: &mut sqlx::PgConnection,
        kind: Kind,
        late: Duration,
    ) -> Result<PendingCounts, StoreError> {
        let row = sqlx::query(safe(&self.writes(kind).counts))
            .bind(format!("{} milliseconds", late.as_millis()))
            .fetch_one(conn)
            .await
            .map_err(|e| self.seen(e))?;
        PendingCounts::from_row(&row)
    }

    /// The group's counts of one table (the table `pending_counts`, migration 0008) and
    /// how long ago they were counted: as another node counted them, if less than
    /// `fresh` ago; else counted here and shared, unless another node is counting them
    /// right now (then its previous ones; `None` before the first). One count per group
    /// per refresh, not one per node.
    pub async fn shared_counts(
        &self,
        kind: Kind,
        late: Duration,
        fresh: Duration,
    ) -> Result<Option<(PendingCounts, Duration)>, StoreError> {
        let (name, fresh) = (kind.name(), format!("{} milliseconds", fresh.as_millis()));
        let w = self.writes(kind);
        self.ready().await?;
        let mut conn = self.acquire().await?;
        let shared = |row: &sqlx::postgres::PgRow| -> Result<_, StoreError> {
            let age: f64 = row.try_get("age")?;
            // '-infinity': never counted yet, nothing to report.
            Duration::try_from_secs_f64(age)
                .ok()
                .map(|age| PendingCounts::from_row(row).map(|c| (c, age)))
                .transpose()
        };
        let row = sqlx::query(safe(&w.shared_read))
            .bind(name)
            .bind(&fresh)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.seen(e))?;
        if row.try_get("fresh")? {
            return shared(&row);
        }
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(|e| self.seen(e))?;
        let mine = sqlx::query(safe(&w.shared_lock))
            .bind(name)
            .bind(&fresh)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.seen(e))?;
        match mine {
            // Another node is counting: its previous counts meanwhile.
            None => return shared(&row),
            // Counted by another node in the meantime.
            Some(r) if r.try_get("fresh")? => return shared(&r),
            Some(_) => {}
        }
        let c = self.count(&mut tx, kind, late).await?;
        sqlx::query(safe(&w.shared_write))
            .bind(name)
            .bind(c.pending)
            .bind(c.due)
            .bind(c.overdue)
            .bind(c.failing)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.seen(e))?;
        tx.commit().await.map_err(|e| self.seen(e))?;
        Ok(Some((c, Duration::ZERO)))
    }

    fn writes(&self, kind: Kind) -> &Writes {
        // Built from `Kind::ALL`, in its order.
        &self.sql.writes[kind.index()]
    }

    /// The channel the migrations' trigger notifies on new or moved deadlines.
    pub fn notify_channel(&self) -> String {
        let mut channel = format!("timeoutd_{}", self.schema);
        channel.truncate(63);
        channel
    }

    /// `LISTEN` on [`Store::notify_channel`] as a statement: run again on a listener's
    /// connection it changes nothing but proves the connection answers (and leaves
    /// `pg_stat_activity` showing what the session is for).
    pub fn listen_statement(&self) -> String {
        format!(r#"LISTEN "{}""#, self.notify_channel().replace('"', "\"\""))
    }

    /// A listener on [`Store::notify_channel`] (one pooled connection, held while the
    /// listener lives: the scan opens it only while active, see `firing::notice::listen`).
    pub async fn listener(&self) -> Result<PgListener, StoreError> {
        let session = self.session();
        session.ready().await?;
        let mut listener = PgListener::connect_with(&session.pool)
            .await
            .map_err(|e| session.seen(e))?;
        // A lost connection ends the listener: the scan must know when it listens again
        // (see `firing::notice::listen`), which sqlx's own reconnect would hide.
        listener.eager_reconnect(false);
        listener.listen(&self.notify_channel()).await?;
        Ok(listener)
    }

    /// A round trip to the database, bounded by `limit`.
    pub async fn ping(&self, limit: Duration) -> Result<(), String> {
        let ping = async {
            self.ready().await?;
            sqlx::query("SELECT 1")
                .execute(&self.pool)
                .await
                .map_err(|e| self.seen(e))
        };
        match tokio::time::timeout(limit, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(crate::telemetry::Chain(&e).to_string()),
            Err(_) => {
                if let Some(h) = &self.hosts {
                    h.lost();
                }
                Err(format!("no answer within {limit:?}"))
            }
        }
    }

    /// Close idle connections until at most `keep` are left: a passive node holds one
    /// (its checks, the pending counts, the ingress between deliveries), the observer
    /// store of a passive node none. The pool reuses its idle connections in turn, so a
    /// regular check alone would keep every one of them warm: an `idle_timeout` never
    /// ends any. Never waits: connections in use are left alone, and each closes in the
    /// background.
    pub fn trim(&self, keep: usize) {
        while self.pool.num_idle() > keep {
            let Some(mut conn) = self.pool.try_acquire() else {
                return;
            };
            conn.close_on_drop();
        }
    }

    /// Lean or not (see [`Store::acquire`]): the firing task sets it by the node's role.
    pub(crate) fn lean(&self, lean: bool) {
        self.lean.store(lean, Ordering::Relaxed);
    }

    /// A connection for a probe or a count. Lean (a passive node), without opening a
    /// second one: the idle one, a new one if none is open, else the one in use once it
    /// is given back. Sequential statements on a pool may otherwise each find the one
    /// before still being given back (that happens in a task of its own) and open
    /// another: a passive node's check of two kinds would churn a connection every
    /// second.
    async fn acquire(&self) -> Result<PoolConnection<Postgres>, StoreError> {
        if !self.lean.load(Ordering::Relaxed) {
            return self.pool.acquire().await.map_err(|e| self.seen(e));
        }
        loop {
            if let Some(conn) = self.pool.try_acquire() {
                return Ok(conn);
            }
            // A closed pool (the stop) answers `acquire` with its error at once.
            if self.pool.size() == 0 || self.pool.is_closed() {
                return self.pool.acquire().await.map_err(|e| self.seen(e));
            }
            tokio::time::sleep(ALONE_POLL).await;
        }
    }

    pub async fn close(&self) {
        if let Some(session) = &self.session {
            session.pool.close().await;
        }
        self.pool.close().await;
    }

    /// Mark the pools closed at once, without waiting for the connections in use: a
    /// connection given back from now on is closed, not tested with a round trip that a
    /// slow or silent database could hold up.
    pub(crate) fn close_now(&self) {
        for pool in std::iter::once(&self.pool).chain(self.session.iter().map(|s| &s.pool)) {
            drop(pool.close());
        }
    }
}

/// How often a lean [`Store::acquire`] looks whether the connection in use was given back.
const ALONE_POLL: Duration = Duration::from_millis(20);

/// A database step bounded on the client too: the server's `statement_timeout` cannot
/// help when the network to it silently drops packets.
pub(crate) async fn bounded<T>(
    limit: Duration,
    step: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, step)
        .await
        .unwrap_or(Err(StoreError::NoAnswer(limit)))
}

/// The value of column `name` of a due row, expected at position `index`: found there
/// by comparing its name, which costs far less per row than sqlx's lookup by name (a
/// hash of the name, for every column of every row); looked up by name where a
/// statement put it elsewhere.
fn column<'r, T>(row: &'r sqlx::postgres::PgRow, index: usize, name: &str) -> Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    use sqlx::Column;
    if row.columns().get(index).is_some_and(|c| c.name() == name) {
        row.try_get(index)
    } else {
        row.try_get(name)
    }
}

/// Where a locked row lies (`ctid`, as text), read at `index`; `None` where the statement
/// did not select it (the benchmark's hand-rolled loop reads rows with its own).
fn tid(row: &sqlx::postgres::PgRow, index: usize) -> Result<Option<String>, sqlx::Error> {
    match column(row, index, "tid") {
        Err(sqlx::Error::ColumnNotFound(_) | sqlx::Error::ColumnIndexOutOfBounds { .. }) => {
            Ok(None)
        }
        read => read,
    }
}

/// The statements are built from a validated identifier only (see `Sql::new`).
fn safe(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(sql.clone())
}

/// One host's options (`base`, from its URL) completed: the connection's name, and
/// unless `pooled` (see [`Store::open`]) the session settings, sent at startup (no round
/// trip).
fn connect_options(
    settings: &config::Postgres,
    name: &str,
    pooled: bool,
    base: PgConnectOptions,
) -> PgConnectOptions {
    let timeout = settings.statement_timeout.as_millis().to_string();
    // A delete that waits for a lock of the process manager's (a foreign key, a
    // trigger) gives up early and is retried later; the scan itself never waits for row
    // locks (SKIP LOCKED).
    let lock_timeout = (settings.statement_timeout / 4).min(Duration::from_secs(1));
    let mut options = base.application_name(name);
    if !pooled {
        options = options.options([
            ("search_path", settings.schema.clone()),
            ("statement_timeout", timeout.clone()),
            ("lock_timeout", lock_timeout.as_millis().to_string()),
            // A scanner frozen mid-batch (SIGSTOP, a dead VM) must not hold its row
            // locks forever: the server ends the session and the rows become visible
            // again.
            ("idle_in_transaction_session_timeout", timeout),
        ]);
    }
    if let Some(ca) = &settings.ca_file {
        options = options.ssl_root_cert(ca);
        // As libpq: given a root certificate, `require` also verifies the chain.
        if matches!(options.get_ssl_mode(), PgSslMode::Require) {
            options = options.ssl_mode(PgSslMode::VerifyCa);
        }
    }
    options
}

/// Through a transaction pooler the server's own settings bound every statement and
/// every transaction left open (a node frozen mid-batch must not hold its row locks
/// forever): a connection without them is refused, naming what to set.
async fn server_bounds(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    const BOUNDS: [&str; 2] = ["statement_timeout", "idle_in_transaction_session_timeout"];
    let (statement, idle): (String, String) = sqlx::query_as(
        "SELECT current_setting('statement_timeout'), \
                current_setting('idle_in_transaction_session_timeout')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let unbounded: Vec<&str> = BOUNDS
        .into_iter()
        .zip([statement, idle])
        .filter(|(_, v)| v == "0")
        .map(|(k, _)| k)
        .collect();
    if unbounded.is_empty() {
        return Ok(());
    }
    let (names, verb) = match unbounded.as_slice() {
        [one] => ((*one).to_owned(), "is"),
        _ => (unbounded.join(" and "), "are"),
    };
    Err(sqlx::Error::Configuration(
        format!(
            "through a transaction pooler (postgres.session_url is set) the server must bound \
             the sessions, but {names} {verb} 0 here: set them for the daemons' role or \
             database (ALTER ROLE … SET …; see docs/operating/pgbouncer.md)"
        )
        .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner uses an expression index only for the very expression it was built
    /// on: each table's due expression must be its migration's index, word for word.
    #[test]
    fn the_due_expression_is_the_indexed_one() {
        let migration = include_str!("../migrations/0003_due_never_before_deadline.sql");
        let indexed = Kind::Expectation.due_at().replace("m.", "");
        assert!(migration.contains(&format!("(({indexed}))")), "{indexed}");
        assert!(lock_due_sql("t").contains(&format!("ORDER BY {}", Kind::Expectation.due_at())));
    }
}
