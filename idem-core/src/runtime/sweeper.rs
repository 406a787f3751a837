//! The runtime's retention sweeper: one task per inbox store, sweeping on an interval.

use crate::store::Sweeper;
use crate::telemetry;
use crate::transport::StopSignal;
use std::time::Duration;

/// How the runtime sweeps expired inbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SweepSettings {
    /// Time between sweeps.
    pub(crate) interval: Duration,
    /// Rows per delete statement.
    pub(crate) batch: u32,
    /// Delete statements per sweep, at most (the next sweep goes on).
    pub(crate) max_batches: u32,
    /// The pause after each statement, in multiples of its time.
    pub(crate) pause: u32,
}

/// The runtime sweeper's pause after each delete statement, in multiples of the statement's
/// time: it deletes at most a tenth of the time (measured in BENCHMARKS.md: at 10M rows with a
/// day's worth expired it costs the consumers about 5% per message, and works off a backlog at
/// about 12,000 rows/s).
pub const DEFAULT_SWEEP_PAUSE: u32 = 9;

impl Default for SweepSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            batch: 1_000,
            max_batches: 1_000,
            pause: DEFAULT_SWEEP_PAUSE,
        }
    }
}

/// Sweeps with `sweeper` every `settings.interval` (the first time at once) until `stop`.
pub(crate) async fn run(sweeper: Sweeper, settings: SweepSettings, mut stop: StopSignal) {
    let store = sweeper.kind.label();
    loop {
        let sweep = (sweeper.sweep)(settings.batch, settings.max_batches, settings.pause);
        let report = tokio::select! {
            report = sweep => report,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        match report {
            Ok(report) if report.locked => {
                telemetry::swept(store, &report);
                tracing::debug!(
                    store,
                    deleted = report.deleted,
                    batches = report.batches,
                    longest_batch = ?report.longest_batch,
                    lag = ?report.lag,
                    "inbox swept"
                );
            }
            Ok(_) => tracing::debug!(store, "another sweeper is at work; skipping this sweep"),
            Err(e) => {
                tracing::warn!(store, error = %e, "sweeping the inbox failed; retrying at the next interval")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(settings.interval) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    }
}
