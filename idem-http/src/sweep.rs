//! Expiring keys in a service that runs no idem `Runtime` (whose sweeper would do it).

use idem_core::store::SweepStore;
use std::time::Duration;

/// Deletes expired keys (and every other expired row of the inbox) every `interval`, the first
/// time at once, forever: spawn it beside the server. Sweepers of several processes take turns
/// through the inbox's sweeper lock.
pub async fn sweep_every<S: SweepStore>(store: S, interval: Duration) {
    loop {
        match store.sweep(1_000, 1_000).await {
            Ok(report) => {
                tracing::debug!(deleted = report.deleted, lag = ?report.lag, "idempotency keys swept")
            }
            Err(e) => {
                tracing::warn!(error = %e, "sweeping expired idempotency keys failed; retrying at the next interval")
            }
        }
        tokio::time::sleep(interval).await;
    }
}
