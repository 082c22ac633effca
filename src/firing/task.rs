//! The firing task. While this node holds the lease it does what its [`Pacer`] says: rows
//! that come due within `scan.horizon` are locked a little ahead and each is sent at its
//! due time (by the database's clock: waking early or late never sends early); a backlog
//! of overdue rows drains oldest first, batch after batch, with a share kept for rows
//! coming due meanwhile. Postgres `NOTIFY` tells of new and moved due times; the due
//! index is probed every `scan.probe_interval` besides (every tick while the LISTEN
//! connection is down). Batches and probes run as tasks of their own, so a slow probe or
//! a slow commit never delays a held row, nor the other kinds.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::{Id, JoinError, JoinSet};

use super::Firing;
use super::batch::{self, BatchError, BatchOutcome};
use super::checks::{self, health_backoff};
use super::notice::{self, NOTICES, NoticeState, Notices};
use super::pacer::{self, Action, Finished, Locked, Pacer, Planned, Probing};
use super::report::{Summary, record};
use crate::backoff::Backoff;
use crate::bus::Bus;
use crate::election::Role;
use crate::health::Check;
use crate::kind::Kind;
use crate::store::{DelayedRow, DueRow, NextDue};
use crate::telemetry::Chain;

/// An active node that ran no batch for this long closes the connections its batches
/// opened, keeping one per kind for the probes; batches that come closer together than
/// this reuse them.
const ACTIVE_IDLE_AFTER: Duration = Duration::from_secs(10);
/// Idle connections a passive node keeps in its pool: the one its checks, the pending
/// counts and the delay ingress share (docs/operating/capacity.md).
pub(crate) const PASSIVE_CONNECTIONS: usize = 1;

/// The firing task of one node (runs for the daemon's whole life; idle while passive).
pub(crate) async fn run(firing: Arc<Firing>) {
    let settings = &firing.settings;
    let (tx, rx) = mpsc::channel(NOTICES);
    let state = Arc::new(NoticeState::default());
    let mut notices = Notices { rx, state };
    let mut lease = firing.lease.clone();
    let mut bus = firing.bus.clone();
    let mut summary = Summary::new();
    let mut checked = Instant::now();
    loop {
        firing.status.beat(&firing.status.scan_beat);
        let current = bus.borrow_and_update().clone();
        let active = lease.borrow_and_update().role == Role::Active;
        match current.filter(|_| active) {
            Some(bus) => {
                // LISTEN only while active: a passive node fires nothing, so notices are
                // no use to it, and the connection would be one more per passive node.
                // The look at every kind after LISTEN, and the pacer's probing every tick
                // until then, cover what was written before.
                firing.store.lean(false);
                tokio::spawn(write_api_rules(firing.clone()));
                let listener = tokio::spawn(notice::listen(
                    firing.clone(),
                    tx.clone(),
                    notices.state.clone(),
                ));
                active_spell(&firing, &bus, &mut notices, &mut summary).await;
                listener.abort();
                notices.state.listening.store(false, Ordering::Relaxed);
            }
            None => {
                firing.store.lean(!active);
                if !active && checked.elapsed() >= settings.election.announce_interval {
                    // A check waiting on a slow database is no reason to delay a stop.
                    tokio::select! {
                        _ = firing.stop.cancelled() => {},
                        _ = checks::check_while_passive(&firing) => {},
                    }
                    checked = Instant::now();
                }
                if !active {
                    // One connection between checks: what the ingress or the last
                    // active spell opened beyond it is closed (see `Store::trim`).
                    firing.store.trim(PASSIVE_CONNECTIONS);
                }
                // Due times announced while passive are stale once active: it probes.
                while notices.rx.try_recv().is_ok() {}
                // Wake at least every tick so the liveness heartbeat keeps moving.
                tokio::select! {
                    _ = firing.stop.cancelled() => {},
                    _ = lease.changed() => {},
                    _ = bus.changed() => {},
                    _ = tokio::time::sleep(settings.election.tick) => {},
                }
            }
        }
        if firing.stop.is_cancelled() {
            break;
        }
    }
    summary.flush();
}

/// The batches and probes under way, each with what it is (by task id: a task that
/// panicked returns nothing to tell it by, and the pacer must still hear of its end).
struct InFlight {
    batches: JoinSet<Result<BatchOutcome, BatchError>>,
    batch_of: Vec<(Id, Running)>,
    /// What batches tell as soon as they have locked their rows.
    locks: mpsc::UnboundedReceiver<LockNews>,
    tell_locked: mpsc::UnboundedSender<LockNews>,
    probes: JoinSet<Probed>,
    probe_of: Vec<(Id, Kind)>,
}

/// A batch in flight: its plan, and whether the pacer heard it locked.
struct Running {
    planned: Planned,
    lock_told: bool,
}

/// A batch locked its rows.
struct LockNews {
    task: Id,
    rows: Locked,
}

impl InFlight {
    fn new() -> Self {
        let (tell_locked, locks) = mpsc::unbounded_channel();
        Self {
            batches: JoinSet::new(),
            batch_of: Vec::new(),
            locks,
            tell_locked,
            probes: JoinSet::new(),
            probe_of: Vec::new(),
        }
    }

    /// Tell the pacer that batch `id` locked its rows (`None`: it ended without), once.
    fn locked(&mut self, pacer: &mut Pacer, id: Id, rows: Option<Locked>) {
        let Some(running) = self
            .batch_of
            .iter_mut()
            .find_map(|(task, r)| (*task == id).then_some(r))
        else {
            return;
        };
        if std::mem::replace(&mut running.lock_told, true) {
            return;
        }
        let Planned { kind, lane, .. } = running.planned;
        pacer.locked(kind, lane, Instant::now(), rows);
    }

    /// Tell the pacer of every lock reported so far (before any batch's end: a batch
    /// reports its lock before it can end).
    fn take_locks(&mut self, pacer: &mut Pacer) {
        while let Ok(news) = self.locks.try_recv() {
            self.locked(pacer, news.task, Some(news.rows));
        }
    }

    fn start(&mut self, firing: &Arc<Firing>, bus: &Arc<Bus>, action: Action) {
        match action {
            Action::Batch(planned) => {
                tracing::trace!(kind = planned.kind.name(), lane = ?planned.lane, from = ?planned.window.from, "starting a batch");
                let (firing, bus) = (firing.clone(), bus.clone());
                let (window, tell) = (planned.window, self.tell_locked.clone());
                let task = self.batches.spawn(async move {
                    let locked = move |full, last_due| {
                        if let Some(task) = tokio::task::try_id() {
                            let rows = Locked {
                                full,
                                last_due,
                                epoch: planned.epoch,
                            };
                            // The receiver lives as long as the spell: a send can only
                            // fail once nobody waits for the news.
                            let _ = tell.send(LockNews { task, rows });
                        }
                    };
                    match planned.kind {
                        Kind::Expectation => {
                            batch::run::<DueRow>(&firing, &bus, window, locked).await
                        }
                        Kind::Delayed => {
                            batch::run::<DelayedRow>(&firing, &bus, window, locked).await
                        }
                    }
                });
                let running = Running {
                    planned,
                    lock_told: false,
                };
                self.batch_of.push((task.id(), running));
            }
            // Read-only: one still under way when the spell ends is dropped.
            Action::Probe(Probing { kind, after, from }) => {
                tracing::trace!(kind = kind.name(), ?after, ?from, "probing");
                let firing = firing.clone();
                let task = self.probes.spawn(async move {
                    let next = checks::probe(&firing, kind, after, from).await;
                    Probed {
                        at: Instant::now(),
                        next,
                    }
                });
                self.probe_of.push((task.id(), kind));
            }
        }
    }
}

/// What a probe returns: when it answered, and the answer.
struct Probed {
    at: Instant,
    next: Result<NextDue, String>,
}

/// The SQL door follows the configuration that fires: each spell as the active node
/// writes its rules (destinations, bounds), if they differ from what the door has.
async fn write_api_rules(firing: Arc<Firing>) {
    let Some(rules) = &firing.limits.api_rules else {
        return;
    };
    let node = firing.node_id.to_string();
    let write = firing.store.write_api_rules(rules, &node);
    match firing.db(firing.limits.db_bound, write).await {
        Ok(true) => tracing::info!("the SQL API's rules written from this node's settings"),
        Ok(false) => {}
        Err(e) => tracing::warn!(
            error = %Chain(&e),
            "the SQL API's rules not written: expect() and schedule_delayed() keep the rules they have"
        ),
    }
}

/// What one spell as the active node keeps.
struct Spell {
    pacer: Pacer,
    backoff: Backoff,
}

/// Fire as the pacer says until the lease is lost, the broker connection changes or we
/// stop; then wait for the batches in flight (each commits or rolls back as a whole).
async fn active_spell(
    firing: &Arc<Firing>,
    bus: &Arc<Bus>,
    notices: &mut Notices,
    summary: &mut Summary,
) {
    let kinds = firing.kinds();
    let mut spell = Spell {
        pacer: Pacer::new(pacing(firing), &kinds, Instant::now()),
        backoff: health_backoff(&firing.settings),
    };
    // Probes run as tasks too: one walking many deleted index entries (seconds after a
    // large drain) holds up neither the other kinds nor the batches' starts.
    let mut in_flight = InFlight::new();
    let mut lease = firing.lease.clone();
    let mut bus_rx = firing.bus.clone();
    let mut busy_at = Instant::now();
    loop {
        firing.status.beat(&firing.status.scan_beat);
        let pacer = &mut spell.pacer;
        if !in_flight.batches.is_empty() {
            busy_at = Instant::now();
        } else if busy_at.elapsed() >= ACTIVE_IDLE_AFTER {
            // Idle: the connections the batches opened are closed; the probes' stay.
            firing.store.trim(kinds.len());
        }
        let listening = notices.state.listening.load(Ordering::Relaxed);
        pacer.listening(listening, Instant::now());
        if notices.state.lost.swap(false, Ordering::Relaxed) {
            pacer.notified(None, None, Instant::now());
        }
        if in_flight.batches.is_empty() {
            let chores = async {
                firing.settle_leftovers().await;
                checks::recheck_publish(firing).await;
            };
            // Leftovers not settled now are fired again by the next active node, as
            // they would be if this node had died: a stop does not wait on the database
            // for them.
            tokio::select! {
                _ = firing.stop.cancelled() => break,
                _ = chores => {},
            }
        }
        for action in pacer.actions(Instant::now()) {
            in_flight.start(firing, bus, action);
        }
        let wake = pacer.wake_at(Instant::now());
        tracing::trace!(in_ = ?wake.saturating_duration_since(Instant::now()), running = pacer.running(), "sleeping");
        tokio::select! {
            _ = firing.stop.cancelled() => break,
            _ = lease.changed() => if lease.borrow_and_update().role != Role::Active { break },
            // A clone of the shared receiver starts with its version unseen: only another
            // connection ends this loop, or every batch would wait for the whole drain.
            _ = bus_rx.changed() => if !still_on(&mut bus_rx, bus) { break },
            Some(joined) = in_flight.batches.join_next_with_id(), if !in_flight.batches.is_empty() => {
                finished(firing, &mut spell, summary, &mut in_flight, joined);
            }
            Some(news) = in_flight.locks.recv() => {
                in_flight.locked(&mut spell.pacer, news.task, Some(news.rows));
            }
            Some(joined) = in_flight.probes.join_next_with_id(), if !in_flight.probes.is_empty() => {
                probed(firing, &mut spell.pacer, &mut in_flight, joined);
            }
            Some(n) = notices.rx.recv() => {
                tracing::trace!(?n, "notified");
                pacer.notified(n.kind, n.due, Instant::now());
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
    }
    // The batches have until the stop's grace, should a stop come (now or while they
    // finish): each commits, or rolls back when it is dropped (its transaction with it).
    let all_ended = {
        let joined = async {
            while let Some(joined) = in_flight.batches.join_next_with_id().await {
                finished(firing, &mut spell, summary, &mut in_flight, joined);
            }
        };
        let grace_spent = async {
            firing.stop.cancelled().await;
            tokio::time::sleep_until(firing.stopping.grace_until().into()).await;
        };
        tokio::select! {
            _ = joined => true,
            _ = grace_spent => false,
        }
    };
    if !all_ended {
        abandon_batches(firing, &mut in_flight);
    }
}

fn pacing(firing: &Firing) -> pacer::Config {
    let (s, tick) = (&firing.settings.scan, firing.settings.election.tick);
    pacer::Config {
        horizon: s.horizon,
        lead: pacer::Config::lead_for(s.horizon),
        fresh: pacer::FRESH,
        concurrency: s.concurrency as usize,
        fresh_slots: s.fresh_slots as usize,
        tick,
        probe_interval: s.probe_interval.max(tick),
    }
}

/// Give up the batches still in flight when the stop's grace is spent. Whatever they
/// published without committing is published again by the next active node, with the
/// same `message_id` (the contract's "cannot know whether it was delivered").
fn abandon_batches(firing: &Firing, in_flight: &mut InFlight) {
    in_flight.batches.abort_all();
    let kinds: Vec<&str> = in_flight
        .batch_of
        .iter()
        .map(|(_, r)| r.planned.kind.name())
        .collect();
    firing.stopping.abandon(format!(
        "{} firing batch(es) in flight ({}): not known to be committed; rows they published \
         may be published again",
        kinds.len(),
        kinds.join(", ")
    ));
}

/// Whether the shared connection is still `bus` (marks the news seen).
fn still_on(rx: &mut watch::Receiver<Option<Arc<Bus>>>, bus: &Arc<Bus>) -> bool {
    rx.borrow_and_update()
        .as_ref()
        .is_some_and(|now| Arc::ptr_eq(now, bus))
}

/// The id of a joined task, whether it returned or panicked.
fn task_id<T>(joined: &Result<(Id, T), JoinError>) -> Id {
    joined.as_ref().map_or_else(|e| e.id(), |(id, _)| *id)
}

/// Take what `id` was out of `of`.
fn take<T>(of: &mut Vec<(Id, T)>, id: Id) -> Option<T> {
    let i = of.iter().position(|(task, _)| *task == id)?;
    Some(of.swap_remove(i).1)
}

/// A probe answered: tell the pacer.
fn probed(
    firing: &Firing,
    pacer: &mut Pacer,
    in_flight: &mut InFlight,
    joined: Result<(Id, Probed), JoinError>,
) {
    let Some(kind) = take(&mut in_flight.probe_of, task_id(&joined)) else {
        return;
    };
    let Probed { at, next } = match joined {
        Ok((_, probed)) => probed,
        Err(e) => {
            // A panic is a bug; the kind is probed again in a tick.
            tracing::error!(error = %e, "a probe failed");
            Probed {
                at: Instant::now(),
                next: Err(e.to_string()),
            }
        }
    };
    firing.health.record(Check::Postgres, &next);
    match next {
        Ok(next) => {
            tracing::trace!(kind = kind.name(), ?next, "probed");
            firing
                .status
                .saw_due(kind.name(), next.earliest, next.start);
            pacer.probed(kind, at, next)
        }
        Err(e) => {
            tracing::warn!(error = %e, kind = kind.name(), "cannot probe the due rows");
            firing.status.update(|s| s.database_ok = Some(false));
            pacer.probe_failed(kind, at);
        }
    }
}

/// One batch ended: record it and tell the pacer.
fn finished(
    firing: &Firing,
    spell: &mut Spell,
    summary: &mut Summary,
    in_flight: &mut InFlight,
    joined: Result<(Id, Result<BatchOutcome, BatchError>), JoinError>,
) {
    let id = task_id(&joined);
    in_flight.take_locks(&mut spell.pacer);
    in_flight.locked(&mut spell.pacer, id, None);
    let now = Instant::now();
    let Some(Running {
        planned: Planned {
            kind, lane, epoch, ..
        },
        ..
    }) = take(&mut in_flight.batch_of, id)
    else {
        return;
    };
    let (pacer, backoff) = (&mut spell.pacer, &mut spell.backoff);
    let result = match joined {
        Ok((_, result)) => result,
        Err(e) => {
            // A panic is a bug; its transaction was dropped, which rolls it back. Its rows
            // are due again: the pacer forgets what it held.
            tracing::error!(error = %e, "a firing batch failed");
            pacer.failed(kind, lane, now, backoff.next_delay());
            return;
        }
    };
    firing.health.record(Check::Postgres, &result);
    match result {
        Ok(outcome) => {
            backoff.reset();
            record(firing, kind, &outcome, summary);
            pacer.finished(
                kind,
                lane,
                now,
                Finished {
                    locked: outcome.locked,
                    full: outcome.full,
                    untouched: outcome.untouched,
                    clock: outcome.clock,
                    last_due: outcome.last_due,
                    window_end: outcome.window_end,
                    epoch,
                },
            );
        }
        Err(e) => {
            let delay = backoff.next_delay();
            if firing.stop.is_cancelled() {
                // The stop closes the pools first: a batch begun at that instant finds
                // its pool closed, which is the stop, not a failure.
                tracing::debug!(error = %Chain(&e), kind = kind.name(), "scan ended by the stop");
            } else {
                tracing::error!(error = %Chain(&e), kind = kind.name(), retry_in = ?delay, "scan failed");
            }
            firing.status.update(|s| s.database_ok = Some(false));
            pacer.failed(kind, lane, now, delay);
        }
    }
}
