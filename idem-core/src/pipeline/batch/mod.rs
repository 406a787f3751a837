//! The pipeline for a batch of deliveries of a transactional handler: one transaction, one
//! multi-row claim, the handler of each new message, one commit. In three steps:
//!
//! 1. [`gather`]: read every delivery, keep one message per key;
//! 2. [`pass`]: the transaction. The fast pass runs the handlers back to back. If one fails,
//!    that pass is rolled back and the batch runs again with each new message under its own
//!    savepoint: a message whose handler fails permanently is rolled back to its savepoint and
//!    its marker removed, so it alone is dead-lettered and the rest commit; a transient handler
//!    failure likewise retries only that message. The happy path pays no round trip for
//!    savepoints; a failing batch runs twice. A failure of the batch itself (begin, claim,
//!    savepoint, commit: the database went away) leaves nothing committed, and every message
//!    whose outcome depended on it is retried;
//! 3. [`finish`]: the outcomes of the copies and of every delivery.

mod finish;
mod gather;
mod pass;

use crate::handler::Handler;
use crate::model::{Envelope, Outcome};
use crate::pipeline::stages::Stages;
use pass::{Batch, Pass};
use std::time::Duration;

/// Processes `envelopes` with handler `H` in one transaction of `store`, keeping the rows for
/// `retention`; one outcome per envelope, in order. Overlaps with the batches before and after
/// it through `stages`.
///
/// A key that occurs twice in the batch is processed once; its later copies are duplicates (or
/// conflicts) of the first once that has committed, and are retried if it did not.
pub(crate) async fn process<H: Handler>(
    store: &H::Store,
    envelopes: &[Envelope],
    mut stages: Stages,
    retention: Duration,
) -> Vec<Outcome> {
    let gather::Gathered {
        mut items,
        payloads,
        copies,
        mut outcomes,
    } = gather::gather::<H>(envelopes);
    if !items.is_empty() {
        let batch = Batch::<H> {
            store,
            envelopes,
            retention,
        };
        let fast = batch
            .pass(&mut items, payloads, &mut outcomes, false, &mut stages)
            .await;
        if fast == Pass::NeedsIsolation {
            // A handler failed in the fast pass, which was rolled back: run the batch again
            // with every message under its own savepoint. The payloads are decoded anew.
            let payloads = gather::decode_again::<H>(&items, envelopes);
            for item in &items {
                outcomes[item.index] = None;
            }
            batch
                .pass(&mut items, payloads, &mut outcomes, true, &mut stages)
                .await;
        }
    }
    finish::finish(H::CONSUMER, envelopes, &items, copies, outcomes)
}
