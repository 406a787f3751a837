//! Step 3 of a batch: the outcomes of the copies (duplicates or conflicts of their key's first
//! delivery, once it committed; retried if it did not), and one outcome for every delivery.

use super::gather::{Copy, Item};
use crate::model::{Envelope, Outcome, Transient};
use crate::pipeline::steps::existing;

/// Every delivery's outcome, in order, given the items' outcomes in `outcomes`.
pub(super) fn finish(
    consumer: &str,
    envelopes: &[Envelope],
    items: &[Item],
    copies: Vec<Copy>,
    mut outcomes: Vec<Option<Outcome>>,
) -> Vec<Outcome> {
    for copy in copies {
        let first = &items[copy.first];
        let Copy { index, keyed, .. } = copy;
        let envelope = &envelopes[index];
        let outcome = match (&outcomes[first.index], first.stored) {
            (Some(Outcome::Processed { output, .. }), _) => existing(
                consumer,
                envelope,
                keyed.key,
                &keyed.fingerprint,
                &first.keyed.fingerprint,
                Some(output.clone()),
            ),
            (Some(Outcome::Duplicate { output, .. }), Some(stored)) => existing(
                consumer,
                envelope,
                keyed.key,
                &keyed.fingerprint,
                &stored,
                Some(output.clone()),
            ),
            // A copy of a stale message is stale too; a different payload under its key is
            // retried (the first left no marker to judge it by).
            (Some(Outcome::Stale(stale)), _) if keyed.fingerprint == first.keyed.fingerprint => {
                Outcome::Stale(crate::model::Stale {
                    key: keyed.key,
                    ..stale.clone()
                })
            }
            (Some(Outcome::Conflict { .. }), Some(stored)) => existing(
                consumer,
                envelope,
                keyed.key,
                &keyed.fingerprint,
                &stored,
                None,
            ),
            // The store could not write the first: the copy waits for it too.
            (Some(Outcome::Unavailable(failure)), _) => Outcome::Unavailable(Transient {
                message: failure.message.clone(),
                key: Some(keyed.key),
            }),
            _ => Outcome::Retry(Transient {
                message: "an earlier copy in the same batch did not commit".to_owned(),
                key: Some(keyed.key),
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
