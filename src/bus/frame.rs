//! The content-header frame a message takes on the wire (class, weight, body size,
//! property flags and every property, the headers encoded as AMQP field tables), measured
//! with amq-protocol's own serializer, and the bounds an arriving message is held to.
//!
//! A content header is never split: RabbitMQ closes the connection of a publisher whose
//! header frame is over the negotiated `frame_max`, and sends a consumer the frame whole
//! with its own headers added (`x-delivery-count`). So the ingress refuses what would
//! leave too little room under `frame_max`, and a due row whose frame, with timeoutd's
//! own headers, would not fit is held instead of published.

use amq_protocol::frame::WriteContext;
use lapin::BasicProperties;
use lapin::protocol::basic::gen_properties;
use lapin::types::{AMQPValue, FieldTable};

/// What a content-header frame weighs besides its properties: frame type, channel and
/// size, class id, weight, body size, frame end.
const FRAME_OVERHEAD: usize = 1 + 2 + 4 + 2 + 2 + 8 + 1;

/// Room the ingress leaves under `frame_max`: for the broker's own headers on the way in
/// and timeoutd's on the way out.
pub const HEADROOM: usize = 4096;

/// Deepest nesting of tables and arrays accepted in an arriving message's headers (the
/// headers table itself is level 1).
pub const MAX_DEPTH: usize = 16;

/// Most values accepted in an arriving message's headers, counting every entry of every
/// nested table and array.
pub const MAX_VALUES: usize = 1024;

/// Deliveries of one message at most: one delivered more often than this (the broker's
/// `x-delivery-count`) without being stored is refused instead of going round again.
pub const MAX_DELIVERIES: i64 = 100;

/// The whole content-header frame of a message with these properties, in bytes.
pub fn header_frame_size(props: &BasicProperties) -> usize {
    match gen_properties(props)(WriteContext::from(Vec::new())) {
        Ok(written) => FRAME_OVERHEAD + written.write.len(),
        // A Vec does not run out of room: nothing that fails here could be sent.
        Err(_) => usize::MAX,
    }
}

/// Why an arriving message is refused (rejected to the broker, which dead-letters it if
/// the ingress queue has a dead-letter policy): the `result` of its metric, and the
/// reason logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub result: &'static str,
    pub why: String,
}

/// An arriving message's properties judged against the bounds, `frame_max` being the
/// connection's negotiated one. The delivery count is read only on a redelivery: then
/// the broker set it; on a first delivery it may be a header the publisher forwarded.
pub fn judge(props: &BasicProperties, frame_max: u32, redelivered: bool) -> Result<(), Refusal> {
    let headers = props.headers().as_ref();
    if let Some(why) = headers.and_then(|h| h.inner().get(lapin::REFUSED_HEADER)) {
        let why = match why {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            _ => String::new(),
        };
        return Err(Refusal {
            result: TOO_DEEP,
            why: format!("headers nested too deep ({why}), over the bound of {MAX_DEPTH}"),
        });
    }
    if let Some(h) = headers {
        let (values, depth) = shape(h);
        if depth > MAX_DEPTH {
            return Err(Refusal {
                result: TOO_DEEP,
                why: format!("headers nested {depth} levels deep, over the bound of {MAX_DEPTH}"),
            });
        }
        if values > MAX_VALUES {
            return Err(Refusal {
                result: TOO_MANY,
                why: format!("{values} header values, over the bound of {MAX_VALUES}"),
            });
        }
        if let Some(n) = delivery_count(h).filter(|n| redelivered && *n > MAX_DELIVERIES) {
            return Err(Refusal {
                result: REDELIVERED,
                why: format!(
                    "delivered {n} times without being stored, over the bound of \
                     {MAX_DELIVERIES}"
                ),
            });
        }
    }
    let max = ingress_max(frame_max);
    let size = header_frame_size(props);
    if size > max {
        return Err(Refusal {
            result: TOO_LARGE,
            why: format!(
                "properties and headers of {size} bytes encoded, over the bound of {max} \
                 (frame_max {frame_max} less {HEADROOM})"
            ),
        });
    }
    Ok(())
}

/// The largest content-header frame the ingress accepts under `frame_max`.
pub fn ingress_max(frame_max: u32) -> usize {
    usize::try_from(frame_max)
        .unwrap_or(usize::MAX)
        .saturating_sub(HEADROOM)
}

pub const TOO_LARGE: &str = "rejected_headers_too_large";
pub const TOO_DEEP: &str = "rejected_headers_too_deep";
pub const TOO_MANY: &str = "rejected_too_many_headers";
pub const REDELIVERED: &str = "rejected_redelivered";

/// How many values a table holds in all, and how deep tables and arrays nest in it,
/// without recursion.
fn shape(table: &FieldTable) -> (usize, usize) {
    let mut values = 0;
    let mut deepest = 1;
    let mut open: Vec<(&AMQPValue, usize)> = table.inner().values().map(|v| (v, 1)).collect();
    while let Some((v, level)) = open.pop() {
        values += 1;
        match v {
            AMQPValue::FieldTable(t) => {
                deepest = deepest.max(level + 1);
                open.extend(t.inner().values().map(|v| (v, level + 1)));
            }
            AMQPValue::FieldArray(a) => {
                deepest = deepest.max(level + 1);
                open.extend(a.as_slice().iter().map(|v| (v, level + 1)));
            }
            _ => {}
        }
    }
    (values, deepest)
}

/// The broker's `x-delivery-count`: deliveries of this message before this one.
fn delivery_count(h: &FieldTable) -> Option<i64> {
    match h.inner().get("x-delivery-count")? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some((*n).into()),
        AMQPValue::LongUInt(n) => Some((*n).into()),
        AMQPValue::ShortInt(n) => Some((*n).into()),
        AMQPValue::ShortUInt(n) => Some((*n).into()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};

    fn with_headers(h: FieldTable) -> BasicProperties {
        BasicProperties::default().with_headers(h)
    }

    fn nested(levels: usize) -> FieldTable {
        let mut t = FieldTable::default();
        for _ in 1..levels {
            let mut outer = FieldTable::default();
            outer.insert("a".into(), AMQPValue::FieldTable(t));
            t = outer;
        }
        t
    }

    #[test]
    fn the_frame_is_measured_as_amq_protocol_writes_it() {
        // No properties: the overhead and two bytes of flags.
        assert_eq!(header_frame_size(&BasicProperties::default()), 22);
        let mut h = FieldTable::default();
        h.insert("k".into(), AMQPValue::LongString(LongString::from("v")));
        // + a table: length (4), key (1 + 1), type (1), long string (4 + 1).
        assert_eq!(header_frame_size(&with_headers(h)), 22 + 4 + 2 + 1 + 5);
    }

    #[test]
    fn depth_and_values_are_bounded() {
        assert_eq!(shape(&nested(1)), (0, 1));
        assert_eq!(shape(&nested(3)), (2, 3));
        assert!(judge(&with_headers(nested(MAX_DEPTH)), 131_072, true).is_ok());
        let deep = judge(&with_headers(nested(MAX_DEPTH + 1)), 131_072, true).unwrap_err();
        assert_eq!(deep.result, TOO_DEEP);
        let mut a = FieldTable::default();
        a.insert(
            "list".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void; MAX_VALUES])),
        );
        assert_eq!(
            judge(&with_headers(a), 131_072, true).unwrap_err().result,
            TOO_MANY
        );
    }

    #[test]
    fn the_frame_must_leave_headroom_under_frame_max() {
        let padded = |n: usize| {
            let mut h = FieldTable::default();
            let pad = "x".repeat(n);
            h.insert(
                "k".into(),
                AMQPValue::LongString(LongString::from(pad.as_str())),
            );
            with_headers(h)
        };
        let empty = header_frame_size(&padded(0));
        let props = padded(131_072 - HEADROOM + 1 - empty);
        assert_eq!(header_frame_size(&props), 131_072 - HEADROOM + 1);
        assert_eq!(judge(&props, 131_072, true).unwrap_err().result, TOO_LARGE);
        assert!(judge(&props, 131_073, true).is_ok());
    }

    #[test]
    fn a_message_delivered_too_often_is_refused() {
        let mut h = FieldTable::default();
        h.insert(
            "x-delivery-count".into(),
            AMQPValue::LongLongInt(MAX_DELIVERIES),
        );
        assert!(judge(&with_headers(h.clone()), 131_072, true).is_ok());
        h.insert(
            "x-delivery-count".into(),
            AMQPValue::LongLongInt(MAX_DELIVERIES + 1),
        );
        assert!(
            judge(&with_headers(h.clone()), 131_072, false).is_ok(),
            "a first delivery's count is the publisher's"
        );
        assert_eq!(
            judge(&with_headers(h), 131_072, true).unwrap_err().result,
            REDELIVERED
        );
    }

    #[test]
    fn the_guard_of_lapin_is_a_refusal() {
        let mut h = FieldTable::default();
        h.insert(
            lapin::REFUSED_HEADER.into(),
            AMQPValue::LongString("deeper than 64".into()),
        );
        assert_eq!(
            judge(&with_headers(h), 131_072, true).unwrap_err().result,
            TOO_DEEP
        );
    }
}
