//! The schema's migrations, embedded, and the check that the session settings sent at
//! connect are in force before they write anything.

use sqlx::Row;

use super::{ApiRules, Store, StoreError};
use crate::config;

impl Store {
    /// [`Store::migrate`], then write what the SQL door allows from `settings` (by
    /// `by`, a node or the command line), so the door follows them from the first call.
    pub async fn migrate_for(
        &self,
        settings: &config::Settings,
        by: &str,
    ) -> Result<(), StoreError> {
        self.migrate().await?;
        if let Some(rules) = ApiRules::new(settings) {
            self.write_api_rules(&rules, by).await?;
        }
        Ok(())
    }

    /// Create the schema and apply the embedded migrations. The migrator holds an
    /// advisory lock, so replicas starting together apply them once; migrations this
    /// version does not know (applied by a newer one) are left alone.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut migrator = sqlx::migrate!();
        migrator.create_schema(self.schema.clone());
        migrator.dangerous_set_table_name(format!("{}._sqlx_migrations", self.schema));
        // A node of this version must still start after a newer one migrated the schema
        // (a rolling upgrade, or a rollback): migrations only ever add.
        migrator.set_ignore_missing(true);
        let session = self.session();
        session.ready().await?;
        // One connection for the check and the migrations, closed (not pooled) when they
        // fail: the migrator's lock is a session-level advisory lock, and Postgres may
        // grant it to a `pg_advisory_lock` cancelled by `lock_timeout` at that moment,
        // reporting the error and keeping the lock. Taken again on that session by the
        // retry and released once, it would stay held as long as the node lives, and
        // every other node's migrations would wait for it (measured: 100 daemons started
        // together, 87 of them stuck for minutes).
        let mut conn = session.pool.acquire().await.map_err(|e| session.seen(e))?;
        let migrated = match session.check_session(&mut conn).await {
            Ok(()) => migrator
                .run_direct(None, &mut *conn, false)
                .await
                .map_err(|e| session.seen(e)),
            Err(e) => Err(e),
        };
        if migrated.is_err() {
            conn.close_on_drop();
        }
        migrated
    }

    /// The session settings the connections ask for at startup (see `pool::connect_options`)
    /// are in force. A pooler may drop them silently (PgBouncer's
    /// `ignore_startup_parameters = options`): the migrations would then create the
    /// tables in whatever schema the server's `search_path` names, and statements would
    /// run unbounded. Refused instead, before anything is written.
    async fn check_session(&self, conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
        let search_path: String = sqlx::raw_sql("SELECT current_setting('search_path')")
            .fetch_one(conn)
            .await
            .map_err(|e| self.seen(e))?
            .try_get(0)?;
        if search_path != self.schema {
            return Err(StoreError::SessionSettings { search_path });
        }
        Ok(())
    }
}
