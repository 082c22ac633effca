use super::*;

fn acked(returned: Option<(&str, &str)>) -> End {
    End::Answered(Answer {
        ack: true,
        returned: returned.map(|(id, why)| (id.to_owned(), why.to_owned())),
    })
}

fn judged(ids: &[&str], ends: Vec<(usize, End)>) -> (Vec<(usize, Fate)>, bool) {
    let mut fates = Vec::new();
    let clean = judge_shared(ids, ends, &mut fates);
    (fates, clean)
}

#[test]
fn a_shared_channel_judges_each_message_by_its_own_confirm() {
    let nacked = End::Answered(Answer {
        ack: false,
        returned: None,
    });
    let (fates, clean) = judged(&["a", "b"], vec![(4, acked(None)), (7, nacked)]);
    assert_eq!(
        fates,
        vec![
            (4, Fate::Confirmed),
            (7, Fate::Failed(PublishError::Nacked))
        ]
    );
    assert!(clean, "every confirm came in: the channel may serve again");
}

#[test]
fn a_return_is_matched_by_message_id_whichever_confirm_brought_it() {
    // lapin hands "b"'s return to the confirm of "a".
    let ends = vec![(0, acked(Some(("b", "312 NO_ROUTE")))), (1, acked(None))];
    let (fates, clean) = judged(&["a", "b"], ends);
    assert_eq!(
        fates,
        vec![
            (0, Fate::Confirmed),
            (
                1,
                Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
            )
        ]
    );
    assert!(clean);
}

#[test]
fn no_confirm_times_out_and_a_closed_channel_leaves_the_fate_unknown() {
    let after = Duration::from_secs(5);
    let ends = vec![
        (0, End::TimedOut(after)),
        (1, End::Closed("channel closed".into(), Refusal::Message)),
        (2, End::NotSent),
        // A return that came in before its channel closed still says what happened.
        (3, End::Closed("channel closed".into(), Refusal::Message)),
        (4, acked(Some(("d", "312 NO_ROUTE")))),
    ];
    let (fates, clean) = judged(&["a", "b", "c", "d", "e"], ends);
    assert_eq!(
        fates,
        vec![
            (0, Fate::Failed(PublishError::ConfirmTimeout(after))),
            (1, Fate::Unknown("channel closed".into())),
            (2, Fate::Unsent),
            (
                3,
                Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
            ),
            (4, Fate::Confirmed),
        ]
    );
    assert!(!clean, "confirms may still arrive on that channel");
}

#[test]
fn unsent_messages_leave_the_channel_clean() {
    let (fates, clean) = judged(&["a"], vec![(0, End::NotSent)]);
    assert_eq!(fates, vec![(0, Fate::Unsent)]);
    assert!(clean);
}

fn shape(exchange: &'static str, routing_key: &'static str) -> Shape<'static> {
    Shape {
        exchange,
        routing_key,
        size: 1,
        alone: false,
    }
}

fn sorted(mut d: Decided) -> (Vec<(usize, Fate)>, Vec<usize>, bool) {
    d.fates.sort_by_key(|(i, _)| *i);
    (d.fates, d.replan, d.trouble.is_some())
}

#[test]
fn a_pilot_refused_for_its_exchange_fails_that_exchange_alone() {
    let shapes = [shape("x", "a"), shape("x", "b"), shape("y", "a")];
    let e = PublishError::NoExchange("x".into());
    let alone = Alone::Refused(Refusal::Exchange, e.clone());
    let (fates, replan, trouble) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
    assert_eq!(
        fates,
        vec![(0, Fate::Failed(e.clone())), (1, Fate::Failed(e))]
    );
    assert_eq!((replan, trouble), (vec![2], false));
}

#[test]
fn a_topic_refusal_fails_that_routing_key_alone() {
    let shapes = [shape("x", "a"), shape("x", "b"), shape("x", "a")];
    let e = PublishError::Refused("ACCESS_REFUSED".into());
    let alone = Alone::Refused(Refusal::RoutingKey, e.clone());
    let (fates, replan, _) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
    assert_eq!(
        fates,
        vec![(0, Fate::Failed(e.clone())), (2, Fate::Failed(e))]
    );
    assert_eq!(replan, vec![1]);
}

#[test]
fn a_refusal_of_the_message_itself_fails_it_alone() {
    let shapes = [shape("x", "a"), shape("x", "a")];
    for refusal in [Refusal::Message, Refusal::Size { limit: Some(1) }] {
        let e = PublishError::Channel("PRECONDITION_FAILED".into());
        let alone = Alone::Refused(refusal, e.clone());
        let (fates, replan, _) = sorted(decide_alone(&shapes, 0, vec![1], alone));
        assert_eq!(fates, vec![(0, Fate::Failed(e))]);
        assert_eq!(replan, vec![1]);
    }
}

#[test]
fn what_waits_for_a_pilot_goes_on_only_once_it_was_delivered() {
    let shapes = [shape("x", "a"), shape("x", "a"), shape("x", "a")];
    let (fates, replan, _) = sorted(decide_alone(
        &shapes,
        0,
        vec![1, 2],
        Alone::Delivered(Fate::Confirmed),
    ));
    assert_eq!((fates, replan), (vec![(0, Fate::Confirmed)], vec![1, 2]));
    let after = Duration::from_secs(5);
    let unanswered = [
        (
            Alone::TimedOut(PublishError::ConfirmTimeout(after)),
            Fate::Failed(PublishError::ConfirmTimeout(after)),
            false,
        ),
        (
            Alone::Lost("gone".into(), BusError::ConnectionLost),
            Fate::Unknown("gone".into()),
            true,
        ),
        (
            Alone::NoChannel(BusError::ConnectionLost),
            Fate::Unsent,
            true,
        ),
        (Alone::NotSent, Fate::Unsent, false),
    ];
    for (alone, first, trouble) in unanswered {
        let (fates, replan, troubled) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
        assert_eq!(
            fates,
            vec![(0, first), (1, Fate::Unsent), (2, Fate::Unsent)]
        );
        assert!(replan.is_empty());
        assert_eq!(troubled, trouble);
    }
}

#[test]
fn a_spent_budget_is_no_trouble_of_the_bus() {
    let shapes = [shape("x", "a")];
    let spent = BusError::Timeout {
        what: BUDGET_SPENT,
        after: Duration::ZERO,
    };
    let d = decide_alone(&shapes, 0, Vec::new(), Alone::NoChannel(spent));
    assert!(d.trouble.is_none());
}

#[test]
fn a_pilot_is_judged_by_its_own_return() {
    let answer = |ack, returned: Option<&str>| Answer {
        ack,
        returned: returned.map(|id| (id.to_owned(), "312 NO_ROUTE".to_owned())),
    };
    assert_eq!(fate_alone("m", &answer(true, None)), Fate::Confirmed);
    assert_eq!(
        fate_alone("m", &answer(false, None)),
        Fate::Failed(PublishError::Nacked)
    );
    assert_eq!(
        fate_alone("m", &answer(true, Some("m"))),
        Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
    );
    // Another message's return says nothing about this one.
    assert_eq!(fate_alone("m", &answer(true, Some("n"))), Fate::Confirmed);
}

#[test]
fn a_pilot_refused_fails_by_what_the_close_concerns() {
    let m = Shape {
        exchange: "x",
        routing_key: "a",
        size: 10,
        alone: true,
    };
    let close = |not_found, access_refused, text: &str| Close {
        not_found,
        access_refused,
        text: text.to_owned(),
    };
    let failure = |c: Close| match refused(&m, &c) {
        Alone::Refused(refusal, e) => (refusal, e),
        _ => panic!("a close is a refusal"),
    };
    assert_eq!(
        failure(close(true, false, "NOT_FOUND - no exchange 'x'")),
        (Refusal::Exchange, PublishError::NoExchange("x".into()))
    );
    let refused_us = "ACCESS_REFUSED - write access to exchange 'x' refused";
    assert_eq!(
        failure(close(false, true, refused_us)),
        (Refusal::Exchange, PublishError::Refused(refused_us.into()))
    );
    let topic = "ACCESS_REFUSED - write access to topic 'a' in exchange 'x' refused";
    assert_eq!(
        failure(close(false, true, topic)),
        (Refusal::RoutingKey, PublishError::Refused(topic.into()))
    );
    let size = "PRECONDITION_FAILED - message size 10 is larger than configured max size 8";
    assert_eq!(
        failure(close(false, false, size)),
        (
            Refusal::Size { limit: Some(8) },
            PublishError::TooLarge { size: 10, max: 8 }
        )
    );
    let other = "PRECONDITION_FAILED - invalid expiration";
    assert_eq!(
        failure(close(false, false, other)),
        (Refusal::Message, PublishError::Channel(other.into()))
    );
}

#[test]
fn expirations_as_rabbitmq_reads_them() {
    for ok in ["0", "60000", "+5", "4294967295"] {
        assert!(valid_expiration(ok), "{ok}");
    }
    for bad in [
        "",
        "-1",
        " 5",
        "5 ",
        "1.5",
        "4294967296",
        "+",
        "abc",
        "99999999999999999999",
    ] {
        assert!(!valid_expiration(bad), "{bad}");
    }
}

#[test]
fn properties_that_would_close_the_channel_fail_the_message_alone() {
    let refused = |p: Properties| refused_properties(&p).map(|e| e.reason());
    assert_eq!(refused(Properties::default()), None);
    let expiration = Properties {
        expiration: Some("soon".into()),
        ..Properties::default()
    };
    assert_eq!(refused(expiration), Some("invalid"));
    let reply_to = Properties {
        reply_to: Some(DIRECT_REPLY_TO.into()),
        ..Properties::default()
    };
    assert_eq!(refused(reply_to), Some("invalid"));
    let cc = |v: Value| Properties {
        headers: vec![("CC".into(), v)],
        ..Properties::default()
    };
    assert_eq!(refused(cc(Value::Str("q".into()))), Some("invalid"));
    assert_eq!(
        refused(cc(Value::Array(vec![Value::Str("q".into())]))),
        None
    );
    // Only the broker's own header names count.
    let other = Properties {
        headers: vec![("cc".into(), Value::Str("q".into()))],
        ..Properties::default()
    };
    assert_eq!(refused(other), None);
}
