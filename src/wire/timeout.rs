//! The TimeOut message of the contract: properties and body, built from a due row.

use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};
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

/// The contract's TimeOut for one row (the payload, if any, is embedded as it is).
pub fn timeout(row: &DueRow, node: Uuid) -> Result<Message, Invalid> {
    short(&row.process_id, "process_id")?;
    short(&row.exchange, "exchange name")?;
    short(&row.routing_key, "routing key")?;
    let mut headers = Vec::with_capacity(2);
    headers.push((NODE_HEADER.to_owned(), Value::Str(uuid_text(node))));
    if let Some(trace) = &row.traceparent {
        headers.push((TRACEPARENT_HEADER.to_owned(), Value::Str(trace.clone())));
    }
    let properties = Properties {
        kind: Some(MESSAGE_TYPE.to_owned()),
        message_id: Some(uuid_text(row.id)),
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

/// A uuid as its hyphenated lowercase text (as `Display` writes it, without the
/// formatting machinery: this is done twice per TimeOut).
fn uuid_text(id: Uuid) -> String {
    id.hyphenated()
        .encode_lower(&mut Uuid::encode_buffer())
        .to_owned()
}

/// The body: `{"expectation_id":…,"process_id":…,"message_type":…,"timeout_at":…,
/// "fired_at":…,"payload":…}`, compact, as serde_json writes such a struct. The payload
/// is spliced in as the text Postgres printed: jsonb is always valid JSON, and
/// re-encoding it would refuse what a JSON library cannot represent (numbers beyond
/// f64, deep nesting) although the consumer may well read it. Written by hand: it is
/// built for every TimeOut, and only the two strings of the process manager's need
/// escaping.
fn body(row: &DueRow) -> Result<Vec<u8>, Invalid> {
    let payload = row.payload.as_deref().unwrap_or("null");
    let mut body =
        Vec::with_capacity(180 + row.process_id.len() + row.message_type.len() + payload.len());
    body.extend_from_slice(b"{\"expectation_id\":\"");
    body.extend_from_slice(uuid_text(row.id).as_bytes());
    body.extend_from_slice(b"\",\"process_id\":");
    json_string(&mut body, &row.process_id)?;
    body.extend_from_slice(b",\"message_type\":");
    json_string(&mut body, &row.message_type)?;
    body.extend_from_slice(b",\"timeout_at\":\"");
    rfc3339(&mut body, row.timeout_at);
    body.extend_from_slice(b"\",\"fired_at\":\"");
    rfc3339(&mut body, row.fired_at);
    body.extend_from_slice(b"\",\"payload\":");
    body.extend_from_slice(payload.as_bytes());
    body.push(b'}');
    Ok(body)
}

fn json_string(out: &mut Vec<u8>, s: &str) -> Result<(), Invalid> {
    serde_json::to_writer(out, s).map_err(|e| Invalid(e.to_string()))
}

/// `t` as RFC 3339 with microseconds and `Z` (chrono's `SecondsFormat::Micros`), written
/// digit by digit for the years 0–9999 (every due row's: see `Kind::deadline` in `store`).
fn rfc3339(out: &mut Vec<u8>, t: DateTime<Utc>) {
    let n = t.naive_utc();
    let (year, nanos) = (n.year(), n.nanosecond());
    let Ok(year) = u32::try_from(year) else {
        return out.extend_from_slice(chrono_rfc3339(t).as_bytes());
    };
    // A leap second (nanoseconds past 10^9) is chrono's to spell.
    if year > 9999 || nanos >= 1_000_000_000 {
        return out.extend_from_slice(chrono_rfc3339(t).as_bytes());
    }
    digits(out, year, 4);
    let parts = [
        (b'-', n.month()),
        (b'-', n.day()),
        (b'T', n.hour()),
        (b':', n.minute()),
        (b':', n.second()),
    ];
    for (sep, value) in parts {
        out.push(sep);
        digits(out, value, 2);
    }
    out.push(b'.');
    digits(out, nanos / 1000, 6);
    out.push(b'Z');
}

/// The last `width` decimal digits of `value`, zero-padded.
fn digits(out: &mut Vec<u8>, value: u32, width: u32) {
    for k in (0..width).rev() {
        let d = value / 10u32.pow(k) % 10;
        out.push(b'0' + u8::try_from(d).unwrap_or(0));
    }
}

fn chrono_rfc3339(t: DateTime<Utc>) -> String {
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
            tid: None,
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

    /// The body as serde_json and chrono write it: what the hand-written one must match
    /// byte for byte.
    fn reference_body(row: &DueRow) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Head<'a> {
            expectation_id: Uuid,
            process_id: &'a str,
            message_type: &'a str,
            timeout_at: String,
            fired_at: String,
        }
        let head = Head {
            expectation_id: row.id,
            process_id: &row.process_id,
            message_type: &row.message_type,
            timeout_at: chrono_rfc3339(row.timeout_at),
            fired_at: chrono_rfc3339(row.fired_at),
        };
        let mut body = serde_json::to_vec(&head).expect("json");
        body.pop();
        body.extend_from_slice(b",\"payload\":");
        body.extend_from_slice(row.payload.as_deref().unwrap_or("null").as_bytes());
        body.push(b'}');
        body
    }

    proptest::proptest! {
        #[test]
        fn the_body_is_what_serde_and_chrono_write(
            process_id in "\\PC*|[\"\\\\\\x00-\\x1f\\u{7f}\\u{2028}]{0,8}",
            message_type in "\\PC{0,20}",
            // Years 0 to 10000 and beyond, any nanosecond.
            secs in -62_167_219_200i64..=253_402_400_000i64,
            nanos in 0u32..1_000_000_000,
            payload in proptest::option::of("\\{\"a\":[0-9]{1,5}\\}"),
        ) {
            let at = Utc.timestamp_opt(secs, nanos).single().expect("time");
            let row = DueRow {
                id: Uuid::new_v4(),
                process_id,
                message_type,
                timeout_at: at,
                exchange: String::new(),
                routing_key: "q".into(),
                payload,
                payload_bytes: None,
                traceparent: None,
                attempts: 0,
                due_at: at,
                fired_at: at + chrono::Duration::nanoseconds(1_234_567),
                window_end: at,
                tid: None,
            };
            let (body, reference) = (body(&row).expect("body"), reference_body(&row));
            proptest::prop_assert_eq!(
                String::from_utf8_lossy(&body),
                String::from_utf8_lossy(&reference)
            );
        }
    }

    #[test]
    fn a_leap_second_is_written_as_chrono_writes_it() {
        let leap = Utc
            .timestamp_opt(1_483_228_799, 1_500_000_000)
            .single()
            .expect("leap second");
        let mut out = Vec::new();
        rfc3339(&mut out, leap);
        assert_eq!(String::from_utf8_lossy(&out), chrono_rfc3339(leap));
    }

    #[test]
    fn ids_are_written_as_display_writes_them() {
        let id = Uuid::new_v4();
        assert_eq!(uuid_text(id), id.to_string());
    }
}
