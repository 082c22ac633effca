//! The simulated world: slots running real `Election`s behind real `Admission`s, a topic
//! exchange that hands every announcement to every queue, an optional attacker on that
//! exchange, and a priority queue of events in virtual time.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use timeoutd::admission::{Admission, Policy};
use timeoutd::election::{Election, Output, Role, Timing};
use timeoutd::wire::announcement::{Announcement, Envelope, GroupKey, Rejected};
use uuid::Uuid;

use crate::measure::{Head, Measures, Report};
use crate::scenario::{Scenario, SimConfig, SimRule};

/// The group's name and the members' broker user in the simulation.
const GROUP: &str = "sim";
const USER: &str = "timeoutd";
const SECRET: &[u8] = b"the simulated group secret";
/// How often the attacker strikes.
const ATTACK_EVERY: Duration = Duration::from_millis(100);
/// Captured announcements the attacker keeps.
const CAPTURED: usize = 2000;

/// One delivery as a queue holds it.
type Mail = Rc<Envelope>;

/// Virtual time in nanoseconds since the start of the run.
type Ns = u64;

fn ns(d: Duration) -> Ns {
    d.as_nanos() as Ns
}

/// One replica's place in the group; a restart puts a fresh node (new id, new queue) in it.
struct Slot {
    election: Option<Election>,
    /// Judges what the node receives, as the daemon does; new with every node.
    admission: Option<Admission>,
    /// The node's announcements so far.
    sent: u64,
    /// Incarnation: events addressed to an earlier node in this slot are dropped.
    inc: u32,
    rule: SimRule,
    paused: bool,
    /// Cut off from the broker: hears nothing, reaches nobody.
    isolated: bool,
    /// Deliveries waiting in a paused node's queue: (sent, announcement, forged).
    backlog: Vec<(Ns, Mail, bool)>,
    /// Counted as active in the measures.
    active: bool,
    /// How far this replica's host clock is off (every node started in it).
    clock: chrono::Duration,
}

#[derive(Debug, Clone)]
enum Event {
    Tick {
        slot: usize,
        inc: u32,
    },
    Deliver {
        slot: usize,
        inc: u32,
        sent: Ns,
        mail: Mail,
        /// Sent by the attacker.
        forged: bool,
    },
    Attack,
    Start {
        slot: usize,
    },
    Disrupt,
    Heal {
        slot: usize,
    },
    Resume {
        slot: usize,
    },
}

/// An event at its time; `seq` keeps equal times in scheduling order (deterministic).
struct Scheduled {
    at: Ns,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct World<'a> {
    cfg: &'a SimConfig,
    rng: StdRng,
    base: Instant,
    now: Ns,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    slots: Vec<Slot>,
    active_all: usize,
    /// Active nodes that are not cut off: the group the takeover measure is about.
    active_outside: usize,
    /// Next slot of a rolling restart.
    cursor: usize,
    measures: Measures,
    policy: Policy,
    /// The attacker's own randomness, so that an attacked run and a quiet one of the
    /// same seed draw the same numbers for the group.
    attacker_rng: StdRng,
    /// What the attacker captured from the exchange: (sent, delivery).
    captured: VecDeque<(Ns, Mail)>,
}

/// Run one simulation to the end and measure it.
pub fn run(cfg: &SimConfig) -> Report {
    let mut world = World::new(cfg);
    let end = ns(cfg.warmup + cfg.duration);
    while let Some(Reverse(next)) = world.queue.pop() {
        if next.at > end {
            break;
        }
        world.now = next.at;
        world.handle(next.event);
        world
            .measures
            .observe(world.now, world.active_all, world.active_outside == 1);
    }
    let head = world.head();
    world.measures.finish(end, head)
}

impl<'a> World<'a> {
    fn new(cfg: &'a SimConfig) -> Self {
        let mut slots: Vec<Slot> = (0..cfg.nodes)
            .map(|i| Slot {
                election: None,
                admission: None,
                sent: 0,
                inc: 0,
                rule: if i < cfg.old_nodes {
                    SimRule::Old
                } else {
                    cfg.rule
                },
                paused: false,
                isolated: false,
                backlog: Vec::new(),
                active: false,
                clock: chrono::Duration::zero(),
            })
            .collect();
        // Host clocks from a generator of their own: a skewed run draws the same numbers
        // for everything else as an unskewed one.
        let mut clocks = StdRng::seed_from_u64(cfg.seed ^ 0xc10c);
        let skew = cfg.clock_skew.as_nanos() as i64;
        for slot in &mut slots {
            if skew > 0 {
                slot.clock = chrono::Duration::nanoseconds(clocks.random_range(-skew..=skew));
            }
        }
        let mut world = Self {
            cfg,
            rng: StdRng::seed_from_u64(cfg.seed),
            base: Instant::now(),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            slots,
            active_all: 0,
            active_outside: 0,
            cursor: 0,
            measures: Measures::new(ns(cfg.warmup)),
            policy: Policy {
                group: GROUP.into(),
                user: USER.into(),
                key: cfg.secret.then(|| GroupKey::new(SECRET)),
                accept_unauthenticated: false,
                announce_interval: cfg.announce_interval,
                member_ttl: cfg.member_ttl,
                // The daemon's default.
                max_clock_skew: Duration::from_secs(1),
            },
            attacker_rng: StdRng::seed_from_u64(cfg.seed ^ 0xa77ac4),
            captured: VecDeque::new(),
        };
        if cfg.attack != crate::Attack::None {
            world.schedule(0, Event::Attack);
        }
        // Replicas start within one tick of each other, as under an orchestrator.
        for slot in 0..cfg.nodes {
            let at = world.rng.random_range(0..ns(cfg.tick));
            world.schedule(at, Event::Start { slot });
        }
        if let Some(period) = cfg.scenario.period() {
            world.schedule(ns(cfg.warmup + period), Event::Disrupt);
        }
        world
    }

    fn head(&self) -> Head {
        let cfg = self.cfg;
        Head {
            scenario: cfg.scenario,
            nodes: cfg.nodes,
            old_nodes: cfg.old_nodes,
            rule: cfg.rule,
            announcers: cfg.announcers,
            seed: cfg.seed,
            seconds: cfg.duration.as_secs_f64(),
            loss: cfg.links.loss,
            jitter_ms: cfg.links.jitter.as_secs_f64() * 1e3,
            announce_interval_s: cfg.announce_interval.as_secs_f64(),
            attack: cfg.attack,
            secret: cfg.secret,
            clock_skew_s: cfg.clock_skew.as_secs_f64(),
        }
    }

    fn schedule(&mut self, at: Ns, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled {
            at,
            seq: self.seq,
            event,
        }));
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.now)
    }

    /// The true time, fixed for determinism; the attacker's clock.
    fn wall(&self) -> DateTime<Utc> {
        DateTime::<Utc>::UNIX_EPOCH
            + chrono::Duration::days(20_000)
            + chrono::Duration::nanoseconds(self.now as i64)
    }

    /// The wall clock of the host of `slot` (off by its skew).
    fn wall_at(&self, slot: usize) -> DateTime<Utc> {
        self.wall() + self.slots[slot].clock
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Tick { slot, inc } => self.tick(slot, inc),
            Event::Deliver {
                slot,
                inc,
                sent,
                mail,
                forged,
            } => self.deliver(slot, inc, sent, mail, forged),
            Event::Attack => self.attack(),
            Event::Start { slot } => self.start(slot),
            Event::Disrupt => self.disrupt(),
            Event::Heal { slot } => self.heal(slot),
            Event::Resume { slot } => self.resume(slot),
        }
    }

    fn start(&mut self, slot: usize) {
        let id = uuid::Builder::from_random_bytes(self.rng.random()).into_uuid();
        let mut timing = Timing::new(self.cfg.announce_interval, self.cfg.member_ttl);
        timing.rule = self.cfg.election_rule(self.slots[slot].rule);
        let now = self.instant();
        let wall = self.wall_at(slot);
        let s = &mut self.slots[slot];
        s.inc += 1;
        s.paused = false;
        s.isolated = false;
        s.backlog.clear();
        s.election = Some(Election::new(id, timing, now));
        s.admission = Some(Admission::new(self.policy.clone(), Some(id), wall));
        s.sent = 0;
        let inc = s.inc;
        self.schedule(self.now + ns(self.cfg.tick), Event::Tick { slot, inc });
        self.flush(slot);
    }

    fn tick(&mut self, slot: usize, inc: u32) {
        let now = self.instant();
        let s = &mut self.slots[slot];
        if s.inc != inc || s.paused {
            return;
        }
        let Some(e) = s.election.as_mut() else { return };
        e.tick(now);
        self.schedule(self.now + ns(self.cfg.tick), Event::Tick { slot, inc });
        self.flush(slot);
    }

    fn deliver(&mut self, slot: usize, inc: u32, sent: Ns, mail: Mail, forged: bool) {
        let s = &mut self.slots[slot];
        if s.inc != inc || s.election.is_none() || s.isolated {
            return;
        }
        if s.paused {
            s.backlog.push((sent, mail, forged));
            return;
        }
        self.step(slot, sent, &mail, forged);
        self.flush(slot);
    }

    /// One delivery into the node: judged by its admission, then (if it counts) into
    /// the election; its own echo also measures its lag.
    fn step(&mut self, slot: usize, sent: Ns, mail: &Envelope, forged: bool) {
        let now = self.instant();
        let wall = self.wall_at(slot);
        let lag = Duration::from_nanos(self.now - sent);
        let s = &mut self.slots[slot];
        let (Some(e), Some(admission)) = (s.election.as_mut(), s.admission.as_mut()) else {
            return;
        };
        let a = match admission.admit(now, wall, mail) {
            Ok(a) => a,
            Err(Rejected::Unvouched { answer, .. }) => {
                self.measures.unvouched += 1;
                if answer {
                    e.unvouched();
                }
                return;
            }
            Err(_) => {
                self.measures.rejected += 1;
                return;
            }
        };
        self.measures.attacker_counted += u64::from(forged);
        e.step(now, a.heard());
        if a.node_id == e.id() {
            e.observe_own_lag(now, lag);
        }
    }

    /// Carry out a node's outputs, then recount it.
    fn flush(&mut self, slot: usize) {
        let mut sends = Vec::new();
        let mut exit = false;
        let wall = self.wall_at(slot);
        let now = self.instant();
        let s = &mut self.slots[slot];
        if let Some(e) = s.election.as_mut() {
            while let Some(out) = e.poll_output() {
                match out {
                    Output::Send(a) => {
                        s.sent += 1;
                        sends.push(Announcement {
                            node_id: e.id(),
                            group: GROUP.into(),
                            sent_at: wall,
                            seq: s.sent,
                            active: a.active,
                            leaving: a.leaving,
                            probe: a.probe,
                            withdrawn: a.withdrawn,
                            after: None,
                        })
                    }
                    Output::Exit { .. } => exit = true,
                    _ => {}
                }
            }
        }
        for a in sends {
            let Some(admission) = self.slots[slot].admission.as_mut() else {
                break;
            };
            let mail = Rc::new(admission.seal(now, &a));
            self.broadcast(slot, mail);
        }
        if exit {
            self.kill(slot, Duration::from_secs(2));
        }
        self.recount(slot);
    }

    /// The topic exchange: one copy per bound queue (every live node, paused ones
    /// included), each through the link model; expired copies (older than
    /// `member_ttl`, the per-message expiration) are dropped.
    fn broadcast(&mut self, from: usize, mail: Mail) {
        if self.slots[from].isolated {
            return;
        }
        if self.cfg.attack.replays() {
            if self.captured.len() == CAPTURED {
                self.captured.pop_front();
            }
            self.captured.push_back((self.now, mail.clone()));
        }
        self.send_to_all(mail, Some(from));
    }

    /// One copy per bound queue through the link model; the attacker's traffic (`from`
    /// = `None`) draws from its own randomness and is not counted as the group's.
    fn send_to_all(&mut self, mail: Mail, from: Option<usize>) {
        let attacker = from.is_none();
        let ttl = ns(self.cfg.member_ttl);
        for to in 0..self.slots.len() {
            let s = &self.slots[to];
            if s.election.is_none() || s.isolated {
                continue;
            }
            let inc = s.inc;
            let copies = if attacker {
                self.cfg.links.copies(&mut self.attacker_rng)
            } else {
                self.measures.delivered(self.now);
                self.cfg.links.copies(&mut self.rng)
            };
            for delay in copies {
                if delay <= ttl {
                    let event = Event::Deliver {
                        slot: to,
                        inc,
                        sent: self.now,
                        mail: mail.clone(),
                        forged: attacker,
                    };
                    self.schedule(self.now + delay, event);
                }
            }
        }
    }

    /// One strike of the attacker (see [`crate::Attack`]).
    fn attack(&mut self) {
        self.schedule(self.now + ns(ATTACK_EVERY), Event::Attack);
        let wall = self.wall();
        if self.cfg.attack.forges() {
            let forged = |node: Uuid, active: bool, leaving: bool| Announcement {
                node_id: node,
                group: GROUP.into(),
                sent_at: wall,
                seq: u64::MAX,
                active,
                leaving,
                probe: false,
                withdrawn: false,
                after: Some(Vec::new()),
            };
            let target = self
                .target()
                .and_then(|slot| self.slots[slot].election.as_ref())
                .map(Election::id);
            let mut mails = Vec::new();
            let lowest = forged(Uuid::nil(), true, false);
            for user in [None, Some("intruder")] {
                let mut mail = self.policy.seal(&lowest);
                mail.user_id = user.map(str::to_owned);
                mail.signature = None;
                mails.push(mail);
            }
            if let Some(target) = target {
                let mut mail = self.policy.seal(&forged(target, false, true));
                mail.user_id = None;
                mail.signature = None;
                mails.push(mail);
            }
            if self.cfg.secret {
                // The attacker logs in as the members' user, but has no secret.
                let mut mail = self.policy.seal(&lowest);
                mail.signature = Some("ab".repeat(32));
                mails.push(mail);
            }
            for mail in mails {
                self.send_to_all(Rc::new(mail), None);
            }
        }
        // Only what it captured long enough ago that the news is old everywhere: a copy
        // of an announcement a node missed counts there while the news is recent (at most
        // about 2 × member_ttl, see `timeoutd::admission`), as the original would have.
        let replay_after = self.cfg.member_ttl * 2 + self.cfg.announce_interval;
        let old = self.now.saturating_sub(ns(replay_after));
        let ripe = self
            .captured
            .iter()
            .take_while(|(at, _)| *at <= old)
            .count();
        if self.cfg.attack.replays() && ripe > 0 {
            let i = self.attacker_rng.random_range(0..ripe);
            let mail = self.captured[i].1.clone();
            self.send_to_all(mail, None);
        }
    }

    fn recount(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        let active = !s.paused
            && s.election
                .as_ref()
                .is_some_and(|e| e.role() == Role::Active);
        if active == s.active {
            return;
        }
        s.active = active;
        let isolated = s.isolated;
        if active {
            self.active_all += 1;
            self.active_outside += usize::from(!isolated);
        } else {
            self.active_all -= 1;
            self.active_outside -= usize::from(!isolated);
        }
    }

    /// The node the scenarios aim at: the lowest active one outside any partition, or
    /// the lowest live one.
    fn target(&self) -> Option<usize> {
        let live = |i: &usize| {
            let s = &self.slots[*i];
            s.election.is_some() && !s.isolated && !s.paused
        };
        let id = |i: &usize| self.slots[*i].election.as_ref().map(Election::id);
        let lowest = |only_active: bool| {
            (0..self.slots.len())
                .filter(live)
                .filter(|i| !only_active || self.slots[*i].active)
                .min_by_key(id)
        };
        lowest(true).or_else(|| lowest(false))
    }

    fn disrupt(&mut self) {
        let Some(period) = self.cfg.scenario.period() else {
            return;
        };
        self.schedule(self.now + ns(period), Event::Disrupt);
        match self.cfg.scenario {
            Scenario::None | Scenario::Loss => {}
            Scenario::RollingRestart => self.rolling_restart(),
            Scenario::CrashLowest => {
                if let Some(slot) = self.target() {
                    self.kill(slot, Duration::from_secs(2));
                }
            }
            Scenario::PartitionLowest => {
                if let Some(slot) = self.target() {
                    self.isolate(slot, Duration::from_secs(5));
                }
            }
            Scenario::PauseLowest => {
                if let Some(slot) = self.target() {
                    self.pause(slot, Duration::from_secs(5));
                }
            }
            Scenario::Churn => self.churn(),
        }
    }

    fn rolling_restart(&mut self) {
        let slot = self.cursor % self.slots.len();
        self.cursor += 1;
        self.slots[slot].rule = self.cfg.rule;
        self.leave(slot, Duration::from_secs(1));
    }

    fn churn(&mut self) {
        let slot = self.rng.random_range(0..self.slots.len());
        if self.slots[slot].election.is_none() || self.slots[slot].paused {
            return;
        }
        match self.rng.random_range(0..3) {
            0 => self.kill(slot, Duration::from_secs(2)),
            1 => self.leave(slot, Duration::from_secs(1)),
            _ => self.pause(slot, Duration::from_secs(2)),
        }
    }

    /// Graceful stop (`leaving` goes out), a fresh node in the slot after `down`.
    fn leave(&mut self, slot: usize, down: Duration) {
        let now = self.instant();
        let Some(e) = self.slots[slot].election.as_mut() else {
            return;
        };
        e.leave(now);
        self.flush(slot);
        self.kill(slot, down);
    }

    /// Crash: gone without a word (its queue with it), a fresh node after `down`.
    fn kill(&mut self, slot: usize, down: Duration) {
        self.measures.disrupted(self.now);
        let s = &mut self.slots[slot];
        s.election = None;
        s.paused = false;
        s.backlog.clear();
        self.recount(slot);
        self.slots[slot].isolated = false;
        self.schedule(self.now + ns(down), Event::Start { slot });
    }

    fn isolate(&mut self, slot: usize, for_: Duration) {
        self.measures.disrupted(self.now);
        self.set_isolated(slot, true);
        let at = self.now + ns(for_);
        self.schedule(at, Event::Heal { slot });
    }

    fn heal(&mut self, slot: usize) {
        if self.slots[slot].isolated {
            self.measures.disrupted(self.now);
            self.set_isolated(slot, false);
        }
    }

    fn set_isolated(&mut self, slot: usize, isolated: bool) {
        let s = &mut self.slots[slot];
        if s.active {
            if isolated {
                self.active_outside -= 1;
            } else {
                self.active_outside += 1;
            }
        }
        s.isolated = isolated;
    }

    fn pause(&mut self, slot: usize, for_: Duration) {
        self.measures.disrupted(self.now);
        self.slots[slot].paused = true;
        self.recount(slot);
        let at = self.now + ns(for_);
        self.schedule(at, Event::Resume { slot });
    }

    /// The process runs again: its queue is read (what has not expired), then it ticks.
    fn resume(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if !s.paused {
            return;
        }
        s.paused = false;
        let inc = s.inc;
        let backlog = std::mem::take(&mut s.backlog);
        self.measures.disrupted(self.now);
        let ttl = ns(self.cfg.member_ttl);
        for (sent, mail, forged) in backlog {
            if self.now - sent <= ttl {
                self.step(slot, sent, &mail, forged);
            }
        }
        self.tick(slot, inc);
        self.flush(slot);
    }
}
