//! Idle scan.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct IdleScan {
    pub(crate) rows: u64,
    pub(crate) runs: usize,
    pub(crate) median_ms: f64,
    pub(crate) p90_ms: f64,
    /// "Execution Time" of `EXPLAIN (ANALYZE, BUFFERS)` (server side, no round trip).
    pub(crate) explain_ms: f64,
    pub(crate) index_used: bool,
    pub(crate) plan: Vec<String>,
}

/// One table per size, each in its own schema made by the daemon's migrations, filled
/// with rows due in a day; the due query is then timed round-robin over the tables, so a
/// change in machine load hits every size alike.
pub(crate) async fn idle_scans(env: &Env, plan: &Plan) -> Result<Vec<IdleScan>> {
    let mut tables = Vec::new();
    for &size in &plan.idle_rows {
        let table = env.idle_table(size).await?;
        fill_not_due(env, &table, size).await?;
        env.execute(format!("ANALYZE {table}")).await?;
        tables.push((size, table));
    }
    let mut conn = env.pool.acquire().await?;
    tokio::time::sleep(Duration::from_secs(1)).await; // let the fills' writes settle
    let timings = time_scans(&mut conn, &tables, plan.scan_runs).await?;
    let mut out = Vec::new();
    for ((rows, table), mut times) in tables.into_iter().zip(timings) {
        let (plan_lines, explain_ms) = explain(&mut conn, &table).await?;
        times.sort_by(f64::total_cmp);
        let scan = IdleScan {
            rows,
            runs: times.len(),
            median_ms: percentile(&times, 50.0),
            p90_ms: percentile(&times, 90.0),
            explain_ms,
            index_used: plan_lines
                .iter()
                .any(|l| l.contains("Index Scan using expected_messages_due_at_idx")),
            plan: plan_lines,
        };
        let access = scan.plan.iter().find(|l| l.contains(" Scan "));
        println!(
            "   {rows} rows: median {:.3} ms; {}",
            scan.median_ms,
            access.map_or("(no scan node in the plan)", |l| l.trim())
        );
        out.push(scan);
    }
    Ok(out)
}

pub(crate) async fn fill_not_due(env: &Env, table: &str, rows: u64) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (process_id, message_type, timeout_at, exchange, routing_key, \
         payload) \
         SELECT 'idle-' || g, 'BenchIdle', now() + interval '1 day' + g * interval '1 ms', \
                '', 'nowhere', jsonb_build_object('i', g) \
         FROM generate_series($1::bigint, $2::bigint) AS g"
    );
    let chunk = 100_000;
    let mut start = 1;
    while start <= rows {
        let end = (start + chunk - 1).min(rows);
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(i64::try_from(start)?)
            .bind(i64::try_from(end)?)
            .execute(&env.pool)
            .await?;
        start = end + 1;
    }
    Ok(())
}

/// The daemon's own due-row statement (`store::lock_due_sql`), run with its binds: a
/// batch of `WINDOW`, payloads up to 16 MiB, nothing skipped, the on-time lane's window
/// (100 ms ahead, at most 1 s overdue, no backlog drain under way).
pub(crate) fn lock_due(
    sql: &str,
) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .bind(WINDOW as i64)
        .bind(16i64 << 20)
        .bind(Vec::<Uuid>::new())
        .bind(0.1f64)
        .bind(Some(1.0f64))
        .bind(None::<chrono::DateTime<chrono::Utc>>)
}

/// Timed runs, round-robin over the tables: one list of milliseconds per table.
pub(crate) async fn time_scans(
    conn: &mut PgConnection,
    tables: &[(u64, String)],
    runs: usize,
) -> Result<Vec<Vec<f64>>> {
    let statements: Vec<String> = tables
        .iter()
        .map(|(_, t)| timeoutd::store::lock_due_sql(t))
        .collect();
    let mut timings = vec![Vec::with_capacity(runs); tables.len()];
    for i in 0..runs + WARMUP_RUNS {
        for (sql, times) in statements.iter().zip(&mut timings) {
            let ms = time_scan(conn, sql).await?;
            if i >= WARMUP_RUNS {
                times.push(ms);
            }
        }
    }
    Ok(timings)
}

/// One scan as the daemon runs it: in a transaction (rolled back), timed on the client.
pub(crate) async fn time_scan(conn: &mut PgConnection, sql: &str) -> Result<f64> {
    let mut tx = sqlx::Connection::begin_with(&mut *conn, timeoutd::store::SCAN_BEGIN).await?;
    let started = Instant::now();
    let found = lock_due(sql).fetch_all(&mut *tx).await?;
    let elapsed = started.elapsed().as_secs_f64() * 1e3;
    tx.rollback().await?;
    if !found.is_empty() {
        bail!("idle scan found {} due rows", found.len());
    }
    Ok(elapsed)
}

pub(crate) async fn explain(conn: &mut PgConnection, table: &str) -> Result<(Vec<String>, f64)> {
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS) {}",
        timeoutd::store::lock_due_sql(table)
    );
    let mut tx = sqlx::Connection::begin_with(&mut *conn, timeoutd::store::SCAN_BEGIN).await?;
    let plan: Vec<String> = lock_due(&sql)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| sqlx::Row::try_get::<String, _>(r, 0))
        .collect::<Result<_, _>>()?;
    tx.rollback().await?;
    let exec = plan
        .iter()
        .find_map(|l| l.trim().strip_prefix("Execution Time:"))
        .and_then(|s| s.trim().trim_end_matches("ms").trim().parse().ok())
        .unwrap_or(f64::NAN);
    Ok((plan, exec))
}
