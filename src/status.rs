//! What a node knows about itself, for `/status`, readiness, liveness and the tests: the
//! status snapshot the tasks update, their heartbeats, and the metrics.

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::admission::RejectedCount;
use crate::config::Settings;
use crate::election::Role;
use crate::metrics::Metrics;
use crate::store::{Store, TABLES};

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
    /// Announcements that did not count (no proof of membership, replays, junk).
    pub rejected_announcements: RejectedCount,
    pub bus_connected: bool,
    pub database_ok: Option<bool>,
    pub last_scan: Option<ScanStatus>,
    pub fired_total: u64,
    /// The delayed-message ingress (absent with `delay.enabled = false`).
    pub ingress: Option<IngressStatus>,
}

/// What the ingress task reports.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct IngressStatus {
    pub queue: String,
    /// Consuming now (false while the broker or the database is away).
    pub consuming: bool,
    /// Delayed messages this node stored since it started.
    pub stored_total: u64,
    pub last_error: Option<String>,
}

/// What the HTTP probes and `/status` read: the snapshot, loop heartbeats, the store.
pub struct Probe {
    started: Instant,
    status: RwLock<Snapshot>,
    pub(crate) node_beat: AtomicU64,
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
    pub(crate) fn new(settings: &Settings, node_id: Uuid, store: Store) -> Self {
        let s = settings;
        Self {
            started: Instant::now(),
            status: RwLock::new(Snapshot::starting(node_id, &s.election.group)),
            node_beat: AtomicU64::new(0),
            scan_beat: AtomicU64::new(0),
            stall_after: 2
                * (s.amqp.connect_timeout + s.postgres.statement_timeout + s.backoff.max),
            tick: s.election.tick,
            store,
            metrics: Metrics::new(&s.election.group, node_id),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        self.status
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut Snapshot)) {
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
        for table in TABLES {
            let counts =
                tokio::time::timeout(PROBE_TIMEOUT, self.store.counts(table, self.tick)).await;
            match counts {
                Ok(Ok(c)) => self.metrics.set_pending(table.kind(), c),
                _ => return false,
            }
        }
        true
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

impl Snapshot {
    fn starting(node_id: Uuid, group: &str) -> Self {
        Self {
            node_id,
            group: group.to_owned(),
            role: Role::Passive,
            settled: false,
            candidate: true,
            failing_checks: Vec::new(),
            lowest: node_id,
            members: Vec::new(),
            rejected_announcements: RejectedCount::default(),
            bus_connected: false,
            database_ok: None,
            last_scan: None,
            fired_total: 0,
            ingress: None,
        }
    }
}
