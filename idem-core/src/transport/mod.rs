//! Transports: the contract between the runtime and a message broker ([`Transport`],
//! [`Settle`]), and an in-memory transport for tests and demos ([`MemoryTransport`]). The
//! RabbitMQ transport is in idem-rabbitmq.

pub mod contract;
pub mod demand;
pub mod memory;
pub mod outbound;

pub use contract::{
    DeadLetterLog, Delivery, Partition, QueueSpec, Settle, StopSignal, Transport, TransportError,
};
pub use demand::{Demand, Gathering, Wants};
pub use memory::MemoryTransport;
pub use outbound::{Outbound, OutboundError};
