//! What the scan does besides batches: a passive node's checks (could it fire if
//! elected?), the publish check, probes of the due index, and deleting the confirmed rows
//! of batches that did not commit.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::Firing;
use super::pacer::FRESH;
use crate::backoff::Backoff;
use crate::health::Check;
use crate::kind::Kind;
use crate::store::{Fired, NextDue};
use crate::telemetry::Chain;

impl Firing {
    /// Delete the confirmed rows of batches that did not commit (if their deadline is
    /// unchanged): without this they would fire again. Failing that is no reason to stop
    /// firing: they are kept for the next round.
    pub(super) async fn settle_leftovers(&self) {
        let mut by_kind: HashMap<Kind, Vec<Fired>> = HashMap::new();
        for (kind, fired) in self.memory.take_leftovers() {
            by_kind.entry(kind).or_default().push(fired);
        }
        let mut settled = 0;
        let mut failed = None;
        for (kind, fired) in by_kind {
            if failed.is_some() {
                self.memory.remember_later(kind, fired);
                continue;
            }
            let delete = self.store.delete_fired(kind, &fired);
            match self.db(self.limits.db_bound * 2, delete).await {
                Ok(s) => {
                    self.memory.settled(kind, &s, &fired, self.limits.retry_min);
                    settled += fired.len() - s.later.len();
                }
                Err(e) => {
                    self.memory.remember_later(kind, fired);
                    failed = Some(e);
                }
            }
        }
        match failed {
            Some(e) => {
                tracing::warn!(error = %Chain(&e), "cannot delete the fired rows of an uncommitted batch yet")
            }
            None if settled > 0 => {
                tracing::info!(
                    settled,
                    "deleted the fired rows of a batch that had not committed"
                )
            }
            None => {}
        }
    }

    /// The kinds this node fires.
    pub(super) fn kinds(&self) -> Vec<Kind> {
        if self.settings.delay.enabled {
            Kind::ALL.to_vec()
        } else {
            vec![Kind::Expectation]
        }
    }
}

/// A passive node must know whether it could fire if elected: a withdrawn one rejoins
/// only when Postgres answers again (so that nobody flaps while the database is down for
/// everyone) and, if publishing was what failed, when it can get a channel again. Rows
/// fired by a batch that then failed to commit are deleted now too.
pub(super) async fn check_while_passive(firing: &Firing) {
    recheck_publish(firing).await;
    recheck_listen(firing).await;
    // The due-row index, not just `SELECT 1`: a table locked by someone else (a
    // migration, an ALTER) fails the scan, and must fail this check too. From now on
    // only: from its start, the probe would walk every deleted row not yet vacuumed
    // (seconds after a large drain, every time while an old snapshot keeps them).
    let mut pinged = Ok(());
    for kind in firing.kinds() {
        if let Err(e) = probe(firing, kind, None, Some(Utc::now())).await {
            pinged = Err(e);
            break;
        }
    }
    firing.health.record(Check::Postgres, &pinged);
    firing
        .status
        .update(|s| s.database_ok = Some(pinged.is_ok()));
    if pinged.is_ok() {
        firing.settle_leftovers().await;
    }
}

/// The publish check fails with a batch's trouble and passes with a batch that had
/// none; with nothing to fire, it is asked directly: can we get a channel?
pub(super) async fn recheck_publish(firing: &Firing) {
    let bus = firing.bus.borrow().clone();
    if let Some(bus) = bus
        && firing.health.failing().contains(&Check::Publish.name())
    {
        firing
            .health
            .record(Check::Publish, &bus.check_publish().await);
    }
}

/// A passive node holds no LISTEN connection (see `task::run`); one whose LISTEN failed
/// while active would stay withdrawn, or rejoin only to fail again: while the check
/// fails it tries a LISTEN at every passive check and lets it go.
async fn recheck_listen(firing: &Firing) {
    if !firing.health.failing().contains(&Check::Listen.name()) {
        return;
    }
    let limit = firing.settings.postgres.statement_timeout;
    let listened = match tokio::time::timeout(limit, firing.store.listener()).await {
        Ok(r) => r.map(drop).map_err(|e| Chain(&e).to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    };
    firing.health.record(Check::Listen, &listened);
}

/// Retries of what the node's health depends on (scans, LISTEN) are capped at the
/// announce interval: a database back within `member_ttl` is noticed before the node
/// would withdraw, and a withdrawn node rejoins soon after it is back.
pub(super) fn health_backoff(s: &crate::config::Settings) -> Backoff {
    Backoff::new(
        s.backoff.min,
        s.backoff.max.min(s.election.announce_interval),
    )
}

/// When the next rows of `kind` are due (see `Store::probe`), bounded on the client.
pub(super) async fn probe(
    firing: &Firing,
    kind: Kind,
    after: Option<DateTime<Utc>>,
    from: Option<DateTime<Utc>>,
) -> Result<NextDue, String> {
    let limit = firing.settings.postgres.statement_timeout;
    let _under_way = firing.health.step(Check::Postgres);
    match tokio::time::timeout(limit, firing.store.probe(kind, after, FRESH, from)).await {
        Ok(r) => r.map_err(|e| Chain(&e).to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}
