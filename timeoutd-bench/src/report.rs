//! Report.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Memory {
    pub(crate) idle_before_mib: f64,
    pub(crate) burst_peak_mib: f64,
    pub(crate) idle_after_mib: f64,
}

impl Memory {
    pub(crate) fn from(before: Mem, peak: Mem, after: Mem) -> Self {
        Self {
            idle_before_mib: before.rss as f64 / MIB,
            burst_peak_mib: peak.hwm as f64 / MIB,
            idle_after_mib: after.rss as f64 / MIB,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Line {
    pub(crate) measurement: String,
    pub(crate) result: String,
    pub(crate) target: String,
    /// `None`: no target.
    pub(crate) pass: Option<bool>,
}

pub(crate) fn line(measurement: &str, result: String, target: &str, pass: Option<bool>) -> Line {
    Line {
        measurement: measurement.to_owned(),
        result,
        target: target.to_owned(),
        pass,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Meta {
    pub(crate) started_at: DateTime<Utc>,
    pub(crate) plan: Plan,
    pub(crate) cpus: usize,
    pub(crate) bench_profile: &'static str,
    pub(crate) daemon: String,
    pub(crate) daemon_scan_batch_size: u32,
    pub(crate) daemon_election_tick_ms: u128,
    pub(crate) daemon_warnings: usize,
    pub(crate) daemon_stop: String,
    pub(crate) schema: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) meta: Meta,
    pub(crate) publish: PublishBaseline,
    pub(crate) limit: PublishLimit,
    pub(crate) delete: DeleteBaseline,
    pub(crate) hand: HandRolled,
    pub(crate) burst: Burst,
    /// One per `--rate`.
    pub(crate) steady: Vec<Steady>,
    /// `None` with `--scrape-flood-secs 0`.
    pub(crate) scrape_flood: Option<ScrapeFlood>,
    /// `None` with `--big-neighbours-secs 0`.
    pub(crate) neighbours: Option<BigNeighbours>,
    /// `None` with `--catch-up 0`.
    pub(crate) catch_up: Option<CatchUp>,
    /// `None` with `--idle-secs 0`.
    pub(crate) idle_cost: Option<IdleCost>,
    /// `None` with `--no-delayed`.
    pub(crate) delayed: Option<Delayed>,
    pub(crate) idle_scan: Vec<IdleScan>,
    pub(crate) memory: Memory,
    pub(crate) lines: Vec<Line>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        env: &Env,
        plan: &Plan,
        started_at: DateTime<Utc>,
        publish: PublishBaseline,
        limit: PublishLimit,
        delete: DeleteBaseline,
        hand: HandRolled,
        burst: Burst,
        steady: Vec<Steady>,
        scrape_flood: Option<ScrapeFlood>,
        neighbours: Option<BigNeighbours>,
        catch_up: Option<CatchUp>,
        delayed: Option<Delayed>,
        idle_cost: Option<IdleCost>,
        idle_scan: Vec<IdleScan>,
        memory: Memory,
        (daemon_warnings, daemon_stop): (usize, String),
    ) -> Self {
        let meta = Meta {
            started_at,
            plan: plan.clone(),
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            bench_profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            daemon: env.daemon_bin.display().to_string(),
            daemon_scan_batch_size: env.settings.scan.batch_size,
            daemon_election_tick_ms: env.settings.election.tick.as_millis(),
            daemon_warnings,
            daemon_stop,
            schema: env.schema.clone(),
        };
        let mut report = Self {
            meta,
            publish,
            limit,
            delete,
            hand,
            burst,
            steady,
            scrape_flood,
            neighbours,
            catch_up,
            idle_cost,
            delayed,
            idle_scan,
            memory,
            lines: Vec::new(),
        };
        report.lines = report.table_lines();
        report
    }

    pub(crate) fn table_lines(&self) -> Vec<Line> {
        let mut lines = self.throughput_lines();
        lines.extend(limit_lines(&self.limit, self.burst.rows_per_sec));
        lines.extend(hand_rolled_lines(
            &self.hand,
            self.limit.best.msgs_per_sec,
            self.burst.rows_per_sec,
        ));
        for s in &self.steady {
            lines.extend(steady_lines(s));
        }
        if let Some(f) = &self.scrape_flood {
            lines.extend(flood_lines(f));
        }
        if let Some(n) = &self.neighbours {
            lines.extend(neighbours_lines(n));
        }
        if let Some(c) = &self.catch_up {
            lines.extend(catch_up_lines(c, self.limit.best.msgs_per_sec));
        }
        if let Some(i) = &self.idle_cost {
            lines.extend(idle_cost_lines(i));
        }
        lines.extend(self.idle_lines());
        lines.extend(self.memory_lines());
        lines.extend(self.delayed_lines());
        lines
    }

    pub(crate) fn throughput_lines(&self) -> Vec<Line> {
        let (p, d, b) = (&self.publish, &self.delete, &self.burst);
        let ratio = b.rows_per_sec / p.rows_per_sec;
        vec![
            line(
                "baseline publish (lapin, confirms, window 500)",
                format!(
                    "{} msgs in {:.2} s = {:.0}/s ({} unconfirmed)",
                    p.rows, p.secs, p.rows_per_sec, p.not_confirmed
                ),
                "",
                None,
            ),
            line(
                "baseline delete (sqlx, DELETE … RETURNING, 500/stmt)",
                format!(
                    "{} rows in {:.2} s = {:.0}/s",
                    d.deleted, d.secs, d.rows_per_sec
                ),
                "",
                None,
            ),
            line(
                "burst: due (T0) → last TimeOut received",
                format!(
                    "{} rows in {:.2} s = {:.0}/s",
                    b.rows,
                    b.last_ms / 1e3,
                    b.rows_per_sec
                ),
                "",
                None,
            ),
            line(
                "burst: how the daemon spent it (/metrics)",
                format!(
                    "first TimeOut {:.0} ms after T0, first→last {:.0}/s; {}; \
                     batch time {:.0}% of the wall time (batches overlap)",
                    b.first_ms,
                    b.drain_rows_per_sec,
                    batches_text(&b.daemon),
                    b.busy_fraction * 100.0
                ),
                "",
                None,
            ),
            line(
                "burst: a batch's steps, mean (/metrics)",
                b.daemon.steps.text(),
                "",
                None,
            ),
            line(
                "burst: CPU per TimeOut, every process (/proc)",
                b.cpu.per_message_text(b.rows, "daemon", "bench (consumer)"),
                "",
                None,
            ),
            line(
                "burst / baseline publish",
                format!("{:.0}%", ratio * 100.0),
                "≥ 80%",
                Some(ratio >= 0.8),
            ),
            line(
                "burst: each row exactly once",
                delivery_text(&b.delivery, b.left_in_table),
                "= rows, 0 dup",
                Some(b.delivery.exact(b.rows) && b.left_in_table == 0),
            ),
        ]
    }

    pub(crate) fn idle_lines(&self) -> Vec<Line> {
        let mut lines: Vec<Line> = self
            .idle_scan
            .iter()
            .map(|s| {
                line(
                    &format!("idle scan, {} rows not due", human(s.rows)),
                    format!(
                        "median {:.3} ms (p90 {:.3}, server {:.3} ms)",
                        s.median_ms, s.p90_ms, s.explain_ms
                    ),
                    "index scan",
                    Some(s.index_used),
                )
            })
            .collect();
        if let (Some(small), Some(big)) = (self.idle_scan.first(), self.idle_scan.last()) {
            let ratio = big.median_ms / small.median_ms;
            lines.push(line(
                &format!("idle scan {} vs {}", human(big.rows), human(small.rows)),
                format!("{ratio:.2}×, {:.3} ms", big.median_ms),
                "≤ 2× and < 1 ms",
                Some(ratio <= 2.0 && big.median_ms < 1.0),
            ));
        }
        lines
    }

    pub(crate) fn memory_lines(&self) -> Vec<Line> {
        let m = &self.memory;
        vec![
            line(
                "daemon RSS idle, before burst",
                format!("{:.1} MiB", m.idle_before_mib),
                "≤ 32 MiB",
                Some(m.idle_before_mib <= 32.0),
            ),
            line(
                "daemon peak RSS (VmHWM) after burst",
                format!("{:.1} MiB", m.burst_peak_mib),
                "≤ 96 MiB",
                Some(m.burst_peak_mib <= 96.0),
            ),
            line(
                "daemon RSS idle, after steady",
                format!("{:.1} MiB", m.idle_after_mib),
                "≤ 32 MiB",
                Some(m.idle_after_mib <= 32.0),
            ),
        ]
    }
}

impl Report {
    pub(crate) fn delayed_lines(&self) -> Vec<Line> {
        let Some(d) = &self.delayed else {
            return Vec::new();
        };
        let b = &d.broker;
        let mut lines = vec![line(
            "delayed: baseline publish (quorum queue, no consumer)",
            format!(
                "{} msgs in {:.2} s = {:.0}/s ({} unconfirmed)",
                b.msgs, b.secs, b.msgs_per_sec, b.not_confirmed
            ),
            "",
            None,
        )];
        for run in &d.ingest {
            lines.extend(ingest_lines(run));
        }
        lines.extend(self.delayed_steady_lines(&d.steady));
        lines.extend(self.delayed_burst_lines(&d.burst));
        lines
    }

    pub(crate) fn delayed_steady_lines(&self, s: &DelayedSteady) -> Vec<Line> {
        let d = &s.daemon;
        vec![
            line(
                &format!(
                    "delayed steady {}/s for {} s, x-delay {} ms: lateness p50 / p90",
                    s.rate, s.secs, s.delay_ms
                ),
                format!(
                    "{:.1} ms / {:.1} ms (mean {:.1} ms, max {:.1} ms)",
                    s.p50_ms, s.p90_ms, s.mean_ms, s.max_ms
                ),
                "",
                None,
            ),
            line(
                "delayed steady: lateness p99 (receipt − publish − delay)",
                format!("{:.1} ms", s.p99_ms),
                "≤ 50 ms",
                Some(s.p99_ms <= 50.0),
            ),
            line(
                "delayed steady: each message once, none early",
                format!(
                    "{}; {} early; {} unconfirmed",
                    delivery_text(&s.delivery, s.left_in_table),
                    s.early,
                    s.not_confirmed
                ),
                "= msgs, 0 dup, 0 early",
                Some(
                    s.delivery.exact(s.msgs)
                        && s.early == 0
                        && s.left_in_table == 0
                        && s.not_confirmed == 0,
                ),
            ),
            line(
                "delayed steady: the daemon's view (/metrics)",
                format!(
                    "{}; lateness at fire mean {:.1} ms, p99 {}; {}",
                    batches_text(d),
                    d.lateness_mean_ms,
                    bound_text(d.lateness_p99_le_ms),
                    ingest_text(&s.ingest)
                ),
                "",
                None,
            ),
        ]
    }

    pub(crate) fn delayed_burst_lines(&self, b: &DelayedBurst) -> Vec<Line> {
        let ratio = b.msgs_per_sec / self.publish.rows_per_sec;
        vec![
            line(
                "delayed burst: due (T0) → last received",
                format!(
                    "{} msgs in {:.2} s = {:.0}/s",
                    b.msgs,
                    b.last_ms / 1e3,
                    b.msgs_per_sec
                ),
                "",
                None,
            ),
            line(
                "delayed burst: how the daemon spent it (/metrics)",
                format!(
                    "stored in {:.2} s, {:.0} ms before T0; first message {:.0} ms after T0, \
                     first→last {:.0}/s; {}; peak RSS {:.1} MiB",
                    b.stored_secs,
                    b.stored_before_t0_ms,
                    b.first_ms,
                    b.drain_msgs_per_sec,
                    batches_text(&b.daemon),
                    b.peak_rss_mib
                ),
                "",
                None,
            ),
            line(
                "delayed burst / baseline publish",
                format!(
                    "{:.0}% (of {:.0}/s, {} msgs)",
                    ratio * 100.0,
                    self.publish.rows_per_sec,
                    self.publish.rows
                ),
                "≥ 80%",
                Some(ratio >= 0.8),
            ),
            line(
                "delayed burst: each message exactly once",
                format!(
                    "{}; {} unconfirmed",
                    delivery_text(&b.delivery, b.left_in_table),
                    b.not_confirmed
                ),
                "= msgs, 0 dup",
                Some(b.delivery.exact(b.msgs) && b.left_in_table == 0 && b.not_confirmed == 0),
            ),
        ]
    }
}

/// Two rows per ingest run: the rate (with a target for one daemon), the daemon's view.
pub(crate) fn ingest_lines(run: &IngestRun) -> Vec<Line> {
    let nodes = match run.nodes {
        1 => "1 daemon".to_owned(),
        n => format!("{n} daemons"),
    };
    let mut result = format!(
        "{} msgs in {:.2} s = {:.0}/s (all confirmed after {:.2} s",
        run.msgs, run.stored_secs, run.msgs_per_sec, run.confirmed_secs
    );
    if run.not_confirmed > 0 {
        result.push_str(&format!(", {} unconfirmed", run.not_confirmed));
    }
    if !run.complete {
        result.push_str(&format!("; only {} stored", run.rows));
    }
    result.push(')');
    let (target, pass) = if run.nodes == 1 {
        (
            "≥ 10000/s",
            Some(run.complete && run.not_confirmed == 0 && run.msgs_per_sec >= 10_000.0),
        )
    } else {
        ("", None)
    };
    vec![
        line(
            &format!("delayed ingest, {nodes}: first publish → all stored"),
            result,
            target,
            pass,
        ),
        line(
            &format!("delayed ingest, {nodes}: the daemons' view (/metrics)"),
            ingest_text(&run.daemon),
            "",
            None,
        ),
    ]
}

/// What an ingress did: batches and their arrival → commit time (p99 a bucket bound).
pub(crate) fn ingest_text(d: &IngestDelta) -> String {
    let mut s = format!(
        "{} stored in {} ingest batches ({:.1} per batch), batch arrival → commit mean \
         {:.1} ms, p99 {}",
        d.stored,
        d.batches,
        d.mean_batch_msgs,
        d.mean_ms,
        bound_text(d.p99_le_ms)
    );
    if d.held > 0 || d.duplicates > 0 {
        s.push_str(&format!("; {} held, {} duplicates", d.held, d.duplicates));
    }
    s
}

/// Batches and TimeOuts a phase's scrapes saw; the longest batch is a bucket bound.
pub(crate) fn batches_text(d: &ScanDelta) -> String {
    let mut s = format!(
        "{} batches, mean {:.1} ms, longest {} (bucket bound); {} fired",
        d.batches,
        d.mean_batch_ms,
        bound_text(d.max_batch_le_ms),
        d.fired
    );
    if d.publish_failures > 0 {
        s.push_str(&format!(", {} publish failures", d.publish_failures));
    }
    s
}

pub(crate) fn delivery_text(d: &Delivery, left: i64) -> String {
    let mut s = format!(
        "received {}, distinct {}, dup {}, missing {}",
        d.received, d.distinct, d.duplicates, d.missing
    );
    if left != 0 {
        s.push_str(&format!(", {left} rows left"));
    }
    s
}

pub(crate) fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

pub(crate) fn verdict(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "PASS",
        Some(false) => "FAIL",
        None => "",
    }
}

/// A Markdown table, so it can be pasted as is.
pub(crate) fn print_table(report: &Report) {
    let m = &report.meta;
    println!(
        "\ntimeoutd-bench {} · {} CPUs · bench {} · daemon: scan.batch_size {}, \
         election.tick {} ms",
        m.started_at.format("%Y-%m-%d %H:%M UTC"),
        m.cpus,
        m.bench_profile,
        m.daemon_scan_batch_size,
        m.daemon_election_tick_ms
    );
    let width = |f: fn(&Line) -> usize, head: &str| {
        report
            .lines
            .iter()
            .map(f)
            .max()
            .unwrap_or(0)
            .max(head.chars().count())
    };
    let w0 = width(|l| l.measurement.chars().count(), "measurement");
    let w1 = width(|l| l.result.chars().count(), "result");
    let w2 = width(|l| l.target.chars().count(), "target");
    let row = |a: &str, b: &str, c: &str, d: &str| {
        println!("| {a:<w0$} | {b:<w1$} | {c:<w2$} | {d:<7} |");
    };
    println!();
    row("measurement", "result", "target", "verdict");
    row(&"-".repeat(w0), &"-".repeat(w1), &"-".repeat(w2), "-------");
    for l in &report.lines {
        row(&l.measurement, &l.result, &l.target, verdict(l.pass));
    }
    if m.plan.quick {
        println!(
            "\nnote: --quick is a smoke run; a burst this short is dominated by the wait for \
             the first scan, so its ratio to the baseline means little"
        );
    }
    let failed = report
        .lines
        .iter()
        .filter(|l| l.pass == Some(false))
        .count();
    println!(
        "\n{failed} target(s) missed; daemon warnings/errors logged: {}; daemon stop: {}",
        m.daemon_warnings, m.daemon_stop
    );
    if let Some(d) = &report.delayed {
        let stops = match d.daemon_stop_errors.len() {
            0 => "all exit 0 after SIGTERM".to_owned(),
            n => format!("{n} not clean: {}", d.daemon_stop_errors.join("; ")),
        };
        println!(
            "delayed phases' daemons: warnings/errors logged: {}; stops: {stops}",
            d.daemon_warnings
        );
    }
    if let Some(big) = report.idle_scan.last() {
        println!(
            "\nEXPLAIN (ANALYZE, BUFFERS), {} rows not due:",
            human(big.rows)
        );
        for l in &big.plan {
            println!("  {l}");
        }
    }
}

pub(crate) fn write_results(out: &Path, report: &Report) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(out.join("bench.json"), json).context("writing bench.json")?;
    std::fs::write(out.join("bench.svg"), svg::chart(report)).context("writing bench.svg")?;
    Ok(())
}

/// One steady phase: lateness percentiles against the targets, exactness, the daemon's
/// view and where its batches' time went.
pub(crate) fn steady_lines(s: &Steady) -> Vec<Line> {
    let name = |what: &str| format!("steady {}/s: {what}", s.rate);
    let d = &s.daemon;
    vec![
        line(
            &name(&format!("lateness p50 / p90 ({} s)", s.secs)),
            format!(
                "{:.1} ms / {:.1} ms (mean {:.1} ms)",
                s.p50_ms, s.p90_ms, s.mean_ms
            ),
            "",
            None,
        ),
        line(
            &name("lateness p99"),
            format!("{:.1} ms", s.p99_ms),
            "≤ 5 ms",
            Some(s.p99_ms <= 5.0),
        ),
        line(
            &name("lateness max"),
            format!("{:.1} ms", s.max_ms),
            "≤ 20 ms",
            Some(s.max_ms <= 20.0),
        ),
        line(
            &name("each row once, none early"),
            format!(
                "{}; {} early; rows inserted ≥ {:.0} ms before due",
                delivery_text(&s.delivery, 0),
                s.early,
                s.min_insert_lead_ms
            ),
            "= rows, 0 dup, 0 early",
            Some(s.delivery.exact(s.rows) && s.early == 0),
        ),
        line(
            &name("the daemon's view (/metrics)"),
            format!(
                "{}; lateness at fire mean {:.1} ms, p99 {}",
                batches_text(d),
                d.lateness_mean_ms,
                bound_text(d.lateness_p99_le_ms)
            ),
            "",
            None,
        ),
        line(
            &name("a batch's steps, mean (/metrics)"),
            d.steps.text(),
            "",
            None,
        ),
    ]
}

/// The catch-up phase: drain pace against the publish baseline, exactness, the rows that
/// came due meanwhile, memory.
pub(crate) fn catch_up_lines(c: &CatchUp, publish: f64) -> Vec<Line> {
    let ratio = c.rows_per_sec / publish;
    vec![
        line(
            &format!(
                "catch-up: {} rows overdue ≤ 1 h, commit → last received",
                human(c.rows as u64)
            ),
            format!(
                "{:.2} s = {:.0}/s (inserted in {:.1} s); {}",
                c.drain_secs,
                c.rows_per_sec,
                c.insert_secs,
                batches_text(&c.daemon)
            ),
            "",
            None,
        ),
        line(
            "catch-up: CPU per TimeOut, every process (/proc)",
            c.cpu.per_message_text(
                c.rows + c.fresh_rows,
                "daemon",
                "bench (consumer, fresh rows)",
            ),
            "",
            None,
        ),
        line(
            "catch-up / best publish limit",
            format!("{:.0}%", ratio * 100.0),
            "≥ 90%",
            Some(ratio >= 0.9),
        ),
        line(
            "catch-up: each row exactly once",
            delivery_text(&c.delivery, c.left_in_table),
            "= rows, 0 dup",
            Some(c.delivery.exact(c.rows) && c.left_in_table == 0),
        ),
        line(
            "catch-up: rows coming due meanwhile (100/s), lateness p50 / p99 / max",
            format!(
                "{:.1} / {:.1} / {:.1} ms over {} rows, {} early",
                c.fresh_p50_ms, c.fresh_p99_ms, c.fresh_max_ms, c.fresh_rows, c.fresh_early
            ),
            "0 early",
            Some(c.fresh_early == 0),
        ),
        line(
            "catch-up: daemon peak RSS (VmHWM)",
            format!("{:.1} MiB", c.peak_rss_mib),
            "≤ 64 MiB",
            Some(c.peak_rss_mib <= 64.0),
        ),
    ]
}

/// Three idle daemons: CPU and memory each, broker and database traffic.
pub(crate) fn idle_cost_lines(i: &IdleCost) -> Vec<Line> {
    let each = |v: &[f64], unit: &str| {
        v.iter()
            .map(|x| format!("{x:.2}{unit}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        line(
            &format!(
                "idle: {} daemons for {:.0} s, CPU of one core each",
                i.nodes, i.secs
            ),
            each(&i.cpu_percent, " %"),
            "≤ 0.5 %",
            Some(i.max_cpu_percent() <= 0.5),
        ),
        line("idle: RSS each", each(&i.rss_mib, " MiB"), "", None),
        line(
            "idle: announcements routed per second (one observer)",
            format!("{:.2}/s", i.announcements_per_sec),
            "",
            None,
        ),
        line(
            "idle: database transactions per second (all clients)",
            format!("{:.1}/s", i.db_transactions_per_sec),
            "",
            None,
        ),
    ]
}

/// The publish limit search and the burst against its best.
pub(crate) fn limit_lines(l: &PublishLimit, burst: f64) -> Vec<Line> {
    let t = |t: &Trial| {
        format!(
            "{} ch × window {}: {:.0}/s",
            t.channels, t.window, t.msgs_per_sec
        )
    };
    let ratio = burst / l.best.msgs_per_sec;
    vec![
        line(
            "publish limit: channels × confirm window, consumed (best first)",
            {
                let mut trials = l.trials.clone();
                trials.sort_by(|a, b| b.msgs_per_sec.total_cmp(&a.msgs_per_sec));
                trials.iter().map(t).collect::<Vec<_>>().join("; ")
            },
            "",
            None,
        ),
        line(
            "publish limit, best setting: CPU per message, every process (/proc)",
            l.best
                .cpu
                .per_message_text(l.best.msgs, "daemon", "bench (publisher, consumer)"),
            "",
            None,
        ),
        line(
            "publish limit, nobody consuming (best setting)",
            t(&l.raw),
            "",
            None,
        ),
        line(
            "burst / best publish limit",
            format!("{:.0}%", ratio * 100.0),
            "≥ 90%",
            Some(ratio >= 0.9),
        ),
    ]
}

/// The firing transaction rolled by hand, against the limit, and the daemon's burst
/// against it.
pub(crate) fn hand_rolled_lines(h: &HandRolled, limit: f64, burst: f64) -> Vec<Line> {
    vec![
        line(
            "hand-rolled firing (lock, publish, delete, commit)",
            format!(
                "{} rows in {:.2} s = {:.0}/s = {:.0}% of the publish limit; {} workers × \
                 batch {}, {} transactions; {}",
                h.rows,
                h.secs,
                h.rows_per_sec,
                100.0 * h.rows_per_sec / limit,
                h.workers,
                h.batch,
                h.transactions,
                delivery_text(&h.delivery, h.left_in_table)
            ),
            "",
            Some(h.delivery.exact(h.rows) && h.left_in_table == 0),
        ),
        line(
            "hand-rolled firing: CPU per TimeOut, every process (/proc)",
            h.cpu.per_message_text(h.rows, "loop", "bench (consumer)"),
            "",
            None,
        ),
        line(
            "burst / hand-rolled firing",
            format!("{:.0}%", 100.0 * burst / h.rows_per_sec),
            "",
            None,
        ),
    ]
}
