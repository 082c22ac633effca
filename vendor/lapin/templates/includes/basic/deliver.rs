/// Server delivery of a message to a consumer.
///
/// Received internally and surfaced as [`crate::message::Delivery`] values via the
/// [`crate::Consumer`] stream.
