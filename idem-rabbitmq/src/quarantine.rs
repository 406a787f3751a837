//! Taking out of a queue the deliveries lapin cannot parse.
//!
//! RabbitMQ accepts properties that lapin's parser refuses (a `message_id` or a routing key that
//! is not UTF-8, a header field of a type it does not know). lapin then drops its connection on
//! every delivery of such a message, and the queue behind it would never move again. So when a
//! consumer's connection fails to parse, idem reads the head of the queue with its own reader
//! ([`crate::wire`]), judges every frame with lapin's parser, rejects (without requeue) each
//! delivery it refuses, so that the broker dead-letters it into `<queue>.dlq` once, after
//! recording why in the handler's store (reason `unparsable`, see [`idem_core::transport::DeadLetterLog`]),
//! and closes: every other delivery it held goes back to the queue, untouched but flagged
//! redelivered.

use crate::config::RabbitConfig;
use crate::wire::{BODY, Frame, HEADER, METHOD, RawConnection, long, short};
use idem_core::model::reasons::UNPARSABLE as REASON;
use idem_core::{
    model::DeadLetter, model::DeadLetterRecord, model::Fingerprint, model::StoreError,
    transport::QueueSpec,
};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tokio::time::{Instant, timeout};

/// How long the reader waits for the next frame before it decides it has seen the head.
const IDLE: Duration = Duration::from_millis(500);
/// The longest a quarantine pass reads.
const PASS: Duration = Duration::from_secs(10);

/// A quarantine pass failed; the consumer retries after its backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum QuarantineError {
    /// The reader's connection failed.
    #[error("idem's own AMQP reader failed: {0}")]
    Wire(#[from] std::io::Error),
    /// The reason could not be recorded, so the delivery was left in the queue.
    #[error("recording why a delivery is dead-lettered failed: {0}")]
    Record(#[from] StoreError),
}

/// One delivery as the reader assembles it. Its body is never kept: only its fingerprint,
/// computed as its frames pass, so a pass holds a few hundred bytes per delivery whatever the
/// bodies weigh.
#[derive(Default)]
struct Delivery {
    tag: u64,
    /// Why lapin's parser refuses one of its frames, if it does.
    unparsable: Option<String>,
    message_id: Option<Vec<u8>>,
    /// The body's SHA-256 so far (recorded with the dead letter).
    digest: Sha256,
    body_size: u64,
    body_read: u64,
    header_seen: bool,
}

/// A delivery the reader has seen whole and lapin's parser refuses.
struct Refused {
    tag: u64,
    why: String,
    message_id: Option<Vec<u8>>,
    fingerprint: Fingerprint,
}

/// Judges the frames of the deliveries at a queue's head, one at a time, as they come.
#[derive(Default)]
pub(crate) struct Judge {
    current: Delivery,
    /// Deliveries seen whole.
    seen: u32,
    refused: Vec<Refused>,
}

impl Judge {
    /// Takes the next frame.
    pub(crate) fn frame(&mut self, frame: &Frame) {
        let refused = parse_error(&frame.bytes());
        let current = &mut self.current;
        match frame.kind {
            METHOD if frame.method() == Some((60, 60)) => {
                *current = Delivery {
                    tag: frame.payload.get(4..).and_then(delivery_tag).unwrap_or(0),
                    unparsable: refused,
                    ..Delivery::default()
                };
            }
            HEADER => {
                current.header_seen = true;
                current.body_size = frame
                    .payload
                    .get(4..12)
                    .and_then(|size| size.try_into().ok())
                    .map_or(0, u64::from_be_bytes);
                current.message_id = message_id(&frame.payload);
                current.unparsable = current.unparsable.take().or(refused);
            }
            BODY => {
                current.body_read += frame.payload.len() as u64;
                current.digest.update(&frame.payload);
            }
            _ => return,
        }
        if current.header_seen && current.body_read >= current.body_size {
            self.seen += 1;
            let done = std::mem::take(current);
            if let (Some(why), true) = (done.unparsable, done.tag != 0) {
                self.refused.push(Refused {
                    tag: done.tag,
                    why,
                    message_id: done.message_id,
                    fingerprint: Fingerprint::of_digest(done.digest.finalize().into()),
                });
            }
        }
    }

    /// How many deliveries it has seen whole.
    pub(crate) fn seen(&self) -> u32 {
        self.seen
    }

    /// The tags of the deliveries it refuses, in the order seen.
    pub(crate) fn refused_tags(&self) -> impl Iterator<Item = u64> + '_ {
        self.refused.iter().map(|refused| refused.tag)
    }
}

/// Reads up to `window` deliveries at the head of `spec.queue` and takes out those lapin cannot
/// parse; returns how many it took out.
pub(crate) async fn run(
    config: &RabbitConfig,
    spec: &QueueSpec,
    window: u16,
) -> Result<usize, QuarantineError> {
    let mut raw = raw_connection(config).await?;
    let mut qos = 0u32.to_be_bytes().to_vec();
    qos.extend_from_slice(&window.to_be_bytes());
    qos.push(0);
    raw.method(1, 60, 10, &qos).await?;
    raw.expect(60, 11).await?;
    let mut consume = 0u16.to_be_bytes().to_vec();
    short(&mut consume, spec.queue.as_bytes());
    short(
        &mut consume,
        format!("{}:quarantine", spec.consumer).as_bytes(),
    );
    consume.push(0);
    long(&mut consume, b"");
    raw.method(1, 60, 20, &consume).await?;
    raw.expect(60, 21).await?;

    let mut judge = Judge::default();
    let deadline = Instant::now() + PASS;
    while judge.seen() < u32::from(window) && Instant::now() < deadline {
        let Ok(frame) = timeout(IDLE, raw.read()).await else {
            break;
        };
        judge.frame(&frame?);
    }
    let taken = judge.refused.len();
    if taken > 0 {
        record(spec, &judge.refused).await?;
        for tag in judge.refused_tags() {
            let mut reject = tag.to_be_bytes().to_vec();
            reject.push(0); // requeue = false: the broker dead-letters it
            raw.method(1, 60, 90, &reject).await?;
        }
    }
    // Waits until the broker has processed the rejects; the rest goes back to the queue.
    raw.close().await?;
    Ok(taken)
}

/// Records why each of `deliveries` is dead-lettered, before any of them is rejected.
async fn record(spec: &QueueSpec, deliveries: &[Refused]) -> Result<(), StoreError> {
    for delivery in deliveries {
        let detail = format!(
            "the AMQP client cannot parse this delivery's frames ({}); taken out of the queue by idem's own reader",
            delivery.why
        );
        tracing::warn!(queue = spec.queue, consumer = spec.consumer, %detail, "dead-lettering a delivery lapin cannot parse");
        let letter = DeadLetter::new(REASON, detail, spec.consumer.clone(), None, 1);
        // The id as far as it reads; the record's fingerprint ties it to the message.
        let message_id = delivery
            .message_id
            .as_deref()
            .map(|id| String::from_utf8_lossy(id).into_owned());
        let record = DeadLetterRecord::of_fingerprint(
            &letter,
            message_id,
            delivery.fingerprint,
            &spec.queue,
        );
        match spec.dead_letters.record(record).await {
            Ok(()) => {}
            // Retrying will not write it: it is taken out all the same, and counted.
            Err(e) if e.class() == idem_core::model::ErrorClass::Permanent => {
                tracing::error!(queue = spec.queue, error = %e, "the dead letter's record cannot be written; taking it out without one");
                idem_core::telemetry::dead_letter_unrecorded(spec.consumer.as_str());
            }
            Err(e) => return Err(e),
        }
        idem_core::telemetry::dead_letter(spec.consumer.as_str(), REASON);
    }
    Ok(())
}

/// Why lapin's parser refuses `frame`, if it does.
fn parse_error(frame: &[u8]) -> Option<String> {
    amq_protocol::frame::parse_frame(frame)
        .err()
        .map(|e| format!("{e:?}"))
}

/// The delivery tag of a `basic.deliver`'s arguments: after the consumer tag.
fn delivery_tag(args: &[u8]) -> Option<u64> {
    let tag_len = usize::from(*args.first()?);
    let tag = args.get(1 + tag_len..9 + tag_len)?;
    tag.try_into().ok().map(u64::from_be_bytes)
}

/// The raw `message-id` of a content header's payload (class, weight, size, flags, then the
/// properties present, in flag order), whatever its bytes.
fn message_id(payload: &[u8]) -> Option<Vec<u8>> {
    let flags = u16::from_be_bytes(payload.get(12..14)?.try_into().ok()?);
    let mut at = 14;
    let short_at = |at: &mut usize| -> Option<Vec<u8>> {
        let len = usize::from(*payload.get(*at)?);
        let value = payload.get(*at + 1..*at + 1 + len)?.to_vec();
        *at += 1 + len;
        Some(value)
    };
    // Bits 15 (content-type) to 7 (message-id): short strings, a table, two octets.
    for bit in (7..=15).rev() {
        if flags & (1 << bit) == 0 {
            continue;
        }
        match bit {
            13 => {
                let len = u32::from_be_bytes(payload.get(at..at + 4)?.try_into().ok()?);
                at += 4 + usize::try_from(len).ok()?;
            }
            12 | 11 => at += 1,
            7 => return short_at(&mut at),
            _ => {
                short_at(&mut at)?;
            }
        }
    }
    None
}

/// A raw connection to the first broker that answers, in failover order.
async fn raw_connection(config: &RabbitConfig) -> std::io::Result<RawConnection> {
    let mut failed = None;
    for (index, url) in config.brokers() {
        match RawConnection::open(url, config.tls_ca.as_deref()).await {
            Ok(raw) => {
                config.worked(index);
                return Ok(raw);
            }
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.unwrap_or_else(|| std::io::Error::other("no broker configured")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_message_id_of_a_content_header() {
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&2u64.to_be_bytes());
        let flags: u16 = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7);
        header.extend_from_slice(&flags.to_be_bytes());
        short(&mut header, b"application/json");
        long(&mut header, &[1, b'x', b'S', 0, 0, 0, 1, b'y']);
        header.push(2);
        short(&mut header, &[0xff, 0xfe, b'x']);
        assert_eq!(message_id(&header), Some(vec![0xff, 0xfe, b'x']));
        let mut tag = Vec::new();
        short(&mut tag, b"ctag");
        tag.extend_from_slice(&42u64.to_be_bytes());
        assert_eq!(delivery_tag(&tag), Some(42));
    }
}

#[cfg(test)]
mod judged {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    /// The frames of one delivery (tag, message id, body in frames of `chunk` bytes).
    fn delivery(tag: u64, message_id: &[u8], body: &[u8], chunk: usize) -> Vec<Frame> {
        let mut deliver = 60u16.to_be_bytes().to_vec();
        deliver.extend_from_slice(&60u16.to_be_bytes());
        short(&mut deliver, b"ctag");
        deliver.extend_from_slice(&tag.to_be_bytes());
        deliver.push(0);
        short(&mut deliver, b"");
        short(&mut deliver, b"q");
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&(1u16 << 7).to_be_bytes());
        short(&mut header, message_id);
        let mut frames = vec![
            Frame {
                kind: METHOD,
                channel: 1,
                payload: deliver,
            },
            Frame {
                kind: HEADER,
                channel: 1,
                payload: header,
            },
        ];
        frames.extend(body.chunks(chunk.max(1)).map(|part| Frame {
            kind: BODY,
            channel: 1,
            payload: part.to_vec(),
        }));
        frames
    }

    fn any_frame() -> impl Strategy<Value = Frame> {
        (
            prop_oneof![Just(METHOD), Just(HEADER), Just(BODY), any::<u8>()],
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(kind, channel, payload)| Frame {
                kind,
                channel,
                payload,
            })
    }

    /// Message ids of the classes that lie either side of "lapin parses it": valid UTF-8
    /// (ASCII, multi-byte, with a NUL) and ids one step from it (a multi-byte character cut
    /// short, an overlong encoding, a surrogate, one byte of a valid id made invalid), and
    /// random bytes; each with the name of its class.
    fn message_id() -> impl Strategy<Value = (&'static str, Vec<u8>)> {
        let text = "[a-z0-9 ]{0,12}";
        prop_oneof![
            "[ -~]{1,39}".prop_map(|s| ("ascii", s.into_bytes())),
            "[a-zé€😀]{1,9}".prop_map(|s| ("multi-byte", s.into_bytes())),
            (text, text).prop_map(|(a, b)| ("with a NUL", format!("{a}\0{b}").into_bytes())),
            (text, prop::sample::select(vec!["é", "€", "😀"])).prop_map(|(a, c)| {
                let mut id = format!("{a}{c}").into_bytes();
                id.pop();
                ("cut short", id)
            }),
            (text, text).prop_map(|(a, b)| {
                (
                    "overlong",
                    [a.as_bytes(), &[0xC0, 0xAF], b.as_bytes()].concat(),
                )
            }),
            (text, text).prop_map(|(a, b)| {
                (
                    "surrogate",
                    [a.as_bytes(), &[0xED, 0xA0, 0x80], b.as_bytes()].concat(),
                )
            }),
            ("[a-z]{1,20}", any::<prop::sample::Index>(), 0x80u8..=0xFF).prop_map(
                |(a, at, byte)| {
                    let mut id = a.into_bytes();
                    let at = at.index(id.len());
                    id[at] = byte;
                    ("one byte made invalid", id)
                }
            ),
            prop::collection::vec(any::<u8>(), 1..40).prop_map(|id| ("random", id)),
        ]
    }

    /// Deliveries whose message ids are drawn from every class beside the line lapin draws
    /// (see [`message_id`]): exactly the ones that are not UTF-8 are refused, and every class
    /// is reached, refused and passed ones both, over the run.
    #[test]
    fn ids_either_side_of_utf8_are_judged_and_every_class_is_reached() {
        use proptest::test_runner::{Config, TestRunner};
        use std::collections::BTreeMap;
        let seen: std::sync::Mutex<BTreeMap<&str, u32>> = Default::default();
        let (refused_seen, passed_seen) = (
            std::sync::atomic::AtomicU32::new(0),
            std::sync::atomic::AtomicU32::new(0),
        );
        let mut runner = TestRunner::new(Config::with_cases(256));
        let ids = proptest::collection::vec(message_id(), 1..12);
        runner
            .run(&(ids, 1usize..700), |(ids, chunk)| {
                let mut judge = Judge::default();
                let mut expected = Vec::new();
                for (n, (class, id)) in ids.iter().enumerate() {
                    let tag = n as u64 + 1;
                    let body = format!("body {n}").into_bytes();
                    if std::str::from_utf8(id).is_err() {
                        expected.push((tag, Fingerprint::of(&body)));
                    }
                    for frame in delivery(tag, id, &body, chunk) {
                        judge.frame(&frame);
                    }
                    *seen.lock().unwrap().entry(class).or_default() += 1;
                }
                prop_assert_eq!(judge.seen() as usize, ids.len());
                let refused: Vec<_> = judge
                    .refused
                    .iter()
                    .map(|r| (r.tag, r.fingerprint))
                    .collect();
                refused_seen.fetch_add(refused.len() as u32, std::sync::atomic::Ordering::Relaxed);
                passed_seen.fetch_add(
                    (ids.len() - refused.len()) as u32,
                    std::sync::atomic::Ordering::Relaxed,
                );
                prop_assert_eq!(refused, expected);
                Ok(())
            })
            .unwrap();
        let seen = seen.into_inner().unwrap();
        for class in [
            "ascii",
            "multi-byte",
            "with a NUL",
            "cut short",
            "overlong",
            "surrogate",
            "one byte made invalid",
            "random",
        ] {
            assert!(
                seen.get(class).copied().unwrap_or(0) >= 20,
                "{class} too rare: {seen:?}"
            );
        }
        let (refused, passed) = (refused_seen.into_inner(), passed_seen.into_inner());
        assert!(
            refused >= 100 && passed >= 100,
            "{refused} refused, {passed} passed"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Deliveries with a message id that is not UTF-8 are refused, exactly those, with
        /// the fingerprint of their whole body; arbitrary frames between them never panic the
        /// judge, and it keeps no body.
        #[test]
        fn the_judge_refuses_exactly_the_deliveries_lapin_cannot_parse(
            ids in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 1..12),
            bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..2000), 12),
            chunk in 1usize..700,
            noise in proptest::collection::vec(any_frame(), 0..40),
        ) {
            let mut judge = Judge::default();
            let mut expected = Vec::new();
            for (n, id) in ids.iter().enumerate() {
                let tag = n as u64 + 1;
                if std::str::from_utf8(id).is_err() {
                    expected.push((tag, Fingerprint::of(&bodies[n])));
                }
                for frame in delivery(tag, id, &bodies[n], chunk) {
                    judge.frame(&frame);
                }
            }
            prop_assert_eq!(judge.seen() as usize, ids.len());
            let refused: Vec<_> = judge.refused.iter().map(|r| (r.tag, r.fingerprint)).collect();
            prop_assert_eq!(refused, expected);
            for frame in &noise {
                judge.frame(frame);
            }
            prop_assert!(judge.refused.len() <= judge.seen() as usize);
        }
    }
}
