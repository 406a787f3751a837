//! [`NatsSettle`]: how one JetStream delivery is settled. An ack is a plain ack, confirmed in
//! bulk with the queue's others ([`crate::acks`]); a retry publishes a copy to the queue's retry stream with the next attempt
//! and its due time, confirmed, then acks the original; a dead letter is published to the
//! dead-letter stream, confirmed, then acked; a release is a negative ack, for redelivery now.
//! A crash between a copy's publish and the ack leaves both; the copy's `Nats-Msg-Id` names the
//! delivery it settles ([`CopyId`]), so JetStream drops the second copy of that settlement, and
//! the inbox makes a second run a duplicate. A later delivery of the same message (a replay, a
//! producer's second payload under one message id) names its copies after itself.
//!
//! Until it is settled, JetStream is told the delivery is in progress every third of the ack
//! wait ([`crate::progress`]), so a long handler is not redelivered while it runs; and an ack the
//! connection lost is sent again for a while, since JetStream takes it as long as it has not
//! redelivered the message. No ack or negative ack crosses a re-creation of the stream
//! ([`Reading`]).

use crate::envelope::{
    self, DUE_HEADER, FIRST_FAILURE_HEADER, REASON_DETAIL_HEADER, REASON_HEADER,
    SOURCE_QUEUE_HEADER,
};
use crate::names::Names;
use async_nats::Subject;
use async_nats::header::HeaderValue;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{AckKind, Context, message::Acker};
use bytes::Bytes;
use idem_core::transport::{CopyId, CopyPurpose, DeliveryOrigin};
use idem_core::{
    future::BoxFuture, model::DeadLetter, model::Envelope, transport::Settle,
    transport::TransportError,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long an ack is sent again when the connection fails under it.
const ACK_PATIENCE: Duration = Duration::from_secs(10);

/// One delivery's settlement.
pub(crate) struct NatsSettle {
    pub(crate) acker: Acker,
    /// Where the delivery's ack goes (the acker's subject), for the confirmed ack.
    pub(crate) reply: Option<Subject>,
    pub(crate) js: Context,
    /// The queue's names, shared by its deliveries.
    pub(crate) names: std::sync::Arc<Names>,
    pub(crate) body: Bytes,
    /// The delivery's sequence in its stream.
    pub(crate) sequence: u64,
    /// Which incarnation of the stream delivered it ([`incarnation`]).
    pub(crate) incarnation: i128,
    /// Which one the queue's session reads now.
    pub(crate) reading: Reading,
    /// How many times JetStream has delivered it (1 the first time).
    pub(crate) delivered: i64,
    /// The queue's acks, confirmed in bulk ([`crate::acks`]).
    pub(crate) acks: Arc<crate::acks::Acks>,
    /// Among the unsettled deliveries JetStream is told are in progress, until dropped.
    pub(crate) _unsettled: crate::progress::Tracked,
}

/// Which incarnation of a queue's stream ([`incarnation`]) its consumer's session reads: set
/// while a session runs, 0 between sessions; shared by the queue's deliveries. An ack names
/// only the stream, the durable and sequences, and JetStream 2.9 takes one sent after the
/// stream was deleted and declared again for the new stream's message with that sequence,
/// which it removes unhandled; so a delivery is acked (or given back) only while the stream
/// that delivered it is the queue's: as the session reads it, or, between sessions, as the
/// server says.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reading(Arc<AtomicI64>);

/// Whether a delivery's stream is the one its queue's session reads.
enum Source {
    Read,
    /// Between sessions: the server is asked.
    Unknown,
    /// Deleted and declared again since: the delivery's message went with it.
    Replaced,
}

impl Reading {
    /// A session reads `incarnation`.
    pub(crate) fn set(&self, incarnation: i128) {
        let value = i64::try_from(incarnation).unwrap_or(i64::MAX);
        self.0.store(value, Ordering::SeqCst);
    }

    /// No session runs.
    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::SeqCst);
    }

    fn of(&self, incarnation: i128) -> Source {
        match self.0.load(Ordering::SeqCst) {
            0 => Source::Unknown,
            read if i128::from(read) == incarnation => Source::Read,
            _ => Source::Replaced,
        }
    }
}

fn settle_error(e: impl Into<idem_core::model::BoxError>) -> TransportError {
    TransportError::Settle(e.into())
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The headers of `envelope`'s dead letter, JetStream id `msg_id`: its own, the reason, its
/// detail (at most 1,024 characters) and the queue it came from.
pub(crate) fn dead_letter_headers(
    envelope: &Envelope,
    msg_id: &str,
    reason: &DeadLetter,
    names: &Names,
) -> async_nats::HeaderMap {
    let mut headers = envelope::headers(envelope, Some(msg_id));
    headers.insert(REASON_HEADER, HeaderValue::from_lossy(&reason.reason));
    let detail: String = reason.detail.chars().take(1024).collect();
    headers.insert(REASON_DETAIL_HEADER, HeaderValue::from_lossy(&detail));
    headers.insert(SOURCE_QUEUE_HEADER, HeaderValue::from_lossy(&names.subject));
    headers
}

/// The incarnation of `stream`: its creation time in nanoseconds since the Unix epoch, so that
/// a stream deleted and declared again does not name copies as its predecessor did.
pub(crate) fn incarnation(stream: &async_nats::jetstream::stream::Stream) -> i128 {
    SystemTime::from(stream.cached_info().created)
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX))
}

/// How long a delivery whose settlement could not be published waits before it is delivered
/// again: doubling with each delivery from 250 ms, at most 30 s.
fn settle_backoff(delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 7)).unwrap_or(7);
    (Duration::from_millis(250) * 2u32.pow(doublings)).min(Duration::from_secs(30))
}

impl NatsSettle {
    /// The JetStream id of the copy that settles this delivery for `purpose`: named after the
    /// delivery (stream, incarnation, sequence), never after the message id, which a replay or
    /// a producer reusing ids shares with other deliveries ([`CopyId`]).
    fn copy_id(&self, purpose: CopyPurpose) -> String {
        let origin = DeliveryOrigin {
            source: &self.names.stream,
            incarnation: self.incarnation,
            position: self.sequence,
        };
        CopyId::new(origin, purpose).to_string()
    }

    /// Publishes `headers` and the body to `subject` and waits for JetStream's confirm; then
    /// acks this delivery. A failed publish gives the delivery back, to be delivered again after
    /// a wait that grows with its deliveries ([`settle_backoff`]); a stream deleted under the
    /// queue is declared again first.
    async fn move_to(
        self,
        subject: &str,
        headers: async_nats::HeaderMap,
    ) -> Result<(), TransportError> {
        let published = async {
            self.js
                .publish_with_headers(subject.to_owned(), headers, self.body.clone())
                .await?
                .await
        };
        if let Err(e) = published.await {
            if e.kind() == PublishErrorKind::StreamNotFound {
                match crate::topology::settlement_stream(&self.js, &self.names, subject).await {
                    Ok(()) => tracing::warn!(
                        subject,
                        "the stream for `{subject}` was gone; declared again"
                    ),
                    Err(declared) => {
                        tracing::warn!(subject, error = %declared, "the stream for `{subject}` is gone and could not be declared again")
                    }
                }
            }
            let wait = settle_backoff(self.delivered);
            self.give_back(Some(wait)).await;
            return Err(settle_error(format!(
                "publishing to `{subject}`: {e}; delivered again in {wait:?}"
            )));
        }
        // Half-way: the copy is out, the original not yet acked.
        #[cfg(feature = "fault-injection")]
        if subject == self.names.dlq_subject {
            idem_core::fault::maybe_crash(idem_core::fault::Point::InDeadLetter);
        }
        self.double_ack().await
    }

    /// Whether the stream that delivered this is the queue's stream now: as the session
    /// reads it, or, between sessions, as the server says.
    async fn source(&self) -> Result<Source, async_nats::Error> {
        match self.reading.of(self.incarnation) {
            Source::Unknown => {
                let stream = self.js.get_stream(&self.names.stream).await?;
                Ok(match incarnation(&stream) == self.incarnation {
                    true => Source::Read,
                    false => Source::Replaced,
                })
            }
            known => Ok(known),
        }
    }

    /// Acks with JetStream's confirm ([`crate::acks::confirm_ack`]), again for a while when it fails; not
    /// at all once the stream that delivered it was replaced ([`Reading`]).
    async fn double_ack(&self) -> Result<(), TransportError> {
        let client = self.js.client();
        let deadline = tokio::time::Instant::now() + ACK_PATIENCE;
        let mut pause = Duration::from_millis(50);
        loop {
            let acked = match self.source().await {
                Ok(Source::Replaced) => {
                    tracing::warn!(
                        "not acked: the stream that delivered it was deleted and declared again, and the ack would remove the new stream's message with its sequence"
                    );
                    return Ok(());
                }
                Ok(_) => crate::acks::confirm_ack(&client, self.reply.as_ref()).await,
                Err(e) => Err(e),
            };
            match acked {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() + pause > deadline => {
                    return Err(settle_error(e));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "an ack was not confirmed; sending it again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// A negative ack (redelivered after `delay`, else at once), unless the stream that
    /// delivered it was replaced: JetStream redelivers once the ack wait ends.
    async fn give_back(&self, delay: Option<Duration>) {
        if !matches!(self.source().await, Ok(Source::Replaced)) {
            let _ = self.acker.ack_with(AckKind::Nak(delay)).await;
        }
    }
}

impl Settle for NatsSettle {
    /// Sends the ack and leaves its confirm to the queue's bulk confirms ([`crate::acks`]);
    /// not at all once the stream that delivered it was replaced ([`Reading`]).
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            match (self.source().await, &self.reply) {
                (Ok(Source::Replaced), _) => {
                    tracing::warn!(
                        "not acked: the stream that delivered it was deleted and declared again, and the ack would remove the new stream's message with its sequence"
                    );
                    Ok(())
                }
                (Ok(_), Some(reply)) if self.acks.ack(&self.js.client(), reply).await.is_ok() => {
                    Ok(())
                }
                // The server could not be asked, or the client refused the publish: the
                // confirmed ack, sent again for a while.
                _ => self.double_ack().await,
            }
        })
    }

    fn retry<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let mut copy = envelope.clone();
            copy.attempt = envelope.attempt.saturating_add(1);
            // The first failure's time, on the first retry copy; the next copies keep it.
            let now = idem_core::transport::headers::epoch_ms();
            if idem_core::transport::headers::first_failure(envelope, now).is_none() {
                copy.headers.insert(FIRST_FAILURE_HEADER, now);
            }
            let msg_id = self.copy_id(CopyPurpose::Retry);
            let mut headers = envelope::headers(&copy, Some(&msg_id));
            // JetStream delays each copy on its own: jittered, so that what failed together is
            // not all tried again together.
            let delay = idem_core::runtime::jittered(delay);
            let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
            let due = now_ms().saturating_add(delay_ms);
            headers.insert(DUE_HEADER, HeaderValue::from(due));
            let subject = self.names.retry_subject.clone();
            self.move_to(&subject, headers).await
        })
    }

    fn dead_letter<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        reason: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let msg_id = self.copy_id(CopyPurpose::DeadLetter);
            let headers = dead_letter_headers(envelope, &msg_id, reason, &self.names);
            let subject = self.names.dlq_subject.clone();
            self.move_to(&subject, headers).await
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            if matches!(self.source().await, Ok(Source::Replaced)) {
                return Ok(());
            }
            self.acker
                .ack_with(AckKind::Nak(None))
                .await
                .map_err(settle_error)
        })
    }
}
