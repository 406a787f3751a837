//! One handler queue's consumer: where a JetStream delivery enters idem. It declares the
//! queue's streams and durable consumer (again after any failure), pulls what its mailbox has
//! room for ([`Puller`]: the mailbox, what waits for it and what is asked for hold at most
//! `prefetch` together), turns each message into a [`Delivery`] as it arrives (told in
//! progress from then on) and hands it to the handler's mailbox, and runs the queue's retry
//! forwarder beside it. A lost connection or consumer ends a session; the next one starts
//! after a backoff ([`supervise`]), until the runtime stops it.

use crate::connection::Shared;
use crate::names::durable;
use crate::progress::Unsettled;
use crate::pull::Puller;
use crate::settle::{NatsSettle, Reading};
use crate::{envelope, quarantine, retry, topology};
use async_nats::jetstream::consumer::PullConsumer;
use idem_core::model::BoxError;
use idem_core::transport::{Began, Ended, Session, Supervision, supervise};
use idem_core::{
    future::BoxFuture, transport::Delivery, transport::QueueSpec, transport::StopSignal,
};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;

pub(crate) struct Consumer {
    pub(crate) shared: Shared,
    pub(crate) spec: QueueSpec,
    pub(crate) prefetch: u16,
    pub(crate) mailbox: mpsc::Sender<Delivery>,
    pub(crate) stop: StopSignal,
    /// Its unsettled deliveries, told in progress by one ticker across sessions.
    pub(crate) unsettled: Unsettled,
    /// Which incarnation of the queue's stream the running session reads.
    pub(crate) reading: Reading,
    /// Its acks, confirmed in bulk.
    pub(crate) acks: Arc<crate::acks::Acks>,
}

impl Consumer {
    /// Consumes until `stop` is raised, a session after another ([`supervise`]). Deliveries
    /// unsettled when a session fails are redelivered by JetStream once their ack wait ends.
    pub(crate) async fn run(self) {
        let config = &self.shared.config;
        // Not ended with the consumer: handlers still running at shutdown are told in progress
        // until they settle.
        tokio::spawn(self.unsettled.clone().tell(
            self.shared.clone(),
            config.ack_wait / 3,
            self.stop.clone(),
        ));
        let supervision = Supervision::new(
            self.spec.queue.as_str(),
            "NATS",
            (config.reconnect_min, config.reconnect_max),
            self.shared.consuming.clone(),
            self.stop.clone(),
        );
        supervise(self, supervision).await;
    }

    async fn session(&mut self, began: &Began) -> Result<Ended, BoxError> {
        let js = self.shared.jetstream().await?;
        let (names, _) = topology::declare(&js, &self.spec, &self.shared.config).await?;
        let stream = js.get_stream(&names.stream).await?;
        let incarnation = crate::settle::incarnation(&stream);
        self.reading.set(incarnation);
        let durable = durable(&self.spec.consumer);
        let mut consumer: PullConsumer = stream.get_consumer(&durable).await?;
        let client = js.client();
        let connects = client.statistics();
        let mut scanned = connects.connects.load(Ordering::Relaxed);
        self.quarantine(&js, &names, incarnation, &mut consumer)
            .await;
        let mut puller = Puller::new(client.clone(), &names.stream, &durable).await?;
        let mut forwarder = AbortOnDrop(tokio::spawn(retry::forward(js.clone(), names.clone())));
        let names = Arc::new(names);
        began.consuming();
        let mut reconnected = tokio::time::interval(RECONNECT_CHECK);
        // Deliveries received, tracked, and not yet in the mailbox; and slots reserved in it,
        // every one that frees up: a delivery goes into one as it arrives, and the loop wakes
        // as a handler takes a delivery out.
        let mut held: VecDeque<Delivery> = VecDeque::new();
        let mut slots: Vec<mpsc::OwnedPermit<Delivery>> = Vec::new();
        let prefetch = usize::from(self.prefetch).max(1);
        loop {
            while !held.is_empty() && !slots.is_empty() {
                if let (Some(permit), Some(delivery)) = (slots.pop(), held.pop_front()) {
                    permit.send(delivery);
                }
            }
            // Asks for what there is room for: the mailbox, what waits for it and what is
            // asked for hold at most `prefetch` together; in halves, so that requests are few.
            let in_mailbox = self.mailbox.max_capacity() - self.mailbox.capacity() - slots.len();
            let room = prefetch.saturating_sub(in_mailbox + held.len() + puller.outstanding());
            if room >= prefetch.div_ceil(2)
                && let Err(e) = puller.ask(room).await
            {
                give_back(held).await;
                return Err(e.into());
            }
            tokio::select! {
                next = puller.next() => match next {
                    Ok(message) => {
                        let delivery = self.delivery(&js, &names, incarnation, message)?;
                        held.push_back(delivery);
                    }
                    Err(e) => {
                        give_back(held).await;
                        return Err(e.into());
                    }
                },
                permit = self.mailbox.clone().reserve_owned() => match permit {
                    Ok(permit) => slots.push(permit),
                    Err(_) => {
                        give_back(held).await;
                        return Ok(Ended::MailboxClosed);
                    }
                },
                _ = reconnected.tick() => {
                    // The client connected again: a delivery it could not parse may have cut
                    // the connection, and the pull requests it had sent are gone.
                    let now = connects.connects.load(Ordering::Relaxed);
                    if now != scanned {
                        scanned = now;
                        self.quarantine(&js, &names, incarnation, &mut consumer).await;
                        puller = Puller::new(client.clone(), &names.stream, &durable).await?;
                    }
                }
                () = stopped(&mut self.stop) => {
                    // Not handed to the runtime: given back for redelivery now.
                    give_back(held).await;
                    return Ok(Ended::Stopped);
                }
                ended = &mut forwarder.0 => {
                    give_back(held).await;
                    let why = match ended {
                        Ok(Err(e)) => e.to_string(),
                        Ok(Ok(())) => "it ended".to_owned(),
                        Err(e) => e.to_string(),
                    };
                    return Err(format!("the retry forwarder stopped: {why}").into());
                }
            }
        }
    }

    /// The delivery of `message`, among the unsettled from now on (told in progress).
    fn delivery(
        &self,
        js: &async_nats::jetstream::Context,
        names: &Arc<crate::names::Names>,
        incarnation: i128,
        message: async_nats::Message,
    ) -> Result<Delivery, BoxError> {
        let message = async_nats::jetstream::Message {
            message,
            context: js.clone(),
        };
        let (delivered, sequence, stored_ms) = match message.info() {
            Ok(info) => (
                info.delivered,
                info.stream_sequence,
                i64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).ok(),
            ),
            Err(e) => return Err(format!("a delivery without its JetStream info: {e}").into()),
        };
        let reply = message.reply.clone();
        let tracked = self.unsettled.track(reply.clone());
        let (message, acker) = message.split();
        let envelope = envelope::envelope(
            message.subject.as_str(),
            message.headers.as_ref(),
            message.payload.to_vec(),
            delivered,
            stored_ms,
        );
        let settle = NatsSettle {
            acker,
            reply,
            js: js.clone(),
            names: names.clone(),
            body: message.payload,
            sequence,
            incarnation,
            reading: self.reading.clone(),
            delivered,
            acks: self.acks.clone(),
            _unsettled: tracked,
        };
        Ok(Delivery {
            envelope,
            settle: Box::new(settle),
        })
    }

    /// Takes out of the stream the deliveries the consumer has out that the client cannot
    /// parse ([`quarantine`]); a pass that fails is logged, and the next connection cut or
    /// session tries again.
    async fn quarantine(
        &self,
        js: &async_nats::jetstream::Context,
        names: &crate::names::Names,
        incarnation: i128,
        consumer: &mut PullConsumer,
    ) {
        let out = match consumer.info().await {
            Ok(info) => (
                info.ack_floor.stream_sequence,
                info.delivered.stream_sequence,
            ),
            Err(e) => {
                tracing::warn!(queue = self.spec.queue, error = %e, "reading the consumer's deliveries out failed");
                return;
            }
        };
        match quarantine::run(js, names, &self.spec, incarnation, out).await {
            Ok(0) => {}
            Ok(taken) => {
                tracing::warn!(
                    queue = self.spec.queue,
                    taken,
                    "dead-lettered deliveries the NATS client cannot parse"
                );
            }
            Err(e) => {
                tracing::warn!(queue = self.spec.queue, error = %e, "taking out deliveries the NATS client cannot parse failed; tried again at the next cut");
            }
        }
    }
}

impl Session for Consumer {
    type Lost = BoxError;

    fn run<'a>(&'a mut self, began: &'a Began) -> BoxFuture<'a, Result<Ended, BoxError>> {
        Box::pin(async move {
            let ended = self.session(began).await;
            self.reading.clear();
            ended
        })
    }
}

/// How often a session checks whether the client connected again.
const RECONNECT_CHECK: Duration = Duration::from_secs(1);

/// Gives back the deliveries received and not handed to the runtime, so that JetStream
/// redelivers them now instead of after their ack wait.
async fn give_back(held: VecDeque<Delivery>) {
    for delivery in held {
        let _ = delivery.settle.release().await;
    }
}

/// Resolves once `stop` is raised.
async fn stopped(stop: &mut StopSignal) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

/// Aborts the task when dropped: the retry forwarder lives as long as its session.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), BoxError>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
