//! What a batch handler receives ([`Batch`]), returns ([`BatchOutput`]) and fails with
//! ([`BatchError`]).

use super::error::HandlerError;
use std::ops::Deref;

/// The new messages of a batch, in delivery order: what a batch handler
/// (`orders: idem::Batch<OrderPlaced>`) receives, after in-batch and inbox deduplication, in
/// the transaction that holds their inbox rows. Reads as a slice (`orders.iter()`,
/// `orders[i]`, `orders.len()`); [`Batch::keys`] gives each message's dedup key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T> {
    items: Vec<T>,
    keys: Vec<String>,
}

impl<T> Batch<T> {
    /// A batch of `(dedup key, payload)` pairs, in order. The runtime builds these; tests that
    /// call a batch handler directly can too.
    pub fn new(items: impl IntoIterator<Item = (String, T)>) -> Self {
        let (keys, items) = items.into_iter().unzip();
        Self { items, keys }
    }

    /// The dedup key of each message, in the batch's order.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// The payloads, owned, in order.
    pub fn into_vec(self) -> Vec<T> {
        self.items
    }
}

impl<T> Deref for Batch<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.items
    }
}

impl<T> IntoIterator for Batch<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Batch<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

/// How a batch handler fails: one message of the batch, or the batch as a whole.
///
/// `?` on anything that converts into a [`HandlerError`] (a `sqlx::Error`, a
/// `serde_json::Error`, a `HandlerError`) gives [`BatchError::Batch`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The message at `index` of the [`Batch`] failed: it alone is dead-lettered (permanent)
    /// or retried (transient), and the batch runs again without it.
    #[error("message {index} of the batch failed: {error}")]
    Item {
        /// Its position in the batch.
        index: usize,
        /// Why, and whether it is worth a retry.
        error: HandlerError,
    },
    /// The batch failed with no culprit named. Transient: the whole batch is retried.
    /// Permanent: the batch is split in halves, each run on its own, until the message that
    /// fails alone is found; only it is dead-lettered.
    #[error("the batch failed: {0}")]
    Batch(HandlerError),
}

impl BatchError {
    /// The message at `index` of the batch failed with `error`.
    pub fn item(index: usize, error: impl Into<HandlerError>) -> Self {
        Self::Item {
            index,
            error: error.into(),
        }
    }
}

impl<E: Into<HandlerError>> From<E> for BatchError {
    fn from(error: E) -> Self {
        Self::Batch(error.into())
    }
}

/// What a batch handler may return on success: `()`, or one result per message (`Vec<T>`, in
/// the batch's order), stored on each message's inbox row and replayed to its duplicates.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a batch handler's success type",
    label = "a batch handler returns `Result<(), E>` or `Result<Vec<T>, E>` (one `T` per message)"
)]
pub trait BatchOutput {
    /// Each message's result.
    type Item;
    /// One result per message of a batch of `len`; a `Vec` of another length is an error.
    fn into_items(self, len: usize) -> Result<Vec<Self::Item>, BatchError>;
}

impl BatchOutput for () {
    type Item = ();

    fn into_items(self, len: usize) -> Result<Vec<()>, BatchError> {
        Ok(vec![(); len])
    }
}

impl<T> BatchOutput for Vec<T> {
    type Item = T;

    fn into_items(self, len: usize) -> Result<Vec<T>, BatchError> {
        if self.len() == len {
            Ok(self)
        } else {
            Err(BatchError::Batch(HandlerError::permanent(format!(
                "the batch handler returned {} results for {len} messages",
                self.len()
            ))))
        }
    }
}

/// What a batch handler may return: `Result<O, E>` with `O:` [`BatchOutput`] and
/// `E: Into<BatchError>` (a [`BatchError`], or anything that converts into a `HandlerError`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a batch handler result",
    label = "a batch handler returns `Result<(), E>` or `Result<Vec<T>, E>` with `E: Into<idem::BatchError>`"
)]
pub trait BatchResult {
    /// The success type.
    type Ok: BatchOutput;
    /// One result per message of a batch of `len`, or the failure.
    fn into_batch_result(
        self,
        len: usize,
    ) -> Result<Vec<<Self::Ok as BatchOutput>::Item>, BatchError>;
}

impl<O: BatchOutput, E: Into<BatchError>> BatchResult for Result<O, E> {
    type Ok = O;

    fn into_batch_result(self, len: usize) -> Result<Vec<O::Item>, BatchError> {
        self.map_err(Into::into)?.into_items(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_reads_as_a_slice_with_its_keys() {
        let batch = Batch::new([("a".to_owned(), 1), ("b".to_owned(), 2)]);
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[1], 2);
        assert_eq!(batch.keys(), ["a", "b"]);
        assert_eq!(batch.iter().sum::<i32>(), 3);
        assert_eq!(batch.into_vec(), vec![1, 2]);
    }

    #[test]
    fn results_are_one_per_message() {
        let unit: Result<(), BatchError> = Ok(());
        assert_eq!(unit.into_batch_result(3).unwrap().len(), 3);
        let short: Result<Vec<u8>, BatchError> = Ok(vec![1]);
        let err = short.into_batch_result(2).unwrap_err();
        assert!(
            err.to_string().contains("1 results for 2 messages"),
            "{err}"
        );
        let failed: Result<(), HandlerError> = Err(HandlerError::transient("db gone"));
        assert!(matches!(
            failed.into_batch_result(1),
            Err(BatchError::Batch(HandlerError::Transient(_)))
        ));
        let item = BatchError::item(4, HandlerError::permanent("bad"));
        assert!(matches!(item, BatchError::Item { index: 4, .. }));
    }
}
