use super::*;

const GROUP: &str = "g";
const USER: &str = "timeoutd";
const TTL: Duration = Duration::from_secs(3);
const INTERVAL: Duration = Duration::from_secs(1);
const SKEW: Duration = Duration::from_secs(30);

fn policy() -> Policy {
    Policy {
        group: GROUP.into(),
        user: USER.into(),
        key: None,
        accept_unauthenticated: false,
        announce_interval: INTERVAL,
        member_ttl: TTL,
        max_clock_skew: SKEW,
    }
}

fn with_key(secret: &[u8]) -> Policy {
    Policy {
        key: Some(GroupKey::new(secret)),
        ..policy()
    }
}

/// An admission listening since long before the test's announcements.
fn listening(p: Policy) -> Admission {
    Admission::new(p, None, Utc::now() - chrono::Duration::hours(1))
}

fn announcement(node: Uuid, seq: u64, sent_at: DateTime<Utc>) -> Announcement {
    Announcement {
        node_id: node,
        group: GROUP.into(),
        sent_at,
        seq,
        active: true,
        leaving: false,
        probe: false,
        withdrawn: false,
    }
}

fn kind(r: Result<Announcement, Rejected>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    }
}

/// Table: (user_id, accept_unauthenticated) → verdict, without a group secret.
#[test]
fn without_a_secret_only_the_daemons_own_user_counts() {
    let cases = [
        (Some(USER), false, "ok"),
        (Some("intruder"), false, "foreign_user"),
        (None, false, "unauthenticated"),
        (Some(USER), true, "ok"),
        (Some("intruder"), true, "foreign_user"),
        (None, true, "ok"),
        (Some("TIMEOUTD"), false, "foreign_user"),
    ];
    let t0 = Instant::now();
    let wall = Utc::now();
    for (user, legacy, expected) in cases {
        let mut adm = listening(Policy {
            accept_unauthenticated: legacy,
            ..policy()
        });
        let mut env = seal(&announcement(Uuid::new_v4(), 1, wall), USER, None);
        env.user_id = user.map(str::to_owned);
        assert_eq!(
            kind(adm.admit(t0, wall, &env)),
            expected,
            "{user:?} legacy={legacy}"
        );
    }
}

/// Table: (signed with, user_id, accept_unauthenticated) → verdict, with a group secret.
#[test]
fn with_a_secret_the_signature_is_the_proof() {
    let ours = GroupKey::new(b"our group secret, long enough");
    let theirs = GroupKey::new(b"somebody else's secret");
    let cases: [(Option<&GroupKey>, Option<&str>, bool, &str); 8] = [
        (Some(&ours), Some(USER), false, "ok"),
        // Members may log in as different users (e.g. per-pod credentials).
        (Some(&ours), Some("pod-7"), false, "ok"),
        (Some(&ours), None, false, "ok"),
        (Some(&theirs), Some(USER), false, "bad_signature"),
        (None, Some(USER), false, "unauthenticated"),
        (None, None, false, "unauthenticated"),
        // While upgrading to a secret: unsigned counts under the user rule.
        (None, Some(USER), true, "ok"),
        (None, Some("intruder"), true, "foreign_user"),
    ];
    let t0 = Instant::now();
    let wall = Utc::now();
    for (i, (signer, user, legacy, expected)) in cases.into_iter().enumerate() {
        let mut adm = listening(Policy {
            accept_unauthenticated: legacy,
            ..with_key(b"our group secret, long enough")
        });
        let mut env = seal(&announcement(Uuid::new_v4(), 1, wall), USER, signer);
        env.user_id = user.map(str::to_owned);
        assert_eq!(kind(adm.admit(t0, wall, &env)), expected, "case {i}");
    }
}

#[test]
fn a_signature_covers_the_body_so_a_changed_body_fails() {
    let key = GroupKey::new(b"our group secret, long enough");
    let mut adm = listening(with_key(b"our group secret, long enough"));
    let wall = Utc::now();
    let real = seal(&announcement(Uuid::new_v4(), 1, wall), USER, Some(&key));
    let forged = Envelope {
        body: announcement(Uuid::nil(), 2, wall).encode(),
        ..real.clone()
    };
    assert_eq!(
        kind(adm.admit(Instant::now(), wall, &forged)),
        "bad_signature"
    );
    assert_eq!(kind(adm.admit(Instant::now(), wall, &real)), "ok");
}

/// A copy of a real announcement never counts: the same one, an earlier one, a `leaving`
/// the receiver counted already. One that arrives late, behind a later one, counts
/// once, as long as it is among the sender's latest `WINDOW`.
#[test]
fn each_announcement_of_a_sender_counts_once() {
    let mut adm = listening(policy());
    let t0 = Instant::now();
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let at = |s: i64| wall + chrono::Duration::milliseconds(s);
    let leaving = Announcement {
        leaving: true,
        ..announcement(node, 9, at(0))
    };
    let steps = [
        (announcement(node, 1, at(-2000)), "ok"),
        (announcement(node, 1, at(-2000)), "replayed"),
        (announcement(node, 3, at(-1000)), "ok"),
        // Late, behind 3, but recent (reordered on the way): counts once.
        (announcement(node, 2, at(-20)), "ok"),
        (announcement(node, 2, at(-20)), "replayed"),
        // Behind, and old: kept and sent again.
        (announcement(node, 2, at(-1500)), "replayed"),
        (announcement(node, 1, at(-2000)), "replayed"),
        (leaving.clone(), "ok"),
        (leaving, "replayed"),
        (announcement(node, 3, at(-1000)), "replayed"),
        // Another sender has its own numbers.
        (announcement(Uuid::new_v4(), 1, at(0)), "ok"),
        // Far behind the newest: never.
        (announcement(node, 9 + WINDOW, at(0)), "ok"),
        (announcement(node, 8, at(0)), "replayed"),
        (announcement(node, 10, at(0)), "ok"),
        // Late and older than the skew allows.
        (
            announcement(node, 9, at(-(SKEW.as_millis() as i64) - 10)),
            "replayed",
        ),
    ];
    for (i, (a, expected)) in steps.into_iter().enumerate() {
        let env = seal(&a, USER, None);
        assert_eq!(kind(adm.admit(t0, wall, &env)), expected, "step {i}");
    }
}

/// Earlier versions send no `seq`: their announcements are ordered by `sent_at`.
#[test]
fn without_seq_the_send_time_orders_a_senders_announcements() {
    let mut adm = listening(Policy {
        accept_unauthenticated: true,
        ..policy()
    });
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let legacy = |ms: i64| {
        let mut env = seal(
            &announcement(node, 0, wall - chrono::Duration::milliseconds(ms)),
            USER,
            None,
        );
        env.user_id = None;
        env
    };
    let t0 = Instant::now();
    assert_eq!(kind(adm.admit(t0, wall, &legacy(2000))), "ok");
    assert_eq!(kind(adm.admit(t0, wall, &legacy(1000))), "ok");
    assert_eq!(kind(adm.admit(t0, wall, &legacy(1000))), "replayed");
    assert_eq!(kind(adm.admit(t0, wall, &legacy(1500))), "replayed");
}

/// Table: sent_at offset from the receiver's clock (ms) → verdict.
#[test]
fn an_announcement_too_far_from_this_clock_is_stale() {
    let limit = (INTERVAL + SKEW).as_millis() as i64;
    let ahead = SKEW.as_millis() as i64;
    let cases = [
        (0, "ok"),
        (-limit + 10, "ok"),
        (-limit - 10, "stale"),
        (ahead - 10, "ok"),
        (ahead + 10, "stale"),
        (-365 * 24 * 3600 * 1000, "stale"),
    ];
    let wall = Utc::now();
    for (offset, expected) in cases {
        let mut adm = listening(policy());
        let a = announcement(
            Uuid::new_v4(),
            1,
            wall + chrono::Duration::milliseconds(offset),
        );
        let got = kind(adm.admit(Instant::now(), wall, &seal(&a, USER, None)));
        assert_eq!(got, expected, "offset {offset} ms");
    }
}

/// A sender forgotten (nothing heard for `remember_for`) can have no copy counted again:
/// every copy is stale by then.
#[test]
fn a_forgotten_senders_copies_are_stale() {
    let p = policy();
    let keep = p.remember_for();
    let mut adm = listening(p);
    let t0 = Instant::now();
    let wall = Utc::now();
    // The sender's clock runs a full SKEW ahead: the worst case for staleness.
    let a = announcement(
        Uuid::new_v4(),
        9,
        wall + chrono::Duration::from_std(SKEW).expect("small"),
    );
    let env = seal(&a, USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &env)), "ok");
    let later = wall + chrono::Duration::from_std(keep).expect("small");
    assert_eq!(kind(adm.admit(t0 + keep, later, &env)), "stale");
}

#[test]
fn junk_is_refused_before_it_is_parsed_and_counted_with_its_reason() {
    let mut adm = listening(policy());
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let mut forged = seal(&announcement(node, 1, wall), USER, None);
    forged.user_id = None;
    let big = Envelope {
        body: vec![b' '; crate::wire::announcement::MAX_BODY + 1],
        ..forged.clone()
    };
    let other_type = Envelope {
        kind: Some("Order".into()),
        ..seal(&announcement(node, 1, wall), USER, None)
    };
    let junk = Envelope {
        body: b"not json".to_vec(),
        ..seal(&announcement(node, 1, wall), USER, None)
    };
    for (env, expected) in [
        (&big, "too_large"),
        (&other_type, "foreign_type"),
        (&junk, "malformed"),
        (&forged, "unauthenticated"),
    ] {
        assert_eq!(kind(adm.admit(Instant::now(), wall, env)), expected);
    }
    let r = adm.rejected();
    assert_eq!(r.total, 4);
    assert_eq!(r.by_reason.get("unauthenticated"), Some(&1));
    let last = r.last.as_ref().expect("last");
    assert_eq!(
        (last.reason, last.node_id, last.user_id.as_deref()),
        ("unauthenticated", Some(node), None)
    );
}

#[test]
fn memory_of_senders_stays_bounded() {
    let mut adm = listening(policy());
    let t0 = Instant::now();
    let wall = Utc::now();
    for i in 0..(MAX_SENDERS + 50) {
        let now = t0 + Duration::from_micros(i as u64);
        let env = seal(&announcement(Uuid::new_v4(), 1, wall), USER, None);
        assert_eq!(kind(adm.admit(now, wall, &env)), "ok");
    }
    assert!(adm.last.len() <= MAX_SENDERS);
}

/// Randomized: a stream of real announcements from a few members, some delivered late
/// (behind later ones), mixed with copies of earlier ones (replays, in any order) and
/// forgeries without proof; every announcement that counts is a real one, counted once,
/// and every real one counts.
#[test]
fn random_replays_and_forgeries_never_count() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    for seed in 0..50 {
        let mut rng = StdRng::seed_from_u64(seed);
        let key = GroupKey::new(b"our group secret, long enough");
        let mut adm = listening(with_key(b"our group secret, long enough"));
        let members: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
        let mut seq = [0u64; 4];
        let mut sent: Vec<Envelope> = Vec::new();
        let mut counted = std::collections::HashSet::new();
        let mut late: Vec<Envelope> = Vec::new();
        let t0 = Instant::now();
        let wall0 = Utc::now();
        for step in 0..400u64 {
            let now = t0 + Duration::from_millis(step * 50);
            let wall = wall0 + chrono::Duration::milliseconds(step as i64 * 50);
            let (env, real) = match rng.random_range(0..11) {
                0..=4 => {
                    let m = rng.random_range(0..4);
                    seq[m] += 1;
                    let a = announcement(members[m], seq[m], wall);
                    let env = seal(&a, "shared", Some(&key));
                    if rng.random_range(0..4) == 0 {
                        // Held back: delivered behind later ones.
                        late.push(env);
                        continue;
                    }
                    (env, true)
                }
                10 if !late.is_empty() => (late.remove(0), true),
                5..=7 if !sent.is_empty() => {
                    let i = rng.random_range(0..sent.len());
                    (sent[i].clone(), false)
                }
                _ => {
                    let a = Announcement {
                        leaving: rng.random(),
                        ..announcement(members[rng.random_range(0..4)], u64::MAX, wall)
                    };
                    let mut env = seal(&a, "shared", None);
                    if rng.random() {
                        env.signature = Some("00".repeat(32));
                    }
                    (env, false)
                }
            };
            if real {
                // Delivered: from now on the attacker may have a copy.
                sent.push(env.clone());
            }
            match adm.admit(now, wall, &env) {
                Ok(a) => {
                    assert!(real, "seed {seed} step {step}: a copy or forgery counted");
                    assert!(counted.insert((a.node_id, a.seq)), "seed {seed}: twice");
                }
                Err(e) => assert!(!real, "seed {seed} step {step}: a real one refused: {e}"),
            }
        }
    }
}

/// A node that has just begun listening counts nothing sent well before: a copy of a
/// dead node's announcement cannot bring it back for a newcomer, which knows no
/// sender's last number yet.
#[test]
fn nothing_sent_well_before_this_node_listened_counts() {
    let p = Policy {
        max_clock_skew: Duration::from_secs(1),
        ..policy()
    };
    let t0 = Instant::now();
    let start = Utc::now();
    let mut adm = Admission::new(p, None, start);
    let at = |ms: i64| start + chrono::Duration::milliseconds(ms);
    let dead = Uuid::new_v4();
    let live = Uuid::new_v4();
    let cases = [
        (dead, 7, at(-1500), "stale"),
        (live, 3, at(-500), "ok"),
        (live, 4, at(200), "ok"),
        (dead, 8, at(-1100), "stale"),
    ];
    for (i, (node, seq, sent, expected)) in cases.into_iter().enumerate() {
        let env = seal(&announcement(node, seq, sent), USER, None);
        assert_eq!(kind(adm.admit(t0, at(300), &env)), expected, "case {i}");
    }
    // Reconnected: listening anew.
    adm.restart(at(5000));
    let env = seal(&announcement(live, 5, at(3000)), USER, None);
    assert_eq!(kind(adm.admit(t0, at(5000), &env)), "stale");
    let env = seal(&announcement(live, 6, at(4900)), USER, None);
    assert_eq!(kind(adm.admit(t0, at(5000), &env)), "ok");
}

/// A node's own announcements count however late they come back (their delay is its
/// lag); another node's that late do not.
#[test]
fn own_announcements_count_however_late() {
    let me = Uuid::new_v4();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall - chrono::Duration::hours(1));
    let late = wall - chrono::Duration::seconds(40);
    let t0 = Instant::now();
    let own = seal(&announcement(me, 1, late), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &own)), "ok");
    assert_eq!(kind(adm.admit(t0, wall, &own)), "replayed");
    let other = seal(&announcement(Uuid::new_v4(), 1, late), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &other)), "stale");
}
