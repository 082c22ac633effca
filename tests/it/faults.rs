//! Fault injection against the real services. Each scenario inserts a known set of
//! expectations, injects its fault while they come due, and counts what matters: lost,
//! fired early, duplicates (all with the same message_id), and the longest stretch in
//! which no node claimed the role. One summary line per scenario.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use timeoutd::client::{self, Expectation};

use crate::common::{
    Inbox, Observer, PATIENCE, Proc, STAMP_SLACK, World, amqp_addr, pg_addr, wait_for,
    wait_for_async,
};
use crate::proxy::{Mode, Proxy};

struct Scenario {
    name: &'static str,
    /// Measure gaps between active claims from the fault's start, not from the last
    /// claim before it (for outages during which nobody may act, by design).
    gaps_from_since: bool,
    world: World,
    inbox: Inbox,
    observer: Observer,
    deadlines: HashMap<String, DateTime<Utc>>,
}

#[derive(Debug)]
struct Summary {
    rows: usize,
    lost: usize,
    early: usize,
    duplicates: usize,
    max_active_gap: Duration,
}

impl Scenario {
    async fn new(name: &'static str, world: World) -> Self {
        world.migrate().await;
        let observer = Observer::new(&world.group).await;
        Self {
            name,
            gaps_from_since: false,
            world,
            inbox: Inbox::new().await,
            observer,
            deadlines: HashMap::new(),
        }
    }

    /// `n` rows due evenly from `first` to `first + spread` from now, in one transaction.
    async fn insert(&mut self, n: usize, first: Duration, spread: Duration) {
        let start = Utc::now() + chrono::Duration::from_std(first).expect("duration");
        let mut tx = self.world.pool.begin().await.expect("tx");
        for i in 0..n {
            let offset = spread.mul_f64(i as f64 / n as f64);
            let due = start + chrono::Duration::from_std(offset).expect("duration");
            let e = Expectation::new(&format!("{}-{i}", self.name), "Reply", &self.inbox.queue)
                .due_at(due);
            client::expect(&mut tx, &self.world.schema, &e)
                .await
                .expect("insert");
            self.deadlines.insert(e.id.to_string(), due);
        }
        tx.commit().await.expect("commit");
    }

    async fn wait_firing(&self, at_least: usize) {
        wait_for(PATIENCE, "TimeOuts flowing", || {
            self.inbox.len() >= at_least
        })
        .await;
    }

    /// Wait until every row fired and the table is empty, then count and print.
    async fn finish(self, since: Instant) -> Summary {
        let ids: Vec<String> = self.deadlines.keys().cloned().collect();
        wait_for(PATIENCE * 2, "every row received", || {
            let counts = self.inbox.counts();
            ids.iter().all(|id| counts.contains_key(id))
        })
        .await;
        wait_for_async(PATIENCE, "table empty", || async {
            self.world.count("true").await == 0
        })
        .await;
        let summary = self.count(since);
        println!(
            "fault={} rows={} lost={} early={} duplicates={} (same message_id) \
             longest_gap_between_active_claims={:.2}s",
            self.name,
            summary.rows,
            summary.lost,
            summary.early,
            summary.duplicates,
            summary.max_active_gap.as_secs_f64()
        );
        assert_eq!(summary.lost, 0, "{summary:?}");
        assert_eq!(summary.early, 0, "{summary:?}");
        // Contract bound for a new active node (member_ttl + tick + settle), plus one
        // announce interval because the gap is measured between two nodes' periodic
        // claims.
        let e = self.world.settings().election;
        let bound = e.member_ttl + e.tick + e.announce_interval * 2 + STAMP_SLACK;
        assert!(
            summary.max_active_gap <= bound,
            "{summary:?} (at most {bound:?})"
        );
        self.world.cleanup().await;
        summary
    }

    /// SIGTERM `node` and check what it left: exit 0 in time, and of `total` rows every
    /// one either received once and gone, or still there and never received. Returns
    /// (fired, remaining).
    async fn terminate(&self, node: &mut Proc, total: usize) -> (usize, usize) {
        let status = node.terminate(&self.world).await;
        assert!(status.success(), "{status:?}");
        // Let in-flight deliveries land before counting: wait until the count stops moving.
        let mut seen = usize::MAX;
        wait_for_async(PATIENCE, "deliveries settle", || {
            let before = seen;
            seen = self.inbox.len();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                before == seen
            }
        })
        .await;
        let remaining = remaining_ids(&self.world).await;
        let counts = self.inbox.counts();
        assert!(counts.values().all(|n| *n == 1), "no duplicates");
        assert!(
            remaining.iter().all(|id| !counts.contains_key(id)),
            "none both"
        );
        assert_eq!(
            counts.len() + remaining.len(),
            total,
            "fired + remaining = all"
        );
        (counts.len(), remaining.len())
    }

    fn count(&self, since: Instant) -> Summary {
        let got = self.inbox.all();
        let mut per_id: HashMap<String, usize> = HashMap::new();
        let mut early = 0;
        for r in &got {
            let id = r.properties.message_id().as_ref().expect("id").to_string();
            // A duplicate is recognisable only if it carries the same id in both places.
            assert_eq!(r.body["expectation_id"].as_str(), Some(id.as_str()));
            if self.deadlines.get(&id).is_some_and(|due| r.at < *due) {
                early += 1;
            }
            *per_id.entry(id).or_default() += 1;
        }
        Summary {
            rows: self.deadlines.len(),
            lost: self
                .deadlines
                .keys()
                .filter(|id| !per_id.contains_key(*id))
                .count(),
            early,
            duplicates: per_id.values().map(|n| n - 1).sum(),
            max_active_gap: self.max_active_gap(since),
        }
    }

    /// Longest time between two consecutive `active` claims (any node) after `since`, by
    /// the claims' own `sent_at`: how late they reached this test does not count.
    fn max_active_gap(&self, since: Instant) -> Duration {
        let since = Utc::now() - chrono::Duration::from_std(since.elapsed()).expect("since");
        let mut claims: Vec<DateTime<Utc>> = self
            .observer
            .all()
            .into_iter()
            .filter(|s| s.a.active)
            .map(|s| s.a.sent_at)
            .collect();
        claims.sort_unstable();
        let mut last = claims
            .iter()
            .copied()
            .rfind(|t| *t <= since && !self.gaps_from_since)
            .unwrap_or(since);
        let mut gap = chrono::Duration::zero();
        for t in claims.into_iter().filter(|t| *t > since) {
            gap = gap.max(t - last);
            last = t;
        }
        gap.max(Utc::now() - last).to_std().unwrap_or_default()
    }
}

/// The common opening: `nodes` daemons, an active one (its index returned), `rows`
/// expectations due from 1 s on over `spread`, and TimeOuts already flowing.
async fn opened(
    name: &'static str,
    world: World,
    nodes: usize,
    rows: usize,
    spread: Duration,
) -> (Scenario, Vec<Proc>, usize) {
    let mut s = Scenario::new(name, world).await;
    let procs = Proc::group(&s.world, nodes).await;
    let i = active(&s, &procs).await;
    s.insert(rows, Duration::from_secs(1), spread).await;
    s.wait_firing(rows / 15).await;
    (s, procs, i)
}

fn amqp_url(proxy: SocketAddr) -> String {
    format!("amqp://guest:guest@{proxy}/%2f")
}

/// A world whose `var` URL points at a proxy in front of `upstream`.
async fn behind_proxy(
    upstream: &str,
    var: &str,
    url: impl Fn(SocketAddr) -> String,
) -> (Proxy, World) {
    let proxy = Proxy::start(upstream.parse().expect("addr")).await;
    let mut world = World::new().await;
    world.overrides.push((var.to_owned(), url(proxy.addr)));
    (proxy, world)
}

/// Index of the node that claimed the role most recently.
async fn active(s: &Scenario, procs: &[Proc]) -> usize {
    let mut found = None;
    wait_for(PATIENCE, "an active node", || {
        found = s
            .observer
            .all()
            .into_iter()
            .rev()
            .find(|x| x.a.active)
            .and_then(|x| procs.iter().position(|p| p.node_id == x.a.node_id));
        found.is_some()
    })
    .await;
    found.expect("active")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_active_node_mid_scan() {
    let (s, mut procs, i) = opened(
        "kill-9",
        World::new().await,
        3,
        3000,
        Duration::from_secs(3),
    )
    .await;
    let victim = procs.remove(i);
    let since = Instant::now();
    victim.signal("KILL");
    s.finish(since).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_and_sigcont_of_the_active_node() {
    let (s, procs, i) = opened(
        "sigstop",
        World::new().await,
        2,
        1500,
        Duration::from_secs(5),
    )
    .await;
    let since = Instant::now();
    procs[i].signal("STOP");
    let other = procs[1 - i].node_id;
    s.observer
        .await_first_after(since, "the other node takes over", |a| {
            a.active && a.node_id == other
        })
        .await;
    // Keep it stopped for longer than member_ttl, so that its view is really stale.
    while since.elapsed() < Duration::from_millis(3500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    procs[i].signal("CONT");
    // Resumed after more than member_ttl: it must notice the pause, not act on it.
    wait_for(PATIENCE, "the resumed node notices its pause", || {
        procs[i].logged("view is stale")
    })
    .await;
    s.finish(since).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_closes_the_active_nodes_connection() {
    let (s, procs, i) = opened(
        "amqp-close",
        World::new().await,
        2,
        1500,
        Duration::from_secs(4),
    )
    .await;
    let since = Instant::now();
    close_amqp_connection(procs[i].node_id).await;
    wait_for(PATIENCE, "reconnected", || {
        procs[i].logged("reconnected to RabbitMQ") || procs[i].logged("connection lost")
    })
    .await;
    s.finish(since).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_backends_of_the_active_node_terminated() {
    let (s, procs, i) = opened(
        "pg-terminate",
        World::new().await,
        2,
        1500,
        Duration::from_secs(4),
    )
    .await;
    let since = Instant::now();
    let mut killed = 0;
    for _ in 0..5 {
        killed += terminate_backends(&s.world, procs[i].node_id).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(killed > 0, "terminated at least one backend");
    s.finish(since).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_proxy_cuts_and_refuses_the_broker() {
    let (proxy, world) = behind_proxy(&amqp_addr(), "TIMEOUTD__AMQP__URL", amqp_url).await;
    let (s, procs, _) = opened("tcp-cut", world, 2, 1500, Duration::from_secs(5)).await;
    let since = Instant::now();
    proxy.set(Mode::Refuse);
    proxy.cut();
    let outage = Instant::now();
    wait_for(PATIENCE, "both nodes notice", || {
        procs.iter().all(|p| p.logged("cannot connect to RabbitMQ"))
    })
    .await;
    while outage.elapsed() < Duration::from_millis(1500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.set(Mode::Pass);
    wait_for(PATIENCE, "both reconnect", || {
        procs.iter().all(|p| p.logged("reconnected to RabbitMQ"))
    })
    .await;
    s.finish(since).await;
}

/// Postgres unreachable for less than member_ttl (refused and cut by a proxy): scans fail
/// and are retried, the node keeps its role and its announcements, /readyz names the
/// database, and everything due fires once it is back. (Longer outages: see below.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_keeps_the_role_and_fires_after() {
    let pg_url = |a| format!("postgres://postgres@{a}/postgres");
    let (proxy, mut world) = behind_proxy(&pg_addr(), "TIMEOUTD__POSTGRES__URL", pg_url).await;
    // The outage ends once this test has seen its effects, which takes a loaded machine
    // seconds: a member_ttl of 10 s keeps it the short outage it is meant to be.
    world.overrides.push((
        "TIMEOUTD__ELECTION__MEMBER_TTL".to_owned(),
        "10s".to_owned(),
    ));
    let member_ttl = world.settings().election.member_ttl;
    let (s, procs, _) = opened("pg-outage", world, 1, 1500, Duration::from_secs(5)).await;
    let node = &procs[0];
    let since = Instant::now();
    proxy.set(Mode::Refuse);
    proxy.cut();
    wait_for(PATIENCE, "scan failures logged", || {
        node.logged("scan failed")
    })
    .await;
    let addr = node.http_addr;
    let (code, body) = crate::http::get(addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains("postgres"), "{body}");
    while since.elapsed() < Duration::from_millis(1500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.set(Mode::Pass);
    let outage = since.elapsed();
    assert!(
        outage < member_ttl,
        "the test could not end the outage within member_ttl: {outage:?}"
    );
    s.wait_firing(1400).await;
    assert!(
        !node.logged("\"role\":\"passive\"") && !node.logged("withdrawn"),
        "kept the role through a short outage"
    );
    s.finish(since).await;
}

/// The "suicidal snail": every byte from the broker arrives 2 s late, so the node's own
/// announcements come back later than max_lag. It steps down, names the lag, and exits
/// with code 3 once the lag has lasted max_lag_exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_announcements_lag_steps_down_and_exits() {
    let (proxy, mut world) = behind_proxy(&amqp_addr(), "TIMEOUTD__AMQP__URL", amqp_url).await;
    world.overrides.extend([
        ("TIMEOUTD__ELECTION__MAX_LAG".to_owned(), "1s".to_owned()),
        (
            "TIMEOUTD__ELECTION__MAX_LAG_EXIT".to_owned(),
            "4s".to_owned(),
        ),
    ]);
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let mut node = Proc::spawn(&world).await;
    wait_for(PATIENCE, "active", || {
        observer.all().iter().any(|s| s.a.active)
    })
    .await;
    proxy.set(Mode::Delay(Duration::from_secs(2)));
    wait_for(PATIENCE, "steps down naming the lag", || {
        node.logged("own announcements arrive too late")
    })
    .await;
    let status = tokio::time::timeout(PATIENCE, node.child.wait())
        .await
        .expect("exits while lagging")
        .expect("wait");
    assert_eq!(status.code(), Some(3), "{status:?}");
    assert!(node.logged("lagging for too long"));
    println!("fault=lag: stepped down and exited with code 3");
    world.cleanup().await;
}

/// SIGTERM in the middle of a large burst: the batch in flight completes (never half
/// deleted), `leaving` is announced, the process exits 0; every row is either fired and
/// gone or still there, never both, never twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_large_scan_loses_and_duplicates_nothing() {
    let mut s = Scenario::new("sigterm-burst", World::new().await).await;
    s.insert(20_000, Duration::from_millis(500), Duration::ZERO)
        .await;
    let observer_since = Instant::now();
    let mut node = Proc::spawn(&s.world).await;
    s.wait_firing(1000).await;
    let (fired, remaining) = s.terminate(&mut node, 20_000).await;
    s.observer
        .await_first_after(observer_since, "announced leaving", |a| {
            a.leaving && a.node_id == node.node_id
        })
        .await;
    println!(
        "fault=sigterm-burst rows=20000 fired={fired} remaining={remaining} duplicates=0 exit=0"
    );
    s.world.cleanup().await;
}

async fn remaining_ids(world: &World) -> Vec<String> {
    let sql = format!("SELECT id::text FROM {}.expected_messages", world.schema);
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(&world.pool)
        .await
        .expect("ids")
}

async fn terminate_backends(world: &World, node: uuid::Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = $1",
    )
    .bind(format!("timeoutd-{node}"))
    .fetch_one(&world.pool)
    .await
    .expect("terminate")
}

/// Close the node's AMQP connection from the broker side (`rabbitmqctl`), identified by
/// its connection name.
async fn close_amqp_connection(node: uuid::Uuid) {
    let out = crate::common::rabbitmqctl()
        .args([
            "-q",
            "--no-table-headers",
            "list_connections",
            "pid",
            "client_properties",
        ])
        .output()
        .await
        .expect("rabbitmqctl");
    let name = format!("timeoutd {node}");
    let listing = String::from_utf8_lossy(&out.stdout);
    let pid = listing
        .lines()
        .find(|l| l.contains(&name))
        .and_then(|l| l.split('\t').next())
        .expect("the node's connection")
        .to_owned();
    let ok = crate::common::rabbitmqctl()
        .args(["-q", "close_connection", &pid, "fault injection"])
        .status()
        .await
        .expect("rabbitmqctl")
        .success();
    assert!(ok, "close_connection");
}

fn pg_url(proxy: SocketAddr) -> String {
    format!("postgres://postgres@{proxy}/postgres")
}

/// `n` daemons, each reaching `upstream` through a proxy of its own (`var` is the URL's
/// variable): one node can be cut off alone.
async fn each_behind_proxy(
    world: &World,
    n: usize,
    upstream: &str,
    var: &str,
    url: impl Fn(SocketAddr) -> String,
) -> (Vec<Proxy>, Vec<Proc>) {
    let mut proxies = Vec::new();
    let mut procs = Vec::new();
    for _ in 0..n {
        let proxy = Proxy::start(upstream.parse().expect("addr")).await;
        let env = [(var.to_owned(), url(proxy.addr))];
        procs.push(Proc::spawn_with(world, &env).await);
        proxies.push(proxy);
    }
    (proxies, procs)
}

/// When a node other than `victim` first sent a TimeOut after `since`, by its stamp.
fn first_fired_by_another(
    s: &Scenario,
    victim: uuid::Uuid,
    since: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let victim = victim.to_string();
    s.inbox
        .all()
        .iter()
        .filter(|r| r.sender().is_some_and(|n| n != victim))
        .map(|r| r.fired_at())
        .filter(|at| *at >= since)
        .min()
}

/// The active node loses Postgres (its own proxy refuses and cuts), the others keep it:
/// the active node withdraws after member_ttl, another takes over and fires, nothing is
/// lost or early; duplicates only for the rows the cut node had published but could not
/// commit. Back in touch, the cut node rejoins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_node_cut_from_postgres_alone_hands_over() {
    let world = World::new().await;
    let mut s = Scenario::new("pg-cut-active", world).await;
    let (proxies, procs) =
        each_behind_proxy(&s.world, 3, &pg_addr(), "TIMEOUTD__POSTGRES__URL", pg_url).await;
    let i = active(&s, &procs).await;
    s.insert(2000, Duration::from_secs(1), Duration::from_secs(9))
        .await;
    s.wait_firing(150).await;
    let victim = procs[i].node_id;
    let (since, since_utc) = (Instant::now(), Utc::now());
    proxies[i].set(Mode::Refuse);
    proxies[i].cut();
    wait_for(PATIENCE, "another node fires", || {
        first_fired_by_another(&s, victim, since_utc).is_some()
    })
    .await;
    let working = first_fired_by_another(&s, victim, since_utc).expect("fired") - since_utc;
    let working = working.to_std().expect("after the cut");
    assert!(
        procs[i].logged("withdrawn: not a candidate"),
        "the cut node withdrew"
    );
    proxies[i].set(Mode::Pass);
    wait_for(PATIENCE, "the cut node rejoins", || {
        procs[i].logged("rejoining: probing the group")
    })
    .await;
    let e = s.world.settings().election;
    let summary = s.finish(since).await;
    println!(
        "fault=pg-cut-active time_to_working_active={:.2}s duplicates={} (cause: TimeOuts the cut \
         node had confirmed but could not commit)",
        working.as_secs_f64(),
        summary.duplicates
    );
    // Until the next node's first TimeOut, by its stamp: a tick until a statement of the
    // cut node fails, member_ttl of failing until it withdraws, a tick to notice, a tick
    // for the next node to claim the role.
    let bound = e.member_ttl + e.tick * 3 + STAMP_SLACK;
    assert!(working <= bound, "{working:?} (at most {bound:?})");
}

/// Postgres down for every node: all withdraw, nobody claims the role and nobody flaps
/// while it is down; once it is back they rejoin and exactly one fires everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_for_everyone_nobody_flaps() {
    let (proxy, world) = behind_proxy(&pg_addr(), "TIMEOUTD__POSTGRES__URL", pg_url).await;
    let (s, procs, _) = opened("pg-down-all", world, 2, 800, Duration::from_secs(4)).await;
    proxy.set(Mode::Refuse);
    proxy.cut();
    wait_for(PATIENCE, "both withdraw", || {
        procs.iter().all(|p| p.logged("withdrawn: not a candidate"))
    })
    .await;
    // Both have logged their withdrawal: a claim sent after this (by its own stamp,
    // however late it reaches the observer) was made while withdrawn.
    let quiet_from = Utc::now();
    // Long enough for a flap to show: a node that rejoined would settle and claim.
    tokio::time::sleep(s.world.settings().election.member_ttl * 2).await;
    let claims = s
        .observer
        .all()
        .iter()
        .filter(|x| x.a.sent_at >= quiet_from && x.a.active)
        .count();
    assert_eq!(
        claims, 0,
        "nobody claims the role while the database is down"
    );
    assert!(
        procs.iter().all(|p| !p.logged("rejoining")),
        "nobody rejoins while the database is down"
    );
    let addr = procs[0].http_addr;
    let (code, body) = crate::http::get(addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(
        body.contains("withdrawn") || body.contains("postgres"),
        "{body}"
    );
    let (_, metrics) = crate::http::get(addr, "/metrics").await;
    let gauge = |name| crate::http::metric(&metrics, name);
    assert_eq!(gauge("timeoutd_candidate{"), Some(0.0), "{metrics}");
    assert_eq!(gauge("timeoutd_active{"), Some(0.0), "{metrics}");
    proxy.set(Mode::Pass);
    wait_for(PATIENCE, "both rejoin", || {
        procs
            .iter()
            .all(|p| p.logged("rejoining: probing the group"))
    })
    .await;
    let back = Instant::now();
    s.observer
        .await_first_after(back, "one active again", |a| a.active)
        .await;
    println!("fault=pg-down-all: both withdrew, 0 active claims while down, both rejoined");
    // The outage itself is a gap by design: measure from the recovery.
    let mut s = s;
    s.gaps_from_since = true;
    s.finish(back).await;
}

/// The lowest (active) node's broker link turns slow: its own announcements come back
/// late, it withdraws at once, and the next node is active within a tick of hearing the
/// withdrawal — not after member_ttl. When the link recovers it rejoins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_lowest_node_is_passed_over_at_once() {
    let mut world = World::new().await;
    world.overrides.extend([
        ("TIMEOUTD__ELECTION__MAX_LAG".to_owned(), "1s".to_owned()),
        (
            "TIMEOUTD__ELECTION__MAX_LAG_EXIT".to_owned(),
            "20s".to_owned(),
        ),
    ]);
    let mut s = Scenario::new("lag-lowest", world).await;
    let (proxies, procs) =
        each_behind_proxy(&s.world, 2, &amqp_addr(), "TIMEOUTD__AMQP__URL", amqp_url).await;
    let i = active(&s, &procs).await;
    let (victim, other) = (procs[i].node_id, procs[1 - i].node_id);
    s.insert(800, Duration::from_secs(1), Duration::from_secs(8))
        .await;
    s.wait_firing(50).await;
    let since = Instant::now();
    proxies[i].set(Mode::Delay(Duration::from_secs(2)));
    let withdrawn = s
        .observer
        .await_first_after(since, "the lagging node withdraws", |a| {
            a.withdrawn && a.node_id == victim
        })
        .await;
    let took = s
        .observer
        .await_first_after(since, "the next node takes over", |a| {
            a.active && a.node_id == other
        })
        .await;
    // By the nodes' own stamps: how late either announcement reached this test does
    // not count.
    let no_candidate = (took.a.sent_at - withdrawn.a.sent_at)
        .to_std()
        .unwrap_or_default();
    let withdrawn = withdrawn.at;
    proxies[i].set(Mode::Pass);
    wait_for(PATIENCE, "the node rejoins when on time", || {
        procs[i].logged("rejoining: probing the group")
    })
    .await;
    let tick = s.world.settings().election.tick;
    s.finish(since).await;
    println!(
        "fault=lag-lowest: withdrew {:.2}s after the slowdown; next node active {:.0} ms after \
         the withdrawal",
        (withdrawn - since).as_secs_f64(),
        no_candidate.as_secs_f64() * 1000.0
    );
    // The next node claims at its next tick after hearing the withdrawal, not a
    // member_ttl later.
    assert!(no_candidate <= tick + STAMP_SLACK, "{no_candidate:?}");
}

/// SIGTERM while a batch waits for slow confirms (every byte from the broker 700 ms
/// late), with a `shutdown.grace` that allows for them: the batch stops sending, awaits
/// what it sent, commits; exit 0. Nothing is both received and still in the table,
/// nothing twice; a node started afterwards fires the rest, each exactly once. (With the
/// default grace such a broker is given up on: see `stopping`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_slow_batch_in_flight_commits_it() {
    let (proxy, mut world) = behind_proxy(&amqp_addr(), "TIMEOUTD__AMQP__URL", amqp_url).await;
    world.overrides.extend(
        [
            ("TIMEOUTD__SHUTDOWN__GRACE", "5s"),
            ("TIMEOUTD__SHUTDOWN__TIMEOUT", "10s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let mut s = Scenario::new("sigterm-slow-batch", world).await;
    s.insert(3000, Duration::from_millis(500), Duration::ZERO)
        .await;
    proxy.set(Mode::Delay(Duration::from_millis(700)));
    let mut node = Proc::spawn(&s.world).await;
    s.wait_firing(600).await;
    let (fired, remaining) = s.terminate(&mut node, 3000).await;
    assert!(
        !node.logged("not committed"),
        "the batch in flight committed"
    );
    println!("fault=sigterm-slow-batch: fired={fired} remaining={remaining} exit=0");
    proxy.set(Mode::Pass);
    let _rest = Proc::spawn(&s.world).await;
    s.finish(Instant::now()).await;
}

/// A slow broker (every byte back 600 ms late, so opening a channel takes 1.2 s and a
/// confirm 0.6 s) and rows spread over 40 exchanges nobody has published to yet, with
/// `postgres.statement_timeout` 2 s: published one by one, the first batch's pilots
/// would outlive the transaction. The batch budget (¾ of it, sends stop a confirm timeout
/// earlier) leaves what does not fit for the next batch: every batch commits, every row
/// arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_cannot_make_a_batch_outlive_its_transaction() {
    let (proxy, mut world) = behind_proxy(&amqp_addr(), "TIMEOUTD__AMQP__URL", amqp_url).await;
    world.overrides.extend(
        [
            ("TIMEOUTD__POSTGRES__STATEMENT_TIMEOUT", "2s"),
            ("TIMEOUTD__AMQP__CONFIRM_TIMEOUT", "1s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let mut s = Scenario::new("slow-broker-budget", world).await;
    let exchanges = bind_exchanges(&s, 40).await;
    let node = Proc::spawn(&s.world).await;
    active(&s, std::slice::from_ref(&node)).await;
    let due = Utc::now() + chrono::Duration::seconds(2);
    let mut tx = s.world.pool.begin().await.expect("tx");
    for (i, x) in exchanges.iter().cycle().take(200).enumerate() {
        let e = Expectation::new(&format!("budget-{i}"), "Reply", "r")
            .exchange(x)
            .due_at(due);
        client::expect(&mut tx, &s.world.schema, &e)
            .await
            .expect("insert");
        s.deadlines.insert(e.id.to_string(), due);
    }
    tx.commit().await.expect("commit");
    proxy.set(Mode::Delay(Duration::from_millis(600)));
    let since = Instant::now();
    let summary = s.finish(since).await;
    assert_eq!(summary.duplicates, 0, "{summary:?}");
    assert!(!node.logged("not committed"), "every batch committed");
    assert!(
        !node.logged("scan failed"),
        "no batch outlived its transaction"
    );
    println!("fault=slow-broker-budget: 200 rows over 40 new exchanges, every batch committed");
}

/// `n` auto-delete topic exchanges, each bound to the scenario's queue with `#`.
async fn bind_exchanges(s: &Scenario, n: usize) -> Vec<String> {
    let mut names = Vec::new();
    for k in 0..n {
        let name = format!("budget-{}-{k}", s.world.group);
        s.inbox.bind_new_exchange(&name, "#").await;
        names.push(name);
    }
    names
}

/// A node cut from Postgres stops consuming the delay ingress: after holding its batch
/// for a while it gives it back, and the messages wait in the quorum queue (none lost,
/// none dropped after returned deliveries); when the database is back they are stored
/// and delivered, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_postgres_stops_consuming_delayed_messages_and_resumes() {
    use lapin::BasicProperties;
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};

    use crate::delayed::{headers, publish, publisher};
    let (proxy, mut world) = behind_proxy(&pg_addr(), "TIMEOUTD__POSTGRES__URL", pg_url).await;
    let target = format!("t.cut.{}", world.group);
    world.overrides.push((
        "TIMEOUTD__DELAY__TARGET_EXCHANGE".to_owned(),
        target.clone(),
    ));
    world.migrate().await;
    let inbox = crate::common::Inbox::on_exchange(&target, "#").await;
    let node = world.start().await;
    let consuming =
        |n: &timeoutd::daemon::Handle| n.snapshot().ingress.is_some_and(|i| i.consuming);
    wait_for(PATIENCE, "consuming", || consuming(&node)).await;
    proxy.set(Mode::Refuse);
    proxy.cut();
    let (_conn, ch) = publisher().await;
    for i in 0..50 {
        let props = BasicProperties::default()
            .with_message_id(format!("cut-{i}").into())
            .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(200))]));
        publish(&ch, &world.ingress(), "k", props, b"x").await;
    }
    wait_for(PATIENCE, "ingress paused", || !consuming(&node)).await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let waiting = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    wait_for_async(PATIENCE, "50 messages back in the queue", || {
        let (ch, queue, waiting) = (ch.clone(), world.ingress(), waiting.clone());
        async move {
            let q = ch
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await
                .expect("queue");
            waiting.store(q.message_count(), std::sync::atomic::Ordering::Relaxed);
            q.message_count() == 50
        }
    })
    .await;
    let waiting = waiting.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "delayed ingress paused while Postgres was cut: {waiting} messages waiting in the queue"
    );
    proxy.set(Mode::Pass);
    wait_for(PATIENCE, "50 delivered", || inbox.len() >= 50).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let counts = inbox.counts();
    assert_eq!(counts.len(), 50);
    assert!(counts.values().all(|n| *n == 1), "each once: {counts:?}");
    node.stop().await;
    world.cleanup().await;
}
