//! What a handler may know about the delivery it is processing.

use super::envelope::{Envelope, HeaderValue};
use crate::state::{self, State};

/// The delivery a handler is processing, passed as an optional parameter after the payload
/// (`ctx: &idem::Context<'_>`), with the runtime's [`State`].
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    envelope: &'a Envelope,
    consumer: &'a str,
    key: &'a str,
    state: &'a State,
}

impl<'a> Context<'a> {
    /// A context for `envelope`, processed by `consumer` under dedup key `key`. The runtime
    /// builds these; tests that call a handler directly can too.
    pub fn new(envelope: &'a Envelope, consumer: &'a str, key: &'a str) -> Self {
        Self {
            envelope,
            consumer,
            key,
            state: &state::EMPTY,
        }
    }

    /// This context with `state` (a context from [`Context::new`] holds none).
    pub fn with_state(self, state: &'a State) -> Self {
        Self { state, ..self }
    }

    /// The runtime's state value of type `T` (what a handler parameter `&T` receives).
    pub fn state<T: Send + Sync + 'static>(&self) -> Option<&'a T> {
        self.state.get()
    }

    /// The dedup key of this message. Pass it downstream as an idempotency key so the next
    /// tier can deduplicate too.
    pub fn idempotency_key(&self) -> &'a str {
        self.key
    }

    /// The consumer identity that scopes the key.
    pub fn consumer(&self) -> &'a str {
        self.consumer
    }

    /// The message id property.
    pub fn message_id(&self) -> Option<&'a str> {
        self.envelope.message_id.as_deref()
    }

    /// The correlation id property.
    pub fn correlation_id(&self) -> Option<&'a str> {
        self.envelope.correlation_id.as_deref()
    }

    /// A header by exact name.
    pub fn header(&self, name: &str) -> Option<&'a HeaderValue> {
        self.envelope.headers.get(name)
    }

    /// Which delivery attempt this is, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.envelope.attempt
    }

    /// The whole envelope.
    pub fn envelope(&self) -> &'a Envelope {
        self.envelope
    }
}
