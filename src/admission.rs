//! Who counts in the election: every announcement passes here before the election hears
//! it. Pure, like the election: the caller hands in the delivery, its own monotonic and
//! wall clocks, and gets the announcement or why it was dropped.
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
//! returned late to make it step down). So:
//! - each of a sender's announcements (by `seq`) counts once; one that arrives behind a
//!   later one counts only while it is among the sender's latest [`WINDOW`] and was
//!   sent within `max_clock_skew` (reordered on the way, not kept and sent again: as
//!   IPsec's anti-replay window). Earlier versions send no `seq`: theirs count in the
//!   order of `sent_at`;
//! - another node's announcement whose `sent_at` is further from this node's clock
//!   than `announce_interval` + `max_clock_skew` (or further ahead than
//!   `max_clock_skew`) does not count at all: a real one arrives within milliseconds,
//!   and every member speaks again within an interval. A copy sent again sooner than
//!   that, to a node that missed the original, counts once: news that old is still
//!   true enough. The node's own announcements come back however late they are: their
//!   delay is how it measures its own lag (`max_lag`);
//! - nor does one sent more than `max_clock_skew` before this node began listening
//!   (started, or reconnected: [`Admission::restart`]). A node that has just begun
//!   knows no sender's last number, and a copy of a dead node's announcement would
//!   otherwise bring it back for it; the live members answer its probe anyway.
//!
//! A sender's last number is remembered long enough that any older copy is stale by
//! the time it is forgotten. The clocks of the members must therefore agree within
//! `max_clock_skew`; announcements of a member whose clock does not are dropped as
//! `stale`, counted and logged with the offset.

use std::collections::{BTreeMap, HashMap};
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

    /// The delivery a member sends: `a` with its proof (the broker user as `user_id`,
    /// and the signature with a group secret).
    pub fn seal(&self, a: &Announcement) -> Envelope {
        seal(a, &self.user, self.key.as_ref())
    }

    /// How far another node's `sent_at` may be in the past (by this node's clock).
    fn max_age(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.announce_interval + self.max_clock_skew)
            .unwrap_or(chrono::Duration::MAX)
    }

    fn max_ahead(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.max_clock_skew).unwrap_or(chrono::Duration::MAX)
    }

    /// How long a sender's last number is kept: once it is forgotten, any copy of its
    /// announcements is older than `max_age` even if the sender's clock ran
    /// `max_clock_skew` ahead.
    fn remember_for(&self) -> Duration {
        self.member_ttl + self.max_clock_skew * 2 + Duration::from_secs(1)
    }
}

/// How far behind a sender's newest announcement a late one may still count.
pub const WINDOW: u64 = 64;

/// Senders remembered at most: only senders with proof are remembered, so this bounds
/// memory, never correctness in a real group.
const MAX_SENDERS: usize = 4096;

/// What a receiver remembers of one sender.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The newest `seq` counted.
    newest: u64,
    /// Bit `i` set: `newest - i` was counted.
    counted: u64,
    /// For senders without `seq` (earlier versions): the newest `sent_at` counted.
    legacy: Option<DateTime<Utc>>,
    /// When it was last counted (remembered `remember_for` after that).
    at: Instant,
}

impl Seen {
    fn new(at: Instant) -> Self {
        Self {
            newest: 0,
            counted: 0,
            legacy: None,
            at,
        }
    }

    /// Count announcement `seq` (sent at `sent_at`) unless it was counted before or is
    /// too far behind; `Err(newest)` when it may not count.
    fn count(&mut self, seq: u64, sent_at: DateTime<Utc>) -> Result<(), u64> {
        if seq == 0 {
            if self.legacy.is_some_and(|last| sent_at <= last) {
                return Err(self.newest);
            }
            self.legacy = Some(sent_at);
            return Ok(());
        }
        if seq > self.newest {
            let shift = seq - self.newest;
            self.counted = if shift >= WINDOW {
                0
            } else {
                self.counted << shift
            };
            self.counted |= 1;
            self.newest = seq;
            return Ok(());
        }
        let behind = self.newest - seq;
        if behind >= WINDOW || self.counted & (1 << behind) != 0 {
            return Err(self.newest);
        }
        self.counted |= 1 << behind;
        Ok(())
    }
}

/// The admission of one node (or watcher).
#[derive(Debug)]
pub struct Admission {
    policy: Policy,
    /// This node's own id: its announcements are judged by proof and count, not age.
    me: Option<Uuid>,
    last: HashMap<Uuid, Seen>,
    /// When this node began listening (its clock): nothing sent well before counts.
    since: DateTime<Utc>,
    rejected: RejectedCount,
}

/// Announcements that did not count, for `/status` and `timeoutd members`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RejectedCount {
    pub total: u64,
    pub by_reason: BTreeMap<&'static str, u64>,
    pub last: Option<LastRejected>,
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
            since: wall,
            rejected: RejectedCount::default(),
        }
    }

    /// The node listens anew (a new broker connection): what was sent while it did not
    /// listen does not count.
    pub fn restart(&mut self, wall: DateTime<Utc>) {
        self.since = wall;
    }

    pub fn rejected(&self) -> &RejectedCount {
        &self.rejected
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Judge one delivery at `now` (monotonic) and `wall` (this node's clock).
    pub fn admit(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        envelope: &Envelope,
    ) -> Result<Announcement, Rejected> {
        let judged = self.judge(now, wall, envelope);
        if let Err(e) = &judged {
            self.count(wall, envelope, e);
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
        let age = wall - a.sent_at;
        let before_us = self.since - a.sent_at > self.policy.max_ahead();
        let too_old = age > self.policy.max_age() || before_us;
        if Some(a.node_id) != self.me && (too_old || -age > self.policy.max_ahead()) {
            return Err(Rejected::Stale(age.num_milliseconds()));
        }
        self.once(now, wall, &a)?;
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

    /// Each of a sender's announcements counts once (see [`Seen`]); one behind a later
    /// one only if it is recent.
    fn once(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        a: &Announcement,
    ) -> Result<(), Rejected> {
        let keep = self.policy.remember_for();
        if self.last.len() >= MAX_SENDERS && !self.last.contains_key(&a.node_id) {
            self.last
                .retain(|_, seen| now.saturating_duration_since(seen.at) <= keep);
            if self.last.len() >= MAX_SENDERS
                && let Some(oldest) = self.last.iter().min_by_key(|(_, seen)| seen.at)
            {
                let oldest = *oldest.0;
                self.last.remove(&oldest);
            }
        }
        let seen = self.last.entry(a.node_id).or_insert_with(|| Seen::new(now));
        if now.saturating_duration_since(seen.at) > keep {
            *seen = Seen::new(now);
        }
        if a.seq > 0 && a.seq < seen.newest && wall - a.sent_at > self.policy.max_ahead() {
            return Err(Rejected::Replayed {
                seq: a.seq,
                last: seen.newest,
            });
        }
        seen.count(a.seq, a.sent_at)
            .map_err(|last| Rejected::Replayed { seq: a.seq, last })?;
        seen.at = now;
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
