//! Delayed messages (contract section 7): what an arriving message asks for (store it
//! until a due time, or cancel one), and the message delivered when it is due. Pure:
//! the bus hands in plain messages, the store keeps what comes out.

use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use uuid::Uuid;

use super::{Invalid, Message, Properties, Value, short};
use crate::store::{DelayedRow, Due, Ingest, Stored};

/// Milliseconds to wait, as with the delayed-message-exchange plugin.
pub const DELAY_HEADER: &str = "x-delay";
/// An RFC 3339 instant to deliver at (wins over `x-delay`).
pub const DELIVER_AT_HEADER: &str = "x-timeoutd-deliver-at";
/// The exchange to deliver to, instead of `delay.target_exchange`.
pub const EXCHANGE_HEADER: &str = "x-timeoutd-exchange";
/// A message carrying this header cancels the pending message with that `message_id`.
pub const CANCEL_HEADER: &str = "x-timeoutd-cancel";
/// How long the message was held, in milliseconds (added at delivery).
pub const DELAYED_MS_HEADER: &str = "x-timeoutd-delayed-ms";
/// The publisher's `user_id`, which cannot be published again as a property.
pub const USER_ID_HEADER: &str = "x-timeoutd-user-id";
/// Headers of ours, removed from what the publisher sent.
const OURS: &str = "x-timeoutd-";
/// Longer delays are a publisher's mistake (and would overflow timestamps): held.
const MAX_DELAY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The group's settings an arriving message is judged by.
#[derive(Debug, Clone)]
pub struct Rules {
    pub target_exchange: String,
    pub max_body: usize,
}

/// Read one arriving message (its routing key, properties and body).
pub fn ingest(message: Message, rules: &Rules) -> Ingest {
    let Message {
        mut routing_key,
        mut properties,
        body,
        ..
    } = message;
    if let Some(id) = properties
        .header(CANCEL_HEADER)
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
    {
        return Ingest::Cancel(id.to_owned());
    }
    let mut problems = Vec::new();
    let due = due(&properties).unwrap_or_else(|e| {
        problems.push(e);
        Due::After(Duration::ZERO)
    });
    let exchange = exchange(&properties, rules).unwrap_or_else(|e| {
        problems.push(e);
        rules.target_exchange.clone()
    });
    if let Err(e) = short(&routing_key, "routing key") {
        problems.push(e.0);
    }
    if body.len() > rules.max_body {
        problems.push(format!(
            "body of {} bytes is larger than delay.max_body ({} bytes)",
            body.len(),
            rules.max_body
        ));
    }
    if let Some(v) = properties.header(CANCEL_HEADER) {
        problems.push(format!("{CANCEL_HEADER} is not a message id: {v:?}"));
    }
    if without_nul(&mut routing_key) | without_nul_in(&mut properties) {
        problems.push("NUL characters (which Postgres text cannot hold) replaced".to_owned());
    }
    let message_id = properties
        .message_id
        .clone()
        .unwrap_or_else(|| Uuid::new_v4().to_string());
    properties.message_id = Some(message_id.clone());
    strip_ours(&mut properties.headers);
    let properties = serde_json::to_string(&properties).unwrap_or_else(|e| {
        problems.push(format!("properties cannot be stored: {e}"));
        "{}".to_owned()
    });
    Ingest::Store(Box::new(Stored {
        message_id,
        due,
        exchange,
        routing_key,
        properties,
        body,
        held: (!problems.is_empty()).then(|| problems.join("; ")),
    }))
}

fn due(p: &Properties) -> Result<Due, String> {
    if let Some(v) = p.header(DELIVER_AT_HEADER) {
        let at = v
            .as_str()
            .and_then(|s| DateTime::parse_from_rfc3339(s.trim()).ok())
            .map(|at| at.with_timezone(&Utc))
            // Postgres holds 4713 BC to 294276 AD; outside 1..=9999 is a mistake anyway.
            .filter(|at| (1..=9999).contains(&at.year()))
            .ok_or_else(|| format!("{DELIVER_AT_HEADER} is not an RFC 3339 time: {v:?}"))?;
        return Ok(Due::At(at));
    }
    let Some(v) = p.header(DELAY_HEADER) else {
        return Ok(Due::After(Duration::ZERO));
    };
    let ms = v
        .as_integer()
        .ok_or_else(|| format!("{DELAY_HEADER} is not a whole number of milliseconds: {v:?}"))?;
    let ms = u64::try_from(ms.max(0)).unwrap_or(u64::MAX);
    let delay = Duration::from_millis(ms);
    if delay > MAX_DELAY {
        return Err(format!("{DELAY_HEADER} of {ms} ms is more than 100 years"));
    }
    Ok(Due::After(delay))
}

fn exchange(p: &Properties, rules: &Rules) -> Result<String, String> {
    let Some(v) = p.header(EXCHANGE_HEADER) else {
        return Ok(rules.target_exchange.clone());
    };
    let name = v
        .as_str()
        .ok_or_else(|| format!("{EXCHANGE_HEADER} is not a string: {v:?}"))?;
    short(name, "exchange name").map_err(|e| e.0)?;
    Ok(name.to_owned())
}

/// Replace NUL characters, which Postgres text cannot hold; true if there were any.
fn without_nul(s: &mut String) -> bool {
    if !s.contains('\0') {
        return false;
    }
    *s = s.replace('\0', "\u{fffd}");
    true
}

/// As [`without_nul`] for every text property and header name (header values that hold
/// NUL are kept as bytes, see `Value::long_string`).
fn without_nul_in(p: &mut Properties) -> bool {
    let mut found = false;
    for v in [
        &mut p.kind,
        &mut p.message_id,
        &mut p.correlation_id,
        &mut p.content_type,
        &mut p.content_encoding,
        &mut p.reply_to,
        &mut p.expiration,
        &mut p.app_id,
        &mut p.user_id,
    ]
    .into_iter()
    .flatten()
    {
        found |= without_nul(v);
    }
    for (k, v) in &mut p.headers {
        found |= without_nul(k);
        if let Value::Short(s) = v {
            found |= without_nul(s);
        }
    }
    found
}

/// Drop `x-delay` and every `x-timeoutd-*` header: they were instructions to us.
fn strip_ours(headers: &mut Vec<(String, Value)>) {
    headers.retain(|(k, _)| k != DELAY_HEADER && !k.starts_with(OURS));
}

/// The message a due row becomes: as it was published, plus how long it was held and
/// who sent it.
pub fn delivery(row: &DelayedRow, node: Uuid) -> Result<Message, Invalid> {
    let mut properties: Properties = serde_json::from_str(&row.properties)
        .map_err(|e| Invalid(format!("stored properties are not readable: {e}")))?;
    short(&row.exchange, "exchange name")?;
    short(&row.routing_key, "routing key")?;
    strip_ours(&mut properties.headers);
    let held = (row.fired_at - row.created_at).num_milliseconds().max(0);
    properties
        .headers
        .push((DELAYED_MS_HEADER.to_owned(), Value::I64(held)));
    properties.headers.push((
        super::timeout::NODE_HEADER.to_owned(),
        Value::Str(node.to_string()),
    ));
    if let Some(user) = properties.user_id.take() {
        properties
            .headers
            .push((USER_ID_HEADER.to_owned(), Value::Str(user)));
    }
    Ok(Message {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        properties,
        body: row.body.clone().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests;
