//! The process manager's expectations (table `expected_messages`): the due row the scan
//! locks, and what `timeoutd pending` and the gauges read.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use sqlx::postgres::PgRow;

use super::due::{column, tid};
use super::sql::safe;
use super::{Kind, PendingCounts, Store, StoreError};

/// One due row, locked by the scan's transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct DueRow {
    pub id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    /// The payload as Postgres prints it (always valid JSON), embedded in the TimeOut as
    /// is: jsonb holds numbers and nesting depths that a JSON library may refuse, and
    /// such a row must still fire. `None` for SQL NULL, and for a payload the scan left in
    /// the database (then `payload_bytes` is set: 0 until it was read, then its size).
    pub payload: Option<String>,
    pub payload_bytes: Option<i32>,
    /// The W3C trace context the expectation was written with: the TimeOut carries it.
    pub traceparent: Option<String>,
    pub attempts: i32,
    /// When it may be sent: `timeout_at`, or a later retry time.
    pub due_at: DateTime<Utc>,
    /// Database clock when the row was read, then (see `fire`) when it was sent: never
    /// before `due_at`.
    pub fired_at: DateTime<Utc>,
    /// The end of the window of due times its batch locked.
    pub window_end: DateTime<Utc>,
    /// Where the locked row lies in the table (`ctid`), if read.
    pub tid: Option<String>,
}

/// Read by position, in the order of [`lock_due_sql`]'s columns (see [`column`]).
impl<'r> sqlx::FromRow<'r, PgRow> for DueRow {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: column(row, 0, "id")?,
            process_id: column(row, 1, "process_id")?,
            message_type: column(row, 2, "message_type")?,
            timeout_at: column(row, 3, "timeout_at")?,
            exchange: column(row, 4, "exchange")?,
            routing_key: column(row, 5, "routing_key")?,
            payload: column(row, 6, "payload")?,
            payload_bytes: column(row, 7, "payload_bytes")?,
            traceparent: column(row, 8, "traceparent")?,
            attempts: column(row, 9, "attempts")?,
            due_at: column(row, 10, "due_at")?,
            fired_at: column(row, 11, "fired_at")?,
            window_end: column(row, 12, "window_end")?,
            tid: tid(row, 13)?,
        })
    }
}

impl DueRow {
    /// The payload was left in the database (large, or compressed): its size once known,
    /// 0 before.
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
    #[sqlx(rename = "held")]
    pub parked: bool,
}

/// Which rows `timeoutd pending` lists: each field set narrows it (default: all). A
/// field of one kind (a process id, an owner) leaves out every row of the other kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingFilter {
    /// Rows of this kind only ([`Kind::Expectation`] or [`Kind::Delayed`]).
    pub kind: Option<Kind>,
    pub process_id: Option<String>,
    pub message_type: Option<String>,
    pub owner: Option<String>,
    pub message_id: Option<String>,
    /// Whose publish failed at least once (`attempts > 0`): held and parked rows
    /// included, as in the `failing` count.
    pub failing: bool,
    /// Held delayed messages and parked expectations only: those waiting for an
    /// operator (`retry_at = 'infinity'`).
    pub held: bool,
}

impl PendingFilter {
    /// Every row whose publish failed (`pending --failing`).
    pub fn failing() -> Self {
        Self {
            failing: true,
            ..Self::default()
        }
    }

    /// Whether it can match rows of `table` at all.
    pub(super) fn admits(&self, kind: Kind) -> bool {
        let of_expectations = self.process_id.is_some() || self.message_type.is_some();
        let of_delayed = self.owner.is_some() || self.message_id.is_some();
        let of_other = if kind == Kind::Delayed {
            of_expectations
        } else {
            of_delayed
        };
        !of_other && self.kind.is_none_or(|k| k == kind)
    }
}

/// The statement that finds and locks due rows, for `table` (binds: see `Store::lock_due`).
/// The benchmark runs it too.
pub fn lock_due_sql(table: &str) -> String {
    // Printing a large jsonb payload costs as much as sending it: only payloads stored
    // uncompressed and small enough that their text cannot exceed `$2` (printed, a jsonb
    // value is at most six times its stored size: a control character becomes
    // \u0000) come with the rows; the others are left behind (`payload_bytes` 0: size
    // unknown until read, see `Store::payload`), so that a batch of large payloads
    // neither takes batch_size × max_message_size of memory nor holds up the lock.
    let (deadline, window, due_at, due) = (
        Kind::Expectation.deadline(),
        Kind::Expectation.window(),
        Kind::Expectation.due_at(),
        Kind::Expectation.due_columns(table),
    );
    let inline =
        "pg_column_compression(m.payload) IS NULL AND pg_column_size(m.payload)::int8 * 6 <= $2";
    format!(
        "SELECT m.id, m.process_id, m.message_type, {deadline} AS timeout_at, m.exchange, \
         m.routing_key, CASE WHEN {inline} THEN m.payload::text END AS payload, \
         CASE WHEN NOT ({inline}) THEN 0 END AS payload_bytes, m.traceparent, m.attempts, {due} \
         FROM {table} AS m \
         WHERE {window} AND m.id <> ALL($3) ORDER BY {due_at} LIMIT $1 FOR UPDATE OF m SKIP LOCKED"
    )
}

/// The statements that only expectations have.
#[derive(Debug, Clone)]
pub(super) struct Statements {
    pub(super) lock_due: Arc<str>,
    payload: Arc<str>,
    list: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        let t = Kind::Expectation.qualified(schema);
        let cols = Kind::Expectation.list_columns();
        Self {
            lock_due: lock_due_sql(&t).into(),
            payload: format!(
                "SELECT CASE WHEN octet_length(p) <= $2 THEN p END, octet_length(p) \
                 FROM (SELECT payload::text FROM {t} WHERE id = $1 OFFSET 0) AS s(p)"
            )
            .into(),
            // Binds: see `PendingFilter`; a NULL or false one does not narrow.
            list: format!(
                "SELECT {cols} FROM {t} AS m WHERE ($2::text IS NULL OR m.process_id = $2) \
                 AND ($3::text IS NULL OR m.message_type = $3) \
                 AND (NOT $4 OR m.attempts > 0) AND (NOT $5 OR m.retry_at = 'infinity') \
                 ORDER BY m.timeout_at LIMIT $1"
            )
            .into(),
        }
    }
}

impl Store {
    /// Read into `row` the payload `lock_due` left behind, if its text is at most `max`
    /// bytes; either way `payload_bytes` then says how large it is. Returns the bytes read.
    pub async fn payload(
        &self,
        tx: &mut PgConnection,
        row: &mut DueRow,
        max: usize,
    ) -> Result<usize, StoreError> {
        let max = i32::try_from(max).unwrap_or(i32::MAX);
        let read: Option<(Option<String>, Option<i32>)> =
            sqlx::query_as(safe(&self.sql.expectations.payload))
                .bind(row.id)
                .bind(max)
                .fetch_optional(tx)
                .await?;
        let (text, bytes) = read.unwrap_or_default();
        row.payload_bytes = bytes;
        row.payload = text;
        Ok(row.payload.as_ref().map_or(0, String::len))
    }

    /// Counts for operators; `overdue` means due for longer than `late`.
    pub async fn pending_counts(&self, late: Duration) -> Result<PendingCounts, StoreError> {
        self.counts(Kind::Expectation, late).await
    }

    /// Peek at rows, earliest deadline first; never changes them.
    pub async fn list(
        &self,
        filter: &PendingFilter,
        limit: i64,
    ) -> Result<Vec<PendingRow>, StoreError> {
        if !filter.admits(Kind::Expectation) {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_as(safe(&self.sql.expectations.list))
            .bind(limit)
            .bind(&filter.process_id)
            .bind(&filter.message_type)
            .bind(filter.failing)
            .bind(filter.held)
            .fetch_all(&self.pool)
            .await?)
    }
}
