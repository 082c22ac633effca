use crate::{
    Error, ErrorKind, Result,
    channel_receiver_state::{ChannelReceiverStates, DeliveryCause},
    channel_recovery_context::ChannelRecoveryContext,
    error_holder::ErrorHolder,
    internal_rpc::InternalRPCHandle,
    killswitch::KillSwitch,
    notifier::Notifier,
    topology::ChannelDefinition,
    types::{ChannelId, Identifier, PayloadSize, ShortUInt},
};
use std::{
    fmt,
    sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard},
};
use tracing::trace;

/// Shared, cheaply cloneable view of a channel's current state.
///
/// Obtained from [`Channel::status`].
///
/// [`Channel::status`]: crate::Channel::status
#[derive(Clone)]
pub struct ChannelStatus(Arc<RwLock<Inner>>);

impl ChannelStatus {
    pub(crate) fn new(id: ChannelId, internal_rpc: InternalRPCHandle) -> Self {
        Self(Arc::new(RwLock::new(Inner::new(id, internal_rpc))))
    }

    /// Returns `true` if the channel is in the process of opening (not yet ready).
    #[must_use]
    pub fn initializing(&self) -> bool {
        [ChannelState::Initial, ChannelState::Reconnecting].contains(&self.read().state)
    }

    /// Returns `true` if the channel is in the process of closing or reconnecting.
    #[must_use]
    pub fn closing(&self) -> bool {
        [ChannelState::Closing, ChannelState::Reconnecting].contains(&self.read().state)
    }

    /// Returns `true` if the channel is in [`ChannelState::Connected`] and ready for use.
    #[must_use]
    pub fn connected(&self) -> bool {
        self.read().state == ChannelState::Connected
    }

    /// Returns `true` if the channel is waiting for the connection to be recovered.
    #[must_use]
    pub fn reconnecting(&self) -> bool {
        self.read().state == ChannelState::Reconnecting
    }

    pub(crate) fn connected_or_recovering(&self) -> bool {
        [ChannelState::Connected, ChannelState::Reconnecting].contains(&self.read().state)
    }

    pub(crate) fn update_recovery_context<R, F: Fn(&mut ChannelRecoveryContext) -> R>(
        &self,
        apply: F,
    ) -> Option<R> {
        Some(apply(self.write().recovery_context.as_mut()?))
    }

    pub(crate) fn finalize_connection(&self) {
        self.write().finalize_connection();
    }

    pub(crate) fn can_receive_messages(&self) -> bool {
        [
            ChannelState::Closing,
            ChannelState::Connected,
            ChannelState::Reconnecting,
        ]
        .contains(&self.read().state)
    }

    /// Returns `true` if publisher confirms are enabled on this channel.
    #[must_use]
    pub fn confirm(&self) -> bool {
        self.read().confirm
    }

    pub(crate) fn set_confirm(&self) {
        let mut inner = self.write();
        inner.confirm = true;
        trace!("Publisher confirms activated");
        inner.finalize_connection();
    }

    /// Returns the quality-of-service settings currently applied to this channel.
    ///
    /// These are the settings the broker has confirmed through
    /// [`Channel::basic_qos`](crate::Channel::basic_qos); they are replayed as-is
    /// when the channel is recovered.
    #[must_use]
    pub fn qos(&self) -> ChannelQos {
        self.read().qos
    }

    pub(crate) fn set_qos(&self, prefetch_count: ShortUInt, global: bool) {
        let mut inner = self.write();
        if global {
            inner.qos.global_prefetch_count = Some(prefetch_count);
        } else {
            inner.qos.prefetch_count = Some(prefetch_count);
        }
        trace!(prefetch_count, global, "QoS updated");
    }

    pub(crate) fn set_state(&self, state: ChannelState) {
        self.write().state = state;
    }

    pub(crate) fn state_error(&self, context: &'static str) -> Error {
        let inner = self.read();
        let error = Error::from(ErrorKind::InvalidChannelState(inner.state, context));
        if inner.state == ChannelState::Reconnecting {
            return error.with_notifier(inner.notifier());
        }
        error
    }

    pub(crate) fn set_reconnecting(&self, error: Error, topology: ChannelDefinition) -> Error {
        self.write().set_reconnecting(error, topology)
    }

    /// Makes every acker of this channel's deliveries so far unusable, and records `error` as the
    /// reason. The first error recorded is kept: it is the one that ended the channel.
    ///
    /// Callers poison the ackers before changing the channel's state. An ack that then fails on
    /// the new state is sure to find the reason recorded.
    pub(crate) fn poison_ackers(&self, error: Error) {
        let _ = self.read().ackers.set(error);
    }

    pub(crate) fn auto_close(&self, id: ChannelId) -> bool {
        id != 0 && self.connected()
    }

    #[cfg(test)]
    pub(crate) fn receiver_state(&self) -> crate::channel_receiver_state::ChannelReceiverState {
        self.write().receiver_state.receiver_state()
    }

    pub(crate) fn set_will_receive(
        &self,
        class_id: Identifier,
        delivery_cause: DeliveryCause,
    ) -> ErrorHolder {
        let mut inner = self.write();
        inner
            .receiver_state
            .set_will_receive(class_id, delivery_cause);
        inner.ackers.clone()
    }

    pub(crate) fn set_content_length<
        Handler: FnOnce(&DeliveryCause, bool),
        OnInvalidClass: FnOnce(String) -> Result<()>,
        OnError: FnOnce(String) -> Result<()>,
    >(
        &self,
        channel_id: ChannelId,
        class_id: Identifier,
        length: PayloadSize,
        handler: Handler,
        invalid_class_hanlder: OnInvalidClass,
        error_handler: OnError,
    ) -> Result<()> {
        let mut inner = self.write();
        let confirm_mode = inner.confirm;
        inner.receiver_state.set_content_length(
            channel_id,
            class_id,
            length,
            handler,
            invalid_class_hanlder,
            error_handler,
            confirm_mode,
        )
    }

    pub(crate) fn receive<
        Handler: FnOnce(&DeliveryCause, PayloadSize, bool),
        OnError: FnOnce(String) -> Result<()>,
    >(
        &self,
        channel_id: ChannelId,
        length: PayloadSize,
        handler: Handler,
        error_handler: OnError,
    ) -> Result<()> {
        let mut inner = self.write();
        let confirm_mode = inner.confirm;
        inner
            .receiver_state
            .receive(channel_id, length, handler, error_handler, confirm_mode)
    }

    pub(crate) fn set_send_flow(&self, flow: bool) {
        self.write().send_flow = flow;
    }

    pub(crate) fn flow(&self) -> bool {
        self.read().send_flow
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// The quality-of-service settings applied to a channel.
///
/// `prefetch_size` is not part of this struct: lapin always sends `0` (no
/// limit) for it, as RabbitMQ does not implement it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelQos {
    /// Per-consumer prefetch count (`global: false`), if it has been set.
    pub prefetch_count: Option<ShortUInt>,
    /// Channel-wide prefetch count (`global: true`), if it has been set.
    pub global_prefetch_count: Option<ShortUInt>,
}

/// The lifecycle state of an AMQP channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChannelState {
    /// The channel has been created but `Channel.Open` has not been sent yet.
    #[default]
    Initial,
    /// The channel is waiting for the connection to be recovered after an error.
    Reconnecting,
    /// The channel is open and ready for AMQP operations.
    Connected,
    /// `Channel.Close` has been sent; waiting for `Channel.Close-Ok`.
    Closing,
    /// The channel has been closed normally.
    Closed,
    /// The channel has been closed due to a protocol error.
    Error,
}

impl fmt::Debug for ChannelStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("ChannelStatus");
        if let Ok(inner) = self.0.try_read() {
            debug
                .field("state", &inner.state)
                .field("receiver_state", &inner.receiver_state)
                .field("confirm", &inner.confirm)
                .field("qos", &inner.qos)
                .field("send_flow", &inner.send_flow);
        }
        debug.finish()
    }
}

struct Inner {
    id: ChannelId,
    confirm: bool,
    qos: ChannelQos,
    send_flow: bool,
    state: ChannelState,
    receiver_state: ChannelReceiverStates,
    recovery_context: Option<ChannelRecoveryContext>,
    /// Gates this incarnation's internal RPC commands. Killed when the channel starts recovering.
    killswitch: KillSwitch,
    /// Poisons the ackers of this incarnation's deliveries. Set to the channel's error when the
    /// channel starts recovering, is closed, or fails.
    ackers: ErrorHolder,
    internal_rpc: InternalRPCHandle,
}

impl Inner {
    fn new(id: ChannelId, internal_rpc: InternalRPCHandle) -> Self {
        let this = Self {
            id,
            confirm: false,
            qos: ChannelQos::default(),
            send_flow: true,
            state: ChannelState::default(),
            receiver_state: ChannelReceiverStates::default(),
            recovery_context: None,
            killswitch: KillSwitch::default(),
            ackers: ErrorHolder::default(),
            internal_rpc,
        };
        this.update_rpc_status();
        this
    }

    fn update_rpc_status(&self) {
        self.internal_rpc
            .set_channel_status(self.id, self.killswitch.clone());
    }

    fn set_reconnecting(&mut self, error: Error, topology: ChannelDefinition) -> Error {
        self.state = ChannelState::Reconnecting;
        std::mem::take(&mut self.killswitch).kill();
        self.receiver_state.reset();
        let cause = match self.recovery_context.as_ref() {
            Some(ctx) => ctx.cause(),
            None => {
                let ctx = ChannelRecoveryContext::new(error, topology);
                let error = ctx.cause();
                self.recovery_context = Some(ctx);
                error
            }
        };
        let _ = std::mem::take(&mut self.ackers).set(cause.clone());
        cause
    }

    pub(crate) fn finalize_connection(&mut self) {
        self.state = ChannelState::Connected;
        self.update_rpc_status();
        if let Some(ctx) = self.recovery_context.take() {
            ctx.finalize_recovery();
        }
    }

    fn notifier(&self) -> Option<Notifier> {
        Some(self.recovery_context.as_ref()?.notifier())
    }
}
