//! What the transactional and the external path share: the layer's state, the request's
//! scope and fingerprint, replays, the layer's own answers, calling the handler and reading
//! its response.

use crate::inflight::InFlight;
use crate::key::Scope;
use crate::problem::Problem;
use crate::settings::Settings;
use crate::stored::StoredResponse;
use crate::telemetry::{self, Result as Seen};
use axum_core::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::{
    model::Fingerprint, model::StoreError, store::ClaimRequest, store::InboxStore, store::Refusal,
};
use std::convert::Infallible;
use std::time::Duration;
use tower_service::Service;

/// The handler a layer wraps: a service answering `Response<B>` (axum's routes are).
pub trait Inner<B>:
    Service<Request<Body>, Response = Response<B>, Error = Infallible, Future: Send> + Send
{
}

impl<T, B> Inner<B> for T where
    T: Service<Request<Body>, Response = Response<B>, Error = Infallible, Future: Send> + Send
{
}

/// The body of a handler's response.
pub trait ResponseBody:
    http_body::Body<Data = Bytes, Error: Into<axum_core::BoxError>> + Send + 'static
{
}

impl<T> ResponseBody for T where
    T: http_body::Body<Data = Bytes, Error: Into<axum_core::BoxError>> + Send + 'static
{
}

/// What every request of one layer shares.
pub struct Shared<S> {
    pub(crate) config: Settings<S>,
    pub(crate) in_flight: InFlight,
}

/// A request on its way through the layer: what both paths need.
pub struct Keyed<'a, S> {
    pub(crate) shared: &'a Shared<S>,
    pub(crate) scope: Scope,
    pub(crate) fingerprint: Fingerprint,
}

impl<S: InboxStore> Keyed<'_, S> {
    /// The inbox claim of this request's key.
    pub(crate) fn claim_request(&self) -> ClaimRequest<'_> {
        ClaimRequest {
            consumer: &self.scope.consumer,
            key: &self.scope.key,
            fingerprint: &self.fingerprint,
            attempt: 1,
            retention: self.shared.config.retention,
        }
    }

    /// The layer's operation.
    pub(crate) fn operation(&self) -> &str {
        &self.shared.config.operation
    }

    /// Counts the request and answers `problem`.
    pub(crate) fn problem(&self, seen: Seen, problem: Problem) -> Response<Body> {
        answer(self.shared, seen, problem)
    }

    /// The store failed: 503, nothing recorded.
    pub(crate) fn unavailable(&self, error: &StoreError) -> Response<Body> {
        unavailable(self.shared, error)
    }

    /// The answer to a request the inbox refused to run ([`Refusal`], judged in core as for
    /// every entry point): 409 while the same request runs elsewhere, the stored response to
    /// the same request, 422 when the key was used for a different request.
    pub(crate) fn refused(&self, refusal: Refusal) -> Response<Body> {
        let output = match refusal {
            Refusal::Busy { remaining } => {
                return in_progress(self, remaining.unwrap_or(Duration::from_secs(1)));
            }
            Refusal::Conflict { .. } => {
                return self.problem(
                    Seen::Mismatch,
                    Problem::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Idempotency-Key reused",
                        "this Idempotency-Key was used for a different request (method, path or \
                         body); use a new key for a new request",
                    ),
                );
            }
            Refusal::Duplicate { output } | Refusal::Failed { output } => output,
        };
        let replay = output
            .and_then(|output| output.decode::<StoredResponse>().ok())
            .and_then(|stored| stored.replay());
        match replay {
            Some(response) => {
                telemetry::request(self.operation(), Seen::Replayed);
                response
            }
            None => self.problem(
                Seen::Unavailable,
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Stored response unreadable",
                    "this Idempotency-Key is recorded, but its stored response cannot be read",
                ),
            ),
        }
    }
}

/// The store failed: 503, nothing executed or recorded.
pub(crate) fn unavailable<S>(shared: &Shared<S>, error: &StoreError) -> Response<Body> {
    tracing::warn!(error = %error, "idempotency store failed; the request was not executed");
    let problem = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "Idempotency store unavailable",
        "the request was not executed; retry it with the same Idempotency-Key",
    )
    .retry_after(Duration::from_secs(1));
    answer(shared, Seen::Unavailable, problem)
}

/// Calls the handler.
pub(crate) async fn call<I, B>(
    mut inner: I,
    request: Request<Body>,
) -> Result<Response<B>, Infallible>
where
    I: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    inner.call(request).await
}

/// The same key is being executed: 409, try again after `after`.
pub(crate) fn in_progress<S: InboxStore>(keyed: &Keyed<'_, S>, after: Duration) -> Response<Body> {
    keyed.problem(
        Seen::InProgress,
        Problem::new(
            StatusCode::CONFLICT,
            "Request in progress",
            "a request with this Idempotency-Key is still being executed; retry it later",
        )
        .retry_after(after),
    )
}

/// A response body read whole, or why not.
pub(crate) enum Read {
    /// The body.
    Whole(Bytes),
    /// Larger than the limit.
    TooLarge,
    /// The body failed while it was read.
    Failed(axum_core::BoxError),
}

/// Reads a response body up to `limit` bytes.
pub(crate) async fn read<B>(body: B, limit: usize) -> Read
where
    B: ResponseBody,
{
    match Limited::new(body, limit).collect().await {
        Ok(body) => Read::Whole(body.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Read::TooLarge,
        Err(e) => Read::Failed(e),
    }
}

pub(crate) fn answer<S>(shared: &Shared<S>, seen: Seen, problem: Problem) -> Response<Body> {
    let config = &shared.config;
    telemetry::request(&config.operation, seen);
    problem.into_response(config.policy.as_deref(), config.retention)
}
