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
//! returned late to make it step down). So each sender's announcements count in the
//! order of their `seq` (then `sent_at`), each once, and one whose `sent_at` is further
//! from this node's clock than `member_ttl` + `max_clock_skew` does not count at all. A
//! sender's last number is remembered long enough that any older copy is stale by the
//! time it is forgotten.

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
            member_ttl: e.member_ttl,
            max_clock_skew: e.max_clock_skew,
        }
    }

    /// The delivery a member sends: `a` with its proof (the broker user as `user_id`,
    /// and the signature with a group secret).
    pub fn seal(&self, a: &Announcement) -> Envelope {
        seal(a, &self.user, self.key.as_ref())
    }

    /// How far `sent_at` may be in the past (by this node's clock).
    fn max_age(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.member_ttl + self.max_clock_skew)
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

/// Senders remembered at most: only senders with proof are remembered, so this bounds
/// memory, never correctness in a real group.
const MAX_SENDERS: usize = 4096;

/// The order of one sender's announcements.
type Position = (u64, DateTime<Utc>);

/// The admission of one node (or watcher).
#[derive(Debug)]
pub struct Admission {
    policy: Policy,
    last: HashMap<Uuid, (Position, Instant)>,
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
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            last: HashMap::new(),
            rejected: RejectedCount::default(),
        }
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
        let skew = wall - a.sent_at;
        if skew > self.policy.max_age() || -skew > self.policy.max_ahead() {
            return Err(Rejected::Stale(skew.num_milliseconds()));
        }
        self.in_order(now, &a)?;
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

    /// Each sender's announcements count once each, in order.
    fn in_order(&mut self, now: Instant, a: &Announcement) -> Result<(), Rejected> {
        let keep = self.policy.remember_for();
        let position = (a.seq, a.sent_at);
        if let Some(((seq, sent_at), at)) = self.last.get(&a.node_id)
            && now.saturating_duration_since(*at) <= keep
            && position <= (*seq, *sent_at)
        {
            return Err(Rejected::Replayed {
                seq: a.seq,
                last: *seq,
            });
        }
        if self.last.len() >= MAX_SENDERS && !self.last.contains_key(&a.node_id) {
            self.last
                .retain(|_, (_, at)| now.saturating_duration_since(*at) <= keep);
            if self.last.len() >= MAX_SENDERS
                && let Some(oldest) = self.last.iter().min_by_key(|(_, (_, at))| *at)
            {
                let oldest = *oldest.0;
                self.last.remove(&oldest);
            }
        }
        self.last.insert(a.node_id, (position, now));
        Ok(())
    }

    fn count(&mut self, wall: DateTime<Utc>, envelope: &Envelope, e: &Rejected) {
        let r = &mut self.rejected;
        r.total += 1;
        *r.by_reason.entry(e.kind()).or_default() += 1;
        // Best effort, for the operator: which id the body claims.
        let node_id = serde_json::from_slice::<serde_json::Value>(&envelope.body)
            .ok()
            .and_then(|v| v.get("node_id")?.as_str()?.parse().ok());
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
