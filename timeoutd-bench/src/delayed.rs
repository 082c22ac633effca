//! Delayed messages (docs/integrating/delayed-messages.md): ingest throughput with one daemon, with
//! several, and of the broker alone; steady delivery lateness; a burst due at one
//! instant. Runs after the main daemon stopped: each part starts daemons of its own (same
//! schema and group) and, when done, stops them, deletes its queues and the group's
//! ingress queue and exchange (the next daemons declare them again), and empties
//! `delayed_messages`.

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel, ExchangeKind, PublisherConfirm};
use timeoutd::wire::delayed::{DELAY_HEADER, DELIVER_AT_HEADER};

use crate::prelude::*;
use crate::*;

/// `x-delay` of the ingest runs: nothing becomes due while they are measured.
pub(crate) const INGEST_DELAY_MS: i64 = 3_600_000;
/// `x-delay` of every message of the steady phase.
pub(crate) const DELAYED_STEADY_DELAY: Duration = Duration::from_millis(1500);
/// Publisher confirms outstanding at most (a sliding window: the oldest is awaited when
/// it is full).
pub(crate) const CONFIRM_WINDOW: usize = 1000;
pub(crate) const ROUTING_KEY: &str = "bench.delayed";
/// How often `delayed_messages` is counted while an ingest run waits for its rows (the
/// resolution of its clock).
const COUNT_EVERY: Duration = Duration::from_millis(20);
/// The same while a burst waits for its rows (only "before T0?" matters there).
const BURST_COUNT_EVERY: Duration = Duration::from_millis(100);
/// Time between the burst's rows all being stored (expected) and T0.
const BURST_SLACK: Duration = Duration::from_secs(3);
pub(crate) const START_LIMIT: Duration = Duration::from_secs(30);

/// The sizes of the delayed-message phases.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DelayedPlan {
    /// Messages per ingest run (broker baseline, 1 daemon, `nodes` daemons).
    pub(crate) ingest: usize,
    /// Daemons consuming the ingress in the second ingest run.
    pub(crate) nodes: usize,
    pub(crate) steady_secs: u64,
    pub(crate) rate: u32,
    pub(crate) burst: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Delayed {
    pub(crate) broker: BrokerBaseline,
    /// One daemon, then `nodes` daemons.
    pub(crate) ingest: Vec<IngestRun>,
    pub(crate) steady: DelayedSteady,
    pub(crate) burst: DelayedBurst,
    /// Warnings and errors the phases' daemons logged.
    pub(crate) daemon_warnings: usize,
    /// Daemons that did not stop cleanly after SIGTERM, and why.
    pub(crate) daemon_stop_errors: Vec<String>,
}

/// The publisher's and the broker's limit: the ingest runs' messages published with
/// confirms into a durable quorum queue that nobody consumes.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BrokerBaseline {
    pub(crate) msgs: usize,
    pub(crate) secs: f64,
    pub(crate) msgs_per_sec: f64,
    pub(crate) not_confirmed: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct IngestRun {
    pub(crate) nodes: usize,
    pub(crate) msgs: usize,
    /// First publish → last publisher confirm.
    pub(crate) confirmed_secs: f64,
    /// First publish → every message committed in `delayed_messages` (seen by a
    /// `count(*)` polled every 20 ms).
    pub(crate) stored_secs: f64,
    pub(crate) msgs_per_sec: f64,
    pub(crate) not_confirmed: usize,
    /// Rows in `delayed_messages` at the end.
    pub(crate) rows: i64,
    /// What the ingress of every daemon did, from their `/metrics` added up.
    pub(crate) daemon: IngestDelta,
    pub(crate) complete: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DelayedSteady {
    pub(crate) rate: u32,
    pub(crate) secs: u64,
    pub(crate) delay_ms: u64,
    pub(crate) msgs: usize,
    pub(crate) not_confirmed: usize,
    pub(crate) delivery: Delivery,
    /// Received before publish time + delay (a contract violation).
    pub(crate) early: usize,
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) mean_ms: f64,
    pub(crate) histogram: Vec<(String, usize)>,
    /// Delivery of the delayed kind, from `/metrics` (batches count every kind; only
    /// delayed messages are due here).
    pub(crate) daemon: ScanDelta,
    pub(crate) ingest: IngestDelta,
    pub(crate) left_in_table: i64,
    pub(crate) complete: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DelayedBurst {
    pub(crate) msgs: usize,
    pub(crate) not_confirmed: usize,
    /// First publish → all stored.
    pub(crate) stored_secs: f64,
    /// How long before T0 every message was stored (negative: after T0, and the clock
    /// then starts when they were).
    pub(crate) stored_before_t0_ms: f64,
    /// Milliseconds from T0 to the first and the last message received.
    pub(crate) first_ms: f64,
    pub(crate) last_ms: f64,
    /// Messages / (last − T0).
    pub(crate) msgs_per_sec: f64,
    /// Messages / (last − first).
    pub(crate) drain_msgs_per_sec: f64,
    pub(crate) delivery: Delivery,
    pub(crate) left_in_table: i64,
    pub(crate) daemon: ScanDelta,
    /// The daemon's peak RSS (VmHWM) after the burst, in MiB.
    pub(crate) peak_rss_mib: f64,
    pub(crate) complete: bool,
}

/// Warnings and unclean stops of the phases' daemons.
#[derive(Default)]
struct Tally {
    warnings: usize,
    stop_errors: Vec<String>,
}

impl Tally {
    async fn stop(&mut self, daemons: Vec<Daemon>) {
        for daemon in daemons {
            self.warnings += daemon.log.warnings.load(Ordering::Relaxed);
            if let Err(e) = daemon.stop().await {
                eprintln!("warning: {e:#}");
                self.stop_errors.push(format!("{e:#}"));
            }
        }
    }
}

/// Every delayed-message phase, in order (the main daemon stopped).
pub(crate) async fn delayed(env: &Env, plan: &DelayedPlan) -> Result<Delayed> {
    let mut tally = Tally::default();
    // Whatever a failed earlier run or the main daemon left: an empty ingress.
    end_part(env, &[]).await?;
    let broker = phase(
        "delayed: broker baseline (quorum queue)",
        broker_baseline(env, plan.ingest),
    )
    .await?;
    let mut ingest = Vec::new();
    let mut counts = vec![1, plan.nodes];
    counts.dedup();
    for nodes in counts {
        let name = match nodes {
            1 => "delayed: ingest, 1 daemon".to_owned(),
            n => format!("delayed: ingest, {n} daemons"),
        };
        let run = phase(&name, ingest_run(env, plan.ingest, nodes, &mut tally)).await?;
        ingest.push(run);
    }
    let steady = phase("delayed: steady", delayed_steady(env, plan, &mut tally)).await?;
    // The burst's T0 is set from the ingest rate of one daemon.
    let rate = ingest[0].msgs_per_sec.min(broker.msgs_per_sec);
    let burst = phase(
        "delayed: burst",
        delayed_burst(env, plan.burst, rate, &mut tally),
    )
    .await?;
    Ok(Delayed {
        broker,
        ingest,
        steady,
        burst,
        daemon_warnings: tally.warnings,
        daemon_stop_errors: tally.stop_errors,
    })
}

/// The phase's messages into a durable quorum queue of their own, nobody consuming.
async fn broker_baseline(env: &Env, n: usize) -> Result<BrokerBaseline> {
    let queue = quorum_queue(env);
    let channel = env.amqp.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let declare = channel.queue_declare(queue.as_str().into(), options, args);
    bounded("declare quorum queue", Duration::from_secs(10), declare).await??;
    let messages = messages(n, &When::DelayMs(INGEST_DELAY_MS));
    let mut publisher = Publisher::open(env).await?;
    let started = Instant::now();
    for m in &messages {
        publisher.publish("", &queue, m).await?;
    }
    let not_confirmed = publisher.flush().await?;
    let secs = started.elapsed().as_secs_f64();
    publisher.close().await;
    delete_queue(&env.amqp, &queue).await?;
    Ok(BrokerBaseline {
        msgs: n,
        secs,
        msgs_per_sec: n as f64 / secs,
        not_confirmed,
    })
}

/// `n` messages due in an hour into the ingress, `nodes` daemons consuming; the clock
/// runs from the first publish to the moment `delayed_messages` holds them all.
async fn ingest_run(env: &Env, n: usize, nodes: usize, tally: &mut Tally) -> Result<IngestRun> {
    let mut daemons = Vec::new();
    for _ in 0..nodes {
        daemons.push(Daemon::spawn(env)?);
    }
    for daemon in &mut daemons {
        daemon.wait_gauge(INGRESS_CONSUMING, START_LIMIT).await?;
    }
    let before = scrape_all(&mut daemons).await?;
    let messages = messages(n, &When::DelayMs(INGEST_DELAY_MS));
    let ingress = env.settings.delay_exchange();
    let mut publisher = Publisher::open(env).await?;
    let started = Instant::now();
    for m in &messages {
        publisher.publish(&ingress, ROUTING_KEY, m).await?;
    }
    let not_confirmed = publisher.flush().await?;
    let confirmed_secs = started.elapsed().as_secs_f64();
    publisher.close().await;
    let (rows, stored) = wait_stored(env, n, receive_limit(n), COUNT_EVERY).await?;
    let stored_secs = stored.map_or(f64::NAN, |(at, _)| (at - started).as_secs_f64());
    for daemon in &mut daemons {
        daemon.check_alive()?;
    }
    // The counter moves right after the commit the count already saw.
    let deadline = Instant::now() + SETTLE_LIMIT;
    let after = loop {
        let after = scrape_all(&mut daemons).await?;
        let counted = IngestDelta::between(&before, &after).stored;
        if counted >= rows.max(0) as u64 || Instant::now() >= deadline {
            break after;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tally.stop(daemons).await;
    end_part(env, &[]).await?;
    if stored.is_none() {
        eprintln!("   delayed ingest: only {rows} of {n} stored");
    }
    Ok(IngestRun {
        nodes,
        msgs: n,
        confirmed_secs,
        stored_secs,
        msgs_per_sec: n as f64 / stored_secs,
        not_confirmed,
        rows,
        daemon: IngestDelta::between(&before, &after),
        complete: stored.is_some(),
    })
}

/// `rate` messages/s for `steady_secs`, each with `x-delay` 1500 ms, published every
/// 10 ms; lateness = receipt − (publish + delay).
async fn delayed_steady(env: &Env, plan: &DelayedPlan, tally: &mut Tally) -> Result<DelayedSteady> {
    let mut daemon = start_delivering(env).await?;
    let queue = steady_queue(env);
    let inbox = Arc::new(Inbox::default());
    consume_target(env, &queue, inbox.clone()).await?;
    let before = daemon.scrape().await?;
    let total = plan.rate as usize * plan.steady_secs as usize;
    let delay = DELAYED_STEADY_DELAY;
    let delay_ms = i64::try_from(delay.as_millis())?;
    let messages = messages(total, &When::DelayMs(delay_ms));
    let wait = chrono::Duration::from_std(delay)?;
    let step = 1.0 / f64::from(plan.rate);
    let ingress = env.settings.delay_exchange();
    let mut publisher = Publisher::open(env).await?;
    let mut due = HashMap::with_capacity(total);
    let mut tick = tokio::time::interval(STEADY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut next = 0;
    while next < total {
        tick.tick().await;
        let elapsed = started.elapsed().as_secs_f64();
        while next < total && next as f64 * step <= elapsed {
            let m = &messages[next];
            let at = Utc::now();
            publisher.publish(&ingress, ROUTING_KEY, m).await?;
            due.insert(m.id, at + wait);
            next += 1;
        }
    }
    let not_confirmed = publisher.flush().await?;
    publisher.close().await;
    let complete = inbox.wait_for(total, delay + Duration::from_secs(30)).await;
    daemon.check_alive()?;
    let got = inbox.take();
    let expected: HashSet<Uuid> = due.keys().copied().collect();
    let delivery = Delivery::check(&got, &expected);
    let after = settle_fired(&mut daemon, &before, delivery.distinct as u64).await?;
    let lateness = lateness_ms(&got, &due);
    let early = lateness.iter().filter(|l| **l < 0.0).count();
    let left_in_table = count_delayed(env).await?;
    tally.stop(vec![daemon]).await;
    end_part(env, &[queue]).await?;
    Ok(DelayedSteady {
        rate: plan.rate,
        secs: plan.steady_secs,
        delay_ms: delay_ms.unsigned_abs(),
        msgs: total,
        not_confirmed,
        delivery,
        early,
        p50_ms: percentile(&lateness, 50.0),
        p90_ms: percentile(&lateness, 90.0),
        p99_ms: percentile(&lateness, 99.0),
        max_ms: lateness.last().copied().unwrap_or(f64::NAN),
        mean_ms: lateness.iter().sum::<f64>() / lateness.len().max(1) as f64,
        histogram: histogram(&lateness),
        daemon: ScanDelta::of_kind(&before, &after, DELAYED_KIND),
        ingest: IngestDelta::between(&before, &after),
        left_in_table,
        complete,
    })
}

/// `n` messages all with `x-timeoutd-deliver-at` = T0, T0 set so that they are all
/// stored before it (at the ingest rate measured, with margin); the clock runs from T0
/// to the receipt of the last one.
async fn delayed_burst(
    env: &Env,
    n: usize,
    ingest_rate: f64,
    tally: &mut Tally,
) -> Result<DelayedBurst> {
    let mut daemon = start_delivering(env).await?;
    let queue = burst_queue(env);
    let inbox = Arc::new(Inbox::default());
    consume_target(env, &queue, inbox.clone()).await?;
    let before = daemon.scrape().await?;
    let rate = if ingest_rate.is_finite() && ingest_rate > 0.0 {
        ingest_rate
    } else {
        1000.0
    };
    let lead = Duration::from_secs_f64(n as f64 / rate * 1.5) + BURST_SLACK;
    let t0 = (Utc::now() + chrono::Duration::from_std(lead)?).trunc_subsecs(6);
    let at = t0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let messages = messages(n, &When::At(at));
    let ingress = env.settings.delay_exchange();
    let mut publisher = Publisher::open(env).await?;
    let started = Instant::now();
    for m in &messages {
        publisher.publish(&ingress, ROUTING_KEY, m).await?;
    }
    let not_confirmed = publisher.flush().await?;
    publisher.close().await;
    let limit = lead + receive_limit(n);
    let (_, stored) = wait_stored(env, n, limit, BURST_COUNT_EVERY).await?;
    let stored_at = stored.map_or_else(Utc::now, |(_, at)| at);
    let stored_secs = stored.map_or(f64::NAN, |(at, _)| (at - started).as_secs_f64());
    let start = t0.max(stored_at);
    if start > t0 {
        eprintln!("   delayed burst: not all stored before T0; the clock starts when they were");
    }
    env.burst_hook("start", daemon.pid);
    let complete = inbox.wait_for(n, limit).await;
    env.burst_hook("stop", daemon.pid);
    daemon.check_alive()?;
    let got = inbox.take();
    let expected: HashSet<Uuid> = messages.iter().map(|m| m.id).collect();
    let arrival = Arrival::of(&got, &expected, start);
    let delivery = arrival.delivery;
    let after = settle_fired(&mut daemon, &before, delivery.distinct as u64).await?;
    let peak = daemon.memory()?;
    let scan = ScanDelta::of_kind(&before, &after, DELAYED_KIND);
    let left_in_table = count_delayed(env).await?;
    tally.stop(vec![daemon]).await;
    end_part(env, &[queue]).await?;
    Ok(DelayedBurst {
        msgs: n,
        not_confirmed,
        stored_secs,
        stored_before_t0_ms: ms(t0 - stored_at),
        first_ms: arrival.first_ms,
        last_ms: arrival.last_ms,
        msgs_per_sec: arrival.per_sec,
        drain_msgs_per_sec: arrival.drain_per_sec,
        delivery,
        left_in_table,
        daemon: scan,
        peak_rss_mib: peak.hwm as f64 / MIB,
        complete,
    })
}

/// The label of delayed messages in the daemon's `kind` series.
pub(crate) const DELAYED_KIND: &str = "delayed";

/// One daemon, active and consuming the ingress.
async fn start_delivering(env: &Env) -> Result<Daemon> {
    let mut daemon = Daemon::start(env).await?;
    daemon.wait_gauge(INGRESS_CONSUMING, START_LIMIT).await?;
    Ok(daemon)
}

/// Scrape until the daemon counts `fired` more delayed messages than in `before`, for at
/// most `SETTLE_LIMIT` (it counts a batch once it commits).
pub(crate) async fn settle_fired(
    daemon: &mut Daemon,
    before: &Scrape,
    fired: u64,
) -> Result<Scrape> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    loop {
        let now = daemon.scrape().await?;
        let counted = ScanDelta::of_kind(before, &now, DELAYED_KIND).fired;
        if counted >= fired || Instant::now() >= deadline {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every daemon's `/metrics`, as one.
async fn scrape_all(daemons: &mut [Daemon]) -> Result<Scrape> {
    let mut scrapes = Vec::with_capacity(daemons.len());
    for daemon in daemons {
        scrapes.push(daemon.scrape().await?);
    }
    Ok(Scrape::merged(&scrapes))
}

pub(crate) async fn count_delayed(env: &Env) -> Result<i64> {
    let sql = format!("SELECT count(*) FROM {}.delayed_messages", env.schema);
    Ok(sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&env.pool)
        .await?)
}

/// Count `delayed_messages` every `every` until it holds `n` rows: the last count and,
/// once reached, when (the end of that count's query).
async fn wait_stored(
    env: &Env,
    n: usize,
    limit: Duration,
    every: Duration,
) -> Result<(i64, Option<(Instant, DateTime<Utc>)>)> {
    let deadline = Instant::now() + limit;
    let n = i64::try_from(n)?;
    loop {
        let rows = count_delayed(env).await?;
        if rows >= n {
            return Ok((rows, Some((Instant::now(), Utc::now()))));
        }
        if Instant::now() >= deadline {
            return Ok((rows, None));
        }
        tokio::time::sleep(every).await;
    }
}

/// When a message is due.
pub(crate) enum When {
    /// `x-delay`, milliseconds.
    DelayMs(i64),
    /// `x-timeoutd-deliver-at`, RFC 3339.
    At(String),
}

/// One message as a publisher of delayed messages sends it.
pub(crate) struct Outgoing {
    pub(crate) id: Uuid,
    pub(crate) properties: BasicProperties,
    pub(crate) body: Vec<u8>,
}

/// Persistent JSON messages with a uuid `message_id` (how the consumer knows them).
pub(crate) fn messages(n: usize, when: &When) -> Vec<Outgoing> {
    (0..n)
        .map(|k| {
            let id = Uuid::new_v4();
            let mut headers = FieldTable::default();
            match when {
                When::DelayMs(ms) => {
                    headers.insert(DELAY_HEADER.into(), AMQPValue::LongLongInt(*ms))
                }
                When::At(at) => headers.insert(
                    DELIVER_AT_HEADER.into(),
                    AMQPValue::LongString(at.as_str().into()),
                ),
            };
            let properties = BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_headers(headers);
            let body = serde_json::json!({ "k": k }).to_string().into_bytes();
            Outgoing {
                id,
                properties,
                body,
            }
        })
        .collect()
}

/// A connection of its own with confirms, `CONFIRM_WINDOW` confirms outstanding at most;
/// mandatory publishes (a returned message counts as not confirmed).
pub(crate) struct Publisher {
    conn: Connection,
    channel: Channel,
    in_flight: VecDeque<PublisherConfirm>,
    not_confirmed: usize,
}

impl Publisher {
    pub(crate) async fn open(env: &Env) -> Result<Self> {
        let (conn, channel) = crate::baselines::publisher(env).await?;
        Ok(Self {
            conn,
            channel,
            in_flight: VecDeque::with_capacity(CONFIRM_WINDOW + 1),
            not_confirmed: 0,
        })
    }

    pub(crate) async fn publish(&mut self, exchange: &str, key: &str, m: &Outgoing) -> Result<()> {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                key.into(),
                options,
                &m.body,
                m.properties.clone(),
            )
            .await?;
        self.in_flight.push_back(confirm);
        while self.in_flight.len() > CONFIRM_WINDOW {
            self.settle_oldest().await?;
        }
        Ok(())
    }

    async fn settle_oldest(&mut self) -> Result<()> {
        if let Some(confirm) = self.in_flight.pop_front() {
            let c = bounded("publisher confirm", Duration::from_secs(30), confirm).await??;
            if c.is_nack() || c.take_message().is_some() {
                self.not_confirmed += 1;
            }
        }
        Ok(())
    }

    /// Await every outstanding confirm; how many messages were not confirmed in all.
    pub(crate) async fn flush(&mut self) -> Result<usize> {
        while !self.in_flight.is_empty() {
            self.settle_oldest().await?;
        }
        Ok(self.not_confirmed)
    }

    pub(crate) async fn close(self) {
        let _ = bounded(
            "close",
            Duration::from_secs(5),
            self.conn.close(200, "done".into()),
        )
        .await;
    }
}

/// The run's target exchange, as the daemon would declare it (a durable topic exchange).
/// Declared before any daemon starts: the daemon looks for it with a passive declare,
/// which the broker answers for a missing exchange by closing the channel, and lapin
/// logs that as an error (counted among the daemon's warnings).
pub(crate) async fn declare_target(amqp: &Connection, target: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let declare = channel.exchange_declare(
        target.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    );
    bounded("declare target exchange", Duration::from_secs(5), declare).await??;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

/// A durable auto-delete queue bound with `#` to the run's target exchange, consumed
/// without acks into `inbox`.
pub(crate) async fn consume_target(env: &Env, queue: &str, inbox: Arc<Inbox>) -> Result<()> {
    let target = env.settings.delay.target_exchange.as_str();
    let consumer = declare_queue(&env.amqp, queue).await?;
    let channel = env.amqp.create_channel().await?;
    channel
        .queue_bind(
            queue.into(),
            target.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tokio::spawn(consume(consumer, inbox));
    Ok(())
}

pub(crate) fn quorum_queue(env: &Env) -> String {
    format!("{}-quorum", env.queue)
}

pub(crate) fn steady_queue(env: &Env) -> String {
    format!("{}-delayed-steady", env.queue)
}

pub(crate) fn burst_queue(env: &Env) -> String {
    format!("{}-delayed-burst", env.queue)
}

/// Every queue the delayed phases may declare (for the run's final cleanup).
pub(crate) fn delayed_queues(env: &Env) -> Vec<String> {
    vec![quorum_queue(env), steady_queue(env), burst_queue(env)]
}

/// The end of a part, its daemons stopped: its queues, the ingress queue and exchange
/// deleted (the target exchange stays until the run ends); `delayed_messages` emptied.
async fn end_part(env: &Env, queues: &[String]) -> Result<()> {
    delete_delayed_topology(env, queues, false).await;
    env.execute(format!("TRUNCATE {}.delayed_messages", env.schema))
        .await?;
    Ok(())
}

/// Delete `queues`, the group's ingress queue and exchange and, with `target`, the run's
/// target exchange; errors are printed. The ingress is deleted only when its name holds
/// the run's group (`delay.exchange` could name a shared one).
pub(crate) async fn delete_delayed_topology(env: &Env, queues: &[String], target: bool) {
    let ingress = env.settings.delay_exchange();
    let ours = ingress.contains(&env.group);
    let mut queues = queues.to_vec();
    if ours {
        queues.push(ingress.clone());
    }
    for queue in &queues {
        if let Err(e) = delete_queue(&env.amqp, queue).await {
            eprintln!("warning: could not delete queue {queue}: {e:#}");
        }
    }
    let mut exchanges = Vec::new();
    if target {
        exchanges.push(env.settings.delay.target_exchange.clone());
    }
    if ours {
        exchanges.push(ingress);
    }
    for exchange in &exchanges {
        if let Err(e) = delete_exchange(&env.amqp, exchange).await {
            eprintln!("warning: could not delete exchange {exchange}: {e:#}");
        }
    }
}

/// On a channel of its own: an error closes the channel.
pub(crate) async fn delete_queue(amqp: &Connection, queue: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let delete = channel.queue_delete(queue.into(), QueueDeleteOptions::default());
    bounded("queue delete", Duration::from_secs(5), delete).await??;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

async fn delete_exchange(amqp: &Connection, exchange: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let delete = channel.exchange_delete(exchange.into(), ExchangeDeleteOptions::default());
    bounded("exchange delete", Duration::from_secs(5), delete).await??;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Plan {
        let args = Args::parse_from(std::iter::once("timeoutd-bench").chain(args.iter().copied()));
        match Plan::from(&args) {
            Ok(p) => p,
            Err(e) => panic!("{e:#}"),
        }
    }

    #[test]
    fn delayed_sizes_default_follow_quick_and_burst_and_can_be_skipped() {
        let d = plan(&[])
            .delayed
            .map(|d| (d.ingest, d.nodes, d.steady_secs, d.rate, d.burst));
        assert_eq!(d, Some((20_000, 3, 10, 1000, 100_000)));
        let d = plan(&["--quick"])
            .delayed
            .map(|d| (d.ingest, d.steady_secs, d.burst));
        assert_eq!(d, Some((5_000, 3, 10_000)));
        let d = plan(&[
            "--burst",
            "7000",
            "--delayed-ingest",
            "2000",
            "--delayed-burst",
            "5000",
        ])
        .delayed
        .map(|d| (d.ingest, d.burst));
        assert_eq!(d, Some((2_000, 5_000)));
        assert!(plan(&["--no-delayed"]).delayed.is_none());
        let args = Args::parse_from(["timeoutd-bench", "--delayed-rate", "0"]);
        assert!(Plan::from(&args).is_err());
    }

    #[test]
    fn messages_are_persistent_with_an_id_and_their_due_header() {
        let header = |m: &Outgoing, name: &str| {
            m.properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(name).cloned())
        };
        let delayed = messages(2, &When::DelayMs(1500));
        assert_eq!(delayed.len(), 2);
        assert_ne!(delayed[0].id, delayed[1].id);
        let m = &delayed[1];
        assert_eq!(header(m, DELAY_HEADER), Some(AMQPValue::LongLongInt(1500)));
        assert_eq!(header(m, DELIVER_AT_HEADER), None);
        assert_eq!(*m.properties.delivery_mode(), Some(2));
        let id = m.properties.message_id().as_ref().map(|s| s.to_string());
        assert_eq!(id, Some(m.id.to_string()));
        assert_eq!(m.body, br#"{"k":1}"#.to_vec());
        let at = "2030-01-01T00:00:00.000000Z";
        let m = &messages(1, &When::At(at.to_owned()))[0];
        let expected = AMQPValue::LongString(at.into());
        assert_eq!(header(m, DELIVER_AT_HEADER), Some(expected));
        assert_eq!(header(m, DELAY_HEADER), None);
    }
}
