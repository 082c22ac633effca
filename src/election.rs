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
//! - a node whose own announcements come back later than `max_lag` steps down (the
//!   "suicidal snail"), and asks to exit when the lag persists past `max_lag_exit`.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Timing knobs of the election; validated by `config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub announce_interval: Duration,
    pub member_ttl: Duration,
    /// Own announcements slower than this make the node step down.
    pub max_lag: Duration,
    /// A node lagging continuously for this long asks to exit.
    pub max_lag_exit: Duration,
}

impl Timing {
    /// Timing with `max_lag` at half of `member_ttl` and `max_lag_exit` at 3 × `member_ttl`.
    pub fn new(announce_interval: Duration, member_ttl: Duration) -> Self {
        Self {
            announce_interval,
            member_ttl,
            max_lag: member_ttl / 2,
            max_lag_exit: member_ttl * 3,
        }
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

/// What a received announcement tells the election (the wire format lives in
/// `announcement`; this is only the part the rules need).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard {
    pub from: Uuid,
    pub active: bool,
    pub leaving: bool,
    pub probe: bool,
}

/// An announcement the node must send now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announce {
    pub active: bool,
    pub leaving: bool,
    pub probe: bool,
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
}

#[derive(Debug, Clone, Copy)]
struct Member {
    last_seen: Instant,
    active: bool,
    /// Still settling: not a candidate until it announces without `probe`.
    probing: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Settling { until: Instant },
    Settled,
    Leaving,
}

/// A member as seen from this node, for status views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberView {
    pub id: Uuid,
    pub age: Duration,
    pub active: bool,
    pub probing: bool,
}

#[derive(Debug)]
pub struct Election {
    me: Uuid,
    timing: Timing,
    members: BTreeMap<Uuid, Member>,
    phase: Phase,
    role: Role,
    last_tick: Instant,
    last_heard: Instant,
    next_announce: Instant,
    silent_warned: bool,
    lagging_since: Option<Instant>,
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
            last_heard: now,
            next_announce: now,
            silent_warned: false,
            lagging_since: None,
            outputs: VecDeque::new(),
        };
        e.start_settling(now);
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

    /// The lowest candidate id (settled live members and this node).
    pub fn lowest(&self) -> Uuid {
        self.candidates().next().unwrap_or(self.me).min(self.me)
    }

    pub fn members(&self, now: Instant) -> Vec<MemberView> {
        self.members
            .iter()
            .map(|(id, m)| MemberView {
                id: *id,
                age: now.saturating_duration_since(m.last_seen),
                active: m.active,
                probing: m.probing,
            })
            .collect()
    }

    /// Next output to act on, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// Advance time: detect pauses, expire members, end settling, announce when due.
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
        if let Phase::Settling { until } = self.phase
            && now >= until
        {
            self.phase = Phase::Settled;
            self.queue_announce();
        }
        self.recompute();
        if now >= self.next_announce {
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
        if heard.leaving {
            self.members.remove(&heard.from);
        } else {
            self.members.insert(
                heard.from,
                Member {
                    last_seen: now,
                    active: heard.active,
                    probing: heard.probe,
                },
            );
        }
        if heard.from != self.me {
            if heard.probe {
                self.queue_announce();
            }
            self.settle_early_on_active_answer(heard);
        }
        self.recompute();
    }

    /// The lag of one of our own announcements (receive minus send, both our clock).
    pub fn observe_own_lag(&mut self, now: Instant, lag: Duration) {
        if self.phase == Phase::Leaving {
            return;
        }
        if lag <= self.timing.max_lag {
            if self.lagging_since.take().is_some() {
                self.outputs.push_back(Output::LagRecovered { lag });
            }
            self.recompute();
            return;
        }
        let since = match self.lagging_since {
            Some(since) => since,
            None => {
                self.outputs.push_back(Output::Lagging { lag });
                *self.lagging_since.insert(now)
            }
        };
        if now.saturating_duration_since(since) >= self.timing.max_lag_exit {
            self.outputs.push_back(Output::Exit { lag });
        }
        self.set_role(Role::Passive, Reason::Lagging(lag));
    }

    /// Re-check the lease right before acting. A pause longer than `member_ttl` since
    /// the last tick makes the view stale: the role is dropped and the node settles again.
    pub fn check_lease(&mut self, now: Instant) -> Lease {
        if self.detect_pause(now) {
            return Lease::Stale;
        }
        match self.role {
            Role::Active => Lease::Held,
            Role::Passive => Lease::Demoted,
        }
    }

    /// The connection to the broker is gone (a node that cannot announce must not hold
    /// the role): passive at once; after reconnecting it probes and settles again.
    pub fn bus_lost(&mut self, now: Instant) {
        if self.phase != Phase::Leaving {
            self.restart(now, Reason::BusLost);
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
        }));
    }

    fn start_settling(&mut self, now: Instant) {
        self.phase = Phase::Settling {
            until: now + self.timing.announce_interval,
        };
        self.last_tick = now;
        self.last_heard = now;
        self.queue_announce();
    }

    fn detect_pause(&mut self, now: Instant) -> bool {
        let gap = now.saturating_duration_since(self.last_tick);
        if gap <= self.timing.member_ttl {
            return false;
        }
        self.restart(now, Reason::Paused(gap));
        true
    }

    /// Drop the role and the view, probe and settle again.
    fn restart(&mut self, now: Instant, reason: Reason) {
        self.set_role(Role::Passive, reason);
        self.members.clear();
        self.lagging_since = None;
        self.start_settling(now);
    }

    /// Keep the members heard within `member_ttl` (the published version inverted this).
    fn expire(&mut self, now: Instant) {
        let ttl = self.timing.member_ttl;
        self.members
            .retain(|_, m| now.saturating_duration_since(m.last_seen) <= ttl);
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
            self.queue_announce();
        }
    }

    fn candidates(&self) -> impl Iterator<Item = Uuid> + '_ {
        self.members
            .iter()
            .filter(|(_, m)| !m.probing)
            .map(|(id, _)| *id)
    }

    /// Asymmetric on purpose: to *take* the role a node defers to every live lower id,
    /// settling or not (nodes started together must not all act); to *keep* it, only a
    /// settled lower member counts (a newcomer's probe must not leave the group without
    /// an active node while the newcomer settles).
    fn recompute(&mut self) {
        if self.phase != Phase::Settled || self.lagging_since.is_some() {
            return;
        }
        let lowest = match self.role {
            Role::Active => self.lowest(),
            Role::Passive => self
                .members
                .keys()
                .next()
                .copied()
                .unwrap_or(self.me)
                .min(self.me),
        };
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
        let members = self.members.keys().copied().collect();
        self.outputs.push_back(Output::RoleChanged {
            role,
            reason,
            members,
        });
        self.queue_announce();
    }

    /// Queue our announcement with the current state; coalesce with one already queued
    /// so a burst of probes costs one answer.
    fn queue_announce(&mut self) {
        self.next_announce = self.last_tick + self.timing.announce_interval;
        self.outputs
            .retain(|o| !matches!(o, Output::Send(a) if !a.leaving));
        self.outputs.push_back(Output::Send(Announce {
            active: self.role == Role::Active,
            leaving: false,
            probe: matches!(self.phase, Phase::Settling { .. }),
        }));
    }
}

#[cfg(test)]
mod tests;
