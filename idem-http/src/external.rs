//! External mode: the key is leased `in_progress` in a transaction of its own before the
//! handler runs, and settled with the response after it, through the runtime's own lease
//! state machine ([`LeasedRun`]). A lease left by a crash is taken over once it expires.

use crate::keyed::{self, Inner, Keyed, Read, ResponseBody};
use crate::stored::StoredResponse;
use crate::telemetry::{self, Result as Seen};
use crate::tx::Execution;
use axum_core::body::Body;
use http::{Request, Response};
use idem_core::store::{LeasedRun, Leasing};
use idem_core::{model::StoredOutput, store::LeaseEnd, store::LeaseStore};
use std::convert::Infallible;
use std::time::Duration;

/// Runs one keyed request in external mode.
pub(crate) async fn run<S, I, B>(
    keyed: &Keyed<'_, S>,
    lease: Duration,
    inner: I,
    request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: LeaseStore,
    I: Inner<B>,
    B: ResponseBody,
{
    let store = &keyed.shared.config.store;
    let claim = keyed.claim_request();
    let owner = format!("http-{}", idem_core::store::owner_token());
    let run = match LeasedRun::take(store, &claim, owner, lease).await {
        Ok(Leasing::Run(run)) => run,
        Ok(Leasing::Refused(refusal)) => return Ok(keyed.refused(refusal)),
        Err(e) => return Ok(keyed.unavailable(&e)),
    };
    if run.attempts() > 1 {
        tracing::info!(
            attempts = run.attempts(),
            "took over an expired lease: the request runs again"
        );
    }
    let response = keyed::call(inner, request).await?;
    let (parts, body) = response.into_parts();
    if parts.extensions.get::<Execution>() == Some(&Execution::NotBegun) {
        // Refused before execution: the key is freed for a corrected request, while this
        // request still holds it (a retry may have taken it over, and completed it, meanwhile).
        match run.abandon().await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!("the key was taken over while this request ran; left as it is")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not free the key; it is free again when its lease expires")
            }
        }
        telemetry::request(keyed.operation(), Seen::NotStored);
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    // The handler's effects are done and cannot be undone: its caller gets the whole response,
    // and a body over the limit is stored without it.
    let limit = keyed.shared.config.max_response_bytes;
    let (stored, body) = match keyed::read(body, usize::MAX).await {
        Read::Whole(body) if body.len() <= limit => (
            StoredResponse::capture(&parts, &body, &keyed.shared.config.unstored),
            Body::from(body),
        ),
        Read::Whole(body) => {
            tracing::error!(
                limit,
                len = body.len(),
                "the response is larger than max_response_bytes; its body is not stored, and retries get an empty body"
            );
            (
                StoredResponse::without_body(&parts, &keyed.shared.config.unstored),
                Body::from(body),
            )
        }
        Read::TooLarge | Read::Failed(_) => {
            tracing::warn!("the response body failed; storing the status and headers");
            (
                StoredResponse::without_body(&parts, &keyed.shared.config.unstored),
                Body::empty(),
            )
        }
    };
    let end = match stored.is_server_error() {
        true => LeaseEnd::Failed,
        false => LeaseEnd::Completed,
    };
    let settled = match StoredOutput::encode(&stored) {
        Ok(output) => run.settle(end, &output).await,
        Err(e) => Err(idem_core::model::StoreError::new(
            "encode response",
            idem_core::model::ErrorClass::Permanent,
            e.to_string(),
        )),
    };
    match settled {
        Ok(true) => telemetry::request(keyed.operation(), Seen::Executed),
        Ok(false) => {
            tracing::warn!(
                "the lease expired while the handler ran and was taken over: the request may have run twice; lengthen the lease"
            );
            telemetry::request(keyed.operation(), Seen::NotStored);
        }
        Err(e) => {
            tracing::warn!(error = %e, "the response was not recorded: a retry runs the handler again once the lease expires");
            telemetry::request(keyed.operation(), Seen::NotStored);
        }
    }
    Ok(Response::from_parts(parts, body))
}
