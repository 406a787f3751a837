//! Transports: which broker a URL names ([`Broker::of_url`]), the contract between the runtime
//! and a message broker ([`Transport`], [`Settle`]), the life of a queue's consumer on any
//! broker ([`supervise`]), the forwarder of retry copies for a broker that cannot deliver
//! later by itself ([`forward_due`]), idem's own headers ([`IdemHeader`]), the ids of the copies a settlement publishes ([`CopyId`]), an
//! operator's reader of dead letters ([`DeadLetterReader`]), what a transport that
//! acknowledges cumulatively settles through ([`Watermark`]), how an ordered partition's
//! messages are spread over its lanes ([`lane_of`]), and an in-memory transport for tests and
//! demos ([`MemoryTransport`]). The RabbitMQ and NATS transports are in idem-rabbitmq and
//! idem-nats.

pub mod brokers;
pub mod contract;
pub mod copies;
pub mod dead_letters;
pub mod demand;
pub mod error;
pub mod forwarder;
pub mod headers;
pub mod lanes;
pub mod memory;
pub mod outbound;
pub mod released;
pub mod supervisor;
pub mod watermark;

pub use brokers::{BROKERS, Broker, BrokerScheme, UnknownBroker};
pub use contract::{DeadLetterLog, Delivery, Partition, QueueSpec, Settle, StopSignal, Transport};
pub use copies::{CopyId, CopyPurpose, DeliveryOrigin};
pub use dead_letters::{DeadLetterReader, HeldLetter, PublishTime};
pub use demand::{Demand, Gathering, Wants};
pub use error::TransportError;
pub use forwarder::{DueCopies, FORWARD_RETRY, forward_due};
pub use headers::IdemHeader;
pub use lanes::lane_of;
pub use memory::MemoryTransport;
pub use outbound::{Outbound, OutboundError};
pub use released::{release, released_claim, released_copy, released_seq};
pub use supervisor::{Began, Consuming, Ended, Session, Supervision, supervise};
pub use watermark::Watermark;
