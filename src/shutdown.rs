//! How a daemon ends, and waiting that gives way to a stop request.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

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
    /// Its own announcements lagged past `election.max_lag_exit`: restart it.
    Lagging,
    /// A task of the daemon failed (panicked or ended on its own): restart it.
    Failed,
}
