//! Writing the fate of a fired batch: delete the confirmed rows, charge the failed ones,
//! park what cannot be deleted. The same statements for every [`Kind`]; one row the
//! database refuses never fails the others (savepoints, halving).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::sql::safe;
use super::{Kind, Store, StoreError};

/// A publish that did not go through: the row stays and is retried after `delay`, or
/// (`None`) is held for an operator (`retry_at = 'infinity'`): retrying cannot help.
#[derive(Debug, Clone)]
pub struct Failure {
    pub id: Uuid,
    pub error: String,
    pub delay: Option<Duration>,
}

/// A row whose message was confirmed, to delete in the transaction that locked it: its id,
/// and where the lock statement found it (`None`: not read; deleted by id). The place is
/// trusted as it is: whatever row lies there is deleted, so it must be the `tid` that
/// this transaction's own [`Store::lock_due`] returned for this row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirmed<'a> {
    pub id: Uuid,
    pub tid: Option<&'a str>,
}

/// A row whose message was confirmed but whose batch did not commit: it is deleted
/// later if it still has the deadline it was fired for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fired {
    pub id: Uuid,
    pub deadline: DateTime<Utc>,
}

/// What [`Store::settle`] could not do the fast way.
#[derive(Debug, Default)]
pub struct Settlement {
    /// Confirmed rows that could not be deleted (a constraint or trigger of the process
    /// manager refused): kept with `retry_at = 'infinity'` so they never fire again.
    pub parked: Vec<(Uuid, String)>,
    /// Confirmed rows whose delete waited too long for a lock: to delete later, in a
    /// transaction of their own.
    pub later: Vec<Uuid>,
    /// Confirmed rows that could be neither deleted nor parked: they must not be
    /// published again by this process.
    pub stuck: Vec<(Uuid, String)>,
    /// Failed rows whose failure could not be written: not to be retried at once.
    pub uncharged: Vec<(Uuid, String)>,
}

/// Why the database did not take one write.
#[derive(Debug, Clone)]
struct Refusal {
    /// It waited too long (a lock held by someone else, the statement timeout): it may
    /// well pass later.
    busy: bool,
    reason: String,
}

/// Longest `last_error` stored; the rest of a long error message adds nothing.
const MAX_ERROR_CHARS: usize = 1000;
/// The bit of `pg_trigger.tgtype` that says a trigger fires on DELETE.
const ON_DELETE: i32 = 1 << 3;
/// Delete triggers of our own migrations, which never refuse a row (0007: the usage
/// ledger, an insert into a table without constraints). Comma-separated.
const OWN_DELETE_TRIGGERS: &str = "delayed_messages_usage_delete";
/// `attempts + 1` that cannot overflow (rows written by other tools may hold anything).
const NEXT_ATTEMPT: &str = "CASE WHEN m.attempts < 2147483647 THEN m.attempts + 1 \
                            ELSE m.attempts END";

/// How the firing transaction deletes the rows it fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deletes {
    /// Nothing can refuse the delete of a row the transaction holds (see
    /// [`Writes::guard`]): the transaction deletes them itself, in one statement.
    Direct,
    /// A foreign key, trigger, rule, policy or privilege may refuse some rows: each write
    /// in a savepoint, undone and halved around the rows refused.
    Guarded,
}

/// The writes of the firing transaction on one table, and its next-deadline probe.
#[derive(Debug, Clone)]
pub(super) struct Writes {
    /// The table, schema-qualified.
    pub(super) table: Arc<str>,
    /// Run first in the firing transaction: takes the lock a delete takes, before
    /// [`Writes::guard`] looks. A statement of its own: one that fails (lock_timeout)
    /// fails inside the transaction, which is then rolled back.
    pub(super) lock: Arc<str>,
    /// Run in the firing transaction once its lock is taken: asks the catalog whether
    /// anything may refuse a delete ([`Deletes`]); `$1` the table's name. Why a
    /// savepoint is not simply always used: rows locked by the transaction and deleted
    /// in a subtransaction carry a MultiXact as their deleter, and Postgres never marks
    /// the index entry of such a row dead; every later scan of the due index walks every
    /// such row again until vacuum (measured: a scan over 75,000 fired rows 0.3 ms after
    /// direct deletes, 3.5 ms every time after deletes in savepoints). Holding the
    /// table's ROW EXCLUSIVE lock from before the check, no trigger, foreign key or rule
    /// can appear before the delete (creating one needs a lock that conflicts with it).
    /// A prepared statement, planned once per connection: sent as a simple query with
    /// the lock, parsed and planned for every batch, it cost Postgres 0.3–0.4 ms a batch
    /// more (pgbench, docs/performance.md).
    pub(super) guard: Arc<str>,
    pub(super) probe: Arc<str>,
    pub(super) counts: Arc<str>,
    /// The group's shared counts of this kind ($1 the kind, $2 how fresh as an
    /// interval): read; read locked, skipping a row another node holds; written.
    pub(super) shared_read: Arc<str>,
    pub(super) shared_lock: Arc<str>,
    pub(super) shared_write: Arc<str>,
    delete: Arc<str>,
    /// Rows the transaction holds locked, by where they lie ($1 their `ctid`s as text):
    /// a TID scan goes straight to each row, where deleting by id looks every one up in
    /// the primary key (500 rows: 0.2 ms against 2.1 ms, docs/performance.md). A locked
    /// row stays where it was read until the transaction ends: nobody else may update or
    /// delete it, and vacuum moves no live row. The places are of rows of the table
    /// itself (the lock statement reads one only for such a row), so the delete is of
    /// the table itself (`ONLY`).
    delete_locked: Arc<str>,
    delete_fired: Arc<str>,
    fail: Arc<str>,
    park: Arc<str>,
}

impl Writes {
    pub(super) fn new(schema: &str, kind: Kind) -> Self {
        let t = kind.qualified(schema);
        let (deadline, due_at) = (kind.deadline(), kind.due_at());
        // Epochs, not a difference of timestamps: '-infinity' - now() is an error before
        // Postgres 17, its epoch is minus infinity.
        let secs = format!("(extract(epoch FROM {due_at}) - extract(epoch FROM now()))::float8");
        let from = super::sql::from_bound("$3");
        Self {
            table: t.as_str().into(),
            lock: format!("LOCK TABLE {t} IN ROW EXCLUSIVE MODE").into(),
            guard: format!(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_constraint \
                 WHERE confrelid = c.oid AND contype = 'f') \
                 OR EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE tgrelid = c.oid \
                 AND NOT tgisinternal AND tgenabled <> 'D' AND (tgtype::int4 & {ON_DELETE}) <> 0 \
                 AND tgname <> ALL ('{{{OWN_DELETE_TRIGGERS}}}'::text[])) \
                 OR EXISTS (SELECT FROM pg_catalog.pg_rewrite WHERE ev_class = c.oid \
                 AND ev_type = '4') \
                 OR EXISTS (SELECT FROM pg_catalog.pg_inherits WHERE inhparent = c.oid) \
                 OR c.relrowsecurity OR c.relkind <> 'r' \
                 OR c.relreplident = 'n' OR NOT has_table_privilege(c.oid, 'DELETE') \
                 FROM pg_catalog.pg_class AS c WHERE c.oid = $1::regclass"
            )
            .into(),
            // Seconds from now (database clock) to the earliest due row, and to the
            // earliest due after $1 and at most $2 seconds ago: each one probe of the
            // due index.
            probe: format!(
                "SELECT (SELECT {secs} FROM {t} AS m \
                 WHERE {due_at} >= {from} \
                 ORDER BY {due_at} LIMIT 1), \
                 (SELECT {secs} FROM {t} AS m \
                 WHERE {due_at} > greatest(coalesce($1::timestamptz, '-infinity'), \
                 now() - make_interval(secs => $2)) \
                 ORDER BY {due_at} LIMIT 1), clock_timestamp(), now()"
            )
            .into(),
            counts: format!(
                "SELECT count(*) AS pending, \
                 count(*) FILTER (WHERE {deadline} <= now()) AS due, \
                 count(*) FILTER (WHERE {deadline} <= now() - $1::interval) AS overdue, \
                 count(*) FILTER (WHERE attempts > 0) AS failing FROM {t} AS m"
            )
            .into(),
            shared_read: shared_read(schema).into(),
            shared_lock: format!("{} FOR UPDATE SKIP LOCKED", shared_read(schema)).into(),
            shared_write: format!(
                "UPDATE {schema}.pending_counts SET counted_at = now(), pending = $2, due = $3, \
                 overdue = $4, failing = $5 WHERE kind = $1"
            )
            .into(),
            delete: format!("DELETE FROM {t} WHERE id = ANY($1)").into(),
            delete_locked: format!("DELETE FROM ONLY {t} WHERE ctid = ANY($1::text[]::tid[])")
                .into(),
            delete_fired: format!(
                "DELETE FROM {t} AS m USING unnest($1::uuid[], $2::timestamptz[]) AS f(id, at) \
                 WHERE m.id = f.id AND {deadline} = f.at"
            )
            .into(),
            fail: format!(
                "UPDATE {t} AS m SET attempts = {NEXT_ATTEMPT}, last_error = f.error, \
                 retry_at = CASE WHEN f.delay IS NULL THEN 'infinity'::timestamptz \
                 ELSE clock_timestamp() + make_interval(secs => f.delay) END \
                 FROM unnest($1::uuid[], $2::text[], $3::float8[]) AS f(id, error, delay) \
                 WHERE m.id = f.id"
            )
            .into(),
            park: format!(
                "UPDATE {t} AS m SET attempts = {NEXT_ATTEMPT}, last_error = $2, \
                 retry_at = 'infinity' WHERE m.id = $1"
            )
            .into(),
        }
    }
}

impl Store {
    /// Write the fate of a batch whose TimeOuts were published: delete the confirmed
    /// rows, charge the failed ones. One row must not be able to fail it (a confirmed
    /// batch is never rolled back): a write the database refuses is undone to a
    /// savepoint and retried on halves until the refusing rows stand alone; those are
    /// parked (confirmed) or reported (failed). Only a broken connection is an error.
    /// With [`Deletes::Direct`] the confirmed rows are deleted by the transaction itself
    /// (nothing can refuse them; a statement that fails all the same, cancelled or timed
    /// out, is an error like a broken connection), by where the lock statement found
    /// them, the failed ones charged as above.
    pub async fn settle(
        &self,
        tx: &mut PgConnection,
        kind: Kind,
        deletes: Deletes,
        confirmed: &[Confirmed<'_>],
        failures: &[Failure],
    ) -> Result<Settlement, StoreError> {
        let w = self.writes(kind);
        if deletes == Deletes::Direct {
            delete_locked(tx, w, confirmed).await?;
            return charge_in_halves(tx, w, failures).await;
        }
        let confirmed: Vec<Uuid> = confirmed.iter().map(|c| c.id).collect();
        let confirmed = &confirmed[..];
        let both = attempt(tx, w, Write::Both(confirmed, failures)).await?;
        if both.is_ok() {
            return Ok(Settlement::default());
        }
        let refused = in_halves(tx, w, confirmed, Write::Delete).await?;
        let mut out = park_refused(tx, w, refused).await?;
        out.uncharged = charge_in_halves(tx, w, failures).await?.uncharged;
        Ok(out)
    }

    /// Delete rows fired by a batch that failed to commit, if they still have the
    /// deadline they were fired for (a moved deadline is the process manager's new
    /// intent: that row fires again). Its own transaction; a row the database will not
    /// let go is parked, as in [`Store::settle`].
    pub async fn delete_fired(
        &self,
        kind: Kind,
        fired: &[Fired],
    ) -> Result<Settlement, StoreError> {
        let w = self.writes(kind);
        let mut tx = self.begin().await?;
        let refused = in_halves(&mut tx, w, fired, Write::DeleteFired).await?;
        let refused = refused.into_iter().map(|(f, r)| (f.id, r)).collect();
        let out = park_refused(&mut tx, w, refused).await?;
        tx.commit().await?;
        Ok(out)
    }
}

/// Confirmed rows the database did not let us delete: busy ones are left for later,
/// refused ones are parked.
async fn park_refused(
    tx: &mut PgConnection,
    w: &Writes,
    refused: Vec<(Uuid, Refusal)>,
) -> Result<Settlement, StoreError> {
    let mut out = Settlement::default();
    for (id, r) in refused {
        if r.busy {
            out.later.push(id);
            continue;
        }
        let why = format!("delivered, but the row cannot be deleted: {}", r.reason);
        match attempt(tx, w, Write::Park(id, &why)).await? {
            Ok(()) => out.parked.push((id, why)),
            Err(r) if r.busy => out.later.push(id),
            Err(r) => out.stuck.push((id, r.reason)),
        }
    }
    Ok(out)
}

/// Charge the failed rows, each refusal alone.
async fn charge_in_halves(
    tx: &mut PgConnection,
    w: &Writes,
    failures: &[Failure],
) -> Result<Settlement, StoreError> {
    let mut out = Settlement::default();
    if failures.is_empty() {
        return Ok(out);
    }
    let refused = in_halves(tx, w, failures, Write::Charge).await?;
    out.uncharged = refused.into_iter().map(|(f, r)| (f.id, r.reason)).collect();
    Ok(out)
}

/// Run `write` on all `items`; where the database refuses, on each half, down to
/// single items, which are returned with the database's reason.
async fn in_halves<'a, T: Clone>(
    tx: &mut PgConnection,
    w: &Writes,
    items: &'a [T],
    write: impl Fn(&'a [T]) -> Write<'a>,
) -> Result<Vec<(T, Refusal)>, StoreError> {
    let mut refused = Vec::new();
    let mut todo = vec![items];
    while let Some(part) = todo.pop() {
        match (attempt(tx, w, write(part)).await?, part) {
            (Ok(()), _) | (_, []) => {}
            (Err(e), [one]) => refused.push((one.clone(), e)),
            (Err(_), _) => {
                let (a, b) = part.split_at(part.len() / 2);
                todo.extend([b, a]);
            }
        }
    }
    Ok(refused)
}

/// One write inside a savepoint: `Ok(Err(refusal))` when the database refused it
/// (and it was undone), `Err` when the connection failed.
async fn attempt(
    tx: &mut PgConnection,
    w: &Writes,
    write: Write<'_>,
) -> Result<Result<(), Refusal>, StoreError> {
    sqlx::query("SAVEPOINT settle").execute(&mut *tx).await?;
    match apply(tx, w, write).await {
        Ok(()) => Ok(Ok(())),
        Err(sqlx::Error::Database(e)) => {
            sqlx::query("ROLLBACK TO SAVEPOINT settle")
                .execute(&mut *tx)
                .await?;
            let code = e.code();
            let busy = super::waited_too_long(code.as_deref());
            Ok(Err(Refusal {
                busy,
                reason: e.to_string(),
            }))
        }
        Err(e) => Err(e.into()),
    }
}

async fn apply(tx: &mut PgConnection, w: &Writes, write: Write<'_>) -> Result<(), sqlx::Error> {
    match write {
        Write::Both(ids, failures) => {
            delete(tx, w, ids).await?;
            charge(tx, w, failures).await
        }
        Write::Delete(ids) => delete(tx, w, ids).await,
        Write::DeleteFired(fired) => {
            let ids: Vec<Uuid> = fired.iter().map(|f| f.id).collect();
            let at: Vec<DateTime<Utc>> = fired.iter().map(|f| f.deadline).collect();
            sqlx::query(safe(&w.delete_fired))
                .bind(ids)
                .bind(at)
                .execute(tx)
                .await?;
            Ok(())
        }
        Write::Charge(failures) => charge(tx, w, failures).await,
        Write::Park(id, why) => {
            sqlx::query(safe(&w.park))
                .bind(id)
                .bind(truncate(why))
                .execute(tx)
                .await?;
            Ok(())
        }
    }
}

async fn delete(tx: &mut PgConnection, w: &Writes, ids: &[Uuid]) -> Result<(), sqlx::Error> {
    if !ids.is_empty() {
        sqlx::query(safe(&w.delete)).bind(ids).execute(tx).await?;
    }
    Ok(())
}

/// Delete rows this transaction locked, by where they lie ([`Writes::delete_locked`]).
/// Should fewer go than were named (a place not read, or holding no row), the rest are
/// deleted by id: a row is never left behind for a faster path.
async fn delete_locked(
    tx: &mut PgConnection,
    w: &Writes,
    confirmed: &[Confirmed<'_>],
) -> Result<(), sqlx::Error> {
    let ids: Vec<Uuid> = confirmed.iter().map(|c| c.id).collect();
    let tids: Option<Vec<&str>> = confirmed.iter().map(|c| c.tid).collect();
    if let Some(tids) = tids.filter(|t| !t.is_empty()) {
        let deleted = sqlx::query(safe(&w.delete_locked))
            .bind(&tids)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if usize::try_from(deleted).is_ok_and(|d| d == ids.len()) {
            return Ok(());
        }
        tracing::warn!(
            deleted,
            named = ids.len(),
            "confirmed rows not where they were locked: the rest deleted by id"
        );
    }
    delete(tx, w, &ids).await
}

/// attempts + 1 (saturating), last_error, retry_at = now + delay (or 'infinity').
async fn charge(
    tx: &mut PgConnection,
    w: &Writes,
    failures: &[Failure],
) -> Result<(), sqlx::Error> {
    if failures.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
    let errors: Vec<String> = failures.iter().map(|f| truncate(&f.error)).collect();
    let delays: Vec<Option<f64>> = failures
        .iter()
        .map(|f| f.delay.map(|d| d.as_secs_f64()))
        .collect();
    sqlx::query(safe(&w.fail))
        .bind(ids)
        .bind(errors)
        .bind(delays)
        .execute(tx)
        .await?;
    Ok(())
}

/// One write of [`Store::settle`].
enum Write<'a> {
    Both(&'a [Uuid], &'a [Failure]),
    Delete(&'a [Uuid]),
    DeleteFired(&'a [Fired]),
    Charge(&'a [Failure]),
    Park(Uuid, &'a str),
}

fn truncate(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
}

/// The shared counts of one kind and whether they are fresh (see `Store::shared_counts`).
fn shared_read(schema: &str) -> String {
    format!(
        "SELECT counted_at > now() - $2::interval AS fresh, \
         greatest(extract(epoch FROM now()) - extract(epoch FROM counted_at), 0)::float8 \
         AS age, pending, due, \
         overdue, failing FROM {schema}.pending_counts WHERE kind = $1"
    )
}

#[cfg(test)]
mod tests {
    use crate::store::sql::Sql;

    #[test]
    fn every_kind_has_its_writes_in_its_place() {
        let sql = Sql::new("s");
        for kind in crate::store::Kind::ALL {
            let w = &sql.writes[kind.index()];
            assert!(w.delete.contains(&format!("s.{}", kind.table())));
            assert!(w.delete_fired.contains(&kind.deadline()));
        }
    }
}
