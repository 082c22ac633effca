//! What goes in and out of the pacer: its configuration, the actions it plans, and
//! what the firing task tells it of the batches and probes it started.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::firing::clock::DbClock;
use crate::kind::Kind;
use crate::store::Window;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    OnTime,
    Backlog,
    /// A backlog batch from the start of the due index (see [`super::BACKLOG_RESCAN`]).
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
    /// The epoch of its kind it started with ([`Planned::epoch`]).
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
    /// The epoch of its kind it started with ([`Planned::epoch`]).
    pub(crate) epoch: u64,
}

/// What the firing task is to do now (see [`super::Pacer::actions`]).
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
