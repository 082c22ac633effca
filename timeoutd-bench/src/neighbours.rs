//! Big neighbours: the lateness of ordinary rows while rows with payloads of hundreds of
//! kilobytes to megabytes come due among them (contract section 6: one row's fate never
//! depends on another's). The same steady load runs twice with one daemon: alone, then
//! with `big_rate` big rows a second due among its rows. The big rows go to a queue of
//! their own that keeps nothing (`x-max-length` 0: routed, confirmed, dropped), so the
//! consumer whose receipt times are measured never handles them: what differs between
//! the two cases is the daemon's work (reading, rendering and sending the big rows), the
//! broker's and the database's.

use crate::prelude::*;
use crate::*;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct BigNeighbours {
    /// The ordinary rows alone.
    pub(crate) alone: Steady,
    /// The same load with the big rows among it.
    pub(crate) beside: Steady,
    pub(crate) big: BigRows,
}

/// What was inserted of the big rows, and what became of them.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BigRows {
    pub(crate) rate: u32,
    pub(crate) min_bytes: usize,
    pub(crate) max_bytes: usize,
    pub(crate) inserted: usize,
    pub(crate) bytes: usize,
    /// Still in the table once the ordinary rows had all arrived and the daemon had
    /// counted them: not fired (failing, or not yet).
    pub(crate) left: i64,
}

pub(crate) async fn big_neighbours(
    env: &Env,
    daemon: &mut Daemon,
    plan: NeighboursPlan,
) -> Result<BigNeighbours> {
    let sink = format!("{}-big", env.queue);
    declare_sink(&env.amqp, &sink).await?;
    let outcome = async {
        let alone = steady(env, daemon, plan.rate, plan.secs).await?;
        let before = daemon.scrape().await?;
        let (rows, big) = tokio::try_join!(
            steady_rows(env, plan.rate, plan.secs),
            insert_big(env, &sink, plan),
        )?;
        daemon.check_alive()?;
        let after = daemon
            .scrape_after(&before, rows.delivery.distinct as u64, SETTLE_LIMIT)
            .await?;
        let sql = format!(
            "SELECT count(*) FROM {} WHERE routing_key = $1",
            env.table()
        );
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(&sink)
            .fetch_one(&env.pool)
            .await?;
        Ok(BigNeighbours {
            alone,
            beside: rows.measured(ScanDelta::between(&before, &after)),
            big: BigRows { left, ..big },
        })
    }
    .await;
    let channel = env.amqp.create_channel().await?;
    channel
        .queue_delete(sink.as_str().into(), QueueDeleteOptions::default())
        .await?;
    outcome
}

/// A queue that takes every message and keeps none.
async fn declare_sink(amqp: &Connection, queue: &str) -> Result<()> {
    let channel = amqp.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-max-length".into(),
        lapin::types::AMQPValue::LongLongInt(0),
    );
    let options = QueueDeclareOptions {
        auto_delete: false,
        ..QueueDeclareOptions::default()
    };
    channel.queue_declare(queue.into(), options, args).await?;
    Ok(())
}

/// `plan.big_rate` rows a second for `plan.secs`, each due [`STEADY_LEAD`] after its
/// insert as the ordinary rows are, with a payload of `min_bytes..max_bytes` letters
/// (pseudo-random, so that Postgres cannot compress them away).
async fn insert_big(env: &Env, sink: &str, plan: NeighboursPlan) -> Result<BigRows> {
    let total = plan.big_rate as usize * plan.secs as usize;
    let every = Duration::from_secs_f64(1.0 / f64::from(plan.big_rate));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut letters = Letters(0x9E37_79B9_7F4A_7C15);
    let sql = format!(
        "INSERT INTO {} (id, process_id, message_type, timeout_at, exchange, routing_key, \
         payload) VALUES ($1, 'big-' || $1, 'BenchBig', $2, '', $3, to_jsonb($4::text))",
        env.table()
    );
    let lead = chrono::Duration::from_std(STEADY_LEAD)?;
    let mut bytes = 0;
    for _ in 0..total {
        tick.tick().await;
        let size = plan.min_bytes + letters.below(plan.max_bytes - plan.min_bytes);
        let payload = letters.text(size);
        bytes += size;
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(Uuid::new_v4())
            .bind(Utc::now() + lead)
            .bind(sink)
            .bind(payload)
            .execute(&env.pool)
            .await?;
    }
    Ok(BigRows {
        rate: plan.big_rate,
        min_bytes: plan.min_bytes,
        max_bytes: plan.max_bytes,
        inserted: total,
        bytes,
        left: 0,
    })
}

/// xorshift64: payload letters and sizes, the same in every run.
struct Letters(u64);

impl Letters {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn text(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        (0..len)
            .map(|_| char::from(ALPHABET[self.below(ALPHABET.len())]))
            .collect()
    }
}

pub(crate) fn neighbours_lines(n: &BigNeighbours) -> Vec<Line> {
    let b = &n.big;
    let mut lines = Vec::new();
    for (case, s) in [("alone", &n.alone), ("beside big rows", &n.beside)] {
        let name = |what: &str| format!("big neighbours, steady {}/s {case}: {what}", s.rate);
        lines.push(line(
            &name("lateness p50 / p99 / max"),
            format!("{:.1} / {:.1} / {:.1} ms", s.p50_ms, s.p99_ms, s.max_ms),
            "",
            None,
        ));
        lines.push(line(
            &name("each row once, none early"),
            format!("{}; {} early", delivery_text(&s.delivery, 0), s.early),
            "= rows, 0 dup, 0 early",
            Some(s.delivery.exact(s.rows) && s.early == 0),
        ));
    }
    lines.push(line(
        "big neighbours: the big rows",
        format!(
            "{}/s, {} rows of {}–{} KiB ({:.1} MiB), {} not fired when the others were",
            b.rate,
            b.inserted,
            b.min_bytes / 1024,
            b.max_bytes / 1024,
            b.bytes as f64 / MIB,
            b.left
        ),
        "",
        None,
    ));
    lines
}

/// What `--only-big-neighbours` shows.
pub(crate) const BIG_NEIGHBOURS: Alone<BigNeighbours> =
    Alone("big neighbours", neighbours_lines, neighbours_measurements);

pub(crate) fn neighbours_measurements(n: &BigNeighbours) -> Vec<Measurement> {
    let mut m = Vec::new();
    for (case, s) in [("alone", &n.alone), ("beside big rows", &n.beside)] {
        let name = |what: &str| format!("big neighbours, {case}: lateness {what}");
        m.push((name("p50"), "ms", s.p50_ms, None));
        m.push((name("p99"), "ms", s.p99_ms, None));
        m.push((name("max"), "ms", s.max_ms, None));
    }
    m
}
