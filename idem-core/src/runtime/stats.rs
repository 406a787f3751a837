//! Counters of what the runtime did, readable while it runs.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a runtime has done so far.
#[derive(Debug, Default)]
pub struct Stats {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) conflicts: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) settle_failures: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) pauses: AtomicU64,
    pub(crate) parked: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Deliveries processed (committed) and acked.
    pub processed: u64,
    /// Duplicates skipped and acked.
    pub duplicates: u64,
    /// Versioned messages at or below their entity's applied version, acked without running.
    pub stale: u64,
    /// Same key with a different payload (each one also counted in `dead_lettered`).
    pub conflicts: u64,
    /// Permanent refusals (each one also counted in `dead_lettered`).
    pub rejected: u64,
    /// Transient failures sent for a delayed retry.
    pub retried: u64,
    /// Deliveries dead-lettered, for any reason.
    pub dead_lettered: u64,
    /// Handler panics (retried as transient failures).
    pub panics: u64,
    /// Settlements (ack, retry, dead letter) the transport could not send; the broker
    /// redelivers those messages.
    pub settle_failures: u64,
    /// Deliveries (and batch members) that found their store unable to write and waited,
    /// unsettled, to be tried again as the same attempt once it wrote.
    pub unavailable: u64,
    /// Times a store could not write and paused its handlers' consumption.
    pub pauses: u64,
    /// Deliveries of an ordered handler stored behind their key's dead-lettered message (the
    /// key is parked) and acked without running.
    pub parked: u64,
}

impl Stats {
    pub(crate) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Snapshot {
            processed: get(&self.processed),
            duplicates: get(&self.duplicates),
            stale: get(&self.stale),
            conflicts: get(&self.conflicts),
            rejected: get(&self.rejected),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            panics: get(&self.panics),
            settle_failures: get(&self.settle_failures),
            unavailable: get(&self.unavailable),
            pauses: get(&self.pauses),
            parked: get(&self.parked),
        }
    }
}

impl Snapshot {
    /// Deliveries settled for good: acked (processed, duplicate, stale, parked) or
    /// dead-lettered (not counting retries, which come back).
    pub fn settled(&self) -> u64 {
        self.processed + self.duplicates + self.stale + self.parked + self.dead_lettered
    }
}
