//! The GUID election as a pure state machine.
//!
//! No I/O, no async, no clock: the caller feeds in monotonic time (`Instant`) and the
//! announcements it received, and drains [`Output`]s telling it what to send and when the
//! role changed. This mirrors raft-rs' `RawNode`: `tick`, `step`, then `poll_output`.
//!
//! The rules are RouteMaster's TimeoutManager election (announce every interval, remember
//! when each member was last heard, forget members older than `member_ttl`, lowest live id
//! acts), with these corrections:
//! - expiry keeps the *live* members (the published `cleanOld` kept the dead ones);
//! - a node starts passive, probes, and settles before it may act;
//! - a `leaving` announcement removes its sender at once;
//! - a node that hears nobody, not even itself, warns and acts alone (the database
//!   transaction, not the election, is what keeps rows from firing twice);
//! - a node re-checks its lease before committing: a monotonic gap larger than
//!   `member_ttl` since the last tick means it was paused, so it drops to passive and settles
//!   again instead of acting on a stale view;
//! - a node unfit to act *withdraws*: it stops being a candidate for itself and for
//!   everyone who hears it, so the group neither waits for it nor hands it the role.
//!   Causes: its own checks (Postgres, publishing) failing for longer than `member_ttl`,
//!   or its own announcements coming back later than `max_lag` (the "suicidal snail",
//!   which also asks to exit when the lag persists past `max_lag_exit`). When the last
//!   cause clears it rejoins like a newcomer: probe, then settle;
//! - a probe is answered at the next tick, once, however many probes arrived;
//! - with [`Rule::Lowest`] (the default) only the nodes that know fewer than `k` lower
//!   live candidates announce, so announcement traffic grows as O(N) instead of O(N²);
//!   see [`Rule`] for why that keeps every guarantee.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Timing knobs of the election, and who announces; validated by `config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub announce_interval: Duration,
    pub member_ttl: Duration,
    /// Own announcements slower than this make the node step down.
    pub max_lag: Duration,
    /// A node lagging continuously for this long asks to exit.
    pub max_lag_exit: Duration,
    pub rule: Rule,
}

impl Timing {
    /// Timing with `max_lag` at half of `member_ttl`, `max_lag_exit` at 3 × `member_ttl`
    /// and the default [`Rule`].
    pub fn new(announce_interval: Duration, member_ttl: Duration) -> Self {
        Self {
            announce_interval,
            member_ttl,
            max_lag: member_ttl / 2,
            max_lag_exit: member_ttl * 3,
            rule: Rule::default(),
        }
    }
}

/// Who announces every interval (and answers newcomers' probes).
///
/// With `All` every node does: each interval costs N announcements × N deliveries (the
/// topic exchange hands each to every member). With `Lowest { announcers: k }` a node
/// announces only while it is active or knows fewer than `k` lower live settled
/// candidates; the others are *quiet*. In a steady group the `k` lowest announce: k·N
/// deliveries per interval. It keeps the guarantees because:
/// - a quiet node knows a lower live candidate, so it is passive; the active node and
///   its `k - 1` successors announce exactly as before, so a crash or a graceful leave
///   of the active node is taken over by the next one in the same time as with `All`
///   (hence `k` ≥ 2);
/// - a quiet node never takes the role before announcing again: once fewer than `k`
///   lower candidates are live in its view (expired after `member_ttl`, or `leaving`)
///   it announces at the next tick, and when it knows no lower candidate at all (all `k`
///   gone at once, or it was cut off) it probes and settles first, keeping its view,
///   so that nodes quiet until now hear each other before one of them acts;
/// - observers' probes (`probe` + `leaving`, e.g. `timeoutd members`) are answered by
///   every node, quiet or not, so the whole group stays visible.
///
/// No wire change: nodes of the previous version (which follow `All`) hear the
/// announcers, which are the lowest live candidates, so they elect the same node; they
/// never hear quiet nodes, which are never the lowest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Every node announces every interval (the rule of earlier versions).
    All,
    /// Only the nodes among the `announcers` lowest live candidates they know announce.
    Lowest { announcers: usize },
}

impl Default for Rule {
    fn default() -> Self {
        Rule::Lowest { announcers: 3 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Passive,
    Active,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Passive => "passive",
            Role::Active => "active",
        })
    }
}

/// The answer to "may I act?", asked right before publishing and before committing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// Active, with a fresh view.
    Held,
    /// Not (or no longer) active, but the view is fresh: someone else is in charge now.
    Demoted,
    /// The process was paused longer than `member_ttl`: everything it believes is old.
    Stale,
}

/// A snapshot of the lease, for tasks that must not wait for the election's owner: the
/// role, and until when the view it rests on is fresh (`member_ttl` after the last tick:
/// past that the driver has not ticked — a paused process, a stuck task — and nothing it
/// believes can be trusted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseView {
    pub role: Role,
    pub fresh_until: Instant,
    pub generation: u64,
}

impl LeaseView {
    /// A view that holds nothing (before the election has run, or after it stopped).
    pub fn none(now: Instant) -> Self {
        Self {
            role: Role::Passive,
            fresh_until: now,
            generation: 0,
        }
    }

    /// May the node act at `now`? The one rule for `Held`: active with a fresh view.
    pub fn check(&self, now: Instant) -> Lease {
        match self.role {
            _ if now > self.fresh_until => Lease::Stale,
            Role::Active => Lease::Held,
            Role::Passive => Lease::Demoted,
        }
    }
}

/// What a received announcement tells the election (the wire format lives in
/// `announcement`; this is only the part the rules need).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard {
    pub from: Uuid,
    pub active: bool,
    pub leaving: bool,
    pub probe: bool,
    /// The sender is not a candidate; it stays a member (it still announces).
    pub withdrawn: bool,
}

/// An announcement the node must send now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announce {
    pub active: bool,
    /// Set on shutdown, and also while withdrawn: nodes of the previous version ignore
    /// `withdrawn` but drop a leaving sender at once, so they stop waiting for it too.
    pub leaving: bool,
    pub probe: bool,
    pub withdrawn: bool,
}

/// Why the role changed (or why the node is worried); logged with every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// Settled and the lowest live id.
    Lowest,
    /// A lower settled member is live.
    LowerMember(Uuid),
    /// Monotonic time jumped by more than `member_ttl` since the last tick.
    Paused(Duration),
    /// Own announcements arrive this late.
    Lagging(Duration),
    /// Own checks (Postgres, publishing) have been failing for this long.
    Unhealthy(Duration),
    /// Every cause of a withdrawal has cleared.
    Fit,
    /// The connection to the broker was lost.
    BusLost,
    /// The node is shutting down.
    Leaving,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Lowest => f.write_str("lowest live id"),
            Reason::LowerMember(id) => write!(f, "lower member {id} is live"),
            Reason::Paused(gap) => write!(f, "paused for {gap:?}, view is stale"),
            Reason::Lagging(lag) => write!(f, "own announcements arrive {lag:?} late"),
            Reason::Unhealthy(d) => write!(f, "own checks failing for {d:?}"),
            Reason::Fit => f.write_str("own checks pass and announcements are on time"),
            Reason::BusLost => f.write_str("lost the broker connection"),
            Reason::Leaving => f.write_str("shutting down"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Send(Announce),
    RoleChanged {
        role: Role,
        reason: Reason,
        members: Vec<Uuid>,
    },
    /// Nothing, not even our own announcements, heard for `member_ttl`.
    BusSilent {
        for_: Duration,
    },
    /// Own announcements started arriving later than `max_lag`: not fit to act.
    Lagging {
        lag: Duration,
    },
    /// Own announcements are on time again.
    LagRecovered {
        lag: Duration,
    },
    /// Lag persisted past `max_lag_exit`: the process should exit so it gets restarted.
    Exit {
        lag: Duration,
    },
    /// A member went silent for `member_ttl` without saying it was leaving: frozen,
    /// cut off or dead. Whatever rows it held locked, the active node releases (see
    /// `fence`). `quiet`: it was not active and the rule lets such a member stop
    /// announcing ([`Rule::Lowest`]), so its silence is no sign of trouble.
    Departed {
        id: Uuid,
        quiet: bool,
    },
    /// The node withdrew (`candidate: false`, with the cause) or rejoins (`true`).
    Candidacy {
        candidate: bool,
        reason: Reason,
    },
}

#[derive(Debug, Clone, Copy)]
struct Member {
    last_seen: Instant,
    active: bool,
    /// Still settling: not a candidate until it announces without `probe`.
    probing: bool,
    /// Unfit to act: never a candidate, but still a member until it expires.
    withdrawn: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Settling {
        until: Instant,
    },
    Settled,
    /// Unfit to act (see `Causes`); announces `withdrawn` and never takes the role.
    Withdrawn,
    Leaving,
}

/// Why a node is withdrawn; it rejoins when none holds.
#[derive(Debug, Clone, Copy, Default)]
struct Causes {
    unhealthy: bool,
    /// Since when own announcements have been late.
    lagging_since: Option<Instant>,
}

impl Causes {
    fn any(&self) -> bool {
        self.unhealthy || self.lagging_since.is_some()
    }
}

/// A member as seen from this node, for status views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberView {
    pub id: Uuid,
    pub age: Duration,
    pub active: bool,
    pub probing: bool,
    pub withdrawn: bool,
}

#[derive(Debug)]
pub struct Election {
    me: Uuid,
    timing: Timing,
    members: BTreeMap<Uuid, Member>,
    phase: Phase,
    role: Role,
    last_tick: Instant,
    /// Counts role changes: a lease view of another generation is another lease.
    generation: u64,
    /// When the current view began (start, or the last restart after a pause): checks
    /// failing since before it count from here.
    view_since: Instant,
    last_heard: Instant,
    next_announce: Instant,
    silent_warned: bool,
    causes: Causes,
    /// A probe from another node awaits our answer, sent at the next tick.
    answer_due: bool,
    /// An observer's probe awaits our answer; quiet nodes answer these too.
    observer_due: bool,
    /// Not announcing (see [`Rule::Lowest`]); decided at each tick.
    quiet: bool,
    outputs: VecDeque<Output>,
}

impl Election {
    /// A new node: passive, probing, settling for one announce interval.
    pub fn new(me: Uuid, timing: Timing, now: Instant) -> Self {
        let mut e = Self {
            me,
            timing,
            members: BTreeMap::new(),
            phase: Phase::Settled,
            role: Role::Passive,
            last_tick: now,
            generation: 0,
            view_since: now,
            last_heard: now,
            next_announce: now,
            silent_warned: false,
            causes: Causes::default(),
            answer_due: false,
            observer_due: false,
            quiet: false,
            outputs: VecDeque::new(),
        };
        e.settle(now);
        e
    }

    pub fn id(&self) -> Uuid {
        self.me
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn is_settled(&self) -> bool {
        self.phase == Phase::Settled
    }

    /// Neither withdrawn nor leaving: this node may hold the role once settled.
    pub fn is_candidate(&self) -> bool {
        matches!(self.phase, Phase::Settling { .. } | Phase::Settled)
    }

    /// Not announcing, because enough lower live candidates are known (see [`Rule`]).
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// The lowest candidate id: settled, not withdrawn live members, and this node while
    /// it is a candidate. This node's id when nobody is a candidate (all withdrawn).
    pub fn lowest(&self) -> Uuid {
        let me = self.is_candidate().then_some(self.me);
        self.lowest_candidate(true, me).unwrap_or(self.me)
    }

    pub fn members(&self, now: Instant) -> Vec<MemberView> {
        self.members
            .iter()
            .map(|(id, m)| MemberView {
                id: *id,
                age: now.saturating_duration_since(m.last_seen),
                active: m.active,
                probing: m.probing,
                withdrawn: m.withdrawn,
            })
            .collect()
    }

    /// Next output to act on, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// Advance time: detect pauses, expire members, end settling, announce when due
    /// (periodically, or to answer probes heard since the last tick: one send at most).
    pub fn tick(&mut self, now: Instant) {
        if self.phase == Phase::Leaving {
            return;
        }
        if self.detect_pause(now) {
            return;
        }
        self.last_tick = now;
        self.expire(now);
        self.check_silence(now);
        let mut settled_now = false;
        if let Phase::Settling { until } = self.phase
            && now >= until
        {
            self.phase = Phase::Settled;
            settled_now = true;
        }
        self.recompute();
        if self.update_quiet(now) {
            return;
        }
        let due = settled_now || self.answer_due || now >= self.next_announce;
        if self.observer_due || (due && !self.quiet) {
            self.queue_announce();
        }
    }

    /// Take in one announcement from the group (our own echo included).
    pub fn step(&mut self, now: Instant, heard: Heard) {
        if self.phase == Phase::Leaving {
            return;
        }
        // Queued announcements delivered after a pause must not refresh a stale view.
        self.detect_pause(now);
        self.last_heard = now;
        self.silent_warned = false;
        self.remember(now, heard);
        if heard.from != self.me {
            // Answered at the next tick, so a flood of probes costs one answer per tick.
            self.answer_due |= heard.probe;
            self.observer_due |= heard.probe && heard.leaving && !heard.withdrawn;
            self.settle_early_on_active_answer(heard);
        }
        self.recompute();
    }

    /// An announcement with proof from a sender the admission cannot vouch for yet (heard
    /// for the first time, or again after a gap): no member, nothing heard, but answered
    /// at the next tick (by an announcing node, as a probe is), since the answer names
    /// it and lets a live sender prove it is live.
    pub fn unvouched(&mut self) {
        if self.phase != Phase::Leaving {
            self.answer_due = true;
        }
    }

    /// The driver's own checks (Postgres usable, TimeOuts publishable), every tick:
    /// `failing_since` is when they started failing continuously, `None` while they pass.
    /// Failing for longer than `member_ttl` withdraws the node until they pass again.
    pub fn observe_health(&mut self, now: Instant, failing_since: Option<Instant>) {
        if self.phase == Phase::Leaving {
            return;
        }
        // A process paused with a check under way would count the pause as failing.
        self.detect_pause(now);
        let Some(since) = failing_since else {
            if std::mem::take(&mut self.causes.unhealthy) {
                self.rejoin_if_fit(now);
            }
            return;
        };
        let failing = now.saturating_duration_since(since.max(self.view_since));
        if failing > self.timing.member_ttl && !self.causes.unhealthy {
            self.causes.unhealthy = true;
            self.withdraw(Reason::Unhealthy(failing));
        }
    }

    /// The lag of one of our own announcements (receive minus send, both our clock).
    pub fn observe_own_lag(&mut self, now: Instant, lag: Duration) {
        if self.phase == Phase::Leaving {
            return;
        }
        if lag <= self.timing.max_lag {
            if self.causes.lagging_since.take().is_some() {
                self.outputs.push_back(Output::LagRecovered { lag });
                self.rejoin_if_fit(now);
            }
            return;
        }
        let since = match self.causes.lagging_since {
            Some(since) => since,
            None => {
                self.outputs.push_back(Output::Lagging { lag });
                *self.causes.lagging_since.insert(now)
            }
        };
        if now.saturating_duration_since(since) >= self.timing.max_lag_exit {
            self.outputs.push_back(Output::Exit { lag });
        }
        // At once, not after `member_ttl`: the group must not wait for a snail.
        self.withdraw(Reason::Lagging(lag));
    }

    /// Re-check the lease right before acting. A pause longer than `member_ttl` since
    /// the last tick makes the view stale: the role is dropped and the node settles again.
    pub fn check_lease(&mut self, now: Instant) -> Lease {
        if self.detect_pause(now) {
            return Lease::Stale;
        }
        self.lease_view().check(now)
    }

    /// What another task needs to decide whether this node may act, without asking the
    /// election: the driver publishes it after every input (see [`LeaseView`]).
    pub fn lease_view(&self) -> LeaseView {
        LeaseView {
            role: self.role,
            fresh_until: self.last_tick + self.timing.member_ttl,
            generation: self.generation,
        }
    }

    /// The connection to the broker is gone (a node that cannot announce must not hold
    /// the role): passive at once; after reconnecting it probes and settles again.
    pub fn bus_lost(&mut self, now: Instant) {
        if self.phase != Phase::Leaving {
            self.restart(now, Reason::BusLost);
        }
    }

    /// The bus is up for the first time. Connecting may have taken longer than an
    /// interval: the settling starts now, so that the group hears our probe for a whole
    /// interval before we may act.
    pub fn connected(&mut self, now: Instant) {
        if let Phase::Settling { .. } = self.phase {
            self.settle_from(now);
            self.last_tick = now;
            self.view_since = now;
            self.last_heard = now;
        }
    }

    /// Shut down: go passive and announce `leaving` once. Further input is ignored.
    pub fn leave(&mut self, now: Instant) {
        if self.phase == Phase::Leaving {
            return;
        }
        self.set_role(Role::Passive, Reason::Leaving);
        self.phase = Phase::Leaving;
        self.last_tick = now;
        // The leaving announcement says it all; drop the ordinary one set_role queued.
        self.outputs.retain(|o| !matches!(o, Output::Send(_)));
        self.outputs.push_back(Output::Send(Announce {
            active: false,
            leaving: true,
            probe: false,
            withdrawn: false,
        }));
    }

    /// Probe and settle for one announce interval (or until the active node answers).
    fn settle(&mut self, now: Instant) {
        self.settle_from(now);
        self.queue_announce();
    }

    fn settle_from(&mut self, now: Instant) {
        self.phase = Phase::Settling {
            until: now + self.timing.announce_interval,
        };
    }

    fn detect_pause(&mut self, now: Instant) -> bool {
        let gap = now.saturating_duration_since(self.last_tick);
        // A leaving node stops ticking; its gap means nothing and it must not restart.
        if gap <= self.timing.member_ttl || self.phase == Phase::Leaving {
            return false;
        }
        self.restart(now, Reason::Paused(gap));
        true
    }

    /// Drop the role and the view, probe and settle again; a withdrawn node stays
    /// withdrawn (its causes are about itself, not about the view) and does not probe.
    fn restart(&mut self, now: Instant, reason: Reason) {
        self.set_role(Role::Passive, reason);
        self.members.clear();
        self.view_since = now;
        self.last_tick = now;
        self.last_heard = now;
        self.quiet = false;
        if self.phase == Phase::Withdrawn {
            self.queue_announce();
        } else {
            self.settle(now);
        }
    }

    /// A cause of withdrawal appeared; only the first one changes anything.
    fn withdraw(&mut self, reason: Reason) {
        if !self.is_candidate() {
            return;
        }
        self.phase = Phase::Withdrawn;
        self.set_role(Role::Passive, reason.clone());
        self.outputs.push_back(Output::Candidacy {
            candidate: false,
            reason,
        });
        // Tell the group now, active or not: it must stop counting on us at once.
        self.queue_announce();
    }

    /// A cause cleared; with none left, rejoin like a newcomer, keeping the view.
    fn rejoin_if_fit(&mut self, now: Instant) {
        if self.phase != Phase::Withdrawn || self.causes.any() {
            return;
        }
        self.outputs.push_back(Output::Candidacy {
            candidate: true,
            reason: Reason::Fit,
        });
        self.settle(now);
    }

    /// A `leaving` sender is dropped at once, unless it is only withdrawn: that one stays
    /// a (non-candidate) member until it leaves or expires.
    fn remember(&mut self, now: Instant, heard: Heard) {
        if heard.leaving && !heard.withdrawn {
            self.members.remove(&heard.from);
            return;
        }
        self.members.insert(
            heard.from,
            Member {
                last_seen: now,
                active: heard.active,
                probing: heard.probe,
                withdrawn: heard.withdrawn,
            },
        );
    }

    /// Keep the members heard within `member_ttl` (the published version inverted this).
    fn expire(&mut self, now: Instant) {
        let ttl = self.timing.member_ttl;
        let may_fall_quiet = matches!(self.timing.rule, Rule::Lowest { .. });
        let (me, outputs) = (self.me, &mut self.outputs);
        self.members.retain(|id, m| {
            let live = now.saturating_duration_since(m.last_seen) <= ttl;
            if !live && *id != me {
                outputs.push_back(Output::Departed {
                    id: *id,
                    quiet: may_fall_quiet && !m.active,
                });
            }
            live
        });
    }

    fn check_silence(&mut self, now: Instant) {
        let quiet = now.saturating_duration_since(self.last_heard);
        if quiet > self.timing.member_ttl && !self.silent_warned {
            self.silent_warned = true;
            self.outputs.push_back(Output::BusSilent { for_: quiet });
        }
    }

    /// The active node answering our probe tells us the group's state: no need to wait.
    fn settle_early_on_active_answer(&mut self, heard: Heard) {
        if heard.active && !heard.probe && matches!(self.phase, Phase::Settling { .. }) {
            self.phase = Phase::Settled;
            match self.timing.rule {
                Rule::All => self.queue_announce(),
                // At the next tick, when the other announcers' answers are in too: a
                // newcomer that knows enough lower candidates by then stays quiet.
                Rule::Lowest { .. } => self.next_announce = self.last_tick,
            }
        }
    }

    /// The lowest live member that is not withdrawn (and, with `settled_only`, not
    /// probing), or `me` if lower. Our own echo is skipped: whether this node is a
    /// candidate is its phase, which the echo may not reflect yet.
    fn lowest_candidate(&self, settled_only: bool, me: Option<Uuid>) -> Option<Uuid> {
        let member = self
            .members
            .iter()
            .find(|(id, m)| **id != self.me && !m.withdrawn && !(settled_only && m.probing))
            .map(|(id, _)| *id);
        member.into_iter().chain(me).min()
    }

    /// Settled, not withdrawn live members with a lower id than ours.
    fn lower_settled_candidates(&self) -> usize {
        self.members
            .range(..self.me)
            .filter(|(_, m)| !m.withdrawn && !m.probing)
            .count()
    }

    /// Whether this node should announce now under its rule. The active node always
    /// does; so does a settling one (its probe is how it learns the group).
    fn loud(&self) -> bool {
        match self.timing.rule {
            Rule::All => true,
            Rule::Lowest { announcers } => {
                self.role == Role::Active
                    || matches!(self.phase, Phase::Settling { .. })
                    || self.lower_settled_candidates() < announcers
            }
        }
    }

    /// Decide, at a tick, whether the node is quiet. A quiet node that must speak again
    /// and knows no lower candidate at all probes and settles before it may act: its view
    /// held only the announcers, so other quiet nodes may be lower. True when it did.
    fn update_quiet(&mut self, now: Instant) -> bool {
        let quiet = !self.loud();
        let was_quiet = std::mem::replace(&mut self.quiet, quiet);
        if !was_quiet || self.quiet || self.phase != Phase::Settled {
            return false;
        }
        if self.lower_settled_candidates() > 0 {
            return false;
        }
        self.settle(now);
        true
    }

    /// Asymmetric on purpose: to *take* the role a node defers to every live lower
    /// candidate, settling or not (nodes started together must not all act); to *keep*
    /// it, only a settled lower member counts (a newcomer's probe must not leave the
    /// group without an active node while the newcomer settles). Withdrawn members
    /// count for neither. A quiet node never takes the role: it speaks (and, knowing
    /// nobody lower, settles) at its next tick first.
    fn recompute(&mut self) {
        if self.phase != Phase::Settled {
            return;
        }
        let settled_only = self.role == Role::Active;
        let lowest = self
            .lowest_candidate(settled_only, Some(self.me))
            .unwrap_or(self.me);
        if lowest == self.me && self.quiet {
            return;
        }
        if lowest == self.me {
            self.set_role(Role::Active, Reason::Lowest);
        } else {
            self.set_role(Role::Passive, Reason::LowerMember(lowest));
        }
    }

    fn set_role(&mut self, role: Role, reason: Reason) {
        if self.role == role {
            return;
        }
        self.role = role;
        self.generation += 1;
        let members = self.members.keys().copied().collect();
        self.outputs.push_back(Output::RoleChanged {
            role,
            reason,
            members,
        });
        self.queue_announce();
    }

    /// Queue our announcement with the current state, replacing one still queued (it
    /// would only be older news); it answers any probe heard so far.
    fn queue_announce(&mut self) {
        self.next_announce = self.last_tick + self.timing.announce_interval;
        self.answer_due = false;
        self.observer_due = false;
        self.outputs
            .retain(|o| !matches!(o, Output::Send(a) if a.withdrawn || !a.leaving));
        let withdrawn = self.phase == Phase::Withdrawn;
        self.outputs.push_back(Output::Send(Announce {
            active: self.role == Role::Active,
            leaving: withdrawn,
            probe: matches!(self.phase, Phase::Settling { .. }),
            withdrawn,
        }));
    }
}

#[cfg(test)]
mod tests;
