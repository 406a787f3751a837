//! The inbox pipeline for one delivery: decode, key, claim, run, complete, commit.
//!
//! This is where the inbox transaction is opened and where the marker is written (through the
//! [`InboxStore`]); the ack decision is made by whoever reads the returned [`Outcome`].

use crate::context::Context;
use crate::envelope::Envelope;
use crate::error::{ErrorClass, HandlerError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::handler::Handler;
use crate::outcome::{Outcome, RejectReason, Rejection, StoredOutput, Transient};
use crate::store::{Claim, ClaimRequest, InboxStore, retention_of};
use crate::telemetry;
use std::time::{Duration, Instant};

/// Processes one delivery with handler `H` in `store`'s transaction.
///
/// The marker row and the handler's writes commit together or not at all. Nothing is
/// committed unless the outcome is [`Outcome::Processed`]; every other outcome leaves the
/// database as it was.
pub async fn process<H: Handler>(store: &H::Store, envelope: &Envelope) -> Outcome {
    process_in::<H>(store, envelope, retention_of::<H>(store, None)).await
}

/// [`process`], keeping the row for `retention`.
pub(crate) async fn process_in<H: Handler>(
    store: &H::Store,
    envelope: &Envelope,
    retention: Duration,
) -> Outcome {
    let (payload, key, fingerprint) = match prepare::<H>(envelope) {
        Ok(prepared) => prepared,
        Err(rejected) => return rejected,
    };
    let request = ClaimRequest {
        consumer: H::CONSUMER,
        key: &key,
        fingerprint: &fingerprint,
        attempt: envelope.attempt,
        retention,
    };

    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return store_failure(e, &key),
    };
    let claiming = Instant::now();
    let claim = store.claim(&mut tx, &request).await;
    telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
    match claim {
        Ok(Claim::Claimed) => {}
        Ok(Claim::Existing {
            fingerprint: stored,
            output,
        }) => {
            store.rollback(tx).await;
            return existing(H::CONSUMER, envelope, key, &fingerprint, &stored, output);
        }
        Err(e) => {
            store.rollback(tx).await;
            return store_failure(e, &key);
        }
    }

    let ctx = Context::new(envelope, H::CONSUMER, &key);
    let running = Instant::now();
    let result = H::call(&mut tx, payload, &ctx).await;
    telemetry::handler_duration(H::CONSUMER, running.elapsed());
    let output = match encode_result::<H>(result, &key) {
        Ok(output) => output,
        Err(failed) => {
            store.rollback(tx).await;
            return failed;
        }
    };
    if !output.is_null()
        && let Err(e) = store.complete(&mut tx, &request, &output).await
    {
        store.rollback(tx).await;
        return store_failure(e, &key);
    }
    #[cfg(feature = "fault-injection")]
    crate::fault::maybe_crash(crate::fault::Point::BeforeCommit);
    match store.commit(tx).await {
        Ok(()) => Outcome::Processed { key, output },
        // The commit may or may not have happened; a retry finds out (it is a duplicate if it
        // did). Retrying is safe either way, acking is not.
        Err(e) => store_failure(e, &key),
    }
}

/// Decodes the payload, reads its key and fingerprints the body; a failure is the rejection.
pub(crate) fn prepare<H: Handler>(
    envelope: &Envelope,
) -> Result<(H::Payload, String, Fingerprint), Outcome> {
    let payload = H::decode(envelope).map_err(Outcome::Rejected)?;
    let key = H::key(envelope, &payload).map_err(|e| {
        Outcome::Rejected(Rejection::new(
            RejectReason::MissingKey,
            e.to_string(),
            None,
        ))
    })?;
    Ok((payload, key, Fingerprint::of(&envelope.body)))
}

/// The outcome of a message whose key was committed before: a duplicate when the payload is
/// the same, a conflict when it is not.
pub(crate) fn existing(
    consumer: &str,
    envelope: &Envelope,
    key: String,
    fingerprint: &Fingerprint,
    stored: &Fingerprint,
    output: Option<StoredOutput>,
) -> Outcome {
    let correlation_id = envelope.correlation_id.as_deref();
    if stored == fingerprint {
        tracing::debug!(consumer, %key, correlation_id, "duplicate skipped");
        Outcome::Duplicate {
            key,
            output: output.unwrap_or_else(StoredOutput::null),
        }
    } else {
        tracing::warn!(consumer, %key, correlation_id, %stored, received = %fingerprint, "same key, different payload");
        Outcome::Conflict { key }
    }
}

/// The handler's result as the output to store, or the outcome of its failure.
pub(crate) fn encode_result<H: Handler>(
    result: Result<H::Output, HandlerError>,
    key: &str,
) -> Result<StoredOutput, Outcome> {
    match result.map(|value| StoredOutput::encode(&value)) {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(e)) => Err(Outcome::Rejected(Rejection::new(
            RejectReason::Output,
            format!("the handler's result could not be serialized: {e}"),
            Some(key.to_owned()),
        ))),
        Err(e) => Err(handler_failure(e, key.to_owned())),
    }
}

fn handler_failure(error: HandlerError, key: String) -> Outcome {
    match error.class() {
        ErrorClass::Transient => Outcome::Retry(Transient {
            message: error.to_string(),
            key: Some(key),
        }),
        ErrorClass::Permanent => Outcome::Rejected(Rejection::new(
            RejectReason::Handler,
            error.to_string(),
            Some(key),
        )),
    }
}

pub(crate) fn store_failure(error: StoreError, key: &str) -> Outcome {
    failure(error.class(), error.to_string(), key)
}

/// The outcome of a store failure of `class`, described by `message`.
pub(crate) fn failure(class: ErrorClass, message: String, key: &str) -> Outcome {
    match class {
        ErrorClass::Transient => Outcome::Retry(Transient {
            message,
            key: Some(key.to_owned()),
        }),
        ErrorClass::Permanent => Outcome::Rejected(Rejection::new(
            RejectReason::Store,
            message,
            Some(key.to_owned()),
        )),
    }
}

#[cfg(test)]
mod tests {
    //! The pipeline's decisions, against an in-memory store. The real stores are tested
    //! against PostgreSQL and SQLite in the workspace's `tests/`.
    use super::*;
    use crate::key::{KeyError, KeySource, field_key};
    use std::collections::HashMap;
    use std::sync::Mutex;

    type RowId = (String, String);
    type Row = (Fingerprint, Option<StoredOutput>);

    #[derive(Default)]
    struct MemStore {
        rows: Mutex<HashMap<RowId, Row>>,
        effects: Mutex<Vec<String>>,
    }

    #[derive(Default)]
    struct MemTx {
        row: Option<(RowId, Row)>,
        effects: Vec<String>,
    }

    impl InboxStore for MemStore {
        type Tx = MemTx;
        const KIND: crate::store::StoreKind = crate::store::StoreKind::Sqlite;

        async fn check(&self) -> Result<(), StoreError> {
            Ok(())
        }

        async fn begin(&self) -> Result<MemTx, StoreError> {
            Ok(MemTx::default())
        }

        async fn claim(&self, tx: &mut MemTx, r: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
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
            tx: &mut MemTx,
            _: &ClaimRequest<'_>,
            output: &StoredOutput,
        ) -> Result<(), StoreError> {
            if let Some(row) = tx.row.as_mut() {
                row.1.1 = Some(output.clone());
            }
            Ok(())
        }

        async fn savepoint(&self, _: &mut MemTx, _: bool) -> Result<(), StoreError> {
            Ok(())
        }

        async fn rollback_to_savepoint(&self, _: &mut MemTx) -> Result<(), StoreError> {
            Ok(())
        }

        async fn unclaim(&self, _: &mut MemTx, _: &str, _: &[&str]) -> Result<(), StoreError> {
            Ok(())
        }

        async fn commit(&self, tx: MemTx) -> Result<(), StoreError> {
            if let Some((id, row)) = tx.row {
                self.rows.lock().unwrap().insert(id, row);
            }
            self.effects.lock().unwrap().extend(tx.effects);
            Ok(())
        }

        async fn rollback(&self, _: MemTx) {}
    }

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
        const NAME: &'static str = "order";
        const CONSUMER: &'static str = "test::order";
        const QUEUE: Option<&'static str> = None;
        const KEY: KeySource = KeySource::Field("order.id");

        fn key(_: &Envelope, order: &Order) -> Result<String, KeyError> {
            field_key(&order.id, Self::KEY)
        }

        async fn call<'a>(
            tx: &'a mut MemTx,
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
        process::<OrderHandler>(store, &Envelope::new(body)).await
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
