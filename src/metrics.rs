//! Prometheus metrics in the text exposition format. Hand-rolled: a handful of atomics and
//! two fixed-bucket histograms, every series labelled with the group and the node id.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use uuid::Uuid;

use crate::store::PendingCounts;

/// Scan durations: a batch is milliseconds when healthy, seconds when the database stalls.
const SCAN_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Lateness of a TimeOut after its deadline: the default tick is 250 ms.
const LATENESS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Counters keyed by a label value (`reason`, `kind`).
#[derive(Debug, Default)]
struct Labelled(Mutex<BTreeMap<&'static str, u64>>);

impl Labelled {
    fn inc(&self, key: &'static str, by: u64) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default() += by;
    }

    fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.iter().map(|(k, v)| (*k, *v)).collect()
    }
}

/// The daemon's metrics.
#[derive(Debug)]
pub struct Metrics {
    labels: String,
    pub active: AtomicU64,
    pub candidate: AtomicU64,
    pub members: AtomicU64,
    pub role_changes: AtomicU64,
    pub announcements_sent: AtomicU64,
    received: Labelled,
    rejected: Labelled,
    pub fired: AtomicU64,
    pub parked: AtomicU64,
    publish_failures: Labelled,
    scan_duration: Histogram,
    lateness: Histogram,
    pub amqp_connected: AtomicU64,
    pending: [AtomicI64; 4],
}

impl Metrics {
    pub fn new(group: &str, node: Uuid) -> Self {
        let group = group.replace('\\', "\\\\").replace('"', "\\\"");
        Self {
            labels: format!("group=\"{group}\",node_id=\"{node}\""),
            active: AtomicU64::new(0),
            candidate: AtomicU64::new(1),
            members: AtomicU64::new(0),
            role_changes: AtomicU64::new(0),
            announcements_sent: AtomicU64::new(0),
            received: Labelled::default(),
            rejected: Labelled::default(),
            fired: AtomicU64::new(0),
            parked: AtomicU64::new(0),
            publish_failures: Labelled::default(),
            scan_duration: Histogram::new(SCAN_BUCKETS),
            lateness: Histogram::new(LATENESS_BUCKETS),
            amqp_connected: AtomicU64::new(0),
            pending: Default::default(),
        }
    }

    pub fn received(&self, kind: &'static str) {
        self.received.inc(kind, 1);
    }

    pub fn rejected(&self, reason: &'static str) {
        self.rejected.inc(reason, 1);
    }

    pub fn publish_failed(&self, reason: &'static str) {
        self.publish_failures.inc(reason, 1);
    }

    pub fn scanned(&self, duration: Duration, lateness: &[Duration]) {
        self.scan_duration.observe(duration);
        lateness.iter().for_each(|l| self.lateness.observe(*l));
        self.fired
            .fetch_add(lateness.len() as u64, Ordering::Relaxed);
    }

    pub fn set_pending(&self, c: PendingCounts) {
        for (gauge, v) in self
            .pending
            .iter()
            .zip([c.pending, c.due, c.overdue, c.failing])
        {
            gauge.store(v, Ordering::Relaxed);
        }
    }

    /// The exposition text; `postgres_ok` is measured by the caller at scrape time.
    pub fn render(&self, postgres_ok: bool) -> String {
        let mut out = String::with_capacity(4096);
        let l = &self.labels;
        let gauges = [
            (
                "timeoutd_active",
                "1 if this node is the active one",
                self.active.load(Ordering::Relaxed),
            ),
            (
                "timeoutd_candidate",
                "0 while this node is withdrawn (own checks failing or lagging)",
                self.candidate.load(Ordering::Relaxed),
            ),
            (
                "timeoutd_members",
                "live members in this node's view",
                self.members.load(Ordering::Relaxed),
            ),
            (
                "timeoutd_amqp_connected",
                "1 while connected to RabbitMQ",
                self.amqp_connected.load(Ordering::Relaxed),
            ),
            (
                "timeoutd_postgres_connected",
                "1 if Postgres answered at scrape time",
                u64::from(postgres_ok),
            ),
        ];
        for (name, help, v) in gauges {
            header(&mut out, name, help, "gauge");
            let _ = writeln!(out, "{name}{{{l}}} {v}");
        }
        let counters = [
            (
                "timeoutd_role_changes_total",
                "role changes of this node",
                &self.role_changes,
            ),
            (
                "timeoutd_announcements_sent_total",
                "announcements sent",
                &self.announcements_sent,
            ),
            (
                "timeoutd_timeouts_fired_total",
                "TimeOuts confirmed and their rows deleted",
                &self.fired,
            ),
            (
                "timeoutd_rows_parked_total",
                "rows whose TimeOut was confirmed but that could not be deleted (parked)",
                &self.parked,
            ),
        ];
        for (name, help, v) in counters {
            header(&mut out, name, help, "counter");
            let _ = writeln!(out, "{name}{{{l}}} {}", v.load(Ordering::Relaxed));
        }
        self.render_labelled(&mut out);
        self.render_pending(&mut out);
        self.scan_duration.render(
            &mut out,
            "timeoutd_scan_duration_seconds",
            "duration of scan batches that locked rows",
            l,
        );
        self.lateness.render(
            &mut out,
            "timeoutd_fire_lateness_seconds",
            "fire time minus deadline of each TimeOut",
            l,
        );
        out
    }

    fn render_labelled(&self, out: &mut String) {
        let l = &self.labels;
        let families = [
            (
                "timeoutd_announcements_received_total",
                "announcements accepted, by kind",
                "kind",
                &self.received,
            ),
            (
                "timeoutd_announcements_rejected_total",
                "announcements dropped, by reason",
                "reason",
                &self.rejected,
            ),
            (
                "timeoutd_publish_failures_total",
                "TimeOuts not confirmed, by reason",
                "reason",
                &self.publish_failures,
            ),
        ];
        for (name, help, label, values) in families {
            header(out, name, help, "counter");
            for (k, v) in values.snapshot() {
                let _ = writeln!(out, "{name}{{{l},{label}=\"{k}\"}} {v}");
            }
        }
    }

    fn render_pending(&self, out: &mut String) {
        let names = [
            ("timeoutd_pending_total", "expectations in the table"),
            ("timeoutd_pending_due", "rows due but not yet fired"),
            (
                "timeoutd_pending_overdue",
                "rows due for longer than a tick",
            ),
            (
                "timeoutd_pending_failing",
                "rows whose publish failed (attempts > 0)",
            ),
        ];
        for ((name, help), v) in names.iter().zip(&self.pending) {
            header(out, name, help, "gauge");
            let _ = writeln!(
                out,
                "{name}{{{}}} {}",
                self.labels,
                v.load(Ordering::Relaxed)
            );
        }
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
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
        ] {
            assert!(text.contains(&line), "missing {line}\n{text}");
        }
    }
}
