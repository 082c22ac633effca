//! The ingress task (every node, active or not): consume the group's delayed-message
//! queue, store what arrives in `delayed_messages`, acknowledge after the commit. A
//! message is acknowledged only once it is stored, so a crash between commit and ack
//! redelivers it and the unique `message_id` keeps it from being stored twice. A node
//! whose database is away holds its unacknowledged messages for a while, then gives
//! them back to the queue (for nodes that can store them) and stops consuming until
//! Postgres answers again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::bus::{Arrived, Bus, BusError, InTheWay, Ingress, IngressSpec};
use crate::config::Settings;
use crate::destinations::Destinations;
use crate::metrics::Metrics;
use crate::shutdown::sleep_or_stop;
use crate::status::{IngressStatus, Status};
use crate::store::{Bound, Held, Ingest, IngestOutcome, Quota, Store, StoreError, Stored, bounded};
use crate::telemetry::{Chain, LogLimiter};
use crate::wire::delayed::{self, Rules};

/// Closing the ingress channel is a courtesy (closing the connection returns the
/// unacknowledged messages too): never wait long for it.
const CLOSE_LIMIT: Duration = Duration::from_secs(1);

/// What the ingress task uses.
pub(crate) struct Intake {
    pub(crate) settings: Arc<Settings>,
    pub(crate) store: Store,
    pub(crate) bus: watch::Receiver<Option<Arc<Bus>>>,
    pub(crate) status: Arc<Status>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) stop: CancellationToken,
}

/// What arriving messages are judged by, and the log lines about them (one per kind
/// of result per [`LOG_EVERY`]: a flood of bad messages must not flood the log).
struct Judge {
    rules: Rules,
    quota: Quota,
    logs: Mutex<HashMap<&'static str, LogLimiter>>,
}

const LOG_EVERY: Duration = Duration::from_secs(10);

impl Judge {
    /// One warning about `n` messages with result `result`, unless one was logged less
    /// than [`LOG_EVERY`] ago.
    fn warn(&self, result: &'static str, n: u64, what: &str) {
        if n == 0 {
            return;
        }
        // Bookkeeping only: a panicking holder left nothing half-done.
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        let limiter = logs
            .entry(result)
            .or_insert_with(|| LogLimiter::new(LOG_EVERY));
        if let Some(suppressed) = limiter.allow(Instant::now()) {
            tracing::warn!(result, n, suppressed_logs = suppressed, "{what}");
        }
    }
}

/// A stored batch: the messages to reject, then the tag that acknowledges the rest
/// (`None`: every one was rejected).
struct Taken {
    last: Option<u64>,
    reject: Vec<u64>,
}

/// Why consuming ended.
enum Ended {
    Stop,
    /// The channel or connection failed: wait for the node task's next connection.
    BusLost,
    /// Postgres did not take the batch in time: messages given back, wait for it.
    DatabaseAway,
}

impl Intake {
    fn spec(&self) -> IngressSpec {
        IngressSpec {
            name: self.settings.delay_exchange(),
            target_exchange: self.settings.delay.target_exchange.clone(),
            prefetch: self.settings.delay.prefetch,
        }
    }

    fn judge(&self) -> Judge {
        let delay = &self.settings.delay;
        let rules = Rules::of(&self.settings).unwrap_or_else(|e| {
            tracing::error!(error = %e, "delayed messages will be stored held");
            Rules {
                destinations: Destinations::nowhere(),
                max_body: 0,
                max_delay: Duration::ZERO,
            }
        });
        Judge {
            rules,
            quota: Quota {
                messages: delay.max_pending_per_owner,
                bytes: delay.max_bytes_per_owner.as_u64(),
            },
            logs: Mutex::default(),
        }
    }

    fn set_consuming(&self, consuming: bool, error: Option<String>) {
        self.metrics.set_ingress_consuming(consuming);
        self.status.update(|s| {
            let i = s.ingress.get_or_insert_with(IngressStatus::default);
            i.consuming = consuming;
            // Consuming again clears it: readiness must not name a cause long gone.
            if error.is_some() || consuming {
                i.last_error = error;
            }
        });
    }
}

/// Consume the ingress queue until stopped: with every broker connection the node task
/// makes, and again whenever the database is back.
pub(crate) async fn ingress_loop(ctx: Intake) {
    let spec = ctx.spec();
    ctx.status.update(|s| {
        s.ingress = Some(IngressStatus {
            queue: spec.name.clone(),
            ..IngressStatus::default()
        })
    });
    let mut bus_rx = ctx.bus.clone();
    let mut backoff = Backoff::new(ctx.settings.backoff.min, ctx.settings.backoff.max);
    // The failure last logged: the same one again (every retry) goes to debug.
    let mut reported: Option<String> = None;
    loop {
        let Some(bus) = next_bus(&mut bus_rx, &ctx.stop).await else {
            return;
        };
        let opened = tokio::select! {
            _ = ctx.stop.cancelled() => return,
            opened = bus.ingress(&spec) => opened,
        };
        let ended = match opened {
            Ok(ingress) => {
                tracing::info!(queue = %spec.name, "consuming delayed messages");
                reported = None;
                ctx.set_consuming(true, None);
                backoff.reset();
                consume(&ctx, ingress).await
            }
            Err(e) => {
                let why = Chain(&e).to_string();
                let in_the_way = e.in_the_way();
                if reported.as_ref() == Some(&why) {
                    tracing::debug!(queue = %spec.name, error = %why, "still cannot consume the delay ingress");
                } else if in_the_way.is_some() {
                    tracing::error!(queue = %spec.name, error = %why, "cannot consume the delay ingress (not ready until it can)");
                } else {
                    tracing::warn!(queue = %spec.name, error = %why, "cannot consume the delay ingress yet");
                }
                reported = Some(why.clone());
                ctx.set_consuming(false, Some(why));
                if let Some(what) = in_the_way
                    && wait_while_in_the_way(&ctx, &bus, &what).await
                {
                    backoff.reset();
                }
                Ended::BusLost
            }
        };
        ctx.set_consuming(false, None);
        match ended {
            Ended::Stop => return,
            Ended::BusLost => {}
            Ended::DatabaseAway => wait_for_database(&ctx).await,
        }
        if !sleep_or_stop(&ctx.stop, backoff.next_delay()).await {
            return;
        }
    }
}

/// While an exchange or queue is in the ingress's way, declaring it again fails the same
/// way: look whether it is gone (quietly, with the `backoff.*` delays), and declare again
/// once it is, or after `IN_THE_WAY_RETRY` × `backoff.max` at the latest (it may have
/// been replaced by one the ingress can use). True if it is gone.
async fn wait_while_in_the_way(ctx: &Intake, bus: &Bus, what: &InTheWay) -> bool {
    let (min, max) = (ctx.settings.backoff.min, ctx.settings.backoff.max);
    let mut backoff = Backoff::new(min, max);
    let until = Instant::now() + max * IN_THE_WAY_RETRY;
    while Instant::now() < until {
        if !sleep_or_stop(&ctx.stop, backoff.next_delay()).await {
            return false;
        }
        match bus.still_there(what).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(?what, "what was in the delay ingress's way is gone");
                return true;
            }
            Err(_) => return false,
        }
    }
    false
}

/// How many `backoff.max` at most before the ingress declares again all the same.
const IN_THE_WAY_RETRY: u32 = 6;

/// The node task's current connection, once there is a healthy one; `None` on stop.
async fn next_bus(
    rx: &mut watch::Receiver<Option<Arc<Bus>>>,
    stop: &CancellationToken,
) -> Option<Arc<Bus>> {
    loop {
        let current = rx.borrow_and_update().clone();
        if let Some(bus) = current.filter(|b| b.is_healthy()) {
            return Some(bus);
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            changed = rx.changed() => if changed.is_err() { return None },
            // A connection that broke without a new one published yet.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// What the consume loop waits for next.
enum Next {
    Batch(Result<Vec<Arrived>, BusError>),
    /// What settles the stored batch (`None`: it was empty).
    Stored(Result<Option<Taken>, Ended>),
}

/// Up to `delay.ingest_concurrency` batches are stored at once, so the broker keeps
/// delivering while one commits; they are acknowledged in arrival order (`multiple`
/// acknowledges every earlier delivery too), each once it and all before it are stored.
async fn consume(ctx: &Intake, mut ingress: Ingress) -> Ended {
    let judge = ctx.judge();
    let depth = usize::from(ctx.settings.delay.ingest_concurrency);
    let max = usize::from(ctx.settings.delay.prefetch).div_ceil(depth);
    let linger = ctx.settings.delay.ingest_linger;
    let mut storing = FuturesOrdered::new();
    let ended = loop {
        let next = tokio::select! {
            _ = ctx.stop.cancelled() => break Ended::Stop,
            batch = ingress.next_batch(max, linger), if storing.len() < depth => Next::Batch(batch),
            Some(stored) = storing.next() => Next::Stored(stored),
        };
        match next {
            Next::Batch(Ok(batch)) => storing.push_back(take_in(ctx, batch, &judge)),
            Next::Batch(Err(e)) => {
                tracing::warn!(error = %Chain(&e), "delay ingress lost its channel");
                break Ended::BusLost;
            }
            Next::Stored(Ok(None)) => {}
            Next::Stored(Ok(Some(taken))) => {
                if let Err(ended) = settle(&ingress, taken).await {
                    break ended;
                }
            }
            // Later batches cannot be acknowledged before this one: they return to the
            // queue with it, and what they stored is found stored on redelivery.
            Next::Stored(Err(ended)) => break ended,
        }
    };
    if matches!(ended, Ended::Stop) {
        // Batches being stored finish (each is bounded) and are acknowledged: a stop
        // should not cause redeliveries.
        while let Some(Ok(taken)) = storing.next().await {
            if let Some(taken) = taken
                && settle(&ingress, taken).await.is_err()
            {
                break;
            }
        }
    }
    ingress.close(CLOSE_LIMIT).await;
    ended
}

/// Store one batch: the delivery tag that acknowledges it, once stored (never tag 0,
/// which with `multiple` would acknowledge every delivery), and those of the messages
/// over their owner's quota, to reject.
async fn take_in(ctx: &Intake, batch: Vec<Arrived>, judge: &Judge) -> Result<Option<Taken>, Ended> {
    let arrived = Instant::now();
    if batch.is_empty() {
        return Ok(None);
    }
    let now = chrono::Utc::now();
    let mut tags: Vec<u64> = Vec::with_capacity(batch.len());
    let mut items: Vec<Ingest> = Vec::with_capacity(batch.len());
    let mut refused: Vec<u64> = Vec::new();
    for a in batch {
        match a.message {
            Ok(message) => {
                tags.push(a.tag);
                items.push(delayed::ingest(message, &judge.rules, now));
            }
            Err(r) => {
                refused.push(a.tag);
                ctx.metrics.ingress_refused(r.result);
                judge.warn(
                    r.result,
                    1,
                    &format!(
                        "a delayed message over the ingress's bounds rejected to the broker \
                         (dead-lettered if the ingress queue has a dead-letter policy, else \
                         dropped): {}",
                        r.why
                    ),
                );
            }
        }
    }
    if items.is_empty() {
        return Ok(Some(Taken {
            last: None,
            reject: refused,
        }));
    }
    let outcome = store(ctx, &items, judge.quota).await?;
    ctx.metrics.ingested(&outcome, arrived.elapsed());
    ctx.status.update(|s| {
        if let Some(i) = s.ingress.as_mut() {
            i.stored_total += outcome.stored;
        }
    });
    for bound in Bound::ALL {
        let what = match bound {
            Bound::BadInput => "delayed messages with bad input stored held",
            Bound::TooLate => "delayed messages due later than delay.max_delay stored held",
            Bound::TooLarge => {
                "delayed messages with a body over delay.max_body stored held, without the body"
            }
            Bound::NotAllowed => {
                "delayed messages naming an exchange not allowed for them stored held"
            }
        };
        let what = format!("{what} (see timeoutd pending --failing)");
        judge.warn(bound.result(), outcome.held[bound as usize], &what);
    }
    judge.warn(
        crate::metrics::OVER_QUOTA,
        outcome.over_quota.len() as u64,
        "delayed messages over their owner's delay.max_pending_per_owner or \
         delay.max_bytes_per_owner rejected to the broker (dead-lettered if the ingress \
         queue has a dead-letter policy, else dropped)",
    );
    let mut reject: Vec<u64> = outcome
        .over_quota
        .iter()
        .filter_map(|i| tags.get(*i).copied())
        .collect();
    reject.extend(refused);
    // A rejected tag is no longer the channel's to acknowledge: acknowledging it (even
    // as `multiple`'s upper end) would close the channel and return every delivery.
    let last = tags.iter().rev().copied().find(|t| !reject.contains(t));
    Ok(Some(Taken { last, reject }))
}

/// Reject what was over quota, then acknowledge the rest (`multiple` would acknowledge
/// the rejected ones too if it came first). Stored but not acknowledged is safe: the
/// redelivery finds its message_id stored.
async fn settle(ingress: &Ingress, taken: Taken) -> Result<(), Ended> {
    let lost = |e: BusError| {
        tracing::warn!(error = %Chain(&e), "cannot settle stored delayed messages");
        Ended::BusLost
    };
    for tag in taken.reject {
        ingress.reject(tag).await.map_err(lost)?;
    }
    match taken.last {
        Some(last) => ingress.ack_up_to(last).await.map_err(lost),
        None => Ok(()),
    }
}

/// Store a batch, retrying while the database is away for up to `election.member_ttl`
/// (the messages wait, unacknowledged). A batch the database refuses is stored message
/// by message, so one bad message never holds up the others.
async fn store(ctx: &Intake, items: &[Ingest], quota: Quota) -> Result<IngestOutcome, Ended> {
    let give_up = Instant::now() + ctx.settings.election.member_ttl;
    let mut backoff = Backoff::new(ctx.settings.backoff.min, ctx.settings.backoff.max);
    loop {
        match bounded(
            ctx.settings.db_bound(),
            ctx.store
                .ingest(items, ctx.settings.delay.cancel_ttl, quota),
        )
        .await
        {
            Ok(outcome) => return Ok(outcome),
            Err(StoreError::Db(sqlx::Error::Database(e))) if about_the_message(&*e) => {
                tracing::warn!(error = %e, "the database refused a batch of delayed messages: storing them one by one");
                return store_alone(ctx, items, quota).await;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %Chain(&e), retry_in = ?delay, "cannot store delayed messages yet");
                if Instant::now() + delay > give_up {
                    tracing::error!(
                        "database away: giving the delayed messages back to the queue and pausing the ingress"
                    );
                    return Err(Ended::DatabaseAway);
                }
                if !sleep_or_stop(&ctx.stop, delay).await {
                    return Err(Ended::Stop);
                }
            }
        }
    }
}

/// Whether the database refused this message as it is: a refusal blamed on the host or
/// the database being away (`store::Blame`) is retried with the messages
/// unacknowledged; only one about the statement is stored held.
fn about_the_message(e: &dyn sqlx::error::DatabaseError) -> bool {
    crate::store::blame_of(e) == crate::store::Blame::Statement
}

/// Each message in a transaction of its own; one the database refuses as it is is
/// stored held, with its body and the database's reason; one that cannot be stored at
/// all is logged and counted (the database refused even the plain row). When the
/// database is away meanwhile, the batch goes back to the queue unacknowledged (what
/// was stored of it is found by its message_id when it comes again).
async fn store_alone(ctx: &Intake, items: &[Ingest], quota: Quota) -> Result<IngestOutcome, Ended> {
    let mut total = IngestOutcome::default();
    for (i, item) in items.iter().enumerate() {
        let outcome = match bounded(
            ctx.settings.db_bound(),
            ctx.store.ingest(
                std::slice::from_ref(item),
                ctx.settings.delay.cancel_ttl,
                quota,
            ),
        )
        .await
        {
            Ok(o) => Ok(o),
            Err(StoreError::Db(sqlx::Error::Database(e))) if about_the_message(&*e) => match item {
                Ingest::Store(s) => {
                    let plain = Ingest::Store(Box::new(held_plain(s, &e.to_string())));
                    bounded(
                        ctx.settings.db_bound(),
                        ctx.store
                            .ingest(&[plain], ctx.settings.delay.cancel_ttl, quota),
                    )
                    .await
                }
                Ingest::Cancel { .. } => Err(StoreError::Db(sqlx::Error::Database(e))),
            },
            Err(e) => Err(e),
        };
        match outcome {
            Ok(o) => total = total.plus(o, i),
            Err(e) if !refused(&e) => {
                tracing::warn!(error = %Chain(&e), "cannot store delayed messages now: giving them back to the queue");
                return Err(Ended::DatabaseAway);
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), "a delayed message could not be stored at all: dropped");
                ctx.metrics.ingest_dropped();
            }
        }
    }
    Ok(total)
}

/// Whether the database refused this (rather than being away).
fn refused(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(sqlx::Error::Database(d)) if about_the_message(&**d))
}

/// A message the database would not take as it was: body and routing key kept, the
/// rest replaced by the reason, held for an operator.
fn held_plain(s: &Stored, why: &str) -> Stored {
    let id = uuid::Uuid::new_v4().to_string();
    Stored {
        owner: s.owner.clone(),
        message_id: id.clone(),
        due: s.due,
        exchange: s.exchange.clone(),
        routing_key: s.routing_key.clone(),
        properties: serde_json::json!({ "message_id": id }).to_string(),
        body: s.body.clone(),
        body_dropped: s.body_dropped,
        held: Some(Held {
            why: format!(
                "the database refused the message as published ({why}); its properties are lost"
            ),
            bound: Bound::BadInput,
        }),
    }
}

/// Until Postgres answers (or a stop).
async fn wait_for_database(ctx: &Intake) {
    let mut backoff = Backoff::new(ctx.settings.backoff.min, ctx.settings.backoff.max);
    while ctx
        .store
        .ping(ctx.settings.postgres.connect_timeout)
        .await
        .is_err()
    {
        if !sleep_or_stop(&ctx.stop, backoff.next_delay()).await {
            return;
        }
    }
}
