//! Publishing one batch with confirms, and the fate of every message in it.
//!
//! Each message's fate comes from facts about that message, never from ordering luck:
//! - a batch publishes on confirm channels of its own (taken from a pool, given back
//!   only when every confirm came in), so concurrent batches never see each other's
//!   returns, confirms or channel closes;
//! - a returned (unroutable) message is matched by its `message_id`, which the broker
//!   sends back with it: lapin hands a return to whichever confirm resolves next, so the
//!   confirm it arrives with says nothing about which message it was;
//! - what the broker would refuse by closing the channel is checked before publishing
//!   where it can be (names, size, `expiration`, `reply_to`, `CC`/`BCC`); the rest —
//!   an exchange missing or refusing us, a routing key a topic permission refuses, a
//!   body over the broker's own size limit — is learnt from *pilots*: a message shares
//!   a channel only with what the broker already accepted from us (see [`proof`]), and
//!   anything else goes out alone, so a refusal closes a channel that carried nothing
//!   but the message it is about;
//! - a pilot's refusal is judged by what it concerns: a missing or refusing exchange
//!   fails every message of the batch for that exchange (or, for a topic permission,
//!   for that exchange and routing key) with that reason; a refusal of the message itself
//!   fails it alone and the others go on.
//!
//! The batch goes out in waves: pilots and the proven messages side by side, then what
//! the pilots' answers released. The whole batch is bounded by a [`Budget`]: no message
//! is sent after `send_until` or once `stop` is cancelled, no channel opening, write or
//! confirm is awaited past `confirm_until`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::join_all;
use lapin::options::BasicPublishOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, PublisherConfirm};
use tokio::time::timeout_at;
use tokio_util::sync::CancellationToken;

use super::convert::{lapin_properties, short};
use super::proof::{self, Job, Refusal, Shape};
use super::{Bus, BusError};
use crate::wire::{Message, Properties, Value};

/// Messages of a shared channel handed to lapin at once (see `publish_shared`). Under
/// flow control, the part in flight may time out; the parts after it stay unsent.
pub const HANDED_OVER_TOGETHER: usize = 64;
/// Pilots and shared groups in flight at once (each holds a channel).
const JOBS_PARALLEL: usize = 8;

/// One message to publish with a confirm.
#[derive(Debug, Clone)]
pub struct ToPublish {
    pub message: Message,
    /// Publish it on a channel of its own (its last attempt ended in a channel close).
    pub alone: bool,
}

/// A message as lapin takes it.
struct Outgoing<'a> {
    /// Its `message_id`: how a returned message is matched to it.
    message_id: String,
    exchange: &'a str,
    routing_key: &'a str,
    properties: BasicProperties,
    body: &'a [u8],
    alone: bool,
}

impl<'a> Outgoing<'a> {
    /// The message in lapin's types, and why it cannot be published, if it cannot.
    fn of(m: &'a ToPublish) -> (Self, Option<PublishError>) {
        let message = &m.message;
        let (properties, invalid) = match refused_properties(&message.properties)
            .map_or_else(|| lapin_properties(&message.properties), Err)
        {
            Ok(p) => (p, None),
            Err(e) => (BasicProperties::default(), Some(e)),
        };
        let outgoing = Self {
            message_id: message.properties.message_id.clone().unwrap_or_default(),
            exchange: &message.exchange,
            routing_key: &message.routing_key,
            properties,
            body: &message.body,
            alone: m.alone,
        };
        (outgoing, invalid)
    }

    fn shape(&self) -> Shape<'a> {
        Shape {
            exchange: self.exchange,
            routing_key: self.routing_key,
            size: self.body.len(),
            alone: self.alone,
        }
    }
}

/// Properties RabbitMQ refuses by closing the channel (`rabbit_channel`'s checks on
/// `basic.publish`), so that no such message is ever sent.
fn refused_properties(p: &Properties) -> Option<PublishError> {
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
    /// `wire::delayed::Destinations`): held for an operator, not retried.
    #[error("not allowed, held: {0}")]
    NotAllowed(String),
    /// Over `amqp.max_message_size`, or over the broker's own limit once it refused one.
    #[error("message of {size} bytes is over the limit of {max} bytes")]
    TooLarge { size: usize, max: usize },
    #[error("channel closed by the broker: {0}")]
    Channel(String),
}

impl PublishError {
    /// Retrying cannot help, whatever happens on the broker: the row is held.
    pub fn holds(&self) -> bool {
        matches!(self, PublishError::NotAllowed(_))
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

/// The bounds of one batch.
#[derive(Debug, Clone)]
pub struct Budget {
    pub send_until: Instant,
    pub confirm_until: Instant,
    pub stop: CancellationToken,
}

/// What a [`BusError::Timeout`] names when a batch's budget ran out: a slow broker for
/// this batch, not a node that cannot publish.
const BUDGET_SPENT: &str = "open channel within the batch budget";

impl BusError {
    fn is_budget(&self) -> bool {
        matches!(self, BusError::Timeout { what, .. } if *what == BUDGET_SPENT)
    }
}

impl Budget {
    /// Time is left to send, and we are not stopping.
    pub fn may_send(&self) -> bool {
        Instant::now() < self.send_until && !self.stop.is_cancelled()
    }
}

/// The fates of a batch, one per message in order, and what went wrong with the bus
/// itself (no channel, connection lost), if anything.
#[derive(Debug)]
pub struct Published {
    pub fates: Vec<Fate>,
    pub trouble: Option<BusError>,
    /// When the last message was handed to the broker (`None`: none was).
    pub sent: Option<Instant>,
}

/// A pilot's outcome.
enum Alone {
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
struct Decided {
    fates: Vec<(usize, Fate)>,
    replan: Vec<usize>,
    trouble: Option<BusError>,
    /// When the job handed its last message to the broker.
    sent: Option<Instant>,
}

impl Bus {
    /// Publish `batch` (mandatory, confirm mode) within `budget`; one fate per message.
    pub async fn publish_batch(&self, batch: &[ToPublish], budget: &Budget) -> Published {
        let (batch, invalid): (Vec<Outgoing>, Vec<Option<PublishError>>) =
            batch.iter().map(Outgoing::of).unzip();
        let shapes: Vec<Shape> = batch.iter().map(Outgoing::shape).collect();
        let mut fates: Vec<Option<Fate>> =
            invalid.into_iter().map(|e| e.map(Fate::Failed)).collect();
        let mut pending: Vec<usize> = (0..batch.len()).filter(|&i| fates[i].is_none()).collect();
        let (batch, shapes) = (&batch[..], &shapes[..]);
        let mut trouble = None;
        let mut sent = None;
        while !pending.is_empty() {
            let view = self.proofs().view(Instant::now());
            // Checked again each wave: a pilot may have taught the broker's size limit.
            pending.retain(|&i| match self.precheck(&batch[i], view.limit) {
                Ok(()) => true,
                Err(e) => {
                    fates[i] = Some(Fate::Failed(e));
                    false
                }
            });
            let jobs = proof::plan(shapes, &pending, &view);
            let done: Vec<Decided> = futures_util::stream::iter(jobs)
                .map(|job| self.run(batch, shapes, job, budget))
                .buffer_unordered(JOBS_PARALLEL)
                .collect()
                .await;
            pending.clear();
            for d in done {
                d.fates.into_iter().for_each(|(i, f)| fates[i] = Some(f));
                pending.extend(d.replan);
                trouble = trouble.or(d.trouble);
                sent = sent.max(d.sent);
            }
            // Oldest due first, as the batch came.
            pending.sort_unstable();
        }
        Published {
            fates: fates
                .into_iter()
                .map(|f| f.unwrap_or(Fate::Unsent))
                .collect(),
            trouble,
            sent,
        }
    }

    async fn run(
        &self,
        batch: &[Outgoing<'_>],
        shapes: &[Shape<'_>],
        job: Job,
        budget: &Budget,
    ) -> Decided {
        match job {
            Job::Alone { first, rest } => self.run_alone(batch, shapes, first, rest, budget).await,
            Job::Shared(idx) => self.publish_shared(batch, shapes, &idx, budget).await,
        }
    }

    /// Refuse what the broker would refuse by closing the channel, where size and names
    /// tell: `limit` is the broker's own size limit, once learnt.
    fn precheck(&self, m: &Outgoing<'_>, limit: Option<usize>) -> Result<(), PublishError> {
        short(m.exchange, "exchange name")?;
        short(m.routing_key, "routing key")?;
        let max = self.settings.max_message_size.as_u64();
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let max = limit.map_or(max, |l| l.min(max));
        if m.body.len() > max {
            return Err(PublishError::TooLarge {
                size: m.body.len(),
                max,
            });
        }
        Ok(())
    }

    /// Send `first` alone; what becomes of `rest` (messages waiting for what it proves)
    /// depends on the answer.
    async fn run_alone(
        &self,
        batch: &[Outgoing<'_>],
        shapes: &[Shape<'_>],
        first: usize,
        rest: Vec<usize>,
        budget: &Budget,
    ) -> Decided {
        let mut d = Decided::default();
        let unsent = |d: &mut Decided, rest: Vec<usize>| {
            d.fates.extend(rest.into_iter().map(|j| (j, Fate::Unsent)));
        };
        if !budget.may_send() {
            d.fates.push((first, Fate::Unsent));
            unsent(&mut d, rest);
            return d;
        }
        let m = &shapes[first];
        match self.publish_alone(&batch[first], budget, &mut d.sent).await {
            Alone::Delivered(fate) => {
                self.proofs().accepted(m, Instant::now());
                d.fates.push((first, fate));
                d.replan = rest;
            }
            Alone::Refused(refusal, e) => {
                self.proofs().refused(m, &refusal);
                d.fates.push((first, Fate::Failed(e.clone())));
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
            }
            // The broker does not answer: try the rest in the next batch instead of
            // holding this one up message after message.
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

    /// Send one message on a channel of its own and await its confirm; `sent` learns
    /// when it was handed to the broker.
    async fn publish_alone(
        &self,
        m: &Outgoing<'_>,
        budget: &Budget,
        sent: &mut Option<Instant>,
    ) -> Alone {
        let channel = match self.channel_within(budget).await {
            Ok(c) => c,
            Err(e) => return Alone::NoChannel(e),
        };
        // Opening the channel may have taken the time there was.
        if !budget.may_send() {
            self.give_back(channel);
            return Alone::NotSent;
        }
        let answer = match self.send(&channel, m, budget).await {
            Ok(confirm) => {
                *sent = Some(Instant::now());
                self.await_confirm(confirm, budget).await
            }
            Err(e) => Err(e),
        };
        match answer {
            Ok(a) => {
                self.give_back(channel);
                let returned = a.returned.into_iter().collect();
                Alone::Delivered(fate_of(m, Some(a.ack), &returned))
            }
            Err(Waited::TimedOut(after)) => Alone::TimedOut(PublishError::ConfirmTimeout(after)),
            Err(Waited::Closed(e)) => self.closed_under(m, &e),
        }
    }

    /// Classify the error that closed a pilot's channel.
    fn closed_under(&self, m: &Outgoing<'_>, e: &lapin::Error) -> Alone {
        if !self.is_healthy() {
            return Alone::Lost(e.to_string(), BusError::ConnectionLost);
        }
        let refusal = refusal_of(e, m.body.len());
        let failure = match &refusal {
            Refusal::Exchange if soft_error(e) == Some(AMQPSoftError::NOTFOUND) => {
                PublishError::NoExchange(m.exchange.to_owned())
            }
            Refusal::Exchange | Refusal::RoutingKey => PublishError::Refused(e.to_string()),
            Refusal::Size { limit: Some(max) } => PublishError::TooLarge {
                size: m.body.len(),
                max: *max,
            },
            Refusal::Size { limit: None } | Refusal::Message => {
                PublishError::Channel(e.to_string())
            }
        };
        Alone::Refused(refusal, failure)
    }

    /// Proven messages of one exchange, pipelined on a channel of their own.
    async fn publish_shared(
        &self,
        batch: &[Outgoing<'_>],
        shapes: &[Shape<'_>],
        idx: &[usize],
        budget: &Budget,
    ) -> Decided {
        let mut d = Decided::default();
        if !budget.may_send() {
            d.fates.extend(idx.iter().map(|i| (*i, Fate::Unsent)));
            return d;
        }
        let channel = match self.channel_within(budget).await {
            Ok(c) => c,
            Err(e) => {
                d.fates.extend(idx.iter().map(|i| (*i, Fate::Unsent)));
                d.trouble = Some(e).filter(|e| !e.is_budget());
                return d;
            }
        };
        let mut sent = Vec::with_capacity(idx.len());
        let mut blocked = Vec::new();
        for part in idx.chunks(HANDED_OVER_TOGETHER) {
            // Yields between parts: without this a batch of hundreds would hold its worker
            // thread, and with it the timers of held rows, for the whole loop.
            tokio::task::consume_budget().await;
            if !budget.may_send() || !channel.status().connected() || !blocked.is_empty() {
                d.fates.extend(part.iter().map(|i| (*i, Fate::Unsent)));
                continue;
            }
            // A publish hands its frames to lapin's I/O thread when first polled, and
            // returns once that thread has taken them: awaited one by one, each message
            // costs two thread wake-ups; awaited together, a part costs about two.
            let handed = join_all(part.iter().map(|&i| {
                let channel = &channel;
                async move { (i, self.send(channel, &batch[i], budget).await) }
            }))
            .await;
            for (i, result) in handed {
                match result {
                    Ok(confirm) => sent.push((i, confirm)),
                    // The broker stopped reading (flow control): part of it may be out.
                    Err(Waited::TimedOut(after)) => blocked.push((i, after)),
                    // Refused locally (the channel is already closed): never left the process.
                    Err(Waited::Closed(_)) => d.fates.push((i, Fate::Unsent)),
                }
            }
        }
        if !sent.is_empty() {
            d.sent = Some(Instant::now());
        }
        let mut waited = join_all(
            sent.into_iter()
                .map(|(i, c)| async move { (i, self.await_confirm(c, budget).await) }),
        )
        .await;
        waited.extend(
            blocked
                .into_iter()
                .map(|(i, after)| (i, Err(Waited::TimedOut(after)))),
        );
        let clean = self.judge_shared(batch, shapes, waited, &mut d);
        if clean {
            self.give_back(channel);
        }
        if !self.is_healthy() {
            d.trouble = Some(BusError::ConnectionLost);
        }
        d
    }

    /// Fates of the shared channel's messages; true when every confirm came in (the
    /// channel can serve another batch: nothing of this one can still arrive on it).
    fn judge_shared(
        &self,
        batch: &[Outgoing<'_>],
        shapes: &[Shape<'_>],
        waited: Vec<(usize, Result<Answer, Waited>)>,
        d: &mut Decided,
    ) -> bool {
        // Every return first: it may have arrived with any message's confirm.
        let returned: HashMap<String, String> = waited
            .iter()
            .filter_map(|(_, w)| w.as_ref().ok()?.returned.clone())
            .collect();
        let mut clean = true;
        for (i, w) in waited {
            let m = &batch[i];
            let fate = match w {
                Ok(a) => fate_of(m, Some(a.ack), &returned),
                Err(Waited::TimedOut(after)) => {
                    clean = false;
                    match fate_of(m, None, &returned) {
                        Fate::Unsent => Fate::Failed(PublishError::ConfirmTimeout(after)),
                        known => known,
                    }
                }
                Err(Waited::Closed(e)) => {
                    clean = false;
                    // Whatever the reason, prove it again before sharing a channel; and
                    // learn what the broker's answer says (a size limit, say).
                    let mut proofs = self.proofs();
                    proofs.doubt(m.exchange);
                    proofs.refused(&shapes[i], &refusal_of(&e, 0));
                    drop(proofs);
                    match fate_of(m, None, &returned) {
                        Fate::Unsent => Fate::Unknown(e.to_string()),
                        known => known,
                    }
                }
            };
            d.fates.push((i, fate));
        }
        clean
    }

    /// A confirm channel, opened (if it must be) within the batch's budget.
    async fn channel_within(&self, budget: &Budget) -> Result<Channel, BusError> {
        let after = budget
            .confirm_until
            .saturating_duration_since(Instant::now());
        match timeout_at(budget.confirm_until.into(), self.confirm_channel()).await {
            Ok(channel) => channel,
            Err(_) => Err(BusError::Timeout {
                what: BUDGET_SPENT,
                after,
            }),
        }
    }

    /// Hand one message to the broker, within the batch's budget (a broker that applies
    /// flow control stops reading, and the write would wait).
    async fn send(
        &self,
        channel: &Channel,
        m: &Outgoing<'_>,
        budget: &Budget,
    ) -> Result<PublisherConfirm, Waited> {
        // Names were checked by `precheck`.
        let exchange = ShortString::try_new(m.exchange).unwrap_or_default();
        let routing_key = ShortString::try_new(m.routing_key).unwrap_or_default();
        let publish = channel.basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            m.body,
            m.properties.clone(),
        );
        match timeout_at(budget.confirm_until.into(), publish).await {
            Ok(Ok(confirm)) => Ok(confirm),
            Ok(Err(e)) => Err(Waited::Closed(e)),
            Err(_) => Err(Waited::TimedOut(self.settings.confirm_timeout)),
        }
    }

    async fn await_confirm(
        &self,
        confirm: PublisherConfirm,
        budget: &Budget,
    ) -> Result<Answer, Waited> {
        let limit = self.settings.confirm_timeout;
        let until = (Instant::now() + limit).min(budget.confirm_until);
        match timeout_at(until.into(), confirm).await {
            Ok(Ok(c)) => Ok(Answer {
                ack: c.is_ack(),
                returned: c.take_message().and_then(returned_entry),
            }),
            Ok(Err(e)) => Err(Waited::Closed(e)),
            Err(_) => Err(Waited::TimedOut(limit)),
        }
    }
}

/// The broker's answer to one publish: ack or nack, and a returned message that came
/// with it (not necessarily this publish's own).
struct Answer {
    ack: bool,
    returned: Option<(String, String)>,
}

/// How waiting for one confirm ended, when it did not end in a confirm.
enum Waited {
    TimedOut(Duration),
    Closed(lapin::Error),
}

/// The fate of a message from facts about it alone: returned (by its message_id), then
/// the broker's ack or nack; `None` when no confirm came.
fn fate_of(m: &Outgoing<'_>, acked: Option<bool>, returned: &HashMap<String, String>) -> Fate {
    if let Some(why) = returned.get(&m.message_id) {
        return Fate::Failed(PublishError::Returned(why.clone()));
    }
    match acked {
        Some(true) => Fate::Confirmed,
        Some(false) => Fate::Failed(PublishError::Nacked),
        None => Fate::Unsent,
    }
}

/// A returned message's message_id, with the broker's reason.
fn returned_entry(r: lapin::message::BasicReturnMessage) -> Option<(String, String)> {
    let id = r.properties.message_id().as_ref()?.to_string();
    Some((id, format!("{} {}", r.reply_code, r.reply_text)))
}

/// What a channel close under a message of `size` bytes concerns.
fn refusal_of(e: &lapin::Error, size: usize) -> Refusal {
    let soft = soft_error(e);
    Refusal::of(
        soft == Some(AMQPSoftError::NOTFOUND),
        soft == Some(AMQPSoftError::ACCESSREFUSED),
        &e.to_string(),
        size,
    )
}

fn soft_error(e: &lapin::Error) -> Option<AMQPSoftError> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => Some(s.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expirations_as_rabbitmq_reads_them() {
        for ok in ["0", "60000", "+5", "4294967295"] {
            assert!(valid_expiration(ok), "{ok}");
        }
        for bad in [
            "",
            "-1",
            " 5",
            "5 ",
            "1.5",
            "4294967296",
            "+",
            "abc",
            "99999999999999999999",
        ] {
            assert!(!valid_expiration(bad), "{bad}");
        }
    }

    #[test]
    fn properties_that_would_close_the_channel_fail_the_message_alone() {
        let refused = |p: Properties| refused_properties(&p).map(|e| e.reason());
        assert_eq!(refused(Properties::default()), None);
        let expiration = Properties {
            expiration: Some("soon".into()),
            ..Properties::default()
        };
        assert_eq!(refused(expiration), Some("invalid"));
        let reply_to = Properties {
            reply_to: Some(DIRECT_REPLY_TO.into()),
            ..Properties::default()
        };
        assert_eq!(refused(reply_to), Some("invalid"));
        let cc = |v: Value| Properties {
            headers: vec![("CC".into(), v)],
            ..Properties::default()
        };
        assert_eq!(refused(cc(Value::Str("q".into()))), Some("invalid"));
        assert_eq!(
            refused(cc(Value::Array(vec![Value::Str("q".into())]))),
            None
        );
        // Only the broker's own header names count.
        let other = Properties {
            headers: vec![("cc".into(), Value::Str("q".into()))],
            ..Properties::default()
        };
        assert_eq!(refused(other), None);
    }
}
