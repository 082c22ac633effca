//! The TimeOut message of the contract: properties and body, built from a due row.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{Invalid, Message, Properties, Value, short};
use crate::store::DueRow;

/// AMQP `type` of every TimeOut.
pub const MESSAGE_TYPE: &str = "TimeOut";
/// Header naming the node that fired.
pub const NODE_HEADER: &str = "x-timeoutd-node";
/// Header carrying the W3C trace context of the request that wrote the expectation
/// (<https://www.w3.org/TR/trace-context/>), under the name OpenTelemetry's AMQP
/// propagators read.
pub const TRACEPARENT_HEADER: &str = "traceparent";

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
    let mut headers = vec![(NODE_HEADER.to_owned(), Value::Str(node.to_string()))];
    if let Some(trace) = &row.traceparent {
        headers.push((TRACEPARENT_HEADER.to_owned(), Value::Str(trace.clone())));
    }
    let properties = Properties {
        kind: Some(MESSAGE_TYPE.to_owned()),
        message_id: Some(row.id.to_string()),
        correlation_id: Some(row.process_id.clone()),
        content_type: Some("application/json".to_owned()),
        delivery_mode: Some(2),
        timestamp: Some(u64::try_from(row.fired_at.timestamp()).unwrap_or(0)),
        headers,
        ..Properties::default()
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

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    /// What the daemon writes is what a consumer of the client crate reads.
    #[test]
    fn the_client_decodes_what_the_daemon_encodes() {
        let at = Utc
            .timestamp_opt(1_790_000_000, 123_456_000)
            .single()
            .expect("time");
        let row = DueRow {
            id: Uuid::new_v4(),
            process_id: "order-42".into(),
            message_type: "PaymentReceived".into(),
            timeout_at: at,
            exchange: String::new(),
            routing_key: "orders.timeouts".into(),
            payload: Some(r#"{"big": 1e400, "deep": [[[1]]]}"#.into()),
            payload_bytes: None,
            traceparent: Some(TRACE.into()),
            attempts: 0,
            due_at: at,
            fired_at: at,
            window_end: at,
        };
        let m = timeout(&row, Uuid::nil()).expect("a TimeOut");
        let t = timeoutd_client::TimeOut::from_body(&m.body).expect("decodes");
        assert_eq!(t.expectation_id, row.id);
        assert_eq!(t.process_id, row.process_id);
        assert_eq!(t.message_type, row.message_type);
        assert_eq!((t.timeout_at, t.fired_at), (at, at));
        assert_eq!(t.payload.get(), row.payload.as_deref().unwrap_or_default());
        assert_eq!(m.properties.message_id, Some(row.id.to_string()));
        assert_eq!(
            m.properties.header(TRACEPARENT_HEADER),
            Some(&Value::Str(TRACE.into()))
        );
        let untraced = DueRow {
            traceparent: None,
            ..row
        };
        let m = timeout(&untraced, Uuid::nil()).expect("a TimeOut");
        assert_eq!(m.properties.header(TRACEPARENT_HEADER), None);
    }

    const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
}
