//! Baselines.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PublishBaseline {
    pub(crate) rows: usize,
    pub(crate) secs: f64,
    pub(crate) rows_per_sec: f64,
    pub(crate) not_confirmed: usize,
    pub(crate) delivery: Delivery,
}

/// A connection of the publisher's own and a channel in confirm mode on it.
pub(crate) async fn publisher(env: &Env) -> Result<(Connection, lapin::Channel)> {
    let conn = connect_amqp(&env.amqp_url).await?;
    let channel = confirm_channel(&conn).await?;
    Ok((conn, channel))
}

/// The burst's TimeOuts, published pipelined in windows of 500 (publish all, then await
/// all confirms), mandatory, until the consumer has them all. Like the daemon, the
/// publisher has its own connection; one untimed window warms it up.
pub(crate) async fn baseline_publish(env: &Env, n: usize) -> Result<PublishBaseline> {
    let mut messages = baseline_messages(&env.queue, n + WINDOW)?;
    let timed = messages.split_off(WINDOW);
    let expected: HashSet<Uuid> = timed.iter().map(|(id, _)| *id).collect();
    let (conn, channel) = publisher(env).await?;
    publish_window(&channel, &messages).await?;
    env.inbox.wait_for(WINDOW, receive_limit(WINDOW)).await;
    env.inbox.take();
    let started = Instant::now();
    let mut not_confirmed = 0;
    for window in timed.chunks(WINDOW) {
        not_confirmed += publish_window(&channel, window).await?;
    }
    let all = env.inbox.wait_for(n, receive_limit(n)).await;
    let secs = started.elapsed().as_secs_f64();
    let delivery = Delivery::check(&env.inbox.take(), &expected);
    if !all {
        eprintln!(
            "   baseline publish: only {} of {n} received",
            delivery.received
        );
    }
    let _ = bounded(
        "close",
        Duration::from_secs(5),
        conn.close(200, "done".into()),
    )
    .await;
    Ok(PublishBaseline {
        rows: n,
        secs,
        rows_per_sec: n as f64 / secs,
        not_confirmed,
        delivery,
    })
}

/// The same messages the daemon would send for these rows (same body, properties).
pub(crate) fn baseline_messages(
    queue: &str,
    n: usize,
) -> Result<Vec<(Uuid, timeoutd::wire::Message)>> {
    let node = Uuid::new_v4();
    let now = Utc::now().trunc_subsecs(6);
    (0..n)
        .map(|i| {
            let row = DueRow {
                id: Uuid::new_v4(),
                process_id: format!("bench-{i}"),
                message_type: "BenchExpected".into(),
                timeout_at: now,
                exchange: String::new(),
                routing_key: queue.to_owned(),
                payload: Some(serde_json::json!({ "i": i }).to_string()),
                payload_bytes: None,
                traceparent: None,
                attempts: 0,
                due_at: now,
                fired_at: now,
                window_end: now,
                tid: None,
            };
            let message = timeout_message(&row, node).map_err(|e| anyhow!("{e}"))?;
            Ok((row.id, message))
        })
        .collect()
}

/// Publish one window; returns how many were not confirmed (nacked, returned, error).
/// Handed to lapin in parts awaited together, as the daemon does: awaiting each publish
/// alone costs two thread wake-ups per message, and the limit would be that cost's.
pub(crate) async fn publish_window(
    channel: &lapin::Channel,
    window: &[(Uuid, timeoutd::wire::Message)],
) -> Result<usize> {
    let mut confirms = Vec::with_capacity(window.len());
    for part in window.chunks(timeoutd::bus::HANDED_OVER_TOGETHER) {
        let handed = futures_util::future::join_all(part.iter().map(|(_, m)| async move {
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let properties = timeoutd::bus::lapin_properties(&m.properties)?;
            let exchange = m.exchange.as_str().into();
            let key = m.routing_key.as_str().into();
            anyhow::Ok(
                channel
                    .basic_publish(exchange, key, options, &m.body, properties)
                    .await?,
            )
        }))
        .await;
        for confirm in handed {
            confirms.push(confirm?);
        }
    }
    let mut failed = 0;
    for confirm in confirms {
        let c = bounded("publisher confirm", Duration::from_secs(30), confirm).await??;
        if c.is_nack() || c.take_message().is_some() {
            failed += 1;
        }
    }
    Ok(failed)
}

pub(crate) fn receive_limit(n: usize) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(5 * n as u64)
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeleteBaseline {
    pub(crate) rows: usize,
    pub(crate) secs: f64,
    pub(crate) rows_per_sec: f64,
    pub(crate) deleted: usize,
    pub(crate) statements: usize,
    /// Rows inserted per second while preparing (used to schedule the burst).
    pub(crate) insert_rows_per_sec: f64,
}

/// Delete `n` due rows, 500 per statement, through the daemon's due index.
pub(crate) async fn baseline_delete(env: &Env, n: usize) -> Result<DeleteBaseline> {
    let mut conn = env.pool.acquire().await?;
    let ids = fresh_ids(n);
    let started = Instant::now();
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    insert_due(&mut tx, &env.table(), &env.queue, &ids, Deadline::At(None)).await?;
    tx.commit().await?;
    let insert_rows_per_sec = n as f64 / started.elapsed().as_secs_f64();
    analyze(env).await?;
    let due = DUE;
    let sql = format!(
        "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE {due} <= now() \
         ORDER BY {due} LIMIT {WINDOW} FOR UPDATE SKIP LOCKED) RETURNING *",
        t = env.table()
    );
    let started = Instant::now();
    let (mut deleted, mut statements) = (0, 0);
    loop {
        let rows = sqlx::query(AssertSqlSafe(sql.clone()))
            .fetch_all(&mut *conn)
            .await?;
        statements += 1;
        if rows.is_empty() {
            break;
        }
        deleted += rows.len();
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(DeleteBaseline {
        rows: n,
        secs,
        rows_per_sec: deleted as f64 / secs,
        deleted,
        statements,
        insert_rows_per_sec,
    })
}

/// The due expression of the schema's first due index (migration 0001): what the
/// baseline delete and the hand-rolled loop order by. The bench's rows have no
/// `retry_at`, so it picks the same rows as the daemon's `greatest(timeout_at, retry_at)`.
pub(crate) const DUE: &str = "coalesce(retry_at, timeout_at)";

/// The table's dead rows (of the phases before) cleared, so that each firing phase
/// starts from the same table: the hand-rolled loop would otherwise find the baseline
/// delete's 100,000 and the daemon's burst those and the loop's as well, and an
/// autovacuum may or may not have come in between.
pub(crate) async fn vacuum(env: &Env) -> Result<()> {
    env.execute(format!("VACUUM {}", env.table())).await?;
    Ok(())
}

pub(crate) async fn analyze(env: &Env) -> Result<()> {
    env.execute(format!("ANALYZE {}", env.table())).await?;
    Ok(())
}
