//! The pipeline for a batch of deliveries of a transactional handler: one transaction, one
//! multi-row claim, the handler of each new message, one commit. In three steps:
//!
//! 1. [`gather`]: read every delivery, keep one message per key (the handler run that a
//!    redelivery is about to start counted for the poison limit, which is judged on the keys
//!    the pass claims; a batch with a redelivery in it runs one message per transaction, so
//!    that only the handler that starts is counted);
//! 2. [`pass`]: the transaction. The fast pass runs the handlers back to back. If one fails,
//!    that pass is rolled back and the batch runs again with each new message under its own
//!    savepoint: a message whose handler fails permanently is rolled back to its savepoint and
//!    its marker removed, so it alone is dead-lettered and the rest commit; a transient handler
//!    failure likewise retries only that message. The happy path pays no round trip for
//!    savepoints; a failing batch runs twice. A transient failure of the batch itself (begin,
//!    claim, savepoint, commit: the database went away) leaves nothing committed, and every
//!    message whose outcome depended on it is retried; a permanent one (the store refused the
//!    claim of one member's key, say) runs the members again in halves, so that only the
//!    member that fails alone is dead-lettered;
//! 3. [`finish`]: the outcomes of the copies and of every delivery.
//!
//! A batch handler ([`crate::handler::BatchHandler`]) runs once per pass on every new message
//! ([`set`]); a pass that fails one message runs again without it, one that fails permanently
//! with no culprit runs again in halves. Only the last pass lets the next batch run its
//! handlers (`stages`): a half that committed keeps it waiting for the other half.

mod finish;
mod gather;
mod pass;
mod run;
mod set;

use crate::handler::Handler;
use crate::model::{Envelope, Outcome, Transient};
use crate::pipeline::stages::Stages;
use crate::pipeline::steps::{Limits, count_start, reply_again, settle_counts};
use crate::store::InboxStore;
use run::{Batch, Pass, Passes, Place};
use std::collections::VecDeque;

/// Processes `envelopes` with handler `H` in one transaction of `store` on the connection in
/// `held` (see [`InboxStore::begin_on`]), within `limits`; one outcome per envelope, in order.
/// Overlaps with the batches before and after it through `stages`.
///
/// A key that occurs twice in the batch is processed once; its later copies are duplicates (or
/// conflicts) of the first once that has committed, and are retried if it did not.
///
/// A batch with a redelivery in it, under a poison limit, runs one message per transaction
/// instead ([`one_by_one`]): only a handler that starts may count toward the limit, and in one
/// transaction the members behind a handler that never returns would never start.
pub(crate) async fn process<H: Handler<Kind: Passes<H>>>(
    store: &H::Store,
    envelopes: &[Envelope],
    stages: &mut Stages,
    limits: Limits<'_>,
    held: &mut Option<<H::Store as InboxStore>::Held>,
) -> Vec<Outcome> {
    let redelivered = envelopes.iter().any(|envelope| envelope.redelivered);
    if limits.poison.is_some() && redelivered && envelopes.len() > 1 {
        return one_by_one::<H>(store, envelopes, stages, limits, held).await;
    }
    together::<H>(store, envelopes, stages, limits, held).await
}

/// [`process`] for a batch after a crash: each message in a transaction of its own, after the
/// batch before it and before the one after it, each redelivery counted just before its handler
/// starts.
async fn one_by_one<H: Handler<Kind: Passes<H>>>(
    store: &H::Store,
    envelopes: &[Envelope],
    stages: &mut Stages,
    limits: Limits<'_>,
    held: &mut Option<<H::Store as InboxStore>::Held>,
) -> Vec<Outcome> {
    stages.wait_for_previous().await;
    let mut outcomes = Vec::with_capacity(envelopes.len());
    for (i, envelope) in envelopes.iter().enumerate() {
        let one = std::slice::from_ref(envelope);
        let outcome = together::<H>(store, one, &mut Stages::default(), limits, held).await;
        let unavailable = unavailable_of(&outcome);
        outcomes.extend(outcome);
        if let Some(failure) = unavailable {
            // The store cannot write: the rest wait for it too, untried.
            outcomes.extend(envelopes[i + 1..].iter().map(|_| waits(&failure, None)));
            break;
        }
    }
    stages.fire_unless_waiting(&outcomes);
    outcomes
}

/// [`process`] in one transaction.
async fn together<H: Handler<Kind: Passes<H>>>(
    store: &H::Store,
    envelopes: &[Envelope],
    stages: &mut Stages,
    limits: Limits<'_>,
    held: &mut Option<<H::Store as InboxStore>::Held>,
) -> Vec<Outcome> {
    let gather::Gathered {
        mut items,
        payloads,
        copies,
        mut outcomes,
    } = gather::gather::<H>(envelopes);
    for item in &mut items {
        let envelope = &envelopes[item.index];
        let (retention, limit) = (limits.retention, limits.poison);
        count_start::<H>(store, envelope, &mut item.keyed, retention, limit).await;
    }
    let counted: Vec<(usize, String)> = items
        .iter()
        .filter(|item| item.keyed.unsettled.is_some())
        .map(|item| (item.index, item.keyed.key.clone()))
        .collect();
    if !items.is_empty() {
        let place = &mut Place {
            stages: &mut *stages,
            held,
        };
        let batch = Batch::<H> {
            store,
            envelopes,
            limits,
        };
        let all: Vec<usize> = (0..items.len()).collect();
        batch
            .passes(&mut items, all, payloads, &mut outcomes, place)
            .await;
    }
    let outcomes = finish::finish(H::CONSUMER, envelopes, &items, copies, outcomes);
    stages.fire_unless_waiting(&outcomes);
    let settled: Vec<(&str, &Outcome)> = counted
        .iter()
        .map(|(index, key)| (key.as_str(), &outcomes[*index]))
        .collect();
    settle_counts::<H>(store, &settled).await;
    reply_to_duplicates::<H>(envelopes, outcomes, limits).await
}

/// The store's unavailability among `outcomes`, if any.
fn unavailable_of(outcomes: &[Outcome]) -> Option<Transient> {
    outcomes.iter().find_map(|outcome| match outcome {
        Outcome::Unavailable(failure) => Some(failure.clone()),
        _ => None,
    })
}

/// The outcome of a message that waits, untried, for the store that `failure` found unable to
/// write.
fn waits(failure: &Transient, key: Option<String>) -> Outcome {
    Outcome::Unavailable(Transient {
        message: failure.message.clone(),
        key,
    })
}

/// The outcomes, once every duplicate whose request names `reply_to` was sent its stored
/// result again (see `steps::reply_again`).
async fn reply_to_duplicates<H: Handler>(
    envelopes: &[Envelope],
    outcomes: Vec<Outcome>,
    limits: Limits<'_>,
) -> Vec<Outcome> {
    if envelopes.iter().all(|e| e.reply_to.is_none()) {
        return outcomes;
    }
    let mut replied = Vec::with_capacity(outcomes.len());
    for (envelope, outcome) in envelopes.iter().zip(outcomes) {
        replied.push(reply_again(H::CONSUMER, envelope, outcome, limits.dispatch).await);
    }
    replied
}

impl<H: Handler<Kind: Passes<H>>> Batch<'_, H> {
    /// Runs the handler over `members` (their payloads in `payloads`), again without a message
    /// a batch handler failed, and in halves after a permanent failure with no culprit (a batch
    /// handler's, or the store's), until every member has its outcome.
    async fn passes(
        &self,
        items: &mut [gather::Item],
        members: Vec<usize>,
        payloads: Vec<Option<H::Payload>>,
        outcomes: &mut [Option<Outcome>],
        place: &mut Place<'_, H::Store>,
    ) {
        let mut pending = VecDeque::from([members]);
        let mut payloads = Some(payloads);
        while let Some(members) = pending.pop_front() {
            let decoded = match payloads.take() {
                Some(payloads) => payloads,
                None => gather::decode_again::<H>(items, &members, self.envelopes),
            };
            // Only the batch's last pass may let the next batch run its handlers: a pass that
            // commits with more to come (a half) keeps the next batch waiting.
            let held = if pending.is_empty() {
                None
            } else {
                let stages = &mut *place.stages;
                Some((stages.committing.take(), stages.committed.take()))
            };
            let ended = H::Kind::pass_of(self, items, &members, decoded, outcomes, place).await;
            if let Some((committing, committed)) = held {
                place.stages.committing = committing;
                place.stages.committed = committed;
            }
            if ended == Pass::Done {
                // A store that cannot write: the members still to run wait for it, untried.
                let failure = members
                    .iter()
                    .find_map(|&k| match &outcomes[items[k].index] {
                        Some(Outcome::Unavailable(failure)) => Some(failure.clone()),
                        _ => None,
                    });
                if let Some(failure) = failure {
                    for k in pending.drain(..).flatten() {
                        let key = Some(items[k].keyed.key.clone());
                        outcomes[items[k].index] = Some(waits(&failure, key));
                    }
                }
                continue;
            }
            // Rolled back: every member is judged again in the next pass.
            for &k in &members {
                outcomes[items[k].index] = None;
            }
            match ended {
                Pass::OneByOne => {
                    for k in members.into_iter().rev() {
                        pending.push_front(vec![k]);
                    }
                }
                Pass::Exclude(excluded, outcome) => {
                    outcomes[items[excluded].index] = Some(outcome);
                    let rest: Vec<usize> = members.into_iter().filter(|&k| k != excluded).collect();
                    if !rest.is_empty() {
                        pending.push_front(rest);
                    }
                }
                _ => {
                    let (first, second) = members.split_at(members.len() / 2);
                    pending.push_front(second.to_vec());
                    pending.push_front(first.to_vec());
                }
            }
        }
    }
}
