//! Fencing: the active node ends the database sessions of members that departed without
//! leaving — frozen, cut off, dead — so that the rows they held locked (ahead of their
//! deadline, or in a batch awaiting confirms) fire within about `member_ttl` + a tick of
//! the fault, however long the fault lasts. `SKIP LOCKED` would otherwise make the
//! active node pass them by until the departed node wakes up or heals.
//!
//! Having ended any, it sends the schema's notice without a due time: the freed rows are
//! behind where its own scan stands (it passed them by), and only a look from the start
//! finds them.
//!
//! The cost: a row the departed node had already published (confirmed or not) but not
//! yet deleted is published again, with the same `message_id` — the contract's "cannot
//! know whether the first was delivered".
//!
//! Members that announce themselves withdrawn (unfit: cannot use Postgres, say) are
//! fenced too: a node cut off from Postgres keeps announcing, and its sessions stay on
//! the server holding their rows until their connections time out.
//!
//! Only a node that hears the group — its own announcements come back — fences: one cut
//! off from the broker sees everyone depart and must not end the sessions of the node
//! that is really firing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::Settings;
use crate::election::Role;
use crate::metrics::Metrics;
use crate::status::{MemberStatus, Status};
use crate::store::{Store, bounded};
use crate::telemetry::{Chain, LogLimiter};

/// A departed node is fenced for this long unless heard again: past it, a node still
/// cut off has stopped firing by its own checks (it cannot publish).
const WATCH_FOR: Duration = Duration::from_secs(600);
/// At most one log line per this period when fencing fails.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// What the fence task uses.
pub(crate) struct Fence {
    pub(crate) settings: Arc<Settings>,
    pub(crate) node_id: Uuid,
    pub(crate) store: Store,
    pub(crate) role: watch::Receiver<Role>,
    pub(crate) status: Arc<Status>,
    pub(crate) metrics: Arc<Metrics>,
    /// Members the election saw depart (`election::Output::Departed`).
    pub(crate) departed: mpsc::Receiver<Uuid>,
    pub(crate) stop: CancellationToken,
}

/// The capacity of the departed channel; a full one drops the news (the member count is
/// small, and a dropped node is only fenced later by nobody: its locks end with its
/// session or `idle_in_transaction_session_timeout`).
pub(crate) const DEPARTED_QUEUE: usize = 256;

pub(crate) async fn fence_loop(mut f: Fence) {
    let mut watched: HashMap<Uuid, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(f.settings.election.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warn = LogLimiter::new(WARN_EVERY);
    let bound = f.settings.db_bound();
    loop {
        tokio::select! {
            _ = f.stop.cancelled() => return,
            Some(id) = f.departed.recv() => {
                watched.insert(id, Instant::now());
            }
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let members = f.status.snapshot().members;
        let role = *f.role.borrow();
        let nodes = targets(&mut watched, &members, f.node_id, role, now);
        if nodes.is_empty() {
            continue;
        }
        let fencing = tokio::select! {
            _ = f.stop.cancelled() => return,
            r = bounded(bound, f.store.fence(&nodes)) => r,
        };
        match fencing {
            Ok(0) => {}
            Ok(ended) => {
                tracing::warn!(
                    sessions = ended,
                    ?nodes,
                    "ended the database sessions of departed or withdrawn nodes that held rows locked"
                );
                f.metrics.fenced(ended);
            }
            Err(e) => {
                if let Some(held_back) = warn.allow(now) {
                    tracing::warn!(
                        error = %Chain(&e), held_back,
                        "cannot end the sessions of departed nodes: their locked rows wait \
                         for them (grant the daemons' role pg_signal_backend, or run every \
                         node as the same role)"
                    );
                }
            }
        }
    }
}

/// Whose sessions to end now: the departed nodes watched (dropping those heard again or
/// watched long enough) and the members announcing themselves withdrawn — none unless
/// this node is active and hears itself.
fn targets(
    watched: &mut HashMap<Uuid, Instant>,
    members: &[MemberStatus],
    me: Uuid,
    role: Role,
    now: Instant,
) -> Vec<Uuid> {
    watched.retain(|id, since| {
        now.duration_since(*since) < WATCH_FOR && !members.iter().any(|m| m.node_id == *id)
    });
    let hears_itself = members.iter().any(|m| m.node_id == me);
    if role != Role::Active || !hears_itself {
        return Vec::new();
    }
    let mut nodes: Vec<Uuid> = watched.keys().copied().collect();
    nodes.extend(
        members
            .iter()
            .filter(|m| m.withdrawn && m.node_id != me)
            .map(|m| m.node_id),
    );
    nodes.sort();
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(n: u8, withdrawn: bool) -> MemberStatus {
        MemberStatus {
            node_id: Uuid::from_bytes([n; 16]),
            last_seen_ms: 0,
            active: false,
            probing: false,
            withdrawn,
        }
    }

    fn id(n: u8) -> Uuid {
        Uuid::from_bytes([n; 16])
    }

    #[test]
    fn the_active_node_that_hears_itself_fences_departed_and_withdrawn_members() {
        let now = Instant::now();
        let mut watched = HashMap::from([(id(2), now)]);
        let members = [member(1, false), member(3, true), member(4, false)];
        assert_eq!(
            targets(&mut watched, &members, id(1), Role::Active, now),
            vec![id(2), id(3)]
        );
    }

    #[test]
    fn nobody_is_fenced_by_a_passive_node_or_one_that_does_not_hear_itself() {
        let now = Instant::now();
        let mut watched = HashMap::from([(id(2), now)]);
        let members = [member(1, false), member(3, true)];
        assert!(targets(&mut watched, &members, id(1), Role::Passive, now).is_empty());
        // Cut off from the broker: it hears nobody, itself included.
        assert!(targets(&mut watched, &[], id(1), Role::Active, now).is_empty());
        // Still watched for when it hears again.
        assert!(watched.contains_key(&id(2)));
    }

    #[test]
    fn a_departed_node_heard_again_or_watched_long_enough_is_let_be() {
        let now = Instant::now();
        let mut watched = HashMap::from([(id(2), now), (id(3), now)]);
        let members = [member(1, false), member(2, false)];
        assert_eq!(
            targets(&mut watched, &members, id(1), Role::Active, now),
            vec![id(3)]
        );
        let later = now + WATCH_FOR;
        assert!(targets(&mut watched, &members, id(1), Role::Active, later).is_empty());
        assert!(watched.is_empty());
    }
}
