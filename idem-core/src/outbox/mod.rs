//! The outbox as the runtime drives it, in one place: the rows a relay pass takes and what it
//! did (`select`), the dispatch of a run's messages right after its commit (`dispatch`; from
//! memory: `kept`; the runs shutdown waits for: `in_flight`) and the relay task that publishes
//! what no dispatch took (`relay`). What a handler stages is [`crate::model::Outgoing`]; where
//! a store keeps it, [`crate::store::OutboxStore`]; what publishes it, [`crate::transport::Outbound`].

mod dispatch;
mod in_flight;
mod kept;
pub(crate) mod relay;
pub mod select;

pub use dispatch::{Dispatch, Relay, RelayFn, WakeupFn};
pub use kept::RemoveFn;
pub use select::{OutboxSelect, RelayReport};
