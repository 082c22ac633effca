//! The firing transaction rolled by hand: what a team would write instead of running
//! timeoutd, with the same crates, batch size and concurrency, on the burst's rows.
//! Each worker: `BEGIN`; lock up to a batch of due rows, oldest first, `FOR UPDATE SKIP
//! LOCKED`; publish their TimeOuts (mandatory, persistent, handed over in parts and
//! confirmed as the baseline publisher does); delete the confirmed rows by id; `COMMIT`.
//! No election, no pacing, no per-row fates beyond the confirm, no retries: the least
//! work that still fires each row once. Its rate against the publish limit says what the
//! transaction itself costs on this machine; the daemon's burst against it says what
//! timeoutd adds on top.

use crate::prelude::*;
use crate::*;

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

/// `n` due rows fired by `workers` hand-rolled loops of `batch` rows each.
pub(crate) async fn hand_rolled(
    env: &Env,
    n: usize,
    workers: usize,
    batch: usize,
) -> Result<HandRolled> {
    let ids = fresh_ids(n);
    let mut conn = env.pool.acquire().await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    insert_due(&mut tx, &env.table(), &env.queue, &ids, Deadline::At(None)).await?;
    tx.commit().await?;
    drop(conn);
    analyze(env).await?;
    let (amqp, _) = confirm_channel(env).await?;
    let mut loops = Vec::with_capacity(workers);
    for _ in 0..workers {
        let channel = amqp.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        loops.push(channel);
    }
    env.inbox.take();
    let meter = CpuMeter::start();
    let started = Instant::now();
    let tasks: Vec<_> = loops
        .into_iter()
        .map(|channel| {
            let (pool, table) = (env.pool.clone(), env.table());
            tokio::spawn(async move { fire_loop(&pool, &table, &channel, batch).await })
        })
        .collect();
    let mut transactions = 0;
    for t in tasks {
        transactions += t.await??;
    }
    env.inbox.wait_for(n, receive_limit(n)).await;
    let secs = started.elapsed().as_secs_f64();
    let cpu = meter.spent(secs);
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    let delivery = Delivery::check(&env.inbox.take(), &expected);
    let _ = bounded(
        "close",
        Duration::from_secs(5),
        amqp.close(200, "done".into()),
    )
    .await;
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
