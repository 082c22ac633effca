//! Bursts in other shapes than the burst's (`--only-due-bursts`): the same N rows or
//! messages, one daemon, fired when the daemon cannot have looked ahead for them because
//! they are already due when they appear, or appear after their deadline one by one.
//! Each shape against the reference, N rows committed in one transaction 3 s before
//! their one deadline T0 (the burst's shape):
//!
//! - due now: one `INSERT … SELECT` with `timeout_at = now()`;
//! - due 1 µs apart: one statement, `timeout_at = now() + i µs`;
//! - due 1 s, 1 min, 1 h ago: one statement each, `now() - 1 s` and so on;
//! - single rows finishing late: N one-row transactions on four connections, all due at
//!   a T0 one second after the first begins, so that most commit after T0;
//! - delayed messages, `x-delay: 0` and `x-timeoutd-deliver-at` a second before the
//!   first publish: N published with confirms into the group's ingress;
//! - after a takeover (unless `--due-bursts-takeover false`): due now, and delayed with
//!   `x-delay: 0`, each on a group of its own of [`GROUP_SIZE`] daemons (the run's group,
//!   the one daemon stopped by then): once every node's `/status` agrees on one active
//!   node and all are settled and consume the ingress, the active node is killed
//!   (SIGKILL); the shape is put in as soon as another node's `/status` says active, and
//!   timed on that node. The takeover itself is timed too: the kill → another active.
//!
//! The clock runs from the deadline, or from when the rows could be seen if that is
//! later (the commit, the last commit, the first publish: every row was due by then),
//! to the receipt of the last one. What a shape does to the daemon's pacer shows as the
//! ratio of its time to the reference's; for delayed messages that ratio counts from the
//! last publisher confirm (every message stored and due by then), as rows count from
//! their commit.

use crate::prelude::*;
use crate::*;

/// T0 of the single-row shape, after the first of its inserts begins.
const LATE_T0: Duration = Duration::from_secs(1);
/// Connections inserting the single-row shape's rows.
const SINGLE_ROW_WRITERS: usize = 4;
/// Waited after the last row arrived, for a second copy of any to arrive too.
const STRAGGLERS: Duration = Duration::from_millis(300);
/// Between shapes: the daemon idle again.
const PAUSE: Duration = Duration::from_secs(1);
/// A shape's time against the reference's, at most.
pub(crate) const DUE_RATIO_TARGET: f64 = 2.0;
/// Daemons in each group whose active node is killed before a shape.
const GROUP_SIZE: usize = 3;
/// How long a group may take to agree and settle, and a takeover to happen.
const GROUP_LIMIT: Duration = Duration::from_secs(60);
/// How often the group's `/status` is asked while waiting (the takeover's resolution).
const STATUS_EVERY: Duration = Duration::from_millis(20);

/// What `--only-due-bursts` shows.
pub(crate) const DUE_BURSTS: Alone<DueBursts> =
    Alone("due bursts", due_burst_lines, due_burst_measurements);

/// The reference shape's name.
pub(crate) const AHEAD: &str = "ahead";
/// The shapes also put in right after a takeover.
const DUE_NOW: &str = "due now";
const DELAYED_NOW: &str = "delayed, x-delay 0";
/// The one-statement shapes, the reference first: name, and when the rows are due (the
/// first `offset` seconds after the transaction's `now()`, each next `step` seconds
/// later).
const ONE_STATEMENT: [(&str, f64, f64); 6] = [
    (AHEAD, 3.0, 0.0),
    (DUE_NOW, 0.0, 0.0),
    ("due 1 µs apart", 0.0, 1e-6),
    ("due 1 s ago", -1.0, 0.0),
    ("due 1 min ago", -60.0, 0.0),
    ("due 1 h ago", -3600.0, 0.0),
];

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DueBursts {
    pub(crate) rows: usize,
    /// Daemons of each group killed into a takeover; `None`: no shapes after a takeover.
    pub(crate) takeover_group: Option<usize>,
    /// The reference ("ahead") first, the shapes after a takeover last.
    pub(crate) shapes: Vec<DueShape>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DueShape {
    pub(crate) name: String,
    pub(crate) rows: usize,
    #[serde(flatten)]
    pub(crate) put: Put,
    #[serde(flatten)]
    pub(crate) arrival: Arrival,
    /// `last_ms` over the reference's.
    pub(crate) vs_ahead: f64,
    /// Delayed messages: from the last publisher confirm to the last received (what the
    /// clock holds beyond the publishing itself).
    pub(crate) after_confirms_ms: Option<f64>,
    /// After a takeover: from the kill of the active node until another one's `/status`
    /// said active (the shape was put in right then).
    pub(crate) takeover_ms: Option<f64>,
    /// Rows (or delayed messages) left once the last arrived and the daemon counted them.
    pub(crate) left_in_table: i64,
    pub(crate) daemon: ScanDelta,
    pub(crate) complete: bool,
}

/// How a shape was put in, and where its clock starts.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Put {
    /// Where the clock starts: the (last) "deadline", the "commit", the "last commit" or
    /// the "first publish".
    pub(crate) clock: &'static str,
    /// How long after the last deadline the clock starts (the rows could not be seen
    /// before); `None` for delayed messages (due when stored).
    pub(crate) clock_after_due_ms: Option<f64>,
    /// Inserting the rows (or publishing the messages, confirms included).
    pub(crate) insert_secs: f64,
    /// Single rows: how many committed after their deadline.
    pub(crate) committed_late: Option<usize>,
    pub(crate) not_confirmed: usize,
    /// Delayed messages: the first publish → the last confirm.
    pub(crate) confirmed_ms: Option<f64>,
}

/// What a shape put in, and when its clock starts.
struct Inserted {
    expected: HashSet<Uuid>,
    start: DateTime<Utc>,
    put: Put,
}

/// Where a shape's rows live, and so how its TimeOuts are counted and received.
#[derive(Clone, Copy)]
enum Path<'a> {
    /// The run's table, fired to the run's queue.
    Table,
    /// `delayed_messages`, delivered to the target exchange, received into this inbox.
    Delayed(&'a Inbox),
}

/// Every shape in turn, with the one daemon; then, with `takeover`, that daemon stopped,
/// the shapes after a takeover.
pub(crate) async fn due_bursts(
    env: &Env,
    daemon: &mut Daemon,
    n: usize,
    takeover: bool,
) -> Result<DueBursts> {
    if !env.settings.delay.enabled {
        bail!("delay.enabled is false for the daemon (TIMEOUTD__DELAY__ENABLED?)");
    }
    let mut shapes = Vec::new();
    for (name, offset_secs, step_secs) in ONE_STATEMENT {
        let insert = one_statement(env, n, offset_secs, step_secs);
        shapes.push(shape(env, By::Settled(daemon), name, Path::Table, insert).await?);
    }
    let name = "single rows, finishing late";
    let insert = single_rows(env, n);
    shapes.push(shape(env, By::Settled(daemon), name, Path::Table, insert).await?);
    daemon.wait_gauge(INGRESS_CONSUMING, START_LIMIT).await?;
    let queue = burst_queue(env);
    let inbox = Arc::new(Inbox::default());
    consume_target(env, &queue, inbox.clone()).await?;
    let delayed = async {
        for (name, ago) in [
            (DELAYED_NOW, None),
            ("delayed, deliver-at 1 s ago", Some(Duration::from_secs(1))),
        ] {
            let insert = publish(env, n, ago);
            let path = Path::Delayed(&inbox);
            shapes.push(shape(env, By::Settled(daemon), name, path, insert).await?);
        }
        if takeover {
            // The group's nodes take the daemon's place: a node more would be a fourth.
            daemon.terminate().await?;
            let insert = one_statement(env, n, 0.0, 0.0);
            shapes.push(shape(env, By::Takeover, DUE_NOW, Path::Table, insert).await?);
            let insert = publish(env, n, None);
            let path = Path::Delayed(&inbox);
            shapes.push(shape(env, By::Takeover, DELAYED_NOW, path, insert).await?);
        }
        Ok::<_, anyhow::Error>(())
    };
    let outcome = delayed.await;
    if let Err(e) = delete_queue(&env.amqp, &queue).await {
        eprintln!("warning: could not delete queue {queue}: {e:#}");
    }
    outcome?;
    let reference = shapes[0].arrival.last_ms;
    for s in &mut shapes {
        // Delayed messages are judged from the last confirm, when every one was stored
        // and due, as rows are from their commit: before it, the clock counts the
        // publisher's pace, not the daemon's.
        s.vs_ahead = s.after_confirms_ms.unwrap_or(s.arrival.last_ms) / reference;
    }
    Ok(DueBursts {
        rows: n,
        takeover_group: takeover.then_some(GROUP_SIZE),
        shapes,
    })
}

/// Who fires a shape.
enum By<'d> {
    /// The one daemon, once it has been idle for a pause.
    Settled(&'d mut Daemon),
    /// The successor of a takeover in a group of [`GROUP_SIZE`] (see [`take_over`]),
    /// as soon as it says it is active; the survivors are stopped after.
    Takeover,
}

/// Insert (or publish) one shape and time its arrival.
async fn shape(
    env: &Env,
    by: By<'_>,
    name: &str,
    path: Path<'_>,
    insert: impl Future<Output = Result<Inserted>>,
) -> Result<DueShape> {
    let name = match by {
        By::Settled(_) => name.to_owned(),
        By::Takeover => format!("after a takeover, {name}"),
    };
    phase(&format!("due bursts: {name}"), async {
        path.ready(env).await?;
        if let By::Settled(daemon) = by {
            tokio::time::sleep(PAUSE).await;
            return timed(env, daemon, &name, path, insert).await;
        }
        let (mut survivors, successor, took) = take_over(env).await?;
        println!(
            "   kill -9 of the active node: another active after {:.0} ms",
            took.as_secs_f64() * 1e3
        );
        let mut shape = timed(env, &mut survivors[successor], &name, path, insert).await?;
        shape.takeover_ms = Some(took.as_secs_f64() * 1e3);
        for daemon in survivors {
            daemon.stop().await?;
        }
        Ok(shape)
    })
    .await
}

/// Spawn [`GROUP_SIZE`] daemons in the run's group, wait until they agree on one active
/// node, all settled and consuming the ingress, and after a pause kill the active one
/// (SIGKILL): the survivors, which of them said it was active first, and when (from the
/// kill).
async fn take_over(env: &Env) -> Result<(Vec<Daemon>, usize, Duration)> {
    let mut group = (0..GROUP_SIZE)
        .map(|_| Daemon::spawn(env))
        .collect::<Result<Vec<_>>>()?;
    let active = wait_status(&mut group, "one active node, all settled", settled_active).await?;
    for daemon in &mut group {
        daemon.wait_gauge(INGRESS_CONSUMING, START_LIMIT).await?;
    }
    tokio::time::sleep(PAUSE).await;
    let mut victim = group.remove(active);
    let killed = Instant::now();
    victim.child.start_kill()?;
    let _ = victim.child.wait().await;
    let successor = wait_status(&mut group, "another node active", first_active).await?;
    Ok((group, successor, killed.elapsed()))
}

/// The active node, once every node answers, names it, and is settled.
fn settled_active(all: &[Option<NodeStatus>]) -> Option<usize> {
    let active = agreed(all)?;
    let settled = all.iter().flatten().all(|s| s.settled);
    all.iter()
        .position(|s| settled && s.as_ref().is_some_and(|s| s.node_id == active))
}

/// The first node that says it is active, whatever the others say.
fn first_active(all: &[Option<NodeStatus>]) -> Option<usize> {
    all.iter()
        .position(|s| s.as_ref().is_some_and(|s| s.role == "active"))
}

/// Ask every daemon's `/status` every [`STATUS_EVERY`] until `found` picks one of them
/// (`what` it waits for, if it never does within [`GROUP_LIMIT`]).
async fn wait_status(
    group: &mut [Daemon],
    what: &str,
    found: impl Fn(&[Option<NodeStatus>]) -> Option<usize>,
) -> Result<usize> {
    let deadline = Instant::now() + GROUP_LIMIT;
    loop {
        for daemon in group.iter_mut() {
            daemon.check_alive()?;
        }
        let asked = group.iter().map(|d| node_status(d.http));
        let all = futures_util::future::join_all(asked).await;
        if let Some(i) = found(&all) {
            return Ok(i);
        }
        if Instant::now() >= deadline {
            bail!("the group: not {what} within {GROUP_LIMIT:?}; its /status: {all:?}");
        }
        tokio::time::sleep(STATUS_EVERY).await;
    }
}

impl Path<'_> {
    /// Before a shape: the table vacuumed (the last shape's dead rows gone).
    async fn ready(self, env: &Env) -> Result<()> {
        if let Path::Table = self {
            vacuum(env).await?;
        }
        Ok(())
    }
}

/// Insert (or publish) one shape at once and time its arrival, with `daemon` firing it.
async fn timed(
    env: &Env,
    daemon: &mut Daemon,
    name: &str,
    path: Path<'_>,
    insert: impl Future<Output = Result<Inserted>>,
) -> Result<DueShape> {
    let inbox = match path {
        Path::Table => &env.inbox,
        Path::Delayed(inbox) => inbox,
    };
    inbox.take();
    let before = daemon.scrape().await?;
    let inserted = insert.await?;
    let n = inserted.expected.len();
    let complete = inbox.wait_for(n, receive_limit(n)).await;
    daemon.check_alive()?;
    tokio::time::sleep(STRAGGLERS).await;
    let got = inbox.take();
    let arrival = Arrival::of(&got, &inserted.expected, inserted.start);
    let fired = arrival.delivery.distinct as u64;
    let (daemon, left_in_table) = match path {
        Path::Table => {
            let after = daemon.scrape_after(&before, fired, SETTLE_LIMIT).await?;
            (ScanDelta::between(&before, &after), env.count_rows().await?)
        }
        Path::Delayed(_) => {
            let after = settle_fired(daemon, &before, fired).await?;
            let delta = ScanDelta::of_kind(&before, &after, DELAYED_KIND);
            (delta, count_delayed(env).await?)
        }
    };
    Ok(DueShape {
        name: name.to_owned(),
        rows: n,
        after_confirms_ms: inserted.put.confirmed_ms.map(|c| arrival.last_ms - c),
        put: inserted.put,
        arrival,
        vs_ahead: f64::NAN,
        takeover_ms: None,
        left_in_table,
        daemon,
        complete,
    })
}

/// `n` rows in one statement of one transaction, the first due `offset_secs` after the
/// transaction's `now()`, each next `step_secs` later. The clock starts at the last row's
/// deadline, or at the commit if that is later.
async fn one_statement(env: &Env, n: usize, offset_secs: f64, step_secs: f64) -> Result<Inserted> {
    let ids = fresh_ids(n);
    let due = Deadline::Spaced {
        offset_secs,
        step_secs,
    };
    let started = Instant::now();
    let mut tx = env.pool.begin().await?;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await?;
    insert_due_in(&mut tx, &env.table(), &env.queue, &ids, due, n).await?;
    tx.commit().await?;
    let committed = Utc::now();
    let insert_secs = started.elapsed().as_secs_f64();
    let last = offset_secs + step_secs * n.saturating_sub(1) as f64;
    let last_due = now + chrono::Duration::microseconds((last * 1e6).round() as i64);
    Ok(Inserted {
        expected: ids.into_iter().collect(),
        start: last_due.max(committed),
        put: Put {
            clock: if last_due > committed {
                "deadline"
            } else {
                "commit"
            },
            clock_after_due_ms: Some(ms(committed - last_due).max(0.0)),
            insert_secs,
            committed_late: None,
            not_confirmed: 0,
            confirmed_ms: None,
        },
    })
}

/// `n` rows in as many transactions, one row each, on [`SINGLE_ROW_WRITERS`]
/// connections at once, all due at T0, [`LATE_T0`] after the first insert begins. The
/// clock starts at the last commit (its row was due by then), or at T0 if that is later.
async fn single_rows(env: &Env, n: usize) -> Result<Inserted> {
    let ids = fresh_ids(n);
    let table = env.table();
    let started = Instant::now();
    let t0 = (Utc::now() + chrono::Duration::from_std(LATE_T0)?).trunc_subsecs(6);
    let per_writer = n.div_ceil(SINGLE_ROW_WRITERS).max(1);
    let writers = ids.chunks(per_writer).map(|part| {
        let table = table.as_str();
        async move {
            let mut conn = env.pool.acquire().await?;
            let mut late = 0;
            for id in part {
                let one = std::slice::from_ref(id);
                insert_due(&mut conn, table, &env.queue, one, Deadline::At(Some(t0))).await?;
                late += usize::from(Utc::now() > t0);
            }
            Ok::<_, anyhow::Error>(late)
        }
    });
    let late = futures_util::future::try_join_all(writers).await?;
    let committed = Utc::now();
    Ok(Inserted {
        expected: ids.into_iter().collect(),
        start: t0.max(committed),
        put: Put {
            clock: "last commit",
            clock_after_due_ms: Some(ms(committed - t0).max(0.0)),
            insert_secs: started.elapsed().as_secs_f64(),
            committed_late: Some(late.into_iter().sum()),
            not_confirmed: 0,
            confirmed_ms: None,
        },
    })
}

/// `n` delayed messages published with confirms into the group's ingress: with
/// `x-delay: 0`, or (`ago`) with `x-timeoutd-deliver-at` that long before the first
/// publish. The clock starts at the first publish.
async fn publish(env: &Env, n: usize, ago: Option<Duration>) -> Result<Inserted> {
    let when = match ago {
        None => When::DelayMs(0),
        Some(ago) => When::At(
            (Utc::now() - chrono::Duration::from_std(ago)?)
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        ),
    };
    let messages = messages(n, &when);
    let ingress = env.settings.delay_exchange();
    let mut publisher = Publisher::open(env).await?;
    let start = Utc::now();
    let started = Instant::now();
    for m in &messages {
        publisher.publish(&ingress, ROUTING_KEY, m).await?;
    }
    let not_confirmed = publisher.flush().await?;
    let confirmed = Utc::now();
    let insert_secs = started.elapsed().as_secs_f64();
    publisher.close().await;
    Ok(Inserted {
        expected: messages.iter().map(|m| m.id).collect(),
        start,
        put: Put {
            clock: "first publish",
            clock_after_due_ms: None,
            insert_secs,
            committed_late: None,
            not_confirmed,
            confirmed_ms: Some(ms(confirmed - start)),
        },
    })
}

/// Two lines a shape: its time against the reference's, and the daemon's view.
pub(crate) fn due_burst_lines(d: &DueBursts) -> Vec<Line> {
    let mut lines = Vec::new();
    for s in &d.shapes {
        let a = &s.arrival;
        let exact = a.delivery.exact(s.rows) && s.left_in_table == 0 && s.put.not_confirmed == 0;
        let reference = s.name == AHEAD;
        let (target, pass) = if reference {
            ("= rows, 0 dup".to_owned(), exact)
        } else {
            let target = format!("≤ {DUE_RATIO_TARGET}× ahead, = rows, 0 dup");
            (target, exact && s.vs_ahead <= DUE_RATIO_TARGET)
        };
        let mut result = format!(
            "{} rows, the last {:.0} ms after the {}: {:.2}× ahead; the first at {:+.0} ms, \
             drain (first→last) {:.0}/s; {}",
            s.rows,
            a.last_ms,
            s.put.clock,
            s.vs_ahead,
            a.first_ms,
            a.drain_per_sec,
            delivery_text(&a.delivery, s.left_in_table)
        );
        if s.put.not_confirmed > 0 {
            result.push_str(&format!(", {} unconfirmed", s.put.not_confirmed));
        }
        lines.push(line(
            &format!("due bursts, {}: {} → last received", s.name, s.put.clock),
            result,
            &target,
            Some(pass),
        ));
        if let Some(took) = s.takeover_ms {
            lines.push(line(
                &format!(
                    "due bursts, {}: kill -9 of the active node → another active",
                    s.name
                ),
                format!("{took:.0} ms (its /status asked every {STATUS_EVERY:?})"),
                "",
                None,
            ));
        }
        let mut view = format!("inserted in {:.2} s", s.put.insert_secs);
        if let Some(after) = s.put.clock_after_due_ms {
            view.push_str(&format!(
                ", clock from {after:.0} ms after the last deadline"
            ));
        }
        if let Some(late) = s.put.committed_late {
            view.push_str(&format!(", {late} rows committed after T0"));
        }
        if let Some(after) = s.after_confirms_ms {
            view.push_str(&format!(
                ", the last received {after:.0} ms after the last confirm"
            ));
        }
        view.push_str(&format!("; {}", batches_text(&s.daemon)));
        lines.push(line(
            &format!("due bursts, {}: the daemon's view (/metrics)", s.name),
            view,
            "",
            None,
        ));
    }
    lines
}

pub(crate) fn due_burst_measurements(d: &DueBursts) -> Vec<Measurement> {
    let mut m = Vec::new();
    for s in &d.shapes {
        let name = |what: &str| format!("due bursts, {}: {what}", s.name);
        let a = &s.arrival;
        if let Some(took) = s.takeover_ms {
            m.push((name("kill -9 → another active"), "ms", took, None));
        }
        m.push((name("clock → last received"), "ms", a.last_ms, None));
        m.push((
            name("drain (first → last)"),
            "rows/s",
            a.drain_per_sec,
            None,
        ));
        if s.name != AHEAD {
            let target = Some(Want::AtMost(100.0 * DUE_RATIO_TARGET));
            m.push((name("last / ahead's last"), "%", 100.0 * s.vs_ahead, target));
        }
        if let Some(after) = s.after_confirms_ms {
            m.push((name("last confirm → last received"), "ms", after, None));
        }
        let wrong = a.delivery.duplicates + a.delivery.missing;
        m.push((
            name("duplicates + missing"),
            "rows",
            wrong as f64,
            Some(Want::AtMost(0.0)),
        ));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u128, role: &str, lowest: u128, settled: bool) -> Option<NodeStatus> {
        Some(NodeStatus {
            node_id: Uuid::from_u128(id),
            role: role.to_owned(),
            lowest: Uuid::from_u128(lowest),
            settled,
        })
    }

    #[test]
    fn the_group_is_settled_once_all_answer_agree_and_settled() {
        let settled = [
            node(2, "passive", 1, true),
            node(1, "active", 1, true),
            node(3, "passive", 1, true),
        ];
        assert_eq!(settled_active(&settled), Some(1));
        let mut probing = settled.clone();
        probing[2] = node(3, "passive", 1, false);
        assert_eq!(settled_active(&probing), None);
        let mut silent = settled.clone();
        silent[0] = None;
        assert_eq!(settled_active(&silent), None);
        let mut disagreeing = settled;
        disagreeing[2] = node(3, "passive", 3, true);
        assert_eq!(settled_active(&disagreeing), None);
    }

    #[test]
    fn the_successor_is_the_first_to_say_active() {
        assert_eq!(first_active(&[node(2, "passive", 1, true), None]), None);
        let took_over = [node(2, "passive", 1, true), node(3, "active", 3, true)];
        assert_eq!(first_active(&took_over), Some(1));
    }
}
