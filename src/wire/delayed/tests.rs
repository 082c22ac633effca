use super::*;

fn rules() -> Rules {
    Rules {
        target_exchange: "timeoutd.delayed".into(),
        max_body: 10,
    }
}

fn arriving(headers: Vec<(&str, Value)>, body: &[u8]) -> Message {
    Message {
        exchange: "timeoutd.delay.g".into(),
        routing_key: "orders.retry".into(),
        properties: Properties {
            message_id: Some("m-1".into()),
            headers: headers
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            ..Properties::default()
        },
        body: body.to_vec(),
    }
}

/// The stored properties, read back.
fn props(s: &Stored) -> Properties {
    serde_json::from_str(&s.properties).expect("stored properties are JSON")
}

fn stored(m: Message) -> Stored {
    match ingest(m, &rules()) {
        Ingest::Store(s) => *s,
        other => panic!("not stored: {other:?}"),
    }
}

#[test]
fn x_delay_in_any_integer_type_or_digits() {
    for v in [
        Value::I32(1500),
        Value::U16(1500),
        Value::I64(1500),
        Value::Str("1500".into()),
        Value::Short(" 1500".into()),
    ] {
        let s = stored(arriving(vec![("x-delay", v.clone())], b"x"));
        assert_eq!(s.due, Due::After(Duration::from_millis(1500)), "{v:?}");
        assert_eq!(s.held, None);
    }
}

#[test]
fn absent_zero_or_negative_delay_is_due_at_once() {
    for h in [
        vec![],
        vec![("x-delay", Value::I32(0))],
        vec![("x-delay", Value::I64(-5))],
    ] {
        assert_eq!(stored(arriving(h, b"")).due, Due::After(Duration::ZERO));
    }
}

#[test]
fn deliver_at_wins_over_x_delay() {
    let s = stored(arriving(
        vec![
            ("x-delay", Value::I32(1)),
            (
                "x-timeoutd-deliver-at",
                Value::Str("2030-01-02T03:04:05+01:00".into()),
            ),
        ],
        b"",
    ));
    let at: DateTime<Utc> = "2030-01-02T02:04:05Z".parse().expect("time");
    assert_eq!(s.due, Due::At(at));
}

#[test]
fn bad_input_is_kept_and_held_with_every_reason() {
    let s = stored(arriving(
        vec![
            ("x-delay", Value::Str("soon".into())),
            ("x-timeoutd-exchange", Value::I32(3)),
        ],
        b"more than ten bytes",
    ));
    let why = s.held.expect("held");
    assert!(why.contains("x-delay"), "{why}");
    assert!(why.contains("x-timeoutd-exchange"), "{why}");
    assert!(why.contains("delay.max_body"), "{why}");
    assert_eq!(s.body, b"more than ten bytes");
    for bad in [Value::F64(1.5f64.to_bits()), Value::I64(i64::MAX)] {
        assert!(stored(arriving(vec![("x-delay", bad)], b"")).held.is_some());
    }
    let at = stored(arriving(
        vec![("x-timeoutd-deliver-at", Value::Str("tomorrow".into()))],
        b"",
    ));
    assert!(at.held.is_some());
}

#[test]
fn our_headers_are_removed_and_the_rest_kept_in_order() {
    let s = stored(arriving(
        vec![
            ("b", Value::I8(1)),
            ("x-delay", Value::I32(5)),
            ("x-timeoutd-exchange", Value::Str("orders".into())),
            ("a", Value::Void),
        ],
        b"",
    ));
    assert_eq!(s.exchange, "orders");
    let p = props(&s);
    let names: Vec<&str> = p.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["b", "a"]);
}

#[test]
fn a_message_without_id_gets_one_it_keeps() {
    let mut m = arriving(vec![], b"");
    m.properties.message_id = None;
    let s = stored(m);
    assert!(Uuid::parse_str(&s.message_id).is_ok());
    assert_eq!(props(&s).message_id.as_deref(), Some(s.message_id.as_str()));
}

#[test]
fn a_cancel_names_the_message_id() {
    let m = arriving(vec![("x-timeoutd-cancel", Value::Str("m-9".into()))], b"");
    assert_eq!(ingest(m, &rules()), Ingest::Cancel("m-9".into()));
    let bad = arriving(vec![("x-timeoutd-cancel", Value::I32(9))], b"");
    assert!(stored(bad).held.is_some());
}

#[test]
fn delivery_restores_the_message_and_says_how_long_it_was_held() {
    let properties = Properties {
        message_id: Some("m-1".into()),
        user_id: Some("alice".into()),
        headers: vec![("k".into(), Value::U32(7))],
        ..Properties::default()
    };
    let created_at: DateTime<Utc> = "2030-01-01T00:00:00Z".parse().expect("time");
    let row = DelayedRow {
        id: Uuid::new_v4(),
        message_id: "m-1".into(),
        deliver_at: created_at,
        exchange: "orders".into(),
        routing_key: "rk".into(),
        properties: serde_json::to_string(&properties).expect("json"),
        body: Some(vec![0, 159, 146, 150]),
        body_bytes: 4,
        attempts: 0,
        created_at,
        due_at: created_at,
        fired_at: created_at + chrono::Duration::milliseconds(1500),
        window_end: created_at,
    };
    let node = Uuid::new_v4();
    let m = delivery(&row, node).expect("valid");
    assert_eq!(
        (m.exchange.as_str(), m.routing_key.as_str()),
        ("orders", "rk")
    );
    assert_eq!(m.body, vec![0, 159, 146, 150]);
    assert_eq!(m.properties.user_id, None);
    assert_eq!(m.properties.header("k"), Some(&Value::U32(7)));
    assert_eq!(
        m.properties.header(DELAYED_MS_HEADER),
        Some(&Value::I64(1500))
    );
    assert_eq!(
        m.properties.header(USER_ID_HEADER),
        Some(&Value::Str("alice".into()))
    );
    assert_eq!(
        m.properties.header("x-timeoutd-node"),
        Some(&Value::Str(node.to_string()))
    );
}
