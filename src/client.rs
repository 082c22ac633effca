//! Client API for Rust process managers: register, cancel and move expectations inside
//! your own sqlx transaction, so the expectation commits or rolls back with your state.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
//! use std::time::Duration;
//! use timeoutd::client::{self, Expectation};
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
//! `schema` must be the daemon's `postgres.schema` (a plain identifier; anything else is
//! refused with [`sqlx::Error::Configuration`]).

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// One expected message.
#[derive(Debug, Clone, PartialEq)]
pub struct Expectation {
    pub id: Uuid,
    pub process_id: String,
    pub message_type: String,
    pub timeout_at: DateTime<Utc>,
    /// `""` is the default exchange.
    pub exchange: String,
    pub routing_key: String,
    pub payload: Option<serde_json::Value>,
}

impl Expectation {
    /// Due now, on the default exchange, with a fresh id; adjust with the builders.
    pub fn new(process_id: &str, message_type: &str, routing_key: &str) -> Self {
        Self {
            id: Uuid::new_v4(),
            process_id: process_id.to_owned(),
            message_type: message_type.to_owned(),
            timeout_at: Utc::now(),
            exchange: String::new(),
            routing_key: routing_key.to_owned(),
            payload: None,
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
}

fn table(schema: &str) -> Result<String, sqlx::Error> {
    let plain = !schema.is_empty()
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !plain {
        return Err(sqlx::Error::Configuration(
            format!("schema {schema:?} is not a plain identifier").into(),
        ));
    }
    Ok(format!("{schema}.expected_messages"))
}

/// Insert the expectation; returns its id (the TimeOut's `message_id`).
pub async fn expect(
    conn: &mut PgConnection,
    schema: &str,
    e: &Expectation,
) -> Result<Uuid, sqlx::Error> {
    let sql = format!(
        "INSERT INTO {} (id, process_id, message_type, timeout_at, exchange, routing_key, \
         payload) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        table(schema)?
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(e.id)
        .bind(&e.process_id)
        .bind(&e.message_type)
        .bind(e.timeout_at)
        .bind(&e.exchange)
        .bind(&e.routing_key)
        .bind(&e.payload)
        .execute(conn)
        .await?;
    Ok(e.id)
}

/// Delete the expectation. `true`: cancelled in time. `false`: it is gone already, so
/// its TimeOut has fired (or is firing right now and will arrive).
pub async fn cancel(conn: &mut PgConnection, schema: &str, id: Uuid) -> Result<bool, sqlx::Error> {
    let sql = format!("DELETE FROM {} WHERE id = $1", table(schema)?);
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Move the deadline. `false` means the TimeOut has already fired. Resets the failure
/// backoff, since the new deadline is a new intent.
pub async fn reschedule(
    conn: &mut PgConnection,
    schema: &str,
    id: Uuid,
    timeout_at: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE {} SET timeout_at = $2, retry_at = NULL WHERE id = $1",
        table(schema)?
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id)
        .bind(timeout_at)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}
