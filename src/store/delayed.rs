//! Delayed messages (table `delayed_messages`): storing what the ingress receives, the
//! due row the scan locks, and cancels.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use serde::Serialize;

use super::{DELAYED, PendingFilter, Store, StoreError, Window, lock_rows, safe};

/// One due delayed message, locked by the scan's transaction.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct DelayedRow {
    pub id: Uuid,
    pub message_id: String,
    pub deliver_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    /// The stored properties (JSON of `wire::Properties`).
    pub properties: String,
    /// `None` when larger than the scan asked for (then `body_bytes` says how large).
    pub body: Option<Vec<u8>>,
    pub body_bytes: i32,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// When it may be sent: `deliver_at`, or a later retry time.
    pub due_at: DateTime<Utc>,
    /// Database clock when the row was read, then (see `fire`) when it was sent: never
    /// before `due_at`.
    pub fired_at: DateTime<Utc>,
    /// The end of the window of due times its batch locked.
    pub window_end: DateTime<Utc>,
}

impl DelayedRow {
    /// The body was left in the database because it is larger than the limit.
    pub fn body_withheld(&self) -> Option<usize> {
        match self.body {
            None => Some(usize::try_from(self.body_bytes).unwrap_or(usize::MAX)),
            Some(_) => None,
        }
    }
}

/// One delayed message as `timeoutd pending --list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct PendingDelayed {
    pub id: Uuid,
    pub message_id: String,
    pub deliver_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    pub body_bytes: i32,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub retry_at: Option<DateTime<Utc>>,
    /// Held for an operator: bad input, or delivered but not deletable (see
    /// `last_error`); never delivered again by itself.
    pub held: bool,
}

/// What one arriving message asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Ingest {
    Store(Box<Stored>),
    /// Delete the pending message with this `message_id`.
    Cancel(String),
}

/// A message to keep until it is due.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub message_id: String,
    pub due: Due,
    pub exchange: String,
    pub routing_key: String,
    /// As published, without `x-delay` and `x-timeoutd-*`: the JSON of
    /// `wire::Properties` (stored as jsonb).
    pub properties: String,
    pub body: Vec<u8>,
    /// Bad input: kept, but held for an operator with this reason, never delivered.
    pub held: Option<String>,
}

/// When a stored message is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This long after the database's `now()` at insert.
    After(Duration),
    At(DateTime<Utc>),
}

/// What one ingest transaction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// New rows (held ones included).
    pub stored: u64,
    /// Messages whose `message_id` was already pending (a redelivery): nothing added.
    pub duplicates: u64,
    /// Held for an operator (bad input).
    pub held: u64,
    /// Pending messages deleted by cancel messages.
    pub cancelled: u64,
    /// Messages that arrived after a cancel message naming them: dropped.
    pub arrived_cancelled: u64,
}

impl IngestOutcome {
    pub fn plus(self, o: Self) -> Self {
        Self {
            stored: self.stored + o.stored,
            duplicates: self.duplicates + o.duplicates,
            held: self.held + o.held,
            cancelled: self.cancelled + o.cancelled,
            arrived_cancelled: self.arrived_cancelled + o.arrived_cancelled,
        }
    }
}

/// Hash buckets of `message_id` the ingest transactions lock (a power of two): enough
/// that small batches rarely meet, few enough for Postgres's lock table.
const CANCEL_BUCKETS: u32 = 64;

/// Expired cancels one cancel statement forgets.
const FORGET: u32 = 100;

/// The statement that finds and locks due delayed messages, for `table` (binds: see
/// `lock_rows`).
pub fn lock_delayed_sql(table: &str) -> String {
    let (deadline, window, due_at, due) = (
        DELAYED.deadline(),
        DELAYED.window(),
        DELAYED.due_at(),
        DELAYED.due_columns(),
    );
    format!(
        "SELECT m.id, m.message_id, {deadline} AS deliver_at, m.exchange, \
         m.routing_key, m.properties::text AS properties, \
         CASE WHEN octet_length(m.body) <= $2 THEN m.body END AS body, \
         octet_length(m.body) AS body_bytes, m.attempts, m.created_at, {due} \
         FROM {table} AS m WHERE {window} AND m.id <> ALL($3) \
         ORDER BY {due_at} LIMIT $1 FOR UPDATE OF m SKIP LOCKED"
    )
}

#[derive(Debug, Clone)]
pub(super) struct Statements {
    order: Arc<str>,
    insert: Arc<str>,
    cancel_remembered: Arc<str>,
    cancel: Arc<str>,
    lock_due: Arc<str>,
    body: Arc<str>,
    list_all: Arc<str>,
    list_failing: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        let t = format!("{schema}.{}", DELAYED.name);
        let c = format!("{schema}.delayed_cancels");
        // The lock space of this schema's ingest, apart from other schemas and other
        // users of two-key advisory locks (a collision would only make them wait).
        let space = format!("hashtext('timeoutd.delayed_messages:{schema}')");
        let mask = CANCEL_BUCKETS - 1;
        let deadline = DELAYED.deadline();
        let cols = format!(
            "m.id, m.message_id, {deadline} AS deliver_at, m.exchange, m.routing_key, \
             octet_length(m.body) AS body_bytes, m.attempts, m.last_error, \
             CASE WHEN isfinite(m.retry_at) THEN m.retry_at END AS retry_at, \
             coalesce(m.retry_at = 'infinity', false) AS held"
        );
        Self {
            // One statement per batch; a message_id already pending (a redelivery after
            // a crash between commit and ack, or a duplicate in the batch) adds nothing.
            // Locks taken first, in bucket order (no deadlock between two batches):
            // exclusive on the buckets of the batch's cancels, shared on those of its
            // messages, so a cancel and the message it names, stored by two nodes at
            // once, never both miss each other (see migration 0006).
            order: format!(
                "SELECT s.b, CASE WHEN s.cancel THEN pg_advisory_xact_lock({space}, s.b) \
                 ELSE pg_advisory_xact_lock_shared({space}, s.b) END::text \
                 FROM (SELECT (hashtextextended(i.message_id, 0) & {mask})::int AS b, \
                 bool_or(i.cancel) AS cancel \
                 FROM unnest($1::text[], $2::bool[]) AS i(message_id, cancel) \
                 GROUP BY 1 ORDER BY 1) AS s"
            )
            .into(),
            // One statement per batch; a message_id already pending (a redelivery after
            // a crash between commit and ack, or a duplicate in the batch) adds nothing,
            // and neither does one a cancel message named first. Rows go in in
            // message_id order: two batches holding the same redelivered messages wait
            // for each other's unique-index entries in one order, never deadlock.
            insert: format!(
                "WITH r AS (SELECT r.*, EXISTS (SELECT 1 FROM {c} AS c \
                 WHERE c.message_id = r.message_id AND c.expires_at > now()) AS cancelled \
                 FROM unnest($1::uuid[], $2::text[], $3::float8[], $4::timestamptz[], \
                 $5::text[], $6::text[], $7::text[], $8::bytea[], $9::text[]) \
                 AS r(id, message_id, delay_ms, at, exchange, routing_key, properties, body, held)), \
                 stored AS (INSERT INTO {t} (id, message_id, deliver_at, exchange, routing_key, \
                 properties, body, attempts, last_error, retry_at) \
                 SELECT r.id, r.message_id, \
                 coalesce(r.at, now() + make_interval(secs => r.delay_ms / 1000.0)), \
                 r.exchange, r.routing_key, r.properties::jsonb, r.body, \
                 CASE WHEN r.held IS NULL THEN 0 ELSE 1 END, r.held, \
                 CASE WHEN r.held IS NULL THEN NULL ELSE 'infinity'::timestamptz END \
                 FROM r WHERE NOT r.cancelled ORDER BY r.message_id COLLATE \"C\" \
                 ON CONFLICT (message_id) DO NOTHING RETURNING 1) \
                 SELECT (SELECT count(*) FROM stored), (SELECT count(*) FROM r WHERE r.cancelled)"
            )
            .into(),
            // The cancel is remembered (renewed if repeated), and a few expired ones
            // are forgotten, so the table holds about the cancels of one cancel_ttl.
            cancel_remembered: format!(
                "WITH x AS (SELECT DISTINCT unnest($1::text[]) AS message_id), \
                 remember AS (INSERT INTO {c} (message_id, expires_at) \
                 SELECT message_id, now() + make_interval(secs => $2) FROM x \
                 ON CONFLICT (message_id) DO UPDATE SET expires_at = excluded.expires_at), \
                 forget AS (DELETE FROM {c} WHERE message_id IN (SELECT message_id FROM {c} \
                 WHERE expires_at <= now() AND message_id NOT IN (SELECT message_id FROM x) \
                 ORDER BY expires_at LIMIT {FORGET})), \
                 deleted AS (DELETE FROM {t} WHERE message_id IN (SELECT message_id FROM x) \
                 RETURNING 1) \
                 SELECT count(*) FROM deleted"
            )
            .into(),
            cancel: format!("DELETE FROM {t} WHERE message_id = ANY($1)").into(),
            lock_due: lock_delayed_sql(&t).into(),
            body: format!("SELECT body FROM {t} WHERE id = $1").into(),
            list_all: format!("SELECT {cols} FROM {t} AS m ORDER BY m.deliver_at LIMIT $1").into(),
            list_failing: format!(
                "SELECT {cols} FROM {t} AS m WHERE m.attempts > 0 ORDER BY m.deliver_at LIMIT $1"
            )
            .into(),
        }
    }
}

impl Store {
    /// Store and cancel in arrival order, in one transaction (a cancel that arrives
    /// after its message in the same batch still finds it); a cancel is remembered for
    /// `cancel_ttl`, so its message arriving later, through another node, is dropped.
    pub async fn ingest(
        &self,
        batch: &[Ingest],
        cancel_ttl: Duration,
    ) -> Result<IngestOutcome, StoreError> {
        let mut out = IngestOutcome::default();
        let mut tx = self.begin().await?;
        self.order(&mut tx, batch).await?;
        for run in
            batch.chunk_by(|a, b| matches!(a, Ingest::Store(_)) == matches!(b, Ingest::Store(_)))
        {
            match &run[0] {
                Ingest::Store(_) => self.insert(&mut tx, run, &mut out).await?,
                Ingest::Cancel(_) => {
                    out.cancelled += self.cancel_in(&mut tx, run, cancel_ttl).await?
                }
            }
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Take the batch's bucket locks (see `Statements::order`).
    async fn order(&self, tx: &mut PgConnection, batch: &[Ingest]) -> Result<(), StoreError> {
        let (ids, cancels): (Vec<&str>, Vec<bool>) = batch
            .iter()
            .map(|i| match i {
                Ingest::Store(s) => (s.message_id.as_str(), false),
                Ingest::Cancel(id) => (id.as_str(), true),
            })
            .unzip();
        sqlx::query(safe(&self.sql.delayed.order))
            .bind(ids)
            .bind(cancels)
            .fetch_all(tx)
            .await?;
        Ok(())
    }

    async fn insert(
        &self,
        tx: &mut PgConnection,
        run: &[Ingest],
        out: &mut IngestOutcome,
    ) -> Result<(), StoreError> {
        let rows: Vec<&Stored> = run
            .iter()
            .filter_map(|i| match i {
                Ingest::Store(s) => Some(&**s),
                Ingest::Cancel(_) => None,
            })
            .collect();
        let properties: Vec<&str> = rows.iter().map(|r| r.properties.as_str()).collect();
        let (delay_ms, at): (Vec<Option<f64>>, Vec<Option<DateTime<Utc>>>) = rows
            .iter()
            .map(|r| match r.due {
                Due::After(d) => (Some(d.as_secs_f64() * 1000.0), None),
                Due::At(t) => (None, Some(t)),
            })
            .unzip();
        let (inserted, cancelled): (i64, i64) = sqlx::query_as(safe(&self.sql.delayed.insert))
            .bind(rows.iter().map(|_| Uuid::new_v4()).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|r| r.message_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(delay_ms)
            .bind(at)
            .bind(rows.iter().map(|r| r.exchange.as_str()).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|r| r.routing_key.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(properties)
            .bind(rows.iter().map(|r| r.body.as_slice()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.held.as_deref()).collect::<Vec<_>>())
            .fetch_one(&mut *tx)
            .await?;
        let (inserted, cancelled) = (inserted.unsigned_abs(), cancelled.unsigned_abs());
        out.stored += inserted;
        out.arrived_cancelled += cancelled;
        out.duplicates += (rows.len() as u64).saturating_sub(inserted + cancelled);
        out.held += rows.iter().filter(|r| r.held.is_some()).count() as u64;
        Ok(())
    }

    async fn cancel_in(
        &self,
        tx: &mut PgConnection,
        run: &[Ingest],
        ttl: Duration,
    ) -> Result<u64, StoreError> {
        let ids: Vec<&str> = run
            .iter()
            .filter_map(|i| match i {
                Ingest::Cancel(id) => Some(id.as_str()),
                Ingest::Store(_) => None,
            })
            .collect();
        let deleted: i64 = sqlx::query_scalar(safe(&self.sql.delayed.cancel_remembered))
            .bind(ids)
            .bind(ttl.as_secs_f64())
            .fetch_one(tx)
            .await?;
        Ok(deleted.unsigned_abs())
    }

    /// Peek at delayed messages, earliest due first; never changes them.
    pub async fn list_delayed(
        &self,
        filter: PendingFilter,
        limit: i64,
    ) -> Result<Vec<PendingDelayed>, StoreError> {
        let sql = match filter {
            PendingFilter::All => &self.sql.delayed.list_all,
            PendingFilter::Failing => &self.sql.delayed.list_failing,
        };
        Ok(sqlx::query_as(safe(sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Cancel one pending delayed message: `true` when it was still pending.
    pub async fn cancel_delayed(&self, message_id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(safe(&self.sql.delayed.cancel))
            .bind(vec![message_id])
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Lock up to `limit` due delayed messages, as [`Store::lock_due`] does for
    /// expectations; bodies over `inline` bytes are left in the database.
    pub async fn lock_due_delayed(
        &self,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
        window: Window,
    ) -> Result<Vec<DelayedRow>, StoreError> {
        lock_rows(&self.sql.delayed.lock_due, tx, limit, inline, skip, window).await
    }

    /// The body of one (locked) row that `lock_due_delayed` left behind.
    pub async fn delayed_body(
        &self,
        tx: &mut PgConnection,
        id: Uuid,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(sqlx::query_scalar(safe(&self.sql.delayed.body))
            .bind(id)
            .fetch_optional(tx)
            .await?)
    }
}
