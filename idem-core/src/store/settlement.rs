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
/// effects are done (a downstream call was made), so a transient failure here (a deadlock
/// victim, a lock wait timeout) is retried in place, [`SETTLE_ATTEMPTS`] times at most with a
/// backoff from 10 ms, rather than left to the lease's expiry, after which another request
/// would run them again. Retrying is safe: a failed settlement rolled back, and one that did
/// commit leaves nothing in progress for the retry to match (`Ok(false)`, as when the lease was
/// taken over).
pub async fn settle_lease<S: LeaseStore + ?Sized>(
    store: &S,
    request: &ClaimRequest<'_>,
    owner: &str,
    end: LeaseEnd,
    output: &StoredOutput,
) -> Result<bool, StoreError> {
    let mut pause = Duration::from_millis(10);
    let mut attempt = 1;
    loop {
        match store.settle(request, owner, end, output).await {
            Err(e) if e.class() == ErrorClass::Transient && attempt < SETTLE_ATTEMPTS => {
                tracing::debug!(consumer = request.consumer, key = request.key, error = %e, attempt,
                    "settling the lease failed; trying again");
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            settled => return settled,
        }
    }
}
