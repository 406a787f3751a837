//! Queue names and their declaration.

use crate::config::{QueueType, RabbitConfig};
use crate::connections::Connections;
use idem_core::{transport::Partition, transport::QueueSpec, transport::TransportError};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection};
use std::time::Duration;

/// The exchange type that routes an ordered handler's messages to its partitions, from the
/// `rabbitmq_consistent_hash_exchange` plugin that ships with RabbitMQ.
pub const CONSISTENT_HASH: &str = "x-consistent-hash";

/// How long the broker is given to answer the declarations of one queue's topology, or the
/// steps of subscribing to it, before the attempt counts as failed (RabbitMQ's own
/// `channel_operation_timeout` is 15 s).
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);

/// What declaring an ordered handler's exchange failed on, and the fixes.
pub(crate) const NO_PLUGIN: &str = "declaring the ordered handler's x-consistent-hash exchange (enable the plugin: rabbitmq-plugins enable rabbitmq_consistent_hash_exchange; or run one partition, .ordered(consumer, 1), which needs no plugin; an exchange of that name and another type must be deleted)";

/// A partition queue's binding key: its weight on the hash ring (all equal).
const PARTITION_WEIGHT: &str = "1";

/// Whether the broker of `config` has the consistent-hash exchange type (the plugin
/// `rabbitmq_consistent_hash_exchange`, shipped with RabbitMQ and off by default), which an
/// ordered handler of more than one partition needs; one partition needs no plugin. Declares
/// and deletes a probe exchange on a short connection of its own.
pub async fn consistent_hash_available(config: &RabbitConfig) -> Result<bool, TransportError> {
    const PROBE: &str = "idem.consistent-hash.probe";
    let failed = |e: lapin::Error| TransportError::Topology {
        queue: PROBE.to_owned(),
        action: "probing for the consistent-hash exchange type",
        source: e.into(),
    };
    let connections = Connections::default();
    let connection = connections.open(config, "probe").await.map_err(failed)?;
    let channel = channel(&connection, PROBE).await?;
    let options = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    let kind = lapin::ExchangeKind::Custom(CONSISTENT_HASH.to_owned());
    let declared = channel
        .exchange_declare(
            ShortString::from(PROBE),
            kind,
            options,
            FieldTable::default(),
        )
        .await;
    let available = match declared {
        Ok(()) => {
            let deleting = channel.exchange_delete(ShortString::from(PROBE), Default::default());
            deleting.await.map_err(failed)?;
            true
        }
        // RabbitMQ answers a type no plugin provides with 503 COMMAND_INVALID ("unknown
        // exchange type", or "invalid exchange type" once the plugin was disabled), closing
        // the connection.
        Err(e) if e.to_string().contains("exchange type") => false,
        Err(e) => return Err(failed(e)),
    };
    connections.close_all().await;
    Ok(available)
}

/// The dead-letter queue of `queue`.
pub fn dlq(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// The delay queue of `queue` for `delay`.
pub fn retry_queue(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}ms", delay.as_millis())
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

fn queue_arguments(config: &RabbitConfig, dead_letter_to: Option<&str>) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-queue-type"),
        text(config.queue_type.name()),
    );
    if let Some(target) = dead_letter_to {
        args.insert(ShortString::from("x-dead-letter-exchange"), text(""));
        args.insert(ShortString::from("x-dead-letter-routing-key"), text(target));
        if config.queue_type == QueueType::Quorum {
            // Quorum queues dead-letter at most once unless told otherwise; a dead letter must
            // never be lost, so confirm it into the target (which needs reject-publish).
            args.insert(
                ShortString::from("x-dead-letter-strategy"),
                text("at-least-once"),
            );
            args.insert(ShortString::from("x-overflow"), text("reject-publish"));
        }
    }
    args
}

/// Declares the queues of every spec in `specs` on a connection of its own, closed afterwards.
pub(crate) async fn declare_all(
    connections: &Connections,
    config: &RabbitConfig,
    specs: &[QueueSpec],
) -> Result<(), TransportError> {
    crate::tls::check(config, crate::tls::AVAILABLE)?;
    let connection =
        connections
            .open(config, "topology")
            .await
            .map_err(|e| TransportError::Connection {
                broker: config.redacted_url(),
                url_variable: "AMQP_URL",
                source: e.into(),
            })?;
    let result = async {
        for spec in specs {
            // A broker that took the connection but never answers (a cluster node still
            // recovering its queues was seen to) must not hold a consumer's reconnection, or
            // the runtime's start, for good.
            let declaring = declare(&connection, config, spec);
            match tokio::time::timeout(ANSWER_TIMEOUT, declaring).await {
                Ok(declared) => declared?,
                Err(_) => return Err(unanswered(&spec.queue)),
            }
        }
        Ok(())
    }
    .await;
    let closing = connection.close(200, ShortString::from("topology declared"));
    let _ = tokio::time::timeout(ANSWER_TIMEOUT, closing).await;
    result
}

/// The error of declarations the broker did not answer within [`ANSWER_TIMEOUT`].
fn unanswered(queue: &str) -> TransportError {
    let waited = std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no answer within {ANSWER_TIMEOUT:?}"),
    );
    TransportError::Topology {
        queue: queue.to_owned(),
        action: "waiting for the broker to answer its declaration (a cluster node still recovering its queues can be that slow)",
        source: waited.into(),
    }
}

/// Declares the queues of `spec`. A queue that exists with other arguments is an error carrying
/// the broker's explanation (it names the argument that differs).
async fn declare(
    connection: &Connection,
    config: &RabbitConfig,
    spec: &QueueSpec,
) -> Result<(), TransportError> {
    let q = spec.queue.as_str();
    let mut main = queue_arguments(config, Some(&dlq(q)));
    if let (QueueType::Quorum, Some(limit)) = (config.queue_type, config.delivery_limit) {
        main.insert(
            ShortString::from("x-delivery-limit"),
            AMQPValue::LongLongInt(i64::from(limit)),
        );
    }
    if let Some(ttl) = config.message_ttl {
        main.insert(
            ShortString::from("x-message-ttl"),
            AMQPValue::LongLongInt(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)),
        );
    }
    if spec.partition.is_some() {
        // One consumer at a time across processes: the partition is handled in order.
        main.insert(
            ShortString::from("x-single-active-consumer"),
            AMQPValue::Boolean(true),
        );
    }
    let mut queues = vec![
        (dlq(q), queue_arguments(config, None)),
        (q.to_owned(), main),
    ];
    for delay in &spec.retry_delays {
        let mut args = queue_arguments(config, Some(q));
        let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        args.insert(
            ShortString::from("x-message-ttl"),
            AMQPValue::LongLongInt(ttl),
        );
        queues.push((retry_queue(q, *delay), args));
    }
    for (name, args) in queues {
        // A failed declaration closes the channel: use a fresh one per queue.
        let channel = channel(connection, &name).await?;
        channel
            .queue_declare(
                ShortString::from(name.as_str()),
                QueueDeclareOptions::durable(),
                args,
            )
            .await
            .map_err(|e| TransportError::Topology {
                queue: name.clone(),
                action: "declaring the queue (if it exists with other arguments, delete it or change the configuration to match it)",
                source: e.into(),
            })?;
        let _ = channel.close(200, ShortString::from("declared")).await;
    }
    if let Some(partition) = &spec.partition {
        bind_partition(connection, q, partition).await?;
    }
    for binding in config.bindings.iter().filter(|b| b.queue == q) {
        let channel = channel(connection, &binding.exchange).await?;
        let failed = |action: &'static str, e: lapin::Error| TransportError::Topology {
            queue: binding.exchange.clone(),
            action,
            source: e.into(),
        };
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                ShortString::from(binding.exchange.as_str()),
                binding.kind.lapin(),
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| failed("declaring the exchange", e))?;
        channel
            .queue_bind(
                ShortString::from(q),
                ShortString::from(binding.exchange.as_str()),
                ShortString::from(binding.routing_key.as_str()),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| failed("binding the queue", e))?;
        let _ = channel.close(200, ShortString::from("bound")).await;
    }
    Ok(())
}

/// What a partition's exchange is declared as: with several partitions, the consistent-hash
/// exchange (a plugin); with one, a fanout exchange that needs none (one queue holds every key
/// in order), unless an exchange of that name exists already, whose type is kept.
async fn partition_exchange(
    connection: &Connection,
    partition: &Partition,
) -> Result<Option<lapin::ExchangeKind>, TransportError> {
    if partition.count > 1 {
        return Ok(Some(lapin::ExchangeKind::Custom(
            CONSISTENT_HASH.to_owned(),
        )));
    }
    let exchange = partition.source.as_str();
    let channel = channel(connection, exchange).await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let exists = channel
        .exchange_declare(
            ShortString::from(exchange),
            lapin::ExchangeKind::Fanout,
            passive,
            FieldTable::default(),
        )
        .await
        .is_ok();
    // A missing exchange closes the channel (404); an existing one leaves it open.
    let _ = channel.close(200, ShortString::from("looked")).await;
    Ok((!exists).then_some(lapin::ExchangeKind::Fanout))
}

/// Declares an ordered handler's exchange ([`partition_exchange`]) and binds partition queue
/// `queue` to it with weight 1, so that the partitions share the routing keys evenly.
async fn bind_partition(
    connection: &Connection,
    queue: &str,
    partition: &Partition,
) -> Result<(), TransportError> {
    let exchange = partition.source.as_str();
    let kind = partition_exchange(connection, partition).await?;
    let channel = channel(connection, exchange).await?;
    let failed = |action: &'static str, e: lapin::Error| TransportError::Topology {
        queue: exchange.to_owned(),
        action,
        source: e.into(),
    };
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    if let Some(kind) = kind {
        channel
            .exchange_declare(
                ShortString::from(exchange),
                kind,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| failed(NO_PLUGIN, e))?;
    }
    channel
        .queue_bind(
            ShortString::from(queue),
            ShortString::from(exchange),
            ShortString::from(PARTITION_WEIGHT),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| failed("binding the partition queue", e))?;
    let _ = channel.close(200, ShortString::from("bound")).await;
    Ok(())
}

async fn channel(connection: &Connection, queue: &str) -> Result<Channel, TransportError> {
    connection
        .create_channel()
        .await
        .map_err(|e| TransportError::Topology {
            queue: queue.to_owned(),
            action: "opening a channel",
            source: e.into(),
        })
}
