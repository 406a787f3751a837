//! What a pass over a batch works on, how it ends, and how a handler's kind runs in it: shared
//! by the pass (`pass.rs`) and a batch handler's part of it (`set.rs`).

use super::gather::Item;
use crate::future::BoxFuture;
use crate::handler::Handler;
use crate::model::{Envelope, ErrorClass, Outcome, Outgoing, StoreError};
use crate::pipeline::stages::Stages;
use crate::pipeline::steps::Limits;
use crate::store::{Claim, InboxStore};

/// How a pass runs a transactional handler (a batch handler's pass has one way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum How {
    /// Each new message's handler, back to back.
    Fast,
    /// Each new message's handler under its own savepoint.
    Isolated,
}

/// How the handlers of one kind run in a batch's passes: a transactional handler once per
/// new message (`pass.rs`), a batch handler once on all of them (`set.rs`). Implemented by
/// [`crate::handler::kind::Transactional`] and [`crate::handler::kind::Batch`]; the kind of a handler picks it when the
/// handler's pipeline is compiled.
pub(crate) trait Passes<H: Handler>: Sized {
    /// One pass over the `members` of `items` (their payloads in `payloads`), run again in the
    /// way the kind needs until it ends for good or asks the caller for another.
    fn pass_of<'x>(
        batch: &'x Batch<'_, H>,
        items: &'x mut [Item],
        members: &'x [usize],
        payloads: Vec<Option<H::Payload>>,
        outcomes: &'x mut [Option<Outcome>],
        place: &'x mut Place<'_, H::Store>,
    ) -> BoxFuture<'x, Pass>;

    /// In a pass's transaction once its keys are claimed: the claims judged and the handlers
    /// of the new messages run, `how` says.
    fn handle<'x, 'c: 'x>(
        run: &'x mut Run<'_, '_, H>,
        tx: &'x mut <H::Store as InboxStore>::Tx<'c>,
        claims: Vec<Claim>,
        payloads: Vec<Option<H::Payload>>,
        how: How,
    ) -> BoxFuture<'x, Result<SetEnd, StoreError>>;
}

/// How a pass over a batch ended.
#[derive(Debug, PartialEq)]
pub(crate) enum Pass {
    /// Every member has its outcome (committed, or failed as a whole).
    Done,
    /// A handler failed in a fast pass; the transaction was rolled back.
    NeedsIsolation,
    /// The batch handler failed the item at this index with this outcome; the transaction
    /// was rolled back, and the others are to run again without it.
    Exclude(usize, Outcome),
    /// The batch handler failed permanently without naming a culprit, or the store refused
    /// the pass of several members for good (a claim, a completion, the commit); the
    /// transaction was rolled back, and the members are to run again in halves, so that the
    /// one that fails alone is found and settled alone.
    Split,
    /// The claim of several members failed for now (a key another transaction holds, past the
    /// store's bound on lock waits; a deadlock): the members are to run one by one, so that
    /// only the one whose key is held waits, and is retried alone.
    OneByOne,
}

/// What every pass of a batch works on.
pub(crate) struct Batch<'a, H: Handler> {
    pub(super) store: &'a H::Store,
    pub(super) envelopes: &'a [Envelope],
    /// Its rows' retention, its state, what becomes of stale messages.
    pub(super) limits: Limits<'a>,
}

/// The transaction of one pass, and where its outcomes go.
pub(crate) struct Run<'a, 'b, H: Handler> {
    pub(super) batch: &'b Batch<'a, H>,
    pub(super) items: &'b mut [Item],
    /// The items this pass works on (indices into `items`), in order.
    pub(super) members: &'b [usize],
    pub(super) outcomes: &'b mut [Option<Outcome>],
    /// How many outbox messages the pass staged (replies included).
    pub(super) staged: u32,
    /// The pass's staged messages, in order, when they can be published from memory (a batch
    /// handler's, all staged in the pass's transaction outside any savepoint); `None`: read
    /// back after the commit.
    pub(super) kept: Option<Vec<Outgoing>>,
}

/// How the handler part of a pass ended.
pub(crate) enum SetEnd {
    /// The handlers ran; the markers of these items go (they failed, or are stale).
    Failed(Vec<usize>),
    /// Roll back, and end the pass with this.
    Again(Pass),
    /// Roll back; every unsettled member fails with this message, as the class says.
    Abort(ErrorClass, String),
}

/// Where a batch's passes run: after the batch before it and before the one after it
/// (`stages`), on the database connection its worker keeps for it (`held`).
pub(crate) struct Place<'p, S: InboxStore> {
    pub(super) stages: &'p mut Stages,
    pub(super) held: &'p mut Option<S::Held>,
}
