//! What operators do with a queue's dead letters (`idem dlq`), through the transport that put
//! them there: read them without removing them, publish a copy back, remove them.

use super::error::TransportError;
use super::outbound::OutboundError;
use crate::future::BoxFuture;

/// One dead letter, held by its [`DeadLetterReader`]: it stays among the dead letters until the
/// reader removes it, and goes back (unread) when the reader closes without removing it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLetter {
    /// The reader's handle for it.
    pub tag: u64,
    /// Its message id.
    pub message_id: Option<String>,
    /// Its correlation id.
    pub correlation_id: Option<String>,
    /// Its content type.
    pub content_type: Option<String>,
    /// Its headers as text, in the broker's order, without the broker's own dead-lettering
    /// bookkeeping (RabbitMQ's `x-death`).
    pub headers: Vec<(String, String)>,
    /// Its body.
    pub body: Vec<u8>,
    /// The queue it was dead-lettered from, as the broker recorded it.
    pub source: Option<String>,
    /// When its message was first published, where it says
    /// ([`Envelope::published_at_ms`](crate::model::Envelope::published_at_ms)).
    pub published_at_ms: Option<i64>,
}

impl HeldLetter {
    /// A letter with `tag` and `body`, and nothing else known.
    pub fn new(tag: u64, body: Vec<u8>) -> Self {
        Self {
            tag,
            message_id: None,
            correlation_id: None,
            content_type: None,
            headers: Vec::new(),
            body,
            source: None,
            published_at_ms: None,
        }
    }
}

/// What a replayed copy says of when its message was published
/// ([`Envelope::published_at_ms`](crate::model::Envelope::published_at_ms)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishTime {
    /// The dead letter's own: its consumer judges the copy's dedup window from the original
    /// publish.
    Kept,
    /// Now: the copy starts a dedup window of its own (`idem dlq replay --force`, for a dead
    /// letter whose window is over).
    Now,
}

/// Reads one queue's dead letters for an operator. Letters are read oldest first and held
/// until removed; those not removed go back when the reader closes, or when its connection
/// ends, so that an interrupted command leaves the dead letters as they were.
pub trait DeadLetterReader: Send + Sync {
    /// Where the dead letters are kept, as the broker names it (RabbitMQ: `<queue>.dlq`).
    fn name(&self) -> &str;

    /// How many dead letters there are now. A queue with no dead letters kept at all is
    /// [`TransportError::Topology`].
    fn count(&self) -> BoxFuture<'_, Result<u64, TransportError>>;

    /// The next dead letter, now held; `None` when every one has been read.
    fn next(&self) -> BoxFuture<'_, Result<Option<HeldLetter>, TransportError>>;

    /// Publishes a copy of the held `letter` to `queue`, with its id, body and properties but
    /// without the broker's dead-lettering bookkeeping and idem's attempt count, and waits for
    /// the broker's confirm; a copy nothing takes is [`OutboundError::Unroutable`]. Its publish
    /// time is the letter's, or now, as `time` says. The letter stays held.
    fn replay<'a>(
        &'a self,
        letter: &'a HeldLetter,
        queue: &'a str,
        time: PublishTime,
    ) -> BoxFuture<'a, Result<(), OutboundError>>;

    /// Removes the held `letter` from the dead letters.
    fn remove<'a>(&'a self, letter: &'a HeldLetter) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Closes the reader; the letters still held go back.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

impl std::fmt::Debug for dyn DeadLetterReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterReader")
            .field("name", &self.name())
            .finish_non_exhaustive()
    }
}
