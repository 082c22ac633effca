//! Ending the database sessions of a node that departed without leaving, so that the
//! rows it held locked fire now instead of when it wakes up or heals.

use uuid::Uuid;

use super::{Kind, Store, StoreError};

/// The `application_name` of a node's firing sessions: how an operator tells them apart
/// in `pg_stat_activity`, and how [`Store::fence`] finds them.
pub fn session_name(node_id: Uuid) -> String {
    format!("timeoutd-{node_id}")
}

impl Store {
    /// End the sessions of `nodes` that hold rows of this schema's tables locked for
    /// firing (`FOR UPDATE` takes `RowShareLock` on the table; inserts and reads do not).
    /// Returns how many it ended. Needs the right to signal their backends: the same
    /// database role, or `pg_signal_backend`.
    pub async fn fence(&self, nodes: &[Uuid]) -> Result<usize, StoreError> {
        let names: Vec<String> = nodes.iter().copied().map(session_name).collect();
        let tables: Vec<&str> = Kind::ALL
            .iter()
            .map(|&kind| &*self.writes(kind).table)
            .collect();
        let ended: Vec<bool> = sqlx::query_scalar(
            // CASE: only a session that holds rows is ended (AND would not promise the order).
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_locks l \
                        WHERE l.pid = a.pid AND l.locktype = 'relation' \
                          AND l.mode = 'RowShareLock' AND l.granted \
                          AND l.relation = ANY (SELECT to_regclass(t) FROM unnest($2::text[]) t)) \
                    THEN coalesce(pg_terminate_backend(a.pid), false) ELSE false END \
             FROM pg_stat_activity a \
             WHERE a.application_name = ANY($1) AND a.pid <> pg_backend_pid() \
               AND a.datname = current_database()",
        )
        .bind(&names)
        .bind(&tables)
        .fetch_all(&self.pool)
        .await?;
        let ended = ended.into_iter().filter(|e| *e).count();
        if ended > 0 {
            // The freed rows are behind where the active node's scan stands (it passed
            // them by, locked): a notice without a due time makes it look from the start
            // (any other payload is dropped as someone else's).
            let looks: Vec<String> = Kind::ALL.iter().map(|k| k.look_from_start()).collect();
            sqlx::query("SELECT pg_notify($1, look) FROM unnest($2::text[]) AS look")
                .bind(self.notify_channel())
                .bind(&looks)
                .execute(&self.pool)
                .await?;
        }
        Ok(ended)
    }
}
