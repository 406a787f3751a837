//! The store contract, split by role: the inbox every store implements ([`InboxStore`]), and
//! the optional roles ([`LeaseStore`], [`DeadLetterStore`], [`SweepStore`], [`OutboxStore`];
//! together [`RuntimeStore`]); external mode's per-key states ([`Lease`]) and the set of
//! stores a runtime holds ([`Stores`]). The SQL stores are in idem-sqlx.

mod in_flight;
pub mod inbox;
mod kept;
pub mod lease;
mod outbox;
pub mod relay;
pub mod roles;
pub mod set;

pub use inbox::{Claim, ClaimRequest, DEFAULT_RETENTION, InboxStore, StoreKind, SweepReport};
pub use kept::RemoveFn;
pub use lease::{Lease, LeaseEnd, owner_token};
pub(crate) use outbox::Watched;
pub use outbox::{Dispatch, Relay, RelayFn, WakeupFn};
pub use relay::{OutboxSelect, RelayReport};
pub use roles::{DeadLetterStore, LeaseStore, OutboxStore, RuntimeStore, SweepStore};
pub use set::{Stores, SweepFn, Sweeper};
