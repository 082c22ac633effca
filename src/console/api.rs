//! The console's database work: listing, searching and showing rows, and acting on them
//! through the SQL API of migration 0009 (`cancel_expectation`, `release_delayed`, …),
//! the one place each rule lives; nothing here writes a table itself.
//!
//! All of it on one connection of its own (`Store::console`), opened at the first use
//! and closed after `console.idle_timeout` unused: never one the firing needs, and never
//! more than one statement at a time, however many requests arrive. A request waits at
//! most `console.acquire_timeout` for it; every transaction bounds its statements to
//! `console.statement_timeout` (`SET LOCAL`, which also holds through a transaction
//! pooler), and the whole step is bounded on the client too. Lists take at most
//! [`LIMIT`] rows, in the order of an index.

use std::sync::OnceLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

use crate::config::Settings;
use crate::store::{self, Due, Kind, Store, StoreError};
use crate::telemetry::Chain;

/// The most rows a list or a search returns.
pub(super) const LIMIT: i64 = 100;
/// How much of a payload or a body a row's detail shows.
const PREVIEW: i32 = 4096;

/// Why a database step gave no answer.
#[derive(Debug)]
pub(super) enum DbError {
    /// The connection is busy, or the database did not answer in time: 503.
    Busy(String),
    /// The SQL API refused (a row stored without its body cannot be released): 409.
    Refused(String),
    /// The request misses something the action needs: 400.
    Input(String),
    Other(String),
}

impl From<StoreError> for DbError {
    fn from(e: StoreError) -> Self {
        match &e {
            StoreError::Db(sqlx::Error::PoolTimedOut) => DbError::Busy(
                "the console's database connection is busy or cannot connect \
                 (console.acquire_timeout); try again"
                    .into(),
            ),
            StoreError::Refused(_, e) => DbError::Refused(
                e.as_database_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned()),
            ),
            StoreError::NoAnswer(after) => {
                DbError::Busy(format!("the database did not answer within {after:?}"))
            }
            StoreError::Db(sqlx::Error::Database(d)) => {
                let code = d.code();
                if store::waited_too_long(code.as_deref()) {
                    DbError::Busy(format!(
                        "the database did not finish in time ({}); try again",
                        d.message()
                    ))
                } else if store::refused_by_the_api(code.as_deref()) {
                    DbError::Refused(d.message().to_owned())
                } else {
                    DbError::Other(Chain(&e).to_string())
                }
            }
            _ => DbError::Other(Chain(&e).to_string()),
        }
    }
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Db(e).into()
    }
}

/// Which rows a list shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowsState {
    /// Every pending row, next due first.
    Pending,
    /// Rows whose publish failed and that wait for their next attempt.
    Failing,
    /// Held (delayed) or parked (expectations): never sent again without an operator.
    Held,
}

impl RowsState {
    pub(super) fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(RowsState::Pending),
            "failing" => Some(RowsState::Failing),
            "held" => Some(RowsState::Held),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Action {
    Cancel,
    Release,
    Retry,
    Reschedule,
}

impl Action {
    pub(super) fn name(self) -> &'static str {
        match self {
            Action::Cancel => "cancel",
            Action::Release => "release",
            Action::Retry => "retry",
            Action::Reschedule => "reschedule",
        }
    }
}

/// An action as the page posts it: an expectation by `id`; a delayed message by
/// `message_id` and `owner` (as the SQL API names it); `at` for a reschedule.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ActionRequest {
    kind: Kind,
    action: Action,
    #[serde(default)]
    id: Option<Uuid>,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    at: Option<DateTime<Utc>>,
}

impl ActionRequest {
    pub(super) fn kind(&self) -> Kind {
        self.kind
    }

    pub(super) fn action(&self) -> Action {
        self.action
    }

    /// The row it names, for the log.
    pub(super) fn target(&self) -> String {
        match (self.kind, &self.id, &self.message_id) {
            (Kind::Expectation, Some(id), _) => id.to_string(),
            (Kind::Delayed, _, Some(m)) => {
                format!("{m} (owner {:?})", self.owner.as_deref().unwrap_or(""))
            }
            _ => String::new(),
        }
    }
}

/// An expectation as lists show it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub(super) struct ExpectationRow {
    id: Uuid,
    process_id: String,
    message_type: String,
    timeout_at: DateTime<Utc>,
    exchange: String,
    routing_key: String,
    attempts: i32,
    last_error: Option<String>,
    retry_at: Option<DateTime<Utc>>,
    /// Parked: its TimeOut was confirmed but the row could not be deleted.
    held: bool,
}

/// A delayed message as lists show it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub(super) struct DelayedRow {
    id: Uuid,
    owner: String,
    message_id: String,
    deliver_at: DateTime<Utc>,
    exchange: String,
    routing_key: String,
    body_bytes: i32,
    attempts: i32,
    last_error: Option<String>,
    retry_at: Option<DateTime<Utc>>,
    held: bool,
}

/// A row of either kind, tagged with it.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub(super) enum Listed {
    Expectation(ExpectationRow),
    Delayed(DelayedRow),
}

/// A row's detail: the row, and the start of its payload or body.
#[derive(Debug, Serialize)]
pub(super) struct Detail {
    row: Listed,
    created_at: DateTime<Utc>,
    /// The first [`PREVIEW`] bytes of the payload (JSON text) or body: as text when it
    /// is UTF-8, else in hex (`preview_hex`).
    preview: Option<String>,
    preview_hex: bool,
    /// The whole payload's or body's size in bytes.
    size: Option<i64>,
    /// A delayed message's AMQP properties, headers among them, as stored.
    properties: Option<serde_json::Value>,
    traceparent: Option<String>,
    idempotency_key: Option<String>,
    /// A delayed message stored without its body (larger than `delay.max_body`).
    body_dropped: bool,
}

/// The statements, built once from the validated schema name (as `store` does).
struct Statements {
    expectations: [String; 3],
    delayed: [String; 3],
    search_expectations: String,
    search_delayed: String,
    expectation: String,
    delayed_one: String,
}

impl Statements {
    fn new(schema: &str) -> Self {
        // Each list walks a due index (migrations 0003, 0004) in its order, next due
        // first: held rows sit at its end ('infinity'), failing ones are filtered on the
        // way. `LIMIT` bounds them all.
        let list = |kind: Kind, cols: &str| {
            let due = kind.due_at();
            let from = format!("FROM {} AS m", kind.qualified(schema));
            [
                format!("SELECT {cols} {from} ORDER BY {due} LIMIT $1"),
                format!(
                    "SELECT {cols} {from} WHERE m.attempts > 0 AND m.retry_at IS NOT NULL \
                     AND m.retry_at <> 'infinity' ORDER BY {due} LIMIT $1"
                ),
                format!(
                    "SELECT {cols} {from} WHERE {due} = 'infinity' AND m.retry_at = 'infinity' \
                     LIMIT $1"
                ),
            ]
        };
        let e = Kind::Expectation.qualified(schema);
        let d = Kind::Delayed.qualified(schema);
        let (expectation_columns, delayed_columns) = (
            Kind::Expectation.list_columns(),
            Kind::Delayed.list_columns(),
        );
        Self {
            expectations: list(Kind::Expectation, &expectation_columns),
            delayed: list(Kind::Delayed, &delayed_columns),
            // By process id (the index of migration 0009) or by the row's id.
            search_expectations: format!(
                "(SELECT {expectation_columns} FROM {e} AS m WHERE m.process_id = $1 LIMIT $3) \
                 UNION ALL (SELECT {expectation_columns} FROM {e} AS m WHERE m.id = $2)"
            ),
            // By message id across owners (the index of migration 0009) or the row's id.
            search_delayed: format!(
                "(SELECT {delayed_columns} FROM {d} AS m WHERE m.message_id = $1 LIMIT $3) \
                 UNION ALL (SELECT {delayed_columns} FROM {d} AS m WHERE m.id = $2)"
            ),
            expectation: format!(
                "SELECT {expectation_columns}, m.created_at, \
                 left(m.payload::text, {PREVIEW}) AS preview, \
                 octet_length(m.payload::text)::int8 AS size, m.traceparent, m.idempotency_key \
                 FROM {e} AS m WHERE m.id = $1"
            ),
            delayed_one: format!(
                "SELECT {delayed_columns}, m.created_at, \
                 substring(m.body FROM 1 FOR {PREVIEW}) AS preview, \
                 octet_length(m.body)::int8 AS size, m.properties, m.body_dropped \
                 FROM {d} AS m WHERE m.id = $1"
            ),
        }
    }
}

/// The console's database: its own store, opened at its first use.
pub(super) struct Db {
    store: OnceLock<Result<Store, String>>,
    postgres: crate::config::Postgres,
    name: String,
    idle: Duration,
    sql: Statements,
    /// `BEGIN …` of a reading transaction, with the statement bound (actions are
    /// bounded by the console store's own `statement_timeout`).
    begin_read: String,
    /// The client's bound on a whole step.
    bound: Duration,
}

impl Db {
    pub(super) fn new(settings: &Settings, node_id: Uuid) -> Self {
        let c = &settings.console;
        let mut postgres = settings.postgres.clone();
        postgres.statement_timeout = c.statement_timeout;
        // The pool's acquire timeout: how long a request waits for the connection.
        postgres.connect_timeout = c.acquire_timeout;
        let ms = c.statement_timeout.as_millis();
        let bounds = format!("SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}");
        Self {
            store: OnceLock::new(),
            postgres,
            name: format!("timeoutd-{node_id}-console"),
            idle: c.idle_timeout,
            sql: Statements::new(&settings.postgres.schema),
            begin_read: format!("BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; {bounds}"),
            // Waiting for the connection, then a few statements each within their bound.
            bound: c.acquire_timeout + c.statement_timeout * 2,
        }
    }

    /// The store, opened on the first call (on the HTTP server's thread, whose runtime
    /// then runs its connection and its idle reaper).
    fn store(&self) -> Result<&Store, DbError> {
        self.store
            .get_or_init(|| {
                Store::console(&self.postgres, &self.name, self.idle)
                    .map_err(|e| Chain(&e).to_string())
            })
            .as_ref()
            .map_err(|e| DbError::Other(e.clone()))
    }

    /// `step`, bounded on the client as well.
    async fn bounded<T>(
        &self,
        step: impl Future<Output = Result<T, DbError>>,
    ) -> Result<T, DbError> {
        tokio::time::timeout(self.bound, step)
            .await
            .unwrap_or_else(|_| Err(StoreError::NoAnswer(self.bound).into()))
    }

    pub(super) async fn rows(&self, kind: Kind, state: RowsState) -> Result<Vec<Listed>, DbError> {
        let i = match state {
            RowsState::Pending => 0,
            RowsState::Failing => 1,
            RowsState::Held => 2,
        };
        let store = self.store()?;
        self.bounded(async {
            let mut conn = store.connection().await?;
            let mut tx =
                sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(self.begin_read.clone()))
                    .await?;
            let rows = match kind {
                Kind::Expectation => {
                    sqlx::query_as(AssertSqlSafe(self.sql.expectations[i].clone()))
                        .bind(LIMIT)
                        .fetch_all(&mut *tx)
                        .await?
                        .into_iter()
                        .map(Listed::Expectation)
                        .collect()
                }
                Kind::Delayed => sqlx::query_as(AssertSqlSafe(self.sql.delayed[i].clone()))
                    .bind(LIMIT)
                    .fetch_all(&mut *tx)
                    .await?
                    .into_iter()
                    .map(Listed::Delayed)
                    .collect(),
            };
            tx.commit().await?;
            Ok(rows)
        })
        .await
    }

    /// Rows of either kind with this process id, message id or row id (exact).
    pub(super) async fn search(&self, q: &str) -> Result<Vec<Listed>, DbError> {
        let id = Uuid::parse_str(q).ok();
        let store = self.store()?;
        self.bounded(async {
            let mut conn = store.connection().await?;
            let mut tx =
                sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(self.begin_read.clone()))
                    .await?;
            let expectations: Vec<ExpectationRow> =
                sqlx::query_as(AssertSqlSafe(self.sql.search_expectations.clone()))
                    .bind(q)
                    .bind(id)
                    .bind(LIMIT)
                    .fetch_all(&mut *tx)
                    .await?;
            let delayed: Vec<DelayedRow> =
                sqlx::query_as(AssertSqlSafe(self.sql.search_delayed.clone()))
                    .bind(q)
                    .bind(id)
                    .bind(LIMIT)
                    .fetch_all(&mut *tx)
                    .await?;
            tx.commit().await?;
            Ok(expectations
                .into_iter()
                .map(Listed::Expectation)
                .chain(delayed.into_iter().map(Listed::Delayed))
                .collect())
        })
        .await
    }

    pub(super) async fn row(&self, kind: Kind, id: Uuid) -> Result<Option<Detail>, DbError> {
        let store = self.store()?;
        self.bounded(async {
            let mut conn = store.connection().await?;
            let mut tx =
                sqlx::Connection::begin_with(&mut *conn, AssertSqlSafe(self.begin_read.clone()))
                    .await?;
            let sql = match kind {
                Kind::Expectation => &self.sql.expectation,
                Kind::Delayed => &self.sql.delayed_one,
            };
            let found = sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            tx.commit().await?;
            let Some(r) = found else {
                return Ok(None);
            };
            let detail = match kind {
                Kind::Expectation => Detail {
                    row: Listed::Expectation(sqlx::FromRow::from_row(&r)?),
                    created_at: r.try_get("created_at")?,
                    preview: r.try_get("preview")?,
                    preview_hex: false,
                    size: r.try_get("size")?,
                    properties: None,
                    traceparent: r.try_get("traceparent")?,
                    idempotency_key: r.try_get("idempotency_key")?,
                    body_dropped: false,
                },
                Kind::Delayed => {
                    let raw: Vec<u8> = r.try_get("preview")?;
                    let (preview, preview_hex) = match String::from_utf8(raw) {
                        Ok(text) => (text, false),
                        // A preview may end inside a character: that alone is no
                        // reason to show a text body in hex.
                        Err(e) if e.utf8_error().error_len().is_none() => {
                            let valid = e.utf8_error().valid_up_to();
                            let mut bytes = e.into_bytes();
                            bytes.truncate(valid);
                            (String::from_utf8(bytes).unwrap_or_default(), false)
                        }
                        Err(e) => (hex::encode(e.into_bytes()), true),
                    };
                    Detail {
                        row: Listed::Delayed(sqlx::FromRow::from_row(&r)?),
                        created_at: r.try_get("created_at")?,
                        preview: Some(preview),
                        preview_hex,
                        size: r.try_get("size")?,
                        properties: r.try_get("properties")?,
                        traceparent: None,
                        idempotency_key: None,
                        body_dropped: r.try_get("body_dropped")?,
                    }
                }
            };
            Ok(Some(detail))
        })
        .await
    }

    /// Act through the SQL API, by the store's calls of its functions (the command line
    /// uses the same): whether the row changed (false: gone, or not in the state the
    /// action needs).
    pub(super) async fn act(&self, a: &ActionRequest) -> Result<bool, DbError> {
        let at = match (a.action, a.at) {
            (Action::Reschedule, None) => {
                return Err(DbError::Input(
                    "a reschedule needs at (an RFC 3339 time)".into(),
                ));
            }
            (_, at) => at.map(Due::At),
        };
        let store = self.store()?;
        self.bounded(async {
            let done = match a.kind {
                Kind::Expectation => {
                    let id =
                        a.id.ok_or_else(|| DbError::Input("an expectation is named by id".into()))?;
                    match (a.action, at) {
                        (Action::Cancel, _) => store.cancel_expectation(id).await?,
                        (Action::Release, _) => store.release_expectation(id).await?,
                        (Action::Retry, _) => store.retry_expectation(id).await?,
                        (Action::Reschedule, Some(at)) => {
                            store.reschedule_expectation(id, at).await?.is_some()
                        }
                        (Action::Reschedule, None) => false,
                    }
                }
                // The daemon's role may delete from delayed_messages: it acts for any
                // owner.
                Kind::Delayed => {
                    let (Some(m), Some(o)) = (&a.message_id, &a.owner) else {
                        return Err(DbError::Input(
                            "a delayed message is named by message_id and owner".into(),
                        ));
                    };
                    let o = Some(o.as_str());
                    match (a.action, at) {
                        (Action::Cancel, _) => store.cancel_delayed(m, o).await?,
                        (Action::Release, _) => store.release_delayed(m, o).await?,
                        (Action::Retry, _) => store.retry_delayed(m, o).await?,
                        (Action::Reschedule, Some(at)) => {
                            store.reschedule_delayed(m, at, o).await?.is_some()
                        }
                        (Action::Reschedule, None) => false,
                    }
                }
            };
            Ok(done)
        })
        .await
    }
}
