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
