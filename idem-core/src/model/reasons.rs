//! The reason codes of dead letters: the `reason` of a dead letter's record, of its reason
//! header and of the metric `idem_dead_letters_total`. A handler's rejections have theirs in
//! [`RejectReason::code`]; the others are here.

use super::outcome::RejectReason;

/// Another payload under a key that was processed before.
pub const CONFLICT: &str = "conflict";
/// Transient failures used every attempt of the retry policy.
pub const RETRIES_EXHAUSTED: &str = "retries-exhausted";
/// A delivery's body or headers over the transport's limit, refused before decoding.
pub const TOO_LARGE: &str = "too-large";
/// A delivery the broker's client library cannot parse, taken out by idem's own reader.
pub const UNPARSABLE: &str = "unparsable";

/// Every reason code idem writes.
pub const REASONS: &[&str] = &[
    "decode",
    "missing-key",
    "handler",
    "output",
    "store",
    "previously-failed",
    "poison",
    "version",
    "stale",
    "beyond-dedup-window",
    CONFLICT,
    RETRIES_EXHAUSTED,
    TOO_LARGE,
    UNPARSABLE,
];

impl RejectReason {
    /// Every rejection reason.
    pub const ALL: [RejectReason; 10] = [
        Self::Decode,
        Self::MissingKey,
        Self::Handler,
        Self::Output,
        Self::Store,
        Self::PreviouslyFailed,
        Self::Poison,
        Self::Version,
        Self::Stale,
        Self::BeyondDedupWindow,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `reason` is in [`RejectReason::ALL`]: a new variant does not compile here until
    /// it is placed.
    fn listed(reason: RejectReason) -> bool {
        match reason {
            RejectReason::Decode
            | RejectReason::MissingKey
            | RejectReason::Handler
            | RejectReason::Output
            | RejectReason::Store
            | RejectReason::PreviouslyFailed
            | RejectReason::Poison
            | RejectReason::Version
            | RejectReason::Stale
            | RejectReason::BeyondDedupWindow => RejectReason::ALL.contains(&reason),
        }
    }

    #[test]
    fn every_reason_code_is_listed_once() {
        for reason in RejectReason::ALL {
            assert!(listed(reason));
            assert!(REASONS.contains(&reason.code()), "{}", reason.code());
        }
        let mut codes = REASONS.to_vec();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), REASONS.len());
        assert_eq!(REASONS.len(), RejectReason::ALL.len() + 4);
    }
}
