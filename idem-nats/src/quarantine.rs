//! Taking out of a queue's stream the messages async-nats cannot parse.
//!
//! nats-server stores message headers as producers send them, and async-nats drops its whole
//! connection on a delivery whose header block it refuses (not UTF-8, a line without a colon, a
//! name with a space or a control character, a status it does not know). The delivery is
//! never seen, never acked, and comes back after its ack wait to cut the connection again, for
//! ever. So whenever a consumer's session starts, and whenever the client has connected again
//! during one, idem reads the deliveries its durable consumer has out (between the ack floor
//! and the last delivered sequence) by sequence, through JetStream's message API, which returns
//! the header block as bytes and leaves the parsing to idem. Each message whose header block
//! the client would refuse is dead-lettered once: its reason recorded in the handler's store
//! (reason `unparsable`, see [`idem_core::transport::DeadLetterLog`]), then published to the dead-letter
//! stream with its body as it was and its headers mended, named after its sequence so that a
//! second pass publishes nothing new ([`CopyId`]), then deleted from the work stream, which
//! JetStream then stops redelivering. The connection is cut once for it.

use crate::names::Names;
use crate::settle::{dead_letter_headers, incarnation};
use async_nats::jetstream::Context;
use async_nats::jetstream::response::Response;
use async_nats::{HeaderName, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use idem_core::transport::{CopyId, CopyPurpose, DeliveryOrigin};
use idem_core::{
    model::DeadLetter, model::DeadLetterRecord, model::Envelope, model::ErrorClass, model::Headers,
    transport::QueueSpec,
};
use std::str::FromStr;

/// The reason code of a message taken out this way (the same as on RabbitMQ).
pub(crate) const REASON: &str = idem_core::model::reasons::UNPARSABLE;

/// A quarantine pass failed; the message stays, and the next pass tries again.
#[derive(Debug, thiserror::Error)]
pub(crate) enum QuarantineError {
    /// A JetStream request failed.
    #[error("reading or removing a delivery the client cannot parse: {0}")]
    JetStream(String),
    /// The reason could not be recorded, so the message was left in the stream.
    #[error("recording why a delivery is dead-lettered failed: {0}")]
    Record(#[from] idem_core::model::StoreError),
}

fn jetstream(e: impl std::fmt::Display) -> QuarantineError {
    QuarantineError::JetStream(e.to_string())
}

/// A request of JetStream's message API: the first message at `seq` or after on `next_by_subj`.
#[derive(serde::Serialize)]
struct GetRequest<'a> {
    seq: u64,
    next_by_subj: &'a str,
}

#[derive(serde::Deserialize)]
struct GetResponse {
    message: Stored,
}

/// A stored message as the message API returns it: headers and body in base64.
#[derive(serde::Deserialize)]
struct Stored {
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

/// Dead-letters each message of `spec`'s stream (`names`, incarnation `incarnation`) that its
/// durable consumer has delivered without an ack, from after `ack_floor` up to `delivered`,
/// and that the client cannot parse; returns how many it took out.
pub(crate) async fn run(
    js: &Context,
    names: &Names,
    spec: &QueueSpec,
    incarnation_read: i128,
    (ack_floor, delivered): (u64, u64),
) -> Result<usize, QuarantineError> {
    let mut next = ack_floor.saturating_add(1);
    let mut taken = 0;
    while next <= delivered {
        let request = GetRequest {
            seq: next,
            next_by_subj: &names.subject,
        };
        let response: Response<GetResponse> = js
            .request(format!("STREAM.MSG.GET.{}", names.stream), &request)
            .await
            .map_err(jetstream)?;
        let stored = match response {
            Response::Ok(got) => got.message,
            Response::Err { error }
                if error.error_code() == async_nats::jetstream::ErrorCode::NO_MESSAGE_FOUND =>
            {
                break;
            }
            Response::Err { error } => return Err(jetstream(error)),
        };
        if stored.seq > delivered {
            break;
        }
        next = stored.seq.saturating_add(1);
        let header = decode(stored.hdrs.as_deref())?;
        if let Some(why) = parse_error(&header) {
            let body = decode(stored.data.as_deref())?;
            take_out(
                js,
                names,
                spec,
                incarnation_read,
                stored.seq,
                &header,
                body,
                &why,
            )
            .await?;
            taken += 1;
        }
    }
    Ok(taken)
}

fn decode(base64: Option<&str>) -> Result<Vec<u8>, QuarantineError> {
    base64.map_or(Ok(Vec::new()), |text| {
        STANDARD
            .decode(text)
            .map_err(|e| jetstream(format!("a stored message in bad base64: {e}")))
    })
}

/// Records, dead-letters and removes the message at `sequence`.
#[allow(clippy::too_many_arguments)]
async fn take_out(
    js: &Context,
    names: &Names,
    spec: &QueueSpec,
    incarnation_read: i128,
    sequence: u64,
    header: &[u8],
    body: Vec<u8>,
    why: &str,
) -> Result<(), QuarantineError> {
    let envelope = mended(header, body);
    let detail = format!(
        "the NATS client cannot parse this message's headers ({why}); taken out of the stream by idem, its headers mended"
    );
    tracing::warn!(queue = spec.queue, consumer = spec.consumer, sequence, %detail, "dead-lettering a message async-nats cannot parse");
    let letter = DeadLetter::new(REASON, detail, spec.consumer.clone(), None, 1);
    match spec
        .dead_letters
        .record(DeadLetterRecord::new(&letter, &envelope, &spec.queue))
        .await
    {
        Ok(()) => {}
        // Retrying will not write it: it is taken out all the same, its reason in its headers.
        Err(e) if e.class() == ErrorClass::Permanent => {
            tracing::error!(queue = spec.queue, error = %e, "the dead letter's record cannot be written; taking it out without one");
            idem_core::telemetry::dead_letter_unrecorded(spec.consumer.as_str());
        }
        Err(e) => return Err(e.into()),
    }
    let origin = DeliveryOrigin {
        source: &names.stream,
        incarnation: incarnation_read,
        position: sequence,
    };
    let msg_id = CopyId::new(origin, CopyPurpose::DeadLetter).to_string();
    let headers = dead_letter_headers(&envelope, &msg_id, &letter, names);
    let published = async {
        js.publish_with_headers(names.dlq_subject.clone(), headers, envelope.body.into())
            .await?
            .await
    };
    if let Err(e) = published.await {
        if e.kind() == async_nats::jetstream::context::PublishErrorKind::StreamNotFound {
            let _ = crate::topology::settlement_stream(js, names, &names.dlq_subject).await;
        }
        return Err(jetstream(format!(
            "publishing to `{}`: {e}",
            names.dlq_subject
        )));
    }
    // Removed only from the stream that holds it: one deleted and declared again since has
    // another message under this sequence.
    let stream = js.get_stream(&names.stream).await.map_err(jetstream)?;
    if incarnation(&stream) == incarnation_read {
        stream.delete_message(sequence).await.map_err(jetstream)?;
    }
    idem_core::telemetry::dead_letter(spec.consumer.as_str(), REASON);
    Ok(())
}

/// Why async-nats refuses `header`, a stored message's header block, if it does: the checks its
/// connection makes of a delivery's headers, in its order (`async_nats::connection`, 0.52).
pub(crate) fn parse_error(header: &[u8]) -> Option<String> {
    if header.is_empty() {
        return None;
    }
    let Ok(text) = std::str::from_utf8(header) else {
        return Some("a header is not UTF-8".to_owned());
    };
    let mut lines = text.lines().peekable();
    let Some(version) = lines.next() else {
        return Some("no version line".to_owned());
    };
    let Some(suffix) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Some("the version line is not `NATS/1.0`".to_owned());
    };
    let status = suffix
        .split_once(' ')
        .map_or(suffix, |(status, _)| status.trim());
    if !status.is_empty() && StatusCode::from_str(status).is_err() {
        return Some(format!("status `{}` is not a status code", shown(status)));
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else {
            return Some(format!("header line `{}` has no colon", shown(line)));
        };
        if HeaderName::from_str(name).is_err() {
            return Some(format!(
                "header name `{}` holds a space, a control or a non-ASCII character",
                shown(name)
            ));
        }
        // A value folded over several lines: lines that start with white space.
        while lines
            .next_if(|line| line.starts_with(char::is_whitespace))
            .is_some()
        {}
    }
    None
}

/// At most 64 characters of `text`, for a detail.
fn shown(text: &str) -> String {
    text.chars()
        .take(64)
        .collect::<String>()
        .escape_debug()
        .to_string()
}

/// The envelope of a message whose header block the client refuses: its body as it is, its
/// headers read line by line with what is not UTF-8 replaced (names are mended again on the
/// way out: `crate::envelope::headers`).
fn mended(header: &[u8], body: Vec<u8>) -> Envelope {
    let text = String::from_utf8_lossy(header);
    let mut headers = Headers::default();
    let property = |name: &str| find(&text, name);
    let mut envelope = Envelope::new(body);
    envelope.message_id =
        property(crate::envelope::MESSAGE_ID_HEADER).or_else(|| property("Nats-Msg-Id"));
    envelope.correlation_id = property(crate::envelope::CORRELATION_ID_HEADER);
    envelope.content_type = property(crate::envelope::CONTENT_TYPE_HEADER);
    for line in text.lines().skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if name.is_empty() || crate::envelope::is_own(name) {
            continue;
        }
        headers.insert(name, value.trim());
    }
    envelope.headers = headers;
    envelope
}

/// The value of the first header named `name` (case-insensitive) in the lossy `text`.
fn find(text: &str, name: &str) -> Option<String> {
    text.lines().skip(1).find_map(|line| {
        let (found, value) = line.split_once(':')?;
        found
            .trim()
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_blocks_the_client_refuses_are_named() {
        for (block, refused) in [
            (&b""[..], false),
            (b"NATS/1.0\r\n\r\n", false),
            (b"NATS/1.0\r\nNats-Msg-Id: a\r\nTenant: acme\r\n\r\n", false),
            (b"NATS/1.0\r\nLong: a\r\n  folded\r\n\r\n", false),
            (b"NATS/1.0\r\nTenant: caf\xe9\r\n\r\n", true),
            (b"NATS/1.0\r\nBad Name: x\r\n\r\n", true),
            (b"NATS/1.0\r\nno colon\r\n\r\n", true),
            (b"NATS/1.0\r\nT\x01: x\r\n\r\n", true),
            (b"NATS/2.0\r\nA: b\r\n\r\n", true),
            (b"NATS/1.0 abc\r\n\r\n", true),
            (b"NATS/1.0 503\r\n\r\n", false),
        ] {
            assert_eq!(
                parse_error(block).is_some(),
                refused,
                "{}",
                String::from_utf8_lossy(block)
            );
        }
    }

    #[test]
    fn a_refused_message_keeps_its_ids_and_headers_mended() {
        let envelope = mended(
            b"NATS/1.0\r\nNats-Msg-Id: m-\xe91\r\nIdem-Correlation-Id: c-1\r\nTenant: caf\xe9\r\nBad Name: x\r\n\r\n",
            b"{}".to_vec(),
        );
        assert_eq!(envelope.message_id.as_deref(), Some("m-\u{FFFD}1"));
        assert_eq!(envelope.correlation_id.as_deref(), Some("c-1"));
        assert_eq!(
            envelope.headers.get("Tenant"),
            Some(&idem_core::model::HeaderValue::from("caf\u{FFFD}"))
        );
        assert_eq!(
            envelope.headers.get("Bad Name"),
            Some(&idem_core::model::HeaderValue::from("x"))
        );
        assert_eq!(envelope.headers.len(), 2, "{:?}", envelope.headers);
    }
}
