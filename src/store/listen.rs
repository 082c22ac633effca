//! Notices of new or moved deadlines: the channel the migrations' trigger notifies on,
//! and the LISTEN session that hears them.

use sqlx::postgres::PgListener;

use super::{Store, StoreError};

impl Store {
    /// The channel the migrations' trigger notifies on new or moved deadlines.
    pub fn notify_channel(&self) -> String {
        let mut channel = format!("timeoutd_{}", self.schema);
        channel.truncate(63);
        channel
    }

    /// `LISTEN` on [`Store::notify_channel`] as a statement: run again on a listener's
    /// connection it changes nothing but proves the connection answers (and leaves
    /// `pg_stat_activity` showing what the session is for).
    pub fn listen_statement(&self) -> String {
        format!(r#"LISTEN "{}""#, self.notify_channel().replace('"', "\"\""))
    }

    /// A listener on [`Store::notify_channel`] (one pooled connection, held while the
    /// listener lives: the scan opens it only while active, see `firing::notice::listen`).
    pub async fn listener(&self) -> Result<PgListener, StoreError> {
        let session = self.session();
        session.ready().await?;
        let mut listener = PgListener::connect_with(&session.pool)
            .await
            .map_err(|e| session.seen(e))?;
        // A lost connection ends the listener: the scan must know when it listens again
        // (see `firing::notice::listen`), which sqlx's own reconnect would hide.
        listener.eager_reconnect(false);
        listener.listen(&self.notify_channel()).await?;
        Ok(listener)
    }
}
