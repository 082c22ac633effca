//! Burst.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Burst {
    pub(crate) rows: usize,
    /// Time to insert the rows (one transaction), committed before they were due.
    pub(crate) insert_secs: f64,
    /// Milliseconds from the deadline (T0) to the first and the last TimeOut received.
    pub(crate) first_ms: f64,
    pub(crate) last_ms: f64,
    /// Rows / (last − T0): the burst throughput.
    pub(crate) rows_per_sec: f64,
    /// Rows / (last − first): without the wait for the first tick after T0.
    pub(crate) drain_rows_per_sec: f64,
    pub(crate) delivery: Delivery,
    pub(crate) left_in_table: i64,
    /// What the daemon did, from its `/metrics` scraped before the insert and after the
    /// last TimeOut.
    pub(crate) daemon: ScanDelta,
    /// Sum of batch durations / (last − T0): the share of the wall time spent in batches
    /// (above 1 when batches overlap, `scan.concurrency` > 1).
    pub(crate) busy_fraction: f64,
    /// CPU of every process from T0 to the last receipt.
    pub(crate) cpu: CpuSpent,
    pub(crate) complete: bool,
}

/// N rows, all due at T0 (committed before T0); the clock runs from T0 to the receipt of
/// the last TimeOut.
pub(crate) async fn burst(
    env: &Env,
    daemon: &mut Daemon,
    n: usize,
    insert_rate: f64,
) -> Result<Burst> {
    let ids = fresh_ids(n);
    vacuum(env).await?;
    let lead = Duration::from_secs_f64(n as f64 / insert_rate * 1.5 + 1.0);
    let t0 = (Utc::now() + chrono::Duration::from_std(lead)?).trunc_subsecs(6);
    env.inbox.take();
    let before = daemon.scrape().await?;
    let started = Instant::now();
    let mut tx = env.pool.begin().await?;
    insert_due(
        &mut tx,
        &env.table(),
        &env.queue,
        &ids,
        Deadline::At(Some(t0)),
    )
    .await?;
    tx.commit().await?;
    let insert_secs = started.elapsed().as_secs_f64();
    let start = t0.max(Utc::now());
    if start > t0 {
        eprintln!("   burst: insert committed after T0; the clock starts at the commit");
    }
    // Metered from T0: before it, nothing but the daemon's look ahead runs.
    tokio::time::sleep((t0 - Utc::now()).to_std().unwrap_or_default()).await;
    env.burst_hook("start", daemon.pid);
    let meter = CpuMeter::start();
    let complete = env.inbox.wait_for(n, lead + receive_limit(n)).await;
    env.burst_hook("stop", daemon.pid);
    daemon.check_alive()?;
    let got = env.inbox.take();
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    let arrival = Arrival::of(&got, &expected, start);
    let (delivery, last_ms) = (arrival.delivery, arrival.last_ms);
    let cpu = meter.spent(last_ms / 1e3);
    let after = daemon
        .scrape_after(&before, delivery.distinct as u64, SETTLE_LIMIT)
        .await?;
    let scan = ScanDelta::between(&before, &after);
    Ok(Burst {
        rows: n,
        insert_secs,
        first_ms: arrival.first_ms,
        last_ms,
        rows_per_sec: arrival.per_sec,
        drain_rows_per_sec: arrival.drain_per_sec,
        delivery,
        left_in_table: env.count_rows().await?,
        daemon: scan,
        busy_fraction: scan.busy_ms / last_ms,
        cpu,
        complete,
    })
}

/// What arrived of the messages expected, timed from `start` (their deadline, or when
/// the clock could start).
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Arrival {
    pub(crate) delivery: Delivery,
    /// Milliseconds from `start` to the first and the last message received.
    pub(crate) first_ms: f64,
    pub(crate) last_ms: f64,
    /// Distinct messages / (last − start).
    pub(crate) per_sec: f64,
    /// Distinct messages / (last − first): without the wait for the first.
    pub(crate) drain_per_sec: f64,
}

impl Arrival {
    pub(crate) fn of(
        got: &[(Uuid, DateTime<Utc>)],
        expected: &HashSet<Uuid>,
        start: DateTime<Utc>,
    ) -> Self {
        let delivery = Delivery::check(got, expected);
        let first = got.iter().map(|(_, at)| *at).min().unwrap_or(start);
        let last = got.iter().map(|(_, at)| *at).max().unwrap_or(start);
        let last_ms = ms(last - start);
        Self {
            delivery,
            first_ms: ms(first - start),
            last_ms,
            per_sec: delivery.distinct as f64 / (last_ms / 1e3),
            drain_per_sec: delivery.distinct as f64 / (ms(last - first) / 1e3),
        }
    }
}

pub(crate) fn ms(d: chrono::Duration) -> f64 {
    d.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e3
}
