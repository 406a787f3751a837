//! [`Mode`]: how a route's handler and its key's record commit, as a type: [`Transactional`]
//! or [`External`]. The mode picks the path every keyed request of its layer takes, when the
//! layer is built: no request looks it up.

use crate::keyed::{self, Inner, Keyed, ResponseBody, Shared};
use crate::{external, transactional};
use axum_core::body::Body;
use http::{Request, Response};
use idem_core::store::RuntimeStore;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::time::Duration;

/// The mode of a transactional [`Idempotency`](crate::Idempotency): the handler writes in the
/// request's transaction ([`crate::Tx`]); its writes, the key's row and the stored response
/// commit together, and a crash leaves nothing behind. Its layer wraps handlers
/// ([`crate::IdempotencyLayer::handler`]), whose `Tx` is checked against the layer's store.
#[derive(Debug, Clone, Copy)]
pub struct Transactional;

/// The mode of an external [`Idempotency`](crate::Idempotency): the handler calls other
/// services; the key is leased `in_progress` in a transaction of its own, then settled with
/// the response, and a lease left by a crash is taken over once it expires. Its layer is a
/// tower layer around any route ([`crate::IdempotencyLayer`] implements `tower::Layer`).
#[derive(Debug, Clone, Copy)]
pub struct External {
    /// How long a lease lasts; it must outlast the handler's longest run.
    lease: Duration,
}

impl External {
    /// External mode with leases of `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        Self { lease }
    }
}

/// How the handler's effects and the key's record commit: [`Transactional`] or [`External`],
/// the two modes there are.
pub trait Mode: sealed::Sealed + Copy + fmt::Debug + Send + Sync + 'static {
    /// How long a key is leased while its handler runs; `None`: no lease (the request's
    /// transaction holds the key).
    fn lease(&self) -> Option<Duration>;

    /// Runs a keyed request on this mode's path.
    #[doc(hidden)]
    fn keyed<S, I, B>(
        self,
        keyed: &Keyed<'_, S>,
        inner: I,
        request: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, Infallible>> + Send
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody;

    /// Runs a request without a key on a route where keys are optional.
    #[doc(hidden)]
    fn unkeyed<S, I, B>(
        self,
        shared: &Shared<S>,
        inner: I,
        request: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, Infallible>> + Send
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody;
}

impl Mode for Transactional {
    fn lease(&self) -> Option<Duration> {
        None
    }

    async fn keyed<S, I, B>(
        self,
        keyed: &Keyed<'_, S>,
        inner: I,
        request: Request<Body>,
    ) -> Result<Response<Body>, Infallible>
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody,
    {
        transactional::run(keyed, inner, request).await
    }

    /// The handler gets its transaction all the same; nothing is recorded.
    async fn unkeyed<S, I, B>(
        self,
        shared: &Shared<S>,
        inner: I,
        request: Request<Body>,
    ) -> Result<Response<Body>, Infallible>
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody,
    {
        transactional::run_unkeyed(shared, inner, request).await
    }
}

impl Mode for External {
    fn lease(&self) -> Option<Duration> {
        Some(self.lease)
    }

    async fn keyed<S, I, B>(
        self,
        keyed: &Keyed<'_, S>,
        inner: I,
        request: Request<Body>,
    ) -> Result<Response<Body>, Infallible>
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody,
    {
        external::run(keyed, self.lease, inner, request).await
    }

    /// The handler runs unguarded.
    async fn unkeyed<S, I, B>(
        self,
        _: &Shared<S>,
        inner: I,
        request: Request<Body>,
    ) -> Result<Response<Body>, Infallible>
    where
        S: RuntimeStore,
        I: Inner<B>,
        B: ResponseBody,
    {
        keyed::call(inner, request).await.map(|r| r.map(Body::new))
    }
}

mod sealed {
    use crate::mode::{External, Transactional};

    pub trait Sealed {}
    impl Sealed for Transactional {}
    impl Sealed for External {}
}
