//! The announcement wire format: encode, decode, validate. Nothing else.
//!
//! Body: `{"node_id", "group", "sent_at", "active", "leaving", "probe", "withdrawn"}`.
//! The booleans default to `false` when absent, so announcements of earlier versions
//! (without `withdrawn`) still decode, and unknown fields are ignored, so earlier
//! versions decode ours. A withdrawn node also sets `leaving`: an earlier version drops
//! it at once instead of waiting for it, a current one keeps it as a member that is
//! not a candidate.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::election::Heard;

/// AMQP `type` property of every announcement.
pub const MESSAGE_TYPE: &str = "TimeoutManagerAnnouncement";
/// Bodies larger than this are refused before parsing (a real one is ~150 bytes).
pub const MAX_BODY: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    pub node_id: Uuid,
    pub group: String,
    pub sent_at: DateTime<Utc>,
    #[serde(default)]
    pub active: bool,
    #[serde(default)]
    pub leaving: bool,
    #[serde(default)]
    pub probe: bool,
    /// The sender is unfit to act (unhealthy or lagging) and is not a candidate; it
    /// comes with `leaving` for the sake of earlier versions.
    #[serde(default)]
    pub withdrawn: bool,
}

/// Why an incoming announcement was dropped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Rejected {
    #[error("body of {0} bytes exceeds {MAX_BODY}")]
    TooLarge(usize),
    #[error("message type {0:?} is not {MESSAGE_TYPE:?}")]
    ForeignType(String),
    #[error("malformed body: {0}")]
    Malformed(String),
    #[error("announcement for group {0:?}, not ours")]
    OtherGroup(String),
}

impl Rejected {
    /// Stable label for metrics and rate-limited logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejected::TooLarge(_) => "too_large",
            Rejected::ForeignType(_) => "foreign_type",
            Rejected::Malformed(_) => "malformed",
            Rejected::OtherGroup(_) => "other_group",
        }
    }
}

impl Announcement {
    pub fn encode(&self) -> Vec<u8> {
        // Serializing a struct of plain fields into a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Validate and parse one delivery. `kind` is the AMQP `type` property; a missing
    /// type is accepted (the body is still checked), a different one is refused.
    pub fn decode(kind: Option<&str>, body: &[u8], group: &str) -> Result<Self, Rejected> {
        if body.len() > MAX_BODY {
            return Err(Rejected::TooLarge(body.len()));
        }
        if let Some(kind) = kind.filter(|k| *k != MESSAGE_TYPE) {
            return Err(Rejected::ForeignType(truncate(kind)));
        }
        let a: Announcement =
            serde_json::from_slice(body).map_err(|e| Rejected::Malformed(e.to_string()))?;
        if a.group != group {
            return Err(Rejected::OtherGroup(truncate(&a.group)));
        }
        Ok(a)
    }

    pub fn heard(&self) -> Heard {
        Heard {
            from: self.node_id,
            active: self.active,
            leaving: self.leaving,
            probe: self.probe,
            withdrawn: self.withdrawn,
        }
    }
}

/// Keep echoed foreign strings short in logs.
fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GROUP: &str = "g";

    fn sample() -> Announcement {
        Announcement {
            node_id: Uuid::new_v4(),
            group: GROUP.into(),
            sent_at: Utc::now(),
            active: true,
            leaving: false,
            probe: false,
            withdrawn: false,
        }
    }

    #[test]
    fn roundtrips() {
        let a = sample();
        let back = Announcement::decode(Some(MESSAGE_TYPE), &a.encode(), GROUP);
        assert_eq!(back, Ok(a));
    }

    #[test]
    fn a_withdrawn_announcement_roundtrips_and_reaches_the_election() {
        let a = Announcement {
            active: false,
            leaving: true,
            withdrawn: true,
            ..sample()
        };
        let back = Announcement::decode(Some(MESSAGE_TYPE), &a.encode(), GROUP);
        assert_eq!(back.as_ref(), Ok(&a));
        let heard = back.map(|b| b.heard()).expect("decoded");
        assert!(heard.withdrawn && heard.leaving && !heard.active);
    }

    /// Earlier versions send no `withdrawn`: such a node is not withdrawn.
    #[test]
    fn an_announcement_without_withdrawn_decodes_as_not_withdrawn() {
        let body = br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g",
            "sent_at": "2026-11-21T10:00:00.123Z", "active": true, "leaving": false,
            "probe": false}"#;
        let a = Announcement::decode(Some(MESSAGE_TYPE), body, GROUP).expect("valid");
        assert!(a.active && !a.withdrawn && !a.heard().withdrawn);
    }

    #[test]
    fn contract_example_decodes_and_unknown_fields_are_ignored() {
        let body = br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g",
            "sent_at": "2026-11-21T10:00:00.123Z", "active": false, "leaving": false,
            "probe": true, "extra": [1, 2]}"#;
        let a = Announcement::decode(None, body, GROUP).expect("valid");
        assert!(a.probe && !a.active && !a.leaving);
    }

    /// Table: (type property, body, expected rejection kind).
    #[test]
    fn bad_input_is_rejected_with_a_reason() {
        let big = vec![b' '; MAX_BODY + 1];
        let cases: [(Option<&str>, &[u8], &str); 9] = [
            (None, b"not json", "malformed"),
            (None, b"[]", "malformed"),
            (None, br#"{"node_id": 5, "group": "g", "sent_at": "2026-01-01T00:00:00Z"}"#, "malformed"),
            (None, br#"{"node_id": "nope", "group": "g", "sent_at": "2026-01-01T00:00:00Z"}"#, "malformed"),
            (None, br#"{"group": "g", "sent_at": "2026-01-01T00:00:00Z"}"#, "malformed"),
            (None, br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g", "sent_at": "yesterday"}"#, "malformed"),
            (None, br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "other", "sent_at": "2026-01-01T00:00:00Z"}"#, "other_group"),
            (Some("Order"), b"{}", "foreign_type"),
            (None, &big, "too_large"),
        ];
        for (kind, body, expected) in cases {
            let err = Announcement::decode(kind, body, GROUP).expect_err("rejected");
            assert_eq!(err.kind(), expected, "{err}");
        }
    }
}
