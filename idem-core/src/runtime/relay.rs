//! The runtime's outbox relay: one task per store that keeps an outbox, publishing the rows
//! that no dispatch took (the process that staged them crashed, or the broker was away).

use crate::store::{OutboxSelect, Relay};
use crate::telemetry;
use crate::transport::{Outbound, StopSignal};
use std::sync::Arc;
use std::time::Duration;

/// How the runtime relays outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelaySettings {
    /// Time between passes when the last one found less than a full batch.
    pub(crate) interval: Duration,
    /// How long a row is left to the dispatch of the process that staged it.
    pub(crate) age: Duration,
    /// Rows per pass.
    pub(crate) batch: u32,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(500),
            age: Duration::from_secs(2),
            batch: 500,
        }
    }
}

/// Relays `relay`'s rows through `outbound` until `stop`: a full pass is followed by the next
/// at once, anything less waits `settings.interval`, or until the store says rows staged
/// outside any handler were committed (then those are taken at once).
pub(crate) async fn run(
    relay: Relay,
    outbound: Arc<dyn Outbound>,
    settings: RelaySettings,
    mut stop: StopSignal,
) {
    let store = relay.kind.label();
    let older = OutboxSelect::Older {
        age: settings.age,
        limit: settings.batch,
    };
    let mut select = older.clone();
    loop {
        let pass = (relay.relay)(select.clone(), outbound.clone());
        let report = tokio::select! {
            report = pass => report,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        let full = match report {
            Ok(report) => {
                telemetry::relayed(store, "relay", &report);
                if let Some(failure) = &report.failure {
                    tracing::warn!(
                        store,
                        failure,
                        "the outbox relay stopped early; retrying at the next interval"
                    );
                } else if report.published > 0 {
                    tracing::debug!(store, published = report.published, "outbox rows relayed");
                }
                report.failure.is_none() && report.published >= u64::from(settings.batch)
            }
            Err(e) => {
                tracing::warn!(store, error = %e, "the outbox relay failed; retrying at the next interval");
                false
            }
        };
        if full {
            continue;
        }
        select = tokio::select! {
            () = tokio::time::sleep(settings.interval) => older.clone(),
            () = (relay.wakeup)() => OutboxSelect::Unowned { limit: settings.batch },
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
    }
}
