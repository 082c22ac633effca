//! The broker's real limit for TimeOuts on this machine: confirmed, mandatory, persistent
//! publishes routed to a durable queue, searched over channels × confirm window; and the
//! same best setting into a queue nobody consumes, to see what the consumer costs.

use crate::prelude::*;
use crate::*;

/// Channels (each on the publisher's one connection) × messages per confirm window.
const CHANNELS: [usize; 3] = [1, 2, 4];
const WINDOWS: [usize; 3] = [100, 500, 2000];
/// Messages per trial (at most): enough for a steady pace, short enough for nine trials.
const TRIAL: usize = 30_000;

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Trial {
    pub(crate) channels: usize,
    pub(crate) window: usize,
    pub(crate) msgs: usize,
    pub(crate) msgs_per_sec: f64,
    pub(crate) not_confirmed: usize,
    /// CPU of every process while it ran (publisher and consumer are this bench).
    pub(crate) cpu: CpuSpent,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PublishLimit {
    pub(crate) trials: Vec<Trial>,
    /// The best trial, consumer included: what the burst is judged against.
    pub(crate) best: Trial,
    /// The best setting again, into a durable queue nobody consumes (publish → last
    /// confirm).
    pub(crate) raw: Trial,
}

pub(crate) async fn publish_limit(env: &Env, n: usize) -> Result<PublishLimit> {
    let n = n.clamp(1, TRIAL);
    let mut trials = Vec::new();
    for channels in CHANNELS {
        for window in WINDOWS {
            trials.push(trial(env, n, channels, window, true).await?);
        }
    }
    let best = trials
        .iter()
        .copied()
        .max_by(|a, b| a.msgs_per_sec.total_cmp(&b.msgs_per_sec))
        .context("no trial")?;
    let raw = trial(env, n, best.channels, best.window, false).await?;
    Ok(PublishLimit { trials, best, raw })
}

/// `n` TimeOuts over `channels` channels in windows of `window`; `consumed`: into the
/// run's queue until the consumer has them all, else into a queue of its own nobody reads.
async fn trial(
    env: &Env,
    n: usize,
    channels: usize,
    window: usize,
    consumed: bool,
) -> Result<Trial> {
    let conn = connect_amqp(&env.amqp_url).await?;
    let queue = if consumed {
        env.queue.clone()
    } else {
        let q = format!("{}-raw", env.queue);
        let ch = conn.create_channel().await?;
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(q.as_str().into(), options, FieldTable::default())
            .await?;
        q
    };
    let messages = baseline_messages(&queue, n)?;
    let per = n.div_ceil(channels);
    let mut shares = Vec::new();
    for share in messages.chunks(per) {
        let channel = confirm_channel(&conn).await?;
        shares.push((channel, share.to_vec()));
    }
    env.inbox.take();
    let meter = CpuMeter::start();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (channel, share) in shares {
        tasks.push(tokio::spawn(async move {
            let mut failed = 0;
            for w in share.chunks(window) {
                failed += publish_window(&channel, w).await?;
            }
            anyhow::Ok(failed)
        }));
    }
    let mut not_confirmed = 0;
    for t in tasks {
        not_confirmed += t.await??;
    }
    if consumed {
        env.inbox.wait_for(n, receive_limit(n)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = meter.spent(secs);
    env.inbox.take();
    if !consumed {
        let ch = conn.create_channel().await?;
        ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    let _ = bounded(
        "close",
        Duration::from_secs(5),
        conn.close(200, "done".into()),
    )
    .await;
    Ok(Trial {
        channels,
        window,
        msgs: n,
        msgs_per_sec: n as f64 / secs,
        not_confirmed,
        cpu,
    })
}
