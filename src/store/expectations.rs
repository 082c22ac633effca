//! The process manager's expectations (table `expected_messages`): the due row the scan
//! locks, and what `timeoutd pending` and the gauges read.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{EXPECTATIONS, PendingCounts, Store, StoreError, Window, lock_rows, safe};

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
    /// When it may be sent: `timeout_at`, or a later retry time.
    pub due_at: DateTime<Utc>,
    /// Database clock when the row was read, then (see `fire`) when it was sent: never
    /// before `due_at`.
    pub fired_at: DateTime<Utc>,
    /// The end of the window of due times its batch locked.
    pub window_end: DateTime<Utc>,
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

/// The statement that finds and locks due rows, for `table` (binds: see `lock_rows`).
/// The benchmark runs it too.
pub fn lock_due_sql(table: &str) -> String {
    // The payload is rendered once per row (OFFSET 0 keeps the subquery from being
    // inlined into each use) and left behind when it is large (see `Store::payload`), so
    // that a batch of large payloads cannot take batch_size × max_message_size of memory.
    let (deadline, window, due_at, due) = (
        EXPECTATIONS.deadline(),
        EXPECTATIONS.window(),
        EXPECTATIONS.due_at(),
        EXPECTATIONS.due_columns(),
    );
    format!(
        "SELECT m.id, m.process_id, m.message_type, {deadline} AS timeout_at, m.exchange, \
         m.routing_key, CASE WHEN octet_length(p.text) <= $2 THEN p.text END AS payload, \
         octet_length(p.text) AS payload_bytes, m.attempts, {due} \
         FROM {table} AS m, LATERAL (SELECT m.payload::text OFFSET 0) AS p(text) \
         WHERE {window} AND m.id <> ALL($3) ORDER BY {due_at} LIMIT $1 FOR UPDATE OF m SKIP LOCKED"
    )
}

/// The statements that only expectations have.
#[derive(Debug, Clone)]
pub(super) struct Statements {
    lock_due: Arc<str>,
    payload: Arc<str>,
    list_all: Arc<str>,
    list_failing: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        let t = format!("{schema}.{}", EXPECTATIONS.name);
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
            list_all: format!("SELECT {cols} FROM {t} AS m ORDER BY m.timeout_at LIMIT $1").into(),
            list_failing: format!(
                "SELECT {cols} FROM {t} AS m WHERE m.attempts > 0 ORDER BY m.timeout_at LIMIT $1"
            )
            .into(),
        }
    }
}

impl Store {
    /// Lock up to `limit` rows due within `window`, oldest due first, skipping rows another
    /// scan holds and the ids in `skip`. Payloads over `inline` bytes are left in the
    /// database.
    pub async fn lock_due(
        &self,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
        window: Window,
    ) -> Result<Vec<DueRow>, StoreError> {
        lock_rows(
            &self.sql.expectations.lock_due,
            tx,
            limit,
            inline,
            skip,
            window,
        )
        .await
    }

    /// The payload of one (locked) row as text, for payloads `lock_due` left behind.
    pub async fn payload(
        &self,
        tx: &mut PgConnection,
        id: Uuid,
    ) -> Result<Option<String>, StoreError> {
        let text = sqlx::query_scalar(safe(&self.sql.expectations.payload))
            .bind(id)
            .fetch_optional(tx)
            .await?;
        Ok(text.flatten())
    }

    /// Counts for operators; `overdue` means due for longer than `late`.
    pub async fn pending_counts(&self, late: Duration) -> Result<PendingCounts, StoreError> {
        self.counts(EXPECTATIONS, late).await
    }

    /// Peek at rows, earliest deadline first; never changes them.
    pub async fn list(
        &self,
        filter: PendingFilter,
        limit: i64,
    ) -> Result<Vec<PendingRow>, StoreError> {
        let sql = match filter {
            PendingFilter::All => &self.sql.expectations.list_all,
            PendingFilter::Failing => &self.sql.expectations.list_failing,
        };
        Ok(sqlx::query_as(safe(sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }
}
