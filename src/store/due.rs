//! Locking and probing due rows: how the firing transaction begins, which window of due
//! rows a batch locks, when the next ones are due, and reading the locked rows' columns.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Row, Transaction};

use super::sql::safe;
use super::{Deletes, Kind, Store, StoreError};

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

impl Store {
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
}

/// The value of column `name` of a due row, expected at position `index`: found there
/// by comparing its name, which costs far less per row than sqlx's lookup by name (a
/// hash of the name, for every column of every row); looked up by name where a
/// statement put it elsewhere.
pub(super) fn column<'r, T>(
    row: &'r sqlx::postgres::PgRow,
    index: usize,
    name: &str,
) -> Result<T, sqlx::Error>
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
pub(super) fn tid(
    row: &sqlx::postgres::PgRow,
    index: usize,
) -> Result<Option<String>, sqlx::Error> {
    match column(row, index, "tid") {
        Err(sqlx::Error::ColumnNotFound(_) | sqlx::Error::ColumnIndexOutOfBounds { .. }) => {
            Ok(None)
        }
        read => read,
    }
}
