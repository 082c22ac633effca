//! What the pacer knows of one kind of row: where the scan stands, its timers, its
//! batches and probes in flight, and the due times notified while they run.

use std::ops::{Index, IndexMut};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::{BACKLOG_RESCAN, Finished, PROBE_ROUNDING};

/// The timers of one kind. Each is `None` while not set; [`super::Pacer::wake_at`]
/// wakes for every one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Timer {
    /// An on-time batch should start (not set: no row known to be coming).
    OnTime,
    /// Probe the due index (not set while a probe is under way and nothing asked for
    /// another).
    Probe,
    /// Sweep from the start of the due index (see [`BACKLOG_RESCAN`]).
    Sweep,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Timers([Option<Instant>; 3]);

impl Timers {
    /// Every timer set.
    pub(super) fn iter(&self) -> impl Iterator<Item = Instant> + '_ {
        self.0.iter().flatten().copied()
    }
}

impl Index<Timer> for Timers {
    type Output = Option<Instant>;

    fn index(&self, t: Timer) -> &Option<Instant> {
        &self.0[t as usize]
    }
}

impl IndexMut<Timer> for Timers {
    fn index_mut(&mut self, t: Timer) -> &mut Option<Instant> {
        &mut self.0[t as usize]
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct KindState {
    pub(super) timers: Timers,
    /// Rows due up to this database instant are held by our on-time batches (or were
    /// sent): the next on-time batch is for rows beyond it.
    pub(super) covered: Option<DateTime<Utc>>,
    /// Rows overdue by more than `fresh` are waiting.
    pub(super) backlog: bool,
    /// Where the scan stands: every row due before it was sent or is held by a batch in
    /// flight, as far as we know (a row written later with an earlier due time moves it
    /// back when notified, see [`KindState::told`]). Probes and backlog batches look
    /// from here, past the index entries of the rows deleted before it.
    pub(super) from: Option<DateTime<Utc>>,
    /// A sweep should start (its timer is set once `from` is).
    pub(super) sweep: bool,
    /// The last on-time batch to finish came back full: its window holds more rows than
    /// one batch (a burst due at once), so the slots the backlog leaves free take parts
    /// of it too.
    pub(super) on_time_more: bool,
    pub(super) on_time_running: usize,
    pub(super) backlog_running: usize,
    /// A backlog batch (not a sweep) has started and not yet locked its rows: the next
    /// one waits for where it ends (see [`super::Pacer::locked`]).
    pub(super) backlog_locking: bool,
    /// A probe is under way, begun at stamp `epoch` (see [`KindState::epoch`]).
    pub(super) probing: Option<u64>,
    /// The probe under way looks from the start of the due index: what it finds is
    /// where the scan stands, even behind where it stood.
    pub(super) probing_all: bool,
    /// The kind's stamp: it moves on with every notification and every time the scan
    /// forgets or stands back. A batch or probe carries the stamp it began at: what it
    /// learnt is of the rows written before, and void if begun before `void_before`
    /// (rows it saw held may be due again since, or it looked from further on).
    pub(super) epoch: u64,
    pub(super) void_before: u64,
    /// Due times notified with their stamps, for the batches and probes in flight that
    /// began before them: none may move where the scan stands past a row it could not
    /// see. Each due time is earlier than every one after it (a later, earlier one
    /// bounds all that an earlier one would).
    pub(super) told: Vec<(u64, DateTime<Utc>)>,
    /// The stamps of the batches in flight.
    pub(super) tickets: Vec<u64>,
}

impl KindState {
    /// An on-time batch ended (see [`super::Pacer::finished`]).
    pub(super) fn on_time_finished(
        &mut self,
        f: &Finished,
        now: Instant,
        tick: Duration,
        listening: bool,
    ) {
        self.on_time_running = self.on_time_running.saturating_sub(1);
        self.on_time_more = f.full;
        if !self.current(f.epoch) {
            // Begun before the scan forgot where it stood: see `epoch`.
            self.timers[Timer::Probe] = Some(now);
        } else if f.full {
            // Rows past its last one were not locked, whatever its start counted
            // as held (see `look_past_window`).
            self.covered = f.last_due;
            // More rows in this window: the lane's last part takes the next one at
            // once; while others run, a freed slot is the backlog's first (see
            // `more_on_time`), or every slot would stay on time under a load the
            // lane cannot drain.
            if self.on_time_running == 0 {
                self.timers[Timer::OnTime] = Some(now);
            }
        } else {
            self.covered = self.covered.max(f.window_end);
            // A later window's batch in flight looked past its own window when it
            // started (or ends in a probe of its own). Without notifications a
            // probe names rows others hold too: one that found none to lock
            // looks again in a tick, not at once.
            if self.on_time_running == 0 {
                let idle = f.locked == 0 && !listening;
                self.timers[Timer::Probe] = Some(if idle { now + tick } else { now });
            }
        }
    }

    /// A backlog batch or, `sweep`, a sweep ended (see [`super::Pacer::finished`]).
    pub(super) fn backlog_finished(
        &mut self,
        sweep: bool,
        f: &Finished,
        now: Instant,
        tick: Duration,
    ) {
        self.backlog_running = self.backlog_running.saturating_sub(1);
        // Begun before the scan last stood back or forgot: rows it could not see
        // may be pending, so it ends neither the drain's bound nor the backlog.
        let current = self.current(f.epoch);
        if f.untouched == 0 && current {
            // Every row due before its last one is sent or held by an earlier
            // batch in flight (which starts over if it leaves rows behind). A
            // full sweep found rows behind where the scan stood: go on from them.
            if sweep && f.full {
                self.from = None;
                self.backlog = true;
                // Backlog batches in flight began further on: none may move
                // the scan past what the sweep found.
                if let Some(found) = f.last_due {
                    self.told(found);
                }
            }
            self.advance(f.epoch, f.last_due, now);
        }
        if !f.full && current {
            self.backlog = false;
            // Rows held by someone else (a second active node) are not ours to
            // spin on: look again in a tick.
            let again = if f.locked == 0 { now + tick } else { now };
            self.timers[Timer::Probe] =
                Some(self.timers[Timer::Probe].map_or(again, |p| p.min(again)));
        }
    }

    /// A batch left rows it held unsent.
    pub(super) fn left_rows(&mut self, now: Instant) {
        // Rows it held are due again and no notification will say so: batches go
        // for them at once (the fresh ones on time, the others as backlog, from the
        // start), without waiting for a probe.
        self.covered = None;
        self.on_time_more = false;
        self.restart_drain();
        self.timers[Timer::Probe] = Some(now);
        self.timers[Timer::OnTime] = Some(now);
        self.backlog = true;
    }

    /// The next backlog batch and probe look from the start of the due index.
    pub(super) fn restart_drain(&mut self) {
        self.void();
        self.from = None;
        self.timers[Timer::Sweep] = None;
        self.sweep = false;
    }

    /// A row told of (see [`KindState::told`], which placed the scan before it) waits in
    /// the backlog: what batches and probes under way learnt is void (as after
    /// [`KindState::restart_drain`]): a backlog batch that comes back short, begun before,
    /// must not end the backlog this row is in.
    pub(super) fn behind(&mut self) {
        self.backlog = true;
        self.void();
    }

    /// What every batch and probe under way learnt is void.
    pub(super) fn void(&mut self) {
        self.epoch += 1;
        self.void_before = self.epoch;
        self.told.clear();
        let void_before = self.void_before;
        self.tickets.retain(|t| *t >= void_before);
    }

    /// Whether a batch or probe begun at stamp `t` may teach the scan.
    pub(super) fn current(&self, t: u64) -> bool {
        t >= self.void_before
    }

    /// A row due at `due` was written (a notification): if the scan stood past it, it
    /// stands at it now, and no batch or probe begun before may move it further (see
    /// [`KindState::advance`]).
    pub(super) fn told(&mut self, due: DateTime<Utc>) {
        // A due time read as a float of seconds (before Postgres 14) may be a
        // microsecond late.
        let due = due - PROBE_ROUNDING;
        self.from = self.from.map(|from| from.min(due));
        self.epoch += 1;
        while self.told.last().is_some_and(|(_, d)| *d >= due) {
            self.told.pop();
        }
        // Each batch or probe is bounded by the first due time told after it began: one
        // told after another with no batch or probe begun between them bounds nothing
        // more, as it is later.
        let needed = self.told.last().is_none_or(|(last, _)| {
            self.tickets
                .iter()
                .chain(self.probing.iter())
                .any(|t| t >= last)
        });
        if needed {
            self.told.push((self.epoch, due));
        }
        self.prune();
    }

    /// Drop the due times no batch or probe in flight began before.
    pub(super) fn prune(&mut self) {
        let void_before = self.void_before;
        let oldest = self
            .tickets
            .iter()
            .chain(self.probing.iter())
            .filter(|t| **t >= void_before)
            .min()
            .copied();
        match oldest {
            Some(oldest) => self.told.retain(|(s, _)| *s > oldest),
            None => self.told.clear(),
        }
    }

    /// A batch begun at stamp `t` ended.
    pub(super) fn ended(&mut self, t: u64) {
        if let Some(i) = self.tickets.iter().position(|x| *x == t) {
            self.tickets.swap_remove(i);
        }
        self.prune();
    }

    /// A batch or probe begun at stamp `t` saw every row due before `to` sent or held:
    /// the scan stands there, or further, but not past a row notified since `t` (its
    /// statement may not have seen it).
    pub(super) fn advance(&mut self, t: u64, to: Option<DateTime<Utc>>, now: Instant) {
        let bound = self.told.iter().find(|(s, _)| *s > t).map(|(_, due)| *due);
        let to = match (to, bound) {
            (Some(to), Some(bound)) => Some(to.min(bound)),
            (to, _) => to,
        };
        if to.is_some() {
            self.from = self.from.max(to);
            self.timers[Timer::Sweep] = self.timers[Timer::Sweep].or(Some(now + BACKLOG_RESCAN));
        }
    }
}
