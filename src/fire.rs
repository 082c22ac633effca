//! Firing: one transactional batch: lock due rows → publish their messages → one fate
//! per row → delete the confirmed rows, charge the failed ones → commit. The script is
//! the same for every kind of due row ([`kind::Kind`]: an expectation that becomes a
//! TimeOut, a stored message to deliver).
//!
//! The transaction is what makes a row fire once: its rows stay locked (and invisible to
//! other scanners through SKIP LOCKED) from the moment they are read until the commit.
//! Once the broker has confirmed anything, the batch commits: nothing after the publish
//! rolls it back (a row the database refuses to delete or charge is handled alone in
//! `Store::settle`; a stale lease commits too: its locks were either still held, and the
//! rows are ours to delete, or lost with the session, and the commit fails by itself).
//! If the commit fails all the same, the confirmed rows are remembered and deleted by a
//! later statement (`Scanner::settle_leftovers`), so they do not fire again in a loop.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff;
use crate::bus::{Budget, Bus, BusError, Fate, PublishError, ToPublish};
use crate::election::Lease;
use crate::health::{Check, Health};
use crate::store::{Failure, Fired, Settlement, Store, StoreError, Table, bounded};
use crate::wire::Message;

pub mod kind;

pub use kind::{Delayed, Due, Expectations, Kind};

/// Rows remembered per kind of memory (suspects, rows to skip, rows to delete later):
/// beyond this the oldest are forgotten, which costs at most a second TimeOut.
const MEMORY: usize = 100_000;
/// Payloads up to this size come with the locked rows; larger ones are fetched one by
/// one (see `Scanner::fetch_large_payloads`).
const INLINE_PAYLOAD: usize = 64 * 1024;
/// Bytes of large payloads one batch holds at most (at least one payload, however large).
const LARGE_PAYLOADS: usize = 64 * 1024 * 1024;
/// A confirmed row that can be neither deleted nor parked is not published again by this
/// process for this long.
const STUCK_HOLD: Duration = Duration::from_secs(24 * 3600);
/// A row published alone whose fate stayed unknown this many times is charged.
const UNKNOWN_STRIKES: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The batch published, then could not settle or commit: its confirmed rows are
    /// remembered and deleted later.
    #[error("batch not committed after publishing ({fired} TimeOuts confirmed)")]
    Commit {
        fired: usize,
        #[source]
        source: StoreError,
    },
}

/// What one batch did.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// The kind of row (`Kind::NAME`).
    pub kind: &'static str,
    /// Rows locked (a full batch means: scan again at once).
    pub locked: usize,
    /// TimeOuts confirmed and their rows deleted.
    pub fired: usize,
    /// Rows kept with attempts + 1 (unroutable, nacked, unconfirmed, invalid, too large).
    pub failed: usize,
    /// Rows left as they were: not sent (budget, stop), or sent with an unknown fate.
    pub untouched: usize,
    /// Rows whose TimeOut was confirmed but that could not be deleted (parked).
    pub parked: usize,
    /// The lease was not held before publishing: rolled back, nothing sent.
    pub lease_lost: bool,
    pub duration: Duration,
    /// Lateness of each fired row (fire time minus deadline).
    pub lateness: Vec<Duration>,
    /// Why each kept row failed (`PublishError::reason`), for the metrics.
    pub failure_reasons: Vec<&'static str>,
    /// The bus failed under the batch (no channel, connection lost).
    pub bus_trouble: Option<BusError>,
}

/// Settings of the scan, and what it remembers between batches about single rows.
#[derive(Debug)]
pub struct Scanner {
    pub node_id: Uuid,
    pub batch_size: u32,
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Largest TimeOut body (`amqp.max_message_size`); larger payloads stay in Postgres.
    pub max_message_size: usize,
    /// Bound on one batch from lock to commit (`Settings::batch_budget`).
    pub budget: Duration,
    pub confirm_timeout: Duration,
    /// Client-side bound on a database step (`statement_timeout` + `connect_timeout`).
    pub db_bound: Duration,
    /// Where database steps under way are reported (a hung one withdraws the node).
    health: Arc<Health>,
    memory: Mutex<Memory>,
}

#[derive(Debug, Default)]
struct Memory {
    /// Rows whose last TimeOut went out on a channel that closed before its confirm,
    /// with how often that happened while published alone: published alone next time.
    suspects: HashMap<Uuid, u8>,
    /// Rows whose bookkeeping the database refused: not retried before the instant.
    skip: HashMap<Uuid, Instant>,
    /// Confirmed rows of batches that failed to commit, with their table: to delete.
    leftovers: Vec<(Table, Fired)>,
}

impl Scanner {
    pub fn new(node_id: Uuid, settings: &crate::config::Settings, health: Arc<Health>) -> Self {
        let max = settings.amqp.max_message_size.as_u64();
        Self {
            node_id,
            batch_size: settings.scan.batch_size,
            retry_min: settings.scan.retry_min,
            retry_max: settings.scan.retry_max,
            max_message_size: usize::try_from(max).unwrap_or(usize::MAX),
            budget: settings.batch_budget(),
            confirm_timeout: settings.amqp.confirm_timeout,
            db_bound: settings.db_bound(),
            health,
            memory: Mutex::new(Memory::default()),
        }
    }

    /// A database step: bounded on the client, and reported to the node's health while
    /// under way.
    async fn db<T>(
        &self,
        limit: Duration,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let _under_way = self.health.step(Check::Postgres);
        bounded(limit, step).await
    }

    /// Run one batch. `lease` is asked right before publishing: anything but `Held` rolls
    /// back (nothing has been sent yet). `stop` ends publishing early; what was sent is
    /// still awaited and committed.
    pub async fn run_batch<K: Kind>(
        &self,
        store: &Store,
        bus: &Bus,
        lease: impl Fn() -> Lease,
        stop: &CancellationToken,
    ) -> Result<BatchOutcome, ScanError> {
        let started = Instant::now();
        let skip = self.skipped();
        let locked = self.db(self.db_bound, async {
            let mut tx = store.begin().await?;
            let mut rows =
                K::lock_due(store, &mut tx, self.batch_size, INLINE_PAYLOAD, &skip).await?;
            let deferred = self
                .fetch_large_payloads::<K>(store, &mut tx, &mut rows)
                .await?;
            Ok((tx, rows, deferred))
        });
        let (mut tx, rows, deferred) = locked.await?;
        let mut outcome = BatchOutcome {
            kind: K::NAME,
            locked: rows.len() + deferred,
            untouched: deferred,
            ..BatchOutcome::default()
        };
        if rows.is_empty() || lease() != Lease::Held {
            outcome.lease_lost = !rows.is_empty();
            self.db(self.db_bound, async { Ok(tx.rollback().await?) })
                .await?;
            outcome.duration = started.elapsed();
            return Ok(outcome);
        }
        let budget = self.budget_from(started, stop);
        let judged = self.publish::<K>(bus, &rows, &budget).await;
        outcome.bus_trouble = judged.trouble;
        // From here on the batch commits: the broker may have confirmed TimeOuts.
        let settle = self.db(self.db_bound * 2, async {
            let settled = store
                .settle(&mut tx, K::TABLE, &judged.fired, &judged.failures)
                .await?;
            tx.commit().await?;
            Ok(settled)
        });
        let fired = fired_rows(&rows, &judged.fired);
        let settled = match settle.await {
            Ok(s) => s,
            Err(source) => {
                self.remember_later(K::TABLE, fired);
                return Err(ScanError::Commit {
                    fired: judged.fired.len(),
                    source,
                });
            }
        };
        self.report(K::TABLE, &settled, &fired);
        outcome.fired = judged.fired.len();
        outcome.failed = judged.failures.len();
        outcome.untouched += judged.untouched;
        outcome.parked = settled.parked.len();
        outcome.failure_reasons = judged.reasons;
        outcome.lateness = lateness(&rows, &judged.fired);
        outcome.duration = started.elapsed();
        Ok(outcome)
    }

    /// Delete the confirmed rows of batches that failed to commit (if their deadline is
    /// unchanged): without this they would fire again. Kept for the next try on error.
    /// Returns how many rows were settled.
    pub async fn settle_leftovers(&self, store: &Store) -> Result<usize, StoreError> {
        let leftovers = std::mem::take(&mut self.memory().leftovers);
        let mut by_table: HashMap<Table, Vec<Fired>> = HashMap::new();
        for (table, fired) in leftovers {
            by_table.entry(table).or_default().push(fired);
        }
        let mut settled = 0;
        let mut failed = None;
        for (table, fired) in by_table {
            if failed.is_some() {
                self.remember_later(table, fired);
                continue;
            }
            match self
                .db(self.db_bound * 2, store.delete_fired(table, &fired))
                .await
            {
                Ok(s) => {
                    self.report(table, &s, &fired);
                    settled += fired.len() - s.later.len();
                }
                Err(e) => {
                    self.remember_later(table, fired);
                    failed = Some(e);
                }
            }
        }
        failed.map_or(Ok(settled), Err)
    }

    /// Act on what `settle` could not do the fast way (`fired`: the confirmed rows it
    /// was given): log parked rows, keep busy ones for a later delete, hold back rows
    /// whose bookkeeping could not be written.
    fn report(&self, table: Table, settled: &Settlement, fired: &[Fired]) {
        for (id, why) in &settled.parked {
            tracing::error!(%id, "{why}; parked (it will not fire again; delete it by hand)");
        }
        let later = fired.iter().filter(|f| settled.later.contains(&f.id));
        self.remember_later(table, later.copied().collect());
        let mut memory = self.memory();
        let now = Instant::now();
        for (id, why) in &settled.stuck {
            tracing::error!(%id, "delivered, but the row can be neither deleted nor parked \
                ({why}); this node will not publish it again");
            memory.skip.insert(*id, now + STUCK_HOLD);
        }
        for (id, why) in &settled.uncharged {
            tracing::error!(%id, "cannot record the failure of this row: {why}");
            memory.skip.insert(*id, now + self.retry_min);
        }
        if memory.skip.len() > MEMORY {
            memory.skip.clear();
        }
    }

    /// Fetch the payloads `lock_due` left behind (larger than `INLINE_PAYLOAD`), one by
    /// one, while the batch holds less than `LARGE_PAYLOADS` of them; rows beyond that
    /// stay locked but unpublished (the next batch takes them first). Returns how many
    /// rows were left out. Payloads over `amqp.max_message_size` are not fetched at all:
    /// those rows fail as too large.
    async fn fetch_large_payloads<K: Kind>(
        &self,
        store: &Store,
        tx: &mut sqlx::PgConnection,
        rows: &mut Vec<K::Row>,
    ) -> Result<usize, StoreError> {
        let mut held = 0;
        let mut deferred = Vec::new();
        for (i, row) in rows.iter_mut().enumerate() {
            let Some(size) = row.withheld() else {
                continue;
            };
            if size > self.max_message_size {
                continue;
            }
            if held > 0 && held + size > LARGE_PAYLOADS {
                deferred.push(i);
                continue;
            }
            K::fetch_withheld(store, tx, row).await?;
            held += size;
        }
        for i in deferred.iter().rev() {
            rows.remove(*i);
        }
        Ok(deferred.len())
    }

    fn budget_from(&self, started: Instant, stop: &CancellationToken) -> Budget {
        let confirm_until = started + self.budget;
        Budget {
            send_until: confirm_until
                .checked_sub(self.confirm_timeout)
                .unwrap_or(started),
            confirm_until,
            stop: stop.clone(),
        }
    }

    /// Build every row's message, publish them, and sort the rows by fate.
    async fn publish<K: Kind>(&self, bus: &Bus, rows: &[K::Row], budget: &Budget) -> Judged {
        let mut judged = Judged::default();
        let mut sendable = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        {
            let memory = self.memory();
            for row in rows {
                match self.message::<K>(row) {
                    Ok(message) => {
                        let alone = memory.suspects.contains_key(&row.id());
                        sendable.push(row);
                        messages.push(ToPublish { message, alone });
                    }
                    Err(e) => judged.fail(self.failure::<K>(row, &e)),
                }
            }
        }
        let published = bus.publish_batch(&messages, budget).await;
        judged.trouble = published.trouble;
        for ((row, m), fate) in sendable.iter().zip(&messages).zip(published.fates) {
            self.judge::<K>(*row, m.alone, fate, &mut judged);
        }
        judged
    }

    fn judge<K: Kind>(&self, row: &K::Row, alone: bool, fate: Fate, judged: &mut Judged) {
        let fate = self.note_suspect(row.id(), alone, fate);
        match fate {
            Fate::Confirmed => judged.fired.push(row.id()),
            Fate::Failed(e) => judged.fail(self.failure::<K>(row, &e)),
            Fate::Unsent => judged.untouched += 1,
            Fate::Unknown(why) => {
                tracing::warn!(id = %row.id(), kind = K::NAME, "message may or may not have \
                    been delivered (channel closed before its confirm: {why}); it will be \
                    sent again, alone");
                judged.untouched += 1;
            }
        }
    }

    /// Keep track of rows whose fate was unknown; one that stays unknown while published
    /// alone is the cause of its channel's closing: it fails.
    fn note_suspect(&self, id: Uuid, alone: bool, fate: Fate) -> Fate {
        let mut memory = self.memory();
        let Fate::Unknown(why) = fate else {
            memory.suspects.remove(&id);
            return fate;
        };
        let strikes = memory.suspects.entry(id).or_default();
        *strikes += u8::from(alone);
        if *strikes < UNKNOWN_STRIKES {
            if memory.suspects.len() > MEMORY {
                memory.suspects.clear();
            }
            return Fate::Unknown(why);
        }
        memory.suspects.remove(&id);
        Fate::Failed(PublishError::Channel(why))
    }

    fn failure<K: Kind>(&self, row: &K::Row, error: &PublishError) -> (Failure, &'static str) {
        let attempts = u32::try_from(row.attempts()).unwrap_or(0);
        let (exchange, routing_key) = row.destination();
        tracing::warn!(
            id = %row.id(), kind = K::NAME, exchange, routing_key,
            attempts = attempts.saturating_add(1), reason = error.reason(),
            "{} not published: {error}", K::MESSAGE
        );
        let failure = Failure {
            id: row.id(),
            error: error.to_string(),
            delay: backoff::exponential(self.retry_min, self.retry_max, attempts),
        };
        (failure, error.reason())
    }

    /// Confirmed rows not yet deleted: `settle_leftovers` deletes them.
    fn remember_later(&self, table: Table, fired: Vec<Fired>) {
        let mut memory = self.memory();
        memory
            .leftovers
            .extend(fired.into_iter().map(|f| (table, f)));
        memory.leftovers.truncate(MEMORY);
    }

    fn skipped(&self) -> Vec<Uuid> {
        let mut memory = self.memory();
        let now = Instant::now();
        memory.skip.retain(|_, until| *until > now);
        memory.skip.keys().copied().collect()
    }

    fn memory(&self) -> MutexGuard<'_, Memory> {
        // Bookkeeping maps: a panicking holder leaves nothing half-done that matters.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The message of one row; content left in the database here is too large.
    fn message<K: Kind>(&self, row: &K::Row) -> Result<Message, PublishError> {
        if let Some(size) = row.withheld() {
            return Err(PublishError::TooLarge {
                size,
                max: self.max_message_size,
            });
        }
        K::message(row, self.node_id).map_err(|e| PublishError::Invalid(e.0))
    }
}

/// Rows sorted by fate.
#[derive(Default)]
struct Judged {
    fired: Vec<Uuid>,
    failures: Vec<Failure>,
    reasons: Vec<&'static str>,
    untouched: usize,
    trouble: Option<BusError>,
}

impl Judged {
    fn fail(&mut self, (failure, reason): (Failure, &'static str)) {
        self.failures.push(failure);
        self.reasons.push(reason);
    }
}

fn fired_rows<R: Due>(rows: &[R], fired: &[Uuid]) -> Vec<Fired> {
    let fired: HashSet<&Uuid> = fired.iter().collect();
    rows.iter()
        .filter(|r| fired.contains(&r.id()))
        .map(|r| Fired {
            id: r.id(),
            deadline: r.deadline(),
        })
        .collect()
}

fn lateness<R: Due>(rows: &[R], fired: &[Uuid]) -> Vec<Duration> {
    let fired: HashSet<&Uuid> = fired.iter().collect();
    rows.iter()
        .filter(|r| fired.contains(&r.id()))
        .map(|r| (r.fired_at() - r.deadline()).to_std().unwrap_or_default())
        .collect()
}
