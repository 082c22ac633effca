//! Postgres: connection pool, embedded migrations, and the statements of the scan.
//!
//! Each [`Kind`] of due row lives in a table of its own; the writes of the firing transaction (delete,
//! charge, park, delete-if-unchanged) are the same statements for every table. Every
//! statement names `<schema>.<table>`; the schema is a validated plain identifier (see
//! `config`) and the table a constant, so formatting them into SQL is safe. The
//! statements are built once per store so sqlx's per-connection statement cache prepares
//! each of them once.
//!
//! The [`Store`] is declared here; its calls live by concern: connecting and the pool's
//! connections (`pool`, the hosts of a multi-host URL in `hosts`), the migrations
//! (`migrate`), the statements and what due means (`sql`), locking and probing due rows
//! (`due`), writing a batch's fate (`settle`), the pending counts (`counts`), the
//! notices of new deadlines (`listen`), each kind's rows (`expectations`, `delayed`),
//! the operator's verbs (`api`), fencing a departed node (`fence`), and the error type
//! (`error`) with whom an error is about (`sqlstate`).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use sqlx::postgres::PgPool;

mod api;
mod counts;
mod delayed;
mod due;
mod error;
mod expectations;
mod fence;
mod hosts;
mod listen;
mod migrate;
mod pool;
mod settle;
mod sql;
pub(crate) mod sqlstate;

pub use api::{ApiRules, Refusal};
pub use counts::PendingCounts;
pub use delayed::{
    Bound, DelayedRow, Due, Held, Ingest, IngestOutcome, PendingDelayed, Quota, Stored,
    lock_delayed_sql,
};
pub use due::{BEGIN, NextDue, SCAN_BEGIN, Window};
pub use error::StoreError;
pub(crate) use error::bounded;
pub use expectations::{DueRow, PendingFilter, PendingRow, lock_due_sql};
pub use fence::session_name;
pub use settle::{Confirmed, Deletes, Failure, Fired, Settlement};
pub(crate) use sqlstate::{Blame, blame_of, refused_by_the_api, waited_too_long};

pub use crate::kind::Kind;

#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    schema: String,
    sql: sql::Sql,
    /// Which host of a multi-host `postgres.url` the pool uses; `None` with one host
    /// and no `target_session_attrs`.
    hosts: Option<Arc<hosts::Hosts>>,
    /// Probes and counts share one connection (see [`Store::acquire`]).
    lean: Arc<AtomicBool>,
    /// With `postgres.session_url`: a pool of one on that address, for what needs a
    /// session of its own (see [`Store::session`]).
    session: Option<Box<Store>>,
}
