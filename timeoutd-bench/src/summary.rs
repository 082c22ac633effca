//! Several runs summarized: every measurement taken per run (ratios too, so drift between
//! runs hits both sides of a ratio alike), then its median and range over the runs.

use crate::prelude::*;
use crate::*;

/// How a target is met.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) enum Want {
    AtLeast(f64),
    AtMost(f64),
}

/// One measurement over the runs.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Summed {
    pub(crate) measurement: String,
    pub(crate) unit: &'static str,
    pub(crate) values: Vec<f64>,
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) target: Option<Want>,
    /// The median meets the target; `None` without one.
    pub(crate) pass: Option<bool>,
}

/// One measurement of one run: name, unit, value, target.
pub(crate) type Measurement = (String, &'static str, f64, Option<Want>);

/// The measurements of one run, in table order.
fn measurements(r: &Report) -> Vec<Measurement> {
    let publish = r.publish.rows_per_sec;
    let limit = r.limit.best.msgs_per_sec;
    let mut m = vec![
        ("baseline publish".into(), "msgs/s", publish, None),
        (
            "baseline delete".into(),
            "rows/s",
            r.delete.rows_per_sec,
            None,
        ),
        ("burst".into(), "rows/s", r.burst.rows_per_sec, None),
        (
            "burst / baseline publish".into(),
            "%",
            100.0 * r.burst.rows_per_sec / publish,
            None,
        ),
        (
            "publish limit (best of the search)".into(),
            "msgs/s",
            limit,
            None,
        ),
        (
            "publish limit, nobody consuming".into(),
            "msgs/s",
            r.limit.raw.msgs_per_sec,
            None,
        ),
        (
            "burst / best publish limit".into(),
            "%",
            100.0 * r.burst.rows_per_sec / limit,
            Some(Want::AtLeast(90.0)),
        ),
        (
            "hand-rolled firing".into(),
            "rows/s",
            r.hand.rows_per_sec,
            None,
        ),
        (
            "hand-rolled firing / best publish limit".into(),
            "%",
            100.0 * r.hand.rows_per_sec / limit,
            None,
        ),
        (
            "burst / hand-rolled firing".into(),
            "%",
            100.0 * r.burst.rows_per_sec / r.hand.rows_per_sec,
            None,
        ),
        (
            "publish limit: CPU per message, every process".into(),
            "µs",
            r.limit.best.cpu.per_message_us(r.limit.best.msgs),
            None,
        ),
        (
            "burst: CPU per TimeOut, every process".into(),
            "µs",
            r.burst.cpu.per_message_us(r.burst.rows),
            None,
        ),
        (
            "burst: CPU per TimeOut, daemon + Postgres".into(),
            "µs",
            r.burst.cpu.per(
                r.burst.cpu.firing_ms + r.burst.cpu.postgres_ms,
                r.burst.rows,
            ),
            None,
        ),
        (
            "hand-rolled firing: CPU per TimeOut, every process".into(),
            "µs",
            r.hand.cpu.per_message_us(r.hand.rows),
            None,
        ),
        (
            "hand-rolled firing: CPU per TimeOut, Postgres".into(),
            "µs",
            r.hand.cpu.per(r.hand.cpu.postgres_ms, r.hand.rows),
            None,
        ),
        (
            "hand-rolled firing: CPU per TimeOut, its process".into(),
            "µs",
            r.hand.cpu.per(r.hand.cpu.firing_ms, r.hand.rows),
            None,
        ),
        (
            "hand-rolled firing: CPU per TimeOut, the bench's consumer".into(),
            "µs",
            r.hand.cpu.per(r.hand.cpu.bench_ms, r.hand.rows),
            None,
        ),
        (
            "burst: CPU per TimeOut, daemon".into(),
            "µs",
            r.burst.cpu.per(r.burst.cpu.firing_ms, r.burst.rows),
            None,
        ),
        (
            "burst: CPU per TimeOut, Postgres".into(),
            "µs",
            r.burst.cpu.per(r.burst.cpu.postgres_ms, r.burst.rows),
            None,
        ),
        (
            "burst: CPU per TimeOut, the bench's consumer".into(),
            "µs",
            r.burst.cpu.per(r.burst.cpu.bench_ms, r.burst.rows),
            None,
        ),
        (
            "hand-rolled firing / baseline publish".into(),
            "%",
            100.0 * r.hand.rows_per_sec / publish,
            None,
        ),
        (
            "burst: busy".into(),
            "cores",
            r.burst.cpu.busy_cores(),
            None,
        ),
        // The burst against the loop in two factors: its rate's ratio is the first over
        // the second (each phase's rate is its busy cores over its CPU per TimeOut).
        (
            "burst / hand-rolled firing: cores busy".into(),
            "%",
            100.0 * r.burst.cpu.busy_cores() / r.hand.cpu.busy_cores(),
            None,
        ),
        (
            "burst / hand-rolled firing: CPU per TimeOut, every process".into(),
            "%",
            100.0 * r.burst.cpu.per_message_us(r.burst.rows)
                / r.hand.cpu.per_message_us(r.hand.rows),
            None,
        ),
        (
            "burst: batches in flight, on average".into(),
            "batches",
            r.burst.busy_fraction,
            None,
        ),
    ];
    for s in &r.steady {
        let name = |what: &str| format!("steady {}/s: {what}", s.rate);
        m.push((name("lateness p50"), "ms", s.p50_ms, None));
        m.push((
            name("lateness p99"),
            "ms",
            s.p99_ms,
            Some(Want::AtMost(5.0)),
        ));
        m.push((
            name("lateness max"),
            "ms",
            s.max_ms,
            Some(Want::AtMost(20.0)),
        ));
        let st = &s.daemon.steps;
        for (step, t) in [
            ("lock", st.lock),
            ("wake", st.wake),
            ("publish", st.publish),
            ("confirm", st.confirm),
            ("settle", st.settle),
        ] {
            m.push((
                name(&format!("batch step {step}, mean")),
                "ms",
                t.mean_ms,
                None,
            ));
        }
    }
    if let Some(c) = &r.catch_up {
        let layout = match c.layout {
            Layout::Random => "",
            Layout::DueOrder => " in due order",
        };
        let name = |what: &str| format!("catch-up {}{layout}: {what}", human(c.rows as u64));
        m.push((name("drain"), "rows/s", c.rows_per_sec, None));
        m.push((
            name("drain / best publish limit"),
            "%",
            100.0 * c.rows_per_sec / limit,
            Some(Want::AtLeast(90.0)),
        ));
        m.push((
            name("drain / burst"),
            "%",
            100.0 * c.rows_per_sec / r.burst.rows_per_sec,
            None,
        ));
        m.push((
            name("CPU per TimeOut, every process"),
            "µs",
            c.cpu.per_message_us(c.rows + c.fresh_rows),
            None,
        ));
        m.push((
            name("CPU per TimeOut, daemon"),
            "µs",
            c.cpu.per(c.cpu.firing_ms, c.rows + c.fresh_rows),
            None,
        ));
        m.push((
            name("CPU per TimeOut, Postgres"),
            "µs",
            c.cpu.per(c.cpu.postgres_ms, c.rows + c.fresh_rows),
            None,
        ));
        m.push((name("fresh rows' lateness p50"), "ms", c.fresh_p50_ms, None));
        m.push((name("fresh rows' lateness p99"), "ms", c.fresh_p99_ms, None));
        m.push((
            name("daemon peak RSS"),
            "MiB",
            c.peak_rss_mib,
            Some(Want::AtMost(64.0)),
        ));
    }
    if let Some(i) = &r.idle_cost {
        let name = |what: &str| format!("idle, {} daemons: {what}", i.nodes);
        m.push((
            name("CPU of the busiest"),
            "%",
            i.max_cpu_percent(),
            Some(Want::AtMost(0.5)),
        ));
        m.push((name("announcements"), "/s", i.announcements_per_sec, None));
        m.push((
            name("database transactions"),
            "/s",
            i.db_transactions_per_sec,
            None,
        ));
    }
    if let Some(i) = r.idle_scan.last() {
        let name = format!("idle scan, {} rows not due (median)", human(i.rows));
        m.push((name, "ms", i.median_ms, None));
    }
    m.push((
        "daemon RSS idle".into(),
        "MiB",
        r.memory.idle_before_mib,
        None,
    ));
    m.push((
        "daemon peak RSS (burst)".into(),
        "MiB",
        r.memory.burst_peak_mib,
        None,
    ));
    if let Some(f) = &r.scrape_flood {
        m.extend(flood_measurements(f));
    }
    if let Some(n) = &r.neighbours {
        m.extend(neighbours_measurements(n));
    }
    if let Some(d) = &r.delayed {
        m.extend(delayed_measurements(d, publish));
    }
    m
}

fn delayed_measurements(d: &Delayed, publish: f64) -> Vec<Measurement> {
    let mut m = vec![(
        "delayed: broker alone (quorum queue)".to_owned(),
        "msgs/s",
        d.broker.msgs_per_sec,
        None,
    )];
    for run in &d.ingest {
        let target = (run.nodes == 1).then_some(Want::AtLeast(10_000.0));
        let name = format!("delayed ingest, {} daemon(s)", run.nodes);
        m.push((name, "msgs/s", run.msgs_per_sec, target));
    }
    let s = &d.steady;
    let name = |what: &str| format!("delayed steady {}/s: {what}", s.rate);
    m.push((name("lateness p50"), "ms", s.p50_ms, None));
    m.push((
        name("lateness p99"),
        "ms",
        s.p99_ms,
        Some(Want::AtMost(50.0)),
    ));
    m.push((
        "delayed burst / baseline publish".to_owned(),
        "%",
        100.0 * d.burst.msgs_per_sec / publish,
        Some(Want::AtLeast(80.0)),
    ));
    m
}

/// Median and range of every measurement over `reports` (all runs of one plan).
pub(crate) fn summarize(reports: &[Report]) -> Vec<Summed> {
    summarize_runs(&reports.iter().map(measurements).collect::<Vec<_>>())
}

/// Median and range of every measurement of the first run over all runs.
pub(crate) fn summarize_runs(per_run: &[Vec<Measurement>]) -> Vec<Summed> {
    let Some(first) = per_run.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, (name, unit, _, target))| {
            let mut values: Vec<f64> = per_run
                .iter()
                .filter_map(|run| run.get(i).filter(|m| m.0 == *name).map(|m| m.2))
                .collect();
            values.sort_by(f64::total_cmp);
            let median = percentile(&values, 50.0);
            let pass = target.map(|t| match t {
                Want::AtLeast(v) => median >= v,
                Want::AtMost(v) => median <= v,
            });
            Summed {
                measurement: name.clone(),
                unit,
                min: values.first().copied().unwrap_or(f64::NAN),
                max: values.last().copied().unwrap_or(f64::NAN),
                median,
                values,
                target: *target,
                pass,
            }
        })
        .collect()
}

/// The summary as a Markdown table (what docs/performance.md pastes).
pub(crate) fn summary_table(rows: &[Summed], runs: usize) -> String {
    let mut out = format!(
        "| measurement | median (min–max) of {runs} run(s) | target | |\n|---|---|---|---|\n"
    );
    for r in rows {
        let num = |v: f64| {
            if v.abs() >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        };
        let target = match r.target {
            Some(Want::AtLeast(v)) => format!("≥ {} {}", num(v), r.unit),
            Some(Want::AtMost(v)) => format!("≤ {} {}", num(v), r.unit),
            None => String::new(),
        };
        out += &format!(
            "| {} | {} {} ({}–{}) | {target} | {} |\n",
            r.measurement,
            num(r.median),
            r.unit,
            num(r.min),
            num(r.max),
            verdict(r.pass)
        );
    }
    out
}
