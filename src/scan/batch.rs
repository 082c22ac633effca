//! One batch: one transaction that locks the rows of one kind due within a window →
//! publishes each row's message at its due time → one fate per row → deletes the
//! confirmed rows, charges the failed ones → commits. Rows locked ahead of their due time
//! are held and sent on the dot by the database's clock, never before ([`clock`]). The
//! script is the same for every kind of due row ([`Row`]).
//!
//! The transaction is what makes a row fire once: its rows stay locked (and invisible to
//! other batches through SKIP LOCKED) from the moment they are read until the commit.
//! Once the broker has confirmed anything, the batch commits: nothing after the publish
//! rolls it back (a row the database refuses to delete or charge is handled alone in
//! `Store::settle`; a stale lease commits too: its locks were either still held, and the
//! rows are ours to delete, or lost with the session, and the commit fails by itself).
//! If the commit fails all the same, the confirmed rows are remembered ([`Memory`]) and
//! deleted by a later statement, so they do not fire again in a loop.
//!
//! [`clock`]: super::clock
//! [`Memory`]: super::memory::Memory

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Scan;
use super::clock::{self, DbClock};
use super::large::{Large, ReadDone, Reader};
use super::row::Row;
use crate::backoff;
use crate::bus::{Budget, Bus, BusError, Fate, PublishError, Published, ToPublish};
use crate::election::Lease;
use crate::store::{Failure, Fired, StoreError, Window};
use crate::wire::Message;

/// Payloads up to this size come with the locked rows; larger ones are fetched one by
/// one (see `large.rs`).
const INLINE_PAYLOAD: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
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
pub(crate) struct BatchOutcome {
    /// Rows locked (a full batch means: scan again at once).
    pub(crate) locked: usize,
    /// TimeOuts confirmed and their rows deleted.
    pub(crate) fired: usize,
    /// Rows kept with attempts + 1 (unroutable, nacked, unconfirmed, invalid, too large).
    pub(crate) failed: usize,
    /// Rows left as they were: not sent (budget, stop), or sent with an unknown fate.
    pub(crate) untouched: usize,
    /// Rows whose TimeOut was confirmed but that could not be deleted (parked).
    pub(crate) parked: usize,
    /// The lease was not held before publishing (rolled back, nothing sent), or was lost
    /// while rows were held (the rest left unsent).
    pub(crate) lease_lost: bool,
    pub(crate) duration: Duration,
    /// The database clock as the lock statement read it; `None` if it locked nothing.
    pub(crate) clock: Option<DbClock>,
    /// The due time of the last row locked (rows are locked in due order).
    pub(crate) last_due: Option<DateTime<Utc>>,
    /// Up to when rows were due for the lock statement (it took them all unless full).
    pub(crate) window_end: Option<DateTime<Utc>>,
    /// How long each step took (see [`Step`]).
    pub(crate) steps: Vec<(Step, Duration)>,
    /// Lateness of each fired row (fire time minus deadline).
    pub(crate) lateness: Vec<Duration>,
    /// Why each kept row failed (`PublishError::reason`), for the metrics.
    pub(crate) failure_reasons: Vec<&'static str>,
    /// The bus failed under the batch (no channel, connection lost).
    pub(crate) bus_trouble: Option<BusError>,
}

/// A step of a batch, timed for the metrics (`timeoutd_batch_step_seconds{step}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
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
    pub(crate) fn name(self) -> &'static str {
        match self {
            Step::Wake => "wake",
            Step::Lock => "lock",
            Step::Publish => "publish",
            Step::Confirm => "confirm",
            Step::Settle => "settle",
        }
    }
}

impl Scan {
    /// Run one batch over the rows due within `window`. `lease` is asked right before
    /// each slot is sent: anything but `Held` before the first rolls back (nothing has
    /// been sent yet), later it stops sending. `stop` ends sending early; what was sent
    /// is still awaited and committed.
    pub(crate) async fn run_batch<R: Row>(
        &self,
        bus: &Bus,
        window: Window,
    ) -> Result<BatchOutcome, BatchError> {
        let (store, stop, lease) = (&self.store, &self.stop, || self.lease());
        let started = Instant::now();
        let skip = self.memory.skipped();
        let locked = self.db(self.limits.db_bound, async {
            let (mut tx, deletes) = store.begin_batch(R::KIND).await?;
            let rows = R::lock_due(
                store,
                &mut tx,
                self.limits.batch_size,
                INLINE_PAYLOAD,
                &skip,
                window,
            )
            .await?;
            Ok((tx, deletes, rows, Instant::now()))
        });
        let (mut tx, deletes, mut rows, read_at) = locked.await?;
        let mut outcome = BatchOutcome {
            locked: rows.len(),
            clock: clock::read_clock(&rows, read_at),
            last_due: rows.last().map(|r| r.locked().due_at),
            window_end: rows.first().map(|r| r.locked().window_end),
            steps: vec![(Step::Lock, started.elapsed())],
            ..BatchOutcome::default()
        };
        let Some(clock) = outcome.clock.filter(|_| lease() == Lease::Held) else {
            outcome.lease_lost = !rows.is_empty();
            self.db(self.limits.db_bound, async { Ok(tx.rollback().await?) })
                .await?;
            outcome.duration = started.elapsed();
            return Ok(outcome);
        };
        let budget = self.budget_from(started, stop);
        let judged = self
            .publish_on_time::<R>(
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
        let settle = self.db(self.limits.db_bound * 2, async {
            let settled = store
                .settle(&mut tx, R::KIND, deletes, &judged.fired, &judged.failures)
                .await?;
            tx.commit().await?;
            Ok(settled)
        });
        let fired = fired_rows(&rows, &judged.fired);
        let settled = match settle.await {
            Ok(s) => s,
            Err(source) => {
                self.memory.remember_later(R::KIND, fired);
                return Err(BatchError::Commit {
                    fired: judged.fired.len(),
                    source,
                });
            }
        };
        outcome.steps.push((Step::Settle, settling.elapsed()));
        self.memory
            .settled(R::KIND, &settled, &fired, self.limits.retry_min);
        outcome.fired = judged.fired.len();
        outcome.failed = judged.failures.len();
        outcome.untouched += judged.untouched;
        outcome.parked = settled.parked.len();
        outcome.failure_reasons = judged.reasons;
        outcome.lateness = lateness(&rows, &judged.fired);
        outcome.duration = started.elapsed();
        Ok(outcome)
    }

    fn budget_from(&self, started: Instant, stop: &CancellationToken) -> Budget {
        let confirm_until = started + self.limits.budget;
        Budget {
            send_until: confirm_until
                .checked_sub(self.limits.confirm_timeout)
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
    async fn publish_on_time<'a, R: Row>(
        &'a self,
        large: Large<'a>,
        bus: &Bus,
        rows: &mut [R],
        clock: DbClock,
        budget: &Budget,
        lease: &impl Fn() -> Lease,
        outcome: &mut BatchOutcome,
    ) -> Judged {
        let due: Vec<Instant> = rows
            .iter()
            .map(|r| clock.local(r.locked().due_at))
            .collect();
        let mut judged = Judged::default();
        let mut in_flight = FuturesUnordered::new();
        let mut reader = Reader::new(large);
        let limit = bus.size_limit().min(self.limits.max_message_size);
        let mut first = 0;
        while let Some(&at) = due.get(first) {
            let woke = match self
                .until::<R>(
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
                    let sent = self.read_done::<R>(done, rows, limit, &mut judged);
                    in_flight.extend(sent.map(|s| Box::pin(s.send(bus, budget))));
                    self.read_next::<R>(&mut reader, rows, limit);
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
            let slot = clock::due_by(&due, first, now);
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
            let (sending, withheld) = self.messages::<R>(rows, slot, limit, &mut judged);
            in_flight.push(Box::pin(sending.send(bus, budget)));
            // Large contents are read only now, after the slot's other rows went out, and
            // beside the slots that follow: they delay nobody but their own rows.
            if !withheld.is_empty() {
                reader.queue.push_back((withheld, now));
                self.read_next::<R>(&mut reader, rows, limit);
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
                    self.take_slot::<R>(done, rows, outcome, &mut judged);
                }
                done = reader.reading(), if reader.is_busy() => {
                    let sent = self.read_done::<R>(done, rows, limit, &mut judged);
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

    /// Wait until `at`, taking the fates of slots sent earlier as they come in; return
    /// early when large contents were read.
    #[allow(clippy::too_many_arguments)]
    async fn until<'a, R: Row>(
        &self,
        at: Instant,
        in_flight: &mut FuturesUnordered<impl Future<Output = SlotDone>>,
        reader: &mut Reader<'a, R>,
        rows: &[R],
        outcome: &mut BatchOutcome,
        judged: &mut Judged,
        budget: &Budget,
    ) -> Until<R> {
        let sleep = tokio::time::sleep_until(at.into());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return Until::Woke,
                _ = budget.stop.cancelled() => return Until::Stopped,
                done = reader.reading(), if reader.is_busy() => return Until::Read(done),
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    self.take_slot::<R>(done, rows, outcome, judged);
                }
            }
        }
    }

    /// The fates of one slot's rows, and its publish and confirm steps.
    fn take_slot<R: Row>(
        &self,
        SlotDone {
            started,
            positions,
            alone,
            published,
            ended,
        }: SlotDone,
        rows: &[R],
        outcome: &mut BatchOutcome,
        judged: &mut Judged,
    ) {
        if let Some(sent) = published.sent {
            outcome
                .steps
                .push((Step::Publish, sent.saturating_duration_since(started)));
            outcome
                .steps
                .push((Step::Confirm, ended.saturating_duration_since(sent)));
        }
        judged.trouble = judged.trouble.take().or(published.trouble);
        let sent = positions.iter().zip(alone).zip(published.fates);
        for ((i, alone), fate) in sent {
            self.judge::<R>(&rows[*i], alone, fate, judged);
        }
    }

    /// Build the message of each row of `slot`; rows that cannot be one are failed here.
    /// Returns what to send, and the positions of the rows whose content is still in the
    /// database (no larger than `limit`, as far as is known: a larger one fails as too
    /// large without being read).
    fn messages<R: Row>(
        &self,
        rows: &[R],
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
                None => self.to_publish::<R>(row),
            };
            match message {
                Ok(m) => sending.push(i, m),
                Err(e) => judged.fail(self.failure::<R>(row, &e)),
            }
        }
        (sending, withheld)
    }

    /// A row's message as the bus takes it: alone if its last one's fate was unknown.
    pub(super) fn to_publish<R: Row>(&self, row: &R) -> Result<ToPublish, PublishError> {
        let message = self.message::<R>(row)?;
        let alone = self.memory.suspect(row.locked().id);
        Ok(ToPublish { message, alone })
    }

    fn judge<R: Row>(&self, row: &R, alone: bool, fate: Fate, judged: &mut Judged) {
        let fate = self.memory.judge(row.locked().id, alone, fate);
        match fate {
            Fate::Confirmed => judged.fired.push(row.locked().id),
            Fate::Failed(e) => judged.fail(self.failure::<R>(row, &e)),
            Fate::Unsent => judged.untouched += 1,
            Fate::Unknown(why) => {
                tracing::warn!(id = %row.locked().id, kind = R::KIND.name(), "message may or may not have \
                    been delivered (channel closed before its confirm: {why}); it will be \
                    sent again, alone");
                judged.untouched += 1;
            }
        }
    }

    pub(super) fn failure<R: Row>(&self, row: &R, error: &PublishError) -> (Failure, &'static str) {
        let attempts = u32::try_from(row.locked().attempts).unwrap_or(0);
        let due = row.locked();
        let (exchange, routing_key) = (due.exchange, due.routing_key);
        tracing::warn!(
            id = %row.locked().id, kind = R::KIND.name(), exchange, routing_key,
            attempts = attempts.saturating_add(1), reason = error.reason(),
            "{} not published: {error}", R::KIND.message()
        );
        let failure = Failure {
            id: row.locked().id,
            error: error.to_string(),
            delay: (!error.holds()).then(|| {
                backoff::exponential(self.limits.retry_min, self.limits.retry_max, attempts)
            }),
        };
        (failure, error.reason())
    }

    /// The message of one row; content left in the database here is too large.
    fn message<R: Row>(&self, row: &R) -> Result<Message, PublishError> {
        if let Some(size) = row.withheld() {
            return Err(PublishError::TooLarge {
                size,
                max: self.limits.max_message_size,
            });
        }
        row.message(self.node_id, &self.limits.destinations)
    }
}

/// A slot sent.
struct SlotDone {
    /// When its messages were built.
    started: Instant,
    /// Its rows' positions in the batch, and whether each went alone.
    positions: Vec<usize>,
    alone: Vec<bool>,
    /// Their fates, in the same order.
    published: Published,
    /// When the last fate was known.
    ended: Instant,
}

/// Messages to publish together, and the positions of their rows in the batch.
pub(super) struct Sending {
    pub(super) started: Instant,
    pub(super) positions: Vec<usize>,
    pub(super) messages: Vec<ToPublish>,
}

impl Sending {
    pub(super) fn new(started: Instant) -> Self {
        Self {
            started,
            positions: Vec::new(),
            messages: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, position: usize, message: ToPublish) {
        self.positions.push(position);
        self.messages.push(message);
    }

    async fn send(self, bus: &Bus, budget: &Budget) -> SlotDone {
        let published = bus.publish_batch(&self.messages, budget).await;
        SlotDone {
            started: self.started,
            positions: self.positions,
            alone: self.messages.iter().map(|m| m.alone).collect(),
            published,
            ended: Instant::now(),
        }
    }
}

/// How waiting for a slot's instant ended.
enum Until<R> {
    Woke,
    Stopped,
    /// Large contents were read (the instant may not have come yet).
    Read(ReadDone<R>),
}

/// Rows sorted by fate.
#[derive(Default)]
pub(super) struct Judged {
    pub(super) fired: Vec<Uuid>,
    pub(super) failures: Vec<Failure>,
    pub(super) reasons: Vec<&'static str>,
    pub(super) untouched: usize,
    pub(super) trouble: Option<BusError>,
}

impl Judged {
    pub(super) fn fail(&mut self, (failure, reason): (Failure, &'static str)) {
        self.failures.push(failure);
        self.reasons.push(reason);
    }
}

fn fired_rows<R: Row>(rows: &[R], fired: &[Uuid]) -> Vec<Fired> {
    let fired: HashSet<&Uuid> = fired.iter().collect();
    rows.iter()
        .filter(|r| fired.contains(&r.locked().id))
        .map(|r| Fired {
            id: r.locked().id,
            deadline: r.deadline(),
        })
        .collect()
}

fn lateness<R: Row>(rows: &[R], fired: &[Uuid]) -> Vec<Duration> {
    let fired: HashSet<&Uuid> = fired.iter().collect();
    rows.iter()
        .filter(|r| fired.contains(&r.locked().id))
        .map(|r| {
            (r.locked().fired_at - r.deadline())
                .to_std()
                .unwrap_or_default()
        })
        .collect()
}
