//! The store contract, split by role: the inbox every store implements ([`InboxStore`], and
//! [`end_transaction`], where every inbox transaction ends), and the optional roles
//! ([`LeaseStore`], [`DeadLetterStore`], [`SweepStore`], [`OutboxStore`], [`ParkingStore`]; together
//! [`RuntimeStore`]); external mode's per-key states ([`Lease`]) and the run that
//! holds a lease ([`LeasedRun`]); what a claim's or a lease's answer means for a request
//! ([`Admission`], judged in one place); and the set of
//! stores a runtime holds ([`Stores`]). The SQL stores are in idem-sqlx.

pub mod admission;
pub mod inbox;
pub mod lease;
pub mod leased;
pub mod roles;
pub mod set;
pub mod settlement;
pub mod sweep;

pub use admission::{Admission, Refusal};
pub use inbox::{
    Claim, ClaimRequest, DEFAULT_RETENTION, DURABILITY, Ended, InboxStore, PROBE_CONSUMER,
    StoreKind, end_transaction,
};
pub use lease::{Lease, LeaseEnd, owner_token};
pub use leased::{LeasedRun, Leasing};
pub use roles::{DeadLetterStore, LeaseStore, OutboxStore, ParkingStore, RuntimeStore, SweepStore};
pub use set::{Stores, SweepFn, Sweeper};
pub use settlement::{SETTLE_ATTEMPTS, settle_lease};
pub use sweep::{Pace, SweepReport};
