//! When to fire. While active, the scan task runs batches as its [`pacer::Pacer`] says:
//! rows that come due within `scan.horizon` are locked a little ahead and each is sent
//! at its due time (by the database's clock: waking early or late never sends early); a
//! backlog of overdue rows drains oldest first, batch after batch, with a share kept for
//! rows coming due meanwhile. Postgres `NOTIFY` tells of new and moved due times; the
//! due index is probed every `scan.probe_interval` besides (every tick while the LISTEN
//! connection is down). Batches and probes run as tasks of their
//! own, so a slow probe or a slow commit never delays a held row, nor the other kinds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::bus::Bus;
use crate::config::Settings;
use crate::election::{Lease, LeaseView, Role};
use crate::fire::{BatchOutcome, Delayed, Expectations, ScanError, Scanner};
use crate::health::{Check, Health};
use crate::shutdown::{Stopping, sleep_or_stop};
use crate::status::{Probe, ScanStatus};
use crate::store::{DELAYED, EXPECTATIONS, Store, Table, Window};
use crate::telemetry::Chain;

mod pacer;

use pacer::{Finished, Lane, Pacer, Probing};

/// How often the per-batch activity is summarised at info level.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);
/// Rows overdue by more than this are a backlog (see `pacer`).
const FRESH: Duration = Duration::from_secs(1);
/// Notifications queued for the scan loop; beyond this they are dropped and the loop
/// looks at every table instead.
const NOTICES: usize = 1024;
/// An active node that ran no batch for this long closes the connections its batches
/// opened, keeping one per kind for the probes; batches that come closer together than
/// this reuse them.
const ACTIVE_IDLE_AFTER: Duration = Duration::from_secs(10);
/// Idle connections a passive node keeps in its pool: the one its checks, the pending
/// counts and the delay ingress share (docs/operating/capacity.md).
pub(crate) const PASSIVE_CONNECTIONS: usize = 1;

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
    /// How long the batches in flight may take to finish once stopping.
    pub(crate) stopping: Arc<Stopping>,
}

impl Firing {
    /// The lease right now, from the view the node task published: no lock, no wait.
    fn lease(&self) -> Lease {
        self.lease.borrow().check(Instant::now())
    }

    fn pacing(&self) -> pacer::Config {
        let scan = &self.settings.scan;
        pacer::Config {
            horizon: scan.horizon,
            lead: pacer::Config::lead_for(scan.horizon),
            fresh: FRESH,
            concurrency: scan.concurrency as usize,
            fresh_slots: scan.fresh_slots as usize,
            tick: self.settings.election.tick,
            probe_interval: scan.probe_interval.max(self.settings.election.tick),
        }
    }
}

/// A new or moved due time, from the trigger's `NOTIFY`: of which kind (`None`: any)
/// and when (`None`: unknown, look now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Notice {
    kind: Option<Fires>,
    due: Option<DateTime<Utc>>,
}

impl Notice {
    /// Look at every kind now: what changed is unknown.
    const ANY: Notice = Notice {
        kind: None,
        due: None,
    };
}

/// What the listener shares with the scan loop besides the notices themselves.
#[derive(Default)]
struct NoticeState {
    /// Some notices were dropped (the queue was full).
    lost: AtomicBool,
    /// The LISTEN connection is up: notices arrive.
    listening: AtomicBool,
}

/// Notifications on their way to the scan loop.
struct Notices {
    rx: mpsc::Receiver<Notice>,
    state: Arc<NoticeState>,
}

/// The scan loop of one node (runs for the daemon's whole life; idle while passive).
pub(crate) async fn scan_loop(shared: Arc<Firing>) {
    let settings = &shared.settings;
    let scanner = Arc::new(Scanner::new(
        shared.node_id,
        settings,
        shared.health.clone(),
    ));
    let (tx, rx) = mpsc::channel(NOTICES);
    let state = Arc::new(NoticeState::default());
    let mut notices = Notices { rx, state };
    let mut lease = shared.lease.clone();
    let mut bus = shared.bus.clone();
    let mut summary = Summary::new();
    let mut checked = Instant::now();
    loop {
        shared.probe.beat(&shared.probe.scan_beat);
        let current = bus.borrow_and_update().clone();
        let active = lease.borrow_and_update().role == Role::Active;
        match current.filter(|_| active) {
            Some(bus) => {
                // LISTEN only while active: a passive node fires nothing, so notices are
                // no use to it, and the connection would be one more per passive node.
                // The look at every kind after LISTEN, and the pacer's probing every tick
                // until then, cover what was written before.
                shared.store.lean(false);
                let listener =
                    tokio::spawn(listen(shared.clone(), tx.clone(), notices.state.clone()));
                fire_while_active(&shared, &scanner, &bus, &mut notices, &mut summary).await;
                listener.abort();
                notices.state.listening.store(false, Ordering::Relaxed);
            }
            None => {
                shared.store.lean(!active);
                if !active && checked.elapsed() >= settings.election.announce_interval {
                    // A check waiting on a slow database is no reason to delay a stop.
                    tokio::select! {
                        _ = shared.stop.cancelled() => {},
                        _ = check_while_passive(&shared, &scanner) => {},
                    }
                    checked = Instant::now();
                }
                if !active {
                    // One connection between checks: what the ingress or the last
                    // active spell opened beyond it is closed (see `Store::trim`).
                    shared.store.trim(PASSIVE_CONNECTIONS);
                }
                // Due times announced while passive are stale once active: it probes.
                while notices.rx.try_recv().is_ok() {}
                // Wake at least every tick so the liveness heartbeat keeps moving.
                tokio::select! {
                    _ = shared.stop.cancelled() => {},
                    _ = lease.changed() => {},
                    _ = bus.changed() => {},
                    _ = tokio::time::sleep(settings.election.tick) => {},
                }
            }
        }
        if shared.stop.is_cancelled() {
            break;
        }
    }
    summary.flush();
}

/// A batch in flight: its kind (and the pacer's index of it), its lane, and the pacer's
/// epoch of the kind when it started.
type Started = (Fires, usize, Lane, u64);

/// What a probe task returns: when it answered, and the answer.
type Probed = (Instant, Result<crate::store::Probe, String>);

/// The batches in flight, and what each is (by task id: a batch that panicked returns
/// nothing to tell it by, and the pacer must still count it as ended).
#[derive(Default)]
struct Batches {
    tasks: JoinSet<Result<BatchOutcome, ScanError>>,
    started: Vec<(tokio::task::Id, Started)>,
}

/// The probes under way, and the kind of each (by task id: a probe that panicked
/// returns nothing else to tell its kind by).
#[derive(Default)]
struct Probes {
    tasks: JoinSet<Probed>,
    kinds: Vec<(tokio::task::Id, usize)>,
}

/// Fire as the pacer says until the lease is lost, the broker connection changes or we
/// stop; then wait for the batches in flight (each commits or rolls back as a whole).
async fn fire_while_active(
    shared: &Arc<Firing>,
    scanner: &Arc<Scanner>,
    bus: &Arc<Bus>,
    notices: &mut Notices,
    summary: &mut Summary,
) {
    let kinds = kinds(&shared.settings);
    let mut pacer = Pacer::new(shared.pacing(), kinds.len(), Instant::now());
    let mut batches = Batches::default();
    // Probes run as tasks too: one walking many deleted index entries (seconds after a
    // large drain) holds up neither the other kinds nor the batches' starts.
    let mut probes = Probes::default();
    let mut lease = shared.lease.clone();
    let mut bus_rx = shared.bus.clone();
    let mut backoff = health_backoff(&shared.settings);
    let mut busy_at = Instant::now();
    loop {
        shared.probe.beat(&shared.probe.scan_beat);
        if !batches.tasks.is_empty() {
            busy_at = Instant::now();
        } else if busy_at.elapsed() >= ACTIVE_IDLE_AFTER {
            // Idle: the connections the batches opened are closed; the probes' stay.
            shared.store.trim(kinds.len());
        }
        let listening = notices.state.listening.load(Ordering::Relaxed);
        pacer.listening(listening, Instant::now());
        if notices.state.lost.swap(false, Ordering::Relaxed) {
            pacer.notified(None, None, Instant::now());
        }
        if batches.tasks.is_empty() {
            let chores = async {
                settle_leftovers(scanner, &shared.store).await;
                recheck_publish(shared).await;
            };
            // Leftovers not settled now are fired again by the next active node, as
            // they would be if this node had died: a stop does not wait on the database
            // for them.
            tokio::select! {
                _ = shared.stop.cancelled() => break,
                _ = chores => {},
            }
        }
        for (kind, lane) in pacer.starts(Instant::now()) {
            let window = pacer.window(kind, lane);
            let fires = kinds[kind];
            tracing::trace!(kind = fires.table().kind(), ?lane, from = ?window.from, "starting a batch");
            let task = batch(shared.clone(), scanner.clone(), bus.clone(), fires, window);
            let task = batches.tasks.spawn(task);
            batches
                .started
                .push((task.id(), (fires, kind, lane, pacer.epoch(kind))));
        }
        // After the starts: an on-time start asks at once for a probe past its window.
        start_probes(shared, &kinds, &mut pacer, &mut probes);
        let wake = pacer.wake_at(Instant::now());
        tracing::trace!(in_ = ?wake.saturating_duration_since(Instant::now()), running = pacer.running(), "sleeping");
        tokio::select! {
            _ = shared.stop.cancelled() => break,
            _ = lease.changed() => if lease.borrow_and_update().role != Role::Active { break },
            // A clone of the shared receiver starts with its version unseen: only another
            // connection ends this loop, or every batch would wait for the whole drain.
            _ = bus_rx.changed() => if !still_on(&mut bus_rx, bus) { break },
            Some(joined) = batches.tasks.join_next_with_id(), if !batches.tasks.is_empty() => {
                finished(shared, &mut pacer, &mut backoff, summary, &mut batches, joined);
            }
            Some(joined) = probes.tasks.join_next_with_id(), if !probes.tasks.is_empty() => {
                probed(shared, &kinds, &mut pacer, &mut probes, joined);
            }
            Some(n) = notices.rx.recv() => {
                tracing::trace!(?n, "notified");
                pacer.notified(n.kind.and_then(|k| kinds.iter().position(|x| *x == k)), n.due, Instant::now());
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
    }
    // The batches have until the stop's grace, should a stop come (now or while they
    // finish): each commits, or rolls back when it is dropped (its transaction with it).
    let all_ended = {
        let joined = async {
            while let Some(joined) = batches.tasks.join_next_with_id().await {
                finished(
                    shared,
                    &mut pacer,
                    &mut backoff,
                    summary,
                    &mut batches,
                    joined,
                );
            }
        };
        let grace_spent = async {
            shared.stop.cancelled().await;
            tokio::time::sleep_until(shared.stopping.grace_until().into()).await;
        };
        tokio::select! {
            _ = joined => true,
            _ = grace_spent => false,
        }
    };
    if !all_ended {
        abandon_batches(shared, &mut batches);
    }
}

/// Give up the batches still in flight when the stop's grace is spent. Whatever they
/// published without committing is published again by the next active node, with the
/// same `message_id` (the contract's "cannot know whether it was delivered").
fn abandon_batches(shared: &Firing, batches: &mut Batches) {
    batches.tasks.abort_all();
    let kinds: Vec<&str> = batches
        .started
        .iter()
        .map(|(_, (kind, ..))| kind.table().kind())
        .collect();
    shared.stopping.abandon(format!(
        "{} scan batch(es) in flight ({}): not known to be committed; rows they published \
         may be published again",
        kinds.len(),
        kinds.join(", ")
    ));
}

/// Whether the shared connection is still `bus` (marks the news seen).
fn still_on(rx: &mut watch::Receiver<Option<Arc<Bus>>>, bus: &Arc<Bus>) -> bool {
    rx.borrow_and_update()
        .as_ref()
        .is_some_and(|now| Arc::ptr_eq(now, bus))
}

/// Start a probe of each kind whose probe is due (read-only: one still under way when
/// the loop ends is dropped).
fn start_probes(shared: &Arc<Firing>, kinds: &[Fires], pacer: &mut Pacer, probes: &mut Probes) {
    for Probing { kind, after, from } in pacer.probes_due(Instant::now()) {
        let (shared, table) = (shared.clone(), kinds[kind].table());
        tracing::trace!(kind = table.kind(), ?after, ?from, "probing");
        let task = probes.tasks.spawn(async move {
            let probed = probe_table(&shared, table, after, from).await;
            (Instant::now(), probed)
        });
        probes.kinds.push((task.id(), kind));
    }
}

/// A probe answered: tell the pacer.
fn probed(
    shared: &Firing,
    kinds: &[Fires],
    pacer: &mut Pacer,
    probes: &mut Probes,
    joined: Result<(tokio::task::Id, Probed), tokio::task::JoinError>,
) {
    let id = joined.as_ref().map_or_else(|e| e.id(), |(id, _)| *id);
    let Some(i) = probes.kinds.iter().position(|(task, _)| *task == id) else {
        return;
    };
    let (_, kind) = probes.kinds.swap_remove(i);
    let (at, probed) = match joined {
        Ok((_, p)) => p,
        Err(e) => {
            // A panic is a bug; the kind is probed again in a tick.
            tracing::error!(error = %e, "a probe failed");
            (Instant::now(), Err(e.to_string()))
        }
    };
    shared.health.record(Check::Postgres, &probed);
    let name = kinds[kind].table().kind();
    match probed {
        Ok(p) => {
            tracing::trace!(kind = name, ?p, "probed");
            shared.probe.saw_due(name, p.earliest, p.start);
            pacer.probed(kind, at, p)
        }
        Err(e) => {
            tracing::warn!(error = %e, kind = name, "cannot probe the due rows");
            shared.probe.update(|s| s.database_ok = Some(false));
            pacer.probe_failed(kind, at);
        }
    }
}

/// One batch ended: record it and tell the pacer.
fn finished(
    shared: &Firing,
    pacer: &mut Pacer,
    backoff: &mut Backoff,
    summary: &mut Summary,
    batches: &mut Batches,
    joined: Result<(tokio::task::Id, Result<BatchOutcome, ScanError>), tokio::task::JoinError>,
) {
    let now = Instant::now();
    let id = joined.as_ref().map_or_else(|e| e.id(), |(id, _)| *id);
    let Some(i) = batches.started.iter().position(|(task, _)| *task == id) else {
        return;
    };
    let (_, (kind, index, lane, began)) = batches.started.swap_remove(i);
    let result = match joined {
        Ok((_, result)) => result,
        Err(e) => {
            // A panic is a bug; its transaction was dropped, which rolls it back. Its rows
            // are due again: the pacer forgets what it held.
            tracing::error!(error = %e, "a scan batch failed");
            pacer.failed(index, lane, now, backoff.next_delay());
            return;
        }
    };
    shared.health.record(Check::Postgres, &result);
    match result {
        Ok(outcome) => {
            backoff.reset();
            record(shared, &outcome, summary);
            let full = outcome.locked >= shared.settings.scan.batch_size as usize;
            pacer.finished(
                index,
                lane,
                now,
                Finished {
                    locked: outcome.locked,
                    full,
                    untouched: outcome.untouched,
                    clock: outcome.clock,
                    last_due: outcome.last_due,
                    window_end: outcome.window_end,
                    began,
                },
            );
        }
        Err(e) => {
            let delay = backoff.next_delay();
            if shared.stop.is_cancelled() {
                // The stop closes the pools first: a batch begun at that instant finds
                // its pool closed, which is the stop, not a failure.
                tracing::debug!(error = %Chain(&e), kind = kind.table().kind(), "scan ended by the stop");
            } else {
                tracing::error!(error = %Chain(&e), kind = kind.table().kind(), retry_in = ?delay, "scan failed");
            }
            shared.probe.update(|s| s.database_ok = Some(false));
            pacer.failed(index, lane, now, delay);
        }
    }
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
/// everyone) and, if publishing was what failed, when it can get a channel again. Rows
/// fired by a batch that then failed to commit are deleted now too.
async fn check_while_passive(shared: &Firing, scanner: &Scanner) {
    recheck_publish(shared).await;
    recheck_listen(shared).await;
    // The due-row index, not just `SELECT 1`: a table locked by someone else (a
    // migration, an ALTER) fails the scan, and must fail this check too. From now on
    // only: from its start, the probe would walk every deleted row not yet vacuumed
    // (seconds after a large drain, every time while an old snapshot keeps them).
    let mut pinged = Ok(());
    for kind in kinds(&shared.settings) {
        if let Err(e) = probe_table(shared, kind.table(), None, Some(Utc::now())).await {
            pinged = Err(e);
            break;
        }
    }
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

/// A passive node holds no LISTEN connection (see `scan_loop`); one whose LISTEN failed
/// while active would stay withdrawn, or rejoin only to fail again: while the check
/// fails it tries a LISTEN at every passive check and lets it go.
async fn recheck_listen(shared: &Firing) {
    if !shared.health.failing().contains(&Check::Listen.name()) {
        return;
    }
    let limit = shared.settings.postgres.statement_timeout;
    let listened = match tokio::time::timeout(limit, shared.store.listener()).await {
        Ok(r) => r.map(drop).map_err(|e| Chain(&e).to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    };
    shared.health.record(Check::Listen, &listened);
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

/// When the next rows of `table` are due (see `Store::probe`), bounded on the client.
async fn probe_table(
    shared: &Firing,
    table: Table,
    after: Option<DateTime<Utc>>,
    from: Option<DateTime<Utc>>,
) -> Result<crate::store::Probe, String> {
    let limit = shared.settings.postgres.statement_timeout;
    let _under_way = shared.health.step(Check::Postgres);
    match tokio::time::timeout(limit, shared.store.probe(table, after, FRESH, from)).await {
        Ok(r) => r.map_err(|e| Chain(&e).to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}

/// Forward the trigger's notifications to the scan loop; reconnect with backoff. After
/// every LISTEN it asks for one look at every kind: what was written before it (or in the
/// gap after a lost connection) was told to nobody.
async fn listen(shared: Arc<Firing>, tx: mpsc::Sender<Notice>, notices: Arc<NoticeState>) {
    let mut backoff = health_backoff(&shared.settings);
    let send = |n: Notice| {
        if tx.try_send(n).is_err() {
            notices.lost.store(true, Ordering::Relaxed);
        }
    };
    // The stop closes the pool before it tells the tasks (see `daemon`), and a listener
    // ends with the pool: that is the stop, not a lost connection.
    let stopping = || shared.store.pool().is_closed();
    loop {
        let moves = shared.store.host_moves();
        let listening = shared.store.listener().await;
        if listening.is_err() && stopping() {
            return;
        }
        shared.health.record(Check::Listen, &listening);
        match listening {
            Ok(mut listener) => {
                backoff.reset();
                notices.listening.store(true, Ordering::Relaxed);
                send(Notice::ANY);
                let ended = forward(&shared, &mut listener, moves, &send).await;
                notices.listening.store(false, Ordering::Relaxed);
                match ended {
                    Listened::Moved => {
                        tracing::info!("the pool moved to another Postgres host: LISTEN there");
                        continue;
                    }
                    Listened::Stopped => return,
                    Listened::Lost(_) if stopping() => return,
                    Listened::Lost(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; probing every tick meanwhile");
                        shared.health.fail(Check::Listen, Instant::now());
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "cannot LISTEN; probing every tick meanwhile")
            }
        }
        if !sleep_or_stop(&shared.stop, backoff.next_delay()).await {
            return;
        }
    }
}

/// How a LISTEN session ended.
enum Listened {
    Stopped,
    /// The connection failed (why).
    Lost(String),
    /// The pool moved to another host: notices come from there now.
    Moved,
}

/// Notifications of `listener` until it is lost, the pool moves to another host, or we
/// stop.
async fn forward(
    shared: &Firing,
    listener: &mut sqlx::postgres::PgListener,
    moves: Option<watch::Receiver<u64>>,
    send: &impl Fn(Notice),
) -> Listened {
    let moved = async {
        let Some(mut moves) = moves else {
            return std::future::pending().await;
        };
        if moves.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(moved);
    loop {
        let next = tokio::select! {
            _ = shared.stop.cancelled() => return Listened::Stopped,
            _ = &mut moved => return Listened::Moved,
            n = listener.try_recv() => n,
        };
        match next {
            Ok(Some(n)) => send(parse_notice(n.payload())),
            // sqlx would reconnect on the next call, but only a new LISTEN tells us when
            // it is back, and the look after it must come after it.
            Ok(None) => return Listened::Lost("the connection closed".to_owned()),
            Err(e) => return Listened::Lost(Chain(&e).to_string()),
        }
    }
}

/// The trigger's payload: `<kind>:<epoch micros>` (migration 0005), `<kind>:` for an
/// infinite due time; anything else asks to look at every kind now.
fn parse_notice(payload: &str) -> Notice {
    let Some((kind, micros)) = payload.split_once(':') else {
        return Notice::ANY;
    };
    let kind = Fires::ALL.into_iter().find(|f| f.table().kind() == kind);
    match micros {
        // Infinite: a held or parked row, nothing to wake for.
        "" if kind.is_some() => Notice {
            kind,
            due: Some(DateTime::<Utc>::MAX_UTC),
        },
        _ => Notice {
            kind,
            due: micros
                .parse()
                .ok()
                .and_then(DateTime::from_timestamp_micros),
        },
    }
}

/// A kind of due row the scan fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fires {
    Expectations,
    Delayed,
}

impl Fires {
    const ALL: [Fires; 2] = [Fires::Expectations, Fires::Delayed];

    fn table(self) -> Table {
        match self {
            Fires::Expectations => EXPECTATIONS,
            Fires::Delayed => DELAYED,
        }
    }
}

fn kinds(settings: &Settings) -> Vec<Fires> {
    if settings.delay.enabled {
        Fires::ALL.to_vec()
    } else {
        vec![Fires::Expectations]
    }
}

/// One batch of `kind` over `window`, as a task of its own.
async fn batch(
    shared: Arc<Firing>,
    scanner: Arc<Scanner>,
    bus: Arc<Bus>,
    kind: Fires,
    window: Window,
) -> Result<BatchOutcome, ScanError> {
    let (store, stop, lease) = (&shared.store, &shared.stop, || shared.lease());
    match kind {
        Fires::Expectations => {
            scanner
                .run_batch::<Expectations>(store, &bus, lease, stop, window)
                .await
        }
        Fires::Delayed => {
            scanner
                .run_batch::<Delayed>(store, &bus, lease, stop, window)
                .await
        }
    }
}

fn record(shared: &Firing, outcome: &BatchOutcome, summary: &mut Summary) {
    shared.probe.update(|s| s.database_ok = Some(true));
    // Stopping, a node hands its role over on purpose: rows it held are the next
    // active node's, nothing an operator must look at.
    let stopping = shared.stop.is_cancelled();
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
            shared.health.fail(Check::Publish, Instant::now());
        }
        None => shared.health.pass(Check::Publish),
    }
    let metrics = &shared.probe.metrics;
    for (step, took) in &outcome.steps {
        metrics.step(outcome.kind, step.name(), *took);
    }
    metrics.parked(outcome.parked);
    metrics.scanned(outcome.kind, outcome.duration, &outcome.lateness);
    outcome
        .failure_reasons
        .iter()
        .for_each(|r| metrics.publish_failed(outcome.kind, r));
    tracing::debug!(
        fired = outcome.fired, failed = outcome.failed, duration = ?outcome.duration,
        steps = ?outcome.steps, "fired batch"
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
