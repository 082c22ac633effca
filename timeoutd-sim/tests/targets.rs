//! The seeded set CI runs: small groups, a few simulated minutes per scenario, the
//! issue's targets at that scale and the O(N) bound. Each run is deterministic.

use std::time::Duration;

use timeoutd_sim::{Attack, Report, Scenario, SimConfig, SimRule, run};

fn config(nodes: usize, rule: SimRule, scenario: Scenario, loss: f64, jitter_ms: u64) -> SimConfig {
    let mut cfg = SimConfig::new(nodes, rule, scenario, 42);
    cfg.duration = Duration::from_secs(180);
    cfg.links.loss = loss;
    cfg.links.jitter = Duration::from_millis(jitter_ms);
    cfg
}

fn sim(nodes: usize, rule: SimRule, scenario: Scenario, loss: f64, jitter_ms: u64) -> Report {
    run(&config(nodes, rule, scenario, loss, jitter_ms))
}

/// member_ttl + 2 ticks with the default timing.
const TAKEOVER_TARGET_S: f64 = 3.5;

#[test]
fn the_same_seed_gives_the_same_run() {
    let a = sim(10, SimRule::New, Scenario::Churn, 0.05, 50);
    let b = sim(10, SimRule::New, Scenario::Churn, 0.05, 50);
    assert_eq!(a, b);
}

#[test]
fn new_rule_traffic_grows_linearly_old_rule_quadratically() {
    for n in [3usize, 10, 30] {
        let new = sim(n, SimRule::New, Scenario::None, 0.0, 0);
        let old = sim(n, SimRule::Old, Scenario::None, 0.0, 0);
        let n = n as f64;
        // The three lowest announce, each to everyone.
        assert!(new.deliveries_per_interval <= 3.0 * n + 1.0, "{new:?}");
        assert!(
            (old.deliveries_per_interval - n * n).abs() <= 1.0,
            "{old:?}"
        );
    }
}

#[test]
fn without_faults_exactly_one_node_is_active() {
    for rule in [SimRule::Old, SimRule::New] {
        for n in [3, 10] {
            let r = sim(n, rule, Scenario::None, 0.0, 0);
            assert_eq!(r.zero_active_fraction, 0.0, "{r:?}");
            assert_eq!(r.multi_active_fraction, 0.0, "{r:?}");
        }
    }
}

/// Groups larger than the rest of this file, where each announcement can name only some
/// of the senders its node cannot vouch for yet: every node announcing (the old rule, as
/// in a group of earlier versions' rule), and five hundred replicas started within one
/// tick. Both converge within the warm-up (5 s) and stay converged.
#[test]
fn large_groups_converge_to_one_active_node() {
    let mut all = config(100, SimRule::Old, Scenario::None, 0.0, 0);
    all.duration = Duration::from_secs(10);
    let mut cold = config(500, SimRule::New, Scenario::None, 0.0, 0);
    cold.duration = Duration::from_secs(1);
    // A start order where naming a fixed few strangers left nodes active past 5 s.
    cold.seed = 1;
    for cfg in [all, cold] {
        let r = run(&cfg);
        assert_eq!(r.multi_active_fraction, 0.0, "{r:?}");
        assert_eq!(r.zero_active_fraction, 0.0, "{r:?}");
    }
}

#[test]
fn one_percent_loss_and_50ms_jitter_meet_the_targets() {
    for rule in [SimRule::Old, SimRule::New] {
        for n in [3, 10] {
            let r = sim(n, rule, Scenario::Loss, 0.01, 50);
            assert!(r.zero_active_fraction < 0.01, "{r:?}");
            assert!(r.multi_active_fraction < 0.001, "{r:?}");
            assert!(r.deliveries_per_interval <= 10.0 * n as f64, "{r:?}");
        }
    }
}

#[test]
fn five_percent_loss_stays_within_the_traffic_bound() {
    let r = sim(10, SimRule::New, Scenario::Loss, 0.05, 50);
    assert!(r.deliveries_per_interval <= 10.0 * 10.0, "{r:?}");
    assert!(r.zero_active_fraction < 0.01, "{r:?}");
}

#[test]
fn after_the_lowest_crashes_one_node_is_active_within_ttl_and_two_ticks() {
    for rule in [SimRule::Old, SimRule::New] {
        for n in [3, 10] {
            let r = sim(n, rule, Scenario::CrashLowest, 0.01, 50);
            assert!(r.takeovers >= 15, "{r:?}");
            assert!(r.takeover_p99_s <= TAKEOVER_TARGET_S, "{r:?}");
        }
    }
}

/// The new rule may not make a disrupted group worse than the old one (a little noise
/// allowed: the two runs take different random paths).
fn no_worse(new: &Report, old: &Report) {
    assert!(
        new.zero_active_fraction <= old.zero_active_fraction * 1.25 + 0.005,
        "{new:?}\nvs {old:?}"
    );
    assert!(
        new.multi_active_fraction <= old.multi_active_fraction * 1.25 + 0.001,
        "{new:?}\nvs {old:?}"
    );
}

#[test]
fn rolling_restarts_hand_over_in_time() {
    for n in [3, 10] {
        let old = sim(n, SimRule::Old, Scenario::RollingRestart, 0.01, 50);
        let new = sim(n, SimRule::New, Scenario::RollingRestart, 0.01, 50);
        for r in [&old, &new] {
            // A lost `leaving` costs a member_ttl; with three nodes the successor may
            // itself be settling after its own restart.
            assert!(r.takeover_p99_s <= TAKEOVER_TARGET_S, "{r:?}");
            assert!(r.zero_active_fraction < 0.03, "{r:?}");
            // Two active only while a lower newcomer's settled announcement travels
            // (or, when lost, for one interval).
            assert!(r.longest_multi_active_s <= 1.1, "{r:?}");
        }
        no_worse(&new, &old);
    }
}

#[test]
fn a_rolling_deploy_from_old_to_new_nodes_keeps_one_active_node() {
    let mut cfg = config(10, SimRule::New, Scenario::RollingRestart, 0.01, 50);
    cfg.old_nodes = 10;
    let mixed = run(&cfg);
    assert!(mixed.takeover_p99_s <= TAKEOVER_TARGET_S, "{mixed:?}");
    assert!(mixed.zero_active_fraction < 0.01, "{mixed:?}");
    // Two active only while a lower node's announcement travels, or for one interval
    // when it is lost. (Measured: more such stretches than with old nodes only, see
    // docs/design/simulator.md; bounded here, not hidden.)
    assert!(mixed.longest_multi_active_s <= 1.1, "{mixed:?}");
    assert!(mixed.multi_active_fraction < 0.01, "{mixed:?}");
}

#[test]
fn a_mixed_group_with_crashes_takes_over_in_time() {
    let mut cfg = config(10, SimRule::New, Scenario::CrashLowest, 0.01, 50);
    cfg.old_nodes = 5;
    let r = run(&cfg);
    assert!(r.takeover_p99_s <= TAKEOVER_TARGET_S, "{r:?}");
    assert!(r.longest_multi_active_s <= 1.1, "{r:?}");
}

#[test]
fn a_partitioned_lowest_node_is_replaced_in_time() {
    for rule in [SimRule::Old, SimRule::New] {
        let r = sim(10, rule, Scenario::PartitionLowest, 0.0, 0);
        assert!(r.takeover_p99_s <= TAKEOVER_TARGET_S, "{r:?}");
        // The cut-off node acts alone while cut off (by design): bounded by the cut.
        assert!(r.longest_multi_active_s <= 5.0, "{r:?}");
    }
}

#[test]
fn a_paused_lowest_node_is_replaced_in_time_and_takes_back_the_role_cleanly() {
    let old = sim(10, SimRule::Old, Scenario::PauseLowest, 0.01, 50);
    let new = sim(10, SimRule::New, Scenario::PauseLowest, 0.01, 50);
    for r in [&old, &new] {
        assert!(r.takeover_p99_s <= TAKEOVER_TARGET_S, "{r:?}");
        // Resumed, it settles again and takes the role back as the lowest id: two
        // active only while that announcement travels (one interval when it is lost).
        assert!(r.longest_multi_active_s <= 1.1, "{r:?}");
    }
    no_worse(&new, &old);
}

#[test]
fn churn_keeps_the_group_working_under_both_rules() {
    let old = sim(10, SimRule::Old, Scenario::Churn, 0.01, 50);
    let new = sim(10, SimRule::New, Scenario::Churn, 0.01, 50);
    for r in [&old, &new] {
        // A disruption every second on ten nodes: mostly the active node crashing or
        // pausing (zero active until the takeover), and lower newcomers taking over.
        assert!(r.zero_active_fraction < 0.2, "{r:?}");
        assert!(r.multi_active_fraction < 0.01, "{r:?}");
        assert!(r.longest_multi_active_s <= 1.1, "{r:?}");
    }
    assert!(new.deliveries_per_interval <= 10.0 * 10.0, "{new:?}");
}

/// Host clocks seconds or minutes apart change nothing at all: the same run with every
/// clock right measures the same (freshness is judged by each node's own monotonic
/// clock).
#[test]
fn skewed_clocks_change_nothing() {
    for scenario in [
        Scenario::None,
        Scenario::CrashLowest,
        Scenario::RollingRestart,
        Scenario::PauseLowest,
    ] {
        for skew in [5, 30, 600] {
            let right = config(10, SimRule::New, scenario, 0.01, 50);
            let mut skewed = right.clone();
            skewed.clock_skew = Duration::from_secs(skew);
            let (r, mut s) = (run(&right), run(&skewed));
            assert_eq!(s.head.clock_skew_s, skew as f64);
            s.head.clock_skew_s = 0.0;
            assert_eq!(s, r, "{scenario:?} skew ±{skew} s");
        }
    }
}

/// An attacker forging announcements and sending copies of real ones again (proof and
/// all, 2 × member_ttl + an interval or more after it captured them: news that old is
/// stale everywhere) every 100 ms, against members whose clocks are right or up to ten
/// minutes off, whether members prove membership by broker user or by a group secret:
/// nothing it sends counts anywhere. Without disruptions the run measures exactly as
/// the same run without it. With crashes and restarts, copies of announcements of nodes
/// that started or died before a member did are strangers to that member, which
/// answers them (once each): the traffic grows and the run takes other random paths,
/// but it meets the same targets and is no worse than without the attacker.
#[test]
fn forged_and_replayed_announcements_change_nothing() {
    for scenario in [
        Scenario::None,
        Scenario::CrashLowest,
        Scenario::RollingRestart,
    ] {
        for secret in [false, true] {
            for skew in [0, 600] {
                let mut quiet = config(10, SimRule::New, scenario, 0.01, 50);
                quiet.secret = secret;
                quiet.clock_skew = Duration::from_secs(skew);
                let mut attacked = quiet.clone();
                attacked.attack = Attack::ForgeAndReplay;
                let (q, mut a) = (run(&quiet), run(&attacked));
                let what = format!("{scenario:?} secret={secret} skew=±{skew} s");
                assert!(a.rejected > q.rejected + 1000, "the attack ran: {a:?}");
                assert_eq!(a.attacker_counted, 0, "{what}: {a:?}");
                if scenario == Scenario::None {
                    a.rejected = q.rejected;
                    a.unvouched = q.unvouched;
                    a.head.attack = Attack::None;
                    assert_eq!(a, q, "{what}");
                    continue;
                }
                no_worse(&a, &q);
                assert!(a.takeover_p99_s <= TAKEOVER_TARGET_S, "{what}: {a:?}");
                assert!(a.longest_multi_active_s <= 1.1, "{what}: {a:?}");
                assert!(a.deliveries_per_interval <= 10.0 * 10.0, "{what}: {a:?}");
            }
        }
    }
}
