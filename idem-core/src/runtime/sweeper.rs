//! The runtime's retention sweeper: one task per inbox store. A sweep that finds the sweeper
//! caught up paces its delete statements (`pause`) and the next one comes an interval later;
//! while it is behind (a sweep ran out of statements with expired rows left, or left a row that
//! expired more than an interval ago) it sweeps back to back without pausing, until it has
//! caught up.

use crate::store::{Pace, Sweeper};
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

/// The runtime sweeper's pause after each delete statement while it is caught up, in multiples
/// of the statement's time: it deletes at most a tenth of the time (behind, it does not pause) (measured in BENCHMARKS.md: at 10M rows with a
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

/// Sweeps with `sweeper` every `settings.interval` (the first time at once) until `stop`, back
/// to back and unpaced while it is behind ([`behind`]).
pub(crate) async fn run(sweeper: Sweeper, settings: SweepSettings, mut stop: StopSignal) {
    let store = sweeper.kind.label();
    let mut behind = false;
    loop {
        let pace = match behind {
            true => Pace::none(),
            false => Pace::new(settings.pause, settings.interval),
        };
        let sweep = (sweeper.sweep)(settings.batch, settings.max_batches, pace);
        let report = tokio::select! {
            report = sweep => report,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        behind = false;
        match report {
            Ok(report) if report.locked => {
                report.record(store);
                behind = self::behind(&report, &settings);
                tracing::debug!(
                    store,
                    deleted = report.deleted,
                    batches = report.batches,
                    longest_batch = ?report.longest_batch,
                    lag = ?report.lag,
                    behind,
                    "inbox swept"
                );
            }
            Ok(_) => {
                telemetry::not_sweeping(store);
                tracing::debug!(store, "another sweeper is at work; skipping this sweep");
            }
            Err(e) => {
                tracing::warn!(store, error = %e, "sweeping the inbox failed; retrying at the next interval")
            }
        }
        if behind {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(settings.interval) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    }
}

/// Whether a sweep left the sweeper behind: it deleted rows, and ran out of statements with
/// expired rows left, or left a row that expired more than an interval ago (the inflow expires
/// rows faster than paced sweeps delete them). A sweep that deleted nothing is never behind: the
/// rows left are held by another transaction (the delete skips locked rows), and sweeping again
/// at once would only spin.
fn behind(report: &crate::store::SweepReport, settings: &SweepSettings) -> bool {
    let capped = report.batches >= settings.max_batches && report.expired > 0;
    report.deleted > 0 && (capped || report.lag > settings.interval)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{StoreKind, SweepFn, SweepReport};
    use std::sync::{Arc, Mutex};
    use tokio::sync::watch;

    /// A sweeper behind twice (capped, then old rows left), then stuck on a row another
    /// transaction holds: the two sweeps after the behind ones come at once and unpaced, the
    /// next ones an interval apart and paced (a sweep that deleted nothing is not behind).
    #[tokio::test(start_paused = true)]
    async fn a_sweeper_behind_sweeps_back_to_back_and_paces_once_caught_up() {
        let settings = SweepSettings {
            interval: Duration::from_secs(60),
            batch: 10,
            max_batches: 3,
            pause: 9,
        };
        let reports = [
            SweepReport {
                locked: true,
                batches: 3,
                deleted: 30,
                expired: 500,
                ..SweepReport::default()
            },
            SweepReport {
                locked: true,
                batches: 2,
                deleted: 15,
                expired: 5,
                lag: Duration::from_secs(61),
                ..SweepReport::default()
            },
            // A row another transaction holds, long expired: nothing deleted, not behind.
            SweepReport {
                locked: true,
                batches: 1,
                expired: 1,
                lag: Duration::from_secs(300),
                ..SweepReport::default()
            },
        ];
        let calls: Arc<Mutex<Vec<(u32, tokio::time::Instant)>>> = Arc::default();
        let seen = calls.clone();
        let sweep: SweepFn = Arc::new(move |_, _, pace: Pace| {
            let seen = seen.clone();
            let n = {
                let mut seen = seen.lock().unwrap();
                seen.push((pace.pause, tokio::time::Instant::now()));
                seen.len() - 1
            };
            let report = reports.get(n).copied().unwrap_or_default();
            Box::pin(async move {
                Ok(SweepReport {
                    locked: true,
                    ..report
                })
            })
        });
        let sweeper = Sweeper {
            kind: StoreKind::new("Test", "test", "Test"),
            sweep,
        };
        let (stop, stopped) = watch::channel(false);
        let started = tokio::time::Instant::now();
        let task = tokio::spawn(run(sweeper, settings, stopped));
        tokio::time::sleep(Duration::from_secs(150)).await;
        let _ = stop.send(true);
        task.await.unwrap();
        let calls = calls.lock().unwrap().clone();
        let at: Vec<(u32, u64)> = calls
            .iter()
            .map(|(pause, at)| (*pause, (*at - started).as_secs()))
            .collect();
        assert_eq!(
            at,
            [(9, 0), (0, 0), (0, 0), (9, 60), (9, 120)],
            "pause and start of each sweep"
        );
    }

    /// A sweeper that held the lock, then found another process holding it: its gauges no
    /// longer tell its last sweep's figures.
    #[tokio::test(start_paused = true)]
    async fn a_sweeper_that_loses_the_lock_leaves_no_stale_figures() {
        let captured = crate::telemetry::captured::Captured::default();
        let _recorder = metrics::set_default_local_recorder(&captured);
        let calls = Arc::new(Mutex::new(0));
        let seen = calls.clone();
        let sweep: SweepFn = Arc::new(move |_, _, _| {
            let first = {
                let mut seen = seen.lock().unwrap();
                *seen += 1;
                *seen == 1
            };
            Box::pin(async move {
                Ok(SweepReport {
                    locked: first,
                    lag: Duration::from_secs(4000),
                    ..SweepReport::default()
                })
            })
        });
        let sweeper = Sweeper {
            kind: StoreKind::new("Test", "test", "Test"),
            sweep,
        };
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(sweeper, SweepSettings::default(), stopped));
        let lag = "idem_sweeper_lag_seconds{store=test}";
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(captured.gauge(lag), Some(4000.0));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(*calls.lock().unwrap(), 2);
        assert!(captured.gauge(lag).is_some_and(f64::is_nan));
        let _ = stop.send(true);
        task.await.unwrap();
    }
}
