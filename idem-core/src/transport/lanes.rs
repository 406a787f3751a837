//! Which lane of an ordered partition a message takes: a stable hash of its partition key, so
//! that every process and every transport (the runtime's lanes, a transport routing to
//! partition queues) puts one key in the same place.

/// The lane of partition key `key` among `lanes` (FNV-1a, stable across processes and
/// versions); a message without a routing key goes to lane 0.
pub fn lane_of(key: Option<&str>, lanes: usize) -> usize {
    let Some(key) = key else { return 0 };
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    usize::try_from(hash % lanes.max(1) as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_takes_the_same_lane_and_keys_spread() {
        assert_eq!(lane_of(Some("order-1"), 8), lane_of(Some("order-1"), 8));
        assert_eq!(lane_of(None, 8), 0);
        assert_eq!(lane_of(Some("x"), 1), 0);
        let used: std::collections::HashSet<_> = (0..100)
            .map(|i| lane_of(Some(&format!("order-{i}")), 8))
            .collect();
        assert_eq!(used.len(), 8, "100 keys reach every one of 8 lanes");
    }
}
