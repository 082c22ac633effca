//! What a finished batch tells the status, the health, the metrics and the logs.

use std::time::{Duration, Instant};

use chrono::Utc;

use super::Firing;
use super::batch::BatchOutcome;
use crate::health::Check;
use crate::kind::Kind;
use crate::status::ScanStatus;
use crate::telemetry::Chain;

/// How often the per-batch activity is summarised at info level.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);

/// What a finished batch of `kind` tells the status, the health, the metrics and the
/// logs.
pub(super) fn record(firing: &Firing, kind: Kind, outcome: &BatchOutcome, summary: &mut Summary) {
    firing.status.update(|s| s.database_ok = Some(true));
    // Stopping, a node hands its role over on purpose: rows it held are the next
    // active node's, nothing an operator must look at.
    let stopping = firing.stop.is_cancelled();
    if outcome.lease_lost && outcome.fired + outcome.failed == 0 {
        if stopping {
            tracing::info!(locked = outcome.locked, "stopping: batch rolled back");
        } else {
            tracing::warn!(locked = outcome.locked, "lease lost: batch rolled back");
        }
        return;
    }
    if outcome.lease_lost {
        if stopping {
            tracing::info!(
                untouched = outcome.untouched,
                "stopping: the rows held and not yet due are left to the next active node"
            );
        } else {
            tracing::warn!(
                untouched = outcome.untouched,
                "lease lost while rows were held: the rest left unsent"
            );
        }
    }
    if outcome.locked == 0 {
        return;
    }
    match &outcome.bus_trouble {
        Some(e) => {
            tracing::warn!(error = %Chain(e), untouched = outcome.untouched, "publishing failed under the batch");
            firing.health.fail(Check::Publish, Instant::now());
        }
        None => firing.health.pass(Check::Publish),
    }
    let metrics = &firing.metrics;
    for (step, took) in &outcome.steps {
        metrics.step(kind.name(), step.name(), *took);
    }
    metrics.parked(outcome.parked);
    metrics.scanned(kind.name(), outcome.duration, &outcome.lateness);
    outcome
        .failure_reasons
        .iter()
        .for_each(|r| metrics.publish_failed(kind.name(), r));
    tracing::debug!(
        fired = outcome.fired, failed = outcome.failed, duration = ?outcome.duration,
        steps = ?outcome.steps, "fired batch"
    );
    summary.add(outcome);
    firing.status.update(|s| {
        s.fired_total += outcome.fired as u64;
        s.last_scan = Some(ScanStatus {
            at: Utc::now(),
            duration_ms: outcome.duration.as_secs_f64() * 1000.0,
            fired: outcome.fired,
            failed: outcome.failed,
        });
    });
}

/// Batches add up to one info line per second, not one per batch: with deadline-driven
/// wakeups a busy node runs hundreds of small batches a second.
pub(super) struct Summary {
    since: Instant,
    batches: usize,
    fired: usize,
    failed: usize,
    busy: Duration,
    max_lateness: Duration,
}

impl Summary {
    pub(super) fn new() -> Self {
        Self {
            since: Instant::now(),
            batches: 0,
            fired: 0,
            failed: 0,
            busy: Duration::ZERO,
            max_lateness: Duration::ZERO,
        }
    }

    fn add(&mut self, o: &BatchOutcome) {
        self.batches += 1;
        self.fired += o.fired;
        self.failed += o.failed;
        self.busy += o.duration;
        let late = o.lateness.iter().max().copied().unwrap_or_default();
        self.max_lateness = self.max_lateness.max(late);
        if self.since.elapsed() >= SUMMARY_EVERY {
            self.flush();
        }
    }

    pub(super) fn flush(&mut self) {
        if self.batches > 0 {
            tracing::info!(
                fired = self.fired, failed = self.failed, batches = self.batches,
                duration = ?self.busy, max_lateness = ?self.max_lateness, "fired due rows"
            );
        }
        *self = Self::new();
    }
}
