//! The handwritten consumers of the latency benchmark: lapin + sqlx, publishing their event
//! after the commit, with no outbox or with one. Their events carry what idem's do (content
//! type, correlation id, causation header): the broker took measurably longer to confirm
//! such messages into a growing queue than bare ones.

use super::latency::{Quantiles, Sent, feed, quantiles};
use super::next_hop::Events;
use super::{BILLED, ORDERS, OutboxBench, reset};
use crate::workload::Order;
use anyhow::bail;
use futures_util::StreamExt;
use idem::Envelope;
use idem::outbox::CAUSATION_HEADER;
use idem::rabbitmq::{Publisher, RabbitConfig};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use sqlx::{Connection as _, PgConnection};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Creates the handwritten consumers' inbox, `bench_outbox_hand` (the narrow row a lean
/// consumer writes per message), and the outbox of the one that keeps one,
/// `bench_outbox_hand_outbox` (the event's id and body).
pub(super) async fn create_hand_tables(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_outbox_hand (consumer TEXT NOT NULL, key TEXT NOT NULL, \
         received_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, key))",
    )
    .execute(pool)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_outbox_hand_outbox (message_id TEXT PRIMARY KEY, \
         body BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// What the handwritten consumer does with its event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HandEvent {
    /// Published after the commit, with no outbox: a crash in between loses it.
    AfterCommit,
    /// Staged as an outbox row in the order's transaction, published after the commit, and its
    /// row deleted once confirmed (on a second connection with `synchronous_commit = off`: a
    /// delete lost in a crash only sends the event again): the same work as idem's outbox.
    Outbox,
    /// As [`HandEvent::Outbox`], but the delivery is acked right after the commit, while its
    /// event is published (and its row deleted) by a task of its own: idem's contract, where
    /// the ack does not wait for the dispatch.
    OutboxDetached,
}

impl HandEvent {
    /// Whether the event is staged as an outbox row in the order's transaction.
    fn staged(self) -> bool {
        matches!(self, Self::Outbox | Self::OutboxDetached)
    }
}

/// The handwritten consumer's workers (the runtime's default concurrency) and prefetch (its
/// default prefetch).
const WORKERS: usize = 8;
const PREFETCH: u16 = 32;

/// One run of a handwritten consumer: `WORKERS` tasks, each holding its own connection,
/// taking deliveries from one consumer; per order an inbox row (and with [`HandEvent::Outbox`]
/// the event's outbox row) in its own transaction, then, after the commit, the event published
/// and its confirm awaited (then its row deleted), then the ack.
pub(super) async fn handwritten_run(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    rabbit: &RabbitConfig,
    event: HandEvent,
) -> anyhow::Result<(Quantiles, Option<Quantiles>)> {
    reset(pool, &b.amqp_url).await?;
    let sent = Sent::default();
    let events = Events::start(b, sent.clone()).await?;
    let total = (b.rate * b.seconds) as usize;
    let connection =
        lapin::Connection::connect(&b.amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            ORDERS.into(),
            "handwritten".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await?;
    let consumer = Arc::new(tokio::sync::Mutex::new(consumer.take(total)));
    let publisher = Arc::new(Publisher::connect(rabbit).await?);
    let took = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let (detached, deleting) = match event {
        HandEvent::OutboxDetached => {
            let (ids, deleting) = detached_deletes(&b.database_url).await?;
            (Some(ids), Some(deleting))
        }
        HandEvent::AfterCommit | HandEvent::Outbox => (None, None),
    };
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..WORKERS {
        let mut db = PgConnection::connect(&b.database_url).await?;
        // The outbox variant's deletes, on a connection of their own; none without the outbox.
        let mut deletes = match event {
            HandEvent::Outbox => Some(lazy_connection(&b.database_url).await?),
            HandEvent::AfterCommit | HandEvent::OutboxDetached => None,
        };
        let (consumer, publisher, took) = (consumer.clone(), publisher.clone(), took.clone());
        let detached = detached.clone();
        workers.spawn(async move {
            loop {
                let next = consumer.lock().await.next().await;
                let Some(delivery) = next else {
                    return anyhow::Ok(());
                };
                let delivery = delivery?;
                let order: Order = serde_json::from_slice(&delivery.data)?;
                let cause = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map_or_else(String::new, ToString::to_string);
                let mut tx = db.begin().await?;
                let claimed = sqlx::query(
                    "INSERT INTO bench_outbox_hand (consumer, key) VALUES ('handwritten', $1) \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&order.order_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                let id = format!("billed-{}", order.order_id);
                let body = serde_json::to_vec(&order)?;
                if claimed == 1 && event.staged() {
                    sqlx::query(
                        "INSERT INTO bench_outbox_hand_outbox (message_id, body) VALUES ($1, $2)",
                    )
                    .bind(&id)
                    .bind(&body)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                if claimed == 1
                    && let Some(ids) = &detached
                {
                    let committed = Instant::now();
                    let (publisher, took, ids) = (publisher.clone(), took.clone(), ids.clone());
                    tokio::spawn(async move {
                        let message = billed_event(&id, &cause, body);
                        let published = publisher.publish("", BILLED, &message).await;
                        let elapsed = committed.elapsed();
                        if published.is_ok()
                            && let Ok(mut took) = took.lock()
                        {
                            took.push(elapsed);
                        }
                        let _ = ids.send(published.map(|()| id).map_err(anyhow::Error::from));
                    });
                } else if claimed == 1 {
                    let committed = Instant::now();
                    let message = billed_event(&id, &cause, body);
                    publisher.publish("", BILLED, &message).await?;
                    let elapsed = committed.elapsed();
                    if let Some(deletes) = &mut deletes {
                        sqlx::query("DELETE FROM bench_outbox_hand_outbox WHERE message_id = $1")
                            .bind(&id)
                            .execute(&mut *deletes)
                            .await?;
                    }
                    took.lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push(elapsed);
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
        });
    }
    let fed = feed(b, &sent).await?;
    while let Some(done) = workers.join_next().await {
        done??;
    }
    // The detached publishes hold the deleting task's senders: it ends after the last.
    drop(detached);
    if let Some(deleting) = deleting {
        deleting.await??;
    }
    let _ = connection.close(200, "done".into()).await;
    let end_to_end = super::check_events(b, events, fed).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_outbox_hand_outbox")
        .fetch_one(pool)
        .await?;
    if left > 0 {
        bail!("the handwritten outbox kept {left} rows of confirmed events");
    }
    let took = std::mem::take(&mut *took.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    Ok((quantiles(took), end_to_end))
}

/// The event `id` as idem's outbox sends its handler's: JSON, with the message id of the
/// order that caused it (`cause`) as its correlation id and in its causation header.
fn billed_event(id: &str, cause: &str, body: Vec<u8>) -> Envelope {
    let mut message = Envelope::new(body)
        .with_message_id(id)
        .with_content_type("application/json")
        .with_correlation_id(cause);
    message.headers.insert(CAUSATION_HEADER, cause);
    message
}

/// A connection whose commits do not wait for the disk: a delete lost in a crash only sends
/// its event again.
async fn lazy_connection(url: &str) -> anyhow::Result<PgConnection> {
    let mut connection = PgConnection::connect(url).await?;
    sqlx::query("SET synchronous_commit = off")
        .execute(&mut connection)
        .await?;
    Ok(connection)
}

/// The detached publishes' ids sender (an id once its event is confirmed, or why its publish
/// failed), and the task deleting their rows, one at a time on a [`lazy_connection`]; it ends,
/// with the first failure, once every sender is gone.
async fn detached_deletes(
    url: &str,
) -> anyhow::Result<(
    tokio::sync::mpsc::UnboundedSender<anyhow::Result<String>>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
)> {
    let mut connection = lazy_connection(url).await?;
    let (ids, mut confirmed) = tokio::sync::mpsc::unbounded_channel::<anyhow::Result<String>>();
    let deleting = tokio::spawn(async move {
        while let Some(id) = confirmed.recv().await {
            sqlx::query("DELETE FROM bench_outbox_hand_outbox WHERE message_id = $1")
                .bind(id?)
                .execute(&mut connection)
                .await?;
        }
        anyhow::Ok(())
    });
    Ok((ids, deleting))
}
