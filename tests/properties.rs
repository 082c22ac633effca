//! Property tests of the decoders of everything that comes from outside: announcement
//! bodies from the bus, and rows from the database turned into TimeOuts. Bounded by
//! proptest's case count; no panic, no unbounded allocation (bodies are size-checked
//! before parsing).

use chrono::{DateTime, TimeZone, Utc};
use proptest::prelude::*;
use timeoutd::store::DueRow;
use timeoutd::wire::announcement::{Announcement, MAX_BODY, MESSAGE_TYPE};
use timeoutd::wire::timeout::timeout as timeout_message;
use uuid::Uuid;

fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,40}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
            prop::collection::hash_map(".{0,12}", inner, 0..8)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

fn time() -> impl Strategy<Value = DateTime<Utc>> {
    // Postgres' timestamptz range, clamped the way the store's query clamps it.
    (-62_135_596_800i64..253_402_300_799i64, 0u32..1_000_000_000)
        .prop_map(|(s, n)| Utc.timestamp_opt(s, n).single().unwrap_or_default())
}

fn uuid() -> impl Strategy<Value = Uuid> {
    any::<[u8; 16]>().prop_map(Uuid::from_bytes)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoding_arbitrary_bytes_never_panics(
        kind in proptest::option::of(".{0,30}"),
        body in prop::collection::vec(any::<u8>(), 0..(MAX_BODY + 64)),
    ) {
        let _ = Announcement::decode(kind.as_deref(), &body, "g");
    }

    #[test]
    fn decoding_arbitrary_json_never_panics(v in json()) {
        let body = serde_json::to_vec(&v).unwrap_or_default();
        let _ = Announcement::decode(Some(MESSAGE_TYPE), &body, "g");
    }

    #[test]
    fn announcements_roundtrip(
        id in uuid(), group in ".{1,40}", at in time(),
        seq: u64, active: bool, leaving: bool, probe: bool, withdrawn: bool,
    ) {
        let a = Announcement { node_id: id, group: group.clone(), sent_at: at, seq, active, leaving, probe, withdrawn, after: None };
        let body = a.encode();
        if body.len() <= MAX_BODY {
            prop_assert_eq!(Announcement::decode(Some(MESSAGE_TYPE), &body, &group), Ok(a));
        }
    }

    #[test]
    fn any_row_becomes_a_timeout_or_a_clear_refusal(
        id in uuid(), process_id in ".{0,300}", message_type in ".{0,300}",
        timeout_at in time(), fired_at in time(), exchange in ".{0,300}",
        routing_key in ".{0,300}", payload in proptest::option::of(json()),
        attempts in any::<i32>(),
    ) {
        let row = DueRow {
            id, process_id: process_id.clone(), message_type: message_type.clone(),
            timeout_at, exchange: exchange.clone(), routing_key: routing_key.clone(), attempts, fired_at,
            due_at: timeout_at, window_end: fired_at,
            payload: payload.as_ref().map(|p| p.to_string()), payload_bytes: None,
            traceparent: None, tid: None,
        };
        let too_long = [&process_id, &exchange, &routing_key].iter().any(|s| s.len() > 255);
        match timeout_message(&row, Uuid::nil()) {
            Ok(m) => {
                prop_assert!(!too_long);
                let body: serde_json::Value = serde_json::from_slice(&m.body).expect("json body");
                let id = id.to_string();
                prop_assert_eq!(body["expectation_id"].as_str(), Some(id.as_str()));
                prop_assert_eq!(body["process_id"].as_str(), Some(process_id.as_str()));
                prop_assert_eq!(body["message_type"].as_str(), Some(message_type.as_str()));
                // Compared after the same JSON round trip (float text is serde_json's).
                let expected: serde_json::Value =
                    serde_json::from_slice(&serde_json::to_vec(&payload).expect("json"))
                        .expect("json");
                prop_assert_eq!(&body["payload"], &expected);
            }
            Err(e) => prop_assert!(too_long, "{e}"),
        }
    }
}
