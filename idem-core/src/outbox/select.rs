//! The outbox rows a relay pass publishes ([`OutboxSelect`]) and what it did ([`RelayReport`]).

use std::time::Duration;

/// Which committed outbox rows one relay pass takes (rows another pass holds are skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutboxSelect {
    /// The rows staged by these runs, each `(consumer, key)`: staged while that consumer
    /// processed that key. The dispatch right after their transactions committed.
    Runs {
        /// `(consumer identity, dedup key)` of each run.
        runs: Vec<(String, String)>,
    },
    /// At most `limit` rows staged longer than `age` ago, oldest first: what a crash or a
    /// failed dispatch left behind.
    Older {
        /// How long a row waits for its own dispatch before the relay takes it.
        age: Duration,
        /// Rows per pass.
        limit: u32,
    },
    /// At most `limit` rows staged outside any handler (in a transaction of the caller's own,
    /// whose process dispatches nothing), whatever their age, oldest first: what a relay takes
    /// when the store tells it such rows were committed.
    Unowned {
        /// Rows per pass.
        limit: u32,
    },
}

/// What one relay pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Rows published, confirmed and removed.
    pub published: u64,
    /// Rows the broker could not route, or carry (of those parked).
    pub unroutable: u64,
    /// Rows moved out of the relay's way because the broker refused them (a store that parks
    /// them tries them again later); an operator lists and releases them.
    pub parked: u64,
    /// Parked rows given up because the broker kept refusing them too long after they were
    /// staged: outbox dead letters, which only an operator releases.
    pub given_up: u64,
    /// Why the pass stopped before the end of its rows, if it did: the rows from there on stay
    /// for a later pass.
    pub failure: Option<String>,
    /// How long the oldest row taken had waited, when any was.
    pub oldest: Option<Duration>,
}

impl RelayReport {
    /// Counts what this pass (`by`: `dispatch` or `relay`) of `store` did, in idem's metrics.
    pub(crate) fn record(&self, store: &'static str, by: &'static str) {
        use crate::telemetry::{
            OUTBOX_GIVEN_UP, OUTBOX_LAG, OUTBOX_PARKED, OUTBOX_PUBLISHED, OUTBOX_UNROUTABLE,
        };
        if self.published > 0 {
            metrics::counter!(OUTBOX_PUBLISHED, "store" => store, "by" => by)
                .increment(self.published);
        }
        if self.unroutable > 0 {
            metrics::counter!(OUTBOX_UNROUTABLE, "store" => store).increment(self.unroutable);
        }
        if self.parked > 0 {
            metrics::counter!(OUTBOX_PARKED, "store" => store).increment(self.parked);
        }
        if self.given_up > 0 {
            metrics::counter!(OUTBOX_GIVEN_UP, "store" => store).increment(self.given_up);
        }
        if by == "relay" && self.failure.is_none() {
            // Every relay pass that ran sets it: zero when it took no row, so a drained backlog
            // does not leave the last lag behind. A failed pass measured nothing.
            let oldest = self.oldest.unwrap_or_default();
            metrics::gauge!(OUTBOX_LAG, "store" => store).set(oldest.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::captured::Captured;

    #[test]
    fn the_relay_lag_is_current_after_every_pass_that_ran() {
        let captured = Captured::default();
        let lag = "idem_outbox_lag_seconds{store=s}";
        metrics::with_local_recorder(&captured, || {
            let took = RelayReport {
                published: 3,
                oldest: Some(Duration::from_secs(400)),
                ..RelayReport::default()
            };
            took.record("s", "relay");
            assert_eq!(captured.gauge(lag), Some(400.0));
            // The backlog drained: a pass that took nothing says so.
            RelayReport::default().record("s", "relay");
            assert_eq!(captured.gauge(lag), Some(0.0));
            took.record("s", "relay");
            // A pass that stopped early measured nothing; a dispatch is not a relay pass.
            let failed = RelayReport {
                failure: Some("the broker went away".into()),
                ..RelayReport::default()
            };
            failed.record("s", "relay");
            RelayReport::default().record("s", "dispatch");
            assert_eq!(captured.gauge(lag), Some(400.0));
            crate::telemetry::relay_failed("s");
            assert_eq!(
                captured.counter("idem_outbox_relay_failures_total{store=s}"),
                Some(1)
            );
        });
    }
}
