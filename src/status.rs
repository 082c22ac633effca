//! What a node knows about itself, for `/status`, readiness, liveness and the tests: the
//! status snapshot the tasks update, their heartbeats, their health, and the metrics.
//!
//! Observing reads only what is here: no HTTP request waits for, or takes, a database
//! connection (contract section 8, "Observing cannot harm"). The one thing observers
//! want from the database, the pending counts, is refreshed by [`count_pending`], one
//! task (on a connection of its own while the node is active), from the counts the group
//! shares (see `Store::shared_counts`), and cached in the metrics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::admission::RejectedCount;
use crate::config::Settings;
use crate::election::Role;
use crate::health::{Check, Health, Standing};
use crate::metrics::Metrics;
use crate::shutdown::sleep_or_stop;
use crate::store::{Kind, PendingCounts, Store, StoreError, bounded};
use crate::telemetry::{Chain, LogLimiter};

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
    /// Why it could not consume, since it last did.
    pub last_error: Option<String>,
}

/// What the HTTP probes and `/status` read: the snapshot, loop heartbeats, the health
/// the node's own tasks report, the metrics. Nothing that reaches out.
pub struct Status {
    started: Instant,
    status: RwLock<Snapshot>,
    pub(crate) node_beat: AtomicU64,
    pub(crate) scan_beat: AtomicU64,
    stall_after: Duration,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    /// The earliest due row of each kind, as the scan last probed it.
    due_seen: RwLock<Vec<DueSeen>>,
}

/// A kind's earliest due row (held rows aside), as this node's scan last saw it: only
/// the active node probes often; another's is as old as `seen_at` says.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DueSeen {
    pub kind: &'static str,
    /// `None`: nothing pending (or only held rows).
    pub earliest_due: Option<DateTime<Utc>>,
    /// The database clock when it was probed.
    pub seen_at: DateTime<Utc>,
}

impl Status {
    pub(crate) fn new(
        settings: &Settings,
        node_id: Uuid,
        health: Arc<Health>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let s = settings;
        Self {
            started: Instant::now(),
            status: RwLock::new(Snapshot::starting(node_id, s)),
            node_beat: AtomicU64::new(0),
            scan_beat: AtomicU64::new(0),
            stall_after: 2
                * (s.amqp.connect_timeout + s.postgres.statement_timeout + s.backoff.max),
            health,
            metrics,
            due_seen: RwLock::default(),
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

    /// Readiness: `Some(reason)` unless connected to RabbitMQ, the node's own statements
    /// reach Postgres (as its scan and probes last found: never a round trip of its
    /// own), consuming the delay ingress (when enabled), a candidate and settled. The
    /// ingress counts for readiness only, not for the election: every node consumes it,
    /// and what stops one (an old exchange in the way) stops them all, which must not
    /// stop the TimeOuts too.
    pub fn not_ready(&self) -> Option<String> {
        let s = self.snapshot();
        if !s.bus_connected {
            return Some("rabbitmq: not connected".into());
        }
        match self.health.standing(Check::Postgres) {
            Standing::Passing => {}
            Standing::Failing(for_) => {
                return Some(format!(
                    "postgres: the node's statements fail or do not answer (for {:.1}s)",
                    for_.as_secs_f64()
                ));
            }
            Standing::Untried => return Some("postgres: not reached yet".into()),
        }
        if let Some(i) = s.ingress.as_ref().filter(|i| !i.consuming) {
            return Some(match &i.last_error {
                Some(e) => format!("delay ingress {}: not consuming: {e}", i.queue),
                None => format!("delay ingress {}: not consuming yet", i.queue),
            });
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

    /// The scan probed `kind`: its earliest due row is `earliest` seconds from `start`
    /// (see `store::NextDue`).
    pub(crate) fn saw_due(&self, kind: &'static str, earliest: Option<f64>, start: DateTime<Utc>) {
        let earliest_due = earliest.map(|s| {
            chrono::Duration::from_std(Duration::from_secs_f64(s.abs().min(1e10)))
                .ok()
                .and_then(|d| {
                    if s < 0.0 {
                        start.checked_sub_signed(d)
                    } else {
                        start.checked_add_signed(d)
                    }
                })
                .unwrap_or(DateTime::<Utc>::MIN_UTC)
        });
        let seen = DueSeen {
            kind,
            earliest_due,
            seen_at: start,
        };
        let mut all = self.due_seen.write().unwrap_or_else(|e| e.into_inner());
        match all.iter_mut().find(|d| d.kind == kind) {
            Some(d) => *d = seen,
            None => all.push(seen),
        }
    }

    /// What [`Status::saw_due`] last recorded, per kind.
    pub fn due_seen(&self) -> Vec<DueSeen> {
        self.due_seen
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The exposition text, from cached values only.
    pub fn metrics_text(&self) -> String {
        let postgres_ok = self.health.standing(Check::Postgres) == Standing::Passing;
        self.metrics.render(postgres_ok)
    }
}

/// At most one log line per this period about counts that cannot be had.
const COUNT_LOG_EVERY: Duration = Duration::from_secs(60);

/// Where the pending gauges count: on the active node, `observer` (one connection of
/// its own, see `Store::observer`), so that counting never takes a connection the firing
/// needs; on a passive node, which fires nothing, the node's own pool, lean then (see
/// `Store::acquire`): the one connection its checks keep open anyway
/// (docs/operating/capacity.md). The observer's connection is then closed.
pub(crate) struct Counting {
    pub(crate) observer: Store,
    pub(crate) pool: Store,
    pub(crate) role: watch::Receiver<Role>,
}

impl Counting {
    /// The store to count on now, and whether it is the pool.
    fn store(&self) -> (&Store, bool) {
        if *self.role.borrow() == Role::Active {
            (&self.observer, false)
        } else {
            self.observer.trim(0);
            (&self.pool, true)
        }
    }

    /// Resolves when the node becomes active (never if the role is no longer published).
    async fn activated(&self) {
        let mut role = self.role.clone();
        if role.wait_for(|r| *r == Role::Active).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The pending gauges' task: every `http.pending_refresh`, count each table in turn (see
/// [`Counting`] for on which connection), each count bounded like any statement of the
/// node, and cache the counts in the metrics. "Overdue" means due for longer than a
/// tick. A failure leaves the last counts, whose age the metrics show.
pub(crate) async fn count_pending(
    metrics: Arc<Metrics>,
    counting: Counting,
    settings: Arc<Settings>,
    stop: CancellationToken,
) {
    let (every, late) = (settings.http.pending_refresh, settings.election.tick);
    let limit = settings.db_bound();
    let mut quiet = LogLimiter::new(COUNT_LOG_EVERY);
    loop {
        for kind in Kind::ALL {
            let counted = loop {
                let (store, on_pool) = counting.store();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    // Once active, the pool's connections are the firing's: a count
                    // begun there while passive is given up and made again on the
                    // observer's (the statement ends on the server within its bound,
                    // then the connection goes back to the pool, which has room for it).
                    _ = counting.activated(), if on_pool => continue,
                    c = bounded(limit, group_counts(store, kind, late, every)) => break c,
                }
            };
            match counted {
                Ok(Some((c, age))) => metrics.set_pending(kind.name(), c, age),
                Ok(None) => {}
                Err(e) => {
                    if let Some(suppressed) = quiet.allow(Instant::now()) {
                        tracing::warn!(error = %Chain(&e), kind = kind.name(), suppressed, "cannot count the pending rows for the gauges");
                    }
                }
            }
        }
        if !sleep_or_stop(&stop, every).await {
            return;
        }
    }
}

/// The group's shared counts (see `Store::shared_counts`): what another node counted
/// less than `fresh` ago, else counted here. Where they cannot be shared (a role without
/// the grants on `pending_counts` of SECURITY.md), counted here alone.
async fn group_counts(
    store: &Store,
    kind: Kind,
    late: Duration,
    fresh: Duration,
) -> Result<Option<(PendingCounts, Duration)>, StoreError> {
    match store.shared_counts(kind, late, fresh).await {
        Err(StoreError::Db(sqlx::Error::Database(e)))
            if e.code().as_deref()
                == Some(crate::store::sqlstate::code::INSUFFICIENT_PRIVILEGE) =>
        {
            Ok(Some((store.counts(kind, late).await?, Duration::ZERO)))
        }
        other => other,
    }
}

impl Snapshot {
    fn starting(node_id: Uuid, s: &Settings) -> Self {
        Self {
            node_id,
            group: s.election.group.clone(),
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
            // Present from the start, so that readiness waits for it.
            ingress: s.delay.enabled.then(|| IngressStatus {
                queue: s.delay_exchange(),
                ..IngressStatus::default()
            }),
        }
    }
}
