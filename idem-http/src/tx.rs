//! The transaction a transactional route's handler writes in ([`Tx`]), and how the layer hands
//! it over and takes it back.

use axum_core::extract::FromRequestParts;
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use sqlx::{Database, Transaction};
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{Mutex, OwnedMutexGuard};

/// The transaction of a request, shared between the layer and the handler's [`Tx`].
pub(crate) struct TxSlot<T> {
    tx: Arc<Mutex<Option<T>>>,
    /// Set when the handler first uses the transaction mutably: execution began.
    used: Arc<AtomicBool>,
}

impl<T> Clone for TxSlot<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            used: self.used.clone(),
        }
    }
}

impl<T> TxSlot<T> {
    /// A slot holding `tx`.
    pub(crate) fn new(tx: T) -> Self {
        Self {
            tx: Arc::new(Mutex::new(Some(tx))),
            used: Arc::default(),
        }
    }

    /// Takes the transaction back once the handler is done with it (waiting for a [`Tx`] the
    /// handler still holds), and whether the handler used it.
    pub(crate) async fn finish(self) -> (Option<T>, bool) {
        let tx = self.tx.lock().await.take();
        (tx, self.used.load(Ordering::Acquire))
    }
}

/// The request's database transaction, for a handler behind a transactional layer
/// ([`crate::IdempotencyLayer::handler`], which checks when it compiles that `DB` is the
/// database of the layer's store): the key's row is already in it, and the layer stores the
/// response in it and commits after the handler returns. Use it as `&mut *tx` (a
/// `sqlx::Transaction`) or `&mut **tx` (the connection), as with `#[idempotent]`.
///
/// The first mutable use marks the request as executed: from then on its response is stored
/// and replayed, error responses too. A response produced before (a rejected body, a
/// validation error answered without touching the database) is not stored, and the key stays
/// free. [`crate::Execution`] on the response overrides that.
pub struct Tx<DB: Database> {
    guard: OwnedMutexGuard<Option<Transaction<'static, DB>>>,
    used: Arc<AtomicBool>,
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = Transaction<'static, DB>;

    fn deref(&self) -> &Self::Target {
        match self.guard.as_ref() {
            Some(tx) => tx,
            None => unreachable!("a Tx is only made from a slot holding its transaction"),
        }
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.used.store(true, Ordering::Release);
        match self.guard.as_mut() {
            Some(tx) => tx,
            None => unreachable!("a Tx is only made from a slot holding its transaction"),
        }
    }
}

/// Why a handler could not get its [`Tx`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TxRejection {
    /// No transaction is on the request: the handler was routed without a transactional
    /// layer (`layer.handler(create)`).
    #[error(
        "no idempotent transaction on this request: route the handler as \
         `layer.handler(handler)` with a transactional idem_http::Idempotency layer"
    )]
    Missing,
    /// Another extractor of this request holds the transaction.
    #[error("the request's transaction is already extracted")]
    InUse,
}

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        // Both are mistakes of the route, not of the client.
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

impl<DB: Database, S: Send + Sync> FromRequestParts<S> for Tx<DB> {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let slot = parts
            .extensions
            .get::<TxSlot<Transaction<'static, DB>>>()
            .ok_or(TxRejection::Missing)?;
        let guard = slot
            .tx
            .clone()
            .try_lock_owned()
            .map_err(|_| TxRejection::InUse)?;
        if guard.is_none() {
            return Err(TxRejection::Missing);
        }
        Ok(Self {
            guard,
            used: slot.used.clone(),
        })
    }
}

/// Overrides, on a response, whether the layer stores it: put it in the response's extensions
/// (in axum, return `(Execution::NotBegun, response)`).
///
/// Without it, a transactional route stores the response when the handler used its [`Tx`],
/// and an external route stores every response its handler produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Execution {
    /// The request was executed: store the response and replay it to retries.
    Began,
    /// The request was refused before anything happened (validation): do not store the
    /// response, and leave the key free for a corrected request.
    NotBegun,
}

impl axum_core::response::IntoResponseParts for Execution {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: axum_core::response::ResponseParts,
    ) -> Result<axum_core::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}
