//! Connecting: the lazy pools a store opens, the host of `postgres.url` each uses, the
//! session settings sent at connect, and handing out, checking, trimming and closing
//! their connections.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgSslMode};

use super::sql::Sql;
use super::{Store, StoreError, hosts};
use crate::config;

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
    pub(super) fn session(&self) -> &Store {
        self.session.as_deref().unwrap_or(self)
    }

    /// Before using the pool: its host found (see `hosts`).
    pub(super) async fn ready(&self) -> Result<(), StoreError> {
        match &self.hosts {
            Some(h) => h.ready(&self.pool).await,
            None => Ok(()),
        }
    }

    /// After an error: one that says the host is gone makes the next use look again.
    pub(super) fn seen(&self, e: impl Into<StoreError>) -> StoreError {
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
    pub(super) async fn acquire(&self) -> Result<PoolConnection<Postgres>, StoreError> {
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
