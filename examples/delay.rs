//! Publish a delayed message through timeoutd, or cancel one: the Rust twin of
//! `examples/delay.py`, whose docstring explains the headers.
//!
//! cargo run --example delay -- --delay-ms 3000 --routing-key orders.retry --body hello
//! cargo run --example delay -- --cancel MESSAGE_ID
//!
//! Prints the message_id it published. The AMQP URL is `--url`, else TIMEOUTD__AMQP__URL,
//! else the local guest. To watch deliveries: `python examples/delay.py --consume`.

use anyhow::{Context, bail};
use chrono::DateTime;
use clap::Parser;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};

#[derive(Parser)]
#[command(about = "Publish a delayed message through timeoutd, or cancel one")]
struct Args {
    #[arg(
        long,
        env = "TIMEOUTD__AMQP__URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    url: String,
    /// timeoutd's election.group: publishes to timeoutd.delay.<GROUP>.
    #[arg(long, default_value = "default")]
    group: String,
    /// x-delay: milliseconds to hold the message.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(i64).range(0..))]
    delay_ms: i64,
    /// x-timeoutd-deliver-at: an RFC 3339 instant (wins over --delay-ms).
    #[arg(long)]
    deliver_at: Option<String>,
    #[arg(long, default_value = "demo")]
    routing_key: String,
    #[arg(long, default_value = "hello")]
    body: String,
    /// x-timeoutd-exchange: deliver here instead of timeoutd.delayed (an exchange the
    /// daemons allow: delay.allowed_exchanges).
    #[arg(long)]
    exchange: Option<String>,
    /// Default: a random UUID.
    #[arg(long)]
    message_id: Option<String>,
    /// Cancel the pending message with this message_id instead of publishing one.
    #[arg(
        long,
        value_name = "MESSAGE_ID",
        conflicts_with_all = ["deliver_at", "exchange", "message_id"]
    )]
    cancel: Option<String>,
}

/// A string header, as a long string ('S'): RabbitMQ reads 's' as a 16-bit integer.
fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

/// A name or property of at most 255 bytes.
fn short(s: &str, what: &str) -> anyhow::Result<ShortString> {
    ShortString::try_new(s).map_err(|_| anyhow::anyhow!("{what} is longer than 255 bytes"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut headers = FieldTable::default();
    let message_id = if let Some(id) = &args.cancel {
        headers.insert("x-timeoutd-cancel".into(), text(id));
        id.clone()
    } else {
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(args.delay_ms));
        if let Some(at) = &args.deliver_at {
            DateTime::parse_from_rfc3339(at).context("--deliver-at is not RFC 3339")?;
            headers.insert("x-timeoutd-deliver-at".into(), text(at));
        }
        if let Some(exchange) = &args.exchange {
            headers.insert("x-timeoutd-exchange".into(), text(exchange));
        }
        args.message_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
    };
    let mut props = BasicProperties::default()
        .with_delivery_mode(2) // persistent
        .with_content_type("text/plain".into())
        .with_headers(headers);
    if args.cancel.is_none() {
        props = props.with_message_id(short(&message_id, "--message-id")?);
    }
    let ingress = format!("timeoutd.delay.{}", args.group);
    let exchange = short(&ingress, "--group")?;
    let routing_key = short(&args.routing_key, "--routing-key")?;

    let conn = Connection::connect(&args.url, ConnectionProperties::default())
        .await
        .context("cannot connect to the broker")?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    // The ingress queue is bound with '#': mandatory is not needed to notice anything.
    let confirmation = channel
        .basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions::default(),
            args.body.as_bytes(),
            props,
        )
        .await?
        .await
        .with_context(|| {
            format!("not accepted by {ingress}: is timeoutd running for this group?")
        })?;
    if !confirmation.is_ack() {
        bail!("the broker refused the message (nack)");
    }
    println!("{message_id}");
    conn.close(200, "done".into()).await?;
    Ok(())
}
