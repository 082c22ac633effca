//! Inserting rows.

use crate::prelude::*;
use crate::*;

/// Insert `ids` (one transaction per call) due at `due` (`None`: already due, a second ago).
pub(crate) async fn insert_due(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    ids: &[Uuid],
    due: Option<DateTime<Utc>>,
) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'bench-' || ($4 + u.ord), 'BenchExpected', \
                coalesce($2, now() - interval '1 second'), '', $3, \
                jsonb_build_object('i', $4 + u.ord) \
         FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)"
    );
    for (i, chunk) in ids.chunks(INSERT_CHUNK).enumerate() {
        let offset = i64::try_from(i * INSERT_CHUNK)?;
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(chunk)
            .bind(due)
            .bind(queue)
            .bind(offset)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

pub(crate) fn fresh_ids(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
}

/// Insert `ids` overdue by up to `secs` seconds each (uniformly at random): as if the
/// database had been away that long; one transaction per call.
pub(crate) async fn insert_overdue(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    ids: &[Uuid],
    secs: f64,
) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'overdue-' || ($4 + u.ord), 'BenchExpected', \
                now() - make_interval(secs => $2 * random()), '', $3, \
                jsonb_build_object('i', $4 + u.ord) \
         FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)"
    );
    for (i, chunk) in ids.chunks(INSERT_CHUNK).enumerate() {
        let offset = i64::try_from(i * INSERT_CHUNK)?;
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(chunk)
            .bind(secs)
            .bind(queue)
            .bind(offset)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// Insert one row per `(id, due)` in one statement (the steady inserter's tick).
pub(crate) async fn insert_each_due(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    rows: &[(Uuid, DateTime<Utc>)],
) -> Result<()> {
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'steady-' || u.id, 'BenchExpected', u.due, '', $3, \
                jsonb_build_object('k', u.id) \
         FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, due)"
    );
    let (ids, dues): (Vec<Uuid>, Vec<DateTime<Utc>>) = rows.iter().copied().unzip();
    sqlx::query(AssertSqlSafe(sql))
        .bind(ids)
        .bind(dues)
        .bind(queue)
        .execute(conn)
        .await?;
    Ok(())
}
