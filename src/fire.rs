//! Firing: one transactional batch: lock the rows due within a window → publish each
//! row's message at its due time → one fate per row → delete the confirmed rows, charge
//! the failed ones → commit. Rows locked ahead of their due time are held and sent on
//! the dot by the database's clock, never before ([`slots`]). The script is the same for
//! every kind of due row ([`kind::Kind`]: an expectation that becomes a TimeOut, a
//! stored message to deliver).
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

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff;
use crate::bus::{Budget, Bus, BusError, Fate, PublishError, Published, ToPublish};
use crate::election::Lease;
use crate::health::{Check, Health};
use crate::store::{Failure, Fired, Settlement, Store, StoreError, Table, Window, bounded};
use crate::telemetry::Chain;
use crate::wire::Message;
use crate::wire::delayed::Destinations;

pub mod kind;
pub mod slots;

pub use kind::{Delayed, Due, Expectations, Kind};
pub use slots::DbClock;

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
    /// The lease was not held before publishing (rolled back, nothing sent), or was lost
    /// while rows were held (the rest left unsent).
    pub lease_lost: bool,
    pub duration: Duration,
    /// The database clock as the lock statement read it; `None` if it locked nothing.
    pub clock: Option<DbClock>,
    /// The due time of the last row locked (rows are locked in due order).
    pub last_due: Option<DateTime<Utc>>,
    /// Up to when rows were due for the lock statement (it took them all unless full).
    pub window_end: Option<DateTime<Utc>>,
    /// How long each step took (see [`Step`]).
    pub steps: Vec<(Step, Duration)>,
    /// Lateness of each fired row (fire time minus deadline).
    pub lateness: Vec<Duration>,
    /// Why each kept row failed (`PublishError::reason`), for the metrics.
    pub failure_reasons: Vec<&'static str>,
    /// The bus failed under the batch (no channel, connection lost).
    pub bus_trouble: Option<BusError>,
}

/// A step of a batch, timed for the metrics (`timeoutd_batch_step_seconds{step}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// How late the timer fired after a held slot's due instant.
    Wake,
    /// BEGIN and the locking statement (and large contents fetched alone).
    Lock,
    /// Writing one slot's messages.
    Publish,
    /// From a slot's last write to its last confirm.
    Confirm,
    /// Delete, charge, commit.
    Settle,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::Wake => "wake",
            Step::Lock => "lock",
            Step::Publish => "publish",
            Step::Confirm => "confirm",
            Step::Settle => "settle",
        }
    }
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
    /// Where delayed messages may go, judged again before each is sent.
    destinations: Destinations,
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
            destinations: settings.delay_destinations().unwrap_or_else(|e| {
                tracing::error!(error = %e, "delayed messages will be held, not delivered");
                Destinations::nowhere()
            }),
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

    /// Run one batch over the rows due within `window`. `lease` is asked right before
    /// each slot is sent: anything but `Held` before the first rolls back (nothing has
    /// been sent yet), later it stops sending. `stop` ends sending early; what was sent
    /// is still awaited and committed.
    pub async fn run_batch<K: Kind>(
        &self,
        store: &Store,
        bus: &Bus,
        lease: impl Fn() -> Lease,
        stop: &CancellationToken,
        window: Window,
    ) -> Result<BatchOutcome, ScanError> {
        let started = Instant::now();
        let skip = self.skipped();
        let locked = self.db(self.db_bound, async {
            let (mut tx, deletes) = store.begin_scan(K::TABLE).await?;
            let rows = K::lock_due(
                store,
                &mut tx,
                self.batch_size,
                INLINE_PAYLOAD,
                &skip,
                window,
            )
            .await?;
            Ok((tx, deletes, rows, Instant::now()))
        });
        let (mut tx, deletes, mut rows, read_at) = locked.await?;
        let mut outcome = BatchOutcome {
            kind: K::NAME,
            locked: rows.len(),
            clock: read_clock(&rows, read_at),
            last_due: rows.last().map(Due::due_at),
            window_end: rows.first().map(Due::window_end),
            steps: vec![(Step::Lock, started.elapsed())],
            ..BatchOutcome::default()
        };
        let Some(clock) = outcome.clock.filter(|_| lease() == Lease::Held) else {
            outcome.lease_lost = !rows.is_empty();
            self.db(self.db_bound, async { Ok(tx.rollback().await?) })
                .await?;
            outcome.duration = started.elapsed();
            return Ok(outcome);
        };
        let budget = self.budget_from(started, stop);
        let judged = self
            .publish_on_time::<K>(
                Large {
                    store,
                    tx: &mut tx,
                    held: 0,
                },
                bus,
                &mut rows,
                clock,
                &budget,
                &lease,
                &mut outcome,
            )
            .await;
        outcome.bus_trouble = judged.trouble;
        // From here on the batch commits: the broker may have confirmed TimeOuts.
        let settling = Instant::now();
        let settle = self.db(self.db_bound * 2, async {
            let settled = store
                .settle(&mut tx, K::TABLE, deletes, &judged.fired, &judged.failures)
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
        outcome.steps.push((Step::Settle, settling.elapsed()));
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

    /// Fetch the contents `lock_due` left in the database of `rows` (those of at most
    /// `max` bytes), while the batch holds less than `LARGE_PAYLOADS` of them (at least
    /// one). Returns the rows fetched (a row still withheld was too large), and how many
    /// were left out: they stay locked but unsent (the next batch takes them first).
    async fn fetch_large<K: Kind>(
        &self,
        large: &mut Large<'_>,
        rows: Vec<K::Row>,
        max: usize,
    ) -> (Vec<K::Row>, usize, Option<StoreError>) {
        let mut fetched = Vec::with_capacity(rows.len());
        let mut left = 0;
        for mut row in rows {
            let size = row.withheld().unwrap_or(0);
            if large.held > 0 && large.held.saturating_add(size) >= LARGE_PAYLOADS {
                left += 1;
                continue;
            }
            let fetch = K::fetch_withheld(large.store, large.tx, &mut row, max);
            match self.db(self.db_bound, fetch).await {
                Ok(read) => large.held += read,
                // Leave the rest too: the database is in trouble, and the settle says so.
                Err(e) => return (fetched, left + 1, Some(e)),
            }
            fetched.push(row);
        }
        (fetched, left, None)
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

    /// Send the rows at their due times — on each wake-up every row due by then (rows
    /// already due at once) — and sort them by fate. What one wake-up sends is published
    /// while the next waits for its time. Rows not sent (stop, lease lost, budget spent)
    /// are left untouched.
    #[allow(clippy::too_many_arguments)]
    async fn publish_on_time<'a, K: Kind>(
        &'a self,
        large: Large<'a>,
        bus: &Bus,
        rows: &mut [K::Row],
        clock: DbClock,
        budget: &Budget,
        lease: &impl Fn() -> Lease,
        outcome: &mut BatchOutcome,
    ) -> Judged {
        let due: Vec<Instant> = rows.iter().map(|r| clock.local(r.due_at())).collect();
        let mut judged = Judged::default();
        let mut in_flight = FuturesUnordered::new();
        let mut reader = Reader::new(large);
        let limit = bus.size_limit().min(self.max_message_size);
        let mut first = 0;
        while let Some(&at) = due.get(first) {
            let woke = match self
                .until::<K>(
                    at,
                    &mut in_flight,
                    &mut reader,
                    rows,
                    outcome,
                    &mut judged,
                    budget,
                )
                .await
            {
                Until::Read(done) => {
                    let sent = self.read_done::<K>(done, rows, limit, &mut judged);
                    in_flight.extend(sent.map(|s| Box::pin(s.send(bus, budget))));
                    self.read_next::<K>(&mut reader, rows, limit);
                    continue;
                }
                Until::Woke => true,
                Until::Stopped => false,
            };
            if !woke || !budget.may_send() || lease() != Lease::Held {
                outcome.lease_lost |= woke && lease() != Lease::Held;
                judged.untouched += rows.len() - first;
                break;
            }
            let now = Instant::now();
            let slot = slots::due_by(&due, first, now);
            if slot.is_empty() {
                // Woken before the timer's instant: wait again.
                continue;
            }
            if at > clock.at {
                outcome
                    .steps
                    .push((Step::Wake, now.saturating_duration_since(at)));
            }
            first = slot.end;
            let sent_at = clock.db_at(now);
            rows[slot.clone()]
                .iter_mut()
                .for_each(|r| r.set_fired_at(sent_at));
            let (sending, withheld) = self.messages::<K>(rows, slot, limit, &mut judged);
            in_flight.push(Box::pin(sending.send(bus, budget)));
            // Large contents are read only now, after the slot's other rows went out, and
            // beside the slots that follow: they delay nobody but their own rows.
            if !withheld.is_empty() {
                reader.queue.push_back((withheld, now));
                self.read_next::<K>(&mut reader, rows, limit);
            }
        }
        // Contents still to read are of rows not sent: left as they are.
        judged.untouched += reader
            .queue
            .drain(..)
            .map(|(idx, _)| idx.len())
            .sum::<usize>();
        loop {
            tokio::select! {
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    self.take_slot::<K>(done, rows, outcome, &mut judged);
                }
                done = reader.reading(), if reader.is_busy() => {
                    let sent = self.read_done::<K>(done, rows, limit, &mut judged);
                    if budget.may_send() && lease() == Lease::Held {
                        in_flight.extend(sent.map(|s| Box::pin(s.send(bus, budget))));
                    } else {
                        judged.untouched += sent.map_or(0, |s| s.positions.len());
                    }
                }
                else => break,
            }
        }
        judged
    }

    /// Start reading the next slot's large contents, if the reader is free.
    fn read_next<'a, K: Kind>(
        &'a self,
        reader: &mut Reader<'a, K::Row>,
        rows: &[K::Row],
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
            let (read, left, error) = self.fetch_large::<K>(&mut large, copies, limit).await;
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
    fn read_done<K: Kind>(
        &self,
        done: ReadDone<K::Row>,
        rows: &mut [K::Row],
        limit: usize,
        judged: &mut Judged,
    ) -> Option<Sending> {
        judged.untouched += done.left;
        if let Some(e) = &done.error {
            tracing::warn!(error = %Chain(e), kind = K::NAME, "cannot read large contents: \
                those rows are left for the next batch");
        }
        let mut sending = Sending::new(done.started);
        for row in done.read {
            let Some(&i) = done.positions.iter().find(|&&i| rows[i].id() == row.id()) else {
                continue;
            };
            rows[i] = row;
            let message = match rows[i].withheld() {
                Some(size) => Err(PublishError::TooLarge { size, max: limit }),
                None => self.to_publish::<K>(&rows[i]),
            };
            match message {
                Ok(m) => sending.push(i, m),
                Err(e) => judged.fail(self.failure::<K>(&rows[i], &e)),
            }
        }
        (!sending.positions.is_empty()).then_some(sending)
    }

    /// Wait until `at`, taking the fates of slots sent earlier as they come in; return
    /// early when large contents were read.
    #[allow(clippy::too_many_arguments)]
    async fn until<'a, K: Kind>(
        &self,
        at: Instant,
        in_flight: &mut FuturesUnordered<impl Future<Output = SlotDone>>,
        reader: &mut Reader<'a, K::Row>,
        rows: &[K::Row],
        outcome: &mut BatchOutcome,
        judged: &mut Judged,
        budget: &Budget,
    ) -> Until<K::Row> {
        let sleep = tokio::time::sleep_until(at.into());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return Until::Woke,
                _ = budget.stop.cancelled() => return Until::Stopped,
                done = reader.reading(), if reader.is_busy() => return Until::Read(done),
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    self.take_slot::<K>(done, rows, outcome, judged);
                }
            }
        }
    }

    /// The fates of one slot's rows, and its publish and confirm steps.
    fn take_slot<K: Kind>(
        &self,
        (started, positions, alone, published, done): SlotDone,
        rows: &[K::Row],
        outcome: &mut BatchOutcome,
        judged: &mut Judged,
    ) {
        if let Some(sent) = published.sent {
            outcome
                .steps
                .push((Step::Publish, sent.saturating_duration_since(started)));
            outcome
                .steps
                .push((Step::Confirm, done.saturating_duration_since(sent)));
        }
        judged.trouble = judged.trouble.take().or(published.trouble);
        let sent = positions.iter().zip(alone).zip(published.fates);
        for ((i, alone), fate) in sent {
            self.judge::<K>(&rows[*i], alone, fate, judged);
        }
    }

    /// Build the message of each row of `slot`; rows that cannot be one are failed here.
    /// Returns what to send, and the positions of the rows whose content is still in the
    /// database (no larger than `limit`, as far as is known: a larger one fails as too
    /// large without being read).
    fn messages<K: Kind>(
        &self,
        rows: &[K::Row],
        slot: std::ops::Range<usize>,
        limit: usize,
        judged: &mut Judged,
    ) -> (Sending, Vec<usize>) {
        let mut sending = Sending::new(Instant::now());
        let mut withheld = Vec::new();
        for i in slot {
            let row = &rows[i];
            let message = match row.withheld() {
                Some(size) if size > limit => Err(PublishError::TooLarge { size, max: limit }),
                Some(_) => {
                    withheld.push(i);
                    continue;
                }
                None => self.to_publish::<K>(row),
            };
            match message {
                Ok(m) => sending.push(i, m),
                Err(e) => judged.fail(self.failure::<K>(row, &e)),
            }
        }
        (sending, withheld)
    }

    /// A row's message as the bus takes it: alone if its last one's fate was unknown.
    fn to_publish<K: Kind>(&self, row: &K::Row) -> Result<ToPublish, PublishError> {
        let message = self.message::<K>(row)?;
        let alone = self.memory().suspects.contains_key(&row.id());
        Ok(ToPublish { message, alone })
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
            delay: (!error.holds())
                .then(|| backoff::exponential(self.retry_min, self.retry_max, attempts)),
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
        K::message(row, self.node_id, &self.destinations)
    }
}

/// A slot sent: when it started, its rows' positions in the batch and whether each went
/// alone, their fates, when it ended.
type SlotDone = (Instant, Vec<usize>, Vec<bool>, Published, Instant);

/// Messages to publish together, and the positions of their rows in the batch.
struct Sending {
    started: Instant,
    positions: Vec<usize>,
    messages: Vec<ToPublish>,
}

impl Sending {
    fn new(started: Instant) -> Self {
        Self {
            started,
            positions: Vec::new(),
            messages: Vec::new(),
        }
    }

    fn push(&mut self, position: usize, message: ToPublish) {
        self.positions.push(position);
        self.messages.push(message);
    }

    async fn send(self, bus: &Bus, budget: &Budget) -> SlotDone {
        let published = bus.publish_batch(&self.messages, budget).await;
        let alone: Vec<bool> = self.messages.iter().map(|m| m.alone).collect();
        (
            self.started,
            self.positions,
            alone,
            published,
            Instant::now(),
        )
    }
}

/// Where a batch reads the large contents it left in the database, and how much of them
/// it holds so far.
struct Large<'a> {
    store: &'a Store,
    tx: &'a mut sqlx::PgConnection,
    held: usize,
}

/// A batch's reads of large contents: one slot's at a time, in order, beside the slots
/// being sent (the transaction's connection is otherwise idle until the settle).
struct Reader<'a, R> {
    /// The connection, when no read is under way.
    idle: Option<Large<'a>>,
    busy: Option<Reading<'a, R>>,
    /// Positions of rows waiting to be read, and when their slot was sent.
    queue: std::collections::VecDeque<(Vec<usize>, Instant)>,
}

type Reading<'a, R> = std::pin::Pin<Box<dyn Future<Output = (Large<'a>, ReadDone<R>)> + Send + 'a>>;

/// One slot's large contents read.
struct ReadDone<R> {
    read: Vec<R>,
    positions: Vec<usize>,
    left: usize,
    error: Option<StoreError>,
    started: Instant,
}

impl<'a, R> Reader<'a, R> {
    fn new(large: Large<'a>) -> Self {
        Self {
            idle: Some(large),
            busy: None,
            queue: std::collections::VecDeque::new(),
        }
    }

    fn is_busy(&self) -> bool {
        self.busy.is_some()
    }

    /// The read under way, to completion; the connection is free again after it.
    /// Cancel-safe: the read stays under way in `busy` until it is awaited to the end.
    async fn reading(&mut self) -> ReadDone<R> {
        let Some(busy) = self.busy.as_mut() else {
            return std::future::pending().await;
        };
        let (large, done) = busy.await;
        self.busy = None;
        self.idle = Some(large);
        done
    }
}

/// How waiting for a slot's instant ended.
enum Until<R> {
    Woke,
    Stopped,
    /// Large contents were read (the instant may not have come yet).
    Read(ReadDone<R>),
}

/// The database clock of a lock statement that locked rows: the latest read among them.
fn read_clock<R: Due>(rows: &[R], at: Instant) -> Option<DbClock> {
    let db = rows.iter().map(Due::fired_at).max()?;
    Some(DbClock { at, db })
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
