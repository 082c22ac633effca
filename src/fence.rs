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
use crate::status::Probe;
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
    pub(crate) probe: Arc<Probe>,
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
        let members = f.probe.snapshot().members;
        watched.retain(|id, since| {
            now.duration_since(*since) < WATCH_FOR && !members.iter().any(|m| m.node_id == *id)
        });
        let hears_itself = members.iter().any(|m| m.node_id == f.node_id);
        let withdrawn = members
            .iter()
            .any(|m| m.withdrawn && m.node_id != f.node_id);
        if (watched.is_empty() && !withdrawn) || !hears_itself || *f.role.borrow() != Role::Active {
            continue;
        }
        let mut nodes: Vec<Uuid> = watched.keys().copied().collect();
        nodes.extend(
            members
                .iter()
                .filter(|m| m.withdrawn && m.node_id != f.node_id)
                .map(|m| m.node_id),
        );
        match bounded(bound, f.store.fence(&nodes)).await {
            Ok(fenced) if fenced.ended > 0 => {
                tracing::warn!(
                    sessions = fenced.ended,
                    ?nodes,
                    "ended the database sessions of departed or withdrawn nodes that held rows locked"
                );
                f.probe.metrics.fenced(fenced.ended);
            }
            Ok(_) => {}
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
