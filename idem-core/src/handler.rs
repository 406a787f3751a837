//! The contract between `#[idempotent]` and the pipeline.

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

/// How a handler's work relates to the inbox row.
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

/// An idempotent message handler. `#[idempotent]` implements this for each annotated function
/// (on a unit struct) and registers it; implement it by hand only to build a handler the
/// attribute cannot express, and register it with
/// `inventory::submit!(idem::Registration::new(&MyHandler))`.
pub trait Handler: Send + Sync + 'static {
    /// The inbox store whose transaction the handler writes in.
    type Store: RuntimeStore;
    /// The decoded message body.
    type Payload: DeserializeOwned + Send;
    /// The handler's result, stored on the inbox row and replayed to duplicates.
    type Output: Serialize + DeserializeOwned + Send;

    /// The function's name.
    const NAME: &'static str;
    /// The consumer identity that scopes dedup keys.
    const CONSUMER: &'static str;
    /// The queue this handler consumes, when set.
    const QUEUE: Option<&'static str>;
    /// Where the dedup key comes from.
    const KEY: KeySource;
    /// Transactional (the default) or external.
    const MODE: Mode = Mode::Transactional;
    /// How long this consumer's inbox rows are kept (`None`: the runtime's or the store's).
    const RETENTION: Option<Duration> = None;
    /// Whether the function takes the new messages of a batch at once ([`Handler::call_batch`],
    /// a parameter `idem::Batch<T>`) instead of one message ([`Handler::call`]).
    const TAKES_BATCH: bool = false;
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

    /// Runs the user's function inside the inbox transaction.
    fn call<'a, 'c: 'a>(
        tx: &'a mut <Self::Store as InboxStore>::Tx<'c>,
        payload: Self::Payload,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send + 'a;

    /// Runs a batch handler's function ([`Handler::TAKES_BATCH`]) on the new messages of a batch,
    /// in the inbox transaction; one result per message. `ctx` is the first message's (it
    /// carries the runtime's state). Single-message handlers keep this default, which refuses.
    fn call_batch<'a, 'c: 'a>(
        tx: &'a mut <Self::Store as InboxStore>::Tx<'c>,
        batch: Batch<Self::Payload>,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Vec<Self::Output>, BatchError>> + Send + 'a {
        let _ = (tx, batch, ctx);
        async {
            Err(BatchError::Batch(HandlerError::permanent(
                "this handler takes one message at a time",
            )))
        }
    }

    /// Runs the user's function outside any transaction ([`Mode::External`]). Handlers of the
    /// transactional mode keep this default, which refuses.
    fn call_external<'a>(
        payload: Self::Payload,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send + 'a {
        let _ = (payload, ctx);
        async {
            Err(HandlerError::permanent(
                "this handler runs in a transaction (mode = \"transactional\")",
            ))
        }
    }
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
