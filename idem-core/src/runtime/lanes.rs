//! An ordered partition's lanes: the partition's deliveries go to its workers by partition key
//! (the routing key), one lane per worker, so that the messages of one key are processed one
//! at a time and in the order the partition delivered them, while other keys go on in the
//! other lanes.

use crate::transport::Delivery;
use tokio::sync::mpsc;

/// Moves the partition's deliveries from `mailbox` into their lanes until the mailbox closes
/// (the consumer stopped) or every lane is gone. A lane holds up to the prefetch, so a lane
/// retrying in place never holds back the others.
pub(crate) async fn dispatch(
    mut mailbox: mpsc::Receiver<Delivery>,
    lanes: Vec<mpsc::Sender<Delivery>>,
) {
    while let Some(delivery) = mailbox.recv().await {
        let lane = lane_of(delivery.envelope.routing_key.as_deref(), lanes.len());
        if let Err(returned) = lanes[lane].send(delivery).await {
            // The lane's worker ended (shutdown): the delivery goes back to the broker.
            super::settle::release(returned.0).await;
        }
    }
}

/// The lane of partition key `key` among `lanes` (FNV-1a, stable across processes and
/// versions); a message without a routing key goes to lane 0.
pub(crate) fn lane_of(key: Option<&str>, lanes: usize) -> usize {
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
