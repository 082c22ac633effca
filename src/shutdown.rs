//! How a daemon ends, and waiting that gives way to a stop request.
//!
//! A stop is bounded whatever the peers do. What waits on a peer — the batches in
//! flight (their confirms and commit), the `leaving` announcement, the delay ingress'
//! last acknowledgements — has until `shutdown.grace` after the stop was asked; closing
//! the connections has until half of what `shutdown.timeout` leaves after that (the other
//! half is the process' margin to exit, which `timeoutd run` enforces). What is not done
//! in time is given up, named in one log line, and the daemon exits non-zero.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config;

/// Sleep unless stopped first; false when stopped.
pub(crate) async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// How the daemon ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Stopped on request (SIGTERM/SIGINT or `Handle::stop`).
    Stopped,
    /// Stopped on request, but gave up on something the stop waits for (a batch in
    /// flight, the `leaving` announcement, closing a connection): it was not done within
    /// the stop's bounds.
    Abandoned,
    /// Its own announcements lagged past `election.max_lag_exit`: restart it.
    Lagging,
    /// A task of the daemon failed (panicked or ended on its own): restart it.
    Failed,
}

/// The bounds of one stop, and what it gave up on. Shared by the supervisor and the tasks
/// that wait on peers while stopping (the node's `leaving`, the scan's batches).
#[derive(Debug)]
pub(crate) struct Stopping {
    grace: Duration,
    timeout: Duration,
    /// When the stop was asked: set by the first to notice (the supervisor, as a rule;
    /// they all notice within one scheduling round).
    asked: OnceLock<Instant>,
    abandoned: Mutex<Vec<String>>,
}

impl Stopping {
    pub(crate) fn new(settings: &config::Shutdown) -> Arc<Self> {
        Arc::new(Self {
            grace: settings.grace,
            timeout: settings.timeout,
            asked: OnceLock::new(),
            abandoned: Mutex::new(Vec::new()),
        })
    }

    /// When the stop was asked: now, unless someone noticed it before.
    pub(crate) fn asked(&self) -> Instant {
        *self.asked.get_or_init(Instant::now)
    }

    /// Until when what waits on a peer may go on.
    pub(crate) fn grace_until(&self) -> Instant {
        self.asked() + self.grace
    }

    /// Until when the connections may take to close: half of what `timeout` leaves after
    /// the grace, the other half being the margin for the process to exit.
    pub(crate) fn close_until(&self) -> Instant {
        self.grace_until() + self.timeout.saturating_sub(self.grace) / 2
    }

    /// Give `what` up: told once, with the rest, when the daemon has stopped.
    pub(crate) fn abandon(&self, what: impl Into<String>) {
        self.list().push(what.into());
    }

    /// What the stop gave up on so far.
    pub(crate) fn abandoned(&self) -> Vec<String> {
        self.list().clone()
    }

    /// A list of strings: a panicking holder cannot leave it inconsistent.
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.abandoned.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounds_count_from_the_first_notice() {
        let s = Stopping::new(&config::Shutdown {
            grace: Duration::from_millis(500),
            timeout: Duration::from_secs(1),
        });
        let asked = s.asked();
        assert_eq!(s.asked(), asked, "later notices keep the first instant");
        assert_eq!(s.grace_until(), asked + Duration::from_millis(500));
        assert_eq!(s.close_until(), asked + Duration::from_millis(750));
        assert!(s.abandoned().is_empty());
        s.abandon("a batch");
        assert_eq!(s.abandoned(), ["a batch"]);
    }
}
