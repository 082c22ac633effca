//! `timeoutd run`: the daemon until SIGTERM/SIGINT.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use super::EXIT_LAGGING;
use crate::config::Settings;
use crate::daemon::{self, Exit};

pub async fn run(settings: Settings) -> anyhow::Result<ExitCode> {
    tracing::info!(config = ?settings, "configuration");
    let shutdown = CancellationToken::new();
    let handle = daemon::start(settings, shutdown.clone()).await?;
    let signals = tokio::spawn(cancel_on_signal(shutdown));
    let exit = handle.wait().await;
    signals.abort();
    Ok(match exit {
        Exit::Stopped => ExitCode::SUCCESS,
        Exit::Lagging => ExitCode::from(EXIT_LAGGING),
        Exit::Failed => ExitCode::FAILURE,
    })
}

async fn cancel_on_signal(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
    }
    shutdown.cancel();
}
