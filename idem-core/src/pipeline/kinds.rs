//! [`Pipeline`]: the pipeline of each kind of handler, chosen by the handler's
//! [`Handler::Kind`] when it is registered: no kind is looked up per delivery.

use super::stages::Stages;
use super::steps::Limits;
use super::{batch, external, transactional};
use crate::handler::{BatchHandler, ExternalHandler, Handler, Mode, TransactionalHandler, kind};
use crate::model::{Envelope, Outcome, Transient};
use crate::store::InboxStore;
use std::future::Future;

/// The pipeline that runs the handlers of one kind; implemented by the three kinds of
/// [`crate::handler::kind`], each for the handlers of its trait.
#[diagnostic::on_unimplemented(
    message = "`{H}` is of kind `{Self}`, but does not implement that kind's handler trait",
    note = "a handler of kind `kind::Transactional` implements `TransactionalHandler`, of \
            `kind::External` `ExternalHandler`, of `kind::Batch` `BatchHandler`"
)]
pub trait Pipeline<H: Handler>: kind::Kind {
    /// The handler's mode, as the runtime reports it.
    fn mode() -> Mode;

    /// Processes one delivery in `store`, within `limits`; a transaction runs on the
    /// connection in `held` (see [`InboxStore::begin_on`]).
    fn one(
        store: &H::Store,
        envelope: &Envelope,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> impl Future<Output = Outcome> + Send;

    /// Processes a batch in `store`, within `limits`, after the batch before it and before
    /// the one after it (`stages`); one outcome per envelope, in order.
    fn batch(
        store: &H::Store,
        envelopes: &[Envelope],
        stages: &mut Stages,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> impl Future<Output = Vec<Outcome>> + Send;
}

/// One transaction per delivery, and one per batch with a handler run per message.
impl<H: TransactionalHandler> Pipeline<H> for kind::Transactional {
    fn mode() -> Mode {
        Mode::Transactional
    }

    async fn one(
        store: &H::Store,
        envelope: &Envelope,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Outcome {
        transactional::process::<H>(store, envelope, limits, held).await
    }

    async fn batch(
        store: &H::Store,
        envelopes: &[Envelope],
        stages: &mut Stages,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Vec<Outcome> {
        batch::process::<H>(store, envelopes, stages, limits, held).await
    }
}

/// One transaction per batch with one handler run; one delivery is a batch of one.
impl<H: BatchHandler> Pipeline<H> for kind::Batch {
    fn mode() -> Mode {
        Mode::Transactional
    }

    async fn one(
        store: &H::Store,
        envelope: &Envelope,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Outcome {
        let envelopes = std::slice::from_ref(envelope);
        let outcomes =
            batch::process::<H>(store, envelopes, &mut Stages::default(), limits, held).await;
        outcomes.into_iter().next().unwrap_or_else(|| {
            Outcome::Retry(Transient {
                message: "a batch of one gave no outcome".to_owned(),
                key: None,
            })
        })
    }

    async fn batch(
        store: &H::Store,
        envelopes: &[Envelope],
        stages: &mut Stages,
        limits: Limits<'_>,
        held: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Vec<Outcome> {
        batch::process::<H>(store, envelopes, stages, limits, held).await
    }
}

/// A lease per delivery. An external handler shares no transaction, so its batch is its
/// messages one after another, each leased and settled on its own, after the previous batch.
impl<H: ExternalHandler> Pipeline<H> for kind::External {
    fn mode() -> Mode {
        Mode::External { lease: H::LEASE }
    }

    async fn one(
        store: &H::Store,
        envelope: &Envelope,
        limits: Limits<'_>,
        _: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Outcome {
        external::process::<H>(store, envelope, limits).await
    }

    async fn batch(
        store: &H::Store,
        envelopes: &[Envelope],
        stages: &mut Stages,
        limits: Limits<'_>,
        _: &mut Option<<H::Store as InboxStore>::Held>,
    ) -> Vec<Outcome> {
        stages.wait_for_previous().await;
        let mut outcomes = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            outcomes.push(external::process::<H>(store, envelope, limits).await);
        }
        stages.fire_unless_waiting(&outcomes);
        outcomes
    }
}
