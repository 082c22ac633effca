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
use crate::store::{NextDue, Window};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    OnTime,
    Backlog,
    /// A backlog batch from the start of the due index (see [`BACKLOG_RESCAN`]).
    Sweep,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Config {
    pub(crate) horizon: Duration,
    /// How long before its first row's due time an on-time batch starts.
    pub(crate) lead: Duration,
    /// Rows overdue by more than this are backlog.
    pub(crate) fresh: Duration,
    pub(crate) concurrency: usize,
    pub(crate) fresh_slots: usize,
    pub(crate) tick: Duration,
    /// How often a kind is probed while notifications arrive (every `tick` otherwise).
    pub(crate) probe_interval: Duration,
}

impl Config {
    /// The on-time lane's lead: enough to lock a window before it opens, a small part of
    /// the horizon so that windows overlap little (zero without a horizon: rows are then
    /// locked when due).
    pub(crate) fn lead_for(horizon: Duration) -> Duration {
        (horizon / 4).min(Duration::from_millis(25))
    }

    /// What a batch of `lane` locks (a backlog batch: from `from` on).
    pub(crate) fn window(&self, lane: Lane, from: Option<DateTime<Utc>>) -> Window {
        let backlog = |from| Window {
            horizon: Duration::ZERO,
            fresh: None,
            from,
        };
        match lane {
            Lane::OnTime => Window {
                horizon: self.horizon,
                fresh: Some(self.fresh),
                from: None,
            },
            Lane::Backlog => backlog(from),
            Lane::Sweep => backlog(None),
        }
    }
}

/// What a batch that locked its rows tells the pacer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Locked {
    /// It locked a full batch: more rows may wait.
    pub(crate) full: bool,
    /// The due time of the last row it locked (rows are locked in due order).
    pub(crate) last_due: Option<DateTime<Utc>>,
    /// [`Pacer::epoch`] of its kind when it started.
    pub(crate) epoch: u64,
}

/// What a finished batch tells the pacer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Finished {
    pub(crate) locked: usize,
    /// It locked a full batch: more rows may wait.
    pub(crate) full: bool,
    /// Rows it locked but left unsent (stop, lease, budget, unknown fate): they are due
    /// and unlocked again.
    pub(crate) untouched: usize,
    pub(crate) clock: Option<DbClock>,
    pub(crate) last_due: Option<DateTime<Utc>>,
    /// Up to when it locked every row due (if it locked any).
    pub(crate) window_end: Option<DateTime<Utc>>,
    /// [`Pacer::epoch`] of its kind when it started.
    pub(crate) epoch: u64,
}

#[derive(Debug, Clone, Default)]
struct KindState {
    /// When an on-time batch should start (`None`: no row known to be coming).
    on_time_at: Option<Instant>,
    /// Rows due up to this database instant are held by our on-time batches (or were
    /// sent): the next on-time batch is for rows beyond it.
    covered: Option<DateTime<Utc>>,
    /// Rows overdue by more than `fresh` are waiting.
    backlog: bool,
    /// Where the scan stands: every row due before it was sent or is held by a batch in
    /// flight, as far as we know (a row written later with an earlier due time moves it
    /// back when notified, see [`KindState::told`]). Probes and backlog batches look
    /// from here, past the index entries of the rows deleted before it.
    from: Option<DateTime<Utc>>,
    /// When the next sweep is due (set once `from` is), and whether one should start.
    sweep_at: Option<Instant>,
    sweep: bool,
    /// The last on-time batch to finish came back full: its window holds more rows than
    /// one batch (a burst due at once), so the slots the backlog leaves free take parts
    /// of it too.
    on_time_more: bool,
    on_time_running: usize,
    backlog_running: usize,
    /// A backlog batch (not a sweep) has started and not yet locked its rows: the next
    /// one waits for where it ends (see [`Pacer::locked`]).
    backlog_locking: bool,
    /// When to probe the due index next (`None` while a probe is under way and nothing
    /// asked for another).
    probe_at: Option<Instant>,
    /// A probe is under way, begun at stamp `epoch` (see [`KindState::epoch`]).
    probing: Option<u64>,
    /// The probe under way looks from the start of the due index: what it finds is
    /// where the scan stands, even behind where it stood.
    probing_all: bool,
    /// The kind's stamp: it moves on with every notification and every time the scan
    /// forgets or stands back. A batch or probe carries the stamp it began at: what it
    /// learnt is of the rows written before, and void if begun before `void_before`
    /// (rows it saw held may be due again since, or it looked from further on).
    epoch: u64,
    void_before: u64,
    /// Due times notified with their stamps, for the batches and probes in flight that
    /// began before them: none may move where the scan stands past a row it could not
    /// see. Each due time is earlier than every one after it (a later, earlier one
    /// bounds all that an earlier one would).
    told: Vec<(u64, DateTime<Utc>)>,
    /// The stamps of the batches in flight.
    tickets: Vec<u64>,
}

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
        let state = KindState {
            probe_at: Some(now),
            ..KindState::default()
        };
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
                k.probe_at = k.probe_at.map(|at| at.min(soon));
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

    #[cfg(test)]
    pub(crate) fn config(&self) -> &Config {
        &self.config
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
            .filter(|(_, k)| k.probing.is_none() && k.probe_at.is_some_and(|at| at <= now))
            .map(|(i, k)| {
                k.probe_at = None;
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

    /// How often `kind`'s scan forgot where it stood so far: a batch started now passes
    /// it back in [`Finished::epoch`]. One that began before the scan last forgot may
    /// have skipped rows another batch held then and let go since: what it covered
    /// proves nothing.
    #[cfg(test)]
    fn epoch(&self, kind: Kind) -> u64 {
        self.position(kind).map_or(0, |i| self.kinds[i].epoch)
    }

    /// What a batch of `kind` in `lane` locks.
    #[cfg(test)]
    fn window(&self, kind: Kind, lane: Lane) -> Window {
        let from = self.position(kind).and_then(|i| self.kinds[i].from);
        self.config.window(lane, from)
    }

    /// Kinds whose sweep is due get one backlog slot for it.
    fn plan_sweeps(&mut self, now: Instant) {
        for k in &mut self.kinds {
            if k.sweep_at.is_some_and(|at| now >= at) {
                k.sweep_at = Some(now + BACKLOG_RESCAN);
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
        k.probe_at = match (began, k.probe_at) {
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
        k.on_time_at = match (k.on_time_at, next) {
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
        k.probe_at = Some(now + self.config.tick);
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

    /// The batches to start now, by kind and lane.
    #[cfg(test)]
    fn starts_one(&mut self, now: Instant) -> Vec<(Kind, Lane)> {
        let starts = self.start_positions(now);
        starts
            .into_iter()
            .map(|(i, lane)| (self.served[i], lane))
            .collect()
    }

    /// The batches to start now, each backlog batch locking at once (a full batch,
    /// leaving where the scan stands as it was), so that the next may start.
    #[cfg(test)]
    fn starts(&mut self, now: Instant) -> Vec<(Kind, Lane)> {
        let mut all = Vec::new();
        loop {
            let starts = self.starts_one(now);
            if starts.is_empty() {
                return all;
            }
            for &(kind, lane) in &starts {
                let epoch = self.epoch(kind);
                let rows = Locked {
                    full: true,
                    last_due: None,
                    epoch,
                };
                self.locked(kind, lane, now, Some(rows));
            }
            all.extend(starts);
        }
    }

    /// The batches to start now, by position in `kinds`.
    fn start_positions(&mut self, now: Instant) -> Vec<(usize, Lane)> {
        self.plan_sweeps(now);
        let mut starts = Vec::new();
        let mut free = self.config.concurrency.saturating_sub(self.running());
        let mut on_time: Vec<usize> = (0..self.kinds.len())
            .filter(|i| self.on_time_ready(*i, now))
            .collect();
        on_time.sort_by_key(|i| self.kinds[*i].on_time_at);
        for kind in on_time {
            if free == 0 {
                return starts;
            }
            let k = &mut self.kinds[kind];
            k.on_time_at = None;
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
        k.probe_at = Some(k.probe_at.map_or(at, |p| p.min(at)));
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
            Lane::OnTime => {
                k.on_time_running = k.on_time_running.saturating_sub(1);
                k.on_time_more = f.full;
                if !k.current(f.epoch) {
                    // Begun before the scan forgot where it stood: see `epoch`.
                    k.probe_at = Some(now);
                } else if f.full {
                    // Rows past its last one were not locked, whatever its start counted
                    // as held (see `look_past_window`).
                    k.covered = f.last_due;
                    // More rows in this window: the lane's last part takes the next one at
                    // once; while others run, a freed slot is the backlog's first (see
                    // `more_on_time`), or every slot would stay on time under a load the
                    // lane cannot drain.
                    if k.on_time_running == 0 {
                        k.on_time_at = Some(now);
                    }
                } else {
                    k.covered = k.covered.max(f.window_end);
                    // A later window's batch in flight looked past its own window when it
                    // started (or ends in a probe of its own). Without notifications a
                    // probe names rows others hold too: one that found none to lock
                    // looks again in a tick, not at once.
                    if k.on_time_running == 0 {
                        let idle = f.locked == 0 && !listening;
                        k.probe_at = Some(if idle { now + tick } else { now });
                    }
                }
            }
            Lane::Backlog | Lane::Sweep => {
                k.backlog_running = k.backlog_running.saturating_sub(1);
                // Begun before the scan last stood back or forgot: rows it could not see
                // may be pending, so it ends neither the drain's bound nor the backlog.
                let current = k.current(f.epoch);
                if f.untouched == 0 && current {
                    // Every row due before its last one is sent or held by an earlier
                    // batch in flight (which starts over if it leaves rows behind). A
                    // full sweep found rows behind where the scan stood: go on from them.
                    if lane == Lane::Sweep && f.full {
                        k.from = None;
                        k.backlog = true;
                        // Backlog batches in flight began further on: none may move
                        // the scan past what the sweep found.
                        if let Some(found) = f.last_due {
                            k.told(found);
                        }
                    }
                    k.advance(f.epoch, f.last_due, now);
                }
                if !f.full && current {
                    k.backlog = false;
                    // Rows held by someone else (a second active node) are not ours to
                    // spin on: look again in a tick.
                    let again = if f.locked == 0 { now + tick } else { now };
                    k.probe_at = Some(k.probe_at.map_or(again, |p| p.min(again)));
                }
            }
        }
        // Its stamp bounds nothing from now on (after `advance` used what was told since).
        k.ended(f.epoch);
        if f.untouched > 0 {
            // Rows it held are due again and no notification will say so: batches go
            // for them at once (the fresh ones on time, the others as backlog, from the
            // start), without waiting for a probe.
            k.covered = None;
            k.on_time_more = false;
            k.restart_drain();
            k.probe_at = Some(now);
            k.on_time_at = Some(now);
            k.backlog = true;
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
        k.on_time_at = None;
        k.on_time_more = false;
        k.backlog = false;
        k.restart_drain();
        k.probe_at = Some(now + delay);
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
                    k.probe_at = Some(now);
                    now
                }
            };
            k.on_time_at = Some(k.on_time_at.map_or(at, |t| t.min(at)));
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
            .flat_map(|k| [k.on_time_at, k.probe_at, k.sweep_at])
            .flatten()
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
        k.on_time_at.is_some_and(|at| at <= now) && (self.config.fresh_slots > 0 || !k.backlog)
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

/// What the firing task is to do now (see [`Pacer::actions`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Action {
    /// Start a batch.
    Batch(Planned),
    /// Ask the due index when the next rows of a kind are due.
    Probe(Probing),
}

/// A batch to start: of which kind, in which lane, over which window, and the pacer's
/// epoch of its kind (passed back in [`Finished::epoch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Planned {
    pub(crate) kind: Kind,
    pub(crate) lane: Lane,
    pub(crate) window: Window,
    pub(crate) epoch: u64,
}

/// What to probe: `kind`'s rows due at or after `from`, and its next row after `after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Probing {
    pub(crate) kind: Kind,
    pub(crate) after: Option<DateTime<Utc>>,
    pub(crate) from: Option<DateTime<Utc>>,
}

impl KindState {
    /// The next backlog batch and probe look from the start of the due index.
    fn restart_drain(&mut self) {
        self.void();
        self.from = None;
        self.sweep_at = None;
        self.sweep = false;
    }

    /// A row told of (see [`KindState::told`], which placed the scan before it) waits in
    /// the backlog: what batches and probes under way learnt is void (as after
    /// [`KindState::restart_drain`]): a backlog batch that comes back short, begun before,
    /// must not end the backlog this row is in.
    fn behind(&mut self) {
        self.backlog = true;
        self.void();
    }

    /// What every batch and probe under way learnt is void.
    fn void(&mut self) {
        self.epoch += 1;
        self.void_before = self.epoch;
        self.told.clear();
        let void_before = self.void_before;
        self.tickets.retain(|t| *t >= void_before);
    }

    /// Whether a batch or probe begun at stamp `t` may teach the scan.
    fn current(&self, t: u64) -> bool {
        t >= self.void_before
    }

    /// A row due at `due` was written (a notification): if the scan stood past it, it
    /// stands at it now, and no batch or probe begun before may move it further (see
    /// [`KindState::advance`]).
    fn told(&mut self, due: DateTime<Utc>) {
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
    fn prune(&mut self) {
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
    fn ended(&mut self, t: u64) {
        if let Some(i) = self.tickets.iter().position(|x| *x == t) {
            self.tickets.swap_remove(i);
        }
        self.prune();
    }

    /// A batch or probe begun at stamp `t` saw every row due before `to` sent or held:
    /// the scan stands there, or further, but not past a row notified since `t` (its
    /// statement may not have seen it).
    fn advance(&mut self, t: u64, to: Option<DateTime<Utc>>, now: Instant) {
        let bound = self.told.iter().find(|(s, _)| *s > t).map(|(_, due)| *due);
        let to = match (to, bound) {
            (Some(to), Some(bound)) => Some(to.min(bound)),
            (to, _) => to,
        };
        if to.is_some() {
            self.from = self.from.max(to);
            self.sweep_at = self.sweep_at.or(Some(now + BACKLOG_RESCAN));
        }
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
