//! External mode's per-key states, as the store reports and records them.

use crate::model::{Fingerprint, StoredOutput};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What an external-mode claim ([`crate::store::LeaseStore::lease`]) found for its key.
#[derive(Debug, Clone, PartialEq)]
pub enum Lease {
    /// The caller holds the lease: the row is new (`attempts` = 1) or an expired lease was
    /// taken over (`attempts` counts every holder so far).
    Acquired {
        /// How many times a lease on this key was granted.
        attempts: u32,
    },
    /// The key was processed; the stored result is replayed.
    Completed {
        /// The fingerprint stored with it.
        fingerprint: Fingerprint,
        /// The stored result (`None` for `null`).
        output: Option<StoredOutput>,
    },
    /// The handler failed permanently for this key; it is not run again.
    Failed {
        /// The fingerprint stored with it.
        fingerprint: Fingerprint,
        /// The stored failure.
        output: Option<StoredOutput>,
    },
    /// Another consumer holds a live lease.
    Held {
        /// The fingerprint stored with it.
        fingerprint: Fingerprint,
        /// How long the lease still runs.
        remaining: Duration,
    },
}

/// How an external-mode handler ended, as [`crate::store::LeaseStore::settle`] records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// The handler succeeded: `completed`, its result replayed to later copies.
    Completed,
    /// The handler failed permanently: `failed`, later copies are dead-lettered unrun.
    Failed,
}

impl LeaseEnd {
    /// The status column's value.
    pub fn status(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }
}

/// A token naming one lease holder, unique across processes and time: the process id, the time
/// and a counter.
pub fn owner_token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos();
    format!(
        "{}-{nanos:x}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
