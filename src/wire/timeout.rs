//! The TimeOut message of the contract: properties and body, built from a due row.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{Invalid, Message, Properties, short};
use crate::store::DueRow;

/// AMQP `type` of every TimeOut.
pub const MESSAGE_TYPE: &str = "TimeOut";
/// Header naming the node that fired.
pub const NODE_HEADER: &str = "x-timeoutd-node";

/// The body of a TimeOut, without `payload` (see [`body`]).
#[derive(Debug, Serialize)]
struct Head<'a> {
    expectation_id: Uuid,
    process_id: &'a str,
    message_type: &'a str,
    timeout_at: String,
    fired_at: String,
}

/// The contract's TimeOut for one row (the payload, if any, is embedded as it is).
pub fn timeout(row: &DueRow, node: Uuid) -> Result<Message, Invalid> {
    short(&row.process_id, "process_id")?;
    short(&row.exchange, "exchange name")?;
    short(&row.routing_key, "routing key")?;
    let properties = Properties {
        kind: Some(MESSAGE_TYPE.to_owned()),
        message_id: Some(row.id.to_string()),
        correlation_id: Some(row.process_id.clone()),
        content_type: Some("application/json".to_owned()),
        delivery_mode: Some(2),
        timestamp: Some(u64::try_from(row.fired_at.timestamp()).unwrap_or(0)),
        headers: vec![(NODE_HEADER.to_owned(), node.to_string())],
    };
    Ok(Message {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        properties,
        body: body(row)?,
    })
}

/// The body, with the payload spliced in as the text Postgres printed: jsonb is always
/// valid JSON, and re-encoding it would refuse what a JSON library cannot represent
/// (numbers beyond f64, deep nesting) although the consumer may well read it.
fn body(row: &DueRow) -> Result<Vec<u8>, Invalid> {
    let head = Head {
        expectation_id: row.id,
        process_id: &row.process_id,
        message_type: &row.message_type,
        timeout_at: rfc3339(row.timeout_at),
        fired_at: rfc3339(row.fired_at),
    };
    let mut body = serde_json::to_vec(&head).map_err(|e| Invalid(e.to_string()))?;
    let payload = row.payload.as_deref().unwrap_or("null");
    // `{…}` becomes `{…,"payload":<payload>}`.
    body.pop();
    body.reserve(payload.len() + 12);
    body.extend_from_slice(b",\"payload\":");
    body.extend_from_slice(payload.as_bytes());
    body.push(b'}');
    Ok(body)
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}
