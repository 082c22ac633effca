//! RabbitMQ through lapin: connect, declare the announcement topology, announce, consume,
//! and publish TimeOuts with confirms. Every wait here is bounded by a configured timeout.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use tokio::sync::Mutex;
use tokio::time::timeout;

use crate::announcement::{Announcement, MESSAGE_TYPE};
use crate::config;

/// Heartbeat asked of the broker when the URL does not say: a dead peer is noticed in
/// about two intervals instead of the broker default of a minute.
const DEFAULT_HEARTBEAT_SECS: u16 = 5;
/// How long an exchange, once seen to exist, is trusted without asking again.
const EXCHANGE_CACHE_TTL: Duration = Duration::from_secs(30);
/// Bound on the announcement queue, so a stalled node cannot pile up a backlog.
const ANNOUNCE_QUEUE_MAX: i64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid amqp.url: {0}")]
    Url(String),
    #[error("cannot read amqp.ca_file {path}: {source}")]
    CaFile {
        path: String,
        source: std::io::Error,
    },
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("amqp: connection lost")]
    ConnectionLost,
    #[error("amqp: {what} timed out after {after:?}")]
    Timeout { what: &'static str, after: Duration },
}

/// Bound an AMQP operation by `after`.
async fn bounded<T>(
    what: &'static str,
    after: Duration,
    fut: impl Future<Output = lapin::Result<T>>,
) -> Result<T, BusError> {
    match timeout(after, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(BusError::Timeout { what, after }),
    }
}

/// One message to publish with a confirm.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub exchange: String,
    pub routing_key: String,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
}

/// Why one TimeOut was not confirmed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PublishError {
    #[error("exchange {0:?} does not exist")]
    NoExchange(String),
    #[error("unroutable: returned by the broker ({0})")]
    Returned(String),
    #[error("nacked by the broker")]
    Nacked,
    #[error("not confirmed within {0:?}")]
    ConfirmTimeout(Duration),
    #[error("invalid message: {0}")]
    Invalid(String),
    #[error("channel error: {0}")]
    Channel(String),
}

impl PublishError {
    /// Stable label for logs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            PublishError::NoExchange(_) => "no_exchange",
            PublishError::Returned(_) => "returned",
            PublishError::Nacked => "nacked",
            PublishError::ConfirmTimeout(_) => "confirm_timeout",
            PublishError::Invalid(_) => "invalid",
            PublishError::Channel(_) => "channel",
        }
    }
}

/// A connected bus: the announcement channel and queue, and a confirm-mode channel for
/// TimeOuts that is reopened when the broker closes it.
pub struct Bus {
    conn: Connection,
    announce: Channel,
    confirms: Mutex<Channel>,
    exchanges: Mutex<HashMap<String, Instant>>,
    settings: config::Amqp,
    group: String,
}

impl Bus {
    /// Connect and declare: durable topic exchange, exclusive auto-delete server-named
    /// queue bound with the group as routing key. Returns the bus and its consumer.
    pub async fn connect(
        settings: &config::Amqp,
        group: &str,
        name: &str,
    ) -> Result<(Self, Consumer), BusError> {
        let limit = settings.connect_timeout;
        let conn = match timeout(limit, open(settings, name)).await {
            Ok(conn) => conn?,
            Err(_) => {
                return Err(BusError::Timeout {
                    what: "connect",
                    after: limit,
                });
            }
        };
        let announce = bounded("open channel", limit, conn.create_channel()).await?;
        let consumer = declare(&announce, settings, group, limit).await?;
        let confirms = confirm_channel(&conn, limit).await?;
        let bus = Self {
            conn,
            announce,
            confirms: Mutex::new(confirms),
            exchanges: Mutex::new(HashMap::new()),
            settings: settings.clone(),
            group: group.to_owned(),
        };
        Ok((bus, consumer))
    }

    /// Connected and the announcement channel usable.
    pub fn is_healthy(&self) -> bool {
        self.conn.status().connected() && self.announce.status().connected()
    }

    /// Publish an announcement (no confirm: they are ephemeral and repeated).
    pub async fn announce(&self, a: &Announcement, ttl: Duration) -> Result<(), BusError> {
        let props = BasicProperties::default()
            .with_type(MESSAGE_TYPE.into())
            .with_content_type("application/json".into())
            .with_expiration(ttl.as_millis().to_string().into());
        let body = a.encode();
        let publish = self.announce.basic_publish(
            self.settings.announce_exchange.as_str().into(),
            self.group.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            props,
        );
        bounded("announce", self.settings.confirm_timeout, publish).await?;
        Ok(())
    }

    /// Publish all messages pipelined (mandatory, confirm mode), then await every
    /// confirm. One result per message, in order. Messages for exchanges that do not
    /// exist are refused before publishing, so they cannot close the channel under the
    /// rest of the batch.
    pub async fn publish_confirmed(
        &self,
        batch: &[Outgoing],
    ) -> Result<Vec<Result<(), PublishError>>, BusError> {
        let missing = self.missing_exchanges(batch).await?;
        let channel = self.confirm_channel().await?;
        let mut pending = Vec::with_capacity(batch.len());
        for msg in batch {
            if missing.contains(&msg.exchange) {
                pending.push(Err(PublishError::NoExchange(msg.exchange.clone())));
                continue;
            }
            pending.push(self.publish_one(&channel, msg).await);
        }
        let limit = self.settings.confirm_timeout;
        let results = join_all(pending.into_iter().map(|p| async move {
            match p {
                Ok(confirm) => await_confirm(confirm, limit).await,
                Err(e) => Err(e),
            }
        }))
        .await;
        if results
            .iter()
            .any(|r| matches!(r, Err(PublishError::Channel(_))))
        {
            // An exchange deleted since we checked: ask again next time.
            self.exchanges.lock().await.clear();
        }
        Ok(results)
    }

    async fn publish_one(
        &self,
        channel: &Channel,
        msg: &Outgoing,
    ) -> Result<lapin::PublisherConfirm, PublishError> {
        let exchange = short(&msg.exchange, "exchange")?;
        let routing_key = short(&msg.routing_key, "routing key")?;
        let publish = channel.basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            &msg.body,
            msg.properties.clone(),
        );
        match timeout(self.settings.confirm_timeout, publish).await {
            Ok(Ok(confirm)) => Ok(confirm),
            Ok(Err(e)) => Err(PublishError::Channel(e.to_string())),
            Err(_) => Err(PublishError::ConfirmTimeout(self.settings.confirm_timeout)),
        }
    }

    /// The confirm channel, reopened if the broker closed it (e.g. after a 404).
    async fn confirm_channel(&self) -> Result<Channel, BusError> {
        let mut guard = self.confirms.lock().await;
        if !guard.status().connected() {
            tracing::warn!("TimeOut channel was closed, reopening it");
            *guard = confirm_channel(&self.conn, self.settings.connect_timeout).await?;
        }
        Ok(guard.clone())
    }

    /// Exchanges of the batch that do not exist, checked with a passive declare on a
    /// throwaway channel (a failed passive declare closes its channel). Existing ones are
    /// cached for a while; the default exchange always exists.
    async fn missing_exchanges(&self, batch: &[Outgoing]) -> Result<Vec<String>, BusError> {
        let mut cache = self.exchanges.lock().await;
        let now = Instant::now();
        cache.retain(|_, seen| now.duration_since(*seen) < EXCHANGE_CACHE_TTL);
        let mut missing = Vec::new();
        for msg in batch {
            let name = &msg.exchange;
            if name.is_empty() || cache.contains_key(name) || missing.contains(name) {
                continue;
            }
            if self.exchange_exists(name).await? {
                cache.insert(name.clone(), now);
            } else {
                missing.push(name.clone());
            }
        }
        Ok(missing)
    }

    async fn exchange_exists(&self, name: &str) -> Result<bool, BusError> {
        let Ok(exchange) = ShortString::try_new(name) else {
            return Ok(false);
        };
        let limit = self.settings.connect_timeout;
        let channel = bounded("open channel", limit, self.conn.create_channel()).await?;
        let options = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declare = channel.exchange_declare(
            exchange,
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        );
        match timeout(limit, declare).await {
            Ok(Ok(())) => {
                let _ = channel.close(200, "OK".into()).await;
                Ok(true)
            }
            Ok(Err(e)) if is_not_found(&e) => Ok(false),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(BusError::Timeout {
                what: "exchange check",
                after: limit,
            }),
        }
    }

    /// Close the connection politely (bounded).
    pub async fn close(&self) {
        let close = self.conn.close(200, "shutting down".into());
        let _ = timeout(self.settings.connect_timeout, close).await;
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    e.to_string().contains("NOT_FOUND")
}

fn short(s: &str, what: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(s)
        .map_err(|_| PublishError::Invalid(format!("{what} longer than 255 bytes")))
}

async fn await_confirm(
    confirm: lapin::PublisherConfirm,
    limit: Duration,
) -> Result<(), PublishError> {
    match timeout(limit, confirm).await {
        Err(_) => Err(PublishError::ConfirmTimeout(limit)),
        Ok(Err(e)) => Err(PublishError::Channel(e.to_string())),
        Ok(Ok(c)) if c.is_nack() => Err(PublishError::Nacked),
        Ok(Ok(c)) => match c.take_message() {
            Some(returned) => Err(PublishError::Returned(format!(
                "{} {}",
                returned.reply_code, returned.reply_text
            ))),
            None => Ok(()),
        },
    }
}

/// Open the connection: URL parsed by lapin, heartbeat defaulted, TLS roots extended
/// with `ca_file` for amqps://.
async fn open(settings: &config::Amqp, name: &str) -> Result<Connection, BusError> {
    let mut uri = AMQPUri::from_str(&settings.url)
        .map_err(|e| BusError::Url(format!("{e}: {}", config::redact_url(&settings.url))))?;
    uri.query.heartbeat.get_or_insert(DEFAULT_HEARTBEAT_SECS);
    let tls = OwnedTLSConfig {
        identity: None,
        cert_chain: read_ca(settings)?,
    };
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let runtime = lapin::runtime::default_runtime()?;
    Ok(Connection::connect_uri_with_config(uri, props, tls, runtime).await?)
}

fn read_ca(settings: &config::Amqp) -> Result<Option<String>, BusError> {
    let Some(path) = &settings.ca_file else {
        return Ok(None);
    };
    std::fs::read_to_string(path)
        .map(Some)
        .map_err(|source| BusError::CaFile {
            path: path.display().to_string(),
            source,
        })
}

async fn declare(
    channel: &Channel,
    settings: &config::Amqp,
    group: &str,
    limit: Duration,
) -> Result<Consumer, BusError> {
    let exchange: ShortString = settings.announce_exchange.as_str().into();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let declare_exchange = channel.exchange_declare(
        exchange.clone(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    );
    bounded("declare exchange", limit, declare_exchange).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(ANNOUNCE_QUEUE_MAX),
    );
    let options = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    let queue = bounded(
        "declare queue",
        limit,
        channel.queue_declare("".into(), options, args),
    )
    .await?;
    let bind = channel.queue_bind(
        queue.name().clone(),
        exchange,
        group.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    );
    bounded("bind queue", limit, bind).await?;
    let options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    let consume = channel.basic_consume(
        queue.name().clone(),
        "".into(),
        options,
        FieldTable::default(),
    );
    bounded("consume", limit, consume).await
}

async fn confirm_channel(conn: &Connection, limit: Duration) -> Result<Channel, BusError> {
    let channel = bounded("open channel", limit, conn.create_channel()).await?;
    bounded(
        "confirm select",
        limit,
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    Ok(channel)
}

/// A header table with one long string, for `x-timeoutd-node`.
pub fn header(key: &str, value: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(key.into(), AMQPValue::LongString(LongString::from(value)));
    t
}
