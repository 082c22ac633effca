//! The fate of every message of a batch, decided from facts about that message alone,
//! never from ordering luck:
//! - a returned (unroutable) message is matched by its `message_id`, which the broker
//!   sends back with it: lapin hands a return to whichever confirm resolves next, so the
//!   confirm it arrives with says nothing about which message it was;
//! - what the broker would refuse by closing the channel is checked before publishing
//!   where it can be (names, size, `expiration`, `reply_to`, `CC`/`BCC`); the rest is
//!   learnt from pilots, each alone on its channel (see `publish`);
//! - a pilot's refusal is judged by what it concerns: a missing or refusing exchange
//!   fails every message of the batch for that exchange (or, for a topic permission,
//!   for that exchange and routing key) with that reason; a refusal of the message itself
//!   fails it alone and the others go on.
//!
//! Pure: `publish` opens the channels, sends, awaits the confirms and reads returns and
//! channel closes off lapin's types; what it learnt is judged here.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::BusError;
use super::proof::{Refusal, Shape};
use crate::wire::{Properties, Value};

/// Why one message was not confirmed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PublishError {
    #[error("exchange {0:?} does not exist")]
    NoExchange(String),
    #[error("refused by the broker: {0}")]
    Refused(String),
    #[error("unroutable: returned by the broker ({0})")]
    Returned(String),
    #[error("nacked by the broker")]
    Nacked,
    #[error("not confirmed within {0:?}")]
    ConfirmTimeout(Duration),
    #[error("invalid message: {0}")]
    Invalid(String),
    /// A destination this message may never be sent to (see
    /// `destinations::Destinations`): held for an operator, not retried.
    #[error("not allowed, held: {0}")]
    NotAllowed(String),
    /// Over `amqp.max_message_size`, or over the broker's own limit once it refused one.
    #[error("message of {size} bytes is over the limit of {max} bytes")]
    TooLarge { size: usize, max: usize },
    /// Its content-header frame (every property, timeoutd's own headers included) is
    /// over the connection's `frame_max`: the broker would close the connection. Held.
    #[error(
        "properties and headers of {size} bytes encoded (timeoutd's own headers included) \
         do not fit the frame_max of {max} bytes, held"
    )]
    HeaderTooLarge { size: usize, max: usize },
    #[error("channel closed by the broker: {0}")]
    Channel(String),
}

impl PublishError {
    /// Retrying cannot help, whatever happens on the broker: the row is held.
    pub fn holds(&self) -> bool {
        matches!(
            self,
            PublishError::NotAllowed(_) | PublishError::HeaderTooLarge { .. }
        )
    }

    /// Stable label for logs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            PublishError::NoExchange(_) => "no_exchange",
            PublishError::Refused(_) => "refused",
            PublishError::Returned(_) => "returned",
            PublishError::Nacked => "nacked",
            PublishError::ConfirmTimeout(_) => "confirm_timeout",
            PublishError::Invalid(_) => "invalid",
            PublishError::NotAllowed(_) => "not_allowed",
            PublishError::TooLarge { .. } => "too_large",
            PublishError::HeaderTooLarge { .. } => "header_too_large",
            PublishError::Channel(_) => "channel",
        }
    }
}

/// What became of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Confirmed by the broker and not returned: delivered.
    Confirmed,
    /// Not delivered, for a reason of its own: the caller keeps it and retries later.
    Failed(PublishError),
    /// Never sent (budget spent, stopping, or no channel): nothing happened to it.
    Unsent,
    /// Sent, but its channel or connection closed before the confirm: it may or may not
    /// have been delivered.
    Unknown(String),
}

/// Properties RabbitMQ refuses by closing the channel (`rabbit_channel`'s checks on
/// `basic.publish`), so that no such message is ever sent.
pub(super) fn refused_properties(p: &Properties) -> Option<PublishError> {
    if let Some(e) = p.expiration.as_deref().filter(|e| !valid_expiration(e)) {
        return Some(PublishError::Invalid(format!(
            "expiration {e:?} is not a number of milliseconds up to 4294967295"
        )));
    }
    // Direct reply-to works only on the requester's own channel.
    if p.reply_to.as_deref() == Some(DIRECT_REPLY_TO) {
        return Some(PublishError::Invalid(format!(
            "reply_to {DIRECT_REPLY_TO} cannot be delayed: only the requester's own \
             channel may publish with it"
        )));
    }
    p.headers
        .iter()
        .find(|(k, v)| (k == "CC" || k == "BCC") && !matches!(v, Value::Array(_)))
        .map(|(k, _)| PublishError::Invalid(format!("header {k} must be an array")))
}

const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// As RabbitMQ reads it: an integer (an optional `+`, digits) from 0 to 2^32 - 1.
fn valid_expiration(e: &str) -> bool {
    let digits = e.strip_prefix('+').unwrap_or(e);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && digits
            .parse::<u64>()
            .is_ok_and(|n| n <= u64::from(u32::MAX))
}

/// The largest body we may publish: `amqp.max_message_size` (`configured`), or the
/// broker's own `limit` once a refusal taught it (see `proof`).
pub(super) fn size_max(configured: u64, limit: Option<usize>) -> usize {
    let max = usize::try_from(configured).unwrap_or(usize::MAX);
    limit.map_or(max, |l| l.min(max))
}

/// Refuse what the broker would refuse by closing the channel, where size and names
/// tell: `header_frame` is the message's whole content-header frame in bytes,
/// `frame_max` the connection's, `max` the largest body we may publish ([`size_max`]).
pub(super) fn precheck(
    m: &Shape<'_>,
    header_frame: usize,
    frame_max: u32,
    max: usize,
) -> Result<(), PublishError> {
    for (name, what) in [
        (m.exchange, "exchange name"),
        (m.routing_key, "routing key"),
    ] {
        crate::wire::short(name, what).map_err(|e| PublishError::Invalid(e.0))?;
    }
    let frame_max = usize::try_from(frame_max).unwrap_or(usize::MAX);
    if header_frame > frame_max {
        return Err(PublishError::HeaderTooLarge {
            size: header_frame,
            max: frame_max,
        });
    }
    if m.size > max {
        return Err(PublishError::TooLarge { size: m.size, max });
    }
    Ok(())
}

/// What a [`BusError::Timeout`] names when a batch's budget ran out: a slow broker for
/// this batch, not a node that cannot publish.
pub(super) const BUDGET_SPENT: &str = "open channel within the batch budget";

impl BusError {
    pub(super) fn is_budget(&self) -> bool {
        matches!(self, BusError::Timeout { what, .. } if *what == BUDGET_SPENT)
    }
}

/// A pilot's outcome.
pub(super) enum Alone {
    Delivered(Fate),
    /// The broker closed the channel under it: what the refusal concerns, and this
    /// message's failure.
    Refused(Refusal, PublishError),
    /// No confirm in time.
    TimedOut(PublishError),
    Lost(String, BusError),
    NoChannel(BusError),
    /// The budget ran out before it could be sent.
    NotSent,
}

/// Decided fates, messages for the next wave, bus trouble.
#[derive(Default)]
pub(super) struct Decided {
    pub fates: Vec<(usize, Fate)>,
    pub replan: Vec<usize>,
    pub trouble: Option<BusError>,
    /// When the job handed its last message to the broker.
    pub sent: Option<Instant>,
}

/// The broker's answer to one publish: ack or nack, and a returned message that came
/// with it (not necessarily this publish's own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    pub ack: bool,
    /// The returned message's `message_id`, and the broker's reason.
    pub returned: Option<(String, String)>,
}

/// How one message of a shared channel ended, as far as this side can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum End {
    Answered(Answer),
    /// No confirm within the bound.
    TimedOut(Duration),
    /// Its channel closed before the confirm: why, and what the close concerns.
    Closed(String, Refusal),
    /// Never left the process.
    NotSent,
}

/// A channel close as lapin reported it (read off its error by `publish`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Close {
    /// The broker's reply code was NOT_FOUND.
    pub not_found: bool,
    /// The broker's reply code was ACCESS_REFUSED.
    pub access_refused: bool,
    /// The error as lapin words it, the broker's reply text in it.
    pub text: String,
}

impl Close {
    /// What the close under a message of `size` bytes concerns.
    pub(super) fn refusal(&self, size: usize) -> Refusal {
        Refusal::of(self.not_found, self.access_refused, &self.text, size)
    }
}

/// A pilot whose channel the broker closed under it, the connection still up: what the
/// refusal concerns, and the pilot's own failure.
pub(super) fn refused(m: &Shape<'_>, close: &Close) -> Alone {
    let refusal = close.refusal(m.size);
    let failure = match &refusal {
        Refusal::Exchange if close.not_found => PublishError::NoExchange(m.exchange.to_owned()),
        Refusal::Exchange | Refusal::RoutingKey => PublishError::Refused(close.text.clone()),
        Refusal::Size { limit: Some(max) } => PublishError::TooLarge {
            size: m.size,
            max: *max,
        },
        Refusal::Size { limit: None } | Refusal::Message => {
            PublishError::Channel(close.text.clone())
        }
    };
    Alone::Refused(refusal, failure)
}

/// The fates of a shared channel's messages (`ids[k]` is the `message_id` of `ends[k]`'s
/// message), pushed onto `fates`; true when every confirm came in (the channel can serve
/// another batch: nothing of this one can still arrive on it).
pub(super) fn judge_shared(
    ids: &[&str],
    ends: Vec<(usize, End)>,
    fates: &mut Vec<(usize, Fate)>,
) -> bool {
    // Every return first: it may have arrived with any message's confirm.
    let returned: HashMap<&str, &str> = ends
        .iter()
        .filter_map(|(_, e)| match e {
            End::Answered(a) => a.returned.as_ref(),
            _ => None,
        })
        .map(|(id, why)| (id.as_str(), why.as_str()))
        .collect();
    let returned = |k: usize| returned.get(ids[k]).map(|why| (*why).to_owned());
    let mut clean = true;
    let mut judged = Vec::with_capacity(ends.len());
    for (k, (i, end)) in ends.iter().enumerate() {
        let fate = match (end, returned(k)) {
            (End::NotSent, _) => Fate::Unsent,
            (_, Some(why)) => Fate::Failed(PublishError::Returned(why)),
            (End::Answered(a), None) if a.ack => Fate::Confirmed,
            (End::Answered(_), None) => Fate::Failed(PublishError::Nacked),
            (End::TimedOut(after), None) => Fate::Failed(PublishError::ConfirmTimeout(*after)),
            (End::Closed(why, _), None) => Fate::Unknown(why.clone()),
        };
        clean &= matches!(end, End::Answered(_) | End::NotSent);
        judged.push((*i, fate));
    }
    fates.extend(judged);
    clean
}

/// What becomes of a pilot (`first`) and the messages waiting for it (`rest`), from the
/// pilot's outcome.
pub(super) fn decide_alone(
    shapes: &[Shape<'_>],
    first: usize,
    rest: Vec<usize>,
    alone: Alone,
) -> Decided {
    let mut d = Decided::default();
    let unsent = |d: &mut Decided, rest: Vec<usize>| {
        d.fates.extend(rest.into_iter().map(|j| (j, Fate::Unsent)));
    };
    let m = &shapes[first];
    match alone {
        Alone::Delivered(fate) => {
            d.fates.push((first, fate));
            d.replan = rest;
        }
        Alone::Refused(refusal, e) => {
            // The same answer for every message the refusal is about.
            for j in rest {
                let o = &shapes[j];
                let same = match refusal {
                    Refusal::Exchange => o.exchange == m.exchange,
                    Refusal::RoutingKey => {
                        o.exchange == m.exchange && o.routing_key == m.routing_key
                    }
                    Refusal::Size { .. } | Refusal::Message => false,
                };
                if same {
                    d.fates.push((j, Fate::Failed(e.clone())));
                } else {
                    d.replan.push(j);
                }
            }
            d.fates.push((first, Fate::Failed(e)));
        }
        // The broker does not answer: try the rest in the next batch instead of holding
        // this one up message after message.
        Alone::TimedOut(e) => {
            d.fates.push((first, Fate::Failed(e)));
            unsent(&mut d, rest);
        }
        Alone::Lost(why, e) => {
            d.fates.push((first, Fate::Unknown(why)));
            unsent(&mut d, rest);
            d.trouble = Some(e);
        }
        Alone::NoChannel(e) => {
            d.fates.push((first, Fate::Unsent));
            unsent(&mut d, rest);
            d.trouble = Some(e).filter(|e| !e.is_budget());
        }
        Alone::NotSent => {
            d.fates.push((first, Fate::Unsent));
            unsent(&mut d, rest);
        }
    }
    d
}

/// The fate of a pilot whose `message_id` is `id`, from its own confirm: returned (by
/// its message_id), acked or nacked.
pub(super) fn fate_alone(id: &str, a: &Answer) -> Fate {
    match &a.returned {
        Some((returned, why)) if returned == id => {
            Fate::Failed(PublishError::Returned(why.clone()))
        }
        _ if a.ack => Fate::Confirmed,
        _ => Fate::Failed(PublishError::Nacked),
    }
}

#[cfg(test)]
mod tests;
