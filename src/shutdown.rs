//! Waiting that gives way to a stop request.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Sleep unless stopped first; false when stopped.
pub(crate) async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}
