//! Signatures of what timeoutd publishes (`amqp.signing_key`): with a signing key
//! configured, every TimeOut and delayed message carries the header
//! [`SIGNATURE_HEADER`] = `v1:<key id>:<hex HMAC-SHA256>`, computed over
//! [`canonical`]: each of these fields as a 4-byte big-endian length and its bytes, in
//! this order (an absent one is empty):
//!
//! 1. `timeoutd-signature-v1`
//! 2. the key id
//! 3. the exchange it was published to
//! 4. its routing key
//! 5. `message_id`
//! 6. `correlation_id`
//! 7. `type`
//! 8. `timestamp` (seconds since the epoch, in decimal)
//! 9. header `x-timeoutd-node`
//! 10. header `x-timeoutd-user-id` (delayed messages)
//! 11. header `x-timeoutd-delayed-ms` (delayed messages; in decimal)
//! 12. the body
//!
//! A message sent again to another exchange or routing key, or with another body, id or
//! sender, does not verify. Other properties and headers are not covered. Messages
//! dead-lettered or shovelled arrive with another exchange or routing key: verify them
//! with the ones they were published with (`x-death`).
//!
//! ```
//! use timeoutd_client::signature::{self, Signed};
//!
//! let m = Signed {
//!     exchange: "orders",
//!     routing_key: "orders.timeouts",
//!     message_id: Some("7d0e…"),
//!     body: b"{}",
//!     ..Signed::default()
//! };
//! let header = signature::sign("k1", b"a key of at least 16 bytes", &m);
//! let keys: &[(&str, &[u8])] = &[("k1", b"a key of at least 16 bytes")];
//! assert!(signature::verify(&header, &m, keys).is_ok());
//! let moved = Signed { routing_key: "payments.timeouts", ..m };
//! assert!(signature::verify(&header, &moved, keys).is_err());
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header that carries the signature.
pub const SIGNATURE_HEADER: &str = "x-timeoutd-signature";

/// The first field of the canonical form, and the version in the header.
const DOMAIN: &str = "timeoutd-signature-v1";
const VERSION: &str = "v1";

/// What a signature covers, as the consumer received it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signed<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub message_id: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
    /// The AMQP `type` property (`TimeOut` for TimeOuts).
    pub kind: Option<&'a str>,
    /// The AMQP `timestamp` property.
    pub timestamp: Option<u64>,
    /// Header `x-timeoutd-node`.
    pub node: Option<&'a str>,
    /// Header `x-timeoutd-user-id`.
    pub user_id: Option<&'a str>,
    /// Header `x-timeoutd-delayed-ms`.
    pub delayed_ms: Option<i64>,
    pub body: &'a [u8],
}

/// Why a message does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("no signature, or not one of version v1")]
    Malformed,
    #[error("signed with key {0:?}, which is not one of the keys given")]
    UnknownKey(String),
    #[error("the signature does not match the message")]
    Mismatch,
}

/// A key id: 1 to 32 of `A-Z a-z 0-9 . _ -`.
pub fn valid_key_id(id: &str) -> bool {
    (1..=32).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// The bytes signed (see the module docs).
pub fn canonical(key_id: &str, m: &Signed<'_>) -> Vec<u8> {
    let timestamp = m.timestamp.map(|t| t.to_string()).unwrap_or_default();
    let delayed_ms = m.delayed_ms.map(|d| d.to_string()).unwrap_or_default();
    let fields: [&[u8]; 12] = [
        DOMAIN.as_bytes(),
        key_id.as_bytes(),
        m.exchange.as_bytes(),
        m.routing_key.as_bytes(),
        m.message_id.unwrap_or_default().as_bytes(),
        m.correlation_id.unwrap_or_default().as_bytes(),
        m.kind.unwrap_or_default().as_bytes(),
        timestamp.as_bytes(),
        m.node.unwrap_or_default().as_bytes(),
        m.user_id.unwrap_or_default().as_bytes(),
        delayed_ms.as_bytes(),
        m.body,
    ];
    let mut out = Vec::with_capacity(fields.iter().map(|f| f.len() + 4).sum());
    for field in fields {
        // A field longer than 4 GiB is no AMQP message's.
        let len = u32::try_from(field.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(field);
    }
    out
}

fn mac(key: &[u8], key_id: &str, m: &Signed<'_>) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(&canonical(key_id, m));
    mac
}

/// The header value for `m` under `key`, named `key_id`.
pub fn sign(key_id: &str, key: &[u8], m: &Signed<'_>) -> String {
    let tag = mac(key, key_id, m).finalize().into_bytes();
    let mut out = String::with_capacity(VERSION.len() + key_id.len() + 2 + 64);
    out.push_str(VERSION);
    out.push(':');
    out.push_str(key_id);
    out.push(':');
    for b in tag {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether `header` (the value of [`SIGNATURE_HEADER`]) signs `m` under one of `keys`
/// (`(key id, key)`: hold the old and the new key while one replaces the other). The
/// comparison takes the same time however much of a forged signature is right.
pub fn verify(header: &str, m: &Signed<'_>, keys: &[(&str, &[u8])]) -> Result<(), SignatureError> {
    let mut parts = header.trim().splitn(3, ':');
    let (Some(VERSION), Some(key_id), Some(hex)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(SignatureError::Malformed);
    };
    let tag = decode_hex(hex).ok_or(SignatureError::Malformed)?;
    let (_, key) = keys
        .iter()
        .find(|(id, _)| *id == key_id)
        .ok_or_else(|| SignatureError::UnknownKey(key_id.to_owned()))?;
    mac(key, key_id, m)
        .verify_slice(&tag)
        .map_err(|_| SignatureError::Mismatch)
}

fn decode_hex(hex: &str) -> Option<[u8; 32]> {
    let digit = |c: u8| {
        char::from(c)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"signing-key-of-the-test-01234567";

    fn timeout() -> Signed<'static> {
        Signed {
            exchange: "orders",
            routing_key: "orders.timeouts",
            message_id: Some("0c6e9f52-2b4c-4e55-9a0f-8d1f7b1c2d3e"),
            correlation_id: Some("order-42"),
            kind: Some("TimeOut"),
            timestamp: Some(1_795_341_600),
            node: Some("6a1c5d0e-0000-4000-8000-000000000001"),
            user_id: None,
            delayed_ms: None,
            body: br#"{"expectation_id":"0c6e9f52-2b4c-4e55-9a0f-8d1f7b1c2d3e"}"#,
        }
    }

    /// The canonical form is fixed: the Python and Node snippets of
    /// docs/integrating/timeouts.md compute the same bytes (the recipes check them
    /// against a real daemon).
    #[test]
    fn a_known_message_has_a_known_signature() {
        let m = Signed {
            exchange: "x",
            routing_key: "k",
            body: b"b",
            ..Signed::default()
        };
        let c = canonical("k1", &m);
        assert_eq!(&c[..4], &[0, 0, 0, 21]);
        assert_eq!(&c[4..25], b"timeoutd-signature-v1");
        assert_eq!(c.len(), 12 * 4 + 21 + 2 + 1 + 1 + 1);
        let header = sign("k1", KEY, &m);
        assert!(
            header.starts_with("v1:k1:") && header.len() == 6 + 64,
            "{header}"
        );
    }

    #[test]
    fn every_covered_field_matters() {
        let m = timeout();
        let header = sign("k1", KEY, &m);
        let keys: &[(&str, &[u8])] = &[("k0", b"an older key of sixteen+"), ("k1", KEY)];
        assert_eq!(verify(&header, &m, keys), Ok(()));
        let changed = [
            Signed {
                exchange: "payments",
                ..m
            },
            Signed {
                routing_key: "orders.other",
                ..m
            },
            Signed {
                message_id: Some("another"),
                ..m
            },
            Signed {
                correlation_id: Some("order-43"),
                ..m
            },
            Signed { kind: None, ..m },
            Signed {
                timestamp: Some(1),
                ..m
            },
            Signed { node: None, ..m },
            Signed {
                user_id: Some("app"),
                ..m
            },
            Signed {
                delayed_ms: Some(0),
                ..m
            },
            Signed { body: b"{}", ..m },
        ];
        for c in changed {
            assert_eq!(
                verify(&header, &c, keys),
                Err(SignatureError::Mismatch),
                "{c:?}"
            );
        }
        // A field's bytes cannot move to its neighbour.
        let a = Signed {
            exchange: "ab",
            routing_key: "c",
            ..m
        };
        let b = Signed {
            exchange: "a",
            routing_key: "bc",
            ..m
        };
        assert_ne!(sign("k1", KEY, &a), sign("k1", KEY, &b));
    }

    /// The cost of signing (or verifying) a 1 KiB message, printed: `cargo test -p
    /// timeoutd-client --release --lib signing_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn signing_cost() {
        let body = vec![b'x'; 1024];
        let m = Signed {
            body: &body,
            ..timeout()
        };
        let n: u32 = 200_000;
        let started = std::time::Instant::now();
        let mut last = String::new();
        for _ in 0..n {
            last = sign("k1", KEY, std::hint::black_box(&m));
        }
        let each = started.elapsed() / n;
        println!("signing a 1 KiB message: {each:?} each ({n} signed, {last})");
    }

    #[test]
    fn keys_are_named_and_forgeries_refused() {
        let m = timeout();
        let header = sign("k2", KEY, &m);
        let old: &[(&str, &[u8])] = &[("k1", KEY)];
        assert_eq!(
            verify(&header, &m, old),
            Err(SignatureError::UnknownKey("k2".into()))
        );
        let other: &[(&str, &[u8])] = &[("k2", b"not the key it was signed with")];
        assert_eq!(verify(&header, &m, other), Err(SignatureError::Mismatch));
        let keys: &[(&str, &[u8])] = &[("k2", KEY)];
        for bad in [
            "",
            "v1",
            "v1:k2",
            "v2:k2:00",
            "v1:k2:zz",
            &header[..header.len() - 1],
        ] {
            assert_eq!(
                verify(bad, &m, keys),
                Err(SignatureError::Malformed),
                "{bad}"
            );
        }
        assert!(valid_key_id("k1") && valid_key_id("2026-12.a_b"));
        assert!(!valid_key_id("") && !valid_key_id("a:b") && !valid_key_id(&"a".repeat(33)));
    }
}
