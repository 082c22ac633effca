//! The operator's verbs on pending rows — cancel, reschedule, release, retry, for both
//! kinds — as calls of the SQL API (migration 0009, docs/integrating/sql-api.md). Each
//! rule lives in its SQL function: these only call them, so the command line, the
//! console and a process manager in any language act alike. Named after the functions.
//!
//! The delayed-message functions act on the messages of `owner`; a role acts on
//! another owner's only when it may delete from `delayed_messages` directly (the
//! daemons' role may), else the database refuses ([`StoreError::Refused`]).

use std::sync::Arc;

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::sql::safe;
use super::{Due, Store, StoreError};
use crate::config::Settings;
use serde::Serialize;
use sqlx::types::Json;

use crate::destinations::SqlStep;
use crate::wire::SHORT_STRING_MAX;

/// Why the database refused a verb (its SQLSTATE), as [`StoreError::Refused`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 55000 object_not_in_prerequisite_state: a held delayed message stored without its
    /// body (over `delay.max_body`) cannot be released; it can only be cancelled.
    NoBody,
    /// 42501 insufficient_privilege: the role may not call the function (no EXECUTE: it
    /// is not granted `<schema>_api`), or may not act on another owner's delayed
    /// messages.
    NotPermitted,
}

impl Refusal {
    /// The refusal a database error is, if it is one.
    pub(super) fn of(e: &sqlx::Error) -> Option<Self> {
        match e.as_database_error()?.code()?.as_ref() {
            super::sqlstate::code::OBJECT_NOT_IN_PREREQUISITE_STATE => Some(Refusal::NoBody),
            super::sqlstate::code::INSUFFICIENT_PRIVILEGE => Some(Refusal::NotPermitted),
            _ => None,
        }
    }
}

/// The statements, schema-qualified: the functions are found whatever the session's
/// `search_path` (a pooled connection sends none).
#[derive(Debug, Clone)]
pub(super) struct Statements {
    cancel_expectation: Arc<str>,
    cancel_expectations: Arc<str>,
    reschedule_expectation: Arc<str>,
    release_expectation: Arc<str>,
    retry_expectation: Arc<str>,
    cancel_delayed: Arc<str>,
    reschedule_delayed: Arc<str>,
    release_delayed: Arc<str>,
    retry_delayed: Arc<str>,
    write_rules: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        let call =
            |f: &str, args: &str| -> Arc<str> { format!("SELECT {schema}.{f}({args})").into() };
        // The new time, given or relative to the database's clock (`$2` an instant, or
        // `$3` seconds from now), is passed to the function and returned with its answer.
        let reschedule = |f: &str, args: &str| -> Arc<str> {
            format!(
                "SELECT {schema}.{f}({args}), t.at FROM (SELECT coalesce($2::timestamptz, \
                 now() + make_interval(secs => $3::float8)) AS at) AS t"
            )
            .into()
        };
        Self {
            cancel_expectation: call("cancel_expectation", "$1"),
            cancel_expectations: call("cancel_expectations", "$1, $2"),
            reschedule_expectation: reschedule("reschedule_expectation", "$1, t.at"),
            release_expectation: call("release_expectation", "$1"),
            retry_expectation: call("retry_expectation", "$1"),
            cancel_delayed: call("cancel_delayed", "$1, $2"),
            reschedule_delayed: reschedule("reschedule_delayed", "$1, t.at, $4"),
            release_delayed: call("release_delayed", "$1, $2"),
            retry_delayed: call("retry_delayed", "$1, $2"),
            // Written only when it differs: nodes of one configuration do not keep
            // rewriting the row.
            write_rules: format!(
                "UPDATE {schema}.api_rules SET destinations = $1, max_body = $2, \
                 max_delay = make_interval(secs => $3::float8), max_pending_per_owner = $4, \
                 max_bytes_per_owner = $5, max_properties = $6, max_headers = $7, \
                 max_payload = $8, max_short = $9, written_at = now(), written_by = $10 \
                 WHERE (destinations, max_body, max_delay, max_pending_per_owner, \
                 max_bytes_per_owner, max_properties, max_headers, max_payload, max_short) \
                 IS DISTINCT FROM ($1, $2, make_interval(secs => $3::float8), $4, $5, $6, $7, \
                 $8, $9)"
            )
            .into(),
        }
    }
}

/// What the SQL door allows (`api_rules`, migrations 0011 and 0012), as one node's
/// settings say: the active node writes it when it takes over, so the door follows the
/// configuration that fires.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiRules {
    /// The destination rule of each kind, as the door walks it.
    pub destinations: Json<SqlDestinations>,
    pub max_body: u64,
    pub max_delay: Duration,
    pub max_pending_per_owner: u64,
    pub max_bytes_per_owner: u64,
    pub max_properties: u32,
    pub max_headers: u32,
    pub max_payload: u64,
}

/// `api_rules.destinations`: the steps per kind, under the names the door uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SqlDestinations {
    pub expectation: Vec<SqlStep>,
    pub delayed: Vec<SqlStep>,
}

impl ApiRules {
    /// `None` when the settings hold no valid destination rule (they were never
    /// validated): the door then keeps what it has.
    pub fn new(settings: &Settings) -> Option<Self> {
        let d = &settings.delay;
        Some(Self {
            destinations: Json(SqlDestinations {
                expectation: settings.timeout_destinations().ok()?.sql(),
                delayed: settings.delay_destinations().ok()?.sql(),
            }),
            max_body: d.max_body.as_u64(),
            max_delay: d.max_delay,
            max_pending_per_owner: d.max_pending_per_owner,
            max_bytes_per_owner: d.max_bytes_per_owner.as_u64(),
            max_properties: MAX_PROPERTIES,
            max_headers: MAX_HEADERS,
            max_payload: settings.timeouts.max_payload.as_u64(),
        })
    }
}

/// Largest properties a SQL caller may store, as JSON text.
pub const MAX_PROPERTIES: u32 = 64 * 1024;
/// Most headers a SQL caller may give one message.
pub const MAX_HEADERS: u32 = 256;

/// `Due` as the reschedule statements bind it (`$2`, `$3`).
fn binds(due: Due) -> (Option<DateTime<Utc>>, Option<f64>) {
    match due {
        Due::At(at) => (Some(at), None),
        Due::After(d) => (None, Some(d.as_secs_f64())),
    }
}

impl Store {
    /// After a verb's error: a refusal said as one, host loss noted (see `seen`).
    fn refused(&self, e: sqlx::Error) -> StoreError {
        match Refusal::of(&e) {
            Some(why) => StoreError::Refused(why, e),
            None => self.seen(e),
        }
    }

    /// Call one function (`sql`, its arguments bound by `bind`) and decode its answer.
    async fn verb<'q, T>(
        &self,
        sql: &Arc<str>,
        bind: impl FnOnce(Call<'q>) -> Call<'q>,
    ) -> Result<T, StoreError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
    {
        self.ready().await?;
        let query = bind(sqlx::query(safe(sql)));
        let row = query
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.refused(e))?;
        Ok(sqlx::Row::try_get(&row, 0)?)
    }

    /// `cancel_expectation(id)`: `true` when it was pending (its TimeOut will not fire),
    /// `false` when it fired already, was cancelled, or never existed.
    pub async fn cancel_expectation(&self, id: Uuid) -> Result<bool, StoreError> {
        let sql = &self.sql.api.cancel_expectation;
        self.verb(sql, |q| q.bind(id)).await
    }

    /// `cancel_expectations(process_id, message_type)`: every pending expectation of the
    /// process (of one message type, `None`: all); how many.
    pub async fn cancel_expectations(
        &self,
        process_id: &str,
        message_type: Option<&str>,
    ) -> Result<i32, StoreError> {
        let sql = &self.sql.api.cancel_expectations;
        self.verb(sql, |q| q.bind(process_id).bind(message_type))
            .await
    }

    /// `reschedule_expectation(id, timeout_at)`: the new deadline (`Due::After`: from the
    /// database's clock) when it was pending, `None` when not. A failed publish's
    /// backoff starts over; a parked row stays parked.
    pub async fn reschedule_expectation(
        &self,
        id: Uuid,
        due: Due,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let (at, after) = binds(due);
        self.ready().await?;
        let (done, at): (bool, DateTime<Utc>) =
            sqlx::query_as(safe(&self.sql.api.reschedule_expectation))
                .bind(id)
                .bind(at)
                .bind(after)
                .fetch_one(&self.pool)
                .await
                .map_err(|e| self.refused(e))?;
        Ok(done.then_some(at))
    }

    /// `release_expectation(id)`: a parked expectation fires again now (a second
    /// TimeOut). `false`: not parked (or not pending).
    pub async fn release_expectation(&self, id: Uuid) -> Result<bool, StoreError> {
        let sql = &self.sql.api.release_expectation;
        self.verb(sql, |q| q.bind(id)).await
    }

    /// `retry_expectation(id)`: one waiting for its next attempt after a failed publish
    /// is tried now. `false`: not waiting for a retry.
    pub async fn retry_expectation(&self, id: Uuid) -> Result<bool, StoreError> {
        let sql = &self.sql.api.retry_expectation;
        self.verb(sql, |q| q.bind(id)).await
    }

    /// Write what the SQL door allows, by `node`, unless it says so already. `true`:
    /// written.
    pub async fn write_api_rules(&self, rules: &ApiRules, node: &str) -> Result<bool, StoreError> {
        let big = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let done = sqlx::query(safe(&self.sql.api.write_rules))
            .bind(&rules.destinations)
            .bind(big(rules.max_body))
            .bind(rules.max_delay.as_secs_f64())
            .bind(big(rules.max_pending_per_owner))
            .bind(big(rules.max_bytes_per_owner))
            .bind(i32::try_from(rules.max_properties).unwrap_or(i32::MAX))
            .bind(i32::try_from(rules.max_headers).unwrap_or(i32::MAX))
            .bind(big(rules.max_payload))
            .bind(SHORT_STRING_MAX as i32)
            .bind(node)
            .execute(&self.pool)
            .await
            .map_err(|e| self.seen(e))?;
        Ok(done.rows_affected() > 0)
    }

    /// `cancel_delayed(message_id, owner)`: `true` when it was pending. `owner` `None`:
    /// the calling role's own (`sql:<role>`); `""`: published without a `user_id`.
    pub async fn cancel_delayed(
        &self,
        message_id: &str,
        owner: Option<&str>,
    ) -> Result<bool, StoreError> {
        let sql = &self.sql.api.cancel_delayed;
        self.verb(sql, |q| q.bind(message_id).bind(owner)).await
    }

    /// `reschedule_delayed(message_id, deliver_at, owner)`: the new delivery time when it
    /// was pending, `None` when not; a held message stays held.
    pub async fn reschedule_delayed(
        &self,
        message_id: &str,
        due: Due,
        owner: Option<&str>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let (at, after) = binds(due);
        self.ready().await?;
        let (done, at): (bool, DateTime<Utc>) =
            sqlx::query_as(safe(&self.sql.api.reschedule_delayed))
                .bind(message_id)
                .bind(at)
                .bind(after)
                .bind(owner)
                .fetch_one(&self.pool)
                .await
                .map_err(|e| self.refused(e))?;
        Ok(done.then_some(at))
    }

    /// `release_delayed(message_id, owner)`: a held message is judged again and
    /// delivered now if it may be. `false`: not held; refused ([`Refusal::NoBody`]) for
    /// one stored without its body.
    pub async fn release_delayed(
        &self,
        message_id: &str,
        owner: Option<&str>,
    ) -> Result<bool, StoreError> {
        let sql = &self.sql.api.release_delayed;
        self.verb(sql, |q| q.bind(message_id).bind(owner)).await
    }

    /// `retry_delayed(message_id, owner)`: one waiting for its next attempt is tried now.
    /// `false`: not waiting for a retry.
    pub async fn retry_delayed(
        &self,
        message_id: &str,
        owner: Option<&str>,
    ) -> Result<bool, StoreError> {
        let sql = &self.sql.api.retry_delayed;
        self.verb(sql, |q| q.bind(message_id).bind(owner)).await
    }
}

/// A call of one API function, its arguments being bound.
type Call<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;
