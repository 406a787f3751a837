//! The actor runtime: one actor per handler (`actor`), fed by the transport's consumer
//! through a bounded mailbox, with workers (`worker`, `batch_worker`) that run the
//! handler's pipeline and settle each delivery after the commit (`settle`).
//! [`RuntimeBuilder`] checks the configuration; `Runtime::run_until` (`run`) runs it.

mod actor;
mod batch_worker;
mod builder;
mod error;
mod health;
mod lanes;
mod parked;
mod pause;
mod plan;
pub mod retry;
mod run;
pub(crate) mod settle;
mod signal;
mod startup;
mod stats;
mod sweeper;
mod worker;

pub use crate::jitter::jittered;
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub(crate) use builder::given_state;
pub use builder::{DEFAULT_POISON_LIMIT, RuntimeBuilder};
pub use error::RuntimeError;
pub use health::{Health, Readiness};
pub use plan::MAX_PARTITIONS;
pub use retry::{RetryPolicy, RetryPolicyError};
pub use run::Runtime;
pub use signal::shutdown_signal;
pub use startup::DEFAULT_START_DEADLINE;
pub use stats::{Snapshot, Stats};
pub use sweeper::DEFAULT_SWEEP_PAUSE;
