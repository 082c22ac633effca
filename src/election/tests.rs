use super::*;

const MS: Duration = Duration::from_millis(1);

fn timing() -> Timing {
    Timing::new(Duration::from_secs(1), Duration::from_secs(3))
}

fn id(n: u8) -> Uuid {
    Uuid::from_bytes([n; 16])
}

fn heard(from: Uuid) -> Heard {
    Heard {
        from,
        active: false,
        leaving: false,
        probe: false,
        withdrawn: false,
    }
}

fn drain(e: &mut Election) -> Vec<Output> {
    std::iter::from_fn(|| e.poll_output()).collect()
}

fn sends(outputs: &[Output]) -> Vec<Announce> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Send(a) => Some(*a),
            _ => None,
        })
        .collect()
}

fn role_changes(outputs: &[Output]) -> Vec<(Role, Reason)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::RoleChanged { role, reason, .. } => Some((*role, reason.clone())),
            _ => None,
        })
        .collect()
}

/// A node that has heard its own echo and settled by timeout, alone in the group.
fn settled_alone(me: Uuid, t0: Instant) -> Election {
    let mut e = Election::new(me, timing(), t0);
    e.step(t0 + MS, heard(me));
    e.tick(t0 + Duration::from_secs(1));
    e
}

#[test]
fn starts_passive_and_sends_a_probe() {
    let t0 = Instant::now();
    let mut e = Election::new(id(1), timing(), t0);
    assert_eq!(e.role(), Role::Passive);
    assert!(!e.is_settled());
    let out = drain(&mut e);
    assert_eq!(
        sends(&out),
        vec![Announce {
            active: false,
            leaving: false,
            probe: true,
            withdrawn: false
        }]
    );
}

#[test]
fn stays_passive_while_settling_even_when_lowest() {
    let t0 = Instant::now();
    let mut e = Election::new(id(1), timing(), t0);
    e.step(t0 + MS, heard(id(1)));
    e.tick(t0 + Duration::from_millis(999));
    assert_eq!(e.role(), Role::Passive);
    assert_eq!(
        e.check_lease(t0 + Duration::from_millis(999)),
        Lease::Demoted
    );
}

#[test]
fn lowest_becomes_active_after_one_announce_interval() {
    let t0 = Instant::now();
    let mut e = Election::new(id(1), timing(), t0);
    drain(&mut e);
    e.tick(t0 + Duration::from_secs(1));
    let out = drain(&mut e);
    assert_eq!(e.role(), Role::Active);
    assert_eq!(role_changes(&out), vec![(Role::Active, Reason::Lowest)]);
    // The first announcement after settling is not a probe and says active.
    assert_eq!(
        sends(&out).last(),
        Some(&Announce {
            active: true,
            leaving: false,
            probe: false,
            withdrawn: false
        })
    );
}

#[test]
fn newcomer_does_not_act_while_a_lower_node_answers_its_probe() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(t0 + MS, heard(id(2)));
    e.tick(t0 + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Passive);
    let changes = role_changes(&drain(&mut e));
    assert!(changes.is_empty(), "never active: {changes:?}");
}

#[test]
fn active_answer_from_a_higher_node_ends_settling_early() {
    let t0 = Instant::now();
    let mut e = Election::new(id(1), timing(), t0);
    let answer = Heard {
        active: true,
        ..heard(id(9))
    };
    e.step(t0 + 5 * MS, answer);
    assert!(e.is_settled());
    assert_eq!(e.role(), Role::Active);
}

#[test]
fn active_answer_from_a_lower_node_settles_passive() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(
        t0 + 5 * MS,
        Heard {
            active: true,
            ..heard(id(1))
        },
    );
    assert!(e.is_settled());
    assert_eq!(e.role(), Role::Passive);
}

#[test]
fn a_probing_member_is_not_a_candidate_until_it_settles() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    assert_eq!(e.role(), Role::Active);
    let t = t0 + Duration::from_millis(1100);
    e.step(
        t,
        Heard {
            probe: true,
            ..heard(id(1))
        },
    );
    assert_eq!(e.role(), Role::Active, "a probing newcomer does not depose");
    e.step(t + 10 * MS, heard(id(1)));
    assert_eq!(e.role(), Role::Passive);
    let out = drain(&mut e);
    assert!(role_changes(&out).contains(&(Role::Passive, Reason::LowerMember(id(1)))));
}

#[test]
fn answers_a_probe_from_another_node_at_the_next_tick() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    e.step(
        t,
        Heard {
            probe: true,
            ..heard(id(7))
        },
    );
    assert!(sends(&drain(&mut e)).is_empty(), "not before the tick");
    // 1.25 s: the periodic announcement (due at 2 s) is not due; only the answer is.
    e.tick(t0 + Duration::from_millis(1250));
    assert_eq!(
        sends(&drain(&mut e)),
        vec![Announce {
            active: true,
            leaving: false,
            probe: false,
            withdrawn: false
        }]
    );
}

/// A sender the admission cannot vouch for yet is no member and changes no role, but it
/// is answered at the next tick, as a probe is (the answer names it).
#[test]
fn an_unvouched_sender_is_answered_at_the_next_tick_but_is_no_member() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    drain(&mut e);
    e.unvouched();
    assert!(sends(&drain(&mut e)).is_empty(), "not before the tick");
    e.tick(t0 + Duration::from_millis(1250));
    let out = drain(&mut e);
    assert_eq!(sends(&out).len(), 1, "{out:?}");
    assert!(role_changes(&out).is_empty());
    assert_eq!(e.role(), Role::Active);
    assert!(e.members(t0).iter().all(|m| m.id == id(5)));
    // Leaving: nothing more is sent.
    e.leave(t0 + Duration::from_millis(1300));
    drain(&mut e);
    e.unvouched();
    e.tick(t0 + Duration::from_millis(1500));
    assert!(sends(&drain(&mut e)).is_empty());
}

#[test]
fn own_probe_echo_is_not_answered() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    drain(&mut e);
    e.step(
        t0 + MS,
        Heard {
            probe: true,
            ..heard(id(5))
        },
    );
    assert!(sends(&drain(&mut e)).is_empty());
}

#[test]
fn a_burst_of_probes_costs_one_answer() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    for n in 6..20 {
        e.step(
            t,
            Heard {
                probe: true,
                ..heard(id(n))
            },
        );
    }
    e.tick(t + 150 * MS);
    assert_eq!(sends(&drain(&mut e)).len(), 1);
}

/// A probe flood must not become N × flood: answers go out with the tick, one at most.
#[test]
fn a_thousand_probes_between_two_ticks_cost_one_answer() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    for n in 0..1000u128 {
        let probe = Heard {
            probe: true,
            ..heard(Uuid::from_u128(u128::MAX - n))
        };
        e.step(t, probe);
    }
    assert!(sends(&drain(&mut e)).is_empty());
    e.tick(t + 150 * MS);
    assert_eq!(sends(&drain(&mut e)).len(), 1);
    e.tick(t + 400 * MS);
    assert!(sends(&drain(&mut e)).is_empty(), "answered already");
    assert_eq!(e.role(), Role::Active, "probing newcomers do not depose");
}

/// The probe answer and the periodic announcement due at the same tick are one send.
#[test]
fn a_probe_answer_coalesces_with_the_periodic_announcement() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    drain(&mut e);
    e.step(
        t0 + Duration::from_millis(1900),
        Heard {
            probe: true,
            ..heard(id(7))
        },
    );
    e.tick(t0 + Duration::from_secs(2));
    assert_eq!(sends(&drain(&mut e)).len(), 1);
}

#[test]
fn announces_every_interval_and_not_more_often() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let mut sent = 0;
    // Ten seconds of 250 ms ticks, hearing our own echo each time.
    for step in 1..=40u64 {
        let now = t0 + Duration::from_secs(1) + Duration::from_millis(250 * step);
        e.step(now, heard(id(1)));
        e.tick(now);
        sent += sends(&drain(&mut e)).len();
    }
    assert_eq!(sent, 10);
}

/// The published `cleanOld` kept members whose last sighting was older than the window.
/// Table: (age of the member at the tick, still a member afterwards).
#[test]
fn expiry_keeps_live_members_and_drops_old_ones() {
    let cases = [
        (Duration::ZERO, true),
        (Duration::from_millis(2999), true),
        (Duration::from_secs(3), true),
        (Duration::from_millis(3001), false),
        (Duration::from_secs(10), false),
    ];
    for (age, kept) in cases {
        let t0 = Instant::now();
        let mut e = Election::new(id(5), timing(), t0);
        e.step(t0, heard(id(1)));
        // Keep ticking (no pause) and keep hearing ourselves so only id(1) ages.
        let mut now = t0;
        while now < t0 + age {
            now = (now + Duration::from_millis(250)).min(t0 + age);
            e.step(now, heard(id(5)));
            e.tick(now);
        }
        let ids: Vec<Uuid> = e.members(now).iter().map(|m| m.id).collect();
        assert_eq!(ids.contains(&id(1)), kept, "age {age:?}");
    }
}

#[test]
fn takes_over_when_the_lower_member_expires() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(t0, heard(id(1)));
    let mut now = t0;
    let mut took_over_at = None;
    while now < t0 + Duration::from_secs(5) {
        now += Duration::from_millis(250);
        e.step(now, heard(id(5)));
        e.tick(now);
        if e.role() == Role::Active && took_over_at.is_none() {
            took_over_at = Some(now - t0);
        }
    }
    // Last heard at t0, ttl 3 s, tick 250 ms: active at the first tick after 3 s.
    assert_eq!(took_over_at, Some(Duration::from_millis(3250)));
}

#[test]
fn leaving_removes_the_member_at_once() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(t0, heard(id(1)));
    e.tick(t0 + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Passive);
    e.step(
        t0 + Duration::from_millis(1100),
        Heard {
            leaving: true,
            ..heard(id(1))
        },
    );
    assert_eq!(
        e.role(),
        Role::Active,
        "within the same step, not a tick later"
    );
    assert!(e.members(t0).iter().all(|m| m.id != id(1)));
}

#[test]
fn an_observer_probe_with_leaving_gets_an_answer_but_no_membership() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    drain(&mut e);
    e.step(
        t0 + Duration::from_millis(1100),
        Heard {
            probe: true,
            leaving: true,
            ..heard(id(1))
        },
    );
    assert_eq!(e.role(), Role::Active);
    e.tick(t0 + Duration::from_millis(1250));
    assert_eq!(sends(&drain(&mut e)).len(), 1);
    assert!(e.members(t0).iter().all(|m| m.id != id(1)));
}

#[test]
fn hearing_nobody_warns_once_and_acts_alone() {
    let t0 = Instant::now();
    let mut e = Election::new(id(9), timing(), t0);
    e.step(t0, heard(id(1)));
    let mut outs = Vec::new();
    let mut now = t0;
    while now < t0 + Duration::from_secs(6) {
        now += Duration::from_millis(250);
        e.tick(now);
        outs.extend(drain(&mut e));
    }
    let warnings = outs
        .iter()
        .filter(|o| matches!(o, Output::BusSilent { .. }))
        .count();
    assert_eq!(warnings, 1);
    assert_eq!(e.role(), Role::Active);
}

#[test]
fn hearing_again_rearms_the_silence_warning() {
    let t0 = Instant::now();
    let mut e = Election::new(id(9), timing(), t0);
    let mut now = t0;
    let mut warnings = 0;
    for round in 0..2 {
        while now < t0 + Duration::from_secs(4 * (round + 1)) {
            now += Duration::from_millis(250);
            e.tick(now);
        }
        e.step(now, heard(id(9)));
        warnings += drain(&mut e)
            .iter()
            .filter(|o| matches!(o, Output::BusSilent { .. }))
            .count();
    }
    assert_eq!(warnings, 2);
}

#[test]
fn a_pause_longer_than_member_ttl_drops_the_role_and_settles_again() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    assert_eq!(e.role(), Role::Active);
    drain(&mut e);
    let resumed = t0 + Duration::from_secs(1) + Duration::from_millis(3001);
    assert_eq!(
        e.check_lease(resumed),
        Lease::Stale,
        "stale lease must not commit"
    );
    assert_eq!(e.role(), Role::Passive);
    assert!(!e.is_settled());
    let out = drain(&mut e);
    assert!(matches!(
        role_changes(&out).as_slice(),
        [(Role::Passive, Reason::Paused(_))]
    ));
    assert!(sends(&out).iter().any(|a| a.probe), "re-probes the group");
    // Settles again after one interval and, still alone, acts again.
    e.tick(resumed + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Active);
}

/// Table: (gap since the last tick, lease).
#[test]
fn check_lease_accepts_gaps_up_to_member_ttl() {
    let cases = [
        (Duration::from_millis(250), Lease::Held),
        (Duration::from_secs(3), Lease::Held),
        (Duration::from_millis(3001), Lease::Stale),
    ];
    for (gap, held) in cases {
        let t0 = Instant::now();
        let mut e = settled_alone(id(1), t0);
        let last_tick = t0 + Duration::from_secs(1);
        assert_eq!(e.check_lease(last_tick + gap), held, "gap {gap:?}");
    }
}

#[test]
fn passive_node_has_no_lease() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(t0, heard(id(1)));
    e.tick(t0 + Duration::from_secs(1));
    assert_eq!(e.check_lease(t0 + Duration::from_secs(1)), Lease::Demoted);
}

#[test]
fn stale_queued_announcements_after_a_pause_do_not_restore_the_role() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let resumed = t0 + Duration::from_secs(10);
    e.step(resumed, heard(id(1)));
    assert_eq!(e.role(), Role::Passive);
    assert!(!e.is_settled());
}

#[test]
fn lag_past_max_lag_steps_down_and_recovers_when_on_time() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    e.observe_own_lag(t, Duration::from_millis(1600));
    assert_eq!(e.role(), Role::Passive);
    let out = drain(&mut e);
    assert!(out.contains(&Output::Lagging {
        lag: Duration::from_millis(1600)
    }));
    assert!(matches!(
        role_changes(&out).as_slice(),
        [(Role::Passive, Reason::Lagging(_))]
    ));
    // Lag alone keeps it passive even though it is the lowest.
    e.tick(t + Duration::from_millis(250));
    assert_eq!(e.role(), Role::Passive);
    let back = t + Duration::from_millis(300);
    e.observe_own_lag(back, Duration::from_millis(5));
    assert!(drain(&mut e).contains(&Output::LagRecovered {
        lag: Duration::from_millis(5)
    }));
    // Rejoins like a newcomer: settles for an interval before acting again.
    assert_eq!(e.role(), Role::Passive);
    e.tick(back + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Active);
}

#[test]
fn lag_within_max_lag_changes_nothing() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    e.observe_own_lag(
        t0 + Duration::from_millis(1100),
        Duration::from_millis(1500),
    );
    assert_eq!(e.role(), Role::Active);
    assert!(drain(&mut e).is_empty());
}

#[test]
fn persistent_lag_asks_to_exit() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let lag = Duration::from_secs(2);
    let mut exits = 0;
    let mut now = t0 + Duration::from_secs(1);
    for _ in 0..40 {
        now += Duration::from_millis(250);
        e.tick(now);
        e.observe_own_lag(now, lag);
        exits += drain(&mut e)
            .iter()
            .filter(|o| matches!(o, Output::Exit { .. }))
            .count();
    }
    // 10 s of lag with max_lag_exit = 9 s: exit requested from 9 s on.
    assert!(exits >= 1);
    assert_eq!(e.role(), Role::Passive);
}

#[test]
fn leave_announces_leaving_once_and_ignores_further_input() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    e.leave(t);
    e.leave(t);
    e.step(t, heard(id(2)));
    e.tick(t + Duration::from_secs(5));
    let out = drain(&mut e);
    assert_eq!(
        sends(&out),
        vec![Announce {
            active: false,
            leaving: true,
            probe: false,
            withdrawn: false
        }]
    );
    assert_eq!(role_changes(&out), vec![(Role::Passive, Reason::Leaving)]);
    assert_eq!(e.check_lease(t), Lease::Demoted);
}

#[test]
fn lowest_compares_uuid_bytes_like_hyphenated_strings() {
    let a: Uuid = "0fffffff-ffff-4fff-bfff-ffffffffffff"
        .parse()
        .expect("uuid");
    let b: Uuid = "a0000000-0000-4000-8000-000000000000"
        .parse()
        .expect("uuid");
    assert!(a < b);
    assert!(a.to_string() < b.to_string());
    let t0 = Instant::now();
    let mut e = Election::new(b, timing(), t0);
    e.step(t0, heard(a));
    e.tick(t0 + Duration::from_secs(1));
    assert_eq!(e.lowest(), a);
    assert_eq!(e.role(), Role::Passive);
}

/// Three nodes exchanging every announcement: exactly one active once settled, and
/// always the lowest, whatever the start order.
#[test]
fn three_nodes_converge_on_the_lowest() {
    for order in [[1u8, 2, 3], [3, 2, 1], [2, 3, 1]] {
        let t0 = Instant::now();
        let mut nodes: Vec<Election> = order
            .iter()
            .enumerate()
            .map(|(i, n)| Election::new(id(*n), timing(), t0 + 100 * MS * i as u32))
            .collect();
        let mut now = t0;
        let mut ever_active = std::collections::BTreeSet::new();
        while now < t0 + Duration::from_secs(3) {
            now += 50 * MS;
            deliver_all(&mut nodes, now);
            nodes.iter_mut().for_each(|n| n.tick(now));
            ever_active.extend(
                nodes
                    .iter()
                    .filter(|n| n.role() == Role::Active)
                    .map(|n| n.id()),
            );
        }
        assert_eq!(
            ever_active.into_iter().collect::<Vec<_>>(),
            vec![id(1)],
            "{order:?}"
        );
        let active: Vec<Uuid> = nodes
            .iter()
            .filter(|n| n.role() == Role::Active)
            .map(|n| n.id())
            .collect();
        assert_eq!(active, vec![id(1)], "start order {order:?}");
    }
}

/// Route every pending announcement to every node (the topic exchange fan-out);
/// returns every output drained, with the node that produced it.
fn deliver_all(nodes: &mut [Election], now: Instant) -> Vec<(Uuid, Output)> {
    let mut drained = Vec::new();
    for n in nodes.iter_mut() {
        let from = n.id();
        drained.extend(drain(n).into_iter().map(|o| (from, o)));
    }
    let wire: Vec<Heard> = drained
        .iter()
        .filter_map(|(from, o)| match o {
            Output::Send(a) => Some(heard_as(*from, *a)),
            _ => None,
        })
        .collect();
    for h in wire {
        nodes.iter_mut().for_each(|n| n.step(now, h));
    }
    drained
}

/// What the others receive when `from` sends `a`.
fn heard_as(from: Uuid, a: Announce) -> Heard {
    Heard {
        from,
        active: a.active,
        leaving: a.leaving,
        probe: a.probe,
        withdrawn: a.withdrawn,
    }
}

#[test]
fn losing_the_bus_drops_the_role_at_once_and_settles_again() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let t = t0 + Duration::from_millis(1100);
    e.bus_lost(t);
    assert_eq!(e.role(), Role::Passive);
    assert!(!e.is_settled());
    let out = drain(&mut e);
    assert_eq!(role_changes(&out), vec![(Role::Passive, Reason::BusLost)]);
    assert!(sends(&out).iter().all(|a| a.probe && !a.active));
    e.tick(t + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Active);
}

#[test]
fn a_settling_node_defers_to_a_lower_node_that_is_still_probing() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    e.step(
        t0 + 400 * MS,
        Heard {
            probe: true,
            ..heard(id(1))
        },
    );
    e.tick(t0 + Duration::from_secs(1));
    assert!(e.is_settled());
    assert_eq!(e.role(), Role::Passive);
}

// --- Withdrawal ---

const TICK: Duration = Duration::from_millis(250);

const WITHDRAWN: Announce = Announce {
    active: false,
    leaving: true,
    probe: false,
    withdrawn: true,
};

fn candidacy(outputs: &[Output]) -> Vec<(bool, Reason)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Candidacy { candidate, reason } => Some((*candidate, reason.clone())),
            _ => None,
        })
        .collect()
}

fn active_ids(nodes: &[Election]) -> Vec<Uuid> {
    nodes
        .iter()
        .filter(|n| n.role() == Role::Active)
        .map(|n| n.id())
        .collect()
}

/// Tick every node every `TICK` for `for_`, delivering every announcement after each
/// round; `before_tick` feeds each node the driver's per-tick inputs (health).
fn run(
    nodes: &mut [Election],
    now: &mut Instant,
    for_: Duration,
    mut before_tick: impl FnMut(&mut Election, Instant),
) -> Vec<(Uuid, Output)> {
    let end = *now + for_;
    let mut outputs = Vec::new();
    while *now < end {
        *now += TICK;
        for n in nodes.iter_mut() {
            before_tick(n, *now);
            n.tick(*now);
        }
        outputs.extend(deliver_all(nodes, *now));
    }
    outputs
}

fn of(outputs: &[(Uuid, Output)], node: Uuid) -> Vec<Output> {
    outputs
        .iter()
        .filter(|(from, _)| *from == node)
        .map(|(_, o)| o.clone())
        .collect()
}

/// Three settled nodes 1 < 2 < 3, node 1 active.
fn settled_group(t0: Instant) -> (Vec<Election>, Instant) {
    let mut nodes: Vec<Election> = [1, 2, 3].map(|n| Election::new(id(n), timing(), t0)).into();
    let mut now = t0;
    run(&mut nodes, &mut now, Duration::from_secs(2), |_, _| {});
    assert_eq!(active_ids(&nodes), vec![id(1)]);
    assert!(nodes.iter().all(Election::is_settled));
    (nodes, now)
}

fn healthy(n: &mut Election, now: Instant) {
    n.observe_health(now, None);
}

/// Table: (failing for, withdrawn afterwards). Strictly more than `member_ttl`.
#[test]
fn failing_checks_withdraw_only_past_member_ttl() {
    let cases = [
        (Duration::ZERO, false),
        (Duration::from_secs(3), false),
        (Duration::from_millis(3001), true),
    ];
    for (failing, withdrawn) in cases {
        let t0 = Instant::now();
        let mut e = settled_alone(id(1), t0);
        let now = t0 + Duration::from_secs(4);
        e.tick(t0 + Duration::from_millis(3500));
        e.observe_health(now, Some(now - failing));
        assert_eq!(e.is_candidate(), !withdrawn, "failing {failing:?}");
        assert_eq!(e.role() == Role::Active, !withdrawn, "failing {failing:?}");
    }
}

#[test]
fn an_unhealthy_node_withdraws_once_and_rejoins_like_a_newcomer() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    drain(&mut e);
    let since = t0 + Duration::from_millis(500);
    let t = t0 + Duration::from_millis(3600);
    e.tick(t);
    e.observe_health(t, Some(since));
    e.observe_health(t + MS, Some(since));
    let out = drain(&mut e);
    let failing = t - since;
    assert_eq!(
        role_changes(&out),
        vec![(Role::Passive, Reason::Unhealthy(failing))]
    );
    assert_eq!(candidacy(&out), vec![(false, Reason::Unhealthy(failing))]);
    assert_eq!(sends(&out), vec![WITHDRAWN]);
    assert_eq!(e.check_lease(t + MS), Lease::Demoted);
    // Still the only member, still unhealthy: never takes the role back.
    e.tick(t + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Passive);
    let back = t + Duration::from_millis(1100);
    e.observe_health(back, None);
    let out = drain(&mut e);
    assert_eq!(candidacy(&out), vec![(true, Reason::Fit)]);
    assert!(sends(&out).last().is_some_and(|a| a.probe && !a.withdrawn));
    assert!(e.is_candidate() && !e.is_settled());
    e.tick(back + Duration::from_secs(1));
    assert_eq!(e.role(), Role::Active);
}

#[test]
fn a_withdrawn_node_announces_withdrawn_periodically_and_to_probes() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let t = t0 + Duration::from_millis(1100);
    e.observe_own_lag(t, Duration::from_secs(2));
    drain(&mut e);
    e.step(
        t + 10 * MS,
        Heard {
            probe: true,
            ..heard(id(7))
        },
    );
    e.tick(t + 150 * MS);
    assert_eq!(sends(&drain(&mut e)), vec![WITHDRAWN], "probe answer");
    let mut now = t + 150 * MS;
    let mut sent = Vec::new();
    for _ in 0..8 {
        now += TICK;
        e.tick(now);
        sent.extend(sends(&drain(&mut e)));
    }
    assert_eq!(sent, vec![WITHDRAWN, WITHDRAWN], "every interval");
}

#[test]
fn a_node_stays_withdrawn_while_any_cause_holds() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let since = t0 + Duration::from_millis(1100);
    e.tick(since);
    e.tick(t0 + Duration::from_secs(3));
    drain(&mut e);
    let t = t0 + Duration::from_millis(4200);
    e.observe_own_lag(t, Duration::from_secs(2));
    e.observe_health(t, Some(since));
    let out = drain(&mut e);
    assert_eq!(
        candidacy(&out),
        vec![(false, Reason::Lagging(Duration::from_secs(2)))],
        "one withdrawal, whatever the number of causes"
    );
    e.observe_own_lag(t + 10 * MS, Duration::from_millis(5));
    assert!(!e.is_candidate(), "still unhealthy");
    e.observe_health(t + 20 * MS, None);
    assert!(e.is_candidate());
    assert_eq!(candidacy(&drain(&mut e)), vec![(true, Reason::Fit)]);
}

#[test]
fn a_pause_or_a_lost_bus_keeps_a_withdrawn_node_withdrawn_and_silent_about_probing() {
    let t0 = Instant::now();
    let since = t0 + Duration::from_millis(1100);
    for lose in [
        |e: &mut Election, now| assert_eq!(e.check_lease(now), Lease::Stale),
        |e: &mut Election, now| e.bus_lost(now),
    ] {
        let mut e = settled_alone(id(1), t0);
        e.tick(since);
        e.tick(t0 + Duration::from_secs(3));
        let t = t0 + Duration::from_millis(4200);
        e.observe_health(t, Some(since));
        assert!(!e.is_candidate(), "withdrawn before the loss");
        drain(&mut e);
        let later = t + Duration::from_secs(10);
        lose(&mut e, later);
        assert!(!e.is_candidate());
        assert!(sends(&drain(&mut e)).iter().all(|a| *a == WITHDRAWN));
        e.tick(later + Duration::from_secs(2));
        assert_eq!(e.role(), Role::Passive);
        e.observe_health(later + Duration::from_secs(2), None);
        assert!(sends(&drain(&mut e)).iter().any(|a| a.probe));
    }
}

#[test]
fn leave_works_while_withdrawn() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let t = t0 + Duration::from_millis(1100);
    e.observe_own_lag(t, Duration::from_secs(2));
    drain(&mut e);
    e.leave(t + MS);
    assert_eq!(
        sends(&drain(&mut e)),
        vec![Announce {
            active: false,
            leaving: true,
            probe: false,
            withdrawn: false
        }]
    );
    assert!(!e.is_candidate());
}

#[test]
fn a_leaving_node_asked_for_its_lease_much_later_does_not_restart() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let t = t0 + Duration::from_millis(1100);
    e.leave(t);
    drain(&mut e);
    // Not held (its view is old), and no restart: nothing queued.
    assert_eq!(e.check_lease(t + Duration::from_secs(10)), Lease::Stale);
    assert!(drain(&mut e).is_empty());
}

#[test]
fn a_withdrawn_member_stays_a_member_but_is_no_candidate() {
    let t0 = Instant::now();
    let mut e = Election::new(id(5), timing(), t0);
    let withdrawn = heard_as(id(1), WITHDRAWN);
    e.step(t0 + 10 * MS, withdrawn);
    e.tick(t0 + Duration::from_secs(1));
    assert_eq!(
        e.role(),
        Role::Active,
        "does not defer to a withdrawn lower id"
    );
    assert_eq!(e.lowest(), id(5));
    let view = e.members(t0 + Duration::from_secs(1));
    assert!(
        view.iter()
            .any(|m| m.id == id(1) && m.withdrawn && !m.active)
    );
    // Like any member it expires when no longer heard.
    let mut now = t0 + Duration::from_secs(1);
    while now < t0 + Duration::from_secs(4) {
        now += TICK;
        e.step(now, heard(id(5)));
        e.tick(now);
    }
    assert!(e.members(now).iter().all(|m| m.id != id(1)));
}

#[test]
fn lowest_skips_this_node_while_it_is_withdrawn() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let t = t0 + Duration::from_millis(1100);
    e.step(t, heard(id(4)));
    assert_eq!(e.lowest(), id(1));
    e.observe_own_lag(t, Duration::from_secs(2));
    assert_eq!(e.lowest(), id(4));
}

#[test]
fn the_next_node_takes_over_as_soon_as_it_hears_the_unhealthy_one_withdraw() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = settled_group(t0);
    let since = now;
    let failing = |n: &mut Election, t: Instant| {
        if n.id() == id(1) {
            n.observe_health(t, Some(since));
        }
    };
    // Failing for exactly member_ttl: nothing changes yet.
    run(&mut nodes, &mut now, Duration::from_secs(3), failing);
    assert_eq!(active_ids(&nodes), vec![id(1)]);
    now += TICK;
    nodes[0].observe_health(now, Some(since));
    let out = drain(&mut nodes[0]);
    assert_eq!(
        candidacy(&out),
        vec![(false, Reason::Unhealthy(now - since))]
    );
    assert_eq!(sends(&out), vec![WITHDRAWN]);
    nodes[1].step(now, heard_as(id(1), WITHDRAWN));
    assert_eq!(
        active_ids(&nodes),
        vec![id(2)],
        "one step, no member_ttl wait"
    );
    // While node 1 stays unhealthy, node 2 keeps the role and node 1 stays a member.
    run(&mut nodes, &mut now, Duration::from_secs(10), failing);
    assert_eq!(active_ids(&nodes), vec![id(2)]);
    assert!(
        nodes[1]
            .members(now)
            .iter()
            .any(|m| m.id == id(1) && m.withdrawn)
    );
    // Healthy again: node 1 probes, settles on node 2's answer, takes the role back.
    let out = run(&mut nodes, &mut now, Duration::from_secs(2), healthy);
    assert_eq!(active_ids(&nodes), vec![id(1)]);
    assert_eq!(candidacy(&of(&out, id(1))), vec![(true, Reason::Fit)]);
    assert_eq!(
        role_changes(&of(&out, id(2))),
        vec![(Role::Passive, Reason::LowerMember(id(1)))]
    );
}

#[test]
fn when_every_node_is_unhealthy_nobody_acts_and_nobody_flaps() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = settled_group(t0);
    let since = now;
    let failing = |n: &mut Election, t: Instant| n.observe_health(t, Some(since));
    let out = run(&mut nodes, &mut now, Duration::from_secs(4), failing);
    for n in [1, 2, 3] {
        let withdrawals = candidacy(&of(&out, id(n)));
        assert!(matches!(
            withdrawals.as_slice(),
            [(false, Reason::Unhealthy(_))]
        ));
    }
    assert!(active_ids(&nodes).is_empty());
    let out = run(&mut nodes, &mut now, Duration::from_secs(60), |n, t| {
        failing(n, t);
        assert_eq!(n.role(), Role::Passive);
    });
    let flaps: Vec<&Output> = out
        .iter()
        .map(|(_, o)| o)
        .filter(|o| matches!(o, Output::RoleChanged { .. } | Output::Candidacy { .. }))
        .collect();
    assert!(flaps.is_empty(), "{flaps:?}");
    assert!(
        out.iter()
            .all(|(_, o)| !matches!(o, Output::Send(a) if *a != WITHDRAWN))
    );
    // Everyone still knows everyone, as withdrawn members.
    assert!(nodes.iter().all(|n| n.members(now).len() == 3));
    let mut ever_active = std::collections::BTreeSet::new();
    run(&mut nodes, &mut now, Duration::from_secs(3), |n, t| {
        healthy(n, t);
        ever_active.extend((n.role() == Role::Active).then_some(n.id()));
    });
    assert_eq!(active_ids(&nodes), vec![id(1)]);
    assert_eq!(ever_active.into_iter().collect::<Vec<_>>(), vec![id(1)]);
}

#[test]
fn a_lagging_lowest_node_is_passed_over_at_once_and_rejoins_when_on_time() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = settled_group(t0);
    now += TICK;
    let lag = Duration::from_secs(2);
    nodes[0].observe_own_lag(now, lag);
    let out = deliver_all(&mut nodes, now);
    let node1 = of(&out, id(1));
    assert!(node1.contains(&Output::Lagging { lag }));
    assert_eq!(candidacy(&node1), vec![(false, Reason::Lagging(lag))]);
    assert_eq!(active_ids(&nodes), vec![id(2)], "after one delivery");
    run(&mut nodes, &mut now, Duration::from_secs(5), healthy);
    assert_eq!(active_ids(&nodes), vec![id(2)]);
    nodes[0].observe_own_lag(now, Duration::from_millis(5));
    let out = run(&mut nodes, &mut now, Duration::from_secs(2), healthy);
    let node1 = of(&out, id(1));
    assert!(node1.contains(&Output::LagRecovered {
        lag: Duration::from_millis(5)
    }));
    assert_eq!(candidacy(&node1), vec![(true, Reason::Fit)]);
    assert_eq!(active_ids(&nodes), vec![id(1)]);
}

/// A process frozen (SIGSTOP, `docker pause`) while one of its checks was under way sees,
/// on resume, that check "failing" for as long as the pause: it is the pause that it
/// must act on (drop the role, settle again), not a withdrawal.
#[test]
fn a_pause_with_a_check_under_way_is_a_pause_not_a_failing_check() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let step_began = t0 + Duration::from_millis(1100);
    e.tick(step_began);
    drain(&mut e);
    let resumed = step_began + Duration::from_secs(5);
    e.observe_health(resumed, Some(step_began));
    e.tick(resumed);
    let out = drain(&mut e);
    assert!(e.is_candidate(), "not withdrawn: {out:?}");
    assert!(
        role_changes(&out)
            .iter()
            .any(|(r, why)| *r == Role::Passive && matches!(why, Reason::Paused(_))),
        "the pause is what it noticed: {out:?}"
    );
    // The check still under way a member_ttl after the resume: now it counts.
    let later = resumed + Duration::from_millis(3100);
    e.tick(resumed + Duration::from_millis(3000));
    e.observe_health(later, Some(step_began));
    assert!(
        !e.is_candidate(),
        "withdrawn once failing past member_ttl since the resume"
    );
}

#[test]
fn the_lease_view_holds_only_while_active_and_fresh() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(1), t0);
    let view = e.lease_view();
    let ticked = t0 + Duration::from_secs(1);
    assert_eq!(view.role, Role::Active);
    assert_eq!(view.check(ticked + Duration::from_secs(3)), Lease::Held);
    assert_eq!(
        view.check(ticked + Duration::from_millis(3001)),
        Lease::Stale
    );
    e.leave(ticked + MS);
    let after = e.lease_view();
    assert_eq!(after.check(ticked + MS), Lease::Demoted);
    assert!(
        after.generation > view.generation,
        "a role change is a new generation"
    );
    assert_eq!(LeaseView::none(t0).check(t0 + MS), Lease::Stale);
}

// --- Who announces (Rule::Lowest, the default, and Rule::All) ---

fn node_with(n: u8, rule: Rule, t0: Instant) -> Election {
    let mut t = timing();
    t.rule = rule;
    Election::new(id(n), t, t0)
}

const LOWEST3: Rule = Rule::Lowest { announcers: 3 };

/// Nodes 1..=n settled, each with its rule (from `rules`, cycling).
fn group_of(n: u8, rules: &[Rule], t0: Instant) -> (Vec<Election>, Instant) {
    let mut nodes: Vec<Election> = (1..=n)
        .map(|i| node_with(i, rules[usize::from(i - 1) % rules.len()], t0))
        .collect();
    let mut now = t0;
    run(&mut nodes, &mut now, Duration::from_secs(3), |_, _| {});
    assert_eq!(active_ids(&nodes), vec![id(1)]);
    (nodes, now)
}

/// Which nodes sent anything in `outputs`.
fn senders(outputs: &[(Uuid, Output)]) -> std::collections::BTreeSet<Uuid> {
    outputs
        .iter()
        .filter(|(_, o)| matches!(o, Output::Send(_)))
        .map(|(from, _)| *from)
        .collect()
}

fn ids(ns: &[u8]) -> std::collections::BTreeSet<Uuid> {
    ns.iter().map(|n| id(*n)).collect()
}

#[test]
fn the_default_rule_lets_the_three_lowest_announce() {
    assert_eq!(timing().rule, LOWEST3);
}

#[test]
fn in_a_settled_group_only_the_lowest_k_announce() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(8, &[LOWEST3], t0);
    let out = run(&mut nodes, &mut now, Duration::from_secs(5), |_, _| {});
    assert_eq!(senders(&out), ids(&[1, 2, 3]));
    // Every interval, not more often: five announcements each in five seconds.
    for n in [1, 2, 3] {
        assert_eq!(sends(&of(&out, id(n))).len(), 5, "node {n}");
    }
    let quiet: Vec<bool> = nodes.iter().map(Election::is_quiet).collect();
    assert_eq!(quiet, [false, false, false, true, true, true, true, true]);
}

#[test]
fn with_rule_all_every_node_announces_every_interval() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(6, &[Rule::All], t0);
    let out = run(&mut nodes, &mut now, Duration::from_secs(5), |_, _| {});
    assert_eq!(senders(&out), ids(&[1, 2, 3, 4, 5, 6]));
    assert!(nodes.iter().all(|n| !n.is_quiet()));
}

#[test]
fn announcers_is_how_many_lowest_announce() {
    for k in [2usize, 4, 5] {
        let t0 = Instant::now();
        let (mut nodes, mut now) = group_of(7, &[Rule::Lowest { announcers: k }], t0);
        let out = run(&mut nodes, &mut now, Duration::from_secs(4), |_, _| {});
        let expected: Vec<u8> = (1..=k as u8).collect();
        assert_eq!(senders(&out), ids(&expected), "k = {k}");
    }
}

#[test]
fn a_quiet_node_announces_again_when_a_lower_one_expires() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(6, &[LOWEST3], t0);
    nodes.remove(1); // node 2 crashes
    let out = run(&mut nodes, &mut now, Duration::from_secs(5), |_, _| {});
    // Node 4 is among the three lowest now; 5 and 6 hear it and stay quiet.
    let after = run(&mut nodes, &mut now, Duration::from_secs(3), |_, _| {});
    assert!(senders(&out).contains(&id(4)));
    assert_eq!(senders(&after), ids(&[1, 3, 4]));
    // Node 4 knew node 1 all along: it spoke as a settled member, never probed.
    assert!(sends(&of(&out, id(4))).iter().all(|a| !a.probe));
    assert_eq!(active_ids(&nodes), vec![id(1)]);
}

#[test]
fn the_active_nodes_successor_takes_over_within_member_ttl_and_a_tick() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(8, &[LOWEST3], t0);
    nodes.remove(0);
    let crashed = now;
    while active_ids(&nodes).is_empty() {
        run(&mut nodes, &mut now, TICK, |_, _| {});
        assert!(now - crashed <= Duration::from_secs(3) + TICK, "too slow");
    }
    assert_eq!(active_ids(&nodes), vec![id(2)]);
}

#[test]
fn a_quiet_node_never_takes_the_role_on_hearing_the_lower_ones_leave() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(6, &[LOWEST3], t0);
    // Long enough for the quiet ones to forget each other's start-up announcements.
    run(&mut nodes, &mut now, Duration::from_secs(4), |_, _| {});
    let mut lowest = nodes.drain(..3).collect::<Vec<_>>();
    let left = now + MS;
    for n in &mut lowest {
        n.leave(left);
        let bye = sends(&drain(n))[0];
        nodes
            .iter_mut()
            .for_each(|q| q.step(left, heard_as(n.id(), bye)));
    }
    assert!(active_ids(&nodes).is_empty(), "quiet nodes wait for a tick");
    // They knew only the announcers: each probes and settles before acting.
    let out = run(&mut nodes, &mut now, TICK, |_, _| {});
    for n in [4, 5, 6] {
        assert!(sends(&of(&out, id(n))).iter().all(|a| a.probe), "node {n}");
    }
    let mut ever = std::collections::BTreeSet::new();
    while now < left + Duration::from_secs(3) {
        run(&mut nodes, &mut now, TICK, |_, _| {});
        ever.extend(active_ids(&nodes));
    }
    assert_eq!(ever, ids(&[4]), "only the lowest left ever acts");
    assert!(now - left <= TICK + Duration::from_secs(3));
}

/// Which nodes of a settled group of six send something at the tick after `probe`.
fn who_answers(probe: Heard) -> (Vec<bool>, Vec<Election>) {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(6, &[LOWEST3], t0);
    nodes.iter_mut().for_each(|n| n.step(now, probe));
    drain_all(&mut nodes);
    // Before anyone's periodic announcement is due: only answers go out.
    now += TICK;
    nodes.iter_mut().for_each(|n| n.tick(now));
    let answered = nodes.iter_mut().map(|n| !drain(n).is_empty()).collect();
    (answered, nodes)
}

#[test]
fn a_newcomer_probe_is_answered_only_by_announcers() {
    let (answered, _) = who_answers(Heard {
        probe: true,
        ..heard(id(9))
    });
    assert_eq!(answered, [true, true, true, false, false, false]);
}

#[test]
fn an_observer_probe_is_answered_by_every_node() {
    let (answered, nodes) = who_answers(Heard {
        probe: true,
        leaving: true,
        ..heard(id(99))
    });
    assert_eq!(answered, [true; 6]);
    assert!(nodes[3].is_quiet(), "answering does not make it loud");
}

fn drain_all(nodes: &mut [Election]) {
    nodes.iter_mut().for_each(|n| {
        drain(n);
    });
}

#[test]
fn a_newcomer_with_a_high_id_settles_quiet_without_a_settled_announcement() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(5, &[LOWEST3], t0);
    nodes.push(node_with(9, LOWEST3, now));
    let out = run(&mut nodes, &mut now, Duration::from_secs(4), |_, _| {});
    let mine = sends(&of(&out, id(9)));
    assert!(mine.iter().all(|a| a.probe), "only its probe: {mine:?}");
    assert!(nodes[5].is_settled() && nodes[5].is_quiet());
    assert_eq!(active_ids(&nodes), vec![id(1)]);
}

#[test]
fn a_newcomer_lower_than_everyone_takes_over_and_the_third_goes_quiet() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(5, &[LOWEST3], t0);
    nodes.push(node_with(0, LOWEST3, now));
    run(&mut nodes, &mut now, Duration::from_secs(3), |_, _| {});
    assert_eq!(active_ids(&nodes), vec![id(0)]);
    let out = run(&mut nodes, &mut now, Duration::from_secs(3), |_, _| {});
    assert_eq!(senders(&out), ids(&[0, 1, 2]));
}

#[test]
fn a_withdrawn_announcer_is_replaced_by_the_next_quiet_node() {
    let t0 = Instant::now();
    let (mut nodes, mut now) = group_of(6, &[LOWEST3], t0);
    let since = now;
    let out = run(&mut nodes, &mut now, Duration::from_secs(5), |n, at| {
        let failing = (n.id() == id(2)).then_some(since);
        n.observe_health(at, failing);
    });
    let after = run(&mut nodes, &mut now, Duration::from_secs(3), |n, at| {
        let failing = (n.id() == id(2)).then_some(since);
        n.observe_health(at, failing);
    });
    assert!(senders(&out).contains(&id(4)));
    // Node 2 still says it is withdrawn (it knows only node 1 lower).
    assert_eq!(senders(&after), ids(&[1, 2, 3, 4]));
    assert_eq!(active_ids(&nodes), vec![id(1)]);
}

#[test]
fn a_mixed_group_of_old_and_new_rule_nodes_agrees_on_the_lowest() {
    let t0 = Instant::now();
    // Nodes 1, 3, 5 follow the old rule (they announce every interval).
    let (mut nodes, mut now) = group_of(6, &[Rule::All, LOWEST3], t0);
    let out = run(&mut nodes, &mut now, Duration::from_secs(3), |_, _| {});
    assert_eq!(senders(&out), ids(&[1, 2, 3, 5]));
    nodes.remove(0);
    let mut ever = std::collections::BTreeSet::new();
    while now < t0 + Duration::from_secs(12) {
        run(&mut nodes, &mut now, TICK, |_, _| {});
        ever.extend(active_ids(&nodes));
    }
    assert_eq!(ever, ids(&[2]), "the new-rule successor takes over, alone");
    nodes.remove(0);
    let mut ever = std::collections::BTreeSet::new();
    while now < t0 + Duration::from_secs(18) {
        run(&mut nodes, &mut now, TICK, |_, _| {});
        ever.extend(active_ids(&nodes));
    }
    assert_eq!(ever, ids(&[3]), "then the old-rule one");
}

#[test]
fn a_pause_makes_a_quiet_node_probe_again_like_a_newcomer() {
    let t0 = Instant::now();
    let (mut nodes, now) = group_of(5, &[LOWEST3], t0);
    let resumed = now + Duration::from_secs(5);
    nodes[4].tick(resumed);
    assert!(!nodes[4].is_quiet() && !nodes[4].is_settled());
    assert!(sends(&drain(&mut nodes[4])).iter().all(|a| a.probe));
}

mod rule_props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever is lost and whoever crashes: a quiet node is passive, and once the
        /// network is clean again the lowest live node alone acts and exactly the
        /// `k` lowest announce.
        #[test]
        fn quiet_nodes_are_passive_and_the_group_recovers(
            n in 3u8..10,
            k in 2usize..5,
            crashes in proptest::collection::vec(any::<bool>(), 10),
            losses in proptest::collection::vec(any::<bool>(), 64),
        ) {
            let rule = Rule::Lowest { announcers: k };
            let t0 = Instant::now();
            let mut nodes: Vec<Election> = (1..=n).map(|i| node_with(i, rule, t0)).collect();
            let mut now = t0;
            let mut round = 0usize;
            for step in 0..60 {
                now += TICK;
                nodes.iter_mut().for_each(|e| e.tick(now));
                if step == 20 {
                    let mut i = 0;
                    nodes.retain(|_| { i += 1; !crashes[i - 1] || i == n as usize });
                }
                let mut wire = Vec::new();
                for e in nodes.iter_mut() {
                    let from = e.id();
                    wire.extend(sends(&drain(e)).into_iter().map(|a| heard_as(from, a)));
                }
                for h in wire {
                    for e in nodes.iter_mut() {
                        round += 1;
                        if !losses[round % losses.len()] || step >= 40 {
                            e.step(now, h);
                        }
                    }
                }
                for e in &nodes {
                    prop_assert!(!(e.is_quiet() && e.role() == Role::Active));
                }
            }
            let out = run(&mut nodes, &mut now, Duration::from_secs(4), |_, _| {});
            let lowest: Vec<Uuid> = nodes.iter().map(Election::id).take(k).collect();
            prop_assert_eq!(active_ids(&nodes), vec![lowest[0]]);
            prop_assert_eq!(senders(&out), lowest.into_iter().collect());
        }
    }
}

fn departed(outputs: &[Output]) -> Vec<Uuid> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Departed { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// A member that goes silent is reported departed once, when it expires; one that says
/// `leaving` is not (it finished its batch), and neither is the node itself.
#[test]
fn only_members_that_went_silent_are_reported_departed() {
    let t0 = Instant::now();
    let mut e = settled_alone(id(5), t0);
    let t1 = t0 + Duration::from_secs(1);
    e.step(t1, heard(id(1)));
    e.step(t1, heard(id(2)));
    e.step(
        t1 + MS,
        Heard {
            leaving: true,
            ..heard(id(2))
        },
    );
    drain(&mut e);
    // Our own echo keeps coming; id(1) falls silent.
    let mut seen = Vec::new();
    for s in 2..=6 {
        let now = t0 + Duration::from_secs(s);
        e.step(now, heard(id(5)));
        e.tick(now);
        seen.extend(departed(&drain(&mut e)));
    }
    assert_eq!(seen, vec![id(1)]);
}

/// Connecting took longer than an interval: the node still settles for a whole interval
/// from the connect, however long ago it was built.
#[test]
fn a_node_slow_to_connect_settles_for_an_interval_after_connecting() {
    let t0 = Instant::now();
    let mut e = Election::new(id(1), timing(), t0);
    let connected = t0 + Duration::from_millis(2200);
    e.connected(connected);
    e.step(connected + MS, heard(id(1)));
    e.tick(connected + Duration::from_millis(250));
    assert!(!e.is_settled());
    assert_eq!(e.role(), Role::Passive);
    e.tick(connected + Duration::from_secs(1));
    assert!(e.is_settled());
    assert_eq!(e.role(), Role::Active);
}

/// Under the `lowest` rule a passive member may stop announcing: its expiry is reported
/// `quiet` (no warning); an active one's never is, nor anyone's under `all`.
#[test]
fn a_passive_member_falling_quiet_is_reported_quiet_where_the_rule_allows_it() {
    for (rule, quiet_passive) in [(LOWEST3, true), (Rule::All, false)] {
        let t0 = Instant::now();
        let mut e = node_with(5, rule, t0);
        e.step(t0 + MS, heard(id(5)));
        e.tick(t0 + Duration::from_secs(1));
        let t1 = t0 + Duration::from_secs(1);
        e.step(t1, heard(id(7)));
        e.step(
            t1,
            Heard {
                active: true,
                ..heard(id(1))
            },
        );
        drain(&mut e);
        let mut quiet = Vec::new();
        for s in 2..=6 {
            let now = t0 + Duration::from_secs(s);
            e.step(now, heard(id(5)));
            e.tick(now);
            quiet.extend(drain(&mut e).into_iter().filter_map(|o| match o {
                Output::Departed { id, quiet } => Some((id, quiet)),
                _ => None,
            }));
        }
        quiet.sort();
        assert_eq!(
            quiet,
            vec![(id(1), false), (id(7), quiet_passive)],
            "{rule:?}"
        );
    }
}
