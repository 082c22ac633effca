//! Contents too large to come with the locked rows (see `batch.rs`): read one slot's at a
//! time, in order, on the batch's own connection, beside the slots being sent, and never
//! more than [`LARGE_PAYLOADS`] bytes of them held by one batch.

use std::time::Instant;

use super::Firing;
use super::row::Row;
use crate::store::{Store, StoreError};

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

impl<'a, R: Row> Reader<'a, R> {
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

    /// Forget the rows still waiting to be read (their slots were not sent): how many.
    pub(super) fn drop_queue(&mut self) -> usize {
        self.queue
            .drain(..)
            .map(|(positions, _)| positions.len())
            .sum()
    }

    /// Start reading the next slot's large contents, if the connection is free.
    pub(super) fn read_next(&mut self, firing: &'a Firing, rows: &[R], limit: usize) {
        let Some(large) = self.idle.take() else {
            return;
        };
        let Some((positions, started)) = self.queue.pop_front() else {
            self.idle = Some(large);
            return;
        };
        let copies = positions.iter().map(|&i| rows[i].clone()).collect();
        self.busy = Some(Box::pin(async move {
            let mut large = large;
            let (read, left, error) = fetch(firing, &mut large, copies, limit).await;
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
}

/// Fetch the contents `lock_due` left in the database of `rows` (those of at most `max`
/// bytes), while the batch holds less than [`LARGE_PAYLOADS`] of them (at least one).
/// Returns the rows fetched (a row still withheld was too large), and how many were left
/// out: they stay locked but unsent (the next batch takes them first).
async fn fetch<R: Row>(
    firing: &Firing,
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
        let read = row.fetch_withheld(large.store, large.tx, max);
        match firing.db(firing.limits.db_bound, read).await {
            Ok(read) => large.held += read,
            // Leave the rest too: the database is in trouble, and the settle says so.
            Err(e) => return (fetched, left + 1, Some(e)),
        }
        fetched.push(row);
    }
    (fetched, left, None)
}
