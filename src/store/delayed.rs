//! Delayed messages (table `delayed_messages`): storing what the ingress receives, the
//! due row the scan locks, and cancels.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use serde::Serialize;

use super::due::{column, tid};
use super::sql::safe;
use super::{Kind, PendingFilter, Store, StoreError};

/// One due delayed message, locked by the scan's transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct DelayedRow {
    pub id: Uuid,
    /// Who published it (AMQP `user_id`), `""` for anonymous.
    pub owner: String,
    pub message_id: String,
    pub deliver_at: DateTime<Utc>,
    pub exchange: String,
    pub routing_key: String,
    /// The stored properties (JSON of `wire::Properties`).
    pub properties: String,
    /// `None` when larger than the scan asked for (then `body_bytes` says how large).
    pub body: Option<Vec<u8>>,
    pub body_bytes: i32,
    /// Stored without its body (larger than `delay.max_body`): never deliverable.
    pub body_dropped: bool,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// When it may be sent: `deliver_at`, or a later retry time.
    pub due_at: DateTime<Utc>,
    /// Database clock when the row was read, then (see `fire`) when it was sent: never
    /// before `due_at`.
    pub fired_at: DateTime<Utc>,
    /// The end of the window of due times its batch locked.
    pub window_end: DateTime<Utc>,
    /// Where the locked row lies in the table (`ctid`), if read.
    pub tid: Option<String>,
}

/// Read by position, in the order of [`lock_delayed_sql`]'s columns (see `store::column`).
impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for DelayedRow {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: column(row, 0, "id")?,
            owner: column(row, 1, "owner")?,
            message_id: column(row, 2, "message_id")?,
            deliver_at: column(row, 3, "deliver_at")?,
            exchange: column(row, 4, "exchange")?,
            routing_key: column(row, 5, "routing_key")?,
            properties: column(row, 6, "properties")?,
            body: column(row, 7, "body")?,
            body_bytes: column(row, 8, "body_bytes")?,
            body_dropped: column(row, 9, "body_dropped")?,
            attempts: column(row, 10, "attempts")?,
            created_at: column(row, 11, "created_at")?,
            due_at: column(row, 12, "due_at")?,
            fired_at: column(row, 13, "fired_at")?,
            window_end: column(row, 14, "window_end")?,
            tid: tid(row, 15)?,
        })
    }
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
    pub owner: String,
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
    /// Delete the owner's pending message with this `message_id`.
    Cancel {
        owner: String,
        message_id: String,
    },
}

impl Ingest {
    fn key(&self) -> (&str, &str) {
        match self {
            Ingest::Store(s) => (&s.owner, &s.message_id),
            Ingest::Cancel { owner, message_id } => (owner, message_id),
        }
    }
}

/// A message to keep until it is due.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// The publisher's AMQP `user_id` (checked by the broker), `""` for anonymous: ids,
    /// cancels and quotas are the owner's own.
    pub owner: String,
    pub message_id: String,
    pub due: Due,
    pub exchange: String,
    pub routing_key: String,
    /// As published, without `x-delay` and `x-timeoutd-*`: the JSON of
    /// `wire::Properties` (stored as jsonb).
    pub properties: String,
    pub body: Vec<u8>,
    /// The body was over `delay.max_body` and is not stored (`body` is empty): the row
    /// can never be delivered, even when released.
    pub body_dropped: bool,
    /// Bad input: kept, but held for an operator, never delivered.
    pub held: Option<Held>,
}

/// Why a stored message is held.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// Every reason, for `last_error`.
    pub why: String,
    /// The one it is counted under.
    pub bound: Bound,
}

/// What a held message is counted as (`timeoutd_delayed_ingested_total{result}`); when
/// several apply, the last listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bound {
    /// Unreadable headers, NUL characters, a cancel that names no id.
    BadInput,
    /// Due later than `delay.max_delay` allows.
    TooLate,
    /// A body over `delay.max_body` (not stored).
    TooLarge,
    /// An exchange it may not go to.
    NotAllowed,
}

impl Bound {
    pub const ALL: [Bound; 4] = [
        Bound::BadInput,
        Bound::TooLate,
        Bound::TooLarge,
        Bound::NotAllowed,
    ];

    /// Its `result` label.
    pub fn result(self) -> &'static str {
        match self {
            Bound::BadInput => "held",
            Bound::TooLate => "held_too_late",
            Bound::TooLarge => "held_too_large",
            Bound::NotAllowed => "held_not_allowed",
        }
    }
}

/// What one owner may have stored at once (`delay.max_pending_per_owner`,
/// `delay.max_bytes_per_owner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub messages: u64,
    pub bytes: u64,
}

impl Quota {
    /// No bound (tools and tests that store on purpose).
    pub const NONE: Quota = Quota {
        messages: u64::MAX,
        bytes: u64::MAX,
    };
}

/// When a stored message is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This long after the database's `now()` at insert.
    After(Duration),
    At(DateTime<Utc>),
}

/// What one ingest transaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// New rows (held ones included).
    pub stored: u64,
    /// Messages whose owner had this `message_id` pending (a redelivery): nothing added.
    pub duplicates: u64,
    /// Held for an operator, by [`Bound`] (in the order of `Bound::ALL`).
    pub held: [u64; 4],
    /// Positions in the batch of the messages not stored because their owner is over
    /// its quota: to be rejected to the broker.
    pub over_quota: Vec<usize>,
    /// Pending messages deleted by cancel messages.
    pub cancelled: u64,
    /// Messages that arrived after a cancel message naming them: dropped.
    pub arrived_cancelled: u64,
}

impl IngestOutcome {
    /// `o`, of a batch that followed this one at `offset` in the same delivery.
    pub fn plus(mut self, o: Self, offset: usize) -> Self {
        self.stored += o.stored;
        self.duplicates += o.duplicates;
        for (a, b) in self.held.iter_mut().zip(o.held) {
            *a += b;
        }
        self.over_quota
            .extend(o.over_quota.into_iter().map(|i| i + offset));
        self.cancelled += o.cancelled;
        self.arrived_cancelled += o.arrived_cancelled;
        self
    }

    /// Held for an operator, whatever the bound.
    pub fn held_total(&self) -> u64 {
        self.held.iter().sum()
    }
}

/// Hash buckets of `message_id` the ingest transactions lock (a power of two): enough
/// that small batches rarely meet, few enough for Postgres's lock table.
const CANCEL_BUCKETS: u32 = 64;

/// Expired cancels one cancel statement forgets.
const FORGET: u32 = 100;

/// The statement that finds and locks due delayed messages, for `table` (binds: see
/// `Store::lock_due`).
pub fn lock_delayed_sql(table: &str) -> String {
    let (deadline, window, due_at, due) = (
        Kind::Delayed.deadline(),
        Kind::Delayed.window(),
        Kind::Delayed.due_at(),
        Kind::Delayed.due_columns(table),
    );
    format!(
        "SELECT m.id, m.owner, m.message_id, {deadline} AS deliver_at, m.exchange, \
         m.routing_key, m.properties::text AS properties, \
         CASE WHEN octet_length(m.body) <= $2 THEN m.body END AS body, \
         octet_length(m.body) AS body_bytes, m.body_dropped, m.attempts, m.created_at, {due} \
         FROM {table} AS m WHERE {window} AND m.id <> ALL($3) \
         ORDER BY {due_at} LIMIT $1 FOR UPDATE OF m SKIP LOCKED"
    )
}

#[derive(Debug, Clone)]
pub(super) struct Statements {
    order: Arc<str>,
    insert: Arc<str>,
    cancel_remembered: Arc<str>,
    pub(super) lock_due: Arc<str>,
    body: Arc<str>,
    list: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        let t = Kind::Delayed.qualified(schema);
        let c = format!("{schema}.delayed_cancels");
        // The lock space of this schema's ingest, apart from other schemas and other
        // users of two-key advisory locks (a collision would only make them wait).
        let space = format!("hashtext('timeoutd.delayed_messages:{schema}')");
        let mask = CANCEL_BUCKETS - 1;
        let cols = Kind::Delayed.list_columns();
        Self {
            // Locks taken first, in bucket order (no deadlock between two batches):
            // exclusive on the buckets of the batch's cancels, shared on those of its
            // messages, so a cancel and the message it names, stored by two nodes at
            // once, never both miss each other (see migration 0006). A bucket is a hash
            // of owner and message_id: the pair a cancel names. In the same round trip,
            // which messages ($4 their owners, $5 their sizes) fit the quota ($6
            // messages, $7 bytes): the rule is migration 0012's delayed_usage_admit(),
            // which the SQL door applies too. The lock call's result is counted, so the
            // planner cannot drop it.
            order: format!(
                "SELECT (SELECT count(l.locked) FROM (SELECT CASE WHEN s.cancel \
                 THEN pg_advisory_xact_lock({space}, s.b) \
                 ELSE pg_advisory_xact_lock_shared({space}, s.b) END::text AS locked \
                 FROM (SELECT (hashtextextended(i.message_id, hashtext(i.owner)) & {mask})::int AS b, \
                 bool_or(i.cancel) AS cancel \
                 FROM unnest($1::text[], $2::text[], $3::bool[]) AS i(owner, message_id, cancel) \
                 GROUP BY 1 ORDER BY 1) AS s) AS l), \
                 {schema}.delayed_usage_admit($4, $5, $6, $7)"
            )
            .into(),
            // One statement per batch; a message_id its owner has pending already (a
            // redelivery after a crash between commit and ack, or a duplicate in the
            // batch) adds nothing, and neither does one its owner's cancel message named
            // first. Rows go in in (owner, message_id) order: two batches holding the same
            // redelivered messages wait for each other's unique-index entries in one
            // order, never deadlock.
            insert: format!(
                "WITH r AS (SELECT r.*, EXISTS (SELECT 1 FROM {c} AS c \
                 WHERE c.owner = r.owner AND c.message_id = r.message_id \
                 AND c.expires_at > now()) AS cancelled \
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::float8[], \
                 $5::timestamptz[], $6::text[], $7::text[], $8::text[], $9::bytea[], $10::text[], \
                 $11::bool[]) \
                 AS r(id, owner, message_id, delay_ms, at, exchange, routing_key, properties, \
                 body, held, body_dropped)), \
                 stored AS (INSERT INTO {t} (id, owner, message_id, deliver_at, exchange, \
                 routing_key, properties, body, body_dropped, attempts, last_error, retry_at) \
                 SELECT r.id, r.owner, r.message_id, \
                 coalesce(r.at, now() + make_interval(secs => r.delay_ms / 1000.0)), \
                 r.exchange, r.routing_key, r.properties::jsonb, r.body, r.body_dropped, \
                 CASE WHEN r.held IS NULL THEN 0 ELSE 1 END, r.held, \
                 CASE WHEN r.held IS NULL THEN NULL ELSE 'infinity'::timestamptz END \
                 FROM r WHERE NOT r.cancelled \
                 ORDER BY r.owner COLLATE \"C\", r.message_id COLLATE \"C\" \
                 ON CONFLICT (owner, message_id) DO NOTHING RETURNING 1) \
                 SELECT (SELECT count(*) FROM stored), (SELECT count(*) FROM r WHERE r.cancelled)"
            )
            .into(),
            // The cancel is remembered (renewed if repeated), and a few expired ones
            // are forgotten, so the table holds about the cancels of one cancel_ttl.
            cancel_remembered: format!(
                "WITH x AS (SELECT DISTINCT owner, message_id \
                 FROM unnest($1::text[], $2::text[]) AS x(owner, message_id)), \
                 remember AS (INSERT INTO {c} (owner, message_id, expires_at) \
                 SELECT owner, message_id, now() + make_interval(secs => $3) FROM x \
                 ON CONFLICT (owner, message_id) DO UPDATE SET expires_at = excluded.expires_at), \
                 forget AS (DELETE FROM {c} WHERE (owner, message_id) IN \
                 (SELECT e.owner, e.message_id FROM {c} AS e WHERE e.expires_at <= now() \
                 AND NOT EXISTS (SELECT 1 FROM x WHERE x.owner = e.owner \
                 AND x.message_id = e.message_id) ORDER BY e.expires_at LIMIT {FORGET})), \
                 deleted AS (DELETE FROM {t} AS m USING x \
                 WHERE m.owner = x.owner AND m.message_id = x.message_id RETURNING 1) \
                 SELECT count(*) FROM deleted"
            )
            .into(),
            lock_due: lock_delayed_sql(&t).into(),
            body: format!("SELECT body FROM {t} WHERE id = $1").into(),
            // Binds: see `PendingFilter`; a NULL or false one does not narrow.
            list: format!(
                "SELECT {cols} FROM {t} AS m WHERE ($2::text IS NULL OR m.owner = $2) \
                 AND ($3::text IS NULL OR m.message_id = $3) \
                 AND (NOT $4 OR m.attempts > 0) AND (NOT $5 OR m.retry_at = 'infinity') \
                 ORDER BY m.deliver_at LIMIT $1"
            )
            .into(),
        }
    }
}

/// Bytes a stored message counts against its owner's quota: its body and its properties
/// as JSON text, as the SQL door counts them (the ledger counts them as Postgres stores
/// them: near enough).
fn footprint(s: &Stored) -> u64 {
    (s.body.len() + s.properties.len()) as u64
}

impl Store {
    /// Store and cancel in arrival order, in one transaction (a cancel that arrives
    /// after its message in the same batch still finds it); a cancel is remembered for
    /// `cancel_ttl`, so its message arriving later, through another node, is dropped.
    /// A message whose owner would go over `quota` is not stored (its position is
    /// returned in [`IngestOutcome::over_quota`]). The quota is read once per batch
    /// from committed rows: batches stored at the same time may each take the last
    /// room, so an owner can exceed it by what is in flight at once (prefetch per node).
    pub async fn ingest(
        &self,
        batch: &[Ingest],
        cancel_ttl: Duration,
        quota: Quota,
    ) -> Result<IngestOutcome, StoreError> {
        let mut out = IngestOutcome::default();
        let mut tx = self.begin().await?;
        let admitted = self.order(&mut tx, batch, quota, &mut out).await?;
        let mut offset = 0;
        for run in
            batch.chunk_by(|a, b| matches!(a, Ingest::Store(_)) == matches!(b, Ingest::Store(_)))
        {
            let admitted = &admitted[offset..offset + run.len()];
            offset += run.len();
            match &run[0] {
                Ingest::Store(_) => self.insert(&mut tx, run, admitted, &mut out).await?,
                Ingest::Cancel { .. } => {
                    out.cancelled += self.cancel_in(&mut tx, run, cancel_ttl).await?
                }
            }
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Take the batch's bucket locks (see `Statements::order`), and which of its
    /// messages their owners have room for (all without a quota to check); those without
    /// are noted in `out`.
    async fn order(
        &self,
        tx: &mut PgConnection,
        batch: &[Ingest],
        quota: Quota,
        out: &mut IngestOutcome,
    ) -> Result<Vec<bool>, StoreError> {
        let mut owners = Vec::with_capacity(batch.len());
        let mut ids = Vec::with_capacity(batch.len());
        let mut cancels = Vec::with_capacity(batch.len());
        for item in batch {
            let (owner, id) = item.key();
            owners.push(owner);
            ids.push(id);
            cancels.push(matches!(item, Ingest::Cancel { .. }));
        }
        // The messages to judge, by their place in the batch.
        let storing: Vec<(usize, &Stored)> = if quota == Quota::NONE {
            Vec::new()
        } else {
            batch
                .iter()
                .enumerate()
                .filter_map(|(i, item)| match item {
                    Ingest::Store(s) => Some((i, &**s)),
                    Ingest::Cancel { .. } => None,
                })
                .collect()
        };
        let big = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let (_, fits): (i64, Vec<bool>) = sqlx::query_as(safe(&self.sql.delayed.order))
            .bind(owners)
            .bind(ids)
            .bind(cancels)
            .bind(
                storing
                    .iter()
                    .map(|(_, s)| s.owner.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                storing
                    .iter()
                    .map(|(_, s)| big(footprint(s)))
                    .collect::<Vec<_>>(),
            )
            .bind(big(quota.messages))
            .bind(big(quota.bytes))
            .fetch_one(tx)
            .await?;
        let mut admitted = vec![true; batch.len()];
        // One answer per message judged; a message without one is not admitted.
        for (k, (i, _)) in storing.iter().enumerate() {
            if !fits.get(k).copied().unwrap_or(false) {
                admitted[*i] = false;
                out.over_quota.push(*i);
            }
        }
        Ok(admitted)
    }

    async fn insert(
        &self,
        tx: &mut PgConnection,
        run: &[Ingest],
        admitted: &[bool],
        out: &mut IngestOutcome,
    ) -> Result<(), StoreError> {
        let rows: Vec<&Stored> = run
            .iter()
            .zip(admitted)
            .filter_map(|(i, ok)| match i {
                Ingest::Store(s) if *ok => Some(&**s),
                _ => None,
            })
            .collect();
        if rows.is_empty() {
            return Ok(());
        }
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
            .bind(rows.iter().map(|r| r.owner.as_str()).collect::<Vec<_>>())
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
            .bind(
                rows.iter()
                    .map(|r| r.held.as_ref().map(|h| h.why.as_str()))
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(|r| r.body_dropped).collect::<Vec<_>>())
            .fetch_one(&mut *tx)
            .await?;
        let (inserted, cancelled) = (inserted.unsigned_abs(), cancelled.unsigned_abs());
        out.stored += inserted;
        out.arrived_cancelled += cancelled;
        out.duplicates += (rows.len() as u64).saturating_sub(inserted + cancelled);
        for held in rows.iter().filter_map(|r| r.held.as_ref()) {
            out.held[held.bound as usize] += 1;
        }
        Ok(())
    }

    async fn cancel_in(
        &self,
        tx: &mut PgConnection,
        run: &[Ingest],
        ttl: Duration,
    ) -> Result<u64, StoreError> {
        let (owners, ids): (Vec<&str>, Vec<&str>) = run.iter().map(Ingest::key).unzip();
        let deleted: i64 = sqlx::query_scalar(safe(&self.sql.delayed.cancel_remembered))
            .bind(owners)
            .bind(ids)
            .bind(ttl.as_secs_f64())
            .fetch_one(tx)
            .await?;
        Ok(deleted.unsigned_abs())
    }

    /// Peek at delayed messages, earliest due first; never changes them.
    pub async fn list_delayed(
        &self,
        filter: &PendingFilter,
        limit: i64,
    ) -> Result<Vec<PendingDelayed>, StoreError> {
        if !filter.admits(Kind::Delayed) {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_as(safe(&self.sql.delayed.list))
            .bind(limit)
            .bind(&filter.owner)
            .bind(&filter.message_id)
            .bind(filter.failing)
            .bind(filter.held)
            .fetch_all(&self.pool)
            .await?)
    }

    /// The body of one (locked) row that `Store::lock_due` left behind.
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
