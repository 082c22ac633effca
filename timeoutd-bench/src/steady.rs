//! Steady.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Steady {
    pub(crate) rate: u32,
    pub(crate) secs: u64,
    pub(crate) rows: usize,
    pub(crate) delivery: Delivery,
    /// Received before their deadline (a contract violation).
    pub(crate) early: usize,
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) mean_ms: f64,
    /// Smallest (deadline − insert commit) over all rows: > 0 means every row existed
    /// before it was due, so lateness is the daemon's.
    pub(crate) min_insert_lead_ms: f64,
    pub(crate) histogram: Vec<(String, usize)>,
    /// What the daemon did, from its `/metrics` scraped before the first insert and after
    /// the last TimeOut.
    pub(crate) daemon: ScanDelta,
    pub(crate) complete: bool,
}

/// Rows due at `rate`/s for `steady_secs`, inserted through `client::expect` ~1.5 s ahead,
/// in one transaction every 10 ms; lateness = receipt − deadline.
pub(crate) async fn steady(env: &Env, daemon: &mut Daemon, rate: u32, secs: u64) -> Result<Steady> {
    // Before the first deadline is set: a scrape must not eat into the insert lead.
    let before = daemon.scrape().await?;
    let rows = steady_rows(env, rate, secs).await?;
    daemon.check_alive()?;
    let after = daemon
        .scrape_after(&before, rows.delivery.distinct as u64, SETTLE_LIMIT)
        .await?;
    Ok(rows.measured(ScanDelta::between(&before, &after)))
}

/// What arrived of one steady load, before the daemon's own view is added.
pub(crate) struct SteadyRows {
    rate: u32,
    secs: u64,
    total: usize,
    pub(crate) delivery: Delivery,
    lateness: Vec<f64>,
    min_lead: f64,
    complete: bool,
}

/// Insert the rows of a steady load and collect their TimeOuts (bounded wait).
pub(crate) async fn steady_rows(env: &Env, rate: u32, secs: u64) -> Result<SteadyRows> {
    let total = rate as usize * secs as usize;
    let step = 1e6 / f64::from(rate);
    let first = (Utc::now() + chrono::Duration::from_std(STEADY_LEAD)?).trunc_subsecs(6);
    let deadline = |k: usize| first + chrono::Duration::microseconds((k as f64 * step) as i64);
    env.inbox.take();
    let (deadlines, min_lead) = steady_insert(env, total, deadline).await?;
    let limit = STEADY_LEAD + Duration::from_secs(30);
    let complete = env.inbox.wait_for(total, limit).await;
    let got = env.inbox.take();
    let expected: HashSet<Uuid> = deadlines.keys().copied().collect();
    Ok(SteadyRows {
        rate,
        secs,
        total,
        delivery: Delivery::check(&got, &expected),
        lateness: lateness_ms(&got, &deadlines),
        min_lead,
        complete,
    })
}

impl SteadyRows {
    pub(crate) fn measured(self, daemon: ScanDelta) -> Steady {
        let lateness = &self.lateness;
        Steady {
            rate: self.rate,
            secs: self.secs,
            rows: self.total,
            delivery: self.delivery,
            early: lateness.iter().filter(|l| **l < 0.0).count(),
            p50_ms: percentile(lateness, 50.0),
            p90_ms: percentile(lateness, 90.0),
            p99_ms: percentile(lateness, 99.0),
            max_ms: lateness.last().copied().unwrap_or(f64::NAN),
            mean_ms: lateness.iter().sum::<f64>() / lateness.len().max(1) as f64,
            min_insert_lead_ms: self.min_lead,
            histogram: histogram(lateness),
            daemon,
            complete: self.complete,
        }
    }
}

/// The inserter: every 10 ms, one transaction with every row due within the lead.
pub(crate) async fn steady_insert(
    env: &Env,
    total: usize,
    deadline: impl Fn(usize) -> DateTime<Utc>,
) -> Result<(HashMap<Uuid, DateTime<Utc>>, f64)> {
    let lead = chrono::Duration::from_std(STEADY_LEAD)?;
    let mut deadlines = HashMap::with_capacity(total);
    let mut min_lead = f64::INFINITY;
    let mut tick = tokio::time::interval(STEADY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0;
    while next < total {
        tick.tick().await;
        let horizon = Utc::now() + lead;
        // One statement per tick, as a process manager writing many at once would: at
        // 5,000 rows/s one round trip per row would make the inserter the bottleneck.
        let mut batch = Vec::new();
        while next < total && deadline(next) <= horizon {
            batch.push((Uuid::new_v4(), deadline(next)));
            next += 1;
        }
        if !batch.is_empty() {
            let mut conn = env.pool.acquire().await?;
            insert_each_due(&mut conn, &env.table(), &env.queue, &batch).await?;
        }
        let committed = Utc::now();
        for (id, due) in batch {
            min_lead = min_lead.min(ms(due - committed));
            deadlines.insert(id, due);
        }
    }
    Ok((deadlines, min_lead))
}

/// Sorted lateness of every received id with a known deadline, in milliseconds.
pub(crate) fn lateness_ms(
    got: &[(Uuid, DateTime<Utc>)],
    deadlines: &HashMap<Uuid, DateTime<Utc>>,
) -> Vec<f64> {
    let mut late: Vec<f64> = got
        .iter()
        .filter_map(|(id, at)| deadlines.get(id).map(|due| ms(*at - *due)))
        .collect();
    late.sort_by(f64::total_cmp);
    late
}

/// Nearest-rank percentile of sorted values.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) const BUCKETS_MS: [f64; 11] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 300.0, 500.0, 1000.0,
];

pub(crate) fn histogram(sorted: &[f64]) -> Vec<(String, usize)> {
    let mut counts = vec![0; BUCKETS_MS.len() + 1];
    for v in sorted {
        let i = BUCKETS_MS
            .iter()
            .position(|b| v < b)
            .unwrap_or(BUCKETS_MS.len());
        counts[i] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, c)| (bucket_label(i), c))
        .collect()
}

pub(crate) fn bucket_label(i: usize) -> String {
    match i {
        0 => format!("<{}", BUCKETS_MS[0]),
        i if i == BUCKETS_MS.len() => format!("≥{}", BUCKETS_MS[i - 1]),
        i => format!("{}–{}", BUCKETS_MS[i - 1], BUCKETS_MS[i]),
    }
}
