//! The daemon's Prometheus metrics, kept by the Prometheus project's Rust client
//! (`prometheus-client`) and exposed in the OpenMetrics text format. Every series carries
//! the label `group`; the node's identity, which changes at every start, is in one
//! series, `timeoutd_node_info{node_id}`, so a restart makes no other series anew. The
//! fields are private: the tasks call methods named after the events they count.
//! docs/operating/metrics.md describes every metric; a test holds it to this file.

use std::borrow::Cow;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use uuid::Uuid;

use crate::store::{Bound, IngestOutcome, Kind, PendingCounts};

/// The `result` label of a delayed message rejected over its owner's quota.
pub(crate) const OVER_QUOTA: &str = "rejected_over_quota";

/// The `kind` of expectations (see `Kind::name`).
const EXPECTATION: &str = "expectation";

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Scan durations: a batch is milliseconds when healthy, seconds when the database stalls.
const SCAN_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Lateness of a message after its due time: a held row is sent within a millisecond
/// of it, a backlog drains for seconds.
const LATENESS_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// One step of a batch (a lock query, one slot's writes, a commit): sub-millisecond when
/// healthy, seconds when the database or the broker stalls.
const STEP_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindReasonLabel {
    kind: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindStateLabel {
    kind: &'static str,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindStepLabel {
    kind: &'static str,
    step: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// Seconds from a delayed message's arrival at the ingress to its commit.
const INGEST_BUCKETS: [f64; 11] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn lateness_histogram() -> Histogram {
    Histogram::new(LATENESS_BUCKETS)
}

fn step_histogram() -> Histogram {
    Histogram::new(STEP_BUCKETS)
}

/// The daemon's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    active: Gauge,
    candidate: Gauge,
    members: Gauge,
    amqp_connected: Gauge,
    postgres_connected: Gauge,
    role_changes: Counter,
    fenced: Counter,
    announcements_sent: Counter,
    received: Family<KindLabel, Counter>,
    rejected: Family<ReasonLabel, Counter>,
    fired: Counter,
    parked: Counter,
    publish_failures: Family<KindReasonLabel, Counter>,
    scan_duration: Histogram,
    lateness: Histogram,
    pending: [Gauge; 4],
    fired_by_kind: Family<KindLabel, Counter>,
    lateness_by_kind: Histograms<KindLabel>,
    steps: Histograms<KindStepLabel>,
    pending_by_kind: Family<KindStateLabel, Gauge>,
    pending_age: Family<KindLabel, Gauge<f64, AtomicU64>>,
    /// When each kind's pending counts were last set (the start, until they are), and
    /// how old they were then.
    pending_at: Mutex<Vec<(&'static str, Instant, Duration)>>,
    ingested: Family<ResultLabel, Counter>,
    ingest_time: Histogram,
    ingress_consuming: Gauge,
    console_refused: Family<ReasonLabel, Counter>,
    notifications_dropped: Family<ReasonLabel, Counter>,
    console_actions: Family<ConsoleActionLabel, Counter>,
    /// The last counts of each kind, for the console's summary.
    pending_last: Mutex<Vec<(&'static str, PendingCounts)>>,
    /// Rows fired by this node and the sum of their lateness, by kind (the histogram
    /// keeps them too, but does not tell).
    lateness_total: Mutex<Vec<(&'static str, u64, f64)>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsoleActionLabel {
    kind: &'static str,
    action: &'static str,
    result: &'static str,
}

/// A kind's pending rows as last counted, and the lateness of what this node fired.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PendingSummary {
    pub kind: &'static str,
    #[serde(flatten)]
    pub counts: PendingCounts,
    /// How long ago they were counted (by this node or another of the group).
    pub counted_s_ago: f64,
    /// Rows this node fired, and their mean lateness.
    pub fired_here: u64,
    pub mean_lateness_s: Option<f64>,
}

impl Metrics {
    pub fn new(group: &str, node: Uuid) -> Self {
        let labels = [(Cow::Borrowed("group"), Cow::Owned(group.to_owned()))];
        let mut m = Self {
            registry: Registry::with_prefix_and_labels("timeoutd", labels.into_iter()),
            active: Gauge::default(),
            candidate: Gauge::default(),
            members: Gauge::default(),
            amqp_connected: Gauge::default(),
            postgres_connected: Gauge::default(),
            role_changes: Counter::default(),
            fenced: Counter::default(),
            announcements_sent: Counter::default(),
            received: Family::default(),
            rejected: Family::default(),
            fired: Counter::default(),
            parked: Counter::default(),
            publish_failures: Family::default(),
            scan_duration: Histogram::new(SCAN_BUCKETS),
            lateness: Histogram::new(LATENESS_BUCKETS),
            pending: Default::default(),
            fired_by_kind: Family::default(),
            lateness_by_kind: Family::new_with_constructor(lateness_histogram),
            steps: Family::new_with_constructor(step_histogram),
            pending_by_kind: Family::default(),
            pending_age: Family::default(),
            pending_at: Mutex::new(
                Kind::ALL
                    .iter()
                    .map(|t| (t.name(), Instant::now(), Duration::ZERO))
                    .collect(),
            ),
            ingested: Family::default(),
            ingest_time: Histogram::new(INGEST_BUCKETS),
            ingress_consuming: Gauge::default(),
            console_refused: Family::default(),
            notifications_dropped: Family::default(),
            console_actions: Family::default(),
            pending_last: Mutex::new(Vec::new()),
            lateness_total: Mutex::new(Vec::new()),
        };
        m.candidate.set(1);
        m.register(node);
        m
    }

    fn register(&mut self, node: Uuid) {
        let r = &mut self.registry;
        r.register(
            "node",
            "this node's id (new at every start); join on instance to name a node",
            Info::new(vec![("node_id", node.to_string())]),
        );
        r.register(
            "build",
            "the version of timeoutd this node runs",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        r.register(
            "active",
            "1 if this node is the active one",
            self.active.clone(),
        );
        r.register(
            "candidate",
            "0 while this node is withdrawn (own checks failing or lagging)",
            self.candidate.clone(),
        );
        r.register(
            "members",
            "live members in this node's view",
            self.members.clone(),
        );
        r.register(
            "amqp_connected",
            "1 while connected to RabbitMQ",
            self.amqp_connected.clone(),
        );
        r.register(
            "postgres_connected",
            "1 while this node's own statements reach Postgres (its scan's and probes' \
             last outcome)",
            self.postgres_connected.clone(),
        );
        r.register(
            "role_changes",
            "role changes of this node",
            self.role_changes.clone(),
        );
        r.register(
            "fenced_sessions",
            "database sessions of departed nodes this node ended to release their rows",
            self.fenced.clone(),
        );
        r.register(
            "announcements_sent",
            "announcements sent",
            self.announcements_sent.clone(),
        );
        r.register(
            "announcements_received",
            "announcements accepted, by kind",
            self.received.clone(),
        );
        r.register(
            "announcements_rejected",
            "announcements dropped, by reason",
            self.rejected.clone(),
        );
        r.register(
            "timeouts_fired",
            "TimeOuts confirmed and their rows deleted",
            self.fired.clone(),
        );
        r.register(
            "rows_parked",
            "rows whose TimeOut was confirmed but that could not be deleted (parked)",
            self.parked.clone(),
        );
        r.register(
            "publish_failures",
            "messages not confirmed, by kind of row and reason",
            self.publish_failures.clone(),
        );
        r.register_with_unit(
            "scan_duration",
            "duration of scan batches that locked rows",
            Unit::Seconds,
            self.scan_duration.clone(),
        );
        r.register_with_unit(
            "fire_lateness",
            "fire time minus deadline of each TimeOut",
            Unit::Seconds,
            self.lateness.clone(),
        );
        let pending = [
            ("pending", "expectations in the table"),
            ("pending_due", "rows due but not yet fired"),
            ("pending_overdue", "rows due for longer than a tick"),
            (
                "pending_failing",
                "rows whose publish failed (attempts > 0)",
            ),
        ];
        for ((name, help), gauge) in pending.into_iter().zip(&self.pending) {
            r.register(name, help, gauge.clone());
        }
        self.register_kinds();
    }

    /// The series that cover every kind of due row (expectations, delayed messages) and
    /// the delayed-message ingress.
    fn register_kinds(&mut self) {
        let r = &mut self.registry;
        r.register(
            "fired",
            "messages confirmed and their rows deleted, by kind (expectation, delayed)",
            self.fired_by_kind.clone(),
        );
        r.register_with_unit(
            "lateness",
            "publish time minus due time of each fired row, by kind",
            Unit::Seconds,
            self.lateness_by_kind.clone(),
        );
        r.register_with_unit(
            "batch_step",
            "time of each step of a batch, by kind and step: wake (timer behind a held \
             row's due time), lock (locking query), publish (one slot's writes), confirm \
             (last write to last confirm of a slot), settle (delete, charge, commit)",
            Unit::Seconds,
            self.steps.clone(),
        );
        r.register(
            "pending_rows",
            "rows by kind and state (pending, due, overdue, failing), as last counted \
             (every http.pending_refresh)",
            self.pending_by_kind.clone(),
        );
        r.register_with_unit(
            "pending_rows_age",
            "time since the pending counts of a kind were last counted (since the start \
             before the first count)",
            Unit::Seconds,
            self.pending_age.clone(),
        );
        r.register(
            "delayed_ingested",
            "delayed messages taken in, by result (stored, duplicate, held, held_not_allowed, \
             held_too_large, held_too_late, rejected_over_quota, rejected_headers_too_large, \
             rejected_headers_too_deep, rejected_too_many_headers, rejected_redelivered, \
             cancelled, arrived_cancelled, dropped)",
            self.ingested.clone(),
        );
        r.register_with_unit(
            "delayed_ingest",
            "time from a delayed message's arrival to its commit",
            Unit::Seconds,
            self.ingest_time.clone(),
        );
        r.register(
            "delayed_ingress_consuming",
            "1 while this node consumes the delay ingress queue",
            self.ingress_consuming.clone(),
        );
        r.register(
            "console_refused",
            "web console requests refused, by reason (unauthenticated, forbidden, read_only, \
             cross_site, content_type, busy, throttled, host)",
            self.console_refused.clone(),
        );
        r.register(
            "notifications_dropped",
            "notifications on timeoutd's channel the active node dropped, by reason (foreign: \
             not the trigger's; flood: over the bound a second)",
            self.notifications_dropped.clone(),
        );
        r.register(
            "console_actions",
            "web console actions taken, by kind, action and result (done: the row changed; \
             no_change: gone, or not in the state the action needs; error)",
            self.console_actions.clone(),
        );
    }

    pub fn set_active(&self, active: bool) {
        self.active.set(i64::from(active));
    }

    pub fn set_candidate(&self, candidate: bool) {
        self.candidate.set(i64::from(candidate));
    }

    pub fn set_members(&self, n: usize) {
        self.members.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_amqp_connected(&self, connected: bool) {
        self.amqp_connected.set(i64::from(connected));
    }

    pub fn fenced(&self, sessions: usize) {
        self.fenced.inc_by(sessions as u64);
    }

    pub fn role_changed(&self) {
        self.role_changes.inc();
    }

    pub fn announced(&self) {
        self.announcements_sent.inc();
    }

    pub fn received(&self, kind: &'static str) {
        self.received.get_or_create(&KindLabel { kind }).inc();
    }

    pub fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn publish_failed(&self, kind: &'static str, reason: &'static str) {
        self.publish_failures
            .get_or_create(&KindReasonLabel { kind, reason })
            .inc();
    }

    pub fn parked(&self, rows: usize) {
        self.parked.inc_by(rows as u64);
    }

    /// One batch that locked rows: its duration and the lateness of each fired row.
    /// The unlabelled TimeOut series (kept for existing dashboards) count expectations.
    pub fn scanned(&self, kind: &'static str, duration: Duration, lateness: &[Duration]) {
        self.scan_duration.observe(duration.as_secs_f64());
        let by_kind = self.lateness_by_kind.get_or_create(&KindLabel { kind });
        for l in lateness {
            by_kind.observe(l.as_secs_f64());
            if kind == EXPECTATION {
                self.lateness.observe(l.as_secs_f64());
            }
        }
        let fired = lateness.len() as u64;
        let sum: f64 = lateness.iter().map(Duration::as_secs_f64).sum();
        let mut total = self
            .lateness_total
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match total.iter_mut().find(|(k, ..)| *k == kind) {
            Some((_, n, s)) => (*n, *s) = (*n + fired, *s + sum),
            None => total.push((kind, fired, sum)),
        }
        drop(total);
        self.fired_by_kind
            .get_or_create(&KindLabel { kind })
            .inc_by(fired);
        if kind == EXPECTATION {
            self.fired.inc_by(fired);
        }
    }

    /// How long one step of a batch took (see the `batch_step` help text).
    pub fn step(&self, kind: &'static str, step: &'static str, took: Duration) {
        self.steps
            .get_or_create(&KindStepLabel { kind, step })
            .observe(took.as_secs_f64());
    }

    /// The counts of `kind`, counted `age` ago (by this node or another of the group).
    pub fn set_pending(&self, kind: &'static str, c: PendingCounts, age: Duration) {
        let mut at = self.pending_at.lock().unwrap_or_else(|e| e.into_inner());
        match at.iter_mut().find(|(k, ..)| *k == kind) {
            Some((_, when, old)) => (*when, *old) = (Instant::now(), age),
            None => at.push((kind, Instant::now(), age)),
        }
        drop(at);
        let mut last = self.pending_last.lock().unwrap_or_else(|e| e.into_inner());
        match last.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, old)) => *old = c,
            None => last.push((kind, c)),
        }
        drop(last);
        let states = [
            ("pending", c.pending),
            ("due", c.due),
            ("overdue", c.overdue),
            ("failing", c.failing),
        ];
        for (state, v) in states {
            self.pending_by_kind
                .get_or_create(&KindStateLabel { kind, state })
                .set(v);
        }
        if kind == EXPECTATION {
            for (gauge, (_, v)) in self.pending.iter().zip(states) {
                gauge.set(v);
            }
        }
    }

    /// A notification dropped (`foreign` or `flood`).
    pub fn notification_dropped(&self, reason: &'static str) {
        self.notifications_dropped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A console request refused (see the `console_refused` help text).
    pub fn console_refused(&self, reason: &'static str) {
        self.console_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A console action, and what came of it.
    pub fn console_action(&self, kind: &'static str, action: &'static str, result: &'static str) {
        self.console_actions
            .get_or_create(&ConsoleActionLabel {
                kind,
                action,
                result,
            })
            .inc();
    }

    /// Each kind's last counts (none before the first) and this node's lateness of it.
    pub fn pending_summary(&self) -> Vec<PendingSummary> {
        let at = self.pending_at.lock().unwrap_or_else(|e| e.into_inner());
        let last = self.pending_last.lock().unwrap_or_else(|e| e.into_inner());
        last.iter()
            .map(|(kind, counts)| {
                let age = at
                    .iter()
                    .find(|(k, ..)| k == kind)
                    .map_or(Duration::ZERO, |(_, when, age)| *age + when.elapsed());
                let (fired, sum) = self
                    .lateness_total
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .find(|(k, ..)| k == kind)
                    .map_or((0, 0.0), |(_, n, sum)| (*n, *sum));
                PendingSummary {
                    kind,
                    counts: *counts,
                    counted_s_ago: age.as_secs_f64(),
                    fired_here: fired,
                    mean_lateness_s: (fired > 0).then(|| sum / fired as f64),
                }
            })
            .collect()
    }

    /// One stored batch of delayed messages and how long it took from arrival.
    pub fn ingested(&self, o: &IngestOutcome, took: Duration) {
        let held = o.held_total();
        let results = [
            ("stored", o.stored - held.min(o.stored)),
            ("duplicate", o.duplicates),
            ("cancelled", o.cancelled),
            ("arrived_cancelled", o.arrived_cancelled),
            (OVER_QUOTA, o.over_quota.len() as u64),
        ]
        .into_iter()
        .chain(Bound::ALL.map(|b| (b.result(), o.held[b as usize])));
        for (result, n) in results {
            self.ingested
                .get_or_create(&ResultLabel { result })
                .inc_by(n);
        }
        self.ingest_time.observe(took.as_secs_f64());
    }

    /// One arriving delayed message over the ingress's bounds, rejected to the broker
    /// (`result`: one of `bus::Refusal`'s).
    pub fn ingress_refused(&self, result: &'static str) {
        self.ingested.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn ingest_dropped(&self) {
        self.ingested
            .get_or_create(&ResultLabel { result: "dropped" })
            .inc();
    }

    pub fn set_ingress_consuming(&self, consuming: bool) {
        self.ingress_consuming.set(i64::from(consuming));
    }

    /// The exposition text; `postgres_ok`: how the node's own statements fare.
    pub fn render(&self, postgres_ok: bool) -> String {
        self.postgres_connected.set(i64::from(postgres_ok));
        let at = self.pending_at.lock().unwrap_or_else(|e| e.into_inner());
        for (kind, when, age) in at.iter() {
            self.pending_age
                .get_or_create(&KindLabel { kind })
                .set((*age + when.elapsed()).as_secs_f64());
        }
        drop(at);
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests;
