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
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::{FutureExt, StreamExt};
use lapin::options::BasicPublishOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, PublisherConfirm};
use tokio::time::timeout_at;
use tokio_util::sync::CancellationToken;

use super::convert::lapin_properties;
use super::frame::header_frame_size;
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
    message_id: &'a str,
    exchange: &'a str,
    routing_key: &'a str,
    /// Built once and handed to lapin by the one publish of this message (see
    /// [`Outgoing::properties`]).
    properties: Mutex<Option<BasicProperties>>,
    wire: &'a Properties,
    body: &'a [u8],
    alone: bool,
    /// Its whole content-header frame, in bytes (see `frame`).
    header_frame: usize,
}

impl<'a> Outgoing<'a> {
    /// The message in lapin's types, and why it cannot be published, if it cannot.
    fn of(m: &'a ToPublish) -> (Self, Option<PublishError>) {
        let message = &m.message;
        let (properties, invalid) = match refused_properties(&message.properties)
            .map_or_else(|| lapin_properties(&message.properties), Err)
        {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        let header_frame = properties.as_ref().map_or(0, header_frame_size);
        let outgoing = Self {
            header_frame,
            message_id: message.properties.message_id.as_deref().unwrap_or_default(),
            exchange: &message.exchange,
            routing_key: &message.routing_key,
            properties: Mutex::new(properties),
            wire: &message.properties,
            body: &message.body,
            alone: m.alone,
        };
        (outgoing, invalid)
    }

    /// Its properties for lapin, which takes them by value: built once in `of` and taken
    /// by its publish (a message is published at most once per batch), rebuilt should it
    /// ever be published again.
    fn properties(&self) -> BasicProperties {
        let taken = self
            .properties
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        taken.unwrap_or_else(|| lapin_properties(self.wire).unwrap_or_default())
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
        for (name, what) in [
            (m.exchange, "exchange name"),
            (m.routing_key, "routing key"),
        ] {
            crate::wire::short(name, what).map_err(|e| PublishError::Invalid(e.0))?;
        }
        let frame_max = usize::try_from(self.frame_max()).unwrap_or(usize::MAX);
        if m.header_frame > frame_max {
            return Err(PublishError::HeaderTooLarge {
                size: m.header_frame,
                max: frame_max,
            });
        }
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
        let mut sent = None;
        let alone = if budget.may_send() {
            self.publish_alone(&batch[first], budget, &mut sent).await
        } else {
            Alone::NotSent
        };
        let m = &shapes[first];
        match &alone {
            Alone::Delivered(_) => self.proofs().accepted(m, Instant::now()),
            Alone::Refused(refusal, _) => self.proofs().refused(m, refusal),
            _ => {}
        }
        let mut d = decide_alone(shapes, first, rest, alone);
        d.sent = sent;
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
                Alone::Delivered(fate_alone(m, &a))
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
        let mut ends = Vec::new();
        let mut blocked = false;
        for part in idx.chunks(HANDED_OVER_TOGETHER) {
            // Yields between parts: without this a batch of hundreds would hold its worker
            // thread, and with it the timers of held rows, for the whole loop.
            tokio::task::consume_budget().await;
            if blocked || !budget.may_send() || !channel.status().connected() {
                ends.extend(part.iter().map(|&i| (i, End::NotSent)));
                continue;
            }
            for (i, handed) in part
                .iter()
                .zip(self.hand_over(&channel, batch, part, budget).await)
            {
                match handed {
                    Ok(confirm) => sent.push((*i, confirm)),
                    // The broker stopped reading (flow control): part of it may be out.
                    Err(Waited::TimedOut(after)) => {
                        blocked = true;
                        ends.push((*i, End::TimedOut(after)));
                    }
                    // Refused locally (the channel is already closed): never left the process.
                    Err(Waited::Closed(_)) => ends.push((*i, End::NotSent)),
                }
            }
        }
        if !sent.is_empty() {
            d.sent = Some(Instant::now());
        }
        ends.extend(self.await_confirms(sent, budget).await);
        let ids: Vec<&str> = ends.iter().map(|(i, _)| batch[*i].message_id).collect();
        let closed = ends.iter().filter_map(|(i, e)| match e {
            End::Closed(_, refusal) => Some((*i, refusal.clone())),
            _ => None,
        });
        let closed: Vec<(usize, Refusal)> = closed.collect();
        if !closed.is_empty() {
            // Whatever the reason, prove it again before sharing a channel; and learn
            // what the broker's answer says (a size limit, say).
            let mut proofs = self.proofs();
            for (i, refusal) in &closed {
                proofs.doubt(batch[*i].exchange);
                proofs.refused(&shapes[*i], refusal);
            }
        }
        let clean = judge_shared(&ids, ends, &mut d.fates);
        if clean {
            self.give_back(channel);
        }
        if !self.is_healthy() {
            d.trouble = Some(BusError::ConnectionLost);
        }
        d
    }

    /// Hand one part to lapin at once, bounded together by the batch's budget: a publish
    /// hands its frames to lapin's I/O thread when first polled and returns once that
    /// thread has taken them; awaited one by one, each message would cost two thread
    /// wake-ups, awaited together the part costs about two. One result per message of
    /// `part`, in order.
    async fn hand_over(
        &self,
        channel: &Channel,
        batch: &[Outgoing<'_>],
        part: &[usize],
        budget: &Budget,
    ) -> Vec<Result<PublisherConfirm, Waited>> {
        let mut handed: Vec<Option<lapin::Result<PublisherConfirm>>> =
            part.iter().map(|_| None).collect();
        let publishes = part
            .iter()
            .zip(handed.iter_mut())
            .map(|(&i, slot)| async move {
                *slot = Some(publish(channel, &batch[i]).await);
            });
        // One timer for the part, not one per message.
        let _ = timeout_at(budget.confirm_until.into(), join_all(publishes)).await;
        let after = self.settings.confirm_timeout;
        handed
            .into_iter()
            .map(|h| match h {
                Some(Ok(confirm)) => Ok(confirm),
                Some(Err(e)) => Err(Waited::Closed(e)),
                None => Err(Waited::TimedOut(after)),
            })
            .collect()
    }

    /// Await the confirms of a shared channel, bounded together: by `amqp.confirm_timeout`
    /// from now and by the batch's budget. Awaited in the order sent (the broker confirms
    /// in that order), each with one wake-up; at the bound, those that came in meanwhile
    /// are taken as they are, the rest timed out.
    async fn await_confirms(
        &self,
        sent: Vec<(usize, PublisherConfirm)>,
        budget: &Budget,
    ) -> Vec<(usize, End)> {
        let limit = self.settings.confirm_timeout;
        let until = (Instant::now() + limit).min(budget.confirm_until);
        let mut ends = Vec::with_capacity(sent.len());
        let mut awaiting = None;
        let mut sent = sent.into_iter();
        let all = async {
            for (i, confirm) in sent.by_ref() {
                awaiting = Some(i);
                ends.push((i, End::of(confirm.await)));
                awaiting = None;
            }
        };
        let _ = timeout_at(until.into(), all).await;
        // The confirm awaited when time ran out went with the future.
        ends.extend(awaiting.map(|i| (i, End::TimedOut(limit))));
        // The rest were not awaited yet; their confirms may have come in all the same.
        ends.extend(sent.map(|(i, confirm)| {
            let end = confirm.now_or_never().map_or(End::TimedOut(limit), End::of);
            (i, end)
        }));
        ends
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
        match timeout_at(budget.confirm_until.into(), publish(channel, m)).await {
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
            Ok(Ok(c)) => Ok(Answer::of(c)),
            Ok(Err(e)) => Err(Waited::Closed(e)),
            Err(_) => Err(Waited::TimedOut(limit)),
        }
    }
}

/// Hand `m` to lapin: mandatory, in confirm mode.
async fn publish(channel: &Channel, m: &Outgoing<'_>) -> lapin::Result<PublisherConfirm> {
    // Names were checked by `precheck`.
    let exchange = ShortString::try_new(m.exchange).unwrap_or_default();
    let routing_key = ShortString::try_new(m.routing_key).unwrap_or_default();
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    channel
        .basic_publish(exchange, routing_key, options, m.body, m.properties())
        .await
}

/// The broker's answer to one publish: ack or nack, and a returned message that came
/// with it (not necessarily this publish's own).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    ack: bool,
    /// The returned message's `message_id`, and the broker's reason.
    returned: Option<(String, String)>,
}

impl Answer {
    fn of(c: lapin::Confirmation) -> Self {
        Self {
            ack: c.is_ack(),
            returned: c.take_message().and_then(returned_entry),
        }
    }
}

/// How waiting for one confirm ended, when it did not end in a confirm.
enum Waited {
    TimedOut(Duration),
    Closed(lapin::Error),
}

/// How one message of a shared channel ended, as far as this side can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
    Answered(Answer),
    /// No confirm within the bound.
    TimedOut(Duration),
    /// Its channel closed before the confirm: why, and what the close concerns.
    Closed(String, Refusal),
    /// Never left the process.
    NotSent,
}

impl End {
    fn of(confirm: lapin::Result<lapin::Confirmation>) -> Self {
        match confirm {
            Ok(c) => End::Answered(Answer::of(c)),
            Err(e) => End::Closed(e.to_string(), refusal_of(&e, 0)),
        }
    }
}

/// The fates of a shared channel's messages (`ids[k]` is the `message_id` of `ends[k]`'s
/// message), pushed onto `fates`; true when every confirm came in (the channel can serve
/// another batch: nothing of this one can still arrive on it).
fn judge_shared(ids: &[&str], ends: Vec<(usize, End)>, fates: &mut Vec<(usize, Fate)>) -> bool {
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
fn decide_alone(shapes: &[Shape<'_>], first: usize, rest: Vec<usize>, alone: Alone) -> Decided {
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

/// The fate of a pilot from its own confirm: returned (by its message_id), acked or
/// nacked.
fn fate_alone(m: &Outgoing<'_>, a: &Answer) -> Fate {
    match &a.returned {
        Some((id, why)) if id == m.message_id => Fate::Failed(PublishError::Returned(why.clone())),
        _ if a.ack => Fate::Confirmed,
        _ => Fate::Failed(PublishError::Nacked),
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

    fn acked(returned: Option<(&str, &str)>) -> End {
        End::Answered(Answer {
            ack: true,
            returned: returned.map(|(id, why)| (id.to_owned(), why.to_owned())),
        })
    }

    fn judged(ids: &[&str], ends: Vec<(usize, End)>) -> (Vec<(usize, Fate)>, bool) {
        let mut fates = Vec::new();
        let clean = judge_shared(ids, ends, &mut fates);
        (fates, clean)
    }

    #[test]
    fn a_shared_channel_judges_each_message_by_its_own_confirm() {
        let nacked = End::Answered(Answer {
            ack: false,
            returned: None,
        });
        let (fates, clean) = judged(&["a", "b"], vec![(4, acked(None)), (7, nacked)]);
        assert_eq!(
            fates,
            vec![
                (4, Fate::Confirmed),
                (7, Fate::Failed(PublishError::Nacked))
            ]
        );
        assert!(clean, "every confirm came in: the channel may serve again");
    }

    #[test]
    fn a_return_is_matched_by_message_id_whichever_confirm_brought_it() {
        // lapin hands "b"'s return to the confirm of "a".
        let ends = vec![(0, acked(Some(("b", "312 NO_ROUTE")))), (1, acked(None))];
        let (fates, clean) = judged(&["a", "b"], ends);
        assert_eq!(
            fates,
            vec![
                (0, Fate::Confirmed),
                (
                    1,
                    Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
                )
            ]
        );
        assert!(clean);
    }

    #[test]
    fn no_confirm_times_out_and_a_closed_channel_leaves_the_fate_unknown() {
        let after = Duration::from_secs(5);
        let ends = vec![
            (0, End::TimedOut(after)),
            (1, End::Closed("channel closed".into(), Refusal::Message)),
            (2, End::NotSent),
            // A return that came in before its channel closed still says what happened.
            (3, End::Closed("channel closed".into(), Refusal::Message)),
            (4, acked(Some(("d", "312 NO_ROUTE")))),
        ];
        let (fates, clean) = judged(&["a", "b", "c", "d", "e"], ends);
        assert_eq!(
            fates,
            vec![
                (0, Fate::Failed(PublishError::ConfirmTimeout(after))),
                (1, Fate::Unknown("channel closed".into())),
                (2, Fate::Unsent),
                (
                    3,
                    Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
                ),
                (4, Fate::Confirmed),
            ]
        );
        assert!(!clean, "confirms may still arrive on that channel");
    }

    #[test]
    fn unsent_messages_leave_the_channel_clean() {
        let (fates, clean) = judged(&["a"], vec![(0, End::NotSent)]);
        assert_eq!(fates, vec![(0, Fate::Unsent)]);
        assert!(clean);
    }

    fn shape(exchange: &'static str, routing_key: &'static str) -> Shape<'static> {
        Shape {
            exchange,
            routing_key,
            size: 1,
            alone: false,
        }
    }

    fn sorted(mut d: Decided) -> (Vec<(usize, Fate)>, Vec<usize>, bool) {
        d.fates.sort_by_key(|(i, _)| *i);
        (d.fates, d.replan, d.trouble.is_some())
    }

    #[test]
    fn a_pilot_refused_for_its_exchange_fails_that_exchange_alone() {
        let shapes = [shape("x", "a"), shape("x", "b"), shape("y", "a")];
        let e = PublishError::NoExchange("x".into());
        let alone = Alone::Refused(Refusal::Exchange, e.clone());
        let (fates, replan, trouble) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
        assert_eq!(
            fates,
            vec![(0, Fate::Failed(e.clone())), (1, Fate::Failed(e))]
        );
        assert_eq!((replan, trouble), (vec![2], false));
    }

    #[test]
    fn a_topic_refusal_fails_that_routing_key_alone() {
        let shapes = [shape("x", "a"), shape("x", "b"), shape("x", "a")];
        let e = PublishError::Refused("ACCESS_REFUSED".into());
        let alone = Alone::Refused(Refusal::RoutingKey, e.clone());
        let (fates, replan, _) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
        assert_eq!(
            fates,
            vec![(0, Fate::Failed(e.clone())), (2, Fate::Failed(e))]
        );
        assert_eq!(replan, vec![1]);
    }

    #[test]
    fn a_refusal_of_the_message_itself_fails_it_alone() {
        let shapes = [shape("x", "a"), shape("x", "a")];
        for refusal in [Refusal::Message, Refusal::Size { limit: Some(1) }] {
            let e = PublishError::Channel("PRECONDITION_FAILED".into());
            let alone = Alone::Refused(refusal, e.clone());
            let (fates, replan, _) = sorted(decide_alone(&shapes, 0, vec![1], alone));
            assert_eq!(fates, vec![(0, Fate::Failed(e))]);
            assert_eq!(replan, vec![1]);
        }
    }

    #[test]
    fn what_waits_for_a_pilot_goes_on_only_once_it_was_delivered() {
        let shapes = [shape("x", "a"), shape("x", "a"), shape("x", "a")];
        let (fates, replan, _) = sorted(decide_alone(
            &shapes,
            0,
            vec![1, 2],
            Alone::Delivered(Fate::Confirmed),
        ));
        assert_eq!((fates, replan), (vec![(0, Fate::Confirmed)], vec![1, 2]));
        let after = Duration::from_secs(5);
        let unanswered = [
            (
                Alone::TimedOut(PublishError::ConfirmTimeout(after)),
                Fate::Failed(PublishError::ConfirmTimeout(after)),
                false,
            ),
            (
                Alone::Lost("gone".into(), BusError::ConnectionLost),
                Fate::Unknown("gone".into()),
                true,
            ),
            (
                Alone::NoChannel(BusError::ConnectionLost),
                Fate::Unsent,
                true,
            ),
            (Alone::NotSent, Fate::Unsent, false),
        ];
        for (alone, first, trouble) in unanswered {
            let (fates, replan, troubled) = sorted(decide_alone(&shapes, 0, vec![1, 2], alone));
            assert_eq!(
                fates,
                vec![(0, first), (1, Fate::Unsent), (2, Fate::Unsent)]
            );
            assert!(replan.is_empty());
            assert_eq!(troubled, trouble);
        }
    }

    #[test]
    fn a_spent_budget_is_no_trouble_of_the_bus() {
        let shapes = [shape("x", "a")];
        let spent = BusError::Timeout {
            what: BUDGET_SPENT,
            after: Duration::ZERO,
        };
        let d = decide_alone(&shapes, 0, Vec::new(), Alone::NoChannel(spent));
        assert!(d.trouble.is_none());
    }

    #[test]
    fn a_pilot_is_judged_by_its_own_return() {
        let message = ToPublish {
            message: Message {
                exchange: "x".into(),
                routing_key: "a".into(),
                properties: Properties {
                    message_id: Some("m".into()),
                    ..Properties::default()
                },
                body: Vec::new(),
            },
            alone: true,
        };
        let (m, invalid) = Outgoing::of(&message);
        assert!(invalid.is_none());
        let answer = |ack, returned: Option<&str>| Answer {
            ack,
            returned: returned.map(|id| (id.to_owned(), "312 NO_ROUTE".to_owned())),
        };
        assert_eq!(fate_alone(&m, &answer(true, None)), Fate::Confirmed);
        assert_eq!(
            fate_alone(&m, &answer(false, None)),
            Fate::Failed(PublishError::Nacked)
        );
        assert_eq!(
            fate_alone(&m, &answer(true, Some("m"))),
            Fate::Failed(PublishError::Returned("312 NO_ROUTE".into()))
        );
        // Another message's return says nothing about this one.
        assert_eq!(fate_alone(&m, &answer(true, Some("n"))), Fate::Confirmed);
        // Its properties are built once, and again should it be sent again.
        assert_eq!(
            m.properties().message_id().as_ref().map(|s| s.as_str()),
            Some("m")
        );
        assert_eq!(
            m.properties().message_id().as_ref().map(|s| s.as_str()),
            Some("m")
        );
    }

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
