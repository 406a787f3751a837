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
