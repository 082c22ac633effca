//! Scrape flood: TimeOut lateness and readiness under a steady load, first with nobody
//! but a readiness prober watching, then with hundreds of clients hammering `/metrics`,
//! `/readyz` and `/status` as fast as they are answered (contract section 8: observing
//! cannot harm).
//!
//! The scrapers run on a thread and a runtime of their own, at the lowest priority:
//! stand-ins for scrapers on other machines, they must not compete with this program's
//! consumer for its runtime's turns (its receipt times are the lateness measured), nor,
//! more than they must, with the daemon, the broker and the database for the CPUs.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::prelude::*;
use crate::*;

/// What every scraper asks for, in turn.
const PATHS: [&str; 3] = ["/metrics", "/readyz", "/status"];
/// A readiness probe as the kubelet sends it by default: a new connection, one second
/// to answer (`timeoutSeconds: 1`), here ten times a second.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// A scraper's request without an answer this long counts as failed (Prometheus'
/// default `scrape_timeout`).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// After a failed request a scraper waits this long before it connects again, so that
/// a refused connection does not become a busy loop.
const RETRY_AFTER: Duration = Duration::from_millis(10);
/// Far above the daemon's answers (a few KiB).
const MAX_ANSWER: usize = 1 << 20;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScrapeFlood {
    /// Rows due in an hour in the table throughout.
    pub(crate) backlog: usize,
    pub(crate) quiet: FloodCase,
    pub(crate) flooded: FloodCase,
}

/// One steady load and what the HTTP clients got meanwhile.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FloodCase {
    pub(crate) scrapers: usize,
    pub(crate) steady: Steady,
    /// The readiness prober's answers.
    pub(crate) readiness: Answers,
    /// The scrapers' answers, by path (in the order of [`PATHS`]).
    pub(crate) scraped: Vec<(String, Answers)>,
    pub(crate) secs: f64,
}

/// Answers to some requests.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Answers {
    /// 200.
    pub(crate) ok: u64,
    /// Another status (503 from `/readyz`).
    pub(crate) refused: u64,
    /// No answer in time, or no connection.
    pub(crate) failed: u64,
}

impl Answers {
    pub(crate) fn total(&self) -> u64 {
        self.ok + self.refused + self.failed
    }

    /// The share of 200s, in percent (100 without requests: nothing went wrong).
    pub(crate) fn ok_percent(&self) -> f64 {
        match self.total() {
            0 => 100.0,
            n => 100.0 * self.ok as f64 / n as f64,
        }
    }

    fn count(&mut self, answer: &Result<u16>) {
        match answer {
            Ok(200) => self.ok += 1,
            Ok(_) => self.refused += 1,
            Err(_) => self.failed += 1,
        }
    }

    fn add(&mut self, other: &Answers) {
        self.ok += other.ok;
        self.refused += other.refused;
        self.failed += other.failed;
    }

    fn text(&self) -> String {
        format!(
            "{:.2}% of {} answered 200 ({} other status, {} no answer)",
            self.ok_percent(),
            self.total(),
            self.refused,
            self.failed
        )
    }
}

/// The steady load of `plan`, once quiet and once under its scrapers, with its backlog
/// of rows due in an hour in the table (what a process manager with long timeouts
/// holds: what a count has to count), removed afterwards.
pub(crate) async fn scrape_flood(
    env: &Env,
    daemon: &mut Daemon,
    plan: FloodPlan,
) -> Result<ScrapeFlood> {
    let backlog = fresh_ids(plan.backlog);
    let later = Utc::now() + chrono::Duration::hours(1);
    let mut conn = env.pool.acquire().await?;
    insert_due(
        &mut conn,
        &env.table(),
        &env.queue,
        &backlog,
        Deadline::At(Some(later)),
    )
    .await?;
    env.execute(format!("ANALYZE {}", env.table())).await?;
    let cases = async {
        let quiet = flood_case(env, daemon, plan.rate, plan.secs, 0).await?;
        let flooded = flood_case(env, daemon, plan.rate, plan.secs, plan.scrapers).await?;
        Ok(ScrapeFlood {
            backlog: plan.backlog,
            quiet,
            flooded,
        })
    };
    let outcome = cases.await;
    let sql = format!("DELETE FROM {} WHERE id = ANY($1)", env.table());
    sqlx::query(AssertSqlSafe(sql))
        .bind(&backlog)
        .execute(&mut *conn)
        .await?;
    outcome
}

async fn flood_case(
    env: &Env,
    daemon: &mut Daemon,
    rate: u32,
    secs: u64,
    scrapers: usize,
) -> Result<FloodCase> {
    let before = daemon.scrape().await?;
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let flood = Flood::start(daemon.http, scrapers, stopped.clone())?;
    let prober = tokio::spawn(probe_readiness(daemon.http, stopped));
    // The scrapers are at it before the first row is due: its lead is 1.5 s.
    let rows = steady_rows(env, rate, secs).await;
    let _ = stop.send(true);
    let readiness = prober.await.unwrap_or_default();
    let scraped = flood.join().await?;
    let secs = started.elapsed().as_secs_f64();
    let rows = rows?;
    daemon.check_alive()?;
    let after = daemon
        .scrape_after(&before, rows.delivery.distinct as u64, SETTLE_LIMIT)
        .await?;
    Ok(FloodCase {
        scrapers,
        steady: rows.measured(ScanDelta::between(&before, &after)),
        readiness,
        scraped: PATHS
            .iter()
            .zip(scraped)
            .map(|(p, a)| ((*p).to_owned(), a))
            .collect(),
        secs,
    })
}

/// `GET /readyz` every [`PROBE_EVERY`] on a new connection until `stopped`.
async fn probe_readiness(addr: SocketAddr, mut stopped: watch::Receiver<bool>) -> Answers {
    let mut answers = Answers::default();
    let mut every = tokio::time::interval(PROBE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped.changed() => return answers,
            _ = every.tick() => {}
        }
        let answer = get(addr, "/readyz", PROBE_TIMEOUT).await.map(|(s, _)| s);
        answers.count(&answer);
    }
}

/// The scrapers, on a thread of their own.
struct Flood {
    thread: Option<std::thread::JoinHandle<Result<[Answers; 3]>>>,
}

impl Flood {
    fn start(addr: SocketAddr, scrapers: usize, stopped: watch::Receiver<bool>) -> Result<Self> {
        if scrapers == 0 {
            return Ok(Self { thread: None });
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("a runtime for the scrapers")?;
        let thread = std::thread::Builder::new()
            .name("scrapers".into())
            .spawn(move || {
                lowest_priority();
                runtime.block_on(scrape_all(addr, scrapers, stopped))
            })
            .context("a thread for the scrapers")?;
        Ok(Self {
            thread: Some(thread),
        })
    }

    /// Wait for the scrapers once told to stop; their answers by path.
    async fn join(self) -> Result<[Answers; 3]> {
        let Some(thread) = self.thread else {
            return Ok(Default::default());
        };
        tokio::task::spawn_blocking(move || thread.join())
            .await?
            .map_err(|_| anyhow!("a scraper panicked"))?
    }
}

/// Nice 19 for the calling thread (best effort: a flood at normal priority still runs).
#[cfg(target_os = "linux")]
fn lowest_priority() {
    let me = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(me), 19) {
        eprintln!("warning: the scrapers run at normal priority: {e}");
    }
}

#[cfg(not(target_os = "linux"))]
fn lowest_priority() {}

async fn scrape_all(
    addr: SocketAddr,
    scrapers: usize,
    stopped: watch::Receiver<bool>,
) -> Result<[Answers; 3]> {
    let mut set = tokio::task::JoinSet::new();
    for first in 0..scrapers {
        set.spawn(scraper(addr, first, stopped.clone()));
    }
    let mut total: [Answers; 3] = Default::default();
    while let Some(answers) = set.join_next().await {
        for (t, a) in total.iter_mut().zip(answers?) {
            t.add(&a);
        }
    }
    Ok(total)
}

/// One client on one kept-alive connection (as Prometheus scrapes), asking for every
/// path in turn, starting at `first`, as fast as it is answered, until `stopped`.
async fn scraper(
    addr: SocketAddr,
    first: usize,
    mut stopped: watch::Receiver<bool>,
) -> [Answers; 3] {
    let mut answers: [Answers; 3] = Default::default();
    let mut conn: Option<TcpStream> = None;
    for i in (first..).map(|n| n % PATHS.len()) {
        let request = async {
            let stream = match &mut conn {
                Some(s) => s,
                None => conn.insert(TcpStream::connect(addr).await?),
            };
            keep_alive_get(stream, addr, PATHS[i]).await
        };
        let answer = tokio::select! {
            _ = stopped.changed() => break,
            a = tokio::time::timeout(SCRAPE_TIMEOUT, request) => {
                a.unwrap_or_else(|_| Err(anyhow!("no answer within {SCRAPE_TIMEOUT:?}")))
            }
        };
        answers[i].count(&answer);
        if answer.is_err() {
            conn = None;
            tokio::time::sleep(RETRY_AFTER).await;
        }
    }
    answers
}

/// One HTTP/1.1 request on a kept-alive connection; its status (the body is read and
/// dropped, by its `content-length`).
async fn keep_alive_get(stream: &mut TcpStream, addr: SocketAddr, path: &str) -> Result<u16> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    // Byte by byte up to the blank line: the body follows on the same stream.
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await? == 0 || head.len() > MAX_ANSWER {
            bail!("connection closed within the headers");
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no content-length")?;
    if length > MAX_ANSWER {
        bail!("an answer of {length} bytes");
    }
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await?;
    Ok(status)
}

/// The report's lines of the phase.
pub(crate) fn flood_lines(f: &ScrapeFlood) -> Vec<Line> {
    let mut lines = Vec::new();
    for case in [&f.quiet, &f.flooded] {
        let s = &case.steady;
        let name = |what: &str| {
            format!(
                "scrape flood, {} scrapers, steady {}/s, {} pending: {what}",
                case.scrapers,
                s.rate,
                human(f.backlog as u64)
            )
        };
        lines.push(line(
            &name("lateness p50 / p99 / max"),
            format!(
                "{:.1} / {:.1} / {:.1} ms; at fire p99 {} (/metrics)",
                s.p50_ms,
                s.p99_ms,
                s.max_ms,
                bound_text(s.daemon.lateness_p99_le_ms)
            ),
            "",
            None,
        ));
        lines.push(line(
            &name("each row once, none early"),
            format!("{}; {} early", delivery_text(&s.delivery, 0), s.early),
            "= rows, 0 dup, 0 early",
            Some(s.delivery.exact(s.rows) && s.early == 0),
        ));
        lines.push(line(
            &name("/readyz probe (every 100 ms, 1 s to answer)"),
            case.readiness.text(),
            "100%",
            Some(case.readiness.ok == case.readiness.total()),
        ));
        for (path, answers) in case.scraped.iter().filter(|_| case.scrapers > 0) {
            lines.push(line(
                &name(&format!("scrapers' {path}")),
                format!(
                    "{:.0}/s; {}",
                    answers.total() as f64 / case.secs,
                    answers.text()
                ),
                "",
                None,
            ));
        }
    }
    lines
}

/// What `--only-scrape-flood` shows.
pub(crate) const SCRAPE_FLOOD: Alone<ScrapeFlood> =
    Alone("scrape flood", flood_lines, flood_measurements);

/// The summary's measurements of the phase.
pub(crate) fn flood_measurements(f: &ScrapeFlood) -> Vec<Measurement> {
    let mut m = Vec::new();
    for case in [&f.quiet, &f.flooded] {
        let s = &case.steady;
        let name = |what: &str| format!("scrape flood, {} scrapers: {what}", case.scrapers);
        m.push((name("lateness p50"), "ms", s.p50_ms, None));
        m.push((name("lateness p99"), "ms", s.p99_ms, None));
        m.push((name("lateness max"), "ms", s.max_ms, None));
        m.push((
            name("/readyz probes answered 200"),
            "%",
            case.readiness.ok_percent(),
            Some(Want::AtLeast(100.0)),
        ));
        if case.scrapers > 0 {
            let all = case
                .scraped
                .iter()
                .fold(Answers::default(), |mut t, (_, a)| {
                    t.add(a);
                    t
                });
            m.push((
                name("scrapers' requests answered"),
                "req/s",
                (all.ok + all.refused) as f64 / case.secs,
                None,
            ));
            let readyz = case.scraped.iter().find(|(p, _)| p == "/readyz");
            let percent = readyz.map_or(f64::NAN, |(_, a)| a.ok_percent());
            m.push((name("scrapers' /readyz answered 200"), "%", percent, None));
        }
    }
    m
}
