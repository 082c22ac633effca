//! What the firing transaction needs to know about one kind of due row. Everything else
//! (locking, publishing, sorting fates, delete/charge/park, commit, leftovers) is the
//! same for every kind and lives in `fire.rs` and `store.rs`, once.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::bus::PublishError;
use crate::store::{DELAYED, DelayedRow, DueRow, EXPECTATIONS, Store, StoreError, Table, Window};
use crate::wire::delayed::Destinations;
use crate::wire::{self, Message};

/// A kind of due row: where it is stored, how it is read, what it becomes on the wire.
pub trait Kind: Send + Sync {
    type Row: Due;
    /// What logs, metrics and `pending` call it.
    const NAME: &'static str;
    /// What its message is called in logs ("TimeOut").
    const MESSAGE: &'static str;
    /// Where its rows live (the writes of [`Store::settle`] take it).
    const TABLE: Table;

    /// Lock up to `limit` rows due within `window`, oldest first, skipping rows locked
    /// elsewhere and `skip`; contents over `inline` bytes are left in the database
    /// ([`Due::withheld`]).
    fn lock_due(
        store: &Store,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
        window: Window,
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Read what `lock_due` left in the database into `row`, if it is at most `max`
    /// bytes (else [`Due::withheld`] then says how large it is). Returns the bytes read.
    fn fetch_withheld(
        store: &Store,
        tx: &mut PgConnection,
        row: &mut Self::Row,
        max: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// The message the row becomes, sent by `node`; a delayed message only where
    /// `destinations` allow.
    fn message(
        row: &Self::Row,
        node: Uuid,
        destinations: &Destinations,
    ) -> Result<Message, PublishError>;
}

/// What the transaction reads from any due row.
pub trait Due: Clone + Send + Sync + 'static {
    fn id(&self) -> Uuid;
    /// The deadline it fired for (a row moved since then is not deleted for it).
    fn deadline(&self) -> DateTime<Utc>;
    /// When it may be sent (the deadline, or a later retry time), by the database clock.
    fn due_at(&self) -> DateTime<Utc>;
    /// Database clock when the row was locked; once sent, when it was sent (never before
    /// `due_at`).
    fn fired_at(&self) -> DateTime<Utc>;
    /// Record when it is sent (its message says so).
    fn set_fired_at(&mut self, at: DateTime<Utc>);
    /// The end of the window of due times the lock statement covered.
    fn window_end(&self) -> DateTime<Utc>;
    fn attempts(&self) -> i32;
    /// Size of the content left in the database, if it was left there (0: not known
    /// until read).
    fn withheld(&self) -> Option<usize>;
    /// Exchange and routing key, for logs.
    fn destination(&self) -> (&str, &str);
}

/// The process manager's expectations, fired as TimeOuts.
pub struct Expectations;

impl Kind for Expectations {
    type Row = DueRow;
    const NAME: &'static str = EXPECTATIONS.kind();
    const MESSAGE: &'static str = "TimeOut";
    const TABLE: Table = EXPECTATIONS;

    async fn lock_due(
        store: &Store,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
        window: Window,
    ) -> Result<Vec<DueRow>, StoreError> {
        store.lock_due(tx, limit, inline, skip, window).await
    }

    async fn fetch_withheld(
        store: &Store,
        tx: &mut PgConnection,
        row: &mut DueRow,
        max: usize,
    ) -> Result<usize, StoreError> {
        store.payload(tx, row, max).await
    }

    fn message(row: &DueRow, node: Uuid, _: &Destinations) -> Result<Message, PublishError> {
        wire::timeout::timeout(row, node).map_err(|e| PublishError::Invalid(e.0))
    }
}

impl Due for DueRow {
    fn id(&self) -> Uuid {
        self.id
    }

    fn deadline(&self) -> DateTime<Utc> {
        self.timeout_at
    }

    fn due_at(&self) -> DateTime<Utc> {
        self.due_at
    }

    fn fired_at(&self) -> DateTime<Utc> {
        self.fired_at
    }

    fn set_fired_at(&mut self, at: DateTime<Utc>) {
        self.fired_at = at;
    }

    fn window_end(&self) -> DateTime<Utc> {
        self.window_end
    }

    fn attempts(&self) -> i32 {
        self.attempts
    }

    fn withheld(&self) -> Option<usize> {
        self.payload_withheld()
    }

    fn destination(&self) -> (&str, &str) {
        (&self.exchange, &self.routing_key)
    }
}

/// Messages published with a delay, delivered as they were.
pub struct Delayed;

impl Kind for Delayed {
    type Row = DelayedRow;
    const NAME: &'static str = DELAYED.kind();
    const MESSAGE: &'static str = "delayed message";
    const TABLE: Table = DELAYED;

    async fn lock_due(
        store: &Store,
        tx: &mut PgConnection,
        limit: u32,
        inline: usize,
        skip: &[Uuid],
        window: Window,
    ) -> Result<Vec<DelayedRow>, StoreError> {
        store
            .lock_due_delayed(tx, limit, inline, skip, window)
            .await
    }

    async fn fetch_withheld(
        store: &Store,
        tx: &mut PgConnection,
        row: &mut DelayedRow,
        max: usize,
    ) -> Result<usize, StoreError> {
        // Its size is exact (`octet_length` of the bytea): a larger one is never read.
        if row.body_withheld().is_some_and(|size| size > max) {
            return Ok(0);
        }
        row.body = store.delayed_body(tx, row.id).await?;
        Ok(row.body.as_ref().map_or(0, Vec::len))
    }

    /// Judged again here, not only at ingest: rows stored by an earlier version, under
    /// an earlier configuration, or released by an operator.
    fn message(
        row: &DelayedRow,
        node: Uuid,
        destinations: &Destinations,
    ) -> Result<Message, PublishError> {
        destinations
            .check(&row.exchange)
            .map_err(PublishError::NotAllowed)?;
        wire::delayed::delivery(row, node).map_err(|e| PublishError::Invalid(e.0))
    }
}

impl Due for DelayedRow {
    fn id(&self) -> Uuid {
        self.id
    }

    fn deadline(&self) -> DateTime<Utc> {
        self.deliver_at
    }

    fn due_at(&self) -> DateTime<Utc> {
        self.due_at
    }

    fn fired_at(&self) -> DateTime<Utc> {
        self.fired_at
    }

    fn set_fired_at(&mut self, at: DateTime<Utc>) {
        self.fired_at = at;
    }

    fn window_end(&self) -> DateTime<Utc> {
        self.window_end
    }

    fn attempts(&self) -> i32 {
        self.attempts
    }

    fn withheld(&self) -> Option<usize> {
        self.body_withheld()
    }

    fn destination(&self) -> (&str, &str) {
        (&self.exchange, &self.routing_key)
    }
}
