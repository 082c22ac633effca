//! The formats on the wire, without lapin: the announcement, the TimeOut, and the plain
//! AMQP message the bus turns into lapin's types when it publishes.

pub mod announcement;
pub mod timeout;

/// AMQP short strings (names, most properties) hold at most this many bytes.
pub const SHORT_STRING_MAX: usize = 255;

/// One message to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    pub properties: Properties,
    pub body: Vec<u8>,
}

/// The AMQP basic properties a message of ours carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties {
    pub kind: Option<String>,
    pub message_id: Option<String>,
    pub correlation_id: Option<String>,
    pub content_type: Option<String>,
    /// 2 = persistent.
    pub delivery_mode: Option<u8>,
    /// Seconds since the epoch.
    pub timestamp: Option<u64>,
    /// Headers with long-string values.
    pub headers: Vec<(String, String)>,
}

/// Why a row cannot become a message at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// A value that must fit an AMQP short string.
pub fn short(value: &str, what: &str) -> Result<(), Invalid> {
    if value.len() > SHORT_STRING_MAX {
        return Err(Invalid(format!(
            "{what} longer than {SHORT_STRING_MAX} bytes"
        )));
    }
    Ok(())
}
