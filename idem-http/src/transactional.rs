//! Transactional mode: the key's row is claimed in the request's transaction, the handler
//! writes in it ([`crate::Tx`]), and the response is stored in it before it commits. Where
//! the transaction is opened ([`run`]), the key claimed ([`attempt`]) and the transaction
//! ended, committed with the stored response or rolled back ([`end`], through core's
//! `end_transaction`, where every inbox transaction ends).
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
use idem_core::{
    model::ErrorClass, model::StoreError, model::StoredOutput, store::Admission,
    store::ClaimRequest, store::Ended, store::InboxStore, store::end_transaction,
};
use std::convert::Infallible;

/// How a request's transaction ends; [`end`] carries it out.
enum End {
    /// Nothing of the request is kept: the claim and the handler's writes roll back.
    Rollback,
    /// The handler's writes commit, with the key's row completed with the stored response
    /// when there is one (a request without a key has none).
    Commit(Option<StoredOutput>),
    /// A server error: the handler's writes roll back, and the key is recorded with the stored
    /// response alone, in a transaction of its own.
    Alone(StoredOutput),
}

/// Runs one keyed request in transactional mode.
pub(crate) async fn run<S, I, B>(
    keyed: &Keyed<'_, S>,
    inner: I,
    request: Request<Body>,
) -> Result<Response<Body>, Infallible>
where
    S: InboxStore,
    I: Inner<B>,
    B: ResponseBody,
{
    let store = &keyed.shared.config.store;
    let claim = keyed.claim_request();
    let tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(keyed.unavailable(&e)),
    };
    let (tx, how, response) = attempt(keyed, &claim, tx, inner, request).await?;
    Ok(end(keyed.shared, Some(&claim), tx, how, response).await)
}

/// Claims the key in `tx`, runs the handler in it and reads its response: how the
/// transaction ends, and the answer.
async fn attempt<S, I, B>(
    keyed: &Keyed<'_, S>,
    claim: &ClaimRequest<'_>,
    mut tx: S::Tx<'static>,
    inner: I,
    mut request: Request<Body>,
) -> Result<(S::Tx<'static>, End, Response<Body>), Infallible>
where
    S: InboxStore,
    I: Inner<B>,
    B: ResponseBody,
{
    let store = &keyed.shared.config.store;
    let claimed = store.try_claim(&mut tx, claim).await;
    match claimed.map(|claim| Admission::of_claim(claim, &keyed.fingerprint)) {
        Ok(Admission::Run { .. }) => {}
        Ok(Admission::Refused(refusal)) => return Ok((tx, End::Rollback, keyed.refused(refusal))),
        Err(e) => return Ok((tx, End::Rollback, keyed.unavailable(&e))),
    }
    let slot = TxSlot::new(tx);
    request.extensions_mut().insert(slot.clone());
    // A panic or a dropped request future drops the slot: the transaction rolls back.
    let response = keyed::call(inner, request).await?;
    let (tx, used) = slot.finish().await;
    let Some(tx) = tx else {
        unreachable!("only the layer takes the transaction out of its slot");
    };
    let (parts, body) = response.into_parts();
    let executed = match parts.extensions.get::<Execution>() {
        Some(execution) => *execution == Execution::Began,
        None => used,
    };
    if !executed {
        // Refused before execution: nothing is recorded, and the key stays free.
        telemetry::request(keyed.operation(), Seen::NotStored);
        return Ok((
            tx,
            End::Rollback,
            Response::from_parts(parts, Body::new(body)),
        ));
    }
    let limit = keyed.shared.config.max_response_bytes;
    let body = match keyed::read(body, limit).await {
        Read::Whole(body) => body,
        Read::TooLarge => {
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
            return Ok((tx, End::Rollback, keyed.problem(Seen::NotStored, problem)));
        }
        Read::Failed(e) => {
            tracing::warn!(error = %e, "the response body failed; rolled back");
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Response failed",
                "the response could not be produced; nothing was applied",
            );
            return Ok((tx, End::Rollback, keyed.problem(Seen::NotStored, problem)));
        }
    };
    let stored = StoredResponse::capture(&parts, &body, &keyed.shared.config.unstored);
    let output = match StoredOutput::encode(&stored) {
        Ok(output) => output,
        Err(e) => {
            let e = StoreError::new("encode response", ErrorClass::Permanent, e.to_string());
            return Ok((tx, End::Rollback, keyed.unavailable(&e)));
        }
    };
    let how = match stored.is_server_error() {
        // A server error undoes the handler's writes; the key and the error are recorded on
        // their own, and replayed to retries.
        true => End::Alone(output),
        false => End::Commit(Some(output)),
    };
    Ok((tx, how, Response::from_parts(parts, Body::from(body))))
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
    let tx = match shared.config.store.begin().await {
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
    let how = match response.status().is_server_error() {
        true => End::Rollback,
        false => End::Commit(None),
    };
    Ok(end(shared, None, tx, how, response.map(Body::new)).await)
}

/// Ends a request's transaction `tx` as `how` says, and answers `response`, or 503 when what
/// was to be kept was not. Every transaction of a request ends in core's [`end_transaction`].
async fn end<S: InboxStore>(
    shared: &Shared<S>,
    claim: Option<&ClaimRequest<'_>>,
    mut tx: S::Tx<'static>,
    how: End,
    response: Response<Body>,
) -> Response<Body> {
    let store = &shared.config.store;
    let output = match how {
        End::Rollback => {
            roll_back(store, tx).await;
            return response;
        }
        End::Commit(output) => output,
        End::Alone(output) => {
            roll_back(store, tx).await;
            let again = match claim {
                Some(claim) => claim_again(store, claim).await,
                None => None,
            };
            match again {
                Some(again) => {
                    tx = again;
                    Some(output)
                }
                None => {
                    telemetry::request(&shared.config.operation, Seen::NotStored);
                    return response;
                }
            }
        }
    };
    // The claimed key's row is completed with the stored response, in the same transaction.
    let completed = match (claim, &output) {
        (Some(claim), Some(output)) => store.complete(&mut tx, claim, output).await,
        _ => Ok(()),
    };
    match end_transaction(store, tx, completed).await {
        Ok(()) => {
            if output.is_some() {
                telemetry::request(&shared.config.operation, Seen::Executed);
            }
            response
        }
        // The commit did not happen (or its outcome is unknown: a retry then finds the row and
        // replays it): the client must retry.
        Err(Ended::RolledBack(e) | Ended::NotCommitted(e)) => keyed::unavailable(shared, &e),
    }
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
    let claimed = store.try_claim(&mut tx, claim).await;
    match claimed.map(|answer| Admission::of_claim(answer, claim.fingerprint)) {
        Ok(Admission::Run { .. }) => return Some(tx),
        Ok(Admission::Refused(_)) => {}
        Err(e) => {
            tracing::warn!(error = %e, "the server error is not recorded; a retry runs the handler again");
        }
    }
    roll_back(store, tx).await;
    None
}

/// Rolls `tx` back: nothing of it is kept.
async fn roll_back<S: InboxStore>(store: &S, tx: S::Tx<'static>) {
    let rolled_back: Result<(), _> = end_transaction(store, tx, Err(())).await;
    debug_assert!(matches!(rolled_back, Err(Ended::RolledBack(()))));
}
