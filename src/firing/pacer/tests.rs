use super::*;

const E: Kind = Kind::Expectation;
const D: Kind = Kind::Delayed;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

fn config(concurrency: usize, fresh_slots: usize) -> Config {
    Config {
        horizon: 100 * MS,
        lead: Config::lead_for(100 * MS),
        fresh: Duration::from_secs(1),
        concurrency,
        fresh_slots,
        tick: 250 * MS,
        probe_interval: 1000 * MS,
    }
}

fn db(t0_db: DateTime<Utc>, ms: i64) -> DateTime<Utc> {
    t0_db + chrono::Duration::milliseconds(ms)
}

fn t0() -> (Instant, DateTime<Utc>) {
    (
        Instant::now(),
        "2026-11-22T10:00:00Z".parse().expect("time"),
    )
}

fn probe(earliest: Option<f64>, beyond: Option<f64>) -> NextDue {
    NextDue {
        earliest,
        beyond,
        now: t0().1,
        start: t0().1,
    }
}

/// What is probed now, as (kind, after).
fn probes(p: &mut Pacer, now: Instant) -> Vec<(Kind, Option<DateTime<Utc>>)> {
    p.probes_due(now)
        .into_iter()
        .map(|x| (x.kind, x.after))
        .collect()
}

fn short(clock: DbClock, locked: usize, window_end: DateTime<Utc>) -> Finished {
    Finished {
        locked,
        full: false,
        untouched: 0,
        clock: Some(clock),
        last_due: None,
        window_end: Some(window_end),
        epoch: 0,
    }
}

#[test]
fn a_new_pacer_probes_every_kind_and_starts_nothing_blind() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    assert_eq!(probes(&mut p, now), vec![(E, None), (D, None)]);
    assert!(p.starts(now).is_empty());
}

#[test]
fn while_notifications_arrive_a_kind_is_probed_every_probe_interval_not_every_tick() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    p.listening(true, now);
    assert_eq!(probes(&mut p, now).len(), 2);
    p.probed(E, now, probe(None, None));
    p.probed(D, now, probe(None, None));
    assert!(probes(&mut p, now + 999 * MS).is_empty());
    assert_eq!(
        p.wake_at(now),
        now + 250 * MS,
        "the loop still wakes every tick"
    );
    assert_eq!(probes(&mut p, now + 1000 * MS), vec![(E, None), (D, None)]);
}

#[test]
fn without_notifications_a_kind_is_probed_every_tick_from_the_moment_they_stop() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.listening(true, now);
    probes(&mut p, now);
    p.probed(E, now, probe(None, None));
    let lost = now + 100 * MS;
    p.listening(false, lost);
    assert!(probes(&mut p, lost + 249 * MS).is_empty());
    assert_eq!(probes(&mut p, lost + 250 * MS), vec![(E, None)]);
    p.probed(E, lost + 250 * MS, probe(None, None));
    assert_eq!(probes(&mut p, lost + 500 * MS), vec![(E, None)]);
    // Back: the next probe after this one keeps the longer interval again.
    p.listening(true, lost + 500 * MS);
    p.probed(E, lost + 500 * MS, probe(None, None));
    assert!(probes(&mut p, lost + 1499 * MS).is_empty());
    assert_eq!(probes(&mut p, lost + 1500 * MS), vec![(E, None)]);
}

#[test]
fn a_coming_row_is_locked_lead_before_its_due_time_not_earlier() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.probed(E, now, probe(Some(1.0), Some(1.0)));
    let start = now + Duration::from_secs(1) - p.config().lead;
    assert_eq!(p.wake_at(now), now + 250 * MS, "the probe tick comes first");
    assert!(p.starts(start - MS).is_empty());
    assert_eq!(p.starts(start), vec![(E, Lane::OnTime)]);
    assert_eq!(p.running(), 1);
    let w = p.window(E, Lane::OnTime);
    assert_eq!(
        (w.horizon, w.fresh),
        (100 * MS, Some(Duration::from_secs(1)))
    );
}

#[test]
fn a_short_window_covers_its_end_and_the_next_probe_looks_beyond_it() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.listening(true, now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    assert_eq!(p.starts(now), vec![(E, Lane::OnTime)]);
    let clock = DbClock { at: now, db: at };
    p.finished(E, Lane::OnTime, now + MS, short(clock, 80, db(at, 100)));
    assert_eq!(p.running(), 0);
    assert_eq!(probes(&mut p, now + MS), vec![(E, Some(db(at, 100)))]);
    // The next row beyond the window, due in 101 ms: its batch starts lead before.
    p.probed(E, now + MS, probe(Some(0.05), Some(0.101)));
    let start = now + MS + 101 * MS - p.config().lead;
    assert_eq!(p.wake_at(now + 2 * MS), start);
    assert!(p.starts(start - MS).is_empty());
    assert_eq!(p.starts(start), vec![(E, Lane::OnTime)]);
}

#[test]
fn the_next_window_starts_lead_before_its_first_row_while_the_last_one_still_sends() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.listening(true, now);
    probes(&mut p, now);
    p.probed(E, now, probe(Some(0.1), Some(0.1)));
    let first = now + 100 * MS - p.config().lead;
    assert_eq!(p.starts(first), vec![(E, Lane::OnTime)]);
    // From its start, its window counts as held: the probe looks past it at once.
    let read = DbClock { at: now, db: at };
    let end = read.db_at(first) + chrono::Duration::milliseconds(100);
    assert_eq!(probes(&mut p, first), vec![(E, Some(end))]);
    // The first row past it is due 92 ms after the probe answered.
    let answered = read.db_at(first + MS);
    let past = NextDue {
        now: answered,
        start: answered,
        ..probe(Some(0.01), Some(0.092))
    };
    p.probed(E, first + MS, past);
    let next = first + MS + 92 * MS - p.config().lead;
    assert!(p.starts(next - MS).is_empty());
    assert_eq!(
        p.starts(next),
        vec![(E, Lane::OnTime)],
        "the first still sends"
    );
    assert_eq!(p.running(), 2);
    // The first ends short: the second looked past its own window when it started.
    assert_eq!(probes(&mut p, next).len(), 1);
    p.finished(E, Lane::OnTime, next + 30 * MS, short(read, 90, end));
    assert!(probes(&mut p, next + 30 * MS).is_empty());
    assert!(
        p.kinds[0].covered > Some(end),
        "the second's window stays held"
    );
}

#[test]
fn a_window_begun_before_the_scan_forgot_where_it_stood_covers_nothing() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    probes(&mut p, now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    assert_eq!(p.starts(now), vec![(E, Lane::OnTime)]);
    let began = p.epoch(E);
    p.notified(Some(E), None, now);
    assert_eq!(p.starts(now), vec![(E, Lane::OnTime)]);
    // The first leaves rows unsent: they are due again, and the second skipped them.
    let clock = DbClock { at: now, db: at };
    let left = Finished {
        untouched: 3,
        ..short(clock, 10, db(at, 100))
    };
    p.finished(E, Lane::OnTime, now + MS, left);
    assert_ne!(p.epoch(E), began);
    probes(&mut p, now + MS);
    p.probe_failed(E, now + MS);
    let second = Finished {
        epoch: began,
        ..short(clock, 10, db(at, 150))
    };
    p.finished(E, Lane::OnTime, now + 2 * MS, second);
    assert_eq!(p.kinds[0].covered, None, "its window proves nothing");
    assert_eq!(
        probes(&mut p, now + 2 * MS),
        vec![(E, None)],
        "look from the start"
    );
}

#[test]
fn a_full_window_counts_as_held_only_up_to_its_last_row() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(1, 0), &[E], now);
    probes(&mut p, now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    assert_eq!(p.starts(now), vec![(E, Lane::OnTime)]);
    let clock = DbClock { at: now, db: at };
    p.finished(E, Lane::OnTime, now + MS, burst_part(clock, db(at, 5)));
    assert_eq!(p.kinds[0].covered, Some(db(at, 5)));
    assert_eq!(
        p.starts(now + MS),
        vec![(E, Lane::OnTime)],
        "the next part at once"
    );
    p.finished(E, Lane::OnTime, now + 2 * MS, short(clock, 10, db(at, 101)));
    assert_eq!(p.kinds[0].covered, Some(db(at, 101)));
}

/// A full on-time batch of rows all due at `at`, the window ending 100 ms later.
fn burst_part(clock: DbClock, at: DateTime<Utc>) -> Finished {
    Finished {
        full: true,
        last_due: Some(at),
        ..short(clock, 500, db(at, 100))
    }
}

#[test]
fn a_window_fuller_than_a_batch_takes_every_free_slot_until_a_part_comes_back_short() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    assert_eq!(
        p.starts(now),
        vec![(E, Lane::OnTime)],
        "one, until it is full"
    );
    let clock = DbClock { at: now, db: at };
    let full = burst_part(clock, at);
    p.finished(E, Lane::OnTime, now + MS, full);
    assert_eq!(p.starts(now + MS), vec![(E, Lane::OnTime); 4]);
    p.finished(E, Lane::OnTime, now + 2 * MS, short(clock, 20, db(at, 100)));
    assert!(p.starts(now + 2 * MS).is_empty(), "the window is empty");
    p.finished(E, Lane::OnTime, now + 3 * MS, full);
    assert_eq!(p.starts(now + 3 * MS), vec![(E, Lane::OnTime); 2]);
    assert_eq!(p.running(), 4);
}

#[test]
fn a_window_fuller_than_a_batch_leaves_the_backlog_its_share() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 2), &[E, D], now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    p.probed(D, now, probe(Some(-60.0), None));
    let first = vec![(E, Lane::OnTime), (D, Lane::Backlog), (D, Lane::Backlog)];
    assert_eq!(p.starts(now), first);
    let clock = DbClock { at: now, db: at };
    let full = burst_part(clock, at);
    p.finished(E, Lane::OnTime, now + MS, full);
    assert_eq!(p.starts(now + MS), vec![(E, Lane::OnTime); 2]);
    let backlog = backlog_done(500, true, 0, db(at, -59_000));
    p.finished(D, Lane::Backlog, now + 2 * MS, backlog);
    assert_eq!(
        p.starts(now + 2 * MS),
        vec![(D, Lane::Backlog)],
        "a slot the backlog frees stays the backlog's"
    );
}

#[test]
fn a_backlog_found_while_a_window_is_taken_in_parts_gets_the_slots_they_free() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    p.probed(E, now, probe(Some(0.0), Some(0.0)));
    p.probed(D, now, probe(None, None));
    p.starts(now);
    let clock = DbClock { at: now, db: at };
    p.finished(E, Lane::OnTime, now + MS, burst_part(clock, at));
    assert_eq!(p.starts(now + MS), vec![(E, Lane::OnTime); 4]);
    p.probed(D, now + MS, probe(Some(-60.0), None));
    for i in 2..5 {
        let t = now + i * MS;
        p.finished(E, Lane::OnTime, t, burst_part(clock, at));
        assert_eq!(p.starts(t), vec![(D, Lane::Backlog)], "part {i}");
    }
    let t = now + 5 * MS;
    p.finished(E, Lane::OnTime, t, burst_part(clock, at));
    assert_eq!(
        p.starts(t),
        vec![(E, Lane::OnTime)],
        "the lane's last part is followed by the next"
    );
    for i in 6..50 {
        let t = now + i * MS;
        p.finished(E, Lane::OnTime, t, burst_part(clock, at));
        assert_eq!(p.starts(t), vec![(E, Lane::OnTime)], "part {i}");
        let backlog = backlog_done(500, true, 0, db(at, -59_000));
        p.finished(D, Lane::Backlog, t, backlog);
        assert_eq!(p.starts(t), vec![(D, Lane::Backlog)], "backlog {i}");
    }
}

#[test]
fn a_row_notified_inside_a_held_window_is_fetched_at_once_others_at_their_time() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    p.probed(E, now, probe(None, None));
    p.probed(D, now, probe(None, None));
    p.on_time_window(E, now, at);
    // Inside the window held for kind 0: at once.
    p.notified(Some(E), Some(db(at, 50)), now + MS);
    assert_eq!(p.starts(now + MS), vec![(E, Lane::OnTime)]);
    // Kind 1 holds no window: a row due in 500 ms starts lead before it.
    p.notified(Some(D), Some(db(at, 500)), now + MS);
    let start = now + 500 * MS + 250 * Duration::from_micros(1) - p.config().lead;
    assert!(p.starts(start - 2 * MS).is_empty());
    assert_eq!(p.starts(start + MS), vec![(D, Lane::OnTime)]);
}

#[test]
fn lost_notifications_make_every_kind_look_now() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    p.probed(E, now, probe(None, None));
    p.probed(D, now, probe(None, None));
    p.notified(None, None, now + MS);
    assert_eq!(
        p.starts(now + MS),
        vec![(E, Lane::OnTime), (D, Lane::OnTime)]
    );
}

#[test]
fn a_backlog_drains_beside_the_on_time_lane_within_its_share() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    // An hour overdue, and rows due now as well.
    p.probed(E, now, probe(Some(-3600.0), Some(0.0)));
    let starts = p.starts(now);
    assert_eq!(
        starts,
        vec![
            (E, Lane::OnTime),
            (E, Lane::Backlog),
            (E, Lane::Backlog),
            (E, Lane::Backlog)
        ]
    );
    let w = p.window(E, Lane::Backlog);
    assert_eq!((w.horizon, w.fresh), (Duration::ZERO, None));
}

#[test]
fn the_backlog_never_takes_the_fresh_slots_even_when_they_are_idle() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 2), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), None));
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
    assert!(p.starts(now).is_empty());
}

#[test]
fn strictly_oldest_first_holds_fresh_rows_back_while_a_backlog_drains() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(2, 0), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), Some(0.0)));
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
    let done = Finished {
        locked: 10,
        full: false,
        untouched: 0,
        clock: None,
        last_due: None,
        window_end: None,
        epoch: 0,
    };
    p.finished(E, Lane::Backlog, now + MS, done);
    p.finished(E, Lane::Backlog, now + MS, done);
    // Drained: the fresh rows go now.
    assert_eq!(p.starts(now + MS), vec![(E, Lane::OnTime)]);
}

#[test]
fn backlog_slots_go_to_the_kinds_in_turn() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(4, 1), &[E, D], now);
    p.probed(E, now, probe(Some(-60.0), None));
    p.probed(D, now, probe(Some(-60.0), None));
    let kinds: Vec<Kind> = p.starts(now).into_iter().map(|(k, _)| k).collect();
    assert_eq!(kinds, vec![E, D, E]);
    let full = Finished {
        locked: 500,
        full: true,
        untouched: 0,
        clock: None,
        last_due: None,
        window_end: None,
        epoch: 0,
    };
    p.finished(E, Lane::Backlog, now + MS, full);
    assert_eq!(p.starts(now + MS), vec![(D, Lane::Backlog)]);
}

#[test]
fn a_backlog_batch_that_locks_nothing_waits_a_tick_instead_of_spinning() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(2, 1), &[E], now);
    p.probed(E, now, probe(Some(-60.0), None));
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog)]);
    let nothing = Finished {
        locked: 0,
        full: false,
        untouched: 0,
        clock: None,
        last_due: None,
        window_end: None,
        epoch: 0,
    };
    p.finished(E, Lane::Backlog, now + MS, nothing);
    assert!(probes(&mut p, now + MS).is_empty());
    assert_eq!(probes(&mut p, now + MS + 250 * MS).len(), 1);
    assert!(p.starts(now + 2 * MS).is_empty());
}

#[test]
fn rows_left_unsent_are_due_again_so_the_window_is_forgotten() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.listening(true, now);
    p.probed(E, now, probe(None, None));
    p.on_time_window(E, now, at);
    assert_eq!(probes(&mut p, now), vec![(E, Some(db(at, 100)))]);
    p.probed(E, now, probe(None, None));
    p.notified(Some(E), Some(db(at, 10)), now);
    p.starts(now);
    let clock = DbClock { at: now, db: at };
    let left = Finished {
        untouched: 3,
        ..short(clock, 5, db(at, 100))
    };
    p.finished(E, Lane::OnTime, now + MS, left);
    assert_eq!(probes(&mut p, now + MS), vec![(E, None)]);
}

#[test]
fn a_failed_batch_forgets_its_kind_and_probes_after_the_backoff() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.probed(E, now, probe(Some(-60.0), Some(0.0)));
    p.on_time_window(E, now, at);
    p.failed(E, Lane::Backlog, now, Duration::from_secs(1));
    assert_eq!(p.running(), 2, "the other backlog batches still run");
    assert!(probes(&mut p, now + 999 * MS).is_empty());
    assert_eq!(
        probes(&mut p, now + Duration::from_secs(1)),
        vec![(E, None)]
    );
}

impl Pacer {
    /// Test helper: start an on-time batch of `kind` at `now` and finish it short, its
    /// window ending 100 ms after `at` (database clock).
    fn on_time_window(&mut self, kind: Kind, now: Instant, at: DateTime<Utc>) {
        let i = self.position(kind).expect("a kind of this pacer");
        self.kinds[i].timers[Timer::OnTime] = Some(now);
        let started = self.starts(now);
        assert!(started.contains(&(kind, Lane::OnTime)), "{started:?}");
        let clock = DbClock { at: now, db: at };
        self.finished(kind, Lane::OnTime, now, short(clock, 1, db(at, 100)));
    }
}

#[derive(Debug, Clone)]
enum Event {
    Probed(Kind, f64, f64),
    Finish(usize, bool, usize),
    Fail(usize),
    Notify(Option<Kind>, i64),
    Advance(u64),
}

fn kind() -> impl Strategy<Value = Kind> {
    proptest::sample::select(Kind::ALL.to_vec())
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (kind(), -100.0..5.0f64, -2.0..5.0f64).prop_map(|(k, e, b)| Event::Probed(k, e, b)),
        (0..8usize, any::<bool>(), 0..3usize).prop_map(|(i, f, u)| Event::Finish(i, f, u)),
        (0..8usize).prop_map(Event::Fail),
        (proptest::option::of(kind()), -2000..2000i64).prop_map(|(k, ms)| Event::Notify(k, ms)),
        (0..500u64).prop_map(Event::Advance),
    ]
}

fn backlog_done(locked: usize, full: bool, untouched: usize, last: DateTime<Utc>) -> Finished {
    Finished {
        locked,
        full,
        untouched,
        clock: None,
        last_due: Some(last),
        window_end: None,
        epoch: 0,
    }
}

/// The pacer with a backlog drain under way: two backlog batches started.
fn draining(now: Instant) -> Pacer {
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), None));
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
    p
}

#[test]
fn the_scan_stands_after_the_rows_probes_and_full_batches_saw() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.listening(true, now);
    assert_eq!(p.window(E, Lane::Backlog).from, None);
    p.probed(E, now, probe(Some(-3600.0), None));
    let probed = db(at, -3_600_000) - PROBE_ROUNDING;
    assert_eq!(p.window(E, Lane::Backlog).from, Some(probed));
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 0, db(at, -3000)),
    );
    assert_eq!(p.window(E, Lane::Backlog).from, Some(db(at, -3000)));
    // A batch that started earlier and ends later never moves it back, nor does a drain
    // that runs dry.
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 0, db(at, -3500)),
    );
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(0, false, 0, db(at, -3500)),
    );
    assert_eq!(p.window(E, Lane::Backlog).from, Some(db(at, -3000)));
    // The probe looks from there too; on-time batches never use it; '-infinity' bounds
    // nothing.
    assert_eq!(
        p.probes_due(now + Duration::from_secs(1))[0].from,
        Some(db(at, -3000))
    );
    assert_eq!(p.window(E, Lane::OnTime).from, None);
    p.probed(E, now, probe(Some(f64::NEG_INFINITY), None));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(db(at, -3000)));
    // Nothing pending: the scan stands at the probe's clock.
    p.probed(E, now, probe(None, None));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(at));
}

#[test]
fn the_scan_forgets_where_it_stood_when_rows_may_be_left_behind_it() {
    let (now, at) = t0();
    let last = db(at, -3000);
    type Leave = fn(&mut Pacer, Instant, DateTime<Utc>);
    let cases: [(&str, Leave); 3] = [
        ("left rows unsent", |p, now, last| {
            p.finished(E, Lane::Backlog, now, backlog_done(500, true, 3, last))
        }),
        ("an on-time batch left rows unsent", |p, now, last| {
            p.finished(E, Lane::OnTime, now, backlog_done(5, false, 1, last))
        }),
        ("failed", |p, now, _| {
            p.failed(E, Lane::Backlog, now, Duration::from_secs(1))
        }),
    ];
    for (why, leave) in cases {
        let mut p = draining(now);
        p.finished(E, Lane::Backlog, now, backlog_done(500, true, 0, last));
        assert_eq!(p.window(E, Lane::Backlog).from, Some(last), "{why}");
        leave(&mut p, now, last);
        assert_eq!(p.window(E, Lane::Backlog).from, None, "{why}");
    }
}

#[test]
fn a_sweep_looks_from_the_start_every_backlog_rescan() {
    let (now, at) = t0();
    let mut p = draining(now);
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 0, db(at, -3000)),
    );
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(10, false, 0, db(at, -2000)),
    );
    assert_eq!(p.window(E, Lane::Backlog).from, Some(db(at, -2000)));
    assert!(p.starts(now + BACKLOG_RESCAN - MS).is_empty());
    let later = now + BACKLOG_RESCAN;
    assert_eq!(p.starts(later), vec![(E, Lane::Sweep)]);
    assert_eq!(p.window(E, Lane::Sweep).from, None);
    // The sweep found a full batch of rows written behind the scan: go on from them.
    p.finished(
        E,
        Lane::Sweep,
        later,
        backlog_done(500, true, 0, db(at, -9000)),
    );
    assert_eq!(
        p.window(E, Lane::Backlog).from,
        Some(db(at, -9000) - PROBE_ROUNDING)
    );
    assert_eq!(
        p.starts(later),
        vec![(E, Lane::Backlog), (E, Lane::Backlog)]
    );
    // One sweep per interval.
    p.finished(
        E,
        Lane::Backlog,
        later,
        backlog_done(3, false, 0, db(at, -8000)),
    );
    p.finished(
        E,
        Lane::Backlog,
        later,
        backlog_done(0, false, 0, db(at, -8000)),
    );
    assert!(p.starts(later + MS).is_empty());
}

#[test]
fn a_row_written_overdue_behind_the_scan_is_the_backlogs_at_once_not_the_next_sweeps() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.listening(true, now);
    probes(&mut p, now);
    p.probed(E, now, probe(None, None));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(at));
    let began = p.epoch(E);
    // A process manager writes a deadline a second and a bit old, then one an hour old.
    for overdue_ms in [1_001, 3_600_000] {
        p.notified(Some(E), Some(db(at, -overdue_ms)), now);
        let from = db(at, -overdue_ms) - PROBE_ROUNDING;
        assert_eq!(p.window(E, Lane::Backlog).from, Some(from));
    }
    assert_eq!(
        p.starts(now),
        vec![(E, Lane::Backlog), (E, Lane::Backlog)],
        "the backlog's share of the slots, and no on-time batch for it"
    );
    // A probe or batch begun before looked from further on: it moves the scan nowhere.
    assert_ne!(p.epoch(E), began);
    p.finished(
        E,
        Lane::Backlog,
        now,
        Finished {
            epoch: began,
            ..backlog_done(500, true, 0, db(at, -10))
        },
    );
    assert_eq!(
        p.window(E, Lane::Backlog).from,
        Some(db(at, -3_600_000) - PROBE_ROUNDING)
    );
    // A fresh row (overdue by less than `fresh`, with a tenth to spare for the lock's
    // round trip) stays the on-time lane's; the scan stands at it, should it grow old
    // before the lane takes it (a burst).
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, probe(None, None));
    p.notified(Some(E), Some(db(at, -899)), now);
    assert_eq!(
        p.window(E, Lane::Backlog).from,
        Some(db(at, -899) - PROBE_ROUNDING)
    );
    assert_eq!(p.starts(now), vec![(E, Lane::OnTime)]);
    // Nearer the end of the lane's reach, the backlog's.
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, probe(None, None));
    p.notified(Some(E), Some(db(at, -901)), now);
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
}

#[test]
fn a_backlog_batch_begun_before_a_row_was_written_overdue_does_not_end_the_backlog() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, probe(None, None));
    p.notified(Some(E), Some(db(at, -3_600_000)), now);
    assert_eq!(p.starts(now), vec![(E, Lane::Backlog), (E, Lane::Backlog)]);
    let began = p.epoch(E);
    // Written while those batches run, due after where they look from: they may not
    // see it, and come back short.
    p.notified(Some(E), Some(db(at, -1_800_000)), now);
    for _ in 0..2 {
        let short = Finished {
            epoch: began,
            ..backlog_done(1, false, 0, db(at, -3_600_000))
        };
        p.finished(E, Lane::Backlog, now, short);
    }
    assert_eq!(
        p.starts(now),
        vec![(E, Lane::Backlog), (E, Lane::Backlog)],
        "the backlog goes on"
    );
    // A batch begun after it ends it.
    let current = Finished {
        epoch: p.epoch(E),
        ..backlog_done(1, false, 0, db(at, -1_800_000))
    };
    p.finished(E, Lane::Backlog, now, current);
    p.finished(E, Lane::Backlog, now, current);
    assert!(p.starts(now).is_empty());
}

#[test]
fn a_backlog_batch_begun_before_the_scan_forgot_where_it_stood_moves_it_nowhere() {
    let (now, at) = t0();
    let mut p = draining(now);
    // The first leaves rows unsent; the second, begun before, ends after it.
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 3, db(at, -3000)),
    );
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 0, db(at, -2000)),
    );
    assert_eq!(p.window(E, Lane::Backlog).from, None);
}

#[test]
fn after_lost_notifications_the_scan_looks_from_the_start() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E, D], now);
    p.listening(true, now);
    probes(&mut p, now);
    p.probed(E, now, probe(None, None));
    p.probed(D, now, probe(None, None));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(at));
    p.notified(None, None, now + MS);
    let looks: Vec<_> = p
        .probes_due(now + MS)
        .into_iter()
        .map(|x| (x.kind, x.from))
        .collect();
    assert_eq!(looks, vec![(E, None), (D, None)]);
    assert_eq!(p.window(D, Lane::Backlog).from, None);
}

#[test]
fn a_slow_probe_never_puts_the_bound_past_the_row_it_saw() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    // The seconds count from the statement's now(); its clock was read 800 ms later.
    let slow = NextDue {
        earliest: Some(-0.5),
        beyond: None,
        now: db(at, 800),
        start: at,
    };
    p.probed(E, now, slow);
    assert_eq!(
        p.window(E, Lane::Backlog).from,
        Some(db(at, -500) - PROBE_ROUNDING)
    );
    // Nothing pending as of the statement's snapshot: not as of its end.
    let empty = NextDue {
        earliest: None,
        ..slow
    };
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, empty);
    assert_eq!(p.window(E, Lane::Backlog).from, Some(at));
}

#[test]
fn one_probe_per_kind_is_under_way_and_one_asked_for_meanwhile_follows_it() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(3, 1), &[E, D], now);
    p.listening(true, now);
    assert_eq!(probes(&mut p, now), vec![(E, None), (D, None)]);
    p.probed(D, now, probe(None, None));
    // Kind 0's probe is slow (a walk over deleted rows): kind 1 goes on being probed.
    let later = now + Duration::from_secs(1);
    assert_eq!(probes(&mut p, later), vec![(D, None)]);
    p.probed(D, later, probe(None, None));
    // A batch ends meanwhile and asks for a probe: it follows the one under way at once.
    assert_eq!(p.starts(later), vec![]);
    p.notified(Some(E), None, later);
    assert_eq!(p.starts(later), vec![(E, Lane::OnTime)]);
    let clock = DbClock {
        at: later,
        db: t0().1,
    };
    p.finished(E, Lane::OnTime, later, short(clock, 1, t0().1));
    assert_eq!(probes(&mut p, later), vec![]);
    p.probed(E, later, probe(None, None));
    // It looks past the window the batch held from its start (see the next test), by
    // the latest reading of the clock (the first probe's: the later ones read no later).
    let first = DbClock {
        at: now,
        db: t0().1,
    };
    let held = Some(first.db_at(later) + chrono::Duration::milliseconds(100));
    assert_eq!(probes(&mut p, later), vec![(E, held)]);
    p.probe_failed(E, later);
    assert_eq!(probes(&mut p, later), vec![]);
    assert_eq!(probes(&mut p, later + 250 * MS), vec![(E, held)]);
}

#[test]
fn a_probe_begun_before_the_scan_forgot_where_it_stood_teaches_it_nothing() {
    let (now, _) = t0();
    let mut p = draining(now);
    p.finished(
        E,
        Lane::Backlog,
        now,
        backlog_done(500, true, 0, db(t0().1, -3000)),
    );
    let later = now + Duration::from_secs(1);
    assert_eq!(probes(&mut p, later).len(), 1);
    // The other batch fails while the probe is under way; the probe saw its rows held.
    p.failed(E, Lane::Backlog, later, 100 * MS);
    p.probed(E, later, probe(Some(-1.0), None));
    assert_eq!(p.window(E, Lane::Backlog).from, None);
    // The next probe teaches it again.
    let again = later + Duration::from_secs(1);
    assert_eq!(probes(&mut p, again).len(), 1);
    p.probed(E, again, probe(Some(-1.0), None));
    assert!(p.window(E, Lane::Backlog).from.is_some());
}

fn locked(p: &Pacer, full: bool, last_due: DateTime<Utc>) -> Option<Locked> {
    Some(Locked {
        full,
        last_due: Some(last_due),
        epoch: p.epoch(E),
    })
}

/// No backlog batch's lock statement walks the rows another holds: the next starts when
/// the one before it has locked, from its last row; they send side by side.
#[test]
fn backlog_batches_lock_one_after_the_other_each_from_where_the_last_ended() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), None));
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    assert!(
        p.starts_one(now).is_empty(),
        "the second waits for the first's lock"
    );
    let first_end = db(at, -3_500_000);
    p.locked(E, Lane::Backlog, now, locked(&p, true, first_end));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(first_end));
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    let second_end = db(at, -3_400_000);
    p.locked(E, Lane::Backlog, now, locked(&p, true, second_end));
    assert_eq!(p.window(E, Lane::Backlog).from, Some(second_end));
    assert!(
        p.starts_one(now).is_empty(),
        "two of three slots: the backlog's share"
    );
    // The first ends: its slot goes to the next backlog batch, from the second's end.
    p.finished(
        E,
        Lane::Backlog,
        now + MS,
        backlog_done(500, true, 0, first_end),
    );
    assert_eq!(p.window(E, Lane::Backlog).from, Some(second_end));
    assert_eq!(p.starts_one(now + MS), vec![(E, Lane::Backlog)]);
}

/// A lock that comes back short ends the backlog (nothing more behind it); one that
/// failed lets the next batch try from the same place; one begun before the scan forgot
/// where it stood moves nothing.
#[test]
fn a_short_lock_ends_the_backlog_and_a_failed_or_stale_one_moves_nothing() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), None));
    let from = p.window(E, Lane::Backlog).from;
    let began = p.epoch(E);
    // A row written as overdue as the first voids what batches begun before learn.
    p.notified(Some(E), Some(db(at, -3_600_000)), now);
    assert_eq!(p.window(E, Lane::Backlog).from, from);
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    p.locked(E, Lane::Backlog, now, None);
    assert_eq!(p.window(E, Lane::Backlog).from, from);
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    let stale = Locked {
        full: true,
        last_due: Some(db(at, -100)),
        epoch: began,
    };
    p.locked(E, Lane::Backlog, now, Some(stale));
    assert_eq!(p.window(E, Lane::Backlog).from, from);
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    p.locked(E, Lane::Backlog, now, locked(&p, false, db(at, -3000)));
    assert!(p.starts_one(now).is_empty(), "the backlog is drained");
}

proptest! {
    /// Whatever happens, batches in flight never exceed `concurrency`, the backlog never
    /// takes the fresh slots, at most one backlog batch per kind is locking at a time,
    /// and the pacer never asks to wake in the past.
    #[test]
    fn slots_are_never_exceeded_and_backlog_locks_never_overlap(
        concurrency in 1..6usize,
        fresh in 0..3usize,
        events in proptest::collection::vec(event(), 1..200),
        locks in proptest::collection::vec(0..8usize, 200),
    ) {
        let fresh_slots = fresh.min(concurrency - 1);
        let (mut now, at) = t0();
        let mut p = Pacer::new(config(concurrency, fresh_slots), &[E, D], now);
        // Running batches: kind, lane, and whether it locked.
        let mut running: Vec<(Kind, Lane, bool)> = Vec::new();
        let mut locks = locks.into_iter();
        let clock = DbClock { at: now, db: at };
        for e in events {
            match e {
                Event::Probed(k, earliest, beyond) => p.probed(k, now, probe(Some(earliest), Some(beyond))),
                Event::Finish(i, full, untouched) if !running.is_empty() => {
                    let (k, lane, did) = running.remove(i % running.len());
                    if !did {
                        p.locked(k, lane, now, None);
                    }
                    let f = Finished { full, untouched, epoch: p.epoch(k), ..short(clock, 10, db(at, 100)) };
                    p.finished(k, lane, now, f);
                }
                Event::Fail(i) if !running.is_empty() => {
                    let (k, lane, did) = running.remove(i % running.len());
                    if !did {
                        p.locked(k, lane, now, None);
                    }
                    p.failed(k, lane, now, 100 * MS);
                }
                Event::Notify(k, ms) => p.notified(k, Some(db(at, ms)), now),
                Event::Advance(ms) => now += Duration::from_millis(ms),
                _ => {}
            }
            if let (Some(i), false) = (locks.next(), running.is_empty()) {
                let n = running.len();
                let (k, lane, did) = &mut running[i % n];
                if !*did {
                    *did = true;
                    let rows = Locked { full: true, last_due: Some(db(at, -1000)), epoch: p.epoch(*k) };
                    p.locked(*k, *lane, now, Some(rows));
                }
            }
            running.extend(p.starts_one(now).into_iter().map(|(k, l)| (k, l, l == Lane::OnTime)));
            prop_assert_eq!(p.running(), running.len());
            prop_assert!(running.len() <= concurrency);
            let backlog = running.iter().filter(|(_, l, _)| *l != Lane::OnTime).count();
            prop_assert!(backlog <= concurrency - fresh_slots);
            prop_assert!(p.wake_at(now) > now);
            for kind in [E, D] {
                let locking = running.iter().filter(|(k, l, did)| *k == kind && *l == Lane::Backlog && !did).count();
                prop_assert!(locking <= 1, "{kind:?}: {locking} backlog batches locking at once");
            }
        }
    }
}

/// A sweep walks the deleted entries from the start of the index: the drain neither
/// waits for its lock nor holds it up.
#[test]
fn a_sweep_neither_waits_for_the_drains_lock_nor_holds_it_up() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(4, 1), &[E], now);
    p.probed(E, now, probe(Some(-3600.0), None));
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    p.locked(E, Lane::Backlog, now, locked(&p, true, db(at, -3_000_000)));
    let later = now + BACKLOG_RESCAN;
    assert_eq!(
        p.starts_one(later),
        vec![(E, Lane::Sweep), (E, Lane::Backlog)]
    );
    p.locked(
        E,
        Lane::Backlog,
        later,
        locked(&p, true, db(at, -2_000_000)),
    );
    assert!(
        p.starts_one(later).is_empty(),
        "three of four: the backlog's share"
    );
    p.finished(
        E,
        Lane::Backlog,
        later,
        backlog_done(500, true, 0, db(at, -3_000_000)),
    );
    assert_eq!(
        p.starts_one(later),
        vec![(E, Lane::Backlog)],
        "the sweep has not locked"
    );
}

/// A backlog batch that began before a row was notified ends after it: it may not have
/// seen the row, so it moves the scan no further than the row, fresh or not.
#[test]
fn a_batch_begun_before_a_notified_row_never_moves_the_scan_past_it() {
    let (now, at) = t0();
    let mut p = Pacer::new(config(1, 0), &[E], now);
    p.listening(true, now);
    probes(&mut p, now);
    p.probed(E, now, probe(Some(-3600.0), None));
    assert_eq!(p.starts_one(now), vec![(E, Lane::Backlog)]);
    let began = p.epoch(E);
    p.locked(E, Lane::Backlog, now, locked(&p, true, db(at, -100)));
    p.notified(Some(E), Some(db(at, -500)), now);
    let stands = Some(db(at, -500) - PROBE_ROUNDING);
    assert_eq!(p.window(E, Lane::Backlog).from, stands);
    p.finished(
        E,
        Lane::Backlog,
        now,
        Finished {
            epoch: began,
            ..backlog_done(500, true, 0, db(at, -100))
        },
    );
    assert_eq!(p.window(E, Lane::Backlog).from, stands);
}

/// Without notifications a probe names rows a batch of ours holds: the next probe waits
/// a tick instead of setting off another batch that finds nothing, again and again.
#[test]
fn without_notifications_an_on_time_start_probes_again_in_a_tick_not_at_once() {
    let (now, _) = t0();
    let mut p = Pacer::new(config(3, 1), &[E], now);
    probes(&mut p, now);
    p.probed(E, now, probe(Some(0.01), Some(0.01)));
    assert_eq!(p.starts(now + 10 * MS), vec![(E, Lane::OnTime)]);
    assert!(probes(&mut p, now + 10 * MS).is_empty());
    assert_eq!(probes(&mut p, now + 260 * MS).len(), 1);
}
