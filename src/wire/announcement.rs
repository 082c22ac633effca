//! The announcement wire format: encode, decode, validate. Nothing else.
//!
//! Body: `{"node_id", "group", "sent_at", "seq", "active", "leaving", "probe",
//! "withdrawn", "after"}`. The booleans default to `false`, `seq` to 0 and `after` to
//! none when absent, so announcements of earlier versions still decode, and unknown
//! fields are ignored, so earlier versions decode ours (they judge it by `sent_at`, as
//! before). A withdrawn node also sets `leaving`: an earlier version
//! drops it at once instead of waiting for it, a current one keeps it as a member that
//! is not a candidate.
//!
//! Who sent it is not in the body: the AMQP `user_id` property (which the broker
//! validates) and, with a group secret, an HMAC of the body in header
//! [`SIGNATURE_HEADER`]. Judging those is `admission`'s job; this module only carries
//! and computes them.

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use uuid::Uuid;

use crate::election::Heard;

/// AMQP `type` property of every announcement.
pub const MESSAGE_TYPE: &str = "TimeoutManagerAnnouncement";
/// Bodies larger than this are refused before parsing (a real one is ~150 bytes).
pub const MAX_BODY: usize = 4096;
/// Header carrying the hex HMAC-SHA256 of the body under the group secret.
pub const SIGNATURE_HEADER: &str = "x-timeoutd-signature";
/// Prefixed to the body before signing, so that a signature over an announcement can
/// never be passed off as one over anything else keyed with the same secret.
const SIGNING_CONTEXT: &[u8] = b"timeoutd announcement v1\0";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    pub node_id: Uuid,
    pub group: String,
    pub sent_at: DateTime<Utc>,
    /// Counts the sender's announcements since it started (its id is new at every
    /// start): a receiver takes each number from a sender once, so a captured
    /// announcement sent again does not count. 0 from earlier versions.
    #[serde(default)]
    pub seq: u64,
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
    /// Announcements of others (`[node_id, seq]`) the sender had counted, or answers
    /// (its own earlier ones excluded), when it sent this one: a receiver that sent or
    /// counted one of them recently knows this one is recent too, whatever the clocks
    /// say (see `admission`). Always present from this version on, possibly empty;
    /// absent from earlier versions, which are judged by `sent_at`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<(Uuid, u64)>>,
}

/// One delivery from the group's announcement queue as the broker handed it over,
/// nothing judged yet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Envelope {
    /// The AMQP `type` property.
    pub kind: Option<String>,
    /// The AMQP `user_id` property: the broker refuses one that is not the publishing
    /// connection's own user (unless that user is tagged `impersonator`).
    pub user_id: Option<String>,
    /// The [`SIGNATURE_HEADER`] value, if it is a string.
    pub signature: Option<String>,
    pub body: Vec<u8>,
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
    #[error("no proof of membership ({0})")]
    Unauthenticated(&'static str),
    #[error("sent by broker user {0:?}, not the daemons' own")]
    ForeignUser(String),
    #[error("signature does not verify with election.secret")]
    BadSignature,
    #[error(
        "announcement {seq} of its sender was counted before, or is far behind {last}: a copy sent again"
    )]
    Replayed { seq: u64, last: u64 },
    #[error(
        "sent_at is {0} ms away from this node's clock (an earlier version's announcement: more than announce_interval + election.max_clock_skew)"
    )]
    Stale(i64),
    #[error(
        "announcement {seq} is from a sender this node cannot vouch for yet (heard for the first time, or again after a gap): answered, not counted"
    )]
    Unvouched {
        seq: u64,
        /// The election should answer it (see `admission`).
        answer: bool,
    },
}

impl Rejected {
    /// Stable label for metrics and rate-limited logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejected::TooLarge(_) => "too_large",
            Rejected::ForeignType(_) => "foreign_type",
            Rejected::Malformed(_) => "malformed",
            Rejected::OtherGroup(_) => "other_group",
            Rejected::Unauthenticated(_) => "unauthenticated",
            Rejected::ForeignUser(_) => "foreign_user",
            Rejected::BadSignature => "bad_signature",
            Rejected::Replayed { .. } => "replayed",
            Rejected::Stale(_) => "stale",
            Rejected::Unvouched { .. } => "unvouched",
        }
    }
}

/// The group secret, ready to sign and verify announcement bodies.
#[derive(Clone)]
pub struct GroupKey(Hmac<Sha256>);

impl std::fmt::Debug for GroupKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupKey(***)")
    }
}

impl GroupKey {
    pub fn new(secret: &[u8]) -> Self {
        Self(Hmac::new_from_slice(secret).expect("HMAC takes keys of any length"))
    }

    fn mac(&self, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.0.clone();
        mac.update(SIGNING_CONTEXT);
        mac.update(body);
        mac
    }

    /// The value of [`SIGNATURE_HEADER`] for `body`.
    pub fn sign(&self, body: &[u8]) -> String {
        hex::encode(self.mac(body).finalize().into_bytes())
    }

    /// Whether `signature` is this key's for `body` (compared in constant time).
    pub fn verifies(&self, body: &[u8], signature: &str) -> bool {
        hex::decode(signature.trim()).is_ok_and(|sig| self.mac(body).verify_slice(&sig).is_ok())
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
            seq: 7,
            active: true,
            leaving: false,
            probe: false,
            withdrawn: false,
            after: Some(vec![(Uuid::new_v4(), 3)]),
        }
    }

    #[test]
    fn a_signature_verifies_only_with_its_key_and_its_body() {
        let body = sample().encode();
        let key = GroupKey::new(b"a group secret of some length");
        let sig = key.sign(&body);
        assert!(key.verifies(&body, &sig));
        assert!(!GroupKey::new(b"another secret").verifies(&body, &sig));
        let mut changed = body.clone();
        changed[10] ^= 1;
        assert!(!key.verifies(&changed, &sig));
        for junk in ["", "zz", &sig[..10], "00"] {
            assert!(!key.verifies(&body, junk), "{junk:?}");
        }
    }

    /// Earlier versions send no `seq`: it decodes as 0.
    #[test]
    fn an_announcement_without_seq_decodes_with_seq_zero() {
        let body = br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g",
            "sent_at": "2026-11-21T10:00:00.123Z"}"#;
        let a = Announcement::decode(Some(MESSAGE_TYPE), body, GROUP).expect("valid");
        assert_eq!(a.seq, 0);
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

    /// Earlier versions send no `after`: it decodes as none (judged by `sent_at`); an
    /// empty one stays empty, and ours encodes it as pairs earlier versions skip.
    #[test]
    fn after_is_none_when_absent_and_pairs_when_present() {
        let body = br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g",
            "sent_at": "2026-11-21T10:00:00.123Z", "seq": 4}"#;
        let a = Announcement::decode(Some(MESSAGE_TYPE), body, GROUP).expect("valid");
        assert_eq!(a.after, None);
        let empty = Announcement {
            after: Some(Vec::new()),
            ..sample()
        };
        let back = Announcement::decode(Some(MESSAGE_TYPE), &empty.encode(), GROUP);
        assert_eq!(back.map(|b| b.after), Ok(Some(Vec::new())));
        let named = sample();
        let json: serde_json::Value = serde_json::from_slice(&named.encode()).expect("json");
        let (id, seq) = named.after.as_ref().expect("after")[0];
        assert_eq!(json["after"], serde_json::json!([[id.to_string(), seq]]));
        let bad = br#"{"node_id": "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0", "group": "g",
            "sent_at": "2026-11-21T10:00:00.123Z", "after": [["nope", 1]]}"#;
        let err = Announcement::decode(None, bad, GROUP).expect_err("malformed");
        assert_eq!(err.kind(), "malformed");
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
