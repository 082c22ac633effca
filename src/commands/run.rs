//! `timeoutd run`: the daemon until SIGTERM/SIGINT.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{EXIT_ABANDONED, EXIT_LAGGING};
use crate::config::Settings;
use crate::daemon::{self, Exit};

/// The one line `timeoutd run` prints on stdout, once HTTP is bound and the node id is
/// chosen (logs go to stderr): how supervisors and tests learn who the daemon is and
/// where it serves `/status`. A documented interface (docs/operating/running.md): fields are
/// only ever added.
#[derive(Debug, Serialize)]
struct Ready<'a> {
    ready: bool,
    node_id: Uuid,
    group: &'a str,
    /// The bound address: with `http.listen` on port 0, the port the system chose.
    http_addr: SocketAddr,
    version: &'static str,
    /// The async runtime's worker threads, as it runs (`runtime.worker_threads`).
    worker_threads: usize,
}

pub async fn run(settings: Settings) -> anyhow::Result<ExitCode> {
    tracing::info!(config = ?settings, "configuration");
    let group = settings.election.group.clone();
    let limit = settings.shutdown.timeout;
    let shutdown = CancellationToken::new();
    let handle = daemon::start(settings, shutdown.clone()).await?;
    // Listen for signals before saying ready: a supervisor may stop the daemon as soon as
    // it has read the line.
    let signals = tokio::spawn(cancel_on_signal(signal_streams(), shutdown, limit));
    announce_ready(&Ready {
        ready: true,
        node_id: handle.node_id,
        group: &group,
        http_addr: handle.http_addr,
        version: env!("CARGO_PKG_VERSION"),
        worker_threads: tokio::runtime::Handle::current().metrics().num_workers(),
    });
    let exit = handle.wait().await;
    signals.abort();
    Ok(match exit {
        Exit::Stopped => ExitCode::SUCCESS,
        Exit::Abandoned => ExitCode::from(EXIT_ABANDONED),
        Exit::Lagging => ExitCode::from(EXIT_LAGGING),
        Exit::Failed => ExitCode::FAILURE,
    })
}

/// Print the ready line and flush it. A closed stdout is not the daemon's problem: it
/// keeps running and says so in the log.
fn announce_ready(ready: &Ready<'_>) {
    let line = serde_json::to_string(ready).expect("the ready line serializes");
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
        tracing::warn!(error = %e, "cannot print the ready line on stdout");
    }
}

type Signals = std::io::Result<(Signal, Signal)>;

/// SIGTERM and SIGINT, registered now (not when a task first polls them).
fn signal_streams() -> Signals {
    Ok((
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    ))
}

async fn cancel_on_signal(signals: Signals, shutdown: CancellationToken, limit: Duration) {
    let (mut term, mut int) = match signals {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM/SIGINT");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = int.recv() => tracing::info!("SIGINT: stopping"),
    }
    shutdown.cancel();
    exit_after(limit);
}

/// End the process `limit` after the stop was asked, whatever it is doing then. The stop
/// bounds every wait on its own; this is for what it cannot bound: a thread that blocks
/// (a task stuck outside an await), a runtime too starved to run the stop.
fn exit_after(limit: Duration) {
    let spawned = std::thread::Builder::new()
        .name("timeoutd-exit".into())
        .spawn(move || {
            std::thread::sleep(limit);
            tracing::error!(
                ?limit,
                "still stopping after shutdown.timeout: exiting now, abandoning what is \
                 under way"
            );
            std::process::exit(i32::from(EXIT_ABANDONED));
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the shutdown.timeout watchdog");
    }
}
