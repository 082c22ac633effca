//! Contents too large to come with the locked rows (see `batch.rs`): read one slot's at a
//! time, in order, on the batch's own connection, beside the slots being sent, and never
//! more than [`LARGE_PAYLOADS`] bytes of them held by one batch.

use std::time::Instant;

use super::Scan;
use super::batch::{Judged, Sending};
use super::row::Row;
use crate::bus::PublishError;
use crate::store::{Store, StoreError};
use crate::telemetry::Chain;

/// Bytes of large payloads one batch holds at most (at least one payload, however large).
const LARGE_PAYLOADS: usize = 64 * 1024 * 1024;

/// Where a batch reads the large contents it left in the database, and how much of them
/// it holds so far.
pub(super) struct Large<'a> {
    pub(super) store: &'a Store,
    pub(super) tx: &'a mut sqlx::PgConnection,
    pub(super) held: usize,
}

/// A batch's reads of large contents: one slot's at a time, in order, beside the slots
/// being sent (the transaction's connection is otherwise idle until the settle).
pub(super) struct Reader<'a, R> {
    /// The connection, when no read is under way.
    idle: Option<Large<'a>>,
    busy: Option<Reading<'a, R>>,
    /// Positions of rows waiting to be read, and when their slot was sent.
    pub(super) queue: std::collections::VecDeque<(Vec<usize>, Instant)>,
}

type Reading<'a, R> = std::pin::Pin<Box<dyn Future<Output = (Large<'a>, ReadDone<R>)> + Send + 'a>>;

/// One slot's large contents read.
pub(super) struct ReadDone<R> {
    pub(super) read: Vec<R>,
    pub(super) positions: Vec<usize>,
    pub(super) left: usize,
    pub(super) error: Option<StoreError>,
    pub(super) started: Instant,
}

impl<'a, R> Reader<'a, R> {
    pub(super) fn new(large: Large<'a>) -> Self {
        Self {
            idle: Some(large),
            busy: None,
            queue: std::collections::VecDeque::new(),
        }
    }

    pub(super) fn is_busy(&self) -> bool {
        self.busy.is_some()
    }

    /// The read under way, to completion; the connection is free again after it.
    /// Cancel-safe: the read stays under way in `busy` until it is awaited to the end.
    pub(super) async fn reading(&mut self) -> ReadDone<R> {
        let Some(busy) = self.busy.as_mut() else {
            return std::future::pending().await;
        };
        let (large, done) = busy.await;
        self.busy = None;
        self.idle = Some(large);
        done
    }
}

impl Scan {
    /// Fetch the contents `lock_due` left in the database of `rows` (those of at most
    /// `max` bytes), while the batch holds less than `LARGE_PAYLOADS` of them (at least
    /// one). Returns the rows fetched (a row still withheld was too large), and how many
    /// were left out: they stay locked but unsent (the next batch takes them first).
    async fn fetch_large<R: Row>(
        &self,
        large: &mut Large<'_>,
        rows: Vec<R>,
        max: usize,
    ) -> (Vec<R>, usize, Option<StoreError>) {
        let mut fetched = Vec::with_capacity(rows.len());
        let mut left = 0;
        for mut row in rows {
            let size = row.withheld().unwrap_or(0);
            if large.held > 0 && large.held.saturating_add(size) >= LARGE_PAYLOADS {
                left += 1;
                continue;
            }
            let fetch = row.fetch_withheld(large.store, large.tx, max);
            match self.db(self.limits.db_bound, fetch).await {
                Ok(read) => large.held += read,
                // Leave the rest too: the database is in trouble, and the settle says so.
                Err(e) => return (fetched, left + 1, Some(e)),
            }
            fetched.push(row);
        }
        (fetched, left, None)
    }

    /// Start reading the next slot's large contents, if the reader is free.
    pub(super) fn read_next<'a, R: Row>(
        &'a self,
        reader: &mut Reader<'a, R>,
        rows: &[R],
        limit: usize,
    ) {
        let Some(large) = reader.idle.take() else {
            return;
        };
        let Some((positions, started)) = reader.queue.pop_front() else {
            reader.idle = Some(large);
            return;
        };
        let copies = positions.iter().map(|&i| rows[i].clone()).collect();
        reader.busy = Some(Box::pin(async move {
            let mut large = large;
            let (read, left, error) = self.fetch_large::<R>(&mut large, copies, limit).await;
            let done = ReadDone {
                read,
                positions,
                left,
                error,
                started,
            };
            (large, done)
        }));
    }

    /// Put the rows read back into the batch; what they become, to send.
    pub(super) fn read_done<R: Row>(
        &self,
        done: ReadDone<R>,
        rows: &mut [R],
        limit: usize,
        judged: &mut Judged,
    ) -> Option<Sending> {
        judged.untouched += done.left;
        if let Some(e) = &done.error {
            tracing::warn!(error = %Chain(e), kind = R::KIND.name(), "cannot read large contents: \
                those rows are left for the next batch");
        }
        let mut sending = Sending::new(done.started);
        for row in done.read {
            let Some(&i) = done
                .positions
                .iter()
                .find(|&&i| rows[i].locked().id == row.locked().id)
            else {
                continue;
            };
            rows[i] = row;
            let message = match rows[i].withheld() {
                Some(size) => Err(PublishError::TooLarge { size, max: limit }),
                None => self.to_publish::<R>(&rows[i]),
            };
            match message {
                Ok(m) => sending.push(i, m),
                Err(e) => judged.fail(self.failure::<R>(&rows[i], &e)),
            }
        }
        (!sending.positions.is_empty()).then_some(sending)
    }
}
