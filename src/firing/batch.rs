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
//! One row, one fate, judged from its own message alone ([`Batch::judge`]): confirmed
//! (deleted), failed (charged: attempts + 1, retried after a backoff, or held), unsent or
//! unknown (left as it was; an unknown one goes alone next time, see `memory.rs`).
//!
//! [`clock`]: super::clock
//! [`Memory`]: super::memory::Memory

use std::ops::Range;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use super::Firing;
use super::clock::{self, DbClock};
use super::large::{Large, ReadDone, Reader};
use super::row::Row;
use crate::backoff;
use crate::bus::{Budget, Bus, BusError, Fate, PublishError, Published, ToPublish};
use crate::election::Lease;
use crate::store::{Confirmed, Failure, Fired, StoreError, Window};

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
    /// Rows locked.
    pub(crate) locked: usize,
    /// The batch locked as many rows as it may: more may be due, scan again at once.
    pub(crate) full: bool,
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

/// Run one batch of `R`'s kind over the rows due within `window`, telling `locked` as
/// soon as its rows are locked (whether it locked a full batch, and the due time of its
/// last row). The lease is asked right before each slot is sent: anything but `Held`
/// before the first rolls back (nothing has been sent yet), later it stops sending. The
/// stop ends sending early; what was sent is still awaited and committed.
pub(super) async fn run<R: Row>(
    firing: &Firing,
    bus: &Bus,
    window: Window,
    locked: impl FnOnce(bool, Option<DateTime<Utc>>),
) -> Result<BatchOutcome, BatchError> {
    let (store, limits) = (&firing.store, &firing.limits);
    let started = Instant::now();
    let skip = firing.memory.skipped();
    let lock = firing.db(limits.db_bound, async {
        let (mut tx, deletes) = store.begin_batch(R::KIND).await?;
        let rows = store.lock_due::<R>(
            &mut tx,
            R::KIND,
            limits.batch_size,
            INLINE_PAYLOAD,
            &skip,
            window,
        );
        let rows = rows.await?;
        Ok((tx, deletes, rows, Instant::now()))
    });
    let (mut tx, deletes, rows, read_at) = lock.await?;
    let full = rows.len() >= limits.batch_size as usize;
    let last_due = rows.last().map(|r| r.common().due_at);
    locked(full, last_due);
    let mut outcome = BatchOutcome {
        locked: rows.len(),
        full,
        clock: clock::read_clock(&rows, read_at),
        last_due,
        window_end: rows.first().map(|r| r.common().window_end),
        steps: vec![(Step::Lock, started.elapsed())],
        ..BatchOutcome::default()
    };
    let Some(clock) = outcome.clock.filter(|_| firing.lease() == Lease::Held) else {
        outcome.lease_lost = !rows.is_empty();
        firing
            .db(limits.db_bound, async { Ok(tx.rollback().await?) })
            .await?;
        outcome.duration = started.elapsed();
        return Ok(outcome);
    };
    let confirm_until = started + limits.budget;
    let budget = Budget {
        send_until: confirm_until
            .checked_sub(limits.confirm_timeout)
            .unwrap_or(started),
        confirm_until,
        stop: firing.stop.clone(),
    };
    let mut batch = Batch {
        due: rows
            .iter()
            .map(|r| clock.local(r.common().due_at))
            .collect(),
        rows,
        clock,
        limit: bus.size_limit().min(limits.max_message_size),
        firing,
        bus,
        budget: &budget,
        judged: Judged::default(),
        outcome,
    };
    let large = Large {
        store,
        tx: &mut tx,
        held: 0,
    };
    batch.send_on_time(Reader::new(large)).await;
    let Batch {
        rows,
        judged,
        mut outcome,
        ..
    } = batch;
    outcome.bus_trouble = judged.trouble;
    // From here on the batch commits: the broker may have confirmed TimeOuts.
    let settling = Instant::now();
    let confirmed: Vec<Confirmed> = judged
        .fired
        .iter()
        .map(|&i| {
            let row = rows[i].common();
            Confirmed {
                id: row.id,
                tid: row.tid,
            }
        })
        .collect();
    let settle = firing.db(limits.db_bound * 2, async {
        let settled = store
            .settle(&mut tx, R::KIND, deletes, &confirmed, &judged.failures)
            .await?;
        tx.commit().await?;
        Ok(settled)
    });
    let fired: Vec<Fired> = judged
        .fired
        .iter()
        .map(|&i| Fired {
            id: rows[i].common().id,
            deadline: rows[i].deadline(),
        })
        .collect();
    let settled = match settle.await {
        Ok(s) => s,
        Err(source) => {
            firing.memory.remember_later(R::KIND, fired);
            return Err(BatchError::Commit {
                fired: confirmed.len(),
                source,
            });
        }
    };
    outcome.steps.push((Step::Settle, settling.elapsed()));
    firing
        .memory
        .settled(R::KIND, &settled, &fired, limits.retry_min);
    outcome.fired = fired.len();
    outcome.failed = judged.failures.len();
    outcome.untouched += judged.untouched;
    outcome.parked = settled.parked.len();
    outcome.failure_reasons = judged.reasons;
    outcome.lateness = judged
        .fired
        .iter()
        .map(|&i| {
            let row = &rows[i];
            (row.common().fired_at - row.deadline())
                .to_std()
                .unwrap_or_default()
        })
        .collect();
    outcome.duration = started.elapsed();
    Ok(outcome)
}

/// One batch between its lock and its settle: the locked rows, in due order, each sent
/// at its due time and judged by its own message's fate.
struct Batch<'a, R> {
    firing: &'a Firing,
    bus: &'a Bus,
    budget: &'a Budget,
    rows: Vec<R>,
    /// The local instant each row is due (see [`DbClock::local`]).
    due: Vec<Instant>,
    clock: DbClock,
    /// The largest message this batch sends (the broker's frame limit, the setting).
    limit: usize,
    judged: Judged,
    outcome: BatchOutcome,
}

impl<'a, R: Row> Batch<'a, R> {
    fn lease(&self) -> Lease {
        self.firing.lease()
    }

    /// Send the rows at their due times — on each wake-up every row due by then (rows
    /// already due at once) — and sort them by fate. What one wake-up sends is published
    /// while the next waits for its time. Rows not sent (stop, lease lost, budget spent)
    /// are left untouched.
    async fn send_on_time(&mut self, mut reader: Reader<'a, R>) {
        let mut in_flight = FuturesUnordered::new();
        let mut first = 0;
        while let Some(&at) = self.due.get(first) {
            let woke = match self.until(at, &mut in_flight, &mut reader).await {
                Until::Read(done) => {
                    let sent = self.take_read(done);
                    in_flight.extend(sent.map(|s| Box::pin(s.send(self.bus, self.budget))));
                    reader.read_next(self.firing, &self.rows, self.limit);
                    continue;
                }
                Until::Woke => true,
                Until::Stopped => false,
            };
            if !woke || !self.budget.may_send() || self.lease() != Lease::Held {
                self.outcome.lease_lost |= woke && self.lease() != Lease::Held;
                self.judged.untouched += self.rows.len() - first;
                break;
            }
            let now = Instant::now();
            let slot = clock::due_by(&self.due, first, now);
            if slot.is_empty() {
                // Woken before the timer's instant: wait again.
                continue;
            }
            if at > self.clock.at {
                let late = now.saturating_duration_since(at);
                self.outcome.steps.push((Step::Wake, late));
            }
            first = slot.end;
            let sent_at = self.clock.db_at(now);
            self.rows[slot.clone()]
                .iter_mut()
                .for_each(|r| r.set_fired_at(sent_at));
            let (sending, withheld) = self.messages(slot);
            in_flight.push(Box::pin(sending.send(self.bus, self.budget)));
            // Large contents are read only now, after the slot's other rows went out, and
            // beside the slots that follow: they delay nobody but their own rows.
            if !withheld.is_empty() {
                reader.queue.push_back((withheld, now));
                reader.read_next(self.firing, &self.rows, self.limit);
            }
        }
        // Contents still to read are of rows not sent: left as they are.
        self.judged.untouched += reader.drop_queue();
        loop {
            tokio::select! {
                Some(done) = in_flight.next(), if !in_flight.is_empty() => self.take_slot(done),
                done = reader.reading(), if reader.is_busy() => {
                    let sent = self.take_read(done);
                    if self.budget.may_send() && self.lease() == Lease::Held {
                        in_flight.extend(sent.map(|s| Box::pin(s.send(self.bus, self.budget))));
                    } else {
                        self.judged.untouched += sent.map_or(0, |s| s.positions.len());
                    }
                }
                else => break,
            }
        }
    }

    /// Wait until `at`, taking the fates of slots sent earlier as they come in; return
    /// early when large contents were read.
    async fn until(
        &mut self,
        at: Instant,
        in_flight: &mut FuturesUnordered<impl Future<Output = SlotDone>>,
        reader: &mut Reader<'a, R>,
    ) -> Until<R> {
        let sleep = tokio::time::sleep_until(at.into());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return Until::Woke,
                _ = self.budget.stop.cancelled() => return Until::Stopped,
                done = reader.reading(), if reader.is_busy() => return Until::Read(done),
                Some(done) = in_flight.next(), if !in_flight.is_empty() => self.take_slot(done),
            }
        }
    }

    /// The fates of one slot's rows, and its publish and confirm steps.
    fn take_slot(&mut self, done: SlotDone) {
        let published = done.published;
        if let Some(sent) = published.sent {
            let steps = &mut self.outcome.steps;
            steps.push((Step::Publish, sent.saturating_duration_since(done.started)));
            steps.push((Step::Confirm, done.ended.saturating_duration_since(sent)));
        }
        self.judged.trouble = self.judged.trouble.take().or(published.trouble);
        let sent = done.positions.into_iter().zip(done.alone);
        for ((i, alone), fate) in sent.zip(published.fates) {
            self.judge(i, alone, fate);
        }
    }

    /// Build the message of each row of `slot`; rows that cannot be one are failed here.
    /// Returns what to send, and the positions of the rows whose content is still in the
    /// database (no larger than `limit`, as far as is known: a larger one fails as too
    /// large without being read).
    fn messages(&mut self, slot: Range<usize>) -> (Sending, Vec<usize>) {
        let mut sending = Sending::new(Instant::now(), slot.len());
        let mut withheld = Vec::new();
        for i in slot {
            match self.rows[i].withheld() {
                Some(size) if size > self.limit => self.fail(i, &self.too_large(size)),
                Some(_) => withheld.push(i),
                None => self.push(&mut sending, i),
            }
        }
        (sending, withheld)
    }

    /// Put the rows read back into the batch; what they become, to send.
    fn take_read(&mut self, done: ReadDone<R>) -> Option<Sending> {
        self.judged.untouched += done.left;
        if let Some(e) = &done.error {
            tracing::warn!(error = %crate::telemetry::Chain(e), kind = R::KIND.name(),
                "cannot read large contents: those rows are left for the next batch");
        }
        let mut sending = Sending::new(done.started, done.read.len());
        for row in done.read {
            let id = row.common().id;
            let Some(&i) = done
                .positions
                .iter()
                .find(|&&i| self.rows[i].common().id == id)
            else {
                continue;
            };
            self.rows[i] = row;
            match self.rows[i].withheld() {
                Some(size) => self.fail(i, &self.too_large(size)),
                None => self.push(&mut sending, i),
            }
        }
        (!sending.positions.is_empty()).then_some(sending)
    }

    /// The message of row `i` as the bus takes it (alone if its last one's fate was
    /// unknown), or its failure.
    fn push(&mut self, sending: &mut Sending, i: usize) {
        let row = &self.rows[i];
        let firing = self.firing;
        match row.message(firing.node_id, &firing.limits) {
            Ok(message) => {
                let alone = firing.memory.suspect(row.common().id);
                sending.push(i, ToPublish { message, alone });
            }
            Err(e) => self.fail(i, &e),
        }
    }

    fn too_large(&self, size: usize) -> PublishError {
        PublishError::TooLarge {
            size,
            max: self.limit,
        }
    }

    /// Row `i`'s fate, from its own message's alone.
    fn judge(&mut self, i: usize, alone: bool, fate: Fate) {
        let id = self.rows[i].common().id;
        match self.firing.memory.judge(id, alone, fate) {
            Fate::Confirmed => self.judged.fired.push(i),
            Fate::Failed(e) => self.fail(i, &e),
            Fate::Unsent => self.judged.untouched += 1,
            Fate::Unknown(why) => {
                tracing::warn!(%id, kind = R::KIND.name(), "message may or may not have \
                    been delivered (channel closed before its confirm: {why}); it will be \
                    sent again, alone");
                self.judged.untouched += 1;
            }
        }
    }

    /// Charge row `i` with `error`: attempts + 1, retried after a backoff unless the
    /// error holds the row for an operator.
    fn fail(&mut self, i: usize, error: &PublishError) {
        let row = self.rows[i].common();
        let attempts = u32::try_from(row.attempts).unwrap_or(0);
        tracing::warn!(
            id = %row.id, kind = R::KIND.name(), exchange = row.exchange,
            routing_key = row.routing_key, attempts = attempts.saturating_add(1),
            reason = error.reason(), "{} not published: {error}", R::KIND.message()
        );
        let limits = &self.firing.limits;
        self.judged.failures.push(Failure {
            id: row.id,
            error: error.to_string(),
            delay: (!error.holds())
                .then(|| backoff::exponential(limits.retry_min, limits.retry_max, attempts)),
        });
        self.judged.reasons.push(error.reason());
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
struct Sending {
    started: Instant,
    positions: Vec<usize>,
    messages: Vec<ToPublish>,
}

impl Sending {
    /// Room for `rows` messages: a message is large to move again while a vector grows.
    fn new(started: Instant, rows: usize) -> Self {
        Self {
            started,
            positions: Vec::with_capacity(rows),
            messages: Vec::with_capacity(rows),
        }
    }

    fn push(&mut self, position: usize, message: ToPublish) {
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
struct Judged {
    /// Positions of the confirmed rows.
    fired: Vec<usize>,
    failures: Vec<Failure>,
    /// Why each failed (`PublishError::reason`), in the same order.
    reasons: Vec<&'static str>,
    untouched: usize,
    trouble: Option<BusError>,
}
