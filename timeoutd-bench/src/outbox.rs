//! The transactional outbox (`publish_at_commit`, docs/integrating/sql-api.md): how long
//! from an application's COMMIT to the message in a consumer's hands, with one active
//! daemon. One transaction per message on one connection (`BEGIN; SELECT
//! publish_at_commit(…); COMMIT`); the clock starts when COMMIT has returned (the
//! earliest the application knows its message will go) and stops at the consumer's
//! receipt, both on this machine's wall clock. Two cases: a steady stream (`rate`
//! transactions a second) and a burst (`burst` transactions back to back, as fast as
//! one connection commits them).

use crate::prelude::*;
use crate::*;

/// The outbox phase's sizes.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct OutboxPlan {
    pub(crate) msgs: usize,
    pub(crate) rate: u32,
    pub(crate) burst: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Outbox {
    pub(crate) steady: OutboxCase,
    pub(crate) burst: OutboxCase,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutboxCase {
    pub(crate) msgs: usize,
    /// Transactions a second asked (0: back to back) and achieved.
    pub(crate) rate: u32,
    pub(crate) achieved_per_sec: f64,
    /// COMMIT sent → returned, milliseconds (the application's own wait).
    pub(crate) commit_p50_ms: f64,
    pub(crate) delivery: Delivery,
    /// COMMIT returned → received, milliseconds.
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) histogram: Vec<(String, usize)>,
    pub(crate) left_in_table: i64,
    pub(crate) complete: bool,
}

/// The routing key of the outbox messages (the target exchange routes `#` to the queue).
const OUTBOX_KEY: &str = "bench.outbox";

pub(crate) async fn outbox(env: &Env, daemon: &mut Daemon, plan: OutboxPlan) -> Result<Outbox> {
    let queue = format!("{}-outbox", env.queue);
    let inbox = Arc::new(Inbox::default());
    consume_target(env, &queue, inbox.clone()).await?;
    let outcome = async {
        let steady = phase(
            "outbox: steady",
            outbox_case(env, daemon, &inbox, plan.msgs, plan.rate),
        )
        .await?;
        let burst = phase(
            "outbox: burst",
            outbox_case(env, daemon, &inbox, plan.burst, 0),
        )
        .await?;
        Ok(Outbox { steady, burst })
    }
    .await;
    if let Err(e) = delete_queue(&env.amqp, &queue).await {
        eprintln!("warning: could not delete queue {queue}: {e:#}");
    }
    outcome
}

/// `n` transactions, each publishing one message at commit, `rate` a second (0: back
/// to back); the latency of each from its COMMIT's return to its receipt.
async fn outbox_case(
    env: &Env,
    daemon: &mut Daemon,
    inbox: &Inbox,
    n: usize,
    rate: u32,
) -> Result<OutboxCase> {
    inbox.take();
    let mut conn = env.pool.acquire().await?;
    let sql = format!(
        "SELECT {}.publish_at_commit($1, $2, $3, '{{\"content_type\": \"application/json\"}}', $4)",
        env.schema
    );
    let target = env.settings.delay.target_exchange.clone();
    let mut committed = HashMap::with_capacity(n);
    let mut commit_ms = Vec::with_capacity(n);
    let step = if rate == 0 {
        0.0
    } else {
        1.0 / f64::from(rate)
    };
    let started = Instant::now();
    for k in 0..n {
        if rate > 0 {
            let due = started + Duration::from_secs_f64(k as f64 * step);
            tokio::time::sleep_until(due.into()).await;
        }
        let id = Uuid::new_v4();
        let body = serde_json::json!({ "k": k }).to_string().into_bytes();
        sqlx::query("BEGIN").execute(&mut *conn).await?;
        sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(&target)
            .bind(OUTBOX_KEY)
            .bind(body)
            .bind(id.to_string())
            .execute(&mut *conn)
            .await?;
        let sent = Instant::now();
        sqlx::query("COMMIT").execute(&mut *conn).await?;
        let at = Utc::now();
        commit_ms.push(sent.elapsed().as_secs_f64() * 1e3);
        committed.insert(id, at);
    }
    let achieved = n as f64 / started.elapsed().as_secs_f64();
    drop(conn);
    let complete = inbox.wait_for(n, Duration::from_secs(30)).await;
    daemon.check_alive()?;
    // A second copy would come right behind the first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = inbox.take();
    let expected: HashSet<Uuid> = committed.keys().copied().collect();
    let delivery = Delivery::check(&got, &expected);
    let mut latency: Vec<f64> = got
        .iter()
        .filter_map(|(id, at)| committed.get(id).map(|c| ms(*at - *c)))
        .collect();
    latency.sort_by(f64::total_cmp);
    commit_ms.sort_by(f64::total_cmp);
    Ok(OutboxCase {
        msgs: n,
        rate,
        achieved_per_sec: achieved,
        commit_p50_ms: percentile(&commit_ms, 50.0),
        delivery,
        p50_ms: percentile(&latency, 50.0),
        p90_ms: percentile(&latency, 90.0),
        p99_ms: percentile(&latency, 99.0),
        max_ms: latency.last().copied().unwrap_or(f64::NAN),
        histogram: histogram(&latency),
        left_in_table: count_delayed(env).await?,
        complete,
    })
}

fn case_name(c: &OutboxCase) -> String {
    match c.rate {
        0 => format!("outbox burst ({} back to back)", c.msgs),
        r => format!("outbox steady ({} at {r}/s)", c.msgs),
    }
}

pub(crate) fn outbox_lines(o: &Outbox) -> Vec<Line> {
    let mut lines = Vec::new();
    for c in [&o.steady, &o.burst] {
        let name = case_name(c);
        lines.push(line(
            &format!("{name}: commit → receipt p50 / p90 / p99 / max"),
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} ms",
                c.p50_ms, c.p90_ms, c.p99_ms, c.max_ms
            ),
            "p50 ≤ 20 ms",
            Some(c.p50_ms <= 20.0),
        ));
        lines.push(line(
            &format!("{name}: achieved, COMMIT p50"),
            format!("{:.0} tx/s, {:.2} ms", c.achieved_per_sec, c.commit_p50_ms),
            "",
            None,
        ));
        lines.push(line(
            &format!("{name}: each once"),
            delivery_text(&c.delivery, c.left_in_table),
            "= msgs, 0 dup, 0 left",
            Some(c.delivery.exact(c.msgs) && c.left_in_table == 0),
        ));
    }
    lines
}

/// What `--only-outbox` shows.
pub(crate) const OUTBOX: Alone<Outbox> = Alone("outbox", outbox_lines, outbox_measurements);

pub(crate) fn outbox_measurements(o: &Outbox) -> Vec<Measurement> {
    let mut m = Vec::new();
    for (case, c) in [("steady", &o.steady), ("burst", &o.burst)] {
        let name = |what: &str| format!("outbox {case}: commit → receipt {what}");
        m.push((name("p50"), "ms", c.p50_ms, Some(Want::AtMost(20.0))));
        m.push((name("p99"), "ms", c.p99_ms, None));
        m.push((name("max"), "ms", c.max_ms, None));
    }
    m
}
