//! Idle cost: three daemons of one group with nothing to do, over a window — their CPU
//! and memory, the announcements the broker carries, the transactions Postgres serves.

use std::sync::atomic::AtomicU64;

use lapin::options::QueueBindOptions;

use crate::prelude::*;
use crate::*;

/// Daemons in the idle group.
const NODES: usize = 3;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct IdleCost {
    pub(crate) nodes: usize,
    pub(crate) secs: f64,
    /// Per daemon: CPU share of one core over the window, in percent.
    pub(crate) cpu_percent: Vec<f64>,
    pub(crate) rss_mib: Vec<f64>,
    /// Announcements of the group the broker routed to an observer, per second.
    pub(crate) announcements_per_sec: f64,
    /// Transactions committed or rolled back in the database per second (every client:
    /// nothing else runs meanwhile but this observer's own two reads).
    pub(crate) db_transactions_per_sec: f64,
}

impl IdleCost {
    pub(crate) fn max_cpu_percent(&self) -> f64 {
        self.cpu_percent.iter().copied().fold(0.0, f64::max)
    }
}

/// Start three daemons, let them settle, then watch them for `secs`.
pub(crate) async fn idle_cost(env: &Env, secs: u64) -> Result<IdleCost> {
    let mut daemons = Vec::new();
    for _ in 0..NODES {
        daemons.push(Daemon::spawn(env)?);
    }
    // One becomes active after an announce interval; let starts and migrations finish.
    tokio::time::sleep(env.settings.election.member_ttl * 2).await;
    let heard = Arc::new(AtomicU64::new(0));
    let observer = observe_announcements(env, heard.clone()).await?;
    let cpu_before: Vec<u64> = daemons.iter().map(cpu_ticks).collect::<Result<_>>()?;
    let tx_before = transactions(&env.pool).await?;
    let started = Instant::now();
    heard.store(0, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let announcements = heard.load(Ordering::Relaxed);
    let tx_after = transactions(&env.pool).await?;
    let mut cpu_percent = Vec::new();
    let mut rss_mib = Vec::new();
    for (d, before) in daemons.iter().zip(cpu_before) {
        let ticks = cpu_ticks(d)?.saturating_sub(before);
        cpu_percent.push(ticks as f64 / USER_HZ / elapsed * 100.0);
        rss_mib.push(d.memory()?.rss as f64 / MIB);
    }
    observer.abort();
    for d in daemons {
        if let Err(e) = d.stop().await {
            eprintln!("warning: idle daemon: {e:#}");
        }
    }
    Ok(IdleCost {
        nodes: NODES,
        secs: elapsed,
        cpu_percent,
        rss_mib,
        announcements_per_sec: announcements as f64 / elapsed,
        db_transactions_per_sec: (tx_after - tx_before) as f64 / elapsed,
    })
}

/// utime + stime of the daemon so far, in USER_HZ ticks.
fn cpu_ticks(d: &Daemon) -> Result<u64> {
    let path = format!("/proc/{}/stat", d.pid);
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let ticks = parse_stat(&stat).context("malformed stat")?.ticks;
    Ok(ticks)
}

async fn transactions(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?)
}

/// A queue of our own bound to the group's announcements; counts what arrives.
async fn observe_announcements(
    env: &Env,
    heard: Arc<AtomicU64>,
) -> Result<tokio::task::JoinHandle<()>> {
    let ch = env.amqp.create_channel().await?;
    let declare = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    let q = ch
        .queue_declare("".into(), declare, FieldTable::default())
        .await?;
    ch.queue_bind(
        q.name().clone(),
        env.settings.amqp.announce_exchange.as_str().into(),
        env.group.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    let mut consumer = ch
        .basic_consume(
            q.name().clone(),
            "idle".into(),
            options,
            FieldTable::default(),
        )
        .await?;
    Ok(tokio::spawn(async move {
        let _keep = ch;
        while let Some(Ok(_)) = consumer.next().await {
            heard.fetch_add(1, Ordering::Relaxed);
        }
    }))
}
