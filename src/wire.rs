//! The formats on the wire, without lapin: the announcement, the TimeOut, the delayed
//! message, and the plain AMQP message the bus turns into lapin's types and back.

pub mod announcement;
pub mod delayed;
pub mod sign;
pub mod timeout;
mod value;

pub use value::Value;

use serde::{Deserialize, Serialize};

/// AMQP short strings (names, most properties) hold at most this many bytes.
pub const SHORT_STRING_MAX: usize = 255;

/// One message to publish, or one that arrived.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    pub properties: Properties,
    pub body: Vec<u8>,
}

/// The AMQP basic properties. Serialized as they are stored with a delayed message
/// (`delayed_messages.properties`): absent ones are left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Properties {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_encoding: Option<String>,
    /// 2 = persistent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery_mode: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expiration: Option<String>,
    /// Seconds since the epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    /// Arrives, is stored, but is never published: the broker accepts only the
    /// publishing connection's own user.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, Value)>,
}

impl Properties {
    pub fn header(&self, name: &str) -> Option<&Value> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
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
