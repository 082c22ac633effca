//! Print TimeOut messages and delayed messages as they arrive: a stand-in for a process
//! manager's handler.
//!
//! cargo run --example consume -- [QUEUE] [EXCHANGE] [BINDING_KEY]
//!
//! Declares the durable queue QUEUE (default `demo.timeouts`); with EXCHANGE, also a topic
//! exchange bound to the queue with BINDING_KEY (default `#`), e.g. `timeoutd.delayed`
//! for delayed messages. The AMQP URL comes from TIMEOUTD__AMQP__URL (default: local
//! guest). A delayed message's line ends with `delayed_ms=…`, the header
//! `x-timeoutd-delayed-ms` timeoutd adds.

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("TIMEOUTD__AMQP__URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let queue = args.first().map_or("demo.timeouts", String::as_str);
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await?;
    if let Some(exchange) = args.get(1) {
        let key = args.get(2).map_or("#", String::as_str);
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            queue.into(),
            exchange.as_str().into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    let opts = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    let mut consumer = ch
        .basic_consume(queue.into(), "".into(), opts, FieldTable::default())
        .await?;
    eprintln!("waiting for messages on queue {queue:?} (Ctrl-C to stop)");
    while let Some(delivery) = consumer.next().await {
        let d = delivery?;
        let p = &d.properties;
        let delayed_ms = p
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-timeoutd-delayed-ms"))
            .and_then(integer)
            .map(|ms| format!(" delayed_ms={ms}"))
            .unwrap_or_default();
        println!(
            "{} routing_key={} type={:?} message_id={:?} correlation_id={:?} body={}{}",
            chrono::Utc::now().to_rfc3339(),
            d.routing_key,
            p.kind().as_ref().map(|s| s.as_str()),
            p.message_id().as_ref().map(|s| s.as_str()),
            p.correlation_id().as_ref().map(|s| s.as_str()),
            String::from_utf8_lossy(&d.data),
            delayed_ms,
        );
    }
    Ok(())
}

/// An AMQP integer header, whatever its width.
fn integer(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}
