//! What the pacer's tests and simulation ask of it besides its own interface: its
//! state by kind, and starts without a firing task.

use std::time::Instant;

use super::{Config, Lane, Locked, Pacer};
use crate::kind::Kind;
use crate::store::Window;

impl Pacer {
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// How often `kind`'s scan forgot where it stood so far: a batch started now passes
    /// it back in [`Finished::epoch`]. One that began before the scan last forgot may
    /// have skipped rows another batch held then and let go since: what it covered
    /// proves nothing.
    pub(super) fn epoch(&self, kind: Kind) -> u64 {
        self.position(kind).map_or(0, |i| self.kinds[i].epoch)
    }

    /// What a batch of `kind` in `lane` locks.
    pub(super) fn window(&self, kind: Kind, lane: Lane) -> Window {
        let from = self.position(kind).and_then(|i| self.kinds[i].from);
        self.config.window(lane, from)
    }

    /// The batches to start now, by kind and lane.
    pub(super) fn starts_one(&mut self, now: Instant) -> Vec<(Kind, Lane)> {
        let starts = self.start_positions(now);
        starts
            .into_iter()
            .map(|(i, lane)| (self.served[i], lane))
            .collect()
    }

    /// The batches to start now, each backlog batch locking at once (a full batch,
    /// leaving where the scan stands as it was), so that the next may start.
    pub(super) fn starts(&mut self, now: Instant) -> Vec<(Kind, Lane)> {
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
}
