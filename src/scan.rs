//! One transactional scan batch: lock due rows → publish their TimeOuts pipelined →
//! await every confirm → delete the confirmed rows, keep the failed ones with attempts and
//! backoff → re-check the lease → commit.
//!
//! The transaction is what makes a row fire once: its rows stay locked (and invisible to
//! other scanners through SKIP LOCKED) from the moment they are read until the commit.

use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::BasicProperties;
use lapin::types::ShortString;
use serde::Serialize;
use uuid::Uuid;

use crate::backoff;
use crate::bus::{self, Bus, BusError, Outgoing, PublishError};
use crate::election::Lease;
use crate::store::{DueRow, Failure, Store, StoreError};

/// AMQP `type` of every TimeOut.
pub const MESSAGE_TYPE: &str = "TimeOut";
/// Header naming the node that fired.
pub const NODE_HEADER: &str = "x-timeoutd-node";

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// The body of a TimeOut message.
#[derive(Debug, Serialize)]
struct TimeOutBody<'a> {
    expectation_id: Uuid,
    process_id: &'a str,
    message_type: &'a str,
    timeout_at: String,
    fired_at: String,
    payload: &'a Option<serde_json::Value>,
}

/// What one batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Rows locked (a full batch means: scan again at once).
    pub locked: usize,
    /// TimeOuts confirmed and their rows deleted.
    pub fired: usize,
    /// Rows kept with attempts + 1 (unroutable, nacked, unconfirmed, invalid).
    pub failed: usize,
    /// The lease was lost before commit: rolled back, nothing deleted.
    pub lease_lost: bool,
    pub duration: Duration,
    /// Lateness of each fired row (fire time minus deadline).
    pub lateness: Vec<Duration>,
    /// Why each kept row failed (`PublishError::reason`), for the metrics.
    pub failure_reasons: Vec<&'static str>,
}

/// Settings of the scan that do not change while running.
#[derive(Debug, Clone)]
pub struct Scanner {
    pub node_id: Uuid,
    pub batch_size: u32,
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Scanner {
    /// Run one batch. `lease` is asked right before publishing (anything but `Held`
    /// rolls back: nothing has been sent yet) and right before committing (`Stale` rolls
    /// back: a paused process must not commit on its old belief; `Demoted` commits: the
    /// rows stayed locked by this transaction the whole time, so nobody else fired them,
    /// and rolling back would only fire them a second time).
    pub async fn run_batch(
        &self,
        store: &Store,
        bus: &Bus,
        lease: impl Fn() -> Lease,
    ) -> Result<BatchOutcome, ScanError> {
        let started = Instant::now();
        let mut tx = store.begin().await?;
        let rows = store.lock_due(&mut tx, self.batch_size).await?;
        let mut outcome = BatchOutcome {
            locked: rows.len(),
            ..BatchOutcome::default()
        };
        if rows.is_empty() || lease() != Lease::Held {
            outcome.lease_lost = !rows.is_empty();
            tx.rollback().await.map_err(StoreError::from)?;
            outcome.duration = started.elapsed();
            return Ok(outcome);
        }
        let (fired, failed) = self.publish(bus, &rows).await?;
        let (failures, reasons): (Vec<Failure>, Vec<&'static str>) = failed.into_iter().unzip();
        store.delete(&mut tx, &fired).await?;
        store.record_failures(&mut tx, &failures).await?;
        if lease() == Lease::Stale {
            tx.rollback().await.map_err(StoreError::from)?;
            outcome.lease_lost = true;
        } else {
            tx.commit().await.map_err(StoreError::from)?;
            outcome.fired = fired.len();
            outcome.failed = failures.len();
            outcome.failure_reasons = reasons;
            outcome.lateness = lateness(&rows, &fired);
        }
        outcome.duration = started.elapsed();
        Ok(outcome)
    }

    /// Publish every row's TimeOut and sort the rows into confirmed ids and failures.
    async fn publish(
        &self,
        bus: &Bus,
        rows: &[DueRow],
    ) -> Result<(Vec<Uuid>, Vec<(Failure, &'static str)>), BusError> {
        let mut messages = Vec::with_capacity(rows.len());
        let mut invalid = Vec::new();
        for row in rows {
            match timeout_message(row, self.node_id) {
                Ok(m) => messages.push((row, m)),
                Err(e) => invalid.push(self.failure(row, &e)),
            }
        }
        let outgoing: Vec<Outgoing> = messages.iter().map(|(_, m)| m.clone()).collect();
        let results = bus.publish_confirmed(&outgoing).await?;
        if !bus.is_healthy() {
            // The connection died under the batch: that says nothing about the rows, so
            // roll back instead of charging them a failed attempt.
            return Err(BusError::ConnectionLost);
        }
        let mut fired = Vec::with_capacity(rows.len());
        let mut failures = invalid;
        for ((row, _), result) in messages.iter().zip(results) {
            match result {
                Ok(()) => fired.push(row.id),
                Err(e) => failures.push(self.failure(row, &e)),
            }
        }
        Ok((fired, failures))
    }

    fn failure(&self, row: &DueRow, error: &PublishError) -> (Failure, &'static str) {
        let attempts = u32::try_from(row.attempts).unwrap_or(0);
        tracing::warn!(
            id = %row.id, exchange = %row.exchange, routing_key = %row.routing_key,
            attempts = attempts + 1, reason = error.reason(), "TimeOut not published: {error}"
        );
        let failure = Failure {
            id: row.id,
            error: error.to_string(),
            delay: backoff::exponential(self.retry_min, self.retry_max, attempts),
        };
        (failure, error.reason())
    }
}

fn lateness(rows: &[DueRow], fired: &[Uuid]) -> Vec<Duration> {
    rows.iter()
        .filter(|r| fired.contains(&r.id))
        .map(|r| (r.fired_at - r.timeout_at).to_std().unwrap_or_default())
        .collect()
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The contract's TimeOut for one row.
pub fn timeout_message(row: &DueRow, node: Uuid) -> Result<Outgoing, PublishError> {
    let correlation = ShortString::try_new(row.process_id.as_str())
        .map_err(|_| PublishError::Invalid("process_id longer than 255 bytes".into()))?;
    let body = TimeOutBody {
        expectation_id: row.id,
        process_id: &row.process_id,
        message_type: &row.message_type,
        timeout_at: rfc3339(row.timeout_at),
        fired_at: rfc3339(row.fired_at),
        payload: &row.payload,
    };
    let body = serde_json::to_vec(&body).map_err(|e| PublishError::Invalid(e.to_string()))?;
    let properties = BasicProperties::default()
        .with_type(MESSAGE_TYPE.into())
        .with_message_id(row.id.to_string().into())
        .with_correlation_id(correlation)
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(row.fired_at.timestamp()).unwrap_or(0))
        .with_headers(bus::header(NODE_HEADER, &node.to_string()));
    Ok(Outgoing {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        properties,
        body,
    })
}
