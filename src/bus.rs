//! RabbitMQ through lapin: connect, declare the announcement topology, announce, consume,
//! and publish TimeOuts with confirms (`publish`; each message's fate is judged in
//! `fate`). Every wait here is bounded by a configured timeout.

mod convert;
mod fate;
mod frame;
mod ingress;
mod proof;
mod publish;

pub use convert::{lapin_properties, wire_properties};
pub use fate::{Fate, PublishError};
pub use frame::{
    HEADROOM, MAX_DELIVERIES, MAX_DEPTH as MAX_HEADER_DEPTH, MAX_VALUES as MAX_HEADER_VALUES,
    Refusal, header_frame_size,
};
pub use ingress::{Arrived, DELIVERY_LIMIT, InTheWay, Ingress, IngressSpec, OpenError};
pub use publish::{Budget, HANDED_OVER_TOGETHER, Published, ToPublish};

use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use tokio::time::timeout;

use crate::config;
use crate::wire::announcement::{Envelope, SIGNATURE_HEADER};

/// Heartbeat asked of the broker when the URL does not say: a dead peer is noticed in
/// about two intervals instead of the broker default of a minute.
const DEFAULT_HEARTBEAT_SECS: u16 = 5;
/// Idle confirm channels kept for the next batches.
const IDLE_CHANNELS: usize = 16;
/// Bound on the announcement queue, so a stalled node cannot pile up a backlog.
const ANNOUNCE_QUEUE_MAX: i64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid amqp.url: {0}")]
    Url(String),
    #[error("cannot read amqp.ca_file {path}")]
    CaFile {
        path: String,
        source: std::io::Error,
    },
    #[error("amqp")]
    Amqp(#[from] lapin::Error),
    #[error("amqp: connection lost")]
    ConnectionLost,
    #[error("amqp: {what} timed out after {after:?}")]
    Timeout { what: &'static str, after: Duration },
    #[error("amqp: none of the {0} addresses of amqp.url could be connected (each logged)")]
    NoAddress(usize),
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

/// A connected bus: the announcement channel and queue, and a pool of confirm-mode
/// channels for TimeOuts, one per batch in flight.
pub struct Bus {
    conn: Connection,
    announce: Channel,
    /// Confirm channels not in use by a batch.
    idle: Mutex<Vec<Channel>>,
    /// What the broker recently accepted from us (see `proof`).
    proofs: Mutex<proof::Proofs>,
    settings: config::Amqp,
    group: String,
    /// The broker user of `amqp.url`: our announcements' `user_id`.
    user: String,
    /// The URL (redacted) this connection was opened with.
    address: String,
}

/// The broker user `amqp.url` logs in as (lapin's default `guest` when it names none);
/// every URL of the list names the same one (see `config`).
pub fn broker_user(settings: &config::Amqp) -> Result<String, BusError> {
    let url = settings
        .url
        .first()
        .ok_or_else(|| BusError::Url("no URL".to_owned()))?;
    AMQPUri::from_str(url.expose())
        .map(|uri| uri.authority.userinfo.username)
        .map_err(|e| BusError::Url(format!("{e}: {}", url.redacted())))
}

/// The order in which the URLs of `amqp.url` are tried: a fresh random order at every
/// connect, as RabbitMQ's Java and .NET clients do, so that many daemons spread over a
/// cluster's nodes and none keeps returning to a node that is down.
fn address_order(settings: &config::Amqp) -> Vec<&config::SecretUrl> {
    use rand::seq::SliceRandom;
    let mut urls: Vec<_> = settings.url.iter().collect();
    urls.shuffle(&mut rand::rng());
    urls
}

impl Bus {
    /// Connect and declare: durable topic exchange, exclusive auto-delete server-named
    /// queue bound with the group as routing key. Returns the bus and its consumer.
    ///
    /// With several URLs each is tried in turn (see [`address_order`]), each bounded by
    /// `amqp.connect_timeout`; the first that connects and declares is used.
    pub async fn connect(
        settings: &config::Amqp,
        group: &str,
        name: &str,
    ) -> Result<(Self, Announcements), BusError> {
        let urls = address_order(settings);
        let tried = urls.len();
        if let [url] = urls.as_slice() {
            return Self::connect_to(url, settings, group, name).await;
        }
        for url in urls {
            match Self::connect_to(url, settings, group, name).await {
                Ok(connected) => return Ok(connected),
                Err(e) => tracing::warn!(
                    address = %url.redacted(),
                    error = %crate::telemetry::Chain(&e),
                    "cannot connect to this RabbitMQ address; trying the next"
                ),
            }
        }
        Err(BusError::NoAddress(tried))
    }

    async fn connect_to(
        url: &config::SecretUrl,
        settings: &config::Amqp,
        group: &str,
        name: &str,
    ) -> Result<(Self, Announcements), BusError> {
        let limit = settings.connect_timeout;
        let user = broker_user(settings)?;
        let conn = match timeout(limit, open(url, settings, name)).await {
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
        let bus = Self {
            conn,
            announce,
            idle: Mutex::new(Vec::new()),
            proofs: Mutex::new(proof::Proofs::default()),
            settings: settings.clone(),
            group: group.to_owned(),
            user,
            address: url.redacted(),
        };
        Ok((bus, Announcements { consumer }))
    }

    /// The URL (password redacted) of the broker this bus is connected to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The broker user this bus is connected as.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The largest body this bus may publish: `amqp.max_message_size`, or the broker's
    /// own limit once a refusal taught it (see `proof`).
    pub fn size_limit(&self) -> usize {
        fate::size_max(
            self.settings.max_message_size.as_u64(),
            self.proofs().limit(),
        )
    }

    /// The connection's negotiated `frame_max`: no content-header frame may be larger.
    pub fn frame_max(&self) -> u32 {
        self.conn.configuration().frame_max()
    }

    /// Connected and the announcement channel usable.
    pub fn is_healthy(&self) -> bool {
        self.conn.status().connected() && self.announce.status().connected()
    }

    /// Publish an announcement (no confirm: they are ephemeral and repeated), with its
    /// proof: `user_id` and signature as sealed (see `admission::seal`).
    pub async fn announce(&self, sealed: &Envelope, ttl: Duration) -> Result<(), BusError> {
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_expiration(ttl.as_millis().to_string().into());
        if let Some(kind) = &sealed.kind {
            props = props.with_type(kind.as_str().into());
        }
        if let Some(user) = &sealed.user_id {
            props = props.with_user_id(user.as_str().into());
        }
        if let Some(sig) = &sealed.signature {
            let mut headers = FieldTable::default();
            headers.insert(
                SIGNATURE_HEADER.into(),
                AMQPValue::LongString(sig.as_str().into()),
            );
            props = props.with_headers(headers);
        }
        let publish = self.announce.basic_publish(
            self.settings.announce_exchange.as_str().into(),
            self.group.as_str().into(),
            BasicPublishOptions::default(),
            &sealed.body,
            props,
        );
        bounded("announce", self.settings.confirm_timeout, publish).await?;
        Ok(())
    }

    /// A confirm channel of its own for one batch or pilot: an idle one from the pool,
    /// or a new one.
    async fn confirm_channel(&self) -> Result<Channel, BusError> {
        let idle = lock(&self.idle).pop();
        match idle {
            Some(c) if c.status().connected() => Ok(c),
            _ => confirm_channel(&self.conn, self.settings.connect_timeout).await,
        }
    }

    /// Whether a confirm channel can be had now (the publish check of a passive node).
    pub async fn check_publish(&self) -> Result<(), BusError> {
        let channel = self.confirm_channel().await?;
        self.give_back(channel);
        Ok(())
    }

    /// Return a channel whose every confirm has come in (nothing of its last batch can
    /// still arrive on it). Surplus channels are closed.
    fn give_back(&self, channel: Channel) {
        let mut idle = lock(&self.idle);
        if channel.status().connected() && idle.len() < IDLE_CHANNELS {
            idle.push(channel);
        } else {
            drop(idle);
            tokio::spawn(async move { channel.close(200, "OK".into()).await });
        }
    }

    fn proofs(&self) -> MutexGuard<'_, proof::Proofs> {
        lock(&self.proofs)
    }

    /// Close the connection politely (bounded): an error when the broker did not answer
    /// in time, or the connection was gone already.
    pub async fn close(&self) -> Result<(), BusError> {
        let close = self.conn.close(200, "shutting down".into());
        bounded("close", self.settings.connect_timeout, close).await
    }
}

/// Open the connection: URL parsed by lapin, heartbeat defaulted, TLS roots extended
/// with `ca_file` for amqps://.
async fn open(
    url: &config::SecretUrl,
    settings: &config::Amqp,
    name: &str,
) -> Result<Connection, BusError> {
    let mut uri = AMQPUri::from_str(url.expose())
        .map_err(|e| BusError::Url(format!("{e}: {}", url.redacted())))?;
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

/// The state behind these mutexes is a cache: a panicking holder cannot corrupt it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The group's announcements as they arrive, as plain envelopes (judged by
/// `admission`): nothing outside the bus sees lapin's deliveries.
pub struct Announcements {
    consumer: Consumer,
}

impl Announcements {
    /// The next delivery; `None` when the consumer ended (cancelled by the broker),
    /// `Some(Err)` when the connection failed.
    pub async fn next(&mut self) -> Option<Result<Envelope, BusError>> {
        let delivery = match self.consumer.next().await? {
            Ok(d) => d,
            Err(e) => return Some(Err(e.into())),
        };
        let p = &delivery.properties;
        let text = |s: &Option<ShortString>| s.as_ref().map(|s| s.as_str().to_owned());
        let signature =
            p.headers()
                .as_ref()
                .and_then(|h| match h.inner().get(SIGNATURE_HEADER)? {
                    AMQPValue::LongString(s) => {
                        Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                    }
                    AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
                    _ => None,
                });
        Some(Ok(Envelope {
            kind: text(p.kind()),
            user_id: text(p.user_id()),
            signature,
            body: delivery.data,
        }))
    }
}
