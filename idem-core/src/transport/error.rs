//! What can go wrong in a transport, said so that the user knows what to change.

use crate::model::BoxError;

/// A transport failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Topology exists with other arguments, or could not be declared.
    #[error("topology of `{queue}`, {action}: {source}")]
    Topology {
        /// The queue or exchange concerned.
        queue: String,
        /// What was being done, and what to change if it was refused.
        action: &'static str,
        /// What the broker said.
        #[source]
        source: BoxError,
    },
    /// The broker could not be reached or the connection failed.
    #[error(
        "cannot reach the broker at {broker}: {source}; start it or set its URL ({url_variable})"
    )]
    Connection {
        /// The broker's URL, without its password.
        broker: String,
        /// The environment variable that sets the URL (`AMQP_URL`).
        url_variable: &'static str,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The broker took the connection but did not answer in time, or not yet (JetStream still
    /// recovering its store, a cluster without a leader): waiting may mend it.
    #[error(
        "topology of `{queue}`, {action}: the broker did not answer ({source}); it may still be starting or without a leader"
    )]
    NotAnswering {
        /// The queue or exchange concerned.
        queue: String,
        /// What was being done.
        action: &'static str,
        /// What the client said.
        #[source]
        source: BoxError,
    },
    /// A settlement could not be sent (the channel is gone); the broker redelivers.
    #[error("settle: {0}")]
    Settle(#[source] BoxError),
    /// The transport does not do this.
    #[error("this transport does not support {0}")]
    Unsupported(&'static str),
}
