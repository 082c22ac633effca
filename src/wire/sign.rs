//! Signing what timeoutd publishes (`amqp.signing_key`): the header
//! `x-timeoutd-signature` over the fields `timeoutd_client::signature` names, added
//! last, to the final properties, so what the bus measures and sends is what was
//! signed.

use timeoutd_client::signature::{self, Signed};

use super::delayed::{DELAYED_MS_HEADER, USER_ID_HEADER};
use super::timeout::NODE_HEADER;
use super::{Message, Value};
use crate::config::Settings;

pub use timeoutd_client::signature::SIGNATURE_HEADER;

/// The key messages are signed with, and its id.
pub struct Signer {
    key_id: String,
    key: Vec<u8>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({}: ***)", self.key_id)
    }
}

impl Signer {
    /// The signer `amqp.signing_key` configures, if it is set.
    pub fn from_settings(settings: &Settings) -> Option<Self> {
        let a = &settings.amqp;
        a.signing_key
            .is_set()
            .then(|| Self::new(&a.signing_key_id, a.signing_key.expose().as_bytes()))
    }

    pub fn new(key_id: &str, key: &[u8]) -> Self {
        Self {
            key_id: key_id.to_owned(),
            key: key.to_vec(),
        }
    }

    /// Add the signature header to `m` (replacing one that is there).
    pub fn sign(&self, m: &mut Message) {
        let p = &m.properties;
        let text = |name| match p.header(name) {
            Some(Value::Str(s) | Value::Short(s)) => Some(s.as_str()),
            _ => None,
        };
        let signed = Signed {
            exchange: &m.exchange,
            routing_key: &m.routing_key,
            message_id: p.message_id.as_deref(),
            correlation_id: p.correlation_id.as_deref(),
            kind: p.kind.as_deref(),
            timestamp: p.timestamp,
            node: text(NODE_HEADER),
            user_id: text(USER_ID_HEADER),
            delayed_ms: match p.header(DELAYED_MS_HEADER) {
                Some(Value::I64(ms)) => Some(*ms),
                _ => None,
            },
            body: &m.body,
        };
        let header = signature::sign(&self.key_id, &self.key, &signed);
        m.properties.headers.retain(|(k, _)| k != SIGNATURE_HEADER);
        m.properties
            .headers
            .push((SIGNATURE_HEADER.to_owned(), Value::Str(header)));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::wire::Properties;

    fn message(body: Vec<u8>) -> Message {
        Message {
            exchange: "orders".into(),
            routing_key: "orders.timeouts".into(),
            properties: Properties {
                kind: Some("TimeOut".into()),
                message_id: Some("0c6e9f52-2b4c-4e55-9a0f-8d1f7b1c2d3e".into()),
                correlation_id: Some("order-42".into()),
                timestamp: Some(1_795_341_600),
                headers: vec![
                    (NODE_HEADER.into(), Value::Str("node".into())),
                    (DELAYED_MS_HEADER.into(), Value::I64(5006)),
                ],
                ..Properties::default()
            },
            body,
        }
    }

    /// What the daemon signs, the client crate verifies, from the message as sent.
    #[test]
    fn the_client_verifies_what_the_daemon_signs() {
        let key = b"signing-key-of-the-test-01234567";
        let mut m = message(b"{\"a\":1}".to_vec());
        Signer::new("k1", key).sign(&mut m);
        Signer::new("k1", key).sign(&mut m);
        let headers: Vec<_> = m
            .properties
            .headers
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            headers.iter().filter(|k| **k == SIGNATURE_HEADER).count(),
            1,
            "{headers:?}"
        );
        let Some(Value::Str(header)) = m.properties.header(SIGNATURE_HEADER) else {
            panic!("signed");
        };
        let received = Signed {
            exchange: "orders",
            routing_key: "orders.timeouts",
            message_id: m.properties.message_id.as_deref(),
            correlation_id: Some("order-42"),
            kind: Some("TimeOut"),
            timestamp: Some(1_795_341_600),
            node: Some("node"),
            user_id: None,
            delayed_ms: Some(5006),
            body: &m.body,
        };
        let keys: &[(&str, &[u8])] = &[("k1", key)];
        assert_eq!(signature::verify(header, &received, keys), Ok(()));
        let replayed = Signed {
            routing_key: "payments.timeouts",
            ..received
        };
        assert!(signature::verify(header, &replayed, keys).is_err());
    }

    /// The cost of signing a 1 KiB message, printed (`cargo test --release --lib
    /// signing_cost -- --nocapture --ignored`).
    #[test]
    #[ignore = "a measurement"]
    fn signing_cost() {
        let signer = Signer::new("k1", b"signing-key-of-the-test-01234567");
        let mut m = message(vec![b'x'; 1024]);
        let n = 200_000;
        let started = Instant::now();
        for _ in 0..n {
            signer.sign(&mut m);
        }
        let each = started.elapsed() / n;
        println!("signing a 1 KiB message: {each:?} each ({n} signed)");
    }
}
