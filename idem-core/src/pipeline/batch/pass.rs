//! Step 2 of a batch: one pass in one transaction. Begin; claim every key with one statement;
//! run the handler of each new message; store the results, remove the markers of messages that
//! failed; commit.
//!
//! Without `isolate`, handlers run back to back (no extra round trip per message), and the
//! first handler failure rolls everything back and asks for an isolated pass; with it, each new
//! message runs under its own savepoint, and a failure undoes that message only.

use super::gather::Item;
use crate::handler::Handler;
use crate::model::{Envelope, ErrorClass, Outcome, StoreError, StoredOutput};
use crate::pipeline::stages::Stages;
use crate::pipeline::steps::{Limits, advance, call, encode_result, existing, failure};
use crate::store::{Claim, ClaimRequest, InboxStore};
use crate::telemetry;
use std::time::Instant;

/// How a pass over a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Every item has its outcome (committed, or failed as a whole).
    Done,
    /// A handler failed without savepoints; the transaction was rolled back.
    NeedsIsolation,
}

/// What every pass of a batch works on.
pub(super) struct Batch<'a, H: Handler> {
    pub(super) store: &'a H::Store,
    pub(super) envelopes: &'a [Envelope],
    /// Its rows' retention, its state, what becomes of stale messages.
    pub(super) limits: Limits<'a>,
}

/// The transaction of one pass, and where its outcomes go.
struct Run<'a, 'b, H: Handler> {
    batch: &'b Batch<'a, H>,
    items: &'b mut [Item],
    outcomes: &'b mut [Option<Outcome>],
}

impl<H: Handler> Batch<'_, H> {
    /// Runs one pass over `items` (their payloads in `payloads`), filling `outcomes` for every
    /// item unless it asks for an isolated pass.
    pub(super) async fn pass(
        &self,
        items: &mut [Item],
        payloads: Vec<Option<H::Payload>>,
        outcomes: &mut [Option<Outcome>],
        isolate: bool,
        stages: &mut Stages,
    ) -> Pass {
        let mut run = Run {
            batch: self,
            items,
            outcomes,
        };
        let store = self.store;
        let (mut tx, claims) = match run.claim().await {
            Ok(claimed) => claimed,
            Err(e) => return run.abort(e),
        };
        // The keys are ours; the handlers wait for the previous batch's commit.
        stages.wait_for_previous().await;
        let failed = match run.handle(&mut tx, claims, payloads, isolate).await {
            Ok(Some(failed)) => failed,
            Ok(None) => {
                store.rollback(tx).await;
                return Pass::NeedsIsolation;
            }
            Err(e) => {
                store.rollback(tx).await;
                return run.abort(e);
            }
        };
        if let Err(e) = run.complete(&mut tx, &failed).await {
            store.rollback(tx).await;
            return run.abort(e);
        }
        #[cfg(feature = "fault-injection")]
        crate::fault::maybe_crash(crate::fault::Point::BeforeCommit);
        stages.fire_committing();
        let committed = store.commit(tx).await;
        stages.fire_committed();
        if let Err(e) = committed {
            // It may or may not have committed; the retries find out (duplicates if it did).
            return run.abort(e);
        }
        Pass::Done
    }
}

impl<H: Handler> Run<'_, '_, H> {
    /// The claims of the items, in order.
    fn requests(&self) -> Vec<ClaimRequest<'_>> {
        let Batch {
            envelopes, limits, ..
        } = *self.batch;
        let retention = limits.retention;
        self.items
            .iter()
            .map(|item| {
                item.keyed
                    .request(H::CONSUMER, &envelopes[item.index], retention)
            })
            .collect()
    }

    /// Begins the transaction and claims every item's key with one statement.
    async fn claim(&mut self) -> Result<(<H::Store as InboxStore>::Tx, Vec<Claim>), StoreError> {
        let store = self.batch.store;
        let mut tx = store.begin().await?;
        let claimed = {
            let requests = self.requests();
            let claiming = Instant::now();
            let claimed = store.claim_batch(&mut tx, &requests).await;
            telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
            claimed
        };
        match claimed {
            Ok(claims) if claims.len() == self.items.len() => Ok((tx, claims)),
            Ok(_) => {
                store.rollback(tx).await;
                Err(StoreError::new(
                    "claim",
                    ErrorClass::Permanent,
                    "the store answered a batch claim with the wrong number of rows",
                ))
            }
            Err(e) => {
                store.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Judges the keys that existed and runs the handler of each new message. `Ok(Some(k))`:
    /// the items whose handler failed (isolated pass); `Ok(None)`: a handler failed in a fast
    /// pass, which must be rolled back and isolated.
    async fn handle(
        &mut self,
        tx: &mut <H::Store as InboxStore>::Tx,
        claims: Vec<Claim>,
        mut payloads: Vec<Option<H::Payload>>,
        isolate: bool,
    ) -> Result<Option<Vec<usize>>, StoreError> {
        let Batch {
            store, envelopes, ..
        } = *self.batch;
        let mut first = true;
        let mut failed = Vec::new();
        for (k, claim) in claims.into_iter().enumerate() {
            let item = &mut self.items[k];
            let envelope = &envelopes[item.index];
            let slot = &mut self.outcomes[item.index];
            let (key, fingerprint) = (&item.keyed.key, &item.keyed.fingerprint);
            match claim {
                Claim::Existing {
                    fingerprint: stored,
                    output,
                } => {
                    item.stored = Some(stored);
                    let outcome = existing(
                        H::CONSUMER,
                        envelope,
                        key.clone(),
                        fingerprint,
                        &stored,
                        output,
                    );
                    *slot = Some(outcome);
                }
                Claim::Claimed => {
                    if isolate {
                        store.savepoint(tx, first).await?;
                        first = false;
                    }
                    let Some(payload) = payloads[k].take() else {
                        continue;
                    };
                    let limits = &self.batch.limits;
                    if let Some(stale) = advance::<H>(store, tx, &item.keyed, limits).await? {
                        // Nothing was written for it; its marker goes.
                        *slot = Some(stale);
                        failed.push(k);
                        continue;
                    }
                    let result = call::<H>(tx, payload, envelope, key, limits.state).await;
                    match encode_result::<H>(store, result, key) {
                        Ok(output) => {
                            let key = key.clone();
                            *slot = Some(Outcome::Processed { key, output });
                        }
                        Err(_) if !isolate => return Ok(None),
                        Err(failure) => {
                            *slot = Some(failure);
                            failed.push(k);
                            store.rollback_to_savepoint(tx).await?;
                        }
                    }
                }
            }
        }
        Ok(Some(failed))
    }

    /// Stores the results of the processed items and removes the markers of the `failed` ones.
    async fn complete(
        &self,
        tx: &mut <H::Store as InboxStore>::Tx,
        failed: &[usize],
    ) -> Result<(), StoreError> {
        let store = self.batch.store;
        let requests = self.requests();
        let completed: Vec<(ClaimRequest<'_>, &StoredOutput)> = requests
            .iter()
            .zip(self.items.iter())
            .filter_map(|(request, item)| match &self.outcomes[item.index] {
                Some(Outcome::Processed { output, .. }) if !output.is_null() => {
                    Some((*request, output))
                }
                _ => None,
            })
            .collect();
        store.complete_batch(tx, &completed).await?;
        if !failed.is_empty() {
            let keys: Vec<&str> = failed
                .iter()
                .map(|k| self.items[*k].keyed.key.as_str())
                .collect();
            store.unclaim(tx, H::CONSUMER, &keys).await?;
        }
        Ok(())
    }

    /// The pass failed as a whole: every item whose outcome is not settled by committed data
    /// fails with `error`.
    fn abort(&mut self, error: StoreError) -> Pass {
        let message = error.to_string();
        for item in self.items.iter() {
            let slot = &mut self.outcomes[item.index];
            if matches!(slot, None | Some(Outcome::Processed { .. })) {
                *slot = Some(failure(error.class(), message.clone(), &item.keyed.key));
            }
        }
        Pass::Done
    }
}
