//! Crowds: many real daemons on one machine, against one broker and one database.
//!
//! First one big group (`--crowd-nodes`, 100 `timeoutd run` processes, each on an HTTP
//! port of its own), then many small groups sharing the broker and the database
//! (`--crowd-groups` × `--crowd-group-size`, 20 × 3, each group with a schema, a group
//! name and a consumer of its own). What the simulator predicts for a group
//! (docs/design/simulator.md) is checked against real processes, judged from outside:
//!
//! - time to elect: from the first spawn until every node's `/status` names the same
//!   single active node (exactly one says `active`, and every node's `lowest` is it);
//! - announcements: a queue of our own, bound to the group's routing key on the
//!   announcement exchange, counts what the broker routes, and who sent it;
//! - Postgres connections: `pg_stat_activity` sampled every 500 ms from the first spawn
//!   to the first stop, by `application_name` (`timeoutd-<node id>` for a node's pool,
//!   `timeoutd-<node id>-observe` for its pending counts), per node and role;
//! - CPU (utime + stime) and RSS of each daemon from `/proc`, per role, over a quiet
//!   window in which nothing asks the daemons anything;
//! - takeover (big group): TimeOuts due every 100 ms, consumed by our own consumer, while
//!   the active node is killed with SIGKILL: the longest gap between TimeOuts received,
//!   and when the first TimeOut fired by another node (header `x-timeoutd-node`) came;
//! - isolation (small groups): each group fires rows of its own; each group's consumer
//!   must receive its own rows only, each once, none early, each fired by a member of
//!   that group.
//!
//! A node counts as passive if no `/status` it gave said it was active (the elected
//! nodes, the big group's successor and any node seen active while the group was still
//! agreeing are the active ones). The passive nodes' bound (one session) is judged from
//! the moment every node agreed; their start-up is reported apart.

use futures_util::future::join_all;
use lapin::options::{ExchangeDeleteOptions, QueueBindOptions};
use serde::Deserialize;
use timeoutd::wire::timeout::NODE_HEADER;

use crate::prelude::*;
use crate::*;

/// How often `pg_stat_activity` is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// How often `/status` is asked while waiting for agreement.
const POLL_EVERY: Duration = Duration::from_millis(250);
/// How long a group may take to agree on its active node.
const ELECT_LIMIT: Duration = Duration::from_secs(120);
/// Between agreement and the quiet window: first batches, trims and start-up work end.
const SETTLE: Duration = Duration::from_secs(12);
/// The takeover's TimeOuts: one due every `TICK`, `BEFORE` of them before the kill, and
/// `AFTER` after it (long enough to cover `member_ttl` + a tick and more).
const TAKEOVER_TICK: Duration = Duration::from_millis(100);
const TAKEOVER_BEFORE: usize = 30;
const TAKEOVER_AFTER: usize = 120;
/// Rows each small group fires.
const GROUP_ROWS: usize = 10;

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct CrowdPlan {
    pub(crate) nodes: usize,
    pub(crate) groups: usize,
    pub(crate) group_size: usize,
    pub(crate) watch_secs: u64,
}

impl CrowdPlan {
    pub(crate) fn from(args: &Args) -> Result<Self> {
        let plan = Self {
            nodes: args.crowd_nodes,
            groups: args.crowd_groups,
            group_size: args.crowd_group_size,
            watch_secs: args
                .crowd_watch_secs
                .unwrap_or(if args.quick { 10 } else { 30 }),
        };
        if plan.nodes < 2 || plan.watch_secs == 0 {
            bail!("--crowd-nodes must be at least 2 and --crowd-watch-secs greater than 0");
        }
        if plan.groups > 0 && plan.group_size == 0 {
            bail!("--crowd-group-size must be greater than 0");
        }
        Ok(plan)
    }

    /// Sessions the daemons need at the least (one per node) and a margin for the
    /// active ones and this bench.
    fn connections_needed(&self) -> usize {
        self.nodes.max(self.groups * self.group_size) + 20
    }
}

/// The result of one run: the big group, then the small groups.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Crowd {
    pub(crate) plan: CrowdPlan,
    pub(crate) max_connections: i64,
    pub(crate) big: BigGroup,
    /// `None` with `--crowd-groups 0`.
    pub(crate) groups: Option<ManyGroups>,
}

/// Per role, over the quiet window (CPU in percent of one core, RSS in MiB).
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RoleCost {
    pub(crate) passive_cpu_median: f64,
    pub(crate) passive_cpu_max: f64,
    pub(crate) active_cpu_median: f64,
    pub(crate) all_daemons_cpu: f64,
    pub(crate) passive_rss_median_mib: f64,
    pub(crate) passive_rss_max_mib: f64,
    pub(crate) active_rss_median_mib: f64,
    pub(crate) all_daemons_rss_mib: f64,
    /// Every process of the machine by role over the window, in percent of one core.
    pub(crate) broker_cpu: f64,
    pub(crate) postgres_cpu: f64,
    pub(crate) machine_cpu: f64,
}

/// Postgres sessions of the daemons, from `pg_stat_activity`.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Connections {
    pub(crate) samples: usize,
    /// The most any never-active node held in any sample.
    pub(crate) passive_max: i64,
    /// The same from the moment every node agreed on the active node (start-up over).
    pub(crate) passive_max_after_start: i64,
    /// Passive nodes' sessions per node, mean over the quiet window.
    pub(crate) passive_mean_quiet: f64,
    /// The active node's (nodes') sessions, median over the quiet window (per node).
    pub(crate) active_quiet: f64,
    /// The most an active node held in any sample.
    pub(crate) active_max: i64,
    /// All the daemons' sessions together: median over the quiet window, max over the run.
    pub(crate) total_quiet: f64,
    pub(crate) total_max: i64,
    /// Of those, the pending counts' own sessions (`…-observe`), max over the run.
    pub(crate) observe_max: i64,
    /// Sessions named `timeoutd…` that belong to none of the nodes (a CLI, a migration),
    /// max over the run.
    pub(crate) unattributed_max: i64,
    /// Where a passive node held more than one session: the first such sample and how
    /// many samples (node-samples) did.
    pub(crate) passive_over_one: Option<String>,
    pub(crate) passive_over_one_samples: usize,
    /// The last sample (seconds after the first spawn) in which one did.
    pub(crate) passive_over_one_last_s: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Announcements {
    /// In the quiet window, per `election.announce_interval`.
    pub(crate) per_interval: f64,
    /// Nodes that announced in the quiet window.
    pub(crate) senders: usize,
    /// From the first spawn until the group(s) agreed.
    pub(crate) during_start: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Takeover {
    pub(crate) rows: usize,
    pub(crate) lost: usize,
    pub(crate) duplicates: usize,
    pub(crate) early: usize,
    /// The longest stretch without a TimeOut received, from the first to the last.
    pub(crate) longest_gap_s: f64,
    /// From the kill to the first TimeOut fired by another node.
    pub(crate) first_from_successor_s: f64,
    /// From the kill until every surviving node's `/status` agrees on a new active node.
    pub(crate) agreed_s: f64,
    /// The successor's sessions, the most in any sample after the kill.
    pub(crate) successor_connections_max: i64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct BigGroup {
    pub(crate) nodes: usize,
    pub(crate) spawn_s: f64,
    pub(crate) elect_s: f64,
    pub(crate) announcements: Announcements,
    pub(crate) connections: Connections,
    pub(crate) cost: RoleCost,
    pub(crate) takeover: Takeover,
    /// Every daemon stopped with SIGTERM at once at the end.
    pub(crate) stop: MassStop,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ManyGroups {
    pub(crate) groups: usize,
    pub(crate) group_size: usize,
    pub(crate) spawn_s: f64,
    /// Per group, from the first spawn until its members agreed.
    pub(crate) elect_s: Vec<f64>,
    pub(crate) announcements: Announcements,
    pub(crate) connections: Connections,
    pub(crate) cost: RoleCost,
    pub(crate) rows: usize,
    pub(crate) lost: usize,
    pub(crate) duplicates: usize,
    pub(crate) early: usize,
    /// TimeOuts a group's consumer received that were not its group's rows.
    pub(crate) foreign_rows: usize,
    /// TimeOuts fired by a node that is not a member of the row's group.
    pub(crate) fired_by_outsider: usize,
    pub(crate) stop: MassStop,
}

/// One group's names, settings and consumer.
struct Site {
    schema: String,
    group: String,
    queue: String,
    settings: Settings,
    got: Arc<Got>,
    /// The big group is the environment's own (its schema, ingress and target go with
    /// it); the small groups' are ours to remove.
    own_schema: bool,
}

/// What a site's consumer received.
#[derive(Default)]
struct Got {
    rows: Mutex<Vec<Received>>,
}

#[derive(Debug, Clone, Copy)]
struct Received {
    id: Uuid,
    at: DateTime<Utc>,
    /// The `x-timeoutd-node` header: who fired it.
    node: Option<Uuid>,
}

impl Got {
    fn all(&self) -> Vec<Received> {
        self.rows.lock().map(|r| r.clone()).unwrap_or_default()
    }

    fn len(&self) -> usize {
        self.rows.lock().map(|r| r.len()).unwrap_or(0)
    }
}

impl Site {
    fn new(args: &Args, schema: String, group: String, queue: String, own: bool) -> Result<Self> {
        let settings = daemon_settings(args, &schema, &group)?;
        Ok(Self {
            schema,
            group,
            queue,
            settings,
            got: Arc::default(),
            own_schema: own,
        })
    }

    /// The schema (migrated as the daemon would), the target exchange, the consumer.
    async fn prepare(&self, env: &Env) -> Result<()> {
        if self.own_schema {
            migrate(&self.settings).await?;
        }
        declare_target(&env.amqp, &self.settings.delay.target_exchange).await?;
        let consumer = declare_queue(&env.amqp, &self.queue).await?;
        tokio::spawn(receive(consumer, self.got.clone()));
        Ok(())
    }

    /// Drop what `prepare` and the daemons made; errors are printed.
    async fn cleanup(&self, env: &Env) {
        if self.own_schema {
            env.drop_schema(&self.schema).await;
        }
        if let Err(e) = delete_queue(&env.amqp, &self.queue).await {
            eprintln!("warning: could not delete queue {}: {e:#}", self.queue);
        }
        if !self.own_schema {
            // The environment's own group: its cleanup removes the ingress and target.
            return;
        }
        let ingress = self.settings.delay_exchange();
        if let Err(e) = delete_queue(&env.amqp, &ingress).await {
            eprintln!("warning: could not delete queue {ingress}: {e:#}");
        }
        for exchange in [&ingress, &self.settings.delay.target_exchange] {
            if let Err(e) = delete_exchange(&env.amqp, exchange).await {
                eprintln!("warning: could not delete exchange {exchange}: {e:#}");
            }
        }
    }

    fn table(&self) -> String {
        format!("{}.expected_messages", self.schema)
    }
}

async fn delete_queue(amqp: &Connection, queue: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let delete = channel.queue_delete(queue.into(), QueueDeleteOptions::default());
    bounded("queue delete", Duration::from_secs(5), delete).await??;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

async fn delete_exchange(amqp: &Connection, exchange: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let delete = channel.exchange_delete(exchange.into(), ExchangeDeleteOptions::default());
    bounded("exchange delete", Duration::from_secs(5), delete).await??;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

async fn receive(mut consumer: Consumer, got: Arc<Got>) {
    while let Some(Ok(delivery)) = consumer.next().await {
        let at = Utc::now();
        let p = &delivery.properties;
        let id = p
            .message_id()
            .as_ref()
            .and_then(|s| s.as_str().parse().ok())
            .unwrap_or(Uuid::nil());
        let node = p
            .headers()
            .as_ref()
            .and_then(|h| match h.inner().get(NODE_HEADER) {
                Some(lapin::types::AMQPValue::LongString(s)) => {
                    std::str::from_utf8(s.as_bytes()).ok()?.parse().ok()
                }
                _ => None,
            });
        if let Ok(mut rows) = got.rows.lock() {
            rows.push(Received { id, at, node });
        }
    }
}

/// A daemon of the crowd and what we learned about it.
struct Member {
    daemon: Daemon,
    site: usize,
    node_id: Option<Uuid>,
}

/// What `/status` says, as far as agreement goes.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct NodeStatus {
    pub(crate) node_id: Uuid,
    pub(crate) role: String,
    pub(crate) lowest: Uuid,
    /// Done joining (probing over).
    pub(crate) settled: bool,
}

pub(crate) async fn node_status(addr: SocketAddr) -> Option<NodeStatus> {
    match get(addr, "/status", Duration::from_secs(2)).await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// The one active node every node names, if they all answer and agree.
pub(crate) fn agreed(statuses: &[Option<NodeStatus>]) -> Option<Uuid> {
    let all: Vec<&NodeStatus> = statuses.iter().map(Option::as_ref).collect::<Option<_>>()?;
    let active: Vec<Uuid> = all
        .iter()
        .filter(|s| s.role == "active")
        .map(|s| s.node_id)
        .collect();
    match active.as_slice() {
        [one] if all.iter().all(|s| s.lowest == *one) => Some(*one),
        _ => None,
    }
}

/// Ask every member of each site until each site agrees; per site, when it first did
/// (from `t0`) and its active node. Learns each member's node id on the way, and adds
/// every node that said it was active to `seen_active`.
async fn wait_agreed(
    members: &mut [Member],
    sites: usize,
    skip: Option<usize>,
    t0: Instant,
    seen_active: &mut HashSet<Uuid>,
) -> Result<Vec<(f64, Uuid)>> {
    let mut done: Vec<Option<(f64, Uuid)>> = vec![None; sites];
    let deadline = Instant::now() + ELECT_LIMIT;
    loop {
        for (i, m) in members.iter_mut().enumerate() {
            if Some(i) != skip {
                m.daemon.check_alive()?;
            }
        }
        let asked = members.iter().enumerate().map(|(i, m)| async move {
            if Some(i) == skip {
                None
            } else {
                node_status(m.daemon.http).await
            }
        });
        let answers = join_all(asked).await;
        let at = t0.elapsed().as_secs_f64();
        for (m, a) in members.iter_mut().zip(&answers) {
            if let Some(s) = a {
                m.node_id = Some(s.node_id);
                if s.role == "active" {
                    seen_active.insert(s.node_id);
                }
            }
        }
        for (site, slot) in done.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let of_site: Vec<Option<NodeStatus>> = members
                .iter()
                .zip(&answers)
                .enumerate()
                .filter(|(i, (m, _))| m.site == site && Some(*i) != skip)
                .map(|(_, (_, a))| a.clone())
                .collect();
            if let Some(active) = agreed(&of_site) {
                *slot = Some((at, active));
            }
        }
        if done.iter().all(Option::is_some) {
            return Ok(done.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            let missing = done.iter().filter(|d| d.is_none()).count();
            let census = census(members, skip).await;
            bail!(
                "{missing} group(s) did not agree on one active node within {ELECT_LIMIT:?}; \
                 what the nodes say: {census}"
            );
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// What the nodes' `/status` say, counted: role, settled, broker connected, database.
async fn census(members: &[Member], skip: Option<usize>) -> String {
    let asked = members
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != skip)
        .map(|(_, m)| async move {
            match get(m.daemon.http, "/status", Duration::from_secs(2)).await {
                Ok((200, body)) => match serde_json::from_str::<serde_json::Value>(&body) {
                    Ok(v) => format!(
                        "role {}, settled {}, bus_connected {}, database_ok {}",
                        v["role"], v["settled"], v["bus_connected"], v["database_ok"]
                    ),
                    Err(_) => "unreadable /status".to_owned(),
                },
                Ok((code, _)) => format!("/status answered {code}"),
                Err(_) => "no answer".to_owned(),
            }
        });
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in join_all(asked).await {
        *counts.entry(s).or_default() += 1;
    }
    let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{n}× {s}")).collect();
    parts.join("; ")
}

/// One sample of `pg_stat_activity`: sessions per `application_name`.
struct ConnSample {
    at: Instant,
    by_name: HashMap<String, i64>,
}

/// Samples `pg_stat_activity` until dropped (the task is aborted then).
struct Sampler {
    samples: Arc<Mutex<Vec<ConnSample>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    fn start(pool: PgPool) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let into = samples.clone();
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(SAMPLE_EVERY);
            loop {
                every.tick().await;
                let rows: Result<Vec<(String, i64)>, _> = sqlx::query_as(
                    "SELECT application_name, count(*)::int8 FROM pg_stat_activity \
                     WHERE application_name LIKE 'timeoutd%' GROUP BY 1",
                )
                .fetch_all(&pool)
                .await;
                match rows {
                    Ok(rows) => {
                        if let Ok(mut s) = into.lock() {
                            s.push(ConnSample {
                                at: Instant::now(),
                                by_name: rows.into_iter().collect(),
                            });
                        }
                    }
                    Err(e) => eprintln!("warning: sampling pg_stat_activity: {e:#}"),
                }
            }
        });
        Self { samples, task }
    }

    fn stop(self) -> Vec<ConnSample> {
        self.task.abort();
        self.samples
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A node's sessions in one sample: its pool's and its pending counts'.
fn sessions(sample: &ConnSample, node: Uuid) -> (i64, i64) {
    let pool = format!("timeoutd-{node}");
    let observe = format!("timeoutd-{node}-observe");
    let get = |name: &str| sample.by_name.get(name).copied().unwrap_or(0);
    (get(&pool), get(&observe))
}

/// Connections per role from the samples. `active` are the nodes that were ever seen
/// active, `quiet_active` those active during `quiet`, the quiet window; `t0` the first
/// spawn, `agreed` when every node agreed on the active node.
fn connections(
    samples: &[ConnSample],
    nodes: &[Uuid],
    active: &HashSet<Uuid>,
    quiet_active: &HashSet<Uuid>,
    quiet: (Instant, Instant),
    (t0, agreed): (Instant, Instant),
) -> Connections {
    let mut c = Connections {
        samples: samples.len(),
        ..Connections::default()
    };
    let ours: HashSet<String> = nodes
        .iter()
        .flat_map(|n| [format!("timeoutd-{n}"), format!("timeoutd-{n}-observe")])
        .collect();
    let (mut passive_quiet, mut active_quiet, mut total_quiet) =
        (Vec::new(), Vec::new(), Vec::new());
    let passive_count = nodes.iter().filter(|n| !active.contains(*n)).count().max(1);
    for s in samples {
        let in_quiet = s.at >= quiet.0 && s.at <= quiet.1;
        let (mut total, mut observe, mut passive_sum) = (0, 0, 0);
        for &n in nodes {
            let (pool, obs) = sessions(s, n);
            let held = pool + obs;
            total += held;
            observe += obs;
            if in_quiet && quiet_active.contains(&n) {
                active_quiet.push(held as f64);
            }
            if active.contains(&n) {
                c.active_max = c.active_max.max(held);
            } else {
                c.passive_max = c.passive_max.max(held);
                if s.at >= agreed {
                    c.passive_max_after_start = c.passive_max_after_start.max(held);
                }
                passive_sum += held;
                if held > 1 {
                    c.passive_over_one_samples += 1;
                    c.passive_over_one_last_s = Some((s.at - t0).as_secs_f64());
                    c.passive_over_one.get_or_insert_with(|| {
                        format!(
                            "node {n}, {:.1} s after the first spawn: pool {pool}, counts {obs}",
                            (s.at - t0).as_secs_f64()
                        )
                    });
                }
            }
        }
        let unattributed: i64 = s
            .by_name
            .iter()
            .filter(|(name, _)| !ours.contains(*name))
            .map(|(_, n)| *n)
            .sum();
        c.total_max = c.total_max.max(total);
        c.observe_max = c.observe_max.max(observe);
        c.unattributed_max = c.unattributed_max.max(unattributed);
        if in_quiet {
            passive_quiet.push(passive_sum as f64 / passive_count as f64);
            total_quiet.push(total as f64);
        }
    }
    c.passive_mean_quiet = mean(&passive_quiet);
    c.active_quiet = median(active_quiet);
    c.total_quiet = median(total_quiet);
    c
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// Announcements the broker routed to our queue: when, from whom.
#[derive(Default)]
struct Heard {
    from: Mutex<Vec<(Instant, Uuid)>>,
}

impl Heard {
    fn between(&self, from: Instant, to: Instant) -> Vec<Uuid> {
        self.from
            .lock()
            .map(|h| {
                h.iter()
                    .filter(|(at, _)| *at >= from && *at <= to)
                    .map(|(_, n)| *n)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[derive(Deserialize)]
struct Sender {
    node_id: Uuid,
}

/// A queue of our own bound to every site's group on the announcement exchange.
async fn listen_announcements(
    env: &Env,
    sites: &[Site],
    heard: Arc<Heard>,
) -> Result<tokio::task::JoinHandle<()>> {
    let ch = env.amqp.create_channel().await?;
    let declare = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    let q = ch
        .queue_declare("".into(), declare, FieldTable::default())
        .await?;
    for site in sites {
        // As the daemons declare it: in a fresh vhost it does not exist before them.
        let exchange = &site.settings.amqp.announce_exchange;
        declare_target(&env.amqp, exchange).await?;
        ch.queue_bind(
            q.name().clone(),
            exchange.as_str().into(),
            site.group.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    let options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    let mut consumer = ch
        .basic_consume(
            q.name().clone(),
            "crowd".into(),
            options,
            FieldTable::default(),
        )
        .await?;
    Ok(tokio::spawn(async move {
        let _keep = ch;
        while let Some(Ok(d)) = consumer.next().await {
            let at = Instant::now();
            let node = serde_json::from_slice::<Sender>(&d.data)
                .map(|s| s.node_id)
                .unwrap_or(Uuid::nil());
            if let Ok(mut h) = heard.from.lock() {
                h.push((at, node));
            }
        }
    }))
}

/// What each daemon costs over a quiet window: CPU ticks before, then the cost.
struct Watch {
    ticks: Vec<u64>,
    meter: CpuMeter,
    started: Instant,
}

impl Watch {
    fn start(members: &[Member]) -> Result<Self> {
        Ok(Self {
            ticks: members
                .iter()
                .map(|m| ticks(m.daemon.pid))
                .collect::<Result<_>>()?,
            meter: CpuMeter::start(),
            started: Instant::now(),
        })
    }

    fn end(self, members: &[Member], active: &HashSet<Uuid>) -> Result<RoleCost> {
        let secs = self.started.elapsed().as_secs_f64();
        let machine = self.meter.spent(secs);
        let pct = |ms: f64| ms / 10.0 / secs;
        let (mut p_cpu, mut a_cpu, mut p_rss, mut a_rss) = (vec![], vec![], vec![], vec![]);
        let (mut all_cpu, mut all_rss) = (0.0, 0.0);
        for (m, before) in members.iter().zip(self.ticks) {
            let cpu = ticks(m.daemon.pid)?.saturating_sub(before) as f64 / USER_HZ / secs * 100.0;
            let rss = m.daemon.memory()?.rss as f64 / MIB;
            all_cpu += cpu;
            all_rss += rss;
            if m.node_id.is_some_and(|n| active.contains(&n)) {
                a_cpu.push(cpu);
                a_rss.push(rss);
            } else {
                p_cpu.push(cpu);
                p_rss.push(rss);
            }
        }
        Ok(RoleCost {
            passive_cpu_median: median(p_cpu.clone()),
            passive_cpu_max: max(&p_cpu),
            active_cpu_median: median(a_cpu),
            all_daemons_cpu: all_cpu,
            passive_rss_median_mib: median(p_rss.clone()),
            passive_rss_max_mib: max(&p_rss),
            active_rss_median_mib: median(a_rss),
            all_daemons_rss_mib: all_rss,
            broker_cpu: pct(machine.broker_ms),
            postgres_cpu: pct(machine.postgres_ms),
            machine_cpu: pct(machine.total_ms()),
        })
    }
}

fn ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    Ok(parse_stat(&stat).context("malformed stat")?.ticks)
}

/// Spawn one daemon per site index in `layout`, as fast as they go.
fn spawn_all(env: &Env, sites: &[Site], layout: &[usize]) -> Result<Vec<Member>> {
    let mut ports = Ports::new();
    layout
        .iter()
        .map(|&site| {
            let s = &sites[site];
            Ok(Member {
                daemon: Daemon::spawn_in(env, &s.schema, &s.group, ports.next()?)?,
                site,
                node_id: None,
            })
        })
        .collect()
}

/// HTTP ports for the crowd, below Linux's ephemeral range (32768 and up): with a hundred
/// daemons opening connections, a port found free by binding port 0 was taken as a
/// connection's local port before its daemon could bind it.
struct Ports(u16);

impl Ports {
    /// Where this run starts looking: apart from another run's, most likely.
    fn new() -> Self {
        Self(17_000 + (Uuid::new_v4().as_u128() % 4_000) as u16)
    }

    fn next(&mut self) -> Result<SocketAddr> {
        while self.0 < 32_000 {
            let port = self.0;
            self.0 += 1;
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return Ok(l.local_addr()?);
            }
        }
        bail!("no free port for a daemon below 32000")
    }
}

/// How a mass stop went: SIGTERM to every member at once.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct MassStop {
    pub(crate) daemons: usize,
    /// From SIGTERM to the exit, per daemon: median and max.
    pub(crate) median_ms: f64,
    pub(crate) max_ms: f64,
    /// Exit codes other than 0, with what the daemons said they gave up on.
    pub(crate) unclean: usize,
    pub(crate) reasons: Vec<(String, usize)>,
}

async fn stop_all(members: Vec<Member>) -> MassStop {
    let stops = members.into_iter().map(|m| stop_one(m.daemon));
    let outcomes = join_all(stops).await;
    let mut reasons: HashMap<String, usize> = HashMap::new();
    let mut took = Vec::new();
    for (ms, reason) in &outcomes {
        took.push(*ms);
        if let Some(r) = reason {
            *reasons.entry(r.clone()).or_default() += 1;
        }
    }
    let mut reasons: Vec<(String, usize)> = reasons.into_iter().collect();
    reasons.sort_by_key(|r| std::cmp::Reverse(r.1));
    MassStop {
        daemons: outcomes.len(),
        max_ms: max(&took),
        median_ms: median(took),
        unclean: reasons.iter().map(|r| r.1).sum(),
        reasons,
    }
}

/// SIGTERM, then the exit (SIGKILL after 20 s): how long it took, and for an exit other
/// than 0 its code and what the daemon's log said it gave up on.
async fn stop_one(mut d: Daemon) -> (f64, Option<String>) {
    let started = Instant::now();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &d.pid.to_string()])
        .status();
    if !term.is_ok_and(|s| s.success()) {
        let _ = d.child.start_kill();
    }
    let status = tokio::time::timeout(Duration::from_secs(20), d.child.wait()).await;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let code = match status {
        Ok(Ok(s)) if s.success() => return (ms, None),
        Ok(Ok(s)) => s
            .code()
            .map_or("a signal".to_owned(), |c| format!("exit {c}")),
        Ok(Err(e)) => format!("wait failed: {e}"),
        Err(_) => {
            let _ = d.child.start_kill();
            "no exit within 20 s (killed)".to_owned()
        }
    };
    // Give the log reader the last lines (the exit races the pipe).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let gave_up = d
        .log
        .tail()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| {
            v.get("abandoned")
                .and_then(|a| a.as_str())
                .map(str::to_owned)
        });
    (ms, Some(format!("{code}: {}", gave_up.unwrap_or_default())))
}

/// Rows due one after another, `every` apart from `first`, routed to the site's queue.
async fn insert_series(
    env: &Env,
    site: &Site,
    n: usize,
    first: DateTime<Utc>,
    every: Duration,
) -> Result<Vec<(Uuid, DateTime<Utc>)>> {
    let step = chrono::Duration::from_std(every)?;
    let rows: Vec<(Uuid, DateTime<Utc>)> = (0..n)
        .map(|i| {
            (
                Uuid::new_v4(),
                first + step * i32::try_from(i).unwrap_or(i32::MAX),
            )
        })
        .collect();
    let mut conn = env.pool.acquire().await?;
    insert_each_due(&mut conn, &site.table(), &site.queue, &rows).await?;
    Ok(rows)
}

/// `SHOW max_connections` of the database the daemons use.
async fn max_connections(env: &Env) -> Result<i64> {
    let s: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&env.pool)
        .await?;
    Ok(s.parse()?)
}

/// One run: the big group, then the small groups; every process, schema, queue and
/// exchange removed whatever happens.
pub(crate) async fn crowd(args: &Args, env: &Env, plan: CrowdPlan) -> Result<Crowd> {
    let max_connections = max_connections(env).await?;
    let needed = plan.connections_needed();
    if (max_connections as usize) < needed {
        bail!(
            "the database allows {max_connections} connections; the crowd needs about \
             {needed}: run against a Postgres with a higher max_connections (see \
             timeoutd-bench/crowd.sh, which makes a throwaway one)"
        );
    }
    let big_site = Site::new(
        args,
        env.schema.clone(),
        env.group.clone(),
        format!("{}-crowd", env.queue),
        false,
    )?;
    let big = {
        let sites = vec![big_site];
        let outcome = big_group(env, &sites, plan).await;
        for s in &sites {
            s.cleanup(env).await;
        }
        outcome?
    };
    let groups = match plan.groups {
        0 => None,
        n => {
            let mut sites = Vec::new();
            for i in 0..n {
                sites.push(Site::new(
                    args,
                    format!("{}_g{i}", env.schema),
                    format!("{}-g{i}", env.group),
                    format!("{}-g{i}", env.queue),
                    true,
                )?);
            }
            let outcome = many_groups(env, &sites, plan).await;
            for s in &sites {
                s.cleanup(env).await;
            }
            Some(outcome?)
        }
    };
    Ok(Crowd {
        plan,
        max_connections,
        big,
        groups,
    })
}

async fn big_group(env: &Env, sites: &[Site], plan: CrowdPlan) -> Result<BigGroup> {
    let site = &sites[0];
    site.prepare(env).await?;
    let e = &site.settings.election;
    let heard = Arc::new(Heard::default());
    let listener = listen_announcements(env, sites, heard.clone()).await?;
    let sampler = Sampler::start(env.pool.clone());
    let t0 = Instant::now();
    let mut members = spawn_all(env, sites, &vec![0; plan.nodes])?;
    let spawn_s = t0.elapsed().as_secs_f64();
    println!("   {} daemons spawned in {spawn_s:.2} s", plan.nodes);
    let mut seen_active = HashSet::new();
    let [(elect_s, first)] = wait_agreed(&mut members, 1, None, t0, &mut seen_active).await?[..]
    else {
        bail!("one group, one answer");
    };
    let elected = t0 + Duration::from_secs_f64(elect_s);
    println!(
        "   all {} agree on {first} after {elect_s:.2} s",
        plan.nodes
    );
    // Every node answered by now; the killed one is gone from `members` after the takeover.
    let nodes: Vec<Uuid> = members.iter().filter_map(|m| m.node_id).collect();
    tokio::time::sleep(SETTLE).await;
    let active: HashSet<Uuid> = [first].into();
    let watch = Watch::start(&members)?;
    tokio::time::sleep(Duration::from_secs(plan.watch_secs)).await;
    let quiet = (watch.started, Instant::now());
    let cost = watch.end(&members, &active)?;
    let announcements = Announcements {
        per_interval: heard.between(quiet.0, quiet.1).len() as f64
            / (quiet.1 - quiet.0).as_secs_f64()
            * e.announce_interval.as_secs_f64(),
        senders: heard
            .between(quiet.0, quiet.1)
            .into_iter()
            .collect::<HashSet<_>>()
            .len(),
        during_start: heard.between(t0, elected).len(),
    };
    let (takeover, successor) =
        takeover(env, site, &mut members, first, t0, &mut seen_active).await?;
    let samples = sampler.stop();
    listener.abort();
    seen_active.insert(successor.0);
    let connections = connections(
        &samples,
        &nodes,
        &seen_active,
        &active,
        quiet,
        (t0, elected),
    );
    let successor_connections_max = samples
        .iter()
        .filter(|s| s.at >= successor.1)
        .map(|s| {
            let (pool, obs) = sessions(s, successor.0);
            pool + obs
        })
        .max()
        .unwrap_or(0);
    let stop = stop_all(members).await;
    Ok(BigGroup {
        nodes: plan.nodes,
        spawn_s,
        elect_s,
        announcements,
        connections,
        cost,
        takeover: Takeover {
            successor_connections_max,
            ..takeover
        },
        stop,
    })
}

/// TimeOuts due every 100 ms; the active node killed with SIGKILL in the middle. The
/// killed member is removed from `members`. Returns the successor and when it was agreed.
async fn takeover(
    env: &Env,
    site: &Site,
    members: &mut Vec<Member>,
    active: Uuid,
    t0: Instant,
    seen_active: &mut HashSet<Uuid>,
) -> Result<(Takeover, (Uuid, Instant))> {
    let first = Utc::now() + chrono::Duration::seconds(1);
    let n = TAKEOVER_BEFORE + TAKEOVER_AFTER;
    let rows = insert_series(env, site, n, first, TAKEOVER_TICK).await?;
    let kill_at = first + chrono::Duration::from_std(TAKEOVER_TICK * TAKEOVER_BEFORE as u32)?;
    let wait = (kill_at - Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(wait).await;
    let victim = members
        .iter()
        .position(|m| m.node_id == Some(active))
        .context("the active node is not among the members")?;
    members[victim].daemon.child.start_kill()?;
    let killed_at = Utc::now();
    let killed = Instant::now();
    let _ = members[victim].daemon.child.wait().await;
    let agreed = wait_agreed(members, 1, Some(victim), t0, seen_active).await?;
    let (agreed_after_t0, successor) = agreed[0];
    let agreed_at = t0 + Duration::from_secs_f64(agreed_after_t0);
    members.remove(victim);
    let last_due = rows.last().map(|r| r.1).unwrap_or(killed_at);
    let limit = (last_due - Utc::now()).to_std().unwrap_or_default() + Duration::from_secs(10);
    let deadline = Instant::now() + limit;
    while site.got.len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Late duplicates (a batch the killed node published but never committed, fired again).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = site.got.all();
    let due: HashMap<Uuid, DateTime<Utc>> = rows.iter().copied().collect();
    let mut firsts: HashMap<Uuid, DateTime<Utc>> = HashMap::new();
    let mut t = Takeover {
        rows: n,
        ..Takeover::default()
    };
    for r in &got {
        match due.get(&r.id) {
            Some(d) if r.at < *d => t.early += 1,
            Some(_) => {}
            None => continue,
        }
        if firsts.insert(r.id, r.at).is_some() {
            t.duplicates += 1;
        }
    }
    t.lost = n - firsts.len();
    let mut times: Vec<DateTime<Utc>> = firsts.values().copied().collect();
    times.sort();
    t.longest_gap_s = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_seconds_f64())
        .fold(0.0, f64::max);
    t.first_from_successor_s = got
        .iter()
        .filter(|r| r.at >= killed_at && r.node.is_some_and(|n| n != active))
        .map(|r| (r.at - killed_at).as_seconds_f64())
        .fold(f64::NAN, f64::min);
    t.agreed_s = (agreed_at - killed).as_secs_f64();
    println!(
        "   kill -9 of {active}: {successor} agreed after {:.2} s, first TimeOut from it \
         after {:.2} s, longest gap {:.2} s",
        t.agreed_s, t.first_from_successor_s, t.longest_gap_s
    );
    Ok((t, (successor, agreed_at)))
}

async fn many_groups(env: &Env, sites: &[Site], plan: CrowdPlan) -> Result<ManyGroups> {
    for s in sites {
        s.prepare(env).await?;
    }
    let interval = sites[0].settings.election.announce_interval;
    let heard = Arc::new(Heard::default());
    let listener = listen_announcements(env, sites, heard.clone()).await?;
    let sampler = Sampler::start(env.pool.clone());
    let layout: Vec<usize> = (0..plan.groups)
        .flat_map(|g| std::iter::repeat_n(g, plan.group_size))
        .collect();
    let t0 = Instant::now();
    let mut members = spawn_all(env, sites, &layout)?;
    let spawn_s = t0.elapsed().as_secs_f64();
    println!(
        "   {} daemons in {} groups spawned in {spawn_s:.2} s",
        layout.len(),
        plan.groups
    );
    let mut seen_active = HashSet::new();
    let agreed = wait_agreed(&mut members, plan.groups, None, t0, &mut seen_active).await?;
    let elect_s: Vec<f64> = agreed.iter().map(|a| a.0).collect();
    let all_elected = t0 + Duration::from_secs_f64(max(&elect_s));
    println!("   every group agrees after {:.2} s", max(&elect_s));
    let active: HashSet<Uuid> = agreed.iter().map(|a| a.1).collect();
    tokio::time::sleep(SETTLE).await;
    let watch = Watch::start(&members)?;
    tokio::time::sleep(Duration::from_secs(plan.watch_secs)).await;
    let quiet = (watch.started, Instant::now());
    let cost = watch.end(&members, &active)?;
    let in_quiet = heard.between(quiet.0, quiet.1);
    let announcements = Announcements {
        per_interval: in_quiet.len() as f64 / (quiet.1 - quiet.0).as_secs_f64()
            * interval.as_secs_f64(),
        senders: in_quiet.into_iter().collect::<HashSet<_>>().len(),
        during_start: heard.between(t0, all_elected).len(),
    };
    // Each group fires rows of its own, due together across groups.
    let first = Utc::now() + chrono::Duration::milliseconds(1500);
    let mut expected = Vec::new();
    for s in sites {
        expected.push(insert_series(env, s, GROUP_ROWS, first, TAKEOVER_TICK).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while sites.iter().any(|s| s.got.len() < GROUP_ROWS) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Room for anything fired twice or by another group.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let samples = sampler.stop();
    listener.abort();
    let mut g = ManyGroups {
        groups: plan.groups,
        group_size: plan.group_size,
        spawn_s,
        elect_s,
        announcements,
        connections: Connections::default(),
        cost,
        rows: GROUP_ROWS * plan.groups,
        lost: 0,
        duplicates: 0,
        early: 0,
        foreign_rows: 0,
        fired_by_outsider: 0,
        stop: MassStop::default(),
    };
    for (i, (site, rows)) in sites.iter().zip(&expected).enumerate() {
        let due: HashMap<Uuid, DateTime<Utc>> = rows.iter().copied().collect();
        let members_of: HashSet<Uuid> = members
            .iter()
            .filter(|m| m.site == i)
            .filter_map(|m| m.node_id)
            .collect();
        let mut seen = HashSet::new();
        for r in site.got.all() {
            let Some(d) = due.get(&r.id) else {
                g.foreign_rows += 1;
                continue;
            };
            if r.at < *d {
                g.early += 1;
            }
            if !r.node.is_some_and(|n| members_of.contains(&n)) {
                g.fired_by_outsider += 1;
            }
            if !seen.insert(r.id) {
                g.duplicates += 1;
            }
        }
        g.lost += rows.len() - seen.len();
    }
    let nodes: Vec<Uuid> = members.iter().filter_map(|m| m.node_id).collect();
    seen_active.extend(active.iter().copied());
    g.connections = connections(
        &samples,
        &nodes,
        &seen_active,
        &active,
        quiet,
        (t0, all_elected),
    );
    g.stop = stop_all(members).await;
    Ok(g)
}

/// `--only-crowd`: the crowd alone, `runs` times, each in a fresh environment.
pub(crate) async fn only_crowd(args: &Args, daemon_bin: PathBuf, runs: usize) -> Result<()> {
    let plan = CrowdPlan::from(args)?;
    let mut per_run = Vec::new();
    for n in 1..=runs {
        println!("== run {n} of {runs}");
        let env = Env::setup(args, daemon_bin.clone()).await?;
        println!("timeoutd-bench: schema {}, group {}", env.schema, env.group);
        let outcome = tokio::select! {
            r = phase("crowd", crowd(args, &env, plan)) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
        };
        env.cleanup().await;
        let result = outcome?;
        for l in crowd_lines(&result) {
            println!("{:<70} {:<60} {}", l.measurement, l.result, verdict(l.pass));
        }
        let dir = args.out.join(format!("run-{n}"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("crowd.json"), serde_json::to_vec_pretty(&result)?)?;
        per_run.push(crowd_measurements(&result));
    }
    write_summary(&args.out, &summarize_runs(&per_run), runs)
}

pub(crate) fn crowd_lines(c: &Crowd) -> Vec<Line> {
    let b = &c.big;
    let name = |what: &str| format!("crowd of {}: {what}", b.nodes);
    let mut lines = vec![
        line(
            &name("spawned / all agree on one active node"),
            format!("{:.2} s / {:.2} s", b.spawn_s, b.elect_s),
            "",
            None,
        ),
        line(
            &name("announcements (quiet)"),
            format!(
                "{:.1} per interval from {} node(s); {} until agreed",
                b.announcements.per_interval, b.announcements.senders, b.announcements.during_start
            ),
            "",
            None,
        ),
    ];
    lines.extend(connection_lines(&name, &b.connections));
    lines.extend(cost_lines(&name, &b.cost));
    let t = &b.takeover;
    lines.push(line(
        &name("kill -9 of the active node"),
        format!(
            "survivors agree {:.2} s, first TimeOut from the successor {:.2} s, longest gap \
             {:.2} s; successor holds up to {} connection(s)",
            t.agreed_s, t.first_from_successor_s, t.longest_gap_s, t.successor_connections_max
        ),
        "",
        None,
    ));
    lines.push(line(
        &name("takeover TimeOuts: lost / early / duplicates"),
        format!("{} / {} / {} of {}", t.lost, t.early, t.duplicates, t.rows),
        "0 lost, 0 early",
        Some(t.lost == 0 && t.early == 0),
    ));
    lines.push(stop_line(&name, &b.stop));
    if let Some(g) = &c.groups {
        let name = |what: &str| format!("{} groups of {}: {what}", g.groups, g.group_size);
        let mut sorted = g.elect_s.clone();
        sorted.sort_by(f64::total_cmp);
        lines.push(line(
            &name("spawned / each group agrees (median, slowest)"),
            format!(
                "{:.2} s / {:.2} s, {:.2} s",
                g.spawn_s,
                percentile(&sorted, 50.0),
                max(&sorted)
            ),
            "",
            None,
        ));
        lines.push(line(
            &name("announcements (quiet), all groups"),
            format!(
                "{:.1} per interval from {} node(s); {} until all agreed",
                g.announcements.per_interval, g.announcements.senders, g.announcements.during_start
            ),
            "",
            None,
        ));
        lines.extend(connection_lines(&name, &g.connections));
        lines.extend(cost_lines(&name, &g.cost));
        lines.push(line(
            &name("TimeOuts: lost / early / dup / foreign / fired by another group"),
            format!(
                "{} / {} / {} / {} / {} of {}",
                g.lost, g.early, g.duplicates, g.foreign_rows, g.fired_by_outsider, g.rows
            ),
            "all 0",
            Some(
                g.lost == 0
                    && g.early == 0
                    && g.duplicates == 0
                    && g.foreign_rows == 0
                    && g.fired_by_outsider == 0,
            ),
        ));
        lines.push(stop_line(&name, &g.stop));
    }
    lines
}

fn stop_line(name: &dyn Fn(&str) -> String, s: &MassStop) -> Line {
    let reasons: Vec<String> = s.reasons.iter().map(|(r, n)| format!("{n}× {r}")).collect();
    line(
        &name("all stopped at once (SIGTERM): exit within median / max; not exit 0"),
        format!(
            "{:.0} / {:.0} ms; {} of {}{}{}",
            s.median_ms,
            s.max_ms,
            s.unclean,
            s.daemons,
            if reasons.is_empty() { "" } else { ": " },
            reasons.join("; ")
        ),
        "0 not exit 0",
        Some(s.unclean == 0),
    )
}

fn connection_lines(name: &dyn Fn(&str) -> String, c: &Connections) -> Vec<Line> {
    vec![
        line(
            &name("Postgres sessions per passive node once all agreed (max)"),
            c.passive_max_after_start.to_string(),
            "≤ 1",
            Some(c.passive_max_after_start <= 1),
        ),
        line(
            &name("Postgres sessions per passive node (max over the run)"),
            match &c.passive_over_one {
                None => format!(
                    "{} (mean {:.2} in the quiet window)",
                    c.passive_max, c.passive_mean_quiet
                ),
                Some(first) => format!(
                    "{} (mean {:.2} in the quiet window); more than 1 in {} node-samples, \
                     first: {first}; last {:.1} s after the first spawn",
                    c.passive_max,
                    c.passive_mean_quiet,
                    c.passive_over_one_samples,
                    c.passive_over_one_last_s.unwrap_or(f64::NAN)
                ),
            },
            "",
            None,
        ),
        line(
            &name("Postgres sessions per active node (quiet median / max)"),
            format!("{:.0} / {}", c.active_quiet, c.active_max),
            "",
            None,
        ),
        line(
            &name("Postgres sessions, all nodes (quiet median / max)"),
            format!(
                "{:.0} / {} (of them pending counts' up to {}; unattributed up to {}; {} samples)",
                c.total_quiet, c.total_max, c.observe_max, c.unattributed_max, c.samples
            ),
            "",
            None,
        ),
    ]
}

fn cost_lines(name: &dyn Fn(&str) -> String, c: &RoleCost) -> Vec<Line> {
    vec![
        line(
            &name("CPU (quiet): passive median / max, active, all daemons"),
            format!(
                "{:.2} / {:.2} / {:.2} / {:.1} % of a core",
                c.passive_cpu_median, c.passive_cpu_max, c.active_cpu_median, c.all_daemons_cpu
            ),
            "",
            None,
        ),
        line(
            &name("CPU (quiet): broker / Postgres / whole machine"),
            format!(
                "{:.1} / {:.1} / {:.1} % of a core",
                c.broker_cpu, c.postgres_cpu, c.machine_cpu
            ),
            "",
            None,
        ),
        line(
            &name("RSS: passive median / max, active, all daemons"),
            format!(
                "{:.1} / {:.1} / {:.1} / {:.0} MiB",
                c.passive_rss_median_mib,
                c.passive_rss_max_mib,
                c.active_rss_median_mib,
                c.all_daemons_rss_mib
            ),
            "",
            None,
        ),
    ]
}

pub(crate) fn crowd_measurements(c: &Crowd) -> Vec<Measurement> {
    let b = &c.big;
    let name = |what: &str| format!("crowd of {}: {what}", b.nodes);
    let zero = Some(Want::AtMost(0.0));
    let mut m: Vec<Measurement> = vec![
        (name("time to elect"), "s", b.elect_s, None),
        (
            name("announcements per interval"),
            "",
            b.announcements.per_interval,
            Some(Want::AtMost(10.0)),
        ),
        (
            name("announcing nodes"),
            "",
            b.announcements.senders as f64,
            None,
        ),
        (
            name("announcements until agreed"),
            "",
            b.announcements.during_start as f64,
            None,
        ),
    ];
    m.extend(connection_measurements(&name, &b.connections));
    m.extend(cost_measurements(&name, &b.cost));
    let t = &b.takeover;
    m.extend([
        (name("kill -9: survivors agree"), "s", t.agreed_s, None),
        (
            name("kill -9: first TimeOut from the successor"),
            "s",
            t.first_from_successor_s,
            None,
        ),
        (
            name("kill -9: longest gap in TimeOuts"),
            "s",
            t.longest_gap_s,
            None,
        ),
        (
            name("kill -9: successor's sessions, max"),
            "",
            t.successor_connections_max as f64,
            None,
        ),
        (name("kill -9: TimeOuts lost"), "", t.lost as f64, zero),
        (name("kill -9: TimeOuts early"), "", t.early as f64, zero),
        (
            name("kill -9: TimeOuts duplicated"),
            "",
            t.duplicates as f64,
            None,
        ),
    ]);
    m.extend(stop_measurements(&name, &b.stop));
    if let Some(g) = &c.groups {
        let name = |what: &str| format!("{} groups of {}: {what}", g.groups, g.group_size);
        let mut sorted = g.elect_s.clone();
        sorted.sort_by(f64::total_cmp);
        m.extend([
            (
                name("time to elect, median group"),
                "s",
                percentile(&sorted, 50.0),
                None,
            ),
            (
                name("time to elect, slowest group"),
                "s",
                max(&sorted),
                None,
            ),
            (
                name("announcements per interval, all groups"),
                "",
                g.announcements.per_interval,
                None,
            ),
        ]);
        m.extend(connection_measurements(&name, &g.connections));
        m.extend(cost_measurements(&name, &g.cost));
        m.extend([
            (name("TimeOuts lost"), "", g.lost as f64, zero),
            (name("TimeOuts early"), "", g.early as f64, zero),
            (name("TimeOuts duplicated"), "", g.duplicates as f64, zero),
            (
                name("TimeOuts of another group or fired by one"),
                "",
                (g.foreign_rows + g.fired_by_outsider) as f64,
                zero,
            ),
        ]);
        m.extend(stop_measurements(&name, &g.stop));
    }
    m
}

fn stop_measurements(name: &dyn Fn(&str) -> String, s: &MassStop) -> Vec<Measurement> {
    vec![
        (name("mass SIGTERM: exit, median"), "ms", s.median_ms, None),
        (name("mass SIGTERM: exit, max"), "ms", s.max_ms, None),
        (name("mass SIGTERM: not exit 0"), "", s.unclean as f64, None),
    ]
}

fn connection_measurements(name: &dyn Fn(&str) -> String, c: &Connections) -> Vec<Measurement> {
    vec![
        (
            name("sessions per passive node, max once all agreed"),
            "",
            c.passive_max_after_start as f64,
            Some(Want::AtMost(1.0)),
        ),
        (
            name("sessions per passive node, max (start-up too)"),
            "",
            c.passive_max as f64,
            None,
        ),
        (
            name("sessions per passive node, quiet mean"),
            "",
            c.passive_mean_quiet,
            None,
        ),
        (
            name("sessions per active node, quiet"),
            "",
            c.active_quiet,
            None,
        ),
        (
            name("sessions per active node, max"),
            "",
            c.active_max as f64,
            None,
        ),
        (
            name("sessions of all nodes, quiet"),
            "",
            c.total_quiet,
            None,
        ),
        (
            name("sessions of all nodes, max"),
            "",
            c.total_max as f64,
            None,
        ),
    ]
}

fn cost_measurements(name: &dyn Fn(&str) -> String, c: &RoleCost) -> Vec<Measurement> {
    vec![
        (
            name("CPU per passive node (median)"),
            "%",
            c.passive_cpu_median,
            None,
        ),
        (
            name("CPU per passive node (max)"),
            "%",
            c.passive_cpu_max,
            None,
        ),
        (
            name("CPU of the active node"),
            "%",
            c.active_cpu_median,
            None,
        ),
        (name("CPU of all daemons"), "%", c.all_daemons_cpu, None),
        (name("CPU of the broker"), "%", c.broker_cpu, None),
        (name("CPU of Postgres"), "%", c.postgres_cpu, None),
        (
            name("RSS per passive node (median)"),
            "MiB",
            c.passive_rss_median_mib,
            None,
        ),
        (
            name("RSS of the active node"),
            "MiB",
            c.active_rss_median_mib,
            None,
        ),
        (
            name("RSS of all daemons"),
            "MiB",
            c.all_daemons_rss_mib,
            None,
        ),
    ]
}
