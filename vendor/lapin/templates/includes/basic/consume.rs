/// Register a consumer on a queue.
///
/// Use the higher-level [`Channel::basic_consume`] wrapper instead of calling
/// this method directly.
///
/// [`Channel::basic_consume`]: crate::Channel::basic_consume
