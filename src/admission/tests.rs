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

/// An announcement as earlier versions send it (no `after`): judged by `sent_at`.
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
        after: None,
    }
}

/// An announcement of this version, sent at `sent_at` by its sender's clock, naming
/// `after`.
fn current(node: Uuid, seq: u64, sent_at: DateTime<Utc>, after: &[(Uuid, u64)]) -> Announcement {
    Announcement {
        after: Some(after.to_vec()),
        ..announcement(node, seq, sent_at)
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

/// A sender's numbers are kept: a copy of one of its announcements is refused however
/// long after it was counted, whatever the clocks say.
#[test]
fn a_copy_is_refused_however_late() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall);
    let ours = adm.seal(t0, &current(me, 1, wall, &[]));
    assert_eq!(kind(adm.admit(t0, wall, &ours)), "ok");
    let node = Uuid::new_v4();
    let a = seal(&current(node, 9, wall, &[(me, 1)]), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &a)), "ok");
    for later in [
        Duration::from_secs(1),
        TTL * 10,
        Duration::from_secs(86_400),
    ] {
        let wall = wall + chrono::Duration::from_std(later).expect("small");
        assert_eq!(
            kind(adm.admit(t0 + later, wall, &a)),
            "replayed",
            "{later:?}"
        );
    }
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
                        ..current(members[rng.random_range(0..4)], u64::MAX, wall, &[])
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

/// A node's own announcements count however late they come back within `member_ttl`
/// (their delay is its lag), once each; another node's that late by its clock are no
/// matter; a copy of ours older than that, or one we never sent, does not count.
#[test]
fn own_announcements_count_however_late() {
    let me = Uuid::new_v4();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall - chrono::Duration::hours(1));
    let late = wall - chrono::Duration::seconds(40);
    let t0 = Instant::now();
    let own = adm.seal(t0, &announcement(me, 1, late));
    let back = t0 + TTL - Duration::from_millis(100);
    assert_eq!(kind(adm.admit(back, wall, &own)), "ok");
    assert_eq!(kind(adm.admit(back, wall, &own)), "replayed");
    let lost = adm.seal(t0, &announcement(me, 2, late));
    assert_eq!(kind(adm.admit(t0 + TTL * 3, wall, &lost)), "replayed");
    let never = seal(&announcement(me, 3, wall), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &never)), "replayed");
    let other = seal(&announcement(Uuid::new_v4(), 1, late), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &other)), "stale");
}

fn secs(s: i64) -> chrono::Duration {
    chrono::Duration::seconds(s)
}

/// Senders whose clocks are off by seconds, minutes or a year count alike: freshness
/// is judged by this node's own monotonic clock. A sender heard for the first time
/// counts once it names an announcement this node sent or counted within `member_ttl`;
/// then, while live here, each of its new announcements counts; after a silence longer
/// than `member_ttl` it must name something recent again.
#[test]
fn clocks_need_not_agree() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall);
    for offset in [
        secs(-600),
        secs(-30),
        secs(30),
        secs(600),
        secs(365 * 86_400),
    ] {
        let ours = adm.seal(t0, &current(me, 1, wall, &[]));
        assert_eq!(kind(adm.admit(t0, wall, &ours)), "ok");
        let node = Uuid::new_v4();
        let clock = |at: Duration| wall + offset + chrono::Duration::from_std(at).expect("small");
        let at = |d: Duration| (t0 + d, wall + chrono::Duration::from_std(d).expect("small"));
        let steps = [
            (
                Duration::ZERO,
                current(node, 1, clock(Duration::ZERO), &[]),
                "unvouched",
            ),
            (
                Duration::from_millis(300),
                current(node, 2, clock(Duration::from_millis(300)), &[(me, 1)]),
                "ok",
            ),
            (
                Duration::from_secs(1),
                current(node, 3, clock(Duration::from_secs(1)), &[]),
                "ok",
            ),
            (
                Duration::from_secs(2),
                current(node, 4, clock(Duration::from_secs(2)), &[]),
                "ok",
            ),
            // Silent for longer than member_ttl: not live here any more.
            (
                Duration::from_secs(6),
                current(node, 5, clock(Duration::from_secs(6)), &[]),
                "unvouched",
            ),
            // Naming our announcement of 6 s ago is not enough either.
            (
                Duration::from_secs(7),
                current(node, 6, clock(Duration::from_secs(7)), &[(me, 1)]),
                "unvouched",
            ),
        ];
        for (i, (d, a, expected)) in steps.into_iter().enumerate() {
            let (now, wall) = at(d);
            let got = kind(adm.admit(now, wall, &seal(&a, USER, None)));
            assert_eq!(got, expected, "offset {offset}, step {i}");
        }
        // Our answer names it; its announcement naming our answer counts.
        let (now, w) = at(Duration::from_secs(7) + Duration::from_millis(250));
        let answer = adm.seal(now, &current(me, 2, w, &[]));
        assert!(
            answer_names(&answer, node, 6),
            "the answer names the challenge"
        );
        let (now, w) = at(Duration::from_secs(8));
        let a = current(node, 7, clock(Duration::from_secs(8)), &[(me, 2)]);
        assert_eq!(
            kind(adm.admit(now, w, &seal(&a, USER, None))),
            "ok",
            "offset {offset}"
        );
        adm = Admission::new(policy(), Some(me), wall);
    }
}

fn answer_names(env: &Envelope, node: Uuid, seq: u64) -> bool {
    let a: Announcement = serde_json::from_slice(&env.body).expect("json");
    a.after.unwrap_or_default().contains(&(node, seq))
}

/// A newcomer knows no sender's numbers: copies of a dead node's announcements (which
/// name only what was recent when they were sent) never count for it, however many and
/// in whatever order, while a live member that names the newcomer's probe does.
#[test]
fn a_newcomer_counts_no_copy_of_a_dead_node() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall);
    let probe = adm.seal(
        t0,
        &Announcement {
            probe: true,
            ..current(me, 1, wall, &[])
        },
    );
    assert_eq!(kind(adm.admit(t0, wall, &probe)), "ok");
    let (dead, live, other) = (Uuid::nil(), Uuid::new_v4(), Uuid::new_v4());
    // Captured an hour ago, sent by a clock an hour behind: looks current by `sent_at`.
    let copies: Vec<Envelope> = (1..=20)
        .map(|seq| {
            let a = Announcement {
                leaving: seq == 20,
                ..current(dead, seq, wall, &[(other, seq + 100)])
            };
            seal(&a, USER, None)
        })
        .collect();
    for (i, copy) in copies.iter().enumerate().rev() {
        let now = t0 + Duration::from_millis(10 * i as u64);
        let got = kind(adm.admit(now, wall, copy));
        assert!(got == "unvouched" || got == "replayed", "copy {i}: {got}");
    }
    for copy in &copies {
        assert_eq!(kind(adm.admit(t0, wall, copy)), "replayed");
    }
    let answer = seal(&current(live, 40, wall + secs(-90), &[(me, 1)]), USER, None);
    assert_eq!(
        kind(adm.admit(t0 + Duration::from_millis(300), wall, &answer)),
        "ok"
    );
    assert_eq!(
        adm.rejected().unvouched,
        1,
        "one challenge per sender and number"
    );
}

/// An announcement this node missed, copied later: it counts only while news that old
/// is still recent (the sender live here, within `member_ttl`); later it does not.
#[test]
fn a_missed_announcement_copied_later_counts_only_while_recent() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let run = |delay: Duration| {
        let mut adm = Admission::new(policy(), Some(me), wall);
        let ours = adm.seal(t0, &current(me, 1, wall, &[]));
        let _ = adm.admit(t0, wall, &ours);
        let first = seal(&current(node, 5, wall - secs(45), &[(me, 1)]), USER, None);
        assert_eq!(kind(adm.admit(t0, wall, &first)), "ok");
        // Seq 6 was lost on the way here; the node died after it.
        let missed = seal(&current(node, 6, wall - secs(44), &[(me, 1)]), USER, None);
        kind(adm.admit(t0 + delay, wall, &missed))
    };
    assert_eq!(run(Duration::from_secs(2)), "ok");
    assert_eq!(run(TTL + Duration::from_secs(1)), "unvouched");
    assert_eq!(run(Duration::from_secs(3600)), "unvouched");
}

/// A late announcement (behind a newer one) counts once, only if it was sent within
/// `announce_interval` of the newer one by the sender's own clock and the sender is live.
#[test]
fn a_late_announcement_counts_only_close_behind_a_live_sender() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let theirs = wall + secs(-600);
    let ms = chrono::Duration::milliseconds;
    let mut adm = Admission::new(policy(), Some(me), wall);
    let ours = adm.seal(t0, &current(me, 1, wall, &[]));
    let _ = adm.admit(t0, wall, &ours);
    let cases = [
        (Duration::ZERO, 10, theirs, "ok"),
        (Duration::ZERO, 9, theirs - ms(500), "ok"),
        (Duration::ZERO, 9, theirs - ms(500), "replayed"),
        (Duration::ZERO, 8, theirs - ms(1500), "replayed"),
        // Not live here any more.
        (
            TTL + Duration::from_secs(1),
            7,
            theirs - ms(100),
            "replayed",
        ),
    ];
    for (i, (d, seq, sent, expected)) in cases.into_iter().enumerate() {
        let a = seal(&current(node, seq, sent, &[(me, 1)]), USER, None);
        assert_eq!(kind(adm.admit(t0 + d, wall, &a)), expected, "case {i}");
    }
}

/// Reconnected: nobody is vouched for until heard anew, naming something recent.
#[test]
fn after_a_restart_senders_must_name_something_recent() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let node = Uuid::new_v4();
    let mut adm = Admission::new(policy(), Some(me), wall);
    let ours = adm.seal(t0, &current(me, 1, wall, &[]));
    let _ = adm.admit(t0, wall, &ours);
    let a = |seq, after: &[(Uuid, u64)]| seal(&current(node, seq, wall, after), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &a(1, &[(me, 1)]))), "ok");
    adm.restart(wall);
    let t1 = t0 + Duration::from_millis(500);
    assert_eq!(kind(adm.admit(t1, wall, &a(2, &[]))), "unvouched");
    let probe = adm.seal(t1, &current(me, 2, wall, &[]));
    assert!(answer_names(&probe, node, 2));
    assert_eq!(kind(adm.admit(t1, wall, &a(3, &[(me, 2)]))), "ok");
}

/// What an announcement names: the senders not vouched for yet (probes first), then the
/// newest counted of the lowest live senders; never this node, at most `MAX_AFTER`.
#[test]
fn after_names_challenges_first_then_the_lowest_live() {
    let me = Uuid::from_u128(50);
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = live_senders(me, t0, wall, (1..=MAX_AFTER as u128 + 4).rev());
    // They named this node: each is named back once (see the next test), in two
    // announcements.
    for seq in [2, 3] {
        let _ = adm.seal(t0, &current(me, seq, wall, &[]));
    }
    let (quiet, probing) = (Uuid::from_u128(100), Uuid::from_u128(101));
    let at = |ms| t0 + Duration::from_millis(ms);
    let q = seal(&current(quiet, 4, wall, &[]), USER, None);
    assert_eq!(kind(adm.admit(at(10), wall, &q)), "unvouched");
    let p = Announcement {
        probe: true,
        ..current(probing, 1, wall, &[])
    };
    assert_eq!(
        kind(adm.admit(at(5), wall, &seal(&p, USER, None))),
        "unvouched"
    );
    let env = adm.seal(at(20), &current(me, 4, wall, &[]));
    let after = named(&env);
    assert_eq!(after.len(), MAX_AFTER);
    assert_eq!(&after[..2], &[(probing, 1), (quiet, 4)]);
    let lowest: Vec<(Uuid, u64)> = (1..=MAX_AFTER as u128 - 2)
        .map(|n| (Uuid::from_u128(n), 3))
        .collect();
    assert_eq!(&after[2..], &lowest[..]);
    // Challenges older than member_ttl are no longer named.
    let later = adm.seal(at(20) + TTL, &current(me, 5, wall, &[]));
    assert!(!answer_names(&later, quiet, 4));
}

/// The admission of node `me` that sent its announcement 1 and counted announcement 3
/// of each of `senders` (ids by number, in that order), each naming it.
fn live_senders(
    me: Uuid,
    t0: Instant,
    wall: DateTime<Utc>,
    senders: impl Iterator<Item = u128>,
) -> Admission {
    let mut adm = Admission::new(policy(), Some(me), wall);
    let ours = adm.seal(t0, &current(me, 1, wall, &[]));
    let _ = adm.admit(t0, wall, &ours);
    for n in senders {
        let a = seal(
            &current(Uuid::from_u128(n), 3, wall, &[(me, 1)]),
            USER,
            None,
        );
        assert_eq!(kind(adm.admit(t0, wall, &a)), "ok", "sender {n}");
    }
    adm
}

fn named(env: &Envelope) -> Vec<(Uuid, u64)> {
    let a: Announcement = serde_json::from_slice(&env.body).expect("json");
    a.after.expect("after")
}

/// The handshake's last step: a sender that becomes live here by naming this node is
/// named in this node's next announcement (once), so it can count this node in turn,
/// however many lower live senders fill the rest.
#[test]
fn a_sender_that_becomes_live_by_naming_this_node_is_named_back_once() {
    let me = Uuid::from_u128(50);
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = live_senders(me, t0, wall, 1..=MAX_AFTER as u128);
    let _ = adm.seal(t0, &current(me, 2, wall, &[]));
    let high = Uuid::from_u128(1000);
    let a = seal(&current(high, 7, wall, &[(me, 2)]), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &a)), "ok");
    let next = adm.seal(t0, &current(me, 3, wall, &[]));
    assert!(answer_names(&next, high, 7), "{:?}", named(&next));
    let after_that = adm.seal(t0, &current(me, 4, wall, &[]));
    assert!(!answer_names(&after_that, high, 7));
    // Live already: naming this node again owes nothing.
    let again = seal(&current(high, 8, wall, &[(me, 4)]), USER, None);
    assert_eq!(kind(adm.admit(t0, wall, &again)), "ok");
    let last = adm.seal(t0, &current(me, 5, wall, &[]));
    assert!(!answer_names(&last, high, 8));
}

/// More strangers than one announcement can name, arriving in the same order every
/// interval: each announcement names those named least so far, so every one of them is
/// named within a few announcements (a fixed pick would leave the same ones out for
/// ever).
#[test]
fn every_stranger_is_named_in_turn() {
    let me = Uuid::from_u128(5000);
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall);
    let strangers: Vec<Uuid> = (1..=3 * MAX_AFTER as u128).map(Uuid::from_u128).collect();
    let mut seen = std::collections::HashSet::new();
    for round in 0..3u64 {
        let at = t0 + Duration::from_millis(250 * round);
        for (i, id) in strangers.iter().enumerate() {
            let a = seal(&current(*id, round + 1, wall, &[]), USER, None);
            assert_eq!(kind(adm.admit(at, wall, &a)), "unvouched", "{i}");
        }
        let env = adm.seal(at, &current(me, round + 1, wall, &[]));
        let after = named(&env);
        assert_eq!(after.len(), MAX_AFTER);
        for (id, seq) in after {
            assert_eq!(seq, round + 1);
            assert!(seen.insert(id), "{id} named twice before all were named");
        }
    }
    assert_eq!(seen.len(), strangers.len());
}

/// Randomized: members with host clocks up to ten minutes apart announce (each judging
/// with its own admission and naming what it counted), answer what they cannot vouch for
/// at their next turn, and an attacker sends copies of anything captured two `member_ttl`
/// or more before, plus copies of fresh ones to members that already counted them. No
/// copy ever counts, and every member soon counts every other.
#[test]
fn random_skewed_clocks_and_replays() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    const STEPS: u64 = 400;
    for seed in 0..10 {
        let mut rng = StdRng::seed_from_u64(seed);
        let p = with_key(b"our group secret, long enough");
        let n = 4;
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
        let offsets: Vec<chrono::Duration> = (0..n)
            .map(|_| chrono::Duration::milliseconds(rng.random_range(-600_000..=600_000)))
            .collect();
        let t0 = Instant::now();
        let wall0 = Utc::now();
        let mut adms: Vec<Admission> = (0..n)
            .map(|i| Admission::new(p.clone(), Some(ids[i]), wall0 + offsets[i]))
            .collect();
        let mut seq = vec![0u64; n];
        let mut owe = vec![true; n];
        let mut spoke = vec![0u64; n];
        let mut captured: Vec<(Instant, Envelope)> = Vec::new();
        // The latest real one and who received it.
        let mut latest: Option<(Envelope, Vec<usize>)> = None;
        let mut last_counted = vec![vec![None::<Instant>; n]; n];
        for step in 0..STEPS {
            let now = t0 + Duration::from_millis(step * 50);
            let wall = wall0 + chrono::Duration::milliseconds(step as i64 * 50);
            // Members speak at least once a second, and at once when they owe an answer.
            for i in 0..n {
                if !(owe[i] || rng.random_range(0..10) == 0 || step - spoke[i] >= 20) {
                    continue;
                }
                owe[i] = false;
                spoke[i] = step;
                seq[i] += 1;
                let a = current(ids[i], seq[i], wall + offsets[i], &[]);
                let env = adms[i].seal(now, &a);
                captured.push((now, env.clone()));
                let mut got = Vec::new();
                for j in 0..n {
                    if j != i && rng.random_range(0..50) == 0 {
                        continue; // lost (a node's own come back through its queue)
                    }
                    got.push(j);
                    match adms[j].admit(now, wall + offsets[j], &env) {
                        Ok(_) => last_counted[j][i] = Some(now),
                        Err(Rejected::Unvouched { answer, .. }) => owe[j] |= answer,
                        Err(e) => panic!("seed {seed}: a real one refused: {e}"),
                    }
                }
                latest = Some((env, got));
            }
            // The attacker: an old copy to everyone, a fresh one to anyone.
            let old: Vec<&Envelope> = captured
                .iter()
                .filter(|(at, _)| now.saturating_duration_since(*at) >= TTL * 2)
                .map(|(_, e)| e)
                .collect();
            if !old.is_empty() {
                let copy = old[rng.random_range(0..old.len())].clone();
                for j in 0..n {
                    let got = adms[j].admit(now, wall + offsets[j], &copy);
                    assert!(got.is_err(), "seed {seed} step {step}: an old copy counted");
                }
            }
            if let Some((copy, got)) = &latest {
                let j = got[rng.random_range(0..got.len())];
                if let Ok(a) = adms[j].admit(now, wall + offsets[j], copy) {
                    panic!("seed {seed}: a copy counted twice: {a:?}");
                }
            }
        }
        let end = t0 + Duration::from_millis(STEPS * 50);
        for j in 0..n {
            for i in 0..n {
                let at = last_counted[j][i].expect("counted at some point");
                assert!(
                    end.saturating_duration_since(at) < Duration::from_secs(5),
                    "seed {seed}: {j} stopped counting {i} ({:?} before the end; {i} sent {} times, {:?})",
                    end.saturating_duration_since(at),
                    seq[i],
                    adms[j].rejected()
                );
            }
        }
    }
}

/// Copies of strangers' announcements must not make a node speak at every tick: a
/// stranger's probe, or a member heard again after a gap, is to be answered each time;
/// any other stranger's announcement at most once per `member_ttl`.
#[test]
fn strangers_are_answered_sparingly() {
    let me = Uuid::new_v4();
    let t0 = Instant::now();
    let wall = Utc::now();
    let mut adm = Admission::new(policy(), Some(me), wall);
    let answer = |adm: &mut Admission, ms: u64, a: Announcement| match adm.admit(
        t0 + Duration::from_millis(ms),
        wall,
        &seal(&a, USER, None),
    ) {
        Err(Rejected::Unvouched { answer, .. }) => answer,
        other => panic!("{other:?}"),
    };
    let stranger = |seq| current(Uuid::new_v4(), seq, wall, &[]);
    assert!(answer(&mut adm, 0, stranger(5)));
    assert!(!answer(&mut adm, 100, stranger(6)));
    assert!(!answer(&mut adm, 2900, stranger(7)));
    let probe = Announcement {
        probe: true,
        ..stranger(1)
    };
    assert!(answer(&mut adm, 3000, probe));
    assert!(answer(&mut adm, 3200, stranger(8)), "a member_ttl later");
    // A member heard again after a gap.
    let ours = adm.seal(t0 + Duration::from_secs(4), &current(me, 1, wall, &[]));
    let _ = adm.admit(t0 + Duration::from_secs(4), wall, &ours);
    let member = Uuid::new_v4();
    let named = current(member, 1, wall, &[(me, 1)]);
    assert_eq!(
        kind(adm.admit(t0 + Duration::from_secs(4), wall, &seal(&named, USER, None))),
        "ok"
    );
    assert!(answer(&mut adm, 9000, current(member, 2, wall, &[])));
    assert!(answer(&mut adm, 9100, current(member, 3, wall, &[])));
}
