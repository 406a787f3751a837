//! Consuming one queue, reconnecting with backoff: this is where a delivery enters idem.

use crate::acks;
use crate::config::RabbitConfig;
use crate::envelope::envelope;
use crate::settle::RabbitSettle;
use crate::transport::Connections;
use futures_util::StreamExt;
use idem_core::{Delivery, QueueSpec, StopSignal};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use std::time::Duration;
use tokio::sync::mpsc;

/// Why a session ended.
enum Ended {
    /// Shutdown: the consumer was cancelled; its channel stays open to settle what is in flight.
    Stopped,
    /// The runtime dropped the mailbox.
    MailboxClosed,
}

/// Consumes `spec.queue` until `stop` is raised, reconnecting after any connection or channel
/// failure. Deliveries in flight on a lost channel cannot be acked any more; the broker
/// redelivers them, and the inbox recognises those that committed.
pub(crate) async fn run(
    config: RabbitConfig,
    connections: Connections,
    spec: QueueSpec,
    prefetch: u16,
    mailbox: mpsc::Sender<Delivery>,
    mut stop: StopSignal,
) {
    let mut backoff = config.reconnect_min;
    while !*stop.borrow() {
        match session(
            &config,
            &connections,
            &spec,
            prefetch,
            &mailbox,
            &mut stop,
            &mut backoff,
        )
        .await
        {
            Ok(Ended::Stopped | Ended::MailboxClosed) => return,
            Err(e) => {
                tracing::warn!(queue = spec.queue, error = %e, retry_in = ?backoff, "RabbitMQ consumer lost; reconnecting");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => return,
                }
                backoff = (backoff * 2).min(config.reconnect_max);
            }
        }
    }
}

async fn session(
    config: &RabbitConfig,
    connections: &Connections,
    spec: &QueueSpec,
    prefetch: u16,
    mailbox: &mpsc::Sender<Delivery>,
    stop: &mut StopSignal,
    backoff: &mut Duration,
) -> Result<Ended, String> {
    let fail = |e: lapin::Error| e.to_string();
    let connection = connections.open(config, &spec.queue).await.map_err(fail)?;
    let result = consume(
        &connection,
        connections,
        spec,
        prefetch,
        mailbox,
        stop,
        backoff,
        config,
    )
    .await;
    if result.is_err() {
        // Whatever failed, start the next attempt on a fresh connection.
        let _ = connection
            .close(200, ShortString::from("reconnecting"))
            .await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn consume(
    connection: &lapin::Connection,
    connections: &Connections,
    spec: &QueueSpec,
    prefetch: u16,
    mailbox: &mpsc::Sender<Delivery>,
    stop: &mut StopSignal,
    backoff: &mut Duration,
    config: &RabbitConfig,
) -> Result<Ended, String> {
    let fail = |e: lapin::Error| e.to_string();
    let channel = connection.create_channel().await.map_err(fail)?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(fail)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(fail)?;
    let tag = format!("{}:{}", spec.consumer, std::process::id());
    let mut consumer = channel
        .basic_consume(
            ShortString::from(spec.queue.as_str()),
            ShortString::from(tag.as_str()),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(fail)?;
    tracing::info!(queue = spec.queue, prefetch, "consuming");
    // Shared by every delivery's settlement: no per-delivery copy of the name.
    let queue: std::sync::Arc<str> = spec.queue.as_str().into();
    // Every settlement of this channel goes through one task, in tag order; shutdown waits
    // for it to send what it holds before the connection closes.
    // Deliveries share the channel (one handle, not a clone of its many parts per delivery).
    let channel = std::sync::Arc::new(channel);
    let (acks, settler) = acks::spawn(channel.clone(), queue.clone(), usize::from(prefetch / 4));
    connections.track(settler);
    *backoff = config.reconnect_min;
    loop {
        let next = tokio::select! {
            next = consumer.next() => next,
            _ = stop.changed() => {
                let cancel = channel.basic_cancel(ShortString::from(tag.as_str()), BasicCancelOptions::default());
                if tokio::time::timeout(Duration::from_secs(5), cancel).await.is_err() {
                    tracing::warn!(queue = spec.queue, "the broker did not confirm the consumer's cancel in time");
                }
                return Ok(Ended::Stopped);
            }
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => return Err(e.to_string()),
            None => return Err("the consumer was cancelled or its channel closed".to_owned()),
        };
        let lapin::message::Delivery {
            delivery_tag,
            redelivered,
            properties,
            data,
            ..
        } = delivery;
        let envelope = envelope(&properties, data, redelivered);
        let settle = Box::new(RabbitSettle {
            tag: delivery_tag,
            acks: acks.clone(),
            channel: channel.clone(),
            properties,
            queue: queue.clone(),
            done: false,
        });
        // Waits while the mailbox is full: no more deliveries in memory than prefetch allows.
        if mailbox.send(Delivery { envelope, settle }).await.is_err() {
            return Ok(Ended::MailboxClosed);
        }
    }
}
