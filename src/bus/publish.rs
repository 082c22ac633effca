//! Publishing one batch with confirms, and the fate of every message in it.
//!
//! Each message's fate comes from facts about that message, never from ordering luck:
//! - a batch publishes on confirm channels of its own, one per exchange (taken from a
//!   pool, given back only when every confirm came in), so concurrent batches never see
//!   each other's returns, confirms or channel closes, and a refusal that closes a
//!   channel touches no other exchange's messages;
//! - a returned (unroutable) message is matched by its `message_id`, which the broker
//!   sends back with it: lapin hands a return to whichever confirm resolves next, so the
//!   confirm it arrives with says nothing about which message it was;
//! - what can be checked before publishing is (names, size against
//!   `amqp.max_message_size`);
//! - refusals that close a channel (exchange missing or internal, access refused, a
//!   broker limit) must hit one message only. So a message goes out *alone* on a channel
//!   of its own when its exchange has not accepted one of our messages recently, or when
//!   the caller asks (a message whose fate was unknown after a channel close). The first
//!   message to an exchange is its pilot: once confirmed (or returned: the exchange
//!   exists and accepts us) the exchange is trusted and the rest follow, pipelined. If an
//!   exchange refuses the pilot (404/403), every message of the batch for that exchange
//!   fails with that reason (permissions are judged per exchange, not per routing key);
//!   any other refusal fails the pilot alone and the next message for that exchange
//!   becomes the pilot. Pilots and the trusted exchanges' messages go out side by side.
//!
//! The whole batch is bounded by a [`Budget`]: no message is sent after `send_until` or
//! once `stop` is cancelled, no channel opening, write or confirm is awaited past
//! `confirm_until`.

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
use super::{Bus, BusError};
use crate::wire::Message;

/// Messages of a shared channel handed to lapin at once (see `publish_shared`). Under
/// flow control, the part in flight may time out; the parts after it stay unsent.
pub const HANDED_OVER_TOGETHER: usize = 64;
/// Pilot chains and shared groups in flight at once (each holds a channel).
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
        let (properties, invalid) = match lapin_properties(&message.properties) {
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
    #[error("message of {size} bytes exceeds amqp.max_message_size ({max} bytes)")]
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
    /// The exchange refused us: the same answer for every message to it.
    ExchangeRefused(PublishError),
    /// This message failed; the exchange may still take others.
    Failed(PublishError),
    Lost(String, BusError),
    NoChannel(BusError),
    /// The budget ran out before it could be sent.
    NotSent,
}

/// A unit of a batch's publishing, on a channel of its own.
enum Job {
    /// Messages of one untrusted exchange (or one message that must go alone): sent
    /// alone one after the other until the exchange accepts one.
    Pilot(Vec<usize>),
    /// Messages of one trusted exchange, pipelined.
    Shared(Vec<usize>),
}

/// Decided fates, messages handed on to the batch channel, bus trouble.
#[derive(Default)]
struct Decided {
    fates: Vec<(usize, Fate)>,
    promoted: Vec<usize>,
    trouble: Option<BusError>,
    /// When the job handed its last message to the broker.
    sent: Option<Instant>,
}

impl Bus {
    /// Publish `batch` (mandatory, confirm mode) within `budget`; one fate per message.
    /// Pilots and the trusted exchanges' groups go out at once, side by side; the rest of
    /// an exchange whose pilot was accepted follows in a second wave.
    pub async fn publish_batch(&self, batch: &[ToPublish], budget: &Budget) -> Published {
        let (batch, invalid): (Vec<Outgoing>, Vec<Option<PublishError>>) =
            batch.iter().map(Outgoing::of).unzip();
        let mut fates: Vec<Option<Fate>> = batch
            .iter()
            .zip(invalid)
            .map(|(m, invalid)| invalid.or(self.precheck(m).err()).map(Fate::Failed))
            .collect();
        let batch = &batch[..];
        let mut trouble = None;
        let mut sent = None;
        let mut jobs = self.plan(batch, &fates);
        while !jobs.is_empty() {
            let done: Vec<Decided> = futures_util::stream::iter(jobs)
                .map(|job| self.run(batch, job, budget))
                .buffer_unordered(JOBS_PARALLEL)
                .collect()
                .await;
            jobs = Vec::new();
            for d in done {
                d.fates.into_iter().for_each(|(i, f)| fates[i] = Some(f));
                if !d.promoted.is_empty() {
                    jobs.push(Job::Shared(d.promoted));
                }
                trouble = trouble.or(d.trouble);
                sent = sent.max(d.sent);
            }
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

    async fn run(&self, batch: &[Outgoing<'_>], job: Job, budget: &Budget) -> Decided {
        match job {
            Job::Pilot(chain) => self.pilot_chain(batch, chain, budget).await,
            Job::Shared(idx) => self.publish_shared(batch, &idx, budget).await,
        }
    }

    /// Refuse what the broker would refuse by closing the channel, where we can tell.
    fn precheck(&self, m: &Outgoing<'_>) -> Result<(), PublishError> {
        short(m.exchange, "exchange name")?;
        short(m.routing_key, "routing key")?;
        let max = self.settings.max_message_size.as_u64();
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        if m.body.len() > max {
            return Err(PublishError::TooLarge {
                size: m.body.len(),
                max,
            });
        }
        Ok(())
    }

    /// The first wave: a pilot chain per untrusted exchange and per message that must go
    /// alone, and a shared channel per trusted exchange (a refusal that closes a channel
    /// then touches no other exchange's messages). Oldest due first within each.
    fn plan(&self, batch: &[Outgoing<'_>], fates: &[Option<Fate>]) -> Vec<Job> {
        let trusted = self.trusted_exchanges();
        let mut untrusted: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut shared: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut jobs = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            if fates[i].is_some() {
                continue;
            }
            if m.alone {
                jobs.push(Job::Pilot(vec![i]));
            } else if trusted.contains(m.exchange) {
                shared.entry(m.exchange).or_default().push(i);
            } else {
                untrusted.entry(m.exchange).or_default().push(i);
            }
        }
        jobs.extend(untrusted.into_values().map(Job::Pilot));
        jobs.extend(shared.into_values().map(Job::Shared));
        jobs
    }

    /// Send the chain's messages alone, one after the other, until the exchange accepts
    /// one; the rest then go to the batch channel.
    async fn pilot_chain(
        &self,
        batch: &[Outgoing<'_>],
        chain: Vec<usize>,
        budget: &Budget,
    ) -> Decided {
        let mut d = Decided::default();
        let mut rest = chain.into_iter();
        while let Some(i) = rest.next() {
            if !budget.may_send() {
                d.fates.push((i, Fate::Unsent));
                continue;
            }
            match self.publish_alone(&batch[i], budget, &mut d.sent).await {
                Alone::Delivered(fate) => {
                    self.trust(batch[i].exchange);
                    d.fates.push((i, fate));
                    d.promoted.extend(rest);
                    break;
                }
                Alone::ExchangeRefused(e) => {
                    d.fates.push((i, Fate::Failed(e.clone())));
                    d.fates.extend(rest.map(|j| (j, Fate::Failed(e.clone()))));
                    break;
                }
                // The broker does not answer for this exchange: try it in the next batch
                // instead of holding this one up message after message.
                Alone::Failed(e @ PublishError::ConfirmTimeout(_)) => {
                    d.fates.push((i, Fate::Failed(e)));
                    d.fates.extend(rest.map(|j| (j, Fate::Unsent)));
                    break;
                }
                Alone::Failed(e) => d.fates.push((i, Fate::Failed(e))),
                Alone::Lost(why, e) => {
                    d.fates.push((i, Fate::Unknown(why)));
                    d.fates.extend(rest.map(|j| (j, Fate::Unsent)));
                    d.trouble = Some(e);
                    break;
                }
                Alone::NoChannel(e) => {
                    d.fates.push((i, Fate::Unsent));
                    d.fates.extend(rest.map(|j| (j, Fate::Unsent)));
                    d.trouble = Some(e).filter(|e| !e.is_budget());
                    break;
                }
                Alone::NotSent => {
                    d.fates.push((i, Fate::Unsent));
                    d.fates.extend(rest.map(|j| (j, Fate::Unsent)));
                    break;
                }
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
            Err(Waited::TimedOut(after)) => Alone::Failed(PublishError::ConfirmTimeout(after)),
            Err(Waited::Closed(e)) => self.closed_under(m, &e),
        }
    }

    /// Classify the error that closed a pilot's channel.
    fn closed_under(&self, m: &Outgoing<'_>, e: &lapin::Error) -> Alone {
        if !self.is_healthy() {
            return Alone::Lost(e.to_string(), BusError::ConnectionLost);
        }
        match soft_error(e) {
            Some(AMQPSoftError::NOTFOUND) => {
                Alone::ExchangeRefused(PublishError::NoExchange(m.exchange.to_owned()))
            }
            Some(AMQPSoftError::ACCESSREFUSED) => {
                Alone::ExchangeRefused(PublishError::Refused(e.to_string()))
            }
            _ => Alone::Failed(PublishError::Channel(e.to_string())),
        }
    }

    /// One trusted exchange's messages, pipelined on a channel of their own.
    async fn publish_shared(
        &self,
        batch: &[Outgoing<'_>],
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
        let clean = self.judge_shared(batch, waited, &mut d);
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
                    // The exchange may be the reason: prove it again before trusting it.
                    self.distrust(m.exchange);
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

fn soft_error(e: &lapin::Error) -> Option<AMQPSoftError> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => Some(s.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}
