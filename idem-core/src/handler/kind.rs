//! A handler's kind, as a type: [`Transactional`], [`External`] or [`Batch`]. `#[idempotent]`
//! chooses it from the function's signature and mode; it names the trait the handler is called
//! through, and so the pipeline that runs it, which the runtime picks once, when the handler
//! is registered (not per delivery).

/// The kind of a handler that writes in the inbox transaction, one message at a time
/// ([`super::TransactionalHandler`]).
#[derive(Debug, Clone, Copy)]
pub struct Transactional;

/// The kind of a handler that calls something outside the inbox transaction, with its key
/// leased ([`super::ExternalHandler`]).
#[derive(Debug, Clone, Copy)]
pub struct External;

/// The kind of a handler that takes the new messages of a batch at once
/// ([`super::BatchHandler`]).
#[derive(Debug, Clone, Copy)]
pub struct Batch;

/// One of the three kinds; implemented by them alone.
pub trait Kind: sealed::Sealed + Send + Sync + 'static {
    /// The kind's name, as logs and the runtime's plan show it.
    const NAME: &'static str;
}

impl Kind for Transactional {
    const NAME: &'static str = "transactional";
}

impl Kind for External {
    const NAME: &'static str = "external";
}

impl Kind for Batch {
    const NAME: &'static str = "batch";
}

mod sealed {
    use crate::handler::kind::{Batch, External, Transactional};

    pub trait Sealed {}
    impl Sealed for Transactional {}
    impl Sealed for External {}
    impl Sealed for Batch {}
}
