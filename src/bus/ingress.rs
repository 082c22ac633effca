//! The delayed-message ingress on the broker: the group's ingress exchange and durable
//! quorum queue, consumed with manual acks and a bounded prefetch. Deliveries leave here
//! as plain wire messages; they are acknowledged (all at once, `multiple`) only after
//! the caller stored them.

use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Consumer, ExchangeKind};
use tokio::time::timeout_at;

use super::convert::wire_properties;
use super::frame::{Refusal, judge};
use super::{Bus, BusError, bounded};
use crate::wire::Message;

/// Quorum queues of RabbitMQ 4 drop a message after 20 returned deliveries unless told
/// otherwise; a database outage must never cost a message that way. The ingress never
/// returns messages on purpose (it holds them until they are stored), so this many
/// returns (channel closes, node crashes) cannot be reached in practice.
pub const DELIVERY_LIMIT: i64 = 1_000_000;

/// Where the ingress consumes and where messages go by default.
#[derive(Debug, Clone)]
pub struct IngressSpec {
    /// The ingress exchange and queue (one name for both).
    pub name: String,
    pub target_exchange: String,
    pub prefetch: u16,
}

/// Why the ingress could not be opened. The broker's refusal of an exchange or queue
/// that exists already with another type or other arguments is told apart: it does
/// not go away by retrying, and the operator has to act (typically after moving off the
/// delayed-message plugin, whose exchange is not a topic exchange).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "the exchange {name} exists with another type than a durable topic exchange (the \
         delayed-message plugin's x-delayed-message?): delete it (its bindings go with it) \
         or set delay.exchange to another name; retrying until then"
    )]
    ExchangeExists {
        name: String,
        #[source]
        source: BusError,
    },
    #[error(
        "the queue {name} exists with other arguments than a durable quorum queue: move its \
         messages elsewhere and delete it, or set delay.exchange to another name; retrying \
         until then"
    )]
    QueueExists {
        name: String,
        #[source]
        source: BusError,
    },
    #[error(transparent)]
    Bus(#[from] BusError),
}

impl OpenError {
    /// What is in the way, when the broker refused what exists (an operator must act),
    /// rather than the connection or channel failing.
    pub fn in_the_way(&self) -> Option<InTheWay> {
        match self {
            Self::ExchangeExists { name, .. } => Some(InTheWay::Exchange(name.clone())),
            Self::QueueExists { name, .. } => Some(InTheWay::Queue(name.clone())),
            Self::Bus(_) => None,
        }
    }
}

/// An exchange or queue, of the ingress's name, that exists as the ingress cannot have it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InTheWay {
    Exchange(String),
    Queue(String),
}

/// A consuming ingress.
pub struct Ingress {
    channel: Channel,
    consumer: Consumer,
    /// Taken from the consumer for the next batch, and when the first of them was: kept
    /// here, not in [`Ingress::next_batch`]'s future, so that dropping that future (the
    /// caller's `select!`) loses no message.
    gathered: Vec<Arrived>,
    since: Option<Instant>,
    /// The connection's negotiated `frame_max`.
    frame_max: u32,
}

/// One arrived message and the tag that acknowledges it; or, for a message over the
/// bounds of `frame` (refused to the broker, never stored), why.
pub struct Arrived {
    pub tag: u64,
    pub message: Result<Message, Refusal>,
}

impl Bus {
    /// Declare the ingress topology and start consuming.
    pub async fn ingress(&self, spec: &IngressSpec) -> Result<Ingress, OpenError> {
        let limit = self.settings.connect_timeout;
        self.declare_target(&spec.target_exchange).await?;
        let channel = bounded("open channel", limit, self.conn.create_channel()).await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let declare = channel.exchange_declare(
            spec.name.as_str().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        );
        bounded("declare ingress exchange", limit, declare)
            .await
            .map_err(|e| match e {
                BusError::Amqp(ref a) if is_precondition_failed(a) => OpenError::ExchangeExists {
                    name: spec.name.clone(),
                    source: e,
                },
                e => e.into(),
            })?;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(DELIVERY_LIMIT),
        );
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let queue = channel.queue_declare(spec.name.as_str().into(), options, args);
        bounded("declare ingress queue", limit, queue)
            .await
            .map_err(|e| match e {
                BusError::Amqp(ref a) if is_precondition_failed(a) => OpenError::QueueExists {
                    name: spec.name.clone(),
                    source: e,
                },
                e => e.into(),
            })?;
        let bind = channel.queue_bind(
            spec.name.as_str().into(),
            spec.name.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        bounded("bind ingress queue", limit, bind).await?;
        let qos = channel.basic_qos(spec.prefetch, BasicQosOptions::default());
        bounded("qos", limit, qos).await?;
        let consume = channel.basic_consume(
            spec.name.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let consumer = bounded("consume ingress", limit, consume).await?;
        Ok(Ingress {
            channel,
            consumer,
            gathered: Vec::new(),
            since: None,
            frame_max: self.frame_max(),
        })
    }

    /// The default target exchange exists afterwards: declared as a durable topic
    /// exchange; one that exists already with another type (the operator's choice) is
    /// used as it is.
    async fn declare_target(&self, name: &str) -> Result<(), BusError> {
        let limit = self.settings.connect_timeout;
        let channel = bounded("open channel", limit, self.conn.create_channel()).await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let declare = channel.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        );
        match bounded("declare target exchange", limit, declare).await {
            Ok(()) => {
                let _ = channel.close(200, "OK".into()).await;
                Ok(())
            }
            Err(BusError::Amqp(e)) if is_precondition_failed(&e) => {
                tracing::info!(
                    exchange = name,
                    "the target exchange exists with another type: used as it is"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl Bus {
    /// Whether `what` still exists: a passive declare, which creates nothing and passes
    /// quietly for an exchange of any type or a queue with any arguments. The ingress
    /// asks this while something is in its way instead of declaring again, which the
    /// broker would refuse by closing the channel (and lapin log as an error) each time.
    pub async fn still_there(&self, what: &InTheWay) -> Result<bool, BusError> {
        let limit = self.settings.connect_timeout;
        let channel = bounded("open channel", limit, self.conn.create_channel()).await?;
        let checked = match what {
            InTheWay::Exchange(name) => {
                let passive = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                let declare = channel.exchange_declare(
                    name.as_str().into(),
                    ExchangeKind::Topic,
                    passive,
                    FieldTable::default(),
                );
                bounded("check exchange", limit, declare).await
            }
            InTheWay::Queue(name) => {
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                let declare =
                    channel.queue_declare(name.as_str().into(), passive, FieldTable::default());
                bounded("check queue", limit, declare).await.map(|_| ())
            }
        };
        match checked {
            Ok(()) => {
                let _ = channel.close(200, "OK".into()).await;
                Ok(true)
            }
            Err(BusError::Amqp(e)) if is_not_found(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(p)
            if p.kind() == &AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
    )
}

fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(p)
            if p.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    )
}

impl Ingress {
    /// The next messages: waits for one, then for more until `linger` after it, up to
    /// `max`. Cancel-safe: what was taken waits for the next call. `Err` when the
    /// channel or connection failed, or the broker cancelled us (the broker then
    /// redelivers every unacknowledged message).
    pub async fn next_batch(
        &mut self,
        max: usize,
        linger: Duration,
    ) -> Result<Vec<Arrived>, BusError> {
        while self.gathered.len() < max {
            let next = match self.since {
                None => self.consumer.next().await,
                Some(since) => match self.consumer.next().now_or_never() {
                    Some(next) => next,
                    None => match timeout_at((since + linger).into(), self.consumer.next()).await {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                },
            };
            let delivery = next.ok_or(BusError::ConnectionLost)??;
            self.since.get_or_insert_with(Instant::now);
            self.gathered.push(arrived(delivery, self.frame_max));
        }
        self.since = None;
        Ok(std::mem::take(&mut self.gathered))
    }

    /// Acknowledge every delivery up to and including `tag`.
    pub async fn ack_up_to(&self, tag: u64) -> Result<(), BusError> {
        let ack = self
            .channel
            .basic_ack(tag, BasicAckOptions { multiple: true });
        Ok(ack.await?)
    }

    /// Reject one delivery without requeueing it: the broker dead-letters it if the
    /// queue has a dead-letter exchange, else drops it.
    pub async fn reject(&self, tag: u64) -> Result<(), BusError> {
        let reject = self
            .channel
            .basic_reject(tag, BasicRejectOptions { requeue: false });
        Ok(reject.await?)
    }

    /// Stop consuming: deliveries not acknowledged go back to the queue, for the nodes
    /// that can store them. Bounded: a slow broker must not hold up a stop (closing the
    /// connection returns them too).
    pub async fn close(self, limit: std::time::Duration) {
        let _ = tokio::time::timeout(limit, self.channel.close(200, "OK".into())).await;
    }
}

/// A delivery as the ingress takes it: judged by its properties (see `frame`) before
/// they are converted.
fn arrived(d: lapin::message::Delivery, frame_max: u32) -> Arrived {
    let message = judge(&d.properties, frame_max, d.redelivered).map(|()| Message {
        exchange: d.exchange.as_str().to_owned(),
        routing_key: d.routing_key.as_str().to_owned(),
        properties: wire_properties(&d.properties),
        body: d.data,
    });
    Arrived {
        tag: d.delivery_tag,
        message,
    }
}
