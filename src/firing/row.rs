//! What a batch needs of one kind of due row: how its large contents are read, and what
//! each row becomes on the wire. Everything else (locking order, publishing, one fate per
//! row, delete/charge/park, commit, leftovers) is the same for every kind and lives in
//! `batch.rs` and the store, once.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::Limits;
use crate::bus::PublishError;
use crate::kind::Kind;
use crate::store::{DelayedRow, DueRow, Store, StoreError};
use crate::wire::{self, Message};

/// A due row of one kind, as its batch locked it.
pub(crate) trait Row:
    for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Clone + Send + Sync + Unpin + 'static
{
    const KIND: Kind;

    /// Read what `Store::lock_due` left in the database into the row, if it is at most `max`
    /// bytes (else [`Row::withheld`] then says how large it is). Returns the bytes read.
    fn fetch_withheld(
        &mut self,
        store: &Store,
        tx: &mut PgConnection,
        max: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// The message the row becomes, sent by `node`, only where the kind's destination
    /// rule in `limits` allows.
    fn message(&self, node: Uuid, limits: &Limits) -> Result<Message, PublishError>;

    /// Size of the content left in the database, if it was left there (0: not known
    /// until read).
    fn withheld(&self) -> Option<usize>;

    /// The deadline it fired for (a row moved since then is not deleted for it).
    fn deadline(&self) -> DateTime<Utc>;

    /// The columns every kind's lock statement returns alike.
    fn common(&self) -> Common<'_>;

    /// Record when it is sent (its message says so): never before its due time.
    fn set_fired_at(&mut self, at: DateTime<Utc>);
}

/// The columns every due row has, whatever its kind.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Common<'a> {
    pub(crate) id: Uuid,
    /// When it may be sent (the deadline, or a later retry time), by the database clock.
    pub(crate) due_at: DateTime<Utc>,
    /// Database clock when the row was locked; once sent, when it was sent.
    pub(crate) fired_at: DateTime<Utc>,
    /// The end of the window of due times the lock statement covered.
    pub(crate) window_end: DateTime<Utc>,
    pub(crate) attempts: i32,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    /// Where the locked row lies: how the batch deletes it (`None`: by its id).
    pub(crate) tid: Option<&'a str>,
}

/// The columns both kinds' lock statements return by the same names.
macro_rules! common_columns {
    () => {
        fn common(&self) -> Common<'_> {
            Common {
                id: self.id,
                due_at: self.due_at,
                fired_at: self.fired_at,
                window_end: self.window_end,
                attempts: self.attempts,
                exchange: &self.exchange,
                routing_key: &self.routing_key,
                tid: self.tid.as_deref(),
            }
        }

        fn set_fired_at(&mut self, at: DateTime<Utc>) {
            self.fired_at = at;
        }
    };
}

/// The process manager's expectations, fired as TimeOuts.
impl Row for DueRow {
    const KIND: Kind = Kind::Expectation;

    async fn fetch_withheld(
        &mut self,
        store: &Store,
        tx: &mut PgConnection,
        max: usize,
    ) -> Result<usize, StoreError> {
        store.payload(tx, self, max).await
    }

    /// Judged here, not only by `expect()`: rows written to the table directly.
    fn message(&self, node: Uuid, limits: &Limits) -> Result<Message, PublishError> {
        limits
            .timeouts
            .check(&self.exchange)
            .map_err(PublishError::NotAllowed)?;
        wire::timeout::timeout(self, node)
            .map(|m| limits.signed(m))
            .map_err(|e| PublishError::Invalid(e.0))
    }

    fn withheld(&self) -> Option<usize> {
        self.payload_withheld()
    }

    fn deadline(&self) -> DateTime<Utc> {
        self.timeout_at
    }

    common_columns!();
}

/// Messages published with a delay, delivered as they were.
impl Row for DelayedRow {
    const KIND: Kind = Kind::Delayed;

    async fn fetch_withheld(
        &mut self,
        store: &Store,
        tx: &mut PgConnection,
        max: usize,
    ) -> Result<usize, StoreError> {
        // Its size is exact (`octet_length` of the bytea): a larger one is never read.
        if self.body_withheld().is_some_and(|size| size > max) {
            return Ok(0);
        }
        self.body = store.delayed_body(tx, self.id).await?;
        Ok(self.body.as_ref().map_or(0, Vec::len))
    }

    /// Judged again here, not only at ingest: rows stored by an earlier version, under
    /// an earlier configuration, or released by an operator.
    fn message(&self, node: Uuid, limits: &Limits) -> Result<Message, PublishError> {
        limits
            .delayed
            .check(&self.exchange)
            .map_err(PublishError::NotAllowed)?;
        wire::delayed::delivery(self, node)
            .map(|m| limits.signed(m))
            .map_err(|e| PublishError::Invalid(e.0))
    }

    fn withheld(&self) -> Option<usize> {
        self.body_withheld()
    }

    fn deadline(&self) -> DateTime<Utc> {
        self.deliver_at
    }

    common_columns!();
}
