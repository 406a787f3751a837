//! Step 1 of a batch: read every delivery (decode, key, fingerprint) and keep one message per
//! key; a key's later copies in the batch wait for the first one's outcome.

use crate::handler::Handler;
use crate::model::{Envelope, Fingerprint, Outcome, StoredOutput};
use crate::pipeline::steps::{Keyed, existing, prepare};
use std::collections::HashMap;

/// One distinct key of a batch (its payload is kept apart: payloads need not be `Sync`).
pub(crate) struct Item {
    /// Its delivery's position in the batch.
    pub(super) index: usize,
    pub(super) keyed: Keyed,
    /// The fingerprint of the committed row this key matched, when it existed before.
    pub(super) stored: Option<Fingerprint>,
}

impl Item {
    /// This item's outcome when its key existed, committed with `stored` and `output` (kept
    /// for the key's later copies in the batch): a duplicate, or a conflict.
    pub(super) fn existed(
        &mut self,
        consumer: &str,
        envelope: &Envelope,
        stored: Fingerprint,
        output: Option<StoredOutput>,
    ) -> Outcome {
        self.stored = Some(stored);
        let Keyed {
            key, fingerprint, ..
        } = &self.keyed;
        existing(
            consumer,
            envelope,
            key.clone(),
            fingerprint,
            &stored,
            output,
        )
    }
}

/// A later delivery of a key that occurs earlier in the same batch.
pub(super) struct Copy {
    /// Its delivery's position in the batch.
    pub(super) index: usize,
    /// The [`Item`] of the key's first delivery.
    pub(super) first: usize,
    pub(super) keyed: Keyed,
}

/// A batch after gathering.
pub(super) struct Gathered<P> {
    /// The distinct keys, in delivery order.
    pub(super) items: Vec<Item>,
    /// The items' payloads, by item.
    pub(super) payloads: Vec<Option<P>>,
    /// The later copies of items' keys.
    pub(super) copies: Vec<Copy>,
    /// One slot per delivery; those refused while reading are filled.
    pub(super) outcomes: Vec<Option<Outcome>>,
}

/// Reads `envelopes` for handler `H`.
pub(super) fn gather<H: Handler>(envelopes: &[Envelope]) -> Gathered<H::Payload> {
    let mut gathered = Gathered {
        items: Vec::with_capacity(envelopes.len()),
        payloads: Vec::with_capacity(envelopes.len()),
        copies: Vec::new(),
        outcomes: vec![None; envelopes.len()],
    };
    let mut first_of: HashMap<String, usize> = HashMap::new();
    for (index, envelope) in envelopes.iter().enumerate() {
        if gathered.outcomes[index].is_some() {
            continue;
        }
        match prepare::<H>(envelope) {
            Err(rejected) => gathered.outcomes[index] = Some(rejected),
            Ok((payload, keyed)) => match first_of.get(&keyed.key) {
                Some(&first) => gathered.copies.push(Copy {
                    index,
                    first,
                    keyed,
                }),
                None => {
                    first_of.insert(keyed.key.clone(), gathered.items.len());
                    gathered.payloads.push(Some(payload));
                    gathered.items.push(Item {
                        index,
                        keyed,
                        stored: None,
                    });
                }
            },
        }
    }
    gathered
}

/// The payloads of the `members` of `items` decoded anew, for another pass (by item; `None`
/// for the others).
pub(super) fn decode_again<H: Handler>(
    items: &[Item],
    members: &[usize],
    envelopes: &[Envelope],
) -> Vec<Option<H::Payload>> {
    let mut payloads: Vec<Option<H::Payload>> = items.iter().map(|_| None).collect();
    for &k in members {
        payloads[k] = prepare::<H>(&envelopes[items[k].index])
            .ok()
            .map(|(payload, _)| payload);
    }
    payloads
}
