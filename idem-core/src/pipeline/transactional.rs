//! The per-message pipeline of a transactional handler: decode, key, claim, run, complete,
//! commit.
//!
//! This is where the inbox transaction is **opened**, where the store **writes the inbox
//! row** (its claim), and where it ends (through [`end_transaction`]); the ack decision is made by whoever reads the returned [`Outcome`]
//! (`runtime/settle.rs`).

use super::admit::admit;
use super::steps::{
    Keyed, Limits, advance, call, count_start, encode_result, prepare, refused, reply_again,
    settle_counts, store_failure,
};
use crate::handler::{Handler, TransactionalHandler};
use crate::model::outgoing::reply;
use crate::model::{Envelope, Outcome};
use crate::store::{Admission, Ended, InboxStore, OutboxStore, end_transaction};
use crate::telemetry;
use std::time::Instant;

/// Processes one delivery with handler `H` in `store`'s transaction, within `limits`, on the
/// connection `held` keeps.
///
/// The marker row and the handler's writes commit together or not at all. Nothing is
/// committed unless the outcome is [`Outcome::Processed`]; every other outcome leaves the
/// database as it was.
pub(crate) async fn process<H: TransactionalHandler>(
    store: &H::Store,
    envelope: &Envelope,
    limits: Limits<'_>,
    held: &mut Option<<H::Store as InboxStore>::Held>,
) -> Outcome {
    let (payload, mut keyed) = match prepare::<H>(envelope) {
        Ok(prepared) => prepared,
        Err(rejected) => return rejected,
    };
    count_start::<H>(store, envelope, &mut keyed, limits.retention, limits.poison).await;
    let outcome = run::<H>(store, envelope, payload, &keyed, limits, held).await;
    if keyed.unsettled.is_some() {
        settle_counts::<H>(store, &[(keyed.key.as_str(), &outcome)]).await;
    }
    outcome
}

/// [`process`] once the delivery is read and its handler's run counted: the transaction is
/// begun, everything in it runs ([`inside`]), and it ends as that says ([`end_transaction`]:
/// committed, or rolled back).
async fn run<H: TransactionalHandler>(
    store: &H::Store,
    envelope: &Envelope,
    payload: H::Payload,
    keyed: &Keyed,
    limits: Limits<'_>,
    held: &mut Option<<H::Store as InboxStore>::Held>,
) -> Outcome {
    let key = &keyed.key;
    let mut tx = match store.begin_on(held).await {
        Ok(tx) => tx,
        Err(e) => return store_failure(e, key),
    };
    let inside = inside::<H>(store, &mut tx, envelope, payload, keyed, &limits).await;
    #[cfg(feature = "fault-injection")]
    if inside.is_ok() {
        crate::fault::maybe_crash(crate::fault::Point::BeforeCommit);
    }
    let committing = inside.is_ok().then(Instant::now);
    let ended = end_transaction(store, tx, inside).await;
    if let Some(committing) = committing {
        telemetry::commit_duration(H::CONSUMER, committing.elapsed());
    }
    match ended {
        Ok(done) => committed::<H>(key, done, limits.dispatch).await,
        // The commit may or may not have happened; a retry finds out (it is a duplicate if it
        // did). Retrying is safe either way, acking is not.
        Err(Ended::NotCommitted(e)) => store_failure(e, key),
        Err(Ended::RolledBack(Abort::With(outcome))) => outcome,
        // A stored reply is sent again once the transaction is over.
        Err(Ended::RolledBack(Abort::Duplicate(found))) => {
            reply_again(H::CONSUMER, envelope, found, limits.dispatch).await
        }
    }
}

/// Why a transaction is rolled back: the outcome, or a key found already claimed (whose
/// stored reply goes out again after the rollback).
enum Abort {
    With(Outcome),
    Duplicate(Outcome),
}

impl From<Outcome> for Abort {
    fn from(outcome: Outcome) -> Self {
        Self::With(outcome)
    }
}

/// What a run that is to commit leaves: its output, and the messages it staged (those kept in
/// memory for the dispatch after the commit).
struct Done {
    output: crate::model::StoredOutput,
    staged: u32,
    kept: Option<Vec<crate::model::Outgoing>>,
}

/// Everything in the transaction: claim, poison verdict, version, the handler, completion and
/// the reply staged.
async fn inside<H: TransactionalHandler>(
    store: &H::Store,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    envelope: &Envelope,
    payload: H::Payload,
    keyed: &Keyed,
    limits: &Limits<'_>,
) -> Result<Done, Abort> {
    let request = keyed.request(H::CONSUMER, envelope, limits.retention);
    let key = &keyed.key;
    if limits.inject_failure {
        return Err(super::steps::injected_failure(key).into());
    }
    let claiming = Instant::now();
    let claim = store.claim(tx, &request).await;
    telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
    match claim.map(|claim| Admission::of_claim(Some(claim), &keyed.fingerprint)) {
        Ok(Admission::Run { .. }) => {}
        Ok(Admission::Refused(refusal)) => {
            let fingerprint = &keyed.fingerprint;
            let found = refused(H::CONSUMER, envelope, key.clone(), fingerprint, refusal);
            return Err(Abort::Duplicate(found));
        }
        Err(e) => return Err(store_failure(e, key).into()),
    }
    if let Some(refused) = admit::<H>(keyed, limits) {
        return Err(refused.into());
    }
    match advance::<H>(store, tx, keyed, limits).await {
        Ok(None) => {}
        Ok(Some(stale)) => return Err(stale.into()),
        Err(e) => return Err(store_failure(e, key).into()),
    }
    let called = call::<H>(store, tx, payload, envelope, key, key, limits.state).await;
    let output = encode_result::<H>(store, called.result, key).map_err(Abort::With)?;
    if !output.is_null()
        && let Err(e) = store.complete(tx, &request, &output).await
    {
        return Err(store_failure(e, key).into());
    }
    let (mut staged, mut kept) = (called.staged, called.kept);
    if let Some(reply) = reply(envelope, H::CONSUMER, key, &output) {
        let replies = std::slice::from_ref(&reply);
        if let Err(e) = store.stage_rows(tx, H::CONSUMER, key, replies).await {
            return Err(store_failure(e, key).into());
        }
        staged += 1;
        if let Some(kept) = &mut kept {
            kept.push(reply);
        }
    }
    Ok(Done {
        output,
        staged,
        kept,
    })
}

/// After the commit: dispatches what the run staged, and the outcome.
async fn committed<H: Handler>(
    key: &str,
    done: Done,
    dispatch: Option<crate::outbox::Dispatch<'_>>,
) -> Outcome {
    if done.staged > 0 {
        telemetry::staged(H::CONSUMER, u64::from(done.staged));
        if let Some(dispatch) = dispatch {
            #[cfg(feature = "fault-injection")]
            crate::fault::maybe_crash(crate::fault::Point::AfterCommitBeforeDispatch);
            dispatch.after_commit(H::CONSUMER, key, done.kept).await;
        }
    }
    Outcome::Processed {
        key: key.to_owned(),
        output: done.output,
    }
}

#[cfg(test)]
mod tests {
    //! The pipeline's decisions, against an in-memory store. The real stores are tested
    //! against PostgreSQL and SQLite in the workspace's `tests/`.
    use super::*;
    use crate::model::{Context, Fingerprint};
    use crate::model::{
        HandlerError, KeyError, KeySource, RejectReason, StoreError, StoredOutput, field_key,
    };
    use crate::store::{Claim, ClaimRequest, StoreKind};
    use std::collections::HashMap;
    use std::sync::Mutex;

    type RowId = (String, String);
    type Row = (Fingerprint, Option<StoredOutput>);

    #[derive(Default)]
    struct MemStore {
        rows: Mutex<HashMap<RowId, Row>>,
        effects: Mutex<Vec<String>>,
        /// The poison limit's count fails, as this class says.
        failing_count: Mutex<Option<crate::model::ErrorClass>>,
    }

    #[derive(Default)]
    struct MemTx {
        row: Option<(RowId, Row)>,
        effects: Vec<String>,
    }

    impl InboxStore for MemStore {
        type Tx<'c> = MemTx;
        type Held = ();
        const KIND: StoreKind = StoreKind::new("Memory", "memory", "MemStore");

        async fn check(&self) -> Result<(), StoreError> {
            Ok(())
        }

        async fn begin(&self) -> Result<MemTx, StoreError> {
            Ok(MemTx::default())
        }

        async fn begin_on(&self, _: &mut Option<()>) -> Result<MemTx, StoreError> {
            Ok(MemTx::default())
        }

        async fn claim(
            &self,
            tx: &mut Self::Tx<'_>,
            r: &ClaimRequest<'_>,
        ) -> Result<Claim, StoreError> {
            let id = (r.consumer.to_owned(), r.key.to_owned());
            if let Some((fingerprint, output)) = self.rows.lock().unwrap().get(&id) {
                return Ok(Claim::Existing {
                    fingerprint: *fingerprint,
                    output: output.clone(),
                });
            }
            tx.row = Some((id, (*r.fingerprint, None)));
            Ok(Claim::Claimed)
        }

        async fn complete(
            &self,
            tx: &mut Self::Tx<'_>,
            _: &ClaimRequest<'_>,
            output: &StoredOutput,
        ) -> Result<(), StoreError> {
            if let Some(row) = tx.row.as_mut() {
                row.1.1 = Some(output.clone());
            }
            Ok(())
        }

        async fn savepoint(&self, _: &mut Self::Tx<'_>, _: bool) -> Result<(), StoreError> {
            Ok(())
        }

        async fn rollback_to_savepoint(&self, _: &mut Self::Tx<'_>) -> Result<(), StoreError> {
            Ok(())
        }

        async fn unclaim(
            &self,
            _: &mut Self::Tx<'_>,
            _: &str,
            _: &[&str],
        ) -> Result<(), StoreError> {
            Ok(())
        }

        async fn commit(&self, tx: Self::Tx<'_>) -> Result<(), StoreError> {
            if let Some((id, row)) = tx.row {
                self.rows.lock().unwrap().insert(id, row);
            }
            self.effects.lock().unwrap().extend(tx.effects);
            Ok(())
        }

        async fn rollback(&self, _: Self::Tx<'_>) {}
    }

    // The optional roles, at their defaults: a minimal store.
    impl crate::store::LeaseStore for MemStore {}
    impl crate::store::DeadLetterStore for MemStore {
        async fn count_delivery(&self, _: &ClaimRequest<'_>) -> Result<u32, StoreError> {
            match *self.failing_count.lock().unwrap() {
                Some(class) => Err(StoreError::new("count delivery", class, "cannot count")),
                None => Ok(1),
            }
        }
    }
    impl crate::store::SweepStore for MemStore {}
    impl crate::store::OutboxStore for MemStore {}
    impl crate::store::ParkingStore for MemStore {}

    #[derive(serde::Deserialize)]
    struct Order {
        id: String,
        fail: Option<String>,
    }

    struct OrderHandler;

    impl Handler for OrderHandler {
        type Store = MemStore;
        type Payload = Order;
        type Output = u32;
        type Kind = crate::handler::kind::Transactional;
        const NAME: &'static str = "order";
        const CONSUMER: &'static str = "test::order";
        const QUEUE: Option<&'static str> = None;
        const KEY: KeySource = KeySource::Field("order.id");

        fn key(_: &Envelope, order: &Order) -> Result<String, KeyError> {
            field_key(&order.id, Self::KEY)
        }
    }

    impl TransactionalHandler for OrderHandler {
        async fn call<'a, 'c: 'a>(
            tx: &'a mut <MemStore as InboxStore>::Tx<'c>,
            order: Order,
            _: &'a Context<'a>,
        ) -> Result<u32, HandlerError> {
            match order.fail.as_deref() {
                Some("transient") => Err(HandlerError::transient("database went away")),
                Some(_) => Err(HandlerError::permanent("no such customer")),
                None => {
                    tx.effects.push(order.id);
                    Ok(7)
                }
            }
        }
    }

    async fn run(store: &MemStore, body: &str) -> Outcome {
        run_envelope(store, Envelope::new(body)).await
    }

    async fn run_envelope(store: &MemStore, envelope: Envelope) -> Outcome {
        let limits = Limits {
            retention: std::time::Duration::from_secs(60),
            poison: Some(5),
            inject_failure: false,
            dead_letter_stale: false,
            state: &crate::state::EMPTY,
            dispatch: None,
        };
        process::<OrderHandler>(store, &envelope, limits, &mut None).await
    }

    /// A redelivered copy whose run cannot be counted for the poison limit: a copy of a
    /// completed key is still a duplicate; a new key is held or retried as the count's failure
    /// says, and never dead-lettered for it unless the store refused the count for good.
    #[tokio::test]
    async fn a_failed_count_never_dead_letters_a_copy_of_a_completed_key() {
        use crate::model::ErrorClass;
        let store = MemStore::default();
        assert_eq!(run(&store, r#"{"id":"a"}"#).await.label(), "processed");
        let redelivered = |body: &str| {
            let mut envelope = Envelope::new(body);
            envelope.redelivered = true;
            envelope
        };
        for (class, new_key) in [
            (ErrorClass::Unavailable, "unavailable"),
            (ErrorClass::Transient, "retry"),
            (ErrorClass::Permanent, "rejected"),
        ] {
            *store.failing_count.lock().unwrap() = Some(class);
            let copy = run_envelope(&store, redelivered(r#"{"id":"a"}"#)).await;
            assert_eq!(copy.label(), "duplicate", "{class}");
            let new = run_envelope(&store, redelivered(r#"{"id":"n"}"#)).await;
            assert_eq!(new.label(), new_key, "{class}");
        }
        assert_eq!(*store.effects.lock().unwrap(), vec!["a".to_owned()]);
    }

    #[tokio::test]
    async fn decisions() {
        let store = MemStore::default();
        let first = run(&store, r#"{"id":"a"}"#).await;
        assert_eq!(first.label(), "processed");
        assert_eq!(first.output().unwrap().decode::<u32>().unwrap(), 7);
        let again = run(&store, r#"{"id":"a"}"#).await;
        assert_eq!(again.label(), "duplicate");
        assert_eq!(again.output().unwrap().decode::<u32>().unwrap(), 7);
        let conflict = run(&store, r#"{"id":"a","fail":null}"#).await;
        assert_eq!(conflict, Outcome::Conflict { key: "a".into() });
        assert_eq!(*store.effects.lock().unwrap(), vec!["a".to_owned()]);

        let transient = run(&store, r#"{"id":"b","fail":"transient"}"#).await;
        assert!(matches!(transient, Outcome::Retry(ref t) if t.key.as_deref() == Some("b")));
        let permanent = run(&store, r#"{"id":"c","fail":"permanent"}"#).await;
        assert!(
            matches!(permanent, Outcome::Rejected(ref r) if r.reason == RejectReason::Handler),
            "{permanent:?}"
        );
        assert_eq!(run(&store, r#"{"id":"b"}"#).await.label(), "processed");

        let undecodable = run(&store, "not json").await;
        assert!(
            matches!(undecodable, Outcome::Rejected(ref r) if r.reason == RejectReason::Decode)
        );
        let empty_key = run(&store, r#"{"id":""}"#).await;
        assert!(
            matches!(empty_key, Outcome::Rejected(ref r) if r.reason == RejectReason::MissingKey)
        );
        assert_eq!(store.rows.lock().unwrap().len(), 2);
    }
}
