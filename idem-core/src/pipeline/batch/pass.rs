//! Step 2 of a batch: one pass in one transaction. Begin; claim every key with one statement;
//! run the handler of each new message; store the results, remove the markers of messages that
//! failed; commit.
//!
//! [`How::Fast`]: handlers run back to back (no extra round trip per message), and the first
//! handler failure rolls everything back and asks for an isolated pass; [`How::Isolated`]: each
//! new message runs under its own savepoint, and a failure undoes that message only;
//! a batch handler runs once on every new message (see [`super::set`]).

use super::gather::Item;
use super::run::{Batch, How, Pass, Passes, Place, Run, SetEnd};
use crate::future::BoxFuture;
use crate::handler::{Handler, TransactionalHandler, kind};
use crate::model::outgoing::reply;
use crate::model::{ErrorClass, Outcome, Outgoing, StoreError, StoredOutput};
use crate::pipeline::admit::admit;
use crate::pipeline::stages::Stages;
use crate::pipeline::steps::{advance, call, encode_result, failure};
use crate::store::{Claim, ClaimRequest, Ended, InboxStore, OutboxStore, end_transaction};
use crate::telemetry;
use std::time::Instant;

/// A transactional handler's passes: the fast pass, and when one of its handlers failed (the
/// fast pass was rolled back) the pass again with every message under its own savepoint, its
/// payloads decoded anew.
impl<H: TransactionalHandler> Passes<H> for kind::Transactional {
    fn pass_of<'x>(
        batch: &'x Batch<'_, H>,
        items: &'x mut [Item],
        members: &'x [usize],
        payloads: Vec<Option<H::Payload>>,
        outcomes: &'x mut [Option<Outcome>],
        place: &'x mut Place<'_, H::Store>,
    ) -> BoxFuture<'x, Pass> {
        Box::pin(async move {
            let fast = batch
                .pass(items, members, payloads, outcomes, How::Fast, place)
                .await;
            if fast != Pass::NeedsIsolation {
                return fast;
            }
            let payloads = super::gather::decode_again::<H>(items, members, batch.envelopes);
            for &k in members {
                outcomes[items[k].index] = None;
            }
            batch
                .pass(items, members, payloads, outcomes, How::Isolated, place)
                .await
        })
    }

    fn handle<'x, 'c: 'x>(
        run: &'x mut Run<'_, '_, H>,
        tx: &'x mut <H::Store as InboxStore>::Tx<'c>,
        claims: Vec<Claim>,
        payloads: Vec<Option<H::Payload>>,
        how: How,
    ) -> BoxFuture<'x, Result<SetEnd, StoreError>> {
        Box::pin(async move {
            let isolate = how == How::Isolated;
            Ok(match run.handle(tx, claims, payloads, isolate).await? {
                Some(failed) => SetEnd::Failed(failed),
                None => SetEnd::Again(Pass::NeedsIsolation),
            })
        })
    }
}

impl<H: Handler<Kind: Passes<H>>> Batch<'_, H> {
    /// Runs one pass over the `members` of `items` (their payloads in `payloads`, by item),
    /// filling `outcomes` for every member when it ends [`Pass::Done`].
    pub(super) async fn pass(
        &self,
        items: &mut [Item],
        members: &[usize],
        payloads: Vec<Option<H::Payload>>,
        outcomes: &mut [Option<Outcome>],
        how: How,
        place: &mut Place<'_, H::Store>,
    ) -> Pass {
        let Place { stages, held } = place;
        let mut run = Run {
            batch: self,
            items,
            members,
            outcomes,
            staged: 0,
            kept: None,
        };
        let store = self.store;
        let mut tx = match store.begin_on(held).await {
            Ok(tx) => tx,
            Err(e) => return run.claim_failed(e),
        };
        // Everything in the transaction, which then ends as that says (`end_transaction`).
        let inside = run.inside(&mut tx, payloads, how, stages).await;
        let committing = inside.is_ok().then(|| {
            #[cfg(feature = "fault-injection")]
            crate::fault::maybe_crash(crate::fault::Point::BeforeCommit);
            stages.fire_committing();
            Instant::now()
        });
        let ended = end_transaction(store, tx, inside).await;
        if let Some(committing) = committing {
            telemetry::commit_duration(H::CONSUMER, committing.elapsed());
        }
        // A commit that failed leaves the next batch waiting until this one's outcomes say
        // whether it runs again (`Stages::fire_unless_waiting`).
        if ended.is_ok() {
            stages.fire_committed();
        }
        match ended {
            Ok(()) => {
                run.dispatch().await;
                Pass::Done
            }
            // It may or may not have committed; the retries find out (duplicates if it did).
            Err(Ended::NotCommitted(e)) => run.abort_store(e),
            Err(Ended::RolledBack(again)) => again,
        }
    }
}

impl<'a, H: Handler<Kind: Passes<H>>> Run<'a, '_, H> {
    /// What the pass does in its transaction once its keys are claimed: the handlers (or the
    /// batch handler), then the results stored and the failed members' markers removed; `Err`
    /// says how the pass ends instead, once its transaction is rolled back.
    async fn inside(
        &mut self,
        tx: &mut <H::Store as InboxStore>::Tx<'_>,
        payloads: Vec<Option<H::Payload>>,
        how: How,
        stages: &mut Stages,
    ) -> Result<(), Pass> {
        let claims = match self.claim(tx).await {
            Ok(claims) => claims,
            Err(e) => return Err(self.claim_failed(e)),
        };
        // The keys are ours; the handlers wait for the previous batch's commit.
        stages.wait_for_previous().await;
        let failed = match H::Kind::handle(self, tx, claims, payloads, how).await {
            Ok(SetEnd::Failed(failed)) => failed,
            Ok(SetEnd::Again(again)) => return Err(again),
            Ok(SetEnd::Abort(class, message)) => return Err(self.abort(class, message)),
            Err(e) => return Err(self.abort_store(e)),
        };
        let replies = self
            .complete(tx, &failed)
            .await
            .map_err(|e| self.abort_store(e))?;
        self.staged += u32::try_from(replies.len()).unwrap_or(u32::MAX);
        if let Some(kept) = &mut self.kept {
            kept.extend(replies);
        }
        Ok(())
    }

    /// The claims of the members, in order.
    fn requests(&self) -> Vec<ClaimRequest<'_>> {
        let Batch {
            envelopes, limits, ..
        } = *self.batch;
        let retention = limits.retention;
        self.members
            .iter()
            .map(|&k| {
                let item = &self.items[k];
                item.keyed
                    .request(H::CONSUMER, &envelopes[item.index], retention)
            })
            .collect()
    }

    /// Claims every member's key in `tx` with one statement.
    async fn claim(
        &mut self,
        tx: &mut <H::Store as InboxStore>::Tx<'_>,
    ) -> Result<Vec<Claim>, StoreError> {
        let store = self.batch.store;
        let requests = self.requests();
        let claiming = Instant::now();
        let claimed = store.claim_batch(tx, &requests).await;
        telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
        match claimed {
            Ok(claims) if claims.len() == self.members.len() => Ok(claims),
            Ok(_) => Err(StoreError::new(
                "claim",
                ErrorClass::Permanent,
                "the store answered a batch claim with the wrong number of rows",
            )),
            Err(e) => Err(e),
        }
    }

    /// How the pass ends when its claim failed: a transient failure of several members runs
    /// them one by one (a key held elsewhere waits alone), anything else as
    /// [`Run::abort_store`] says.
    fn claim_failed(&mut self, error: StoreError) -> Pass {
        if error.class() == ErrorClass::Transient && self.members.len() > 1 {
            tracing::info!(consumer = H::CONSUMER, members = self.members.len(), error = %error,
                "a batch's claim failed for now (a key held elsewhere?); running its members one by one");
            for &k in self.members {
                self.outcomes[self.items[k].index] = None;
            }
            return Pass::OneByOne;
        }
        self.abort_store(error)
    }

    /// Stores the results of the processed items, stages the replies of those whose request
    /// names a `reply_to` queue (returning them), and removes the markers of the `failed`
    /// ones.
    async fn complete(
        &self,
        tx: &mut <H::Store as InboxStore>::Tx<'_>,
        failed: &[usize],
    ) -> Result<Vec<Outgoing>, StoreError> {
        let store = self.batch.store;
        let requests = self.requests();
        let completed: Vec<(ClaimRequest<'_>, &StoredOutput)> = requests
            .iter()
            .zip(self.members.iter().map(|&k| &self.items[k]))
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
        let envelopes = self.batch.envelopes;
        let replies: Vec<Outgoing> = self
            .members
            .iter()
            .map(|&k| &self.items[k])
            .filter_map(|item| match &self.outcomes[item.index] {
                Some(Outcome::Processed { key, output }) => {
                    reply(&envelopes[item.index], H::CONSUMER, key, output)
                }
                _ => None,
            })
            .collect();
        if !replies.is_empty() {
            store
                .stage_rows(tx, H::CONSUMER, self.run_key(), &replies)
                .await?;
        }
        Ok(replies)
    }

    /// The key the members' staged messages are grouped under: the first member's.
    pub(super) fn run_key(&self) -> &str {
        self.members
            .first()
            .map_or("", |&k| self.items[k].keyed.key.as_str())
    }

    /// After the commit: publishes the messages the pass staged (those of a member rolled back
    /// to its savepoint went with it), grouped under [`Run::run_key`]: from memory when the
    /// pass kept them ([`Run::kept`]), else read back.
    async fn dispatch(&mut self) {
        if self.staged == 0 {
            return;
        }
        telemetry::staged(H::CONSUMER, u64::from(self.staged));
        let Some(dispatch) = self.batch.limits.dispatch else {
            return;
        };
        #[cfg(feature = "fault-injection")]
        crate::fault::maybe_crash(crate::fault::Point::AfterCommitBeforeDispatch);
        let kept = self.kept.take();
        dispatch
            .after_commit(H::CONSUMER, self.run_key(), kept)
            .await;
    }

    /// The pass failed in its store: a permanent failure of several members splits them (one
    /// member may have made the store refuse the pass, and only it is to be dead-lettered),
    /// anything else ends the pass as [`Run::abort`] says.
    fn abort_store(&mut self, error: StoreError) -> Pass {
        if error.class() == ErrorClass::Permanent && self.members.len() > 1 {
            tracing::info!(consumer = H::CONSUMER, members = self.members.len(), error = %error,
                "the store refused a batch's pass; running its members again in halves");
            for &k in self.members {
                self.outcomes[self.items[k].index] = None;
            }
            return Pass::Split;
        }
        self.abort(error.class(), error.to_string())
    }

    /// The pass failed as a whole: every member whose outcome is not settled by committed data
    /// fails with `message`, as `class` says.
    fn abort(&mut self, class: ErrorClass, message: String) -> Pass {
        for &k in self.members {
            let item = &self.items[k];
            let slot = &mut self.outcomes[item.index];
            if matches!(slot, None | Some(Outcome::Processed { .. })) {
                *slot = Some(failure(class, message.clone(), &item.keyed.key));
            }
        }
        Pass::Done
    }
}

impl<H: TransactionalHandler> Run<'_, '_, H> {
    /// Judges the keys that existed and runs the handler of each new message. `Ok(Some(k))`:
    /// the items whose handler failed (isolated pass); `Ok(None)`: a handler failed in a fast
    /// pass, which must be rolled back and isolated.
    async fn handle(
        &mut self,
        tx: &mut <H::Store as InboxStore>::Tx<'_>,
        claims: Vec<Claim>,
        mut payloads: Vec<Option<H::Payload>>,
        isolate: bool,
    ) -> Result<Option<Vec<usize>>, StoreError> {
        let Batch {
            store, envelopes, ..
        } = *self.batch;
        let mut first = true;
        let mut failed = Vec::new();
        let run_key = self.run_key().to_owned();
        for (&k, claim) in self.members.iter().zip(claims) {
            let item = &mut self.items[k];
            let envelope = &envelopes[item.index];
            let slot = &mut self.outcomes[item.index];
            let key = &item.keyed.key;
            match claim {
                Claim::Existing {
                    fingerprint: stored,
                    output,
                } => *slot = Some(item.existed(H::CONSUMER, envelope, stored, output)),
                Claim::Claimed => {
                    if isolate {
                        store.savepoint(tx, first).await?;
                        first = false;
                    }
                    let Some(payload) = payloads[k].take() else {
                        continue;
                    };
                    let limits = &self.batch.limits;
                    if let Some(refused) = admit::<H>(&item.keyed, limits) {
                        // Nothing was written for it; its marker goes.
                        *slot = Some(refused);
                        failed.push(k);
                        continue;
                    }
                    if let Some(stale) = advance::<H>(store, tx, &item.keyed, limits).await? {
                        // Nothing was written for it; its marker goes.
                        *slot = Some(stale);
                        failed.push(k);
                        continue;
                    }
                    let run = &run_key;
                    let called = call::<H>(store, tx, payload, envelope, key, run, limits.state);
                    let called = called.await;
                    match encode_result::<H>(store, called.result, key) {
                        Ok(output) => {
                            self.staged += called.staged;
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
}
