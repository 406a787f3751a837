//! [`settle_lease`]: how every entry point ends an external-mode run, the runtime's pipeline
//! and the HTTP layer alike.

use super::inbox::ClaimRequest;
use super::lease::LeaseEnd;
use super::roles::LeaseStore;
use crate::model::{ErrorClass, StoreError, StoredOutput};
use std::time::Duration;

/// How many times a settlement that failed transiently is tried, the first included.
pub const SETTLE_ATTEMPTS: u32 = 5;

/// Settles `owner`'s lease on `request`'s key as `end`, with `output`, after its run. The run's
/// effects are done (a downstream call was made), so a failure here is worth trying again in
/// place rather than leaving the key in progress until its lease expires, after which another
/// request would run them again: a transient failure (a deadlock victim, a lock wait timeout)
/// [`SETTLE_ATTEMPTS`] times at most with a backoff from 10 ms, and a store that cannot write
/// for now (a failover, a restart) with a backoff up to 1 s for as long as `patience` (the
/// lease). Retrying is safe: a failed settlement rolled back, and one that did commit leaves
/// nothing in progress for the retry to match (`Ok(false)`, as when the lease was taken over).
pub async fn settle_lease<S: LeaseStore + ?Sized>(
    store: &S,
    request: &ClaimRequest<'_>,
    owner: &str,
    end: LeaseEnd,
    output: &StoredOutput,
    patience: Duration,
) -> Result<bool, StoreError> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(10);
    let mut attempt = 1;
    loop {
        let again = match store.settle(request, owner, end, output).await {
            Err(e) if e.class() == ErrorClass::Transient && attempt < SETTLE_ATTEMPTS => e,
            Err(e)
                if e.class() == ErrorClass::Unavailable && started.elapsed() + pause < patience =>
            {
                e
            }
            settled => return settled,
        };
        tracing::debug!(consumer = request.consumer, key = request.key, error = %again, attempt,
            "settling the lease failed; trying again");
        tokio::time::sleep(crate::jitter::jittered(pause)).await;
        pause = (pause * 2).min(Duration::from_secs(1));
        attempt += 1;
    }
}
