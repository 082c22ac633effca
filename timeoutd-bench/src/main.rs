//! timeoutd-bench: measures the `timeoutd` daemon against raw lapin and sqlx baselines,
//! in one run, against the RabbitMQ and Postgres given on the command line.
//!
//! ```sh
//! cargo build --release --bins
//! cargo run --release --bin timeoutd-bench -- [--quick] [--out bench-results]
//! ```
//!
//! Phases, in order (each run uses its own schema, group and queue, removed at the end):
//! 1. baseline publish: the burst's TimeOut messages (built by `firing::timeout_message`)
//!    published with lapin, mandatory, confirms awaited per window of 500, until a
//!    consumer has received them all;
//! 2. baseline delete: the same number of due rows deleted with sqlx, 500 per
//!    `DELETE … RETURNING *` (no broker);
//! 3. hand-rolled firing: the burst's rows fired by the firing transaction written by hand
//!    (lock, publish with confirms, delete, commit; the daemon's batch size and
//!    concurrency), no daemon running;
//! 4. the daemon (`timeoutd run`, a child process) starts; idle RSS is read;
//! 5. burst: N rows, all due at the same instant T0 (committed before T0), fired by the
//!    daemon; the clock runs from T0 to the consumer's receipt of the last TimeOut;
//! 6. steady: rows due at R/s for S s, each inserted ~1.5 s before its deadline;
//!    lateness = consumer receipt − deadline;
//! 7. scrape flood (unless `--scrape-flood-secs 0`): a steady load of its own, once with
//!    only a readiness prober (`GET /readyz` every 100 ms, 1 s to answer, as a kubelet
//!    probes), once with `--scrapers` clients (300) asking for `/metrics`, `/readyz` and
//!    `/status` in turn on kept-alive connections as fast as they are answered, with
//!    `--scrape-flood-backlog` rows (100k) due in an hour in the table: lateness and the
//!    share of probes answered 200 in both; `--only-scrape-flood` runs this
//!    phase alone (daemon start, the two cases, stop), `--runs` times;
//! 8. big neighbours (unless `--big-neighbours-secs 0`): a steady load of its own, once
//!    alone and once with `--big-rate` rows a second of 256 KiB–2 MiB payloads due among
//!    its rows (sent to a queue that keeps nothing): the ordinary rows' lateness in both;
//!    `--only-big-neighbours` runs this phase alone, `--runs` times;
//!    then idle RSS again, the daemon stopped (SIGTERM);
//! 9. delayed messages (unless `--no-delayed`), with daemons of their own: ingest
//!    throughput (messages due in an hour published with confirms into the ingress, until
//!    all are in `delayed_messages`) with 1 and 3 daemons, and the broker alone (a quorum
//!    queue nobody consumes); steady delivery (`x-delay` 1500 ms, lateness = receipt −
//!    publish − delay); a burst all due at one instant T0 (`x-timeoutd-deliver-at`,
//!    stored before T0), T0 → last received, compared with the baseline publish;
//! 10. idle scan: the daemon's due-row query run directly over tables of 10k/100k/1M rows
//!     that are not due (one schema each, made by the daemon's migrations), median of 200
//!     runs per table taken round-robin, plus `EXPLAIN (ANALYZE, BUFFERS)`.
//!
//! Not part of a whole run: `--only-crowd` (see `crowd`) starts `--crowd-nodes` daemons
//! (100) in one group, then `--crowd-groups` (20) groups of `--crowd-group-size` (3)
//! sharing the broker and the database: time to elect, announcements, Postgres sessions
//! per role, CPU and memory per role, a takeover after `kill -9`, and that no group fires
//! another's rows. It needs more connections than Postgres allows by default;
//! `timeoutd-bench/crowd.sh` runs it against a throwaway cluster and vhost.
//!
//! Not part of a whole run either: `--only-due-bursts` (see `due_bursts`) fires
//! `--due-burst` rows (20000) in shapes the daemon cannot look ahead for (already due
//! when committed, 1 µs apart, 1 s / 1 min / 1 h overdue, single rows committed after
//! their deadline, delayed messages due at once), each against the burst's shape (the
//! rows committed 3 s before their one deadline): to the last received, and the ratio;
//! one daemon per run, `--runs` times (3). Then (unless `--due-bursts-takeover false`)
//! due now and delayed due at once again, each right after a takeover: a group of 3
//! daemons settles, its active node is killed (SIGKILL), and the shape is put in as soon
//! as another node says it is active; the takeover (kill → another active) timed too.
//!
//! Not part of a whole run either: `--only-outbox` (see `outbox`) measures the
//! transactional outbox, `publish_at_commit` from COMMIT to a consumer's receipt with one
//! active daemon: `--outbox-msgs` (2000) transactions at `--outbox-rate` (100/s), then
//! `--outbox-burst` (1000) back to back; `--runs` times (3).
//!
//! What the daemon did in a phase (batches, their durations, TimeOuts fired, lateness at
//! fire time) comes from its `/metrics`, scraped before and after the phase: counter
//! deltas, and histogram buckets for bounds (a bucket bound, not a measured maximum).
//!
//! Results: a table on stdout, `<out>/bench.json`, `<out>/bench.svg`. Missed targets are
//! reported, never turned into a failing exit code.

mod baselines;
mod burst;
mod catch_up;
mod child;
mod cpu;
mod crowd;
mod delayed;
mod due_bursts;
mod env;
mod flood;
mod hand_rolled;
mod idle;
mod idle_cost;
mod insert;
mod limit;
mod neighbours;
mod outbox;
mod prelude;
mod report;
mod scrape;
mod steady;
mod summary;
mod svg;

pub(crate) use baselines::*;
pub(crate) use burst::*;
pub(crate) use catch_up::*;
pub(crate) use child::*;
pub(crate) use cpu::*;
pub(crate) use crowd::*;
pub(crate) use delayed::*;
pub(crate) use due_bursts::*;
pub(crate) use env::*;
pub(crate) use flood::*;
pub(crate) use hand_rolled::*;
pub(crate) use idle::*;
pub(crate) use idle_cost::*;
pub(crate) use insert::*;
pub(crate) use limit::*;
pub(crate) use neighbours::*;
pub(crate) use outbox::*;
use prelude::*;
pub(crate) use report::*;
pub(crate) use scrape::*;
pub(crate) use steady::*;
pub(crate) use summary::*;

pub(crate) const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub(crate) const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Rows per publish window, per delete statement, and per idle-scan `LIMIT`.
pub(crate) const WINDOW: usize = 500;
/// Rows per INSERT statement when filling tables.
pub(crate) const INSERT_CHUNK: usize = 10_000;
/// How long before its deadline a steady row is inserted.
pub(crate) const STEADY_LEAD: Duration = Duration::from_millis(1500);
pub(crate) const STEADY_TICK: Duration = Duration::from_millis(10);
pub(crate) const MIB: f64 = 1024.0 * 1024.0;
/// How long the daemon may take to count TimeOuts the consumer already holds (it counts
/// a batch once it commits).
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(5);
/// Untimed idle scans first: they prepare the statement and warm the caches.
pub(crate) const WARMUP_RUNS: usize = 50;

/// Benchmark timeoutd: burst throughput, steady lateness, idle scan cost, memory.
#[derive(Debug, Clone, Parser)]
#[command(name = "timeoutd-bench")]
pub(crate) struct Args {
    /// Small sizes for a smoke run: 10k burst, 5 s steady, idle scans over 10k and 100k.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Rows in the burst (and in both baselines). Default 100000 (10000 with --quick).
    #[arg(long)]
    pub(crate) burst: Option<usize>,
    /// Duration of the steady phase in seconds. Default 30 (5 with --quick).
    #[arg(long)]
    pub(crate) steady_secs: Option<u64>,
    /// Rows due per second in the steady phases, comma-separated: one phase per rate.
    #[arg(long, value_delimiter = ',', default_values_t = [1000, 5000])]
    pub(crate) rate: Vec<u32>,
    /// Rows overdue by up to an hour, committed at once, in the catch-up phase (0 skips
    /// it). Default 1000000 (20000 with --quick).
    #[arg(long)]
    pub(crate) catch_up: Option<usize>,
    /// How the catch-up's backlog lies on disk: due at random instants (the rows of one
    /// batch on as many heap pages), or inserted in due order (side by side, as the
    /// burst's rows).
    #[arg(long, value_enum, default_value_t = Layout::Random)]
    pub(crate) catch_up_layout: Layout,
    /// Seconds three idle daemons are watched in the idle-cost phase (0 skips it).
    /// Default 60 (10 with --quick).
    #[arg(long)]
    pub(crate) idle_secs: Option<u64>,
    /// Whole runs (baselines and daemon phases interleaved, each run in fresh tables);
    /// the summary gives the median and range of each measurement. Default 3 (1 with
    /// --quick).
    #[arg(long)]
    pub(crate) runs: Option<usize>,
    /// Table sizes of the idle-scan phase, comma-separated. Default 10000,100000,1000000
    /// (10000,100000 with --quick).
    #[arg(long, value_delimiter = ',')]
    pub(crate) idle_rows: Option<Vec<u64>>,
    /// Timed runs of the due-row query per idle table size.
    #[arg(long, default_value_t = 200)]
    pub(crate) scan_runs: usize,
    /// Skip the delayed-message phases.
    #[arg(long)]
    pub(crate) no_delayed: bool,
    /// Delayed messages per ingest run (broker alone, 1 daemon, --delayed-nodes daemons).
    /// Default 20000 (5000 with --quick).
    #[arg(long)]
    pub(crate) delayed_ingest: Option<usize>,
    /// Daemons consuming the ingress in the second ingest run.
    #[arg(long, default_value_t = 3)]
    pub(crate) delayed_nodes: usize,
    /// Duration of the delayed steady phase in seconds. Default 10 (3 with --quick).
    #[arg(long)]
    pub(crate) delayed_steady_secs: Option<u64>,
    /// Delayed messages published per second in the delayed steady phase.
    #[arg(long, default_value_t = 1000)]
    pub(crate) delayed_rate: u32,
    /// Delayed messages in the delayed burst. Default: the --burst size (100000, 10000
    /// with --quick), the size of the baseline publish it is compared with.
    #[arg(long)]
    pub(crate) delayed_burst: Option<usize>,
    /// Duration of each case of the scrape-flood phase in seconds (0 skips it). Default 15
    /// (5 with --quick).
    #[arg(long)]
    pub(crate) scrape_flood_secs: Option<u64>,
    /// Rows due per second during the scrape-flood phase.
    #[arg(long, default_value_t = 500)]
    pub(crate) scrape_flood_rate: u32,
    /// Concurrent clients in the flooded case of the scrape-flood phase.
    #[arg(long, default_value_t = 300)]
    pub(crate) scrapers: usize,
    /// Rows due in an hour kept in the table during the scrape-flood phase (what a count
    /// of the pending rows has to count).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) scrape_flood_backlog: usize,
    /// Run only the scrape-flood phase (daemon start, quiet and flooded case, stop).
    #[arg(long)]
    pub(crate) only_scrape_flood: bool,
    /// Duration of each case of the big-neighbours phase in seconds (0 skips it).
    /// Default 15 (5 with --quick).
    #[arg(long)]
    pub(crate) big_neighbours_secs: Option<u64>,
    /// Ordinary rows due per second during the big-neighbours phase.
    #[arg(long, default_value_t = 200)]
    pub(crate) big_neighbours_rate: u32,
    /// Big rows due per second among them.
    #[arg(long, default_value_t = 5)]
    pub(crate) big_rate: u32,
    /// The big rows' payload sizes, in KiB: from, to.
    #[arg(long, value_delimiter = ',', default_values_t = [256, 2048])]
    pub(crate) big_kib: Vec<usize>,
    /// Run only the big-neighbours phase (daemon start, the two cases, stop).
    #[arg(long)]
    pub(crate) only_big_neighbours: bool,
    /// Run only the crowd phase: `--crowd-nodes` daemons in one group, then
    /// `--crowd-groups` groups of `--crowd-group-size` sharing the broker and the database
    /// (needs a Postgres whose max_connections holds them: see timeoutd-bench/crowd.sh).
    #[arg(long)]
    pub(crate) only_crowd: bool,
    /// Daemons in the crowd's one big group.
    #[arg(long, default_value_t = 100)]
    pub(crate) crowd_nodes: usize,
    /// Small groups sharing the broker and the database after the big group (0 skips).
    #[arg(long, default_value_t = 20)]
    pub(crate) crowd_groups: usize,
    /// Daemons per small group.
    #[arg(long, default_value_t = 3)]
    pub(crate) crowd_group_size: usize,
    /// Seconds of the crowd's quiet window (CPU, memory, announcements, connections).
    /// Default 30 (10 with --quick).
    #[arg(long)]
    pub(crate) crowd_watch_secs: Option<u64>,
    /// Run only the outbox phase: `publish_at_commit` from COMMIT to receipt, a steady
    /// stream then a burst, one transaction per message.
    #[arg(long)]
    pub(crate) only_outbox: bool,
    /// Messages of the outbox's steady stream, one transaction each.
    #[arg(long, default_value_t = 2000)]
    pub(crate) outbox_msgs: usize,
    /// Transactions a second of the outbox's steady stream.
    #[arg(long, default_value_t = 100)]
    pub(crate) outbox_rate: u32,
    /// Transactions of the outbox's burst, back to back on one connection.
    #[arg(long, default_value_t = 1000)]
    pub(crate) outbox_burst: usize,
    /// Run only the due bursts (see `due_bursts`): `--due-burst` rows fired in other
    /// shapes than the burst's (already due when committed, due 1 µs apart, overdue by
    /// 1 s, 1 min, 1 h, single rows committed after their deadline, delayed messages due
    /// at once), each against the same rows committed 3 s before their deadline.
    #[arg(long)]
    pub(crate) only_due_bursts: bool,
    /// Rows (and delayed messages) of each due-burst shape.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) due_burst: usize,
    /// With --only-due-bursts, also due now and delayed with x-delay 0 right after a
    /// takeover: each on a group of 3 daemons whose active node is killed (SIGKILL), put
    /// in as soon as another node's `/status` says active.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub(crate) due_bursts_takeover: bool,
    /// Directory for bench.json and bench.svg.
    #[arg(long, default_value = "bench-results")]
    pub(crate) out: PathBuf,
    /// Write each daemon's stderr (JSON log lines) to `<DIR>/daemon-<pid>.log`, to trace
    /// a phase afterwards (with e.g. `--daemon-rust-log info,timeoutd::firing=trace`).
    #[arg(long)]
    pub(crate) daemon_log: Option<PathBuf>,
    /// `RUST_LOG` of the daemons.
    #[arg(long, default_value = "info")]
    pub(crate) daemon_rust_log: String,
    /// A program run as `PROGRAM start <pid>` when a burst (and the delayed burst) begins
    /// firing and `PROGRAM stop <pid>` once its last message is received, with the firing
    /// daemon's pid: to profile just that (e.g. `perf record -p`, `callgrind_control -i`).
    /// Around the hand-rolled loop likewise, with the pid of the loop's process. The bench
    /// waits for each call to return.
    #[arg(long)]
    pub(crate) burst_hook: Option<PathBuf>,
    /// The timeoutd binary. Default: `timeoutd` next to this program.
    #[arg(long)]
    pub(crate) daemon: Option<PathBuf>,
    #[arg(long, default_value = AMQP_URL)]
    pub(crate) amqp_url: String,
    #[arg(long, default_value = PG_URL)]
    pub(crate) pg_url: String,
}

/// The sizes of one run, resolved from the flags.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Plan {
    pub(crate) quick: bool,
    pub(crate) burst: usize,
    pub(crate) steady_secs: u64,
    pub(crate) rates: Vec<u32>,
    /// 0: no catch-up phase.
    pub(crate) catch_up: usize,
    pub(crate) catch_up_layout: Layout,
    /// 0: no idle-cost phase.
    pub(crate) idle_secs: u64,
    pub(crate) idle_rows: Vec<u64>,
    pub(crate) scan_runs: usize,
    /// `None`: `--no-delayed`.
    pub(crate) delayed: Option<DelayedPlan>,
    /// `None`: `--scrape-flood-secs 0`.
    pub(crate) scrape_flood: Option<FloodPlan>,
    /// `None`: `--big-neighbours-secs 0`.
    pub(crate) neighbours: Option<NeighboursPlan>,
}

/// The big-neighbours phase: each case's steady load, and the big rows among it.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct NeighboursPlan {
    pub(crate) secs: u64,
    pub(crate) rate: u32,
    pub(crate) big_rate: u32,
    pub(crate) min_bytes: usize,
    pub(crate) max_bytes: usize,
}

/// The scrape-flood phase: each case's steady load, and how many scrapers flood.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct FloodPlan {
    pub(crate) secs: u64,
    pub(crate) rate: u32,
    pub(crate) scrapers: usize,
    pub(crate) backlog: usize,
}

impl Plan {
    pub(crate) fn from(args: &Args) -> Result<Self> {
        let (burst, secs, idle) = if args.quick {
            (10_000, 5, vec![10_000, 100_000])
        } else {
            (100_000, 30, vec![10_000, 100_000, 1_000_000])
        };
        let mut idle_rows = args.idle_rows.clone().unwrap_or(idle);
        idle_rows.sort_unstable();
        idle_rows.dedup();
        let burst = args.burst.unwrap_or(burst);
        let delayed = (!args.no_delayed).then(|| DelayedPlan {
            ingest: args
                .delayed_ingest
                .unwrap_or(if args.quick { 5_000 } else { 20_000 }),
            nodes: args.delayed_nodes,
            steady_secs: args
                .delayed_steady_secs
                .unwrap_or(if args.quick { 3 } else { 10 }),
            rate: args.delayed_rate,
            burst: args.delayed_burst.unwrap_or(burst),
        });
        if let Some(d) = &delayed
            && (d.ingest == 0 || d.nodes == 0 || d.steady_secs == 0 || d.rate == 0 || d.burst == 0)
        {
            bail!(
                "--delayed-ingest, --delayed-nodes, --delayed-steady-secs, --delayed-rate and \
                 --delayed-burst must be greater than 0"
            );
        }
        let flood_secs = args
            .scrape_flood_secs
            .unwrap_or(if args.quick { 5 } else { 15 });
        let scrape_flood = (flood_secs > 0).then_some(FloodPlan {
            secs: flood_secs,
            rate: args.scrape_flood_rate,
            scrapers: args.scrapers,
            backlog: args.scrape_flood_backlog,
        });
        if scrape_flood.is_some() && (args.scrape_flood_rate == 0 || args.scrapers == 0) {
            bail!("--scrape-flood-rate and --scrapers must be greater than 0");
        }
        if args.only_scrape_flood && scrape_flood.is_none() {
            bail!("--only-scrape-flood with --scrape-flood-secs 0: nothing to run");
        }
        let neighbours_secs = args
            .big_neighbours_secs
            .unwrap_or(if args.quick { 5 } else { 15 });
        let neighbours = match (neighbours_secs, args.big_kib.as_slice()) {
            (0, _) => None,
            (secs, &[min, max]) if min > 0 && min < max => Some(NeighboursPlan {
                secs,
                rate: args.big_neighbours_rate,
                big_rate: args.big_rate,
                min_bytes: min * 1024,
                max_bytes: max * 1024,
            }),
            _ => bail!("--big-kib takes two sizes, from and to, 0 < from < to"),
        };
        if neighbours.is_some() && (args.big_neighbours_rate == 0 || args.big_rate == 0) {
            bail!("--big-neighbours-rate and --big-rate must be greater than 0");
        }
        if args.only_big_neighbours && neighbours.is_none() {
            bail!("--only-big-neighbours with --big-neighbours-secs 0: nothing to run");
        }
        let plan = Self {
            quick: args.quick,
            burst,
            steady_secs: args.steady_secs.unwrap_or(secs),
            rates: args.rate.clone(),
            idle_secs: args.idle_secs.unwrap_or(if args.quick { 10 } else { 60 }),
            catch_up: args
                .catch_up
                .unwrap_or(if args.quick { 20_000 } else { 1_000_000 }),
            catch_up_layout: args.catch_up_layout,
            idle_rows,
            scan_runs: args.scan_runs,
            delayed,
            scrape_flood,
            neighbours,
        };
        if plan.burst == 0
            || plan.rates.is_empty()
            || plan.rates.contains(&0)
            || plan.scan_runs == 0
            || plan.idle_rows.is_empty()
        {
            bail!("--burst, --rate, --scan-runs and --idle-rows must be greater than 0");
        }
        Ok(plan)
    }
}

#[tokio::main]
pub(crate) async fn main() -> Result<()> {
    if std::env::args().nth(1).as_deref() == Some(LOOP_ARG) {
        return loop_process().await;
    }
    let args = Args::parse();
    let plan = Plan::from(&args)?;
    let daemon_bin = daemon_path(&args)?;
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    if args.only_crowd {
        return only_crowd(&args, daemon_bin, runs).await;
    }
    if args.only_outbox {
        if args.outbox_msgs == 0 || args.outbox_rate == 0 || args.outbox_burst == 0 {
            bail!("--outbox-msgs, --outbox-rate and --outbox-burst must be greater than 0");
        }
        let plan = OutboxPlan {
            msgs: args.outbox_msgs,
            rate: args.outbox_rate,
            burst: args.outbox_burst,
        };
        let measure = async |env: &Env, daemon: &mut Daemon| outbox(env, daemon, plan).await;
        return only_phase(&args, daemon_bin, runs, &OUTBOX, measure).await;
    }
    if args.only_due_bursts {
        if args.due_burst == 0 {
            bail!("--due-burst must be greater than 0");
        }
        let (n, takeover) = (args.due_burst, args.due_bursts_takeover);
        let measure =
            async |env: &Env, daemon: &mut Daemon| due_bursts(env, daemon, n, takeover).await;
        return only_phase(&args, daemon_bin, runs, &DUE_BURSTS, measure).await;
    }
    if let (true, Some(flood)) = (args.only_scrape_flood, plan.scrape_flood) {
        let measure = async |env: &Env, daemon: &mut Daemon| scrape_flood(env, daemon, flood).await;
        return only_phase(&args, daemon_bin, runs, &SCRAPE_FLOOD, measure).await;
    }
    if let (true, Some(plan)) = (args.only_big_neighbours, plan.neighbours) {
        let measure =
            async |env: &Env, daemon: &mut Daemon| big_neighbours(env, daemon, plan).await;
        return only_phase(&args, daemon_bin, runs, &BIG_NEIGHBOURS, measure).await;
    }
    let mut reports = Vec::new();
    for n in 1..=runs {
        println!("== run {n} of {runs}");
        let report = one_run(&args, &plan, daemon_bin.clone()).await?;
        print_table(&report);
        write_results(&args.out.join(format!("run-{n}")), &report)?;
        reports.push(report);
    }
    write_summary(&args.out, &summarize(&reports), runs)
}

/// The summary table on stdout and in `<out>/summary.{md,json}`.
pub(crate) fn write_summary(out: &Path, summary: &[Summed], runs: usize) -> Result<()> {
    let table = summary_table(summary, runs);
    println!("\n{table}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("summary.md"), &table)?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_vec_pretty(summary)?,
    )?;
    println!(
        "wrote {0}/summary.md, {0}/summary.json and each run's results under {0}/run-N",
        out.display()
    );
    Ok(())
}

/// What `--only-…` shows of a phase: its name (of its file too), its lines, its
/// measurements for the summary.
pub(crate) struct Alone<T>(
    pub(crate) &'static str,
    pub(crate) fn(&T) -> Vec<Line>,
    pub(crate) fn(&T) -> Vec<Measurement>,
);

/// `--only-…`: one phase alone, `runs` times, each in a fresh environment with a fresh
/// daemon: its lines printed, its result in `<out>/run-N/<name>.json`, the summary of the
/// runs in `<out>`.
async fn only_phase<T: Serialize>(
    args: &Args,
    daemon_bin: PathBuf,
    runs: usize,
    alone: &Alone<T>,
    measure: impl AsyncFn(&Env, &mut Daemon) -> Result<T>,
) -> Result<()> {
    let Alone(name, lines, measurements) = *alone;
    let mut per_run = Vec::new();
    for n in 1..=runs {
        println!("== run {n} of {runs}");
        let env = Env::setup(args, daemon_bin.clone()).await?;
        println!("timeoutd-bench: schema {}, group {}", env.schema, env.group);
        let alone = async {
            let mut daemon = phase("daemon start", Daemon::start(&env)).await?;
            let result = phase(name, measure(&env, &mut daemon)).await?;
            daemon.stop().await?;
            Ok(result)
        };
        let outcome = tokio::select! {
            r = alone => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
        };
        env.cleanup().await;
        let result = outcome?;
        for l in lines(&result) {
            println!("{:<70} {:<60} {}", l.measurement, l.result, verdict(l.pass));
        }
        let dir = args.out.join(format!("run-{n}"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join(format!("{}.json", name.replace(' ', "-"))),
            serde_json::to_vec_pretty(&result)?,
        )?;
        per_run.push(measurements(&result));
    }
    write_summary(&args.out, &summarize_runs(&per_run), runs)
}

/// One run in fresh tables, a fresh group and a fresh queue, removed afterwards.
async fn one_run(args: &Args, plan: &Plan, daemon_bin: PathBuf) -> Result<Report> {
    let env = Env::setup(args, daemon_bin).await?;
    println!(
        "timeoutd-bench: schema {}, group {}, queue {}; daemon scan.batch_size {}, \
         election.tick {:?}",
        env.schema, env.group, env.queue, env.settings.scan.batch_size, env.settings.election.tick
    );
    let outcome = tokio::select! {
        r = run(&env, plan) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    env.cleanup().await;
    outcome
}

pub(crate) fn daemon_path(args: &Args) -> Result<PathBuf> {
    let path = match &args.daemon {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("locating this program")?
            .with_file_name("timeoutd"),
    };
    if !path.is_file() {
        bail!(
            "daemon binary {} not found: build it first with `cargo build --release --bins` \
             (or pass --daemon PATH)",
            path.display()
        );
    }
    Ok(path)
}

/// All phases, in order. The daemon is killed if anything fails (kill_on_drop).
pub(crate) async fn run(env: &Env, plan: &Plan) -> Result<Report> {
    let started_at = Utc::now();
    if plan.delayed.is_some() && !env.settings.delay.enabled {
        bail!(
            "delay.enabled is false for the daemon (TIMEOUTD__DELAY__ENABLED?): pass --no-delayed"
        );
    }
    let publish = phase("baseline publish", baseline_publish(env, plan.burst)).await?;
    let limit = phase("publish limit", publish_limit(env, plan.burst)).await?;
    let delete = phase("baseline delete", baseline_delete(env, plan.burst)).await?;
    let scan = &env.settings.scan;
    let (workers, batch) = (scan.concurrency as usize, scan.batch_size as usize);
    let hand = phase(
        "hand-rolled firing",
        hand_rolled(env, plan.burst, workers, batch),
    )
    .await?;
    let mut daemon = phase("daemon start", Daemon::start(env)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_before = daemon.memory()?;
    let burst = phase(
        "burst",
        burst(env, &mut daemon, plan.burst, delete.insert_rows_per_sec),
    )
    .await?;
    let peak = daemon.memory()?;
    let mut steady_runs = Vec::new();
    for &rate in &plan.rates {
        let name = format!("steady {rate}/s");
        steady_runs.push(phase(&name, steady(env, &mut daemon, rate, plan.steady_secs)).await?);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_after = daemon.memory()?;
    let scrape_flood = match plan.scrape_flood {
        Some(f) => Some(phase("scrape flood", scrape_flood(env, &mut daemon, f)).await?),
        None => None,
    };
    let neighbours = match plan.neighbours {
        Some(n) => Some(phase("big neighbours", big_neighbours(env, &mut daemon, n)).await?),
        None => None,
    };
    let catch_up = match plan.catch_up {
        0 => None,
        n => {
            let (layout, pace) = (plan.catch_up_layout, publish.rows_per_sec);
            Some(phase("catch-up", catch_up(env, &mut daemon, n, layout, pace)).await?)
        }
    };
    let daemon_warnings = daemon.log.warnings.load(Ordering::Relaxed);
    let daemon_stop = match daemon.stop().await {
        Ok(()) => "exit 0 after SIGTERM".to_owned(),
        Err(e) => {
            eprintln!("warning: {e:#}");
            format!("{e:#}")
        }
    };
    let delayed = match &plan.delayed {
        Some(d) => Some(delayed(env, d).await?),
        None => None,
    };
    let idle_cost = match plan.idle_secs {
        0 => None,
        secs => Some(phase("idle cost", idle_cost(env, secs)).await?),
    };
    let idle_scan = phase("idle scan", idle_scans(env, plan)).await?;
    let memory = Memory::from(idle_before, peak, idle_after);
    Ok(Report::new(
        env,
        plan,
        started_at,
        publish,
        limit,
        delete,
        hand,
        burst,
        steady_runs,
        scrape_flood,
        neighbours,
        catch_up,
        delayed,
        idle_cost,
        idle_scan,
        memory,
        (daemon_warnings, daemon_stop),
    ))
}

pub(crate) async fn phase<T>(name: &str, fut: impl Future<Output = Result<T>>) -> Result<T> {
    println!("-- {name} …");
    let started = Instant::now();
    let out = fut.await.with_context(|| format!("phase {name}"))?;
    println!("   {name} done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(out)
}
