//! Start, supervise, stop: a daemon is five tasks — the node task (`node`: the election
//! and the broker connection), the firing task (`scan`: firing while active), the
//! delayed-message ingress (`ingress`, every node), the HTTP server (`http`) and the
//! pending gauges' counter (`status::count_pending`, on a connection of its own while
//! active) — each
//! given the narrow context it uses. The supervisor watches them all: when one ends before a stop was asked (a panic, a bug), the others are
//! stopped — the node task announces `leaving`, so the group does not wait for a node that
//! cannot fire — and the daemon exits non-zero for the orchestrator to restart it.
//!
//! A stop is bounded whatever the peers do (see `shutdown`): the supervisor notices the
//! request, closes the pools to new connections (so that every connection the tasks drop
//! from then on is closed, not tested with a round trip and kept), then tells the tasks;
//! it aborts what has not ended when the grace is spent and closes the connections within
//! what is left.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::bus::{Bus, BusError};
use crate::config::Settings;
use crate::console;
use crate::election::{LeaseView, Role};
use crate::fence::{self, Fence};
use crate::firing::{self, Firing};
use crate::health::Health;
use crate::http;
use crate::ingress::{self, Intake};
use crate::metrics::Metrics;
use crate::node::{Node, NodeLoop};
pub use crate::shutdown::Exit;
use crate::shutdown::{Stopping, sleep_or_stop};
use crate::status::{self, Snapshot, Status};
use crate::store::{self, Store};
use crate::telemetry::Chain;

/// A running daemon.
pub struct Handle {
    pub node_id: Uuid,
    pub role: watch::Receiver<Role>,
    pub status: Arc<Status>,
    /// Where `/healthz`, `/readyz` and `/status` are served.
    pub http_addr: SocketAddr,
    /// Asks the supervisor for a stop.
    asked: CancellationToken,
    join: JoinHandle<Exit>,
}

impl Handle {
    /// Ask for a graceful stop and wait for it.
    pub async fn stop(self) -> Exit {
        self.asked.cancel();
        self.join.await.unwrap_or(Exit::Failed)
    }

    /// Wait until the daemon ends by itself (lag exit, failure) or is stopped through the
    /// token.
    pub async fn wait(self) -> Exit {
        self.join.await.unwrap_or(Exit::Failed)
    }

    pub fn snapshot(&self) -> Snapshot {
        self.status.snapshot()
    }
}

/// The tasks of a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    Node,
    Firing,
    Fence,
    Http,
    Ingress,
    PendingCounts,
}

/// Start a daemon: bind HTTP, migrate (if configured, retrying while the database is
/// down), then run the tasks until `shutdown` is cancelled.
pub async fn start(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<Handle> {
    // The supervisor hears the request; the tasks hear it from the supervisor, once it
    // has closed the pools to new connections (see the module's doc).
    let asked = shutdown.child_token();
    let stop = CancellationToken::new();
    let stopping = Stopping::new(&settings.shutdown);
    let node_id = Uuid::new_v4();
    let settings = Arc::new(settings);
    let store = Store::connect_as(&settings.postgres, &store::session_name(node_id))?;
    // A node starts passive: its first checks and counts share one connection too, until
    // the firing task sets the role's way (see `Store::acquire`).
    store.lean(true);
    let observer = Store::observer(&settings.postgres, &format!("timeoutd-{node_id}-observe"))?;
    let health = Arc::new(Health::default());
    let metrics = Arc::new(Metrics::new(&settings.election.group, node_id));
    let status = Arc::new(Status::new(
        &settings,
        node_id,
        health.clone(),
        metrics.clone(),
    ));
    let limits = http::Limits {
        max_per_client: settings.http.max_connections_per_client as usize,
        lifetime: settings.http.connection_lifetime,
        exempt_loopback: settings.http.exempt_loopback,
    };
    let console = settings
        .console
        .enabled
        .then(|| console::routes(&settings, node_id, status.clone(), metrics.clone()));
    let serving = if console.is_some() {
        "serving /healthz /readyz /status /metrics /console"
    } else {
        "serving /healthz /readyz /status /metrics"
    };
    let (http_addr, http) = http::bind(
        settings.http_listen()?,
        limits,
        status.clone(),
        console,
        stop.clone(),
    )
    .await
    .with_context(|| format!("binding http.listen {}", settings.http.listen))?;
    tracing::info!(%http_addr, "{serving}");
    let (role_tx, role_rx) = watch::channel(Role::Passive);
    let (lease_tx, lease_rx) = watch::channel(LeaseView::none(Instant::now()));
    let (bus_tx, bus_rx) = watch::channel(None::<Arc<Bus>>);
    let (departed_tx, departed_rx) = mpsc::channel(fence::DEPARTED_QUEUE);
    let fence = Fence {
        settings: settings.clone(),
        node_id,
        store: store.clone(),
        role: role_rx.clone(),
        status: status.clone(),
        metrics: metrics.clone(),
        departed: departed_rx,
        stop: stop.clone(),
    };
    let node = Node {
        settings: settings.clone(),
        node_id,
        status: status.clone(),
        metrics: metrics.clone(),
        health: health.clone(),
        bus: bus_tx,
        lease: lease_tx,
        role: role_tx,
        departed: departed_tx,
        stop: stop.clone(),
        stopping: stopping.clone(),
    };
    let intake = settings.delay.enabled.then(|| Intake {
        settings: settings.clone(),
        store: store.clone(),
        bus: bus_rx.clone(),
        status: status.clone(),
        metrics: metrics.clone(),
        stop: stop.clone(),
    });
    let firing = Firing {
        limits: firing::Limits::new(&settings),
        memory: firing::Memory::default(),
        settings: settings.clone(),
        node_id,
        store: store.clone(),
        bus: bus_rx.clone(),
        lease: lease_rx,
        metrics: metrics.clone(),
        status: status.clone(),
        health,
        stop: stop.clone(),
        stopping: stopping.clone(),
    };
    tracing::info!(node_id = %node_id, group = %settings.election.group, "starting");
    let tasks = Tasks {
        node,
        firing,
        fence,
        http,
        intake,
        observer,
        role: role_rx.clone(),
        metrics,
    };
    let stops = Stops {
        asked: asked.clone(),
        stop,
        stopping,
    };
    let join = tokio::spawn(supervise(settings, store, bus_rx, tasks, stops));
    Ok(Handle {
        node_id,
        role: role_rx,
        status,
        http_addr,
        asked,
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
    /// The pending gauges' connection while active (see `status::Counting`).
    observer: Store,
    role: watch::Receiver<Role>,
    metrics: Arc<Metrics>,
}

/// The stop as the supervisor sees it.
struct Stops {
    /// Cancelled by whoever asks for the stop (a signal, `Handle::stop`).
    asked: CancellationToken,
    /// Cancelled by the supervisor alone: what the tasks stop on.
    stop: CancellationToken,
    stopping: Arc<Stopping>,
}

impl Stops {
    /// Start the stop: note when, close the pools to new connections, tell the tasks.
    fn begin(&self, stores: &[Store]) {
        self.stopping.asked();
        for store in stores {
            store.close_now();
        }
        self.stop.cancel();
    }
}

/// The tasks running, by id: a task that panicked tells nothing else about itself.
type Running = Vec<(tokio::task::Id, Task)>;

async fn supervise(
    settings: Arc<Settings>,
    store: Store,
    bus: watch::Receiver<Option<Arc<Bus>>>,
    tasks: Tasks,
    stops: Stops,
) -> Exit {
    let mut set = JoinSet::new();
    let mut running = Running::new();
    let http = tasks.http;
    let task = set.spawn(async move { (Task::Http, http.run().await.map(|()| Exit::Stopped)) });
    running.push((task.id(), Task::Http));
    let stores = [store.clone(), tasks.observer.clone()];
    let by = format!("node {}", tasks.firing.node_id);
    if settings.postgres.migrate_on_start && !migrate(&settings, &by, &store, &stops, &stores).await
    {
        return finish(set, running, &stores, &bus, &stops.stopping, Exit::Stopped).await;
    }
    let (node, firing) = (tasks.node, tasks.firing);
    let task = set.spawn(async move { (Task::Node, Ok(NodeLoop::new(node).run().await)) });
    running.push((task.id(), Task::Node));
    let task = set.spawn(async move {
        firing::run(Arc::new(firing)).await;
        (Task::Firing, Ok(Exit::Stopped))
    });
    running.push((task.id(), Task::Firing));
    let fence = tasks.fence;
    let task = set.spawn(async move {
        fence::fence_loop(fence).await;
        (Task::Fence, Ok(Exit::Stopped))
    });
    running.push((task.id(), Task::Fence));
    if let Some(intake) = tasks.intake {
        let task = set.spawn(async move {
            ingress::ingress_loop(intake).await;
            (Task::Ingress, Ok(Exit::Stopped))
        });
        running.push((task.id(), Task::Ingress));
    }
    let counting = status::Counting {
        observer: tasks.observer,
        pool: store.clone(),
        role: tasks.role,
    };
    let (metrics, counted, halt) = (tasks.metrics, settings.clone(), stops.stop.clone());
    let task = set.spawn(async move {
        status::count_pending(metrics, counting, counted, halt).await;
        (Task::PendingCounts, Ok(Exit::Stopped))
    });
    running.push((task.id(), Task::PendingCounts));
    let exit = first_to_end(&mut set, &stops, &stores).await;
    finish(set, running, &stores, &bus, &stops.stopping, exit).await
}

/// Wait for a stop request or the first task to end, say what that means for the daemon,
/// and begin the stop.
async fn first_to_end(
    set: &mut JoinSet<(Task, std::io::Result<Exit>)>,
    stops: &Stops,
    stores: &[Store],
) -> Exit {
    // A task's end is kept in the set when the request wins: `finish` still sees it.
    let ended = tokio::select! {
        biased;
        _ = stops.asked.cancelled() => None,
        ended = set.join_next() => ended,
    };
    let stopping = stops.asked.is_cancelled();
    stops.begin(stores);
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

/// The tasks give up at the end of the grace themselves, and say what they gave up; this
/// much later the supervisor aborts whatever has not ended.
const GIVE_UP_SLACK: Duration = Duration::from_millis(50);

/// Join the tasks within the stop's grace (the node task announces `leaving`, the scan
/// task finishes or gives up its batches), abort the rest, close the connections within
/// what is left, and tell once what was given up.
async fn finish(
    mut set: JoinSet<(Task, std::io::Result<Exit>)>,
    mut running: Running,
    stores: &[Store],
    bus: &watch::Receiver<Option<Arc<Bus>>>,
    stopping: &Stopping,
    exit: Exit,
) -> Exit {
    let mut exit = exit;
    let until = stopping.grace_until() + GIVE_UP_SLACK;
    let joined = tokio::time::timeout_at(until.into(), async {
        while let Some(ended) = set.join_next_with_id().await {
            let id = ended.as_ref().map_or_else(|e| e.id(), |(id, _)| *id);
            running.retain(|(task, _)| *task != id);
            match ended {
                Ok((_, (Task::Node, Ok(Exit::Lagging)))) => exit = Exit::Lagging,
                Err(_) => exit = Exit::Failed,
                Ok(_) => {}
            }
        }
    })
    .await;
    if joined.is_err() {
        set.abort_all();
        for (_, task) in &running {
            match owed(*task) {
                Some(what) => stopping.abandon(what),
                None => tracing::debug!(?task, "aborted at the end of the stop's grace"),
            }
        }
    }
    close(stores, bus, stopping).await;
    let abandoned = stopping.abandoned();
    if !abandoned.is_empty() {
        tracing::error!(
            ?abandoned,
            "gave up on what did not end within shutdown.grace (connections: within \
             shutdown.timeout): exiting non-zero"
        );
        if exit == Exit::Stopped {
            exit = Exit::Abandoned;
        }
    }
    tracing::info!(?exit, "stopped");
    exit
}

/// What a task still running at the end of the grace leaves undone, if a stop owes it.
fn owed(task: Task) -> Option<&'static str> {
    match task {
        Task::Node => Some("the node task (announcing `leaving`)"),
        Task::Firing => Some("the firing task (its batches in flight)"),
        Task::Ingress => Some(
            "the delay ingress (storing, acknowledging or closing its channel): what it did \
             not acknowledge is delivered again",
        ),
        // Requests under way, a fencing statement, a count: nothing a stop promises.
        Task::Http | Task::Fence | Task::PendingCounts => None,
    }
}

/// Close the broker connection and the pools, within the stop's bounds.
async fn close(stores: &[Store], bus: &watch::Receiver<Option<Arc<Bus>>>, stopping: &Stopping) {
    let until = stopping.close_until().into();
    let last_bus = bus.borrow().clone();
    let closing_bus = async {
        match &last_bus {
            Some(bus) => bus.close().await,
            None => Ok(()),
        }
    };
    let closing_pools = futures_util::future::join_all(stores.iter().map(Store::close));
    let (bus_closed, pools_closed) = tokio::join!(
        tokio::time::timeout_at(until, closing_bus),
        tokio::time::timeout_at(until, closing_pools),
    );
    match bus_closed {
        Err(_) | Ok(Err(BusError::Timeout { .. })) => {
            stopping.abandon("closing the RabbitMQ connection (no answer in time)")
        }
        // Gone already: nothing left to close.
        Ok(Err(e)) => tracing::debug!(error = %Chain(&e), "RabbitMQ connection closed already"),
        Ok(Ok(())) => {}
    }
    if pools_closed.is_err() {
        // Also a connection given back before the stop and still being tested by the
        // pool (a round trip): nothing of ours rides on it, but it did not close.
        stopping.abandon("closing the Postgres connections (not all closed in time)");
    }
}

/// Apply the migrations, retrying with backoff while the database is unreachable. False
/// when a stop was asked first: a migration cut short is rolled back with its session,
/// and applied at the next start.
async fn migrate(
    settings: &Settings,
    by: &str,
    store: &Store,
    stops: &Stops,
    stores: &[Store],
) -> bool {
    let mut backoff = Backoff::new(settings.backoff.min, settings.backoff.max);
    loop {
        // Dropped only after the stop has begun, so its connection is closed, not tested.
        let migrating = store.migrate_for(settings, by);
        tokio::pin!(migrating);
        let migrated = tokio::select! {
            _ = stops.asked.cancelled() => None,
            migrated = &mut migrating => Some(migrated),
        };
        match migrated {
            None => {
                stops.begin(stores);
                return false;
            }
            Some(Ok(())) => return true,
            Some(Err(e)) => {
                let delay = backoff.next_delay();
                tracing::error!(error = %Chain(&e), retry_in = ?delay, "migrations failed");
                if !sleep_or_stop(&stops.asked, delay).await {
                    stops.begin(stores);
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops() -> Stops {
        Stops {
            asked: CancellationToken::new(),
            stop: CancellationToken::new(),
            stopping: Stopping::new(&crate::config::Shutdown {
                grace: Duration::from_millis(500),
                timeout: Duration::from_secs(1),
            }),
        }
    }

    /// A node task that runs until stopped, as the real one does.
    fn node_until_stopped(set: &mut JoinSet<(Task, std::io::Result<Exit>)>, stops: &Stops) {
        let stop = stops.stop.clone();
        set.spawn(async move {
            stop.cancelled().await;
            (Task::Node, Ok(Exit::Stopped))
        });
    }

    #[tokio::test]
    async fn a_panicking_task_stops_the_node_and_fails_the_daemon() {
        let stops = stops();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stops);
        set.spawn(async { panic!("firing task bug") });
        assert_eq!(first_to_end(&mut set, &stops, &[]).await, Exit::Failed);
        assert!(stops.stop.is_cancelled(), "the node task is told to leave");
    }

    #[tokio::test]
    async fn a_task_that_ends_on_its_own_fails_the_daemon() {
        let stops = stops();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stops);
        set.spawn(async { (Task::Firing, Ok(Exit::Stopped)) });
        assert_eq!(first_to_end(&mut set, &stops, &[]).await, Exit::Failed);
        assert!(stops.stop.is_cancelled());
    }

    #[tokio::test]
    async fn a_requested_stop_and_a_lag_exit_are_not_failures() {
        let stops = stops();
        let mut set = JoinSet::new();
        node_until_stopped(&mut set, &stops);
        stops.asked.cancel();
        assert_eq!(first_to_end(&mut set, &stops, &[]).await, Exit::Stopped);
        assert!(stops.stop.is_cancelled(), "the request reaches the tasks");
        let stops = self::stops();
        let mut set = JoinSet::new();
        set.spawn(async { (Task::Node, Ok(Exit::Lagging)) });
        assert_eq!(first_to_end(&mut set, &stops, &[]).await, Exit::Lagging);
    }

    /// A task that cannot even give up in time is aborted at the end of the grace and
    /// named, if the stop owes what it was doing; the daemon then exits non-zero.
    #[tokio::test]
    async fn a_task_that_outlives_the_grace_is_abandoned() {
        let stops = stops();
        let mut set = JoinSet::new();
        let stuck = set.spawn(async {
            std::future::pending::<()>().await;
            (Task::Firing, Ok(Exit::Stopped))
        });
        let idle = set.spawn(async {
            std::future::pending::<()>().await;
            (Task::Fence, Ok(Exit::Stopped))
        });
        let running = vec![(stuck.id(), Task::Firing), (idle.id(), Task::Fence)];
        stops.asked.cancel();
        assert_eq!(first_to_end(&mut set, &stops, &[]).await, Exit::Stopped);
        let (_, bus) = watch::channel(None);
        let began = Instant::now();
        let exit = finish(set, running, &[], &bus, &stops.stopping, Exit::Stopped).await;
        assert_eq!(exit, Exit::Abandoned);
        assert!(
            began.elapsed() < Duration::from_secs(1),
            "{:?}",
            began.elapsed()
        );
        assert_eq!(
            stops.stopping.abandoned(),
            ["the firing task (its batches in flight)"]
        );
    }
}
