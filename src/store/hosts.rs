//! The hosts of `postgres.url` (libpq's multi-host form) and which of them the pool
//! connects to. sqlx knows one host per pool; this picks it: each host in the order
//! given, the first that accepts a connection and meets `target_session_attrs` wins,
//! and the pool's connect options are pointed at it. A failure of the pool's host
//! (a connection refused, lost, or found read-only) makes the next use look again.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

use super::StoreError;
use crate::config::{self, TargetSession};

pub(super) struct Hosts {
    /// Complete options per host, in the order of `postgres.url`.
    options: Vec<PgConnectOptions>,
    /// `host:port` per host, for logs.
    labels: Vec<String>,
    target: TargetSession,
    connect_timeout: Duration,
    /// The host the pool's options point at (`usize::MAX` until the first use, so that
    /// the first host chosen is logged too).
    applied: AtomicUsize,
    /// The host a hook found; applied to the pool by the next [`Hosts::ready`].
    found: AtomicUsize,
    /// The pool's host failed: look again before the next use.
    stale: AtomicBool,
    looking: tokio::sync::Mutex<()>,
    /// Counts the pool's moves to another host, for what holds a connection of its own
    /// outside the pool's checks (the LISTEN session).
    moves: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for Hosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hosts")
            .field("hosts", &self.labels)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Hosts {
    /// The options of every host of `url`, each completed by `complete`.
    /// `None` when there is one host and any server will do: nothing to choose.
    pub(super) fn new(
        url: &config::SecretUrl,
        settings: &config::Postgres,
        complete: impl Fn(PgConnectOptions) -> PgConnectOptions,
    ) -> Result<(PgConnectOptions, Option<Arc<Self>>), StoreError> {
        let parsed = config::pg_hosts(url.expose())
            .map_err(|e| StoreError::Url(sqlx::Error::Configuration(e.into())))?;
        let options = parsed
            .urls
            .iter()
            .map(|u| PgConnectOptions::from_str(u.expose()).map(&complete))
            .collect::<Result<Vec<_>, _>>()
            .map_err(StoreError::Url)?;
        let first = options[0].clone();
        if options.len() == 1 && parsed.target == TargetSession::Any {
            return Ok((first, None));
        }
        let labels = options
            .iter()
            .map(|o| format!("{}:{}", o.get_host(), o.get_port()))
            .collect();
        let hosts = Self {
            // One host: nothing to look for until it fails.
            stale: AtomicBool::new(options.len() > 1),
            options,
            labels,
            target: parsed.target,
            connect_timeout: settings.connect_timeout,
            applied: AtomicUsize::new(usize::MAX),
            found: AtomicUsize::new(0),
            looking: tokio::sync::Mutex::new(()),
            moves: tokio::sync::watch::Sender::new(0),
        };
        Ok((first, Some(Arc::new(hosts))))
    }

    /// Check every pooled connection before it is handed out (in place of sqlx's
    /// liveness ping: the same one round trip) against the target; every new one is
    /// checked by [`Hosts::on_connect`], which the store's own connect hook calls.
    pub(super) fn hooks(self: &Arc<Self>, pool: PgPoolOptions) -> PgPoolOptions {
        if self.target == TargetSession::Any {
            return pool;
        }
        let on_acquire = self.clone();
        pool.test_before_acquire(false)
            .before_acquire(move |conn, _| {
                let hosts = on_acquire.clone();
                Box::pin(async move {
                    let fits = hosts.fits(conn).await?;
                    if !fits {
                        tracing::warn!(
                            target_session_attrs = ?hosts.target,
                            "a pooled Postgres connection no longer fits (failover?): dropped"
                        );
                        hosts.lost();
                    }
                    Ok(fits)
                })
            })
    }

    /// A new connection to the pool's host that does not fit is swapped for one to the
    /// first host that does, which the pool then uses.
    pub(super) async fn on_connect(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.fits(conn).await? {
            return Ok(());
        }
        tracing::warn!(
            host = %self.labels[self.applied.load(Ordering::Relaxed)],
            target_session_attrs = ?self.target,
            "this Postgres host does not fit: looking for one that does"
        );
        match self.find().await {
            Ok((i, found)) => {
                let old = std::mem::replace(conn, found);
                let _ = old.close().await;
                self.found.store(i, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.lost();
                Err(sqlx::Error::Configuration(e.to_string().into()))
            }
        }
    }

    /// Before a use of the pool: after a failure, find the host again; after a hook
    /// found one, point the pool at it.
    pub(super) async fn ready(&self, pool: &PgPool) -> Result<(), StoreError> {
        if self.stale.load(Ordering::Relaxed) {
            let _one = self.looking.lock().await;
            if self.stale.load(Ordering::Relaxed) {
                let (i, conn) = self.find().await?;
                let _ = conn.close().await;
                self.found.store(i, Ordering::Relaxed);
                self.stale.store(false, Ordering::Relaxed);
            }
        }
        let found = self.found.load(Ordering::Relaxed);
        let before = self.applied.swap(found, Ordering::Relaxed);
        if before != found {
            tracing::info!(host = %self.labels[found], "Postgres: using this host from now on");
            pool.set_connect_options(self.options[found].clone());
            if before != usize::MAX {
                self.moves.send_modify(|n| *n += 1);
            }
        }
        Ok(())
    }

    /// Changes each time the pool moves to another host.
    pub(super) fn moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.moves.subscribe()
    }

    /// The pool's host failed us: the next use looks again.
    pub(super) fn lost(&self) {
        if self.options.len() > 1 {
            self.stale.store(true, Ordering::Relaxed);
        }
    }

    /// Whether an error says the pool's host is gone or no longer fits.
    pub(super) fn is_host_lost(e: &StoreError) -> bool {
        let StoreError::Db(e) = e else {
            return matches!(e, StoreError::NoAnswer(_));
        };
        match e {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::Configuration(_) => true,
            sqlx::Error::Database(d) => super::blame_of(&**d) == super::Blame::Host,
            _ => false,
        }
    }

    /// The first host, in the order given, that accepts a connection (each attempt
    /// bounded by `postgres.connect_timeout`) and fits the target.
    async fn find(&self) -> Result<(usize, PgConnection), StoreError> {
        for (i, options) in self.options.iter().enumerate() {
            let host = &self.labels[i];
            let attempt = async {
                let mut conn = options.connect().await?;
                if self.fits(&mut conn).await? {
                    Ok(Some(conn))
                } else {
                    let _ = conn.close().await;
                    Ok::<_, sqlx::Error>(None)
                }
            };
            match tokio::time::timeout(self.connect_timeout, attempt).await {
                Ok(Ok(Some(conn))) => return Ok((i, conn)),
                Ok(Ok(None)) => tracing::warn!(
                    host = %host,
                    target_session_attrs = ?self.target,
                    "this Postgres host does not fit; trying the next"
                ),
                Ok(Err(e)) => tracing::warn!(
                    host = %host,
                    error = %crate::telemetry::Chain(&e),
                    "cannot connect to this Postgres host; trying the next"
                ),
                Err(_) => tracing::warn!(
                    host = %host,
                    after = ?self.connect_timeout,
                    "this Postgres host did not answer; trying the next"
                ),
            }
        }
        Err(StoreError::NoHost {
            hosts: self.options.len(),
            target: self.target,
        })
    }

    /// Whether the server of `conn` meets the target (libpq: `read-write` asks
    /// `transaction_read_only`, `primary` asks `pg_is_in_recovery()`).
    async fn fits(&self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        if self.target == TargetSession::Any {
            return Ok(true);
        }
        let (read_only, in_recovery): (bool, bool) = sqlx::query_as(
            "SELECT current_setting('transaction_read_only') = 'on', pg_is_in_recovery()",
        )
        .fetch_one(conn)
        .await?;
        Ok(self.target.accepts(read_only, in_recovery))
    }
}
