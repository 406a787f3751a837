//! How a relay learns that rows were staged outside any handler: the database's notifications
//! (PostgreSQL `LISTEN`/`NOTIFY`, see `Dialect::listen`) wake it ([`Wake`]).

use std::sync::atomic::{AtomicBool, Ordering};

/// The channel PostgreSQL notifications of staged rows go to; the payload names the outbox.
#[cfg(feature = "postgres")]
pub const CHANNEL: &str = "idem_outbox";

/// The wake-ups of an inbox's relay: set by the database's notifications, where it sends them.
#[derive(Debug, Default)]
pub struct Wake {
    /// A permit per notification (one is kept while nobody waits).
    pub notify: tokio::sync::Notify,
    /// Whether a listener was started.
    listening: AtomicBool,
}

impl Wake {
    /// `true` the first time: the caller starts the listener.
    pub(crate) fn start(&self) -> bool {
        !self.listening.swap(true, Ordering::AcqRel)
    }
}
