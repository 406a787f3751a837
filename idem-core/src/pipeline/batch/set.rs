//! The pass of a batch handler ([`BatchHandler`]): the claims judged and the versions
//! advanced as for single handlers, then the user's function once on every new message, and
//! its results, or its failure, sorted out per message.
//!
//! A failure of one message ([`BatchError::Item`]) rolls the pass back and leaves that message
//! out of the next one (dead-lettered or retried as its error says). A permanent failure with
//! no culprit rolls back and splits the members in halves, so the message that fails alone is
//! found and only it is dead-lettered; a transient one retries every member.

use super::gather::Item;
use super::run::{Batch, How, Pass, Passes, Place, Run, SetEnd};
use crate::future::BoxFuture;
use crate::handler::{BatchHandler, Handler, kind};
use crate::model::{BatchError, Context, ErrorClass, HandlerError, Outcome, StoreError};
use crate::pipeline::admit::admit;
use crate::pipeline::steps::{advance, encode_result, handler_failure};
use crate::store::{Claim, InboxStore, OutboxStore};
use crate::telemetry;

/// A batch handler's passes: one each time, the handler once on every new message.
impl<H: BatchHandler> Passes<H> for kind::Batch {
    fn pass_of<'x>(
        batch: &'x Batch<'_, H>,
        items: &'x mut [Item],
        members: &'x [usize],
        payloads: Vec<Option<H::Payload>>,
        outcomes: &'x mut [Option<Outcome>],
        place: &'x mut Place<'_, H::Store>,
    ) -> BoxFuture<'x, Pass> {
        Box::pin(batch.pass(items, members, payloads, outcomes, How::Fast, place))
    }

    fn handle<'x, 'c: 'x>(
        run: &'x mut Run<'_, '_, H>,
        tx: &'x mut <H::Store as InboxStore>::Tx<'c>,
        claims: Vec<Claim>,
        payloads: Vec<Option<H::Payload>>,
        _: How,
    ) -> BoxFuture<'x, Result<SetEnd, StoreError>> {
        Box::pin(handle(run, tx, claims, payloads))
    }
}

/// Judges the members' claims and runs the batch handler once on the new ones.
async fn handle<H: BatchHandler>(
    run: &mut Run<'_, '_, H>,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    claims: Vec<Claim>,
    payloads: Vec<Option<H::Payload>>,
) -> Result<SetEnd, StoreError> {
    let (fresh, unclaimed) = judge(run, tx, claims, payloads).await?;
    if fresh.is_empty() {
        return Ok(SetEnd::Failed(unclaimed));
    }
    let fresh_items: Vec<usize> = fresh.iter().map(|(k, _)| *k).collect();
    let result = call(run, tx, fresh).await;
    Ok(sort_out(run, result, &fresh_items, unclaimed))
}

/// The members' claims judged: duplicates and conflicts settled, poison and stale messages
/// left out (their markers go: `unclaimed`), and the new messages with their payloads.
async fn judge<H: Handler>(
    run: &mut Run<'_, '_, H>,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    claims: Vec<Claim>,
    mut payloads: Vec<Option<H::Payload>>,
) -> Result<(Vec<(usize, H::Payload)>, Vec<usize>), StoreError> {
    let Batch {
        store,
        envelopes,
        limits,
    } = *run.batch;
    let mut fresh = Vec::with_capacity(claims.len());
    let mut unclaimed = Vec::new();
    for (&k, claim) in run.members.iter().zip(claims) {
        let item = &mut run.items[k];
        let envelope = &envelopes[item.index];
        match claim {
            Claim::Existing {
                fingerprint: stored,
                output,
            } => {
                run.outcomes[item.index] =
                    Some(item.existed(H::CONSUMER, envelope, stored, output));
            }
            Claim::Claimed => {
                let Some(payload) = payloads[k].take() else {
                    continue;
                };
                if let Some(refused) = admit::<H>(&item.keyed, &limits) {
                    // Nothing was written for it, and its marker goes.
                    run.outcomes[item.index] = Some(refused);
                    unclaimed.push(k);
                    continue;
                }
                if let Some(outcome) = advance::<H>(store, tx, &item.keyed, &limits).await? {
                    // Stale: nothing is written for it, and its marker goes.
                    run.outcomes[item.index] = Some(outcome);
                    unclaimed.push(k);
                    continue;
                }
                fresh.push((k, payload));
            }
        }
    }
    Ok((fresh, unclaimed))
}

/// The batch handler, called once on the new messages (`fresh`, not empty), each with a
/// context of its own and the batch's context over them; what it staged is counted in `run`.
async fn call<H: BatchHandler>(
    run: &mut Run<'_, '_, H>,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    fresh: Vec<(usize, H::Payload)>,
) -> Result<Vec<H::Output>, BatchError> {
    let Batch {
        store,
        envelopes,
        limits,
    } = *run.batch;
    let fresh_items: Vec<usize> = fresh.iter().map(|(k, _)| *k).collect();
    let first = fresh_items[0];
    let batch = crate::model::Batch::new(
        fresh
            .into_iter()
            .map(|(k, payload)| (run.items[k].keyed.key.clone(), payload)),
    );
    let (result, staged, kept) = {
        let run_key = run.run_key();
        let outbox = store.outbox_table();
        let transaction = store.transaction_identity(tx);
        let context = |k: usize| {
            let item = &run.items[k];
            Context::new(&envelopes[item.index], H::CONSUMER, &item.keyed.key)
                .with_state(limits.state)
                .with_outbox(outbox)
                .with_run(run_key)
                .with_transaction(transaction)
        };
        let items: Vec<Context<'_>> = fresh_items.iter().map(|&k| context(k)).collect();
        let ctx = context(first).with_items(&items);
        let running = telemetry::HandlerRun::start(H::CONSUMER);
        let result = <H as BatchHandler>::call(tx, batch, &ctx).await;
        running.end();
        (result, ctx.staged(), ctx.kept())
    };
    run.staged += staged;
    // Published from memory after the commit when the handler staged every message through
    // the batch's context (as `stage_all` does), else read back.
    run.kept = kept;
    result
}

/// The handler's results sorted out per message: every output recorded, or the pass run
/// again without the message at fault, in halves, or aborted as the error's class says.
fn sort_out<H: Handler>(
    run: &mut Run<'_, '_, H>,
    result: Result<Vec<H::Output>, BatchError>,
    fresh_items: &[usize],
    unclaimed: Vec<usize>,
) -> SetEnd {
    let store = run.batch.store;
    let error = match result {
        Ok(outputs) if outputs.len() == fresh_items.len() => {
            for (&k, output) in fresh_items.iter().zip(outputs) {
                let item = &run.items[k];
                let key = &item.keyed.key;
                match encode_result::<H>(store, Ok(output), key) {
                    Ok(output) => {
                        let key = key.clone();
                        run.outcomes[item.index] = Some(Outcome::Processed { key, output });
                    }
                    Err(failure) => return SetEnd::Again(Pass::Exclude(k, failure)),
                }
            }
            return SetEnd::Failed(unclaimed);
        }
        Ok(outputs) => HandlerError::permanent(format!(
            "the batch handler returned {} results for {} messages",
            outputs.len(),
            fresh_items.len()
        )),
        Err(BatchError::Item { index, error }) => match fresh_items.get(index) {
            Some(&k) => {
                let error = error.classify(|e| store.classify(e));
                let outcome = handler_failure(error, &run.items[k].keyed.key);
                return SetEnd::Again(Pass::Exclude(k, outcome));
            }
            None => HandlerError::permanent(format!(
                "the batch handler failed message {index} of a batch of {}: {error}",
                fresh_items.len()
            )),
        },
        Err(BatchError::Batch(error)) => error.classify(|e| store.classify(e)),
    };
    match (error.class(), fresh_items) {
        (Some(ErrorClass::Permanent), [only]) => {
            let outcome = handler_failure(error, &run.items[*only].keyed.key);
            SetEnd::Again(Pass::Exclude(*only, outcome))
        }
        (Some(ErrorClass::Permanent), _) => SetEnd::Again(Pass::Split),
        (Some(ErrorClass::Unavailable), _) => {
            SetEnd::Abort(ErrorClass::Unavailable, error.to_string())
        }
        _ => SetEnd::Abort(ErrorClass::Transient, error.to_string()),
    }
}
