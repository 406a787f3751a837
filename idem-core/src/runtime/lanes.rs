//! An ordered partition's lanes: the partition's deliveries go to its workers by partition key
//! (the routing key), one lane per worker, so that the messages of one key are processed one
//! at a time and in the order the partition delivered them, while other keys go on in the
//! other lanes.

use crate::transport::{Delivery, lane_of};
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
