//! The ids of the copies a transport publishes for a delivery: the retry copy and the dead
//! letter that settle it, and the copy an operator's replay sends back.
//!
//! A broker with a duplicate window (JetStream's `Nats-Msg-Id`) drops a message whose id it
//! took within the window, whatever became of the first. So a copy's id names the one
//! settlement it makes: the delivery it settles (where the broker holds it, which incarnation of
//! that stream or queue, and its position there) and what the copy is for. A crash between a
//! copy's publish and the original's ack settles the same delivery again and gets the same id,
//! and the broker answers "already stored"; a later attempt, a replay, or a second payload sent
//! under a reused message id is another delivery and gets another id.

use std::fmt;

/// What a copy is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CopyPurpose {
    /// The next attempt of a delivery that failed transiently.
    Retry,
    /// The dead letter of a delivery.
    DeadLetter,
    /// A dead letter sent back to its queue by an operator.
    Replay,
}

impl CopyPurpose {
    /// The id's last part: `retry`, `dlq` or `replay`.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::DeadLetter => "dlq",
            Self::Replay => "replay",
        }
    }
}

/// Where a delivery sits on its broker: the stream or queue holding it, that stream's
/// incarnation (its creation time, so that a stream deleted and declared again under the same
/// name does not reuse ids), and its position (JetStream's stream sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeliveryOrigin<'a> {
    /// The stream or queue.
    pub source: &'a str,
    /// Which incarnation of `source`: its creation time in nanoseconds, or 0 where the broker
    /// gives none.
    pub incarnation: i128,
    /// The delivery's position in `source`.
    pub position: u64,
}

/// The id of the copy of the delivery at `origin` made for `purpose`:
/// `<source>@<incarnation>:<position>.<purpose>`.
///
/// ```
/// use idem_core::transport::{CopyId, CopyPurpose, DeliveryOrigin};
///
/// let origin = DeliveryOrigin { source: "IDEM_orders", incarnation: 7, position: 42 };
/// let id = CopyId::new(origin, CopyPurpose::Retry).to_string();
/// assert_eq!(id, "IDEM_orders@7:42.retry");
/// // The same settlement made twice names the same copy; another purpose, another one.
/// assert_eq!(id, CopyId::new(origin, CopyPurpose::Retry).to_string());
/// assert_ne!(id, CopyId::new(origin, CopyPurpose::DeadLetter).to_string());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyId<'a> {
    origin: DeliveryOrigin<'a>,
    purpose: CopyPurpose,
}

impl<'a> CopyId<'a> {
    /// The copy of the delivery at `origin` made for `purpose`.
    pub fn new(origin: DeliveryOrigin<'a>, purpose: CopyPurpose) -> Self {
        Self { origin, purpose }
    }
}

impl fmt::Display for CopyId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let DeliveryOrigin {
            source,
            incarnation,
            position,
        } = self.origin;
        write!(
            f,
            "{source}@{incarnation}:{position}.{}",
            self.purpose.suffix()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(source: &str, incarnation: i128, position: u64, purpose: CopyPurpose) -> String {
        let origin = DeliveryOrigin {
            source,
            incarnation,
            position,
        };
        CopyId::new(origin, purpose).to_string()
    }

    #[test]
    fn each_part_of_the_origin_and_the_purpose_makes_another_id() {
        let base = id("s", 1, 2, CopyPurpose::Retry);
        assert_eq!(base, id("s", 1, 2, CopyPurpose::Retry));
        for other in [
            id("t", 1, 2, CopyPurpose::Retry),
            id("s", 3, 2, CopyPurpose::Retry),
            id("s", 1, 3, CopyPurpose::Retry),
            id("s", 1, 2, CopyPurpose::DeadLetter),
            id("s", 1, 2, CopyPurpose::Replay),
        ] {
            assert_ne!(base, other);
        }
    }
}
