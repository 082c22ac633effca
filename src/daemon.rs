//! Start, supervise, stop: a daemon is five tasks — the node task (`node`: the election
//! and the broker connection), the scan task (`scheduler`: firing while active), the
//! delayed-message ingress (`ingress`, every node), the HTTP server (`http`) and the
//! pending gauges' counter (`status::count_pending`, on a connection of its own) — each
//! given the narrow context it uses. The supervisor watches them all: when one ends before a stop was asked (a panic, a bug), the others are
//! stopped — the node task announces `leaving`, so the group does not wait for a node that
//! cannot fire — and the daemon exits non-zero for the orchestrator to restart it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::bus::Bus;
use crate::config::Settings;
use crate::election::{LeaseView, Role};
use crate::fence::{self, Fence};
use crate::health::Health;
use crate::http;
use crate::ingress::{self, Intake};
use crate::node::{Node, NodeLoop};
use crate::scheduler::{self, Firing};
pub use crate::shutdown::Exit;
use crate::shutdown::sleep_or_stop;
use crate::status::{self, Probe, Snapshot};
use crate::store::{self, Store};
use crate::telemetry::Chain;

/// A running daemon.
pub struct Handle {
    pub node_id: Uuid,
    pub role: watch::Receiver<Role>,
    pub probe: Arc<Probe>,
    /// Where `/healthz`, `/readyz` and `/status` are served.
    pub http_addr: SocketAddr,
    shutdown: CancellationToken,
    join: JoinHandle<Exit>,
}

impl Handle {
    /// Ask for a graceful stop and wait for it.
    pub async fn stop(self) -> Exit {
        self.shutdown.cancel();
        self.join.await.unwrap_or(Exit::Failed)
    }

    /// Wait until the daemon ends by itself (lag exit, failure) or is stopped through the
    /// token.
    pub async fn wait(self) -> Exit {
        self.join.await.unwrap_or(Exit::Failed)
    }

    pub fn snapshot(&self) -> Snapshot {
        self.probe.snapshot()
    }
}

/// The tasks of a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    Node,
    Scan,
    Fence,
    Http,
    Ingress,
    PendingCounts,
}

/// Start a daemon: bind HTTP, migrate (if configured, retrying while the database is
/// down), then run the tasks until `shutdown` is cancelled.
pub async fn start(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<Handle> {
    let node_id = Uuid::new_v4();
    let settings = Arc::new(settings);
    let store = Store::connect_as(&settings.postgres, &store::session_name(node_id))?;
    let observer = Store::observer(&settings.postgres, &format!("timeoutd-{node_id}-observe"))?;
    let health = Arc::new(Health::default());
    let probe = Arc::new(Probe::new(&settings, node_id, health.clone()));
    let stop = shutdown.child_token();
    let limits = http::Limits {
        max_per_client: settings.http.max_connections_per_client as usize,
        lifetime: settings.http.connection_lifetime,
    };
    let (http_addr, http) =
        http::bind(settings.http_listen()?, limits, probe.clone(), stop.clone())
            .await
            .with_context(|| format!("binding http.listen {}", settings.http.listen))?;
    tracing::info!(%http_addr, "serving /healthz /readyz /status /metrics");
    let (role_tx, role_rx) = watch::channel(Role::Passive);
    let (lease_tx, lease_rx) = watch::channel(LeaseView::none(Instant::now()));
    let (bus_tx, bus_rx) = watch::channel(None::<Arc<Bus>>);
    let (departed_tx, departed_rx) = mpsc::channel(fence::DEPARTED_QUEUE);
    let fence = Fence {
        settings: settings.clone(),
        node_id,
        store: store.clone(),
        role: role_rx.clone(),
        probe: probe.clone(),
        departed: departed_rx,
        stop: stop.clone(),
    };
    let node = Node {
        settings: settings.clone(),
        node_id,
        probe: probe.clone(),
        health: health.clone(),
        bus: bus_tx,
        lease: lease_tx,
        role: role_tx,
        departed: departed_tx,
        stop: stop.clone(),
    };
    let intake = settings.delay.enabled.then(|| Intake {
        settings: settings.clone(),
        store: store.clone(),
        bus: bus_rx.clone(),
        probe: probe.clone(),
        stop: stop.clone(),
    });
    let firing = Firing {
        settings: settings.clone(),
        node_id,
        store: store.clone(),
        bus: bus_rx.clone(),
        lease: lease_rx,
        probe: probe.clone(),
        health,
        stop: stop.clone(),
    };
    tracing::info!(node_id = %node_id, group = %settings.election.group, "starting");
    let tasks = Tasks {
        node,
        firing,
        fence,
        http,
        intake,
        observer,
        probe: probe.clone(),
    };
    let join = tokio::spawn(supervise(settings, store, bus_rx, tasks, stop.clone()));
    Ok(Handle {
        node_id,
        role: role_rx,
        probe,
        http_addr,
        shutdown: stop,
        join,
    })
}

/// What the supervisor starts.
struct Tasks {
    node: Node,
    firing: Firing,
    fence: Fence,
    http: http::Server,
    /// The delayed-message ingress, unless `delay.enabled = false`.
    intake: Option<Intake>,
    /// The pending gauges' connection (see `Store::observer`).
    observer: Store,
    probe: Arc<Probe>,
}

async fn supervise(
    settings: Arc<Settings>,
    store: Store,
    bus: watch::Receiver<Option<Arc<Bus>>>,
    tasks: Tasks,
    stop: CancellationToken,
) -> Exit {
    let mut set = JoinSet::new();
    set.spawn(async move { (Task::Http, tasks.http.run().await.map(|()| Exit::Stopped)) });
    let stores = [store.clone(), tasks.observer.clone()];
    if settings.postgres.migrate_on_start && !migrate(&settings, &store, &stop).await {
        return finish(set, &settings, &stores, &bus, Exit::Stopped).await;
    }
    let (node, firing) = (tasks.node, tasks.firing);
    set.spawn(async move { (Task::Node, Ok(NodeLoop::new(node).run().await)) });
    set.spawn(async move {
        scheduler::scan_loop(Arc::new(firing)).await;
        (Task::Scan, Ok(Exit::Stopped))
    });
    let fence = tasks.fence;
    set.spawn(async move {
        fence::fence_loop(fence).await;
        (Task::Fence, Ok(Exit::Stopped))
    });
    if let Some(intake) = tasks.intake {
        set.spawn(async move {
            ingress::ingress_loop(intake).await;
            (Task::Ingress, Ok(Exit::Stopped))
        });
    }
    let (probe, observer, counting, halt) =
        (tasks.probe, tasks.observer, settings.clone(), stop.clone());
    set.spawn(async move {
        status::count_pending(probe, observer, counting, halt).await;
        (Task::PendingCounts, Ok(Exit::Stopped))
    });
    let exit = first_to_end(&mut set, &stop).await;
    finish(set, &settings, &stores, &bus, exit).await
}

/// Wait for the first task to end and say what that means for the daemon.
async fn first_to_end(
    set: &mut JoinSet<(Task, std::io::Result<Exit>)>,
    stop: &CancellationToken,
) -> Exit {
    let ended = set.join_next().await;
    let stopping = stop.is_cancelled();
    stop.cancel();
    match ended {
        Some(Ok((Task::Node, Ok(exit)))) if stopping || exit == Exit::Lagging => exit,
        Some(Ok((_, Ok(_)))) if stopping => Exit::Stopped,
        Some(Ok((task, Ok(_)))) => {
            tracing::error!(?task, "task ended on its own: stopping the node");
            Exit::Failed
        }
        Some(Ok((task, Err(e)))) => {
            tracing::error!(?task, error = %Chain(&e), "task failed: stopping the node");
            Exit::Failed
        }
        Some(Err(e)) => {
            tracing::error!(error = %e, "task panicked: stopping the node");
            Exit::Failed
        }
        None => Exit::Stopped,
    }
}

/// Join the other tasks within `shutdown.timeout` (the node task announces `leaving`, the
/// scan task finishes its batch), then close the connections.
async fn finish(
    mut set: JoinSet<(Task, std::io::Result<Exit>)>,
    settings: &Settings,
    stores: &[Store],
    bus: &watch::Receiver<Option<Arc<Bus>>>,
    exit: Exit,
) -> Exit {
    let limit = settings.shutdown.timeout;
    let joined = tokio::time::timeout(limit, async {
        let mut exit = exit;
        while let Some(ended) = set.join_next().await {
            if let Ok((Task::Node, Ok(Exit::Lagging))) = ended {
                exit = Exit::Lagging;
            }
            if ended.is_err() {
                exit = Exit::Failed;
            }
        }
        exit
    })
    .await;
    let exit = joined.unwrap_or_else(|_| {
        // Cannot happen with a valid configuration (a batch is bounded by
        // `batch_budget` < `shutdown.timeout`), but a stop must stay bounded.
        tracing::error!(?limit, "tasks did not stop in time: aborted");
        exit
    });
    set.abort_all();
    let last_bus = bus.borrow().clone();
    if let Some(bus) = last_bus {
        bus.close().await;
    }
    for store in stores {
        store.close().await;
    }
    tracing::info!(?exit, "stopped");
    exit
}

/// Apply the migrations, retrying with backoff while the database is unreachable.
async fn migrate(settings: &Settings, store: &Store, stop: &CancellationToken) -> bool {
    let mut backoff = Backoff::new(settings.backoff.min, settings.backoff.max);
    loop {
        match store.migrate().await {
            Ok(()) => return true,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::error!(error = %Chain(&e), retry_in = ?delay, "migrations failed");
                if !sleep_or_stop(stop, delay).await {
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node task that runs until stopped, as the real one does.
    fn node_until_stopped(
        set: &mut JoinSet<(Task, std::io::Result<Exit>)>,
        stop: &CancellationToken,
    ) {
        let stop = stop.clone();
        set.spawn(async move {
            stop.cancelled().await;
            (Task::Node, Ok(Exit::Stopped))
        });
    }

    #[tokio::test]
    async fn a_panicking_task_stops_the_node_and_fails_the_daemon() {
        let stop = CancellationToken::new();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stop);
        set.spawn(async { panic!("scan task bug") });
        assert_eq!(first_to_end(&mut set, &stop).await, Exit::Failed);
        assert!(stop.is_cancelled(), "the node task is told to leave");
    }

    #[tokio::test]
    async fn a_task_that_ends_on_its_own_fails_the_daemon() {
        let stop = CancellationToken::new();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stop);
        set.spawn(async { (Task::Scan, Ok(Exit::Stopped)) });
        assert_eq!(first_to_end(&mut set, &stop).await, Exit::Failed);
        assert!(stop.is_cancelled());
    }

    #[tokio::test]
    async fn a_requested_stop_and_a_lag_exit_are_not_failures() {
        let stop = CancellationToken::new();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stop);
        stop.cancel();
        assert_eq!(first_to_end(&mut set, &stop).await, Exit::Stopped);
        let mut set = JoinSet::new();
        set.spawn(async { (Task::Node, Ok(Exit::Lagging)) });
        assert_eq!(
            first_to_end(&mut set, &CancellationToken::new()).await,
            Exit::Lagging
        );
    }
}
