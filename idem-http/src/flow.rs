//! Where a request enters: its key, client and fingerprint are read, its scope is held in this
//! process, and it goes on to the path of its layer's [`Mode`].

use crate::key::{self, KeyError, Scope};
use crate::keyed::{self, Inner, Keyed, ResponseBody, Shared, answer};
use crate::mode::Mode;
use crate::problem::Problem;
use crate::telemetry::{self, Result as Seen};
use axum_core::body::Body;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::store::RuntimeStore;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument as _;

/// Handles one request of an idempotent route.
pub(crate) async fn handle<S, M, I, B>(
    shared: Arc<Shared<S>>,
    mode: M,
    inner: I,
    request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: RuntimeStore,
    M: Mode,
    I: Inner<B>,
    B: ResponseBody,
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
                let request = Request::from_parts(parts, body);
                return mode.unkeyed(&shared, inner, request).await;
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
            return Ok(keyed::in_progress(&keyed, Duration::from_secs(1)));
        };
        let request = Request::from_parts(parts, Body::from(body));
        mode.keyed(&keyed, inner, request).await
    }
    .instrument(span)
    .await
}

fn bad_key<S>(shared: &Shared<S>, error: &KeyError) -> Response<Body> {
    let problem = Problem::new(
        StatusCode::BAD_REQUEST,
        "Idempotency-Key required",
        error.to_string(),
    );
    answer(shared, Seen::BadKey, problem)
}
