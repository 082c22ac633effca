//! The firing transaction rolled by hand: what a team would write instead of running
//! timeoutd, with the same crates, batch size and concurrency, on the burst's rows.
//! Each worker: `BEGIN`; lock up to a batch of due rows, oldest first, `FOR UPDATE SKIP
//! LOCKED`; publish their TimeOuts (mandatory, persistent, handed over in parts and
//! confirmed as the baseline publisher does); delete the confirmed rows by id; `COMMIT`.
//! No election, no pacing, no per-row fates beyond the confirm, no retries: the least
//! work that still fires each row once. Its rate against the publish limit says what the
//! transaction itself costs on this machine; the daemon's burst against it says what
//! timeoutd adds on top.
//!
//! The loop runs in a process of its own (this program, started with [`LOOP_ARG`]), as
//! the daemon does and as a team would deploy it: sharing the bench's process, its
//! threads would be kept awake by the consumer's, and each would pay less for waking the
//! other than two processes do (docs/performance.md measures the difference).

use crate::prelude::*;
use crate::*;
use tokio::io::AsyncWriteExt;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct HandRolled {
    pub(crate) rows: usize,
    pub(crate) workers: usize,
    pub(crate) batch: usize,
    /// The workers' start (every row already due) → the consumer's receipt of the last
    /// TimeOut.
    pub(crate) secs: f64,
    pub(crate) rows_per_sec: f64,
    pub(crate) transactions: usize,
    pub(crate) delivery: Delivery,
    pub(crate) left_in_table: i64,
    /// CPU of every process over `secs` (the loop runs in this bench).
    pub(crate) cpu: CpuSpent,
}

/// The first argument that makes this program the hand-rolled loop's process.
pub(crate) const LOOP_ARG: &str = "--hand-rolled-loop";
/// What the loop's process reads from its environment (not its arguments: a URL may hold
/// a password).
const ENV_PG: &str = "TIMEOUTD_BENCH_LOOP_PG_URL";
const ENV_AMQP: &str = "TIMEOUTD_BENCH_LOOP_AMQP_URL";
const ENV_TABLE: &str = "TIMEOUTD_BENCH_LOOP_TABLE";
const ENV_WORKERS: &str = "TIMEOUTD_BENCH_LOOP_WORKERS";
const ENV_BATCH: &str = "TIMEOUTD_BENCH_LOOP_BATCH";
/// The loop's process says this once connected, and starts on a line from the bench.
const READY: &str = "ready";
/// Then it says how many transactions it ran, and waits for its stdin to close before it
/// exits: the bench reads its CPU time while it still exists.
const DONE: &str = "transactions ";

/// `n` due rows fired by `workers` hand-rolled loops of `batch` rows each, in a process
/// of their own.
pub(crate) async fn hand_rolled(
    env: &Env,
    n: usize,
    workers: usize,
    batch: usize,
) -> Result<HandRolled> {
    let ids = fresh_ids(n);
    vacuum(env).await?;
    let mut conn = env.pool.acquire().await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    insert_due(&mut tx, &env.table(), &env.queue, &ids, Deadline::At(None)).await?;
    tx.commit().await?;
    drop(conn);
    analyze(env).await?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg(LOOP_ARG)
        .env(ENV_PG, &env.pg_url)
        .env(ENV_AMQP, &env.amqp_url)
        .env(ENV_TABLE, env.table())
        .env(ENV_WORKERS, workers.to_string())
        .env(ENV_BATCH, batch.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the hand-rolled loop's process")?;
    let pid = child
        .id()
        .context("the hand-rolled loop's process is gone")?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        bail!("the hand-rolled loop's process has no stdin or stdout");
    };
    let mut said = BufReader::new(stdout).lines();
    let mut next = async |what: &str, limit: Duration| -> Result<String> {
        bounded(what, limit, said.next_line())
            .await??
            .with_context(|| format!("{what}: the hand-rolled loop's process ended"))
    };
    let ready = next("hand-rolled loop: connect", Duration::from_secs(30)).await?;
    if ready != READY {
        bail!("the hand-rolled loop's process said {ready:?}, not {READY:?}");
    }
    env.inbox.take();
    env.burst_hook("start", pid);
    let meter = CpuMeter::start();
    let started = Instant::now();
    stdin.write_all(b"go\n").await?;
    stdin.flush().await?;
    let done = next("hand-rolled loop", receive_limit(n)).await?;
    let transactions = done
        .strip_prefix(DONE)
        .and_then(|t| t.parse().ok())
        .with_context(|| format!("the hand-rolled loop's process said {done:?}"))?;
    env.inbox.wait_for(n, receive_limit(n)).await;
    let secs = started.elapsed().as_secs_f64();
    let cpu = meter.spent(secs);
    env.burst_hook("stop", pid);
    drop(stdin);
    let status = bounded(
        "hand-rolled loop: exit",
        Duration::from_secs(10),
        child.wait(),
    )
    .await??;
    if !status.success() {
        bail!("the hand-rolled loop's process ended with {status}");
    }
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    let delivery = Delivery::check(&env.inbox.take(), &expected);
    Ok(HandRolled {
        rows: n,
        workers,
        batch,
        secs,
        rows_per_sec: delivery.distinct as f64 / secs,
        transactions,
        delivery,
        left_in_table: env.count_rows().await?,
        cpu,
    })
}

/// The loop's process: connect, say [`READY`], on a line from stdin run the workers
/// until nothing is due, say [`DONE`] and how many transactions ran, exit once stdin
/// closes.
pub(crate) async fn loop_process() -> Result<()> {
    let var = |k: &str| std::env::var(k).with_context(|| format!("{k} is not set"));
    let (pg_url, amqp_url, table) = (var(ENV_PG)?, var(ENV_AMQP)?, var(ENV_TABLE)?);
    let workers: usize = var(ENV_WORKERS)?.parse().context(ENV_WORKERS)?;
    let batch: usize = var(ENV_BATCH)?.parse().context(ENV_BATCH)?;
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(workers)?)
        .min_connections(u32::try_from(workers)?)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&pg_url)
        .await
        .context("connecting to Postgres")?;
    let amqp = connect_amqp(&amqp_url).await?;
    let mut channels = Vec::with_capacity(workers);
    for _ in 0..workers {
        channels.push(confirm_channel(&amqp).await?);
    }
    // Every connection opened before the clock starts, as the daemon's are.
    let mut warm = Vec::with_capacity(workers);
    for _ in 0..workers {
        warm.push(pool.acquire().await?);
    }
    drop(warm);
    let mut stdout = tokio::io::stdout();
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    stdout.write_all(format!("{READY}\n").as_bytes()).await?;
    stdout.flush().await?;
    stdin.next_line().await?;
    let tasks: Vec<_> = channels
        .into_iter()
        .map(|channel| {
            let (pool, table) = (pool.clone(), table.clone());
            tokio::spawn(async move { fire_loop(&pool, &table, &channel, batch).await })
        })
        .collect();
    let mut transactions = 0;
    for t in tasks {
        transactions += t.await??;
    }
    stdout
        .write_all(format!("{DONE}{transactions}\n").as_bytes())
        .await?;
    stdout.flush().await?;
    while stdin.next_line().await?.is_some() {}
    let _ = bounded(
        "close",
        Duration::from_secs(5),
        amqp.close(200, "done".into()),
    )
    .await;
    pool.close().await;
    Ok(())
}

/// Transactions until one finds nothing due; returns how many ran.
async fn fire_loop(
    pool: &PgPool,
    table: &str,
    channel: &lapin::Channel,
    batch: usize,
) -> Result<usize> {
    let due = DUE;
    let lock = format!(
        "SELECT id, process_id, message_type, timeout_at, exchange, routing_key, \
         payload::text AS payload, NULL::int4 AS payload_bytes, traceparent, attempts, {due} AS due_at, \
         now() AS fired_at, now() AS window_end \
         FROM {table} WHERE {due} <= now() ORDER BY {due} LIMIT {batch} \
         FOR UPDATE SKIP LOCKED"
    );
    let delete = format!("DELETE FROM {table} WHERE id = ANY($1)");
    let node = Uuid::new_v4();
    let mut transactions = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<DueRow> = sqlx::query_as(AssertSqlSafe(lock.clone()))
            .fetch_all(&mut *tx)
            .await?;
        transactions += 1;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(transactions);
        }
        let messages = rows
            .iter()
            .map(|row| {
                Ok((
                    row.id,
                    timeout_message(row, node).map_err(|e| anyhow!("{e}"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        if publish_window(channel, &messages).await? > 0 {
            bail!("a hand-rolled batch was not confirmed in full");
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        sqlx::query(AssertSqlSafe(delete.clone()))
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
}
