//! Where a request enters: its key, client and fingerprint are read, its scope is held in this
//! process, and it goes on to the transactional or the external path; and what both paths
//! share (replays, reading the response).

use crate::config::HttpMode;
use crate::key::{self, KeyError, Scope};
use crate::layer::Shared;
use crate::problem::Problem;
use crate::stored::StoredResponse;
use crate::telemetry::{self, Result as Seen};
use crate::{external, transactional};
use axum_core::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::{Fingerprint, InboxStore, StoreError, StoredOutput};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tower_service::Service;
use tracing::Instrument as _;

/// A request on its way through the layer: what both paths need.
pub(crate) struct Keyed<'a, S> {
    pub(crate) shared: &'a Shared<S>,
    pub(crate) scope: Scope,
    pub(crate) fingerprint: Fingerprint,
}

impl<S: InboxStore> Keyed<'_, S> {
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
        tracing::warn!(error = %error, "idempotency store failed; the request was not executed");
        self.problem(
            Seen::Unavailable,
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                "the request was not executed; retry it with the same Idempotency-Key",
            )
            .retry_after(Duration::from_secs(1)),
        )
    }

    /// The answer to a key that is already recorded with `stored` (fingerprint) and `output`:
    /// the stored response, or 422 when the key was used for another request.
    pub(crate) fn replay(
        &self,
        stored: &Fingerprint,
        output: Option<&StoredOutput>,
    ) -> Response<Body> {
        if *stored != self.fingerprint {
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

/// Handles one request of an idempotent route.
pub(crate) async fn handle<S, I, B>(
    shared: Arc<Shared<S>>,
    inner: I,
    request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: InboxStore,
    I: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Send,
    I::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum_core::BoxError>,
{
    let span = tracing::info_span!(
        "idem.http",
        operation = %shared.config.operation,
        key = tracing::field::Empty,
        result = tracing::field::Empty,
    );
    async move {
        let config = &shared.config;
        let (parts, body) = request.into_parts();
        let key = match key::read(&parts, config.max_key_len) {
            Ok(Some(key)) => key,
            Ok(None) if !config.required => {
                telemetry::request(&config.operation, Seen::Unkeyed);
                return call(inner, Request::from_parts(parts, body))
                    .await
                    .map(|r| r.map(Body::new));
            }
            Ok(None) => return Ok(bad_key(&shared, &KeyError::Missing)),
            Err(e) => return Ok(bad_key(&shared, &e)),
        };
        tracing::Span::current().record("key", key.as_str());
        let client = match &config.identity {
            Some(identity) => match identity(&parts) {
                Some(client) => Some(client),
                None => {
                    let problem = Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "Client unknown",
                        "this operation scopes Idempotency-Keys by client, and the request names none",
                    );
                    return Ok(answer(&shared, Seen::Anonymous, problem));
                }
            },
            None => None,
        };
        let body = match Limited::new(body, config.max_request_bytes).collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => {
                let detail = format!(
                    "the body is larger than the {} bytes this operation accepts",
                    config.max_request_bytes
                );
                return Ok(answer(
                    &shared,
                    Seen::TooLarge,
                    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "Request too large", detail),
                ));
            }
            Err(e) => {
                let detail = format!("the request body could not be read: {e}");
                return Ok(answer(
                    &shared,
                    Seen::BadKey,
                    Problem::new(StatusCode::BAD_REQUEST, "Unreadable request", detail),
                ));
            }
        };
        let keyed = Keyed {
            shared: &shared,
            scope: Scope::new(&config.operation, client.as_deref(), &key),
            fingerprint: key::fingerprint(&parts, &body),
        };
        let Some(_flight) = shared.in_flight.enter(&keyed.scope) else {
            return Ok(in_progress(&keyed, Duration::from_secs(1)));
        };
        let request = Request::from_parts(parts, Body::from(body));
        match config.mode {
            HttpMode::Transactional => transactional::run(&keyed, inner, request).await,
            HttpMode::External { lease } => external::run(&keyed, lease, inner, request).await,
        }
    }
    .instrument(span)
    .await
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
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum_core::BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(body) => Read::Whole(body.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Read::TooLarge,
        Err(e) => Read::Failed(e),
    }
}

fn bad_key<S>(shared: &Shared<S>, error: &KeyError) -> Response<Body> {
    let problem = Problem::new(
        StatusCode::BAD_REQUEST,
        "Idempotency-Key required",
        error.to_string(),
    );
    answer(shared, Seen::BadKey, problem)
}

fn answer<S>(shared: &Shared<S>, seen: Seen, problem: Problem) -> Response<Body> {
    let config = &shared.config;
    telemetry::request(&config.operation, seen);
    problem.into_response(config.policy.as_deref(), config.retention)
}
