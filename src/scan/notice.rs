//! Postgres `NOTIFY` of new and moved due times (the trigger of migration 0005), on a
//! LISTEN connection of its own while the node is active, turned into [`Notice`]s for the
//! scan task's pacer. Every `scan.probe_interval` the listener asks its connection for a
//! round trip: one that stopped delivering without a word (half-open TCP) answers nothing
//! within the next interval (at least a second) and counts as lost, and what was written
//! meanwhile is looked for as after any other gap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch};

use super::Scan;
use super::checks::health_backoff;
use crate::health::Check;
use crate::kind::Kind;
use crate::shutdown::sleep_or_stop;
use crate::telemetry::Chain;

/// Notifications queued for the scan task; beyond this they are dropped and the task
/// looks at every kind instead.
pub(super) const NOTICES: usize = 1024;

/// A new or moved due time, from the trigger's `NOTIFY`: of which kind (`None`: any)
/// and when (`None`: unknown, look now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Notice {
    pub(super) kind: Option<Kind>,
    pub(super) due: Option<DateTime<Utc>>,
}

impl Notice {
    /// Look at every kind now: what changed is unknown.
    const ANY: Notice = Notice {
        kind: None,
        due: None,
    };
}

/// What the listener shares with the scan loop besides the notices themselves.
#[derive(Default)]
pub(super) struct NoticeState {
    /// Some notices were dropped (the queue was full).
    pub(super) lost: AtomicBool,
    /// The LISTEN connection is up: notices arrive.
    pub(super) listening: AtomicBool,
}

/// Notifications on their way to the scan loop.
pub(super) struct Notices {
    pub(super) rx: mpsc::Receiver<Notice>,
    pub(super) state: Arc<NoticeState>,
}

/// Forward the trigger's notifications to the scan loop; reconnect with backoff. After
/// every LISTEN it asks for one look at every kind: what was written before it (or in the
/// gap after a lost connection) was told to nobody.
pub(super) async fn listen(scan: Arc<Scan>, tx: mpsc::Sender<Notice>, notices: Arc<NoticeState>) {
    let mut backoff = health_backoff(&scan.settings);
    let send = |n: Notice| {
        if tx.try_send(n).is_err() {
            notices.lost.store(true, Ordering::Relaxed);
        }
    };
    // The stop closes the pool before it tells the tasks (see `daemon`), and a listener
    // ends with the pool: that is the stop, not a lost connection.
    let stopping = || scan.store.pool().is_closed();
    loop {
        let moves = scan.store.host_moves();
        let listening = scan.store.listener().await;
        if listening.is_err() && stopping() {
            return;
        }
        scan.health.record(Check::Listen, &listening);
        match listening {
            Ok(mut listener) => {
                backoff.reset();
                notices.listening.store(true, Ordering::Relaxed);
                send(Notice::ANY);
                let ended = forward(&scan, &mut listener, moves, &send).await;
                notices.listening.store(false, Ordering::Relaxed);
                match ended {
                    Listened::Moved => {
                        tracing::info!("the pool moved to another Postgres host: LISTEN there");
                        continue;
                    }
                    Listened::Stopped => return,
                    Listened::Lost(_) if stopping() => return,
                    Listened::Lost(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; probing every tick meanwhile");
                        scan.health.fail(Check::Listen, Instant::now());
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "cannot LISTEN; probing every tick meanwhile")
            }
        }
        if !sleep_or_stop(&scan.stop, backoff.next_delay()).await {
            return;
        }
    }
}

/// How a LISTEN session ended.
enum Listened {
    Stopped,
    /// The connection failed (why).
    Lost(String),
    /// The pool moved to another host: notices come from there now.
    Moved,
}

/// How long the LISTEN connection has to answer a round trip at the least: one that
/// takes longer under load is slow, not dead, and counting it lost costs a look at every
/// kind from the start of the due index.
const ANSWER_FLOOR: Duration = Duration::from_secs(1);

/// What woke the listener.
enum Woken {
    Notified(Result<Option<sqlx::postgres::PgNotification>, sqlx::Error>),
    /// Time to check that the connection still answers.
    Check,
}

/// Notifications of `listener` until it is lost (a round trip on it unanswered for
/// `scan.probe_interval`, at least [`ANSWER_FLOOR`], counts), the pool moves to another
/// host, or we stop.
async fn forward(
    scan: &Scan,
    listener: &mut sqlx::postgres::PgListener,
    moves: Option<watch::Receiver<u64>>,
    send: &impl Fn(Notice),
) -> Listened {
    let settings = &scan.settings;
    let every = settings.scan.probe_interval.max(settings.election.tick);
    let within = every.max(ANSWER_FLOOR);
    let mut check = tokio::time::interval(every);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let moved = async {
        let Some(mut moves) = moves else {
            return std::future::pending().await;
        };
        if moves.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(moved);
    loop {
        let woken = tokio::select! {
            _ = scan.stop.cancelled() => return Listened::Stopped,
            _ = &mut moved => return Listened::Moved,
            _ = check.tick() => Woken::Check,
            n = listener.try_recv() => Woken::Notified(n),
        };
        let next = match woken {
            Woken::Notified(n) => n,
            Woken::Check => {
                // A connection that stopped delivering without a word (half-open TCP, a
                // stalled proxy) answers nothing either; notifications that arrive
                // meanwhile wait in the listener's buffer.
                let again = scan.store.listen_statement();
                let asked = sqlx::raw_sql(sqlx::AssertSqlSafe(again)).execute(&mut *listener);
                match tokio::time::timeout(within, asked).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => return Listened::Lost(Chain(&e).to_string()),
                    Err(_) => {
                        return Listened::Lost(format!(
                            "no answer on the LISTEN connection within {within:?}"
                        ));
                    }
                }
            }
        };
        match next {
            Ok(Some(n)) => send(parse_notice(n.payload())),
            // sqlx would reconnect on the next call, but only a new LISTEN tells us when
            // it is back, and the look after it must come after it.
            Ok(None) => return Listened::Lost("the connection closed".to_owned()),
            Err(e) => return Listened::Lost(Chain(&e).to_string()),
        }
    }
}

/// The trigger's payload: `<kind>:<epoch micros>` (migration 0005), `<kind>:` for
/// 'infinity', `<kind>:-` for '-infinity' (migration 0010; read as an unknown due time:
/// look at the kind from the start); anything else asks to look at every kind now.
fn parse_notice(payload: &str) -> Notice {
    let Some((kind, micros)) = payload.split_once(':') else {
        return Notice::ANY;
    };
    let kind = Kind::parse(kind);
    match micros {
        // Infinite: a held or parked row, nothing to wake for.
        "" if kind.is_some() => Notice {
            kind,
            due: Some(DateTime::<Utc>::MAX_UTC),
        },
        _ => Notice {
            kind,
            due: micros
                .parse()
                .ok()
                .and_then(DateTime::from_timestamp_micros),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_names_its_kind_and_due_time_and_junk_asks_for_a_look_at_every_kind() {
        let n = parse_notice("expectation:1795341600000000");
        assert_eq!(n.kind, Some(Kind::Expectation));
        assert_eq!(
            n.due,
            DateTime::from_timestamp_micros(1_795_341_600_000_000)
        );
        let held = parse_notice("delayed:");
        assert_eq!(held.kind, Some(Kind::Delayed));
        assert_eq!(
            held.due,
            Some(DateTime::<Utc>::MAX_UTC),
            "infinite: nothing to wake for"
        );
        for junk in ["", "expectation", "other:12", "expectation:soon", ":"] {
            let n = parse_notice(junk);
            assert!(n.due.is_none() || n.kind.is_none(), "{junk:?}: {n:?}");
        }
        assert_eq!(parse_notice("nonsense"), Notice::ANY);
        let minus = parse_notice("expectation:-");
        assert_eq!(
            (minus.kind, minus.due),
            (Some(Kind::Expectation), None),
            "'-infinity': look at this kind from the start now"
        );
    }
}
