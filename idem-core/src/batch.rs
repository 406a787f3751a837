//! The inbox pipeline for a batch of deliveries: one transaction, one multi-row claim, the
//! handler of each new message, one commit.
//!
//! The fast pass runs the handlers back to back. If one fails, that pass is rolled back and the
//! batch runs again with each new message under its own savepoint: a message whose handler
//! fails permanently is rolled back to its savepoint and its marker removed, so it alone is
//! dead-lettered and the rest commit; a transient handler failure likewise retries only that
//! message. The happy path pays no round trip for savepoints; a failing batch runs twice. A failure of the batch itself (begin, claim, savepoint,
//! commit: the database went away) leaves nothing committed, and every message whose outcome
//! depended on it is retried.

use crate::context::Context;
use crate::envelope::Envelope;
use crate::error::{ErrorClass, StoreError};
use crate::fingerprint::Fingerprint;
use crate::handler::Handler;
use crate::outcome::{Outcome, StoredOutput, Transient};
use crate::pipeline::{encode_result, existing, failure, prepare};
use crate::store::{Claim, ClaimRequest, InboxStore, retention_of};
use crate::telemetry;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// One distinct key of a batch (its payload is kept apart: payloads need not be `Sync`).
struct Item {
    /// Its delivery's position in the batch.
    index: usize,
    key: String,
    fingerprint: Fingerprint,
    /// The fingerprint of the committed row this key matched, when it existed before.
    stored: Option<Fingerprint>,
}

/// Lets consecutive batches overlap: the next batch begins and claims its keys while this one
/// commits, and runs its handlers only once this one has committed (so their writes never wait
/// on each other's locks). A dropped sender counts as fired.
#[derive(Debug, Default)]
pub struct Stages {
    /// Resolves when the previous batch has committed (or given up).
    pub after: Option<oneshot::Receiver<()>>,
    /// Fired when this batch's handlers are done and it is about to commit.
    pub committing: Option<oneshot::Sender<()>>,
    /// Fired when this batch has committed (or given up).
    pub committed: Option<oneshot::Sender<()>>,
}

/// Processes `envelopes` with handler `H` in one transaction of `store`, returning one outcome
/// per envelope, in order.
///
/// A key that occurs twice in the batch is processed once; its later copies are duplicates (or
/// conflicts) of the first once that has committed, and are retried if it did not.
pub async fn process_batch<H: Handler>(store: &H::Store, envelopes: &[Envelope]) -> Vec<Outcome> {
    process_batch_staged::<H>(store, envelopes, Stages::default()).await
}

/// [`process_batch`], overlapping with the batches before and after it through `stages`.
pub async fn process_batch_staged<H: Handler>(
    store: &H::Store,
    envelopes: &[Envelope],
    stages: Stages,
) -> Vec<Outcome> {
    process_batch_in::<H>(store, envelopes, stages, retention_of::<H>(store, None)).await
}

/// [`process_batch_staged`], keeping the rows for `retention`.
pub(crate) async fn process_batch_in<H: Handler>(
    store: &H::Store,
    envelopes: &[Envelope],
    mut stages: Stages,
    retention: Duration,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = vec![None; envelopes.len()];
    let mut items: Vec<Item> = Vec::with_capacity(envelopes.len());
    let mut payloads: Vec<Option<H::Payload>> = Vec::with_capacity(envelopes.len());
    let mut first_of: HashMap<String, usize> = HashMap::new();
    let mut copies = Vec::new();
    for (index, envelope) in envelopes.iter().enumerate() {
        match prepare::<H>(envelope) {
            Err(rejected) => outcomes[index] = Some(rejected),
            Ok((payload, key, fingerprint)) => match first_of.get(&key) {
                Some(&item) => copies.push((index, item, key, fingerprint)),
                None => {
                    first_of.insert(key.clone(), items.len());
                    payloads.push(Some(payload));
                    items.push(Item {
                        index,
                        key,
                        fingerprint,
                        stored: None,
                    });
                }
            },
        }
    }
    if !items.is_empty() {
        let input = Input::<H> {
            store,
            envelopes,
            retention,
        };
        let pass = run::<H>(
            &input,
            &mut items,
            payloads,
            &mut outcomes,
            false,
            &mut stages,
        )
        .await;
        if pass == Pass::NeedsIsolation {
            // A handler failed in the fast pass, which was rolled back: run the batch again
            // with every message under its own savepoint. The payloads are decoded anew.
            let payloads = items
                .iter()
                .map(|item| prepare::<H>(&envelopes[item.index]).ok().map(|p| p.0))
                .collect();
            for item in &items {
                outcomes[item.index] = None;
            }
            run::<H>(
                &input,
                &mut items,
                payloads,
                &mut outcomes,
                true,
                &mut stages,
            )
            .await;
        }
    }
    for (index, item, key, fingerprint) in copies {
        let first = &items[item];
        let outcome = match (&outcomes[first.index], first.stored) {
            (Some(Outcome::Processed { output, .. }), _) => existing(
                H::CONSUMER,
                &envelopes[index],
                key,
                &fingerprint,
                &first.fingerprint,
                Some(output.clone()),
            ),
            (Some(Outcome::Duplicate { .. } | Outcome::Conflict { .. }), Some(stored)) => {
                let output = match &outcomes[first.index] {
                    Some(Outcome::Duplicate { output, .. }) => Some(output.clone()),
                    _ => None,
                };
                existing(
                    H::CONSUMER,
                    &envelopes[index],
                    key,
                    &fingerprint,
                    &stored,
                    output,
                )
            }
            _ => Outcome::Retry(Transient {
                message: "an earlier copy in the same batch did not commit".to_owned(),
                key: Some(key),
            }),
        };
        outcomes[index] = Some(outcome);
    }
    outcomes
        .into_iter()
        .map(|outcome| {
            outcome.unwrap_or_else(|| {
                Outcome::Retry(Transient {
                    message: "the batch ended before this message was processed".to_owned(),
                    key: None,
                })
            })
        })
        .collect()
}

/// How a pass over a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Every item has its outcome (committed, or failed as a whole).
    Done,
    /// A handler failed without savepoints; the transaction was rolled back.
    NeedsIsolation,
}

/// The transaction of one batch. Fills `outcomes` for every item.
///
/// Without `isolate`, handlers run without savepoints (no extra round trip per message), and
/// the first handler failure rolls everything back and asks for an isolated pass; with it,
/// each new message runs under its own savepoint, and a failure undoes that message only.
/// What every pass of a batch works on.
struct Input<'a, H: Handler> {
    store: &'a H::Store,
    envelopes: &'a [Envelope],
    retention: Duration,
}

async fn run<H: Handler>(
    input: &Input<'_, H>,
    items: &mut [Item],
    mut payloads: Vec<Option<H::Payload>>,
    outcomes: &mut [Option<Outcome>],
    isolate: bool,
    stages: &mut Stages,
) -> Pass {
    let Input {
        store,
        envelopes,
        retention,
    } = *input;
    // Fails every item whose outcome is not settled by committed data.
    let abort = |items: &[Item], outcomes: &mut [Option<Outcome>], error: StoreError| {
        let message = error.to_string();
        for item in items {
            let slot = &mut outcomes[item.index];
            if matches!(slot, None | Some(Outcome::Processed { .. })) {
                *slot = Some(failure(error.class(), message.clone(), &item.key));
            }
        }
    };

    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            abort(items, outcomes, e);
            return Pass::Done;
        }
    };
    let claimed = {
        let requests = requests(items, envelopes, H::CONSUMER, retention);
        let claiming = Instant::now();
        let claimed = store.claim_batch(&mut tx, &requests).await;
        telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
        claimed
    };
    let claims = match claimed {
        Ok(claims) if claims.len() == items.len() => claims,
        Ok(_) => {
            store.rollback(tx).await;
            let e = StoreError::new(
                "claim",
                ErrorClass::Permanent,
                "the store answered a batch claim with the wrong number of rows",
            );
            abort(items, outcomes, e);
            return Pass::Done;
        }
        Err(e) => {
            store.rollback(tx).await;
            abort(items, outcomes, e);
            return Pass::Done;
        }
    };
    // The keys are ours; the handlers wait for the previous batch's commit.
    if let Some(after) = stages.after.take() {
        let _ = after.await;
    }

    let mut first = true;
    let mut failed: Vec<usize> = Vec::new();
    for (k, claim) in claims.into_iter().enumerate() {
        let item = &mut items[k];
        let envelope = &envelopes[item.index];
        match claim {
            Claim::Existing {
                fingerprint: stored,
                output,
            } => {
                item.stored = Some(stored);
                let key = item.key.clone();
                outcomes[item.index] = Some(existing(
                    H::CONSUMER,
                    envelope,
                    key,
                    &item.fingerprint,
                    &stored,
                    output,
                ));
            }
            Claim::Claimed => {
                if isolate {
                    if let Err(e) = store.savepoint(&mut tx, first).await {
                        store.rollback(tx).await;
                        abort(items, outcomes, e);
                        return Pass::Done;
                    }
                    first = false;
                }
                let Some(payload) = payloads[k].take() else {
                    continue;
                };
                let ctx = Context::new(envelope, H::CONSUMER, &item.key);
                let running = Instant::now();
                let result = H::call(&mut tx, payload, &ctx).await;
                telemetry::handler_duration(H::CONSUMER, running.elapsed());
                match encode_result::<H>(result, &item.key) {
                    Ok(output) => {
                        outcomes[item.index] = Some(Outcome::Processed {
                            key: item.key.clone(),
                            output,
                        });
                    }
                    Err(_) if !isolate => {
                        store.rollback(tx).await;
                        return Pass::NeedsIsolation;
                    }
                    Err(failure) => {
                        outcomes[item.index] = Some(failure);
                        failed.push(k);
                        if let Err(e) = store.rollback_to_savepoint(&mut tx).await {
                            store.rollback(tx).await;
                            abort(items, outcomes, e);
                            return Pass::Done;
                        }
                    }
                }
            }
        }
    }

    let finished = async {
        let all = requests(items, envelopes, H::CONSUMER, retention);
        let completed: Vec<(ClaimRequest<'_>, &StoredOutput)> = all
            .iter()
            .zip(items.iter())
            .filter_map(|(request, item)| match &outcomes[item.index] {
                Some(Outcome::Processed { output, .. }) if !output.is_null() => {
                    Some((*request, output))
                }
                _ => None,
            })
            .collect();
        store.complete_batch(&mut tx, &completed).await?;
        if !failed.is_empty() {
            let keys: Vec<&str> = failed.iter().map(|k| items[*k].key.as_str()).collect();
            store.unclaim(&mut tx, H::CONSUMER, &keys).await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = finished {
        store.rollback(tx).await;
        abort(items, outcomes, e);
        return Pass::Done;
    }
    #[cfg(feature = "fault-injection")]
    crate::fault::maybe_crash(crate::fault::Point::BeforeCommit);
    if let Some(committing) = stages.committing.take() {
        let _ = committing.send(());
    }
    let committed = store.commit(tx).await;
    if let Some(signal) = stages.committed.take() {
        let _ = signal.send(());
    }
    if let Err(e) = committed {
        // It may or may not have committed; the retries find out (duplicates if it did).
        abort(items, outcomes, e);
    }
    Pass::Done
}

/// The claims of `items`, in order.
fn requests<'a>(
    items: &'a [Item],
    envelopes: &[Envelope],
    consumer: &'a str,
    retention: Duration,
) -> Vec<ClaimRequest<'a>> {
    items
        .iter()
        .map(|item| ClaimRequest {
            consumer,
            key: &item.key,
            fingerprint: &item.fingerprint,
            attempt: envelopes[item.index].attempt,
            retention,
        })
        .collect()
}
