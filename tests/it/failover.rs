use std::time::{Duration, Instant};

use timeoutd::client::Expectation;

use crate::common::{Inbox, Observer, PATIENCE, Proc, STAMP_SLACK, World, lowest_active, wait_for};

/// kill -9 of the active daemon process: another takes over within member_ttl + tick of
/// the last announcement it heard from the dead node, and fires what comes due
/// afterwards, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_active_node_is_replaced_and_later_rows_fire() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let mut procs = Proc::group(&world, 3).await;
    let i = lowest_active(&observer, &procs, Instant::now() - Duration::from_secs(60)).await;
    let dead = procs.remove(i);
    let killed_at = Instant::now();
    dead.signal("KILL");
    let took_over = observer
        .await_first_after(killed_at, "another node active", |a| {
            a.active && a.node_id != dead.node_id
        })
        .await;
    // Measured by the nodes' own stamps, from the dead node's last announcement to the
    // successor's claim: neither the broker's delivery to this test nor its polling
    // counts. Contract: member_ttl + one tick.
    let last_words = observer
        .all()
        .iter()
        .filter(|s| s.a.node_id == dead.node_id)
        .map(|s| s.a.sent_at)
        .max()
        .expect("the dead node announced");
    let gap = (took_over.a.sent_at - last_words)
        .to_std()
        .expect("claimed after the dead node's last announcement");
    println!("kill -9 of the active node: another active {gap:?} after its last announcement");
    let e = world.settings().election;
    let bound = e.member_ttl + e.tick + STAMP_SLACK;
    assert!(gap <= bound, "takeover took {gap:?} (at most {bound:?})");
    let new_active = took_over.a.node_id;
    let mut ids = Vec::new();
    for n in 0..20 {
        let e = Expectation::new(&format!("after-kill-{n}"), "Reply", &inbox.queue)
            .due_in(Duration::from_millis(300));
        ids.push(world.expect(&e).await);
    }
    wait_for(PATIENCE, "rows due after the kill fired", || {
        inbox.len() >= 20
    })
    .await;
    let counts = inbox.counts();
    assert!(ids.iter().all(|id| counts.get(&id.to_string()) == Some(&1)));
    let senders: Vec<String> = inbox.all().iter().filter_map(|r| r.sender()).collect();
    assert_eq!(senders.len(), 20);
    assert!(
        senders.iter().all(|s| *s == new_active.to_string()),
        "{senders:?}"
    );
    drop(procs);
    drop(dead);
    world.cleanup().await;
}

/// SIGTERM of the active daemon process: it announces `leaving`, exits 0, and the next
/// node announces itself active within one tick of that `leaving`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_hands_over_within_a_tick() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let mut procs = Proc::group(&world, 2).await;
    let i = lowest_active(&observer, &procs, Instant::now() - Duration::from_secs(60)).await;
    let mut leaver = procs.remove(i);
    let asked = Instant::now();
    let status = leaver.terminate(&world).await;
    assert!(status.success(), "exit status {status:?}");
    let leaving = observer
        .await_first_after(asked, "leaving announced", |a| {
            a.leaving && a.node_id == leaver.node_id
        })
        .await;
    let next = observer
        .await_first_after(asked, "successor active", |a| {
            a.active && a.node_id == procs[0].node_id
        })
        .await;
    // By the nodes' own stamps, from the `leaving` to the successor's claim: the
    // successor acts at its next tick after hearing it, not a member_ttl later.
    let handover = (next.a.sent_at - leaving.a.sent_at)
        .to_std()
        .expect("claimed after the leaving");
    println!("graceful stop: successor active {handover:?} after the leaving announcement");
    let tick = world.settings().election.tick;
    assert!(handover <= tick + STAMP_SLACK, "handover took {handover:?}");
    assert!(leaver.logged("stopped"), "logged its stop");
    drop(procs);
    world.cleanup().await;
}
