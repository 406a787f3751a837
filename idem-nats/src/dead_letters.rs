//! [`NatsDeadLetters`]: a queue's dead-letter stream read for an operator (`idem dlq`). Letters
//! are read by sequence, oldest first, and stay in the stream until removed (reading holds
//! nothing, so an interrupted command leaves them as they were). A copy published back keeps
//! the letter's message id and headers, without the dead-lettering ones and the attempt.

use crate::envelope::{
    ATTEMPT_HEADER, CONTENT_TYPE_HEADER, CORRELATION_ID_HEADER, DUE_HEADER, MESSAGE_ID_HEADER,
    MSG_ID_HEADER, PUBLISHED_HEADER, REASON_DETAIL_HEADER, REASON_HEADER, SOURCE_QUEUE_HEADER,
};
use crate::names::Names;
use async_nats::HeaderMap;
use async_nats::header::HeaderValue;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::PublishErrorKind;
use idem_core::transport::{CopyId, CopyPurpose, DeliveryOrigin};
use idem_core::{
    future::BoxFuture, transport::DeadLetterReader, transport::HeldLetter,
    transport::OutboundError, transport::PublishTime, transport::TransportError,
};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Headers a dead letter carries that its replayed copy does not.
const DROPPED: &[&str] = &[
    REASON_HEADER,
    REASON_DETAIL_HEADER,
    SOURCE_QUEUE_HEADER,
    ATTEMPT_HEADER,
    DUE_HEADER,
    MSG_ID_HEADER,
];

/// One queue's dead letters, read for an operator (see the module).
pub(crate) struct NatsDeadLetters {
    js: Context,
    names: Names,
    /// The next sequence to read.
    next: AtomicU64,
    /// The headers of each letter read, by sequence, and the incarnation of the stream it was
    /// read from, for its copy.
    read: Mutex<HashMap<u64, (HeaderMap, i128)>>,
}

fn topology(names: &Names, action: &'static str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Topology {
        queue: names.dlq_stream.clone(),
        action,
        source: e.to_string().into(),
    }
}

impl NatsDeadLetters {
    pub(crate) fn new(js: Context, names: Names) -> Self {
        Self {
            js,
            names,
            next: AtomicU64::new(1),
            read: Mutex::default(),
        }
    }

    async fn stream(&self) -> Result<async_nats::jetstream::stream::Stream, TransportError> {
        self.js
            .get_stream(&self.names.dlq_stream)
            .await
            .map_err(|e| topology(&self.names, "reading the dead letters", e))
    }
}

impl DeadLetterReader for NatsDeadLetters {
    fn name(&self) -> &str {
        &self.names.dlq_subject
    }

    fn count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let mut stream = self.stream().await?;
            let info = stream
                .info()
                .await
                .map_err(|e| topology(&self.names, "reading the dead letters", e))?;
            Ok(info.state.messages)
        })
    }

    fn next(&self) -> BoxFuture<'_, Result<Option<HeldLetter>, TransportError>> {
        Box::pin(async move {
            let mut stream = self.stream().await?;
            let last = stream
                .info()
                .await
                .map_err(|e| topology(&self.names, "reading the dead letters", e))?
                .state
                .last_sequence;
            loop {
                let sequence = self.next.fetch_add(1, Ordering::AcqRel);
                if sequence > last {
                    return Ok(None);
                }
                // A sequence removed (by an operator, or a replay) is skipped.
                let Ok(message) = stream.get_raw_message(sequence).await else {
                    continue;
                };
                let letter = letter(sequence, &message.headers, message.payload.to_vec());
                let incarnation = crate::settle::incarnation(&stream);
                let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
                read.insert(sequence, (message.headers, incarnation));
                return Ok(Some(letter));
            }
        })
    }

    /// Published to `queue`'s subject with a `Nats-Msg-Id` naming the letter's place in the
    /// dead-letter stream ([`CopyId`]: each replay of each letter is a copy of its own),
    /// confirmed.
    fn replay<'a>(
        &'a self,
        letter: &'a HeldLetter,
        queue: &'a str,
        time: PublishTime,
    ) -> BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let (headers, incarnation) = {
                let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
                read.get(&letter.tag).cloned()
            }
            .ok_or_else(|| OutboundError::Broker("the letter was not read".into()))?;
            let mut copy = HeaderMap::new();
            for (name, values) in headers.iter() {
                let text: &str = name.as_ref();
                if DROPPED.iter().any(|d| d.eq_ignore_ascii_case(text)) {
                    continue;
                }
                for value in values {
                    copy.append(name.clone(), value.clone());
                }
            }
            if let Some(id) = &letter.message_id {
                copy.insert(MESSAGE_ID_HEADER, HeaderValue::from_lossy(id));
            }
            if time == PublishTime::Now {
                let now = idem_core::transport::headers::epoch_ms().to_string();
                copy.insert(PUBLISHED_HEADER, HeaderValue::from_lossy(&now));
            }
            let origin = DeliveryOrigin {
                source: &self.names.dlq_stream,
                incarnation,
                position: letter.tag,
            };
            let msg_id = CopyId::new(origin, CopyPurpose::Replay).to_string();
            copy.insert(MSG_ID_HEADER, HeaderValue::from_lossy(&msg_id));
            let failed = |e: async_nats::jetstream::context::PublishError| match e.kind() {
                PublishErrorKind::StreamNotFound => OutboundError::Unroutable {
                    destination: idem_core::model::Destination::queue(queue),
                },
                _ => OutboundError::Broker(e.into()),
            };
            self.js
                .publish_with_headers(queue.to_owned(), copy, letter.body.clone().into())
                .await
                .map_err(failed)?
                .await
                .map_err(failed)?;
            Ok(())
        })
    }

    fn remove<'a>(&'a self, letter: &'a HeldLetter) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let stream = self.stream().await?;
            stream
                .delete_message(letter.tag)
                .await
                .map_err(|e| topology(&self.names, "removing a dead letter", e))?;
            let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
            read.remove(&letter.tag);
            Ok(())
        })
    }

    /// Nothing is held: reading left every letter in the stream.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// The letter at `sequence` with `headers` and `body`.
fn letter(sequence: u64, headers: &HeaderMap, body: Vec<u8>) -> HeldLetter {
    let text = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
    let mut letter = HeldLetter::new(sequence, body);
    // idem publishes every dead letter with a `Nats-Msg-Id` of its own: the message id, if
    // it had one, is in `Idem-Message-Id`.
    letter.message_id = text(MESSAGE_ID_HEADER);
    letter.correlation_id = text(CORRELATION_ID_HEADER);
    letter.content_type = text(CONTENT_TYPE_HEADER);
    letter.source = text(SOURCE_QUEUE_HEADER);
    letter.published_at_ms = text(PUBLISHED_HEADER)
        .and_then(|ms| ms.trim().parse().ok())
        .filter(|ms: &i64| *ms > 0);
    let mut shown: Vec<(String, String)> = headers
        .iter()
        .filter(|(name, _)| {
            let name: &str = name.as_ref();
            !name.eq_ignore_ascii_case(MSG_ID_HEADER)
        })
        .filter_map(|(name, values)| {
            let name: &str = name.as_ref();
            Some((name.to_owned(), values.first()?.as_str().to_owned()))
        })
        .collect();
    shown.sort();
    letter.headers = shown;
    letter
}
