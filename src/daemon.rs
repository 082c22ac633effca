//! Wires the election, the bus, the store and the scan together: supervision of the broker
//! connection, the announcement loop, the scan loop, and graceful shutdown.
//!
//! Two tasks share the election behind a std mutex (held for microseconds, never across
//! an await): the node loop feeds it ticks and announcements and carries out its
//! outputs; the scan loop asks it for the lease right before publishing and committing.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use anyhow::Context;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::Consumer;
use lapin::message::Delivery;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::announcement::Announcement;
use crate::backoff::Backoff;
use crate::bus::Bus;
use crate::config::Settings;
use crate::election::{Election, Lease, Output, Role};
use crate::health::{Check, Health};
use crate::http;
use crate::metrics::Metrics;
use crate::scheduler;
use crate::store::Store;
use crate::telemetry::LogLimiter;

/// How the daemon ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Stopped on request (SIGTERM/SIGINT or `Handle::stop`).
    Stopped,
    /// Its own announcements lagged past `election.max_lag_exit`: restart it.
    Lagging,
}

/// A member as `/status` and `members` show it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MemberStatus {
    pub node_id: Uuid,
    pub last_seen_ms: u128,
    pub active: bool,
    pub probing: bool,
    pub withdrawn: bool,
}

/// The last scan batch that locked rows.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ScanStatus {
    pub at: DateTime<Utc>,
    pub duration_ms: f64,
    pub fired: usize,
    pub failed: usize,
}

/// What the node knows about itself, for `/status`, readiness and tests.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Snapshot {
    pub node_id: Uuid,
    pub group: String,
    pub role: Role,
    pub settled: bool,
    /// False while withdrawn (own checks failing, or lagging): not electable.
    pub candidate: bool,
    /// This node's own checks that are failing now (see `health`).
    pub failing_checks: Vec<&'static str>,
    pub lowest: Uuid,
    pub members: Vec<MemberStatus>,
    pub bus_connected: bool,
    pub database_ok: Option<bool>,
    pub last_scan: Option<ScanStatus>,
    pub fired_total: u64,
}

/// What the HTTP probes and `/status` read: the snapshot, loop heartbeats, the store.
pub struct Probe {
    started: Instant,
    status: RwLock<Snapshot>,
    node_beat: AtomicU64,
    pub(crate) scan_beat: AtomicU64,
    stall_after: Duration,
    /// "Overdue" in the pending gauges means due for longer than this.
    tick: Duration,
    store: Store,
    pub metrics: Metrics,
}

/// Bound on the database round trips of `/readyz` and `/metrics`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl Probe {
    pub fn snapshot(&self) -> Snapshot {
        self.status
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        f(&mut self.status.write().unwrap_or_else(|e| e.into_inner()));
    }

    pub(crate) fn beat(&self, which: &AtomicU64) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        which.store(ms, Ordering::Relaxed);
    }

    /// Liveness: `Some(reason)` when a loop has not made progress for too long.
    pub fn stalled(&self) -> Option<String> {
        let now = self.started.elapsed();
        for (name, beat) in [("node", &self.node_beat), ("scan", &self.scan_beat)] {
            let since = now.saturating_sub(Duration::from_millis(beat.load(Ordering::Relaxed)));
            if since > self.stall_after {
                return Some(format!("{name} loop made no progress for {since:?}"));
            }
        }
        None
    }

    /// Refresh the pending gauges (bounded); false when Postgres did not answer.
    pub async fn refresh_pending(&self) -> bool {
        let counts =
            tokio::time::timeout(PROBE_TIMEOUT, self.store.pending_counts(self.tick)).await;
        match counts {
            Ok(Ok(c)) => {
                self.metrics.set_pending(c);
                true
            }
            _ => false,
        }
    }

    /// Readiness: `Some(reason)` unless connected to both services and settled.
    pub async fn not_ready(&self) -> Option<String> {
        let s = self.snapshot();
        if !s.bus_connected {
            return Some("rabbitmq: not connected".into());
        }
        if let Err(e) = self.store.ping(PROBE_TIMEOUT).await {
            return Some(format!("postgres: {e}"));
        }
        if !s.candidate {
            return Some(format!(
                "election: withdrawn (failing: {})",
                s.failing_checks.join(", ")
            ));
        }
        if !s.settled {
            return Some("election: settling".into());
        }
        None
    }
}

/// A running daemon.
pub struct Handle {
    pub node_id: Uuid,
    pub role: watch::Receiver<Role>,
    pub probe: Arc<Probe>,
    /// Where `/healthz`, `/readyz` and `/status` are served.
    pub http_addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    join: JoinHandle<Exit>,
}

impl Handle {
    /// Ask for a graceful stop and wait for it.
    pub async fn stop(self) -> Exit {
        self.shutdown.cancel();
        self.join.await.unwrap_or(Exit::Stopped)
    }

    /// Wait until the daemon ends by itself (lag exit) or is stopped through the token.
    pub async fn wait(self) -> Exit {
        self.join.await.unwrap_or(Exit::Stopped)
    }

    pub fn snapshot(&self) -> Snapshot {
        self.probe.snapshot()
    }
}

/// Everything both loops share.
pub(crate) struct Shared {
    pub(crate) settings: Settings,
    pub(crate) node_id: Uuid,
    pub(crate) election: Mutex<Election>,
    pub(crate) role: watch::Sender<Role>,
    pub(crate) bus: watch::Sender<Option<Arc<Bus>>>,
    pub(crate) probe: Arc<Probe>,
    pub(crate) store: Store,
    pub(crate) health: Arc<Health>,
    pub(crate) stop: CancellationToken,
}

impl Shared {
    pub(crate) fn election(&self) -> MutexGuard<'_, Election> {
        // The election has no invariant a panicking holder could break half-way.
        self.election.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn update_status(&self, f: impl FnOnce(&mut Snapshot)) {
        self.probe.update(f);
    }

    /// Re-check the lease right before acting (see `Election::check_lease`).
    pub(crate) fn lease(&self) -> Lease {
        self.election().check_lease(Instant::now())
    }
}

/// Start a daemon: migrate (if configured, retrying while the database is down), then
/// run the node and scan loops until `shutdown` is cancelled.
pub async fn start(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<Handle> {
    let node_id = Uuid::new_v4();
    let store = Store::connect_as(&settings.postgres, &format!("timeoutd-{node_id}"))?;
    let timing = settings.timing();
    let election = Election::new(node_id, timing, Instant::now());
    let (role_tx, role_rx) = watch::channel(Role::Passive);
    let (bus_tx, _) = watch::channel(None);
    let status = RwLock::new(Snapshot {
        node_id,
        group: settings.election.group.clone(),
        role: Role::Passive,
        settled: false,
        candidate: true,
        failing_checks: Vec::new(),
        lowest: node_id,
        members: Vec::new(),
        bus_connected: false,
        database_ok: None,
        last_scan: None,
        fired_total: 0,
    });
    let s = &settings;
    let probe = Arc::new(Probe {
        started: Instant::now(),
        status,
        node_beat: AtomicU64::new(0),
        scan_beat: AtomicU64::new(0),
        stall_after: 2 * (s.amqp.connect_timeout + s.postgres.statement_timeout + s.backoff.max),
        tick: s.election.tick,
        store: store.clone(),
        metrics: Metrics::new(&settings.election.group, node_id),
    });
    let stop = shutdown.child_token();
    let http_addr = http::serve(settings.http_listen()?, probe.clone(), stop.clone())
        .await
        .with_context(|| format!("binding http.listen {}", settings.http.listen))?;
    tracing::info!(%http_addr, "serving /healthz /readyz /status");
    let shared = Arc::new(Shared {
        settings,
        node_id,
        election: Mutex::new(election),
        role: role_tx,
        bus: bus_tx,
        probe: probe.clone(),
        store,
        health: Arc::default(),
        stop: stop.clone(),
    });
    tracing::info!(node_id = %node_id, group = %shared.settings.election.group, "starting");
    let join = tokio::spawn(run(shared));
    Ok(Handle {
        node_id,
        role: role_rx,
        probe,
        http_addr,
        shutdown: stop,
        join,
    })
}

async fn run(shared: Arc<Shared>) -> Exit {
    if shared.settings.postgres.migrate_on_start && !migrate(&shared).await {
        return Exit::Stopped;
    }
    let scanner = tokio::spawn(scheduler::scan_loop(shared.clone()));
    let (exit, bus) = NodeLoop::new(shared.clone()).run().await;
    shared.stop.cancel();
    let limit = shared.settings.shutdown.timeout;
    let abort = scanner.abort_handle();
    if tokio::time::timeout(limit, scanner).await.is_err() {
        // Cannot happen with a valid configuration (a batch is bounded by
        // `batch_budget` < `shutdown.timeout`), but a stop must stay bounded.
        abort.abort();
        tracing::error!(
            ?limit,
            "scan did not stop in time: aborted, its transaction is rolled back"
        );
    }
    if let Some(bus) = bus {
        bus.close().await;
    }
    shared.store.close().await;
    tracing::info!(node_id = %shared.node_id, ?exit, "stopped");
    exit
}

/// Apply the migrations, retrying with backoff while the database is unreachable.
async fn migrate(shared: &Shared) -> bool {
    let mut backoff = Backoff::new(shared.settings.backoff.min, shared.settings.backoff.max);
    loop {
        match shared.store.migrate().await {
            Ok(()) => return true,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::error!(error = %e, retry_in = ?delay, "migrations failed");
                if !sleep_or_stop(&shared.stop, delay).await {
                    return false;
                }
            }
        }
    }
}

/// Sleep unless stopped first; false when stopped.
pub(crate) async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// At most one log line per rejection kind per this period.
const REJECT_LOG_EVERY: Duration = Duration::from_secs(10);

/// The election driver and broker supervisor.
struct NodeLoop {
    shared: Arc<Shared>,
    /// One limiter per rejection kind, so a flood of one kind cannot hide another.
    rejected: HashMap<&'static str, LogLimiter>,
    /// `sent_at` of our latest announcements: only those measure our own lag, so a
    /// forged "own" announcement with an old timestamp cannot make us withdraw or exit.
    sent: VecDeque<DateTime<Utc>>,
    exit: Option<Exit>,
}

/// Own announcements remembered for lag measurement (several intervals' worth, so a
/// late one is still recognised).
const SENT_REMEMBERED: usize = 64;

/// Why serving one connection ended.
enum Ended {
    BusLost,
    Stop,
}

impl NodeLoop {
    fn metrics(&self) -> &Metrics {
        &self.shared.probe.metrics
    }

    fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            rejected: HashMap::new(),
            sent: VecDeque::with_capacity(SENT_REMEMBERED),
            exit: None,
        }
    }

    /// Connect, serve, reconnect on loss; on stop announce `leaving`. Returns the last bus
    /// (still open, for the caller to close once the scan has stopped).
    async fn run(mut self) -> (Exit, Option<Arc<Bus>>) {
        let mut backoff = Backoff::new(
            self.shared.settings.backoff.min,
            self.shared.settings.backoff.max,
        );
        let mut first = true;
        loop {
            let Some((bus, consumer)) = self.connect(&mut backoff).await else {
                return (self.exit.unwrap_or(Exit::Stopped), None);
            };
            if first {
                tracing::info!("connected to RabbitMQ");
            } else {
                tracing::info!("reconnected to RabbitMQ: probing the group again");
                self.shared.election().bus_lost(Instant::now());
            }
            first = false;
            self.shared.health.pass(Check::Publish);
            self.shared.bus.send_replace(Some(bus.clone()));
            self.shared.update_status(|s| s.bus_connected = true);
            self.metrics().amqp_connected.store(1, Ordering::Relaxed);
            let ended = self.serve(&bus, consumer).await;
            self.shared.bus.send_replace(None);
            self.shared.update_status(|s| s.bus_connected = false);
            self.metrics().amqp_connected.store(0, Ordering::Relaxed);
            match ended {
                Ended::Stop => {
                    self.leave(&bus).await;
                    return (self.exit.unwrap_or(Exit::Stopped), Some(bus));
                }
                Ended::BusLost => {
                    self.shared.election().bus_lost(Instant::now());
                    self.apply_outputs(None).await;
                    bus.close().await;
                }
            }
        }
    }

    async fn connect(&mut self, backoff: &mut Backoff) -> Option<(Arc<Bus>, Consumer)> {
        let settings = &self.shared.settings;
        let name = format!("timeoutd {}", self.shared.node_id);
        loop {
            self.shared.probe.beat(&self.shared.probe.node_beat);
            if self.shared.stop.is_cancelled() {
                return None;
            }
            match Bus::connect(&settings.amqp, &settings.election.group, &name).await {
                Ok((bus, consumer)) => {
                    backoff.reset();
                    return Some((Arc::new(bus), consumer));
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::error!(error = %e, retry_in = ?delay, "cannot connect to RabbitMQ");
                    if !sleep_or_stop(&self.shared.stop, delay).await {
                        return None;
                    }
                }
            }
        }
    }

    async fn serve(&mut self, bus: &Bus, mut consumer: Consumer) -> Ended {
        let mut ticker = tokio::time::interval(self.shared.settings.election.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.shared.stop.cancelled() => return Ended::Stop,
                _ = ticker.tick() => {
                    if !bus.is_healthy() {
                        tracing::error!("RabbitMQ connection lost");
                        return Ended::BusLost;
                    }
                    let now = Instant::now();
                    let failing_since = self.shared.health.failing_since();
                    let mut election = self.shared.election();
                    election.observe_health(now, failing_since);
                    election.tick(now);
                }
                delivery = consumer.next() => match delivery {
                    Some(Ok(d)) => self.receive(&d),
                    Some(Err(e)) => {
                        tracing::error!(error = %e, "announcement consumer failed");
                        return Ended::BusLost;
                    }
                    None => {
                        tracing::error!("announcement consumer was cancelled");
                        return Ended::BusLost;
                    }
                },
            }
            self.shared.probe.beat(&self.shared.probe.node_beat);
            if !self.apply_outputs(Some(bus)).await {
                return Ended::BusLost;
            }
            if self.exit.is_some() {
                return Ended::Stop;
            }
        }
    }

    fn receive(&mut self, delivery: &Delivery) {
        let now = Instant::now();
        let settings = &self.shared.settings;
        let kind = delivery.properties.kind().as_ref().map(|k| k.as_str());
        let a = match Announcement::decode(kind, &delivery.data, &settings.election.group) {
            Ok(a) => a,
            Err(e) => {
                self.metrics().rejected(e.kind());
                let limiter = self
                    .rejected
                    .entry(e.kind())
                    .or_insert_with(|| LogLimiter::new(REJECT_LOG_EVERY));
                if let Some(suppressed) = limiter.allow(now) {
                    tracing::warn!(reason = e.kind(), suppressed, "dropped announcement: {e}");
                }
                return;
            }
        };
        self.metrics()
            .received(match (a.withdrawn, a.leaving, a.probe) {
                (true, _, _) => "withdrawn",
                (_, true, _) => "leaving",
                (_, _, true) => "probe",
                _ => "announce",
            });
        let mut election = self.shared.election();
        election.step(now, a.heard());
        // A withdrawn node keeps measuring: it rejoins once its lag has recovered.
        let ours = a.node_id == self.shared.node_id && self.sent.contains(&a.sent_at);
        if ours && (!a.leaving || a.withdrawn) {
            // Our own message: sent and received by this clock, so skew cannot fake lag.
            let lag = (Utc::now() - a.sent_at).to_std().unwrap_or_default();
            election.observe_own_lag(now, lag);
        }
    }

    /// Carry out what the election asks. False when an announcement could not be sent
    /// (the bus is broken).
    async fn apply_outputs(&mut self, bus: Option<&Bus>) -> bool {
        let (outputs, snapshot) = {
            let mut e = self.shared.election();
            let outputs: Vec<Output> = std::iter::from_fn(|| e.poll_output()).collect();
            (outputs, members_view(&e))
        };
        self.metrics()
            .members
            .store(snapshot.4.len() as u64, Ordering::Relaxed);
        let failing = self.shared.health.failing();
        self.shared.update_status(|s| {
            (s.role, s.settled, s.candidate, s.lowest, s.members) = snapshot;
            s.failing_checks = failing;
        });
        for output in outputs {
            if !self.apply(output, bus).await {
                return false;
            }
        }
        true
    }

    async fn apply(&mut self, output: Output, bus: Option<&Bus>) -> bool {
        match output {
            Output::Send(a) => {
                let Some(bus) = bus else { return true };
                let msg = Announcement {
                    node_id: self.shared.node_id,
                    group: self.shared.settings.election.group.clone(),
                    sent_at: Utc::now(),
                    active: a.active,
                    leaving: a.leaving,
                    probe: a.probe,
                    withdrawn: a.withdrawn,
                };
                if self.sent.len() == SENT_REMEMBERED {
                    self.sent.pop_front();
                }
                self.sent.push_back(msg.sent_at);
                if let Err(e) = bus
                    .announce(&msg, self.shared.settings.election.member_ttl)
                    .await
                {
                    tracing::error!(error = %e, "cannot announce");
                    return false;
                }
                self.metrics()
                    .announcements_sent
                    .fetch_add(1, Ordering::Relaxed);
            }
            Output::RoleChanged {
                role,
                reason,
                members,
            } => {
                let members: Vec<String> = members.iter().map(Uuid::to_string).collect();
                tracing::info!(node_id = %self.shared.node_id, %role, %reason, ?members, "role changed");
                self.shared.role.send_replace(role);
                let m = self.metrics();
                m.role_changes.fetch_add(1, Ordering::Relaxed);
                m.active
                    .store(u64::from(role == Role::Active), Ordering::Relaxed);
            }
            Output::BusSilent { for_ } => tracing::warn!(
                silent_for = ?for_,
                "heard no announcement, not even our own: the bus is broken for this node; acting alone"
            ),
            Output::Lagging { lag } => tracing::error!(
                ?lag, max_lag = ?self.shared.settings.timing().max_lag,
                "own announcements arrive too late: stepping down"
            ),
            Output::LagRecovered { lag } => tracing::info!(?lag, "announcements on time again"),
            Output::Exit { lag } => {
                tracing::error!(
                    ?lag,
                    "lagging for too long: exiting so the orchestrator restarts us"
                );
                self.exit = Some(Exit::Lagging);
            }
            Output::Candidacy { candidate, reason } => {
                let failing = self.shared.health.failing();
                if candidate {
                    tracing::info!(%reason, "rejoining: probing the group");
                } else {
                    tracing::warn!(%reason, ?failing, "withdrawn: not a candidate until fit again");
                }
                self.metrics()
                    .candidate
                    .store(u64::from(candidate), Ordering::Relaxed);
            }
        }
        true
    }

    /// Announce `leaving` so the next node takes over within a tick.
    async fn leave(&mut self, bus: &Bus) {
        self.shared.election().leave(Instant::now());
        self.apply_outputs(Some(bus)).await;
    }
}

type MembersView = (Role, bool, bool, Uuid, Vec<MemberStatus>);

fn members_view(e: &Election) -> MembersView {
    let members = e
        .members(Instant::now())
        .into_iter()
        .map(|m| MemberStatus {
            node_id: m.id,
            last_seen_ms: m.age.as_millis(),
            active: m.active,
            probing: m.probing,
            withdrawn: m.withdrawn,
        })
        .collect();
    (
        e.role(),
        e.is_settled(),
        e.is_candidate(),
        e.lowest(),
        members,
    )
}
