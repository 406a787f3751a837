//! Consuming one queue, reconnecting with backoff: this is where a delivery **enters** idem. Each
//! delivery becomes an [`idem_core::model::Envelope`] with its settlement handle ([`RabbitSettle`]) and
//! waits in its handler's mailbox.

use crate::answer::{lost, on_channel, unless_lost};
use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::envelope::{envelope, table_size};
use crate::quarantine;
use crate::settle::{self, Acks, RabbitSettle};
use crate::topology;
use futures_util::StreamExt;
use idem_core::transport::{Began, Ended, Session, Supervision, supervise};
use idem_core::{
    future::BoxFuture, model::DeadLetter, model::DeadLetterRecord, transport::Delivery,
    transport::QueueSpec, transport::StopSignal, transport::TransportError,
};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long the consumer pauses when a too-large delivery's record cannot be written,
/// before the delivery goes back to the queue.
const RECORD_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Why consuming on a connection stopped working.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Lost {
    /// The connection or channel failed.
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    /// A delivery's frames do not parse (lapin drops the connection on them).
    #[error("a delivery cannot be parsed: {0}")]
    Unparsable(lapin::Error),
    /// The broker cancelled the consumer (its queue was deleted, for example) or closed the
    /// channel.
    #[error("the consumer was cancelled or its channel closed")]
    Cancelled,
    /// The queue's topology could not be declared.
    #[error(transparent)]
    Topology(#[from] TransportError),
    /// The broker took the connection but did not answer the subscription in time.
    #[error("the broker did not answer the subscription within {0:?}")]
    Unanswered(Duration),
}

/// A subscription: its channel, lapin's consumer and the consumer tag.
type Subscribed = Result<(Channel, lapin::Consumer, String), Lost>;

/// The consumer of one handler's queue.
pub(crate) struct Consumer {
    pub(crate) config: RabbitConfig,
    /// Where settlements publish their copies (retries, dead letters with their reason).
    pub(crate) copies: Arc<crate::outbound::RabbitOutbound>,
    pub(crate) connections: Connections,
    pub(crate) spec: QueueSpec,
    pub(crate) prefetch: u16,
    pub(crate) mailbox: mpsc::Sender<Delivery>,
    pub(crate) stop: StopSignal,
}

impl Consumer {
    /// Consumes until `stop` is raised, a session after another ([`supervise`]). Deliveries in
    /// flight on a lost channel cannot be acked any more; the broker redelivers them, and the
    /// inbox recognises those that committed.
    pub(crate) async fn run(self) {
        let supervision = Supervision::new(
            self.spec.queue.as_str(),
            "RabbitMQ",
            (self.config.reconnect_min, self.config.reconnect_max),
            self.connections.consuming.clone(),
            self.stop.clone(),
        );
        supervise(self, supervision).await;
    }
}

impl Session for Consumer {
    type Lost = Lost;

    fn run<'a>(&'a mut self, began: &'a Began) -> BoxFuture<'a, Result<Ended, Lost>> {
        Box::pin(self.session(began))
    }

    /// A delivery lapin choked on is taken out of the queue; once it is, the next session
    /// starts at once.
    fn recover<'a>(&'a mut self, lost: &'a Lost) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            match lost {
                Lost::Unparsable(e) => self.quarantine(e).await,
                _ => false,
            }
        })
    }
}

impl Consumer {
    /// Takes out of the queue the deliveries lapin cannot parse (see [`crate::quarantine`]);
    /// whether it took any.
    async fn quarantine(&self, cause: &lapin::Error) -> bool {
        tracing::warn!(queue = self.spec.queue, error = %cause, "a delivery the AMQP client cannot parse broke the connection; reading the queue's head with idem's own reader");
        // The delivery is among those lapin held; after the connection loss they are back at
        // the head of the queue.
        let window = self.prefetch.saturating_mul(2).max(64);
        let mut stop = self.stop.clone();
        let pass = tokio::select! {
            pass = quarantine::run(&self.config, &self.spec, window) => pass,
            // Shutdown ends the pass where it is: every delivery it held goes back to the
            // queue when its connection drops; none was rejected without its record.
            _ = stop.wait_for(|stopped| *stopped) => return false,
        };
        match pass {
            Ok(0) => {
                tracing::warn!(
                    queue = self.spec.queue,
                    "idem's own reader found no delivery to take out"
                );
                false
            }
            Ok(taken) => {
                tracing::warn!(
                    queue = self.spec.queue,
                    taken,
                    "deliveries the AMQP client cannot parse dead-lettered"
                );
                true
            }
            Err(e) => {
                tracing::error!(queue = self.spec.queue, error = %e, "could not take the unparsable delivery out of the queue");
                false
            }
        }
    }

    /// One connection's life: declare the queue's topology again first (an operator or a lost
    /// node may have deleted the queue, its retry and dead-letter queues or its bindings since;
    /// on a short connection of its own), then open the connection, consume on it, close it if
    /// consuming failed. It tells `began` once it consumes (the backoff starts over). Setting up is
    /// bounded in time and ends at once on shutdown: a broker that takes connections but does
    /// not answer (a cluster node recovering its queues) neither stops this queue's
    /// consumption for good nor holds up the shutdown.
    async fn session(&mut self, began: &Began) -> Result<Ended, Lost> {
        let mut stop = self.stop.clone();
        let (connection, subscribed) = tokio::select! {
            set_up = self.set_up(began) => set_up?,
            // A connection opened meanwhile is closed with the others at shutdown.
            _ = stop.wait_for(|stopped| *stopped) => return Ok(Ended::Stopped),
        };
        let result = match subscribed {
            Ok((channel, consumer, tag)) => self.consume(channel, consumer, &tag).await,
            Err(e) => Err(e),
        };
        if result.is_err() {
            // Whatever failed, start the next attempt on a fresh connection; a broker that
            // does not answer the close does not hold up the reconnection.
            let close = connection.close(200, ShortString::from("reconnecting"));
            let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
        }
        result
    }

    /// Declares the topology, opens the connection and subscribes on it: the connection, and
    /// whether subscribing worked (within [`topology::ANSWER_TIMEOUT`]).
    async fn set_up(&self, began: &Began) -> Result<(Arc<Connection>, Subscribed), Lost> {
        let topology = std::slice::from_ref(&self.spec);
        topology::declare_all(&self.connections, &self.config, topology).await?;
        let connection = self
            .connections
            .open(&self.config, &self.spec.queue)
            .await?;
        let subscribing = self.subscribe(&connection, began);
        let subscribed = match tokio::time::timeout(topology::ANSWER_TIMEOUT, subscribing).await {
            Ok(subscribed) => subscribed.map_err(Lost::from),
            Err(_) => Err(Lost::Unanswered(topology::ANSWER_TIMEOUT)),
        };
        Ok((connection, subscribed))
    }

    /// Opens the channel (prefetch, publisher confirms for retry copies and reasons) and starts
    /// consuming the queue.
    async fn subscribe(
        &self,
        connection: &Connection,
        began: &Began,
    ) -> Result<(Channel, lapin::Consumer, String), lapin::Error> {
        let alive = || connection.status().connected();
        let channel = unless_lost(alive, connection.create_channel(), lost).await?;
        let qos = channel.basic_qos(self.prefetch, BasicQosOptions::default());
        on_channel(&channel, qos).await?;
        let confirms = channel.confirm_select(ConfirmSelectOptions::default());
        on_channel(&channel, confirms).await?;
        let tag = format!("{}:{}", self.spec.consumer, std::process::id());
        let consume = channel.basic_consume(
            ShortString::from(self.spec.queue.as_str()),
            ShortString::from(tag.as_str()),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let consumer = on_channel(&channel, consume).await?;
        tracing::info!(
            queue = self.spec.queue,
            prefetch = self.prefetch,
            "consuming"
        );
        began.consuming();
        Ok((channel, consumer, tag))
    }

    /// Hands every delivery to the mailbox until shutdown, the mailbox closing, or a failure;
    /// reads lapin's consumer only while the runtime wants deliveries (`QueueSpec::demand`).
    async fn consume(
        &mut self,
        channel: Channel,
        mut consumer: lapin::Consumer,
        tag: &str,
    ) -> Result<Ended, Lost> {
        // Shared by every delivery's settlement: no per-delivery copy of the name.
        let queue: Arc<str> = self.spec.queue.as_str().into();
        // Every settlement of this channel goes through one task, in tag order; shutdown waits
        // for it to send what it holds before the connection closes. Deliveries share the
        // channel (one handle, not a clone of its many parts per delivery).
        let channel = Arc::new(channel);
        let lag = usize::from(self.prefetch / 4);
        let (acks, settler) = settle::spawn(channel.clone(), queue.clone(), lag);
        self.connections.track(settler);
        loop {
            // Batch mode: deliveries wait in lapin's buffer until a batch gathers.
            if !self.spec.demand.is_wanted() {
                let mut stopping = self.stop.clone();
                tokio::select! {
                    () = self.spec.demand.wanted() => {}
                    _ = stopping.wait_for(|stopped| *stopped) => {}
                }
            }
            let next = tokio::select! {
                next = consumer.next() => next,
                _ = self.stop.changed() => {
                    let cancel = channel.basic_cancel(ShortString::from(tag), BasicCancelOptions::default());
                    if tokio::time::timeout(Duration::from_secs(5), cancel).await.is_err() {
                        tracing::warn!(queue = self.spec.queue, "the broker did not confirm the consumer's cancel in time");
                    }
                    return Ok(Ended::Stopped);
                }
            };
            let delivery = match next {
                Some(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                    return Err(Lost::Unparsable(e));
                }
                Some(delivery) => delivery?,
                None => return Err(Lost::Cancelled),
            };
            let header_bytes = delivery.properties.headers().as_ref().map_or(0, table_size);
            let delivery = self.enter(delivery, &acks, &channel, &queue);
            let (body, limits) = (delivery.envelope.body.len(), &self.config);
            if body > limits.max_body {
                let detail = format!(
                    "the body is {body} bytes, over the {} allowed (RabbitConfig::max_body)",
                    limits.max_body
                );
                self.refuse_too_large(delivery, detail).await;
                continue;
            }
            if header_bytes > limits.max_headers {
                let detail = format!(
                    "the header table is about {header_bytes} bytes, over the {} allowed (RabbitConfig::max_headers)",
                    limits.max_headers
                );
                self.refuse_too_large(delivery, detail).await;
                continue;
            }
            // Waits while the mailbox is full: no more deliveries in memory than prefetch allows.
            if self.mailbox.send(delivery).await.is_err() {
                return Ok(Ended::MailboxClosed);
            }
        }
    }

    /// Dead-letters a delivery whose body or header table is over the configured limit (said
    /// in `detail`), without handing it to the runtime: its reason is recorded in the handler's
    /// store, then the broker moves it to the DLQ, once.
    async fn refuse_too_large(&self, delivery: Delivery, detail: String) {
        let Delivery { envelope, settle } = delivery;
        let mut reason = DeadLetter::new(
            idem_core::model::reasons::TOO_LARGE,
            detail,
            self.spec.consumer.clone(),
            None,
            envelope.attempt,
        );
        tracing::warn!(queue = self.spec.queue, message_id = envelope.message_id.as_deref(), detail = %reason.detail, "dead-lettering");
        let record = DeadLetterRecord::new(&reason, &envelope, &self.spec.queue);
        match self.spec.dead_letters.record(record).await {
            Ok(()) => {}
            Err(e) if e.class() == idem_core::model::ErrorClass::Permanent => {
                // Retrying will not write it: moved all the same (its reason in its headers
                // and logged), counted.
                tracing::error!(error = %e, detail = %reason.detail, "the dead letter's record cannot be written; moving it without one");
                idem_core::telemetry::dead_letter_unrecorded(&self.spec.consumer);
                reason = reason.unrecorded();
            }
            Err(e) => {
                // Not moved without its reason: back to the queue, after a pause.
                tracing::warn!(error = %e, "could not record the dead letter; it stays in the queue");
                tokio::time::sleep(RECORD_RETRY).await;
                drop(settle);
                return;
            }
        }
        idem_core::telemetry::dead_letter(&self.spec.consumer, &reason.reason);
        if let Err(e) = settle.dead_letter(&envelope, &reason).await {
            tracing::warn!(error = %e, "dead-lettering failed; the broker redelivers");
        }
    }

    /// One broker delivery as the runtime takes it: the envelope, and the handle that settles it.
    fn enter(
        &self,
        delivery: lapin::message::Delivery,
        acks: &Acks,
        channel: &Arc<Channel>,
        queue: &Arc<str>,
    ) -> Delivery {
        let lapin::message::Delivery {
            delivery_tag,
            redelivered,
            properties,
            data,
            routing_key,
            ..
        } = delivery;
        let mut envelope = envelope(&properties, data, redelivered);
        envelope.routing_key = Some(routing_key.to_string());
        let settle = Box::new(RabbitSettle {
            tag: delivery_tag,
            acks: acks.clone(),
            channel: channel.clone(),
            copies: self.copies.clone(),
            properties,
            queue: queue.clone(),
            done: false,
        });
        Delivery { envelope, settle }
    }
}
