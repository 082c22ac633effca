//! What the scan remembers between batches about single rows: rows whose last message's
//! fate was unknown (sent alone next time), rows whose bookkeeping the database refused
//! (not retried for a while), and confirmed rows of batches that failed to commit (to
//! delete later, or they would fire again in a loop).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::bus::{Fate, PublishError};
use crate::kind::Kind;
use crate::store::{Fired, Settlement};

/// Rows remembered per kind of memory (suspects, rows to skip, rows to delete later):
/// beyond this the oldest are forgotten, which costs at most a second TimeOut.
const MEMORY: usize = 100_000;
/// A confirmed row that can be neither deleted nor parked is not published again by this
/// process for this long.
const STUCK_HOLD: Duration = Duration::from_secs(24 * 3600);
/// A row published alone whose fate stayed unknown this many times is charged.
const UNKNOWN_STRIKES: u8 = 2;

#[derive(Debug, Default)]
pub(crate) struct Memory(Mutex<Rows>);

#[derive(Debug, Default)]
struct Rows {
    /// Rows whose last message went out on a channel that closed before its confirm,
    /// with how often that happened while published alone: published alone next time.
    suspects: HashMap<Uuid, u8>,
    /// Rows whose bookkeeping the database refused: not retried before the instant.
    skip: HashMap<Uuid, Instant>,
    /// Confirmed rows of batches that failed to commit, with their kind: to delete.
    leftovers: Vec<(Kind, Fired)>,
}

impl Memory {
    fn rows(&self) -> MutexGuard<'_, Rows> {
        // Bookkeeping maps: a panicking holder leaves nothing half-done that matters.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the row's last message's fate was unknown: it goes alone.
    pub(crate) fn suspect(&self, id: Uuid) -> bool {
        let rows = self.rows();
        !rows.suspects.is_empty() && rows.suspects.contains_key(&id)
    }

    /// The fate of a row's message, after what is known of it: one whose fate stays
    /// unknown while published alone is the cause of its channel's closing: it fails.
    pub(crate) fn judge(&self, id: Uuid, alone: bool, fate: Fate) -> Fate {
        let Fate::Unknown(why) = fate else {
            let mut rows = self.rows();
            if !rows.suspects.is_empty() {
                rows.suspects.remove(&id);
            }
            return fate;
        };
        let mut rows = self.rows();
        let strikes = rows.suspects.entry(id).or_default();
        *strikes += u8::from(alone);
        if *strikes < UNKNOWN_STRIKES {
            if rows.suspects.len() > MEMORY {
                rows.suspects.clear();
            }
            return Fate::Unknown(why);
        }
        rows.suspects.remove(&id);
        Fate::Failed(PublishError::Channel(why))
    }

    /// Rows not to lock now.
    pub(crate) fn skipped(&self) -> Vec<Uuid> {
        let mut rows = self.rows();
        if rows.skip.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        rows.skip.retain(|_, until| *until > now);
        rows.skip.keys().copied().collect()
    }

    /// Confirmed rows not yet deleted: [`Memory::take_leftovers`] hands them back.
    pub(crate) fn remember_later(&self, kind: Kind, fired: Vec<Fired>) {
        if fired.is_empty() {
            return;
        }
        let mut rows = self.rows();
        rows.leftovers.extend(fired.into_iter().map(|f| (kind, f)));
        rows.leftovers.truncate(MEMORY);
    }

    pub(crate) fn take_leftovers(&self) -> Vec<(Kind, Fired)> {
        std::mem::take(&mut self.rows().leftovers)
    }

    /// Act on what the settle could not do the fast way (`fired`: the confirmed rows it
    /// was given): log parked rows, keep busy ones for a later delete, hold back rows
    /// whose bookkeeping could not be written (for `retry` if it was a charge).
    pub(crate) fn settled(
        &self,
        kind: Kind,
        settled: &Settlement,
        fired: &[Fired],
        retry: Duration,
    ) {
        for (id, why) in &settled.parked {
            tracing::error!(%id, "{why}; parked (it will not fire again; delete it by hand)");
        }
        if !settled.later.is_empty() {
            let later = fired.iter().filter(|f| settled.later.contains(&f.id));
            self.remember_later(kind, later.copied().collect());
        }
        if settled.stuck.is_empty() && settled.uncharged.is_empty() {
            return;
        }
        let mut rows = self.rows();
        let now = Instant::now();
        for (id, why) in &settled.stuck {
            tracing::error!(%id, "delivered, but the row can be neither deleted nor parked \
                ({why}); this node will not publish it again");
            rows.skip.insert(*id, now + STUCK_HOLD);
        }
        for (id, why) in &settled.uncharged {
            tracing::error!(%id, "cannot record the failure of this row: {why}");
            rows.skip.insert(*id, now + retry);
        }
        if rows.skip.len() > MEMORY {
            rows.skip.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unknown() -> Fate {
        Fate::Unknown("channel closed".into())
    }

    #[test]
    fn a_row_whose_fate_stays_unknown_while_alone_fails_and_is_forgotten() {
        let m = Memory::default();
        let id = Uuid::new_v4();
        assert!(matches!(m.judge(id, false, unknown()), Fate::Unknown(_)));
        assert!(m.suspect(id));
        assert!(matches!(m.judge(id, true, unknown()), Fate::Unknown(_)));
        assert!(matches!(
            m.judge(id, true, unknown()),
            Fate::Failed(PublishError::Channel(_))
        ));
        assert!(!m.suspect(id));
    }

    #[test]
    fn a_confirmed_suspect_is_forgotten() {
        let m = Memory::default();
        let id = Uuid::new_v4();
        m.judge(id, false, unknown());
        assert!(matches!(
            m.judge(id, true, Fate::Confirmed),
            Fate::Confirmed
        ));
        assert!(!m.suspect(id));
    }
}
