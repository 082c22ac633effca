//! Delayed messages (contract section 7): what an arriving message asks for (store it
//! until a due time, or cancel one), and the message delivered when it is due. Pure:
//! the bus hands in plain messages, the store keeps what comes out.

use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use uuid::Uuid;

use super::{Invalid, Message, Properties, Value, short};
use crate::store::{Bound, DelayedRow, Due, Held, Ingest, Stored};

use crate::config::{ConfigError, Settings};
use crate::destinations::Destinations;

/// Milliseconds to wait, as with the delayed-message-exchange plugin (see [`delay_ms`]).
pub const DELAY_HEADER: &str = "x-delay";
/// An RFC 3339 instant to deliver at (wins over `x-delay`).
pub const DELIVER_AT_HEADER: &str = "x-timeoutd-deliver-at";
/// The exchange to deliver to, instead of `delay.target_exchange`.
pub const EXCHANGE_HEADER: &str = "x-timeoutd-exchange";
/// A message carrying this header cancels its owner's pending message with that
/// `message_id`.
pub const CANCEL_HEADER: &str = "x-timeoutd-cancel";
/// How long the message was held, in milliseconds (added at delivery).
pub const DELAYED_MS_HEADER: &str = "x-timeoutd-delayed-ms";
/// The message's owner: the `user_id` it was published with (the broker checked it),
/// which cannot be published again as a property.
pub const USER_ID_HEADER: &str = "x-timeoutd-user-id";
/// Headers of ours, removed from what the publisher sent, in any letter case.
const OURS: &str = "x-timeoutd-";

/// The owner of what broker user `user_id` publishes: its name, unless that would read
/// as a SQL role's (`sql:<role>`, migration 0009) or as this escape itself, which are
/// owned under `amqp:`: a broker user can never act on a SQL role's messages.
pub fn broker_owner(user_id: Option<&str>) -> String {
    match user_id {
        None => String::new(),
        Some(u) if u.starts_with("sql:") || u.starts_with("amqp:") => format!("amqp:{u}"),
        Some(u) => u.to_owned(),
    }
}

/// The group's settings an arriving message is judged by.
#[derive(Debug, Clone)]
pub struct Rules {
    /// Where it may go (`delay.target_exchange`, `delay.allowed_exchanges`).
    pub destinations: Destinations,
    /// `delay.max_body`.
    pub max_body: usize,
    /// `delay.max_delay`.
    pub max_delay: Duration,
}

impl Rules {
    /// The rules a group's settings make (`delay.*`, and the exchanges never allowed).
    pub fn of(settings: &Settings) -> Result<Self, ConfigError> {
        Ok(Self {
            destinations: settings.delay_destinations()?,
            max_body: usize::try_from(settings.delay.max_body.as_u64()).unwrap_or(usize::MAX),
            max_delay: settings.delay.max_delay,
        })
    }
}

/// Read one arriving message (its routing key, properties and body); `now` bounds
/// `x-timeoutd-deliver-at` by `max_delay`.
pub fn ingest(message: Message, rules: &Rules, now: DateTime<Utc>) -> Ingest {
    let Message {
        mut routing_key,
        mut properties,
        mut body,
        ..
    } = message;
    // The broker refuses a user_id that is not the publishing connection's own user.
    let owner = broker_owner(properties.user_id.as_deref());
    if let Some(id) = properties
        .header(CANCEL_HEADER)
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
    {
        return Ingest::Cancel {
            owner,
            message_id: id.to_owned(),
        };
    }
    let mut problems: Vec<Problem> = Vec::new();
    let due = due(&properties, rules, now).unwrap_or_else(|(due, e)| {
        problems.push(e);
        due
    });
    let exchange = exchange(&properties, rules).unwrap_or_else(|(exchange, e)| {
        problems.push(e);
        exchange
    });
    if let Err(e) = short(&routing_key, "routing key") {
        problems.push((Bound::BadInput, e.0));
    }
    let body_dropped = body.len() > rules.max_body;
    if body_dropped {
        problems.push((
            Bound::TooLarge,
            format!(
                "body of {} bytes is larger than delay.max_body ({} bytes): not stored",
                body.len(),
                rules.max_body
            ),
        ));
        body = Vec::new();
    }
    if let Some(v) = properties.header(CANCEL_HEADER) {
        let e = format!("{CANCEL_HEADER} is not a message id: {v:?}");
        problems.push((Bound::BadInput, e));
    }
    if without_nul(&mut routing_key) | without_nul_in(&mut properties) {
        let e = "NUL characters (which Postgres text cannot hold) replaced".to_owned();
        problems.push((Bound::BadInput, e));
    }
    let message_id = properties
        .message_id
        .clone()
        .unwrap_or_else(|| Uuid::new_v4().to_string());
    properties.message_id = Some(message_id.clone());
    strip_ours(&mut properties.headers);
    let properties = serde_json::to_string(&properties).unwrap_or_else(|e| {
        problems.push((Bound::BadInput, format!("properties cannot be stored: {e}")));
        "{}".to_owned()
    });
    let held = problems.iter().map(|(b, _)| *b).max().map(|bound| Held {
        why: problems
            .iter()
            .map(|(_, why)| why.as_str())
            .collect::<Vec<_>>()
            .join("; "),
        bound,
    });
    Ingest::Store(Box::new(Stored {
        owner,
        message_id,
        due,
        exchange,
        routing_key,
        properties,
        body,
        body_dropped,
        held,
    }))
}

/// When it is due; `Err` says why it is held, with the due time to store it with (one
/// Postgres can hold).
fn due(p: &Properties, rules: &Rules, now: DateTime<Utc>) -> Result<Due, (Due, Problem)> {
    let at_once = Due::After(Duration::ZERO);
    let far = |what: String| {
        let why = format!(
            "{what} is later than delay.max_delay ({}) allows",
            humantime::format_duration(rules.max_delay)
        );
        (Bound::TooLate, why)
    };
    if let Some(v) = p.header(DELIVER_AT_HEADER) {
        let at = v
            .as_str()
            .and_then(|s| DateTime::parse_from_rfc3339(s.trim()).ok())
            .map(|at| at.with_timezone(&Utc))
            // Postgres holds 4713 BC to 294276 AD; outside 1..=9999 is a mistake anyway.
            .filter(|at| (1..=9999).contains(&at.year()))
            .ok_or_else(|| {
                let e = format!("{DELIVER_AT_HEADER} is not an RFC 3339 time: {v:?}");
                (at_once, (Bound::BadInput, e))
            })?;
        let ahead = (at - now).to_std().unwrap_or_default();
        if ahead > rules.max_delay {
            return Err((Due::At(at), far(format!("{DELIVER_AT_HEADER} {at}"))));
        }
        return Ok(Due::At(at));
    }
    let Some(v) = p.header(DELAY_HEADER) else {
        return Ok(at_once);
    };
    let ms = delay_ms(v).ok_or_else(|| {
        let e = format!(
            "{DELAY_HEADER} is not a number of milliseconds: {}",
            shown(v)
        );
        (at_once, (Bound::BadInput, e))
    })?;
    let delay = Duration::from_millis(ms);
    if delay > rules.max_delay {
        // Stored as due at the bound, should an operator release it.
        return Err((
            Due::After(rules.max_delay),
            far(format!("{DELAY_HEADER} of {} ms", shown(v))),
        ));
    }
    Ok(Due::After(delay))
}

/// `x-delay` as the delayed-message plugin reads it: any AMQP integer type, a string of
/// decimal digits, or a float, double or decimal, whose fraction is dropped (truncated
/// toward zero, as the plugin does: kombu sends a whole `2500` as the double `2500.0`).
/// Negative means now (0). A number too large for a `u64` of milliseconds saturates
/// (it is beyond `delay.max_delay` anyway). `None` for anything else, NaN included.
fn delay_ms(v: &Value) -> Option<u64> {
    let whole = match *v {
        Value::F32(bits) => truncated(f32::from_bits(bits).into())?,
        Value::F64(bits) => truncated(f64::from_bits(bits))?,
        Value::Decimal { scale, value } => {
            // value / 10^scale; a scale beyond 9 leaves nothing of a u32 but zero.
            i128::from(value) / 10i128.checked_pow(scale.into()).unwrap_or(i128::MAX)
        }
        _ => v.as_integer()?,
    };
    Some(u64::try_from(whole.max(0)).unwrap_or(u64::MAX))
}

/// A header value as a person reads it: floats as numbers, not as their bits.
fn shown(v: &Value) -> String {
    match *v {
        Value::F32(bits) => format!("float {}", f32::from_bits(bits)),
        Value::F64(bits) => format!("double {}", f64::from_bits(bits)),
        Value::Decimal { scale, value } => format!("decimal {value}e-{scale}"),
        Value::Short(ref s) | Value::Str(ref s) => format!("{s:?}"),
        _ => match v.as_integer() {
            Some(n) => n.to_string(),
            None => format!("{v:?}"),
        },
    }
}

/// `x` toward zero, saturating at the ends of `i128` (infinities included); `None` for
/// NaN, which names no time at all.
fn truncated(x: f64) -> Option<i128> {
    // `as` truncates toward zero and saturates; only NaN must be told apart.
    (!x.is_nan()).then_some(x as i128)
}

/// Where it goes; `Err` says why it is held, with the exchange to store.
fn exchange(p: &Properties, rules: &Rules) -> Result<String, (String, Problem)> {
    let target = rules.destinations.target();
    let Some(v) = p.header(EXCHANGE_HEADER) else {
        return Ok(target.to_owned());
    };
    let name = v.as_str().ok_or_else(|| {
        let e = format!("{EXCHANGE_HEADER} is not a string: {v:?}");
        (target.to_owned(), (Bound::BadInput, e))
    })?;
    short(name, "exchange name").map_err(|e| (target.to_owned(), (Bound::BadInput, e.0)))?;
    // Kept as named (held), so an operator sees where it wanted to go.
    rules
        .destinations
        .check(name)
        .map_err(|e| (name.to_owned(), (Bound::NotAllowed, e)))?;
    Ok(name.to_owned())
}

/// Why a message is held, and what it is counted as.
type Problem = (Bound, String);

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

/// Drop `x-delay` and every `x-timeoutd-*` header, in any letter case: they were
/// instructions to us (read in exact case only, as the plugin reads `x-delay`), or a
/// publisher's attempt to speak for timeoutd to consumers that compare names without
/// case.
fn strip_ours(headers: &mut Vec<(String, Value)>) {
    headers.retain(|(k, _)| !is_ours(k));
}

/// `x-delay`, or a name starting `x-timeoutd-`, in any letter case; also with non-ASCII
/// letters that case-insensitive comparisons take for ASCII ones (`ı`, `ſ`, `K`, `İ`).
pub fn is_ours(name: &str) -> bool {
    let folded: String = name.chars().map(fold).collect();
    folded.starts_with(OURS) || folded == DELAY_HEADER
}

/// A letter as a case-insensitive comparison may see it: ASCII lowercase, or the ASCII
/// letter Unicode's case mapping makes of it.
fn fold(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    c.to_uppercase()
        .chain(c.to_lowercase())
        .find(char::is_ascii_alphabetic)
        .map_or(c, |a| a.to_ascii_lowercase())
}

/// The message a due row becomes: as it was published, plus how long it was held, who
/// sent it and who published it (its owner). Where it may go is not judged here (see
/// [`Destinations`]).
pub fn delivery(row: &DelayedRow, node: Uuid) -> Result<Message, Invalid> {
    if row.body_dropped {
        return Err(Invalid(
            "stored without its body (larger than delay.max_body): it cannot be delivered"
                .to_owned(),
        ));
    }
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
    // Never republished as a property: the broker takes only our own user there.
    properties.user_id = None;
    if !row.owner.is_empty() {
        properties
            .headers
            .push((USER_ID_HEADER.to_owned(), Value::Str(row.owner.clone())));
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
