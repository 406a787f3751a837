//! The contract between `#[idempotent]` and the pipeline: what every handler declares
//! ([`Handler`]), and the trait of its kind through which it is called ([`kind`]).

pub mod kind;

use crate::model::{
    Batch, BatchError, Context, Envelope, HandlerError, KeyError, KeySource, RejectReason,
    Rejection, VersionError, Versioned,
};
use crate::state::StateType;
use crate::store::{InboxStore, RuntimeStore};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::time::Duration;

/// The lease an external-mode handler gets unless it sets `lease = "..."`.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How a handler's work relates to the inbox row, as the runtime reports it; a handler's
/// [`Handler::Kind`] says it in its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// The handler writes in the inbox transaction: marker and writes commit together.
    Transactional,
    /// The handler calls something that cannot join a transaction (a payment API, a mailer).
    /// The key is claimed `in_progress` with a lease and committed first; the handler runs
    /// with the key to pass downstream; the row is then marked `completed` or `failed`. A
    /// consumer that dies mid-call leaves the lease to expire; the next copy takes over and
    /// calls again with the same key, which the downstream deduplicates.
    External {
        /// How long a claim holds the key before another copy may take it over. Longer than
        /// the handler ever runs.
        lease: Duration,
    },
}

/// An idempotent message handler: what every kind of handler declares. `#[idempotent]`
/// implements it, and the trait of the handler's kind ([`TransactionalHandler`],
/// [`ExternalHandler`] or [`BatchHandler`]), for each annotated function (on a unit struct)
/// and registers it. Implement them by hand only to build a handler the attribute cannot
/// express, and register it with `inventory::submit!(idem::handler::Registration::new(&MyHandler))`.
pub trait Handler: Send + Sync + 'static {
    /// The inbox store whose transaction the handler writes in.
    type Store: RuntimeStore;
    /// The decoded message body.
    type Payload: DeserializeOwned + Send;
    /// The handler's result, stored on the inbox row and replayed to duplicates.
    type Output: Serialize + DeserializeOwned + Send;
    /// The handler's kind ([`kind::Transactional`], [`kind::External`] or [`kind::Batch`]):
    /// the pipeline that runs it, and the trait through which it is called.
    type Kind: kind::Kind;

    /// The function's name.
    const NAME: &'static str;
    /// The consumer identity that scopes dedup keys.
    const CONSUMER: &'static str;
    /// The queue this handler consumes, when set.
    const QUEUE: Option<&'static str>;
    /// Where the dedup key comes from.
    const KEY: KeySource;
    /// How long this consumer's inbox rows are kept (`None`: the runtime's or the store's).
    const RETENTION: Option<Duration> = None;
    /// The deliveries per batch the handler asks for (`batch = N`), unless the runtime builder
    /// sets the handler's batch.
    const BATCH_SIZE: Option<usize> = None;

    /// The [`State`](crate::state::State) types the function's parameters ask for; `build()` refuses
    /// a runtime that lacks one. The function reads them with [`Context::state`].
    fn state_types() -> Vec<StateType> {
        Vec::new()
    }

    /// Decodes the body (JSON).
    fn decode(envelope: &Envelope) -> Result<Self::Payload, Rejection> {
        serde_json::from_slice(&envelope.body).map_err(|e| {
            Rejection::new(
                RejectReason::Decode,
                format!(
                    "body does not decode as JSON into `{}`: {e}",
                    std::any::type_name::<Self::Payload>()
                ),
                None,
            )
        })
    }

    /// Reads the dedup key from the envelope or the decoded payload.
    fn key(envelope: &Envelope, payload: &Self::Payload) -> Result<String, KeyError>;

    /// The entity and version of a versioned message (`#[idempotent(version = ..., entity =
    /// ...)]`); `None` for handlers that keep no versions.
    fn versioned(payload: &Self::Payload) -> Option<Result<Versioned, VersionError>> {
        let _ = payload;
        None
    }
}

/// A handler that writes in the inbox transaction, one message at a time: its writes and the
/// key's marker commit together.
pub trait TransactionalHandler: Handler<Kind = kind::Transactional> {
    /// Runs the user's function inside the inbox transaction.
    fn call<'a, 'c: 'a>(
        tx: &'a mut <Self::Store as InboxStore>::Tx<'c>,
        payload: Self::Payload,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send + 'a;
}

/// A handler that calls something that cannot join a transaction (a payment API, a mailer):
/// see [`Mode::External`].
pub trait ExternalHandler: Handler<Kind = kind::External> {
    /// How long a claim holds the key before another copy may take it over (`lease = "..."`):
    /// longer than the handler ever runs.
    const LEASE: Duration = DEFAULT_LEASE;

    /// Runs the user's function outside any transaction, with the key leased.
    fn call<'a>(
        payload: Self::Payload,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send + 'a;
}

/// A handler that takes the new messages of a batch at once (a parameter `idem::Batch<T>`), in
/// the inbox transaction.
pub trait BatchHandler: Handler<Kind = kind::Batch> {
    /// Runs the user's function on the new messages of a batch, in the inbox transaction; one
    /// result per message. `ctx` is the first message's (it carries the runtime's state), and
    /// holds each message's own ([`Context::item`]).
    fn call<'a, 'c: 'a>(
        tx: &'a mut <Self::Store as InboxStore>::Tx<'c>,
        batch: Batch<Self::Payload>,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Vec<Self::Output>, BatchError>> + Send + 'a;
}

/// What an `#[idempotent]` function may return: `Result<T, E>` with `E: Into<HandlerError>`
/// (the bounds on `T` are those of [`Handler::Output`]).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler result",
    label = "an #[idempotent] handler returns `Result<T, E>` with `E: Into<idem::HandlerError>`",
    note = "implement `From<YourError> for idem::HandlerError`, saying whether it is transient or permanent"
)]
pub trait HandlerResult {
    /// The success type.
    type Ok;
    /// Converts into the pipeline's form.
    fn into_handler_result(self) -> Result<Self::Ok, HandlerError>;
}

impl<T, E: Into<HandlerError>> HandlerResult for Result<T, E> {
    type Ok = T;

    fn into_handler_result(self) -> Result<T, HandlerError> {
        self.map_err(Into::into)
    }
}
