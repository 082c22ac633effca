//! The scan: everything that fires due rows, on the active node. One `TimeOut` (or one
//! delayed message) goes through it like this (docs/design/scan.md draws it):
//!
//! 1. [`task`]: the firing task runs for the daemon's whole life; while this node holds the
//!    lease it asks its [`pacer`] what to do and does it: start a batch, probe the due
//!    index. [`notice`] turns the database's `NOTIFY` of new and moved due times into
//!    pacer input; [`checks`] keeps a passive node's health honest.
//! 2. [`pacer`]: a pure state machine: which batch of which kind starts when, over which
//!    window of due times ([`pacer::Action`]).
//! 3. [`batch`]: one transaction: lock the due rows of one kind ([`row`]: what differs
//!    between kinds), hold each until its due time by the database's clock ([`clock`]),
//!    publish it (`bus::publish`), judge each row's fate alone, delete / charge / park
//!    (`store::settle`), commit. Large contents are read beside the sending ([`large`]).
//! 4. [`memory`]: what the scan keeps between batches about single rows.
//! 5. [`report`]: what a finished batch tells the metrics, the status and the logs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::bus::Bus;
use crate::config::Settings;
use crate::destinations::Destinations;
use crate::election::{Lease, LeaseView};
use crate::health::{Check, Health};
use crate::metrics::Metrics;
use crate::shutdown::Stopping;
use crate::status::Status;
use crate::store::{ApiRules, Store, StoreError, bounded};
use crate::wire::Message;
use crate::wire::sign::Signer;

mod batch;
mod checks;
mod clock;
mod large;
mod memory;
mod notice;
mod pacer;
mod report;
mod row;
mod task;

#[cfg(test)]
pub(crate) use batch::BatchError;
pub(crate) use memory::Memory;
pub(crate) use task::run;

/// What the firing task and its batches use: the store, the bus and the lease view the
/// node task publishes, the status, metrics and health they report to, the limits of a
/// batch and what the scan remembers about single rows.
pub(crate) struct Firing {
    pub(crate) settings: Arc<Settings>,
    pub(crate) node_id: Uuid,
    pub(crate) store: Store,
    pub(crate) bus: watch::Receiver<Option<Arc<Bus>>>,
    pub(crate) lease: watch::Receiver<LeaseView>,
    pub(crate) status: Arc<Status>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) health: Arc<Health>,
    pub(crate) stop: CancellationToken,
    /// How long the batches in flight may take to finish once stopping.
    pub(crate) stopping: Arc<Stopping>,
    pub(crate) limits: Limits,
    pub(crate) memory: Memory,
}

/// The limits of one batch, from the settings.
#[derive(Debug)]
pub(crate) struct Limits {
    batch_size: u32,
    retry_min: Duration,
    retry_max: Duration,
    /// Largest message body (`amqp.max_message_size`); larger contents stay in Postgres.
    max_message_size: usize,
    /// Bound on one batch from lock to commit (`Settings::batch_budget`).
    budget: Duration,
    confirm_timeout: Duration,
    /// Client-side bound on a database step (`statement_timeout` + `connect_timeout`).
    db_bound: Duration,
    /// Where TimeOuts may go, judged before each is sent (rows written directly
    /// bypass the SQL door's check).
    timeouts: Destinations,
    /// Where delayed messages may go, judged again before each is sent.
    delayed: Destinations,
    /// What the SQL door allows, from the same settings.
    api_rules: Option<ApiRules>,
    /// Signs each message last, when `amqp.signing_key` is set.
    signer: Option<Signer>,
}

impl Limits {
    pub(crate) fn new(settings: &Settings) -> Self {
        let max = settings.amqp.max_message_size.as_u64();
        Self {
            batch_size: settings.scan.batch_size,
            retry_min: settings.scan.retry_min,
            retry_max: settings.scan.retry_max,
            max_message_size: usize::try_from(max).unwrap_or(usize::MAX),
            budget: settings.batch_budget(),
            confirm_timeout: settings.amqp.confirm_timeout,
            db_bound: settings.db_bound(),
            timeouts: settings.timeout_destinations().unwrap_or_else(|e| {
                tracing::error!(error = %e, "TimeOuts will be held, not published");
                Destinations::nowhere()
            }),
            delayed: settings.delay_destinations().unwrap_or_else(|e| {
                tracing::error!(error = %e, "delayed messages will be held, not delivered");
                Destinations::nowhere()
            }),
            api_rules: ApiRules::new(settings),
            signer: Signer::from_settings(settings),
        }
    }

    /// `m` with its signature header, when messages are signed: added to its final
    /// properties, before the bus measures and publishes it.
    fn signed(&self, mut m: Message) -> Message {
        if let Some(signer) = &self.signer {
            signer.sign(&mut m);
        }
        m
    }
}

impl Firing {
    /// The lease right now, from the view the node task published: no lock, no wait.
    fn lease(&self) -> Lease {
        self.lease.borrow().check(Instant::now())
    }

    /// A database step: bounded on the client, and reported to the node's health while
    /// under way.
    async fn db<T>(
        &self,
        limit: Duration,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let _under_way = self.health.step(Check::Postgres);
        bounded(limit, step).await
    }
}
