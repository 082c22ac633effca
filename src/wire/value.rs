//! AMQP field values (header values), without lapin, in a form that survives a trip
//! through jsonb unchanged: every value keeps its AMQP type, floats keep their bits (NaN
//! and infinities included), strings that are not UTF-8 keep their bytes. A delayed
//! message is delivered with the headers it came with, with one difference: field tables
//! (the headers, and tables nested in them) come out sorted by key, and of a key sent
//! twice only the last value is left. That happens as the message arrives, not here:
//! lapin's `FieldTable` (amq-protocol) is a `BTreeMap`, and lapin hands over only parsed
//! properties, so the order on the wire cannot be had. A `Table` keeps the order it is
//! built with.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "v", rename_all = "snake_case")]
pub enum Value {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    /// An f32, as its bits.
    F32(u32),
    /// An f64, as its bits.
    F64(u64),
    Decimal {
        scale: u8,
        value: u32,
    },
    /// A short string (deprecated in field tables, still sent by some clients).
    Short(String),
    /// A long string that is valid UTF-8 without NUL (nearly all of them).
    Str(String),
    /// A long string that is not UTF-8, or holds NUL (which jsonb cannot store as text).
    StrBytes(Vec<u8>),
    Array(Vec<Value>),
    /// Seconds since the epoch.
    Timestamp(u64),
    Table(Vec<(String, Value)>),
    Bytes(Vec<u8>),
    Void,
}

impl Value {
    /// A long string from its bytes.
    pub fn long_string(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(s) if !s.contains('\0') => Self::Str(s.to_owned()),
            _ => Self::StrBytes(bytes.to_vec()),
        }
    }

    /// The value as a whole number, for headers such as `x-delay`: any integer type, or
    /// a string of decimal digits. `None` for anything else.
    pub fn as_integer(&self) -> Option<i128> {
        match self {
            Self::I8(v) => Some((*v).into()),
            Self::U8(v) => Some((*v).into()),
            Self::I16(v) => Some((*v).into()),
            Self::U16(v) => Some((*v).into()),
            Self::I32(v) => Some((*v).into()),
            Self::U32(v) => Some((*v).into()),
            Self::I64(v) => Some((*v).into()),
            Self::Timestamp(v) => Some((*v).into()),
            Self::Short(s) | Self::Str(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// The value as text, for headers that name something.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Short(s) | Self::Str(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_value_survives_json_unchanged() {
        let table = Value::Table(vec![
            ("z".into(), Value::F64(f64::NAN.to_bits())),
            ("a".into(), Value::StrBytes(vec![0xff, 0x00])),
            ("m".into(), Value::Array(vec![Value::Void, Value::I8(-1)])),
            (
                "d".into(),
                Value::Decimal {
                    scale: 2,
                    value: 12345,
                },
            ),
            ("i".into(), Value::I64(i64::MIN)),
            ("t".into(), Value::Timestamp(u64::MAX)),
        ]);
        let json = serde_json::to_string(&table).expect("json");
        let back: Value = serde_json::from_str(&json).expect("back");
        assert_eq!(back, table);
    }

    #[test]
    fn integers_come_from_any_integer_type_or_digits() {
        assert_eq!(Value::U8(5).as_integer(), Some(5));
        assert_eq!(Value::I64(-3).as_integer(), Some(-3));
        assert_eq!(Value::Str(" 1500 ".into()).as_integer(), Some(1500));
        assert_eq!(Value::Str("1.5s".into()).as_integer(), None);
        assert_eq!(Value::F64(1f64.to_bits()).as_integer(), None);
        assert_eq!(Value::long_string(b"ok"), Value::Str("ok".into()));
        assert_eq!(Value::long_string(b"a\0"), Value::StrBytes(b"a\0".to_vec()));
    }
}
