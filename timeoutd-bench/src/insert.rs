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
    /// Overdue by up to this many seconds, evenly spread in the order of insertion (the
    /// first inserted the most overdue): on disk in due order, as rows written one by one
    /// with the same timeout lie.
    OverdueInOrder(f64),
    /// The first at `now()` plus `offset_secs` (negative: overdue), each next one
    /// `step_secs` later (0: all at the same instant).
    Spaced { offset_secs: f64, step_secs: f64 },
}

/// How the catch-up's backlog lies on disk (`--catch-up-layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Layout {
    /// Due at random instants: the rows of one batch lie on as many heap pages.
    Random,
    /// Inserted in due order: the rows of one batch lie side by side, as the burst's do.
    DueOrder,
}

impl Layout {
    pub(crate) fn overdue_up_to(self, secs: f64) -> Deadline {
        match self {
            Layout::Random => Deadline::OverdueUpTo(secs),
            Layout::DueOrder => Deadline::OverdueInOrder(secs),
        }
    }
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
    insert_due_in(conn, table, queue, ids, deadline, INSERT_CHUNK).await
}

/// As [`insert_due`], `chunk` rows per statement (`ids.len()`: one statement).
pub(crate) async fn insert_due_in(
    conn: &mut PgConnection,
    table: &str,
    queue: &str,
    ids: &[Uuid],
    deadline: Deadline,
    chunk: usize,
) -> Result<()> {
    let due = match deadline {
        Deadline::At(_) => "coalesce($2::timestamptz, now() - interval '1 second')",
        Deadline::OverdueUpTo(_) => "now() - make_interval(secs => $2::float8 * random())",
        Deadline::OverdueInOrder(_) => {
            "now() - make_interval(secs => $2::float8 * (1 - ($4 + u.ord)::float8 / $5))"
        }
        Deadline::Spaced { .. } => {
            "now() + make_interval(secs => $2::float8 + ($4 + u.ord - 1) * $5::float8)"
        }
    };
    let sql = format!(
        "INSERT INTO {table} (id, process_id, message_type, timeout_at, exchange, \
         routing_key, payload) \
         SELECT u.id, 'bench-' || ($4 + u.ord), 'BenchExpected', {due}, '', $3, \
                jsonb_build_object('i', $4 + u.ord) \
         FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)"
    );
    let size = chunk.max(1);
    for (i, chunk) in ids.chunks(size).enumerate() {
        let offset = i64::try_from(i * size)?;
        let query = sqlx::query(AssertSqlSafe(sql.clone())).bind(chunk);
        let query = match deadline {
            Deadline::At(at) => query.bind(at),
            Deadline::OverdueUpTo(secs) | Deadline::OverdueInOrder(secs) => query.bind(secs),
            Deadline::Spaced { offset_secs, .. } => query.bind(offset_secs),
        };
        let query = query.bind(queue).bind(offset);
        let query = match deadline {
            Deadline::OverdueInOrder(_) => query.bind(i64::try_from(ids.len())?),
            Deadline::Spaced { step_secs, .. } => query.bind(step_secs),
            _ => query,
        };
        query.execute(&mut *conn).await?;
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
