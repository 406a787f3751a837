//! The built layer of one operation, and the tower [`Layer`] and [`Service`] that put an
//! external route behind an `Idempotency-Key`.

use crate::config::{ConfigError, Idempotency};
use crate::flow;
use crate::inflight::InFlight;
use crate::keyed::Shared;
use crate::mode::{External, Mode};
use axum_core::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use idem_core::store::RuntimeStore;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// The layer of one operation, built by [`Idempotency::layer`]. Cloning it is cheap; every
/// route of the operation shares its keys.
///
/// - A [`Transactional`](crate::Transactional) layer wraps each handler of the operation
///   (axum: `post(layer.handler(create))`); the handler's [`crate::Tx`] is checked against the
///   layer's store when it compiles. It is not a tower layer: there the check would wait for a
///   request.
/// - An [`External`] layer is a tower layer on the operation's routes (axum:
///   `post(handler).layer(layer)`).
pub struct IdempotencyLayer<S, M> {
    pub(crate) shared: Arc<Shared<S>>,
    pub(crate) mode: M,
}

impl<S: RuntimeStore, M: Mode> Idempotency<S, M> {
    /// Checks the configuration and builds the layer.
    pub fn layer(self) -> Result<IdempotencyLayer<S, M>, ConfigError> {
        self.check()?;
        let shared = Shared {
            config: self.settings,
            in_flight: InFlight::default(),
        };
        Ok(IdempotencyLayer {
            shared: Arc::new(shared),
            mode: self.mode,
        })
    }
}

impl<S, M: Copy> Clone for IdempotencyLayer<S, M> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            mode: self.mode,
        }
    }
}

impl<S, M: fmt::Debug> fmt::Debug for IdempotencyLayer<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("mode", &self.mode)
            .field("settings", &self.shared.config)
            .finish()
    }
}

impl<S, I> Layer<I> for IdempotencyLayer<S, External> {
    type Service = IdempotencyService<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        IdempotencyService {
            shared: self.shared.clone(),
            mode: self.mode,
            inner,
        }
    }
}

/// The service an [`External`] [`IdempotencyLayer`] wraps around a route.
pub struct IdempotencyService<S, I> {
    shared: Arc<Shared<S>>,
    mode: External,
    inner: I,
}

impl<S, I: Clone> Clone for IdempotencyService<S, I> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            mode: self.mode,
            inner: self.inner.clone(),
        }
    }
}

impl<S, I> fmt::Debug for IdempotencyService<S, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("mode", &self.mode)
            .field("settings", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// The service takes requests of any body type (hyper's, axum's, a test's `String`), as
/// tower-http's layers do; its handler gets the body, once read for the fingerprint, as axum's
/// [`Body`].
impl<S, I, B, ReqB> Service<Request<ReqB>> for IdempotencyService<S, I>
where
    S: RuntimeStore,
    I: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone + Send + 'static,
    I::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum_core::BoxError>,
    ReqB: http_body::Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<axum_core::BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // The clone is the one made ready by `poll_ready`; the original waits for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(flow::handle(
            self.shared.clone(),
            self.mode,
            inner,
            request.map(Body::new),
        ))
    }
}
