//! Postgres `NOTIFY` of new and moved due times (the trigger of migration 0005), on a
//! LISTEN connection of its own while the node is active, turned into [`Notice`]s for the
//! firing task's pacer. Every `scan.probe_interval` the listener asks its connection for a
//! round trip: one that stopped delivering without a word (half-open TCP) answers nothing
//! within the next interval (at least a second) and counts as lost, and what was written
//! meanwhile is looked for as after any other gap.
//!
//! Any role that may connect may `NOTIFY` the channel too, so what a notification can
//! cost is bounded: a payload that is not the trigger's is dropped (counted in
//! `timeoutd_notifications_dropped_total{reason="foreign"}`, logged once a minute); of
//! the trigger's, at most [`NOTICES_PER_SECOND`] a second reach
//! the pacer (each can start at most one batch). Past that, the rest of the second's are
//! dropped (`reason="flood"`) and the scan probes every tick instead, as while no LISTEN connection is up,
//! until a whole second passes under the bound; then it looks at every kind once, as
//! after any gap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch};

use super::Firing;
use super::checks::health_backoff;
use crate::health::Check;
use crate::kind::Kind;
use crate::shutdown::sleep_or_stop;
use crate::telemetry::{Chain, LogLimiter};

/// Notifications queued for the firing task; beyond this they are dropped and the task
/// looks at every kind instead.
pub(super) const NOTICES: usize = 1024;

/// The trigger's notifications passed on to the pacer in one second at most; more in a
/// second make the scan probe every tick instead, until a second passes under it.
pub(super) const NOTICES_PER_SECOND: u32 = 2000;

/// At most one log line a minute about payloads that are not the trigger's.
const FOREIGN_LOG_EVERY: Duration = Duration::from_secs(60);

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

/// What the listener shares with the firing task besides the notices themselves.
#[derive(Default)]
pub(super) struct NoticeState {
    /// Some notices were dropped (the queue was full).
    pub(super) lost: AtomicBool,
    /// The LISTEN connection is up: notices arrive.
    pub(super) listening: AtomicBool,
}

/// Notifications on their way to the firing task.
pub(super) struct Notices {
    pub(super) rx: mpsc::Receiver<Notice>,
    pub(super) state: Arc<NoticeState>,
}

/// Forward the trigger's notifications to the firing task; reconnect with backoff. After
/// every LISTEN it asks for one look at every kind: what was written before it (or in the
/// gap after a lost connection) was told to nobody.
pub(super) async fn listen(
    firing: Arc<Firing>,
    tx: mpsc::Sender<Notice>,
    notices: Arc<NoticeState>,
) {
    let mut backoff = health_backoff(&firing.settings);
    let send = |n: Notice| {
        if tx.try_send(n).is_err() {
            notices.lost.store(true, Ordering::Relaxed);
        }
    };
    // The stop closes the pool before it tells the tasks (see `daemon`), and a listener
    // ends with the pool: that is the stop, not a lost connection.
    let stopping = || firing.store.pool().is_closed();
    loop {
        let moves = firing.store.host_moves();
        let listening = firing.store.listener().await;
        if listening.is_err() && stopping() {
            return;
        }
        firing.health.record(Check::Listen, &listening);
        match listening {
            Ok(mut listener) => {
                backoff.reset();
                notices.listening.store(true, Ordering::Relaxed);
                send(Notice::ANY);
                let ended = forward(&firing, &mut listener, moves, &send, &notices).await;
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
                        firing.health.fail(Check::Listen, Instant::now());
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "cannot LISTEN; probing every tick meanwhile")
            }
        }
        if !sleep_or_stop(&firing.stop, backoff.next_delay()).await {
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
    firing: &Firing,
    listener: &mut sqlx::postgres::PgListener,
    moves: Option<watch::Receiver<u64>>,
    send: &impl Fn(Notice),
    notices: &NoticeState,
) -> Listened {
    let mut flood = Flood::new(Instant::now());
    let mut foreign = LogLimiter::new(FOREIGN_LOG_EVERY);
    let settings = &firing.settings;
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
            _ = firing.stop.cancelled() => return Listened::Stopped,
            _ = &mut moved => return Listened::Moved,
            _ = check.tick() => Woken::Check,
            n = listener.try_recv() => Woken::Notified(n),
        };
        let next = match woken {
            Woken::Notified(n) => n,
            Woken::Check => {
                if flood.quiet(Instant::now()) {
                    tracing::info!("the NOTIFY flood is over: notifications paced again");
                    notices.listening.store(true, Ordering::Relaxed);
                    send(Notice::ANY);
                }
                // A connection that stopped delivering without a word (half-open TCP, a
                // stalled proxy) answers nothing either; notifications that arrive
                // meanwhile wait in the listener's buffer.
                let again = firing.store.listen_statement();
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
            Ok(Some(n)) => {
                let Some(notice) = parse_notice(n.payload()) else {
                    firing.metrics.notification_dropped("foreign");
                    if let Some(suppressed) = foreign.allow(Instant::now()) {
                        tracing::warn!(
                            channel = n.channel(),
                            suppressed,
                            "dropped a notification that is not the trigger's (someone else \
                             notifies timeoutd's channel)"
                        );
                    }
                    continue;
                };
                match flood.take(Instant::now()) {
                    Take::Pass => send(notice),
                    Take::Drop => firing.metrics.notification_dropped("flood"),
                    Take::Flooded => {
                        firing.metrics.notification_dropped("flood");
                        tracing::warn!(
                            per_second = NOTICES_PER_SECOND,
                            "more notifications than the pacer takes: probing every tick \
                             instead until they calm down"
                        );
                        notices.listening.store(false, Ordering::Relaxed);
                    }
                    Take::Calm => {
                        tracing::info!("the NOTIFY flood is over: notifications paced again");
                        notices.listening.store(true, Ordering::Relaxed);
                        send(Notice::ANY);
                    }
                }
            }
            // sqlx would reconnect on the next call, but only a new LISTEN tells us when
            // it is back, and the look after it must come after it.
            Ok(None) => return Listened::Lost("the connection closed".to_owned()),
            Err(e) => return Listened::Lost(Chain(&e).to_string()),
        }
    }
}

/// What a notification does to the pacer's input.
#[derive(Debug, PartialEq, Eq)]
enum Take {
    /// Pass it on.
    Pass,
    /// Drop it: the second's bound is spent.
    Drop,
    /// Drop it: it spent the second's bound; probe every tick from now on.
    Flooded,
    /// Pass on a look at every kind instead: a whole second passed under the bound.
    Calm,
}

/// The trigger's notifications counted per second (from the first of each).
struct Flood {
    since: Instant,
    count: u32,
    flooded: bool,
}

impl Flood {
    const SECOND: Duration = Duration::from_secs(1);

    fn new(now: Instant) -> Self {
        Self {
            since: now,
            count: 0,
            flooded: false,
        }
    }

    /// One more notification at `now`.
    fn take(&mut self, now: Instant) -> Take {
        let calm = self.quiet(now);
        if now.saturating_duration_since(self.since) >= Self::SECOND {
            self.since = now;
            self.count = 0;
        }
        self.count = self.count.saturating_add(1);
        if calm {
            return Take::Calm;
        }
        if self.flooded {
            return Take::Drop;
        }
        if self.count > NOTICES_PER_SECOND {
            self.flooded = true;
            return Take::Flooded;
        }
        Take::Pass
    }

    /// Whether a flood ended: a whole second passed since this second began, within the
    /// bound (checked at each notification and every probe interval).
    fn quiet(&mut self, now: Instant) -> bool {
        let over = now.saturating_duration_since(self.since) >= Self::SECOND;
        if self.flooded && over && self.count <= NOTICES_PER_SECOND {
            self.flooded = false;
            return true;
        }
        if over && self.flooded {
            // Another flooded second: count the next one afresh.
            self.since = now;
            self.count = 0;
        }
        false
    }
}

/// The trigger's payload: `<kind>:<epoch micros>` (migration 0005), `<kind>:` for
/// 'infinity', `<kind>:-` for '-infinity' (migration 0010; read as an unknown due time:
/// look at the kind from the start). Anything else is not the trigger's: `None`.
fn parse_notice(payload: &str) -> Option<Notice> {
    let (kind, micros) = payload.split_once(':')?;
    let kind = Some(Kind::parse(kind)?);
    let due = match micros {
        // Infinite: a held or parked row, nothing to wake for.
        "" => Some(DateTime::<Utc>::MAX_UTC),
        "-" => None,
        _ => Some(DateTime::from_timestamp_micros(micros.parse().ok()?)?),
    };
    Some(Notice { kind, due })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_names_its_kind_and_due_time_and_junk_is_dropped() {
        let n = parse_notice("expectation:1795341600000000").expect("the trigger's");
        assert_eq!(n.kind, Some(Kind::Expectation));
        assert_eq!(
            n.due,
            DateTime::from_timestamp_micros(1_795_341_600_000_000)
        );
        let held = parse_notice("delayed:").expect("the trigger's");
        assert_eq!(held.kind, Some(Kind::Delayed));
        assert_eq!(
            held.due,
            Some(DateTime::<Utc>::MAX_UTC),
            "infinite: nothing to wake for"
        );
        // What the fence sends after ending a departed node's sessions.
        for kind in Kind::ALL {
            let look = parse_notice(&kind.look_from_start()).expect("the trigger's form");
            assert_eq!((look.kind, look.due), (Some(kind), None));
        }
        for junk in [
            "",
            "expectation",
            "other:12",
            "expectation:soon",
            ":",
            "nonsense",
            "expectation:99999999999999999999",
            "delayed:-1x",
        ] {
            assert_eq!(parse_notice(junk), None, "{junk:?}");
        }
        let minus = parse_notice("expectation:-").expect("the trigger's");
        assert_eq!(
            (minus.kind, minus.due),
            (Some(Kind::Expectation), None),
            "'-infinity': look at this kind from the start now"
        );
    }

    /// At most `NOTICES_PER_SECOND` a second pass; past that none until a second
    /// passes under the bound, which asks for one look at everything.
    #[test]
    fn a_flood_is_cut_to_the_bound_and_calms_down() {
        let start = Instant::now();
        let mut f = Flood::new(start);
        let ms = |n: u64| start + Duration::from_millis(n);
        for _ in 0..NOTICES_PER_SECOND {
            assert_eq!(f.take(ms(10)), Take::Pass);
        }
        assert_eq!(f.take(ms(20)), Take::Flooded);
        assert_eq!(f.take(ms(30)), Take::Drop);
        // The next second is flooded too: still dropped.
        for _ in 0..=NOTICES_PER_SECOND {
            assert_eq!(f.take(ms(1100)), Take::Drop);
        }
        assert!(!f.quiet(ms(2000)), "the second at 1.1 s was over the bound");
        // A second (from 2.0 s) with few: calm at the next notification after it.
        assert_eq!(f.take(ms(2500)), Take::Drop);
        assert_eq!(f.take(ms(3100)), Take::Drop, "within that second");
        assert_eq!(f.take(ms(3600)), Take::Calm);
        assert_eq!(f.take(ms(3700)), Take::Pass);
        // Or, with none at all, at the probe interval's check.
        let mut g = Flood::new(start);
        for _ in 0..=NOTICES_PER_SECOND {
            g.take(ms(1));
        }
        assert!(!g.quiet(ms(500)));
        assert!(!g.quiet(ms(1001)), "the flooded second");
        assert!(g.quiet(ms(2002)), "a quiet second ends the flood");
        assert!(!g.quiet(ms(3000)), "once");
    }
}
