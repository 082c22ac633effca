//! Publishing one batch with confirms: the I/O. What becomes of each message is judged in
//! [`fate`] from facts about that message alone; they are gathered here so that each is
//! about one message:
//! - a batch publishes on confirm channels of its own (taken from a pool, given back
//!   only when every confirm came in), so concurrent batches never see each other's
//!   returns, confirms or channel closes;
//! - a returned (unroutable) message is taken from whichever confirm lapin hands it to,
//!   with the `message_id` it is matched by;
//! - what the broker would refuse by closing the channel and [`fate::precheck`] cannot
//!   tell — an exchange missing or refusing us, a routing key a topic permission
//!   refuses, a body over the broker's own size limit — is learnt from *pilots*: a
//!   message shares a channel only with what the broker already accepted from us (see
//!   [`proof`]), and anything else goes out alone, so a refusal closes a channel that
//!   carried nothing but the message it is about.
//!
//! The batch goes out in waves: pilots and the proven messages side by side, then what
//! the pilots' answers released. The whole batch is bounded by a [`Budget`]: no message
//! is sent after `send_until` or once `stop` is cancelled, no channel opening, write or
//! confirm is awaited past `confirm_until`.

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
use super::fate::{
    self, Alone, Answer, BUDGET_SPENT, Close, Decided, End, Fate, PublishError, decide_alone,
    fate_alone, judge_shared, refused_properties,
};
use super::frame::header_frame_size;
use super::proof::{self, Job, Refusal, Shape};
use super::{Bus, BusError};
use crate::wire::{Message, Properties};

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

/// The bounds of one batch.
#[derive(Debug, Clone)]
pub struct Budget {
    pub send_until: Instant,
    pub confirm_until: Instant,
    pub stop: CancellationToken,
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
            let max = fate::size_max(self.settings.max_message_size.as_u64(), view.limit);
            let frame_max = self.frame_max();
            let precheck =
                |i: usize| fate::precheck(&shapes[i], batch[i].header_frame, frame_max, max);
            pending.retain(|&i| match precheck(i) {
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
                Alone::Delivered(fate_alone(m.message_id, &a))
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
        fate::refused(&m.shape(), &Close::of(e))
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
    // Names were checked by `fate::precheck`.
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

/// How waiting for one confirm ended, when it did not end in a confirm.
enum Waited {
    TimedOut(Duration),
    Closed(lapin::Error),
}

// lapin's side of `fate`'s facts: reading confirms, returns and channel closes off
// lapin's types is the adapter's.

impl Answer {
    fn of(c: lapin::Confirmation) -> Self {
        Self {
            ack: c.is_ack(),
            returned: c.take_message().and_then(returned_entry),
        }
    }
}

impl End {
    fn of(confirm: lapin::Result<lapin::Confirmation>) -> Self {
        match confirm {
            Ok(c) => End::Answered(Answer::of(c)),
            Err(e) => {
                let close = Close::of(&e);
                let refusal = close.refusal(0);
                End::Closed(close.text, refusal)
            }
        }
    }
}

/// A returned message's message_id, with the broker's reason.
fn returned_entry(r: lapin::message::BasicReturnMessage) -> Option<(String, String)> {
    let id = r.properties.message_id().as_ref()?.to_string();
    Some((id, format!("{} {}", r.reply_code, r.reply_text)))
}

impl Close {
    /// The close lapin reports with `e`.
    fn of(e: &lapin::Error) -> Self {
        let soft = soft_error(e);
        Close {
            not_found: soft == Some(AMQPSoftError::NOTFOUND),
            access_refused: soft == Some(AMQPSoftError::ACCESSREFUSED),
            text: e.to_string(),
        }
    }
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
    fn an_outgoing_message_is_matched_by_its_id_and_builds_its_properties_once_and_again() {
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
        assert_eq!(m.message_id, "m");
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
}
