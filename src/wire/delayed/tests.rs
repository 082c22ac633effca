use super::*;
use crate::destinations::Names;

fn rules() -> Rules {
    Rules {
        destinations: Destinations::new(Names {
            target: "timeoutd.delayed",
            allowed: &["orders".to_owned(), "team.*".to_owned()],
            announce: "timeoutd.announcements",
            ingress_template: "timeoutd.delay.{group}",
            ingress: "timeoutd.delay.g",
        })
        .expect("valid"),
        max_body: 10,
        max_delay: Duration::from_secs(3600),
    }
}

fn now() -> DateTime<Utc> {
    "2030-01-01T00:00:00Z".parse().expect("time")
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
    match ingest(m, &rules(), now()) {
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

fn f64(x: f64) -> Value {
    Value::F64(x.to_bits())
}

#[test]
fn x_delay_as_a_float_double_or_decimal_counts_its_whole_milliseconds() {
    for v in [
        f64(2500.0),
        Value::F32(2500f32.to_bits()),
        Value::Decimal {
            scale: 1,
            value: 25_000,
        },
        // The fraction is dropped, as the plugin does (Erlang's `trunc`).
        f64(2500.9),
        Value::Decimal {
            scale: 3,
            value: 2_500_999,
        },
    ] {
        let s = stored(arriving(vec![("x-delay", v.clone())], b""));
        assert_eq!(s.due, Due::After(Duration::from_millis(2500)), "{v:?}");
        assert_eq!(s.held, None, "{v:?}");
    }
    for v in [
        f64(0.9),
        f64(-0.0),
        f64(-2500.0),
        f64(f64::NEG_INFINITY),
        Value::Decimal {
            scale: 255,
            value: u32::MAX,
        },
    ] {
        let s = stored(arriving(vec![("x-delay", v.clone())], b""));
        assert_eq!(s.due, Due::After(Duration::ZERO), "{v:?}");
        assert_eq!(s.held, None, "{v:?}");
    }
}

#[test]
fn x_delay_nan_is_bad_input_and_infinity_or_huge_is_too_late() {
    let nan = stored(arriving(vec![("x-delay", f64(f64::NAN))], b""));
    let held = nan.held.expect("held");
    assert_eq!(held.bound, Bound::BadInput);
    assert!(held.why.contains("double NaN"), "{}", held.why);
    assert_eq!(nan.due, Due::After(Duration::ZERO));
    for v in [f64(f64::INFINITY), f64(1e300), f64(3_600_001.0)] {
        let s = stored(arriving(vec![("x-delay", v.clone())], b""));
        let held = s.held.expect("held");
        assert_eq!(held.bound, Bound::TooLate, "{v:?}");
        assert!(held.why.contains("double"), "{}", held.why);
        assert_eq!(s.due, Due::After(Duration::from_secs(3600)), "{v:?}");
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
    let held = s.held.expect("held");
    let why = &held.why;
    assert!(why.contains("x-delay"), "{why}");
    assert!(why.contains("x-timeoutd-exchange"), "{why}");
    assert!(why.contains("delay.max_body"), "{why}");
    assert!(why.contains("19 bytes"), "{why}");
    assert_eq!(
        held.bound,
        Bound::TooLarge,
        "counted under the weightiest bound"
    );
    assert!(s.body.is_empty(), "a body over max_body is not stored");
    for bad in [Value::F64(f64::NAN.to_bits()), Value::I64(i64::MAX)] {
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
    assert_eq!(
        ingest(m, &rules(), now()),
        Ingest::Cancel {
            owner: String::new(),
            message_id: "m-9".into()
        }
    );
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
        owner: "alice".into(),
        message_id: "m-1".into(),
        deliver_at: created_at,
        exchange: "orders".into(),
        routing_key: "rk".into(),
        properties: serde_json::to_string(&properties).expect("json"),
        body: Some(vec![0, 159, 146, 150]),
        body_bytes: 4,
        body_dropped: false,
        attempts: 0,
        created_at,
        due_at: created_at,
        fired_at: created_at + chrono::Duration::milliseconds(1500),
        window_end: created_at,
        tid: None,
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
    // One stored without its body (over delay.max_body) is never delivered, whoever
    // released it.
    let dropped = DelayedRow {
        body: Some(Vec::new()),
        body_bytes: 0,
        body_dropped: true,
        ..row
    };
    let e = delivery(&dropped, node).expect_err("never delivered");
    assert!(e.0.contains("without its body"), "{e:?}");
}

#[test]
fn an_exchange_not_allowed_is_stored_held_as_named() {
    let to = |x: &str| arriving(vec![("x-timeoutd-exchange", Value::Str(x.into()))], b"");
    for ok in ["orders", "team.eu", "timeoutd.delayed"] {
        let s = stored(to(ok));
        assert_eq!((s.exchange.as_str(), s.held), (ok, None));
    }
    for no in [
        "",
        "amq.topic",
        "timeoutd.announcements",
        "timeoutd.delay.g",
        "timeoutd.delay.other",
        "other.team",
    ] {
        let s = stored(to(no));
        assert_eq!(s.exchange, no, "kept as named");
        let held = s.held.expect("held");
        assert_eq!(held.bound, Bound::NotAllowed, "{no}");
        assert!(held.why.contains(&format!("{no:?}")), "{}", held.why);
    }
}

#[test]
fn a_delay_beyond_max_delay_is_held_due_at_the_bound() {
    let s = stored(arriving(vec![("x-delay", Value::I64(3_600_001))], b""));
    let held = s.held.expect("held");
    assert_eq!(held.bound, Bound::TooLate);
    assert!(held.why.contains("delay.max_delay"), "{}", held.why);
    assert_eq!(s.due, Due::After(Duration::from_secs(3600)));
    let ok = stored(arriving(vec![("x-delay", Value::I64(3_600_000))], b""));
    assert_eq!(ok.held, None);
    for (at, held) in [
        ("2030-01-01T01:00:00Z", false),
        ("2030-01-01T01:00:01Z", true),
    ] {
        let s = stored(arriving(
            vec![("x-timeoutd-deliver-at", Value::Str(at.into()))],
            b"",
        ));
        assert_eq!(s.held.is_some(), held, "{at}");
    }
    let huge = stored(arriving(vec![("x-delay", Value::I64(i64::MAX))], b""));
    assert_eq!(huge.held.map(|h| h.bound), Some(Bound::TooLate));
}

#[test]
fn the_owner_is_the_user_id() {
    let mut m = arriving(vec![], b"");
    m.properties.user_id = Some("alice".into());
    assert_eq!(stored(m).owner, "alice");
    assert_eq!(stored(arriving(vec![], b"")).owner, "");
    let mut cancel = arriving(vec![("x-timeoutd-cancel", Value::Str("m-1".into()))], b"");
    cancel.properties.user_id = Some("bob".into());
    assert_eq!(
        ingest(cancel, &rules(), now()),
        Ingest::Cancel {
            owner: "bob".into(),
            message_id: "m-1".into()
        }
    );
}

/// A publisher's identity headers, in any letter case, never reach the consumer; nor do
/// instruction headers in another case, which are not read either.
#[test]
fn our_headers_are_removed_in_any_letter_case() {
    let spoofs = [
        "X-Timeoutd-User-Id",
        "X-TIMEOUTD-NODE",
        "x-timeoutd-delayed-ms",
        "x-TimeoutD-anything",
        "X-Delay",
        "X-TIMEOUTD-EXCHANGE",
        "x-tımeoutd-user-id",
        "x-timeoutd-uſer-id",
        "X-TİMEOUTD-NODE",
    ];
    let mut headers: Vec<(&str, Value)> = spoofs
        .iter()
        .map(|k| (*k, Value::Str("admin".into())))
        .collect();
    headers.push(("x-delayed", Value::I8(1)));
    headers.push(("x-timeoutd", Value::I8(2)));
    let s = stored(arriving(headers, b""));
    assert_eq!(s.held, None);
    assert_eq!(s.due, Due::After(Duration::ZERO), "X-Delay is not read");
    assert_eq!(
        s.exchange, "timeoutd.delayed",
        "X-TIMEOUTD-EXCHANGE is not read"
    );
    let names: Vec<String> = props(&s).headers.into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["x-delayed", "x-timeoutd"]);
    let row = DelayedRow {
        id: Uuid::new_v4(),
        owner: String::new(),
        message_id: "m".into(),
        deliver_at: now(),
        exchange: "orders".into(),
        routing_key: "k".into(),
        // As an earlier version might have stored it.
        properties: serde_json::to_string(&Properties {
            headers: spoofs
                .iter()
                .map(|k| ((*k).to_owned(), Value::Str("admin".into())))
                .collect(),
            ..Properties::default()
        })
        .expect("json"),
        body: Some(Vec::new()),
        body_bytes: 0,
        body_dropped: false,
        attempts: 0,
        created_at: now(),
        due_at: now(),
        fired_at: now(),
        window_end: now(),
        tid: None,
    };
    let m = delivery(&row, Uuid::nil()).expect("valid");
    let names: Vec<&str> = m
        .properties
        .headers
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(
        names,
        [DELAYED_MS_HEADER, "x-timeoutd-node"],
        "anonymous: no user id"
    );
}

#[test]
fn a_broker_user_never_owns_as_a_sql_role() {
    assert_eq!(broker_owner(None), "");
    assert_eq!(broker_owner(Some("orders")), "orders");
    assert_eq!(broker_owner(Some("sql:orders_pm")), "amqp:sql:orders_pm");
    assert_eq!(
        broker_owner(Some("amqp:sql:orders_pm")),
        "amqp:amqp:sql:orders_pm"
    );
    let mut m = arriving(vec![], b"x");
    m.properties.user_id = Some("sql:orders_pm".to_owned());
    assert_eq!(stored(m).owner, "amqp:sql:orders_pm");
}
