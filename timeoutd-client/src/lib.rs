//! The client of timeoutd for Rust process managers: register, cancel and move
//! expectations, and publish messages at commit (the outbox), inside your own sqlx
//! transaction, so they commit or roll back with your state; and decode the TimeOuts
//! that arrive ([`TimeOut`]). Every call is one of the SQL API's functions (migration
//! 0009), so the role needs only `<schema>_api`; and verify the signatures of what timeoutd
//! publishes ([`signature`]). Small dependencies only (sqlx's Postgres driver, serde,
//! chrono, uuid, hmac): not the daemon.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
//! use std::time::Duration;
//! use timeoutd_client::{self as client, Expectation};
//!
//! let mut tx = pool.begin().await?;
//! let e = Expectation::new("order-42", "PaymentReceived", "orders.timeouts")
//!     .due_in(Duration::from_secs(30))
//!     .payload(serde_json::json!({"order": 42}));
//! let id = client::expect(&mut tx, "timeoutd", &e).await?;
//! tx.commit().await?;
//!
//! // Later, when PaymentReceived arrives:
//! let mut tx = pool.begin().await?;
//! if !client::cancel(&mut tx, "timeoutd", id).await? {
//!     // Too late: the TimeOut has fired (or is being fired); it carries message_id = id.
//! }
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! `schema` must be the daemon's `postgres.schema` (a plain identifier, see [`Schema`];
//! anything else is refused with [`sqlx::Error::Configuration`]).

pub mod signature;

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// The name of the schema holding `expected_messages`: a plain SQL identifier
/// (`[a-z_][a-z0-9_]*`, at most 63 bytes), safe to write into a statement. The one
/// validation of it, for the daemon's `postgres.schema` as for the client calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema(String);

/// A schema name that is not a plain identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most 63 bytes)")]
pub struct InvalidSchema(pub String);

impl Schema {
    pub fn new(name: &str) -> Result<Self, InvalidSchema> {
        let mut chars = name.chars();
        let first = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if first && rest && name.len() <= 63 {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidSchema(name.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `<schema>.expected_messages`.
    pub fn table(&self) -> String {
        format!("{}.expected_messages", self.0)
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The body of a TimeOut message (`type = "TimeOut"`, `message_id` = `expectation_id`,
/// `correlation_id` = `process_id`), as a consumer decodes it.
#[derive(Debug, Serialize, Deserialize)]
pub struct TimeOut {
    pub expectation_id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    pub fired_at: DateTime<Utc>,
    /// The expectation's payload exactly as Postgres printed the jsonb (`null` for none):
    /// decode it with [`TimeOut::payload`], or keep it raw when it holds numbers or
    /// nesting your JSON types cannot.
    pub payload: Box<RawValue>,
}

impl TimeOut {
    /// Decode a TimeOut's body.
    pub fn from_body(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// The payload as `T` (`Option<T>` when it may be null).
    pub fn payload<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.payload.get())
    }
}

/// One expected message.
#[derive(Debug, Clone, PartialEq)]
pub struct Expectation {
    pub id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    /// `""` is the default exchange, which the daemons refuse unless
    /// `timeouts.allow_default_exchange` is on: name an exchange with
    /// [`Expectation::exchange`].
    pub exchange: String,
    pub routing_key: String,
    pub payload: Option<serde_json::Value>,
    /// Makes [`expect`] idempotent: while an expectation with this key is pending, a
    /// second one with the same key adds nothing and returns the first one's id.
    pub idempotency_key: Option<String>,
    /// A W3C trace context (`00-<trace id>-<span id>-<flags>`): the TimeOut carries it as
    /// its `traceparent` header.
    pub traceparent: Option<String>,
}

impl Expectation {
    /// Due now, on the default exchange (allowed only with the daemons'
    /// `timeouts.allow_default_exchange`), with a fresh id; adjust with the builders.
    pub fn new(process_id: &str, message_type: &str, routing_key: &str) -> Self {
        Self {
            id: Uuid::new_v4(),
            process_id: process_id.to_owned(),
            message_type: message_type.to_owned(),
            timeout_at: Utc::now(),
            exchange: String::new(),
            routing_key: routing_key.to_owned(),
            payload: None,
            idempotency_key: None,
            traceparent: None,
        }
    }

    pub fn due_in(mut self, after: std::time::Duration) -> Self {
        self.timeout_at = Utc::now() + chrono::Duration::from_std(after).unwrap_or_default();
        self
    }

    pub fn due_at(mut self, at: DateTime<Utc>) -> Self {
        self.timeout_at = at;
        self
    }

    pub fn exchange(mut self, exchange: &str) -> Self {
        self.exchange = exchange.to_owned();
        self
    }

    pub fn payload(mut self, payload: serde_json::Value) -> Self {
        self.payload = Some(payload);
        self
    }

    pub fn idempotency_key(mut self, key: &str) -> Self {
        self.idempotency_key = Some(key.to_owned());
        self
    }

    pub fn traceparent(mut self, traceparent: &str) -> Self {
        self.traceparent = Some(traceparent.to_owned());
        self
    }
}

/// `SELECT <schema>.<function>(<args>)`: every call goes through the SQL API
/// (docs/integrating/sql-api.md), never the tables.
fn call(schema: &str, function: &str, args: &str) -> Result<String, sqlx::Error> {
    let schema = Schema::new(schema)
        .map_err(|e| sqlx::Error::Configuration(format!("schema {e}").into()))?;
    Ok(format!("SELECT {schema}.{function}({args})"))
}

/// Register the expectation (SQL `expect`); returns its id, the TimeOut's `message_id`
/// (with an idempotency key already pending: that expectation's id).
pub async fn expect(
    conn: &mut PgConnection,
    schema: &str,
    e: &Expectation,
) -> Result<Uuid, sqlx::Error> {
    let sql = call(
        schema,
        "expect",
        "process_id => $1, message_type => $2, routing_key => $3, timeout_at => $4, \
         exchange => $5, payload => $6, idempotency_key => $7, traceparent => $8, id => $9",
    )?;
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(&e.process_id)
        .bind(&e.message_type)
        .bind(&e.routing_key)
        .bind(e.timeout_at)
        .bind(&e.exchange)
        .bind(&e.payload)
        .bind(&e.idempotency_key)
        .bind(&e.traceparent)
        .bind(e.id)
        .fetch_one(conn)
        .await
}

/// Cancel the expectation. `true`: cancelled in time. `false`: it is gone already, so
/// its TimeOut has fired (a row being fired at that moment is waited for).
pub async fn cancel(conn: &mut PgConnection, schema: &str, id: Uuid) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(call(schema, "cancel_expectation", "$1")?))
        .bind(id)
        .fetch_one(conn)
        .await
}

/// Cancel every pending expectation of a process (of one message type, or all); how
/// many.
pub async fn cancel_all(
    conn: &mut PgConnection,
    schema: &str,
    process_id: &str,
    message_type: Option<&str>,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(call(
        schema,
        "cancel_expectations",
        "$1, $2",
    )?))
    .bind(process_id)
    .bind(message_type)
    .fetch_one(conn)
    .await
}

/// Move the deadline. `false` means the TimeOut has already fired. The backoff of a
/// failed publish starts over, since the new deadline is a new intent.
pub async fn reschedule(
    conn: &mut PgConnection,
    schema: &str,
    id: Uuid,
    timeout_at: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(call(
        schema,
        "reschedule_expectation",
        "$1, $2",
    )?))
    .bind(id)
    .bind(timeout_at)
    .fetch_one(conn)
    .await
}

/// The transactional outbox (SQL `publish_at_commit`): the message is published as soon
/// as the transaction commits, never if it rolls back. `properties` as in the SQL API
/// (`{"content_type": …, "headers": {…}}`); returns its `message_id`.
pub async fn publish_at_commit(
    conn: &mut PgConnection,
    schema: &str,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: &serde_json::Value,
) -> Result<String, sqlx::Error> {
    let sql = call(schema, "publish_at_commit", "$1, $2, $3, $4")?;
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(exchange)
        .bind(routing_key)
        .bind(body)
        .bind(properties)
        .fetch_one(conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        for ok in ["timeoutd", "_x", "a1_b2"] {
            assert_eq!(
                Schema::new(ok).map(|s| s.table()),
                Ok(format!("{ok}.expected_messages"))
            );
        }
        let long = "a".repeat(64);
        for bad in ["", "1a", "A", "a-b", "a.b", "a;drop", long.as_str()] {
            assert!(Schema::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_timeout_body_decodes_with_its_payload_raw() {
        let body = br#"{"expectation_id":"0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0","process_id":"p","message_type":"T","timeout_at":"2026-11-21T10:00:30.000000Z","fired_at":"2026-11-21T10:00:30.012345Z","payload":{"big": 1e400}}"#;
        let t = TimeOut::from_body(body).expect("decodes");
        assert_eq!(t.process_id, "p");
        assert_eq!(t.payload.get(), r#"{"big": 1e400}"#);
        let null = br#"{"expectation_id":"0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0","process_id":"p","message_type":"T","timeout_at":"2026-11-21T10:00:30Z","fired_at":"2026-11-21T10:00:30Z","payload":null}"#;
        let t = TimeOut::from_body(null).expect("decodes");
        assert_eq!(
            t.payload::<Option<serde_json::Value>>().expect("null"),
            None
        );
    }
}
