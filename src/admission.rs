//! Who counts in the election: every announcement passes here before the election hears
//! it. Pure, like the election: the caller hands in the delivery and its own monotonic
//! clock (and wall clock, for announcements of earlier versions), and gets the
//! announcement or why it was dropped.
//!
//! An announcement counts only with proof that a member sent it:
//! - by default, the AMQP `user_id` is the daemons' own broker user. RabbitMQ refuses a
//!   publish whose `user_id` is not the connection's own user, so only holders of the
//!   daemons' credentials (or a user tagged `impersonator`) can send one;
//! - with `election.secret`, a valid HMAC of the body under that secret (for brokers
//!   where other services log in as the same user); the user is not checked then, so
//!   members may use different broker users;
//! - with `election.accept_unauthenticated` (a rolling upgrade from a version that sends
//!   neither), also announcements that carry no proof at all. A `user_id` naming another
//!   user is refused even then: earlier versions never set one.
//!
//! Proof is not enough against a copy of a real announcement sent again later (a
//! replay: a forged `leaving`, a dead node brought back, a node's own announcement
//! returned late to make it step down). Freshness is judged by the receiver's own
//! monotonic clock, never by comparing clocks of different hosts:
//! - each of a sender's announcements (by `seq`, counted from 1 by each incarnation,
//!   whose id is new at every start) counts once, in order; one that arrives behind a
//!   later one counts only while it is among the sender's latest [`WINDOW`], was sent
//!   within `announce_interval` of that later one (by the sender's own clock) and the
//!   sender is live here;
//! - a newer one counts when the sender is live here (this node counted one of its
//!   announcements within `member_ttl`), or when it names, in `after`, an announcement
//!   this node sent or counted within `member_ttl`: it was sent after that one, so it
//!   is at most about two `member_ttl` old. Every announcement names the newest it
//!   heard of the senders it could not vouch for yet (in turn, when there are more than
//!   one announcement holds), of those that just became live here by naming it (so
//!   they can count it in turn), and of the lowest live members;
//! - otherwise (a sender heard for the first time, or again after a gap, a restart or
//!   a reconnect) the announcement is *unvouched*: it does not count, but the election
//!   answers it at its next tick (a stranger's announcement that is no probe: at most
//!   one a `member_ttl`), and that answer names it. A live sender hears the
//!   answer, counts it (it names the sender's own recent announcement) and names the
//!   answer in its next announcement, which then counts here. A copy of an old
//!   announcement can name only old announcements: it never counts;
//! - a sender's numbers are remembered for as long as memory allows ([`MAX_SENDERS`],
//!   the least recently heard forgotten first), so a copy of any announcement this node
//!   counted, or answered, is refused as `replayed`.
//!
//! The node's own announcements count however late they come back within `member_ttl`
//! (the broker expires them then), each once: their delay is how it measures its own
//! lag (`max_lag`).
//!
//! Announcements of earlier versions name nothing (no `after`). Those are judged as
//! those versions judge: by `sent_at` against this node's clock, within
//! `announce_interval` + `max_clock_skew` (and not sent before this node began
//! listening), so a group that still has such members needs clocks that agree within
//! `max_clock_skew` while it does.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::wire::announcement::{Announcement, Envelope, GroupKey, MESSAGE_TYPE, Rejected};

/// What makes an announcement count; from `election.*` and the broker user.
#[derive(Debug, Clone)]
pub struct Policy {
    pub group: String,
    /// The broker user the daemons connect as.
    pub user: String,
    pub key: Option<GroupKey>,
    pub accept_unauthenticated: bool,
    pub announce_interval: Duration,
    pub member_ttl: Duration,
    /// How far the clocks of members of earlier versions (announcements without
    /// `after`) may be from this node's.
    pub max_clock_skew: Duration,
}

impl Policy {
    /// The policy of `settings` for a node that logs in as broker user `user`.
    pub fn new(settings: &crate::config::Settings, user: String) -> Self {
        let e = &settings.election;
        Self {
            group: e.group.clone(),
            user,
            key: e
                .secret
                .is_set()
                .then(|| GroupKey::new(e.secret.expose().as_bytes())),
            accept_unauthenticated: e.accept_unauthenticated,
            announce_interval: e.announce_interval,
            member_ttl: e.member_ttl,
            max_clock_skew: e.max_clock_skew,
        }
    }

    /// The delivery `a` makes as it is, with its proof (the broker user as `user_id`,
    /// and the signature with a group secret). Members seal with [`Admission::seal`],
    /// which also names what their announcement was sent after.
    pub fn seal(&self, a: &Announcement) -> Envelope {
        seal(a, &self.user, self.key.as_ref())
    }

    /// How far an earlier version's `sent_at` may be in the past (by this node's clock).
    fn max_age(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.announce_interval + self.max_clock_skew)
            .unwrap_or(chrono::Duration::MAX)
    }

    fn max_ahead(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.max_clock_skew).unwrap_or(chrono::Duration::MAX)
    }

    /// How far behind (by the sender's clock) a late announcement may be sent.
    fn max_behind(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.announce_interval).unwrap_or(chrono::Duration::MAX)
    }
}

/// How far behind a sender's newest announcement a late one may still count.
pub const WINDOW: u64 = 64;

/// Senders remembered at most: only senders with proof are remembered, so this bounds
/// memory, never correctness in a real group.
pub const MAX_SENDERS: usize = 4096;

/// Announcements one announcement names in `after`, at most: with the rest of the body,
/// well within [`crate::wire::announcement::MAX_BODY`]. Only a node with strangers to
/// answer (a group starting, many newcomers) names more than a few.
pub const MAX_AFTER: usize = 16;
/// Of those, how many name the lowest live senders at least (the rest: senders not
/// vouched for yet, and those owed an answer).
const LOWEST_NAMED: usize = 2;
/// Counted announcements remembered per sender, with when: what `after` may name.
const RECENT: usize = 4;
/// Own announcements remembered with when they were sent.
const OWN: usize = 16;

/// What a receiver remembers of one sender.
#[derive(Debug, Clone)]
struct Seen {
    /// The newest `seq` taken (counted, or answered as unvouched).
    newest: u64,
    /// Bit `i` set: `newest - i` was taken.
    taken: u64,
    /// `sent_at` of `newest`, by the sender's clock.
    newest_sent_at: Option<DateTime<Utc>>,
    /// For senders without `seq` (earliest versions): the newest `sent_at` counted.
    legacy: Option<DateTime<Utc>>,
    /// When one of its announcements last counted.
    vouched_at: Option<Instant>,
    /// Its latest counted announcements and when: what others' `after` may name.
    recent: VecDeque<(u64, Instant)>,
    /// Its newest announcement not vouched for, to be named.
    challenge: Option<Challenge>,
    /// It became live here by naming this node (or what this node counted): named once
    /// in this node's next announcement, so it can count this node in turn.
    owed: bool,
    /// When anything with proof last came from it (the least recent is forgotten first).
    heard: Instant,
    /// Vouched for at some time (restarts and gaps included).
    known: bool,
}

impl Seen {
    fn new(now: Instant) -> Self {
        Self {
            newest: 0,
            taken: 0,
            newest_sent_at: None,
            legacy: None,
            vouched_at: None,
            recent: VecDeque::with_capacity(RECENT),
            challenge: None,
            owed: false,
            heard: now,
            known: false,
        }
    }

    fn live(&self, now: Instant, ttl: Duration) -> bool {
        self.vouched_at
            .is_some_and(|at| now.saturating_duration_since(at) <= ttl)
    }

    /// Take `seq` as the newest.
    fn advance(&mut self, seq: u64, sent_at: DateTime<Utc>) {
        let shift = seq - self.newest;
        self.taken = if shift >= WINDOW {
            0
        } else {
            self.taken << shift
        };
        self.taken |= 1;
        self.newest = seq;
        self.newest_sent_at = Some(sent_at);
    }

    fn vouch(&mut self, seq: u64, now: Instant, ttl: Duration) {
        self.owed |= !self.live(now, ttl);
        self.vouched_at = Some(now);
        self.known = true;
        self.challenge = None;
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, now));
    }

    /// Whether this node counted, within `ttl`, an announcement of this sender that was
    /// sent no later than its `seq`.
    fn names_recent(&self, seq: u64, now: Instant, ttl: Duration) -> bool {
        self.recent
            .iter()
            .any(|(s, at)| *s <= seq && now.saturating_duration_since(*at) <= ttl)
    }
}

/// A sender's announcement not vouched for yet.
#[derive(Debug, Clone, Copy)]
struct Challenge {
    seq: u64,
    at: Instant,
    probe: bool,
    /// In how many of this node's announcements it was named: the least named go first,
    /// so every stranger is named however many arrive in the same order each interval.
    named: u32,
}

/// The admission of one node (or watcher).
#[derive(Debug)]
pub struct Admission {
    policy: Policy,
    /// This node's own id: its announcements are judged by proof and count, not age.
    me: Option<Uuid>,
    last: HashMap<Uuid, Seen>,
    /// This node's latest announcements (seq, when sealed).
    own: VecDeque<(u64, Instant)>,
    /// When this node began listening (its clock): nothing of an earlier version sent
    /// well before counts.
    since: DateTime<Utc>,
    /// When an announcement of a stranger (never vouched for) that is no probe was last
    /// answered: at most once per `member_ttl`.
    stranger_answered: Option<Instant>,
    rejected: RejectedCount,
}

/// Announcements that did not count, for `/status` and `timeoutd members`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RejectedCount {
    pub total: u64,
    pub by_reason: BTreeMap<&'static str, u64>,
    pub last: Option<LastRejected>,
    /// Announcements with proof from senders not vouched for yet (newcomers, members
    /// heard again after a gap, copies of announcements of nodes never heard): answered,
    /// not counted. Not in `total`: every newcomer's first probe is one.
    pub unvouched: u64,
}

/// The latest announcement that did not count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LastRejected {
    pub reason: &'static str,
    pub detail: String,
    /// As the broker delivered it (validated by the broker when present).
    pub user_id: Option<String>,
    /// The id the body claims, when it could be read.
    pub node_id: Option<Uuid>,
    pub at: DateTime<Utc>,
}

impl Admission {
    /// The admission of node `me` (`None`: a watcher), judging from `wall` (this node's
    /// clock) on.
    pub fn new(policy: Policy, me: Option<Uuid>, wall: DateTime<Utc>) -> Self {
        Self {
            policy,
            me,
            last: HashMap::new(),
            own: VecDeque::with_capacity(OWN),
            since: wall,
            stranger_answered: None,
            rejected: RejectedCount::default(),
        }
    }

    /// The node listens anew (a new broker connection): nobody is vouched for until
    /// heard anew, and nothing of an earlier version sent while it did not listen counts.
    pub fn restart(&mut self, wall: DateTime<Utc>) {
        self.since = wall;
        for seen in self.last.values_mut() {
            seen.vouched_at = None;
            seen.recent.clear();
            seen.challenge = None;
            seen.owed = false;
        }
    }

    pub fn rejected(&self) -> &RejectedCount {
        &self.rejected
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// This node's announcement `a`, sent at `now`, as a delivery: with its proof, and
    /// naming in `after` what it was sent after (see the module docs).
    pub fn seal(&mut self, now: Instant, a: &Announcement) -> Envelope {
        let mut a = a.clone();
        a.after = Some(self.after(now));
        if self.own.len() == OWN {
            self.own.pop_front();
        }
        self.own.push_back((a.seq, now));
        self.policy.seal(&a)
    }

    /// What this node's next announcement names: the newest announcement of each sender
    /// not vouched for yet (probes first, then the least often named)
    /// and of each sender owed an answer, then the newest counted of the lowest live
    /// senders (at least [`LOWEST_NAMED`]).
    fn after(&mut self, now: Instant) -> Vec<(Uuid, u64)> {
        let ttl = self.policy.member_ttl;
        let me = self.me;
        // Among equals, each node takes the strangers in an order of its own, so the
        // few announcing nodes answer different newcomers at once.
        let mix = me.map_or(0, |m| m.as_u128());
        let mut challenges: Vec<(bool, u32, u128, Uuid)> = self
            .last
            .iter()
            .filter_map(|(id, s)| {
                let c = s.challenge?;
                (now.saturating_duration_since(c.at) <= ttl).then_some((
                    !c.probe,
                    c.named,
                    id.as_u128() ^ mix,
                    *id,
                ))
            })
            .collect();
        challenges.sort_unstable();
        let mut owed: Vec<Uuid> = self
            .last
            .iter()
            .filter(|(id, s)| s.owed && Some(**id) != me)
            .map(|(id, _)| *id)
            .collect();
        owed.sort_unstable();
        let mut live: Vec<(Uuid, u64)> = self
            .last
            .iter()
            .filter(|(id, s)| Some(**id) != me && s.live(now, ttl))
            .filter_map(|(id, s)| s.recent.back().map(|(seq, _)| (*id, *seq)))
            .collect();
        live.sort_unstable();
        let room = MAX_AFTER - LOWEST_NAMED.min(live.len());
        let mut after = Vec::with_capacity(MAX_AFTER);
        for (_, _, _, id) in challenges.into_iter().take(room) {
            if let Some(c) = self.last.get_mut(&id).and_then(|s| s.challenge.as_mut()) {
                c.named += 1;
                after.push((id, c.seq));
            }
        }
        for id in owed.into_iter().take(room - after.len()) {
            if let Some(s) = self.last.get_mut(&id) {
                s.owed = false;
                if let (true, Some((seq, _))) = (s.live(now, ttl), s.recent.back()) {
                    after.push((id, *seq));
                }
            }
        }
        for entry in live {
            if after.len() == MAX_AFTER {
                break;
            }
            if !after.contains(&entry) {
                after.push(entry);
            }
        }
        after
    }

    /// Judge one delivery at `now` (monotonic) and `wall` (this node's clock, used only
    /// for announcements of earlier versions).
    pub fn admit(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        envelope: &Envelope,
    ) -> Result<Announcement, Rejected> {
        let judged = self.judge(now, wall, envelope);
        match &judged {
            Err(Rejected::Unvouched { .. }) => self.rejected.unvouched += 1,
            Err(e) => self.count(wall, envelope, e),
            Ok(_) => {}
        }
        judged
    }

    fn judge(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        envelope: &Envelope,
    ) -> Result<Announcement, Rejected> {
        let body = &envelope.body;
        // Cheap refusals and the proof come before the body is parsed.
        if body.len() > crate::wire::announcement::MAX_BODY {
            return Err(Rejected::TooLarge(body.len()));
        }
        self.authenticate(envelope)?;
        let a = Announcement::decode(envelope.kind.as_deref(), body, &self.policy.group)?;
        let own = Some(a.node_id) == self.me;
        let fresh = if own {
            // Ours comes back within member_ttl (the broker expires it then): an older
            // copy, or one we never sent, is not our news.
            let ttl = self.policy.member_ttl;
            let sent = self.own.iter().find(|(seq, _)| *seq == a.seq);
            if sent.is_none_or(|(_, at)| now.saturating_duration_since(*at) > ttl) {
                let last = self.own.back().map_or(0, |(seq, _)| *seq);
                return Err(Rejected::Replayed { seq: a.seq, last });
            }
            true
        } else if let Some(after) = &a.after {
            self.names_recent(now, after)
        } else {
            // An earlier version: judged by its clock against ours, as it judges.
            let age = wall - a.sent_at;
            let before_us = self.since - a.sent_at > self.policy.max_ahead();
            if age > self.policy.max_age() || before_us || -age > self.policy.max_ahead() {
                return Err(Rejected::Stale(age.num_milliseconds()));
            }
            true
        };
        self.once(now, wall, &a, own, fresh)?;
        Ok(a)
    }

    fn authenticate(&self, envelope: &Envelope) -> Result<(), Rejected> {
        let p = &self.policy;
        match (&p.key, &envelope.signature) {
            (Some(key), Some(sig)) => {
                return if key.verifies(&envelope.body, sig) {
                    Ok(())
                } else {
                    Err(Rejected::BadSignature)
                };
            }
            (Some(_), None) if !p.accept_unauthenticated => {
                return Err(Rejected::Unauthenticated("no signature"));
            }
            _ => {}
        }
        match envelope.user_id.as_deref() {
            Some(user) if user == p.user => Ok(()),
            Some(user) => Err(Rejected::ForeignUser(user.chars().take(64).collect())),
            None if p.accept_unauthenticated => Ok(()),
            None => Err(Rejected::Unauthenticated("no user_id")),
        }
    }

    /// Whether `after` names an announcement this node sent or counted within
    /// `member_ttl` (or a later one of the same sender).
    fn names_recent(&self, now: Instant, after: &[(Uuid, u64)]) -> bool {
        let ttl = self.policy.member_ttl;
        after.iter().any(|(id, seq)| {
            if Some(*id) == self.me {
                self.own
                    .iter()
                    .any(|(s, at)| s <= seq && now.saturating_duration_since(*at) <= ttl)
            } else {
                self.last
                    .get(id)
                    .is_some_and(|s| s.names_recent(*seq, now, ttl))
            }
        })
    }

    /// Each of a sender's announcements counts once, in order (see the module docs).
    fn once(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        a: &Announcement,
        own: bool,
        fresh: bool,
    ) -> Result<(), Rejected> {
        let p = &self.policy;
        let (ttl, legacy) = (p.member_ttl, a.after.is_none());
        let late_ok = |seen: &Seen| {
            own || if legacy {
                wall - a.sent_at <= p.max_ahead()
            } else {
                seen.live(now, ttl)
                    && seen
                        .newest_sent_at
                        .is_some_and(|newest| newest - a.sent_at <= p.max_behind())
            }
        };
        if self.last.len() >= MAX_SENDERS
            && !self.last.contains_key(&a.node_id)
            && let Some(oldest) = self.last.iter().min_by_key(|(_, seen)| seen.heard)
        {
            let oldest = *oldest.0;
            self.last.remove(&oldest);
        }
        let seen = self.last.entry(a.node_id).or_insert_with(|| Seen::new(now));
        seen.heard = now;
        if a.seq == 0 {
            // The earliest versions send no `seq`: ordered by `sent_at`.
            if !legacy || seen.legacy.is_some_and(|last| a.sent_at <= last) {
                return Err(Rejected::Replayed {
                    seq: 0,
                    last: seen.newest,
                });
            }
            seen.legacy = Some(a.sent_at);
            seen.vouched_at = Some(now);
            return Ok(());
        }
        if a.seq > seen.newest {
            seen.advance(a.seq, a.sent_at);
            if own || fresh || seen.live(now, ttl) {
                seen.vouch(a.seq, now, ttl);
                return Ok(());
            }
            let named = seen.challenge.map_or(0, |c| c.named);
            seen.challenge = Some(Challenge {
                seq: a.seq,
                at: now,
                probe: a.probe,
                named,
            });
            // Copies of dead strangers' announcements must not make a node speak at
            // every tick: a probe, or a member heard again, is answered at once; any
            // other stranger at most once per member_ttl.
            let answer = a.probe
                || seen.known
                || self
                    .stranger_answered
                    .is_none_or(|at| now.saturating_duration_since(at) > ttl);
            if answer && !a.probe && !seen.known {
                self.stranger_answered = Some(now);
            }
            return Err(Rejected::Unvouched { seq: a.seq, answer });
        }
        let behind = seen.newest - a.seq;
        let replayed = Rejected::Replayed {
            seq: a.seq,
            last: seen.newest,
        };
        if behind >= WINDOW || seen.taken & (1 << behind) != 0 || !late_ok(seen) {
            return Err(replayed);
        }
        seen.taken |= 1 << behind;
        Ok(())
    }

    fn count(&mut self, wall: DateTime<Utc>, envelope: &Envelope, e: &Rejected) {
        let r = &mut self.rejected;
        r.total += 1;
        *r.by_reason.entry(e.kind()).or_default() += 1;
        // Best effort, for the operator: which id the body claims (a body too large to
        // judge is not read for it either: a flood of them must stay cheap).
        #[derive(serde::Deserialize)]
        struct Claim {
            node_id: Uuid,
        }
        let node_id = (envelope.body.len() <= crate::wire::announcement::MAX_BODY)
            .then(|| serde_json::from_slice::<Claim>(&envelope.body).ok())
            .flatten()
            .map(|c| c.node_id);
        r.last = Some(LastRejected {
            reason: e.kind(),
            detail: e.to_string(),
            user_id: envelope
                .user_id
                .as_ref()
                .map(|u| u.chars().take(64).collect()),
            node_id,
            at: wall,
        });
    }
}

/// `a` sealed by `user` with `key`.
pub fn seal(a: &Announcement, user: &str, key: Option<&GroupKey>) -> Envelope {
    let body = a.encode();
    Envelope {
        kind: Some(MESSAGE_TYPE.to_owned()),
        user_id: Some(user.to_owned()),
        signature: key.map(|k| k.sign(&body)),
        body,
    }
}

#[cfg(test)]
mod tests;
