//! One handler's actor: its configuration (queue, workers, prefetch, batching), and what its
//! workers share while they run.

use super::pause::Pause;
use super::retry::RetryPolicy;
use super::stats::Stats;
use crate::pipeline::ErasedHandler;
use crate::registry::Registration;
use crate::store::Stores;
use crate::transport::QueueSpec;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// One handler as the runtime runs it: fed by the transport's consumer through a bounded
/// mailbox, processed by `workers` workers.
pub(crate) struct Actor {
    pub(crate) registration: &'static Registration,
    pub(crate) spec: QueueSpec,
    /// Deliveries (batch mode: batches) processed at once.
    pub(crate) workers: usize,
    pub(crate) prefetch: u16,
    pub(crate) batch: Option<BatchSpec>,
    /// One partition of an ordered handler: deliveries go to workers by routing key, and
    /// failures are retried in place.
    pub(crate) ordered: bool,
    /// An ordered handler that parks keys ([`KeyPolicy::Park`](crate::model::KeyPolicy)):
    /// where its messages are published (the partitions' source).
    pub(crate) parking: Option<Arc<str>>,
}

/// How a handler's deliveries are grouped into transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchSpec {
    /// At most this many deliveries per transaction.
    pub(crate) size: usize,
    /// How long a batch waits for more deliveries after its first.
    pub(crate) linger: Duration,
}

/// What every worker of one handler shares.
pub(crate) struct Shared {
    pub(crate) handler: &'static dyn ErasedHandler,
    pub(crate) stores: Arc<Stores>,
    /// The queue consumed, as dead-letter records name it.
    pub(crate) queue: Arc<str>,
    pub(crate) retry: RetryPolicy,
    pub(crate) stats: Arc<Stats>,
    /// Retry transient failures in place (ordered handlers) instead of through the transport.
    pub(crate) in_place: bool,
    /// An ordered handler's concurrency, shared by all its partitions in this process: a
    /// worker holds a permit while it processes a delivery.
    pub(crate) permits: Option<Arc<Semaphore>>,
    /// Whether its store writes: a delivery that finds it unable to waits here, and so does
    /// every worker of the store's handlers before it takes another delivery.
    pub(crate) pause: Arc<Pause>,
    /// An ordered handler that parks keys: where a released message is published, and how.
    pub(crate) parks: Option<Parks>,
}

/// What the workers of an ordered handler that parks keys share.
pub(crate) struct Parks {
    /// Where the handler's messages are published (the partitions' source): a released
    /// message goes there again, with its order key.
    pub(crate) source: Arc<str>,
    /// What publishes a released message; `None`: the transport cannot publish.
    pub(crate) outbound: Option<Arc<dyn crate::transport::Outbound>>,
}
