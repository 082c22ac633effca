//! The pending counts of a table, for `timeoutd pending` and the gauges: counted here,
//! or shared with the group through the table `pending_counts` so that one node counts
//! per refresh.

use std::time::Duration;

use serde::Serialize;
use sqlx::Row;

use super::sql::safe;
use super::{Kind, Store, StoreError};

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

impl Store {
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
}
