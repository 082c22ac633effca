//! Which batch to start, and when: a pure state machine (no clock, no I/O, like the
//! election). The firing task feeds in what it learns — probes of the due index, finished
//! batches, notifications of new due times — with the current instant, then starts the
//! batches [`Pacer::starts`] names and sleeps until [`Pacer::wake_at`].
//!
//! Each kind of due row has two lanes:
//! - **on time**: a batch locks the rows due from `fresh` ago to `horizon` ahead, and
//!   sends each at its due time. The next such batch starts `lead` before the first row
//!   due after the window the last one covered, so rows are held a little ahead of their
//!   time and sent on the dot. A new row inside a covered window (a notification) starts
//!   a batch at once: the one holding the window skipped it. A window that holds more
//!   than a batch (a burst due at once) is taken in parts side by side, by every slot
//!   the backlog leaves free.
//! - **backlog**: rows overdue by more than `fresh` (after an outage, a burst larger
//!   than the on-time lane drains while it is fresh, a row written late), locked oldest
//!   first, batch after batch while batches come back full.
//!
//! **Work-conserving**: whenever a row is due by the database's clock and not held,
//! failing or parked, a batch of its kind is in flight or starts within one tick (plus
//! a probe's round trip when no notification tells of the row), whatever order rows
//! were written in and whatever their due times; only a batch the database failed
//! waits out its backoff, and only a full set of slots makes a kind wait for a slot.
//! No other timer stands between a due row and its batch. `sim.rs` beside this file
//! checks this, with the promises below, over randomized schedules.
//!
//! Deleted rows stay in the due index until vacuum, and a scan from its start walks all
//! of them. So each kind remembers where the scan stands (every row due before it was
//! sent or is held), learnt from probes and finished backlog batches; probes and
//! backlog batches look from there. What keeps that true:
//! - every notified due time behind where the scan stands moves it back to that row,
//!   whatever the row's age (a transaction that took its `now()` before a probe found
//!   the table empty, a burst that outgrows the on-time lane while fresh);
//! - no batch or probe moves it past a row notified after it began (its statement may
//!   not have seen the row): each carries the kind's stamp, and the stamped due times
//!   bound what it may teach;
//! - while no notification can arrive, every probe looks from the start of the index
//!   and for the first fresh row, held or not;
//! - a batch that fails or leaves rows unsent makes the scan forget where it stood.
//!
//! A *sweep* every [`BACKLOG_RESCAN`] looks from the start besides: it finds only rows
//! whose notification could not say where they are: written with the trigger disabled
//! (e.g. by `session_replication_role = replica`).
//!
//! Batches in flight never exceed `concurrency`; the backlog of all kinds together takes
//! at most `concurrency - fresh_slots` of them, so rows coming due now are not late by
//! the whole drain (with `fresh_slots = 0` the on-time lane waits for the backlog:
//! strictly oldest first). Backlog slots go to the kinds in turn, so one kind's backlog
//! never starves another's. A kind is probed every `probe_interval` besides, in case a
//! notification was lost, and every `tick` while none can arrive (no LISTEN connection).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::clock::DbClock;
use crate::kind::Kind;
use crate::store::NextDue;

mod plan;
mod state;
#[cfg(test)]
mod test_api;

pub(crate) use plan::{Action, Config, Finished, Lane, Locked, Planned, Probing};
use state::{KindState, Timer};

/// How often a *sweep* (a backlog batch from the start of the due index) looks for rows
/// behind where the scan stands that no notification placed (see the module docs). A
/// sweep walks the index entries of the rows deleted so far, in a batch task of its own;
/// probes never do while notifications arrive and the scan knows where it stands.
pub(crate) const BACKLOG_RESCAN: Duration = Duration::from_secs(30);

/// Rows overdue by more than this are a backlog.
pub(crate) const FRESH: Duration = Duration::from_secs(1);

/// Taken off a probed earliest due time before it bounds anything: the time is computed
/// from a float of seconds, which may round it up a little.
const PROBE_ROUNDING: chrono::Duration = chrono::Duration::milliseconds(1);

#[derive(Debug)]
pub(crate) struct Pacer {
    config: Config,
    kinds: Vec<KindState>,
    /// The database clock as last read, to place notified due times on our clock.
    clock: Option<DbClock>,
    /// The kind of each entry of `kinds`.
    served: Vec<Kind>,
    /// The kind whose backlog goes first next time.
    turn: usize,
    /// Notifications arrive (the LISTEN connection is up): probes are a safety net.
    listening: bool,
}

impl Pacer {
    /// The pacer of the scan of `kinds`, each probed at `now`.
    pub(crate) fn new(config: Config, kinds: &[Kind], now: Instant) -> Self {
        let mut state = KindState::default();
        state.timers[Timer::Probe] = Some(now);
        Self {
            config,
            kinds: vec![state; kinds.len()],
            served: kinds.to_vec(),
            clock: None,
            turn: 0,
            listening: false,
        }
    }

    /// Whether notifications arrive now. Without them nothing tells of a new row but a
    /// probe: every kind is probed every tick from now on.
    pub(crate) fn listening(&mut self, on: bool, now: Instant) {
        if self.listening && !on {
            let soon = now + self.config.tick;
            for k in &mut self.kinds {
                k.timers[Timer::Probe] = k.timers[Timer::Probe].map(|at| at.min(soon));
            }
        }
        self.listening = on;
    }

    fn probe_every(&self) -> Duration {
        if self.listening {
            self.config.probe_interval
        } else {
            self.config.tick
        }
    }

    /// The kinds to probe now, with the instant each probe's `after` should be (the end
    /// of the covered window, if any) and its `from` (where the scan stands). Each is
    /// under way until [`Pacer::probed`] or [`Pacer::probe_failed`]: one at a time per
    /// kind, and one asked for meanwhile follows it.
    fn probes_due(&mut self, now: Instant) -> Vec<Probing> {
        let listening = self.listening;
        self.kinds
            .iter_mut()
            .enumerate()
            .filter(|(_, k)| {
                k.probing.is_none() && k.timers[Timer::Probe].is_some_and(|at| at <= now)
            })
            .map(|(i, k)| {
                k.timers[Timer::Probe] = None;
                k.probing = Some(k.epoch);
                // Without notifications nothing tells of a row written behind where the
                // scan stands, or inside a window a batch holds: every probe looks from
                // the start, and for the first fresh row held or not.
                k.probing_all = !listening || k.from.is_none();
                Probing {
                    kind: self.served[i],
                    after: if listening { k.covered } else { None },
                    from: if listening { k.from } else { None },
                }
            })
            .collect()
    }

    /// Kinds whose sweep is due get one backlog slot for it.
    fn plan_sweeps(&mut self, now: Instant) {
        for k in &mut self.kinds {
            if k.timers[Timer::Sweep].is_some_and(|at| now >= at) {
                k.timers[Timer::Sweep] = Some(now + BACKLOG_RESCAN);
                k.sweep = true;
            }
        }
    }

    /// A probe of `kind` answered at `now` (its seconds count from about then).
    pub(crate) fn probed(&mut self, kind: Kind, now: Instant, probe: NextDue) {
        let Some(kind) = self.position(kind) else {
            return;
        };
        self.read_clock(
            DbClock {
                at: now,
                db: probe.now,
            },
            now,
        );
        let fresh = self.config.fresh.as_secs_f64();
        let lead = self.config.lead;
        let again = now + self.probe_every();
        let listening = self.listening;
        let k = &mut self.kinds[kind];
        let began = k.probing.take();
        // A probe asked for while this one was under way follows it.
        k.timers[Timer::Probe] = match (began, k.timers[Timer::Probe]) {
            (Some(_), Some(asked)) => Some(asked.min(again)),
            _ => Some(again),
        };
        // Begun before the scan last forgot where it stood: what it saw held may be due
        // again.
        let current = began.is_none_or(|t| k.current(t));
        k.backlog |= probe.earliest.is_some_and(|s| s < -fresh);
        // Nothing pending was due before the earliest row the probe saw; with none at
        // all, a row written after its snapshot with an earlier due time is notified
        // (see `told`).
        let stands = match probe.earliest {
            Some(s) => db_offset(probe.start, s).map(|t| t - PROBE_ROUNDING),
            None => Some(probe.start),
        };
        let ticket = began.unwrap_or(k.epoch);
        if current {
            let all = std::mem::take(&mut k.probing_all);
            if all {
                // Every row due before `stands` is gone, as of the probe's snapshot;
                // rows written since with earlier due times are notified (see
                // `notified`), or found by the next probe while no notification can come.
                k.from = None;
            }
            k.advance(ticket, stands, now);
            if let Some(found) = stands.filter(|_| all && !listening) {
                // No notification bounds the backlog batches in flight, which began from
                // further on: what this look found bounds them as one would.
                k.told(found);
            }
        }
        k.prune();
        // The first row beyond what we hold; an overdue one is the backlog's. A start
        // asked for meanwhile (a notification) stands.
        let next = probe
            .beyond
            .filter(|s| *s >= -fresh)
            .map(|s| offset(now, s).checked_sub(lead).unwrap_or(now).max(now));
        k.timers[Timer::OnTime] = match (k.timers[Timer::OnTime], next) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// A probe of `kind` failed: try again in a tick.
    pub(crate) fn probe_failed(&mut self, kind: Kind, now: Instant) {
        let Some(kind) = self.position(kind) else {
            return;
        };
        let k = &mut self.kinds[kind];
        k.probing = None;
        k.probing_all = false;
        k.timers[Timer::Probe] = Some(now + self.config.tick);
    }

    /// What to do now: the batches to start (each then counts as running until
    /// [`Pacer::finished`] or [`Pacer::failed`]), then the probes to make (see
    /// [`Pacer::probes_due`]). The probes come after the starts: an on-time start asks at
    /// once for a probe past its window.
    pub(crate) fn actions(&mut self, now: Instant) -> Vec<Action> {
        let mut actions: Vec<Action> = self
            .start_positions(now)
            .into_iter()
            .map(|(i, lane)| {
                Action::Batch(Planned {
                    kind: self.served[i],
                    lane,
                    window: self.config.window(lane, self.kinds[i].from),
                    epoch: self.kinds[i].epoch,
                })
            })
            .collect();
        actions.extend(self.probes_due(now).into_iter().map(Action::Probe));
        actions
    }

    /// The batches to start now, by position in `kinds`.
    fn start_positions(&mut self, now: Instant) -> Vec<(usize, Lane)> {
        self.plan_sweeps(now);
        let mut starts = Vec::new();
        let mut free = self.config.concurrency.saturating_sub(self.running());
        let mut on_time: Vec<usize> = (0..self.kinds.len())
            .filter(|i| self.on_time_ready(*i, now))
            .collect();
        on_time.sort_by_key(|i| self.kinds[*i].timers[Timer::OnTime]);
        for kind in on_time {
            if free == 0 {
                return starts;
            }
            let k = &mut self.kinds[kind];
            k.timers[Timer::OnTime] = None;
            k.on_time_running += 1;
            k.tickets.push(k.epoch);
            free -= 1;
            starts.push((kind, Lane::OnTime));
            self.look_past_window(kind, now);
        }
        let cap = self.config.concurrency - self.config.fresh_slots;
        while free > 0 && self.backlog_running() < cap {
            let Some(kind) = self.next_backlog() else {
                break;
            };
            let k = &mut self.kinds[kind];
            k.backlog_running += 1;
            k.tickets.push(k.epoch);
            free -= 1;
            // A sweep looks from the start of the index, apart from the drain: it may
            // walk many deleted entries, and the drain does not wait for its lock.
            let lane = if std::mem::take(&mut k.sweep) {
                Lane::Sweep
            } else {
                k.backlog_locking = true;
                Lane::Backlog
            };
            starts.push((kind, lane));
        }
        // A backlog waiting for its batch in flight to lock gets its next slot then:
        // those slots stay the backlog's.
        let waiting = self.kinds.iter().any(|k| k.backlog && k.backlog_locking);
        let kept = if waiting {
            cap.saturating_sub(self.backlog_running()).min(free)
        } else {
            0
        };
        self.more_on_time(free - kept, &mut starts);
        starts
    }

    /// An on-time batch starting `now` locks at least every row due up to the database's
    /// clock now plus the horizon: count that window as held at once and look for the
    /// first row past it, so that the next window's batch starts `lead` before that row
    /// while this one still sends. Waiting for this one to commit first would make the
    /// rows just past its window late by a commit, a probe and a lock.
    fn look_past_window(&mut self, kind: usize, now: Instant) {
        let Some(clock) = self.clock else { return };
        let Ok(horizon) = chrono::Duration::from_std(self.config.horizon) else {
            return;
        };
        // Without notifications a probe names rows this batch holds too: the next one
        // waits a tick, or each would start another batch that finds nothing.
        let at = if self.listening {
            now
        } else {
            now + self.config.tick
        };
        let k = &mut self.kinds[kind];
        k.covered = k.covered.max(Some(clock.db_at(now) + horizon));
        k.timers[Timer::Probe] = Some(k.timers[Timer::Probe].map_or(at, |p| p.min(at)));
    }

    /// Slots left over go to windows known to hold more than one batch, kind by kind.
    fn more_on_time(&mut self, mut free: usize, starts: &mut Vec<(usize, Lane)>) {
        let fresh_first = self.config.fresh_slots > 0;
        for (kind, k) in self.kinds.iter_mut().enumerate() {
            while free > 0 && k.on_time_more && (fresh_first || !k.backlog) {
                k.on_time_running += 1;
                k.tickets.push(k.epoch);
                free -= 1;
                starts.push((kind, Lane::OnTime));
            }
        }
    }

    /// A batch of `kind` in `lane` locked its rows (`None`: it ended without locking
    /// any). Backlog batches lock one after the other, each from where the one before
    /// it ended, so that no lock statement walks the rows another batch holds (`SKIP
    /// LOCKED` still visits each of them); they send side by side. Told once per batch,
    /// before [`Pacer::finished`] or [`Pacer::failed`].
    pub(crate) fn locked(&mut self, kind: Kind, lane: Lane, now: Instant, rows: Option<Locked>) {
        let Some(kind) = self.position(kind) else {
            return;
        };
        if lane != Lane::Backlog {
            return;
        }
        let k = &mut self.kinds[kind];
        k.backlog_locking = false;
        let Some(rows) = rows.filter(|r| k.current(r.epoch)) else {
            return;
        };
        if rows.full {
            // Every row due before its last one is sent or held, by it or by an earlier
            // batch in flight (which starts the drain over if it leaves rows behind).
            k.advance(rows.epoch, rows.last_due, now);
        } else {
            k.backlog = false;
        }
    }

    /// A batch of `kind` in `lane` ended at `now`.
    pub(crate) fn finished(&mut self, kind: Kind, lane: Lane, now: Instant, f: Finished) {
        let Some(kind) = self.position(kind) else {
            return;
        };
        if let Some(clock) = f.clock {
            self.read_clock(clock, now);
        }
        let tick = self.config.tick;
        let listening = self.listening;
        let k = &mut self.kinds[kind];
        match lane {
            Lane::OnTime => k.on_time_finished(&f, now, tick, listening),
            Lane::Backlog | Lane::Sweep => k.backlog_finished(lane == Lane::Sweep, &f, now, tick),
        }
        // Its stamp bounds nothing from now on (after `advance` used what was told since).
        k.ended(f.epoch);
        if f.untouched > 0 {
            k.left_rows(now);
        }
    }

    /// A batch of `kind` failed (the database): forget what we held, probe after `delay`.
    pub(crate) fn failed(&mut self, kind: Kind, lane: Lane, now: Instant, delay: Duration) {
        let Some(kind) = self.position(kind) else {
            return;
        };
        let k = &mut self.kinds[kind];
        match lane {
            Lane::OnTime => k.on_time_running = k.on_time_running.saturating_sub(1),
            Lane::Backlog | Lane::Sweep => k.backlog_running = k.backlog_running.saturating_sub(1),
        }
        k.covered = None;
        k.timers[Timer::OnTime] = None;
        k.on_time_more = false;
        k.backlog = false;
        k.restart_drain();
        k.timers[Timer::Probe] = Some(now + delay);
    }

    /// A new or moved row of `kind` (every kind when `None`) is due at `due` (`None`:
    /// unknown, e.g. notifications were lost: look now, from the start). Its batch
    /// starts `lead` before; a row overdue by more than `fresh` is the backlog's.
    pub(crate) fn notified(
        &mut self,
        kind: Option<Kind>,
        due: Option<DateTime<Utc>>,
        now: Instant,
    ) {
        let lead = self.config.lead;
        let clock = self.clock;
        // Rows near the end of the on-time lane's reach go to the backlog: by the time an
        // on-time batch locks, they may be out of it (the clock is known only to a lower
        // bound, and the lock comes a round trip later).
        let fresh = chrono::Duration::from_std(self.config.fresh - self.config.fresh / 10)
            .unwrap_or(chrono::Duration::MAX);
        for (i, k) in self.kinds.iter_mut().enumerate() {
            if kind.is_some_and(|kind| kind != self.served[i]) {
                continue;
            }
            // Written with a due time behind where the scan stands (a transaction that
            // took its `now()` before a probe, a burst the on-time lane does not take
            // while it is fresh): the scan stands before it now, and nothing learnt
            // before this notice may move it past the row again.
            if let Some(due) = due {
                k.told(due);
            }
            let at = match (due, clock) {
                // Written already overdue: out of the on-time lane's reach, the
                // backlog's.
                (Some(due), Some(clock))
                    if clock
                        .db_at(now)
                        .checked_sub_signed(fresh)
                        .is_some_and(|f| due < f) =>
                {
                    k.behind();
                    continue;
                }
                // Inside a window a batch already holds: it skipped this row.
                (Some(due), _) if k.covered.is_some_and(|c| due <= c) => now,
                (Some(due), Some(clock)) => {
                    clock.local(due).checked_sub(lead).unwrap_or(now).max(now)
                }
                // No clock read yet: an on-time batch takes what is fresh, and its end
                // asks for a probe (the first probe looks from the start anyway).
                (Some(_), None) => now,
                // Unknown (notifications lost, or a LISTEN after a gap): rows written
                // meanwhile may be due anywhere, behind where the scan stands too.
                (None, _) => {
                    k.restart_drain();
                    k.timers[Timer::Probe] = Some(now);
                    now
                }
            };
            k.timers[Timer::OnTime] = Some(k.timers[Timer::OnTime].map_or(at, |t| t.min(at)));
        }
    }

    /// A reading of the database clock: kept if it places the database later than the one
    /// held (both are lower bounds; a probe's reading is as old as its snapshot).
    fn read_clock(&mut self, clock: DbClock, now: Instant) {
        if self
            .clock
            .is_none_or(|held| held.db_at(now) <= clock.db_at(now))
        {
            self.clock = Some(clock);
        }
    }

    /// When something is due next: an on-time batch or a probe. A start that waits for a
    /// free slot is woken by the batch that frees it.
    pub(crate) fn wake_at(&self, now: Instant) -> Instant {
        let tick = now + self.config.tick;
        self.kinds
            .iter()
            .flat_map(|k| k.timers.iter())
            .filter(|at| *at > now)
            .fold(tick, Instant::min)
    }

    /// Batches in flight.
    pub(crate) fn running(&self) -> usize {
        self.kinds
            .iter()
            .map(|k| k.on_time_running + k.backlog_running)
            .sum()
    }

    fn backlog_running(&self) -> usize {
        self.kinds.iter().map(|k| k.backlog_running).sum()
    }

    fn on_time_ready(&self, kind: usize, now: Instant) -> bool {
        let k = &self.kinds[kind];
        k.timers[Timer::OnTime].is_some_and(|at| at <= now)
            && (self.config.fresh_slots > 0 || !k.backlog)
    }

    fn position(&self, kind: Kind) -> Option<usize> {
        self.served.iter().position(|k| *k == kind)
    }

    /// The next kind with a backlog, in turn.
    fn next_backlog(&mut self) -> Option<usize> {
        let n = self.kinds.len();
        let kind = (0..n).map(|i| (self.turn + i) % n).find(|i| {
            let k = &self.kinds[*i];
            k.sweep || (k.backlog && !k.backlog_locking)
        })?;
        self.turn = (kind + 1) % n;
        Some(kind)
    }
}

/// The database instant `secs` after `now` (negative: before); `None` when out of range
/// (a row due at '-infinity').
fn db_offset(now: DateTime<Utc>, secs: f64) -> Option<DateTime<Utc>> {
    let d = chrono::Duration::from_std(Duration::try_from_secs_f64(secs.abs()).ok()?).ok()?;
    if secs < 0.0 {
        now.checked_sub_signed(d)
    } else {
        now.checked_add_signed(d)
    }
}

/// `now` moved by `secs` (negative: back), as far as an `Instant` can go.
fn offset(now: Instant, secs: f64) -> Instant {
    let d = Duration::try_from_secs_f64(secs.abs()).unwrap_or(Duration::MAX);
    if secs >= 0.0 {
        now.checked_add(d).unwrap_or(now)
    } else {
        now.checked_sub(d).unwrap_or(now)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod sim;
