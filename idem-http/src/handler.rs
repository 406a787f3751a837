//! A transactional operation's handlers: [`IdempotencyLayer::handler`] wraps one, once the
//! compiler has checked that it writes in the [`Tx`] of the layer's store ([`WritesIn`]).

use crate::flow;
use crate::keyed::Shared;
use crate::layer::IdempotencyLayer;
use crate::mode::Transactional;
use crate::tx::Tx;
use axum::handler::Handler;
use axum_core::extract::Request;
use axum_core::response::Response;
use idem_core::store::RuntimeStore;
use sqlx::{Database, Transaction};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

impl<S: RuntimeStore> IdempotencyLayer<S, Transactional> {
    /// `handler` behind this layer, to route as any axum handler
    /// (`post(layer.handler(create))`): each keyed request runs it once, in a transaction of
    /// the layer's store that the handler takes as its [`Tx`] argument.
    ///
    /// A handler that takes no `Tx` of the store's database (a `Tx<Postgres>` behind a
    /// SQLite store, or none) does not compile ([`WritesIn`]).
    pub fn handler<H, Args, Position>(&self, handler: H) -> IdempotentHandler<H, S>
    where
        H: WritesIn<S::Tx<'static>, Args, Position>,
    {
        IdempotentHandler {
            handler,
            shared: self.shared.clone(),
        }
    }
}

/// A handler behind a transactional [`IdempotencyLayer`], made by
/// [`IdempotencyLayer::handler`]; it is an axum handler.
pub struct IdempotentHandler<H, S> {
    handler: H,
    shared: Arc<Shared<S>>,
}

impl<H: Clone, S> Clone for IdempotentHandler<H, S> {
    fn clone(&self) -> Self {
        Self {
            handler: self.handler.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<H, S> fmt::Debug for IdempotentHandler<H, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentHandler")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<H, T, St, S> Handler<T, St> for IdempotentHandler<H, S>
where
    H: Handler<T, St>,
    T: 'static,
    St: Clone + Send + Sync + 'static,
    S: RuntimeStore,
{
    type Future = Pin<Box<dyn Future<Output = Response> + Send>>;

    fn call(self, request: Request, state: St) -> Self::Future {
        let inner = self.handler.with_state(state);
        Box::pin(async move {
            match flow::handle(self.shared, Transactional, inner, request).await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        })
    }
}

/// Where a handler takes its [`Tx`]: `At<0>` as its first argument, `At<1>` as its second…
#[derive(Debug, Clone, Copy)]
pub struct At<const N: usize>;

/// A handler (a function of `Args`) that takes one [`Tx`] of the transaction type `Txn`, at
/// `Position`: what [`IdempotencyLayer::handler`] asks of the handlers it wraps, so that a
/// handler taking the `Tx` of another database than the layer's store does not compile.
/// Implemented for functions of up to 8 arguments.
#[diagnostic::on_unimplemented(
    message = "this handler takes no `idem_http::Tx` of the layer's store",
    label = "takes no `Tx` writing in a `{Txn}`",
    note = "a transactional layer wraps handlers that take one `idem_http::Tx<DB>` of its store's \
            database (`Tx<sqlx::Sqlite>` for `SqliteInbox`, `Tx<sqlx::Postgres>` for `PgInbox`, \
            `Tx<sqlx::MySql>` for `MySqlInbox`), among at most 8 arguments"
)]
pub trait WritesIn<Txn, Args, Position> {}

/// `WritesIn` for the functions whose argument number `$at` is the `Tx`, between `$before`
/// and `$after`.
macro_rules! writes_in {
    ($at:literal: $($before:ident)*; $($after:ident)*) => {
        impl<F, Fut, DB, $($before,)* $($after,)*>
            WritesIn<Transaction<'static, DB>, ($($before,)* Tx<DB>, $($after,)*), At<$at>> for F
        where
            F: FnOnce($($before,)* Tx<DB>, $($after,)*) -> Fut,
            DB: Database,
        {
        }
    };
}

writes_in!(0: ;);
writes_in!(0: ; A2);
writes_in!(1: A1; );
writes_in!(0: ; A2 A3);
writes_in!(1: A1; A3);
writes_in!(2: A1 A2; );
writes_in!(0: ; A2 A3 A4);
writes_in!(1: A1; A3 A4);
writes_in!(2: A1 A2; A4);
writes_in!(3: A1 A2 A3; );
writes_in!(0: ; A2 A3 A4 A5);
writes_in!(1: A1; A3 A4 A5);
writes_in!(2: A1 A2; A4 A5);
writes_in!(3: A1 A2 A3; A5);
writes_in!(4: A1 A2 A3 A4; );
writes_in!(0: ; A2 A3 A4 A5 A6);
writes_in!(1: A1; A3 A4 A5 A6);
writes_in!(2: A1 A2; A4 A5 A6);
writes_in!(3: A1 A2 A3; A5 A6);
writes_in!(4: A1 A2 A3 A4; A6);
writes_in!(5: A1 A2 A3 A4 A5; );
writes_in!(0: ; A2 A3 A4 A5 A6 A7);
writes_in!(1: A1; A3 A4 A5 A6 A7);
writes_in!(2: A1 A2; A4 A5 A6 A7);
writes_in!(3: A1 A2 A3; A5 A6 A7);
writes_in!(4: A1 A2 A3 A4; A6 A7);
writes_in!(5: A1 A2 A3 A4 A5; A7);
writes_in!(6: A1 A2 A3 A4 A5 A6; );
writes_in!(0: ; A2 A3 A4 A5 A6 A7 A8);
writes_in!(1: A1; A3 A4 A5 A6 A7 A8);
writes_in!(2: A1 A2; A4 A5 A6 A7 A8);
writes_in!(3: A1 A2 A3; A5 A6 A7 A8);
writes_in!(4: A1 A2 A3 A4; A6 A7 A8);
writes_in!(5: A1 A2 A3 A4 A5; A7 A8);
writes_in!(6: A1 A2 A3 A4 A5 A6; A8);
writes_in!(7: A1 A2 A3 A4 A5 A6 A7; );
