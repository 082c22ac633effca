//! The daemon's Prometheus metrics, kept by the Prometheus project's Rust client
//! (`prometheus-client`) and exposed in the OpenMetrics text format. Every series carries
//! the labels `group` and `node_id`; the fields are private: the tasks call methods named
//! after the events they count.

use std::borrow::Cow;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use uuid::Uuid;

use crate::store::PendingCounts;

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Scan durations: a batch is milliseconds when healthy, seconds when the database stalls.
const SCAN_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Lateness of a TimeOut after its deadline: the default tick is 250 ms.
const LATENESS_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
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
    announcements_sent: Counter,
    received: Family<KindLabel, Counter>,
    rejected: Family<ReasonLabel, Counter>,
    fired: Counter,
    parked: Counter,
    publish_failures: Family<ReasonLabel, Counter>,
    scan_duration: Histogram,
    lateness: Histogram,
    pending: [Gauge; 4],
}

impl Metrics {
    pub fn new(group: &str, node: Uuid) -> Self {
        let labels = [
            (Cow::Borrowed("group"), Cow::Owned(group.to_owned())),
            (Cow::Borrowed("node_id"), Cow::Owned(node.to_string())),
        ];
        let mut m = Self {
            registry: Registry::with_prefix_and_labels("timeoutd", labels.into_iter()),
            active: Gauge::default(),
            candidate: Gauge::default(),
            members: Gauge::default(),
            amqp_connected: Gauge::default(),
            postgres_connected: Gauge::default(),
            role_changes: Counter::default(),
            announcements_sent: Counter::default(),
            received: Family::default(),
            rejected: Family::default(),
            fired: Counter::default(),
            parked: Counter::default(),
            publish_failures: Family::default(),
            scan_duration: Histogram::new(SCAN_BUCKETS),
            lateness: Histogram::new(LATENESS_BUCKETS),
            pending: Default::default(),
        };
        m.candidate.set(1);
        m.register();
        m
    }

    fn register(&mut self) {
        let r = &mut self.registry;
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
            "1 if Postgres answered at scrape time",
            self.postgres_connected.clone(),
        );
        r.register(
            "role_changes",
            "role changes of this node",
            self.role_changes.clone(),
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
            "TimeOuts not confirmed, by reason",
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
            ("pending_total", "expectations in the table"),
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

    pub fn publish_failed(&self, reason: &'static str) {
        self.publish_failures
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub fn parked(&self, rows: usize) {
        self.parked.inc_by(rows as u64);
    }

    /// One batch that locked rows: its duration and the lateness of each fired row.
    pub fn scanned(&self, duration: Duration, lateness: &[Duration]) {
        self.scan_duration.observe(duration.as_secs_f64());
        lateness
            .iter()
            .for_each(|l| self.lateness.observe(l.as_secs_f64()));
        self.fired.inc_by(lateness.len() as u64);
    }

    pub fn set_pending(&self, c: PendingCounts) {
        for (gauge, v) in self
            .pending
            .iter()
            .zip([c.pending, c.due, c.overdue, c.failing])
        {
            gauge.set(v);
        }
    }

    /// The exposition text; `postgres_ok` is measured by the caller at scrape time.
    pub fn render(&self, postgres_ok: bool) -> String {
        self.postgres_connected.set(i64::from(postgres_ok));
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_labels_and_cumulative_buckets() {
        let m = Metrics::new("g\"x", Uuid::nil());
        m.received("probe");
        m.rejected("malformed");
        m.publish_failed("returned");
        m.scanned(
            Duration::from_millis(3),
            &[Duration::from_millis(7), Duration::from_secs(2)],
        );
        let text = m.render(true);
        let labels = r#"group="g\"x",node_id="00000000-0000-0000-0000-000000000000""#;
        for line in [
            format!("timeoutd_timeouts_fired_total{{{labels}}} 2"),
            format!("timeoutd_announcements_received_total{{{labels},kind=\"probe\"}} 1"),
            format!("timeoutd_publish_failures_total{{{labels},reason=\"returned\"}} 1"),
            format!("timeoutd_fire_lateness_seconds_bucket{{{labels},le=\"0.01\"}} 1"),
            format!("timeoutd_fire_lateness_seconds_bucket{{{labels},le=\"2.5\"}} 2"),
            format!("timeoutd_fire_lateness_seconds_count{{{labels}}} 2"),
            format!("timeoutd_postgres_connected{{{labels}}} 1"),
            format!("timeoutd_candidate{{{labels}}} 1"),
        ] {
            assert!(text.contains(&line), "missing {line}\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
