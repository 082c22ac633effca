//! When to scan. While active, the scan loop runs batches until one comes back short,
//! then sleeps until the earliest pending deadline (never longer than a tick), and is
//! woken early by Postgres `NOTIFY` when a new, earlier deadline is inserted. Rows are
//! still only fired when the database's `now()` has passed them, so waking early or late
//! never fires early.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::bus::Bus;
use crate::config::Settings;
use crate::election::{Lease, LeaseView, Role};
use crate::fire::{BatchOutcome, Delayed, Expectations, ScanError, Scanner};
use crate::health::{Check, Health};
use crate::shutdown::sleep_or_stop;
use crate::status::{Probe, ScanStatus};
use crate::store::Store;
use crate::telemetry::Chain;

/// How often the per-batch activity is summarised at info level.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);

/// What the scan task uses: the store, the bus and the lease view the node task
/// publishes, the status and health it reports to.
pub(crate) struct Firing {
    pub(crate) settings: Arc<Settings>,
    pub(crate) node_id: uuid::Uuid,
    pub(crate) store: Store,
    pub(crate) bus: watch::Receiver<Option<Arc<Bus>>>,
    pub(crate) lease: watch::Receiver<LeaseView>,
    pub(crate) probe: Arc<Probe>,
    pub(crate) health: Arc<Health>,
    pub(crate) stop: CancellationToken,
}

impl Firing {
    /// The lease right now, from the view the node task published: no lock, no wait.
    fn lease(&self) -> Lease {
        self.lease.borrow().check(Instant::now())
    }
}

/// The scan loop of one node (runs for the daemon's whole life; idle while passive).
pub(crate) async fn scan_loop(shared: Arc<Firing>) {
    let settings = &shared.settings;
    let scanner = Scanner::new(shared.node_id, settings, shared.health.clone());
    let wake = Arc::new(Notify::new());
    let listener = tokio::spawn(listen(shared.clone(), wake.clone()));
    let mut lease = shared.lease.clone();
    let mut bus = shared.bus.clone();
    let mut backoff = health_backoff(settings);
    let mut summary = Summary::new();
    let mut checked = Instant::now();
    loop {
        shared.probe.beat(&shared.probe.scan_beat);
        if lease.borrow_and_update().role != Role::Active {
            if checked.elapsed() >= settings.election.announce_interval {
                check_while_passive(&shared, &scanner).await;
                checked = Instant::now();
            }
            // Wake at least every tick so the liveness heartbeat keeps moving.
            tokio::select! {
                _ = shared.stop.cancelled() => break,
                _ = lease.changed() => {},
                _ = tokio::time::sleep(settings.election.tick) => {},
            }
            continue;
        }
        let current = bus.borrow_and_update().clone();
        let pause = match current {
            None => settings.election.tick,
            Some(bus) => {
                let drained = drain(&shared, &scanner, &bus, &mut summary).await;
                shared.health.record(Check::Postgres, &drained);
                match drained {
                    Ok(locked) => {
                        backoff.reset();
                        if locked == 0 {
                            recheck_publish(&shared).await;
                        }
                        next_wake(&shared, locked > 0).await
                    }
                    Err(e) => {
                        let delay = backoff.next_delay();
                        tracing::error!(error = %Chain(&e), retry_in = ?delay, "scan failed");
                        shared.probe.update(|s| s.database_ok = Some(false));
                        delay
                    }
                }
            }
        };
        tokio::select! {
            _ = shared.stop.cancelled() => break,
            _ = tokio::time::sleep(pause) => {},
            _ = wake.notified() => {},
            _ = bus.changed() => {},
        }
    }
    summary.flush();
    listener.abort();
}

/// Delete the confirmed rows of batches that did not commit. Failing that is no reason to
/// stop firing: they are kept for the next round.
async fn settle_leftovers(scanner: &Scanner, store: &crate::store::Store) {
    match scanner.settle_leftovers(store).await {
        Ok(0) => {}
        Ok(settled) => {
            tracing::info!(
                settled,
                "deleted the fired rows of a batch that had not committed"
            )
        }
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "cannot delete the fired rows of an uncommitted batch yet")
        }
    }
}

/// A passive node must know whether it could fire if elected: a withdrawn one rejoins
/// only when Postgres answers again (so that nobody flaps while the database is down for
/// everyone) and, if publishing was what failed, when it can get a channel again. Rows fired by a batch that then failed to commit are deleted now too.
async fn check_while_passive(shared: &Firing, scanner: &Scanner) {
    recheck_publish(shared).await;
    // The due-row index, not just `SELECT 1`: a table locked by someone else (a
    // migration, an ALTER) fails the scan, and must fail this check too.
    let pinged = next_due(shared).await;
    shared.health.record(Check::Postgres, &pinged);
    shared
        .probe
        .update(|s| s.database_ok = Some(pinged.is_ok()));
    if pinged.is_ok() {
        settle_leftovers(scanner, &shared.store).await;
    }
}

/// The publish check fails with a batch's trouble and passes with a batch that had
/// none; with nothing to fire, it is asked directly: can we get a channel?
async fn recheck_publish(shared: &Firing) {
    let bus = shared.bus.borrow().clone();
    if let Some(bus) = bus
        && shared.health.failing().contains(&Check::Publish.name())
    {
        shared
            .health
            .record(Check::Publish, &bus.check_publish().await);
    }
}

/// Retries of what the node's health depends on (scans, LISTEN) are capped at the
/// announce interval: a database back within `member_ttl` is noticed before the node
/// would withdraw, and a withdrawn node rejoins soon after it is back.
fn health_backoff(s: &crate::config::Settings) -> Backoff {
    Backoff::new(
        s.backoff.min,
        s.backoff.max.min(s.election.announce_interval),
    )
}

/// How long to sleep: until the earliest deadline, at most one tick. A deadline already
/// past is usually a row that came due while the last batch ran: scan again at once. But
/// if the last scan found nothing to lock, such rows are held by another scan: wait a
/// tick rather than spin.
async fn next_wake(shared: &Firing, scanned_some: bool) -> Duration {
    let tick = shared.settings.election.tick;
    match next_due(shared).await {
        // Rounded up by a millisecond so the database's now() has passed it.
        Ok(Some(secs)) if secs > 0.0 => Duration::from_secs_f64(secs + 0.001).min(tick),
        Ok(Some(_)) if scanned_some => Duration::ZERO,
        _ => tick,
    }
}

/// Seconds to the earliest deadline (see `Store::next_due_in`), bounded on the client.
async fn next_due(shared: &Firing) -> Result<Option<f64>, String> {
    let limit = shared.settings.postgres.statement_timeout;
    let _under_way = shared.health.step(Check::Postgres);
    match tokio::time::timeout(limit, shared.store.next_due_in()).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}

/// Forward the trigger's notifications to the scan loop; reconnect with backoff.
async fn listen(shared: Arc<Firing>, wake: Arc<Notify>) {
    let s = &shared.settings;
    let mut backoff = health_backoff(s);
    loop {
        let listening = shared.store.listener().await;
        shared.health.record(Check::Listen, &listening);
        let mut listener = match listening {
            Ok(l) => l,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %Chain(&e), retry_in = ?delay, "cannot LISTEN; scanning every tick meanwhile");
                if !sleep_or_stop(&shared.stop, delay).await {
                    return;
                }
                continue;
            }
        };
        backoff.reset();
        loop {
            let next = tokio::select! {
                _ = shared.stop.cancelled() => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(_)) => wake.notify_one(),
                // Reconnected: notifications in the gap are lost, so look once now.
                Ok(None) => wake.notify_one(),
                Err(e) => {
                    tracing::warn!(error = %Chain(&e), "LISTEN connection failed");
                    shared.health.fail(Check::Listen, Instant::now());
                    break;
                }
            }
        }
    }
}

/// A kind of due row the scan fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fires {
    Expectations,
    Delayed,
}

fn kinds(settings: &Settings) -> Vec<Fires> {
    if settings.delay.enabled {
        vec![Fires::Expectations, Fires::Delayed]
    } else {
        vec![Fires::Expectations]
    }
}

async fn batch(
    shared: &Firing,
    scanner: &Scanner,
    bus: &Bus,
    kind: Fires,
) -> Result<BatchOutcome, ScanError> {
    let (store, stop, lease) = (&shared.store, &shared.stop, || shared.lease());
    match kind {
        Fires::Expectations => {
            scanner
                .run_batch::<Expectations>(store, bus, lease, stop)
                .await
        }
        Fires::Delayed => scanner.run_batch::<Delayed>(store, bus, lease, stop).await,
    }
}

/// Run rounds of `scan.concurrency` batches at once (SKIP LOCKED gives each its own
/// rows, and one batch publishes while another awaits its confirms) until every kind's
/// batch comes back short, the lease is lost, or we are stopping; returns how many rows
/// were locked. The slots of a round go to the kinds in turn, and a kind with a full
/// batch keeps its turn while the other is drained, so neither kind's backlog can starve
/// the other. A batch already started is never interrupted: it commits or rolls back as
/// a whole.
async fn drain(
    shared: &Firing,
    scanner: &Scanner,
    bus: &Bus,
    summary: &mut Summary,
) -> Result<usize, ScanError> {
    let parallel = shared.settings.scan.concurrency as usize;
    let mut kinds = kinds(&shared.settings);
    let mut locked = 0;
    let mut turn = 0;
    loop {
        settle_leftovers(scanner, &shared.store).await;
        let slots: Vec<Fires> = (0..parallel)
            .map(|i| kinds[(turn + i) % kinds.len()])
            .collect();
        turn += 1;
        let round = slots.iter().map(|k| batch(shared, scanner, bus, *k));
        let mut full = Vec::new();
        let mut lost = false;
        for (kind, outcome) in slots
            .iter()
            .zip(futures_util::future::join_all(round).await)
        {
            let outcome = outcome?;
            record(shared, &outcome, summary);
            locked += outcome.locked;
            if outcome.locked >= scanner.batch_size as usize && !full.contains(kind) {
                full.push(*kind);
            }
            lost |= outcome.lease_lost;
        }
        kinds.retain(|k| full.contains(k));
        if kinds.is_empty() || lost || shared.stop.is_cancelled() {
            return Ok(locked);
        }
    }
}

fn record(shared: &Firing, outcome: &BatchOutcome, summary: &mut Summary) {
    shared.probe.update(|s| s.database_ok = Some(true));
    if outcome.lease_lost {
        tracing::warn!(locked = outcome.locked, "lease lost: batch rolled back");
        return;
    }
    if outcome.locked == 0 {
        return;
    }
    match &outcome.bus_trouble {
        Some(e) => {
            tracing::warn!(error = %Chain(e), untouched = outcome.untouched, "publishing failed under the batch");
            shared.health.fail(Check::Publish, Instant::now());
        }
        None => shared.health.pass(Check::Publish),
    }
    let metrics = &shared.probe.metrics;
    metrics.parked(outcome.parked);
    metrics.scanned(outcome.kind, outcome.duration, &outcome.lateness);
    outcome
        .failure_reasons
        .iter()
        .for_each(|r| metrics.publish_failed(outcome.kind, r));
    tracing::debug!(
        fired = outcome.fired, failed = outcome.failed, duration = ?outcome.duration,
        "fired batch"
    );
    summary.add(outcome);
    shared.probe.update(|s| {
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
struct Summary {
    since: Instant,
    batches: usize,
    fired: usize,
    failed: usize,
    busy: Duration,
    max_lateness: Duration,
}

impl Summary {
    fn new() -> Self {
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

    fn flush(&mut self) {
        if self.batches > 0 {
            tracing::info!(
                fired = self.fired, failed = self.failed, batches = self.batches,
                duration = ?self.busy, max_lateness = ?self.max_lateness, "fired due rows"
            );
        }
        *self = Self::new();
    }
}
