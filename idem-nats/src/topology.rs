//! Declaring what a handler queue needs on JetStream: its three streams (messages, retry
//! copies, dead letters) and the durable pull consumers of the handler and of the retry
//! forwarder. A partition of an ordered handler is a queue of its own (`<source>.p<i>`) whose
//! consumer has one message in flight at a time. Existing streams and consumers are kept when they agree, and refused, naming the
//! setting, when they do not.

use crate::config::NatsConfig;
use crate::names::{Names, durable};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream::{Config, RetentionPolicy, Stream};
use async_nats::jetstream::{self, Context};
use idem_core::{transport::QueueSpec, transport::TransportError};
use std::time::Duration;

/// The durable consumer of a queue's retry stream, shared by every process.
pub(crate) const RETRY_CONSUMER: &str = "idem-retry";

/// The duplicate window of a dead-letter stream: a delivery whose process died between
/// publishing its dead letter and acking it, delivered again within this time (the fleet was
/// down, the server restarted), is dead-lettered again under the same `Nats-Msg-Id`, and
/// JetStream drops that copy. The server's default of 2 minutes let a later one land twice.
/// JetStream keeps one id per dead letter of the window, and dead letters are few.
pub const DEAD_LETTER_DUPLICATE_WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// The failure of `action` on `queue`: [`TransportError::NotAnswering`] when JetStream did not
/// answer ([`not_answering`]), which start-up waits out, else a refusal.
fn topology(
    queue: &str,
    action: &'static str,
    source: impl Into<idem_core::model::BoxError>,
) -> TransportError {
    let source = source.into();
    let queue = queue.to_owned();
    if not_answering(&*source) {
        return TransportError::NotAnswering {
            queue,
            action,
            source,
        };
    }
    TransportError::Topology {
        queue,
        action,
        source,
    }
}

/// Whether `error` (or an error it wraps) says JetStream did not answer: a request timed out,
/// nobody answers JetStream's API yet, or the server is temporarily unavailable (503).
fn not_answering(error: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{
        CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind, RequestError,
        RequestErrorKind,
    };
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    let unavailable = |e: &async_nats::jetstream::Error| e.code() == 503;
    let mut next = Some(error);
    while let Some(e) = next {
        let answered = if let Some(e) = e.downcast_ref::<CreateStreamError>() {
            match e.kind() {
                CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
                    false
                }
                CreateStreamErrorKind::JetStream(e) => !unavailable(&e),
                _ => true,
            }
        } else if let Some(e) = e.downcast_ref::<GetStreamError>() {
            match e.kind() {
                GetStreamErrorKind::JetStream(e) => !unavailable(&e),
                _ => true,
            }
        } else if let Some(e) = e.downcast_ref::<ConsumerError>() {
            match e.kind() {
                ConsumerErrorKind::TimedOut => false,
                ConsumerErrorKind::JetStream(e) => !unavailable(&e),
                _ => true,
            }
        } else if let Some(e) = e.downcast_ref::<RequestError>() {
            !matches!(
                e.kind(),
                RequestErrorKind::TimedOut | RequestErrorKind::NoResponders
            )
        } else {
            true
        };
        if !answered {
            return true;
        }
        next = e.source();
    }
    false
}

/// Declares the streams of `spec`'s queue and its handler's durable consumer.
pub(crate) async fn declare(
    js: &Context,
    spec: &QueueSpec,
    config: &NatsConfig,
) -> Result<(Names, pull::Config), TransportError> {
    let (ack_wait, replicas) = (config.ack_wait, config.replicas);
    let names = crate::names::of(&spec.queue)?;
    if let Some(partition) = &spec.partition {
        crate::partitions::declare(js, &partition.source, partition.count, replicas).await?;
    }
    let main = stream(
        js,
        &names.stream,
        &names.subject,
        RetentionPolicy::WorkQueue,
        replicas,
    )
    .await?;
    settlement_stream(js, &names, &names.retry_subject).await?;
    settlement_stream(js, &names, &names.dlq_subject).await?;
    let mut config = consumer_config(&durable(&spec.consumer), &names.subject, ack_wait);
    if spec.partition.is_some() {
        // One partition of an ordered handler: one message in flight at a time, across every
        // process, so that its messages are handled one after another in publish order.
        config.max_ack_pending = 1;
    }
    consumer(&main, &names.stream, &config).await?;
    let retry = js
        .get_stream(&names.retry_stream)
        .await
        .map_err(|e| topology(&names.retry_stream, "reading the retry stream", e))?;
    let retry_config = consumer_config(RETRY_CONSUMER, &names.retry_subject, ack_wait);
    consumer(&retry, &names.retry_stream, &retry_config).await?;
    Ok((names, config))
}

/// Declares the retry or dead-letter stream of `names` that `subject` goes to: with the queue,
/// and again after it was deleted under the queue. (The retry forwarder's consumer, lost with
/// its stream, ends the session, and the next one declares it.)
pub(crate) async fn settlement_stream(
    js: &Context,
    names: &Names,
    subject: &str,
) -> Result<(), TransportError> {
    // As many replicas as the queue's own stream has.
    let replicas = match js.get_stream(&names.stream).await {
        Ok(main) => main.cached_info().config.num_replicas.max(1),
        Err(_) => 1,
    };
    if subject == names.dlq_subject {
        let stream = stream(
            js,
            &names.dlq_stream,
            &names.dlq_subject,
            RetentionPolicy::Limits,
            replicas,
        )
        .await?;
        dead_letter_window(js, stream).await?;
    } else {
        stream(
            js,
            &names.retry_stream,
            &names.retry_subject,
            RetentionPolicy::WorkQueue,
            replicas,
        )
        .await?;
    }
    Ok(())
}

/// Widens the duplicate window of the dead-letter stream `stream` to
/// [`DEAD_LETTER_DUPLICATE_WINDOW`] (at most its age limit, which JetStream requires), where it
/// is shorter: as the server's default of 2 minutes is.
async fn dead_letter_window(js: &Context, stream: Stream) -> Result<(), TransportError> {
    let existing = &stream.cached_info().config;
    let mut wanted = DEAD_LETTER_DUPLICATE_WINDOW;
    if !existing.max_age.is_zero() {
        wanted = wanted.min(existing.max_age);
    }
    if existing.duplicate_window >= wanted {
        return Ok(());
    }
    let was = existing.duplicate_window;
    let mut update = existing.clone();
    update.duplicate_window = wanted;
    js.update_stream(update)
        .await
        .map_err(|e| topology(&existing.name, "widening the duplicate window", e))?;
    tracing::info!(stream = %existing.name, window = ?wanted, was = ?was, "widened the dead-letter stream's duplicate window");
    Ok(())
}

/// Whether creating a stream failed because its name or its subject is taken: what another
/// process creating it at the same moment causes.
fn created_meanwhile(error: &async_nats::jetstream::context::CreateStreamError) -> bool {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::CreateStreamErrorKind;
    matches!(error.kind(), CreateStreamErrorKind::JetStream(e)
        if [ErrorCode::STREAM_NAME_EXIST, ErrorCode::STREAM_SUBJECT_OVERLAP].contains(&e.error_code()))
}

/// The durable pull consumer `name` of `subject`: explicit acks, redelivered without limit
/// (idem's poison limit decides), from the first message.
pub(crate) fn consumer_config(name: &str, subject: &str, ack_wait: Duration) -> pull::Config {
    pull::Config {
        durable_name: Some(name.to_owned()),
        filter_subject: subject.to_owned(),
        ack_policy: AckPolicy::Explicit,
        deliver_policy: DeliverPolicy::All,
        ack_wait,
        max_deliver: -1,
        max_ack_pending: 10_000,
        ..pull::Config::default()
    }
}

/// The stream `name` holding `subject` on `replicas` servers, created if absent; an existing
/// one must hold the subject with the same retention, and is scaled to `replicas`.
async fn stream(
    js: &Context,
    name: &str,
    subject: &str,
    retention: RetentionPolicy,
    replicas: usize,
) -> Result<Stream, TransportError> {
    let config = Config {
        name: name.to_owned(),
        subjects: vec![subject.to_owned()],
        retention,
        storage: jetstream::stream::StorageType::File,
        num_replicas: replicas,
        ..Config::default()
    };
    let mut stream = match js.get_or_create_stream(config).await {
        Ok(stream) => stream,
        // Another process may have created it between this one's read and its create, and
        // changed it since (the dead-letter stream's duplicate window): the server then says
        // the name is taken, or that its subject is. A stream of that name is checked below as
        // any existing one is; without one, the refusal stands.
        Err(e) if created_meanwhile(&e) => match js.get_stream(name).await {
            Ok(stream) => stream,
            Err(_) => return Err(topology(name, "declaring the stream", e)),
        },
        Err(e) => return Err(topology(name, "declaring the stream", e)),
    };
    let was = stream.cached_info().config.num_replicas.max(1);
    if was != replicas {
        let mut update = stream.cached_info().config.clone();
        update.num_replicas = replicas;
        js.update_stream(update).await.map_err(|e| {
            topology(
                name,
                "scaling the stream to the replicas configured (NatsConfig::replicas)",
                e,
            )
        })?;
        tracing::warn!(
            stream = name,
            replicas,
            was,
            "scaled a stream to the replicas configured"
        );
        stream = js
            .get_stream(name)
            .await
            .map_err(|e| topology(name, "reading the scaled stream", e))?;
    }
    let existing = &stream.cached_info().config;
    if let Some(why) = drift(existing, retention) {
        return Err(topology(name, "checking the existing stream", why));
    }
    if existing.retention != retention {
        return Err(topology(
            name,
            "checking the existing stream",
            format!(
                "it has retention {:?}, idem needs {retention:?}; delete the stream or use another queue name",
                existing.retention
            ),
        ));
    }
    if !existing.subjects.iter().any(|s| s == subject) {
        return Err(topology(
            name,
            "checking the existing stream",
            format!(
                "it holds subjects {:?}, not `{subject}`; delete the stream or use another queue name",
                existing.subjects
            ),
        ));
    }
    Ok(stream)
}

/// What in an existing stream's settings `existing` would strand or lose idem's messages, with
/// the fix: a stream in memory (lost with the server), and on a work or retry stream an age
/// limit or a size limit that discards old messages (messages removed before they are
/// handled).
fn drift(existing: &Config, retention: RetentionPolicy) -> Option<String> {
    if existing.storage != jetstream::stream::StorageType::File {
        return Some(format!(
            "its storage is {:?}; idem needs File storage (a server restart loses what memory holds): delete the stream or use another queue name",
            existing.storage
        ));
    }
    if retention != RetentionPolicy::WorkQueue {
        return None;
    }
    if !existing.max_age.is_zero() {
        return Some(format!(
            "its max_age is {:?}; messages older than that would be removed unhandled: remove the limit (max_age 0) or delete the stream",
            existing.max_age
        ));
    }
    let limited = existing.max_messages > 0
        || existing.max_bytes > 0
        || existing.max_messages_per_subject > 0;
    if limited && existing.discard == jetstream::stream::DiscardPolicy::Old {
        return Some(format!(
            "it keeps at most {} messages or {} bytes and discards old ones when full; messages would be removed unhandled: remove the limits or set discard to New",
            existing.max_messages, existing.max_bytes
        ));
    }
    None
}

/// The durable consumer of `config` on `stream`, created if absent; an existing one must filter
/// the same subject with explicit acks. One whose ack wait or delivery limit drifted from
/// `config` (an ack wait the in-progress signals are not paced for; a delivery limit that
/// strands a message JetStream stops delivering) is updated to `config`.
async fn consumer(
    stream: &Stream,
    name: &str,
    config: &pull::Config,
) -> Result<(), TransportError> {
    let durable = config.durable_name.clone().unwrap_or_default();
    let consumer = stream
        .get_or_create_consumer::<pull::Config>(&durable, config.clone())
        .await
        .map_err(|e| topology(name, "declaring the durable consumer", e))?;
    let drifted = |existing: &jetstream::consumer::Config| {
        existing.ack_wait != config.ack_wait || existing.max_deliver != config.max_deliver
    };
    let mut existing = consumer.cached_info().config.clone();
    if drifted(&existing) {
        let before = existing.clone();
        // The server takes a changed ack wait and delivery limit as an update of the durable.
        let mut update = existing;
        update.ack_wait = config.ack_wait;
        update.max_deliver = config.max_deliver;
        let updated = stream
            .create_consumer(update)
            .await
            .map_err(|e| topology(name, "updating the durable consumer", e))?;
        existing = updated.cached_info().config.clone();
        if drifted(&existing) {
            return Err(topology(
                name,
                "checking the existing consumer",
                format!(
                    "consumer `{durable}` has ack wait {:?} and max_deliver {}; idem needs {:?} and {} and the server did not take the update: delete the consumer",
                    before.ack_wait, before.max_deliver, config.ack_wait, config.max_deliver
                ),
            ));
        }
        tracing::warn!(consumer = %durable, ack_wait = ?config.ack_wait, "a durable consumer's ack wait or delivery limit had drifted; updated (was {:?}, max_deliver {})", before.ack_wait, before.max_deliver);
    }
    let existing = &existing;
    if existing.filter_subject != config.filter_subject
        || existing.ack_policy != AckPolicy::Explicit
        || existing.max_ack_pending != config.max_ack_pending
    {
        return Err(topology(
            name,
            "checking the existing consumer",
            format!(
                "consumer `{durable}` filters `{}` with ack policy {:?} and at most {} unacknowledged; idem needs `{}` with explicit acks and {}; delete the consumer",
                existing.filter_subject,
                existing.ack_policy,
                existing.max_ack_pending,
                config.filter_subject,
                config.max_ack_pending
            ),
        ));
    }
    Ok(())
}
