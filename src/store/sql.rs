//! The statements, built once per store from its schema (see the module docs), and the
//! pieces every table's statements share: where each kind's rows live and what due
//! means.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

use super::settle::Writes;
use super::{Kind, Store, api, delayed, expectations, settle};

/// Where each kind's rows live. Everything the firing transaction writes is the same for
/// every kind (see [`Writes`]).
impl Kind {
    /// The table holding its rows.
    pub(crate) const fn table(self) -> &'static str {
        match self {
            Kind::Expectation => "expected_messages",
            Kind::Delayed => "delayed_messages",
        }
    }

    /// The table, schema-qualified: how every statement names it.
    pub(crate) fn qualified(self, schema: &str) -> String {
        format!("{schema}.{}", self.table())
    }

    /// The column holding its rows' deadline.
    const fn deadline_column(self) -> &'static str {
        match self {
            Kind::Expectation => "timeout_at",
            Kind::Delayed => "deliver_at",
        }
    }

    /// A row as the lists read it (`timeoutd pending --list`, the console): deadlines
    /// clamped so that '-infinity' and 'infinity' still decode; the 'infinity' of a held
    /// (or parked) row's `retry_at`, which no client type holds, selected as `held`
    /// instead (the command line reads it into `PendingRow::parked` and shows it so).
    pub(crate) fn list_columns(self) -> String {
        let (deadline, column) = (self.deadline(), self.deadline_column());
        let (own, size) = match self {
            Kind::Expectation => ("m.process_id, m.message_type", ""),
            Kind::Delayed => (
                "m.owner, m.message_id",
                "octet_length(m.body) AS body_bytes, ",
            ),
        };
        format!(
            "m.id, {own}, {deadline} AS {column}, m.exchange, m.routing_key, {size}\
             m.attempts, m.last_error, CASE WHEN isfinite(m.retry_at) THEN m.retry_at END \
             AS retry_at, coalesce(m.retry_at = 'infinity', false) AS held"
        )
    }

    /// Due means: the deadline has passed and so has any retry time (`greatest` ignores
    /// NULL). The expression index of migration 0003 serves exactly this expression.
    pub(crate) fn due_at(self) -> String {
        format!("greatest(m.{}, m.retry_at)", self.deadline_column())
    }

    /// The deadline clamped so '-infinity' / 'infinity' still decode (and fire, if due).
    pub(super) fn deadline(self) -> String {
        format!(
            "least(greatest(m.{}, '0001-01-01T00:00:00Z'), '9999-12-31T23:59:59Z')",
            self.deadline_column()
        )
    }

    /// Which rows a batch may lock: due within the horizon (`$4` seconds) and, for a
    /// batch that serves only fresh rows, due no earlier than `$5` seconds ago, and for a
    /// backlog batch that continues after earlier ones, due no earlier than `$6` (NULL: no
    /// such bound). `deadline <= …` is implied by the due expression; it is spelled out
    /// so that no change to the bookkeeping can ever hold a row for sending before its
    /// deadline. The rows' own due times (`due_at` below) decide when each is sent.
    pub(super) fn window(self) -> String {
        let due_at = self.due_at();
        format!(
            "{due_at} <= now() + make_interval(secs => $4) \
             AND m.{} <= now() + make_interval(secs => $4) \
             AND {due_at} >= greatest(coalesce(now() - make_interval(secs => $5), \
             '-infinity'), {})",
            self.deadline_column(),
            from_bound("$6")
        )
    }

    /// The instant a row may be sent (its deadline, or a later retry time), clamped as
    /// [`Kind::deadline`] is, and the database clock when it was read: together they
    /// tell the scan how long to hold the row. The end of the window the statement
    /// locked (every row due until then was taken, or held by another batch). And where
    /// the locked version of the row lies (its `ctid`), which the batch deletes it by
    /// (see [`Writes`](settle::Writes)), for a row of `table` itself only: a table
    /// inheriting from it can appear under the batch's lock, its rows at places of their
    /// own (NULL: the batch deletes by id).
    pub(super) fn due_columns(self, table: &str) -> String {
        format!(
            "least(greatest({}, '0001-01-01T00:00:00Z'), '9999-12-31T23:59:59Z') AS due_at, \
             clock_timestamp() AS fired_at, now() + make_interval(secs => $4) AS window_end, \
             CASE WHEN m.tableoid = '{table}'::regclass THEN m.ctid::text END AS tid",
            self.due_at()
        )
    }
}

/// The lower bound `param` (a due time a batch returned, or NULL) puts on `due_at`. Due
/// times come back clamped to year 1 (see [`Kind::deadline`]): a bound there could be
/// any earlier time, even '-infinity', so it bounds nothing.
pub(super) fn from_bound(param: &str) -> String {
    format!(
        "CASE WHEN {param}::timestamptz > '0001-01-01T00:00:00Z' THEN {param}::timestamptz \
         ELSE '-infinity'::timestamptz END"
    )
}

#[derive(Debug, Clone)]
pub(super) struct Sql {
    pub(super) api: api::Statements,
    pub(super) expectations: expectations::Statements,
    pub(super) delayed: delayed::Statements,
    pub(super) writes: Vec<settle::Writes>,
}

impl Sql {
    pub(super) fn new(schema: &str) -> Self {
        Self {
            api: api::Statements::new(schema),
            expectations: expectations::Statements::new(schema),
            delayed: delayed::Statements::new(schema),
            writes: Kind::ALL
                .iter()
                .map(|t| settle::Writes::new(schema, *t))
                .collect(),
        }
    }
}

impl Store {
    pub(super) fn writes(&self, kind: Kind) -> &Writes {
        // Built from `Kind::ALL`, in its order.
        &self.sql.writes[kind.index()]
    }
}

/// The statements are built from a validated identifier only (see `Sql::new`).
pub(super) fn safe(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(sql.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::lock_due_sql;

    /// The planner uses an expression index only for the very expression it was built
    /// on: each table's due expression must be its migration's index, word for word.
    #[test]
    fn the_due_expression_is_the_indexed_one() {
        let migration = include_str!("../../migrations/0003_due_never_before_deadline.sql");
        let indexed = Kind::Expectation.due_at().replace("m.", "");
        assert!(migration.contains(&format!("(({indexed}))")), "{indexed}");
        assert!(lock_due_sql("t").contains(&format!("ORDER BY {}", Kind::Expectation.due_at())));
    }
}
