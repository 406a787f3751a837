//! Transactional mode: the key's row is claimed in the request's transaction, the handler
//! writes in it ([`crate::Tx`]), and the response is stored in it before it commits. Where
//! the transaction is opened, the key claimed, the response stored and the commit made.
//!
//! A response is stored once the handler used its transaction (or said [`Execution::Began`]).
//! With a 2xx-4xx response the handler's writes commit with it; a 5xx response rolls them back
//! and records the key and the error alone.

use crate::keyed::{self, Inner, Keyed, Read, ResponseBody, Shared};
use crate::problem::Problem;
use crate::stored::StoredResponse;
use crate::telemetry::{self, Result as Seen};
use crate::tx::{Execution, TxSlot};
use axum_core::body::Body;
use http::{Request, Response, StatusCode};
use idem_core::{Claim, ClaimRequest, InboxStore, StoredOutput};
use std::convert::Infallible;
use std::time::Duration;

/// Runs one keyed request in transactional mode.
pub(crate) async fn run<S, I, B>(
    keyed: &Keyed<'_, S>,
    inner: I,
    mut request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: InboxStore,
    I: Inner<B>,
    B: ResponseBody,
{
    let store = &keyed.shared.config.store;
    let claim = keyed.claim_request();
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(keyed.unavailable(&e)),
    };
    match store.try_claim(&mut tx, &claim).await {
        Ok(Some(Claim::Claimed)) => {}
        Ok(None) => {
            // Another process runs this key right now.
            store.rollback(tx).await;
            return Ok(keyed::in_progress(keyed, Duration::from_secs(1)));
        }
        Ok(Some(Claim::Existing {
            fingerprint,
            output,
        })) => {
            store.rollback(tx).await;
            return Ok(keyed.replay(&fingerprint, output.as_ref()));
        }
        Err(e) => {
            store.rollback(tx).await;
            return Ok(keyed.unavailable(&e));
        }
    }
    let slot = TxSlot::new(tx);
    request.extensions_mut().insert(slot.clone());
    // A panic or a dropped request future drops the slot: the transaction rolls back.
    let response = keyed::call(inner, request).await?;
    let (tx, used) = slot.finish().await;
    let Some(mut tx) = tx else {
        unreachable!("only the layer takes the transaction out of its slot");
    };
    let (parts, body) = response.into_parts();
    let executed = match parts.extensions.get::<Execution>() {
        Some(execution) => *execution == Execution::Began,
        None => used,
    };
    if !executed {
        // Refused before execution: nothing is recorded, and the key stays free.
        store.rollback(tx).await;
        telemetry::request(keyed.operation(), Seen::NotStored);
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    let limit = keyed.shared.config.max_response_bytes;
    let body = match keyed::read(body, limit).await {
        Read::Whole(body) => body,
        Read::TooLarge => {
            store.rollback(tx).await;
            tracing::error!(
                limit,
                "the response is larger than max_response_bytes; rolled back"
            );
            let detail = format!(
                "the response is larger than the {limit} bytes this operation stores; \
                 nothing was applied"
            );
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Response too large to store",
                detail,
            );
            return Ok(keyed.problem(Seen::NotStored, problem));
        }
        Read::Failed(e) => {
            store.rollback(tx).await;
            tracing::warn!(error = %e, "the response body failed; rolled back");
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Response failed",
                "the response could not be produced; nothing was applied",
            );
            return Ok(keyed.problem(Seen::NotStored, problem));
        }
    };
    let stored = StoredResponse::capture(&parts, &body, &keyed.shared.config.unstored);
    if stored.is_server_error() {
        // A server error undoes the handler's writes; the key and the error are recorded on
        // their own, and replayed to retries.
        store.rollback(tx).await;
        tx = match claim_again(store, &claim).await {
            Some(tx) => tx,
            None => {
                telemetry::request(keyed.operation(), Seen::NotStored);
                return Ok(Response::from_parts(parts, Body::from(body)));
            }
        };
    }
    let recorded = async {
        let output = StoredOutput::encode(&stored).map_err(|e| {
            idem_core::StoreError::new(
                "encode response",
                idem_core::ErrorClass::Permanent,
                e.to_string(),
            )
        })?;
        store.complete(&mut tx, &claim, &output).await?;
        store.commit(tx).await
    };
    match recorded.await {
        Ok(()) => {
            telemetry::request(keyed.operation(), Seen::Executed);
            Ok(Response::from_parts(parts, Body::from(body)))
        }
        // The commit did not happen (or its outcome is unknown: a retry then finds the row and
        // replays it): the client must retry.
        Err(e) => Ok(keyed.unavailable(&e)),
    }
}

/// Runs a request without a key on a route where keys are optional: the handler gets its
/// transaction all the same, committed after a 2xx-4xx response and rolled back after a 5xx;
/// nothing is recorded.
pub(crate) async fn run_unkeyed<S, I, B>(
    shared: &Shared<S>,
    inner: I,
    mut request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: InboxStore,
    I: Inner<B>,
    B: ResponseBody,
{
    let store = &shared.config.store;
    let tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(keyed::unavailable(shared, &e)),
    };
    let slot = TxSlot::new(tx);
    request.extensions_mut().insert(slot.clone());
    let response = keyed::call(inner, request).await?;
    let (tx, _) = slot.finish().await;
    let Some(tx) = tx else {
        unreachable!("only the layer takes the transaction out of its slot");
    };
    if response.status().is_server_error() {
        store.rollback(tx).await;
    } else if let Err(e) = store.commit(tx).await {
        return Ok(keyed::unavailable(shared, &e));
    }
    Ok(response.map(Body::new))
}

/// Claims the key again in a fresh transaction, after a server error rolled the first one back;
/// `None` when that fails, or when a retry claimed it in between (and runs the handler again:
/// nothing of this request was kept).
async fn claim_again<S: InboxStore>(store: &S, claim: &ClaimRequest<'_>) -> Option<S::Tx<'static>> {
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            tracing::warn!(error = %e, "the server error is not recorded; a retry runs the handler again");
            return None;
        }
    };
    match store.try_claim(&mut tx, claim).await {
        Ok(Some(Claim::Claimed)) => Some(tx),
        Ok(Some(Claim::Existing { .. }) | None) => {
            store.rollback(tx).await;
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "the server error is not recorded; a retry runs the handler again");
            store.rollback(tx).await;
            None
        }
    }
}
