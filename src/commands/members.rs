//! `timeoutd members`: watch the group from the outside.
//!
//! The watcher is not a member: it sends a probe that also says `leaving`, so members
//! answer at their next tick (probe) and nobody adds it to their view (leaving).
//! Quiet members (election rule `lowest`) answer only such probes, so a watcher probes
//! again every `member_ttl` to keep them in view. It judges what it hears as a member
//! does (`admission`): it shows the members that count, and how many announcements did
//! not.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use serde::Serialize;
use uuid::Uuid;

use super::EXIT_NOBODY;
use crate::admission::{Admission, Policy, RejectedCount};
use crate::bus::Bus;
use crate::cli::MembersArgs;
use crate::config::Settings;
use crate::telemetry::Shown;
use crate::wire::announcement::Announcement;

#[derive(Debug, Clone, Serialize)]
struct Seen {
    node_id: Uuid,
    active: bool,
    probing: bool,
    /// Alive but not a candidate (its own checks fail, or it lags).
    withdrawn: bool,
    lowest: bool,
    last_seen_ms: u128,
    /// Receive time minus the sender's `sent_at`: transit time plus clock skew.
    lag_ms: i64,
}

pub async fn members(settings: &Settings, args: MembersArgs) -> anyhow::Result<ExitCode> {
    let group = &settings.election.group;
    let (bus, mut announcements) = Bus::connect(&settings.amqp, group, "timeoutd members")
        .await
        .context("connecting to RabbitMQ")?;
    let me = Uuid::new_v4();
    let ttl = settings.election.member_ttl;
    let policy = Policy::new(settings, bus.user().to_owned());
    let mut admission = Admission::new(policy, Some(me), Utc::now());
    let mut seq = 0;
    probe(&bus, &mut admission, me, &mut seq, ttl).await?;
    // The first probe is answered only by the members that announce; once one of them
    // counts, a second probe names it, so that every member can vouch for the watcher.
    let mut vouched_probe = false;
    let refresh = settings.election.announce_interval;
    let mut seen: BTreeMap<Uuid, (Instant, Announcement, i64)> = BTreeMap::new();
    let mut next_print = Instant::now() + refresh.mul_f32(1.5);
    // Half a ttl, so an answer lost now and then does not drop a quiet member.
    let mut next_probe = Instant::now() + ttl / 2;
    let mut heard_nobody = false;
    loop {
        let wait = next_print.saturating_duration_since(Instant::now());
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = tokio::time::sleep(wait) => {
                let members = view(&seen, ttl);
                print(&members, admission.rejected(), args.json)?;
                if args.once {
                    heard_nobody = members.is_empty();
                    break;
                }
                next_print = Instant::now() + refresh;
                if Instant::now() >= next_probe {
                    probe(&bus, &mut admission, me, &mut seq, ttl).await?;
                    next_probe = Instant::now() + ttl / 2;
                }
            }
            heard = announcements.next() => match heard {
                // What does not count is counted by the admission and shown below.
                Some(Ok(envelope)) => {
                    if let Ok(a) = admission.admit(Instant::now(), Utc::now(), &envelope) {
                        let other = a.node_id != me;
                        record(&mut seen, a, me);
                        if other && !std::mem::replace(&mut vouched_probe, true) {
                            probe(&bus, &mut admission, me, &mut seq, ttl).await?;
                        }
                    }
                }
                Some(Err(e)) => return Err(anyhow::Error::new(e).context("consumer failed")),
                None => anyhow::bail!("consumer cancelled"),
            },
        }
    }
    // The watcher is done either way: a broker that does not answer the close drops it.
    let _ = bus.close().await;
    if heard_nobody {
        eprintln!(
            "no member of group {} answered (is a daemon running with the same amqp.url, \
             amqp.announce_exchange and election.group?)",
            Shown(group)
        );
        return Ok(ExitCode::from(EXIT_NOBODY));
    }
    Ok(ExitCode::SUCCESS)
}

/// An observer's probe: every member answers it, and nobody counts the watcher in.
async fn probe(
    bus: &Bus,
    admission: &mut Admission,
    me: Uuid,
    seq: &mut u64,
    ttl: Duration,
) -> anyhow::Result<()> {
    *seq += 1;
    let probe = Announcement {
        node_id: me,
        group: admission.policy().group.clone(),
        sent_at: Utc::now(),
        seq: *seq,
        active: false,
        leaving: true,
        probe: true,
        withdrawn: false,
        after: None,
    };
    bus.announce(&admission.seal(Instant::now(), &probe), ttl)
        .await?;
    Ok(())
}

fn record(seen: &mut BTreeMap<Uuid, (Instant, Announcement, i64)>, a: Announcement, me: Uuid) {
    if a.node_id == me {
        return;
    }
    // A withdrawn node says `leaving` too (for older nodes) but is still there.
    if a.leaving && !a.withdrawn {
        seen.remove(&a.node_id);
        return;
    }
    let lag = (Utc::now() - a.sent_at).num_milliseconds();
    seen.insert(a.node_id, (Instant::now(), a, lag));
}

fn view(seen: &BTreeMap<Uuid, (Instant, Announcement, i64)>, ttl: Duration) -> Vec<Seen> {
    let live: Vec<_> = seen
        .values()
        .filter(|(at, _, _)| at.elapsed() <= ttl)
        .collect();
    let lowest = live
        .iter()
        .filter(|(_, a, _)| !a.probe && !a.withdrawn)
        .map(|(_, a, _)| a.node_id)
        .min();
    live.iter()
        .map(|(at, a, lag)| Seen {
            node_id: a.node_id,
            active: a.active,
            probing: a.probe,
            withdrawn: a.withdrawn,
            lowest: Some(a.node_id) == lowest,
            last_seen_ms: at.elapsed().as_millis(),
            lag_ms: *lag,
        })
        .collect()
}

fn print(members: &[Seen], rejected: &RejectedCount, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(members)?);
        return Ok(());
    }
    println!(
        "{:<38} {:<9} {:>10} {:>8}",
        "NODE", "ROLE", "LAST SEEN", "LAG"
    );
    for m in members {
        let role = match (m.active, m.probing, m.withdrawn) {
            (_, _, true) => "withdrawn",
            (_, true, _) => "joining",
            (true, _, _) => "active",
            _ => "passive",
        };
        let mark = if m.lowest { "*" } else { " " };
        println!(
            "{}{:<37} {:<9} {:>8}ms {:>6}ms",
            mark, m.node_id, role, m.last_seen_ms, m.lag_ms
        );
    }
    println!("({} members; * = lowest candidate)", members.len());
    if let Some(last) = &rejected.last {
        let reasons: Vec<String> = rejected
            .by_reason
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        println!(
            "{} announcements did not count ({}); the last: {}, from broker user {:?}",
            rejected.total,
            reasons.join(", "),
            Shown(&last.detail),
            last.user_id.as_deref().unwrap_or("(none)")
        );
    }
    println!();
    Ok(())
}
