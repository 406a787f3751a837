//! The inbox store contract ([`InboxStore`]), external mode's per-key states ([`Lease`]) and
//! the set of stores a runtime holds ([`Stores`]). The SQL stores are in idem-sqlx.

mod in_flight;
pub mod inbox;
mod kept;
pub mod lease;
mod outbox;
pub mod relay;
pub mod set;

pub use inbox::{Claim, ClaimRequest, DEFAULT_RETENTION, InboxStore, StoreKind, SweepReport};
pub use kept::RemoveFn;
pub use lease::{Lease, LeaseEnd, owner_token};
pub(crate) use outbox::Watched;
pub use outbox::{Dispatch, Relay, RelayFn, WakeupFn};
pub use relay::{OutboxSelect, RelayReport};
pub use set::{Stores, SweepFn, Sweeper};
