//! [`RuntimeError`]: a wrong configuration, or a start that failed.

use crate::model::StoreError;
use crate::registry::RegistryError;
use crate::store::StoreKind;
use crate::transport::TransportError;

/// A wrong runtime configuration or a failed start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// No transport was configured.
    #[error(
        "no transport: call .transport(...) on the runtime builder, with idem::rabbitmq::RabbitTransport::new(RabbitConfig::new(url)) or idem::MemoryTransport::new()"
    )]
    NoTransport,
    /// No handler is registered or selected.
    #[error("no handlers: annotate an async fn with #[idempotent(queue = \"...\", ...)]")]
    NoHandlers,
    /// A handler has no queue to consume.
    #[error("handler `{consumer}` has no queue: add queue = \"...\" to its #[idempotent]")]
    NoQueue {
        /// The handler's consumer identity.
        consumer: &'static str,
    },
    /// A handler's store is missing.
    #[error(
        "handler `{consumer}` writes to {store}, but the runtime has no {store} store: add one with .store({constructor}::new(pool))",
        constructor = .store.constructor()
    )]
    MissingStore {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// The store it needs.
        store: StoreKind,
    },
    /// A handler asks for state that was not given.
    #[error(
        "handler `{handler}` (consumer \"{consumer}\") asks for state of type `{state}`, but the runtime has none: give it with .state(value) on the runtime builder (state given: {given})"
    )]
    MissingState {
        /// The handler's function.
        handler: &'static str,
        /// Its consumer identity.
        consumer: &'static str,
        /// The type it asks for.
        state: &'static str,
        /// The types given, for the message.
        given: String,
    },
    /// A chosen handler is not registered.
    #[error("no registered handler has consumer = \"{0}\"")]
    UnknownHandler(String),
    /// Two handlers share a consumer.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Two handlers consume one queue: each would get only some of its messages.
    #[error(
        "handlers `{first}` and `{second}` both consume queue \"{queue}\": each would get only some of its messages; give each its own queue (bind both queues to one exchange for publish/subscribe)"
    )]
    SharedQueue {
        /// The queue.
        queue: String,
        /// One handler's function.
        first: &'static str,
        /// The other's.
        second: &'static str,
    },
    /// A handler's inbox is not usable (for example, its table was never migrated).
    #[error(
        "the inbox of handler `{consumer}` is not usable: {error}; run the store's migrate() (or idem::sql::migrate(&pool)) before starting"
    )]
    Store {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// What the store said.
        #[source]
        error: StoreError,
    },
    /// A handler's store runs with settings under which a commit can be lost after its message
    /// was acked, and the store was told to refuse them (`idem::sql::Durability::Require`).
    #[error("the store of handler `{consumer}` refuses to start: {error}")]
    StoreSettings {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// What the store found.
        #[source]
        error: StoreError,
    },
    /// A handler's inbox could not be reached within the start deadline (the database is
    /// down, or restarting).
    #[error(
        "the inbox of handler `{consumer}` could not be reached within {waited:?}: {error}; start the database or check its URL (DATABASE_URL), or wait longer with .start_deadline(…)"
    )]
    StoreUnreachable {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// How long start-up waited.
        waited: std::time::Duration,
        /// What the store said last.
        #[source]
        error: StoreError,
    },
    /// A setting is out of range or contradicts another.
    #[error("invalid setting `{setting}`: {problem}")]
    Setting {
        /// The setting to change (`prefetch`, `retention`, `batch`, …).
        setting: &'static str,
        /// What is wrong with it, and what to change.
        problem: String,
    },
    /// The transport refused the topology or could not connect.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl RuntimeError {
    pub(crate) fn setting(setting: &'static str, problem: impl Into<String>) -> Self {
        Self::Setting {
            setting,
            problem: problem.into(),
        }
    }
}
