//! The wire format's plain message properties to lapin's and back: the one place the
//! two type systems meet.

use lapin::BasicProperties;
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};

use super::PublishError;
use crate::wire::{Properties, Value};

/// The wire format's properties as lapin's (`user_id` is never sent: the broker accepts
/// only the connection's own). A value too long for its AMQP type is the message's own
/// failure.
pub fn lapin_properties(p: &Properties) -> Result<BasicProperties, PublishError> {
    let mut props = BasicProperties::default();
    let shorts = [
        (&p.kind, "type"),
        (&p.message_id, "message_id"),
        (&p.correlation_id, "correlation_id"),
        (&p.content_type, "content_type"),
        (&p.content_encoding, "content_encoding"),
        (&p.reply_to, "reply_to"),
        (&p.expiration, "expiration"),
        (&p.app_id, "app_id"),
    ];
    for (value, what) in shorts {
        if let Some(v) = value.as_deref() {
            let v = short(v, what)?;
            props = match what {
                "type" => props.with_type(v),
                "message_id" => props.with_message_id(v),
                "correlation_id" => props.with_correlation_id(v),
                "content_type" => props.with_content_type(v),
                "content_encoding" => props.with_content_encoding(v),
                "reply_to" => props.with_reply_to(v),
                "expiration" => props.with_expiration(v),
                _ => props.with_app_id(v),
            };
        }
    }
    if let Some(mode) = p.delivery_mode {
        props = props.with_delivery_mode(mode);
    }
    if let Some(priority) = p.priority {
        props = props.with_priority(priority);
    }
    if let Some(at) = p.timestamp {
        props = props.with_timestamp(at);
    }
    if !p.headers.is_empty() {
        props = props.with_headers(lapin_table(&p.headers)?);
    }
    Ok(props)
}

/// lapin's properties in the wire format (an arriving message).
pub fn wire_properties(p: &BasicProperties) -> Properties {
    let text = |v: &Option<ShortString>| v.as_ref().map(|s| s.as_str().to_owned());
    Properties {
        kind: text(p.kind()),
        message_id: text(p.message_id()),
        correlation_id: text(p.correlation_id()),
        content_type: text(p.content_type()),
        content_encoding: text(p.content_encoding()),
        delivery_mode: *p.delivery_mode(),
        priority: *p.priority(),
        reply_to: text(p.reply_to()),
        expiration: text(p.expiration()),
        timestamp: *p.timestamp(),
        app_id: text(p.app_id()),
        user_id: text(p.user_id()),
        headers: p.headers().as_ref().map(wire_table).unwrap_or_default(),
    }
}

pub(super) fn short(s: &str, what: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(s)
        .map_err(|_| PublishError::Invalid(format!("{what} longer than 255 bytes")))
}

fn lapin_table(entries: &[(String, Value)]) -> Result<FieldTable, PublishError> {
    let mut table = FieldTable::default();
    for (key, value) in entries {
        table.insert(short(key, "header name")?, lapin_value(value)?);
    }
    Ok(table)
}

fn lapin_value(v: &Value) -> Result<AMQPValue, PublishError> {
    Ok(match v {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::I8(n) => AMQPValue::ShortShortInt(*n),
        Value::U8(n) => AMQPValue::ShortShortUInt(*n),
        Value::I16(n) => AMQPValue::ShortInt(*n),
        Value::U16(n) => AMQPValue::ShortUInt(*n),
        Value::I32(n) => AMQPValue::LongInt(*n),
        Value::U32(n) => AMQPValue::LongUInt(*n),
        Value::I64(n) => AMQPValue::LongLongInt(*n),
        Value::F32(bits) => AMQPValue::Float(f32::from_bits(*bits)),
        Value::F64(bits) => AMQPValue::Double(f64::from_bits(*bits)),
        Value::Decimal { scale, value } => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        Value::Short(s) => AMQPValue::ShortString(short(s, "header value")?),
        Value::Str(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        Value::StrBytes(b) => AMQPValue::LongString(LongString::from(b.as_slice())),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items
                .iter()
                .map(lapin_value)
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Timestamp(t) => AMQPValue::Timestamp(*t),
        Value::Table(entries) => AMQPValue::FieldTable(lapin_table(entries)?),
        Value::Bytes(b) => AMQPValue::ByteArray(ByteArray::from(b.clone())),
        Value::Void => AMQPValue::Void,
    })
}

fn wire_table(table: &FieldTable) -> Vec<(String, Value)> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), wire_value(v)))
        .collect()
}

fn wire_value(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::I8(*n),
        AMQPValue::ShortShortUInt(n) => Value::U8(*n),
        AMQPValue::ShortInt(n) => Value::I16(*n),
        AMQPValue::ShortUInt(n) => Value::U16(*n),
        AMQPValue::LongInt(n) => Value::I32(*n),
        AMQPValue::LongUInt(n) => Value::U32(*n),
        AMQPValue::LongLongInt(n) => Value::I64(*n),
        AMQPValue::Float(f) => Value::F32(f.to_bits()),
        AMQPValue::Double(f) => Value::F64(f.to_bits()),
        AMQPValue::DecimalValue(d) => Value::Decimal {
            scale: d.scale,
            value: d.value,
        },
        AMQPValue::ShortString(s) => Value::Short(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::long_string(s.as_bytes()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(wire_value).collect()),
        AMQPValue::Timestamp(t) => Value::Timestamp(*t),
        AMQPValue::FieldTable(t) => Value::Table(wire_table(t)),
        AMQPValue::ByteArray(b) => Value::Bytes(b.as_slice().to_vec()),
        AMQPValue::Void => Value::Void,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_survive_the_trip_through_lapin() {
        let p = Properties {
            kind: Some("Ping".into()),
            message_id: Some("m-1".into()),
            correlation_id: Some("c".into()),
            content_type: Some("text/plain".into()),
            content_encoding: Some("gzip".into()),
            delivery_mode: Some(2),
            priority: Some(7),
            reply_to: Some("r".into()),
            expiration: Some("60000".into()),
            timestamp: Some(1_700_000_000),
            app_id: Some("app".into()),
            user_id: None,
            headers: vec![
                ("a".into(), Value::Array(vec![Value::I16(-2), Value::Void])),
                ("b".into(), Value::F32(f32::INFINITY.to_bits())),
                ("c".into(), Value::StrBytes(vec![0xc3, 0x28])),
                (
                    "d".into(),
                    Value::Table(vec![("x".into(), Value::Bool(true))]),
                ),
            ],
        };
        let back = wire_properties(&lapin_properties(&p).expect("valid"));
        assert_eq!(back, p);
    }

    #[test]
    fn user_id_is_never_published() {
        let p = Properties {
            user_id: Some("someone".into()),
            ..Properties::default()
        };
        let lapin = lapin_properties(&p).expect("valid");
        assert!(lapin.user_id().is_none());
    }
}
