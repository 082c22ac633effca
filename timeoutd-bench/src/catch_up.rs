//! Catch-up after an outage: a backlog overdue by up to an hour, committed at once, while
//! new rows keep coming due.

use crate::prelude::*;
use crate::*;

/// Rows coming due per second while the backlog drains.
const FRESH_RATE: f64 = 100.0;
/// How far back the backlog's deadlines go.
const OUTAGE_SECS: f64 = 3600.0;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct CatchUp {
    pub(crate) rows: usize,
    pub(crate) layout: Layout,
    /// Inserting the backlog (one transaction).
    pub(crate) insert_secs: f64,
    /// Commit of the backlog → the last of it received.
    pub(crate) drain_secs: f64,
    pub(crate) rows_per_sec: f64,
    pub(crate) delivery: Delivery,
    pub(crate) left_in_table: i64,
    /// Rows that came due during the drain (at 100/s, each inserted 1.5 s ahead): their
    /// lateness, receipt − deadline.
    pub(crate) fresh_rows: usize,
    pub(crate) fresh_p50_ms: f64,
    pub(crate) fresh_p99_ms: f64,
    pub(crate) fresh_max_ms: f64,
    pub(crate) fresh_early: usize,
    /// The daemon's peak RSS (VmHWM) after the drain: its largest since it started.
    pub(crate) peak_rss_mib: f64,
    pub(crate) daemon: ScanDelta,
    /// CPU of every process from the backlog's commit to its last receipt.
    pub(crate) cpu: CpuSpent,
    pub(crate) complete: bool,
}

/// `n` rows overdue by up to an hour appear at once (one commit); rows keep coming due at
/// 100/s for as long as the drain should take at `pace` rows/s (the baseline publish).
pub(crate) async fn catch_up(
    env: &Env,
    daemon: &mut Daemon,
    n: usize,
    layout: Layout,
    pace: f64,
) -> Result<CatchUp> {
    let backlog = fresh_ids(n);
    env.inbox.take();
    let before = daemon.scrape().await?;
    let started = Instant::now();
    let mut tx = env.pool.begin().await?;
    insert_due(
        &mut tx,
        &env.table(),
        &env.queue,
        &backlog,
        layout.overdue_up_to(OUTAGE_SECS),
    )
    .await?;
    tx.commit().await?;
    let committed = Utc::now();
    let meter = CpuMeter::start();
    let insert_secs = started.elapsed().as_secs_f64();
    let expected_secs = n as f64 / pace.max(1.0);
    let fresh_total = ((expected_secs * FRESH_RATE) as usize).max(1);
    let first = (committed + chrono::Duration::from_std(STEADY_LEAD)?).trunc_subsecs(6);
    let step = 1e6 / FRESH_RATE;
    let deadline = |k: usize| first + chrono::Duration::microseconds((k as f64 * step) as i64);
    let (fresh, _) = steady_insert(env, fresh_total, deadline).await?;
    let total = n + fresh_total;
    let complete = env.inbox.wait_for(total, receive_limit(total)).await;
    daemon.check_alive()?;
    let got = env.inbox.take();
    let old: HashSet<Uuid> = backlog.into_iter().collect();
    let backlog_got: Vec<_> = got
        .iter()
        .filter(|(id, _)| old.contains(id))
        .copied()
        .collect();
    let delivery = Delivery::check(&backlog_got, &old);
    let last = backlog_got
        .iter()
        .map(|(_, at)| *at)
        .max()
        .unwrap_or(committed);
    let drain_secs = ms(last - committed) / 1e3;
    let cpu = meter.spent(drain_secs);
    let after = daemon
        .scrape_after(&before, got.len() as u64, SETTLE_LIMIT)
        .await?;
    let lateness = lateness_ms(&got, &fresh);
    Ok(CatchUp {
        rows: n,
        layout,
        insert_secs,
        drain_secs,
        rows_per_sec: delivery.distinct as f64 / drain_secs,
        delivery,
        left_in_table: env.count_rows().await?,
        fresh_rows: fresh_total,
        fresh_p50_ms: percentile(&lateness, 50.0),
        fresh_p99_ms: percentile(&lateness, 99.0),
        fresh_max_ms: lateness.last().copied().unwrap_or(f64::NAN),
        fresh_early: lateness.iter().filter(|l| **l < 0.0).count(),
        peak_rss_mib: daemon.memory()?.hwm as f64 / MIB,
        daemon: ScanDelta::between(&before, &after),
        cpu,
        complete,
    })
}
