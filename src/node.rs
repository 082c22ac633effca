//! The node task: owns the election (nobody else touches it), drives it with ticks, the
//! announcements the bus hands out and the node's own health, carries out its outputs,
//! and publishes what other tasks need: the lease view (for the scan), the role, the bus,
//! the status. It also supervises the broker connection (connect, reconnect, leave).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::admission::{Admission, Policy};
use crate::backoff::Backoff;
use crate::bus::{self, Announcements, Bus};
use crate::config::Settings;
use crate::election::{Election, LeaseView, Output, Role};
use crate::health::{Check, Health};
use crate::metrics::Metrics;
use crate::shutdown::{Exit, Stopping, sleep_or_stop};
use crate::status::{MemberStatus, Status};
use crate::telemetry::Chain;
use crate::telemetry::LogLimiter;
use crate::wire::announcement::{Announcement, Envelope, Rejected};

/// What the node task uses, and what it publishes to the others.
pub(crate) struct Node {
    pub(crate) settings: Arc<Settings>,
    pub(crate) node_id: Uuid,
    pub(crate) status: Arc<Status>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) health: Arc<Health>,
    pub(crate) bus: watch::Sender<Option<Arc<Bus>>>,
    pub(crate) lease: watch::Sender<LeaseView>,
    pub(crate) role: watch::Sender<Role>,
    /// Members that departed without leaving, for the fence task.
    pub(crate) departed: mpsc::Sender<Uuid>,
    pub(crate) stop: CancellationToken,
    /// How long the `leaving` announcement may take once stopping.
    pub(crate) stopping: Arc<Stopping>,
}

/// At most one log line per rejection kind per this period.
const REJECT_LOG_EVERY: Duration = Duration::from_secs(10);

/// The election driver and broker supervisor.
pub(crate) struct NodeLoop {
    ctx: Node,
    /// Owned here and nowhere else: other tasks see the published `LeaseView`.
    election: Election,
    /// Decides which announcements the election hears.
    admission: Admission,
    /// One limiter per rejection kind, so a flood of one kind cannot hide another.
    rejected: HashMap<&'static str, LogLimiter>,
    /// Our announcements so far (the next one's `seq`).
    seq: u64,
    /// `sent_at` of our latest announcements: each measures our own lag once, the first
    /// time it returns, so neither a forged "own" announcement with an old timestamp nor
    /// a copy of a real one sent again can make us withdraw or exit.
    sent: VecDeque<DateTime<Utc>>,
    exit: Option<Exit>,
}

/// Own announcements remembered for lag measurement (several intervals' worth, so a
/// late one is still recognised).
const SENT_REMEMBERED: usize = 64;

/// Why serving one connection ended.
enum Ended {
    BusLost,
    Stop,
}

impl NodeLoop {
    fn metrics(&self) -> &Metrics {
        &self.ctx.metrics
    }

    pub(crate) fn new(ctx: Node) -> Self {
        let timing = ctx.settings.timing();
        // An amqp.url lapin cannot read fails every connect with the reason; until then
        // nothing is admitted either.
        let user = bus::broker_user(&ctx.settings.amqp).unwrap_or_default();
        Self {
            election: Election::new(ctx.node_id, timing, Instant::now()),
            admission: Admission::new(
                Policy::new(&ctx.settings, user),
                Some(ctx.node_id),
                Utc::now(),
            ),
            ctx,
            rejected: HashMap::new(),
            seq: 0,
            sent: VecDeque::with_capacity(SENT_REMEMBERED),
            exit: None,
        }
    }

    /// Connect, serve, reconnect on loss; on stop announce `leaving`. The last bus stays
    /// published (and open) for the scan to finish its batch; the supervisor closes it.
    pub(crate) async fn run(mut self) -> Exit {
        let mut backoff =
            Backoff::new(self.ctx.settings.backoff.min, self.ctx.settings.backoff.max);
        let mut first = true;
        loop {
            let Some((bus, announcements)) = self.connect(&mut backoff).await else {
                return self.exit.unwrap_or(Exit::Stopped);
            };
            if first {
                tracing::info!(address = %bus.address(), "connected to RabbitMQ");
                self.election.connected(Instant::now());
            } else {
                tracing::info!(address = %bus.address(), "reconnected to RabbitMQ: probing the group again");
                self.election.bus_lost(Instant::now());
                self.admission.restart(Utc::now());
            }
            first = false;
            self.ctx.health.pass(Check::Publish);
            self.ctx.bus.send_replace(Some(bus.clone()));
            self.ctx.status.update(|s| s.bus_connected = true);
            self.metrics().set_amqp_connected(true);
            let ended = self.serve(&bus, announcements).await;
            self.ctx.status.update(|s| s.bus_connected = false);
            self.metrics().set_amqp_connected(false);
            match ended {
                Ended::Stop => {
                    self.leave(&bus).await;
                    return self.exit.unwrap_or(Exit::Stopped);
                }
                Ended::BusLost => {
                    self.ctx.bus.send_replace(None);
                    self.election.bus_lost(Instant::now());
                    self.apply_outputs(None).await;
                    // A courtesy to a connection already lost: nothing a stop waits for.
                    let _ = self.unless_stopped(bus.close()).await;
                }
            }
        }
    }

    async fn connect(&mut self, backoff: &mut Backoff) -> Option<(Arc<Bus>, Announcements)> {
        let settings = &self.ctx.settings;
        let name = format!("timeoutd {}", self.ctx.node_id);
        loop {
            self.ctx.status.beat(&self.ctx.status.node_beat);
            if self.ctx.stop.is_cancelled() {
                return None;
            }
            // A broker that is slow or silent must not hold up a stop: the attempt is
            // dropped, and with it the half-open connection.
            let connecting = Bus::connect(&settings.amqp, &settings.election.group, &name);
            let connected = tokio::select! {
                _ = self.ctx.stop.cancelled() => return None,
                connected = connecting => connected,
            };
            match connected {
                Ok((bus, announcements)) => {
                    backoff.reset();
                    return Some((Arc::new(bus), announcements));
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::error!(error = %Chain(&e), retry_in = ?delay, "cannot connect to RabbitMQ");
                    if !sleep_or_stop(&self.ctx.stop, delay).await {
                        return None;
                    }
                }
            }
        }
    }

    async fn serve(&mut self, bus: &Bus, mut announcements: Announcements) -> Ended {
        let mut ticker = tokio::time::interval(self.ctx.settings.election.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.ctx.stop.cancelled() => return Ended::Stop,
                _ = ticker.tick() => {
                    if !bus.is_healthy() {
                        tracing::error!("RabbitMQ connection lost");
                        return Ended::BusLost;
                    }
                    let now = Instant::now();
                    let failing_since = self.ctx.health.failing_since();
                    self.election.observe_health(now, failing_since);
                    self.election.tick(now);
                }
                heard = announcements.next() => match heard {
                    Some(Ok(a)) => self.receive(a),
                    Some(Err(e)) => {
                        tracing::error!(error = %Chain(&e), "announcement consumer failed");
                        return Ended::BusLost;
                    }
                    None => {
                        tracing::error!("announcement consumer was cancelled");
                        return Ended::BusLost;
                    }
                },
            }
            self.ctx.status.beat(&self.ctx.status.node_beat);
            if !self.apply_outputs(Some(bus)).await {
                return Ended::BusLost;
            }
            if self.exit.is_some() {
                return Ended::Stop;
            }
        }
    }

    fn receive(&mut self, envelope: Envelope) {
        let now = Instant::now();
        let a = match self.admission.admit(now, Utc::now(), &envelope) {
            Ok(a) => a,
            Err(e @ Rejected::Unvouched { seq, answer }) => {
                // A newcomer, or a member heard again after a gap: our answer names it.
                // Counted, not warned about: every node's start shows a few.
                self.metrics().rejected(e.kind());
                tracing::debug!(
                    seq,
                    answer,
                    "announcement from a sender not vouched for yet"
                );
                if answer {
                    self.election.unvouched();
                }
                return;
            }
            Err(e) => {
                self.metrics().rejected(e.kind());
                let rejected = self.admission.rejected().clone();
                self.ctx
                    .status
                    .update(|s| s.rejected_announcements = rejected);
                let limiter = self
                    .rejected
                    .entry(e.kind())
                    .or_insert_with(|| LogLimiter::new(REJECT_LOG_EVERY));
                if let Some(suppressed) = limiter.allow(now) {
                    tracing::warn!(
                        reason = e.kind(),
                        user_id = ?envelope.user_id,
                        suppressed,
                        "dropped announcement: {e}"
                    );
                }
                return;
            }
        };
        self.metrics()
            .received(match (a.withdrawn, a.leaving, a.probe) {
                (true, _, _) => "withdrawn",
                (_, true, _) => "leaving",
                (_, _, true) => "probe",
                _ => "announce",
            });
        self.election.step(now, a.heard());
        // A withdrawn node keeps measuring: it rejoins once its lag has recovered.
        let ours = a.node_id == self.ctx.node_id && self.returned(a.sent_at);
        if ours && (!a.leaving || a.withdrawn) {
            // Our own message: sent and received by this clock, so skew cannot fake lag.
            let lag = (Utc::now() - a.sent_at).to_std().unwrap_or_default();
            self.election.observe_own_lag(now, lag);
        }
    }

    /// Whether `sent_at` is one of our latest announcements, returning for the first time.
    fn returned(&mut self, sent_at: DateTime<Utc>) -> bool {
        let Some(i) = self.sent.iter().position(|s| *s == sent_at) else {
            return false;
        };
        self.sent.remove(i);
        true
    }

    /// Carry out what the election asks. False when an announcement could not be sent
    /// (the bus is broken).
    async fn apply_outputs(&mut self, bus: Option<&Bus>) -> bool {
        let e = &mut self.election;
        let outputs: Vec<Output> = std::iter::from_fn(|| e.poll_output()).collect();
        let snapshot = members_view(e);
        self.ctx.lease.send_replace(e.lease_view());
        self.metrics().set_members(snapshot.4.len());
        let failing = self.ctx.health.failing();
        self.ctx.status.update(|s| {
            (s.role, s.settled, s.candidate, s.lowest, s.members) = snapshot;
            s.failing_checks = failing;
        });
        for output in outputs {
            if !self.apply(output, bus).await {
                return false;
            }
        }
        true
    }

    async fn apply(&mut self, output: Output, bus: Option<&Bus>) -> bool {
        match output {
            Output::Send(a) => {
                let Some(bus) = bus else { return true };
                self.seq += 1;
                let msg = Announcement {
                    node_id: self.ctx.node_id,
                    group: self.ctx.settings.election.group.clone(),
                    sent_at: Utc::now(),
                    seq: self.seq,
                    active: a.active,
                    leaving: a.leaving,
                    probe: a.probe,
                    withdrawn: a.withdrawn,
                    after: None,
                };
                if self.sent.len() == SENT_REMEMBERED {
                    self.sent.pop_front();
                }
                self.sent.push_back(msg.sent_at);
                let sealed = self.admission.seal(Instant::now(), &msg);
                // Already stopping: this is the `leaving` announcement of the stop.
                let leaving = self.ctx.stop.is_cancelled();
                let ttl = self.ctx.settings.election.member_ttl;
                match self.unless_stopped(bus.announce(&sealed, ttl)).await {
                    Some(Ok(())) => self.metrics().announced(),
                    Some(Err(e)) => {
                        tracing::error!(error = %Chain(&e), "cannot announce");
                        return false;
                    }
                    None if leaving => self.ctx.stopping.abandon(
                        "announcing `leaving` (the broker did not take it in time): the \
                         group takes over after election.member_ttl, not within a tick",
                    ),
                    // Interrupted by the stop, whose `leaving` goes next.
                    None => {}
                }
            }
            Output::RoleChanged {
                role,
                reason,
                members,
            } => {
                let members: Vec<String> = members.iter().map(Uuid::to_string).collect();
                tracing::info!(node_id = %self.ctx.node_id, %role, %reason, ?members, "role changed");
                self.ctx.role.send_replace(role);
                let m = self.metrics();
                m.role_changed();
                m.set_active(role == Role::Active);
            }
            Output::BusSilent { for_ } => tracing::warn!(
                silent_for = ?for_,
                "heard no announcement, not even our own: the bus is broken for this node; acting alone"
            ),
            Output::Lagging { lag } => tracing::error!(
                ?lag, max_lag = ?self.ctx.settings.timing().max_lag,
                "own announcements arrive too late: stepping down"
            ),
            Output::LagRecovered { lag } => tracing::info!(?lag, "announcements on time again"),
            Output::Exit { lag } => {
                tracing::error!(
                    ?lag,
                    "lagging for too long: exiting so the orchestrator restarts us"
                );
                self.exit = Some(Exit::Lagging);
            }
            Output::Departed { id, quiet } => {
                if quiet {
                    tracing::debug!(%id, "a passive member fell quiet (not among the announcers)");
                } else {
                    tracing::warn!(%id, "member departed without leaving (frozen, cut off or dead)");
                }
                // Full: the fence task is behind; this node's locks end with its session.
                let _ = self.ctx.departed.try_send(id);
            }
            Output::Candidacy { candidate, reason } => {
                let failing = self.ctx.health.failing();
                if candidate {
                    tracing::info!(%reason, "rejoining: probing the group");
                } else {
                    tracing::warn!(%reason, ?failing, "withdrawn: not a candidate until fit again");
                }
                self.metrics().set_candidate(candidate);
            }
        }
        true
    }

    /// Announce `leaving` so the next node takes over within a tick.
    async fn leave(&mut self, bus: &Bus) {
        self.election.leave(Instant::now());
        self.apply_outputs(Some(bus)).await;
    }

    /// `step` until the stop; once stopping, until the stop's grace is spent (the stop's
    /// own `leaving` is sent then). `None`: given up.
    async fn unless_stopped<T>(&self, step: impl Future<Output = T>) -> Option<T> {
        if self.ctx.stop.is_cancelled() {
            let until = self.ctx.stopping.grace_until();
            return tokio::time::timeout_at(until.into(), step).await.ok();
        }
        tokio::select! {
            _ = self.ctx.stop.cancelled() => None,
            done = step => Some(done),
        }
    }
}

type MembersView = (Role, bool, bool, Uuid, Vec<MemberStatus>);

fn members_view(e: &Election) -> MembersView {
    let members = e
        .members(Instant::now())
        .into_iter()
        .map(|m| MemberStatus {
            node_id: m.id,
            last_seen_ms: m.age.as_millis(),
            active: m.active,
            probing: m.probing,
            withdrawn: m.withdrawn,
        })
        .collect();
    (
        e.role(),
        e.is_settled(),
        e.is_candidate(),
        e.lowest(),
        members,
    )
}
