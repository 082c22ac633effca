//! What a store call fails with, and the client-side bound on a call's wait. Whom an
//! error is about (this host, the database, the statement) is read from its SQLSTATE
//! in `sqlstate`.

use std::time::Duration;

use super::Refusal;
use crate::config;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid postgres.url")]
    Url(#[source] sqlx::Error),
    #[error("database")]
    Db(#[from] sqlx::Error),
    #[error("migration")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database: no answer within {0:?}")]
    NoAnswer(Duration),
    #[error(
        "database: none of the {hosts} hosts of postgres.url is usable \
         (target_session_attrs {target:?}; each logged)"
    )]
    NoHost {
        hosts: usize,
        target: config::TargetSession,
    },
    #[error(
        "the database session has search_path {search_path:?}, not postgres.schema: the \
         session settings sent at connect were dropped (a pooler between? see \
         docs/operating/pgbouncer.md)"
    )]
    SessionSettings { search_path: String },
    /// The database refused an operator's verb (see [`Refusal`]); its message says why.
    #[error("refused by the database")]
    Refused(Refusal, #[source] sqlx::Error),
}

/// A database step bounded on the client too: the server's `statement_timeout` cannot
/// help when the network to it silently drops packets.
pub(crate) async fn bounded<T>(
    limit: Duration,
    step: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, step)
        .await
        .unwrap_or(Err(StoreError::NoAnswer(limit)))
}
