//! Inserting rows.

use crate::prelude::*;
use crate::*;

/// When the rows of one insert are due.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Deadline {
    /// All at this instant (`None`: already due, a second ago).
    At(Option<DateTime<Utc>>),
    /// Each overdue by up to this many seconds, uniformly at random: as if the database
    /// had been away that long.
    OverdueUpTo(f64),
}

/// Insert `ids` (in chunks of one statement each, on `conn`: one transaction when the
/// caller opened one) due as `deadline` says.
pub(crate) async fn insert_due(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    ids: &[Uuid],
    deadline: Deadline,
) -> Result<()> {
    let due = match deadline {
        Deadline::At(_) => "coalesce($2::timestamptz, now() - interval '1 second')",
        Deadline::OverdueUpTo(_) => "now() - make_interval(secs => $2::float8 * random())",
    };
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'bench-' || ($4 + u.ord), 'BenchExpected', {due}, '', $3, \
                jsonb_build_object('i', $4 + u.ord) \
         FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)"
    );
    for (i, chunk) in ids.chunks(INSERT_CHUNK).enumerate() {
        let offset = i64::try_from(i * INSERT_CHUNK)?;
        let query = sqlx::query(AssertSqlSafe(sql.clone())).bind(chunk);
        let query = match deadline {
            Deadline::At(at) => query.bind(at),
            Deadline::OverdueUpTo(secs) => query.bind(secs),
        };
        query.bind(queue).bind(offset).execute(&mut *conn).await?;
    }
    Ok(())
}

pub(crate) fn fresh_ids(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
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
