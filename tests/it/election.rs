use chrono::{DateTime, Utc};
use timeoutd::election::Role;
use uuid::Uuid;

use crate::common::{Observer, PATIENCE, STAMP_SLACK, World, wait_for};

/// Three nodes started together: within the settle period exactly one is active, the
/// lowest id, and every node agrees on who that is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_elect_the_lowest_within_settle() {
    let mut world = World::new().await;
    // "Together" means within one settle period (an announce interval) of each other,
    // or a higher node settles alone and acts before the lowest is heard of. Starting
    // three daemons (connecting, migrating) takes seconds on a loaded machine.
    world.overrides.extend(
        [
            ("TIMEOUTD__ELECTION__ANNOUNCE_INTERVAL", "4s"),
            ("TIMEOUTD__ELECTION__MEMBER_TTL", "12s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    world.migrate().await;
    let settings = world.settings().election;
    let observer = Observer::new(&world.group).await;
    let (a, b, c) = tokio::join!(world.start(), world.start(), world.start());
    let nodes = vec![a, b, c];
    let lowest = nodes.iter().map(|n| n.node_id).min().expect("three");
    let one_active = || {
        let active: Vec<_> = nodes
            .iter()
            .filter(|n| *n.role.borrow() == Role::Active)
            .map(|n| n.node_id)
            .collect();
        active == vec![lowest]
    };
    wait_for(PATIENCE, "one active node", one_active).await;
    wait_for(PATIENCE, "all settled on the lowest", || {
        nodes.iter().all(|n| {
            let s = n.snapshot();
            s.settled && s.lowest == lowest && s.members.len() == 3
        })
    })
    .await;
    // The claim reaches the observer a moment after the role changed.
    wait_for(PATIENCE, "the observer hears the claim", || {
        observer.all().iter().any(|s| s.a.active)
    })
    .await;
    let seen = observer.all();
    let first_from = |id: Uuid| -> DateTime<Utc> {
        seen.iter()
            .filter(|s| s.a.node_id == id)
            .map(|s| s.a.sent_at)
            .min()
            .unwrap_or_else(|| panic!("node {id} never announced"))
    };
    let probes: Vec<DateTime<Utc>> = nodes.iter().map(|n| first_from(n.node_id)).collect();
    let spread = *probes.iter().max().expect("three") - *probes.iter().min().expect("three");
    let settle = chrono::Duration::from_std(settings.announce_interval).expect("interval");
    assert!(
        spread < settle,
        "the test did not start its nodes together: first announcements {spread} apart"
    );
    // Nobody but the lowest ever claimed to be active.
    let claims: Vec<_> = seen.iter().filter(|s| s.a.active).collect();
    assert!(
        !claims.is_empty() && claims.iter().all(|s| s.a.node_id == lowest),
        "{claims:?}"
    );
    // Measured by the lowest node's own clock, from its first announcement (the probe)
    // to its claim: it settles for an announce interval, then claims at a tick.
    let elected = claims.iter().map(|s| s.a.sent_at).min().expect("a claim") - first_from(lowest);
    let elected = elected.to_std().expect("claimed after its probe");
    println!("three nodes: the lowest active {elected:?} after its probe");
    assert!(
        elected <= settings.announce_interval + settings.tick + STAMP_SLACK,
        "claimed {elected:?} after its probe"
    );
    for n in nodes {
        n.stop().await;
    }
    world.cleanup().await;
}

/// A node whose first connection to the broker takes longer than an announce interval
/// (a slow broker, a loaded machine) still probes and settles for a whole interval
/// before it may act: it must have heard the group first. Beside an active node, a
/// higher newcomer never claims the role (before the fix, its first announcement was
/// already a claim); a lower one takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_slow_to_connect_settles_after_its_probe() {
    use crate::proxy::{Mode, Proxy};
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let first = world.start().await;
    crate::common::wait_active(&first).await;
    let proxy = Proxy::start(crate::common::amqp_addr().parse().expect("addr")).await;
    // Every answer from the broker 250 ms late: the handshake and the topology take
    // about two seconds, twice the announce interval.
    proxy.set(Mode::Delay(std::time::Duration::from_millis(250)));
    let mut env = world.env();
    env.push((
        "TIMEOUTD__AMQP__URL".to_owned(),
        format!("amqp://guest:guest@{}/%2f", proxy.addr),
    ));
    let settings = timeoutd::config::Settings::load_from(None, env).expect("settings");
    let interval = settings.election.announce_interval;
    let started = std::time::Instant::now();
    let second = timeoutd::daemon::start(settings, tokio_util::sync::CancellationToken::new())
        .await
        .expect("daemon starts");
    let probe = || {
        observer
            .all()
            .into_iter()
            .filter(|s| s.a.node_id == second.node_id)
            .map(|s| s.a.sent_at)
            .min()
    };
    wait_for(PATIENCE, "the newcomer's probe", || probe().is_some()).await;
    let connected = started.elapsed();
    // Long enough for the newcomer to settle and, if it is the lower, to take over.
    tokio::time::sleep(interval * 4).await;
    let probe = probe().expect("probe");
    let claims: Vec<DateTime<Utc>> = observer
        .all()
        .into_iter()
        .filter(|s| s.a.node_id == second.node_id && s.a.active)
        .map(|s| s.a.sent_at)
        .collect();
    println!(
        "newcomer connected after {connected:?}; {} is {} than the active node; its claims \
         after its probe: {:?}",
        second.node_id,
        if second.node_id > first.node_id {
            "higher"
        } else {
            "lower"
        },
        claims.iter().map(|c| *c - probe).collect::<Vec<_>>()
    );
    if second.node_id > first.node_id {
        assert!(claims.is_empty(), "a higher newcomer claimed the role");
    } else {
        // Lower: it takes over once it has heard the group — the active node's answer
        // to its probe ends its settling early (by design), so no interval is promised.
        assert!(!claims.is_empty(), "the lower newcomer took over");
    }
    second.stop().await;
    first.stop().await;
    world.cleanup().await;
}
