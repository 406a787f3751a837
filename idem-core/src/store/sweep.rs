//! What a sweep of an inbox is asked ([`Pace`]) and what it did ([`SweepReport`]).

use std::time::Duration;

/// How a sweep paces its deletes ([`SweepStore::sweep_paced`](super::SweepStore::sweep_paced)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pace {
    /// After each full batch, a pause this many times as long as the batch took.
    pub pause: u32,
    /// No pause while the oldest expired row left expired longer ago than this: the sweeper is
    /// behind, and deletes back to back until it has caught up.
    pub behind_after: Duration,
}

impl Pace {
    /// Pauses `pause` times a batch's time, unless the oldest expired row left expired more than
    /// `behind_after` ago.
    pub fn new(pause: u32, behind_after: Duration) -> Self {
        Self {
            pause,
            behind_after,
        }
    }

    /// No pause.
    pub fn none() -> Self {
        Self::new(0, Duration::ZERO)
    }
}

/// What one sweep of an inbox did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepReport {
    /// Whether this sweeper held the inbox's sweeper lock; `false`: another sweeper (in this
    /// or another process) was at work, and this one did nothing.
    pub locked: bool,
    /// Expired rows deleted.
    pub deleted: u64,
    /// Delete statements run on the inbox rows (each at most one batch of rows).
    pub batches: u32,
    /// Expired delivery counts of the poison limit deleted (in batches of their own).
    pub counts_deleted: u64,
    /// The longest of them: the longest any row lock was held.
    pub longest_batch: Duration,
    /// How far behind the sweeper is after this sweep: the age of the oldest expired row left
    /// (zero when none is).
    pub lag: Duration,
    /// The inbox's rows after this sweep, estimated where the database keeps statistics.
    pub rows: u64,
    /// The age of the row that expires first after this sweep (zero when the inbox is empty).
    pub oldest: Duration,
    /// Expired rows this sweep left (its statement budget ran out, or they expired since),
    /// counted up to 1,000,000.
    pub expired: u64,
    /// Time spent in the delete statements.
    pub busy: Duration,
    /// Time spent pausing between them ([`SweepStore::sweep_paced`](super::SweepStore::sweep_paced)).
    pub paused: Duration,
}

impl SweepReport {
    /// Records this sweep of `store` in idem's metrics.
    pub(crate) fn record(&self, store: &'static str) {
        use crate::telemetry::{
            INBOX_EXPIRED, INBOX_OLDEST, INBOX_ROWS, ROWS_SWEPT, SWEEP_BUSY, SWEEP_PAUSED,
            SWEEPER_LAG,
        };
        metrics::counter!(ROWS_SWEPT, "store" => store).increment(self.deleted);
        metrics::gauge!(SWEEPER_LAG, "store" => store).set(self.lag.as_secs_f64());
        metrics::gauge!(INBOX_ROWS, "store" => store).set(self.rows as f64);
        metrics::gauge!(INBOX_OLDEST, "store" => store).set(self.oldest.as_secs_f64());
        metrics::gauge!(INBOX_EXPIRED, "store" => store).set(self.expired as f64);
        metrics::gauge!(SWEEP_BUSY, "store" => store).set(self.busy.as_secs_f64());
        metrics::gauge!(SWEEP_PAUSED, "store" => store).set(self.paused.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::captured::Captured;
    use std::time::Duration;

    #[test]
    fn a_process_that_does_not_hold_the_sweep_lock_tells_no_sweep_figures() {
        let captured = Captured::default();
        metrics::with_local_recorder(&captured, || {
            let report = SweepReport {
                locked: true,
                lag: Duration::from_secs(4000),
                expired: 7,
                ..SweepReport::default()
            };
            report.record("s");
            assert_eq!(
                captured.gauge("idem_sweeper_lag_seconds{store=s}"),
                Some(4000.0)
            );
            crate::telemetry::not_sweeping("s");
            for gauge in crate::telemetry::SWEEP_GAUGES {
                let value = captured.gauge(&format!("{gauge}{{store=s}}"));
                assert!(value.is_some_and(f64::is_nan), "{gauge}: {value:?}");
            }
        });
    }
}
