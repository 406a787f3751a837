//! The contract between `#[idempotent]` and the pipeline.

use crate::context::Context;
use crate::envelope::Envelope;
use crate::error::HandlerError;
use crate::key::{KeyError, KeySource};
use crate::outcome::{RejectReason, Rejection};
use crate::store::InboxStore;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;

/// An idempotent message handler. `#[idempotent]` implements this for each annotated function;
/// implement it by hand only to build a handler the attribute cannot express.
pub trait Handler: Send + Sync + 'static {
    /// The inbox store whose transaction the handler writes in.
    type Store: InboxStore;
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

    /// Runs the user's function inside the inbox transaction.
    fn call<'a>(
        tx: &'a mut <Self::Store as InboxStore>::Tx,
        payload: Self::Payload,
        ctx: &'a Context<'a>,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send + 'a;
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
