//! The next hop of a latency run: the consumer of the events.

use super::BILLED;
use super::latency::{Quantiles, Sent, quantiles};
use crate::workload::Order;
use anyhow::bail;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The next hop of a latency run: a consumer of the billed queue that takes the events as they
/// arrive and acks each (so the queue does not grow through the run), keeping their ids and
/// how long after its order's publish each one came.
pub(super) struct Events {
    connection: lapin::Connection,
    received: Arc<Mutex<Received>>,
}

/// What the next hop received.
#[derive(Default)]
struct Received {
    events: usize,
    ids: HashSet<String>,
    end_to_end: Vec<Duration>,
}

impl Events {
    /// Starts consuming the billed queue, unless `b.events_unconsumed`.
    pub(super) async fn start(b: &super::OutboxBench, sent: Sent) -> anyhow::Result<Option<Self>> {
        if b.events_unconsumed {
            return Ok(None);
        }
        let connection =
            lapin::Connection::connect(&b.amqp_url, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(1_000, BasicQosOptions::default()).await?;
        let mut consumer = channel
            .basic_consume(
                BILLED.into(),
                "next-hop".into(),
                BasicConsumeOptions::default(),
                Default::default(),
            )
            .await?;
        let received = Arc::new(Mutex::new(Received::default()));
        let seen = received.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let arrived = Instant::now();
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string())
                    .unwrap_or_default();
                let order = serde_json::from_slice::<Order>(&delivery.data).ok();
                let published = order.and_then(|order| {
                    let sent = sent.lock().ok()?;
                    sent.get(&order.order_id).copied()
                });
                if let Ok(mut seen) = seen.lock() {
                    seen.events += 1;
                    seen.ids.insert(id);
                    if let Some(published) = published {
                        seen.end_to_end
                            .push(arrived.saturating_duration_since(published));
                    }
                }
                // Acked one by one as it comes, as a consumer keeping up would.
                if delivery.ack(BasicAckOptions::default()).await.is_err() {
                    return;
                }
            }
        });
        Ok(Some(Self {
            connection,
            received,
        }))
    }

    /// Waits (a minute at most) for `expected` events, then fails unless exactly that many
    /// distinct events came, each once; returns the quantiles from each order's publish to
    /// its event's arrival.
    pub(super) async fn finish(self, expected: usize) -> anyhow::Result<Quantiles> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let counted = || {
            self.received
                .lock()
                .map(|r| (r.events, r.ids.len(), r.end_to_end.len()))
                .map_err(|_| anyhow::anyhow!("poisoned"))
        };
        while counted()?.0 < expected && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.connection.close(200, "done".into()).await;
        let (events, distinct, timed) = counted()?;
        if events != expected || distinct != expected || timed != expected {
            bail!(
                "the next hop received {events} events ({distinct} distinct, {timed} of a published order), expected {expected}"
            );
        }
        let end_to_end = std::mem::take(
            &mut self
                .received
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .end_to_end,
        );
        Ok(quantiles(end_to_end))
    }
}
